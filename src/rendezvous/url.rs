//! Store URLs: one syntax for naming a store everywhere.

use super::{FileStore, HttpStore, Store, TcpStore};
use crate::config::{FERROGLOO_STORE, Vars};
use crate::context::default_timeout;
use crate::error::{Error, Result};
use std::path::PathBuf;
use std::time::Duration;

/// A parsed store URL.
///
/// - `file:DIR` (also `file://DIR`): a [`FileStore`] in `DIR`.
/// - `http://HOST:PORT/SCOPE`: an [`HttpStore`] on that server, with `SCOPE` as the scope.
/// - `tcpstore://HOST:PORT[/PREFIX]`: a PyTorch TCPStore ([`TcpStore`]; torchrun's
///   `MASTER_ADDR:MASTER_PORT`), keys under `PREFIX` when given.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreUrl {
    /// A directory for a [`FileStore`].
    File(PathBuf),
    /// An HTTP rendezvous server.
    Http {
        /// `http://HOST:PORT`.
        base: String,
        /// The scope every key lives in.
        scope: String,
    },
    /// A PyTorch TCPStore.
    TcpStore {
        /// `HOST:PORT`.
        addr: String,
        /// What keys are put under (may be empty).
        prefix: String,
    },
}

impl StoreUrl {
    /// Parses `file:DIR` (or `file://DIR`), `http://HOST:PORT/SCOPE` or
    /// `tcpstore://HOST:PORT[/PREFIX]`.
    pub fn parse(url: &str) -> Result<Self> {
        if let Some(rest) = url.strip_prefix("file:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() {
                return Err(Error::invalid(format!("store URL {url:?} names no directory")));
            }
            return Ok(StoreUrl::File(PathBuf::from(path)));
        }
        if let Some(rest) = url.strip_prefix("http://") {
            let (host, scope) = rest.split_once('/').unwrap_or((rest, ""));
            let scope = scope.trim_end_matches('/');
            if host.is_empty() || scope.is_empty() {
                return Err(Error::invalid(format!(
                    "store URL {url:?} must look like http://HOST:PORT/SCOPE (the scope names the job's keys)"
                )));
            }
            check_authority(url, host)?;
            return Ok(StoreUrl::Http { base: format!("http://{host}"), scope: scope.to_string() });
        }
        if let Some(rest) = url.strip_prefix("tcpstore://") {
            let (host, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if host.is_empty() || !host.contains(':') {
                return Err(Error::invalid(format!("store URL {url:?} must look like tcpstore://HOST:PORT[/PREFIX]")));
            }
            check_authority(url, host)?;
            return Ok(StoreUrl::TcpStore { addr: host.to_string(), prefix: prefix.trim_matches('/').to_string() });
        }
        Err(Error::invalid(format!("unknown store URL {url:?}: expected {FORMS}")))
    }

    /// Opens the store. `timeout` bounds each single store request (HTTP retries included).
    /// An HTTP store sends the job's store token, when the environment gives one
    /// (`FERROGLOO_STORE_TOKEN_FILE` or `FERROGLOO_STORE_TOKEN`, see
    /// [`credentials`](crate::credentials)).
    pub fn open(&self, timeout: Duration) -> Result<Box<dyn Store>> {
        Ok(match self {
            StoreUrl::File(dir) => Box::new(FileStore::new(dir)?),
            StoreUrl::Http { base, scope } => {
                let store = HttpStore::new(base, scope, timeout)?;
                match crate::credentials::Credentials::store_token_from_env()? {
                    Some(token) => Box::new(store.with_token(&token)?),
                    None => Box::new(store),
                }
            }
            StoreUrl::TcpStore { addr, prefix } => Box::new(TcpStore::connect(addr, prefix, timeout)?),
        })
    }
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreUrl::File(dir) => write!(f, "file:{}", dir.display()),
            StoreUrl::Http { base, scope } => write!(f, "{base}/{scope}"),
            StoreUrl::TcpStore { addr, prefix } if prefix.is_empty() => write!(f, "tcpstore://{addr}"),
            StoreUrl::TcpStore { addr, prefix } => write!(f, "tcpstore://{addr}/{prefix}"),
        }
    }
}

/// Checks the `HOST[:PORT]` part of an HTTP or TCPStore URL: a port, when given, is a number
/// from 1 to 65535; an IPv6 host is bracketed.
fn check_authority(url: &str, authority: &str) -> Result<()> {
    let bad = |why: &str| Err(Error::invalid(format!("store URL {url:?}: {why}")));
    let port = if let Some(v6) = authority.strip_prefix('[') {
        let Some((ip, after)) = v6.split_once(']') else { return bad("an IPv6 host must be closed with ']'") };
        if ip.parse::<std::net::Ipv6Addr>().is_err() {
            return bad(&format!("{ip:?} is not an IPv6 address"));
        }
        match after {
            "" => None,
            p => match p.strip_prefix(':') {
                Some(p) => Some(p),
                None => return bad("expected ':PORT' after the IPv6 host"),
            },
        }
    } else {
        match authority.split_once(':') {
            Some(("", _)) => return bad("the host is empty"),
            Some((_, p)) => Some(p),
            None => None,
        }
    };
    match port.map(|p| (p, p.parse::<u16>())) {
        Some((p, Ok(0) | Err(_))) => bad(&format!("the port {p:?} is not a number from 1 to 65535")),
        _ => Ok(()),
    }
}

/// The store URLs [`StoreUrl::parse`] takes, in words for messages.
const FORMS: &str = "file:DIR, http://HOST:PORT/SCOPE or tcpstore://HOST:PORT[/PREFIX]";

