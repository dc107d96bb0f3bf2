//! One shared-memory pair: this rank's ring in the peer's segment (outbound) and the peer's ring
//! in this rank's segment (inbound), the two doorbells, and a Unix socket kept open as a
//! lifeline (its end closes when the peer dies) and for abort causes. What the records and
//! the lifeline's messages hold is in [`super::wire`].
//!
//! Progress is made by whoever holds the pair's lock: a posting thread writes what fits into the
//! ring at once, and a waiting thread ([`super::progress`]) writes the rest and reads what came.
//! Nothing runs in the background: a rank that never waits leaves its peers' messages in its
//! rings (and a sender whose message does not fit waits), as in MPI's shared-memory transports.
//!
//! This file holds the pair's state, posting and cancelling; the sending side is in [`send`],
//! the receiving side in [`receive`], failing and the lifeline in [`lifeline`].

mod lifeline;
mod receive;
mod send;

use super::ring::{Consumer, Producer};
use super::segment::{Segment, ShmRing};
use crate::error::{Error, Result};
use crate::transport::matching::{Delivery, EarlyRx, Matcher, RecvOp};
use crate::transport::wake::EventFd;
use crate::transport::{ALL_GROUPS, AbortCause, Completion, Key, Pair, RecvTarget, SendBuf};
use crate::types::OpDesc;
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Messages up to this many bytes travel inside the ring (two copies: in and out); larger ones
/// go through the ring in fragments, or, with single copy on and the kernel allowing it, are
/// read by the receiver straight from the sender's memory (one copy).
pub(crate) const INLINE_MAX: usize = 16 << 10;
/// Payload of one fragment record.
const FRAG_MAX: usize = 128 << 10;
/// A CMA message at least this large that arrives while no receive at all is posted on the pair
/// is held (left in the ring) for up to [`HOLD`], so that the receive posted meanwhile takes it
/// with one copy instead of two (as the TCP pair does).
const HOLD_MIN: usize = 64 << 10;
const HOLD: Duration = Duration::from_millis(2);

/// A send not yet (wholly) in the ring.
struct Out {
    key: Key,
    desc: OpDesc,
    /// The message: these buffers one after the other (most sends have one).
    parts: SmallVec<[SendBuf; 1]>,
    /// Their total length.
    len: usize,
    done: Arc<Completion>,
    /// Fragments: payload bytes written so far (`None`: the START record not yet).
    sent: Option<usize>,
    /// Payload bytes before what `parts` holds (written before a cancel copied the rest).
    base: usize,
    /// Memory `parts` points into once a cancel copied the rest of the message.
    _owned: Option<Box<[u8]>>,
}

impl Out {
    /// Copies the payload from `sent` on, to be written from the copy: the poster's buffers
    /// are no longer read. Returns the poster's completion (the message now has one nobody
    /// waits for).
    fn detach(&mut self, sent: usize) -> Arc<Completion> {
        // SAFETY: the buffers are still lent (the send is queued, its completion open).
        let rest = unsafe { crate::transport::copy_span(&self.parts, sent - self.base, self.len - sent) };
        self.parts = smallvec::smallvec![SendBuf::from_slice(&rest)];
        self._owned = Some(rest);
        self.base = sent;
        std::mem::replace(&mut self.done, Completion::new())
    }
}

/// Where the FRAG records coming in go.
enum Rx {
    /// No fragmented message in progress.
    Idle,
    Payload(Delivery),
    Early(EarlyRx),
    Discard {
        remaining: usize,
    },
}

struct Inner {
    tx: Producer<ShmRing>,
    rx: Consumer<ShmRing>,
    /// The ring this rank writes into (its `broken` word is this rank's to set).
    outbound: ShmRing,
    /// The ring this rank reads (its `broken` word is the peer's).
    inbound: ShmRing,
    sendq: VecDeque<Out>,
    /// ACKs that found the ring full.
    acks: VecDeque<u64>,
    /// CMA sends the peer has not read yet: sequence, completion, length.
    unacked: VecDeque<(u64, Arc<Completion>, usize)>,
    next_seq: u64,
    rx_state: Rx,
    matcher: Matcher,
    closed: Option<Error>,
    /// Since when a large CMA message is held (see [`HOLD_MIN`]).
    held_since: Option<Instant>,
    /// Bytes of the lifeline read so far (abort messages).
    lifeline_buf: Vec<u8>,
    /// The peer's doorbell should be rung when the lock is let go.
    wake_peer: bool,
    /// The record at the ring's head waits for something on this side (a receive to be
    /// posted, early budget to free, a hold to end): new records cannot be read past it.
    blocked: bool,
}

