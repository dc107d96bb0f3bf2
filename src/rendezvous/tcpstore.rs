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
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// The largest key and value the server takes (PyTorch's libuv server's limits), and the most
/// keys in one request.
const MAX_KEY: usize = 8192;
const MAX_VALUE: usize = 8 << 20;
const MAX_KEYS: usize = 131_072;

/// A client of a PyTorch TCPStore (URL `tcpstore://HOST:PORT[/PREFIX]`). Keys go on the wire as
/// PyTorch's C++ client sends them: `/` then the prefix and `/` (when there is one), then the
/// key. One connection, one request at a time; each bounded by the timeout given.
pub struct TcpStore {
    addr: String,
    prefix: String,
    timeout: Duration,
    conn: Mutex<Option<TcpStream>>,
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

impl TcpStore {
    /// A client of the TCPStore at `addr` (`HOST:PORT`), keys under `prefix` (may be empty),
    /// each request bounded by `timeout`. Connects now (retrying until `timeout` while the
    /// server comes up) and checks that a TCPStore answers.
    pub fn connect(addr: &str, prefix: &str, timeout: Duration) -> Result<Self> {
        let s = TcpStore {
            addr: addr.to_string(),
            prefix: prefix.trim_matches('/').to_string(),
            timeout,
            conn: Mutex::new(None),
        };
        let conn = s.open(Instant::now() + timeout)?;
        *crate::sync::lock(&s.conn) = Some(conn);
        Ok(s)
    }

    fn io(&self, what: &str, e: std::io::Error) -> Error {
        Error::io(format!("{what} the TCPStore at {}", self.addr), e)
    }

    /// A new, validated connection.
    fn open(&self, deadline: Instant) -> Result<TcpStream> {
        let addrs: Vec<SocketAddr> = self.addr.to_socket_addrs().map_err(|e| self.io("resolving", e))?.collect();
        if addrs.is_empty() {
            return Err(Error::invalid(format!("{} resolves to no address", self.addr)));
        }
        let stream = self.connect_any(&addrs, deadline)?;
        let _ = stream.set_nodelay(true);
        let mut hello = vec![VALIDATE];
        hello.extend_from_slice(&MAGIC.to_le_bytes());
        let nonce = std::process::id();
        hello.push(PING);
        hello.extend_from_slice(&nonce.to_le_bytes());
        self.send(&stream, &hello, deadline)?;
        let mut echo = [0u8; 4];
        self.recv(&stream, &mut echo, deadline)?;
        if u32::from_le_bytes(echo) != nonce {
            return Err(Error::Protocol {
                peer: None,
                detail: format!("{} answered the ping with {echo:02x?}: not a PyTorch TCPStore", self.addr),
            });
        }
        Ok(stream)
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
        if n as usize > MAX_VALUE.max(64 << 20) {
            return Err(Error::Protocol { peer: None, detail: format!("{} sent a value of {n} bytes", self.addr) });
        }
        let mut v = vec![0u8; n as usize];
        self.recv(s, &mut v, deadline)?;
        Ok(v)
    }

    /// The key on the wire.
    fn wire(&self, key: &str) -> Vec<u8> {
        if self.prefix.is_empty() { format!("/{key}") } else { format!("/{}/{key}", self.prefix) }.into_bytes()
    }

    /// Runs `f` on the connection (reopened once if it broke: a request is whole or not sent).
    fn with<R>(&self, f: impl Fn(&TcpStream, Instant) -> Result<R>) -> Result<R> {
        let deadline = Instant::now() + self.timeout;
        let mut conn = crate::sync::lock(&self.conn);
        for attempt in 0..2 {
            if conn.is_none() {
                *conn = Some(self.open(deadline)?);
            }
            let Some(s) = conn.as_ref() else { continue };
            match f(s, deadline) {
                Ok(r) => return Ok(r),
                Err(e @ Error::Io { .. }) if attempt == 0 => {
                    tracing::debug!(error = %e, "TCPStore connection broke; reconnecting");
                    *conn = None;
                }
                Err(e) => {
                    // The connection's state is unknown after a failed request.
                    *conn = None;
                    return Err(e);
                }
            }
        }
        Err(Error::invalid(format!("the TCPStore at {} kept closing the connection", self.addr)))
    }

