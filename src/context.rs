//! The [`Context`]: this rank's place in a job, with one connected pair per peer.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::rendezvous::{Backoff, Store};
use crate::sync::lock;
use crate::transport::tcp::device::Route;
use crate::transport::tcp::handshake::{self, ContextId};
use crate::transport::tcp::pair::TcpPair;
use crate::transport::tcp::progress::TcpProgress;
use crate::transport::{BusyWait, Completion, Pair, Passive, Progress, RecvBuf, SendBuf};
use bytemuck::Pod;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Wire-tag namespace of user point-to-point messages.
const NS_P2P: u64 = 1 << 62;
/// Wire-tag namespace of collectives: `NS_COLL | tag << 32 | sequence`, a sequenced tag
/// family per user tag (see the transport contract).
const NS_COLL: u64 = crate::transport::SEQUENCED;

/// Default deadline of every blocking call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How to form a context; see [`Context::builder`].
#[derive(Debug, Clone)]
pub struct ContextBuilder {
    rank: usize,
    size: usize,
    timeout: Duration,
    secret: Option<Vec<u8>>,
    busy_poll: Option<Duration>,
}

impl ContextBuilder {
    /// How long a waiting call busy-polls its connection before it sleeps in the kernel.
    ///
    /// When this host has at least one CPU per rank of the context on it (ranks whose
    /// connections come from this rank's own address) the wait spins, by default for 1 ms:
    /// that saves the wake-up of an idle core. Otherwise it yields the CPU between tries, by
    /// default for 200 µs, so ranks that share a core take turns instead of sleeping. Zero
    /// disables busy-waiting.
    pub fn busy_poll(mut self, budget: Duration) -> Self {
        self.busy_poll = Some(budget);
        self
    }

