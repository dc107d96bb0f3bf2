//! Elastic jobs: ranks that come and go. `ferrogloo-run --min-np M --max-np X` keeps a job
//! going when ranks die, as long as M are left, and adds ranks (up to X) where hosts have room
//! (hosts its `--host-discovery-script` names, or those it was given). Each change is a new
//! *generation* in the job's store (which workers are in it, in rank order); every worker of
//! it rebuilds its context there, with its new rank and size, and carries on.
//!
//! A worker's program is a loop around "build the context, run, and on a membership error
//! rebuild" ([`run`]): it gets the context of the current generation, and when its work fails
//! because a peer is gone (closed, timed out, aborted), or because [`Membership::check`] found
//! a newer generation (ranks joined), [`run`] waits for the next generation and calls it
//! again. The program keeps whatever state it needs across calls (a checkpoint, the step it
//! reached) and brings new members up to date at the start of each call (for example with a
//! broadcast from rank 0). Call [`Membership::check`] at points where the job may change size
//! (every few steps: it reads one store key): without it a job still shrinks, but never grows.
//!
//! The launcher and the workers meet through these store keys:
//!
//! | key | value |
//! |---|---|
//! | `elastic.generation` | the latest generation number, decimal |
//! | `elastic.g<N>.members` | its workers (ids as `FERROGLOO_WORKER` gives them), comma-separated, in rank order |
//! | `elastic.g<N>.ready` | how many of its workers have built their context (the launcher adds ranks only to a generation that all have joined) |
//! | `elastic.g<N>.regroup` | how many of its workers failed in it with a membership error: when no process ended, the launcher publishes the same workers again (a peer only stalled) |
//! | `elastic.fatal` | set by a worker whose work failed for another reason than membership: the job ends |
//!
//! and each generation forms its context under the store prefix `elastic.g<N>`.
//!
//! ```no_run
//! use ferrogloo::device::{Device, TcpAttr};
//! use ferrogloo::launch::{RankEnv, elastic};
//! use ferrogloo::ReduceOp;
//! use std::time::Duration;
//!
//! # fn main() -> ferrogloo::Result<()> {
//! let env = RankEnv::from_env()?;
//! let device = Device::tcp(&TcpAttr::default())?;
//! let mut step = 0u64; // progress survives generations
//! elastic::run(&env, &device, Duration::from_secs(30), |ctx, membership| {
//!     // Newcomers and survivors agree on where to go on from.
//!     let mut start = [step];
//!     ctx.allreduce(&mut start, ReduceOp::Max)?;
//!     step = start[0];
//!     while step < 1000 {
//!         if step % 10 == 0 {
//!             membership.check()?; // ranks joined: rebuild at the new size
//!         }
//!         let mut grads = vec![1.0f32; 1 << 16];
//!         ctx.allreduce(&mut grads, ReduceOp::Sum)?;
//!         step += 1;
//!     }
//!     Ok(())
//! })?;
//! # Ok(())
//! # }
//! ```

use super::RankEnv;
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::rendezvous::{PrefixStore, Store};
use std::time::{Duration, Instant};

/// Set (to `1`) by `ferrogloo-run` for the workers of an elastic job.
pub const ELASTIC_ENV: &str = "FERROGLOO_ELASTIC";
/// This worker's id in an elastic job: stable across generations, unlike its rank.
pub const WORKER_ENV: &str = "FERROGLOO_WORKER";
/// How long a worker waits for the next generation after a membership error, in seconds
/// (default 60).
pub const ELASTIC_TIMEOUT_ENV: &str = "FERROGLOO_ELASTIC_TIMEOUT";

/// The key holding the latest generation.
pub const GENERATION_KEY: &str = "elastic.generation";

/// The key a worker sets (to its id and error) when its work failed for a reason a new
/// generation would not mend: the launcher then ends the job instead of going on without it.
pub const FATAL_KEY: &str = "elastic.fatal";

