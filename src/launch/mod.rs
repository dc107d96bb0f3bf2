//! Running N ranks as local processes, and reading a rank's place in a job from its
//! environment.
//!
//! A program that calls [`spawn_local`] when asked for `--np N` re-executes itself N times with
//! `FERROGLOO_RANK`, `FERROGLOO_SIZE` and `FERROGLOO_STORE` (a fresh temporary
//! [`FileStore`](crate::rendezvous::FileStore) directory) set; each child finds its place with
//! [`RankEnv::from_env`]. The same variables let any launcher (mpirun-like scripts, a cluster
//! scheduler) start ferrogloo programs.
//!
//! Every job is authenticated: [`spawn_local`] hands its ranks the job's secret (fresh for
//! each job, unless this process was given one) in a file readable by its owner only, named by
//! `FERROGLOO_SECRET_FILE` and removed when the job ends; never in a command line or the
//! environment. Each rank's context proves it in its handshakes (see
//! [`credentials`](crate::credentials)).
//!
//! No rank outlives its launcher: every rank process is started with [`spawn_tied`], in a
//! process group of its own and with a parent-death signal, so killing the launcher (even with
//! SIGKILL) kills its ranks, and SIGINT or SIGTERM to the launcher reach them through it. The
//! parent-death signal reaches only direct children, so each rank also inherits the read end of
//! a pipe only the launcher writes (its *lifeline*, named by `FERROGLOO_LIFELINE` as
//! `FD:DEV:INO`); [`RankEnv::from_env`] watches it, and when the launcher ends, however it ends,
//! the read end hangs up and the rank's process group is killed. This reaches ranks started
//! through wrappers (`sh -c '…'`, a container entry point) too.

pub mod elastic;
pub mod env;
mod lifeline;

pub use env::Launcher;

use crate::config::{
    FERROGLOO_ADDR, FERROGLOO_HOSTNAME, FERROGLOO_IFACE, FERROGLOO_LOCAL_RANK, FERROGLOO_LOCAL_SIZE, FERROGLOO_RANK,
    FERROGLOO_SECRET_FILE, FERROGLOO_SIZE, FERROGLOO_STORE, Vars,
};
use crate::error::{Error, Result};
use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// A rank's place in a job, as given by its launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The store URL (see [`StoreUrl`](crate::rendezvous::StoreUrl)).
    pub store: String,
    /// This rank's index among the ranks of its host, when the launcher says.
    pub local_rank: Option<usize>,
    /// The number of ranks on this rank's host, when the launcher says.
    pub local_size: Option<usize>,
    /// The launcher whose variables these are (`None`: set by hand).
    pub launcher: Option<Launcher>,
    /// Rank 0 serves the store at `store` (an HTTP URL) itself: no launcher runs one.
    pub serve_store: bool,
    /// The network interface the launcher asks ranks to use (`HOROVOD_GLOO_IFACE`).
    pub iface: Option<String>,
}

impl RankEnv {
    /// Rank `rank` of `size`, meeting at `store`, with nothing else known.
    pub fn new(rank: usize, size: usize, store: impl Into<String>) -> Self {
        RankEnv {
            rank,
            size,
            store: store.into(),
            local_rank: None,
            local_size: None,
            launcher: None,
            serve_store: false,
            iface: None,
        }
    }

    /// Whether a launcher started this process as a rank (see [`env::detect`]; `true` too when
    /// its variables are there but unusable, so that [`RankEnv::from_env`] says why).
    pub fn is_set() -> bool {
        !matches!(env::detect_in(&Vars::process(), false), Ok(None))
    }

