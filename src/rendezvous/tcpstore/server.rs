//! The TCPStore server, [`TcpStoreServer`]: a thread per connection that reads requests through
//! the `wire` decoder, applies them to the shared entries within their limits and budget, and
//! writes the replies.

use super::wire::{self, Decoded, MAGIC, MAX_VALUE, Request, RequestDecoder, Response, VALIDATE, WireError};
use crate::error::{Error, Result};
use crate::sync::{lock, wait_timeout};
use std::collections::HashMap;
use std::io::{BufWriter, Read};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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
/// Most bytes read from a connection at once.
const READ_CHUNK: usize = 64 << 10;

/// A TCPStore server that PyTorch's clients (and [`TcpStore`](super::TcpStore)) talk to: for a
/// ferrogloo job that hosts the store of a PyTorch one, or the reverse. A thread per
/// connection; stops when dropped.
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
    pub(super) fn set_handshake_timeout(&self, t: Duration) {
        self.state.handshake_ms.store(t.as_millis() as u64, Ordering::Relaxed);
    }

    /// WAIT requests blocked on missing keys now.
    #[cfg(test)]
    pub(super) fn pending_waiters(&self) -> usize {
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

/// What a reply is written from: a key or value shared with the entries, so that it is written
/// with no lock held and no copy made, or nothing (a missing key's value).
enum Held {
    Key(Arc<[u8]>),
    Value(Arc<Vec<u8>>),
    Missing,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        match self {
            Held::Key(k) => k,
            Held::Value(v) => v,
            Held::Missing => &[],
        }
    }
}

impl From<Option<Arc<Vec<u8>>>> for Held {
    fn from(v: Option<Arc<Vec<u8>>>) -> Self {
        v.map_or(Held::Missing, Held::Value)
    }
}

/// One server connection: the client, and what it sent that is not yet applied.
struct Conn<'a> {
    s: &'a TcpStream,
    peer: SocketAddr,
    stop: &'a AtomicBool,
    /// When the client must have validated by, until it has.
    handshake: Option<Instant>,
    decoder: RequestDecoder,
    /// Bytes read and not yet decoded: `buf[at..end]`.
    buf: Vec<u8>,
    at: usize,
    end: usize,
}

