//! `ferrogloo-store-server`: the embedded HTTP rendezvous server as a standalone program.
//!
//! Speaks Horovod's rendezvous protocol (plus atomic add). Its first line of output is the
//! store URL to give every rank, exactly as printed: `FERROGLOO_STORE=http://HOST:PORT/SCOPE`
//! (or `--store` of the examples and the benchmark). Serves until killed (or for `--seconds`).
//!
//! With `--token-file FILE` (or `FERROGLOO_STORE_TOKEN_FILE` / `FERROGLOO_STORE_TOKEN` in its
//! environment) it answers only requests carrying that bearer token, and `401` to others: give
//! the ranks the same file as `FERROGLOO_STORE_TOKEN_FILE`.
//!
//! With `--protocol tcpstore` it speaks PyTorch's TCPStore protocol instead (the library's
//! `rendezvous::TcpStoreServer`), for ranks and PyTorch programs alike, and prints
//! `tcpstore://HOST:PORT/SCOPE`. That protocol has no authentication: a token is refused, and so
//! is a journal.

use clap::Parser;
use ferrogloo::device::TcpAttr;
use ferrogloo::rendezvous::{HttpStoreServer, ServerLimits, TcpStoreServer};
use std::net::SocketAddr;
use std::time::Duration;

/// HTTP rendezvous store for ferrogloo jobs (Horovod's protocol).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on (port 0 picks a free one; 0.0.0.0 listens everywhere).
    #[arg(long, default_value = "127.0.0.1:0")]
    bind: String,
    /// The scope in the printed URL: the namespace of one job's keys.
    #[arg(long, default_value = "ferrogloo")]
    scope: String,
    /// The protocol served: `http` (Horovod's rendezvous, with ferrogloo's atomic add) or
    /// `tcpstore` (PyTorch's TCPStore; no token, no journal; `--max-total-bytes` and
    /// `--max-connections` apply, the HTTP limits do not).
    #[arg(long, default_value = "http", value_parser = ["http", "tcpstore"])]
    protocol: String,
    /// Keep the entries in this journal file too, so that a server restarted on the same file
    /// (and address) carries on a rendezvous where the old one stopped.
    #[arg(long)]
    journal: Option<std::path::PathBuf>,
    /// Answer only requests with `Authorization: Bearer <the token in FILE>` (a file readable
    /// by its owner only), others with 401. Default: the token of FERROGLOO_STORE_TOKEN_FILE or
    /// FERROGLOO_STORE_TOKEN when set, else none (anyone may use the store).
    #[arg(long, value_name = "FILE")]
    token_file: Option<std::path::PathBuf>,
    /// Stop after this many seconds (default: serve until killed).
    #[arg(long)]
    seconds: Option<u64>,
    /// Largest value in bytes (K/M/G suffixes allowed); beyond it, 413 without reading the body.
    #[arg(long, default_value = "16M")]
    max_value: String,
    /// Most keys in one scope; a new key beyond it gets 507.
    #[arg(long, default_value_t = 65536)]
    max_keys_per_scope: usize,
    /// Most bytes of keys and values held in all (K/M/G suffixes allowed); beyond it, 507.
    #[arg(long, default_value = "1G")]
    max_total_bytes: String,
    /// Most connections open at once; one beyond gets 503 and is closed.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a connection has to send a request's headers (and may stay idle between
    /// requests); then it is closed.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a request has to send its whole body; then 408.
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
}

/// Bytes with an optional K/M/G suffix.
fn bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().and_then(|v| v.checked_mul(mul)).ok_or_else(|| format!("{s:?} is not a size in bytes"))
}

fn seconds(what: &str, s: f64) -> Result<Duration, String> {
    Duration::try_from_secs_f64(s).map_err(|_| format!("--{what} {s} is not a number of seconds"))
}

impl Args {
    fn limits(&self) -> Result<ServerLimits, String> {
        Ok(ServerLimits {
            max_value: bytes(&self.max_value)?,
            max_keys_per_scope: self.max_keys_per_scope,
            max_total_bytes: bytes(&self.max_total_bytes)?,
            max_connections: self.max_connections,
            header_timeout: seconds("header-timeout", self.header_timeout)?,
            body_timeout: seconds("body-timeout", self.body_timeout)?,
        })
    }
}

/// The token requests must carry: `--token-file`'s, else the environment's, else none.
fn token(args: &Args) -> ferrogloo::Result<Option<String>> {
    use ferrogloo::credentials::{Credentials, check_token, read_private_file};
    match &args.token_file {
        Some(path) => {
            let raw = read_private_file(path, "--token-file")?;
            let shown = format!("--token-file={}", path.display());
            check_token(&String::from_utf8_lossy(&raw), &shown).map(Some)
        }
        None => Credentials::store_token_from_env(),
    }
}

/// A running server of either protocol (serving until dropped).
enum Server {
    Http(HttpStoreServer),
    TcpStore(TcpStoreServer),
}

impl Server {
    fn local_addr(&self) -> SocketAddr {
        match self {
            Server::Http(s) => s.local_addr(),
            Server::TcpStore(s) => s.local_addr(),
        }
    }

    /// The scheme of its store URL.
    fn scheme(&self) -> &'static str {
        match self {
            Server::Http(_) => "http",
            Server::TcpStore(_) => "tcpstore",
        }
    }
}

/// Starts the server `args` ask for.
fn serve(args: &Args, limits: ServerLimits, token: Option<&str>) -> ferrogloo::Result<Server> {
    if args.protocol == "tcpstore" {
        if token.is_some() {
            return Err(ferrogloo::Error::invalid(
                "PyTorch's TCPStore protocol has no authentication: a store token (--token-file, \
                 FERROGLOO_STORE_TOKEN_FILE or FERROGLOO_STORE_TOKEN) cannot be enforced; use --protocol http",
            ));
        }
        if args.journal.is_some() {
            return Err(ferrogloo::Error::invalid("--journal is for --protocol http only"));
        }
        let s = TcpStoreServer::start(args.bind.as_str())?;
        s.set_max_total_bytes(limits.max_total_bytes);
        s.set_max_connections(limits.max_connections);
        return Ok(Server::TcpStore(s));
    }
    HttpStoreServer::start_authenticated(args.bind.as_str(), limits, args.journal.as_deref(), token).map(Server::Http)
}

fn main() {
    ferrogloo_cli::init_logging();
    let args = Args::parse();
    let limits = match args.limits() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ferrogloo-store-server: {e}");
            std::process::exit(2);
        }
    };
    let token = match token(&args) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ferrogloo-store-server: {e}");
            std::process::exit(2);
        }
    };
    let server = match serve(&args, limits, token.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrogloo-store-server: {e}");
            std::process::exit(if matches!(e, ferrogloo::Error::InvalidArgument(_)) { 2 } else { 1 });
        }
    };
    // A server listening everywhere is reached at this host's address, as a device finds it.
    let mut addr: SocketAddr = server.local_addr();
    if addr.ip().is_unspecified()
        && let Ok(ip) = TcpAttr::default().resolve()
    {
        addr.set_ip(ip);
    }
    // The first line is the URL, so scripts can read it; ranks take it as printed.
    println!("{}://{addr}/{}", server.scheme(), args.scope);
    match args.seconds {
        Some(s) => std::thread::sleep(Duration::from_secs(s)),
        None => loop {
            std::thread::park();
        },
    }
}