    /// This rank's place, from the variables of whichever launcher started the process
    /// (ferrogloo-run or `--np`, torchrun, horovodrun, Open MPI, MPICH, Slurm's srun: see
    /// [`mod@env`]); logs which it found. An error says which variable is missing, unusable or
    /// contradicts another, or that no launcher started this process (use
    /// [`RankEnv::is_set`] to ask that first).
    ///
    /// ```no_run
    /// # fn main() -> ferrogloo::Result<()> {
    /// let env = ferrogloo::launch::RankEnv::from_env()?;
    /// let ctx = env.connect(&ferrogloo::device::TcpAttr::from_env()?, std::time::Duration::from_secs(30))?;
    /// println!("rank {} of {}", ctx.rank(), ctx.size());
    /// # Ok(()) }
    /// ```
    pub fn from_env() -> Result<Self> {
        lifeline::watch();
        env::detect_in(&Vars::process(), true)?.ok_or_else(|| {
            Error::invalid(format!(
                "{FERROGLOO_RANK} is not set, nor the variables of another launcher: start this program as a rank \
                 of a job (with --np N, ferrogloo-run, torchrun, horovodrun, mpirun or srun, or with \
                 {FERROGLOO_RANK}, {FERROGLOO_SIZE} and {FERROGLOO_STORE} set)"
            ))
        })
    }

    /// Opens the job's store ([`RankEnv::store`]); rank 0 of a job whose launcher runs none
    /// ([`RankEnv::serve_store`]: Slurm without `FERROGLOO_STORE`) first starts serving it.
    /// Programs that open the store themselves, rather than through [`RankEnv::connect`], must
    /// open it this way.
    pub fn open_store(&self) -> Result<Box<dyn crate::rendezvous::Store>> {
        if self.serve_store && self.rank == 0 {
            serve_store(&self.store)?;
        }
        crate::rendezvous::open(&self.store)
    }

    /// Joins the job: opens the store and connects this rank's context, with `timeout` as its
    /// deadline, on a new device of the transport `FERROGLOO_TRANSPORT` names (default auto:
    /// shared memory to ranks on this host, TCP on the listener `attr` describes to the others).
    pub fn connect(&self, attr: &crate::device::TcpAttr, timeout: Duration) -> Result<crate::Context> {
        let store = self.open_store()?;
        let mut attr = attr.clone();
        if attr.iface.is_none() && attr.ip.is_none() && attr.hostname.is_none() {
            attr.iface = self.iface.clone();
        }
        let device = crate::device::Device::with_transport(crate::device::Transport::from_env()?, &attr)?;
        crate::Context::builder(self.rank, self.size).timeout(timeout).connect(&store, &device)
    }
}

/// Starts, once per process, the HTTP store server a job without one needs, on every address
/// at the port of `url` (`http://HOST:PORT/SCOPE`); it serves until the process ends, to
/// clients with the job's store token when the environment gives one.
fn serve_store(url: &str) -> Result<()> {
    static SERVER: std::sync::OnceLock<crate::rendezvous::HttpStoreServer> = std::sync::OnceLock::new();
    if SERVER.get().is_some() {
        return Ok(());
    }
    let port = url
        .strip_prefix("http://")
        .and_then(|r| r.split('/').next())
        .and_then(|hp| hp.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| Error::invalid(format!("cannot serve the store {url:?}: not http://HOST:PORT/SCOPE")))?;
    // The job's store token, when its ranks were given one, keeps strangers out of it.
    let token = crate::credentials::Credentials::store_token_from_env()?;
    let server = crate::rendezvous::HttpStoreServer::start_authenticated(
        format!("0.0.0.0:{port}"),
        crate::rendezvous::ServerLimits::default(),
        None,
        token.as_deref(),
    )?;
    tracing::info!("rank 0 serves the job's store at {url}");
    let _ = SERVER.set(server);
    Ok(())
}

/// How long ranks get to stop on their own, after a SIGINT or SIGTERM forwarded to them or
/// after one of them failed, before they are killed.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);

