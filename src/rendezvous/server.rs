//! ferrogloo's own HTTP rendezvous server (Horovod's protocol plus atomic add), on hyper.
//!
//! Every request is bounded before anything is read or allocated for it: headers by size and
//! time, a body by its declared length (checked against the value limit first: nothing is sized
//! by what a client declares) and by time, connections by count. A request over a limit gets
//! its status and the connection is closed, not drained; the server goes on serving the others.

use super::{checked_add, parse_counter};
use crate::codec::{DecodeError, Decoded, Reader};
use crate::error::{Error, Result};
use crate::sync::lock;
use bytes::{BufMut, Bytes};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The journal is rewritten when it is this much larger than the entries it describes.
const COMPACT_SLACK: u64 = 1 << 20;

type Key = (String, String);
type Data = Mutex<State>;

/// What a [`HttpStoreServer`] accepts, each limit with its default. A request beyond one gets a
/// status that says which (and its connection is closed); the server goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLimits {
    /// Largest value (request body): 16 MiB. Beyond: `413 Payload Too Large`, without reading
    /// the body.
    pub max_value: usize,
    /// Most keys in one scope: 65,536. A new key beyond: `507 Insufficient Storage`.
    pub max_keys_per_scope: usize,
    /// Most bytes of keys and values held in all: 1 GiB. Beyond: `507 Insufficient Storage`.
    pub max_total_bytes: usize,
    /// Most connections open at once: 1,024. Beyond: `503 Service Unavailable`, then closed.
    pub max_connections: usize,
    /// Time a connection has to send a request's headers (also the idle time allowed between
    /// requests of a kept-alive connection): 10 s. Then it is closed.
    pub header_timeout: Duration,
    /// Time a request has to send its whole body once its headers are in: 30 s. Beyond:
    /// `408 Request Timeout`.
    pub body_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_value: 16 << 20,
            max_keys_per_scope: 1 << 16,
            max_total_bytes: 1 << 30,
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
        }
    }
}

/// Largest request head (request line and headers) read: beyond it, `431`.
const MAX_HEAD: usize = 16 << 10;

/// The server's entries, and the journal that makes them outlive the process (if any).
#[derive(Default)]
struct State {
    map: HashMap<Key, Vec<u8>>,
    journal: Option<Journal>,
    /// Keys held per scope, and bytes of keys and values held in all.
    per_scope: HashMap<String, usize>,
    bytes: usize,
}

/// An embedded HTTP rendezvous server speaking the protocol of Horovod's `RendezvousServer`
/// (`PUT`/`GET`/`DELETE /<scope>/<key>`), plus `POST /<scope>/<key>` with a decimal delta as
/// body, an atomic add that answers the new value. [`HttpStore`](super::HttpStore) talks to it.
///
/// Start it from code (it serves until dropped) or from the command line with the
/// `ferrogloo-store-server` binary. It keeps serving whatever clients send: see
/// [`ServerLimits`].
///
/// **Restarts.** [`start`](Self::start) keeps its entries in memory only (as Horovod's server
/// does): a restarted server has forgotten every rank's entry, so a job mid-rendezvous times
/// out. [`start_with_journal`](Self::start_with_journal) also appends every change to a file
/// before answering it, and a server started again on the same file (and port) carries on
/// where the old one stopped: clients retry connection failures until their deadline, so a
/// rendezvous survives the server being killed and restarted under it.
///
/// ```
/// use ferrogloo::rendezvous::{HttpStore, HttpStoreServer, Store};
/// use std::time::Duration;
/// let server = HttpStoreServer::start("127.0.0.1:0").unwrap();
/// let store = HttpStore::new(&server.base_url(), "job", Duration::from_secs(5)).unwrap();
/// store.set("k", b"v").unwrap();
/// assert_eq!(store.add("n", 2).unwrap(), 2);
/// assert_eq!(store.try_get("k").unwrap().as_deref(), Some(&b"v"[..]));
/// ```
pub struct HttpStoreServer {
    addr: SocketAddr,
    authenticated: bool,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for HttpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpStoreServer").field("addr", &self.addr).field("authenticated", &self.authenticated).finish()
    }
}