    /// The deadline of rendezvous and the default deadline of every later call (30 s unless
    /// set).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// A secret every rank shares: connection handshakes are then authenticated (HMAC-SHA256
    /// over fresh nonces) and a peer without the secret is refused.
    pub fn secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Rendezvous through `store` and connect the full mesh on `device`.
    ///
    /// Each rank publishes its address under `ferrogloo.rank.<r>` (wrap the store in a
    /// [`PrefixStore`](crate::rendezvous::PrefixStore) to form several contexts on one store).
    /// Rank 0 chooses a fresh random context id; every other rank confirms it over a live
    /// connection to rank 0 and accepts only entries stamped with it, so entries left in the
    /// store by an earlier job are skipped rather than dialled. The higher rank of each pair
    /// connects to the lower.
    ///
    /// Errors: [`Error::InvalidArgument`] for `rank >= size` or `size == 0`;
    /// [`Error::Timeout`] naming the missing ranks and keys when the mesh is not complete in
    /// time.
    pub fn connect<S: Store + ?Sized>(self, store: &S, device: &Device) -> Result<Context> {
        let ContextBuilder { rank, size, timeout, secret, busy_poll } = self;
        if size == 0 {
            return Err(Error::invalid("context size must be at least 1"));
        }
        if rank >= size {
            return Err(Error::invalid(format!("rank {rank} is out of range for size {size}")));
        }
        if size > u32::MAX as usize {
            return Err(Error::invalid(format!("context size {size} is too large")));
        }
        if size == 1 {
            return Ok(Context::single(device.clone(), timeout));
        }
        let deadline = Instant::now() + timeout;
        let shared = device.shared();
        let new_route = || {
            let pairs = (0..size)
                .map(|p| {
                    (p != rank)
                        .then(|| {
                            TcpPair::new(
                                p,
                                rank < p,
                                shared.opts.early_budget,
                                shared.registry.clone(),
                                shared.parking.clone(),
                            )
                        })
                        .transpose()
                })
                .collect::<std::io::Result<_>>()
                .map_err(|e| Error::io("creating a pair's wake-up descriptor", e))?;
            Ok::<_, Error>(Route::new(rank, size, secret.clone(), pairs))
        };
        let me = Entry { ctx: [0; 16], size, addr: device.local_addr() };
        let rv = Rendezvous { store, deadline, timeout, size };

        // 1. Agree on the context id (rank 0 chooses it; others confirm it with rank 0).
        let (ctx, route) = if rank == 0 {
            let ctx = handshake::random16();
            let route = new_route()?;
            shared.add_route(ctx, route.clone())?;
            if let Err(e) = rv.publish(0, &Entry { ctx, ..me }) {
                shared.remove_route(&ctx, rank);
                return Err(e);
            }
            (ctx, route)
        } else {
            let mut last: Option<Vec<u8>> = None;
            let mut refused: Option<Error> = None;
            // The route of the entry being tried: kept while retrying a connection failure, so
            // that the lanes already connected stay (rank 0 refuses a lane twice).
            let mut current: Option<(ContextId, Arc<Route>)> = None;
            let mut retry = Backoff::new();
            let drop_current = |current: &mut Option<(ContextId, Arc<Route>)>| {
                if let Some((c, _)) = current.take() {
                    shared.remove_route(&c, rank);
                }
            };
            loop {
                // A connection that failed (a link still coming up, a listener not reachable
                // yet) is tried again with backoff unless a fresh entry shows up; a refused
                // handshake (a stale entry) waits for a fresh one.
                let again = current.is_some() && retry.sleep_until(deadline);
                let raw = if again {
                    rv.store.try_get(&key(0))
                } else {
                    rv.next_value(0, last.as_deref(), "rank 0's entry (it chooses the context id)", refused.as_ref())
                        .map(Some)
                };
                let raw = match raw {
                    Ok(Some(raw)) => raw,
                    Ok(None) => continue,
                    Err(e) => {
                        drop_current(&mut current);
                        return Err(e);
                    }
                };
                let Some(entry) = Entry::parse(&raw).filter(|e| e.size == size) else {
                    tracing::debug!(key = %key(0), "skipping an entry of another job or world size");
                    drop_current(&mut current);
                    last = Some(raw);
                    continue;
                };
                // The same entry again keeps its route (and the lanes it has connected).
                let route = match &current {
                    Some((_, route)) if last.as_deref() == Some(raw.as_slice()) => Arc::clone(route),
                    _ => {
                        drop_current(&mut current);
                        let route = new_route()?;
                        shared.add_route(entry.ctx, route.clone())?;
                        current = Some((entry.ctx, route.clone()));
                        last = Some(raw);
                        route
                    }
                };
                match shared.connect(entry.ctx, &route, 0, entry.addr, deadline) {
                    Ok(()) => break (entry.ctx, route),
                    Err(e) => {
                        tracing::debug!(error = %e, "rank 0's entry did not answer");
                        if !matches!(e, Error::Io { .. }) {
                            // A live listener that does not know the id: wait for a fresh entry.
                            drop_current(&mut current);
                        }
                        refused = Some(e);
                    }
                }
            }
        };
        let mut guard = RouteGuard { device, ctx, rank, armed: true };
        if rank > 0 {
            rv.publish(rank, &Entry { ctx, ..me })?;
        }

        // 2. Connect to every lower rank but 0, whose entries must carry this context id.
        for peer in 1..rank {
            let mut last: Option<Vec<u8>> = None;
            let entry = loop {
                let raw = rv.next_value(peer, last.as_deref(), "its address", None)?;
                match Entry::parse(&raw) {
                    Some(e) if e.ctx == ctx && e.size == size => break e,
                    _ => last = Some(raw),
                }
            };
            // Connection failures (a link still coming up) are retried until the deadline.
            let mut retry = Backoff::new();
            loop {
                match shared.connect(ctx, &route, peer, entry.addr, deadline) {
                    Ok(()) => break,
                    Err(e @ Error::Io { .. }) if retry.sleep_until(deadline) => {
                        tracing::debug!(peer, error = %e, "connecting failed; trying again");
                    }
                    Err(e) => return Err(e),
                }
            }
        }

        // 3. Wait for every higher rank to connect to us.
        let higher: Vec<usize> = (rank + 1..size).collect();
        let missing = route.wait_attached(&higher, deadline);
        if !missing.is_empty() {
            return Err(Error::Timeout {
                op: format!("rendezvous of rank {rank}: connections from higher ranks"),
                keys: missing.iter().map(|&r| key(r)).collect(),
                ranks: missing,
                waited: timeout,
            });
        }
        guard.armed = false;
        let pairs: Vec<Option<Arc<dyn Pair>>> =
            route.pairs.iter().map(|p| p.clone().map(|p| p as Arc<dyn Pair>)).collect();
        let progress = Arc::new(TcpProgress::new(route.pairs.clone(), shared.parking.clone()));
        let spin = busy_wait(busy_poll, &pairs, device);
        tracing::debug!(rank, size, ?spin, "context connected");
        Ok(Context {
            rank,
            size,
            timeout,
            spin,
            device: device.clone(),
            ctx: Some(ctx),
            pairs,
            progress,
            pending: (0..size).map(|_| AtomicU32::new(0)).collect(),
            collective_seq: Mutex::default(),
            aborted: Mutex::default(),
            scratch: Mutex::default(),
        })
    }
}