impl Conn<'_> {
    /// The next request, or none when the client closed the connection between requests.
    fn next(&mut self) -> std::io::Result<Option<Request>> {
        loop {
            if self.at < self.end {
                let decoded = self.decoder.decode(&self.buf[self.at..self.end]).map_err(|e| self.refuse(e))?;
                match decoded {
                    Decoded::Done(req, used) => {
                        self.at += used;
                        self.validated_before(req.op())?;
                        return Ok(Some(req));
                    }
                    Decoded::NeedMore(_) => self.at = self.end,
                }
                if let Some(op) = self.decoder.op() {
                    self.validated_before(op)?;
                }
            }
            // A clean end of the connection only between requests.
            let between = self.decoder.op().is_none();
            if !self.fill(between)? {
                return Ok(None);
            }
        }
    }

    /// Refuses a request `op` before the client validated.
    fn validated_before(&self, op: u8) -> std::io::Result<()> {
        if self.handshake.is_some() && op != VALIDATE {
            return Err(std::io::Error::other("a request before the validation"));
        }
        Ok(())
    }

    /// Reads what the client sends next, once all read before is decoded, giving up when the
    /// server stops or the handshake time passes; false at the end of the connection when
    /// `between` requests.
    fn fill(&mut self, between: bool) -> std::io::Result<bool> {
        (self.at, self.end) = (0, 0);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Err(std::io::Error::other("the server is stopping"));
            }
            if let Some(by) = self.handshake
                && Instant::now() >= by
            {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no VALIDATE in the handshake time"));
            }
            match (&*self.s).read(&mut self.buf) {
                Ok(0) if between => return Ok(false),
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    self.end = n;
                    return Ok(true);
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the client, whose WAIT is pending, has taken it back with CANCEL_WAIT; looks
    /// without blocking. Anything else it sends is an error.
    fn canceled(&mut self) -> std::io::Result<bool> {
        if self.at == self.end {
            self.s.set_nonblocking(true)?;
            let read = (&*self.s).read(&mut self.buf);
            self.s.set_nonblocking(false)?;
            match read {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => (self.at, self.end) = (0, n),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => {
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        }
        match self.decoder.decode(&self.buf[self.at..self.end]) {
            Ok(Decoded::Done(Request::CancelWait, used)) => {
                self.at += used;
                Ok(true)
            }
            _ => Err(std::io::Error::other("a request while a wait is pending")),
        }
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
            return Err(self.breach(
                op,
                Some(key),
                &format!(
                    "{len} bytes would make the store hold {after} bytes, over its budget of {budget} (it holds {before})"
                ),
            ));
        }
        Ok(())
    }

    /// The error that closes the connection for bytes that break the protocol or, logged, a
    /// limit.
    fn refuse(&self, e: WireError) -> std::io::Error {
        if e.limit {
            return self.breach(e.op, e.key.as_deref(), &e.detail);
        }
        std::io::Error::other(format!("{e} (from {})", self.peer))
    }

    /// Logs a client's breach of a limit, and makes the error that closes its connection.
    fn breach(&self, op: &str, key: Option<&[u8]>, detail: &str) -> std::io::Error {
        let key = key.map_or_else(|| "(not read)".to_string(), wire::show);
        tracing::warn!(peer = %self.peer, op, %key, "a TCPStore client broke a limit; closing its connection: {detail}");
        std::io::Error::other(format!("{op} of key {key} from {}: {detail}", self.peer))
    }
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
    let mut c = Conn {
        s,
        peer,
        stop,
        handshake: Some(handshake),
        decoder: RequestDecoder::new(),
        buf: vec![0; READ_CHUNK],
        at: 0,
        end: 0,
    };
    let mut out = BufWriter::with_capacity(64 << 10, s);
    while let Some(req) = c.next()? {
        if let Some(reply) = apply(&mut c, st, req)? {
            reply.write_to(&mut out)?;
        }
        std::io::Write::flush(&mut out)?;
    }
    Ok(())
}

/// Applies one request of connection `c` to the entries; returns its reply, if it gets one.
fn apply(c: &mut Conn<'_>, st: &State, req: Request) -> std::io::Result<Option<Response<Held>>> {
    let op = req.name();
    Ok(Some(match req {
        Request::Validate { magic } => {
            if magic != MAGIC {
                return Err(std::io::Error::other("a wrong validation number"));
            }
            c.handshake = None;
            return Ok(None);
        }
        Request::Ping { nonce } => Response::Pong(nonce),
        Request::Set { key, value } => {
            let mut m = lock(&st.data);
            c.within_budget(st, op, &key, value.len(), m.bytes, m.bytes_with(&key, value.len()))?;
            m.set(&key, Arc::new(value));
            st.changed.notify_all();
            return Ok(None);
        }
        Request::Append { key, value } => {
            let mut m = lock(&st.data);
            let old = m.map.get(key.as_slice()).map_or(0, |held| held.len());
            let len = old + value.len();
            if len > MAX_VALUE {
                let more = value.len();
                let detail =
                    format!("{more} bytes to a value of {old} would make {len}, over the limit of {MAX_VALUE}");
                return Err(c.breach(op, Some(&key), &detail));
            }
            let after = m.bytes_with(&key, len);
            c.within_budget(st, op, &key, value.len(), m.bytes, after)?;
            m.bytes = after;
            match m.map.get_mut(key.as_slice()) {
                // Copies the value only when a reply is being written from it.
                Some(held) => Arc::make_mut(held).extend_from_slice(&value),
                None => {
                    m.map.insert(Arc::from(key), Arc::new(value));
                }
            }
            st.changed.notify_all();
            return Ok(None);
        }
        Request::CompareSet { key, expected, desired } => {
            let mut m = lock(&st.data);
            let held = m.map.get(key.as_slice()).cloned();
            let swap = held.as_ref().map_or(expected.is_empty(), |v| **v == expected);
            let now = if swap {
                let after = m.bytes_with(&key, desired.len());
                c.within_budget(st, op, &key, desired.len(), m.bytes, after)?;
                let desired = Arc::new(desired);
                m.set(&key, desired.clone());
                st.changed.notify_all();
                desired
            } else {
                held.unwrap_or_else(|| Arc::new(expected))
            };
            Response::Value(Held::Value(now))
        }
        Request::Get { key } => Response::Value(lock(&st.data).map.get(key.as_slice()).cloned().into()),
        Request::Add { key, delta } => {
            let mut m = lock(&st.data);
            let old = match m.map.get(key.as_slice()) {
                None => 0,
                Some(v) => std::str::from_utf8(v).ok().and_then(|t| t.trim().parse::<i64>().ok()).ok_or_else(|| {
                    std::io::Error::other(format!("ADD to key {}, whose value is not a number", wire::show(&key)))
                })?,
            };
            let new = old.wrapping_add(delta);
            let v = new.to_string().into_bytes();
            c.within_budget(st, op, &key, v.len(), m.bytes, m.bytes_with(&key, v.len()))?;
            m.set(&key, Arc::new(v));
            st.changed.notify_all();
            Response::Int(new)
        }
        Request::Check { keys } => {
            let m = lock(&st.data);
            Response::Check(keys.iter().all(|k| m.map.contains_key(k.as_slice())))
        }
        // Answered once every key exists, or WAIT_CANCELED for a CANCEL_WAIT.
        Request::Wait { keys } if wait(c, st, &keys)? => Response::WaitDone,
        Request::Wait { .. } => Response::WaitCanceled,
        Request::GetNumKeys => Response::Int(lock(&st.data).map.len() as i64),
        Request::DeleteKey { key } => Response::Int(i64::from(lock(&st.data).remove(&key))),
        Request::MultiGet { keys } => {
            // The values as they are now, shared, not copied; written one by one.
            let m = lock(&st.data);
            Response::Values(keys.iter().map(|k| m.map.get(k.as_slice()).cloned().into()).collect())
        }
        Request::MultiSet { pairs } => {
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
                c.within_budget(st, op, first, len, before, after)?;
            }
            drop(pending);
            for (k, v) in pairs {
                m.set(&k, Arc::new(v));
            }
            st.changed.notify_all();
            return Ok(None);
        }
        Request::CancelWait => Response::WaitCanceled,
        Request::ListKeys => Response::Keys(lock(&st.data).map.keys().map(|k| Held::Key(k.clone())).collect()),
    }))
}

