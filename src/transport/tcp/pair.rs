//! One TCP connection to one peer: framing, matching, early arrivals, failure.
//!
//! All state sits behind one mutex. Whoever holds it may make progress: the device's event
//! loop on readiness events, a posting thread (a send that fits in the socket buffer is
//! written by the caller itself, with no hand-off to the loop), and a waiting thread that
//! drives the pair (see [`super::progress`]).
//!
//! Who watches the socket ([`Watch`]): the event loop (registered in its epoll set), a waiting
//! thread (which polls it itself), or nobody for a short while after a wait (parked). A parked
//! pair goes back to the loop after [`PARK_GRACE`] unless another wait takes it first: back to
//! back collectives then never register, deregister or wake the loop per message.

use super::device::Parking;
use super::frame::{FrameHeader, HEADER_LEN, Kind, MAX_ABORT};
use super::wake::EventFd;
use crate::error::{Error, Result};
use crate::transport::{Completion, Pair, RecvBuf, SendBuf, seq_after, sequence_mismatch, sequenced};
use mio::Token;
use mio::net::TcpStream;
use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut, Read};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Staging buffer for small reads (headers and small payloads arrive many per syscall).
const STAGING: usize = 64 << 10;
/// A payload remainder at least this large is read straight into the user's buffer.
const DIRECT_MIN: usize = 16 << 10;
/// Most iovecs handed to one `sendmsg`.
const MAX_IOV: usize = 64;
/// Most bytes handed to one `sendmsg`. Measured with `ferrogloo-bench` on the 2-core machine,
/// eight alternating runs of each build, median p50: 1 MiB broadcast 166 µs with this cap
/// against 364 µs without (2 ranks), 1191 vs 1287 µs (4 ranks); 1 MiB allgather 298 vs 344 µs
/// (2 ranks), 863 vs 948 µs (4 ranks). Much smaller caps cost more calls than they save
/// (128 KiB: 1 MiB broadcast 360–420 µs).
const MAX_SEND: usize = 1 << 20;
/// Early-arrival buffers kept for reuse (their capacity also stays within the early budget):
/// a fresh multi-megabyte allocation per early segment costs page faults on every touch.
const SPARE_BUFFERS: usize = 8;
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
/// A message at least this large that arrives while no receive at all is posted on its pair is
/// left in the socket (held) instead of being read into the early budget: when its receive is
/// posted, it is read straight into the receive buffer. An early-buffered message costs two
/// more copies (staging to early buffer, early buffer to receive buffer); in a ring allreduce
/// the next phase's segments routinely arrive before their receives are posted.
const HOLD_MIN: usize = 64 << 10;
/// How long a message is held at most; then it is read into the early budget after all, so a
/// sender that waits for its send to finish before it receives still gets on. (A pair nobody
/// watches, parked, is looked at again after [`PARK_GRACE`], so its hold can last that long.)
pub(crate) const HOLD: Duration = Duration::from_millis(2);

/// Who watches the socket for readiness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watch {
    /// Registered in the event loop's epoll set.
    Loop,
    /// A waiting thread polls it itself; out of the epoll set.
    Driven,
    /// Out of the epoll set and polled by nobody, since `Inner::parked_at`.
    Parked,
}

/// One of a pair's two connections, both opened by the higher rank.
///
/// `Main` carries every frame of the higher rank and the small frames of the lower one; `Bulk`
/// carries the lower rank's large frames ([`BULK_MIN`] and up). So two ranks exchanging large
/// messages write to different connections: with one socket for both ways, a rank inside
/// `sendmsg` owns the socket while the peer's segments and ACKs for it wait in its backlog (two
/// ranks exchanging 512 KiB at once: 256–410 µs per exchange in a bare loopback test, six runs,
/// against 108–176 µs on two connections). Small frames of both ranks share `Main`, so their
/// ACKs ride on data going the other way (with a connection per direction, pure ACKs made an
/// 8-byte round trip 15.1 instead of 10.5 µs). The lower rank switches connections with a
/// switch frame on the one it leaves, and the receiver reads one connection at a time, so
/// frames arrive in the order they were sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// The higher rank's frames and the lower rank's small ones.
    Main = 0,
    /// The lower rank's large frames.
    Bulk = 1,
}

impl Lane {
    fn other(self) -> Lane {
        match self {
            Lane::Main => Lane::Bulk,
            Lane::Bulk => Lane::Main,
        }
    }

    /// Where this lane's entry is in the arrays indexed by lane.
    fn index(self) -> usize {
        self as usize
    }
}

/// Frames at least this large from the lower rank go on [`Lane::Bulk`]. Each trip to the bulk
/// connection costs two switch frames: with 64 KiB a 2-rank 64 KiB broadcast took 30.8 µs
/// against 23.9 µs (median p50 of three alternating runs); 256 KiB and up no size measured
/// differed beyond the noise.
const BULK_MIN: usize = 256 << 10;

/// A connected socket and its event-loop token.
struct Sock {
    stream: TcpStream,
    token: Token,
}

/// What [`TcpPair::acquire`] got.
pub(crate) enum Acquired {
    /// The caller drives the pair now; poll these descriptors (indexed by [`Lane`]).
    Fds([RawFd; 2]),
    /// Another thread drives it.
    Busy,
    /// Not connected (yet, or any more): nothing to drive.
    Unavailable,
}

struct SendOp {
    /// The connection it goes on.
    lane: Lane,
    hdr: [u8; HEADER_LEN],
    buf: SendBuf,
    /// Memory `buf` points into when the pair owns the payload (abort frames).
    _owned: Option<Box<[u8]>>,
    /// Bytes of header + payload written so far.
    off: usize,
    done: Arc<Completion>,
}

