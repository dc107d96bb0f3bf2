//! The Pair contract every transport backend meets, and its backends.
//!
//! A *pair* is the connection between this rank and one peer of a context. Algorithms (and
//! point-to-point calls) talk to pairs only through [`Pair`], so they run unchanged on every
//! backend. A backend promises:
//!
//! 1. **Posting never blocks.** `post_send` and `post_recv` queue the operation and return at
//!    once; the backend completes it later (or right away) by calling
//!    [`Completion::complete`].
//! 2. **Ordering.** Two sends to one peer with the same tag are received in the order they were
//!    posted; a receive matches the oldest unmatched message with its tag. Messages with
//!    different tags are independent.
//! 3. **Exact matching.** A message matches a receive only if the tag is equal; it is then
//!    checked for equal byte length and equal `meta` word, and a difference completes the
//!    receive with [`Error::Mismatch`] (the payload is discarded, the pair stays usable).
//! 4. **Zero copy when posted.** A message whose receive is already posted lands directly in
//!    the receive's buffer. A message that arrives first is held in a per-pair buffer of bounded
//!    size (the *early-arrival budget*); once that is full the backend stops reading from the
//!    peer until a matching receive is posted, so memory stays bounded.
//! 5. **Buffers.** The backend reads a send buffer and writes a receive buffer only between the
//!    post and the moment the completion is completed or [`Pair::cancel`] returns; never after.
//! 6. **Failure.** When the connection fails (EOF, reset), every pending and future operation on
//!    the pair completes with an error naming the peer ([`Error::PeerClosed`]); messages that
//!    arrived completely before the failure can still be received.
//! 7. **Sequenced tags.** A tag whose top two bits are `0b10` ([`SEQUENCED`]) belongs to the
//!    *family* of its top 32 bits and has the sequence number of its low 32 bits (collectives
//!    number their calls this way). Every rank sends a family's messages in sequence order, so
//!    a message of sequence `s'` while a receive of sequence `s != s'` of the same family waits
//!    on the same pair, or the reverse, proves the two ranks disagree (on the collective, root,
//!    count or order): the receive completes with [`Error::Mismatch`] at once, and a message of
//!    an earlier sequence than the receive is dropped.
//! 8. **Abort.** [`Pair::abort`] sends the peer an abort frame with a reason (best effort) and
//!    closes the pair; the peer fails every pending and future operation on it with
//!    [`Error::Aborted`] naming this rank. A context that aborts does so on every pair, so one
//!    rank's failure reaches every rank.
//! 9. **Cancellation.** `cancel` removes a pending operation. If a send had already been partly
//!    written, the byte stream cannot continue, so the pair fails with [`Error::Aborted`].
//!
//! Backends: [`tcp`] (mio event loop; always built) and `ibverbs` (feature `ibverbs`).

pub(crate) mod tcp;

/// The top bits of a sequenced tag (contract rule 7).
pub(crate) const SEQUENCED: u64 = 2 << 62;

/// `(family, sequence)` of a sequenced tag.
pub(crate) fn sequenced(tag: u64) -> Option<(u64, u32)> {
    (tag >> 62 == SEQUENCED >> 62).then_some((tag >> 32, tag as u32))
}

/// Whether sequence `a` comes after `b` (wrapping).
pub(crate) fn seq_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// The mismatch a sequenced message `got` reports to a receive waiting for `want`.
pub(crate) fn sequence_mismatch(peer: usize, family: u64, want: u32, got: u32) -> Error {
    let (what, hint) = if seq_after(got, want) {
        ("has moved on to", "it finished that collective without sending what this rank expects")
    } else {
        ("sent a message of the earlier", "this rank finished that collective without receiving it")
    };
    Error::Mismatch {
        rank: peer,
        detail: format!(
            "while this rank waits in collective #{want} of tag {}, rank {peer} {what} collective #{got} ({hint}): \
             the ranks called different collectives, or disagree on roots, counts or order",
            family & 0x3fff_ffff
        ),
    }
}

use crate::error::{Error, Result};
use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a waiting thread busy-waits before it sleeps in the kernel: for `budget`, spinning
/// when this rank has a core to itself (saves the wake-up of an idle core, tens of
/// microseconds on a VM), or yielding the CPU between tries when ranks share cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BusyWait {
    pub(crate) budget: Duration,
    pub(crate) yield_cpu: bool,
}

/// A send buffer lent to a backend: raw because the backend's I/O thread reads it while the
/// poster waits, with the lifetime guaranteed by the wait/cancel protocol (contract rule 5).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendBuf {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
}

/// A receive buffer lent to a backend (see [`SendBuf`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvBuf {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: the buffers are plain memory; whoever posts one guarantees (contract rule 5) that it
// outlives the operation and that nothing else writes (SendBuf) or touches (RecvBuf) it
// meanwhile, so handing the pointer to the I/O thread is sound.
unsafe impl Send for SendBuf {}
// SAFETY: as for `Send` above.
unsafe impl Send for RecvBuf {}

impl SendBuf {
    pub(crate) fn from_slice(s: &[u8]) -> Self {
        SendBuf { ptr: s.as_ptr(), len: s.len() }
    }
}

impl RecvBuf {
    pub(crate) fn from_slice(s: &mut [u8]) -> Self {
        RecvBuf { ptr: s.as_mut_ptr(), len: s.len() }
    }
}

