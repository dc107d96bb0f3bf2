//! Rendezvous: the key-value [`Store`] through which ranks find each other.
//!
//! A [`Context`](crate::Context) publishes each rank's listening address in a store and reads
//! its peers' addresses from it. Any store that implements the trait works:
//!
//! - [`FileStore`]: a directory on a shared filesystem (NFS); the usual choice.
//! - [`HttpStore`]: a client of Horovod's HTTP rendezvous server, or of our [`HttpStoreServer`].
//! - [`TcpStore`]: a client of PyTorch's TCPStore (what `torchrun` serves at
//!   `MASTER_ADDR:MASTER_PORT`), or of our [`TcpStoreServer`], which serves PyTorch's clients too.
//! - [`HashStore`]: in-process, for ranks that are threads.
//! - [`PrefixStore`]: scopes the keys of another store, so several contexts can share it.
//!
//! [`open`] turns a store URL into a store, each of its requests bounded by the default timeout
//! (`FERROGLOO_TIMEOUT`, else 30 s; see [`default_timeout`](crate::context::default_timeout)):
//!
//! - `file:DIR` (also `file://DIR`): a [`FileStore`];
//! - `http://HOST:PORT/SCOPE`: an [`HttpStore`], its keys in `SCOPE`;
//! - `tcpstore://HOST:PORT[/PREFIX]`: a [`TcpStore`], its keys under `PREFIX` when given.
//!
//! The environment variable `FERROGLOO_STORE` holds the default URL ([`open_from_env`]).

mod file;
mod hash;
mod http;
mod prefix;
mod server;
mod tcpstore;
mod url;

pub use file::FileStore;
pub use hash::HashStore;
pub use http::HttpStore;
pub use prefix::PrefixStore;
pub use server::{HttpStoreServer, ServerLimits};
pub use tcpstore::{TcpStore, TcpStoreServer};
pub use url::{StoreUrl, open, open_from_env};

use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// A key-value store shared by every rank of a job.
///
/// Implementors provide the non-blocking primitives; [`get`](Store::get) and
/// [`wait`](Store::wait) poll [`try_get`](Store::try_get) with backoff until a deadline, and a
/// store that can block more cheaply (like [`HashStore`]) overrides them.
///
/// Keys are arbitrary UTF-8 strings (including `/`); each store escapes them as it needs.
/// Values are arbitrary bytes.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any earlier value.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Returns the value of `key` if it exists now, without waiting.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Atomically adds `delta` to the integer stored at `key` (a missing key counts as 0) and
    /// returns the new value. Values written by `add` are decimal ASCII.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Removes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;

    /// The store in words, for messages ("file:/shared/job", "http://host:29500/job").
    fn describe(&self) -> String {
        "a store".to_string()
    }

    /// Whether processes on other hosts can read this store (a network filesystem, a server on
    /// a non-loopback address). Unknown stores say yes. A rank that publishes an address only
    /// its own host can reach into such a store is warned.
    fn reaches_other_hosts(&self) -> bool {
        true
    }

    /// Returns the value of `key`, waiting until it exists or `timeout` passes
    /// ([`Error::Timeout`] naming the key).
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new();
        loop {
            if let Some(v) = self.try_get(key)? {
                return Ok(v);
            }
            if !backoff.sleep_until(deadline) {
                return Err(missing_keys("store get", vec![key.to_string()], timeout));
            }
        }
    }

    /// Waits until every key in `keys` exists, or `timeout` passes ([`Error::Timeout`] naming
    /// the keys still missing).
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new();
        let mut missing: Vec<&str> = keys.to_vec();
        loop {
            let mut still = Vec::with_capacity(missing.len());
            for k in missing {
                if self.try_get(k)?.is_none() {
                    still.push(k);
                }
            }
            missing = still;
            if missing.is_empty() {
                return Ok(());
            }
            if !backoff.sleep_until(deadline) {
                let keys = missing.iter().map(|k| k.to_string()).collect();
                return Err(missing_keys("store wait", keys, timeout));
            }
        }
    }
}

/// Forwards every `Store` method through a smart pointer or reference.
macro_rules! forward_store {
    ($($ty:ty),*) => {$(
        impl<S: Store + ?Sized> Store for $ty {
            fn set(&self, key: &str, value: &[u8]) -> Result<()> {
                (**self).set(key, value)
            }
            fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
                (**self).try_get(key)
            }
            fn add(&self, key: &str, delta: i64) -> Result<i64> {
                (**self).add(key, delta)
            }
            fn delete(&self, key: &str) -> Result<bool> {
                (**self).delete(key)
            }
            fn describe(&self) -> String {
                (**self).describe()
            }
            fn reaches_other_hosts(&self) -> bool {
                (**self).reaches_other_hosts()
            }
            fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
                (**self).get(key, timeout)
            }
            fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
                (**self).wait(keys, timeout)
            }
        }
    )*};
}
forward_store!(&S, Box<S>, std::sync::Arc<S>);

/// The timeout error of a store wait.
pub(crate) fn missing_keys(op: &str, keys: Vec<String>, waited: Duration) -> Error {
    Error::Timeout { op: op.to_string(), ranks: Vec::new(), keys, waited }
}

/// Exponential backoff for polling loops: 1 ms doubling up to 100 ms, never past a deadline.
pub(crate) struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(1);
    const MAX: Duration = Duration::from_millis(100);

    pub(crate) fn new() -> Self {
        Backoff { next: Self::FIRST }
    }

    /// Sleeps for the next backoff step, cut short at `deadline`. Returns false (without
    /// sleeping) once the deadline has passed.
    pub(crate) fn sleep_until(&mut self, deadline: Instant) -> bool {
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(self.next.min(deadline - now));
        self.next = (self.next * 2).min(Self::MAX);
        true
    }
}

/// Parses the decimal ASCII integer that `add` stores.
pub(crate) fn parse_counter(key: &str, bytes: &[u8]) -> Result<i64> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .ok_or_else(|| Error::store(key, "value is not a decimal integer, so add cannot apply"))
}

/// Adds with overflow reported as a store error.
pub(crate) fn checked_add(key: &str, old: i64, delta: i64) -> Result<i64> {
    old.checked_add(delta).ok_or_else(|| Error::store(key, "add overflowed i64"))
}