impl SendOp {
    fn total(&self) -> usize {
        HEADER_LEN + self.buf.len
    }
}

struct RecvOp {
    tag: u64,
    meta: u32,
    buf: RecvBuf,
    done: Arc<Completion>,
}

struct Early {
    tag: u64,
    meta: u32,
    data: Vec<u8>,
}

/// Where the bytes coming in belong.
enum Rx {
    /// Expecting a frame header.
    Header,
    /// Payload for a posted receive.
    Payload { op: RecvOp, filled: usize },
    /// Payload that arrived before its receive; held within the budget.
    Early { tag: u64, meta: u32, len: usize, data: Vec<u8> },
    /// Payload nobody can take (mismatch, cancelled receive): read and dropped.
    Discard { remaining: u64 },
    /// The reason of an abort frame (bounded by `MAX_ABORT`).
    Abort { len: usize, data: Vec<u8> },
    /// A header whose payload fits neither a posted receive nor the budget, or is held (see
    /// [`HOLD_MIN`]): reading stops (TCP back-pressure) until a receive for it is posted, or the
    /// hold ends.
    Stalled(FrameHeader),
}

/// The pair's connections, indexed by [`Lane`].
enum Conn {
    /// Mesh not yet formed: the lanes attached so far (registered with the event loop).
    Pending([Option<Sock>; 2]),
    Open([Sock; 2]),
    Closed(Error),
}

impl Conn {
    /// The sockets held: both once open, those attached so far while pending.
    fn socks(&mut self) -> Vec<&mut Sock> {
        match self {
            Conn::Open(socks) => socks.iter_mut().collect(),
            Conn::Pending(socks) => socks.iter_mut().flatten().collect(),
            Conn::Closed(_) => Vec::new(),
        }
    }

    /// The sockets held, taken out (see [`Conn::socks`]).
    fn into_socks(self) -> Vec<Sock> {
        match self {
            Conn::Open(socks) => socks.into_iter().collect(),
            Conn::Pending(socks) => socks.into_iter().flatten().collect(),
            Conn::Closed(_) => Vec::new(),
        }
    }
}

struct Inner {
    conn: Conn,
    sendq: VecDeque<SendOp>,
    posted: VecDeque<RecvOp>,
    early: VecDeque<Early>,
    early_bytes: usize,
    /// Emptied early-arrival buffers, for reuse.
    spare: Vec<Vec<u8>>,
    rx: Rx,
    /// The connection the next incoming bytes are read from.
    reading: Lane,
    /// Bytes read from `reading` and not consumed yet: `staging[start..end]`.
    staging: Box<[u8]>,
    start: usize,
    end: usize,
    /// The other connection's staging buffer and unconsumed range, kept across a switch.
    other_staging: Box<[u8]>,
    other_start: usize,
    other_end: usize,
    /// The connection of the last frame queued (a switch frame goes first when it changes).
    send_lane: Lane,
    watch: Watch,
    parked_at: Instant,
    /// On the device's parking list (see [`super::device::Parking`]).
    listed: bool,
    /// Threads waiting for the driver to let go (they need the event loop to take over).
    waiters: u32,
    /// A failed connection's sockets, kept open until the driver stops polling their descriptors.
    zombie: Vec<TcpStream>,
    /// Since when the stalled header is held (see [`HOLD_MIN`]); `None` when not held.
    held_since: Option<Instant>,
    /// Whether the hold is counted in the device's [`Parking`] (see [`TcpPair::count_hold`]).
    hold_counted: bool,
    /// Whether the event loop is asked for writability. Only while sends are queued: a socket
    /// registered for it is reported writable at once, waking the loop for nothing.
    write_interest: bool,
}

/// The TCP pair.
pub(crate) struct TcpPair {
    peer: usize,
    /// This side is the lower rank, which sends large frames on [`Lane::Bulk`].
    sends_bulk: bool,
    early_limit: usize,
    registry: Arc<mio::Registry>,
    /// The device's timers: counts this pair's hold, so that the event loop ends it in time.
    parking: Arc<Parking>,
    /// Wakes the thread driving this pair when another thread needs it to look again.
    wake: EventFd,
    inner: Mutex<Inner>,
}

/// What an I/O step asks of its caller.
type Step = std::result::Result<(), Error>;

