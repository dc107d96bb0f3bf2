//! A communicator: a group of ranks over a formed mesh, with what point-to-point calls and
//! collectives need: posting to pairs, waiting with deadlines, [`Scope`]s, sequence numbers,
//! the abort state and scratch memory.
//!
//! A [`Context`](crate::Context) is a communicator plus the device it was formed on; the
//! algorithms work on communicators only, so they depend on the transport contract and nothing
//! above it. A sub-group ([`Context::split`](crate::Context::split)) is another communicator
//! over the same mesh: it has its own group id in every message key, so its messages never
//! meet the parent's, and it reaches its members through the parent's pairs.

use crate::error::{Error, Result};
use crate::sync::lock;
use crate::transport::{
    ALL_GROUPS, AbortCause, BusyWait, CLOSE_FLUSH, Completion, Done, Key, LocalArea, MemKind, Mesh, Pair, RecvBuf,
    RecvTarget, SEQUENCED, SendBuf, group_id,
};
use crate::types::OpDesc;
use bytemuck::Pod;
use smallvec::{SmallVec, smallvec};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) mod heartbeat;
mod persistent;
mod survival;
pub(crate) use persistent::{Interrupter, PersistentRecv, QUIET, SLEEPING, wait_any};
pub(crate) use survival::{Agreements, Survival};

/// Group id of the hierarchical allreduce's leaders (see `Context::hierarchy`): a constant that
/// `Comm::subgroup_id` never makes (its counter starts at 1).
pub(crate) const LEADERS_GROUP: u64 = 0x6c65_6164_6572_7331;

/// Tag namespace of user point-to-point messages.
const NS_P2P: u64 = 1 << 62;
/// Tag namespace of collectives: `NS_COLL | tag << 32 | sequence`, a sequenced tag family per
/// user tag (see the transport contract).
const NS_COLL: u64 = SEQUENCED;
/// Collective tags are below this (the family must fit 30 bits).
pub(crate) const MAX_TAG: u32 = 1 << 30;

/// A formed mesh and what every communicator over it shares.
pub(crate) struct World {
    pub(crate) mesh: Mesh,
    /// This process's rank in the mesh.
    pub(crate) world_rank: usize,
    /// Each mesh rank's host identity, as published in its store entry.
    pub(crate) hosts: Vec<String>,
    /// Operations posted and not yet waited for or cancelled, per mesh rank: the pairs a wait
    /// may progress besides its own.
    pending: Arc<[AtomicU32]>,
    /// How waits busy-poll before sleeping.
    pub(crate) spin: BusyWait,
    /// The cost model of the mesh's links (see the `cost` module), set as its context forms.
    pub(crate) cost: Mutex<Option<crate::types::CostModel>>,
    /// Which copy path the host's shared-area collectives take (decided as the context forms;
    /// two copies until then, and for contexts made without it).
    pub(crate) copy_plan: Mutex<crate::types::CopyPlan>,
    /// This rank's pair with itself (whatever the backend).
    own: Arc<dyn Pair>,
    /// Why the mesh's own context failed, until its survivors shrink it: told to every peer
    /// when the mesh closes (see `Drop`), so that a peer still in an operation with this rank
    /// reports the first cause, not this rank closing.
    pub(crate) failure: Mutex<Option<Error>>,
    /// Set while a collective goes through the mesh's same-host area (`mesh.local`): its steps
    /// are numbered per area, so two at once from two threads would write slots the other
    /// reads (see `algorithms::steps::Local`).
    pub(crate) area_busy: std::sync::atomic::AtomicBool,
    /// Whether the area's pipelined collectives go in pieces of a fraction of the buffer
    /// (`Local::piece_elems`): the host's first rank's say, published as the context forms
    /// (whole slots until then), so that every member cuts a buffer alike.
    pub(crate) area_pieces: std::sync::atomic::AtomicBool,
}

impl Drop for World {
    fn drop(&mut self) {
        let failure = self.failure.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(err) = failure {
            let cause = AbortCause::of(&err, self.world_rank);
            let deadline = Instant::now() + CLOSE_FLUSH;
            for p in self.mesh.pairs.iter().flatten() {
                p.abort_closing(&err, &cause, deadline);
            }
        }
    }
}

/// The pairs an operation is posted to: one, but for a receive from any of several.
type Pairs = SmallVec<[Arc<dyn Pair>; 1]>;

/// Mesh ranks an operation waits on: a few, kept inline (a wait allocates nothing).
type Ranks = SmallVec<[usize; 4]>;

/// Operations a [`Scope`] holds without allocating: those of one phase of a collective on a
/// few ranks (a 4-rank ring phase posts 6).
const SCOPE_INLINE: usize = 8;

/// How often a long wait asks whether its group was aborted on another pair (a revoke that
/// reached this rank through a peer the waiting operation does not involve).
const REVOKE_CHECK: Duration = Duration::from_millis(10);

/// What a rank may send itself before it posts the receive (a larger send waits for it).
const SELF_BUDGET: usize = 8 << 20;