/// A job of local rank processes; see [`spawn_local_with`].
#[derive(Debug, Clone)]
pub struct LocalJob {
    /// How many ranks.
    pub ranks: usize,
    /// The whole job's deadline: ranks still running then are killed.
    pub timeout: Duration,
    /// See [`DEFAULT_GRACE`].
    pub grace: Duration,
}

/// Runs `n` copies of the current executable with `args`, as ranks `0..n` of one job that
/// meets through a fresh temporary [`FileStore`](crate::rendezvous::FileStore) (removed
/// afterwards). Waits for all of them, at most `timeout`. See [`spawn_local_with`].
pub fn spawn_local(n: usize, args: &[String], timeout: Duration) -> Result<()> {
    spawn_local_with(&LocalJob { ranks: n, timeout, grace: DEFAULT_GRACE }, args)
}

/// Runs `job.ranks` copies of the current executable with `args`, as ranks of one job that
/// meets through a fresh temporary [`FileStore`](crate::rendezvous::FileStore) (removed
/// afterwards), and waits for them.
///
/// - The ranks share a secret: this process's own (`FERROGLOO_SECRET_FILE`, handed on
///   unchanged, or `FERROGLOO_SECRET`), else a fresh random one, in a private file named by
///   `FERROGLOO_SECRET_FILE` and removed afterwards ([`JobCredentials`](crate::credentials::JobCredentials)).
///
/// - When a rank fails, the others get `job.grace` to report their own errors, then are
///   killed; so are all ranks still running at `job.timeout`.
/// - SIGINT and SIGTERM to this process are forwarded to every rank (each runs in a process
///   group of its own, so a terminal's Ctrl-C reaches them only this way); ranks still running
///   after `job.grace` are killed, and a second signal kills them at once. (The handlers are
///   this process's while the job runs, and restored afterwards.)
/// - Killing this process, even with SIGKILL, kills every rank ([`spawn_tied`]). Call it from a
///   thread that lives until it returns (it does not return before its ranks have ended).
///
/// Returns an error naming the ranks that failed, and how.
pub fn spawn_local_with(job: &LocalJob, args: &[String]) -> Result<()> {
    let n = job.ranks;
    if n == 0 {
        return Err(Error::invalid("--np must be at least 1"));
    }
    let exe = std::env::current_exe().map_err(|e| Error::io("locating the current executable", e))?;
    let dir = tempfile::Builder::new()
        .prefix("ferrogloo-store-")
        .tempdir()
        .map_err(|e| Error::io("creating a temporary store directory", e))?;
    let url = format!("file:{}", dir.path().display());
    // Kept until every rank has ended: its files go with it.
    let credentials = crate::credentials::JobCredentials::for_job()?;
    // Every rank runs on this host: loopback, unless the caller chose where to listen.
    let vars = Vars::process();
    let chosen = [FERROGLOO_ADDR, FERROGLOO_IFACE, FERROGLOO_HOSTNAME].iter().any(|v| vars.is_set(v));
    let interrupts = Interrupts::install();
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .env(FERROGLOO_RANK, rank.to_string())
            .env(FERROGLOO_SIZE, n.to_string())
            .env(FERROGLOO_LOCAL_RANK, rank.to_string())
            .env(FERROGLOO_LOCAL_SIZE, n.to_string())
            .env(FERROGLOO_STORE, &url)
            .env(FERROGLOO_SECRET_FILE, credentials.secret_file());
        if !chosen {
            cmd.env(FERROGLOO_ADDR, "127.0.0.1");
        }
        match spawn_tied(&mut cmd) {
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
    let how = Supervision { timeout: Some(job.timeout), grace: job.grace, terminate_on_failure: false };
    let JobEnd { statuses, signal, .. } = supervise(&mut children, &how);
    drop(interrupts);
    let failed: Vec<(usize, String)> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_some_and(|s| s.success()))
        .map(|(r, s)| match s {
            Some(s) => (r, format!("rank {r}: {s}")),
            None => (r, format!("rank {r}: killed at the {} deadline", crate::error::secs(&job.timeout))),
        })
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    let mut detail = failed.iter().map(|(_, d)| d.as_str()).collect::<Vec<_>>().join("; ");
    if let Some(sig) = signal {
        detail = format!("the job was interrupted (signal {sig}, forwarded to every rank); {detail}");
    }
    Err(Error::RanksFailed { ranks: failed.into_iter().map(|(r, _)| r).collect(), detail })
}

