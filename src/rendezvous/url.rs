//! Store URLs: one syntax for naming a store everywhere.

use super::{FileStore, HttpStore, Store, TcpStore};
use crate::error::{Error, Result};
use std::path::PathBuf;
use std::time::Duration;

/// The environment variable holding the default store URL.
pub const STORE_ENV: &str = "FERROGLOO_STORE";

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
    /// Parses `file:DIR` or `http://HOST:PORT/SCOPE`.
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
        Err(Error::invalid(format!(
            "unknown store URL {url:?}: expected file:DIR, http://HOST:PORT/SCOPE or tcpstore://HOST:PORT[/PREFIX]"
        )))
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
                match crate::credentials::Credentials::from_env()?.store_token {
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

/// Checks the `HOST[:PORT]` part of an HTTP store URL: a port, when given, is a number from 1
/// to 65535; an IPv6 host is bracketed.
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

/// Opens the store named by `url` (see [`StoreUrl`]), with a 30 s bound per request.
pub fn open(url: &str) -> Result<Box<dyn Store>> {
    StoreUrl::parse(url)?.open(Duration::from_secs(30))
}

/// Opens the store named by `$FERROGLOO_STORE`.
pub fn open_from_env() -> Result<Box<dyn Store>> {
    let url = std::env::var(STORE_ENV)
        .map_err(|_| Error::invalid(format!("{STORE_ENV} is not set (expected file:DIR or http://HOST:PORT/SCOPE)")))?;
    open(&url)
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
}