impl World {
    pub(crate) fn new(mesh: Mesh, world_rank: usize, hosts: Vec<String>, spin: BusyWait) -> Self {
        let pending = (0..mesh.pairs.len()).map(|_| AtomicU32::new(0)).collect();
        let own = crate::transport::memory::loopback(world_rank, SELF_BUDGET);
        World {
            mesh,
            world_rank,
            hosts,
            pending,
            spin,
            cost: Mutex::default(),
            copy_plan: Mutex::new(crate::types::CopyPlan::TWO),
            own,
            failure: Mutex::default(),
            area_busy: Default::default(),
            area_pieces: Default::default(),
        }
    }

    /// The pair to mesh rank `r` (the loopback pair for this rank).
    fn pair(&self, r: usize) -> Option<Arc<dyn Pair>> {
        if r == self.world_rank { Some(self.own.clone()) } else { self.mesh.pairs.get(r).cloned().flatten() }
    }
}

/// A group of ranks over a mesh; see the module documentation.
pub(crate) struct Comm {
    rank: usize,
    size: usize,
    /// The group id in message keys (0 for the mesh's own context).
    group: u64,
    /// Mesh rank of each member, indexed by rank in the group.
    members: Arc<[usize]>,
    /// Indexed by rank in the group (this rank's is its loopback pair).
    pairs: Vec<Option<Arc<dyn Pair>>>,
    shared: Arc<World>,
    timeout: Duration,
    collective_seq: Mutex<HashMap<u32, u32>>,
    /// Set once the communicator is aborted (by `abort` or a failed collective).
    aborted: Mutex<Option<Error>>,
    /// Set once its connections were closed ([`abort`](Self::abort) of the mesh's own group).
    closed: std::sync::atomic::AtomicBool,
    /// Scratch buffers reused by collectives (see `algorithms::Scratch`).
    scratch: Mutex<Vec<Vec<u64>>>,
    /// How many sub-groups of each kind were made from this one (see `subgroup_id`).
    made: Mutex<HashMap<u64, u64>>,
}

impl Comm {
    /// The communicator of the whole mesh (group 0).
    pub(crate) fn root(shared: Arc<World>, timeout: Duration) -> Self {
        let size = shared.mesh.pairs.len();
        let members: Arc<[usize]> = (0..size).collect();
        Self::over(shared, 0, members, timeout)
    }

