//! The TCP device: one listening socket and one mio event-loop thread that drives every pair of
//! every context made on it, and the accepting side of the handshake (the one handshake of
//! [`crate::transport::handshake`], driven here without blocking). (The connecting side and
//! the mesh a context forms are in [`super::mesh`].)

use super::pair::{Lane, TcpPair};
use super::parking::Parking;
use crate::error::{Error, Result};
use crate::sync::{lock, wait_timeout};
use crate::transport::handshake::messages::{Hello, MAX_MESSAGE};
use crate::transport::handshake::{BackendKind, Event, Handshake, Local};
use crate::transport::{CLOSE_FLUSH, ContextId, Pair, random16};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Registry, Token, Waker};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const FIRST_CONN: usize = 2;

/// `SO_SNDBUF` of connections between ranks on one host unless [`TcpOptions::send_buffer`]
/// says otherwise (the kernel doubles it: 1 MiB of socket memory). With the kernel's
/// autotuning the send buffer grows to megabytes, and a sender copies that far ahead of a
/// receiver that is not running; capped, the two take turns in smaller steps.
///
/// perf, system wide, over the same 33 iterations of a 4-rank 64 MiB allgather: 17.3k
/// samples against 24.2k with autotuning; `_raw_spin_unlock_irqrestore` and
/// `handle_softirqs` (the loopback's packet processing) 0.5k against 3.4k; the kernel's
/// copies in and out 9.0k against 10.5k.
///
/// `ferrogloo-bench` on the 2-core machine, median p50 of three alternating runs, against
/// autotuning: 4 ranks 16 MiB allreduce 21.9 vs 35.9 ms, 64 MiB 83 vs 146 ms, 16 MiB
/// allgather 10.9 vs 16.9 ms; 2 ranks 16 MiB allreduce 5.0 vs 8.8 ms; 4 KiB to 1 MiB within
/// the noise. 1 MiB (2 MiB of socket memory) lost most of the gain; 128 and 256 KiB were as
/// good. Connections to other hosts keep autotuning, which a long or fast path needs to fill
/// its bandwidth-delay product (not measured here). The kernel caps the size at
/// `net.core.wmem_max` (208 KiB on a stock kernel: still in the range measured as good).
const SAME_HOST_SEND_BUFFER: usize = 512 << 10;

/// Sets a connected socket's options: no Nagle delay, and the buffer sizes of `opts` (with
/// [`SAME_HOST_SEND_BUFFER`] for a same-host connection when `opts` leaves the send buffer
/// to the default).
pub(super) fn configure(s: &socket2::SockRef<'_>, opts: &TcpOptions) -> io::Result<()> {
    s.set_tcp_nodelay(true)?;
    match opts.send_buffer {
        Some(n) => s.set_send_buffer_size(n)?,
        None if same_host(s)? => s.set_send_buffer_size(SAME_HOST_SEND_BUFFER)?,
        None => {}
    }
    if let Some(n) = opts.recv_buffer {
        s.set_recv_buffer_size(n)?;
    }
    Ok(())
}

/// Whether the connection's two ends have the same address (loopback, or both on this
/// host's address): a socket tuning only (the path is the host's own); which ranks share a
/// host is decided by the host identity in the store entries, never by addresses.
fn same_host(s: &socket2::SockRef<'_>) -> io::Result<bool> {
    let ip = |a: socket2::SockAddr| a.as_socket().map(|a| a.ip());
    Ok(ip(s.local_addr()?) == ip(s.peer_addr()?))
}

/// Tunables of a TCP device (set through [`TcpAttr`](crate::device::TcpAttr)).
#[derive(Debug, Clone)]
pub(crate) struct TcpOptions {
    pub(crate) send_buffer: Option<usize>,
    pub(crate) recv_buffer: Option<usize>,
    pub(crate) early_budget: usize,
    pub(crate) handshake_timeout: Duration,
    pub(crate) max_pending: usize,
}

