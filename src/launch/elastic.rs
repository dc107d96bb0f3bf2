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
//! A job shrinks in place: when the work fails because members died (a connection closed, a
//! heartbeat went silent, the context was revoked for it), the survivors
//! [shrink](Context::shrink) their context (they agree on who failed, over the connections
//! they hold) and [`run`] calls the work again on the smaller context, in the same generation
//! ([`Membership::shrinks`] counts these). Its rank 0 records the survivors in the store, and
//! the launcher follows ([`Coordinator::follow_shrinks`]) instead of publishing a generation.
//! A store round trip is left for what needs one: ranks joining, a peer that stalled rather
//! than died (it cannot be agreed away), and a shrink that failed (too few survivors, or this
//! worker was itself decided failed).
//!
//! Both halves of the protocol live here: the launcher's ([`Coordinator`], which
//! `ferrogloo-run` drives) and the workers' ([`run`], [`Membership`]). They meet through these
//! store keys, which nothing else reads or writes:
//!
//! | key | value |
//! |---|---|
//! | `elastic.generation` | the latest generation number, decimal |
//! | `elastic.g<N>.members` | its workers (ids as `FERROGLOO_WORKER` gives them), comma-separated, in rank order |
//! | `elastic.g<N>.ready` | how many of its workers have built their context (the launcher adds ranks only to a generation that all have joined) |
//! | `elastic.g<N>.regroup` | how many of its workers failed in it with a membership error: when no process ended, the launcher publishes the same workers again (a peer only stalled) |
//! | `elastic.g<N>.shrink<K>` | its workers after its `K`-th shrink in place (`K` = 1, 2, ...), set by the shrunk context's rank 0 |
//! | `elastic.fatal` | set by a worker whose work failed for another reason than membership: the job ends |
//!
//! and each generation forms its context under the store prefix `elastic.g<N>`.
//!
//! ```no_run
//! use ferrogloo::device::{Device, TcpAttr};
//! use ferrogloo::launch::{RankEnv, elastic};
//! use ferrogloo::Reduction;
//! use std::time::Duration;
//!
//! # fn main() -> ferrogloo::Result<()> {
//! let env = RankEnv::from_env()?;
//! let device = Device::tcp(&TcpAttr::default())?;
//! let mut step = 0u64; // progress survives generations
//! elastic::run(&env, &device, Duration::from_secs(30), |ctx, membership| {
//!     // Newcomers and survivors agree on where to go on from.
//!     let mut start = [step];
//!     ctx.allreduce(&mut start, Reduction::Max)?;
//!     step = start[0];
//!     while step < 1000 {
//!         if step % 10 == 0 {
//!             membership.check()?; // ranks joined: rebuild at the new size
//!         }
//!         let mut grads = vec![1.0f32; 1 << 16];
//!         ctx.allreduce(&mut grads, Reduction::Sum)?;
//!         step += 1;
//!     }
//!     Ok(())
//! })?;
//! # Ok(())
//! # }
//! ```

use super::RankEnv;
use crate::config::{FERROGLOO_ELASTIC, FERROGLOO_ELASTIC_TIMEOUT, FERROGLOO_WORKER, Vars};
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::rendezvous::{PrefixStore, Store};
use std::time::{Duration, Instant};

/// How long a worker waits for the next generation after a membership error, unless
/// [`FERROGLOO_ELASTIC_TIMEOUT`] says otherwise.
const DEFAULT_WAIT: Duration = Duration::from_secs(60);

/// The key holding the latest generation.
const GENERATION_KEY: &str = "elastic.generation";

/// The key a worker sets (to its id and error) when its work failed for a reason a new
/// generation would not mend: the launcher then ends the job instead of going on without it.
const FATAL_KEY: &str = "elastic.fatal";

/// The key holding generation `g`'s workers.
fn members_key(g: u64) -> String {
    format!("elastic.g{g}.members")
}

/// The key counting generation `g`'s workers that have built their context.
fn ready_key(g: u64) -> String {
    format!("elastic.g{g}.ready")
}