    /// COMPARE_SET: sets `key` to `desired` if it holds `expected` (or is missing and
    /// `expected` is empty); returns the value it holds afterwards.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let k = self.wire(key);
        self.with(|s, d| {
            self.send(s, &Req::new(COMPARE_SET).bytes(&k).bytes(expected).bytes(desired).0, d)?;
            self.recv_bytes(s, d)
        })
    }

    /// Waits until `keys` all exist, or `deadline`; takes the wait back on timeout.
    fn wait_keys(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let wire: Vec<Vec<u8>> = keys.iter().map(|k| self.wire(k)).collect();
        let until = Instant::now() + timeout;
        self.with(|s, d| {
            let mut r = Req::new(WAIT).u64(wire.len() as u64);
            for k in &wire {
                r = r.bytes(k);
            }
            self.send(s, &r.0, d)?;
            let mut b = [0u8];
            match self.recv(s, &mut b, until) {
                Ok(()) if b[0] == STOP_WAITING => Ok(()),
                Ok(()) => {
                    Err(Error::Protocol { peer: None, detail: format!("{} answered a wait with {}", self.addr, b[0]) })
                }
                Err(Error::Timeout { .. }) => {
                    // Take the wait back: the answer is WAIT_CANCELED, maybe after a late
                    // STOP_WAITING.
                    self.send(s, &[CANCEL_WAIT], d)?;
                    let mut late = [0u8];
                    self.recv(s, &mut late, d)?;
                    if late[0] == STOP_WAITING {
                        self.recv(s, &mut late, d)?;
                        return Ok(());
                    }
                    Err(super::missing_keys(
                        &format!("store wait in the TCPStore at {}", self.addr),
                        keys.iter().map(|k| k.to_string()).collect(),
                        timeout,
                    ))
                }
                Err(e) => Err(e),
            }
        })
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = self.wire(key);
        self.with(|s, d| self.send(s, &Req::new(SET).bytes(&k).bytes(value).0, d))
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let k = self.wire(key);
        self.with(|s, d| {
            self.send(s, &Req::new(CHECK).u64(1).bytes(&k).0, d)?;
            let mut b = [0u8];
            self.recv(s, &mut b, d)?;
            if b[0] != READY {
                return Ok(None);
            }
            self.send(s, &Req::new(GET).bytes(&k).0, d)?;
            self.recv_bytes(s, d).map(Some)
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = self.wire(key);
        self.with(|s, d| {
            self.send(s, &Req::new(ADD).bytes(&k).u64(delta as u64).0, d)?;
            Ok(self.recv_u64(s, d)? as i64)
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let k = self.wire(key);
        self.with(|s, d| {
            self.send(s, &Req::new(DELETE_KEY).bytes(&k).0, d)?;
            Ok(self.recv_u64(s, d)? != 0)
        })
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
        let k = self.wire(key);
        self.with(|s, d| {
            self.send(s, &Req::new(GET).bytes(&k).0, d)?;
            self.recv_bytes(s, d)
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_keys(keys, timeout)
    }
}

/// A TCPStore server that PyTorch's clients (and [`TcpStore`]) talk to: for a ferrogloo job
/// that hosts the store of a PyTorch one, or the reverse. A thread per connection; a
/// connection that breaks the protocol, or sends a key over 8 KiB or a value over 8 MiB, is
/// closed. Stops when dropped.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The server's keys, and the condition waiters sleep on.
#[derive(Default)]
struct State {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

/// Most connections served at once.
const MAX_CONNECTIONS: usize = 1024;

impl TcpStoreServer {
    /// Listens on `addr` (port 0: any free port) and serves until dropped.
    pub fn start(addr: impl ToSocketAddrs) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::io("binding the TCPStore server", e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("reading the TCPStore server's address", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io("configuring the TCPStore server", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(State::default());
        let open = Arc::new(AtomicUsize::new(0));
        let (stop2, state2) = (stop.clone(), state.clone());
        let thread = std::thread::Builder::new()
            .name(format!("tcpstore-{}", addr.port()))
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((s, _)) if open.load(Ordering::Relaxed) < MAX_CONNECTIONS => {
                            let (state, stop, open) = (state2.clone(), stop2.clone(), open.clone());
                            open.fetch_add(1, Ordering::Relaxed);
                            let spawned = std::thread::Builder::new().name("tcpstore-conn".into()).spawn(move || {
                                if let Err(e) = serve(&s, &state, &stop) {
                                    tracing::debug!(error = %e, "TCPStore connection closed");
                                }
                                open.fetch_sub(1, Ordering::Relaxed);
                            });
                            if spawned.is_err() {
                                tracing::warn!("could not start a thread for a TCPStore connection");
                            }
                        }
                        Ok((s, peer)) => {
                            tracing::warn!(%peer, "too many TCPStore connections; closing one");
                            drop(s);
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
                state2.changed.notify_all();
            })
            .map_err(|e| Error::io("starting the TCPStore server thread", e))?;
        tracing::info!(%addr, "TCPStore server listening");
        Ok(TcpStoreServer { addr, stop, thread: Some(thread) })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
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

/// Reads exactly `buf.len()` bytes, giving up when the server stops; `Ok(false)` at a clean
/// end of the connection before the first byte.
fn read_exact(s: &TcpStream, buf: &mut [u8], stop: &AtomicBool, first: bool) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        if stop.load(Ordering::Relaxed) {
            return Err(std::io::Error::other("the server is stopping"));
        }
        match (&*s).read(&mut buf[got..]) {
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

fn read_u64(s: &TcpStream, stop: &AtomicBool) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    read_exact(s, &mut b, stop, false)?;
    Ok(u64::from_le_bytes(b))
}

fn read_field(s: &TcpStream, stop: &AtomicBool, max: usize, what: &str) -> std::io::Result<Vec<u8>> {
    let n = read_u64(s, stop)?;
    if n > max as u64 {
        return Err(std::io::Error::other(format!("a {what} of {n} bytes (at most {max})")));
    }
    let mut v = vec![0u8; n as usize];
    read_exact(s, &mut v, stop, false)?;
    Ok(v)
}

fn read_keys(s: &TcpStream, stop: &AtomicBool) -> std::io::Result<Vec<Vec<u8>>> {
    let n = read_u64(s, stop)?;
    if n > MAX_KEYS as u64 {
        return Err(std::io::Error::other(format!("{n} keys in one request")));
    }
    (0..n).map(|_| read_field(s, stop, MAX_KEY, "key")).collect()
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// Serves one connection until it closes or breaks the protocol.
fn serve(s: &TcpStream, st: &State, stop: &AtomicBool) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_millis(100)))?;
    let _ = s.set_nodelay(true);
    let mut validated = false;
    loop {
        let mut op = [0u8];
        if !read_exact(s, &mut op, stop, true)? {
            return Ok(());
        }
        if !validated && op[0] != VALIDATE {
            return Err(std::io::Error::other("a request before the validation"));
        }
        let mut out = Vec::new();
        match op[0] {
            VALIDATE => {
                let mut m = [0u8; 4];
                read_exact(s, &mut m, stop, false)?;
                if u32::from_le_bytes(m) != MAGIC {
                    return Err(std::io::Error::other("a wrong validation number"));
                }
                validated = true;
                continue;
            }
            PING => {
                let mut n = [0u8; 4];
                read_exact(s, &mut n, stop, false)?;
                out.extend_from_slice(&n);
            }
            SET | APPEND => {
                let k = read_field(s, stop, MAX_KEY, "key")?;
                let v = read_field(s, stop, MAX_VALUE, "value")?;
                let mut m = crate::sync::lock(&st.map);
                if op[0] == SET {
                    m.insert(k, v);
                } else {
                    m.entry(k).or_default().extend_from_slice(&v);
                }
                st.changed.notify_all();
            }
            COMPARE_SET => {
                let k = read_field(s, stop, MAX_KEY, "key")?;
                let expected = read_field(s, stop, MAX_VALUE, "value")?;
                let desired = read_field(s, stop, MAX_VALUE, "value")?;
                let mut m = crate::sync::lock(&st.map);
                let now = match m.get(&k) {
                    None if expected.is_empty() => {
                        m.insert(k, desired.clone());
                        st.changed.notify_all();
                        desired
                    }
                    None => expected,
                    Some(v) if *v == expected => {
                        m.insert(k, desired.clone());
                        st.changed.notify_all();
                        desired
                    }
                    Some(v) => v.clone(),
                };
                put_bytes(&mut out, &now);
            }
            GET => {
                let k = read_field(s, stop, MAX_KEY, "key")?;
                let v = crate::sync::lock(&st.map).get(&k).cloned().unwrap_or_default();
                put_bytes(&mut out, &v);
            }
            ADD => {
                let k = read_field(s, stop, MAX_KEY, "key")?;
                let delta = read_u64(s, stop)? as i64;
                let mut m = crate::sync::lock(&st.map);
                let old = match m.get(&k) {
                    None => 0,
                    Some(v) => std::str::from_utf8(v)
                        .ok()
                        .and_then(|t| t.trim().parse::<i64>().ok())
                        .ok_or_else(|| std::io::Error::other("ADD to a value that is not a number"))?,
                };
                let new = old.wrapping_add(delta);
                m.insert(k, new.to_string().into_bytes());
                st.changed.notify_all();
                out.extend_from_slice(&new.to_le_bytes());
            }
            CHECK => {
                let keys = read_keys(s, stop)?;
                let m = crate::sync::lock(&st.map);
                out.push(if keys.iter().all(|k| m.contains_key(k)) { READY } else { NOT_READY });
            }
            WAIT => {
                let keys = read_keys(s, stop)?;
                // Sends STOP_WAITING once every key exists, or answers a CANCEL_WAIT.
                if !wait(s, st, stop, &keys)? {
                    (&*s).write_all(&[WAIT_CANCELED])?;
                    continue;
                }
                out.push(STOP_WAITING);
            }
            GETNUMKEYS => {
                let n = crate::sync::lock(&st.map).len() as i64;
                out.extend_from_slice(&n.to_le_bytes());
            }
            DELETE_KEY => {
                let k = read_field(s, stop, MAX_KEY, "key")?;
                let gone = crate::sync::lock(&st.map).remove(&k).is_some();
                out.extend_from_slice(&i64::from(gone).to_le_bytes());
            }
            MULTI_GET => {
                let keys = read_keys(s, stop)?;
                let m = crate::sync::lock(&st.map);
                for k in &keys {
                    put_bytes(&mut out, m.get(k).map_or(&[][..], |v| v.as_slice()));
                }
            }
            MULTI_SET => {
                let n = read_u64(s, stop)?;
                if n > MAX_KEYS as u64 {
                    return Err(std::io::Error::other(format!("{n} keys in one request")));
                }
                let mut pairs = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    pairs.push((read_field(s, stop, MAX_KEY, "key")?, read_field(s, stop, MAX_VALUE, "value")?));
                }
                crate::sync::lock(&st.map).extend(pairs);
                st.changed.notify_all();
            }
            CANCEL_WAIT => out.push(WAIT_CANCELED),
            LIST_KEYS => {
                let m = crate::sync::lock(&st.map);
                out.extend_from_slice(&(m.len() as i64).to_le_bytes());
                for k in m.keys() {
                    put_bytes(&mut out, k);
                }
            }
            other => return Err(std::io::Error::other(format!("unknown request {other}"))),
        }
        if !out.is_empty() {
            (&*s).write_all(&out)?;
        }
    }
}

/// Waits until `keys` all exist (true) or the client cancels the wait (false).
fn wait(s: &TcpStream, st: &State, stop: &AtomicBool, keys: &[Vec<u8>]) -> std::io::Result<bool> {
    let mut m = crate::sync::lock(&st.map);
    loop {
        if keys.iter().all(|k| m.contains_key(k)) {
            return Ok(true);
        }
        if stop.load(Ordering::Relaxed) {
            return Err(std::io::Error::other("the server is stopping"));
        }
        m = crate::sync::wait_timeout(&st.changed, m, Duration::from_millis(50));
        // A client that gives up sends CANCEL_WAIT (or goes away): look without blocking.
        drop(m);
        let mut b = [0u8];
        s.set_nonblocking(true)?;
        let peek = s.peek(&mut b);
        s.set_nonblocking(false)?;
        match peek {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) if b[0] == CANCEL_WAIT => {
                read_exact(s, &mut b, stop, false)?;
                return Ok(false);
            }
            Ok(_) => return Err(std::io::Error::other("a request while a wait is pending")),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        m = crate::sync::lock(&st.map);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let waiter = std::thread::spawn(move || b.get("late", Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(100));
        let c = TcpStore::connect(&addr, "job", Duration::from_secs(5)).unwrap();
        c.set("late", b"here").unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), b"here");
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
}
