//! What every example shares: becoming one rank of a job.
//!
//! `--np N` starts N local rank processes of this same program (through a temporary
//! FileStore) and waits for them. A rank process finds its place in the job from
//! `FERROGLOO_RANK`/`FERROGLOO_SIZE`/`FERROGLOO_STORE` (set by the launcher) or from
//! `--rank R --size N --store URL` (to join a job started by hand on several hosts).

use clap::Args;
use ferrogloo::config::FERROGLOO_STORE;
use ferrogloo::device::TcpAttr;
use ferrogloo::launch::{RankEnv, spawn_local};
use ferrogloo::{Context, Error, Result};
use std::time::Duration;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Options every example takes.
#[derive(Args, Debug, Clone)]
pub struct JobArgs {
    /// Run N local ranks as processes of this program, meeting through a temporary FileStore.
    #[arg(long)]
    pub np: Option<usize>,
    /// This process's rank (with --size and --store, to join a job started by hand).
    #[arg(long)]
    pub rank: Option<usize>,
    /// Number of ranks in the job.
    #[arg(long)]
    pub size: Option<usize>,
    /// Store URL: file:DIR or http://HOST:PORT/SCOPE (default: $FERROGLOO_STORE).
    #[arg(long)]
    pub store: Option<String>,
    /// Network interface to listen on (default: $FERROGLOO_IFACE, else loopback).
    #[arg(long)]
    pub iface: Option<String>,
    /// Deadline of every operation, in seconds (default: $FERROGLOO_TIMEOUT, else 30).
    #[arg(long)]
    pub timeout: Option<f64>,
}

/// `Ok(None)` when this process launched local ranks (they have finished); `Ok(Some(ctx))`
/// when it is a rank. Library logs (a rank waiting for others, say) go to stderr at `info`
/// unless `RUST_LOG` says otherwise (`target=level` directives, comma-separated).
pub fn join(args: &JobArgs) -> Result<Option<Context>> {
    // `target=level` directives (no regular expressions: the main job's binary builds without
    // the regex crates, see allreduce/Cargo.toml).
    let filter = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| v.parse::<tracing_subscriber::filter::Targets>().ok())
        .unwrap_or_else(|| {
            tracing_subscriber::filter::Targets::new().with_default(tracing_subscriber::filter::LevelFilter::INFO)
        });
    // fmt() caps events at info by itself: the cap goes to trace, and `filter` decides.
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .finish()
        .with(filter)
        .try_init();
    let timeout = match args.timeout {
        Some(t) => {
            Duration::try_from_secs_f64(t).map_err(|_| Error::invalid(format!("--timeout {t} is not a duration")))?
        }
        None => ferrogloo::context::default_timeout()?,
    };
    let env = match RankEnv::is_set() {
        true => RankEnv::from_env()?,
        false => match (args.np, args.rank, args.size) {
            (Some(n), None, None) => {
                let argv: Vec<String> = std::env::args().skip(1).collect();
                spawn_local(n, &argv, timeout * 4)?;
                return Ok(None);
            }
            (None, Some(rank), Some(size)) => {
                let store = match &args.store {
                    Some(s) => s.clone(),
                    None => std::env::var(FERROGLOO_STORE)
                        .map_err(|_| Error::invalid(format!("--store or {FERROGLOO_STORE} is required with --rank")))?,
                };
                RankEnv::new(rank, size, store)
            }
            _ => return Err(Error::invalid("give --np N, or --rank R --size N [--store URL]")),
        },
    };
    let mut attr = TcpAttr::from_env()?;
    if let Some(i) = &args.iface {
        attr.iface = Some(i.clone());
    }
    env.connect(&attr, timeout).map(Some)
}

/// Prints an error and exits non-zero.
pub fn exit_on_error<T>(r: Result<T>) -> T {
    r.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    })
}