/// The key holding generation `g`'s workers.
pub fn members_key(g: u64) -> String {
    format!("elastic.g{g}.members")
}

/// The key counting generation `g`'s workers that have built their context.
pub fn ready_key(g: u64) -> String {
    format!("elastic.g{g}.ready")
}

/// The key counting generation `g`'s workers that failed in it with a membership error.
pub fn regroup_key(g: u64) -> String {
    format!("elastic.g{g}.regroup")
}

/// The store prefix generation `g`'s context forms under.
pub fn generation_prefix(g: u64) -> String {
    format!("elastic.g{g}")
}

/// Whether `e` says the job's membership changed (a peer died, left, stalled or was aborted by
/// another rank's failure, or ranks joined): worth a new generation rather than the end.
pub fn is_membership_error(e: &Error) -> bool {
    matches!(
        e,
        Error::PeerClosed { .. }
            | Error::PeerTimedOut { .. }
            | Error::Timeout { .. }
            | Error::Aborted { .. }
            | Error::MembershipChanged { .. }
    )
}

/// A worker's view of its elastic job, handed to the work of each generation by [`run`].
pub struct Membership<'a> {
    store: &'a dyn Store,
    generation: u64,
    worker: u64,
}

impl Membership<'_> {
    /// The generation this context belongs to.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// This worker's id (stable across generations, unlike its rank).
    pub fn worker(&self) -> u64 {
        self.worker
    }

    /// Whether the launcher has published a newer generation (ranks joined or left): then
    /// [`Error::MembershipChanged`], which the work returns (with `?`) so that [`run`] rebuilds
    /// the context at the new size. One store read. Outside an elastic job, always `Ok`.
    pub fn check(&self) -> Result<()> {
        if let Some(latest) = read_generation(self.store)?
            && latest > self.generation
        {
            return Err(Error::MembershipChanged { current: self.generation, generation: latest });
        }
        Ok(())
    }
}