/// Waits until `keys` all exist (true) or the client cancels the wait (false).
fn wait(c: &mut Conn<'_>, st: &State, keys: &[Vec<u8>]) -> std::io::Result<bool> {
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
        if c.canceled()? {
            return Ok(false);
        }
        m = lock(&st.data);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{closed_by_server, encoded, pings, validated};
    use super::super::wire::{APPEND, MULTI_SET, ResponseDecoder, SET};
    use super::*;
    use crate::codec::Reader;
    use crate::rendezvous::{Store, TcpStore};
    use std::io::Write;

    /// Sends `req` on `s` and reads its reply, when it gets one.
    fn exchange(s: &TcpStream, req: Request<&[u8]>) -> Option<Response> {
        (&*s).write_all(&encoded(&req)).unwrap();
        let mut d = ResponseDecoder::new(req.shape()?);
        let (mut buf, mut got) = (Vec::new(), 0);
        loop {
            match d.decode(&buf[..got]).unwrap() {
                Decoded::Done(r, _) => return Some(r),
                Decoded::NeedMore(n) => {
                    buf.resize(n, 0);
                    got = (&*s).read(&mut buf).unwrap();
                    assert!(got > 0, "the server closed the connection");
                }
            }
        }
    }

    #[test]
    fn every_request_is_served_and_its_reply_decodes() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let s = validated(&server);
        assert_eq!(exchange(&s, Request::Set { key: b"/a", value: b"1" }), None);
        assert_eq!(exchange(&s, Request::Append { key: b"/a", value: b"23" }), None);
        assert_eq!(exchange(&s, Request::MultiSet { pairs: vec![(b"/b", b"x"), (b"/c", b"")] }), None);
        assert_eq!(exchange(&s, Request::Ping { nonce: 77 }), Some(Response::Pong(77)));
        assert_eq!(exchange(&s, Request::Get { key: b"/a" }), Some(Response::Value(b"123".to_vec())));
        assert_eq!(exchange(&s, Request::Get { key: b"/zz" }), Some(Response::Value(vec![])));
        assert_eq!(exchange(&s, Request::Add { key: b"/a", delta: -3 }), Some(Response::Int(120)));
        assert_eq!(exchange(&s, Request::GetNumKeys), Some(Response::Int(3)));
        assert_eq!(exchange(&s, Request::Check { keys: vec![b"/a", b"/c"] }), Some(Response::Check(true)));
        assert_eq!(exchange(&s, Request::Check { keys: vec![b"/a", b"/zz"] }), Some(Response::Check(false)));
        let cas: Request<&[u8]> = Request::CompareSet { key: b"/b", expected: b"x", desired: b"y" };
        assert_eq!(exchange(&s, cas), Some(Response::Value(b"y".to_vec())));
        let cas: Request<&[u8]> = Request::CompareSet { key: b"/new", expected: b"q", desired: b"y" };
        assert_eq!(exchange(&s, cas), Some(Response::Value(b"q".to_vec())), "missing and not swapped");
        let got = exchange(&s, Request::MultiGet { keys: vec![b"/b", b"/zz", b"/a"] });
        assert_eq!(got, Some(Response::Values(vec![b"y".to_vec(), vec![], b"120".to_vec()])));
        let Some(Response::Keys(mut keys)) = exchange(&s, Request::ListKeys) else { panic!("LIST_KEYS") };
        keys.sort();
        assert_eq!(keys, [b"/a".to_vec(), b"/b".to_vec(), b"/c".to_vec()]);
        assert_eq!(exchange(&s, Request::Wait { keys: vec![b"/a"] }), Some(Response::WaitDone));
        assert_eq!(exchange(&s, Request::CancelWait), Some(Response::WaitCanceled));
        assert_eq!(exchange(&s, Request::DeleteKey { key: b"/c" }), Some(Response::Int(1)));
        assert_eq!(exchange(&s, Request::DeleteKey { key: b"/c" }), Some(Response::Int(0)));
    }

    #[test]
    fn requests_sent_a_byte_at_a_time_or_many_at_once_are_served_alike() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        let mut b = encoded(&Request::Validate { magic: MAGIC });
        Request::Set { key: &b"/k"[..], value: b"value" }.encode(&mut b);
        Request::<&[u8]>::Ping { nonce: 9 }.encode(&mut b);
        for byte in &b {
            (&s).write_all(&[*byte]).unwrap();
        }
        let mut echo = [0u8; 4];
        (&s).read_exact(&mut echo).unwrap();
        assert_eq!(Reader::new(&echo).get::<u32>(), Ok(9));
        // Many in one write, each answered in turn.
        let mut many = Vec::new();
        for n in 0..50u32 {
            Request::Add { key: &b"/n"[..], delta: 1 }.encode(&mut many);
            Request::<&[u8]>::Ping { nonce: n }.encode(&mut many);
        }
        (&s).write_all(&many).unwrap();
        for n in 0..50u32 {
            let mut reply = [0u8; 12];
            (&s).read_exact(&mut reply).unwrap();
            let mut r = Reader::new(&reply);
            assert_eq!((r.get::<i64>(), r.get::<u32>()), (Ok(i64::from(n) + 1), Ok(n)));
        }
        assert_eq!(exchange(&s, Request::Get { key: b"/k" }), Some(Response::Value(b"value".to_vec())));
    }

    #[test]
    fn a_request_before_validation_is_refused_as_soon_as_its_opcode_arrives() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t = Instant::now();
        (&s).write_all(&[SET]).unwrap();
        assert!(closed_by_server(&s));
        assert!(t.elapsed() < HANDSHAKE_TIMEOUT / 2, "closed after {:?}, not at once", t.elapsed());
    }

    #[test]
    fn multi_get_writes_a_value_named_many_times_as_it_goes() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let store = TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(5)).unwrap();
        let big: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        store.set("big", &big).unwrap();
        let s = validated(&server);
        let copies = 300;
        let mut keys = vec![&b"/big"[..]; copies];
        keys.push(b"/none");
        (&s).write_all(&encoded(&Request::MultiGet { keys })).unwrap();
        let (mut len, mut v) = ([0u8; 8], vec![0u8; big.len()]);
        for _ in 0..copies {
            (&s).read_exact(&mut len).unwrap();
            assert_eq!(Reader::new(&len).get::<u64>(), Ok(big.len() as u64));
            (&s).read_exact(&mut v).unwrap();
            assert!(v == big);
        }
        (&s).read_exact(&mut len).unwrap();
        assert_eq!(Reader::new(&len).get::<u64>(), Ok(0), "a missing key reads as empty");
        assert!(pings(&s), "the connection goes on");
    }

    #[test]
    fn append_past_the_value_limit_closes_the_connection() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let s = validated(&server);
        let five = vec![7u8; 5 << 20];
        let append = encoded(&Request::Append { key: &b"/a"[..], value: &five });
        assert_eq!(append[0], APPEND);
        (&s).write_all(&append).unwrap();
        assert!(pings(&s), "an append within the limit");
        let _ = (&s).write_all(&append);
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
        let names: Vec<String> = (0..9).map(|i| format!("/m{i}")).collect();
        let pairs = names.iter().map(|k| (k.as_bytes(), &full[..])).collect();
        let over = encoded(&Request::MultiSet { pairs });
        assert_eq!(over[0], MULTI_SET);
        let _ = (&s).write_all(&over);
        assert!(closed_by_server(&s));
        assert_eq!(store.try_get("m0").unwrap(), None, "nothing of it was applied");
        let s = validated(&server);
        (&s).write_all(&encoded(&Request::MultiSet { pairs: vec![(b"/x", b"1"), (b"/y", &full)] })).unwrap();
        assert!(pings(&s));
        assert_eq!(store.try_get("y").unwrap().map(|v| v.len()), Some(MAX_VALUE));
    }
}