impl HttpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving in a background thread, with
    /// the default [`ServerLimits`]. The entries live in memory only.
    pub fn start(addr: impl ToSocketAddrs) -> Result<Self> {
        Self::start_with(addr, ServerLimits::default(), None)
    }

    /// Like [`start`](Self::start), with the entries kept in the journal file `path` as well:
    /// the entries a journal already holds (left by an earlier server) are served again, and
    /// every change is written to it before the request is answered. A record cut short by a
    /// crash is dropped; the file is compacted at start and whenever it grows well past its
    /// live entries. Writes reach the operating system, not the disk (no `fsync` per request):
    /// the entries survive the server process dying, not the machine.
    pub fn start_with_journal(addr: impl ToSocketAddrs, path: impl AsRef<Path>) -> Result<Self> {
        Self::start_with(addr, ServerLimits::default(), Some(path.as_ref()))
    }

    /// The server on `addr` with `limits`, and a journal at `journal` when given (see
    /// [`start_with_journal`](Self::start_with_journal)).
    pub fn start_with(addr: impl ToSocketAddrs, limits: ServerLimits, journal: Option<&Path>) -> Result<Self> {
        Self::start_authenticated(addr, limits, journal, None)
    }

    /// [`start_with`](Self::start_with), and with a `token` every request must carry as
    /// `Authorization: Bearer <token>`: one without it, or with another token, is answered
    /// `401 Unauthorized` (its body unread, its connection closed) and nothing else. Tokens are
    /// compared in constant time. Give clients the token with
    /// [`HttpStore::with_token`](super::HttpStore::with_token) (or `FERROGLOO_STORE_TOKEN_FILE`,
    /// see [`credentials`](crate::credentials)). `None` serves anyone, as Horovod's server does.
    ///
    /// ```
    /// use ferrogloo::rendezvous::{HttpStore, HttpStoreServer, ServerLimits, Store};
    /// use std::time::Duration;
    /// let server = HttpStoreServer::start_authenticated("127.0.0.1:0", ServerLimits::default(), None, Some("t0k3n"))?;
    /// let base = server.base_url();
    /// let store = HttpStore::new(&base, "job", Duration::from_secs(5))?.with_token("t0k3n")?;
    /// store.set("k", b"v")?;
    /// let stranger = HttpStore::new(&base, "job", Duration::from_secs(5))?;
    /// assert!(stranger.try_get("k").is_err());
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn start_authenticated(
        addr: impl ToSocketAddrs,
        limits: ServerLimits,
        journal: Option<&Path>,
        token: Option<&str>,
    ) -> Result<Self> {
        let token = token
            .map(|t| crate::credentials::check_token(t, "the store server's token").map(|t| digest(t.as_bytes())))
            .transpose()?;
        let mut state = State::default();
        if let Some(path) = journal {
            let (journal, map) = Journal::open(path)?;
            for (id, v) in &map {
                *state.per_scope.entry(id.0.clone()).or_insert(0) += 1;
                state.bytes += id.1.len() + v.len();
            }
            state.map = map;
            state.journal = Some(journal);
        }
        let addr = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("resolving the store server address", e))?
            .next()
            .ok_or_else(|| Error::invalid("store server address resolves to nothing"))?;
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::io(format!("binding the store server on {addr}"), e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("reading the store server's address", e))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| Error::io("starting the store server's runtime", e))?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let data = Arc::new(Mutex::new(state));
        let authenticated = token.is_some();
        let rules = Arc::new(Rules { limits, token });
        let thread = std::thread::Builder::new()
            .name("ferrogloo-store".into())
            .spawn(move || runtime.block_on(serve(listener, data, rules, stopped)))
            .map_err(|e| Error::io("spawning the store server thread", e))?;
        tracing::info!(%addr, authenticated, "ferrogloo store server listening");
        Ok(HttpStoreServer { addr, authenticated, stop: Some(stop), thread: Some(thread) })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://HOST:PORT`, the base URL for [`HttpStore::new`](super::HttpStore::new).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A store URL for [`open`](super::open): `http://HOST:PORT/SCOPE`.
    pub fn store_url(&self, scope: &str) -> String {
        format!("{}/{}", self.base_url(), scope)
    }
}