/// Spin when every rank on this host can have a core, else yield (see
/// [`ContextBuilder::busy_poll`]). Measured with `ferrogloo-bench` on the 2-core machine: with
/// 2 ranks a 1 ms spin beats 20 µs at 64 KiB-1 MiB allreduce (62 vs 97 µs, 572 vs 890 µs); with
/// 4 ranks, 200 µs of yielding cuts 4 KiB allreduce from 293 to 226 µs and p99 from 2.2 ms to
/// 0.5 ms.
fn busy_wait(budget: Option<Duration>, pairs: &[Option<Arc<dyn Pair>>], device: &Device) -> BusyWait {
    let me = device.local_addr().ip();
    let local = 1 + pairs.iter().flatten().filter(|p| p.remote_ip() == Some(me)).count();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let yield_cpu = local > cores;
    let default = if yield_cpu { Duration::from_micros(200) } else { Duration::from_millis(1) };
    BusyWait { budget: budget.unwrap_or(default), yield_cpu }
}

/// Unregisters a half-formed context on an early return.
struct RouteGuard<'a> {
    device: &'a Device,
    ctx: ContextId,
    rank: usize,
    armed: bool,
}

impl Drop for RouteGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.device.shared().remove_route(&self.ctx, self.rank);
        }
    }
}

/// The store key of a rank's entry.
fn key(rank: usize) -> String {
    format!("ferrogloo.rank.{rank}")
}

/// What a rank publishes: `ferrogloo-v1 <context id hex> <size> <address>`.
#[derive(Debug, Clone, Copy)]
struct Entry {
    ctx: ContextId,
    size: usize,
    addr: SocketAddr,
}

impl Entry {
    fn encode(&self) -> Vec<u8> {
        let hex: String = self.ctx.iter().map(|b| format!("{b:02x}")).collect();
        format!("ferrogloo-v1 {hex} {} {}", self.size, self.addr).into_bytes()
    }

    fn parse(raw: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(raw).ok()?;
        let mut it = s.split(' ');
        if it.next()? != "ferrogloo-v1" {
            return None;
        }
        let hex = it.next()?;
        if hex.len() != 32 {
            return None;
        }
        let mut ctx = [0u8; 16];
        for (i, b) in ctx.iter_mut().enumerate() {
            *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        let size = it.next()?.parse().ok()?;
        let addr = it.next()?.parse().ok()?;
        it.next().is_none().then_some(Entry { ctx, size, addr })
    }
}

/// Store access during rendezvous, all against one deadline.
struct Rendezvous<'a, S: ?Sized> {
    store: &'a S,
    deadline: Instant,
    timeout: Duration,
    size: usize,
}

impl<S: Store + ?Sized> Rendezvous<'_, S> {
    fn publish(&self, rank: usize, e: &Entry) -> Result<()> {
        self.store.set(&key(rank), &e.encode())
    }

    /// The value of `rank`'s key once it exists and differs from `old`.
    /// `refused` is why the previous value did not work, for the timeout message.
    fn next_value(&self, rank: usize, old: Option<&[u8]>, what: &str, refused: Option<&Error>) -> Result<Vec<u8>> {
        let k = key(rank);
        let mut backoff = Backoff::new();
        loop {
            if let Some(v) = self.store.try_get(&k)?
                && old != Some(v.as_slice())
            {
                return Ok(v);
            }
            if !backoff.sleep_until(self.deadline) {
                let stale = match (old, refused) {
                    (_, Some(e)) => format!(" (the entry found did not work: {e})"),
                    (Some(_), None) => " (only a stale entry from another job was found)".to_string(),
                    (None, None) => String::new(),
                };
                return Err(Error::Timeout {
                    op: format!("rendezvous (size {}): waiting for rank {rank}'s {what}{stale}", self.size),
                    ranks: vec![rank],
                    keys: vec![k],
                    waited: self.timeout,
                });
            }
        }
    }
}

