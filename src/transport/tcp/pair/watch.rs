//! Who watches a TCP pair's sockets: the event loop (registered in its epoll set), a waiting
//! thread that polls and drives the pair itself, or nobody for a short while after a wait
//! (parked). A parked pair goes back to the loop after the parking grace unless another wait
//! takes it first: back-to-back collectives then never register, deregister or wake the loop
//! per message.

use super::super::parking::{PARK_GRACE, Parked};
use super::recv::HOLD;
use super::{Conn, Inner, Step, TcpPair};
use crate::transport::wake::EventFd;
use mio::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

/// Who watches the socket for readiness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Watch {
    /// Registered in the event loop's epoll set.
    Loop,
    /// A waiting thread polls it itself; out of the epoll set.
    Driven,
    /// Out of the epoll set and polled by nobody, since `Watching::parked_at`.
    Parked,
}

/// The watching part of a pair's state.
pub(super) struct Watching {
    pub(super) watch: Watch,
    parked_at: Instant,
    /// On the device's parking list.
    listed: bool,
    /// Threads waiting for the driver to let go (they need the event loop to take over).
    waiters: u32,
    /// A failed connection's sockets, kept open until the driver stops polling their descriptors.
    pub(super) zombie: Vec<TcpStream>,
    /// Whether the hold is counted in the device's parking (see [`TcpPair::count_hold`]).
    pub(super) hold_counted: bool,
    /// Whether the event loop is asked for writability. Only while sends are queued: a socket
    /// registered for it is reported writable at once, waking the loop for nothing.
    write_interest: bool,
}

impl Watching {
    pub(super) fn new() -> Self {
        Watching {
            watch: Watch::Loop,
            parked_at: Instant::now(),
            listed: false,
            waiters: 0,
            zombie: Vec::new(),
            hold_counted: false,
            write_interest: false,
        }
    }

    pub(super) fn is_driven(&self) -> bool {
        self.watch == Watch::Driven
    }
}

/// What [`TcpPair::acquire`] got.
pub(crate) enum Acquired {
    /// The caller drives the pair now; poll these descriptors (indexed by
    /// [`Lane`](super::Lane)).
    Fds([RawFd; 2]),
    /// Another thread drives it.
    Busy,
    /// Not connected (yet, or any more): nothing to drive.
    Unavailable,
}

impl TcpPair {
    /// Event-loop entry: a socket of the pair became readable and/or writable.
    pub(crate) fn on_ready(&self) {
        let mut g = self.lock();
        // An event queued before a driver took the pair over: the driver does the I/O now.
        if g.watching.watch == Watch::Loop {
            self.drive(&mut g);
        }
    }

    /// Takes the pair over for the calling thread, which then polls and drives it (see
    /// [`super::super::progress`]) until [`TcpPair::release`]. With `wait_if_busy`, a pair driven by
    /// another thread counts the caller as waiting for it, so that its driver hands it to the
    /// event loop rather than parking it (the caller then calls [`TcpPair::unwait`]).
    pub(crate) fn acquire(&self, wait_if_busy: bool) -> Acquired {
        let mut g = self.lock();
        let Inner { conn, watching, .. } = &mut *g;
        let Conn::Open(socks) = conn else { return Acquired::Unavailable };
        let fds = Acquired::Fds(socks.each_ref().map(|s| s.stream.as_raw_fd()));
        match watching.watch {
            Watch::Driven => {
                if wait_if_busy {
                    watching.waiters += 1;
                }
                Acquired::Busy
            }
            Watch::Loop => match socks.iter_mut().try_for_each(|s| self.registry.deregister(&mut s.stream)) {
                Ok(()) => {
                    watching.watch = Watch::Driven;
                    self.count_hold(&mut g); // the driver ends it now
                    fds
                }
                Err(e) => {
                    let e = self.io_error(e, "taking over the connection to");
                    self.fail_locked(&mut g, e);
                    Acquired::Unavailable
                }
            },
            Watch::Parked => {
                watching.watch = Watch::Driven;
                fds
            }
        }
    }

    /// Undoes the waiting count of an [`TcpPair::acquire`] that found the pair busy.
    pub(crate) fn unwait(&self) {
        let mut g = self.lock();
        g.watching.waiters = g.watching.waiters.saturating_sub(1);
    }

    /// Ends the caller's driving. The pair is parked, or given to the event loop when another
    /// thread waits for it or `to_loop` says so. Returns true when the pair must be put on the
    /// device's parking list.
    pub(crate) fn release(&self, now: Instant, to_loop: bool) -> bool {
        let mut g = self.lock();
        g.watching.zombie.clear();
        if g.watching.watch != Watch::Driven {
            return false;
        }
        if !matches!(g.conn, Conn::Open(_)) {
            g.watching.watch = Watch::Parked;
            return false;
        }
        if to_loop || g.watching.waiters > 0 {
            self.to_loop(&mut g);
            return false;
        }
        g.watching.watch = Watch::Parked;
        g.watching.parked_at = now;
        !std::mem::replace(&mut g.watching.listed, true)
    }

