//! One TCP pair: the two connections to one peer and the [`Pair`] contract over them.
//!
//! The pair's state sits behind one mutex, in four parts, each with its own file:
//! - the connections ([`Conn`], here): attaching lanes, failing, closing;
//! - the sending half ([`send::Sender`]): the queue of frames and its flush;
//! - the receiving half ([`recv::Reader`]): staging, read-ahead, holds, and the
//!   contract's matching ([`Matcher`], shared with every backend);
//! - who watches the sockets ([`watch::Watching`]): the event loop, a waiting thread
//!   that drives the pair itself, or nobody for a short while (parked).
//!
//! Whoever holds the lock may make progress: the device's event loop on readiness events, a
//! posting thread (a send that fits in the socket buffer is written by the caller itself, with
//! no hand-off to the loop), and a waiting thread that drives the pair (see
//! [`super::progress`]).

mod recv;
mod send;
mod watch;

pub(crate) use watch::Acquired;

use super::frame::FrameHeader;
use super::parking::Parking;
use crate::error::{Error, Result};
use crate::transport::matching::{Matcher, RecvOp};
use crate::transport::wake::EventFd;
use crate::transport::{ALL_GROUPS, AbortCause, Completion, Key, Pair, RecvTarget, SendBuf};
use crate::types::OpDesc;
use mio::Token;
use mio::net::TcpStream;
use recv::{Reader, Rx};
use send::Sender;
use smallvec::SmallVec;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use watch::{Watch, Watching};

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

/// How long a closing pair sleeps between looks at sockets that take no more ([`TcpPair::close`]).
const CLOSE_LOOK: Duration = Duration::from_millis(2);

/// A connected socket and its event-loop token.
struct Sock {
    stream: TcpStream,
    token: Token,
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

    /// The error the pair failed with, once closed.
    fn closed_error(&self) -> Option<Error> {
        match self {
            Conn::Closed(e) => Some(e.clone()),
            _ => None,
        }
    }
}

/// Everything behind the pair's lock.
struct Inner {
    conn: Conn,
    /// The event-loop tokens the pair's sockets were given, kept after they close: the device
    /// forgets them when the context goes.
    tokens: Vec<Token>,
    tx: Sender,
    rx: Reader,
    matcher: Matcher,
    watching: Watching,
}

impl Inner {
    /// The `poll(2)` events a thread waiting on the pair waits for, on each connection (indexed
    /// by lane): input only on the connection being read, and not while reading is stalled (a
    /// stalled header cannot be consumed: readiness would fire forever); room only on the
    /// connection the next frame goes on. None once the pair is not open.
    fn wanted_events(&self) -> [i16; 2] {
        let mut ev = [0, 0];
        if matches!(self.conn, Conn::Open(_)) {
            if !self.rx.is_stalled() {
                ev[self.rx.reading.index()] |= libc::POLLIN;
            }
            if let Some(lane) = self.tx.front_lane() {
                ev[lane.index()] |= libc::POLLOUT;
            }
        }
        ev
    }
}