impl Drop for HttpStoreServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What every request is held to: the limits, and the token it must carry (its digest).
struct Rules {
    limits: ServerLimits,
    token: Option<[u8; 32]>,
}

/// SHA-256 of `bytes`: tokens are compared as digests, so the comparison takes the same time
/// whatever the token sent, its length included.
fn digest(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// Whether `req` carries the token whose digest is `want` (`Authorization: Bearer <token>`, the
/// scheme's name in any case), compared in constant time.
fn authorized(req: &Request<Incoming>, want: &[u8; 32]) -> bool {
    let sent = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    let got = digest(sent.unwrap_or("").as_bytes());
    let same = got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
    sent.is_some() && same
}

/// Accepts connections until `stopped`, each served on its own task within the limits.
async fn serve(
    listener: std::net::TcpListener,
    data: Arc<Data>,
    rules: Arc<Rules>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let limits = &rules.limits;
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "store server cannot listen; it stops");
            return;
        }
    };
    let open = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(MAX_HEAD.max(8192))
        .keep_alive(true);
    let http = Arc::new(http);
    loop {
        let (stream, from) = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: say so, and let the backlog wait a little.
                    tracing::warn!(error = %e, "store server accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            // Too many open: a short answer, best effort, and the connection goes.
            let _ =
                stream.try_write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            tracing::warn!(%from, limit = limits.max_connections, "store server refused a connection: too many open");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (data, rules, http) = (data.clone(), rules.clone(), http.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let (data, rules) = (data.clone(), rules.clone());
                async move { Ok::<_, std::convert::Infallible>(handle(req, &data, &rules).await) }
            });
            if let Err(e) = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service).await {
                tracing::debug!(%from, error = %e, "store server connection ended");
            }
            drop(permit);
        });
    }
}

/// An answer: its status and body; `close` asks for the connection to be closed after it
/// (a request whose body was not read is never drained).
fn reply(status: u16, body: impl Into<Bytes>, close: bool) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if close {
        r.headers_mut().insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
    }
    r
}

async fn handle(req: Request<Incoming>, data: &Data, rules: &Rules) -> Response<Full<Bytes>> {
    let limits = &rules.limits;
    if let Some(want) = &rules.token
        && !authorized(&req, want)
    {
        // Nothing about the store, and the body (if any) unread.
        let mut r = reply(401, "this store wants the job's bearer token", true);
        r.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
        return r;
    }
    let path = req.uri().path().to_string();
    let parts: Vec<&str> = path.split('/').collect();
    let [_, scope, key] = parts[..] else {
        return reply(400, "path must be /<scope>/<key>", false);
    };
    if scope.is_empty() || key.is_empty() {
        return reply(400, "path must be /<scope>/<key>", false);
    }
    let id = (scope.to_string(), key.to_string());
    let method = req.method().clone();
    let body = if method == Method::PUT || method == Method::POST {
        match read_body(req, limits).await {
            Ok(b) => b,
            Err(r) => return r,
        }
    } else {
        Vec::new()
    };
    match method {
        Method::GET => match lock(data).map.get(&id) {
            Some(v) => reply(200, v.clone(), false),
            None => reply(404, Bytes::new(), false),
        },
        Method::PUT => match lock(data).set(id, body, limits) {
            Ok(()) => reply(200, Bytes::new(), false),
            Err((status, why)) => reply(status, why, false),
        },
        Method::DELETE => match lock(data).delete(id) {
            Ok(()) => reply(200, Bytes::new(), false),
            Err((status, why)) => reply(status, why, false),
        },
        Method::POST => {
            let shown = format!("{scope}/{key}");
            let mut state = lock(data);
            let result = parse_counter(&shown, &body).and_then(|delta| {
                let old = state.map.get(&id).map(|v| parse_counter(&shown, v)).transpose()?.unwrap_or(0);
                checked_add(&shown, old, delta)
            });
            match result {
                Ok(new) => match state.set(id, new.to_string().into_bytes(), limits) {
                    Ok(()) => reply(200, new.to_string(), false),
                    Err((status, why)) => reply(status, why, false),
                },
                // 409: the key holds something add cannot apply to (the request itself is fine).
                Err(e) => reply(409, e.to_string(), false),
            }
        }
        _ => reply(501, "only GET, PUT, DELETE and POST", false),
    }
}

