//! ferrogloo's own HTTP rendezvous server (Horovod's protocol plus atomic add).

use super::{checked_add, parse_counter};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Largest value the server accepts (a rendezvous value is an address: tiny).
const MAX_VALUE: usize = 64 << 20;

/// Threads answering requests.
const WORKERS: usize = 4;

type Data = Mutex<HashMap<(String, String), Vec<u8>>>;

/// An embedded HTTP rendezvous server speaking the protocol of Horovod's `RendezvousServer`
/// (`PUT`/`GET`/`DELETE /<scope>/<key>`), plus `POST /<scope>/<key>` with a decimal delta as
/// body, an atomic add that answers the new value. [`HttpStore`](super::HttpStore) talks to it.
///
/// Start it from code (it serves until dropped) or from the command line with the
/// `ferrogloo-store-server` binary.
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
    /// Binds `addr` (port 0 picks a free port) and starts serving in background threads.
    pub fn start(addr: impl ToSocketAddrs) -> Result<Self> {
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
        let data: Arc<Data> = Arc::default();
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

fn lock(data: &Data) -> MutexGuard<'_, HashMap<(String, String), Vec<u8>>> {
    // Each update is one insert or remove, so a poisoned map is still consistent.
    data.lock().unwrap_or_else(|p| p.into_inner())
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
        tiny_http::Method::Get => match lock(data).get(&id) {
            Some(v) => (200, v.clone()),
            None => (404, Vec::new()),
        },
        tiny_http::Method::Put => {
            lock(data).insert(id, body);
            (200, Vec::new())
        }
        tiny_http::Method::Delete => {
            lock(data).remove(&id);
            (200, Vec::new())
        }
        tiny_http::Method::Post => {
            let shown = format!("{scope}/{key}");
            let mut map = lock(data);
            let result = parse_counter(&shown, &body).and_then(|delta| {
                let old = map.get(&id).map(|v| parse_counter(&shown, v)).transpose()?.unwrap_or(0);
                checked_add(&shown, old, delta)
            });
            match result {
                Ok(new) => {
                    map.insert(id, new.to_string().into_bytes());
                    (200, new.to_string().into_bytes())
                }
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
