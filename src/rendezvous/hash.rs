//! An in-process store for ranks that are threads.

use super::{Store, checked_add, missing_keys, parse_counter};
use crate::error::Result;
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A thread-safe in-memory store: ranks that are threads of one process share it (tests,
/// examples). Waiting is a condition-variable wait, not polling.
///
/// ```
/// use ferrogloo::rendezvous::{HashStore, Store};
/// use std::time::Duration;
/// let store = HashStore::new();
/// store.set("k", b"v").unwrap();
/// assert_eq!(store.get("k", Duration::from_secs(1)).unwrap(), b"v");
/// assert_eq!(store.add("n", 5).unwrap(), 5);
/// ```
#[derive(Debug, Default)]
pub struct HashStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl HashStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        crate::sync::lock(&self.map)
    }

    /// Waits until `ready` holds for the map, or the deadline passes.
    fn wait_for<T>(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&HashMap<String, Vec<u8>>) -> std::result::Result<T, Vec<String>>,
        op: &str,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            match ready(&map) {
                Ok(v) => return Ok(v),
                Err(missing) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(missing_keys(op, missing, timeout));
                    }
                    map = crate::sync::wait_timeout(&self.changed, map, deadline - now);
                }
            }
        }
    }
}

impl Store for HashStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().get(key).cloned())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.lock();
        let old = match map.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        };
        let new = checked_add(key, old, delta)?;
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.changed.notify_all();
        Ok(new)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock().remove(key).is_some())
    }

    fn describe(&self) -> String {
        "an in-process HashStore".to_string()
    }

    fn reaches_other_hosts(&self) -> bool {
        false
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_for(timeout, |m| m.get(key).cloned().ok_or_else(|| vec![key.to_string()]), "store get")
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_for(
            timeout,
            |m| {
                let missing: Vec<String> =
                    keys.iter().filter(|k| !m.contains_key(**k)).map(|k| k.to_string()).collect();
                if missing.is_empty() { Ok(()) } else { Err(missing) }
            },
            "store wait",
        )
    }
}