/// Starts `cmd` as a process that cannot outlive this one: in a process group of its own (so
/// that a signal for it can reach its own children too, and a terminal's Ctrl-C reaches it only
/// through this process), with a parent-death signal (SIGKILL when the thread that spawned it
/// ends, which covers this process being killed). The child checks its parent right after
/// setting the signal, so a parent that died in between is noticed too. It also inherits this
/// process's lifeline (see the module's documentation), which a ferrogloo program watches from
/// [`RankEnv::from_env`]: that reaches a rank started through a wrapper (a grandchild), which
/// the parent-death signal does not.
pub fn spawn_tied(cmd: &mut Command) -> io::Result<Child> {
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    cmd.process_group(0);
    let line = lifeline::read_end().map(|(fd, spec)| {
        cmd.env(crate::config::FERROGLOO_LIFELINE, spec);
        fd
    });
    // SAFETY: the closure runs in the child between fork and exec, and calls only
    // async-signal-safe functions (prctl, getppid, fcntl, _exit) with plain integer arguments.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(137);
            }
            // The child's copy of the lifeline's read end survives exec (the write end does not).
            if let Some(fd) = line
                && libc::fcntl(fd, libc::F_SETFD, 0) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })
    };
    cmd.spawn()
}

/// Sends `sig` to the process group of `child` (which [`spawn_tied`] made its own).
fn signal_group(child: &Child, sig: libc::c_int) {
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill takes plain integers; a group that is gone makes it fail harmlessly.
        unsafe { libc::kill(-pid, sig) };
    }
}

/// The last SIGINT or SIGTERM received while a local job runs (0: none).
static INTERRUPTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_interrupt(sig: libc::c_int) {
    // An atomic store: async-signal-safe.
    INTERRUPTED.store(sig, Ordering::SeqCst);
}

/// How many jobs have the handlers installed, and the actions they replaced.
static HANDLERS: Mutex<(usize, Vec<(libc::c_int, libc::sigaction)>)> = Mutex::new((0, Vec::new()));

/// SIGINT and SIGTERM recorded instead of ending this process, while a local job runs.
struct Interrupts;

impl Interrupts {
    fn install() -> Self {
        let mut h = crate::sync::lock(&HANDLERS);
        if h.0 == 0 {
            INTERRUPTED.store(0, Ordering::SeqCst);
            for sig in [libc::SIGINT, libc::SIGTERM] {
                // SAFETY: sigaction is plain data; zeroed is a valid empty mask and no flags.
                let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
                act.sa_sigaction = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
                act.sa_flags = libc::SA_RESTART;
                // SAFETY: as above.
                let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
                // SAFETY: both pointers are to live sigaction structs; the handler only stores an
                // atomic.
                if unsafe { libc::sigaction(sig, &act, &mut old) } == 0 {
                    h.1.push((sig, old));
                }
            }
        }
        h.0 += 1;
        Interrupts
    }

    /// The signal received since the last call, if any.
    fn take(&self) -> Option<libc::c_int> {
        let sig = INTERRUPTED.swap(0, Ordering::SeqCst);
        (sig != 0).then_some(sig)
    }
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        let mut h = crate::sync::lock(&HANDLERS);
        h.0 -= 1;
        if h.0 == 0 {
            for (sig, old) in h.1.drain(..) {
                // SAFETY: restores the action saved by `install`, a valid sigaction.
                unsafe { libc::sigaction(sig, &old, std::ptr::null_mut()) };
            }
        }
    }
}

