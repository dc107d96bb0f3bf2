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
/// operation pending on that pair, and each of them gets its own copy. Ranks are named by
/// their rank in the context the mesh was formed for (the job's "world" ranks), also in a
/// sub-group made by [`Context::split`](crate::Context::split).
///
/// When a collective fails on one rank, that rank aborts the context and tells every peer the
/// cause, so every rank reports the *first* cause (the rank that died, the rank that timed
/// out), not a generic "aborted".
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A deadline passed before the operation completed.
    #[error("{op} timed out after {}{}{}", secs(waited), fmt_waiting(ranks), fmt_keys(keys))]
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
    /// The connection to a peer was closed or reset: the peer exited, crashed or dropped its
    /// context.
    #[error("rank {rank} closed its connection{}: {detail}", fmt_op(op))]
    PeerClosed {
        /// The rank whose connection is gone.
        rank: usize,
        /// The operation that noticed it, when known ("allreduce", "recv", ...).
        op: String,
        /// What was observed (EOF, reset, and which rank reported it when another did).
        detail: String,
    },
    /// The context was revoked ([`Context::revoke`](crate::Context::revoke)) by rank `rank`,
    /// this one or a peer: every operation of the context fails with this until the members
    /// [`agree`](crate::Context::agree) and [`shrink`](crate::Context::shrink).
    #[error("rank {rank} revoked the context: {reason}")]
    Revoked {
        /// The rank that revoked it.
        rank: usize,
        /// Why, in its words.
        reason: String,
    },
    /// A peer fell silent: no heartbeat came from it for the time heartbeats allow
    /// ([`ContextBuilder::heartbeat`](crate::context::ContextBuilder::heartbeat)), so it is
    /// taken for dead and this rank closed its connection to it (fail-stop).
    #[error(
        "rank {rank} is silent: no heartbeat for {} (one every {}); taken for dead, its connection closed",
        secs(silent),
        secs(interval)
    )]
    PeerSilent {
        /// The silent rank.
        rank: usize,
        /// How long it had been silent.
        silent: Duration,
        /// The heartbeat interval.
        interval: Duration,
    },
    /// A peer gave up on an operation at its deadline and aborted the context, so this rank's
    /// operations with it cannot finish either.
    #[error("rank {rank} timed out{} and aborted the context: {detail}", fmt_op(op))]
    PeerTimedOut {
        /// The rank that timed out.
        rank: usize,
        /// The operation it timed out in.
        op: String,
        /// Its timeout, in its words (what it was still waiting for).
        detail: String,
    },
    /// The context was aborted with [`Context::abort`](crate::Context::abort), by this rank or
    /// by a peer.
    #[error("rank {rank} aborted the context: {reason}")]
    Aborted {
        /// The rank that called `abort`.
        rank: usize,
        /// Its reason.
        reason: String,
    },
    /// Ranks called different collectives, or the same one with arguments that do not agree (a
    /// different length, element type, root, reduction or order). Reported instead of
    /// corrupting data.
    #[error("the ranks disagree: {detail}")]
    Mismatch {
        /// The peer whose message did not match this rank's call.
        rank: usize,
        /// What differed, in words: "rank 1 called allreduce with 1001 f32 elements, rank 0
        /// with 1000".
        detail: String,
    },
    /// A peer or stranger sent bytes that do not follow the wire protocol, or a connection
    /// was left unusable (a send cancelled half-written).
    #[error("protocol error{}: {detail}", fmt_peer(peer))]
    Protocol {
        /// The peer concerned, when the connection belongs to one.
        peer: Option<usize>,
        /// What was wrong.
        detail: String,
    },
    /// A rendezvous store failed (not a timeout: an unusable directory, a server error, ...).
    #[error("store error{}: {detail}", fmt_key(key))]
    Store {
        /// The key being accessed, when the failure concerns one.
        key: Option<String>,
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
    /// The operation needs something this build or this machine does not have: a cargo feature
    /// left off, memory of a kind the transport cannot reach.
    #[error("{what} is not supported{}", fmt_feature(feature))]
    Unsupported {
        /// What was asked for.
        what: String,
        /// The cargo feature that provides it, when one does.
        feature: Option<String>,
    },
    /// An elastic job's membership changed (ranks joined or left): the work on the current
    /// context stops so that every member rebuilds it in the new generation (see
    /// [`launch::elastic`](crate::launch::elastic)).
    #[error("the elastic job's membership changed: generation {generation} follows generation {current}")]
    MembershipChanged {
        /// The generation this rank was working in.
        current: u64,
        /// The generation the launcher published since.
        generation: u64,
    },
    /// A callback of the caller's panicked; the thread that ran it caught the panic and goes
    /// on (see [`KvWorker::then`](crate::ps::KvWorker::then)).
    #[error("{what} panicked: {message}")]
    Panicked {
        /// Whose callback, in words ("the callback of parameter-server pull request 6 on worker 0").
        what: String,
        /// The panic's message.
        message: String,
    },
    /// Rank processes of a local job failed (see [`launch::spawn_local`](crate::launch::spawn_local)).
    #[error("{}", fmt_failed(ranks, detail))]
    RanksFailed {
        /// The ranks that failed, in rank order.
        ranks: Vec<usize>,
        /// How each failed.
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

    /// Builds an [`Error::Store`] about `key`.
    pub fn store(key: impl Into<String>, detail: impl fmt::Display) -> Self {
        Error::Store { key: Some(key.into()), detail: detail.to_string() }
    }

    /// Builds an [`Error::Unsupported`] for `what`, provided by cargo feature `feature` when
    /// given.
    pub fn unsupported(what: impl Into<String>, feature: Option<&str>) -> Self {
        Error::Unsupported { what: what.into(), feature: feature.map(str::to_string) }
    }

    /// True for [`Error::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// The rank this error blames, when it blames one: the peer that closed, timed out,
    /// aborted, disagreed or broke the protocol.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Error::PeerClosed { rank, .. }
            | Error::PeerSilent { rank, .. }
            | Error::PeerTimedOut { rank, .. }
            | Error::Aborted { rank, .. }
            | Error::Revoked { rank, .. }
            | Error::Mismatch { rank, .. } => Some(*rank),
            Error::Protocol { peer, .. } => *peer,
            Error::Timeout { ranks, .. } if ranks.len() == 1 => Some(ranks[0]),
            _ => None,
        }
    }

    /// Names the operation in which a peer's failure was noticed, unless it already names one.
    pub(crate) fn during(mut self, what: &str) -> Self {
        if let Error::PeerClosed { op, .. } | Error::PeerTimedOut { op, .. } = &mut self
            && op.is_empty()
        {
            *op = what.to_string();
        }
        self
    }
}