/// This rank's membership in a job of `size` ranks: one connected pair per peer, a default
/// deadline, and the collectives and point-to-point calls.
///
/// Build one with [`Context::builder`]. Every blocking call ends by its deadline
/// ([`Error::Timeout`]); a peer that dies makes calls involving it fail with
/// [`Error::PeerClosed`]. A context is `Sync`: threads may share it, using distinct tags for
/// concurrent operations.
pub struct Context {
    rank: usize,
    size: usize,
    timeout: Duration,
    /// How waits busy-poll before sleeping (see [`ContextBuilder::busy_poll`]).
    spin: BusyWait,
    device: Device,
    ctx: Option<ContextId>,
    /// Indexed by peer rank; `None` at our own rank.
    pairs: Vec<Option<Arc<dyn Pair>>>,
    /// How waits drive the pairs.
    progress: Arc<dyn Progress>,
    /// Operations posted and not yet waited for or cancelled, per peer rank: the pairs a wait
    /// may progress besides its own.
    pending: Arc<[AtomicU32]>,
    collective_seq: Mutex<HashMap<u32, u32>>,
    /// Set once the context is aborted (by [`Context::abort`] or a failed collective).
    aborted: Mutex<Option<Error>>,
    /// Scratch buffers reused by collectives (see `algorithms::Arena`).
    scratch: Mutex<Vec<Vec<u64>>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("rank", &self.rank).field("size", &self.size).finish()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if let Some(ctx) = self.ctx {
            self.device.shared().remove_route(&ctx, self.rank);
        }
    }
}

impl Context {
    /// Starts describing the context of `rank` in a job of `size` ranks.
    pub fn builder(rank: usize, size: usize) -> ContextBuilder {
        ContextBuilder { rank, size, timeout: DEFAULT_TIMEOUT, secret: None, busy_poll: None }
    }

    fn single(device: Device, timeout: Duration) -> Self {
        Context {
            rank: 0,
            size: 1,
            timeout,
            spin: BusyWait { budget: Duration::ZERO, yield_cpu: false },
            device,
            ctx: None,
            pairs: vec![None],
            progress: Arc::new(Passive),
            pending: Arc::new([AtomicU32::new(0)]),
            collective_seq: Mutex::default(),
            aborted: Mutex::default(),
            scratch: Mutex::default(),
        }
    }

    /// This rank, in `0..size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The default deadline of blocking calls.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The device this context's connections run on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Makes the context unusable and tells every peer why: each peer's pending and future
    /// operations with this rank fail with [`Error::Aborted`] naming this rank and `reason`,
    /// and so do this rank's own (including calls blocked in other threads right now, which
    /// return promptly).
    ///
    /// A collective that fails after it started communicating (a mismatch, a timeout, a dead
    /// peer) aborts the context itself: the ranks' collective state no longer agrees, and the
    /// abort makes sure every rank learns it, at the latest at its next call. To go on after
    /// a failure, form a new context (for example under a new [`PrefixStore`] prefix).
    ///
    /// [`PrefixStore`]: crate::rendezvous::PrefixStore
    pub fn abort(&self, reason: &str) {
        let err = Error::Aborted { detail: format!("rank {} aborted the context: {reason}", self.rank) };
        {
            let mut a = lock(&self.aborted);
            if a.is_some() {
                return;
            }
            *a = Some(err.clone());
        }
        tracing::debug!(rank = self.rank, reason, "context aborted");
        for p in self.pairs.iter().flatten() {
            p.abort(&err, reason);
        }
    }

    pub(crate) fn scratch_pool(&self) -> &Mutex<Vec<Vec<u64>>> {
        &self.scratch
    }

    /// Whether the context was aborted (it then fails every call).
    pub fn is_aborted(&self) -> bool {
        lock(&self.aborted).is_some()
    }