/// The TCP pair.
pub(crate) struct TcpPair {
    me: usize,
    peer: usize,
    /// This side is the lower rank, which sends large frames on [`Lane::Bulk`].
    sends_bulk: bool,
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
    /// The pair of rank `me` with `peer`, holding at most `early_limit` bytes that arrive
    /// before their receive.
    pub(crate) fn new(
        me: usize,
        peer: usize,
        early_limit: usize,
        registry: Arc<mio::Registry>,
        parking: Arc<Parking>,
    ) -> io::Result<Arc<Self>> {
        Ok(Arc::new(TcpPair {
            me,
            peer,
            sends_bulk: me < peer,
            registry,
            parking,
            wake: EventFd::new()?,
            inner: Mutex::new(Inner {
                conn: Conn::Pending([None, None]),
                tokens: Vec::new(),
                tx: Sender::new(),
                rx: Reader::new(),
                matcher: Matcher::new(me, peer, early_limit),
                watching: Watching::new(),
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
        g.tokens.push(token);
        if let Conn::Pending([Some(_), Some(_)]) = &g.conn
            && let Conn::Pending([Some(main), Some(bulk)]) = std::mem::replace(&mut g.conn, Conn::Pending([None, None]))
        {
            g.conn = Conn::Open([main, bulk]);
            self.drive(&mut g);
            return Ok(true);
        }
        Ok(false)
    }

    /// The tokens the pair's sockets were registered under (also once they are closed).
    pub(crate) fn tokens(&self) -> Vec<Token> {
        self.lock().tokens.clone()
    }

    /// Flushes pending sends and reads what has arrived; fails the pair on error.
    fn drive(&self, g: &mut Inner) {
        let r = self.flush_or_explain(g).and_then(|()| self.read(g)).and_then(|()| self.want_writable(g));
        if let Err(e) = r {
            self.fail_locked(g, e);
        }
    }

    /// Writes what the sockets take of the send queue.
    fn flush(&self, g: &mut Inner) -> Step {
        let Inner { conn, tx, .. } = g;
        let Conn::Open(socks) = conn else { return Ok(()) };
        tx.flush(socks, self.peer).map_err(|e| self.io_error(e, "sending to"))
    }

    /// [`TcpPair::flush`], but a send that finds the peer gone reads first: a peer that gives
    /// up sends an abort frame naming the cause and then closes, and a send can meet the closed
    /// socket before that frame is read. The frame says more than the broken pipe (the rank
    /// that died first, not one that left after it).
    fn flush_or_explain(&self, g: &mut Inner) -> Step {
        match self.flush(g) {
            Err(e @ Error::PeerClosed { .. }) => match self.read(g) {
                // The peer's own EOF or reset says no more than the send did.
                Err(Error::PeerClosed { rank, .. }) if rank == self.peer => Err(e),
                Err(Error::Io { .. }) | Ok(()) => Err(e),
                Err(cause) => Err(cause),
            },
            r => r,
        }
    }

    /// Closes the connection quietly (the context is going away), gracefully: what is still
    /// queued is written first, until `deadline` (see below); then the sockets are shut down
    /// for writing only (the peer reads everything sent, then the end) and handed back, for
    /// the caller to [`linger`](super::super::device::linger) on before it closes them. A
    /// socket a waiting thread may still poll is closed at once instead.
    ///
    /// The queue holds, on a context that failed, the end of a frame begun (the peer reads
    /// the stream as frames) and behind it the abort frame with the failure's cause: dropped
    /// at the close, the peer would read a connection that ended mid-frame and blame this
    /// rank instead of the rank whose death caused it. Input is read meanwhile, so that a peer
    /// that writes to this rank while this rank writes to it does not stall both.
    pub(crate) fn close(&self, deadline: Instant) -> Vec<TcpStream> {
        let mut g = self.flush_until(self.lock(), deadline);
        self.end_locked(&mut g, Error::Aborted { rank: self.me, reason: "this rank closed the context".into() }, true)
    }

    /// Writes what is queued until it is all written, the connection fails or `deadline`
    /// passes, reading input meanwhile ([`close`](Self::close)); the lock is let go while the
    /// sockets take nothing.
    fn flush_until<'g>(&'g self, mut g: MutexGuard<'g, Inner>, deadline: Instant) -> MutexGuard<'g, Inner> {
        while matches!(g.conn, Conn::Open(_)) && !g.tx.is_empty() {
            if self.flush(&mut g).and_then(|()| self.read(&mut g)).is_err() || g.tx.is_empty() {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            // What a driver waits for (a readiness that nothing here consumes would end every
            // poll at once).
            let wanted = g.wanted_events();
            let Conn::Open(socks) = &g.conn else { break };
            let mut fds: SmallVec<[libc::pollfd; 2]> = socks
                .iter()
                .zip(wanted)
                .map(|(s, events)| libc::pollfd {
                    fd: if events == 0 { -1 } else { s.stream.as_raw_fd() },
                    events,
                    revents: 0,
                })
                .collect();
            drop(g);
            let _ = crate::transport::wake::poll_fds(&mut fds, left.min(CLOSE_LOOK));
            g = self.lock();
        }
        g
    }

    /// An error of the pair's socket: one that says the connection to the peer is lost (its
    /// end closed it, or the network or the peer's host stopped answering) is the peer's
    /// [`Error::PeerClosed`], naming it, so that callers can tell which peer is gone; others
    /// stay I/O errors.
    fn io_error(&self, e: io::Error, what: &str) -> Error {
        match e.kind() {
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::TimedOut
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::NetworkDown => {
                Error::PeerClosed { rank: self.peer, op: String::new(), detail: format!("{what} it: {e}") }
            }
            _ => Error::io(format!("{what} rank {}", self.peer), e),
        }
    }

    /// Fails the pair: closes its sockets and fails every pending operation with `err`.
    fn fail_locked(&self, g: &mut Inner, err: Error) {
        let _ = self.end_locked(g, err, false);
    }

    /// [`fail_locked`](Self::fail_locked); with `graceful`, the sockets no thread polls are
    /// shut down for writing only and returned instead of closed.
    fn end_locked(&self, g: &mut Inner, err: Error, graceful: bool) -> Vec<TcpStream> {
        let mut kept = Vec::new();
        if let Conn::Closed(_) = g.conn {
            return kept;
        }
        for Sock { mut stream, .. } in std::mem::replace(&mut g.conn, Conn::Closed(err.clone())).into_socks() {
            let how = match (graceful, g.watching.watch) {
                (true, Watch::Loop | Watch::Parked) => std::net::Shutdown::Write,
                _ => std::net::Shutdown::Both,
            };
            let _ = stream.shutdown(how);
            match g.watching.watch {
                Watch::Driven => {
                    // The driver may be polling this descriptor: keep it open until it stops.
                    g.watching.zombie.push(stream);
                    self.wake.signal();
                    continue;
                }
                Watch::Loop => {
                    let _ = self.registry.deregister(&mut stream);
                }
                Watch::Parked => {}
            }
            if graceful {
                kept.push(stream);
            }
        }
        tracing::debug!(peer = self.peer, error = %err, "pair failed");
        g.tx.fail_all(&err);
        g.matcher.close(&err);
        self.end_hold(g);
        match std::mem::replace(&mut g.rx.state, Rx::Header) {
            Rx::Payload(d) => d.done().complete(Err(err.clone())),
            Rx::Early(early) => g.matcher.early_dropped(early),
            _ => {}
        }
        g.rx.reset();
        kept
    }
}

impl Pair for TcpPair {
    fn peer(&self) -> usize {
        self.peer
    }

    unsafe fn post_send(&self, key: Key, desc: OpDesc, buf: SendBuf, done: &Arc<Completion>) -> Result<()> {
        // SAFETY: as this call's.
        unsafe { self.post_send_parts(key, desc, &[buf], done) }
    }

    fn gathers(&self) -> bool {
        true
    }

    unsafe fn post_send_parts(&self, key: Key, desc: OpDesc, parts: &[SendBuf], done: &Arc<Completion>) -> Result<()> {
        for p in parts {
            p.mem.require_host("tcp")?;
        }
        let len = parts.iter().map(|p| p.len).sum();
        let mut g = self.lock();
        if let Some(e) = g.conn.closed_error().or_else(|| g.matcher.refusal(key.group)) {
            return Err(e);
        }
        let hdr = FrameHeader::data(key, desc, len).encode();
        let idle = g.tx.is_empty();
        let lane = if self.sends_bulk && len >= BULK_MIN { Lane::Bulk } else { Lane::Main };
        g.tx.push(lane, key.group, hdr, parts.iter().copied().collect(), None, done.clone());
        if idle {
            // Nothing queued ahead: write from this thread, no hand-off to the event loop.
            if let Err(e) = self.flush_or_explain(&mut g).and_then(|()| self.want_writable(&mut g)) {
                self.fail_locked(&mut g, e);
            }
        }
        if g.watching.is_driven() && !g.tx.is_empty() {
            self.wake.signal(); // the driver must poll for writability too
        }
        Ok(())
    }

    unsafe fn post_recv(&self, key: Key, desc: OpDesc, target: RecvTarget, done: &Arc<Completion>) -> Result<()> {
        target.mem().require_host("tcp")?;
        let mut g = self.lock();
        g.matcher.post(RecvOp { key, desc, target, done: done.clone() })?;
        // A receive to take the stalled message, or early budget freed for it.
        self.unstall(&mut g);
        Ok(())
    }

    fn abort(&self, group: u64, local: &Error, cause: &AbortCause) {
        let mut g = self.lock();
        if g.conn.closed_error().is_some() {
            return;
        }
        // Best effort: queue the abort frame behind whatever is queued and write what the
        // socket takes now. A peer that misses a closing frame sees the connection close.
        queue_abort(&mut g, group, cause);
        if group == ALL_GROUPS {
            let _ = self.flush(&mut g);
            self.fail_locked(&mut g, local.clone());
        } else {
            g.tx.fail_group(group, local);
            g.matcher.abort_group(group, local);
            if let Err(e) = self.flush_or_explain(&mut g).and_then(|()| self.want_writable(&mut g)) {
                self.fail_locked(&mut g, e);
            }
            // The group's early messages freed budget: a stalled message may go on now. A
            // driver polls with what it knew before: it must look again (its waits may have
            // just failed, and it may have sends to flush).
            self.unstall(&mut g);
            if g.watching.is_driven() {
                self.wake.signal();
            }
        }
    }

    fn abort_closing(&self, local: &Error, cause: &AbortCause, deadline: Instant) {
        let mut g = self.lock();
        if g.conn.closed_error().is_some() {
            return;
        }
        // Behind what is queued (on a failed group: the end of a frame begun, then that
        // group's abort frame): written whole before the pair closes, so that the peer reads
        // the cause before the end, not a connection that ended mid-frame.
        queue_abort(&mut g, ALL_GROUPS, cause);
        let mut g = self.flush_until(g, deadline);
        // Closed as a context's close does (shut down for writing, then input drained until
        // the peer has it all, within the deadline): a socket closed with the peer's input
        // unread resets the connection, and the reset throws away what this side's kernel had
        // not sent yet, the cause last.
        let streams = self.end_locked(&mut g, local.clone(), true);
        drop(g);
        super::device::linger(streams, deadline.saturating_duration_since(Instant::now()));
    }

    fn cancel(&self, done: &Arc<Completion>) {
        let mut g = self.lock();
        g.tx.cancel(done);
        g.matcher.cancel(done);
        g.rx.cancel(done);
    }

    fn recycle(&self, buf: Vec<u8>) {
        self.lock().matcher.recycle(buf);
    }

    fn aborted(&self, group: u64) -> Option<Error> {
        self.lock().matcher.aborted(group)
    }
}

/// Queues the frame that aborts `group` ([`ALL_GROUPS`]: the pair) with `cause`, behind
/// whatever is queued, on the connection of the last frame queued (it owns its bytes).
fn queue_abort(g: &mut Inner, group: u64, cause: &AbortCause) {
    let owned = cause.encode().into_boxed_slice();
    let buf = SendBuf { ptr: owned.as_ptr(), len: owned.len(), mem: crate::transport::MemKind::Host };
    let hdr = FrameHeader::abort(group, owned.len()).encode();
    let lane = g.tx.lane();
    g.tx.push(lane, group, hdr, smallvec::smallvec![buf], Some(owned), Completion::new());
}

impl Drop for TcpPair {
    fn drop(&mut self) {
        let g = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        if g.watching.hold_counted {
            self.parking.hold_ended();
        }
        if g.watching.watch == Watch::Loop {
            for s in g.conn.socks() {
                let _ = self.registry.deregister(&mut s.stream);
            }
        }
    }
}
