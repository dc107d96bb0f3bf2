//! Caller-driven progress: a thread that waits does the I/O of its context's busy pairs itself.
//!
//! Waking a thread costs more than the work it then does on a small message (a
//! cross-core wake-up is an inter-processor interrupt, a VM exit on a virtual machine). So a
//! waiting thread does not sleep while the event loop reads for it: it takes the pairs it waits
//! on, and every other pair of the context with operations outstanding, out of the loop
//! ([`TcpPair::acquire`]), flushes and reads them itself, spins or yields for the busy-wait
//! budget, and only then blocks in `poll(2)` on their sockets and wake-up eventfds.
//!
//! When the wait ends the pairs are parked rather than handed back: the next wait (the next
//! round of the collective, the next collective) takes them again without a system call, and
//! no message wakes the event loop meanwhile. The loop takes back pairs left parked for
//! [`PARK_GRACE`](super::parking::PARK_GRACE), so a message nobody waits for is still read and
//! a queued send still flushed.
//!
//! A pair already driven by another thread is not shared: a wait on it counts itself as
//! waiting, so the driver hands the pair to the event loop when it is done, and sleeps on its
//! completion like any waiter.

use super::pair::{Acquired, TcpPair};
use super::parking::{Parked, Parking};
use crate::error::Result;
use crate::transport::wake::poll_fds;
use crate::transport::{BusyWait, Completion, Done, Progress};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The TCP progress engine of one mesh.
pub(crate) struct TcpProgress {
    /// Indexed by peer rank; `None` at our own rank.
    pairs: Vec<Option<Arc<TcpPair>>>,
    parking: Arc<Parking>,
}

impl TcpProgress {
    pub(crate) fn new(pairs: Vec<Option<Arc<TcpPair>>>, parking: Arc<Parking>) -> Self {
        TcpProgress { pairs, parking }
    }

    fn pair(&self, peer: usize) -> Option<&Arc<TcpPair>> {
        self.pairs.get(peer).and_then(Option::as_ref)
    }

    /// Ends driving `mine`; parks them (or hands them to the loop with `to_loop`).
    fn release(&self, mine: &[(&Arc<TcpPair>, [RawFd; 2])], to_loop: bool) {
        let now = Instant::now();
        let newly: Vec<Arc<dyn Parked>> = mine
            .iter()
            .filter(|(p, _)| p.release(now, to_loop))
            .map(|(p, _)| Arc::clone(p) as Arc<dyn Parked>)
            .collect();
        if !newly.is_empty() {
            self.parking.park(newly);
        }
    }

    /// Drives `mine` until `done` finishes or `deadline`; `None` when it could not poll.
    fn drive(
        &self,
        mine: &[(&Arc<TcpPair>, [RawFd; 2])],
        done: &Completion,
        deadline: Instant,
        busy: BusyWait,
    ) -> Option<Option<Result<Done>>> {
        let mut ready = vec![true; mine.len()];
        // Per pair: its main connection, its bulk connection, its eventfd.
        let mut fds: Vec<libc::pollfd> = mine
            .iter()
            .flat_map(|(p, [main, bulk])| {
                [
                    libc::pollfd { fd: *main, events: 0, revents: 0 },
                    libc::pollfd { fd: *bulk, events: 0, revents: 0 },
                    libc::pollfd { fd: p.wake().raw(), events: libc::POLLIN, revents: 0 },
                ]
            })
            .collect();
        // When each pair's hold of a message ends: it must be stepped then, readiness or not.
        let mut holds: Vec<Option<Instant>> = vec![None; mine.len()];
        let busy_until = Instant::now() + busy.budget;
        loop {
            for ((((p, _), slot), r), hold) in mine.iter().zip(fds.chunks_exact_mut(3)).zip(&ready).zip(&mut holds) {
                if *r {
                    ([slot[0].events, slot[1].events], *hold) = p.drive_now();
                }
            }
            if let Some(o) = done.outcome() {
                return Some(Some(o));
            }
            let now = Instant::now();
            if now >= deadline {
                return Some(done.outcome());
            }
            let spinning = now < busy_until;
            let hold_ends = holds.iter().flatten().min().copied();
            let until = hold_ends.map_or(deadline, |h| h.min(deadline));
            let timeout = if spinning { Duration::ZERO } else { until.saturating_duration_since(now) };
            match poll_fds(&mut fds, timeout) {
                Err(_) => return None,
                Ok(0) => {
                    let now = Instant::now();
                    for (r, hold) in ready.iter_mut().zip(&holds) {
                        *r = hold.is_some_and(|h| h <= now);
                    }
                    if spinning {
                        if busy.yield_cpu {
                            // Cores are shared: let another rank run rather than sleep.
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                    }
                }
                Ok(_) => {
                    for (((p, _), slot), r) in mine.iter().zip(fds.chunks_exact(3)).zip(ready.iter_mut()) {
                        if slot[2].revents != 0 {
                            p.wake().drain();
                        }
                        *r = slot.iter().any(|f| f.revents != 0);
                    }
                }
            }
        }
    }
}

impl Progress for TcpProgress {
    fn interrupt(&self) {
        // A driving wait polls its pairs' eventfds (and the event loop those of the others):
        // a spurious wake-up costs them one look at their pairs.
        for p in self.pairs.iter().flatten() {
            p.wake().signal();
        }
    }

    fn lend(&self, peers: &[usize]) {
        // A parked pair is read by nobody until the loop's sweep takes it back (PARK_GRACE).
        for p in peers.iter().filter_map(|&r| self.pair(r)) {
            p.unpark();
        }
    }

    fn wait(
        &self,
        done: &Completion,
        own: &[usize],
        others: &[usize],
        deadline: Instant,
        busy: BusyWait,
    ) -> Option<Result<Done>> {
        if let Some(o) = done.outcome() {
            return Some(o);
        }
        let mut mine = Vec::with_capacity(own.len() + others.len());
        let mut contended = Vec::new();
        // A peer with no TCP pair here (this rank itself, on its loopback pair) completes the
        // operation without any socket this thread could poll.
        let mut elsewhere = false;
        for &r in own {
            let Some(p) = self.pair(r) else {
                elsewhere = true;
                continue;
            };
            match p.acquire(true) {
                Acquired::Fds(fds) => mine.push((p, fds)),
                Acquired::Busy => contended.push(p),
                Acquired::Unavailable => {}
            }
        }
        if !contended.is_empty() || mine.is_empty() || elsewhere {
            // Another thread drives (one of) our pairs, or the operation may finish off our
            // sockets: a thread polling them would not see the completion. Let the event loop
            // have our pairs and sleep on the completion.
            self.release(&mine, true);
            let outcome = done.wait_until(deadline);
            for p in contended {
                p.unwait();
            }
            return outcome;
        }
        for p in others.iter().filter_map(|&r| self.pair(r)) {
            if let Acquired::Fds(fds) = p.acquire(false) {
                mine.push((p, fds));
            }
        }
        let outcome = self.drive(&mine, done, deadline, busy);
        // Could not poll: give the pairs to the loop and wait like any other waiter.
        self.release(&mine, outcome.is_none());
        outcome.flatten().or_else(|| done.wait_until(deadline))
    }
}
