//! A receive from any of a set of ranks that stays posted from one wait to the next.
//!
//! Background loops (the parameter server's loop and its workers' receiving threads, the
//! engine's idle wait) wait in slices, to send heartbeats or look at deadlines, stop flags and
//! stalls between them. A receive withdrawn at the end of a slice while its message is half
//! read loses the message: the transport reads and drops the rest of the payload. So the
//! receive stays posted across slices, and is only withdrawn when no message has claimed it
//! (the claim is the transport's own arbiter: a claimed receive is finished by the pair that
//! claimed it, an unclaimed one is withdrawn with no message lost).

use crate::Context;
use crate::error::{Error, Result};
use crate::transport::{BusyWait, Completion, Pair, RecvTarget};
use crate::types::OpDesc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A background thread's wait: busy-waits 50 µs before it sleeps, long enough to catch the
/// next fragment of a large message, short enough to leave the core to the threads that do the
/// work.
pub(crate) const QUIET: BusyWait = BusyWait { budget: Duration::from_micros(50), yield_cpu: false, alone: false };

/// The wait of the only thread that waits on its mesh, which waits long and rarely (the
/// engine's idle wait): sleeps at once.
pub(crate) const SLEEPING: BusyWait = BusyWait { budget: Duration::ZERO, yield_cpu: false, alone: true };

/// A posted receive from any of `ranks`.
struct Posted {
    ranks: Vec<usize>,
    pairs: Vec<Arc<dyn Pair>>,
    done: Arc<Completion>,
    /// When a wait first found it claimed by a message still arriving.
    claimed_at: Option<Instant>,
}

/// The next message with one tag from any of a set of ranks of a context, received into a
/// buffer of its own length (at most `max` bytes).
pub(crate) struct Inbox {
    ctx: Arc<Context>,
    tag: u32,
    max: usize,
    spin: BusyWait,
    /// The operation's name in errors.
    what: &'static str,
    posted: Option<Posted>,
}

impl Inbox {
    /// An inbox of messages of at most `max` bytes with `tag` on `ctx`, waiting as `spin`
    /// says; `what` names the operation in errors.
    pub(crate) fn new(ctx: Arc<Context>, tag: u32, max: usize, spin: BusyWait, what: &'static str) -> Self {
        Inbox { ctx, tag, max, spin, what, posted: None }
    }

    /// Whether a receive is posted (one that timed out, or that [`withdraw`](Self::withdraw)
    /// kept because a message claimed it).
    pub(crate) fn is_posted(&self) -> bool {
        self.posted.is_some()
    }

    /// Waits up to `slice` for the next message from any of `ranks`; returns the sender and
    /// the message, or [`Error::Timeout`] with the receive still posted for the next call. A
    /// receive posted for another set of ranks is withdrawn first, unless a message already
    /// claimed it: then that message is what this call waits for.
    ///
    /// A message that began arriving and has not finished within the context's timeout (its
    /// sender stopped mid-message) is given up: the receive is withdrawn, which drops the
    /// message, and the call fails with [`Error::Timeout`]; the next call posts a new one, so
    /// one stalled sender does not keep the others' messages out for longer than that.
    pub(crate) fn recv(&mut self, ranks: &[usize], slice: Duration) -> Result<(usize, Vec<u8>)> {
        if self.posted.as_ref().is_some_and(|p| p.ranks != ranks) {
            self.withdraw();
        }
        let mut posted = match self.posted.take() {
            Some(p) => p,
            None => self.post(ranks)?,
        };
        let own: Vec<usize> = posted.pairs.iter().map(|p| p.peer()).collect();
        let progress = &self.ctx.comm().shared().mesh.progress;
        if let Some(outcome) = progress.wait(&posted.done, &own, &[], Instant::now() + slice, self.spin) {
            return self.finished(&posted, outcome);
        }
        if !posted.done.is_open() {
            // A message claimed it and is arriving.
            let since = *posted.claimed_at.get_or_insert_with(Instant::now);
            if since.elapsed() >= self.ctx.timeout() {
                for p in &posted.pairs {
                    p.cancel(&posted.done);
                }
                // It may have finished between the wait and the withdrawal.
                if let Some(outcome) = posted.done.outcome() {
                    return self.finished(&posted, outcome);
                }
                let e = Error::Timeout {
                    op: format!("{}: a message began arriving and stopped; dropped", self.what),
                    ranks: posted.ranks.clone(),
                    keys: Vec::new(),
                    waited: since.elapsed(),
                };
                posted.done.complete(Err(e.clone()));
                return Err(e);
            }
        }
        let ranks = posted.ranks.clone();
        self.posted = Some(posted);
        Err(Error::Timeout { op: self.what.into(), ranks, keys: Vec::new(), waited: slice })
    }

    /// The message of a finished receive (or its error).
    fn finished(&self, posted: &Posted, outcome: Result<crate::transport::Done>) -> Result<(usize, Vec<u8>)> {
        if posted.pairs.len() > 1 {
            // A receive from any: withdraw what the winner left on the other pairs (the
            // receive is finished, so no message can claim it there any more).
            for p in &posted.pairs {
                p.cancel(&posted.done);
            }
        }
        let done = outcome.map_err(|e| e.during(self.what))?;
        Ok((done.peer, posted.done.take_payload().unwrap_or_default()))
    }

    /// Withdraws the posted receive unless a message has claimed it (or it finished): that one
    /// stays, for the next [`recv`](Self::recv) to return.
    pub(crate) fn withdraw(&mut self) {
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
            return Err(Error::invalid(format!("{} from no rank", self.what)));
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
                    return Err(e.during(self.what));
                }
                // A message from an earlier pair claimed it: take that one; the failed pair's
                // error shows on the next receive that includes it.
                return Ok(Posted { ranks: ranks.to_vec(), pairs: pairs[..i].to_vec(), done, claimed_at: None });
            }
        }
        Ok(Posted { ranks: ranks.to_vec(), pairs, done, claimed_at: None })
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