    /// Hands a parked pair to the event loop now, for a wait that sleeps elsewhere (on another
    /// backend's doorbell) while this pair's operations must still move. A pair the loop or a
    /// driver has is left as it is. (It stays on the parking list; the loop's sweep finds it
    /// no longer parked and drops it.)
    pub(crate) fn unpark(&self) {
        let mut g = self.lock();
        if g.watching.watch == Watch::Parked && matches!(g.conn, Conn::Open(_)) {
            self.to_loop(&mut g);
        }
    }

    /// Registers a parked or driven pair's sockets with the event loop again. Epoll reports
    /// readiness that built up meanwhile at once, so nothing is missed.
    fn to_loop(&self, g: &mut Inner) {
        let write = !g.tx.is_empty();
        let Conn::Open(socks) = &mut g.conn else { return };
        let interest = if write { mio::Interest::READABLE | mio::Interest::WRITABLE } else { mio::Interest::READABLE };
        match socks.iter_mut().try_for_each(|s| self.registry.register(&mut s.stream, s.token, interest)) {
            Ok(()) => {
                g.watching.watch = Watch::Loop;
                g.watching.write_interest = write;
                self.count_hold(g); // the loop ends it now
            }
            Err(e) => {
                g.watching.watch = Watch::Parked;
                let e = self.io_error(e, "handing to the event loop the connection to");
                self.fail_locked(g, e);
            }
        }
    }

    /// One driving step by the thread that acquired the pair: flush and read. Returns the
    /// `poll(2)` events to wait for next on each connection (indexed by lane), and when a
    /// hold ends (the driver must step again then). They stay valid until the next step:
    /// another thread that changes them (a post, a failure) signals the driver's eventfd.
    pub(crate) fn drive_now(&self) -> ([i16; 2], Option<Instant>) {
        let mut g = self.lock();
        self.drive(&mut g);
        let hold_ends = g.rx.held_since.map(|t| t + HOLD);
        (g.wanted_events(), hold_ends)
    }

    /// The event loop's look at a pair while holds are counted: ends an overdue hold of a pair
    /// the loop watches (the only holds counted, see [`TcpPair::count_hold`]).
    pub(crate) fn expire_hold(&self, now: Instant) {
        let mut g = self.lock();
        if g.watching.watch == Watch::Loop && g.rx.held_since.is_some_and(|t| now.saturating_duration_since(t) >= HOLD)
        {
            self.drive(&mut g);
        }
    }

    /// Keeps the device's count of holds in step with this pair. Only a hold on a pair the
    /// event loop watches is counted (the loop then looks at holds every tick): a driver ends
    /// its own holds, and a parked pair's hold is ended after the loop takes the pair back.
    /// Counting every hold made the loop tick all through a ring allreduce, which cost ~8% at
    /// 16 MiB (median p50 of five alternating runs: 2 ranks 8.2 vs 7.5 ms, 4 ranks 32.8 vs
    /// 30.0 ms).
    pub(super) fn count_hold(&self, g: &mut Inner) {
        let counted = g.rx.held_since.is_some() && g.watching.watch == Watch::Loop;
        if counted != g.watching.hold_counted {
            g.watching.hold_counted = counted;
            if counted {
                self.parking.hold_started();
            } else {
                self.parking.hold_ended();
            }
        }
    }

    /// Asks the event loop for writability when sends are left queued (and it watches the pair).
    pub(super) fn want_writable(&self, g: &mut Inner) -> Step {
        let Inner { conn, tx, watching, .. } = g;
        if let Conn::Open(socks) = conn
            && watching.watch == Watch::Loop
            && !watching.write_interest
            && !tx.is_empty()
        {
            let both = mio::Interest::READABLE | mio::Interest::WRITABLE;
            socks
                .iter_mut()
                .try_for_each(|s| self.registry.reregister(&mut s.stream, s.token, both))
                .map_err(|e| self.io_error(e, "registering for writability the connection to"))?;
            watching.write_interest = true;
        }
        Ok(())
    }

    /// The eventfd that wakes this pair's driver.
    pub(crate) fn wake(&self) -> &EventFd {
        &self.wake
    }
}

impl Parked for TcpPair {
    /// Gives a pair parked for the grace period back to the loop. A driven pair stays on the
    /// list: it is parked again soon, and re-listing it would wake the loop each time.
    fn sweep(&self, now: Instant) -> bool {
        let mut g = self.lock();
        let keep = matches!(g.conn, Conn::Open(_))
            && match g.watching.watch {
                Watch::Driven => true,
                Watch::Parked => now.saturating_duration_since(g.watching.parked_at) < PARK_GRACE,
                Watch::Loop => false,
            };
        if !keep {
            g.watching.listed = false;
            if g.watching.watch == Watch::Parked {
                self.to_loop(&mut g);
            }
        }
        keep
    }
}