/// A connection to one peer (see the module documentation for the contract).
pub(crate) trait Pair: Send + Sync {
    /// The peer's rank.
    fn peer(&self) -> usize;

    /// Queues a send of `buf` with `tag` and `meta`.
    ///
    /// # Safety
    /// `buf` must stay valid, and must not be written, until `done` is completed or
    /// [`Pair::cancel`] for `done` has returned.
    unsafe fn post_send(&self, tag: u64, meta: u32, buf: SendBuf, done: &Arc<Completion>) -> Result<()>;

    /// Queues a receive into `buf` of the next message with `tag`. Several pairs may be given
    /// the same `done` (receive from any of several peers, [`Completion::is_shared`]): the
    /// first message to claim it wins, and a pair writes into `buf` only once it has claimed
    /// it. A receive posted to one pair only is that pair's until it completes: the pair may
    /// write into `buf` before it knows which message is next (the TCP pair reads ahead).
    ///
    /// # Safety
    /// `buf` must stay valid, and must not be read or written by anyone else, until `done` is
    /// completed or [`Pair::cancel`] for `done` has returned on every pair it was posted to.
    unsafe fn post_recv(&self, tag: u64, meta: u32, buf: RecvBuf, done: &Arc<Completion>) -> Result<()>;

    /// The peer's IP address, when the backend has one (used to count ranks on this host).
    fn remote_ip(&self) -> Option<IpAddr> {
        None
    }

    /// Gives up on the pair: tells the peer why (best effort), then fails every pending and
    /// future operation here with `err`.
    fn abort(&self, err: &Error, reason: &str);

    /// Withdraws every operation of `done` from this pair. After it returns the pair no longer
    /// touches that operation's buffer.
    fn cancel(&self, done: &Arc<Completion>);
}

/// How a context's waits make progress: a backend may do the I/O of the pairs involved on the
/// waiting thread (see `tcp::progress`).
pub(crate) trait Progress: Send + Sync {
    /// Blocks until `done` finishes or `deadline` passes (`None`). `done` was posted to the
    /// pairs of the peers in `own`; `others` are peers whose pairs have other operations
    /// outstanding, which the wait may progress too. Busy-waits as `busy` says before it
    /// sleeps.
    fn wait(
        &self,
        done: &Completion,
        own: &[usize],
        others: &[usize],
        deadline: Instant,
        busy: BusyWait,
    ) -> Option<Result<usize>>;
}

/// Progress made by backend threads alone: a wait just sleeps on its completion.
pub(crate) struct Passive;

impl Progress for Passive {
    fn wait(
        &self,
        done: &Completion,
        _: &[usize],
        _: &[usize],
        deadline: Instant,
        _: BusyWait,
    ) -> Option<Result<usize>> {
        done.wait_until(deadline)
    }
}

/// The state of one posted operation, shared between the poster and the backend.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    state: Mutex<CompletionState>,
    cond: Condvar,
    /// Posted to several pairs (a receive from any of several ranks).
    shared: bool,
}

#[derive(Debug, Default)]
struct CompletionState {
    /// Threads blocked on the condition variable: only then does completing it notify (a
    /// notify is a futex system call even with nobody waiting, and most waits drive the pair
    /// themselves instead).
    sleepers: u32,
    /// A receive posted to several pairs is claimed by the first message that matches it.
    claimed: bool,
    /// `Some` once finished: the peer rank on success.
    outcome: Option<Result<usize>>,
}

impl Completion {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A completion for an operation posted to `pairs` pairs.
    pub(crate) fn for_pairs(pairs: usize) -> Arc<Self> {
        Arc::new(Self { shared: pairs > 1, ..Self::default() })
    }

    /// Whether the operation is posted to several pairs, any of which may claim it.
    pub(crate) fn is_shared(&self) -> bool {
        self.shared
    }

    fn lock(&self) -> MutexGuard<'_, CompletionState> {
        crate::sync::lock(&self.state)
    }

    /// Claims an unclaimed, unfinished operation for the caller. Exactly one caller wins.
    pub(crate) fn try_claim(&self) -> bool {
        let mut s = self.lock();
        if s.claimed || s.outcome.is_some() {
            return false;
        }
        s.claimed = true;
        true
    }

    /// True while nobody has claimed or finished the operation.
    pub(crate) fn is_open(&self) -> bool {
        let s = self.lock();
        !s.claimed && s.outcome.is_none()
    }

    /// Finishes the operation (the first outcome wins) and wakes its waiter.
    pub(crate) fn complete(&self, outcome: Result<usize>) {
        let mut s = self.lock();
        if s.outcome.is_none() {
            s.claimed = true;
            s.outcome = Some(outcome);
            let sleepers = s.sleepers;
            drop(s);
            if sleepers > 0 {
                self.cond.notify_all();
            }
        }
    }

    /// The outcome, if finished.
    pub(crate) fn outcome(&self) -> Option<Result<usize>> {
        self.lock().outcome.clone()
    }

    /// Waits until finished or `deadline`; `None` on timeout.
    pub(crate) fn wait_until(&self, deadline: Instant) -> Option<Result<usize>> {
        let mut s = self.lock();
        loop {
            if let Some(o) = &s.outcome {
                return Some(o.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s.sleepers += 1;
            s = crate::sync::wait_timeout(&self.cond, s, deadline - now);
            s.sleepers -= 1;
        }
    }
}