/// The key counting generation `g`'s workers that failed in it with a membership error.
fn regroup_key(g: u64) -> String {
    format!("elastic.g{g}.regroup")
}

/// The key holding generation `g`'s workers after its `k`-th shrink in place (1, 2, ...).
fn shrink_key(g: u64, k: u32) -> String {
    format!("elastic.g{g}.shrink{k}")
}

/// The store prefix generation `g`'s context forms under.
fn generation_prefix(g: u64) -> String {
    format!("elastic.g{g}")
}

/// The launcher's side of an elastic job: it publishes each generation (which workers are in
/// it, in rank order) and reads what the workers report back: how many of the current
/// generation have built their context, how many asked to regroup, and a failure that ends
/// the job. `ferrogloo-run --min-np` decides, with these, when to publish (ranks died, ranks
/// were added, a peer stalled); the workers' side is [`run`].
pub struct Coordinator {
    store: Box<dyn Store>,
    generation: u64,
    members: Vec<usize>,
    /// How many shrinks in place of the current generation it has followed.
    shrinks: u32,
    /// How many workers the current generation had when it was published.
    published: usize,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("store", &self.store.describe())
            .field("generation", &self.generation)
            .field("members", &self.members)
            .field("shrinks", &self.shrinks)
            .finish()
    }
}

impl Coordinator {
    /// Publishes generation 0 of the job in `store`: the workers `members` (their ids, as
    /// `FERROGLOO_WORKER` gives them), in rank order.
    pub fn start(store: Box<dyn Store>, members: &[usize]) -> Result<Self> {
        let mut c = Coordinator { store, generation: 0, members: Vec::new(), shrinks: 0, published: 0 };
        c.publish(0, members)?;
        Ok(c)
    }

    /// The latest generation published.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Its workers, in rank order (after the shrinks in place it has
    /// [followed](Self::follow_shrinks)).
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Follows the shrinks in place of the current generation that its workers recorded since
    /// the last call (members died and the survivors went on over the connections they hold,
    /// [`run`]): [`members`](Self::members) are then the survivors. True when there was one.
    /// No new generation is needed for such a loss.
    pub fn follow_shrinks(&mut self) -> Result<bool> {
        let mut followed = false;
        // At most one shrink per member of the generation as published.
        while (self.shrinks as usize) < self.published {
            let Some(raw) = self.store.try_get(&shrink_key(self.generation, self.shrinks + 1))? else { break };
            let text = String::from_utf8_lossy(&raw);
            let members: Option<Vec<usize>> = text.split(',').map(|m| m.trim().parse().ok()).collect();
            let Some(members) = members else {
                return Err(Error::store(
                    shrink_key(self.generation, self.shrinks + 1),
                    format!("holds {text:?}, not a list of workers"),
                ));
            };
            self.members = members;
            self.shrinks += 1;
            followed = true;
        }
        Ok(followed)
    }

    /// Publishes the next generation, of `members` (in rank order): every worker of the
    /// current one leaves its work at its next [`Membership::check`] or failure and joins it;
    /// a worker not in it waits for one that has it. Returns the new generation's number. When
    /// the store fails, nothing is published (the next call tries the same number again).
    pub fn publish_next(&mut self, members: &[usize]) -> Result<u64> {
        self.publish(self.generation + 1, members)?;
        Ok(self.generation)
    }

    /// Publishes generation `g`: its members first, so that a worker that sees the generation
    /// finds them.
    fn publish(&mut self, g: u64, members: &[usize]) -> Result<()> {
        let list = members.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        self.store.set(&members_key(g), list.as_bytes())?;
        self.store.set(GENERATION_KEY, g.to_string().as_bytes())?;
        self.generation = g;
        self.members = members.to_vec();
        self.shrinks = 0;
        self.published = members.len();
        Ok(())
    }

    /// How many workers of the current generation have built its context.
    pub fn ready_count(&self) -> Result<u64> {
        self.counter(&ready_key(self.generation))
    }