/// Reads a request body that must declare its length, within the value limit and the body
/// timeout. Nothing is allocated before the declared length is checked, and only what arrives
/// is kept.
async fn read_body(
    req: Request<Incoming>,
    limits: &ServerLimits,
) -> std::result::Result<Vec<u8>, Response<Full<Bytes>>> {
    let declared = req.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let Some(len) = declared else {
        return Err(reply(411, "a Content-Length is required", true));
    };
    if len > limits.max_value as u64 {
        let why = format!("a value of {len} bytes is over this server's limit of {}", limits.max_value);
        return Err(reply(413, why, true));
    }
    let body = Limited::new(req.into_body(), limits.max_value);
    match tokio::time::timeout(limits.body_timeout, body.collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes().to_vec()),
        Ok(Err(e)) => Err(reply(400, format!("the body could not be read: {e}"), true)),
        Err(_) => Err(reply(408, format!("the body did not arrive within {:?}", limits.body_timeout), true)),
    }
}

impl State {
    /// Sets `id` to `value` (journal first), within the limits; `Err` is the status to answer
    /// and why.
    fn set(&mut self, id: Key, value: Vec<u8>, limits: &ServerLimits) -> std::result::Result<(), (u16, String)> {
        let old = self.map.get(&id).map(Vec::len);
        if old.is_none() && self.per_scope.get(&id.0).copied().unwrap_or(0) >= limits.max_keys_per_scope {
            return Err((
                507,
                format!("scope {:?} holds {} keys, this server's limit", id.0, limits.max_keys_per_scope),
            ));
        }
        let grown = self.bytes - old.map_or(0, |o| o + id.1.len()) + id.1.len() + value.len();
        if grown > limits.max_total_bytes {
            return Err((
                507,
                format!("this server holds at most {} bytes of keys and values", limits.max_total_bytes),
            ));
        }
        if let Some(j) = &mut self.journal {
            let old = old.map(|len| Journal::record_len(&id, len));
            j.append(Op::Set, &id, &value, old, &self.map)
                .map_err(|s| (s, "the journal could not be written".into()))?;
        }
        if old.is_none() {
            *self.per_scope.entry(id.0.clone()).or_insert(0) += 1;
        }
        self.bytes = grown;
        self.map.insert(id, value);
        Ok(())
    }

    /// Deletes `id` (journal first); `Err` is the status to answer and why.
    fn delete(&mut self, id: Key) -> std::result::Result<(), (u16, String)> {
        let Some(old) = self.map.get(&id) else { return Ok(()) };
        let old_len = old.len();
        if let Some(j) = &mut self.journal {
            let old = Some(Journal::record_len(&id, old_len));
            j.append(Op::Delete, &id, &[], old, &self.map)
                .map_err(|s| (s, "the journal could not be written".into()))?;
        }
        self.bytes -= id.1.len() + old_len;
        if let Some(n) = self.per_scope.get_mut(&id.0) {
            *n -= 1;
            if *n == 0 {
                self.per_scope.remove(&id.0);
            }
        }
        self.map.remove(&id);
        Ok(())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Set = b'S' as isize,
    Delete = b'D' as isize,
}

/// An append-only file of changes. A record is one tag byte (`S` set, `D` delete), the
/// little-endian `u32` lengths of scope, key and value, then those bytes.
struct Journal {
    path: PathBuf,
    file: File,
    /// Bytes in the file.
    bytes: u64,
    /// Bytes the live entries take as records: what a compacted file holds.
    live: u64,
}

impl Journal {
    const HEADER: usize = 13;

    fn record_len(id: &Key, value_len: usize) -> u64 {
        (Self::HEADER + id.0.len() + id.1.len() + value_len) as u64
    }

    fn encode(out: &mut Vec<u8>, op: Op, id: &Key, value: &[u8]) {
        out.put_u8(op as u8);
        for len in [id.0.len(), id.1.len(), value.len()] {
            // Scope and key come from a request line and values are capped by the server's limit.
            out.put_u32_le(len as u32);
        }
        out.put_slice(id.0.as_bytes());
        out.put_slice(id.1.as_bytes());
        out.put_slice(value);
    }