    /// The communicator of `members` (mesh ranks, in group-rank order; this process is one of
    /// them) with group id `group`.
    pub(crate) fn over(shared: Arc<World>, group: u64, members: Arc<[usize]>, timeout: Duration) -> Self {
        let me = shared.world_rank;
        let rank = members.iter().position(|&m| m == me).unwrap_or(0);
        let pairs = members.iter().map(|&m| shared.pair(m)).collect();
        Comm {
            rank,
            size: members.len(),
            group,
            members,
            pairs,
            shared,
            timeout,
            collective_seq: Mutex::default(),
            aborted: Mutex::default(),
            closed: Default::default(),
            scratch: Mutex::default(),
            made: Mutex::default(),
        }
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// How this rank's callers busy-wait before they sleep (see `Context`'s `busy_poll`).
    pub(crate) fn spin(&self) -> BusyWait {
        self.shared.spin
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn shared(&self) -> &Arc<World> {
        &self.shared
    }

    /// The group id in this communicator's message keys.
    pub(crate) fn group(&self) -> u64 {
        self.group
    }

    /// The mesh rank of each member, by group rank.
    pub(crate) fn members(&self) -> Arc<[usize]> {
        self.members.clone()
    }

    /// A communicator of the same members under group id `group` (its own sequence numbers
    /// and abort state).
    pub(crate) fn sibling(&self, group: u64) -> Comm {
        Comm::over(self.shared.clone(), group, self.members.clone(), self.timeout)
    }

    /// The mesh rank of group rank `r`.
    pub(crate) fn world_rank(&self, r: usize) -> Option<usize> {
        self.members.get(r).copied()
    }

    /// The group rank of mesh rank `m`, if `m` is a member.
    pub(crate) fn rank_of_world(&self, m: usize) -> Option<usize> {
        self.members.iter().position(|&x| x == m)
    }

    /// The group rank of mesh rank `m` (what a pair's [`Done::peer`] says is the mesh rank);
    /// `m` itself for a rank outside the group, which no operation of the group completes.
    fn group_rank(&self, m: usize) -> usize {
        if self.group == 0 { m } else { self.members.iter().position(|&x| x == m).unwrap_or(m) }
    }

    /// A fresh group id for a sub-group made from this one: the same on every member as long
    /// as they make sub-groups of `kind` (a hash of how the group is chosen) in the same order
    /// (so not from two threads of one rank at once), and distinct, up to a 64-bit hash
    /// collision, from every other group any two members share.
    pub(crate) fn subgroup_id(&self, kind: u64) -> u64 {
        let mut made = lock(&self.made);
        let n = made.entry(kind).or_insert(0);
        *n += 1;
        group_id(fnv(&[self.group, kind, *n]))
    }

    /// The cost model of the mesh's links, measured or read when the mesh's context formed
    /// (see the `cost` module); every communicator over the mesh uses it. `None` for a mesh of
    /// one rank.
    pub(crate) fn cost_model(&self) -> Option<crate::types::CostModel> {
        *lock(&self.shared.cost)
    }

    /// The copy paths of the host's shared-area collectives.
    pub(crate) fn copy_plan(&self) -> crate::types::CopyPlan {
        *lock(&self.shared.copy_plan)
    }

    /// Whether this is the communicator of the whole mesh (group 0), not a sub-group.
    pub(crate) fn is_world(&self) -> bool {
        self.group == 0
    }

    /// The memory this rank shares with the other ranks of its host, for collectives of the
    /// mesh's own group (sub-groups run their collectives over the pairs).
    pub(crate) fn local_area(&self) -> Option<&Arc<dyn LocalArea>> {
        if self.group == 0 { self.shared.mesh.local.as_ref() } else { None }
    }

    /// The scratch pool of this communicator's collectives.
    pub(crate) fn scratch_pool(&self) -> &Mutex<Vec<Vec<u64>>> {
        &self.scratch
    }

    /// Whether [`abort`](Self::abort) closed its connections (the mesh's own group only).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Whether the communicator was aborted (it then fails every call).
    pub(crate) fn is_aborted(&self) -> bool {
        lock(&self.aborted).is_some()
    }

    /// The abort error, if the communicator was aborted.
    pub(crate) fn check_usable(&self) -> Result<()> {
        match &*lock(&self.aborted) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Aborts with `reason` on behalf of the user. Aborting the mesh's own group closes the
    /// connections (every group over them fails); a sub-group's abort leaves them.
    pub(crate) fn abort(&self, reason: &str) {
        let err = Error::Aborted { rank: self.shared.world_rank, reason: reason.to_string() };
        self.fail_as(&err, if self.group == 0 { ALL_GROUPS } else { self.group });
    }

    /// Revokes the communicator with `reason` ([`Context::revoke`](crate::Context::revoke)):
    /// it fails like an abort, with [`Error::Revoked`], and the connections stay up.
    pub(crate) fn revoke(&self, reason: &str) {
        let err = Error::Revoked { rank: self.shared.world_rank, reason: reason.to_string() };
        self.fail(&err);
    }

    /// Makes the communicator unusable because of `err`, and tells every peer the cause, so
    /// that each of them fails its pending and future operations of this group with it. The
    /// connections stay up for other groups (and for agreeing and shrinking, see
    /// `crate::survive`).
    pub(crate) fn fail(&self, err: &Error) {
        self.fail_as(err, self.group);
    }

    /// [`fail`](Self::fail), aborting `group` on every pair ([`ALL_GROUPS`]: closing them).
    fn fail_as(&self, err: &Error, group: u64) {
        {
            let mut a = lock(&self.aborted);
            // Closing goes ahead on a failed group too: its connections stay up until then.
            if a.is_some() && group != ALL_GROUPS {
                return;
            }
            a.get_or_insert_with(|| err.clone());
        }
        if group == ALL_GROUPS {
            self.closed.store(true, Ordering::SeqCst);
        }
        tracing::debug!(rank = self.rank, group = self.group, error = %err, "context aborted");
        let cause = AbortCause::of(err, self.shared.world_rank);
        for p in self.pairs.iter().flatten() {
            p.abort(group, err, &cause);
            if group == 0 {
                // The hierarchical allreduce's leaders run a part of the mesh's own context's
                // collectives in a group of their own: it fails with it.
                p.abort(LEADERS_GROUP, err, &cause);
            }
        }
        if group == 0 {
            lock(&self.shared.failure).get_or_insert_with(|| err.clone());
        }
    }

    /// Why this communicator's operations must end now, if they must: it failed here, or a
    /// peer aborted its group on any of its pairs (an abort that reached this rank through a
    /// peer its waiting operation does not involve).
    pub(crate) fn revoked(&self) -> Option<Error> {
        if let Err(e) = self.check_usable() {
            return Some(e);
        }
        self.pairs.iter().flatten().find_map(|p| p.aborted(self.group))
    }

    pub(crate) fn pair(&self, peer: usize) -> Result<&Arc<dyn Pair>> {
        self.check_usable()?;
        match self.pairs.get(peer) {
            Some(Some(p)) => Ok(p),
            _ => Err(Error::invalid(format!("rank {peer} is out of range for size {}", self.size))),
        }
    }

    /// Gives a buffer that an owned receive from rank `from` handed over back to that rank's
    /// pair once it has been read, to receive a later message into ([`Pair::recycle`]): a
    /// stream of large messages then reuses mapped pages. Dropped for a rank out of range.
    pub(crate) fn recycle(&self, from: usize, buf: Vec<u8>) {
        if let Some(Some(p)) = self.pairs.get(from) {
            p.recycle(buf);
        }
    }

    /// The key of user point-to-point messages with `tag`.
    pub(crate) fn p2p_key(&self, tag: u32) -> Key {
        Key { group: self.group, tag: NS_P2P | u64::from(tag) }
    }

    /// The key of the next collective with user tag `tag`. Every rank calls collectives with
    /// one tag in the same order, so every rank computes the same sequence.
    pub(crate) fn next_collective_key(&self, tag: u32) -> Result<Key> {
        if tag >= MAX_TAG {
            return Err(Error::invalid(format!("collective tag {tag} must be below 2^30")));
        }
        let mut seqs = lock(&self.collective_seq);
        let seq = seqs.entry(tag).or_insert(0);
        let wire = NS_COLL | (u64::from(tag) << 32) | u64::from(*seq);
        *seq = seq.wrapping_add(1);
        Ok(Key { group: self.group, tag: wire })
    }

    /// Runs `f` with a [`Scope`]; see [`Context::scope`](crate::Context::scope).
    pub(crate) fn scope<'env, R>(
        &'env self,
        f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> Result<R>,
    ) -> Result<R> {
        let mut scope = Scope { comm: self, ops: Mutex::default(), _scope: PhantomData, _env: PhantomData };
        let result = catch_unwind(AssertUnwindSafe(|| f(&scope)));
        // `f` has returned: nothing borrows the scope any more, so its operations are read in
        // place, without the lock. Entries already waited for are `None`.
        let ops = scope.ops.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut leftover = ops.iter().flatten().peekable();
        match result {
            Err(panic) => {
                for op in leftover {
                    op.cancel();
                }
                resume_unwind(panic)
            }
            Ok(Err(e)) => {
                // Whatever `f` left in flight is abandoned with it: cancel rather than wait.
                for op in leftover {
                    op.cancel();
                }
                Err(e)
            }
            Ok(Ok(v)) if leftover.peek().is_none() => Ok(v),
            Ok(Ok(v)) => {
                let deadline = Instant::now() + self.timeout;
                let mut first = None;
                for op in leftover {
                    if let Err(e) = op.wait(deadline, &self.shared, &|| self.revoked()) {
                        first.get_or_insert(e);
                    }
                }
                first.map_or(Ok(v), Err)
            }
        }
    }
}

/// FNV-1a over words: ids and hashes that must come out the same on every rank.
pub(crate) fn fnv(words: &[u64]) -> u64 {
    fnv_of(words.iter().copied())
}

/// [`fnv`] over words as they come (nothing collected first).
pub(crate) fn fnv_of(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Posts a receive of `key` into `target` on each of `pairs` (a receive from any of them when
/// there are several), and returns the pairs it stays posted on.
///
/// When a pair refuses the receive (it failed, or the group was aborted), the receive is
/// withdrawn from the pairs it was posted to before, and the pair's error returned; unless a
/// message on one of those pairs has claimed it already (it may be arriving right now): then
/// the receive stays posted on them and gets that message, and the refusing pair's error shows
/// at the next operation with its peer. Withdrawing a claimed receive would lose its message.
///
/// # Safety
/// The target's buffer must stay valid, and must not be read or written by anyone else, until
/// `done` is completed or [`Pair::cancel`] for `done` has returned on every pair returned.
unsafe fn post_recv_any(
    mut pairs: Pairs,
    key: Key,
    desc: OpDesc,
    target: RecvTarget,
    done: &Arc<Completion>,
) -> Result<Pairs> {
    for (i, pair) in pairs.iter().enumerate() {
        // SAFETY: forwarded from this function's contract.
        if let Err(e) = unsafe { pair.post_recv(key, desc, target, done) } {
            if done.try_claim() {
                // Claimed here, so no earlier pair can claim it any more: nothing is lost.
                for p in &pairs[..i] {
                    p.cancel(done);
                }
                done.complete(Err(e.clone()));
                return Err(e);
            }
            pairs.truncate(i);
            return Ok(pairs);
        }
    }
    Ok(pairs)
}

/// One operation started in a scope.
struct Op {
    pairs: Pairs,
    done: Arc<Completion>,
    what: &'static str,
    /// The mesh's per-rank counts of outstanding operations, when this one is part of them.
    pending: Option<Arc<[AtomicU32]>>,
}

impl Op {
    /// An operation the mesh counts as outstanding: other waits drive its pairs too.
    fn new(pairs: Pairs, done: Arc<Completion>, what: &'static str, shared: &World) -> Self {
        for p in &pairs {
            shared.pending[p.peer()].fetch_add(1, Ordering::Relaxed);
        }
        Op { pairs, done, what, pending: Some(shared.pending.clone()) }
    }

    /// An operation only its own waits drive (a background receive that stays posted).
    fn uncounted(pairs: Pairs, done: Arc<Completion>, what: &'static str) -> Self {
        Op { pairs, done, what, pending: None }
    }

    fn cancel(&self) {
        for p in &self.pairs {
            p.cancel(&self.done);
        }
    }

    /// Waits until finished or `deadline`; on timeout withdraws the operation so its buffer is
    /// released. `revoked` is asked every [`REVOKE_CHECK`] of a long wait (see
    /// [`wait_unfinished`](Self::wait_unfinished)).
    fn wait(&self, deadline: Instant, shared: &World, revoked: &dyn Fn() -> Option<Error>) -> Result<Done> {
        self.wait_spinning(deadline, shared, shared.spin, revoked)
    }

    /// The mesh ranks of the pairs it is posted to.
    fn peers(&self) -> Ranks {
        self.pairs.iter().map(|p| p.peer()).collect()
    }

    /// Waits until `done` finishes or `deadline` (`None`), driving this operation's pairs and
    /// those of every other outstanding operation of the mesh; withdraws nothing.
    fn wait_for(
        done: &Completion,
        own: &[usize],
        deadline: Instant,
        shared: &World,
        spin: BusyWait,
    ) -> Option<Result<Done>> {
        let others: SmallVec<[usize; 8]> = (0..shared.pending.len())
            .filter(|r| shared.pending[*r].load(Ordering::Relaxed) > 0 && !own.contains(r))
            .collect();
        shared.mesh.progress.wait(done, own, &others, deadline, spin)
    }

    /// [`wait`](Self::wait) with a busy-wait policy of its own.
    fn wait_spinning(
        &self,
        deadline: Instant,
        shared: &World,
        spin: BusyWait,
        revoked: &dyn Fn() -> Option<Error>,
    ) -> Result<Done> {
        // Finished already (a send the transport took whole, a message that was waiting):
        // nothing to drive, no clock to read.
        let outcome = match self.done.outcome() {
            Some(o) => o,
            None => self.wait_unfinished(deadline, shared, spin, revoked),
        };
        if self.pairs.len() > 1 {
            // Receive from any: withdraw the entries the winner left on the other pairs.
            self.cancel();
        }
        // A peer that closed its connection may have done so because of a failure that
        // reached this rank first another way: another peer's report that a rank died is the
        // first cause to report, not the closure it led to. (A failure of another kind, such
        // as a survivor's timeout, is not its cause and does not replace it.)
        let outcome = match outcome {
            Err(Error::PeerClosed { rank, op, detail }) => Err(match revoked() {
                Some(cause @ Error::PeerClosed { rank: first, .. }) if first != rank => cause,
                _ => Error::PeerClosed { rank, op, detail },
            }),
            o => o,
        };
        outcome.map_err(|e| e.during(self.what))
    }

    /// The waiting part of [`wait_spinning`](Self::wait_spinning): in slices of
    /// [`REVOKE_CHECK`], after each of which `revoked` says whether the operation's group was
    /// aborted elsewhere (then it is withdrawn and fails with that cause).
    fn wait_unfinished(
        &self,
        deadline: Instant,
        shared: &World,
        mut spin: BusyWait,
        revoked: &dyn Fn() -> Option<Error>,
    ) -> Result<Done> {
        let start = Instant::now();
        let own = self.peers();
        loop {
            let slice = deadline.min(Instant::now() + REVOKE_CHECK);
            if let Some(o) = Self::wait_for(&self.done, &own, slice, shared, spin) {
                return o;
            }
            // Busy-waiting was the first slice's; the later ones sleep at once.
            spin.budget = Duration::ZERO;
            let why = match revoked() {
                Some(e) => e,
                None if Instant::now() < deadline => continue,
                None => Error::Timeout {
                    op: self.what.to_string(),
                    ranks: own.to_vec(),
                    keys: Vec::new(),
                    waited: start.elapsed(),
                },
            };
            self.cancel();
            // It may have finished between the slice and the cancel.
            return self.done.outcome().unwrap_or_else(|| {
                self.done.complete(Err(why.clone()));
                Err(why)
            });
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if let Some(pending) = &self.pending {
            for p in &self.pairs {
                pending[p.peer()].fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// A region in which non-blocking sends and receives may borrow buffers; see
/// [`Context::scope`](crate::Context::scope).
pub struct Scope<'scope, 'env: 'scope> {
    comm: &'env Comm,
    /// Every operation started, by index; `None` once waited for.
    ops: Mutex<SmallVec<[Option<Op>; SCOPE_INLINE]>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'scope, 'env> Scope<'scope, 'env> {
    /// This rank in the scope's context.
    pub fn rank(&self) -> usize {
        self.comm.rank
    }

    /// The number of ranks of the scope's context.
    pub fn size(&self) -> usize {
        self.comm.size
    }

    fn push(&'scope self, op: Op) -> usize {
        let mut ops = lock(&self.ops);
        ops.push(Some(op));
        ops.len() - 1
    }

    fn wait_index(&self, idx: usize, timeout: Option<Duration>) -> Result<Done> {
        self.wait_deadline(idx, Instant::now() + timeout.unwrap_or(self.comm.timeout))
    }

    fn is_done(&self, idx: usize) -> bool {
        let ops = lock(&self.ops);
        ops.get(idx).and_then(Option::as_ref).is_none_or(|op| op.done.outcome().is_some())
    }

    /// Starts a send of raw memory with `key` and descriptor `desc`.
    ///
    /// # Safety
    /// `buf` must stay valid and unwritten until the operation is waited for or the scope ends.
    pub(crate) unsafe fn isend_raw(
        &'scope self,
        peer: usize,
        key: Key,
        desc: OpDesc,
        buf: SendBuf,
        what: &'static str,
    ) -> Result<usize> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.isend_parts_raw(peer, key, desc, &[buf], what) }
    }

    /// Starts sending one message made of `parts`, one after the other, to `peer` with `key`
    /// and `desc`, without gathering them first (one part goes on any pair; several need one
    /// that [gathers](Pair::gathers)).
    ///
    /// # Safety
    /// As for [`isend_raw`](Self::isend_raw), for every part.
    pub(crate) unsafe fn isend_parts_raw(
        &'scope self,
        peer: usize,
        key: Key,
        desc: OpDesc,
        parts: &[SendBuf],
        what: &'static str,
    ) -> Result<usize> {
        let pair = self.comm.pair(peer)?.clone();
        let done = Completion::new();
        // SAFETY: forwarded from this function's contract.
        unsafe { pair.post_send_parts(key, desc, parts, &done) }.map_err(|e| e.during(what))?;
        Ok(self.push(Op::new(smallvec![pair], done, what, &self.comm.shared)))
    }

    /// Waits for an operation of this scope until an absolute deadline.
    pub(crate) fn wait_deadline(&self, idx: usize, deadline: Instant) -> Result<Done> {
        self.finish(idx, deadline).map(|(done, _)| done)
    }

    /// Waits for an operation until `deadline`; also returns an owned receive's message.
    fn finish(&self, idx: usize, deadline: Instant) -> Result<(Done, Option<Vec<u8>>)> {
        self.finish_spinning(idx, deadline, self.comm.shared.spin)
    }

    fn finish_spinning(&self, idx: usize, deadline: Instant, spin: BusyWait) -> Result<(Done, Option<Vec<u8>>)> {
        let op = lock(&self.ops).get_mut(idx).and_then(Option::take);
        let Some(op) = op else { return Err(Error::invalid("request already waited for")) };
        let done = op.wait_spinning(deadline, &self.comm.shared, spin, &|| self.comm.revoked())?;
        // The pair names its peer by mesh rank; the caller knows ranks of its group.
        let done = Done { peer: self.comm.group_rank(done.peer), ..done };
        Ok((done, op.done.take_payload()))
    }

    /// Starts a receive into `target` from whichever of `peers` sends first.
    ///
    /// # Safety
    /// The target's buffer must stay valid and untouched until the operation is waited for or
    /// the scope ends.
    pub(crate) unsafe fn irecv_raw(
        &'scope self,
        peers: &[usize],
        key: Key,
        desc: OpDesc,
        target: RecvTarget,
        what: &'static str,
    ) -> Result<usize> {
        if peers.is_empty() {
            return Err(Error::invalid("receive from an empty set of ranks"));
        }
        let pairs = peers.iter().map(|&p| self.comm.pair(p).cloned()).collect::<Result<Pairs>>()?;
        let done = Completion::for_pairs(pairs.len());
        // SAFETY: forwarded from this function's contract: the operation is pushed to the
        // scope, which finishes or cancels it on every pair it is posted to before it ends.
        let posted = unsafe { post_recv_any(pairs, key, desc, target, &done) }.map_err(|e| e.during(what))?;
        Ok(self.push(Op::new(posted, done, what, &self.comm.shared)))
    }

    /// Starts sending `buf` to `peer` with `tag`; see [`Context::send`](crate::Context::send).
    pub fn isend<T: Pod>(&'scope self, peer: usize, tag: u32, buf: &'scope [T]) -> Result<SendRequest<'scope, 'env>> {
        let key = self.comm.p2p_key(tag);
        // SAFETY: `buf` is borrowed for 'scope, and the scope finishes or cancels the operation
        // before 'scope ends (Comm::scope), so it stays valid and unwritten as required.
        let idx = unsafe { self.isend_raw(peer, key, OpDesc::P2P, SendBuf::from_slice(as_bytes(buf)), "send")? };
        Ok(SendRequest { scope: self, idx })
    }

    /// Starts receiving the next message with `tag` from `peer` into `buf`, which it must fill
    /// exactly; see [`Context::recv`](crate::Context::recv).
    pub fn irecv<T: Pod>(
        &'scope self,
        peer: usize,
        tag: u32,
        buf: &'scope mut [T],
    ) -> Result<RecvRequest<'scope, 'env, T>> {
        self.irecv_into(&[peer], tag, buf, false)
    }

    /// Starts receiving the next message with `tag` from whichever of `peers` sends first.
    pub fn irecv_any<T: Pod>(
        &'scope self,
        peers: &[usize],
        tag: u32,
        buf: &'scope mut [T],
    ) -> Result<RecvRequest<'scope, 'env, T>> {
        self.irecv_into(peers, tag, buf, false)
    }

    /// Starts receiving the next message with `tag` from `peer` into the front of `buf`: the
    /// message may be shorter than `buf` (a whole number of elements), and waiting returns the
    /// part it filled. A longer message is [`Error::Mismatch`].
    pub fn irecv_upto<T: Pod>(
        &'scope self,
        peer: usize,
        tag: u32,
        buf: &'scope mut [T],
    ) -> Result<RecvRequest<'scope, 'env, T>> {
        self.irecv_into(&[peer], tag, buf, true)
    }

    fn irecv_into<T: Pod>(
        &'scope self,
        peers: &[usize],
        tag: u32,
        buf: &'scope mut [T],
        upto: bool,
    ) -> Result<RecvRequest<'scope, 'env, T>> {
        let ptr: *mut [T] = buf;
        // SAFETY: reborrow of the same 'scope-long exclusive borrow: the byte view is handed to
        // the transport, the typed pointer is only turned back into a slice after the operation
        // finished (RecvRequest::wait), so the two are never used at once.
        let bytes = RecvBuf::from_slice(as_bytes_mut(unsafe { &mut *ptr }));
        let target = if upto { RecvTarget::Upto(bytes) } else { RecvTarget::Exact(bytes) };
        let key = self.comm.p2p_key(tag);
        // SAFETY: the bytes are exclusively borrowed for 'scope, and the scope finishes or
        // cancels the operation (on every pair it was posted to) before 'scope ends.
        let idx = unsafe { self.irecv_raw(peers, key, OpDesc::P2P, target, "recv")? };
        Ok(RecvRequest { scope: self, idx, buf: ptr, _t: PhantomData })
    }

    /// Starts receiving the next message with `tag` from whichever of `peers` sends first, of
    /// a length the sender decides (at most `max_bytes`), into a buffer allocated for it:
    /// waiting returns the sender's rank and the message. A longer message is
    /// [`Error::Mismatch`].
    pub fn irecv_bytes(
        &'scope self,
        peers: &[usize],
        tag: u32,
        max_bytes: usize,
    ) -> Result<BytesRequest<'scope, 'env>> {
        let key = self.comm.p2p_key(tag);
        // SAFETY: an owned receive lends no memory of the caller's.
        let idx = unsafe { self.irecv_raw(peers, key, OpDesc::P2P, RecvTarget::Owned { max: max_bytes }, "recv")? };
        Ok(BytesRequest { scope: self, idx })
    }
}

/// The scope's operations for the collective algorithms: a collective's key and descriptor,
/// buffers borrowed for the scope as [`isend`](Scope::isend) and [`irecv`](Scope::irecv) borrow
/// them, waits until the collective's deadline.
impl<'scope, 'env> Scope<'scope, 'env> {
    /// Starts sending `buf` to `peer` with `key` and `desc`; returns the operation's index for
    /// [`wait_deadline`](Scope::wait_deadline). `buf` stays borrowed (readable, not writable)
    /// until the scope ends.
    pub(crate) fn send_borrowed<T: Pod>(
        &'scope self,
        peer: usize,
        key: Key,
        desc: OpDesc,
        buf: &'scope [T],
        what: &'static str,
    ) -> Result<usize> {
        // SAFETY: `buf` is borrowed for 'scope, and the scope finishes or cancels the operation
        // before 'scope ends (Comm::scope), so it stays valid and unwritten as required.
        unsafe { self.isend_raw(peer, key, desc, SendBuf::from_slice(as_bytes(buf)), what) }
    }

    /// Starts receiving a message of exactly `len` elements from `peer` with `key` and `desc`
    /// into the front of `buf` (`len <= buf.len()`, else an error). Waiting for the returned
    /// [`Lent`] gives the whole of `buf` back, so that a buffer reused for messages of several
    /// lengths can be lent again.
    pub(crate) fn recv_borrowed<T: Pod>(
        &'scope self,
        peer: usize,
        key: Key,
        desc: OpDesc,
        buf: &'scope mut [T],
        len: usize,
        what: &'static str,
    ) -> Result<Lent<'scope, 'env, T>> {
        if len > buf.len() {
            return Err(Error::invalid(format!("{what}: a receive of {len} elements into a buffer of {}", buf.len())));
        }
        let ptr: *mut [T] = buf;
        // The transport's view and the slice handed back by `Lent::wait_until` both come from
        // `ptr`, and are never used at once.
        let front = RecvBuf { ptr: ptr.cast::<u8>(), len: len * std::mem::size_of::<T>(), mem: MemKind::Host };
        // SAFETY: the memory is exclusively borrowed for 'scope (through `ptr`, which nothing
        // else uses until the operation finished), and the scope finishes or cancels the
        // operation (on every pair it was posted to) before 'scope ends.
        let idx = unsafe { self.irecv_raw(&[peer], key, desc, RecvTarget::Exact(front), what)? };
        Ok(Lent { scope: self, idx, buf: ptr, _t: PhantomData })
    }
}

/// A buffer lent to a receive of a [`Scope`] ([`Scope::recv_borrowed`]); waiting gives it back.
#[must_use = "a lent buffer comes back only when the receive is waited for"]
pub(crate) struct Lent<'scope, 'env, T> {
    scope: &'scope Scope<'scope, 'env>,
    idx: usize,
    buf: *mut [T],
    _t: PhantomData<&'scope mut [T]>,
}

impl<'scope, T> Lent<'scope, '_, T> {
    /// Waits for the message until `deadline` (on timeout the receive is withdrawn) and gives
    /// the buffer back, its front filled.
    pub(crate) fn wait_until(self, deadline: Instant) -> Result<&'scope mut [T]> {
        self.scope.wait_deadline(self.idx, deadline)?;
        // SAFETY: the operation has finished (an exact receive fills the whole front it was
        // given), so the transport no longer touches the buffer, and this value held the
        // 'scope-long exclusive borrow the pointer came from.
        Ok(unsafe { &mut *self.buf })
    }
}

/// A send started in a [`Scope`].
#[must_use = "a request does nothing unless waited for (the scope waits for it at its end)"]
pub struct SendRequest<'scope, 'env> {
    scope: &'scope Scope<'scope, 'env>,
    idx: usize,
}

impl SendRequest<'_, '_> {
    /// Waits (up to the context's timeout) until the send is handed to the transport.
    pub fn wait(self) -> Result<()> {
        self.scope.wait_index(self.idx, None).map(drop)
    }

    /// Waits up to `timeout`; on timeout the send is withdrawn.
    pub fn wait_timeout(self, timeout: Duration) -> Result<()> {
        self.scope.wait_index(self.idx, Some(timeout)).map(drop)
    }

    /// Whether the send has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.scope.is_done(self.idx)
    }
}

/// A receive started in a [`Scope`]; waiting gives the buffer back, filled.
#[must_use = "a request does nothing unless waited for (the scope waits for it at its end)"]
pub struct RecvRequest<'scope, 'env, T> {
    scope: &'scope Scope<'scope, 'env>,
    idx: usize,
    buf: *mut [T],
    _t: PhantomData<&'scope mut [T]>,
}

impl<'scope, T: Pod> RecvRequest<'scope, '_, T> {
    /// Waits (up to the context's timeout) for the message and returns the filled buffer (the
    /// part filled, for [`Scope::irecv_upto`]).
    pub fn wait(self) -> Result<&'scope mut [T]> {
        self.wait_from().map(|(_, b)| b)
    }

    /// Like [`wait`](Self::wait), also returning the rank the message came from.
    pub fn wait_from(self) -> Result<(usize, &'scope mut [T])> {
        let done = self.scope.wait_index(self.idx, None)?;
        self.filled(done)
    }

    /// Waits up to `timeout`; on timeout the receive is withdrawn.
    pub fn wait_timeout(self, timeout: Duration) -> Result<&'scope mut [T]> {
        let done = self.scope.wait_index(self.idx, Some(timeout))?;
        self.filled(done).map(|(_, b)| b)
    }

    /// Whether the receive has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.scope.is_done(self.idx)
    }

