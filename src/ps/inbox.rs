//! A receive of parameter-server messages that stays posted from one wait to the next.
//!
//! The server's loop and the worker's receiving thread wait in short slices (to send
//! heartbeats, look at deadlines and stop flags). A receive withdrawn at the end of a slice
//! while its message is half read loses the message: the transport reads and drops the rest of
//! the payload. So the receive stays posted across slices, and is only withdrawn when no
//! message has claimed it (the claim is the transport's own arbiter: a claimed receive is
//! finished by the pair that claimed it, an unclaimed one is withdrawn with no message lost).

use crate::Context;
use crate::error::{Error, Result};
use crate::transport::{BusyWait, Completion, Pair, RecvTarget};
use crate::types::OpDesc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a wait busy-waits before it sleeps: long enough to catch the next fragment of a
/// large message, short enough to leave the core to the threads that do the work.
const QUIET: BusyWait = BusyWait { budget: Duration::from_micros(50), yield_cpu: false, alone: false };

/// A posted receive from any of `ranks`.
struct Posted {
    ranks: Vec<usize>,
    pairs: Vec<Arc<dyn Pair>>,
    done: Arc<Completion>,
}

/// The next message with one tag from any of a set of ranks of a context, received into a
/// buffer of its own length (at most `max` bytes).
pub(super) struct Inbox {
    ctx: Arc<Context>,
    tag: u32,
    max: usize,
    posted: Option<Posted>,
}

impl Inbox {
    pub(super) fn new(ctx: Arc<Context>, tag: u32, max: usize) -> Self {
        Inbox { ctx, tag, max, posted: None }
    }

    /// Waits up to `slice` for the next message from any of `ranks`; returns the sender and
    /// the message, or [`Error::Timeout`] with the receive still posted for the next call. A
    /// receive posted for another set of ranks is withdrawn first, unless a message already
    /// claimed it: then that message is what this call waits for.
    pub(super) fn recv(&mut self, ranks: &[usize], slice: Duration) -> Result<(usize, Vec<u8>)> {
        if self.posted.as_ref().is_some_and(|p| p.ranks != ranks) {
            self.withdraw();
        }
        let posted = match self.posted.take() {
            Some(p) => p,
            None => self.post(ranks)?,
        };
        let own: Vec<usize> = posted.pairs.iter().map(|p| p.peer()).collect();
        let progress = &self.ctx.comm().shared().mesh.progress;
        match progress.wait(&posted.done, &own, &[], Instant::now() + slice, QUIET) {
            None => {
                let ranks = posted.ranks.clone();
                self.posted = Some(posted);
                Err(Error::Timeout { op: "parameter-server receive".into(), ranks, keys: Vec::new(), waited: slice })
            }
            Some(outcome) => {
                if posted.pairs.len() > 1 {
                    // A receive from any: withdraw what the winner left on the other pairs (the
                    // receive is finished, so no message can claim it there any more).
                    for p in &posted.pairs {
                        p.cancel(&posted.done);
                    }
                }
                let done = outcome.map_err(|e| e.during("parameter-server receive"))?;
                Ok((done.peer, posted.done.take_payload().unwrap_or_default()))
            }
        }
    }

    /// Withdraws the posted receive unless a message has claimed it (or it finished): that one
    /// stays, for the next [`recv`](Self::recv) to return.
    pub(super) fn withdraw(&mut self) {
        let Some(p) = self.posted.take() else { return };
        if p.done.try_claim() {
            // Claimed here, so no pair can claim it any more: nothing is lost.
            for pair in &p.pairs {
                pair.cancel(&p.done);
            }
        } else {
            self.posted = Some(p);
        }
    }

    /// Posts a receive on the pairs of `ranks`.
    fn post(&self, ranks: &[usize]) -> Result<Posted> {
        if ranks.is_empty() {
            return Err(Error::invalid("a parameter-server receive from no rank"));
        }
        let comm = self.ctx.comm();
        let pairs = ranks.iter().map(|&r| comm.pair(r).cloned()).collect::<Result<Vec<_>>>()?;
        let key = comm.p2p_key(self.tag);
        let done = Completion::for_pairs(pairs.len());
        for (i, pair) in pairs.iter().enumerate() {
            // SAFETY: an owned receive lends no memory: the pair allocates the message's buffer
            // and hands it over with the completion.
            let posted = unsafe { pair.post_recv(key, OpDesc::P2P, RecvTarget::Owned { max: self.max }, &done) };
            if let Err(e) = posted {
                if done.try_claim() {
                    for p in &pairs[..i] {
                        p.cancel(&done);
                    }
                    return Err(e.during("parameter-server receive"));
                }
                // A message from an earlier pair claimed it: take that one; the failed pair's
                // error shows on the next receive that includes it.
                return Ok(Posted { ranks: ranks.to_vec(), pairs: pairs[..i].to_vec(), done });
            }
        }
        Ok(Posted { ranks: ranks.to_vec(), pairs, done })
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        if let Some(p) = self.posted.take() {
            // Going away: a message arriving now has nobody to read it.
            for pair in &p.pairs {
                pair.cancel(&p.done);
            }
        }
    }
}
