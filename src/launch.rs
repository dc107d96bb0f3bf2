//! Running N ranks as local processes, and reading a rank's place in a job from its
//! environment.
//!
//! A program that calls [`spawn_local`] when asked for `--np N` re-executes itself N times with
//! `FERROGLOO_RANK`, `FERROGLOO_SIZE` and `FERROGLOO_STORE` (a fresh temporary
//! [`FileStore`](crate::rendezvous::FileStore) directory) set; each child finds its place with
//! [`RankEnv::from_env`]. The same variables let any launcher (mpirun-like scripts, a cluster
//! scheduler) start ferrogloo programs.

use crate::device::{ADDR_ENV, HOSTNAME_ENV, IFACE_ENV};
use crate::error::{Error, Result};
use crate::rendezvous::STORE_ENV;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// The environment variable holding this process's rank.
pub const RANK_ENV: &str = "FERROGLOO_RANK";
/// The environment variable holding the number of ranks.
pub const SIZE_ENV: &str = "FERROGLOO_SIZE";

/// A rank's place in a job, as given by its launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The store URL (see [`StoreUrl`](crate::rendezvous::StoreUrl)).
    pub store: String,
}

impl RankEnv {
    /// Whether this process was started as a rank (`FERROGLOO_RANK` is set).
    pub fn is_set() -> bool {
        std::env::var_os(RANK_ENV).is_some()
    }

    /// Reads `FERROGLOO_RANK`, `FERROGLOO_SIZE` and `FERROGLOO_STORE`. An error says which is
    /// missing or unusable (use [`RankEnv::is_set`] to ask whether this process is a rank at
    /// all).
    ///
    /// ```no_run
    /// # fn main() -> ferrogloo::Result<()> {
    /// let env = ferrogloo::launch::RankEnv::from_env()?;
    /// let ctx = env.connect(&ferrogloo::device::TcpAttr::from_env()?, std::time::Duration::from_secs(30))?;
    /// println!("rank {} of {}", ctx.rank(), ctx.size());
    /// # Ok(()) }
    /// ```
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| {
            std::env::var(name).map_err(|_| {
                Error::invalid(format!(
                    "{name} is not set: start this program as a rank of a job (with --np N, or with \
                     {RANK_ENV}, {SIZE_ENV} and {STORE_ENV} set)"
                ))
            })
        };
        let num = |name: &str, v: &str| {
            v.trim().parse::<usize>().map_err(|_| Error::invalid(format!("{name}={v:?} is not a number")))
        };
        let (rank, size) = (var(RANK_ENV)?, var(SIZE_ENV)?);
        let env = RankEnv { rank: num(RANK_ENV, &rank)?, size: num(SIZE_ENV, &size)?, store: var(STORE_ENV)? };
        if env.rank >= env.size {
            return Err(Error::invalid(format!("{RANK_ENV}={} is out of range for {SIZE_ENV}={}", env.rank, env.size)));
        }
        Ok(env)
    }

    /// Joins the job: opens the store and connects this rank's context on a new TCP device
    /// described by `attr`, with `timeout` as its deadline.
    pub fn connect(&self, attr: &crate::device::TcpAttr, timeout: Duration) -> Result<crate::Context> {
        let store = crate::rendezvous::open(&self.store)?;
        let device = crate::device::Device::new(attr)?;
        crate::Context::builder(self.rank, self.size).timeout(timeout).connect(&store, &device)
    }
}

/// Runs `n` copies of the current executable with `args`, as ranks `0..n` of one job that
/// meets through a fresh temporary [`FileStore`](crate::rendezvous::FileStore) (removed
/// afterwards). Waits for all of them, at most `timeout`.
///
/// When a rank fails, the others get a short grace period to report their own errors, then are
/// killed; so are all ranks still running at the deadline. Returns an error naming the ranks
/// that failed.
pub fn spawn_local(n: usize, args: &[String], timeout: Duration) -> Result<()> {
    if n == 0 {
        return Err(Error::invalid("--np must be at least 1"));
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("locating the current executable", e))?;
    let dir = tempfile::Builder::new()
        .prefix("ferrogloo-store-")
        .tempdir()
        .map_err(|e| Error::io("creating a temporary store directory", e))?;
    let url = format!("file:{}", dir.path().display());
    // Every rank runs on this host: loopback, unless the caller chose where to listen.
    let chosen = [ADDR_ENV, IFACE_ENV, HOSTNAME_ENV].iter().any(|v| std::env::var_os(v).is_some());
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(args).env(RANK_ENV, rank.to_string()).env(SIZE_ENV, n.to_string()).env(STORE_ENV, &url);
        if !chosen {
            cmd.env(ADDR_ENV, "127.0.0.1");
        }
        let child = cmd.spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(Error::io(format!("starting rank {rank}"), e));
            }
        }
    }
    let statuses = wait_all(&mut children, timeout);
    let failed: Vec<(usize, String)> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_some_and(|s| s.success()))
        .map(|(r, s)| match s {
            Some(s) => (r, format!("rank {r}: {s}")),
            None => (r, format!("rank {r}: killed at the {} deadline", crate::error::secs(&timeout))),
        })
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        let detail = failed.iter().map(|(_, d)| d.as_str()).collect::<Vec<_>>().join("; ");
        Err(Error::RanksFailed { ranks: failed.into_iter().map(|(r, _)| r).collect(), detail })
    }
}

/// Waits for every child; `None` for those killed at the deadline.
fn wait_all(children: &mut [Child], timeout: Duration) -> Vec<Option<ExitStatus>> {
    const GRACE: Duration = Duration::from_secs(5);
    let mut deadline = Instant::now() + timeout;
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut poll = Duration::from_millis(1);
    loop {
        for (c, s) in children.iter_mut().zip(statuses.iter_mut()) {
            if s.is_none()
                && let Ok(Some(st)) = c.try_wait()
            {
                *s = Some(st);
                if !st.success() {
                    deadline = deadline.min(Instant::now() + GRACE);
                }
            }
        }
        if statuses.iter().all(Option::is_some) {
            return statuses;
        }
        if Instant::now() >= deadline {
            for (c, s) in children.iter_mut().zip(statuses.iter()) {
                if s.is_none() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
            return statuses;
        }
        // Child exit has no portable wakeup we can wait on alongside a deadline; poll with
        // a growing interval.
        std::thread::sleep(poll);
        poll = (poll * 2).min(Duration::from_millis(50));
    }
}
