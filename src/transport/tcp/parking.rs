//! The event loop's timers: pairs parked by waits, which the loop takes back after
//! [`PARK_GRACE`] unless a wait takes them first, and the count of pairs that hold a message
//! in their socket, whose holds the loop ends in time.
//!
//! Parked things are seen through [`Parked`], so this module knows nothing of pairs: the pair
//! uses the parking, the device owns it and the event loop sweeps it.

use crate::sync::lock;
use mio::Waker;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a pair stays parked (watched by nobody) after a wait before the event loop takes
/// it back. Bounds how late a message nobody waits for is read, or a queued send flushed.
/// Shorter hands pairs to the loop whenever the waiting thread is away a little longer (a
/// descheduled rank, a reduction): the loop thread then competes for the core to read what the
/// next wait would have read. Measured with `ferrogloo-bench` on the 2-core machine, median p50
/// of six alternating runs, 5 ms against 1 ms: 2-rank allreduce 1 MiB 306 vs 358 µs, 16 MiB
/// 11.5 vs 13.4 ms; 4-rank 64 KiB 130 vs 172 µs, 16 MiB 37.6 vs 40.2 ms. (With 1 ms the two
/// loop threads spent 145 and 139 ms of CPU reading in a 2-rank run of 65 16 MiB calls; with
/// 50 ms, 1 and 13 ms.)
pub(crate) const PARK_GRACE: Duration = Duration::from_millis(5);

/// How often the loop looks for overdue holds while there are any: a hold lasts at most
/// `pair::HOLD` plus this.
const HOLD_TICK: Duration = Duration::from_micros(500);

/// Something on the parking list.
pub(crate) trait Parked: Send + Sync {
    /// The loop's look at it: hands it back to the loop once parked for [`PARK_GRACE`].
    /// Returns whether it stays on the list.
    fn sweep(&self, now: Instant) -> bool;
}

/// The parking list and hold count of one device.
pub(crate) struct Parking {
    list: Mutex<Vec<Arc<dyn Parked>>>,
    /// Pairs the loop watches that hold a message.
    held: AtomicUsize,
    /// Whether the loop sleeps with a timeout (it had parked pairs or holds when it last looked).
    timed: AtomicBool,
    waker: Waker,
}

impl Parking {
    pub(crate) fn new(waker: Waker) -> Self {
        Parking { list: Mutex::default(), held: AtomicUsize::new(0), timed: AtomicBool::new(false), waker }
    }

    /// Puts freshly parked pairs on the list; wakes the loop only when it sleeps without a
    /// timeout (once per burst of activity, not per wait).
    pub(crate) fn park(&self, pairs: Vec<Arc<dyn Parked>>) {
        lock(&self.list).extend(pairs);
        self.arm();
    }

    /// A pair started holding a message. Wakes the loop if it sleeps without a timeout.
    pub(crate) fn hold_started(&self) {
        self.held.fetch_add(1, Ordering::SeqCst);
        self.arm();
    }

    /// A pair's hold ended.
    pub(crate) fn hold_ended(&self) {
        self.held.fetch_sub(1, Ordering::SeqCst);
    }

    /// Wakes the loop if it sleeps without a timeout, after a pair was listed or a hold counted.
    /// [`Parking::sweep`] stores `timed` while it holds the list lock and before it reads the
    /// count, so either the loop sees the new pair or hold, or this sees `timed` false.
    fn arm(&self) {
        if !self.timed.swap(true, Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Wakes the event loop.
    pub(crate) fn wake(&self) {
        let _ = self.waker.wake();
    }

    /// The loop's turn: hands back pairs parked for the grace period. Returns how long the
    /// loop may sleep (`None`: until an event) and whether holds are to be looked at.
    pub(crate) fn sweep(&self) -> (Option<Duration>, bool) {
        let now = Instant::now();
        let mut list = lock(&self.list);
        list.retain(|p| p.sweep(now));
        let parked = !list.is_empty();
        self.timed.store(parked, Ordering::SeqCst);
        // After the store: a hold started since is either counted here or sees `timed` false
        // and wakes the loop (both sides are SeqCst).
        let holds = self.held.load(Ordering::SeqCst) > 0;
        if holds {
            self.timed.store(true, Ordering::SeqCst);
        }
        let tick = if holds { Some(HOLD_TICK) } else { None };
        (parked.then_some(PARK_GRACE).into_iter().chain(tick).min(), holds)
    }

    /// Forgets every parked pair (the loop is stopping).
    pub(crate) fn clear(&self) {
        lock(&self.list).clear();
    }
}