/// Runs `work` on the context of each generation of an elastic job until it succeeds: when it
/// fails with a [membership error](is_membership_error), waits for the launcher's next
/// generation (at most `FERROGLOO_ELASTIC_TIMEOUT`), rebuilds the context with this worker's
/// new rank and size, and calls `work` again. Any other error ends it, and is recorded under
/// [`FATAL_KEY`] so that the launcher ends the whole job rather than going on without this
/// worker; so does no generation with this worker in it in time (a worker the launcher
/// started to join the job waits for the generation that includes it). `timeout` is each
/// context's deadline.
///
/// A membership error with no rank gone (a peer only slower than `timeout`) is counted under
/// [`regroup_key`]: the launcher then publishes a new generation of the same workers (one of
/// its resets), and the stalled worker joins it when it wakes. Choose `timeout` well above a
/// step's longest time.
///
/// Outside an elastic job (no `FERROGLOO_ELASTIC`), it is one call of `work` on the job's
/// context (and [`Membership::check`] never reports a change).
pub fn run<R>(
    env: &RankEnv,
    device: &Device,
    timeout: Duration,
    mut work: impl FnMut(&Context, &Membership<'_>) -> Result<R>,
) -> Result<R> {
    let store = crate::rendezvous::open(&env.store)?;
    if std::env::var(ELASTIC_ENV).ok().as_deref() != Some("1") {
        let ctx = Context::builder(env.rank, env.size).timeout(timeout).connect(&store, device)?;
        let fixed = crate::rendezvous::HashStore::new();
        return work(&ctx, &Membership { store: &fixed, generation: 0, worker: env.rank as u64 });
    }
    let me: u64 = std::env::var(WORKER_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| Error::invalid(format!("{ELASTIC_ENV}=1 but {WORKER_ENV} is not a worker id")))?;
    let wait_for = match std::env::var(ELASTIC_TIMEOUT_ENV) {
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| (0.0..=1e9).contains(s))
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .ok_or_else(|| {
                Error::invalid(format!("{ELASTIC_TIMEOUT_ENV}={v:?} is not a number of seconds from 0 to 1e9"))
            })?,
        Err(_) => Duration::from_secs(60),
    };
    let mut seen: Option<u64> = None;
    // Since when this worker has waited for a generation with it in it.
    let mut outside_since: Option<Instant> = None;
    loop {
        let g = next_generation(&*store, seen, wait_for)?;
        seen = Some(g);
        let raw = store.get(&members_key(g), wait_for)?;
        let members: Vec<u64> =
            String::from_utf8_lossy(&raw).split(',').filter_map(|m| m.trim().parse().ok()).collect();
        let Some(rank) = members.iter().position(|&m| m == me) else {
            let since = *outside_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= wait_for {
                return Err(Error::invalid(format!(
                    "worker {me} is not in generation {g} of the elastic job (its members: {members:?}), nor in \
                     any generation for {}",
                    crate::error::secs(&wait_for)
                )));
            }
            tracing::debug!(generation = g, "elastic job: this worker is not in the latest generation; waiting");
            continue;
        };
        outside_since = None;
        tracing::info!(generation = g, rank, size = members.len(), "elastic job: joining a generation");
        let scoped = PrefixStore::new(generation_prefix(g), &*store);
        let membership = Membership { store: &*store, generation: g, worker: me };
        let result = Context::builder(rank, members.len()).timeout(timeout).connect(&scoped, device).and_then(|ctx| {
            // Counted so that the launcher adds ranks only once every member is here: a worker
            // still forming an older generation would wait out its deadline for one that left.
            if let Err(e) = store.add(&ready_key(g), 1) {
                tracing::warn!(error = %e, "elastic job: could not count this worker in the store");
            }
            work(&ctx, &membership)
        });
        match result {
            Ok(r) => return Ok(r),
            Err(e) if is_membership_error(&e) => {
                tracing::warn!(generation = g, error = %e, "elastic job: membership changed; waiting for the next generation");
                // When no process ended (a peer only stalled past the deadline), the launcher
                // has nothing to notice: this asks it for a new generation of the same workers.
                if !matches!(e, Error::MembershipChanged { .. })
                    && let Err(se) = store.add(&regroup_key(g), 1)
                {
                    tracing::warn!(error = %se, "elastic job: could not ask for a new generation");
                }
            }
            Err(e) => {
                // Tell the launcher before this worker exits: this failure ends the job.
                let why = format!("worker {me} (rank {rank} of generation {g}): {e}");
                if let Err(se) = store.set(FATAL_KEY, why.as_bytes()) {
                    tracing::warn!(error = %se, "elastic job: could not record this worker's failure in the store");
                }
                return Err(e);
            }
        }
    }
}

/// The latest generation the store holds, if any.
fn read_generation(store: &dyn Store) -> Result<Option<u64>> {
    let Some(raw) = store.try_get(GENERATION_KEY)? else { return Ok(None) };
    String::from_utf8_lossy(&raw)
        .trim()
        .parse()
        .map(Some)
        .map_err(|_| Error::invalid(format!("{GENERATION_KEY} holds {raw:?}, not a number")))
}

/// The newest generation after `seen` (any, if `None`), waiting for one at most `limit`.
fn next_generation(store: &dyn Store, seen: Option<u64>, limit: Duration) -> Result<u64> {
    let deadline = Instant::now() + limit;
    let mut backoff = crate::rendezvous::Backoff::new();
    loop {
        if let Some(g) = read_generation(store)?
            && seen.is_none_or(|s| g > s)
        {
            return Ok(g);
        }
        if !backoff.sleep_until(deadline) {
            return Err(Error::Timeout {
                op: format!(
                    "waiting for the next generation of the elastic job (after {})",
                    seen.map_or("none".into(), |s| s.to_string())
                ),
                ranks: Vec::new(),
                keys: vec![GENERATION_KEY.to_string()],
                waited: limit,
            });
        }
    }
}
