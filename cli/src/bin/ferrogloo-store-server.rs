//! `ferrogloo-store-server`: the embedded HTTP rendezvous server as a standalone program.
//!
//! Speaks Horovod's rendezvous protocol (plus atomic add). Its first line of output is the
//! store URL to give every rank, exactly as printed: `FERROGLOO_STORE=http://HOST:PORT/SCOPE`
//! (or `--store` of the examples and the benchmark). Serves until killed (or for `--seconds`).

use clap::Parser;
use ferrogloo::device::TcpAttr;
use ferrogloo::rendezvous::HttpStoreServer;
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
    /// Keep the entries in this journal file too, so that a server restarted on the same file
    /// (and address) carries on a rendezvous where the old one stopped.
    #[arg(long)]
    journal: Option<std::path::PathBuf>,
    /// Stop after this many seconds (default: serve until killed).
    #[arg(long)]
    seconds: Option<u64>,
}

fn main() {
    ferrogloo_cli::init_logging();
    let args = Args::parse();
    let started = match &args.journal {
        Some(path) => HttpStoreServer::start_with_journal(args.bind.as_str(), path),
        None => HttpStoreServer::start(args.bind.as_str()),
    };
    let server = match started {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrogloo-store-server: {e}");
            std::process::exit(1);
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
    println!("http://{addr}/{}", args.scope);
    match args.seconds {
        Some(s) => std::thread::sleep(Duration::from_secs(s)),
        None => loop {
            std::thread::park();
        },
    }
}
