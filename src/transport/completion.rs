//! The state of one posted operation ([`Completion`]), shared by the poster and the backend,
//! and what a finished one reports ([`Done`]).

use super::wake;
use crate::error::Result;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// What a finished operation reports: the rank that completed it and the bytes moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Done {
    pub(crate) peer: usize,
    pub(crate) len: usize,
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
    /// `Some` once finished.
    outcome: Option<Result<Done>>,
    /// The message of an owned receive ([`RecvTarget::Owned`]).
    payload: Option<Vec<u8>>,
    /// Rung when the operation finishes: a wait that sleeps in `poll(2)` on it rather than on
    /// the condition variable (see [`Completion::ring_on_finish`]).
    bell: Option<Arc<wake::EventFd>>,
    /// Completed when the operation finishes: a wait for any of several operations waits on it
    /// (see [`Completion::finish_with`]).
    listener: Option<Arc<Completion>>,
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
    pub(crate) fn complete(&self, outcome: Result<Done>) {
        self.finish(outcome, None);
    }

    /// Finishes an owned receive with its message.
    pub(crate) fn complete_owned(&self, peer: usize, data: Vec<u8>) {
        let len = data.len();
        self.finish(Ok(Done { peer, len }), Some(data));
    }

    fn finish(&self, outcome: Result<Done>, payload: Option<Vec<u8>>) {
        let mut s = self.lock();
        if s.outcome.is_none() {
            s.claimed = true;
            s.outcome = Some(outcome);
            s.payload = payload;
            let sleepers = s.sleepers;
            let bell = s.bell.take();
            let listener = s.listener.take();
            drop(s);
            if sleepers > 0 {
                self.cond.notify_all();
            }
            if let Some(b) = bell {
                b.signal();
            }
            if let Some(l) = listener {
                l.complete(Ok(Done { peer: 0, len: 0 }));
            }
        }
    }

    /// Completes `listener` too when the operation finishes (at once if it has): a wait for
    /// any of several operations sleeps on one completion that each of them finishes. A later
    /// call replaces the listener.
    pub(crate) fn finish_with(&self, listener: &Arc<Completion>) {
        let mut s = self.lock();
        if s.outcome.is_some() {
            drop(s);
            listener.complete(Ok(Done { peer: 0, len: 0 }));
        } else {
            s.listener = Some(listener.clone());
        }
    }

    /// Rings `bell` when the operation finishes (at once if it has): for a wait that sleeps on
    /// the eventfd while another thread may finish the operation.
    pub(crate) fn ring_on_finish(&self, bell: &Arc<wake::EventFd>) {
        let mut s = self.lock();
        if s.outcome.is_some() {
            drop(s);
            bell.signal();
        } else {
            s.bell = Some(bell.clone());
        }
    }

    /// The outcome, if finished.
    pub(crate) fn outcome(&self) -> Option<Result<Done>> {
        self.lock().outcome.clone()
    }

    /// The message of a finished owned receive (once).
    pub(crate) fn take_payload(&self) -> Option<Vec<u8>> {
        self.lock().payload.take()
    }

    /// Waits until finished or `deadline`; `None` on timeout.
    pub(crate) fn wait_until(&self, deadline: Instant) -> Option<Result<Done>> {
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
