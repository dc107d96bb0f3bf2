//! PyTorch's TCPStore, from both ends: [`TcpStore`] speaks its wire protocol to a server that
//! `torchrun`, `init_process_group` or [`TcpStoreServer`] runs, and [`TcpStoreServer`] serves
//! it to PyTorch's own clients.
//!
//! The protocol (torch 2.5 to 2.15, checked against 2.15's server and client): every request is
//! a one-byte opcode and its fields, integers little-endian, strings and values a `u64` length
//! and their bytes; replies come in request order, with no header. A client opens with
//! VALIDATE (opcode 0, `u32` magic `0x3C85F7CE`, no reply) and PING (13, a `u32` nonce the
//! server echoes). The C++ client puts `/` before every key. A key nobody has set is waited for
//! with WAIT (6), which the server answers once every key exists, or never; the client then
//! takes its wait back with CANCEL_WAIT (12, answered `1`).
//!
//! Unlike PyTorch's client, every read here has a deadline: a server that stops answering is an
//! error naming it, not a hang.

use super::Store;
use crate::error::{Error, Result};
use crate::sync::{lock, wait_timeout};
use std::collections::HashMap;
use std::io::{BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAGIC: u32 = 0x3C85_F7CE;
const VALIDATE: u8 = 0;
const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const GETNUMKEYS: u8 = 7;
const DELETE_KEY: u8 = 8;
const APPEND: u8 = 9;
const MULTI_GET: u8 = 10;
const MULTI_SET: u8 = 11;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const LIST_KEYS: u8 = 17;
const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// The largest key and value the server takes (PyTorch's libuv server's limits; a value made by
/// APPEND too), and the most keys in one request.
const MAX_KEY: usize = 8192;
const MAX_VALUE: usize = 8 << 20;
const MAX_KEYS: usize = 131_072;
/// Most bytes of keys and values one request to the server may carry (a MULTI_SET, the keys of a
/// WAIT or a MULTI_GET): 64 MiB. The server holds a request whole before it applies it.
const MAX_REQUEST: usize = 64 << 20;
/// What each entry costs the server's budget besides its key and value bytes, so that empty
/// entries count too.
const ENTRY_OVERHEAD: usize = 64;
/// Time a new connection has to send VALIDATE before the server closes it: 5 s. A validated
/// connection may then idle, or block in WAIT, for as long as it likes.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest one write of a reply may block on a client that does not read: 30 s. Then the
/// server closes the connection.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a server connection's blocked reads wake to see whether the server stops.
const POLL: Duration = Duration::from_millis(100);
/// Most idle connections a [`TcpStore`] keeps for later requests.
const MAX_IDLE: usize = 4;

/// A client of a PyTorch TCPStore (URL `tcpstore://HOST:PORT[/PREFIX]`). Keys go on the wire as
/// PyTorch's C++ client sends them: `/` then the prefix and `/` (when there is one), then the
/// key. Each request is bounded by the timeout given.
///
/// A request takes an idle connection or opens one (at most 4 are kept idle), so threads that
/// share a `TcpStore` do not queue behind each other: a `get` blocked on a missing key holds
/// only its own connection. Every request returns once the server has applied it (a `set` is
/// followed by a PING, since SET has no reply), so what one thread did is seen by the next
/// request of any thread. A request that fails before it is fully written is sent again on a
/// new connection (the server cannot have seen it whole); one that fails after is sent again
/// only when it is a read, so an `add` whose reply is lost is an error, never applied twice.
pub struct TcpStore {
    addr: String,
    prefix: String,
    timeout: Duration,
    /// Validated connections no request is using.
    idle: Mutex<Vec<TcpStream>>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore").field("addr", &self.addr).field("prefix", &self.prefix).finish()
    }
}

/// Bytes written by an encoder, sent at once.
struct Req(Vec<u8>);

impl Req {
    fn new(op: u8) -> Self {
        Req(vec![op])
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, b: &[u8]) -> Self {
        let mut r = self.u64(b.len() as u64);
        r.0.extend_from_slice(b);
        r
    }
}

/// `e`, with the request it failed (`what`) named.
fn failing(e: Error, what: &str) -> Error {
    match e {
        Error::Io { context, source } => Error::Io { context: format!("{context} ({what})"), source },
        Error::Timeout { op, ranks, keys, waited } => {
            Error::Timeout { op: format!("{op} for {what}"), ranks, keys, waited }
        }
        Error::Protocol { peer, detail } => Error::Protocol { peer, detail: format!("{detail} ({what})") },
        e => e,
    }
}

