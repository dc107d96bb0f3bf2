//! The one error type of ferrogloo.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// Result alias used throughout ferrogloo.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every way a ferrogloo call can fail.
///
/// Errors are `Clone` because one failure (a peer closing its connection, say) fails every
/// operation pending on that pair, and each of them gets its own copy.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A deadline passed before the operation completed.
    #[error("{op} timed out after {waited:?}{}{}", fmt_ranks(ranks), fmt_keys(keys))]
    Timeout {
        /// What was being waited for ("recv", "store get", "rendezvous", ...).
        op: String,
        /// The ranks that had not answered, when known.
        ranks: Vec<usize>,
        /// The store keys that were still missing, when the wait was on a store.
        keys: Vec<String>,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The connection to a peer was closed or reset (the peer exited or crashed).
    #[error("peer rank {rank} closed the connection ({detail})")]
    PeerClosed {
        /// The rank whose connection is gone.
        rank: usize,
        /// What was observed (EOF, reset, ...).
        detail: String,
    },
    /// Both sides exchanged messages that do not agree: a different length, element type,
    /// collective or root. Reported instead of corrupting data.
    #[error("mismatch with rank {rank}: {detail}")]
    Mismatch {
        /// The peer whose message did not match.
        rank: usize,
        /// What differed.
        detail: String,
    },
    /// A peer or stranger sent bytes that do not follow the wire protocol.
    #[error("protocol error{}: {detail}", fmt_peer(peer))]
    Protocol {
        /// The peer that sent them, when the connection belongs to one.
        peer: Option<usize>,
        /// What was wrong.
        detail: String,
    },
    /// A rendezvous store failed (not a timeout: an unusable directory, a server error, ...).
    #[error("store error on key {key:?}: {detail}")]
    Store {
        /// The key being accessed.
        key: String,
        /// What failed.
        detail: String,
    },
    /// An operating-system I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What ferrogloo was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: Arc<io::Error>,
    },
    /// The caller passed something that cannot work (rank >= size, wrong buffer length, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The operation was aborted, or the context is no longer usable after an earlier failure.
    #[error("aborted: {detail}")]
    Aborted {
        /// Why.
        detail: String,
    },
}

impl Error {
    /// Builds an [`Error::Io`] from an I/O error and a description of what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io { context: context.into(), source: Arc::new(source) }
    }

    /// Builds an [`Error::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// Builds an [`Error::Store`].
    pub fn store(key: impl Into<String>, detail: impl fmt::Display) -> Self {
        Error::Store { key: key.into(), detail: detail.to_string() }
    }

    /// True for [`Error::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }
}

fn fmt_ranks(ranks: &[usize]) -> String {
    if ranks.is_empty() { String::new() } else { format!("; waiting on rank(s) {ranks:?}") }
}

fn fmt_keys(keys: &[String]) -> String {
    if keys.is_empty() { String::new() } else { format!("; missing key(s) {keys:?}") }
}

fn fmt_peer(peer: &Option<usize>) -> String {
    match peer {
        Some(r) => format!(" from rank {r}"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_failed() {
        let e = Error::Timeout {
            op: "store get".into(),
            ranks: vec![3],
            keys: vec!["addr/3".into()],
            waited: Duration::from_millis(1500),
        };
        let s = e.to_string();
        assert!(s.contains("store get") && s.contains("[3]") && s.contains("addr/3"), "{s}");
        let s = Error::PeerClosed { rank: 2, detail: "EOF".into() }.to_string();
        assert!(s.contains("rank 2"), "{s}");
        let s = Error::Protocol { peer: Some(5), detail: "bad kind".into() }.to_string();
        assert!(s.contains("rank 5") && s.contains("bad kind"), "{s}");
    }
}