/// What a new pair needs.
pub(crate) struct PairParts {
    pub(crate) me: usize,
    pub(crate) peer: usize,
    pub(crate) early_budget: usize,
    /// This rank's segment (the inbound ring) and the peer's (the outbound ring).
    pub(crate) mine: Arc<Segment>,
    pub(crate) theirs: Arc<Segment>,
    pub(crate) peer_bell: EventFd,
    pub(crate) lifeline: UnixStream,
    pub(crate) peer_pid: i32,
    /// Whether the peer reads this rank's large messages from its memory.
    pub(crate) peer_reads_mine: bool,
}

/// The shared-memory pair.
pub(crate) struct ShmPair {
    me: usize,
    peer: usize,
    peer_pid: i32,
    peer_reads_mine: bool,
    peer_bell: EventFd,
    lifeline: UnixStream,
    inner: Mutex<Inner>,
    /// Keep the mappings alive as long as the pair.
    _segments: [Arc<Segment>; 2],
}

impl ShmPair {
    pub(crate) fn new(p: PairParts) -> std::io::Result<Arc<Self>> {
        p.lifeline.set_nonblocking(true)?;
        let outbound = p.theirs.ring(p.me);
        let inbound = p.mine.ring(p.peer);
        Ok(Arc::new(ShmPair {
            me: p.me,
            peer: p.peer,
            peer_pid: p.peer_pid,
            peer_reads_mine: p.peer_reads_mine,
            peer_bell: p.peer_bell,
            lifeline: p.lifeline,
            inner: Mutex::new(Inner {
                tx: Producer::new(outbound.clone()),
                rx: Consumer::new(inbound.clone()),
                outbound,
                inbound,
                sendq: VecDeque::new(),
                acks: VecDeque::new(),
                unacked: VecDeque::new(),
                next_seq: 0,
                rx_state: Rx::Idle,
                matcher: Matcher::new(p.me, p.peer, p.early_budget),
                closed: None,
                held_since: None,
                lifeline_buf: Vec::new(),
                wake_peer: false,
                blocked: false,
            }),
            _segments: [p.mine, p.theirs],
        }))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        crate::sync::lock(&self.inner)
    }

    /// The lifeline's descriptor, for a waiter's `poll`.
    pub(crate) fn lifeline_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.lifeline.as_raw_fd()
    }

    /// Writes what fits of the send queue and reads what came in.
    pub(crate) fn drive(&self) {
        let mut g = self.lock();
        self.drive_locked(&mut g);
        self.ring_peer(&mut g);
    }

    fn drive_locked(&self, g: &mut Inner) {
        if g.closed.is_some() {
            return;
        }
        if let Err(e) = self.flush(g).and_then(|()| self.read(g)).and_then(|()| self.flush(g)) {
            self.fail(g, e);
        }
    }

    /// Rings the peer's doorbell if an action asked for it.
    fn ring_peer(&self, g: &mut Inner) {
        if std::mem::take(&mut g.wake_peer) {
            self.peer_bell.signal();
        }
    }

    /// About to sleep until something arrives: false when there is work to do now. A closed
    /// pair has none, and neither has one whose head record waits for this side (what unblocks
    /// it, a receive posted or early budget freed, drives the pair itself; a hold ends at
    /// [`hold_ends`](Self::hold_ends), which bounds the sleep).
    pub(crate) fn prepare_sleep(&self) -> bool {
        let mut g = self.lock();
        if g.closed.is_some() || g.blocked {
            return true;
        }
        if g.rx.peek().is_some() {
            return false;
        }
        g.rx.prepare_sleep()
    }

    /// While a message is halfway through the ring, in either direction (fragments of an
    /// incoming one are still to come, or an outgoing one waits for ring space to go on), where
    /// the rings stand: a value that changes as the message moves.
    pub(crate) fn mid_message(&self) -> Option<u64> {
        let g = self.lock();
        let mid = g.closed.is_none()
            && (!matches!(g.rx_state, Rx::Idle) || g.sendq.front().is_some_and(|o| o.sent.is_some()));
        mid.then(|| g.rx.read().wrapping_add(g.tx.written()))
    }

    /// Whether the pair has failed or closed (its lifeline then has nothing more to say).
    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed.is_some()
    }

    /// The peer's segment.
    pub(crate) fn theirs(&self) -> Arc<Segment> {
        self._segments[1].clone()
    }

    /// The peer's process id.
    pub(crate) fn peer_pid(&self) -> i32 {
        self.peer_pid
    }

    /// Why the pair can no longer serve the same-host area, once it cannot: it failed, or the
    /// mesh's own group (the only one the area serves) was aborted on it.
    pub(crate) fn failure(&self) -> Option<Error> {
        let g = self.lock();
        g.closed.clone().or_else(|| g.matcher.refusal(0))
    }

    /// Rings the peer's doorbell.
    pub(crate) fn wake_peer(&self) {
        self.peer_bell.signal();
    }

    /// Awake after a sleep.
    pub(crate) fn woke(&self) {
        self.lock().rx.woke();
    }

    /// Queues the send of one message made of `parts` and writes what fits.
    ///
    /// # Safety
    /// As for [`Pair::post_send`], for every part.
    unsafe fn queue_send(
        &self,
        key: Key,
        desc: OpDesc,
        parts: SmallVec<[SendBuf; 1]>,
        done: &Arc<Completion>,
    ) -> Result<()> {
        for p in &parts {
            p.mem.require_host("shared-memory")?;
        }
        let len = parts.iter().map(|p| p.len).sum();
        let mut g = self.lock();
        if let Some(e) = g.closed.clone().or_else(|| g.matcher.refusal(key.group)) {
            return Err(e);
        }
        g.sendq.push_back(Out { key, desc, parts, len, done: done.clone(), sent: None, base: 0, _owned: None });
        if g.sendq.len() == 1
            && let Err(e) = self.flush(&mut g)
        {
            self.fail(&mut g, e);
        }
        self.ring_peer(&mut g);
        Ok(())
    }

    pub(super) fn protocol(&self, detail: String) -> Error {
        Error::Protocol { peer: Some(self.peer), detail }
    }
}