/// Whether an idle connection is still open with nothing unread. One the server closed
/// meanwhile (it restarted, or dropped us) shows EOF here.
fn still_open(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let peeked = s.peek(&mut [0u8]);
    s.set_nonblocking(false).is_ok() && matches!(peeked, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

impl TcpStore {
    /// A client of the TCPStore at `addr` (`HOST:PORT`), keys under `prefix` (may be empty),
    /// each request bounded by `timeout`. Connects now (retrying until `timeout` while the
    /// server comes up) and checks that a TCPStore answers.
    pub fn connect(addr: &str, prefix: &str, timeout: Duration) -> Result<Self> {
        let s = TcpStore {
            addr: addr.to_string(),
            prefix: prefix.trim_matches('/').to_string(),
            timeout,
            idle: Mutex::new(Vec::new()),
        };
        let conn = s.open(Instant::now() + timeout)?;
        lock(&s.idle).push(conn);
        Ok(s)
    }

    fn io(&self, what: &str, e: std::io::Error) -> Error {
        Error::io(format!("{what} the TCPStore at {}", self.addr), e)
    }

    /// A new, validated connection. A server that closes it during the handshake (one at its
    /// connection limit, or one still starting) is tried again until `deadline`.
    fn open(&self, deadline: Instant) -> Result<TcpStream> {
        let addrs: Vec<SocketAddr> = self.addr.to_socket_addrs().map_err(|e| self.io("resolving", e))?.collect();
        if addrs.is_empty() {
            return Err(Error::invalid(format!("{} resolves to no address", self.addr)));
        }
        let mut backoff = super::Backoff::new();
        loop {
            let stream = self.connect_any(&addrs, deadline)?;
            match self.handshake(&stream, deadline) {
                Ok(()) => return Ok(stream),
                Err(e @ Error::Io { .. }) => {
                    if !backoff.sleep_until(deadline) {
                        return Err(e);
                    }
                    tracing::debug!(addr = %self.addr, error = %e, "the TCPStore closed a new connection; trying again");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// VALIDATE and PING on a new connection.
    fn handshake(&self, stream: &TcpStream, deadline: Instant) -> Result<()> {
        let _ = stream.set_nodelay(true);
        let mut hello = vec![VALIDATE];
        hello.extend_from_slice(&MAGIC.to_le_bytes());
        let nonce = std::process::id();
        hello.push(PING);
        hello.extend_from_slice(&nonce.to_le_bytes());
        self.send(stream, &hello, deadline)?;
        let mut echo = [0u8; 4];
        self.recv(stream, &mut echo, deadline)?;
        if u32::from_le_bytes(echo) != nonce {
            return Err(Error::Protocol {
                peer: None,
                detail: format!("{} answered the ping with {echo:02x?}: not a PyTorch TCPStore", self.addr),
            });
        }
        Ok(())
    }

    fn connect_any(&self, addrs: &[SocketAddr], deadline: Instant) -> Result<TcpStream> {
        let mut backoff = super::Backoff::new();
        loop {
            let mut err = None;
            for a in addrs {
                let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                match TcpStream::connect_timeout(a, left.min(Duration::from_secs(5))) {
                    Ok(s) => return Ok(s),
                    Err(e) => err = Some(e),
                }
            }
            if !backoff.sleep_until(deadline) {
                let e = err.unwrap_or_else(|| std::io::Error::other("no address"));
                return Err(self.io("connecting to", e));
            }
        }
    }

    fn send(&self, s: &TcpStream, bytes: &[u8], deadline: Instant) -> Result<()> {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        s.set_write_timeout(Some(left)).map_err(|e| self.io("configuring the connection to", e))?;
        (&*s).write_all(bytes).map_err(|e| self.io("writing to", e))
    }

    fn recv(&self, s: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<()> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    op: format!("a reply from the TCPStore at {}", self.addr),
                    ranks: Vec::new(),
                    keys: Vec::new(),
                    waited: self.timeout,
                });
            }
            s.set_read_timeout(Some(left)).map_err(|e| self.io("configuring the connection to", e))?;
            match (&*s).read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(self.io(
                        "reading from",
                        std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "it closed the connection"),
                    ));
                }
                Ok(n) => got += n,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io("reading from", e)),
            }
        }
        Ok(())
    }

    fn recv_u64(&self, s: &TcpStream, deadline: Instant) -> Result<u64> {
        let mut b = [0u8; 8];
        self.recv(s, &mut b, deadline)?;
        Ok(u64::from_le_bytes(b))
    }

    fn recv_bytes(&self, s: &TcpStream, deadline: Instant) -> Result<Vec<u8>> {
        let n = self.recv_u64(s, deadline)?;
        let max = MAX_VALUE.max(64 << 20);
        if n > max as u64 {
            return Err(Error::Protocol {
                peer: None,
                detail: format!("{} sent a value of {n} bytes (at most {max} are taken)", self.addr),
            });
        }
        let mut v = vec![0u8; n as usize];
        self.recv(s, &mut v, deadline)?;
        Ok(v)
    }

    /// The key on the wire.
    fn wire(&self, key: &str) -> Vec<u8> {
        if self.prefix.is_empty() { format!("/{key}") } else { format!("/{}/{key}", self.prefix) }.into_bytes()
    }

    /// An idle connection that is still open, if there is one.
    fn take_idle(&self) -> Option<TcpStream> {
        loop {
            let s = lock(&self.idle).pop()?;
            if still_open(&s) {
                return Some(s);
            }
            tracing::debug!(addr = %self.addr, "the TCPStore closed an idle connection; dropping it");
        }
    }

    /// Keeps `s` for later requests, unless enough are kept.
    fn put_idle(&self, s: TcpStream) {
        let mut idle = lock(&self.idle);
        if idle.len() < MAX_IDLE {
            idle.push(s);
        }
    }

    /// Sends the request `req` (`what` names it in errors) and reads its reply with `read`, on
    /// an idle connection or a new one. The connection is kept for later requests once the
    /// exchange went through, and dropped after any failure (its state is unknown).
    ///
    /// A failure before `req` is fully written is retried once on a new connection: the server
    /// acts on whole requests only. A failure after is retried only when `idempotent` (a read):
    /// the server may have applied the request and lost only its reply.
    fn call<R>(
        &self,
        what: &str,
        req: &[u8],
        idempotent: bool,
        read: impl Fn(&TcpStream, Instant) -> Result<R>,
    ) -> Result<R> {
        let deadline = Instant::now() + self.timeout;
        let mut retried = false;
        loop {
            let pooled = if retried { None } else { self.take_idle() };
            let s = match pooled {
                Some(s) => s,
                None => self.open(deadline).map_err(|e| failing(e, what))?,
            };
            let outcome = match self.send(&s, req, deadline) {
                Err(e) => Err((e, true)),
                Ok(()) => read(&s, deadline).map_err(|e| {
                    let retry = idempotent && matches!(e, Error::Io { .. });
                    (e, retry)
                }),
            };
            match outcome {
                Ok(r) => {
                    self.put_idle(s);
                    return Ok(r);
                }
                Err((e, true)) if !retried => {
                    tracing::debug!(error = %e, request = what, "TCPStore connection broke; sending again on a new one");
                    retried = true;
                }
                Err((e, _)) => return Err(failing(e, what)),
            }
        }
    }

    /// COMPARE_SET: sets `key` to `desired` if it holds `expected` (or is missing and
    /// `expected` is empty); returns the value it holds afterwards.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let req = Req::new(COMPARE_SET).bytes(&self.wire(key)).bytes(expected).bytes(desired);
        let what = format!("COMPARE_SET of key {key:?} ({} and {} bytes)", expected.len(), desired.len());
        self.call(&what, &req.0, false, |s, d| self.recv_bytes(s, d))
    }

    /// Waits until `keys` all exist, or `timeout`; takes the wait back when it times out.
    fn wait_keys(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut req = Req::new(WAIT).u64(keys.len() as u64);
        for k in keys {
            req = req.bytes(&self.wire(k));
        }
        let until = Instant::now() + timeout;
        let what = format!("WAIT for keys {keys:?}");
        let ready = self.call(&what, &req.0, true, |s, _| {
            let mut b = [0u8];
            match self.recv(s, &mut b, until) {
                Ok(()) if b[0] == STOP_WAITING => Ok(true),
                Ok(()) => {
                    Err(Error::Protocol { peer: None, detail: format!("{} answered a wait with {}", self.addr, b[0]) })
                }
                Err(Error::Timeout { .. }) => {
                    // Take the wait back, on a deadline of its own: the wait's has passed. The
                    // answer is WAIT_CANCELED, maybe after a late STOP_WAITING.
                    let d = Instant::now() + self.timeout;
                    self.send(s, &[CANCEL_WAIT], d)?;
                    let mut late = [0u8];
                    self.recv(s, &mut late, d)?;
                    let ready = late[0] == STOP_WAITING;
                    if ready {
                        self.recv(s, &mut late, d)?;
                    }
                    if late[0] != WAIT_CANCELED {
                        return Err(Error::Protocol {
                            peer: None,
                            detail: format!("{} answered CANCEL_WAIT with {}", self.addr, late[0]),
                        });
                    }
                    Ok(ready)
                }
                Err(e) => Err(e),
            }
        })?;
        if ready {
            return Ok(());
        }
        Err(super::missing_keys(
            &format!("store wait in the TCPStore at {}", self.addr),
            keys.iter().map(|k| k.to_string()).collect(),
            timeout,
        ))
    }

    /// GET of a key known to exist.
    fn get_now(&self, key: &str) -> Result<Vec<u8>> {
        let req = Req::new(GET).bytes(&self.wire(key));
        self.call(&format!("GET of key {key:?}"), &req.0, true, |s, d| self.recv_bytes(s, d))
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        // SET has no reply. The PING sent behind it is answered once the server has applied
        // it, so the value is there for every request made after `set` returns, on any
        // connection, and a server that refuses it (closing the connection) is an error here.
        let nonce = std::process::id();
        let req = Req::new(SET).bytes(&self.wire(key)).bytes(value);
        let mut req = req.0;
        req.push(PING);
        req.extend_from_slice(&nonce.to_le_bytes());
        self.call(&format!("SET of key {key:?} ({} bytes)", value.len()), &req, false, |s, d| {
            let mut echo = [0u8; 4];
            self.recv(s, &mut echo, d)?;
            if u32::from_le_bytes(echo) != nonce {
                return Err(Error::Protocol {
                    peer: None,
                    detail: format!("{} answered a ping with {echo:02x?}", self.addr),
                });
            }
            Ok(())
        })
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let req = Req::new(CHECK).u64(1).bytes(&self.wire(key));
        let present = self.call(&format!("CHECK of key {key:?}"), &req.0, true, |s, d| {
            let mut b = [0u8];
            self.recv(s, &mut b, d)?;
            Ok(b[0] == READY)
        })?;
        if !present {
            return Ok(None);
        }
        self.get_now(key).map(Some)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let req = Req::new(ADD).bytes(&self.wire(key)).u64(delta as u64);
        self.call(&format!("ADD of {delta} to key {key:?}"), &req.0, false, |s, d| Ok(self.recv_u64(s, d)? as i64))
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let req = Req::new(DELETE_KEY).bytes(&self.wire(key));
        self.call(&format!("DELETE_KEY of key {key:?}"), &req.0, false, |s, d| Ok(self.recv_u64(s, d)? != 0))
    }

    fn describe(&self) -> String {
        if self.prefix.is_empty() {
            format!("tcpstore://{}", self.addr)
        } else {
            format!("tcpstore://{}/{}", self.addr, self.prefix)
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_keys(&[key], timeout)?;
        self.get_now(key)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_keys(keys, timeout)
    }
}

