//! What a context keeps for surviving failures: the state of its agreements, which
//! `crate::survive` runs (kept here, below the context, so that the context holds it without
//! depending on the module that uses it).

use super::{Comm, PersistentRecv};
use crate::error::Error;
use crate::transport::{ALL_GROUPS, AbortCause};
use std::sync::Mutex;

/// A context's state for agreements: their count (every member counts alike) and the
/// receives they use, kept from one agreement to the next.
#[derive(Default)]
pub(crate) struct Survival {
    pub(crate) inner: Mutex<Option<Agreements>>,
}

/// The agreements of a context.
pub(crate) struct Agreements {
    /// The communicator of the agreements: the context's members under a group id of its own,
    /// which a revoked context's abort does not touch.
    pub(crate) comm: Comm,
    /// One receive per peer (`None` for this rank), so that a failure is the pair's.
    pub(crate) recvs: Vec<Option<PersistentRecv>>,
    /// Agreements this context has run.
    pub(crate) count: u64,
    /// Messages of the next agreement that arrived during one (sender, words).
    pub(crate) later: Vec<(usize, Vec<u64>)>,
    /// Ranks an agreement decided failed (their connections closed): failed in every later one.
    pub(crate) failed: Vec<bool>,
}

impl Agreements {
    /// Closes the pair to `r` (a failed send or receive, a message that breaks the protocol):
    /// from now on it is failed for every member that uses it (fail-stop).
    pub(crate) fn close(&self, r: usize, why: &Error) {
        tracing::debug!(rank = self.comm.rank(), peer = r, error = %why, "agreement: a peer failed");
        if let Ok(p) = self.comm.pair(r) {
            p.abort(ALL_GROUPS, why, &AbortCause::of(why, self.comm.shared().world_rank));
        }
    }
}
