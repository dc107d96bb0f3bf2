//! What user threads and the background thread share: the queue of submissions and commands,
//! the first failure, the names in flight, the counters and stall reports.

use super::handle::{Payload, Promise};
use super::meta::Meta;
use super::stall::StallReport;
use crate::error::Error;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Counters of what an engine did on this rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Negotiation cycles this rank took part in.
    pub cycles: u64,
    /// Cycles that went to the coordinator (some name was not in the cache).
    pub coordinated_cycles: u64,
    /// Names found ready through the response cache's bits.
    pub cache_hits: u64,
    /// Names found ready by the coordinator.
    pub coordinated: u64,
    /// Collectives run (a fused batch counts once).
    pub collectives: u64,
    /// Allreduce batches of more than one tensor.
    pub fused_batches: u64,
    /// Tensors that went through those batches.
    pub fused_tensors: u64,
    /// Of those batches, the ones copied into the fusion buffer and out again (compressed, or
    /// where the collective cannot run on the tensors themselves: see the engine's "Fusion").
    pub fusion_buffer_batches: u64,
    /// Allreduces whose tensors travelled with the negotiation's state messages and were
    /// reduced on every rank with no collective of their own: small tensors found ready in the
    /// response cache once every rank had sent its tensor (each rank sends it once, in any
    /// cycle; the others keep it). One that some rank did not send (too large for its
    /// message, or sent while a rank had joined) runs as an allreduce instead; see the
    /// [module](crate::engine).
    pub eager: u64,
}

/// One submission, on its way to the background thread.
pub(crate) struct Submission {
    pub(crate) name: String,
    pub(crate) meta: Meta,
    pub(crate) payload: Option<Box<dyn Payload>>,
    pub(crate) done: Arc<Promise>,
    pub(crate) submitted: Instant,
}

/// What user threads and the background thread share.
pub(crate) struct EngineState {
    pub(crate) queue: Mutex<Queue>,
    pub(crate) arrived: Condvar,
    /// A wake-up message to this rank is on its way and not yet received.
    pub(crate) wake_pending: AtomicBool,
    /// The thread that drives the engine is in (or about to enter) its idle wait for
    /// messages, where only a wake-up message reaches it: a submission sends one only then.
    pub(crate) on_inbox: AtomicBool,
    /// Callers in a [`Handle`](super::Handle) wait, which drive the engine themselves (see
    /// `drive.rs`); the background thread lets go while there are any.
    pub(crate) waiting: AtomicUsize,
    /// Bumped whenever the drive is let go or a cycle completed something, for callers that
    /// wait for their turn to drive.
    pub(crate) turn: Mutex<Turn>,
    pub(crate) turn_changed: Condvar,
    /// The engine's first failure; every later submission reports it.
    pub(crate) failed: Mutex<Option<Error>>,
    /// Names in flight on this rank.
    pub(crate) inflight: Mutex<HashSet<String>>,
    pub(crate) stats: Mutex<EngineStats>,
    pub(crate) stalls: Mutex<Vec<StallReport>>,
    pub(crate) barriers: AtomicU64,
    /// Calls of `grouped_allreduce` per group name.
    pub(crate) groups: Mutex<HashMap<String, u64>>,
    /// This rank has joined and its join has not completed.
    pub(crate) joined: AtomicBool,
    pub(crate) epoch: Instant,
}

/// What callers waiting for their turn to drive sleep on.
#[derive(Default)]
pub(crate) struct Turn {
    pub(crate) generation: u64,
    pub(crate) sleepers: usize,
}

impl EngineState {
    /// Wakes the callers that wait for their turn to drive (the drive was let go, or a cycle
    /// may have finished their submissions).
    pub(crate) fn changed(&self) {
        let mut t = crate::sync::lock(&self.turn);
        t.generation = t.generation.wrapping_add(1);
        if t.sleepers > 0 {
            drop(t);
            self.turn_changed.notify_all();
        }
    }
}

#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) items: Vec<Submission>,
    pub(crate) shutdown: bool,
    /// The background thread has stopped: nothing more is taken.
    pub(crate) closed: bool,
    pub(crate) timeline: Vec<TimelineCommand>,
    /// The engine's loop waits on `arrived` for a burst to end (submissions notify it only
    /// then).
    pub(crate) batching: bool,
    /// When the last submission came, and how long after the one before.
    pub(crate) last: Option<Instant>,
    pub(crate) gap: Option<Duration>,
}

pub(crate) enum TimelineCommand {
    Start(PathBuf),
    Stop,
}
