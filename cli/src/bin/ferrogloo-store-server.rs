//! `ferrogloo-store-server`: the embedded HTTP rendezvous server as a standalone program.
//!
//! Speaks Horovod's rendezvous protocol (plus atomic add); point ranks at it with
//! `FERROGLOO_STORE=http://HOST:PORT/SCOPE`. Serves until killed (or for `--seconds`).

use clap::Parser;
use ferrogloo::rendezvous::HttpStoreServer;
use std::time::Duration;

/// HTTP rendezvous store for ferrogloo jobs (Horovod's protocol).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:0")]
    bind: String,
    /// Keep the entries in this journal file too, so that a server restarted on the same file
    /// (and address) carries on a rendezvous where the old one stopped.
    #[arg(long)]
    journal: Option<std::path::PathBuf>,
    /// Stop after this many seconds (default: serve until killed).
    #[arg(long)]
    seconds: Option<u64>,
}

fn main() {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
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
    // The first line names the URL, so scripts can read it.
    println!("{}", server.base_url());
    match args.seconds {
        Some(s) => std::thread::sleep(Duration::from_secs(s)),
        None => loop {
            std::thread::park();
        },
    }
}