/// How [`supervise`] runs a job of rank processes.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// The whole job's deadline: ranks still running then are killed (`None`: no deadline).
    pub timeout: Option<Duration>,
    /// How long ranks get to stop after a SIGINT or SIGTERM forwarded to them, or after
    /// another rank failed, before they are killed.
    pub grace: Duration,
    /// When a rank fails, send the others SIGTERM at once (and SIGKILL after the grace);
    /// otherwise leave them the grace period to report their own errors first.
    pub terminate_on_failure: bool,
}

/// How a job of rank processes ended ([`supervise`]).
#[derive(Debug)]
pub struct JobEnd {
    /// Each rank's exit status; `None` for a rank killed at the job's deadline.
    pub statuses: Vec<Option<ExitStatus>>,
    /// The first rank seen to fail (exit non-zero, or die of a signal), if one did.
    pub first_failure: Option<usize>,
    /// The SIGINT or SIGTERM that interrupted the job (forwarded to every rank), if one did.
    pub signal: Option<i32>,
    /// Ranks that failed while the job went on without them ([`supervise_with`]).
    pub absorbed: Vec<usize>,
}

impl JobEnd {
    /// The exit code a launcher should end with: 0 when every rank succeeded, else the first
    /// failed rank's code (128 + its signal if a signal ended it; 124 if the deadline did), or
    /// 128 + the signal that interrupted the job.
    pub fn exit_code(&self) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        if let (None, Some(sig)) = (self.first_failure, self.signal) {
            return 128 + sig;
        }
        let Some(r) = self.first_failure.or_else(|| self.statuses.iter().position(Option::is_none)) else {
            return 0;
        };
        match self.statuses[r] {
            Some(st) => st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)),
            None => 124,
        }
    }
}

/// Waits for a job of rank processes started with [`spawn_tied`] (rank `i` is `children[i]`):
///
/// - a SIGINT or SIGTERM to this process is forwarded to every rank's process group; ranks
///   still running after `how.grace` are killed, and a second signal kills them at once (the
///   handlers are this process's while it waits, and restored afterwards);
/// - when a rank fails, the others are stopped: SIGTERM at once if `how.terminate_on_failure`,
///   SIGKILL after the grace period either way;
/// - at `how.timeout` every rank still running is killed.
///
/// Call it from the thread that spawned the ranks (their parent-death signal follows it).
pub fn supervise(children: &mut Vec<Child>, how: &Supervision) -> JobEnd {
    supervise_with(children, how, &mut Fixed)
}

/// How an elastic job's membership follows its ranks: what [`supervise_with`] asks while the
/// job runs. The defaults are a fixed job's: no failure is absorbed, no rank is added.
pub trait Elasticity {
    /// Ranks `failed` failed (after [`Elasticity::settle`] gathered those that failed
    /// together); `statuses` are all ranks' statuses so far. True when the job goes on
    /// without them: they are then listed in [`JobEnd::absorbed`] and nothing else happens.
    fn absorb(&mut self, failed: &[usize], statuses: &[Option<ExitStatus>]) -> bool {
        let _ = (failed, statuses);
        false
    }

    /// How long failures are gathered after the first of them before [`Elasticity::absorb`]
    /// is asked, so that ranks dying together (a host going down) are one change.
    fn settle(&self) -> Duration {
        Duration::ZERO
    }

    /// Called on every round of the supervision (every few milliseconds) while no failure is
    /// being gathered or ends the job: may start new ranks, appended to `children` (their
    /// statuses follow).
    fn tick(&mut self, children: &mut Vec<Child>, statuses: &[Option<ExitStatus>]) {
        let _ = (children, statuses);
    }
}

/// A job of fixed membership.
struct Fixed;

impl Elasticity for Fixed {}

