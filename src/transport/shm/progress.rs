//! How a wait makes progress on shared memory: the waiting thread drives its pairs (writes what
//! waits to be sent, reads what came), spins or yields for the busy-wait budget, then sleeps in
//! `poll(2)` on this rank's doorbell (rung by a peer that wrote into, or read from, a ring this
//! rank waits on) and its pairs' lifelines (a peer that dies or aborts).

use super::pair::ShmPair;
use crate::error::Result;
use crate::transport::wake::{EventFd, poll_fds};
use crate::transport::{BusyWait, Completion, Done, Progress};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A sleep never lasts longer than this: a second thread waiting on the same rank may have
/// taken the doorbell's wake-up.
const MAX_SLEEP: Duration = Duration::from_millis(5);
/// The longest sleep of a wait that is alone on its mesh ([`BusyWait::alone`]).
const ALONE_SLEEP: Duration = Duration::from_millis(250);
/// Rounds of a wait between looks at the pairs it does not wait on.
const QUIET_EVERY: u32 = 16;
/// While a wait keeps busy past its budget because a message is halfway through a ring, how
/// often it looks at the lifelines (a peer that died mid-message), and how long it stays busy
/// with the message not moving (a peer that stopped, or went off to compute) before it sleeps.
const MID_MESSAGE_LOOK: Duration = Duration::from_millis(1);

/// The shared-memory progress engine of one mesh.
pub(crate) struct ShmProgress {
    /// Indexed by rank; `None` where the pair is not a shared-memory one.
    pairs: Vec<Option<Arc<ShmPair>>>,
    bell: Arc<EventFd>,
}

impl ShmProgress {
    pub(crate) fn new(pairs: Vec<Option<Arc<ShmPair>>>, bell: Arc<EventFd>) -> Self {
        ShmProgress { pairs, bell }
    }
}

impl Progress for ShmProgress {
    fn interrupt(&self) {
        // Every wait of this rank sleeps on its doorbell.
        self.bell.signal();
    }

    fn wait(
        &self,
        done: &Completion,
        own: &[usize],
        others: &[usize],
        deadline: Instant,
        busy: BusyWait,
    ) -> Option<Result<Done>> {
        let pair = |r: usize| self.pairs.get(r).and_then(Option::as_ref);
        // The pairs of the wait first, then every other: a peer's message to this rank may
        // need this rank to read it before the peer can go on (a large one waits for this
        // rank to copy it), and no thread but a waiting one reads the rings.
        let mut pairs: Vec<&Arc<ShmPair>> = own.iter().chain(others).filter_map(|&r| pair(r)).collect();
        let busy_pairs = pairs.len();
        for (r, p) in self.pairs.iter().enumerate() {
            if let Some(p) = p
                && !own.contains(&r)
                && !others.contains(&r)
            {
                pairs.push(p);
            }
        }
        // An operation that may finish elsewhere (on this rank's loopback pair, on a TCP pair's
        // event loop) rings the doorbell this wait sleeps on.
        if own.iter().any(|&r| pair(r).is_none()) {
            done.ring_on_finish(&self.bell);
        }
        let busy_until = Instant::now() + busy.budget;
        let mut fds: Vec<libc::pollfd> = std::iter::once(self.bell.raw())
            .chain(pairs.iter().map(|p| p.lifeline_fd()))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        let mut round = 0u32;
        let mut lifeline_look = Instant::now() + MID_MESSAGE_LOOK;
        // Where the rings of a message halfway through stood, and since when.
        let mut moved: Option<(u64, Instant)> = None;
        loop {
            // The quiet pairs every few rounds only (a lock each).
            let upto = if round.is_multiple_of(QUIET_EVERY) { pairs.len() } else { busy_pairs };
            round = round.wrapping_add(1);
            for p in &pairs[..upto] {
                p.drive();
            }
            if let Some(o) = done.outcome() {
                return Some(o);
            }
            let now = Instant::now();
            if now >= deadline {
                return done.outcome();
            }
            // A message halfway through a ring moves on as soon as the peer has copied its
            // part: sleeping between ring-fulls would add a wake-up to each (measured on 4 MiB
            // parameter-server messages over a 1 MiB ring: a quarter of the time). Busy past
            // the budget then, looking at the lifelines now and again.
            let mut mid = false;
            if now >= busy_until {
                let at = pairs[..busy_pairs].iter().filter_map(|p| p.mid_message()).reduce(u64::wrapping_add);
                if let Some(at) = at {
                    if moved.is_none_or(|(was, _)| was != at) {
                        moved = Some((at, now));
                    }
                    mid = moved.is_some_and(|(_, since)| now < since + MID_MESSAGE_LOOK);
                }
            }
            if mid && now >= lifeline_look {
                lifeline_look = now + MID_MESSAGE_LOOK;
                for f in &mut fds {
                    f.revents = 0;
                }
                if poll_fds(&mut fds[1..], Duration::ZERO).is_ok() {
                    for (p, f) in pairs.iter().zip(&fds[1..]) {
                        if f.revents != 0 {
                            p.check_lifeline();
                        }
                    }
                }
            }
            if now < busy_until || mid {
                if busy.yield_cpu {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            // Sleep, unless something came in while the sleep was being set up.
            let mut armed = 0;
            let ready = pairs.iter().all(|p| {
                let ok = p.prepare_sleep();
                armed += usize::from(ok);
                ok
            });
            if !ready {
                // Something to do on some pair: drive them all next round.
                round = 0;
            }
            if ready && done.outcome().is_none() {
                let hold = pairs.iter().filter_map(|p| p.hold_ends()).min();
                let until = hold
                    .map_or(deadline, |h| h.min(deadline))
                    .min(now + if busy.alone { ALONE_SLEEP } else { MAX_SLEEP });
                for f in &mut fds {
                    f.revents = 0;
                }
                // A closed pair's lifeline reports its end for ever: not polled.
                for (p, f) in pairs.iter().zip(&mut fds[1..]) {
                    f.fd = if p.is_closed() { -1 } else { p.lifeline_fd() };
                }
                if poll_fds(&mut fds, until.saturating_duration_since(now)).is_err() {
                    std::thread::sleep(Duration::from_micros(100));
                }
                if fds[0].revents != 0 {
                    self.bell.drain();
                }
                for (p, f) in pairs.iter().zip(&fds[1..]) {
                    if f.revents != 0 {
                        p.check_lifeline();
                    }
                }
            }
            for p in pairs.iter().take(armed) {
                p.woke();
            }
        }
    }
}