    /// Reads one record: an entry and its value, set, or none, deleted.
    fn record(r: &mut Reader<'_>) -> Decoded<(Key, Option<Vec<u8>>)> {
        let tag = r.get::<u8>()?;
        let (s, k, v) = (r.get::<u32>()? as usize, r.get::<u32>()? as usize, r.get::<u32>()? as usize);
        let text = |b: &[u8]| {
            std::str::from_utf8(b).map(str::to_string).map_err(|_| DecodeError::malformed("a name that is not UTF-8"))
        };
        let id = (text(r.bytes(s)?)?, text(r.bytes(k)?)?);
        let value = r.bytes(v)?;
        match tag {
            b'S' => Ok((id, Some(value.to_vec()))),
            b'D' => Ok((id, None)),
            _ => Err(DecodeError::malformed(format!("an unknown record tag {tag}"))),
        }
    }

    /// Replays the entries of `bytes`, stopping at the first record that is cut short or
    /// malformed (what a crash in the middle of an append leaves).
    fn replay(bytes: &[u8]) -> HashMap<Key, Vec<u8>> {
        let mut map = HashMap::new();
        let mut r = Reader::new(bytes);
        loop {
            let mut next = r.clone();
            match Self::record(&mut next) {
                Ok((id, Some(value))) => map.insert(id, value),
                Ok((id, None)) => map.remove(&id),
                Err(_) => break,
            };
            r = next;
        }
        if r.remaining() > 0 {
            tracing::warn!(dropped = r.remaining(), "store journal ends in a partial record; dropping it");
        }
        map
    }