/// A TCPStore server that PyTorch's clients (and [`TcpStore`]) talk to: for a ferrogloo job
/// that hosts the store of a PyTorch one, or the reverse. A thread per connection; stops when
/// dropped.
///
/// It keeps serving whatever clients send. A connection that breaks the protocol or one of
/// these limits is closed (a limit with a warning that names the client, the key and the
/// sizes) and the others go on:
///
/// - a key of at most 8 KiB; a value of at most 8 MiB, also one that APPEND makes; at most
///   131,072 keys and 64 MiB of keys and values in one request;
/// - at most [`DEFAULT_MAX_TOTAL_BYTES`](Self::DEFAULT_MAX_TOTAL_BYTES) (1 GiB) held in all,
///   each entry counting its key, its value and 64 bytes: a request that would grow the store
///   past it is refused whole (see [`set_max_total_bytes`](Self::set_max_total_bytes));
/// - at most [`DEFAULT_MAX_CONNECTIONS`](Self::DEFAULT_MAX_CONNECTIONS) (1,024) connections at
///   once: beyond, a new one is closed as soon as it is accepted (see
///   [`set_max_connections`](Self::set_max_connections));
/// - a new connection has 5 s to send VALIDATE; a validated one may idle, or block in WAIT, for
///   as long as it likes;
/// - a reply whose write blocks for 30 s on a client that does not read.
///
/// Replies are written from the stored values as the client reads them: a MULTI_GET that names
/// one large value many times costs the server no more than the value.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    state: Arc<State>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The server's entries, the condition waiters sleep on, and its counts and limits.
struct State {
    data: Mutex<Data>,
    changed: Condvar,
    /// WAIT requests blocked on missing keys now.
    waiters: AtomicUsize,
    /// Connections being served now.
    open: AtomicUsize,
    max_total_bytes: AtomicUsize,
    max_connections: AtomicUsize,
    /// [`HANDSHAKE_TIMEOUT`] in milliseconds (tests shorten it).
    handshake_ms: AtomicU64,
}

/// The entries, and what they cost the budget.
#[derive(Default)]
struct Data {
    /// Keys and values are shared so that a reply is written from them with no lock held and
    /// no copy made.
    map: HashMap<Arc<[u8]>, Arc<Vec<u8>>>,
    /// The sum of [`cost`] over the entries.
    bytes: usize,
}

/// What an entry with a key of `key` bytes and a value of `value` bytes costs the budget.
fn cost(key: usize, value: usize) -> usize {
    key.saturating_add(value).saturating_add(ENTRY_OVERHEAD)
}