/// One context's entry in the device: where accepted connections go.
pub(crate) struct Route {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) secret: Option<Vec<u8>>,
    /// Indexed by peer rank; `None` at our own rank.
    pub(crate) pairs: Vec<Option<Arc<TcpPair>>>,
    attached: Mutex<()>,
    attached_cv: Condvar,
}

impl Route {
    pub(crate) fn new(
        rank: usize,
        size: usize,
        secret: Option<Vec<u8>>,
        pairs: Vec<Option<Arc<TcpPair>>>,
    ) -> Arc<Self> {
        Arc::new(Route { rank, size, secret, pairs, attached: Mutex::new(()), attached_cv: Condvar::new() })
    }

    pub(super) fn notify(&self) {
        let _g = lock(&self.attached);
        self.attached_cv.notify_all();
    }

    /// Waits until the pairs to every rank in `peers` are attached; returns those still
    /// missing at the deadline.
    pub(crate) fn wait_attached(&self, peers: &[usize], deadline: Instant) -> Vec<usize> {
        let mut g = lock(&self.attached);
        loop {
            let missing: Vec<usize> =
                peers.iter().copied().filter(|&p| !self.pairs[p].as_ref().is_some_and(|x| x.is_attached())).collect();
            let now = Instant::now();
            if missing.is_empty() || now >= deadline {
                return missing;
            }
            g = wait_timeout(&self.attached_cv, g, deadline - now);
        }
    }
}

/// State shared by the device handle, its event loop and its pairs.
pub(crate) struct DeviceState {
    pub(crate) registry: Arc<Registry>,
    pub(crate) parking: Arc<Parking>,
    pub(crate) addr: SocketAddr,
    pub(crate) opts: TcpOptions,
    next_token: AtomicUsize,
    pairs: Mutex<HashMap<Token, Arc<TcpPair>>>,
    /// Keyed by context id and the local rank (ranks that are threads may share a device).
    routes: Mutex<HashMap<(ContextId, usize), Arc<Route>>>,
    stop: AtomicBool,
}

/// The TCP backend of a [`Device`](crate::device::Device): owns the listener and the
/// event-loop thread; dropping it stops and joins the thread.
pub(crate) struct TcpDevice {
    pub(crate) shared: Arc<DeviceState>,
    thread: Option<JoinHandle<()>>,
}

impl TcpDevice {
    /// Binds `addr` (trying each port of `ports` in turn, or the address's own port) and starts
    /// the event loop.
    pub(crate) fn start(addrs: &[SocketAddr], opts: TcpOptions) -> Result<Self> {
        let mut last_err = None;
        let mut bound = None;
        for a in addrs {
            match TcpListener::bind(*a) {
                Ok(l) => {
                    bound = Some(l);
                    break;
                }
                Err(e) => last_err = Some((a, e)),
            }
        }
        let mut listener = match (bound, last_err) {
            (Some(l), _) => l,
            (None, Some((a, e))) => return Err(Error::io(format!("binding the device listener to {a}"), e)),
            (None, None) => return Err(Error::invalid("no address to bind the device to")),
        };
        let addr = listener.local_addr().map_err(|e| Error::io("reading the listener address", e))?;
        let poll = Poll::new().map_err(|e| Error::io("creating the event loop", e))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| Error::io("registering the listener", e))?;
        let waker = Waker::new(poll.registry(), WAKER).map_err(|e| Error::io("creating the event-loop waker", e))?;
        let registry = Arc::new(poll.registry().try_clone().map_err(|e| Error::io("cloning the poll registry", e))?);
        let parking = Arc::new(Parking::new(waker));
        let shared = Arc::new(DeviceState {
            registry,
            parking,
            addr,
            opts,
            next_token: AtomicUsize::new(FIRST_CONN),
            pairs: Mutex::default(),
            routes: Mutex::default(),
            stop: AtomicBool::new(false),
        });
        let loop_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ferrogloo-tcp-{}", addr.port()))
            .spawn(move || EventLoop { poll, listener, shared: loop_shared, incoming: HashMap::new() }.run())
            .map_err(|e| Error::io("spawning the event-loop thread", e))?;
        Ok(TcpDevice { shared, thread: Some(thread) })
    }
}