    /// Whether every worker of the current generation has built its context (ranks are added
    /// only then: a worker still forming an older generation would wait out its deadline there
    /// for workers that moved on).
    pub fn all_joined(&self) -> Result<bool> {
        Ok(self.ready_count()? >= self.members.len() as u64)
    }

    /// How many workers of the current generation failed in it with a membership error while
    /// no process ended (a peer stalled past their deadline): when this is not zero and no
    /// death explains it, the launcher publishes the same workers again.
    pub fn regroup_count(&self) -> Result<u64> {
        self.counter(&regroup_key(self.generation))
    }

    /// The failure a worker recorded because its work failed for another reason than
    /// membership (its id, rank, generation and error, in words): the job ends.
    pub fn fatal(&self) -> Result<Option<String>> {
        Ok(self.store.try_get(FATAL_KEY)?.map(|why| String::from_utf8_lossy(&why).into_owned()))
    }

    /// A counter the workers add to (0 while missing; a value that is not a count reads 0).
    fn counter(&self, key: &str) -> Result<u64> {
        Ok(self.store.try_get(key)?.and_then(|v| String::from_utf8_lossy(&v).trim().parse().ok()).unwrap_or(0))
    }
}

/// Whether `e` says the job's membership changed (a peer died, left, stalled or was aborted by
/// another rank's failure, or ranks joined): worth a new generation rather than the end.
pub fn is_membership_error(e: &Error) -> bool {
    matches!(
        e,
        Error::PeerClosed { .. }
            | Error::PeerSilent { .. }
            | Error::PeerTimedOut { .. }
            | Error::Timeout { .. }
            | Error::Aborted { .. }
            | Error::Revoked { .. }
            | Error::MembershipChanged { .. }
    )
}

