//! One shared-memory pair: this rank's ring in the peer's segment (outbound) and the peer's ring
//! in this rank's segment (inbound), the two doorbells, and a Unix socket kept open as a
//! lifeline (its end closes when the peer dies) and for abort causes. What the records and
//! the lifeline's messages hold is in [`super::wire`].
//!
//! Progress is made by whoever holds the pair's lock: a posting thread writes what fits into the
//! ring at once, and a waiting thread ([`super::progress`]) writes the rest and reads what came.
//! Nothing runs in the background: a rank that never waits leaves its peers' messages in its
//! rings (and a sender whose message does not fit waits), as in MPI's shared-memory transports.

use super::ring::{Consumer, Producer, Published, Pushed, Record, RingMem};
use super::segment::{Segment, ShmRing};
use super::wire::{
    ACK, ACK_LEN, AbortMsg, Ack, CMA, CMA_REF, CmaRef, FRAG, FRAG_HEAD, Fixed, FragHead, HDR, MSG, MsgHeader, START,
    next_abort,
};
use crate::error::{Error, Result};
use crate::transport::handshake::codec::to_vec;
use crate::transport::matching::{Delivery, Dispatch, EarlyRx, Header, Matcher, RecvOp};
use crate::transport::wake::EventFd;
use crate::transport::{AbortCause, Completion, Done, Key, Pair, RecvTarget, SendBuf};
use crate::types::OpDesc;
use std::collections::VecDeque;
use std::io::{IoSliceMut, Read, Write};
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
    buf: SendBuf,
    done: Arc<Completion>,
    /// Fragments: payload bytes written so far (`None`: the START record not yet).
    sent: Option<usize>,
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

    /// Whether the pair has failed or closed (its lifeline then has nothing more to say).
    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed.is_some()
    }

    /// The peer's segment.
    pub(crate) fn theirs(&self) -> Arc<Segment> {
        self._segments[1].clone()
    }

    /// Why the pair failed, once it has.
    pub(crate) fn failure(&self) -> Option<Error> {
        self.lock().closed.clone()
    }

    /// Rings the peer's doorbell.
    pub(crate) fn wake_peer(&self) {
        self.peer_bell.signal();
    }

    /// Awake after a sleep.
    pub(crate) fn woke(&self) {
        self.lock().rx.woke();
    }

    /// Reads what the lifeline has: abort causes, or the end of the peer.
    pub(crate) fn check_lifeline(&self) {
        let mut g = self.lock();
        if g.closed.is_some() {
            return;
        }
        let mut buf = [0u8; 4096];
        // What ended the lifeline, if it ended: acted on after the messages before it.
        let mut ended = None;
        loop {
            match (&self.lifeline).read(&mut buf) {
                Ok(0) => {
                    ended = Some("it exited or closed its context".to_string());
                    break;
                }
                Ok(n) => g.lifeline_buf.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    ended = Some(format!("its lifeline failed: {e}"));
                    break;
                }
            }
        }
        loop {
            let (AbortMsg { group, cause }, used) = match next_abort(&g.lifeline_buf) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(why) => return self.fail(&mut g, self.protocol(format!("an abort message: {why}"))),
            };
            g.lifeline_buf.drain(..used);
            let err = match AbortCause::decode(&cause) {
                Ok(c) => c.into_error(),
                Err(detail) => Error::Protocol { peer: Some(self.peer), detail },
            };
            if group == 0 {
                return self.fail(&mut g, err);
            }
            Self::fail_group(&mut g, group, &err);
        }
        if let Some(detail) = ended {
            // What the peer wrote before it went is still for this rank (contract rule 6).
            let _ = self.read(&mut g);
            self.fail(&mut g, Error::PeerClosed { rank: self.peer, op: String::new(), detail });
        }
    }

    /// Closes the pair quietly (the context is going away): the peer sees its lifeline end.
    pub(crate) fn close(&self) {
        let mut g = self.lock();
        self.fail(&mut g, Error::Aborted { rank: self.me, reason: "this rank closed the context".into() });
    }

    /// Fails everything pending with `err`; the pair is done.
    fn fail(&self, g: &mut Inner, err: Error) {
        if g.closed.is_some() {
            return;
        }
        tracing::debug!(peer = self.peer, error = %err, "shared-memory pair failed");
        g.closed = Some(err.clone());
        if !g.unacked.is_empty() {
            // The peer may still read these sends' buffers, which go back to their owners now:
            // tell it not to trust what it reads (as a cancel does).
            g.outbound.broken().store(1, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        for o in g.sendq.drain(..) {
            o.done.complete(Err(err.clone()));
        }
        for (_, done, _) in g.unacked.drain(..) {
            done.complete(Err(err.clone()));
        }
        g.matcher.close(&err);
        match std::mem::replace(&mut g.rx_state, Rx::Idle) {
            Rx::Payload(d) => d.done().complete(Err(err)),
            Rx::Early(e) => g.matcher.early_dropped(e),
            _ => {}
        }
        let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
    }

    /// Fails the operations of `group` that have not started.
    fn fail_group(g: &mut Inner, group: u64, err: &Error) {
        g.sendq.retain(|o| {
            let drop = o.key.group == group && o.sent.is_none();
            if drop {
                o.done.complete(Err(err.clone()));
            }
            !drop
        });
        g.matcher.abort_group(group, err);
    }

    /// Writes the send queue into the ring, as far as it fits.
    fn flush(&self, g: &mut Inner) -> Result<()> {
        while let Some(seq) = g.acks.front().copied() {
            match g.tx.push(ACK, &[&Ack { seq }.to_bytes()]) {
                Pushed::Full => return Ok(()),
                pushed => {
                    g.wake_peer |= pushed == Pushed::Wake;
                    g.acks.pop_front();
                }
            }
        }
        while let Some(o) = g.sendq.front_mut() {
            let len = o.buf.len;
            let hdr = MsgHeader(Header { key: o.key, desc: o.desc, len: len as u64 }).to_bytes();
            // SAFETY: the poster lent the buffer until the send completes (Pair::post_send).
            let payload = unsafe { std::slice::from_raw_parts(o.buf.ptr, len) };
            if len <= INLINE_MAX {
                match g.tx.push(MSG, &[&hdr, payload]) {
                    Pushed::Full => return Ok(()),
                    pushed => g.wake_peer |= pushed == Pushed::Wake,
                }
                if let Some(o) = g.sendq.pop_front() {
                    o.done.complete(Ok(Done { peer: self.peer, len }));
                }
            } else if self.peer_reads_mine {
                let seq = g.next_seq;
                let cma = CmaRef { addr: o.buf.ptr as u64, seq }.to_bytes();
                match g.tx.push(CMA, &[&hdr, &cma]) {
                    Pushed::Full => return Ok(()),
                    pushed => g.wake_peer |= pushed == Pushed::Wake,
                }
                g.next_seq += 1;
                if let Some(o) = g.sendq.pop_front() {
                    g.unacked.push_back((seq, o.done, len));
                }
            } else {
                let frag_max = FRAG_MAX.min(g.tx.max_body() - FRAG_HEAD);
                if o.sent.is_none() {
                    match g.tx.push(START, &[&hdr]) {
                        Pushed::Full => return Ok(()),
                        pushed => g.wake_peer |= pushed == Pushed::Wake,
                    }
                    o.sent = Some(0);
                }
                while let Some(sent) = o.sent.filter(|&s| s < len) {
                    let n = frag_max.min(len - sent);
                    let head = FragHead { len: n as u32 }.to_bytes();
                    match g.tx.push(FRAG, &[&head, &payload[sent..sent + n]]) {
                        Pushed::Full => return Ok(()),
                        pushed => g.wake_peer |= pushed == Pushed::Wake,
                    }
                    o.sent = Some(sent + n);
                }
                if let Some(o) = g.sendq.pop_front() {
                    o.done.complete(Ok(Done { peer: self.peer, len }));
                }
            }
        }
        Ok(())
    }

    /// Reads the records that came in, as far as the matching lets.
    fn read(&self, g: &mut Inner) -> Result<()> {
        g.blocked = false;
        while let Some(r) = g.rx.peek() {
            match r.kind {
                ACK => {
                    let Ack { seq } = self.decode::<ACK_LEN, Ack>(&g.rx, r, 0)?;
                    g.rx.consume(r);
                    match g.unacked.iter().position(|(s, _, _)| *s == seq) {
                        Some(i) => {
                            if let Some((_, done, len)) = g.unacked.remove(i) {
                                done.complete(Ok(Done { peer: self.peer, len }));
                            }
                        }
                        None => return Err(self.protocol(format!("an answer for message {seq}, never sent"))),
                    }
                }
                FRAG => {
                    let n = self.decode::<FRAG_HEAD, FragHead>(&g.rx, r, 0)?.len as usize;
                    if n + FRAG_HEAD > r.room {
                        return Err(self.protocol(format!("a fragment of {n} bytes in a record of {}", r.room)));
                    }
                    let src = g.inbound.data_at(r.off + FRAG_HEAD, n);
                    // SAFETY: a published record of the ring, ours until consumed.
                    let bytes = unsafe { std::slice::from_raw_parts(src, n) };
                    let done = match &mut g.rx_state {
                        Rx::Payload(d) => {
                            let n = n.min(d.remaining());
                            d.dst()[..n].copy_from_slice(&bytes[..n]);
                            d.advance(n);
                            d.is_full()
                        }
                        Rx::Early(e) => {
                            e.extend(bytes);
                            e.remaining() == 0
                        }
                        Rx::Discard { remaining } => {
                            *remaining = remaining.saturating_sub(n);
                            *remaining == 0
                        }
                        Rx::Idle => return Err(self.protocol("a fragment outside a message".into())),
                    };
                    g.rx.consume(r);
                    if done {
                        self.finish_fragments(g);
                    }
                }
                MSG | START | CMA => {
                    if !matches!(g.rx_state, Rx::Idle) {
                        return Err(self.protocol("a new message inside a fragmented one".into()));
                    }
                    let MsgHeader(h) = self.decode::<HDR, MsgHeader>(&g.rx, r, 0)?;
                    let len = usize::try_from(h.len).unwrap_or(usize::MAX);
                    if r.kind == MSG && len > r.room - HDR {
                        return Err(self.protocol(format!("a message of {len} bytes in a record of {}", r.room)));
                    }
                    if r.kind == CMA && self.keep_holding(g, len) {
                        g.blocked = true;
                        break;
                    }
                    g.held_since = None;
                    match g.matcher.incoming(h) {
                        Dispatch::Stall => {
                            g.blocked = true;
                            break;
                        }
                        Dispatch::Deliver(mut d) => match r.kind {
                            MSG => {
                                // SAFETY: a published record of the ring, ours until consumed.
                                let src =
                                    unsafe { std::slice::from_raw_parts(g.inbound.data_at(r.off + HDR, len), len) };
                                d.dst().copy_from_slice(src);
                                d.advance(len);
                                g.rx.consume(r);
                                d.finish(self.peer);
                            }
                            CMA => {
                                let CmaRef { addr, seq } = self.decode::<CMA_REF, CmaRef>(&g.rx, r, HDR)?;
                                g.rx.consume(r);
                                if let Err(e) = self.cma_read(g, d.dst(), addr) {
                                    // The receive has left the matching: fail it here.
                                    d.done().complete(Err(e.clone()));
                                    return Err(e);
                                }
                                d.advance(len);
                                g.acks.push_back(seq);
                                d.finish(self.peer);
                            }
                            _ => {
                                g.rx.consume(r);
                                if d.is_full() {
                                    d.finish(self.peer);
                                } else {
                                    g.rx_state = Rx::Payload(d);
                                }
                            }
                        },
                        Dispatch::Early(mut e) => match r.kind {
                            MSG => {
                                // SAFETY: as above.
                                let src =
                                    unsafe { std::slice::from_raw_parts(g.inbound.data_at(r.off + HDR, len), len) };
                                e.extend(src);
                                g.rx.consume(r);
                                g.matcher.early_arrived(e);
                            }
                            CMA => {
                                let CmaRef { addr, seq } = self.decode::<CMA_REF, CmaRef>(&g.rx, r, HDR)?;
                                g.rx.consume(r);
                                let mut res = Ok(());
                                e.fill(len, |dst| {
                                    res = self.cma_read(g, dst, addr);
                                    Ok::<(), ()>(())
                                })
                                .ok();
                                if let Err(err) = res {
                                    // Its early budget goes back.
                                    g.matcher.early_dropped(e);
                                    return Err(err);
                                }
                                g.acks.push_back(seq);
                                g.matcher.early_arrived(e);
                            }
                            _ => {
                                g.rx.consume(r);
                                if e.remaining() == 0 {
                                    g.matcher.early_arrived(e);
                                } else {
                                    g.rx_state = Rx::Early(e);
                                }
                            }
                        },
                        Dispatch::Discard => {
                            if r.kind == CMA {
                                g.acks.push_back(self.decode::<CMA_REF, CmaRef>(&g.rx, r, HDR)?.seq);
                            } else if r.kind == START && len > 0 {
                                g.rx_state = Rx::Discard { remaining: len };
                            }
                            g.rx.consume(r);
                        }
                    }
                }
                k => return Err(self.protocol(format!("a record of unknown kind {k}"))),
            }
        }
        if g.rx.publish() == Published::WakeProducer {
            g.wake_peer = true;
        }
        Ok(())
    }

    /// A fragmented message is complete.
    fn finish_fragments(&self, g: &mut Inner) {
        match std::mem::replace(&mut g.rx_state, Rx::Idle) {
            Rx::Payload(d) => d.finish(self.peer),
            Rx::Early(e) => g.matcher.early_arrived(e),
            _ => {}
        }
    }

    /// Whether a large CMA message stays in the ring for now (see [`HOLD_MIN`]).
    fn keep_holding(&self, g: &mut Inner, len: usize) -> bool {
        if len < HOLD_MIN || g.matcher.has_posted() {
            return false;
        }
        let now = Instant::now();
        *g.held_since.get_or_insert(now) + HOLD > now
    }

    /// When a held message must be looked at again.
    pub(crate) fn hold_ends(&self) -> Option<Instant> {
        self.lock().held_since.map(|t| t + HOLD)
    }

    /// The value of `N` bytes at `at` of record `r`'s body; a protocol error where the record
    /// has no room for it or it does not decode.
    fn decode<const N: usize, T: Fixed<N>>(&self, rx: &Consumer<ShmRing>, r: Record, at: usize) -> Result<T> {
        if at + N > r.room {
            return Err(self.protocol(format!("a record of kind {} with {} bytes of room", r.kind, r.room)));
        }
        let mut b = [0u8; N];
        rx.mem().read(r.off + at, &mut b);
        T::from_bytes(&b).map_err(|why| self.protocol(format!("a record of kind {}: {why}", r.kind)))
    }

    /// Copies `dst.len()` bytes from the peer's memory at `addr`, then makes sure the peer had
    /// not broken its side meanwhile (a send it cancelled while it was being read).
    fn cma_read(&self, g: &Inner, dst: &mut [u8], addr: u64) -> Result<()> {
        let mut done = 0;
        while done < dst.len() {
            let remote = [nix::sys::uio::RemoteIoVec { base: addr as usize + done, len: dst.len() - done }];
            match nix::sys::uio::process_vm_readv(
                nix::unistd::Pid::from_raw(self.peer_pid),
                &mut [IoSliceMut::new(&mut dst[done..])],
                &remote,
            ) {
                Ok(0) => return Err(self.protocol("its memory could not be read".into())),
                Ok(n) => done += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(nix::errno::Errno::ESRCH) => {
                    return Err(Error::PeerClosed {
                        rank: self.peer,
                        op: String::new(),
                        detail: "its process is gone".into(),
                    });
                }
                Err(e) => {
                    return Err(Error::io(
                        format!("reading a message of rank {} from its memory", self.peer),
                        e.into(),
                    ));
                }
            }
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        if g.inbound.broken().load(Ordering::SeqCst) != 0 {
            return Err(self.protocol("it cancelled a send while this rank read it".into()));
        }
        Ok(())
    }

    fn protocol(&self, detail: String) -> Error {
        Error::Protocol { peer: Some(self.peer), detail }
    }

    /// Sends an abort message for `group` over the lifeline (best effort).
    fn send_abort(&self, group: u64, cause: &AbortCause) {
        let m = to_vec(&AbortMsg { group, cause: cause.encode() });
        // Small and rare: the socket buffer takes it, or the peer is gone. A lifeline that
        // cannot take a whole message within a moment is shut: a truncated message would
        // garble every later one, an ended lifeline only tells the peer this rank is gone.
        let mut sent = 0;
        let until = Instant::now() + Duration::from_millis(100);
        while sent < m.len() {
            match (&self.lifeline).write(&m[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < until => {
                    let mut fds = [libc::pollfd { fd: self.lifeline_fd(), events: libc::POLLOUT, revents: 0 }];
                    let _ = crate::transport::wake::poll_fds(&mut fds, Duration::from_millis(10));
                }
                Err(_) => {
                    let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
        }
    }
}

impl Pair for ShmPair {
    fn peer(&self) -> usize {
        self.peer
    }

    unsafe fn post_send(&self, key: Key, desc: OpDesc, buf: SendBuf, done: &Arc<Completion>) -> Result<()> {
        buf.mem.require_host("shared-memory")?;
        let mut g = self.lock();
        if let Some(e) = g.closed.clone().or_else(|| g.matcher.refusal(key.group)) {
            return Err(e);
        }
        g.sendq.push_back(Out { key, desc, buf, done: done.clone(), sent: None });
        if g.sendq.len() == 1
            && let Err(e) = self.flush(&mut g)
        {
            self.fail(&mut g, e);
        }
        self.ring_peer(&mut g);
        Ok(())
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
        if group == 0 {
            self.fail(&mut g, local.clone());
        } else {
            Self::fail_group(&mut g, group, local);
        }
    }

    fn cancel(&self, done: &Arc<Completion>) {
        let mut g = self.lock();
        if let Some(i) = g.sendq.iter().position(|o| Arc::ptr_eq(&o.done, done)) {
            if g.sendq[i].sent.is_some() {
                let e =
                    self.protocol(format!("a send to rank {} was cancelled after part of it was written", self.peer));
                self.fail(&mut g, e);
            } else {
                g.sendq.remove(i);
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
