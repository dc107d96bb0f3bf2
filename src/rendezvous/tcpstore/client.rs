//! The TCPStore client, [`TcpStore`]: a pool of validated connections to a PyTorch TCPStore
//! server, each request sent and its reply read through the `wire` types with a deadline.

use super::wire::{Decoded, MAGIC, Request, Response, ResponseDecoder, Shape, WireError};
use crate::error::{Error, Result};
use crate::rendezvous::{Backoff, Store, missing_keys, parse_counter};
use crate::sync::lock;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most idle connections a [`TcpStore`] keeps for later requests.
const MAX_IDLE: usize = 4;
/// Most bytes read from the socket at once while a reply arrives.
const READ_CHUNK: usize = 64 << 10;

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

/// The bytes of `requests`, one after another, to send at once.
fn encode(requests: &[Request<&[u8]>]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in requests {
        r.encode(&mut out);
    }
    out
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

    /// The server's answer broke the protocol: `detail` says how.
    fn protocol(&self, detail: impl std::fmt::Display) -> Error {
        Error::Protocol { peer: None, detail: format!("{} {detail}", self.addr) }
    }

    /// A reply the protocol does not allow.
    fn bad_reply(&self, e: WireError) -> Error {
        self.protocol(format_args!("sent a reply the protocol does not allow: {}", e.detail))
    }

    /// A new, validated connection. A server that closes it during the handshake (one at its
    /// connection limit, or one still starting) is tried again until `deadline`.
    fn open(&self, deadline: Instant) -> Result<TcpStream> {
        let addrs: Vec<SocketAddr> = self.addr.to_socket_addrs().map_err(|e| self.io("resolving", e))?.collect();
        if addrs.is_empty() {
            return Err(Error::invalid(format!("{} resolves to no address", self.addr)));
        }
        let mut backoff = Backoff::new();
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
        let nonce = std::process::id();
        self.send(stream, &encode(&[Request::Validate { magic: MAGIC }, Request::Ping { nonce }]), deadline)?;
        match self.reply(stream, Shape::Pong, deadline)? {
            Response::Pong(n) if n == nonce => Ok(()),
            r => Err(self.protocol(format_args!("answered the ping with {r:?}: not a PyTorch TCPStore"))),
        }
    }

    fn connect_any(&self, addrs: &[SocketAddr], deadline: Instant) -> Result<TcpStream> {
        let mut backoff = Backoff::new();
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

    /// Reads some bytes into `buf` (at least one), by `deadline`.
    fn recv_some(&self, s: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<usize> {
        loop {
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
            match (&*s).read(buf) {
                Ok(0) => {
                    return Err(self.io(
                        "reading from",
                        std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "it closed the connection"),
                    ));
                }
                Ok(n) => return Ok(n),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io("reading from", e)),
            }
        }
    }

    /// Reads the reply, of `shape`, to a request sent on `s`, by `deadline`. Reads no byte past
    /// it: the decoder never asks for more than the rest of the reply.
    fn reply(&self, s: &TcpStream, shape: Shape, deadline: Instant) -> Result<Response> {
        let mut decoder = ResponseDecoder::new(shape);
        let mut buf = Vec::new();
        let mut got = 0;
        loop {
            match decoder.decode(&buf[..got]).map_err(|e| self.bad_reply(e))? {
                Decoded::Done(r, _) => return Ok(r),
                Decoded::NeedMore(n) => {
                    buf.resize(n.min(READ_CHUNK), 0);
                    got = self.recv_some(s, &mut buf, deadline)?;
                }
            }
        }
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

    /// Sends the bytes `req` (`what` names the request in errors) and reads its reply with
    /// `read`, on an idle connection or a new one. The connection is kept for later requests
    /// once the exchange went through, and dropped after any failure (its state is unknown).
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

    /// [`call`](Self::call) for `reqs`, of which the last gets the reply (the others none),
    /// which `take` turns into the result, or gives back when it is not the one expected.
    fn ask<R>(
        &self,
        what: &str,
        reqs: &[Request<&[u8]>],
        idempotent: bool,
        take: impl Fn(Response) -> std::result::Result<R, Response>,
    ) -> Result<R> {
        let Some(shape) = reqs.last().and_then(Request::shape) else {
            return Err(Error::invalid(format!("{what} gets no reply to wait for")));
        };
        self.call(what, &encode(reqs), idempotent, |s, d| {
            take(self.reply(s, shape, d)?).map_err(|r| self.protocol(format_args!("answered with {r:?}")))
        })
    }

    /// A value, from the reply to GET or COMPARE_SET.
    fn value(r: Response) -> std::result::Result<Vec<u8>, Response> {
        if let Response::Value(v) = r { Ok(v) } else { Err(r) }
    }

    /// An integer, from the reply to ADD or DELETE_KEY.
    fn int(r: Response) -> std::result::Result<i64, Response> {
        if let Response::Int(n) = r { Ok(n) } else { Err(r) }
    }

    /// COMPARE_SET: sets `key` to `desired` if it holds `expected` (or is missing and
    /// `expected` is empty); returns the value it holds afterwards.
    pub fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let wire = self.wire(key);
        let what = format!("COMPARE_SET of key {key:?} ({} and {} bytes)", expected.len(), desired.len());
        self.ask(&what, &[Request::CompareSet { key: &wire, expected, desired }], false, Self::value)
    }

    /// Waits until `keys` all exist, or `timeout`; takes the wait back when it times out.
    fn wait_keys(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let wire: Vec<Vec<u8>> = keys.iter().map(|k| self.wire(k)).collect();
        let req = encode(&[Request::Wait { keys: wire.iter().map(Vec::as_slice).collect() }]);
        let until = Instant::now() + timeout;
        let what = format!("WAIT for keys {keys:?}");
        let ready = self.call(&what, &req, true, |s, _| match self.reply(s, Shape::Wait, until) {
            Ok(Response::WaitDone) => Ok(true),
            Ok(r) => Err(self.protocol(format_args!("answered a wait with {r:?}"))),
            Err(Error::Timeout { .. }) => {
                // Take the wait back, on a deadline of its own: the wait's has passed. The
                // answer is WAIT_CANCELED, maybe after a late STOP_WAITING.
                let d = Instant::now() + self.timeout;
                self.send(s, &encode(&[Request::CancelWait]), d)?;
                let mut r = self.reply(s, Shape::Wait, d)?;
                let ready = r == Response::WaitDone;
                if ready {
                    r = self.reply(s, Shape::Wait, d)?;
                }
                if r != Response::WaitCanceled {
                    return Err(self.protocol(format_args!("answered CANCEL_WAIT with {r:?}")));
                }
                Ok(ready)
            }
            Err(e) => Err(e),
        })?;
        if ready {
            return Ok(());
        }
        // The error names the keys still missing (a CHECK each: WAIT does not say which), or all
        // of them when none is, or when the CHECKs fail.
        let mut missing: Vec<String> = Vec::new();
        if keys.len() > 1 {
            missing = keys.iter().filter(|k| !matches!(self.exists(k), Ok(true))).map(|k| k.to_string()).collect();
        }
        if missing.is_empty() {
            missing = keys.iter().map(|k| k.to_string()).collect();
        }
        Err(missing_keys(&format!("store wait in the TCPStore at {}", self.addr), missing, timeout))
    }

    /// CHECK of one key: whether it exists now.
    fn exists(&self, key: &str) -> Result<bool> {
        let wire = self.wire(key);
        let check = [Request::Check { keys: vec![&wire[..]] }];
        self.ask(&format!("CHECK of key {key:?}"), &check, true, |r| match r {
            Response::Check(ready) => Ok(ready),
            r => Err(r),
        })
    }

    /// GET of a key known to exist.
    fn get_now(&self, key: &str) -> Result<Vec<u8>> {
        let wire = self.wire(key);
        self.ask(&format!("GET of key {key:?}"), &[Request::Get { key: &wire }], true, Self::value)
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        // SET has no reply. The PING sent behind it is answered once the server has applied
        // it, so the value is there for every request made after `set` returns, on any
        // connection, and a server that refuses it (closing the connection) is an error here.
        let (wire, nonce) = (self.wire(key), std::process::id());
        let what = format!("SET of key {key:?} ({} bytes)", value.len());
        let reqs = [Request::Set { key: &wire[..], value }, Request::Ping { nonce }];
        self.ask(&what, &reqs, false, |r| if r == Response::Pong(nonce) { Ok(()) } else { Err(r) })
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        if !self.exists(key)? {
            return Ok(None);
        }
        self.get_now(key).map(Some)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let wire = self.wire(key);
        let what = format!("ADD of {delta} to key {key:?}");
        self.ask(&what, &[Request::Add { key: &wire, delta }], false, Self::int).map_err(|e| {
            // A server closes the connection of an ADD to a value that is not a number: say so,
            // as the other stores do, when that is what the key holds.
            match (&e, self.try_get(key)) {
                (Error::Io { .. }, Ok(Some(v))) => parse_counter(key, &v).err().unwrap_or(e),
                _ => e,
            }
        })
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let wire = self.wire(key);
        let what = format!("DELETE_KEY of key {key:?}");
        Ok(self.ask(&what, &[Request::DeleteKey { key: &wire }], false, Self::int)? != 0)
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

#[cfg(test)]
mod tests {
    use super::super::wire::{ADD, CHECK};
    use super::*;
    use std::net::TcpListener;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

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
        // The ADD was sent once; then CHECKs looked at what the key holds (nothing: the fake
        // closes every connection), so the error stays the lost reply.
        assert_eq!(fake.ops()[0], ADD);
        assert!(fake.ops()[1..].iter().all(|op| *op == CHECK), "the ADD was sent once: {:?}", fake.ops());
    }

    #[test]
    fn a_read_whose_reply_is_lost_is_sent_again() {
        // NOT_READY.
        let fake = Fake::start(|conn, op| (conn > 0 && op == CHECK).then(|| vec![1]));
        let store = TcpStore::connect(&fake.addr.to_string(), "", Duration::from_secs(5)).unwrap();
        assert_eq!(store.try_get("k").unwrap(), None);
        assert_eq!(fake.ops(), [CHECK, CHECK]);
    }

    #[test]
    fn a_reply_the_protocol_does_not_allow_is_an_error_naming_the_server_and_request() {
        // A CHECK answered 7: neither READY nor NOT_READY.
        let fake = Fake::start(|_, _| Some(vec![7]));
        let store = TcpStore::connect(&fake.addr.to_string(), "", Duration::from_secs(5)).unwrap();
        let e = store.try_get("k").unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
        assert!(text.contains(&fake.addr.to_string()) && text.contains("7 answers a CHECK"), "{text}");
        assert!(text.contains("CHECK of key \"k\""), "{text}");
        assert_eq!(fake.ops(), [CHECK], "a broken reply is not a lost one: not sent again");
    }
}
