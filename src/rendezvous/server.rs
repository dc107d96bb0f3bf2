//! ferrogloo's own HTTP rendezvous server (Horovod's protocol plus atomic add).

use super::{checked_add, parse_counter};
use crate::error::{Error, Result};
use crate::sync::lock;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Largest value the server accepts (a rendezvous value is an address: tiny).
const MAX_VALUE: usize = 64 << 20;

/// Threads answering requests.
const WORKERS: usize = 4;

/// The journal is rewritten when it is this much larger than the entries it describes.
const COMPACT_SLACK: u64 = 1 << 20;

type Key = (String, String);
type Data = Mutex<State>;

/// The server's entries, and the journal that makes them outlive the process (if any).
#[derive(Default)]
struct State {
    map: HashMap<Key, Vec<u8>>,
    journal: Option<Journal>,
}

/// An embedded HTTP rendezvous server speaking the protocol of Horovod's `RendezvousServer`
/// (`PUT`/`GET`/`DELETE /<scope>/<key>`), plus `POST /<scope>/<key>` with a decimal delta as
/// body, an atomic add that answers the new value. [`HttpStore`](super::HttpStore) talks to it.
///
/// Start it from code (it serves until dropped) or from the command line with the
/// `ferrogloo-store-server` binary.
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
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for HttpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpStoreServer").field("addr", &self.addr).finish()
    }
}