/// [`supervise`], with `membership` deciding on failures (see [`Elasticity::absorb`]) and
/// adding ranks ([`Elasticity::tick`]).
pub fn supervise_with(children: &mut Vec<Child>, how: &Supervision, membership: &mut dyn Elasticity) -> JobEnd {
    let interrupts = Interrupts::install();
    let started = Instant::now();
    let end = how.timeout.map(|t| started + t);
    let mut deadline = end;
    let mut job =
        JobEnd { statuses: vec![None; children.len()], first_failure: None, signal: None, absorbed: Vec::new() };
    let mut poll = Duration::from_millis(1);
    let cut = |d: Option<Instant>, at: Instant| Some(d.map_or(at, |d| d.min(at)));
    // Failures seen but not yet put to `absorb`, and when the first of them was seen.
    let mut pending: Vec<usize> = Vec::new();
    let mut pending_since = started;
    loop {
        for (r, (child, status)) in children.iter_mut().zip(job.statuses.iter_mut()).enumerate() {
            if status.is_none()
                && let Ok(Some(st)) = child.try_wait()
            {
                *status = Some(st);
                // After an interrupt, ranks end because of it: not failures of their own.
                if !st.success() && job.first_failure.is_none() && job.signal.is_none() {
                    if pending.is_empty() {
                        pending_since = Instant::now();
                    }
                    pending.push(r);
                }
            }
        }
        let settled = pending_since.elapsed() >= membership.settle() || job.statuses.iter().all(Option::is_some);
        if !pending.is_empty() && settled && job.first_failure.is_none() {
            let failed = std::mem::take(&mut pending);
            if membership.absorb(&failed, &job.statuses) {
                job.absorbed.extend(failed);
            } else {
                job.first_failure = failed.first().copied();
                deadline = cut(deadline, Instant::now() + how.grace);
                if how.terminate_on_failure {
                    for (other, _) in children_alive(children, &job.statuses) {
                        signal_group(other, libc::SIGTERM);
                    }
                }
            }
        }
        if !pending.is_empty() {
            poll = poll.min(Duration::from_millis(5));
        }
        if job.statuses.iter().all(Option::is_some) {
            return job;
        }
        if job.first_failure.is_none() && job.signal.is_none() && pending.is_empty() {
            membership.tick(children, &job.statuses);
            job.statuses.resize(children.len(), None);
        }
        if let Some(sig) = interrupts.take() {
            if job.signal.is_none() {
                // Forward it, and give the ranks the grace period to stop.
                tracing::info!(signal = sig, "forwarding the signal to every rank");
                for (c, _) in children_alive(children, &job.statuses) {
                    signal_group(c, sig);
                }
                job.signal = Some(sig);
                deadline = cut(deadline, Instant::now() + how.grace);
            } else {
                deadline = Some(Instant::now()); // a second one: stop now
            }
        }
        if let Some(d) = deadline
            && Instant::now() >= d
        {
            // Killed at the job's deadline: no status (the report says so); killed at the end of
            // a grace period: the kill's status.
            let graceful = end.is_none_or(|e| d < e);
            for (c, s) in children.iter_mut().zip(job.statuses.iter_mut()) {
                if s.is_none() {
                    signal_group(c, libc::SIGKILL);
                    let _ = c.kill();
                    let st = c.wait();
                    if graceful {
                        *s = st.ok();
                    }
                }
            }
            return job;
        }
        // Child exit has no portable wakeup we can wait on alongside a deadline; poll with
        // a growing interval.
        std::thread::sleep(poll);
        poll = (poll * 2).min(Duration::from_millis(50));
    }
}

/// The children whose status is not known yet.
fn children_alive<'a>(
    children: &'a [Child],
    statuses: &'a [Option<ExitStatus>],
) -> impl Iterator<Item = (&'a Child, usize)> + 'a {
    children.iter().zip(statuses).enumerate().filter(|(_, (_, s))| s.is_none()).map(|(r, (c, _))| (c, r))
}