impl Data {
    /// What the entries would cost with `key` holding a value of `len` bytes.
    fn bytes_with(&self, key: &[u8], len: usize) -> usize {
        let old = self.map.get(key).map_or(0, |v| cost(key.len(), v.len()));
        self.bytes.saturating_sub(old).saturating_add(cost(key.len(), len))
    }

    fn set(&mut self, key: &[u8], value: Arc<Vec<u8>>) {
        self.bytes = self.bytes_with(key, value.len());
        match self.map.get_mut(key) {
            Some(held) => *held = value,
            None => {
                self.map.insert(Arc::from(key), value);
            }
        }
    }

    fn remove(&mut self, key: &[u8]) -> bool {
        let Some(v) = self.map.remove(key) else { return false };
        self.bytes = self.bytes.saturating_sub(cost(key.len(), v.len()));
        true
    }
}

impl TcpStoreServer {
    /// The default of [`set_max_total_bytes`](Self::set_max_total_bytes): 1 GiB.
    pub const DEFAULT_MAX_TOTAL_BYTES: usize = 1 << 30;
    /// The default of [`set_max_connections`](Self::set_max_connections): 1,024.
    pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

    /// Listens on `addr` (port 0: any free port) and serves until dropped.
    pub fn start(addr: impl ToSocketAddrs) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::io("binding the TCPStore server", e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("reading the TCPStore server's address", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io("configuring the TCPStore server", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(State {
            data: Mutex::default(),
            changed: Condvar::new(),
            waiters: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
            max_total_bytes: AtomicUsize::new(Self::DEFAULT_MAX_TOTAL_BYTES),
            max_connections: AtomicUsize::new(Self::DEFAULT_MAX_CONNECTIONS),
            handshake_ms: AtomicU64::new(HANDSHAKE_TIMEOUT.as_millis() as u64),
        });
        let (stop2, state2) = (stop.clone(), state.clone());
        let thread = std::thread::Builder::new()
            .name(format!("tcpstore-{}", addr.port()))
            .spawn(move || {
                accept(&listener, &state2, &stop2);
                state2.changed.notify_all();
            })
            .map_err(|e| Error::io("starting the TCPStore server thread", e))?;
        tracing::info!(%addr, "TCPStore server listening");
        Ok(TcpStoreServer { addr, stop, state, thread: Some(thread) })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets the most bytes the store holds, each entry counting its key, its value and 64
    /// bytes ([`DEFAULT_MAX_TOTAL_BYTES`](Self::DEFAULT_MAX_TOTAL_BYTES) until set). A request
    /// that would grow the store past it is refused whole and its connection closed, with a
    /// warning; what the store holds already stays. Takes effect at once.
    pub fn set_max_total_bytes(&self, bytes: usize) {
        self.state.max_total_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Sets the most connections served at once
    /// ([`DEFAULT_MAX_CONNECTIONS`](Self::DEFAULT_MAX_CONNECTIONS) until set). Beyond it, a new
    /// connection is closed as soon as it is accepted, with a warning; open ones stay.
    pub fn set_max_connections(&self, n: usize) {
        self.state.max_connections.store(n, Ordering::Relaxed);
    }

    /// Connections being served now: clients connected and not gone (a client's process
    /// that exits or dies closes its connection).
    pub fn connections(&self) -> usize {
        self.state.open.load(Ordering::SeqCst)
    }

    /// Sets the time a new connection has to validate.
    #[cfg(test)]
    fn set_handshake_timeout(&self, t: Duration) {
        self.state.handshake_ms.store(t.as_millis() as u64, Ordering::Relaxed);
    }

    /// WAIT requests blocked on missing keys now.
    #[cfg(test)]
    fn pending_waiters(&self) -> usize {
        self.state.waiters.load(Ordering::SeqCst)
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Accepts connections until `stop`, and serves each on a thread of its own while under the
/// connection limit.
fn accept(listener: &TcpListener, state: &Arc<State>, stop: &Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((s, peer)) => {
                let open = state.open.load(Ordering::SeqCst);
                let max = state.max_connections.load(Ordering::Relaxed);
                if open >= max {
                    tracing::warn!(%peer, open, max, "too many TCPStore connections; closing a new one");
                    drop(s);
                    continue;
                }
                let slot = Slot::take(state);
                let stop = stop.clone();
                let accepted = Instant::now();
                let spawned = std::thread::Builder::new().name("tcpstore-conn".into()).spawn(move || {
                    if let Err(e) = serve(&s, peer, slot.state(), &stop, accepted) {
                        tracing::debug!(%peer, error = %e, "TCPStore connection closed");
                    }
                });
                if let Err(e) = spawned {
                    tracing::warn!(%peer, error = %e, "could not start a thread for a TCPStore connection; closing it");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a TCPStore connection failed");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// A connection's place under the connection limit, given back when dropped (also when its
/// thread could not start).
struct Slot(Arc<State>);

impl Slot {
    fn take(state: &Arc<State>) -> Self {
        state.open.fetch_add(1, Ordering::SeqCst);
        Slot(state.clone())
    }

    fn state(&self) -> &State {
        &self.0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One pending WAIT, counted while alive.
struct Pending<'a>(&'a AtomicUsize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A key for messages: quoted, cut at 100 characters.
fn show(key: &[u8]) -> String {
    let s = String::from_utf8_lossy(key);
    if s.chars().count() > 100 { format!("{:?}...", s.chars().take(100).collect::<String>()) } else { format!("{s:?}") }
}

/// The reading end of one server connection.
struct Conn<'a> {
    s: &'a TcpStream,
    peer: SocketAddr,
    stop: &'a AtomicBool,
    /// When the client must have validated by, until it has.
    handshake: Option<Instant>,
    /// Bytes of keys and values read for the request being read.
    request: usize,
}

impl Conn<'_> {
    /// Reads exactly `buf.len()` bytes, giving up when the server stops or the handshake time
    /// passes; `Ok(false)` at a clean end of the connection before the first byte of a request
    /// (`first`).
    fn read_exact(&self, buf: &mut [u8], first: bool) -> std::io::Result<bool> {
        let mut got = 0;
        while got < buf.len() {
            if self.stop.load(Ordering::Relaxed) {
                return Err(std::io::Error::other("the server is stopping"));
            }
            if let Some(by) = self.handshake
                && Instant::now() >= by
            {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no VALIDATE in the handshake time"));
            }
            match (&*self.s).read(&mut buf[got..]) {
                Ok(0) if got == 0 && first => return Ok(false),
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    fn read_u64(&self) -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b, false)?;
        Ok(u64::from_le_bytes(b))
    }

    /// A length-prefixed field of at most `max` bytes (`what` of `key` in request `op`, for
    /// messages), counted against the request's limit.
    fn read_field(&mut self, op: &str, what: &str, max: usize, key: Option<&[u8]>) -> std::io::Result<Vec<u8>> {
        let n = self.read_u64()?;
        if n > max as u64 {
            return Err(self.refuse(op, key, format!("a {what} of {n} bytes, over the limit of {max}")));
        }
        let n = n as usize;
        let total = self.request.saturating_add(n);
        if total > MAX_REQUEST {
            return Err(self.refuse(
                op,
                key,
                format!("a {what} of {n} bytes makes {total} bytes in one request, over the limit of {MAX_REQUEST}"),
            ));
        }
        self.request = total;
        // Read as the bytes come: nothing is allocated for what a client only announces.
        let mut v = Vec::new();
        while v.len() < n {
            let at = v.len();
            v.resize(at + (n - at).min(64 << 10), 0);
            self.read_exact(&mut v[at..], false)?;
        }
        Ok(v)
    }

    fn read_key(&mut self, op: &str) -> std::io::Result<Vec<u8>> {
        self.read_field(op, "key", MAX_KEY, None)
    }

    fn read_value(&mut self, op: &str, key: &[u8]) -> std::io::Result<Vec<u8>> {
        self.read_field(op, "value", MAX_VALUE, Some(key))
    }

    fn read_keys(&mut self, op: &str) -> std::io::Result<Vec<Vec<u8>>> {
        let n = self.read_u64()?;
        if n > MAX_KEYS as u64 {
            return Err(self.refuse(op, None, format!("{n} keys in one request, over the limit of {MAX_KEYS}")));
        }
        let mut keys = Vec::with_capacity((n as usize).min(1024));
        for _ in 0..n {
            keys.push(self.read_key(op)?);
        }
        Ok(keys)
    }

    /// Refuses a change (a value of `len` bytes for `key`) that would take the store from
    /// `before` to `after` bytes, past its budget. A change that does not grow the store is
    /// never refused.
    fn within_budget(
        &self,
        st: &State,
        op: &str,
        key: &[u8],
        len: usize,
        before: usize,
        after: usize,
    ) -> std::io::Result<()> {
        let budget = st.max_total_bytes.load(Ordering::Relaxed);
        if after > budget && after > before {
            return Err(self.refuse(
                op,
                Some(key),
                format!(
                    "{len} bytes would make the store hold {after} bytes, over its budget of {budget} (it holds {before})"
                ),
            ));
        }
        Ok(())
    }

    /// Logs a client's breach of a limit, and makes the error that closes its connection.
    fn refuse(&self, op: &str, key: Option<&[u8]>, detail: String) -> std::io::Error {
        let key = key.map_or_else(|| "(not read)".to_string(), show);
        tracing::warn!(peer = %self.peer, op, %key, "a TCPStore client broke a limit; closing its connection: {detail}");
        std::io::Error::other(format!("{op} of key {key} from {}: {detail}", self.peer))
    }
}

fn put_bytes(out: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    out.write_all(&(b.len() as u64).to_le_bytes())?;
    out.write_all(b)
}

/// Serves one connection until it closes, breaks the protocol or a limit.
fn serve(s: &TcpStream, peer: SocketAddr, st: &State, stop: &AtomicBool, accepted: Instant) -> std::io::Result<()> {
    // Blocking whatever the listener is; reads wake to see `stop`, writes give up on a client
    // that does not read.
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(POLL))?;
    s.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let _ = s.set_nodelay(true);
    let handshake = accepted + Duration::from_millis(st.handshake_ms.load(Ordering::Relaxed));
    let mut c = Conn { s, peer, stop, handshake: Some(handshake), request: 0 };
    let mut out = BufWriter::with_capacity(64 << 10, s);
    loop {
        let mut op = [0u8];
        if !c.read_exact(&mut op, true)? {
            return Ok(());
        }
        if c.handshake.is_some() && op[0] != VALIDATE {
            return Err(std::io::Error::other("a request before the validation"));
        }
        c.request = 0;
        match op[0] {
            VALIDATE => {
                let mut m = [0u8; 4];
                c.read_exact(&mut m, false)?;
                if u32::from_le_bytes(m) != MAGIC {
                    return Err(std::io::Error::other("a wrong validation number"));
                }
                c.handshake = None;
            }
            PING => {
                let mut n = [0u8; 4];
                c.read_exact(&mut n, false)?;
                out.write_all(&n)?;
            }
            SET => {
                let k = c.read_key("SET")?;
                let v = c.read_value("SET", &k)?;
                let mut m = lock(&st.data);
                c.within_budget(st, "SET", &k, v.len(), m.bytes, m.bytes_with(&k, v.len()))?;
                m.set(&k, Arc::new(v));
                st.changed.notify_all();
            }
            APPEND => {
                let k = c.read_key("APPEND")?;
                let v = c.read_value("APPEND", &k)?;
                let mut m = lock(&st.data);
                let old = m.map.get(k.as_slice()).map_or(0, |held| held.len());
                let len = old + v.len();
                if len > MAX_VALUE {
                    return Err(c.refuse(
                        "APPEND",
                        Some(&k),
                        format!(
                            "{} bytes to a value of {old} would make {len}, over the limit of {MAX_VALUE}",
                            v.len()
                        ),
                    ));
                }
                let after = m.bytes_with(&k, len);
                c.within_budget(st, "APPEND", &k, v.len(), m.bytes, after)?;
                m.bytes = after;
                match m.map.get_mut(k.as_slice()) {
                    // Copies the value only when a reply is being written from it.
                    Some(held) => Arc::make_mut(held).extend_from_slice(&v),
                    None => {
                        m.map.insert(Arc::from(k), Arc::new(v));
                    }
                }
                st.changed.notify_all();
            }
            COMPARE_SET => {
                let k = c.read_key("COMPARE_SET")?;
                let expected = c.read_value("COMPARE_SET", &k)?;
                let desired = c.read_value("COMPARE_SET", &k)?;
                let mut m = lock(&st.data);
                let held = m.map.get(k.as_slice()).cloned();
                let swap = held.as_ref().map_or(expected.is_empty(), |v| **v == expected);
                let now = if swap {
                    let after = m.bytes_with(&k, desired.len());
                    c.within_budget(st, "COMPARE_SET", &k, desired.len(), m.bytes, after)?;
                    let desired = Arc::new(desired);
                    m.set(&k, desired.clone());
                    st.changed.notify_all();
                    desired
                } else {
                    held.unwrap_or_else(|| Arc::new(expected))
                };
                drop(m);
                put_bytes(&mut out, &now)?;
            }
            GET => {
                let k = c.read_key("GET")?;
                let v = lock(&st.data).map.get(k.as_slice()).cloned();
                put_bytes(&mut out, v.as_deref().map_or(&[][..], Vec::as_slice))?;
            }
            ADD => {
                let k = c.read_key("ADD")?;
                let delta = c.read_u64()? as i64;
                let mut m = lock(&st.data);
                let old = match m.map.get(k.as_slice()) {
                    None => 0,
                    Some(v) => {
                        std::str::from_utf8(v).ok().and_then(|t| t.trim().parse::<i64>().ok()).ok_or_else(|| {
                            std::io::Error::other(format!("ADD to key {}, whose value is not a number", show(&k)))
                        })?
                    }
                };
                let new = old.wrapping_add(delta);
                let v = new.to_string().into_bytes();
                c.within_budget(st, "ADD", &k, v.len(), m.bytes, m.bytes_with(&k, v.len()))?;
                m.set(&k, Arc::new(v));
                st.changed.notify_all();
                drop(m);
                out.write_all(&new.to_le_bytes())?;
            }
            CHECK => {
                let keys = c.read_keys("CHECK")?;
                let ready = {
                    let m = lock(&st.data);
                    keys.iter().all(|k| m.map.contains_key(k.as_slice()))
                };
                out.write_all(&[if ready { READY } else { NOT_READY }])?;
            }
            WAIT => {
                let keys = c.read_keys("WAIT")?;
                // STOP_WAITING once every key exists, or WAIT_CANCELED for a CANCEL_WAIT.
                let ready = wait(&c, st, &keys)?;
                out.write_all(&[if ready { STOP_WAITING } else { WAIT_CANCELED }])?;
            }
            GETNUMKEYS => {
                let n = lock(&st.data).map.len() as i64;
                out.write_all(&n.to_le_bytes())?;
            }
            DELETE_KEY => {
                let k = c.read_key("DELETE_KEY")?;
                let gone = lock(&st.data).remove(&k);
                out.write_all(&i64::from(gone).to_le_bytes())?;
            }
            MULTI_GET => {
                let keys = c.read_keys("MULTI_GET")?;
                // The values as they are now, shared, not copied; written one by one.
                let values: Vec<Option<Arc<Vec<u8>>>> = {
                    let m = lock(&st.data);
                    keys.iter().map(|k| m.map.get(k.as_slice()).cloned()).collect()
                };
                drop(keys);
                for v in &values {
                    put_bytes(&mut out, v.as_deref().map_or(&[][..], Vec::as_slice))?;
                }
            }
            MULTI_SET => {
                let n = c.read_u64()?;
                if n > MAX_KEYS as u64 {
                    return Err(c.refuse(
                        "MULTI_SET",
                        None,
                        format!("{n} keys in one request, over the limit of {MAX_KEYS}"),
                    ));
                }
                let mut pairs = Vec::with_capacity((n as usize).min(1024));
                for _ in 0..n {
                    let k = c.read_key("MULTI_SET")?;
                    let v = c.read_value("MULTI_SET", &k)?;
                    pairs.push((k, v));
                }
                let mut m = lock(&st.data);
                // What the store would hold, a key set twice counting its last value.
                let (before, mut after, mut len) = (m.bytes, m.bytes, 0);
                let mut pending: HashMap<&[u8], usize> = HashMap::new();
                for (k, v) in &pairs {
                    let old = pending.get(k.as_slice()).copied().or_else(|| m.map.get(k.as_slice()).map(|v| v.len()));
                    if let Some(old) = old {
                        after = after.saturating_sub(cost(k.len(), old));
                    }
                    after = after.saturating_add(cost(k.len(), v.len()));
                    len += v.len();
                    pending.insert(k, v.len());
                }
                if let Some((first, _)) = pairs.first() {
                    c.within_budget(st, "MULTI_SET", first, len, before, after)?;
                }
                drop(pending);
                for (k, v) in pairs {
                    m.set(&k, Arc::new(v));
                }
                st.changed.notify_all();
            }
            CANCEL_WAIT => out.write_all(&[WAIT_CANCELED])?,
            LIST_KEYS => {
                let keys: Vec<Arc<[u8]>> = lock(&st.data).map.keys().cloned().collect();
                out.write_all(&(keys.len() as i64).to_le_bytes())?;
                for k in &keys {
                    put_bytes(&mut out, k)?;
                }
            }
            other => return Err(std::io::Error::other(format!("unknown request {other}"))),
        }
        out.flush()?;
    }
}

/// Waits until `keys` all exist (true) or the client cancels the wait (false).
fn wait(c: &Conn<'_>, st: &State, keys: &[Vec<u8>]) -> std::io::Result<bool> {
    let mut m = lock(&st.data);
    // Counted under the lock: a change made once the count shows is seen by a check below, or
    // wakes the wait.
    st.waiters.fetch_add(1, Ordering::SeqCst);
    let _pending = Pending(&st.waiters);
    loop {
        if keys.iter().all(|k| m.map.contains_key(k.as_slice())) {
            return Ok(true);
        }
        if c.stop.load(Ordering::Relaxed) {
            return Err(std::io::Error::other("the server is stopping"));
        }
        m = wait_timeout(&st.changed, m, Duration::from_millis(50));
        // A client that gives up sends CANCEL_WAIT (or goes away): look without blocking.
        drop(m);
        let mut b = [0u8];
        c.s.set_nonblocking(true)?;
        let peek = c.s.peek(&mut b);
        c.s.set_nonblocking(false)?;
        match peek {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) if b[0] == CANCEL_WAIT => {
                c.read_exact(&mut b, false)?;
                return Ok(false);
            }
            Ok(_) => return Err(std::io::Error::other("a request while a wait is pending")),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        m = lock(&st.data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polls `done` until it holds, failing after 10 s.
    fn eventually(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A raw connection to `server` that has sent VALIDATE.
    fn validated(server: &TcpStoreServer) -> TcpStream {
        let s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (&s).write_all(&Req::new(VALIDATE).0).unwrap();
        (&s).write_all(&MAGIC.to_le_bytes()).unwrap();
        s
    }

    /// Whether the server closes `s` (EOF or reset) within its read timeout, skipping replies.
    fn closed_by_server(s: &TcpStream) -> bool {
        let mut b = [0u8; 4096];
        loop {
            match (&*s).read(&mut b) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => {
                    return matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
                    );
                }
            }
        }
    }

    /// Whether the server echoes a PING on `s`.
    fn pings(s: &TcpStream) -> bool {
        let mut echo = [0u8; 4];
        (&*s).write_all(&[PING, 1, 2, 3, 4]).is_ok() && (&*s).read_exact(&mut echo).is_ok() && echo == [1, 2, 3, 4]
    }

    #[test]
    fn our_client_and_server_speak_the_protocol() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let a = TcpStore::connect(&addr, "", Duration::from_secs(5)).unwrap();
        let b = TcpStore::connect(&addr, "job", Duration::from_secs(5)).unwrap();
        a.set("k", b"v1").unwrap();
        assert_eq!(a.try_get("k").unwrap(), Some(b"v1".to_vec()));
        assert_eq!(b.try_get("k").unwrap(), None, "another prefix");
        assert_eq!(a.add("n", 5).unwrap(), 5);
        assert_eq!(a.add("n", -7).unwrap(), -2);
        assert_eq!(a.compare_set("c", b"", b"x").unwrap(), b"x");
        assert_eq!(a.compare_set("c", b"y", b"z").unwrap(), b"x");
        assert!(a.delete("k").unwrap() && !a.delete("k").unwrap());
        // A wait that times out is taken back, and the connection goes on.
        let t = Instant::now();
        let e = b.get("late", Duration::from_millis(300)).unwrap_err();
        assert!(e.is_timeout() && t.elapsed() < Duration::from_secs(3), "{e}");
        assert_eq!(server.pending_waiters(), 0, "the timed-out wait was taken back");
        let waiter = std::thread::spawn(move || b.get("late", Duration::from_secs(10)));
        // The set lands while the server holds the wait, so it is the set that wakes it.
        eventually("the server holds the wait", || server.pending_waiters() == 1);
        let c = TcpStore::connect(&addr, "job", Duration::from_secs(5)).unwrap();
        c.set("late", b"here").unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), b"here");
        assert_eq!(server.pending_waiters(), 0);
    }

    #[test]
    fn a_stranger_is_refused_and_a_silent_server_is_an_error_in_time() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.write_all(&[SET, 1, 0, 0, 0, 0, 0, 0, 0, b'k']).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(s.read(&mut b), Ok(0) | Err(_)), "a request before validation closes the connection");
        // Something that accepts but never answers.
        let mute = TcpListener::bind("127.0.0.1:0").unwrap();
        let t = Instant::now();
        let e = TcpStore::connect(&mute.local_addr().unwrap().to_string(), "", Duration::from_millis(500)).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn a_wait_longer_than_the_store_timeout_fails_as_a_missing_key() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let store = TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(1)).unwrap();
        let t = Instant::now();
        let e = store.get("missing", Duration::from_millis(2500)).unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(2500) && t.elapsed() < Duration::from_secs(5), "{e}");
        match &e {
            Error::Timeout { keys, op, .. } => assert!(keys == &["missing"] && op.contains("store wait"), "{e}"),
            other => panic!("expected the get's timeout, got {other}"),
        }
        assert_eq!(server.pending_waiters(), 0, "the wait was taken back");
        store.set("missing", b"now").unwrap();
        assert_eq!(store.get("missing", Duration::from_secs(5)).unwrap(), b"now");
    }

    #[test]
    fn a_wait_does_not_hold_up_other_requests_of_the_same_client() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let store = Arc::new(TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(5)).unwrap());
        let t = Instant::now();
        let waiter = {
            let store = store.clone();
            std::thread::spawn(move || store.get("k", Duration::from_secs(60)))
        };
        eventually("the server holds the wait", || server.pending_waiters() == 1);
        store.set("k", b"v").unwrap();
        assert_eq!(store.add("n", 2).unwrap(), 2);
        assert_eq!(waiter.join().unwrap().unwrap(), b"v");
        assert!(t.elapsed() < Duration::from_secs(10), "the set waited for the wait: {:?}", t.elapsed());
    }

    /// A fake TCPStore: answers each connection's handshake, records the opcode of each 19-byte
    /// request, and answers it with `reply(connection number, opcode)`, or closes the
    /// connection when that is `None`.
    struct Fake {
        addr: SocketAddr,
        ops: Arc<Mutex<Vec<u8>>>,
        done: Arc<AtomicBool>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Fake {
        fn start(reply: impl Fn(usize, u8) -> Option<Vec<u8>> + Send + 'static) -> Fake {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let (ops, done) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicBool::new(false)));
            let (ops2, done2) = (ops.clone(), done.clone());
            let thread = std::thread::spawn(move || {
                for (n, s) in listener.incoming().enumerate() {
                    if done2.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(mut s) = s else { continue };
                    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                    let mut hello = [0u8; 10];
                    if s.read_exact(&mut hello).is_err() || s.write_all(&hello[6..]).is_err() {
                        continue;
                    }
                    let mut req = [0u8; 19];
                    while s.read_exact(&mut req).is_ok() {
                        lock(&ops2).push(req[0]);
                        match reply(n, req[0]) {
                            Some(r) if s.write_all(&r).is_ok() => {}
                            _ => break,
                        }
                    }
                }
            });
            Fake { addr, ops, done, thread: Some(thread) }
        }

        fn ops(&self) -> Vec<u8> {
            lock(&self.ops).clone()
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            self.done.store(true, Ordering::SeqCst);
            let _ = TcpStream::connect(self.addr);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    #[test]
    fn a_lost_reply_to_add_is_an_error_not_a_second_add() {
        let fake = Fake::start(|_, _| None);
        let store = TcpStore::connect(&fake.addr.to_string(), "", Duration::from_secs(5)).unwrap();
        let e = store.add("n", 1).unwrap_err();
        assert!(matches!(e, Error::Io { .. }) && e.to_string().contains("ADD of 1 to key \"n\""), "{e}");
        assert_eq!(fake.ops(), [ADD], "the ADD was sent once");
    }

    #[test]
    fn a_read_whose_reply_is_lost_is_sent_again() {
        let fake = Fake::start(|conn, op| (conn > 0 && op == CHECK).then(|| vec![NOT_READY]));
        let store = TcpStore::connect(&fake.addr.to_string(), "", Duration::from_secs(5)).unwrap();
        assert_eq!(store.try_get("k").unwrap(), None);
        assert_eq!(fake.ops(), [CHECK, CHECK]);
    }

    #[test]
    fn multi_get_writes_a_value_named_many_times_as_it_goes() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let store = TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(5)).unwrap();
        let big: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        store.set("big", &big).unwrap();
        let s = validated(&server);
        let copies = 300;
        let mut req = Req::new(MULTI_GET).u64(copies + 1);
        for _ in 0..copies {
            req = req.bytes(b"/big");
        }
        (&s).write_all(&req.bytes(b"/none").0).unwrap();
        let (mut len, mut v) = ([0u8; 8], vec![0u8; big.len()]);
        for _ in 0..copies {
            (&s).read_exact(&mut len).unwrap();
            assert_eq!(u64::from_le_bytes(len), big.len() as u64);
            (&s).read_exact(&mut v).unwrap();
            assert!(v == big);
        }
        (&s).read_exact(&mut len).unwrap();
        assert_eq!(u64::from_le_bytes(len), 0, "a missing key reads as empty");
        assert!(pings(&s), "the connection goes on");
    }

    #[test]
    fn append_past_the_value_limit_closes_the_connection() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let s = validated(&server);
        let five = vec![7u8; 5 << 20];
        (&s).write_all(&Req::new(APPEND).bytes(b"/a").bytes(&five).0).unwrap();
        assert!(pings(&s), "an append within the limit");
        let _ = (&s).write_all(&Req::new(APPEND).bytes(b"/a").bytes(&five).0);
        assert!(closed_by_server(&s), "10 MiB is over the 8 MiB limit");
        let store = TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(5)).unwrap();
        assert_eq!(store.try_get("a").unwrap().map(|v| v.len()), Some(5 << 20), "the value is as it was");
    }