    /// The abort error, if the context was aborted.
    pub(crate) fn check_usable(&self) -> Result<()> {
        match &*lock(&self.aborted) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    pub(crate) fn pair(&self, peer: usize) -> Result<&Arc<dyn Pair>> {
        self.check_usable()?;
        match self.pairs.get(peer) {
            Some(Some(p)) => Ok(p),
            Some(None) => Err(Error::invalid(format!("rank {peer} is this rank; it has no connection to itself"))),
            None => Err(Error::invalid(format!("rank {peer} is out of range for size {}", self.size))),
        }
    }

    /// The wire tag of the next collective with user tag `tag`. Every rank calls collectives
    /// with one tag in the same order, so every rank computes the same sequence.
    pub(crate) fn next_collective_tag(&self, tag: u32) -> Result<u64> {
        if tag >= 1 << 30 {
            return Err(Error::invalid(format!("collective tag {tag} must be below 2^30")));
        }
        let mut seqs = lock(&self.collective_seq);
        let seq = seqs.entry(tag).or_insert(0);
        let wire = NS_COLL | (u64::from(tag) << 32) | u64::from(*seq);
        *seq = seq.wrapping_add(1);
        Ok(wire)
    }

    /// Runs `f` with a [`Scope`] in which non-blocking sends and receives borrow buffers.
    ///
    /// Every operation started in the scope is finished before `scope` returns: those `f` did
    /// not wait for are waited for here (each until the context's timeout), and if `f` panics
    /// they are cancelled before the panic continues. So buffers lent to an operation are never
    /// touched after the scope ends, even if a request is leaked with `mem::forget`.
    ///
    /// Returns `f`'s error if it failed, else the first error of an operation `f` did not wait
    /// for.
    ///
    /// ```
    /// # use ferrogloo::{Context, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::loopback().unwrap()).unwrap();
    /// // A ring exchange: send right, receive from the left, both in flight at once.
    /// let (right, left) = ((ctx.rank() + 1) % ctx.size(), (ctx.rank() + ctx.size() - 1) % ctx.size());
    /// # if ctx.size() > 1 {
    /// let out = [ctx.rank() as u64; 4];
    /// let mut inbox = [0u64; 4];
    /// ctx.scope(|s| {
    ///     let sent = s.isend(right, 7, &out)?;
    ///     let got = s.irecv(left, 7, &mut inbox)?;
    ///     sent.wait()?;
    ///     assert_eq!(got.wait()?, &[left as u64; 4]);
    ///     Ok(())
    /// })?;
    /// # }
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn scope<'env, R>(
        &'env self,
        f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> Result<R>,
    ) -> Result<R> {
        let scope = Scope { ctx: self, ops: Mutex::default(), _scope: PhantomData, _env: PhantomData };
        let result = catch_unwind(AssertUnwindSafe(|| f(&scope)));
        let leftover: Vec<Op> = lock(&scope.ops).drain(..).flatten().collect();
        match result {
            Err(panic) => {
                for op in &leftover {
                    op.cancel();
                }
                resume_unwind(panic)
            }
            Ok(Err(e)) => {
                // Whatever `f` left in flight is abandoned with it: cancel rather than wait.
                for op in &leftover {
                    op.cancel();
                }
                Err(e)
            }
            Ok(Ok(v)) => {
                let deadline = Instant::now() + self.timeout;
                let mut first = None;
                for op in leftover {
                    if let Err(e) = op.wait(deadline, self.spin, &*self.progress) {
                        first.get_or_insert(e);
                    }
                }
                first.map_or(Ok(v), Err)
            }
        }
    }

    /// Sends `buf` to `peer`, with `tag` (any `u32`) telling it apart from other messages to that
    /// peer. Returns once the data is handed to the transport (it may still be in flight).
    /// The peer must post a receive with the same tag and exactly the same byte length.
    pub fn send<T: Pod>(&self, peer: usize, tag: u32, buf: &[T]) -> Result<()> {
        self.scope(|s| s.isend(peer, tag, buf)?.wait())
    }

    /// Receives the next message from `peer` with `tag` into `buf`. A message of another
    /// byte length is [`Error::Mismatch`].
    pub fn recv<T: Pod>(&self, peer: usize, tag: u32, buf: &mut [T]) -> Result<()> {
        self.scope(|s| s.irecv(peer, tag, buf)?.wait().map(drop))
    }

    /// Receives the next message with `tag` from whichever rank of `peers` sends first, and
    /// returns that rank.
    pub fn recv_any<T: Pod>(&self, peers: &[usize], tag: u32, buf: &mut [T]) -> Result<usize> {
        self.scope(|s| s.irecv_any(peers, tag, buf)?.wait_from().map(|(r, _)| r))
    }