impl HttpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving in background threads. The
    /// entries live in memory only.
    pub fn start(addr: impl ToSocketAddrs) -> Result<Self> {
        Self::serve_state(addr, State::default())
    }

    /// Like [`start`](Self::start), with the entries kept in the journal file `path` as well:
    /// the entries a journal already holds (left by an earlier server) are served again, and
    /// every change is written to it before the request is answered. A record cut short by a
    /// crash is dropped; the file is compacted at start and whenever it grows well past its
    /// live entries. Writes reach the operating system, not the disk (no `fsync` per request):
    /// the entries survive the server process dying, not the machine.
    pub fn start_with_journal(addr: impl ToSocketAddrs, path: impl AsRef<Path>) -> Result<Self> {
        let (journal, map) = Journal::open(path.as_ref())?;
        Self::serve_state(addr, State { map, journal: Some(journal) })
    }

    fn serve_state(addr: impl ToSocketAddrs, state: State) -> Result<Self> {
        let addr = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("resolving the store server address", e))?
            .next()
            .ok_or_else(|| Error::invalid("store server address resolves to nothing"))?;
        let server = tiny_http::Server::http(addr)
            .map_err(|e| Error::io(format!("binding store server on {addr}"), std::io::Error::other(e.to_string())))?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| Error::invalid("store server is not listening on an IP address"))?;
        let server = Arc::new(server);
        let data: Arc<Data> = Arc::new(Mutex::new(state));
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..WORKERS)
            .map(|i| {
                let (server, data, stop) = (server.clone(), data.clone(), stop.clone());
                std::thread::Builder::new()
                    .name(format!("ferrogloo-store-{i}"))
                    .spawn(move || serve(&server, &data, &stop))
                    .map_err(|e| Error::io("spawning a store server thread", e))
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::info!(%addr, "ferrogloo store server listening");
        Ok(HttpStoreServer { server, addr, stop, workers })
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
        self.stop.store(true, Ordering::SeqCst);
        for _ in &self.workers {
            self.server.unblock();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl State {
    /// Sets `id` to `value` (journal first); `Err` is the status to answer.
    fn set(&mut self, id: Key, value: Vec<u8>) -> std::result::Result<(), u16> {
        if let Some(j) = &mut self.journal {
            let old = self.map.get(&id).map(|v| Journal::record_len(&id, v.len()));
            j.append(Op::Set, &id, &value, old, &self.map)?;
        }
        self.map.insert(id, value);
        Ok(())
    }

    /// Deletes `id` (journal first); `Err` is the status to answer.
    fn delete(&mut self, id: Key) -> std::result::Result<(), u16> {
        let Some(old) = self.map.get(&id) else { return Ok(()) };
        if let Some(j) = &mut self.journal {
            let old = Some(Journal::record_len(&id, old.len()));
            j.append(Op::Delete, &id, &[], old, &self.map)?;
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
        out.push(op as u8);
        for len in [id.0.len(), id.1.len(), value.len()] {
            // Scope and key come from a request line and values are capped at MAX_VALUE.
            out.extend_from_slice(&(len as u32).to_le_bytes());
        }
        out.extend_from_slice(id.0.as_bytes());
        out.extend_from_slice(id.1.as_bytes());
        out.extend_from_slice(value);
    }

    /// Replays the entries of `bytes`, stopping at the first record that is cut short or
    /// malformed (what a crash in the middle of an append leaves).
    fn replay(bytes: &[u8]) -> HashMap<Key, Vec<u8>> {
        let mut map = HashMap::new();
        let mut rest = bytes;
        while rest.len() >= Self::HEADER {
            let len = |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]) as usize;
            let (s, k, v) = (len(1), len(5), len(9));
            let Some(body) = rest.get(Self::HEADER..Self::HEADER + s + k + v) else { break };
            let (Ok(scope), Ok(key)) = (std::str::from_utf8(&body[..s]), std::str::from_utf8(&body[s..s + k])) else {
                break;
            };
            let id = (scope.to_string(), key.to_string());
            match rest[0] {
                b'S' => map.insert(id, body[s + k..].to_vec()),
                b'D' => map.remove(&id),
                _ => break,
            };
            rest = &rest[Self::HEADER + body.len()..];
        }
        if !rest.is_empty() {
            tracing::warn!(dropped = rest.len(), "store journal ends in a partial record; dropping it");
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

fn serve(server: &tiny_http::Server, data: &Data, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        match server.recv() {
            Ok(req) => handle(req, data),
            Err(e) if !stop.load(Ordering::SeqCst) => tracing::debug!(error = %e, "store server accept failed"),
            Err(_) => return,
        }
    }
}

fn handle(mut req: tiny_http::Request, data: &Data) {
    let (status, body) = answer(&mut req, data);
    let resp = tiny_http::Response::from_data(body).with_status_code(status);
    if let Err(e) = req.respond(resp) {
        tracing::debug!(error = %e, "store server could not answer");
    }
}

fn answer(req: &mut tiny_http::Request, data: &Data) -> (u16, Vec<u8>) {
    let url = req.url().to_string();
    let parts: Vec<&str> = url.split('/').collect();
    let [_, scope, key] = parts[..] else {
        return (400, b"path must be /<scope>/<key>".to_vec());
    };
    let id = (scope.to_string(), key.to_string());
    let method = req.method().clone();
    let body = match method {
        tiny_http::Method::Put | tiny_http::Method::Post => match read_body(req) {
            Ok(b) => b,
            Err(status) => return (status, Vec::new()),
        },
        _ => Vec::new(),
    };
    match method {
        tiny_http::Method::Get => match lock(data).map.get(&id) {
            Some(v) => (200, v.clone()),
            None => (404, Vec::new()),
        },
        tiny_http::Method::Put => match lock(data).set(id, body) {
            Ok(()) => (200, Vec::new()),
            Err(status) => (status, Vec::new()),
        },
        tiny_http::Method::Delete => match lock(data).delete(id) {
            Ok(()) => (200, Vec::new()),
            Err(status) => (status, Vec::new()),
        },
        tiny_http::Method::Post => {
            let shown = format!("{scope}/{key}");
            let mut state = lock(data);
            let result = parse_counter(&shown, &body).and_then(|delta| {
                let old = state.map.get(&id).map(|v| parse_counter(&shown, v)).transpose()?.unwrap_or(0);
                checked_add(&shown, old, delta)
            });
            match result {
                Ok(new) => match state.set(id, new.to_string().into_bytes()) {
                    Ok(()) => (200, new.to_string().into_bytes()),
                    Err(status) => (status, Vec::new()),
                },
                // 409: the key holds something add cannot apply to (the request itself is fine).
                Err(e) => (409, e.to_string().into_bytes()),
            }
        }
        _ => (501, Vec::new()),
    }
}

/// Reads a request body that must carry a Content-Length within [`MAX_VALUE`].
fn read_body(req: &mut tiny_http::Request) -> std::result::Result<Vec<u8>, u16> {
    let len = req.body_length().ok_or(411u16)?;
    if len > MAX_VALUE {
        return Err(413);
    }
    let mut body = Vec::with_capacity(len);
    req.as_reader().take(len as u64).read_to_end(&mut body).map_err(|_| 400u16)?;
    if body.len() != len { Err(400) } else { Ok(body) }
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