    #[test]
    fn a_multi_set_over_the_request_limit_closes_the_connection() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let store = TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(5)).unwrap();
        let s = validated(&server);
        let full = vec![1u8; MAX_VALUE];
        // 9 values of 8 MiB: the 8th takes the request past 64 MiB.
        (&s).write_all(&Req::new(MULTI_SET).u64(9).0).unwrap();
        for i in 0..9 {
            let _ = (&s).write_all(&Req(Vec::new()).bytes(format!("/m{i}").as_bytes()).bytes(&full).0);
        }
        assert!(closed_by_server(&s));
        assert_eq!(store.try_get("m0").unwrap(), None, "nothing of it was applied");
        let s = validated(&server);
        (&s).write_all(&Req::new(MULTI_SET).u64(2).bytes(b"/x").bytes(b"1").bytes(b"/y").bytes(&full).0).unwrap();
        assert!(pings(&s));
        assert_eq!(store.try_get("y").unwrap().map(|v| v.len()), Some(MAX_VALUE));
    }

    #[test]
    fn the_store_budget_refuses_growth_and_serves_the_others() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        server.set_max_total_bytes(1 << 20);
        let addr = server.local_addr().to_string();
        let (a, b) = (
            TcpStore::connect(&addr, "", Duration::from_secs(5)).unwrap(),
            TcpStore::connect(&addr, "", Duration::from_secs(5)).unwrap(),
        );
        let v = vec![0u8; 600 << 10];
        a.set("x", &v).unwrap();
        a.set("x", &v).unwrap();
        assert_eq!(a.try_get("x").unwrap().map(|v| v.len()), Some(v.len()), "replacing a value costs nothing more");
        // A second such value is over the budget: that connection is closed, nothing is stored.
        let s = validated(&server);
        (&s).write_all(&Req::new(SET).bytes(b"/y").bytes(&v).0).unwrap();
        assert!(closed_by_server(&s));
        assert_eq!(b.try_get("y").unwrap(), None);
        // Our client's set is an error, and the client goes on.
        let e = a.set("z", &v).unwrap_err();
        assert!(matches!(e, Error::Io { .. }) && e.to_string().contains("SET of key \"z\""), "{e}");
        assert_eq!(a.try_get("z").unwrap(), None);
        let s = validated(&server);
        (&s).write_all(&Req::new(APPEND).bytes(b"/x").bytes(&v).0).unwrap();
        assert!(closed_by_server(&s), "an APPEND over the budget");
        // The others are served, and a deleted value frees its bytes.
        b.set("small", b"1").unwrap();
        assert_eq!(b.try_get("small").unwrap(), Some(b"1".to_vec()));
        assert!(b.delete("x").unwrap());
        b.set("y", &v).unwrap();
        assert_eq!(a.try_get("y").unwrap().map(|v| v.len()), Some(v.len()));
    }

    #[test]
    fn silent_connections_are_closed_and_connections_are_bounded() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        server.set_handshake_timeout(Duration::from_millis(300));
        server.set_max_connections(2);
        let addr = server.local_addr().to_string();
        let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(server.local_addr()).unwrap()).collect();
        eventually("both are served", || server.state.open.load(Ordering::SeqCst) == 2);
        let third = TcpStream::connect(server.local_addr()).unwrap();
        third.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(closed_by_server(&third), "a connection over the limit is closed at once");
        // A client gets in once the silent ones are closed, after the handshake time.
        let t = Instant::now();
        let store = TcpStore::connect(&addr, "", Duration::from_secs(5)).unwrap();
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        for s in &silent {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            assert!(closed_by_server(s));
        }
        // A validated connection may idle past the handshake time.
        let idle = validated(&server);
        std::thread::sleep(Duration::from_millis(600));
        assert!(pings(&idle));
        store.set("k", b"v").unwrap();
        assert_eq!(store.try_get("k").unwrap(), Some(b"v".to_vec()));
    }
}
