//! A store view whose keys all start with a prefix.

use super::Store;
use crate::error::Result;
use std::time::Duration;

/// Scopes every key of an inner store under `prefix/`, so several contexts (or several jobs)
/// can share one store without their keys colliding.
///
/// ```
/// use ferrogloo::rendezvous::{HashStore, PrefixStore, Store};
/// let inner = HashStore::new();
/// let a = PrefixStore::new("job-a", &inner);
/// a.set("k", b"1").unwrap();
/// assert_eq!(inner.try_get("job-a/k").unwrap().as_deref(), Some(&b"1"[..]));
/// ```
#[derive(Debug, Clone)]
pub struct PrefixStore<S> {
    prefix: String,
    inner: S,
}

impl<S: Store> PrefixStore<S> {
    /// Wraps `inner` so that key `k` is stored as `prefix/k`.
    pub fn new(prefix: impl Into<String>, inner: S) -> Self {
        PrefixStore { prefix: prefix.into(), inner }
    }

    /// The prefix (without the trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }
}

impl<S: Store> Store for PrefixStore<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.try_get(&self.key(key))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }

    fn describe(&self) -> String {
        format!("{} (prefix {:?})", self.inner.describe(), self.prefix)
    }

    fn reaches_other_hosts(&self) -> bool {
        self.inner.reaches_other_hosts()
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        // Errors name the full key, so a user can find it in the inner store.
        self.inner.get(&self.key(key), timeout)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }
}
