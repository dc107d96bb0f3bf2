//! A client of Horovod's HTTP rendezvous protocol.

use super::{Backoff, Store, checked_add, missing_keys, parse_counter};
use crate::error::{Error, Result};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// Characters escaped in a scope or key: everything but RFC 3986's unreserved set, so a raw
/// `/` never reaches the server (Horovod's server splits the path on `/` into exactly three
/// parts).
const ESCAPE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// How often a request that got an unexpected status is retried before giving up.
const STATUS_RETRIES: u32 = 4;

/// A store on an HTTP server that speaks Horovod's rendezvous protocol: Horovod's own
/// `RendezvousServer`/`KVStoreServer` unchanged, or ferrogloo's [`HttpStoreServer`].
///
/// | call | request | answer |
/// |---|---|---|
/// | `set` | `PUT /<scope>/<key>` with the value as body (Content-Length) | 200 |
/// | `try_get` | `GET /<scope>/<key>` | 200 with the bytes, 404 while missing |
/// | `delete` | `DELETE /<scope>/<key>` | 200 |
/// | `add` | `POST /<scope>/<key>` with the decimal delta | 200 with the new value, 409 if the value is not an integer |
///
/// `get` and `wait` poll (the protocol has no blocking GET). Connection failures (a server
/// restarting, say) are retried until the call's deadline; other unexpected statuses a few
/// times. Scope and key are percent-escaped, so neither ever contains a raw `/`.
///
/// **`add` and Horovod's server**: Horovod's server has no atomic add (it answers POST with
/// 501). Against it, `add` falls back to GET + PUT, which is *not* atomic when several clients
/// add to one key at once. Against [`HttpStoreServer`] `add` is atomic.
///
/// **Horovod's reserved scopes**: in Horovod's `RendezvousServer`, a DELETE in the scopes
/// `global`, `local_<host>` and `cross_<n>` counts finished workers instead of deleting; use
/// another scope name for ferrogloo.
///
/// **Tokens**: a store made [`with_token`](HttpStore::with_token) sends
/// `Authorization: Bearer <token>` with every request, which an [`HttpStoreServer`] started
/// with that token wants (Horovod's server ignores it). An answer `401` (a server that wants
/// a token this client does not have) fails the call at once, saying so.
///
/// [`HttpStoreServer`]: super::HttpStoreServer
pub struct HttpStore {
    agent: ureq::Agent,
    base: String,
    scope: String,
    timeout: Duration,
    /// 0 = unknown, 1 = server has atomic POST add, 2 = emulate.
    atomic_add: AtomicU8,
    /// `Bearer <token>`, when the store has a token.
    authorization: Option<String>,
}

impl std::fmt::Debug for HttpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token: debug output ends up in logs.
        f.debug_struct("HttpStore")
            .field("base", &self.base)
            .field("scope", &self.scope)
            .field("timeout", &self.timeout)
            .field("token", &self.authorization.is_some())
            .finish()
    }
}

/// Outcome of one HTTP exchange that reached the server.
struct Reply {
    status: u16,
    body: Vec<u8>,
}