    /// Blocks until every rank has called `barrier` (dissemination barrier: ⌈log₂ N⌉ rounds of
    /// one empty message sent and one received per rank).
    pub fn barrier(&self) -> Result<()> {
        self.barrier_with(&crate::algorithms::CollectiveOptions::default())
    }
}

/// One operation started in a scope.
struct Op {
    pairs: Vec<Arc<dyn Pair>>,
    done: Arc<Completion>,
    what: &'static str,
    /// The context's per-peer counts of outstanding operations, which this one is part of.
    pending: Arc<[AtomicU32]>,
}

impl Op {
    fn new(pairs: Vec<Arc<dyn Pair>>, done: Arc<Completion>, what: &'static str, pending: &Arc<[AtomicU32]>) -> Self {
        for p in &pairs {
            pending[p.peer()].fetch_add(1, Ordering::Relaxed);
        }
        Op { pairs, done, what, pending: pending.clone() }
    }

    fn cancel(&self) {
        for p in &self.pairs {
            p.cancel(&self.done);
        }
    }

    /// Waits until finished or `deadline`; on timeout withdraws the operation so its buffer is
    /// released. Returns the rank that completed it.
    fn wait(&self, deadline: Instant, spin: BusyWait, progress: &dyn Progress) -> Result<usize> {
        let start = Instant::now();
        let own: Vec<usize> = self.pairs.iter().map(|p| p.peer()).collect();
        let others: Vec<usize> = (0..self.pending.len())
            .filter(|r| self.pending[*r].load(Ordering::Relaxed) > 0 && !own.contains(r))
            .collect();
        let finished = progress.wait(&self.done, &own, &others, deadline, spin);
        let outcome = match finished {
            Some(o) => o,
            None => {
                self.cancel();
                // It may have finished between the timeout and the cancel.
                self.done.outcome().unwrap_or_else(|| {
                    let e = Error::Timeout {
                        op: self.what.to_string(),
                        ranks: own,
                        keys: Vec::new(),
                        waited: start.elapsed(),
                    };
                    self.done.complete(Err(e.clone()));
                    Err(e)
                })
            }
        };
        if self.pairs.len() > 1 {
            // Receive from any: withdraw the entries the winner left on the other pairs.
            self.cancel();
        }
        outcome
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        for p in &self.pairs {
            self.pending[p.peer()].fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// A region in which non-blocking sends and receives may borrow buffers; see
/// [`Context::scope`].
pub struct Scope<'scope, 'env: 'scope> {
    ctx: &'env Context,
    ops: Mutex<Vec<Option<Op>>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'scope, 'env> Scope<'scope, 'env> {
    /// The context this scope belongs to.
    pub fn context(&self) -> &'env Context {
        self.ctx
    }

    fn push(&'scope self, op: Op) -> usize {
        let mut ops = lock(&self.ops);
        ops.push(Some(op));
        ops.len() - 1
    }

    fn wait_index(&self, idx: usize, timeout: Option<Duration>) -> Result<usize> {
        self.wait_deadline(idx, Instant::now() + timeout.unwrap_or(self.ctx.timeout))
    }

    fn is_done(&self, idx: usize) -> bool {
        let ops = lock(&self.ops);
        ops.get(idx).and_then(Option::as_ref).is_none_or(|op| op.done.outcome().is_some())
    }

    /// Starts a send of raw memory.
    ///
    /// # Safety
    /// `buf` must stay valid and unwritten until the operation is waited for or the scope ends.
    pub(crate) unsafe fn isend_raw(
        &'scope self,
        peer: usize,
        wire: u64,
        meta: u32,
        buf: SendBuf,
        what: &'static str,
    ) -> Result<usize> {
        let pair = self.ctx.pair(peer)?.clone();
        let done = Completion::new();
        // SAFETY: forwarded from this function's contract.
        unsafe { pair.post_send(wire, meta, buf, &done)? };
        Ok(self.push(Op::new(vec![pair], done, what, &self.ctx.pending)))
    }

    /// Waits for an operation of this scope until an absolute deadline.
    pub(crate) fn wait_deadline(&self, idx: usize, deadline: Instant) -> Result<usize> {
        let op = lock(&self.ops).get_mut(idx).and_then(Option::take);
        let Some(op) = op else { return Err(Error::invalid("request already waited for")) };
        op.wait(deadline, self.ctx.spin, &*self.ctx.progress)
    }

    /// Starts a receive into raw memory from whichever of `peers` sends first.
    ///
    /// # Safety
    /// `buf` must stay valid and untouched until the operation is waited for or the scope ends.
    pub(crate) unsafe fn irecv_raw(
        &'scope self,
        peers: &[usize],
        wire: u64,
        meta: u32,
        buf: RecvBuf,
        what: &'static str,
    ) -> Result<usize> {
        if peers.is_empty() {
            return Err(Error::invalid("receive from an empty set of ranks"));
        }
        let pairs = peers.iter().map(|&p| self.ctx.pair(p).cloned()).collect::<Result<Vec<_>>>()?;
        let done = Completion::for_pairs(pairs.len());
        let idx = self.push(Op::new(pairs.clone(), done.clone(), what, &self.ctx.pending));
        for p in &pairs {
            // SAFETY: forwarded from this function's contract (the scope finishes or cancels the
            // operation on every pair it was posted to before the scope ends).
            if let Err(e) = unsafe { p.post_recv(wire, meta, buf, &done) } {
                if let Some(Some(op)) = lock(&self.ops).get(idx) {
                    op.cancel();
                }
                done.complete(Err(e.clone()));
                return Err(e);
            }
        }
        Ok(idx)
    }

    /// Starts sending `buf` to `peer` with `tag`; see [`Context::send`].
    pub fn isend<T: Pod>(&'scope self, peer: usize, tag: u32, buf: &'scope [T]) -> Result<SendRequest<'scope, 'env>> {
        // SAFETY: `buf` is borrowed for 'scope, and the scope finishes or cancels the operation
        // before 'scope ends (Context::scope), so it stays valid and unwritten as required.
        let idx =
            unsafe { self.isend_raw(peer, NS_P2P | u64::from(tag), 0, SendBuf::from_slice(as_bytes(buf)), "send")? };
        Ok(SendRequest { scope: self, idx })
    }

    /// Starts receiving the next message with `tag` from `peer` into `buf`; see
    /// [`Context::recv`].
    pub fn irecv<T: Pod>(
        &'scope self,
        peer: usize,
        tag: u32,
        buf: &'scope mut [T],
    ) -> Result<RecvRequest<'scope, 'env, T>> {
        self.irecv_any(&[peer], tag, buf)
    }

    /// Starts receiving the next message with `tag` from whichever of `peers` sends first.
    pub fn irecv_any<T: Pod>(
        &'scope self,
        peers: &[usize],
        tag: u32,
        buf: &'scope mut [T],
    ) -> Result<RecvRequest<'scope, 'env, T>> {
        let ptr: *mut [T] = buf;
        // SAFETY: reborrow of the same 'scope-long exclusive borrow: the byte view is handed to
        // the transport, the typed pointer is only turned back into a slice after the operation
        // finished (RecvRequest::wait), so the two are never used at once.
        let bytes = RecvBuf::from_slice(as_bytes_mut(unsafe { &mut *ptr }));
        // SAFETY: the bytes are exclusively borrowed for 'scope, and the scope finishes or
        // cancels the operation (on every pair it was posted to) before 'scope ends.
        let idx = unsafe { self.irecv_raw(peers, NS_P2P | u64::from(tag), 0, bytes, "recv")? };
        Ok(RecvRequest { scope: self, idx, buf: ptr, _t: PhantomData })
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

impl<'scope, T> RecvRequest<'scope, '_, T> {
    /// Waits (up to the context's timeout) for the message and returns the filled buffer.
    pub fn wait(self) -> Result<&'scope mut [T]> {
        self.wait_from().map(|(_, b)| b)
    }

    /// Like [`wait`](Self::wait), also returning the rank the message came from.
    pub fn wait_from(self) -> Result<(usize, &'scope mut [T])> {
        let from = self.scope.wait_index(self.idx, None)?;
        // SAFETY: the operation has finished, so the transport no longer touches the buffer,
        // and this request held the 'scope-long exclusive borrow it came from.
        Ok((from, unsafe { &mut *self.buf }))
    }

    /// Waits up to `timeout`; on timeout the receive is withdrawn.
    pub fn wait_timeout(self, timeout: Duration) -> Result<&'scope mut [T]> {
        self.scope.wait_index(self.idx, Some(timeout))?;
        // SAFETY: as in `wait_from`.
        Ok(unsafe { &mut *self.buf })
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