    /// Reads the journal at `path` (a missing file is an empty one) and compacts it.
    fn open(path: &Path) -> Result<(Journal, HashMap<Key, Vec<u8>>)> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(Error::io(format!("reading store journal {}", path.display()), e)),
        };
        let map = Self::replay(&bytes);
        let journal = Self::rewrite(path, &map)?;
        tracing::info!(path = %path.display(), entries = map.len(), "store journal loaded");
        Ok((journal, map))
    }

    /// Writes `map` as a fresh journal beside `path` and renames it over `path`.
    fn rewrite(path: &Path, map: &HashMap<Key, Vec<u8>>) -> Result<Journal> {
        let mut buf = Vec::new();
        for (id, v) in map {
            Self::encode(&mut buf, Op::Set, id, v);
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let ctx = |what: &str| format!("{what} store journal {}", tmp.display());
        std::fs::write(&tmp, &buf).map_err(|e| Error::io(ctx("writing"), e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(ctx("renaming"), e))?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening store journal {}", path.display()), e))?;
        Ok(Journal { path: path.to_path_buf(), file, bytes: buf.len() as u64, live: buf.len() as u64 })
    }

    /// Appends one change; `old` is the record size of the entry it replaces or deletes, and
    /// `map` the entries before the change (for compaction). `Err(500)` when the write fails:
    /// the change is then not applied, and the client sees a failed request.
    fn append(
        &mut self,
        op: Op,
        id: &Key,
        value: &[u8],
        old: Option<u64>,
        map: &HashMap<Key, Vec<u8>>,
    ) -> std::result::Result<(), u16> {
        let mut rec = Vec::with_capacity(Self::record_len(id, value.len()) as usize);
        Self::encode(&mut rec, op, id, value);
        if let Err(e) = self.file.write_all(&rec) {
            tracing::error!(path = %self.path.display(), error = %e, "store journal write failed");
            return Err(500);
        }
        self.bytes += rec.len() as u64;
        self.live = self.live.saturating_sub(old.unwrap_or(0));
        if op == Op::Set {
            self.live += rec.len() as u64;
        }
        if self.bytes > 2 * self.live + COMPACT_SLACK {
            let mut next = map.clone();
            match op {
                Op::Set => next.insert(id.clone(), value.to_vec()),
                Op::Delete => next.remove(id),
            };
            match Self::rewrite(&self.path, &next) {
                Ok(j) => *self = j,
                // The appended file is still complete and correct, only longer.
                Err(e) => tracing::warn!(error = %e, "store journal compaction failed"),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::{HttpStore, Store};
    use std::time::Duration;

    fn client(server: &HttpStoreServer) -> HttpStore {
        HttpStore::new(&server.base_url(), "job", Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn a_server_started_on_the_same_journal_serves_the_same_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.journal");
        {
            let server = HttpStoreServer::start_with_journal("127.0.0.1:0", &path).unwrap();
            let s = client(&server);
            s.set("a", b"1").unwrap();
            s.set("b", b"two").unwrap();
            s.set("a", b"one").unwrap();
            s.set("gone", b"x").unwrap();
            assert!(s.delete("gone").unwrap());
            assert_eq!(s.add("n", 5).unwrap(), 5);
            assert_eq!(s.add("n", -2).unwrap(), 3);
        }
        let server = HttpStoreServer::start_with_journal("127.0.0.1:0", &path).unwrap();
        let s = client(&server);
        assert_eq!(s.try_get("a").unwrap().as_deref(), Some(&b"one"[..]));
        assert_eq!(s.try_get("b").unwrap().as_deref(), Some(&b"two"[..]));
        assert_eq!(s.try_get("gone").unwrap(), None);
        assert_eq!(s.add("n", 1).unwrap(), 4);
        // Without a journal nothing outlives the server.
        let plain = HttpStoreServer::start("127.0.0.1:0").unwrap();
        assert_eq!(client(&plain).try_get("a").unwrap(), None);
    }

    /// The status line of the answer to `request`, sent raw to `server`.
    fn status_of(server: &HttpStoreServer, request: &str) -> String {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer.lines().next().unwrap_or_default().to_string()
    }

    #[test]
    fn a_server_with_a_token_answers_401_without_it_and_200_with_it() {
        let server =
            HttpStoreServer::start_authenticated("127.0.0.1:0", ServerLimits::default(), None, Some("s3cr3t-t0k3n"))
                .unwrap();
        let get = |auth: &str| format!("GET /job/k HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n");
        let put = |auth: &str| {
            format!("PUT /job/k HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 1\r\nConnection: close\r\n\r\nv")
        };
        for auth in [
            "",
            "Authorization: Bearer wrong\r\n",
            "Authorization: Bearer s3cr3t-t0k3\r\n",
            "Authorization: Bearer s3cr3t-t0k3n0\r\n",
            "Authorization: Basic s3cr3t-t0k3n\r\n",
            "Authorization: s3cr3t-t0k3n\r\n",
            "Authorization: Bearer\r\n",
        ] {
            assert_eq!(status_of(&server, &get(auth)), "HTTP/1.1 401 Unauthorized", "{auth:?}");
            assert_eq!(status_of(&server, &put(auth)), "HTTP/1.1 401 Unauthorized", "{auth:?}");
        }
        // Nothing a refused request asked for happened.
        let ok = "Authorization: Bearer s3cr3t-t0k3n\r\n";
        assert_eq!(status_of(&server, &get(ok)), "HTTP/1.1 404 Not Found");
        assert_eq!(status_of(&server, &put(ok)), "HTTP/1.1 200 OK");
        assert_eq!(status_of(&server, &get("authorization: bearer s3cr3t-t0k3n\r\n")), "HTTP/1.1 200 OK");
        // The client: with the token it works; without it, or with another, every call fails at
        // once (no retries until a deadline), saying why.
        let with = client(&server).with_token("s3cr3t-t0k3n").unwrap();
        assert_eq!(with.try_get("k").unwrap().as_deref(), Some(&b"v"[..]));
        assert_eq!(with.add("n", 3).unwrap(), 3);
        let t = std::time::Instant::now();
        for (stranger, words) in [
            (client(&server), "this client has none"),
            (client(&server).with_token("wrong").unwrap(), "does not accept this client's token"),
        ] {
            for e in [
                stranger.try_get("k").unwrap_err(),
                stranger.set("k", b"x").unwrap_err(),
                stranger.add("n", 1).unwrap_err(),
                stranger.get("k", Duration::from_secs(30)).unwrap_err(),
            ] {
                let text = e.to_string();
                assert!(text.contains("401") && text.contains(words), "{text}");
            }
        }
        assert!(t.elapsed() < Duration::from_secs(5), "refusals took {:?}", t.elapsed());
        assert_eq!(with.try_get("k").unwrap().as_deref(), Some(&b"v"[..]), "a refused set changed the value");
        assert_eq!(with.add("n", 0).unwrap(), 3, "a refused add changed the value");
        // A server without a token serves a client that sends one (as Horovod's does).
        let open = HttpStoreServer::start("127.0.0.1:0").unwrap();
        let s = client(&open).with_token("anything").unwrap();
        s.set("a", b"1").unwrap();
        assert_eq!(client(&open).try_get("a").unwrap().as_deref(), Some(&b"1"[..]));
        assert!(
            HttpStoreServer::start_authenticated("127.0.0.1:0", ServerLimits::default(), None, Some("a b")).is_err()
        );
        // The token never shows in debug output.
        assert!(!format!("{with:?}").contains("s3cr3t"));
    }

    #[test]
    fn journal_records_are_unchanged() {
        // The record layout of 329d2e9, before the journal used the crate's codec: journals
        // written then must replay.
        let mut bytes = Vec::new();
        Journal::encode(&mut bytes, Op::Set, &("job".to_string(), "a".to_string()), b"12");
        Journal::encode(&mut bytes, Op::Delete, &("".to_string(), "bc".to_string()), b"");
        let want: &[u8] = b"S\x03\0\0\0\x01\0\0\0\x02\0\0\0joba12D\0\0\0\0\x02\0\0\0\0\0\0\0bc";
        assert_eq!(bytes, want);
        let map = Journal::replay(want);
        assert_eq!(map.len(), 1);
        assert_eq!(map.get(&("job".to_string(), "a".to_string())).map(Vec::as_slice), Some(&b"12"[..]));
    }

    #[test]
    fn a_record_cut_short_is_dropped_and_everything_before_it_kept() {
        let mut bytes = Vec::new();
        let id = |k: &str| ("job".to_string(), k.to_string());
        Journal::encode(&mut bytes, Op::Set, &id("a"), b"1");
        Journal::encode(&mut bytes, Op::Set, &id("b"), b"2");
        Journal::encode(&mut bytes, Op::Delete, &id("a"), b"");
        let whole = bytes.len();
        Journal::encode(&mut bytes, Op::Set, &id("c"), b"333");
        for cut in whole..bytes.len() {
            let map = Journal::replay(&bytes[..cut]);
            assert_eq!(map.len(), 1, "cut at {cut}");
            assert_eq!(map.get(&id("b")).map(Vec::as_slice), Some(&b"2"[..]));
        }
        assert_eq!(Journal::replay(&bytes).len(), 2);
        // A length field claiming 4 GiB allocates nothing and ends the replay.
        let mut huge = bytes.clone();
        huge.extend_from_slice(&[b'S', 3, 0, 0, 0, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, b'j', b'o', b'b', b'k']);
        assert_eq!(Journal::replay(&huge).len(), 2);
        // An unknown tag ends it too.
        let mut junk = bytes.clone();
        junk[whole] = b'Z';
        assert_eq!(Journal::replay(&junk).len(), 1);
    }

    #[test]
    fn the_journal_stays_near_the_size_of_its_live_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.journal");
        let server = HttpStoreServer::start_with_journal("127.0.0.1:0", &path).unwrap();
        let s = client(&server);
        let value = vec![7u8; 64 << 10];
        for i in 0..100 {
            s.set("big", &value).unwrap();
            s.set(&format!("k{}", i % 3), b"v").unwrap();
        }
        // 100 writes of 64 KiB went through; one of them is live.
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(len <= 2 * (64 << 10) + COMPACT_SLACK + 4096, "journal grew to {len} bytes");
        drop(server);
        let server = HttpStoreServer::start_with_journal("127.0.0.1:0", &path).unwrap();
        let s = client(&server);
        assert_eq!(s.try_get("big").unwrap(), Some(value));
        assert_eq!(s.try_get("k2").unwrap().as_deref(), Some(&b"v"[..]));
    }
}