impl HttpStore {
    /// Connects to `base` (`http://HOST:PORT`) using `scope` for every key. `timeout` bounds each
    /// `set`, `add` and `delete` (retries included); `get` and `wait` take their own.
    pub fn new(base: &str, scope: &str, timeout: Duration) -> Result<Self> {
        let base = base.trim_end_matches('/').to_string();
        if !base.starts_with("http://") {
            return Err(Error::invalid(format!("HttpStore needs an http:// URL, got {base:?}")));
        }
        if scope.is_empty() {
            return Err(Error::invalid("HttpStore scope must not be empty"));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(2)))
            .build()
            .into();
        Ok(HttpStore {
            agent,
            base,
            scope: utf8_percent_encode(scope, ESCAPE).to_string(),
            timeout,
            atomic_add: AtomicU8::new(0),
            authorization: None,
        })
    }

    /// This store, sending `token` as `Authorization: Bearer <token>` with every request (see
    /// [`HttpStoreServer::start_authenticated`](super::HttpStoreServer::start_authenticated)).
    /// An error when `token` cannot be a bearer token (printable ASCII without spaces).
    pub fn with_token(mut self, token: &str) -> Result<Self> {
        let token = crate::credentials::check_token(token, "the store token")?;
        self.authorization = Some(format!("Bearer {token}"));
        Ok(self)
    }

    /// The escaped scope as it appears in request paths.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    fn url(&self, key: &str) -> String {
        format!("{}/{}/{}", self.base, self.scope, utf8_percent_encode(key, ESCAPE))
    }

    /// One request, retried on connection errors until `deadline`.
    fn request(&self, method: &str, key: &str, body: Option<&[u8]>, deadline: Instant) -> Result<Reply> {
        let url = self.url(key);
        let mut backoff = Backoff::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            let auth = self.authorization.as_deref();
            let res = match (method, body) {
                ("PUT", Some(b)) => {
                    with_auth(self.agent.put(&url), auth).config().timeout_global(Some(left)).build().send(b)
                }
                ("POST", Some(b)) => {
                    with_auth(self.agent.post(&url), auth).config().timeout_global(Some(left)).build().send(b)
                }
                ("DELETE", _) => {
                    with_auth(self.agent.delete(&url), auth).config().timeout_global(Some(left)).build().call()
                }
                _ => with_auth(self.agent.get(&url), auth).config().timeout_global(Some(left)).build().call(),
            };
            let err = match res {
                Ok(mut resp) => {
                    let status = resp.status().as_u16();
                    match resp.body_mut().with_config().limit(1 << 30).read_to_vec() {
                        Ok(body) => return Ok(Reply { status, body }),
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            tracing::debug!(%url, error = %err, "store request failed; retrying");
            if !backoff.sleep_until(deadline) {
                return Err(Error::store(key, format!("{method} {url} failed: {err}")));
            }
        }
    }

    /// The error of a request the server refused for want of the right token (never retried:
    /// the token will not change).
    fn unauthorized(&self, method: &str, key: &str) -> Error {
        let why = match self.authorization {
            Some(_) => "it does not accept this client's token",
            None => {
                "it wants a bearer token, and this client has none (the job's token goes in \
                 FERROGLOO_STORE_TOKEN_FILE)"
            }
        };
        Error::store(key, format!("{method} {} answered HTTP 401 Unauthorized: {why}", self.url(key)))
    }

    /// A request whose only good answers are `ok` statuses; others are retried a few times.
    fn expect(&self, method: &str, key: &str, body: Option<&[u8]>, ok: &[u16]) -> Result<Reply> {
        let deadline = Instant::now() + self.timeout;
        let mut last = 0;
        for _ in 0..=STATUS_RETRIES {
            let reply = self.request(method, key, body, deadline)?;
            if ok.contains(&reply.status) {
                return Ok(reply);
            }
            if reply.status == 401 {
                return Err(self.unauthorized(method, key));
            }
            last = reply.status;
            if !Backoff::new().sleep_until(deadline) {
                break;
            }
        }
        Err(Error::store(key, format!("{method} {} answered HTTP {last}", self.url(key))))
    }

    fn emulated_add(&self, key: &str, delta: i64) -> Result<i64> {
        let old = match self.try_get(key)? {
            Some(v) => parse_counter(key, &v)?,
            None => 0,
        };
        let new = checked_add(key, old, delta)?;
        self.set(key, new.to_string().as_bytes())?;
        Ok(new)
    }
}

impl Store for HttpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.expect("PUT", key, Some(value), &[200]).map(drop)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let reply = self.expect("GET", key, None, &[200, 404])?;
        Ok((reply.status == 200).then_some(reply.body))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        if self.atomic_add.load(Ordering::Relaxed) == 2 {
            return self.emulated_add(key, delta);
        }
        let body = delta.to_string();
        let reply = self.expect("POST", key, Some(body.as_bytes()), &[200, 404, 405, 409, 501])?;
        match reply.status {
            200 => {
                self.atomic_add.store(1, Ordering::Relaxed);
                return parse_counter(key, &reply.body);
            }
            409 => return Err(Error::store(key, String::from_utf8_lossy(&reply.body))),
            _ => {}
        }
        tracing::debug!(status = reply.status, "store server has no atomic add; emulating it with GET + PUT");
        self.atomic_add.store(2, Ordering::Relaxed);
        self.emulated_add(key, delta)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        // The protocol answers 200 whether or not the key existed; ask first.
        let existed = self.try_get(key)?.is_some();
        self.expect("DELETE", key, None, &[200, 404])?;
        Ok(existed)
    }

    fn describe(&self) -> String {
        format!("{}/{}", self.base, self.scope)
    }

    /// Unless the server's host is a loopback address or `localhost`.
    fn reaches_other_hosts(&self) -> bool {
        let authority = self.base.trim_start_matches("http://");
        let host = match authority.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => authority,
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        !(host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new();
        loop {
            let reply = self.request("GET", key, None, deadline);
            match reply {
                Ok(r) if r.status == 200 => return Ok(r.body),
                Ok(r) if r.status == 401 => return Err(self.unauthorized("GET", key)),
                Ok(_) | Err(Error::Store { .. }) => {}
                Err(e) => return Err(e),
            }
            if !backoff.sleep_until(deadline) {
                return Err(missing_keys("store get", vec![key.to_string()], timeout));
            }
        }
    }
}

/// `req` with the `Authorization` header `auth`, when there is one.
fn with_auth<B>(req: ureq::RequestBuilder<B>, auth: Option<&str>) -> ureq::RequestBuilder<B> {
    match auth {
        Some(a) => req.header("Authorization", a),
        None => req,
    }
}