impl Pair for ShmPair {
    fn peer(&self) -> usize {
        self.peer
    }

    unsafe fn post_send(&self, key: Key, desc: OpDesc, buf: SendBuf, done: &Arc<Completion>) -> Result<()> {
        // SAFETY: as this call's.
        unsafe { self.queue_send(key, desc, smallvec::smallvec![buf], done) }
    }

    fn gathers(&self) -> bool {
        true
    }

    fn sinks(&self) -> bool {
        true
    }

    fn hold_until_posted(&self, key: Key) {
        self.lock().matcher.hold(key);
    }

    unsafe fn post_send_parts(&self, key: Key, desc: OpDesc, parts: &[SendBuf], done: &Arc<Completion>) -> Result<()> {
        // SAFETY: as this call's.
        unsafe { self.queue_send(key, desc, parts.iter().copied().collect(), done) }
    }

    unsafe fn post_recv(&self, key: Key, desc: OpDesc, target: RecvTarget, done: &Arc<Completion>) -> Result<()> {
        target.mem().require_host("shared-memory")?;
        let mut g = self.lock();
        g.matcher.post(RecvOp { key, desc, target, done: done.clone() })?;
        // The message may be waiting in the ring already.
        self.drive_locked(&mut g);
        self.ring_peer(&mut g);
        Ok(())
    }

    fn abort(&self, group: u64, local: &Error, cause: &AbortCause) {
        let mut g = self.lock();
        if g.closed.is_some() {
            return;
        }
        self.send_abort(group, cause);
        if group == ALL_GROUPS {
            self.fail(&mut g, local.clone());
        } else {
            Self::fail_group(&mut g, group, local);
        }
    }

    fn recycle(&self, buf: Vec<u8>) {
        self.lock().matcher.recycle(buf);
    }

    fn aborted(&self, group: u64) -> Option<Error> {
        self.lock().matcher.aborted(group)
    }

    fn cancel(&self, done: &Arc<Completion>) {
        let mut g = self.lock();
        if let Some(i) = g.sendq.iter().position(|o| Arc::ptr_eq(&o.done, done)) {
            match g.sendq[i].sent {
                None => drop(g.sendq.remove(i)),
                // Part of it is in the ring: the peer reads it as one message, so the rest goes
                // out from a copy and the caller's buffers are free (the pair goes on).
                Some(sent) => drop(g.sendq[i].detach(sent)),
            }
        }
        if g.unacked.iter().any(|(_, d, _)| Arc::ptr_eq(d, done)) {
            // The peer may be copying it out of this rank's memory right now: tell it not to
            // trust what it reads, then give the buffer back. The pair cannot go on.
            g.outbound.broken().store(1, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            let e = self.protocol(format!("a send to rank {} was cancelled while it could read it", self.peer));
            self.fail(&mut g, e);
        }
        g.matcher.cancel(done);
        if let Rx::Payload(d) = &g.rx_state
            && Arc::ptr_eq(d.done(), done)
        {
            g.rx_state = Rx::Discard { remaining: d.remaining() };
        }
        if g.closed.is_none() {
            self.drive_locked(&mut g);
        }
        self.ring_peer(&mut g);
    }
}

impl Drop for ShmPair {
    fn drop(&mut self) {
        let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
    }
}