/// Opens the store named by `url` (see [`StoreUrl`]), each request bounded by the default
/// timeout of contexts: [`FERROGLOO_TIMEOUT`](crate::config::FERROGLOO_TIMEOUT) when set (an
/// error when it is not a positive number of seconds), else 30 s ([`default_timeout`]).
pub fn open(url: &str) -> Result<Box<dyn Store>> {
    StoreUrl::parse(url)?.open(default_timeout()?)
}

/// Opens the store named by [`FERROGLOO_STORE`], as [`open`] does.
pub fn open_from_env() -> Result<Box<dyn Store>> {
    open(&Vars::process().required(FERROGLOO_STORE, &format!("expected {FORMS}"))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_forms_and_rejects_others() {
        assert_eq!(StoreUrl::parse("file:/tmp/x").unwrap(), StoreUrl::File("/tmp/x".into()));
        assert_eq!(StoreUrl::parse("file:///tmp/x").unwrap(), StoreUrl::File("/tmp/x".into()));
        assert_eq!(
            StoreUrl::parse("http://127.0.0.1:80/job/a").unwrap(),
            StoreUrl::Http { base: "http://127.0.0.1:80".into(), scope: "job/a".into() }
        );
        assert_eq!(
            StoreUrl::parse("http://[::1]:29500/j").unwrap(),
            StoreUrl::Http { base: "http://[::1]:29500".into(), scope: "j".into() }
        );
        assert!(StoreUrl::parse("http://store-host/j").is_ok(), "the port may be left to the default");
        for bad in [
            "",
            "file:",
            "http://host:1",
            "http:///scope",
            "ftp://x/y",
            "/tmp/x",
            "http://host:99999/j",
            "http://host:0/j",
            "http://host:80x/j",
            "http://host:/j",
            "http://:80/j",
            "http://[::1/j",
            "http://[nope]:80/j",
        ] {
            let e = StoreUrl::parse(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
        }
        let e = StoreUrl::parse("http://host:99999/j").unwrap_err().to_string();
        assert!(e.contains("port") && e.contains("99999"), "{e}");
    }

    #[test]
    fn parses_tcpstore_urls_and_names_every_form_when_refusing() {
        let url = StoreUrl::parse("tcpstore://node1:29500/worker/attempt_2/").unwrap();
        assert_eq!(url, StoreUrl::TcpStore { addr: "node1:29500".into(), prefix: "worker/attempt_2".into() });
        assert_eq!(url.to_string(), "tcpstore://node1:29500/worker/attempt_2");
        let url = StoreUrl::parse("tcpstore://[::1]:29500").unwrap();
        assert_eq!(url, StoreUrl::TcpStore { addr: "[::1]:29500".into(), prefix: String::new() });
        assert_eq!(url.to_string(), "tcpstore://[::1]:29500");
        for bad in ["tcpstore://", "tcpstore://node1", "tcpstore://:29500", "tcpstore://node1:0", "tcpstore://h:x/p"] {
            let e = StoreUrl::parse(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
        }
        let e = StoreUrl::parse("redis://x").unwrap_err().to_string();
        for form in ["file:DIR", "http://HOST:PORT/SCOPE", "tcpstore://HOST:PORT[/PREFIX]"] {
            assert!(e.contains(form), "{e}");
        }
    }

    /// The variable that makes [`open_under_the_environment`] run.
    const CHILD_ENV: &str = "FERROGLOO_TEST_OPEN";

    /// Runs [`open_under_the_environment`] in a process of its own (this test binary again) with
    /// `FERROGLOO_TIMEOUT` set to `timeout`; returns what it printed after `RESULT `.
    fn open_in_a_child(timeout: &str) -> String {
        let exe = std::env::current_exe().unwrap();
        let test = "rendezvous::url::tests::open_under_the_environment";
        let out = std::process::Command::new(exe)
            .args(["--ignored", "--exact", test, "--nocapture", "--test-threads=1"])
            .env(crate::config::FERROGLOO_TIMEOUT, timeout)
            .env(CHILD_ENV, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout.lines().find_map(|l| l.split_once("RESULT ").map(|(_, r)| r));
        line.unwrap_or_else(|| panic!("the child printed no result: {stdout}")).to_string()
    }

    #[test]
    #[ignore = "run as a child process by open_bounds_each_request_by_ferrogloo_timeout"]
    fn open_under_the_environment() {
        if std::env::var_os(CHILD_ENV).is_none() {
            return;
        }
        // A listener that never answers: the TCPStore client's handshake waits for its deadline.
        let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let t = std::time::Instant::now();
        let outcome = open(&format!("tcpstore://{}", mute.local_addr().unwrap()));
        let ms = t.elapsed().as_millis();
        match outcome {
            Ok(_) => println!("RESULT {ms} opened"),
            Err(e) => println!("RESULT {ms} {} {e}", if e.is_timeout() { "timeout" } else { "error" }),
        }
    }

    #[test]
    fn open_bounds_each_request_by_ferrogloo_timeout() {
        let result = open_in_a_child("0.4");
        let (ms, rest) = result.split_once(' ').unwrap();
        let ms: u64 = ms.parse().unwrap();
        assert!(rest.starts_with("timeout"), "{result}");
        assert!((400..5000).contains(&ms), "FERROGLOO_TIMEOUT=0.4 bounded the handshake after {ms} ms: {result}");
        let result = open_in_a_child("soon");
        assert!(result.contains("error") && result.contains("FERROGLOO_TIMEOUT=\"soon\""), "{result}");
    }
}