/// A worker's view of its elastic job, handed to the work of each generation by [`run`].
pub struct Membership<'a> {
    store: &'a dyn Store,
    generation: u64,
    worker: u64,
    shrinks: u32,
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

    /// How many times this generation's context has shrunk in place (members died and the
    /// survivors went on without them) before this call of the work: 0 on a context fresh
    /// from the store.
    pub fn shrinks(&self) -> u32 {
        self.shrinks
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
/// new rank and size, and calls `work` again. Any other error ends it, and is recorded in the
/// store (`elastic.fatal`, [`Coordinator::fatal`]) so that the launcher ends the whole job
/// rather than going on without this worker; so does no generation with this worker in it in
/// time (a worker the launcher started to join the job waits for the generation that
/// includes it). `timeout` is each context's deadline.
///
/// A membership error with no rank gone (a peer only slower than `timeout`) is counted in the
/// store ([`Coordinator::regroup_count`]): the launcher then publishes a new generation of the
/// same workers (one of its resets), and the stalled worker joins it when it wakes. Choose
/// `timeout` well above a step's longest time.
///
/// Outside an elastic job (no `FERROGLOO_ELASTIC`), it is one call of `work` on the job's
/// context (and [`Membership::check`] never reports a change).
pub fn run<R>(
    env: &RankEnv,
    device: &Device,
    timeout: Duration,
    mut work: impl FnMut(&Context, &Membership<'_>) -> Result<R>,
) -> Result<R> {
    let store = env.open_store()?;
    let Some((me, wait_for)) = worker_in(&Vars::process())? else {
        let ctx = Context::builder(env.rank, env.size).timeout(timeout).connect(&store, device)?;
        let fixed = crate::rendezvous::HashStore::new();
        return work(&ctx, &Membership { store: &fixed, generation: 0, worker: env.rank as u64, shrinks: 0 });
    };
    let worker = Worker { store: &*store, device, timeout, me, wait_for };
    worker.run(work)
}

/// This worker's id and how long it waits for a generation, when `vars` say it is a worker
/// of an elastic job ([`FERROGLOO_ELASTIC`], [`FERROGLOO_WORKER`],
/// [`FERROGLOO_ELASTIC_TIMEOUT`]); `None` outside one.
pub(crate) fn worker_in(vars: &Vars<'_>) -> Result<Option<(u64, Duration)>> {
    if !vars.is_one(FERROGLOO_ELASTIC) {
        return Ok(None);
    }
    let me: u64 = vars
        .parse(FERROGLOO_WORKER, "a worker id")?
        .ok_or_else(|| Error::invalid(format!("{FERROGLOO_ELASTIC}=1 but {FERROGLOO_WORKER} is not a worker id")))?;
    let wait_for = vars
        .seconds(FERROGLOO_ELASTIC_TIMEOUT, |s| (0.0..=1e9).contains(&s), "a number of seconds from 0 to 1e9")?
        .unwrap_or(DEFAULT_WAIT);
    Ok(Some((me, wait_for)))
}

/// One worker of an elastic job, as [`run`] found it in its environment.
struct Worker<'a> {
    store: &'a dyn Store,
    device: &'a Device,
    /// Each context's deadline.
    timeout: Duration,
    /// This worker's id.
    me: u64,
    /// How long it waits for a generation with it in it.
    wait_for: Duration,
}

impl Worker<'_> {
    /// [`run`]'s loop over generations.
    fn run<R>(&self, mut work: impl FnMut(&Context, &Membership<'_>) -> Result<R>) -> Result<R> {
        let Worker { store, device, timeout, me, wait_for } = *self;
        let mut seen: Option<u64> = None;
        // Since when this worker has waited for a generation with it in it.
        let mut outside_since: Option<Instant> = None;
        loop {
            let g = next_generation(store, seen, wait_for)?;
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
            let scoped = PrefixStore::new(generation_prefix(g), store);
            let result = match Context::builder(rank, members.len()).timeout(timeout).connect(&scoped, device) {
                Ok(ctx) => {
                    // Counted so that the launcher adds ranks only once every member is here: a
                    // worker still forming an older generation would wait out its deadline for one
                    // that left.
                    if let Err(e) = store.add(&ready_key(g), 1) {
                        tracing::warn!(error = %e, "elastic job: could not count this worker in the store");
                    }
                    self.in_place(ctx, g, &members, &mut work)
                }
                Err(e) if is_membership_error(&e) => Err(e),
                Err(e) => return Err(self.fatal(rank, g, e)),
            };
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
                // Recorded as fatal already, while the context was still up.
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether generation `g` must not go on in place: the launcher published a newer one, a
    /// worker's own failure ends the job, or the store cannot say (then the launcher decides).
    fn superseded(&self, g: u64) -> bool {
        let newer = read_generation(self.store).map(|latest| latest.is_some_and(|l| l > g));
        let fatal = self.store.try_get(FATAL_KEY).map(|f| f.is_some());
        match (newer, fatal) {
            (Ok(newer), Ok(fatal)) => newer || fatal,
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(generation = g, error = %e, "elastic job: the store cannot say whether to shrink in place");
                true
            }
        }
    }

    /// Records `e`, this worker's failure as rank `rank` of generation `g`, for the launcher
    /// (the failure ends the job), and returns it. Called while the worker's context is still
    /// up: the peers that lose it then find the record and do not go on without it.
    fn fatal(&self, rank: usize, g: u64, e: Error) -> Error {
        let why = format!("worker {} (rank {rank} of generation {g}): {e}", self.me);
        if let Err(se) = self.store.set(FATAL_KEY, why.as_bytes()) {
            tracing::warn!(error = %se, "elastic job: could not record this worker's failure in the store");
        }
        e
    }
}

impl Worker<'_> {
    /// Runs `work` on `ctx`, generation `g`'s context (of workers `members`, in rank order),
    /// and each time it fails because members died, [shrinks](Context::shrink) the context in
    /// place and runs `work` again on the survivors' context: no store round trip and no new
    /// connection. The new rank 0 records the survivors (`elastic.g<N>.shrink<K>`) so that the
    /// launcher follows instead of publishing a generation. Returns the error that ends this
    /// generation for this worker: one that a shrink cannot mend (a stalled peer, a newer
    /// generation, a failure of its own), or the peer's loss when the shrink failed (this
    /// worker was decided failed, too few survived, a member did not take part in time).
    fn in_place<R>(
        &self,
        mut ctx: Context,
        g: u64,
        members: &[u64],
        work: &mut impl FnMut(&Context, &Membership<'_>) -> Result<R>,
    ) -> Result<R> {
        let mut shrinks = 0u32;
        loop {
            let membership = Membership { store: self.store, generation: g, worker: self.me, shrinks };
            let e = match work(&ctx, &membership) {
                Ok(r) => return Ok(r),
                Err(e) if !is_membership_error(&e) => {
                    return Err(self.fatal(ctx.world_rank(ctx.rank()).unwrap_or(0), g, e));
                }
                Err(e) => e,
            };
            // A stalled peer cannot be agreed away (it would hold the agreement to its deadline
            // too), a newer generation replaces this one anyway, and a member's own failure
            // (recorded before its context closed) ends the job rather than leaving the others
            // to go on without it.
            if !is_peer_loss(&e) || self.superseded(g) {
                return Err(e);
            }
            tracing::warn!(generation = g, error = %e, "elastic job: a member was lost; shrinking in place");
            let shrunk = match ctx.shrink() {
                Ok(s) => s,
                Err(why) => {
                    tracing::warn!(generation = g, error = %why, "elastic job: could not shrink in place");
                    return Err(e);
                }
            };
            // Again after the shrink: a member that the others agreed away may have left for
            // a generation the launcher published meanwhile (its context closed as it left),
            // or failed on its own; then all go there, or the job ends, rather than on
            // without it.
            if self.superseded(g) {
                return Err(e);
            }
            shrinks += 1;
            let ids: Vec<u64> =
                (0..shrunk.size()).filter_map(|r| members.get(shrunk.world_rank(r)?).copied()).collect();
            tracing::info!(generation = g, shrinks, rank = shrunk.rank(), workers = ?ids, "elastic job: shrank in place");
            if shrunk.rank() == 0 {
                let list = ids.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
                if let Err(se) = self.store.set(&shrink_key(g, shrinks), list.as_bytes()) {
                    // The launcher then publishes a generation of the survivors: they rebuild.
                    tracing::warn!(error = %se, "elastic job: could not record the shrink in the store");
                }
            }
            ctx = shrunk;
        }
    }
}

/// Whether `e` says a member of the context was lost (its connection closed, it went silent,
/// or the context was aborted or revoked because of a loss): what a shrink in place mends.
fn is_peer_loss(e: &Error) -> bool {
    matches!(e, Error::PeerClosed { .. } | Error::PeerSilent { .. } | Error::Aborted { .. } | Error::Revoked { .. })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Reduction;
    use crate::rendezvous::HashStore;
    use std::sync::Arc;

    /// Waits (at most 20 s) until `ready` holds, asking every few milliseconds.
    fn until(what: &str, mut ready: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready() {
            assert!(Instant::now() < deadline, "waited 20 s for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Worker `me` of the job in `store`, on its own thread, running `work`.
    fn worker<R: Send + 'static>(
        store: &Arc<HashStore>,
        me: u64,
        work: impl FnMut(&Context, &Membership<'_>) -> Result<R> + Send + 'static,
    ) -> std::thread::JoinHandle<Result<R>> {
        let store = store.clone();
        std::thread::spawn(move || {
            let device = Device::in_process();
            let w = Worker {
                store: &*store,
                device: &device,
                timeout: Duration::from_secs(2),
                me,
                wait_for: Duration::from_secs(20),
            };
            w.run(work)
        })
    }

    /// Sums 1 over the context: its size, if every member took part.
    fn size_by_allreduce(ctx: &Context) -> Result<usize> {
        let mut one = [1u64];
        ctx.allreduce(&mut one, Reduction::Sum)?;
        Ok(one[0] as usize)
    }

    #[test]
    fn workers_rebuild_in_each_generation_the_coordinator_publishes() {
        let store = Arc::new(HashStore::new());
        let mut c = Coordinator::start(Box::new(store.clone()), &[0, 1, 2]).unwrap();
        assert_eq!((c.generation(), c.members()), (0, &[0, 1, 2][..]));
        // Generation 0 works until the job grows; generation 1 is the job at its new size.
        let work = |ctx: &Context, m: &Membership<'_>| -> Result<(u64, usize, usize)> {
            assert_eq!(size_by_allreduce(ctx)?, ctx.size(), "generation {}", m.generation());
            if m.generation() == 0 {
                let deadline = Instant::now() + Duration::from_secs(20);
                while Instant::now() < deadline {
                    m.check()?;
                    std::thread::sleep(Duration::from_millis(2));
                }
                return Err(Error::invalid("generation 1 never came"));
            }
            Ok((m.generation(), ctx.rank(), ctx.size()))
        };
        let mut workers: Vec<_> = (0..3).map(|w| worker(&store, w, work)).collect();
        until("generation 0 to be joined", || c.all_joined().unwrap());
        assert_eq!(c.ready_count().unwrap(), 3);
        assert_eq!(c.regroup_count().unwrap(), 0);
        // A worker joins: it waits for the generation that has it; the others leave theirs.
        workers.push(worker(&store, 3, work));
        assert_eq!(c.publish_next(&[2, 0, 1, 3]).unwrap(), 1);
        let got: Vec<(u64, usize, usize)> = workers.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        // Ranks follow the published order: worker 2 is rank 0 of generation 1.
        assert_eq!(got, [(1, 1, 4), (1, 2, 4), (1, 0, 4), (1, 3, 4)]);
        until("generation 1 to be joined", || c.all_joined().unwrap());
        assert_eq!((c.ready_count().unwrap(), c.regroup_count().unwrap(), c.fatal().unwrap()), (4, 0, None));
    }

    #[test]
    fn the_survivors_of_a_dead_worker_shrink_in_place_and_the_coordinator_follows() {
        let store = Arc::new(HashStore::new());
        let mut c = Coordinator::start(Box::new(store.clone()), &[0, 1, 2]).unwrap();
        let work = |ctx: &Context, m: &Membership<'_>| -> Result<(u64, u32, usize)> {
            Ok((m.generation(), m.shrinks(), size_by_allreduce(ctx)?))
        };
        let survivors: Vec<_> = (0..2).map(|w| worker(&store, w, work)).collect();
        // Worker 2 joins generation 0 and dies: its connections close with no error of its own.
        let scoped = PrefixStore::new(generation_prefix(0), &*store);
        let ctx = Context::builder(2, 3).timeout(Duration::from_secs(2)).connect(&scoped, &Device::in_process());
        drop(ctx.unwrap());
        // The survivors shrink their context in place and finish in the same generation, at
        // size 2, with no new generation and no request to regroup...
        let got: Vec<(u64, u32, usize)> = survivors.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        assert_eq!(got, [(0, 1, 2), (0, 1, 2)]);
        // ... and the launcher's side follows their record.
        assert_eq!(c.members(), [0, 1, 2]);
        assert!(c.follow_shrinks().unwrap());
        assert_eq!((c.generation(), c.members(), c.regroup_count().unwrap()), (0, &[0, 1][..], 0));
        assert!(!c.follow_shrinks().unwrap(), "nothing new to follow");
        assert_eq!((read_generation(&*store).unwrap(), c.fatal().unwrap()), (Some(0), None));
    }

    #[test]
    fn a_failure_of_a_worker_s_own_is_fatal_and_the_stranded_ask_to_regroup() {
        let store = Arc::new(HashStore::new());
        let mut c = Coordinator::start(Box::new(store.clone()), &[0, 1, 2]).unwrap();
        // Worker 2 fails on its own in generation 0; the others lose it in their allreduce.
        let work = |ctx: &Context, m: &Membership<'_>| -> Result<(u64, usize)> {
            if m.worker() == 2 {
                return Err(Error::invalid("bad input on worker 2"));
            }
            Ok((m.generation(), size_by_allreduce(ctx)?))
        };
        let survivors: Vec<_> = (0..2).map(|w| worker(&store, w, work)).collect();
        let failed = worker(&store, 2, work).join().unwrap().unwrap_err();
        assert!(failed.to_string().contains("bad input on worker 2"), "{failed}");
        let fatal = c.fatal().unwrap().expect("the failure is recorded for the launcher");
        assert!(fatal.contains("worker 2 (rank 2 of generation 0)") && fatal.contains("bad input"), "{fatal}");
        // Nobody ended that the launcher could see die, and the survivors do not go on without
        // the failed worker (no shrink in place): both ask for a new generation...
        until("both survivors to ask to regroup", || c.regroup_count().unwrap() == 2);
        assert_eq!(c.ready_count().unwrap(), 3);
        assert!(!c.follow_shrinks().unwrap(), "no shrink in place after a member's own failure");
        // ... and finish in the one published for them.
        assert_eq!(c.publish_next(&[0, 1]).unwrap(), 1);
        let got: Vec<(u64, usize)> = survivors.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        assert_eq!(got, [(1, 2), (1, 2)]);
        assert_eq!((c.generation(), c.members(), c.regroup_count().unwrap()), (1, &[0, 1][..], 0));
    }

    #[test]
    fn the_coordinator_follows_every_shrink_down_to_one_worker() {
        let store = Arc::new(HashStore::new());
        let mut c = Coordinator::start(Box::new(store.clone()), &[0, 1, 2, 3]).unwrap();
        // Three losses one after another; the last leaves one worker (half of two, rank 0).
        for (k, members) in [(1, "0,1,2"), (2, "0,1"), (3, "0")] {
            store.set(&shrink_key(0, k), members.as_bytes()).unwrap();
        }
        assert!(c.follow_shrinks().unwrap());
        assert_eq!(c.members(), [0]);
        // A record that is no list of workers is an error naming its key.
        let mut c = Coordinator::start(Box::new(store.clone()), &[0, 1]).unwrap();
        store.set(&shrink_key(0, 1), b"0,x").unwrap();
        let e = c.follow_shrinks().unwrap_err();
        assert!(e.to_string().contains("elastic.g0.shrink1"), "{e}");
    }

    #[test]
    fn a_stalled_worker_is_not_shrunk_away_the_others_ask_to_regroup() {
        let store = Arc::new(HashStore::new());
        let mut c = Coordinator::start(Box::new(store.clone()), &[0, 1, 2]).unwrap();
        // Worker 2 stalls past the others' 2 s deadline in generation 0: a peer that is only
        // slow cannot be agreed away, so nobody shrinks; everyone asks to regroup.
        let work = |ctx: &Context, m: &Membership<'_>| -> Result<(u64, u32, usize)> {
            if m.worker() == 2 && m.generation() == 0 {
                std::thread::sleep(Duration::from_millis(2500));
            }
            Ok((m.generation(), m.shrinks(), size_by_allreduce(ctx)?))
        };
        let workers: Vec<_> = (0..3).map(|w| worker(&store, w, work)).collect();
        until("the workers to ask to regroup", || c.regroup_count().unwrap() >= 2);
        assert!(!c.follow_shrinks().unwrap(), "no shrink in place");
        assert_eq!(c.publish_next(&[0, 1, 2]).unwrap(), 1);
        let got: Vec<(u64, u32, usize)> = workers.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        assert_eq!(got, [(1, 0, 3), (1, 0, 3), (1, 0, 3)]);
        assert_eq!(c.fatal().unwrap(), None);
    }

    #[test]
    fn a_worker_left_out_of_the_job_gives_up_at_its_deadline() {
        let store = Arc::new(HashStore::new());
        let _c = Coordinator::start(Box::new(store.clone()), &[0]).unwrap();
        let device = Device::in_process();
        let w = Worker {
            store: &*store,
            device: &device,
            timeout: Duration::from_secs(2),
            me: 7,
            wait_for: Duration::from_millis(300),
        };
        let t = Instant::now();
        let e = w.run(|_, _| Ok(())).unwrap_err();
        assert!(e.is_timeout() && e.to_string().contains("next generation of the elastic job (after 0)"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "gave up after {:?}", t.elapsed());
    }
}