/// "rank 1", "ranks 1 and 2", "ranks 1, 2 and 5".
pub(crate) fn ranks_text(ranks: &[usize]) -> String {
    match ranks {
        [] => "no rank".to_string(),
        [r] => format!("rank {r}"),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(|r| r.to_string()).collect();
            format!("ranks {} and {last}", init.join(", "))
        }
    }
}

/// A duration as people write it: "250 ms", "3.0 s".
pub(crate) fn secs(d: &Duration) -> String {
    if *d < Duration::from_secs(1) { format!("{} ms", d.as_millis()) } else { format!("{:.1} s", d.as_secs_f64()) }
}

fn fmt_waiting(ranks: &[usize]) -> String {
    if ranks.is_empty() { String::new() } else { format!("; still waiting for {}", ranks_text(ranks)) }
}

fn fmt_keys(keys: &[String]) -> String {
    if keys.is_empty() { String::new() } else { format!("; missing store key(s) {}", keys.join(", ")) }
}

fn fmt_peer(peer: &Option<usize>) -> String {
    match peer {
        Some(r) => format!(" with rank {r}"),
        None => String::new(),
    }
}

fn fmt_op(op: &str) -> String {
    if op.is_empty() { String::new() } else { format!(" during {op}") }
}

fn fmt_key(key: &Option<String>) -> String {
    match key {
        Some(k) => format!(" on key {k:?}"),
        None => String::new(),
    }
}

fn fmt_feature(feature: &Option<String>) -> String {
    match feature {
        Some(f) => format!(" by this build (enable the cargo feature `{f}`)"),
        None => String::new(),
    }
}

fn fmt_failed(ranks: &[usize], detail: &str) -> String {
    format!("{} failed: {detail}", ranks_text(ranks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_failed_in_words() {
        let e = Error::Timeout {
            op: "store get".into(),
            ranks: vec![3],
            keys: vec!["addr/3".into()],
            waited: Duration::from_millis(1500),
        };
        assert_eq!(
            e.to_string(),
            "store get timed out after 1.5 s; still waiting for rank 3; missing store key(s) addr/3"
        );
        let e =
            Error::Timeout { op: "recv".into(), ranks: vec![1, 2, 5], keys: vec![], waited: Duration::from_millis(20) };
        assert_eq!(e.to_string(), "recv timed out after 20 ms; still waiting for ranks 1, 2 and 5");
        let s = Error::PeerClosed { rank: 2, op: "allreduce".into(), detail: "EOF".into() }.to_string();
        assert_eq!(s, "rank 2 closed its connection during allreduce: EOF");
        let s = Error::Protocol { peer: Some(5), detail: "bad kind".into() }.to_string();
        assert_eq!(s, "protocol error with rank 5: bad kind");
        let s = Error::Store { key: None, detail: "cannot create the directory at path /x".into() }.to_string();
        assert_eq!(s, "store error: cannot create the directory at path /x");
        let s = Error::unsupported("the ibverbs transport", Some("ibverbs")).to_string();
        assert_eq!(s, "the ibverbs transport is not supported by this build (enable the cargo feature `ibverbs`)");
        let s = Error::Panicked { what: "the callback of request 6".into(), message: "boom".into() }.to_string();
        assert_eq!(s, "the callback of request 6 panicked: boom");
        let s = Error::RanksFailed { ranks: vec![0, 3], detail: "exit status 1".into() }.to_string();
        assert_eq!(s, "ranks 0 and 3 failed: exit status 1");
    }

    #[test]
    fn the_operation_is_filled_in_once() {
        let e = Error::PeerClosed { rank: 1, op: String::new(), detail: "EOF".into() }.during("recv");
        let e = e.during("allreduce");
        assert!(matches!(&e, Error::PeerClosed { op, .. } if op == "recv"), "{e}");
        assert_eq!(e.rank(), Some(1));
    }
}