impl TcpPair {
    pub(crate) fn new(
        peer: usize,
        sends_bulk: bool,
        early_limit: usize,
        registry: Arc<mio::Registry>,
        parking: Arc<Parking>,
    ) -> io::Result<Arc<Self>> {
        Ok(Arc::new(TcpPair {
            peer,
            sends_bulk,
            early_limit,
            registry,
            parking,
            wake: EventFd::new()?,
            inner: Mutex::new(Inner {
                conn: Conn::Pending([None, None]),
                sendq: VecDeque::new(),
                posted: VecDeque::new(),
                early: VecDeque::new(),
                early_bytes: 0,
                spare: Vec::new(),
                rx: Rx::Header,
                reading: Lane::Main,
                staging: vec![0u8; STAGING].into_boxed_slice(),
                start: 0,
                end: 0,
                other_staging: vec![0u8; STAGING].into_boxed_slice(),
                other_start: 0,
                other_end: 0,
                send_lane: Lane::Main,
                watch: Watch::Loop,
                parked_at: Instant::now(),
                listed: false,
                waiters: 0,
                zombie: Vec::new(),
                held_since: None,
                hold_counted: false,
                write_interest: false,
            }),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        crate::sync::lock(&self.inner)
    }

    /// True once both lanes are attached (or the pair has failed).
    pub(crate) fn is_attached(&self) -> bool {
        !matches!(self.lock().conn, Conn::Pending(_))
    }

    /// Whether `lane` is attached (or the pair is past attaching).
    pub(crate) fn lane_attached(&self, lane: Lane) -> bool {
        match &self.lock().conn {
            Conn::Pending(socks) => socks[lane.index()].is_some(),
            _ => true,
        }
    }

    /// Hands the pair one lane's connected stream, registered with the event loop under
    /// `token`. Once both lanes are there the pair opens and drains anything already received;
    /// returns whether it did. Gives `stream` back when the pair already has that lane.
    pub(crate) fn attach(&self, lane: Lane, stream: TcpStream, token: Token) -> std::result::Result<bool, TcpStream> {
        let mut g = self.lock();
        let Conn::Pending(socks) = &mut g.conn else { return Err(stream) };
        let slot = &mut socks[lane.index()];
        if slot.is_some() {
            return Err(stream);
        }
        *slot = Some(Sock { stream, token });
        if let Conn::Pending([Some(_), Some(_)]) = &g.conn
            && let Conn::Pending([Some(main), Some(bulk)]) = std::mem::replace(&mut g.conn, Conn::Pending([None, None]))
        {
            g.conn = Conn::Open([main, bulk]);
            self.drive(&mut g);
            return Ok(true);
        }
        Ok(false)
    }

    /// Event-loop entry: a socket of the pair became readable and/or writable.
    pub(crate) fn on_ready(&self) {
        let mut g = self.lock();
        // An event queued before a driver took the pair over: the driver does the I/O now.
        if g.watch == Watch::Loop {
            self.drive(&mut g);
        }
    }

    /// Takes the pair over for the calling thread, which then polls and drives it (see
    /// [`super::progress`]) until [`TcpPair::release`]. With `wait_if_busy`, a pair driven by
    /// another thread counts the caller as waiting for it, so that its driver hands it to the
    /// event loop rather than parking it (the caller then calls [`TcpPair::unwait`]).
    pub(crate) fn acquire(&self, wait_if_busy: bool) -> Acquired {
        let mut g = self.lock();
        let Inner { conn, watch, waiters, .. } = &mut *g;
        let Conn::Open(socks) = conn else { return Acquired::Unavailable };
        let fds = Acquired::Fds(socks.each_ref().map(|s| s.stream.as_raw_fd()));
        match *watch {
            Watch::Driven => {
                if wait_if_busy {
                    *waiters += 1;
                }
                Acquired::Busy
            }
            Watch::Loop => {
                match socks.iter_mut().try_for_each(|s| self.registry.deregister(&mut s.stream)) {
                    Ok(()) => {
                        *watch = Watch::Driven;
                        self.count_hold(&mut g); // the driver ends it now
                        fds
                    }
                    Err(e) => {
                        let e = self.io_error(e, "taking over the connection to");
                        self.fail_locked(&mut g, e);
                        Acquired::Unavailable
                    }
                }
            }
            Watch::Parked => {
                *watch = Watch::Driven;
                fds
            }
        }
    }

    /// Undoes the waiting count of an [`TcpPair::acquire`] that found the pair busy.
    pub(crate) fn unwait(&self) {
        let mut g = self.lock();
        g.waiters = g.waiters.saturating_sub(1);
    }

    /// Ends the caller's driving. The pair is parked, or given to the event loop when another
    /// thread waits for it or `to_loop` says so. Returns true when the pair must be put on the
    /// device's parking list.
    pub(crate) fn release(&self, now: Instant, to_loop: bool) -> bool {
        let mut g = self.lock();
        g.zombie.clear();
        if g.watch != Watch::Driven {
            return false;
        }
        if !matches!(g.conn, Conn::Open { .. }) {
            g.watch = Watch::Parked;
            return false;
        }
        if to_loop || g.waiters > 0 {
            self.to_loop(&mut g);
            return false;
        }
        g.watch = Watch::Parked;
        g.parked_at = now;
        !std::mem::replace(&mut g.listed, true)
    }

    /// The event loop's look at a listed pair: gives a pair parked for `PARK_GRACE` back to the
    /// loop. Returns whether it stays on the list (a driven pair does: it is parked again soon,
    /// and re-listing it would wake the loop each time).
    pub(crate) fn sweep(&self, now: Instant) -> bool {
        let mut g = self.lock();
        let keep = matches!(g.conn, Conn::Open { .. })
            && match g.watch {
                Watch::Driven => true,
                Watch::Parked => now.saturating_duration_since(g.parked_at) < PARK_GRACE,
                Watch::Loop => false,
            };
        if !keep {
            g.listed = false;
            if g.watch == Watch::Parked {
                self.to_loop(&mut g);
            }
        }
        keep
    }

    /// Registers a parked or driven pair's sockets with the event loop again. Epoll reports
    /// readiness that built up meanwhile at once, so nothing is missed.
    fn to_loop(&self, g: &mut Inner) {
        let write = !g.sendq.is_empty();
        let Conn::Open(socks) = &mut g.conn else { return };
        let interest = if write { mio::Interest::READABLE | mio::Interest::WRITABLE } else { mio::Interest::READABLE };
        match socks.iter_mut().try_for_each(|s| self.registry.register(&mut s.stream, s.token, interest)) {
            Ok(()) => {
                g.watch = Watch::Loop;
                g.write_interest = write;
                self.count_hold(g); // the loop ends it now
            }
            Err(e) => {
                g.watch = Watch::Parked;
                let e = self.io_error(e, "handing to the event loop the connection to");
                self.fail_locked(g, e);
            }
        }
    }

    /// One driving step by the thread that acquired the pair: flush and read. Returns the
    /// `poll(2)` events to wait for next on each connection (indexed by [`Lane`]), and when a
    /// hold ends (the driver must step again then). They stay valid until the next step:
    /// another thread that changes them (a post, a failure) signals the driver's eventfd.
    pub(crate) fn drive_now(&self) -> ([i16; 2], Option<Instant>) {
        let mut g = self.lock();
        self.drive(&mut g);
        let hold_ends = g.held_since.map(|t| t + HOLD);
        let mut ev = [0, 0];
        if matches!(g.conn, Conn::Open(_)) {
            // Only the connection being read; a stalled header cannot be consumed: readiness
            // would fire forever.
            if !matches!(g.rx, Rx::Stalled(_)) {
                ev[g.reading.index()] |= libc::POLLIN;
            }
            if let Some(op) = g.sendq.front() {
                ev[op.lane.index()] |= libc::POLLOUT;
            }
        }
        (ev, hold_ends)
    }

    /// The event loop's look at a pair while holds are counted: ends an overdue hold of a pair
    /// the loop watches (the only holds counted, see [`TcpPair::count_hold`]).
    pub(crate) fn expire_hold(&self, now: Instant) {
        let mut g = self.lock();
        if g.watch == Watch::Loop && g.held_since.is_some_and(|t| now.saturating_duration_since(t) >= HOLD) {
            self.drive(&mut g);
        }
    }

    /// Whether the stalled header `h` stays held: only while no receive is posted on the pair
    /// (one that is posted for another message needs the stream read past this one) and for
    /// at most [`HOLD`]. Starts the hold of a fresh header.
    fn keep_holding(&self, g: &mut Inner, len: usize) -> bool {
        if len < HOLD_MIN || !g.posted.is_empty() {
            return false;
        }
        let now = Instant::now();
        match g.held_since {
            Some(t) => now.saturating_duration_since(t) < HOLD,
            None => {
                g.held_since = Some(now);
                self.count_hold(g);
                true
            }
        }
    }

    /// The stalled header is no longer held.
    fn end_hold(&self, g: &mut Inner) {
        if g.held_since.take().is_some() {
            self.count_hold(g);
        }
    }

    /// Keeps the device's count of holds in step with this pair. Only a hold on a pair the
    /// event loop watches is counted (the loop then looks at holds every tick): a driver ends
    /// its own holds, and a parked pair's hold is ended after the loop takes the pair back.
    /// Counting every hold made the loop tick all through a ring allreduce, which cost ~8% at
    /// 16 MiB (median p50 of five alternating runs: 2 ranks 8.2 vs 7.5 ms, 4 ranks 32.8 vs
    /// 30.0 ms).
    fn count_hold(&self, g: &mut Inner) {
        let counted = g.held_since.is_some() && g.watch == Watch::Loop;
        if counted != g.hold_counted {
            g.hold_counted = counted;
            if counted {
                self.parking.hold_started();
            } else {
                self.parking.hold_ended();
            }
        }
    }

    /// The eventfd that wakes this pair's driver.
    pub(crate) fn wake(&self) -> &EventFd {
        &self.wake
    }

    /// Flushes pending sends and reads what has arrived; fails the pair on error.
    fn drive(&self, g: &mut Inner) {
        let r = self.flush_or_explain(g).and_then(|()| self.read(g)).and_then(|()| self.want_writable(g));
        if let Err(e) = r {
            self.fail_locked(g, e);
        }
    }

    /// [`TcpPair::flush`], but a send that finds the peer gone reads first: a peer that gives
    /// up sends an abort frame naming the cause and then closes, and a send can meet the closed
    /// socket before that frame is read. The frame says more than the broken pipe (the rank
    /// that died first, not one that left after it).
    fn flush_or_explain(&self, g: &mut Inner) -> Step {
        match self.flush(g) {
            Err(e @ Error::PeerClosed { .. }) => match self.read(g) {
                Err(abort @ Error::Aborted { .. }) => Err(abort),
                _ => Err(e),
            },
            r => r,
        }
    }

    /// Asks the event loop for writability when sends are left queued (and it watches the pair).
    fn want_writable(&self, g: &mut Inner) -> Step {
        let Inner { conn, sendq, watch, write_interest, .. } = g;
        if let Conn::Open(socks) = conn
            && *watch == Watch::Loop
            && !*write_interest
            && !sendq.is_empty()
        {
            let both = mio::Interest::READABLE | mio::Interest::WRITABLE;
            socks
                .iter_mut()
                .try_for_each(|s| self.registry.reregister(&mut s.stream, s.token, both))
                .map_err(|e| self.io_error(e, "registering for writability the connection to"))?;
            *write_interest = true;
        }
        Ok(())
    }

    /// Closes the connection quietly (the context is going away).
    pub(crate) fn close(&self) {
        let mut g = self.lock();
        self.fail_locked(
            &mut g,
            Error::Aborted { detail: format!("the context closed its connection to rank {}", self.peer) },
        );
    }

    fn io_error(&self, e: io::Error, what: &str) -> Error {
        match e.kind() {
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionAborted => {
                Error::PeerClosed { rank: self.peer, detail: format!("{what}: {e}") }
            }
            _ => Error::io(format!("{what} rank {}", self.peer), e),
        }
    }

    fn fail_locked(&self, g: &mut Inner, err: Error) {
        if let Conn::Closed(_) = g.conn {
            return;
        }
        for Sock { mut stream, .. } in std::mem::replace(&mut g.conn, Conn::Closed(err.clone())).into_socks() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
            match g.watch {
                Watch::Driven => {
                    // The driver may be polling this descriptor: keep it open until it stops.
                    g.zombie.push(stream);
                    self.wake.signal();
                }
                Watch::Loop => {
                    let _ = self.registry.deregister(&mut stream);
                }
                Watch::Parked => {}
            }
        }
        tracing::debug!(peer = self.peer, error = %err, "pair failed");
        for op in g.sendq.drain(..) {
            op.done.complete(Err(err.clone()));
        }
        for op in g.posted.drain(..) {
            op.done.complete(Err(err.clone()));
        }
        self.end_hold(g);
        match std::mem::replace(&mut g.rx, Rx::Header) {
            Rx::Payload { op, .. } => op.done.complete(Err(err.clone())),
            Rx::Early { len, .. } => g.early_bytes -= len,
            _ => {}
        }
        g.start = 0;
        g.end = 0;
        g.other_start = 0;
        g.other_end = 0;
    }

    fn closed_error(g: &Inner) -> Option<Error> {
        match &g.conn {
            Conn::Closed(e) => Some(e.clone()),
            _ => None,
        }
    }

    // ---------------------------------------------------------------- sending

    /// Writes as much of the send queue as the sockets take, in order: a frame for the other
    /// connection waits until the ones before it are written.
    fn flush(&self, g: &mut Inner) -> Step {
        let Inner { conn, sendq, .. } = g;
        let Conn::Open(socks) = conn else { return Ok(()) };
        while let Some(lane) = sendq.front().map(|op| op.lane) {
            // The queue's next slices for this connection, at most MAX_IOV of them and
            // MAX_SEND bytes in all.
            let mut iov: [IoSlice<'_>; MAX_IOV] = [IoSlice::new(&[]); MAX_IOV];
            let (mut n_iov, mut budget) = (0, MAX_SEND);
            for op in sendq.iter() {
                if n_iov + 2 > MAX_IOV || budget == 0 || op.lane != lane {
                    break;
                }
                // SAFETY: the poster guarantees (Pair::post_send) that the buffer stays valid
                // and unwritten until the completion is completed, which happens below only
                // after the last byte is written.
                let payload = unsafe { std::slice::from_raw_parts(op.buf.ptr, op.buf.len) };
                let (hdr, body): (&[u8], &[u8]) = match op.off.checked_sub(HEADER_LEN) {
                    None => (&op.hdr[op.off..], payload),
                    Some(sent) => (&[], &payload[sent..]),
                };
                for part in [hdr, body] {
                    let take = part.len().min(budget);
                    if take > 0 {
                        iov[n_iov] = IoSlice::new(&part[..take]);
                        n_iov += 1;
                        budget -= take;
                    }
                }
            }
            let sock = socket2::SockRef::from(&socks[lane.index()].stream);
            match sock.send_vectored_with_flags(&iov[..n_iov], libc::MSG_NOSIGNAL) {
                Ok(mut n) => {
                    for op in sendq.iter_mut() {
                        let take = (op.total() - op.off).min(n);
                        op.off += take;
                        n -= take;
                        if n == 0 {
                            break;
                        }
                    }
                    while let Some(op) = sendq.pop_front_if(|op| op.off == op.total()) {
                        op.done.complete(Ok(self.peer));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(e, "sending to")),
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- receiving

    /// Reads until the socket is drained or reading must stall.
    ///
    /// A read that returns less than it asked for has drained the socket, so reading stops
    /// there without the one more `recv` that would only say `EAGAIN`: whatever arrives later
    /// raises readiness again, for `poll(2)` (level-triggered) and the loop's edge-triggered
    /// epoll alike (every arrival is an edge).
    fn read(&self, g: &mut Inner) -> Step {
        let mut drained = None;
        loop {
            self.consume_staged(g)?;
            if matches!(g.rx, Rx::Stalled(_)) || drained == Some(g.reading) {
                return Ok(());
            }
            let Some(res) = self.read_ahead(g).or_else(|| self.read_some(g)) else { return Ok(()) };
            match res {
                Ok((0, _)) => {
                    return Err(Error::PeerClosed { rank: self.peer, detail: "connection closed (EOF)".into() });
                }
                Ok((n, asked)) => {
                    if n < asked {
                        drained = Some(g.reading);
                    }
                    self.finish_payload(g);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(e, "receiving from")),
            }
        }
    }

    /// One read where the state says: straight into a posted receive's buffer when its payload
    /// is being read and at least [`DIRECT_MIN`] of it is left, else into staging. Returns the
    /// bytes read and asked for; `None` when the pair is not connected.
    fn read_some(&self, g: &mut Inner) -> Option<io::Result<(usize, usize)>> {
        let Inner { conn, rx, reading, staging, start, end, .. } = &mut *g;
        let Conn::Open(socks) = conn else { return None };
        let stream = &mut socks[reading.index()].stream;
        Some(match rx {
            Rx::Payload { op, filled } if *start == *end && op.buf.len - *filled >= DIRECT_MIN => {
                // SAFETY: the poster lent this buffer exclusively until completion or cancel
                // (Pair::post_recv); both happen under the lock we hold.
                let dst = unsafe { std::slice::from_raw_parts_mut(op.buf.ptr.add(*filled), op.buf.len - *filled) };
                let asked = dst.len();
                stream.read(dst).map(|n| {
                    *filled += n;
                    (n, asked)
                })
            }
            _ => {
                if *start == *end {
                    *start = 0;
                    *end = 0;
                }
                let asked = staging.len() - *end;
                stream.read(&mut staging[*end..]).map(|n| {
                    *end += n;
                    (n, asked)
                })
            }
        })
    }

    /// Between frames, with nothing staged and a receive of at least [`DIRECT_MIN`] posted
    /// first: reads the next header into staging and what follows it straight into that
    /// receive's buffer, in one `readv`. When the header is that receive's message (the usual
    /// case: a collective posts its receive before the data lands) the payload skips the
    /// staging copy; otherwise the bytes move to staging, as if read there. A 2-rank 64 KiB
    /// allreduce then copies 64 KiB less per message. `None` when there is no such receive.
    fn read_ahead(&self, g: &mut Inner) -> Option<io::Result<(usize, usize)>> {
        let Inner { conn, rx, reading, staging, start, end, posted, .. } = &mut *g;
        let Conn::Open(socks) = conn else { return None };
        if !matches!(rx, Rx::Header) || *start != *end {
            return None;
        }
        // Not a receive from any of several ranks: another pair may claim and fill its buffer.
        let op = posted.front().filter(|op| op.buf.len >= DIRECT_MIN && !op.done.is_shared() && op.done.is_open())?;
        let (hdr, rest) = staging.split_at_mut(HEADER_LEN);
        let ahead = op.buf.len.min(rest.len());
        // SAFETY: the poster lent this buffer exclusively to this pair (it is posted to no other)
        // until completion or cancel, and both need the lock we hold; it is open, so neither
        // has happened. A receive that fails later may be left partly written, as ever.
        let dst = unsafe { std::slice::from_raw_parts_mut(op.buf.ptr, ahead) };
        let asked = HEADER_LEN + ahead;
        let read = socks[reading.index()].stream.read_vectored(&mut [IoSliceMut::new(hdr), IoSliceMut::new(dst)]);
        let n = match read {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        (*start, *end) = (0, n.min(HEADER_LEN));
        if n <= HEADER_LEN {
            return Some(Ok((n, asked)));
        }
        let got = n - HEADER_LEN;
        let mut raw = [0u8; HEADER_LEN];
        raw.copy_from_slice(hdr);
        // What `dispatch` would decide: a data frame for the oldest posted receive of its tag
        // (this one is the oldest of all), of the receive's length and kind.
        let ours = FrameHeader::decode(&raw).is_ok_and(|h| {
            h.kind == Kind::Data && h.tag == op.tag && mismatch(op.buf.len, op.meta, h.len, h.meta).is_none()
        });
        if ours && op.done.try_claim() {
            *end = 0;
            if let Some(op) = posted.pop_front() {
                *rx = Rx::Payload { op, filled: got };
            }
        } else {
            // SAFETY: as above; the receive is untouched otherwise, and `got <= rest.len()`.
            rest[..got].copy_from_slice(unsafe { std::slice::from_raw_parts(op.buf.ptr, got) });
            *end = n;
        }
        Some(Ok((n, asked)))
    }

    /// Reads on at the other connection (the peer sent a switch frame). What was read past the
    /// switch frame belongs to the frames after the switch back: it waits with its connection.
    fn switch_reading(g: &mut Inner) {
        std::mem::swap(&mut g.staging, &mut g.other_staging);
        std::mem::swap(&mut g.start, &mut g.other_start);
        std::mem::swap(&mut g.end, &mut g.other_end);
        g.reading = g.reading.other();
    }

    /// Completes a directly-read payload once full.
    fn finish_payload(&self, g: &mut Inner) {
        if let Rx::Payload { op, filled } = &g.rx
            && *filled == op.buf.len
            && let Rx::Payload { op, .. } = std::mem::replace(&mut g.rx, Rx::Header)
        {
            op.done.complete(Ok(self.peer));
        }
    }

    /// Moves staged bytes to where they belong.
    fn consume_staged(&self, g: &mut Inner) -> Step {
        loop {
            let avail = g.end - g.start;
            match &mut g.rx {
                Rx::Stalled(h) => {
                    let h = *h;
                    self.dispatch(g, h)?;
                    if matches!(g.rx, Rx::Stalled(_)) {
                        return Ok(());
                    }
                }
                Rx::Header => {
                    if avail < HEADER_LEN {
                        if g.start > 0 && avail > 0 {
                            g.staging.copy_within(g.start..g.end, 0);
                        }
                        if g.start > 0 {
                            g.end = avail;
                            g.start = 0;
                        }
                        return Ok(());
                    }
                    let mut raw = [0u8; HEADER_LEN];
                    raw.copy_from_slice(&g.staging[g.start..g.start + HEADER_LEN]);
                    g.start += HEADER_LEN;
                    let h = FrameHeader::decode(&raw)
                        .map_err(|detail| Error::Protocol { peer: Some(self.peer), detail })?;
                    if h.kind == Kind::Switch {
                        Self::switch_reading(g);
                    } else {
                        self.dispatch(g, h)?;
                    }
                }
                _ if avail == 0 => return Ok(()),
                Rx::Payload { op, filled } => {
                    let n = avail.min(op.buf.len - *filled);
                    // SAFETY: as in `read`: the buffer is lent to us until completion/cancel,
                    // and `filled + n <= len`.
                    let dst = unsafe { std::slice::from_raw_parts_mut(op.buf.ptr.add(*filled), n) };
                    dst.copy_from_slice(&g.staging[g.start..g.start + n]);
                    *filled += n;
                    g.start += n;
                    self.finish_payload(g);
                }
                Rx::Early { len, data, .. } => {
                    let n = avail.min(*len - data.len());
                    data.extend_from_slice(&g.staging[g.start..g.start + n]);
                    g.start += n;
                    if data.len() == *len {
                        self.finish_early(g);
                    }
                }
                Rx::Abort { len, data } => {
                    let n = avail.min(*len - data.len());
                    data.extend_from_slice(&g.staging[g.start..g.start + n]);
                    g.start += n;
                    if data.len() == *len {
                        let reason = String::from_utf8_lossy(data).into_owned();
                        return Err(Error::Aborted {
                            detail: format!("rank {} aborted the context: {reason}", self.peer),
                        });
                    }
                }
                Rx::Discard { remaining } => {
                    let n = (avail as u64).min(*remaining);
                    *remaining -= n;
                    g.start += n as usize;
                    if *remaining == 0 {
                        g.rx = Rx::Header;
                    }
                }
            }
        }
    }

    /// Decides where the payload of a fresh header goes.
    fn dispatch(&self, g: &mut Inner, h: FrameHeader) -> Step {
        if h.kind == Kind::Abort {
            // The length is bounded by the decoder.
            let len = h.len as usize;
            if len == 0 {
                return Err(Error::Aborted { detail: format!("rank {} aborted the context", self.peer) });
            }
            g.rx = Rx::Abort { len, data: Vec::with_capacity(len) };
            return Ok(());
        }
        let len = usize::try_from(h.len).unwrap_or(usize::MAX);
        if self.keep_holding(g, len) {
            g.rx = Rx::Stalled(h);
            return Ok(());
        }
        self.end_hold(g);
        // The oldest posted receive for this tag that nobody else has claimed.
        while let Some(i) = g.posted.iter().position(|op| op.tag == h.tag) {
            let Some(op) = g.posted.remove(i) else { break };
            if !op.done.try_claim() {
                continue; // taken by another pair (receive from any) or already finished
            }
            g.rx = self.deliver_to(op, h);
            return Ok(());
        }
        if let Some((family, got)) = sequenced(h.tag) {
            // Receives of the same family waiting for another sequence: the ranks disagree.
            let mut stale = false;
            let mut i = 0;
            while i < g.posted.len() {
                match sequenced(g.posted[i].tag) {
                    Some((f, want)) if f == family && want != got => {
                        stale |= seq_after(want, got);
                        if let Some(op) = g.posted.remove(i) {
                            op.done.complete(Err(sequence_mismatch(self.peer, family, want, got)));
                        }
                    }
                    _ => i += 1,
                }
            }
            if stale {
                // Nobody will ever receive a message of a finished collective.
                g.rx = if h.len == 0 { Rx::Header } else { Rx::Discard { remaining: h.len } };
                return Ok(());
            }
        }
        if len <= self.early_limit.saturating_sub(g.early_bytes) {
            g.early_bytes += len;
            let data = Self::early_buffer(g, len);
            g.rx = Rx::Early { tag: h.tag, meta: h.meta, len, data };
            if len == 0 {
                self.finish_early(g);
            }
        } else {
            g.rx = Rx::Stalled(h);
        }
        Ok(())
    }

    /// Checks a claimed receive against the header; the state the payload goes to.
    fn deliver_to(&self, op: RecvOp, h: FrameHeader) -> Rx {
        if let Some(detail) = mismatch(op.buf.len, op.meta, h.len, h.meta) {
            op.done.complete(Err(Error::Mismatch { rank: self.peer, detail }));
            return if h.len == 0 { Rx::Header } else { Rx::Discard { remaining: h.len } };
        }
        if h.len == 0 {
            op.done.complete(Ok(self.peer));
            return Rx::Header;
        }
        Rx::Payload { op, filled: 0 }
    }

    /// An early message is complete: hand it to a receive posted meanwhile, or keep it.
    fn finish_early(&self, g: &mut Inner) {
        let Rx::Early { tag, meta, data, .. } = std::mem::replace(&mut g.rx, Rx::Header) else { return };
        let msg = Early { tag, meta, data };
        while let Some(i) = g.posted.iter().position(|op| op.tag == tag) {
            let Some(op) = g.posted.remove(i) else { break };
            if op.done.try_claim() {
                self.deliver_early(g, op, msg);
                return;
            }
        }
        g.early.push_back(msg);
    }

    /// After a receive was posted or early budget freed: reads on if the stalled header can go
    /// somewhere now, and tells a driver, which polls a stalled pair without `POLLIN`.
    fn unstall(&self, g: &mut Inner) {
        if matches!(g.rx, Rx::Stalled(_)) {
            self.drive(g);
            if g.watch == Watch::Driven {
                self.wake.signal();
            }
        }
    }

    /// Delivers an early message (no longer on the early list) to the receive that claimed it,
    /// returns its bytes to the early budget and keeps its buffer for reuse.
    fn deliver_early(&self, g: &mut Inner, op: RecvOp, msg: Early) {
        g.early_bytes -= msg.data.len();
        if let Some(detail) = mismatch(op.buf.len, op.meta, msg.data.len() as u64, msg.meta) {
            op.done.complete(Err(Error::Mismatch { rank: self.peer, detail }));
        } else {
            // SAFETY: the receive buffer is lent to this pair until its completion, which
            // follows; the lengths are equal (checked above).
            unsafe { std::ptr::copy_nonoverlapping(msg.data.as_ptr(), op.buf.ptr, msg.data.len()) };
            op.done.complete(Ok(self.peer));
        }
        self.recycle(g, msg.data);
    }

    /// A buffer for an early payload of `len` bytes: the smallest spare that fits, else new.
    fn early_buffer(g: &mut Inner, len: usize) -> Vec<u8> {
        let best = g.spare.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity());
        match best.map(|(i, _)| i) {
            Some(i) => g.spare.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps an emptied early buffer for reuse while the spares stay within their bounds.
    fn recycle(&self, g: &mut Inner, mut data: Vec<u8>) {
        let held: usize = g.spare.iter().map(Vec::capacity).sum();
        if data.capacity() > 0 && g.spare.len() < SPARE_BUFFERS && held + data.capacity() <= self.early_limit {
            data.clear();
            g.spare.push(data);
        }
    }
}

/// Describes how a message differs from the receive it matched, if it does.
fn mismatch(want_len: usize, want_meta: u32, got_len: u64, got_meta: u32) -> Option<String> {
    if got_meta != want_meta {
        return Some(format!(
            "message descriptor {got_meta:#010x} where {want_meta:#010x} was expected \
             (different collective, element type or order)"
        ));
    }
    if got_len != want_len as u64 {
        return Some(format!("message of {got_len} bytes where the receive buffer holds {want_len}"));
    }
    None
}

impl Pair for TcpPair {
    fn peer(&self) -> usize {
        self.peer
    }

    fn remote_ip(&self) -> Option<IpAddr> {
        match &self.lock().conn {
            Conn::Open(socks) => socks[Lane::Main.index()].stream.peer_addr().ok().map(|a| a.ip()),
            _ => None,
        }
    }

    unsafe fn post_send(&self, tag: u64, meta: u32, buf: SendBuf, done: &Arc<Completion>) -> Result<()> {
        let mut g = self.lock();
        if let Some(e) = Self::closed_error(&g) {
            return Err(e);
        }
        let hdr = FrameHeader { kind: Kind::Data, meta, tag, len: buf.len as u64 }.encode();
        let idle = g.sendq.is_empty();
        let lane = if self.sends_bulk && buf.len >= BULK_MIN { Lane::Bulk } else { Lane::Main };
        if lane != g.send_lane {
            // Tell the peer to read on at the other connection.
            let hdr = FrameHeader { kind: Kind::Switch, meta: 0, tag: 0, len: 0 }.encode();
            let empty = SendBuf { ptr: std::ptr::NonNull::<u8>::dangling().as_ptr().cast_const(), len: 0 };
            let op = SendOp { lane: g.send_lane, hdr, buf: empty, _owned: None, off: 0, done: Completion::new() };
            g.sendq.push_back(op);
            g.send_lane = lane;
        }
        g.sendq.push_back(SendOp { lane, hdr, buf, _owned: None, off: 0, done: done.clone() });
        if idle {
            // Nothing queued ahead: write from this thread, no hand-off to the event loop.
            if let Err(e) = self.flush_or_explain(&mut g).and_then(|()| self.want_writable(&mut g)) {
                self.fail_locked(&mut g, e);
            }
        }
        if g.watch == Watch::Driven && !g.sendq.is_empty() {
            self.wake.signal(); // the driver must poll for writability too
        }
        Ok(())
    }

    unsafe fn post_recv(&self, tag: u64, meta: u32, buf: RecvBuf, done: &Arc<Completion>) -> Result<()> {
        let mut g = self.lock();
        if let Some(i) = g.early.iter().position(|m| m.tag == tag) {
            if done.try_claim() {
                if let Some(msg) = g.early.remove(i) {
                    self.deliver_early(&mut g, RecvOp { tag, meta, buf, done: done.clone() }, msg);
                }
                // Budget freed: a stalled header may fit now.
                self.unstall(&mut g);
            }
            return Ok(());
        }
        if let Some((family, want)) = sequenced(tag) {
            // An early message of the same family but another sequence: the ranks disagree.
            let other = g.early.iter().position(|m| sequenced(m.tag).is_some_and(|(f, s)| f == family && s != want));
            if let Some(i) = other {
                let got = sequenced(g.early[i].tag).map_or(0, |(_, s)| s);
                if !seq_after(got, want)
                    && let Some(m) = g.early.remove(i)
                {
                    g.early_bytes -= m.data.len(); // a finished collective's message: drop it
                }
                done.complete(Err(sequence_mismatch(self.peer, family, want, got)));
                return Ok(());
            }
        }
        if let Some(e) = Self::closed_error(&g) {
            return Err(e);
        }
        if !done.is_open() {
            return Ok(()); // claimed elsewhere meanwhile (receive from any)
        }
        g.posted.push_back(RecvOp { tag, meta, buf, done: done.clone() });
        self.unstall(&mut g);
        Ok(())
    }

    fn abort(&self, err: &Error, reason: &str) {
        let mut g = self.lock();
        if Self::closed_error(&g).is_some() {
            return;
        }
        // Best effort: queue the abort frame behind whatever is queued, write what the socket
        // takes now, then close. A peer that misses the frame sees the connection close.
        let mut text = reason.as_bytes().to_vec();
        text.truncate(MAX_ABORT as usize);
        let owned = text.into_boxed_slice();
        let buf = SendBuf { ptr: owned.as_ptr(), len: owned.len() };
        let hdr = FrameHeader { kind: Kind::Abort, meta: 0, tag: 0, len: owned.len() as u64 }.encode();
        let lane = g.send_lane;
        g.sendq.push_back(SendOp { lane, hdr, buf, _owned: Some(owned), off: 0, done: Completion::new() });
        let _ = self.flush(&mut g);
        self.fail_locked(&mut g, err.clone());
    }

    fn cancel(&self, done: &Arc<Completion>) {
        let mut g = self.lock();
        if let Some(i) = g.sendq.iter().position(|op| Arc::ptr_eq(&op.done, done)) {
            if g.sendq[i].off > 0 {
                let e = Error::Aborted {
                    detail: format!(
                        "a send to rank {} was cancelled after part of it was written; the connection cannot continue",
                        self.peer
                    ),
                };
                self.fail_locked(&mut g, e);
            } else {
                g.sendq.remove(i);
            }
        }
        g.posted.retain(|op| !Arc::ptr_eq(&op.done, done));
        if let Rx::Payload { op, filled } = &g.rx
            && Arc::ptr_eq(&op.done, done)
        {
            g.rx = Rx::Discard { remaining: (op.buf.len - filled) as u64 };
        }
    }
}

impl Drop for TcpPair {
    fn drop(&mut self) {
        let g = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        if g.hold_counted {
            self.parking.hold_ended();
        }
        if g.watch == Watch::Loop {
            for s in g.conn.socks() {
                let _ = self.registry.deregister(&mut s.stream);
            }
        }
    }
}

impl TcpPair {
    /// The tokens the pair's sockets are registered under (none once closed).
    pub(crate) fn tokens(&self) -> Vec<Token> {
        self.lock().conn.socks().into_iter().map(|s| s.token).collect()
    }
}