impl Drop for TcpDevice {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.parking.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl DeviceState {
    fn token(&self) -> Token {
        Token(self.next_token.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn add_route(&self, ctx: ContextId, route: Arc<Route>) -> Result<()> {
        let mut routes = lock(&self.routes);
        let key = (ctx, route.rank);
        if routes.contains_key(&key) {
            return Err(Error::invalid(format!(
                "rank {} of this context is already registered on the device",
                route.rank
            )));
        }
        routes.insert(key, route);
        Ok(())
    }

    /// Forgets a context: closes its pairs (gracefully, see [`linger`]) and stops routing
    /// connections to it.
    pub(crate) fn remove_route(&self, ctx: &ContextId, rank: usize) {
        let Some(route) = lock(&self.routes).remove(&(*ctx, rank)) else { return };
        let tokens: Vec<Token> = route.pairs.iter().flatten().flat_map(|p| p.tokens()).collect();
        let flushed_by = Instant::now() + CLOSE_FLUSH;
        let closing: Vec<TcpStream> = route.pairs.iter().flatten().flat_map(|p| p.close(flushed_by)).collect();
        {
            let mut pairs = lock(&self.pairs);
            for t in tokens {
                pairs.remove(&t);
            }
        }
        linger(closing, LINGER);
    }

    /// Registers a connected stream for `pair` and attaches it as `lane`; returns whether the
    /// pair is complete now.
    pub(super) fn attach(
        &self,
        pair: &Arc<TcpPair>,
        lane: Lane,
        mut stream: TcpStream,
        token: Option<Token>,
    ) -> Result<bool> {
        let token = match token {
            Some(t) => t,
            None => {
                let t = self.token();
                self.registry
                    .register(&mut stream, t, Interest::READABLE)
                    .map_err(|e| Error::io("registering a connection", e))?;
                t
            }
        };
        lock(&self.pairs).insert(token, pair.clone());
        match pair.attach(lane, stream, token) {
            Ok(complete) => Ok(complete),
            Err(mut stream) => {
                lock(&self.pairs).remove(&token);
                let _ = self.registry.deregister(&mut stream);
                Err(Error::Protocol {
                    peer: Some(pair.peer()),
                    detail: format!("a second {lane:?} connection for one pair"),
                })
            }
        }
    }
}

/// An accepted connection still in its handshake.
struct Incoming {
    stream: TcpStream,
    from: SocketAddr,
    deadline: Instant,
    hs: Handshake,
    /// The hello, once it came (for the log).
    hello: Option<Hello>,
    /// Set once the hello is admitted: the pair and route it is for, and which of the pair's
    /// connections it opens.
    target: Option<(Arc<TcpPair>, Arc<Route>, Lane)>,
}

/// Where an accepted connection's handshake stands after a step.
enum HandshakeStep {
    /// Waiting for more bytes.
    More,
    /// Accepted: the connection joins its pair.
    Done,
    /// Refused, for this reason: the connection is closed.
    Drop(String),
}

struct EventLoop {
    poll: Poll,
    listener: TcpListener,
    shared: Arc<DeviceState>,
    incoming: HashMap<Token, Box<Incoming>>,
}

impl EventLoop {
    fn run(mut self) {
        let mut events = Events::with_capacity(256);
        while !self.shared.stop.load(Ordering::SeqCst) {
            let (timer, holds) = self.shared.parking.sweep();
            let now = Instant::now();
            if holds {
                let pairs: Vec<Arc<TcpPair>> = lock(&self.shared.pairs).values().cloned().collect();
                for p in pairs {
                    p.expire_hold(now);
                }
            }
            let timeout = self.incoming.values().map(|i| i.deadline.saturating_duration_since(now)).chain(timer).min();
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(error = %e, "ferrogloo event loop failed; the device stops");
                break;
            }
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(),
                    WAKER => {}
                    t => {
                        if self.incoming.contains_key(&t) {
                            self.handshake_step(t);
                        } else {
                            let pair = lock(&self.shared.pairs).get(&t).cloned();
                            if let Some(p) = pair {
                                p.on_ready();
                            }
                        }
                    }
                }
            }
            self.expire();
        }
        lock(&self.shared.pairs).clear();
        self.shared.parking.clear();
    }

    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((mut stream, from)) => {
                    if self.incoming.len() >= self.shared.opts.max_pending {
                        // Make room by dropping the oldest handshake: silent connections cannot
                        // lock real peers out, since a peer sends its hello at once.
                        let oldest = self.incoming.iter().min_by_key(|(_, i)| i.deadline).map(|(t, _)| *t);
                        if let Some(t) = oldest {
                            self.drop_incoming(t, "evicted: too many handshakes in progress");
                        }
                    }
                    if let Err(e) = configure(&socket2::SockRef::from(&stream), &self.shared.opts) {
                        tracing::warn!(%from, error = %e, "refused connection: cannot configure socket");
                        continue;
                    }
                    let token = self.shared.token();
                    if let Err(e) = self.poll.registry().register(&mut stream, token, Interest::READABLE) {
                        tracing::warn!(%from, error = %e, "refused connection: cannot register socket");
                        continue;
                    }
                    let deadline = Instant::now() + self.shared.opts.handshake_timeout;
                    let hs = Handshake::accept(BackendKind::Tcp, random16());
                    self.incoming
                        .insert(token, Box::new(Incoming { stream, from, deadline, hs, hello: None, target: None }));
                    // Bytes may already be there; edge-triggered readiness would not repeat.
                    self.handshake_step(token);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of file descriptors and the like: the connection stays in the
                    // backlog; report and retry at the next event.
                    tracing::warn!(error = %e, "accept failed");
                    return;
                }
            }
        }
    }

    fn drop_incoming(&mut self, token: Token, why: &str) {
        if let Some(mut inc) = self.incoming.remove(&token) {
            let _ = self.poll.registry().deregister(&mut inc.stream);
            tracing::warn!(from = %inc.from, reason = why, "refused connection");
        }
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let late: Vec<Token> = self.incoming.iter().filter(|(_, i)| i.deadline <= now).map(|(t, _)| *t).collect();
        for t in late {
            self.drop_incoming(t, "handshake not completed in time");
        }
    }

    fn handshake_step(&mut self, token: Token) {
        let Some(mut inc) = self.incoming.remove(&token) else { return };
        match self.advance(&mut inc) {
            HandshakeStep::More => {
                self.incoming.insert(token, inc);
            }
            HandshakeStep::Drop(why) => {
                self.incoming.insert(token, inc);
                self.drop_incoming(token, &why);
            }
            HandshakeStep::Done => {
                let Some((pair, route, lane)) = inc.target else { return };
                let peer = pair.peer();
                match self.shared.attach(&pair, lane, inc.stream, Some(token)) {
                    Ok(complete) => {
                        tracing::debug!(from = %inc.from, peer, ?lane, "lane connected");
                        if complete {
                            route.notify();
                        }
                    }
                    Err(e) => tracing::warn!(from = %inc.from, error = %e, "refused connection"),
                }
            }
        }
    }

    /// Reads what the handshake still needs, answers, and decides, until it needs bytes that
    /// have not come yet.
    fn advance(&self, inc: &mut Incoming) -> HandshakeStep {
        let mut buf = [0u8; MAX_MESSAGE];
        loop {
            match inc.hs.poll() {
                Event::Send(o) => {
                    // A few dozen bytes into a socket buffer of kilobytes that the connector
                    // drains: written whole, or the connection is broken.
                    if !matches!(inc.stream.write(&o.bytes), Ok(n) if n == o.bytes.len()) {
                        return HandshakeStep::Drop("could not answer the handshake".into());
                    }
                }
                Event::Need(n) => match inc.stream.read(&mut buf[..n.min(MAX_MESSAGE)]) {
                    Ok(0) => return HandshakeStep::Drop("closed during the handshake".into()),
                    Ok(k) => {
                        inc.hs.feed(&buf[..k]);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return HandshakeStep::More,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return HandshakeStep::Drop(format!("read failed: {e}")),
                },
                Event::Hello(h) => {
                    inc.hello = Some(h);
                    let lane = if h.lane == Lane::Bulk as u8 { Lane::Bulk } else { Lane::Main };
                    let route = lock(&self.shared.routes).get(&(h.ctx, h.to as usize)).cloned();
                    let pair = route.as_ref().and_then(|r| r.pairs.get(h.from as usize).cloned().flatten());
                    let taken = pair.as_ref().is_some_and(|p| p.lane_attached(lane));
                    let local = route.as_ref().map(|r| Local {
                        ctx: h.ctx,
                        rank: r.rank,
                        size: r.size,
                        secret: r.secret.clone(),
                    });
                    inc.hs.admit(local.as_ref(), self.shared.addr.to_string().as_bytes(), taken);
                    inc.target = route.zip(pair).map(|(r, p)| (p, r, lane));
                }
                // Nothing to hand over on TCP.
                Event::Proved(_) => inc.hs.respond(&[]),
                Event::Done(_) => return HandshakeStep::Done,
                Event::Refused(why) => {
                    return HandshakeStep::Drop(match inc.hello {
                        Some(h) => format!("{why} (from rank {} for rank {})", h.from, h.to),
                        None => why.to_string(),
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, TcpListener, TcpStream};

    /// A connected loopback socket from 127.0.0.1 to a listener on `to`, with the listener's
    /// end (kept open for as long as the test looks at the socket).
    fn connected(to: [u8; 4]) -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind((IpAddr::from(to), 0)).expect("bind a loopback listener");
        let out = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
        out.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into()).expect("bind 127.0.0.1");
        out.connect(&listener.local_addr().expect("listener address").into()).expect("connect");
        let (accepted, _) = listener.accept().expect("accept");
        (out.into(), accepted)
    }

    fn opts(send_buffer: Option<usize>) -> TcpOptions {
        TcpOptions {
            send_buffer,
            recv_buffer: None,
            early_budget: 0,
            handshake_timeout: Duration::from_secs(1),
            max_pending: 1,
        }
    }

    /// What the kernel makes of a send buffer of `n` bytes (it doubles it, and caps it at
    /// `net.core.wmem_max`).
    fn kernel_size(n: usize) -> usize {
        let (s, _peer) = connected([127, 0, 0, 1]);
        let s = socket2::SockRef::from(&s);
        s.set_send_buffer_size(n).expect("set SO_SNDBUF");
        s.send_buffer_size().expect("get SO_SNDBUF")
    }

    #[test]
    fn same_host_connections_get_the_capped_send_buffer_and_others_keep_autotuning() {
        let (local, _peer) = connected([127, 0, 0, 1]);
        let local = socket2::SockRef::from(&local);
        assert!(same_host(&local).expect("addresses"));
        configure(&local, &opts(None)).expect("configure");
        assert_eq!(local.send_buffer_size().expect("SO_SNDBUF"), kernel_size(SAME_HOST_SEND_BUFFER));
        assert!(local.tcp_nodelay().expect("TCP_NODELAY"));

        // 127.0.0.1 to 127.0.0.2: two addresses, so not "this host" as far as the rule goes.
        let (other, _peer) = connected([127, 0, 0, 2]);
        let other = socket2::SockRef::from(&other);
        let untouched = other.send_buffer_size().expect("SO_SNDBUF");
        assert!(!same_host(&other).expect("addresses"));
        configure(&other, &opts(None)).expect("configure");
        assert_eq!(other.send_buffer_size().expect("SO_SNDBUF"), untouched);
        assert_ne!(untouched, kernel_size(SAME_HOST_SEND_BUFFER), "the test cannot tell the two apart");

        // An explicit size wins on either kind of connection.
        let (explicit, _peer) = connected([127, 0, 0, 1]);
        let explicit = socket2::SockRef::from(&explicit);
        configure(&explicit, &opts(Some(64 << 10))).expect("configure");
        assert_eq!(explicit.send_buffer_size().expect("SO_SNDBUF"), kernel_size(64 << 10));
    }
}

/// The longest a context's close waits for its peers to take what it sent ([`linger`]).
const LINGER: Duration = Duration::from_secs(1);

/// Closes `streams` (each already shut down for writing) without losing what they sent: a
/// socket closed while input waits unread in it resets the connection, and a reset throws away
/// what its kernel had not sent yet (the last message of a rank that drops its context right
/// after sending it, for one), so input is read and dropped until the peer's kernel has
/// acknowledged everything sent (the end included), for at most `limit`. After `limit` (a peer
/// that does not read) each is closed with its input drained: no reset, and the kernel goes
/// on delivering the rest on its own.
pub(crate) fn linger(streams: Vec<TcpStream>, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut scratch = [0u8; 16 << 10];
    // Each stream, and whether its peer's end was read (nothing more to read then).
    let mut open: Vec<(TcpStream, bool)> = streams.into_iter().map(|s| (s, false)).collect();
    loop {
        open.retain_mut(|(s, ended)| match drain(s, &mut scratch) {
            Input::Broken => false,
            input => {
                *ended |= input == Input::Ended;
                unsent(s) > 0
            }
        });
        if open.is_empty() || Instant::now() >= deadline {
            return;
        }
        // Input wakes the poll; the peer's acknowledgements do not: look again soon.
        let mut fds: Vec<libc::pollfd> = open
            .iter()
            // A stream whose end was read reports a hang-up for ever: not polled (the wait
            // then only sleeps until the next look at its acknowledgements).
            .map(|(s, ended)| libc::pollfd {
                fd: if *ended { -1 } else { s.as_raw_fd() },
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let wait = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(2));
        let _ = crate::transport::wake::poll_fds(&mut fds, wait);
    }
}

/// The most a closing stream is read of in one pass of [`linger`].
const DRAIN_PASS: usize = 4 << 20;

/// What reading a closing stream found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    /// Nothing more to read now.
    Drained,
    /// The peer's end of the stream.
    Ended,
    /// An error: the connection is gone (nothing more is delivered either way).
    Broken,
}

/// Reads and drops what `s` has to read now, at most [`DRAIN_PASS`] bytes (a peer that keeps
/// sending does not hold the caller past its deadline).
fn drain(s: &mut TcpStream, scratch: &mut [u8]) -> Input {
    let mut taken = 0;
    loop {
        if taken >= DRAIN_PASS {
            return Input::Drained;
        }
        match s.read(scratch) {
            Ok(0) => return Input::Ended,
            Ok(n) => taken += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Input::Drained,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Input::Broken,
        }
    }
}

/// Bytes `s` has sent that its peer's kernel has not acknowledged yet, or not sent at all (the
/// end of the stream counts one); 0 when unknown.
fn unsent(s: &TcpStream) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) on a socket descriptor this stream owns writes one int
    // through the pointer, which points at a live local of that type.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    if r < 0 { 0 } else { usize::try_from(n).unwrap_or(0) }
}