    fn filled(&self, done: Done) -> Result<(usize, &'scope mut [T])> {
        let size = std::mem::size_of::<T>();
        if size > 0 && !done.len.is_multiple_of(size) {
            // Errors name ranks of the job.
            let peer = self.scope.comm.world_rank(done.peer).unwrap_or(done.peer);
            return Err(Error::Mismatch {
                rank: peer,
                detail: format!(
                    "rank {peer} sent {} bytes, not a whole number of the receive's {size}-byte elements",
                    done.len
                ),
            });
        }
        // SAFETY: the operation has finished, so the transport no longer touches the buffer,
        // and this request held the 'scope-long exclusive borrow it came from.
        let buf = unsafe { &mut *self.buf };
        let n = done.len.checked_div(size).unwrap_or(buf.len());
        Ok((done.peer, &mut buf[..n]))
    }
}

/// A receive of a length the sender decides, started with [`Scope::irecv_bytes`].
#[must_use = "a request does nothing unless waited for (the scope waits for it at its end)"]
pub struct BytesRequest<'scope, 'env> {
    scope: &'scope Scope<'scope, 'env>,
    idx: usize,
}

impl BytesRequest<'_, '_> {
    /// Waits (up to the context's timeout) for the message; returns the sender and the bytes.
    pub fn wait(self) -> Result<(usize, Vec<u8>)> {
        let timeout = self.scope.comm.timeout;
        self.wait_timeout(timeout)
    }

    /// Waits up to `timeout`; on timeout the receive is withdrawn.
    pub fn wait_timeout(self, timeout: Duration) -> Result<(usize, Vec<u8>)> {
        let (done, data) = self.scope.finish(self.idx, Instant::now() + timeout)?;
        Ok((done.peer, data.unwrap_or_default()))
    }

    /// Whether the receive has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        self.scope.is_done(self.idx)
    }
}

/// The bytes of a slice of plain-old-data values.
pub(crate) fn as_bytes<T: Pod>(s: &[T]) -> &[u8] {
    if std::mem::size_of::<T>() == 0 { &[] } else { bytemuck::cast_slice(s) }
}

/// The bytes of a mutable slice of plain-old-data values.
pub(crate) fn as_bytes_mut<T: Pod>(s: &mut [T]) -> &mut [u8] {
    if std::mem::size_of::<T>() == 0 { &mut [] } else { bytemuck::cast_slice_mut(s) }
}
