//! The [`Context`]: this rank's place in a job, with one connected pair per peer.

use crate::comm::{Comm, LEADERS_GROUP, Scope, World};
use crate::config::{FERROGLOO_HEARTBEAT, FERROGLOO_TIMEOUT, Vars};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::mesh::{self, MeshSpec};
use crate::rendezvous::Store;
use crate::transport::{BusyWait, SendBuf};
use crate::types::OpDesc;
use bytemuck::Pod;
use smallvec::SmallVec;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Default deadline of every blocking call, unless [`FERROGLOO_TIMEOUT`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The default deadline: [`FERROGLOO_TIMEOUT`] seconds when set (fractions allowed; an error
/// when it is not a positive number of seconds), else [`DEFAULT_TIMEOUT`]. It bounds
/// rendezvous and every later call of a context whose builder was not given
/// [`ContextBuilder::timeout`].
pub fn default_timeout() -> Result<Duration> {
    timeout_in(&Vars::process())
}

/// [`default_timeout`] as `vars` give it.
pub(crate) fn timeout_in(vars: &Vars<'_>) -> Result<Duration> {
    let positive = vars.seconds(FERROGLOO_TIMEOUT, |s| s > 0.0, "a positive number of seconds")?;
    Ok(positive.unwrap_or(DEFAULT_TIMEOUT))
}

/// How to form a context; see [`Context::builder`].
#[derive(Debug, Clone)]
pub struct ContextBuilder {
    rank: usize,
    size: usize,
    timeout: Option<Duration>,
    secret: Option<Vec<u8>>,
    busy_poll: Option<Duration>,
    heartbeat: Option<Duration>,
    cost: Option<crate::cost::CostModel>,
}

impl ContextBuilder {
    /// How long a waiting call busy-polls its connection before it sleeps in the kernel.
    ///
    /// When this machine has at least one CPU per rank of the context on it (ranks whose store
    /// entries carry this machine's boot id, whatever their network namespace or container)
    /// the wait spins, by default for 1 ms: that saves the
    /// wake-up of an idle core. Otherwise it yields the CPU between tries, by default for
    /// 200 µs, so ranks that share a core take turns instead of sleeping. Zero disables
    /// busy-waiting.
    pub fn busy_poll(mut self, budget: Duration) -> Self {
        self.busy_poll = Some(budget);
        self
    }

    /// The cost model of the links (see [`crate::cost`]) instead of measuring it as the
    /// context forms (default: `FERROGLOO_COST_MODEL`'s, else measured). Every rank must give
    /// the same one, or none: otherwise `connect` fails on every rank with
    /// [`Error::Mismatch`] naming the ranks and their models (see [`crate::cost`]). It also lets a context
    /// form with a peer that runs no collective yet, such as a test's hand-made one. A model of
    /// rates that are not positive and finite is [`Error::InvalidArgument`].
    pub fn cost_model(mut self, model: crate::cost::CostModel) -> Self {
        self.cost = Some(model);
        self
    }

    /// Heartbeats every `interval` among the ranks (zero: none; default: `FERROGLOO_HEARTBEAT`
    /// seconds when set, else none): a peer silent for four intervals (its process stopped,
    /// its host frozen or cut off while its connections stay open) is taken for dead and its
    /// connections closed, so operations with it fail at once instead of at their deadline,
    /// and [`agree`](Context::agree) counts it failed. It costs a thread per process and a
    /// message per peer and interval. Choose `interval` so that four of them are longer than
    /// the longest message takes to send (a heartbeat waits behind it) and than a thread may
    /// wait for a core on a loaded machine (tens of milliseconds on 2 busy cores: take 100 ms
    /// or more there). A peer taken for dead
    /// that comes back finds its connections closed: it cannot go on in the context (it may
    /// join again through [`grow`](Context::grow)).
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.heartbeat = Some(interval);
        self
    }

    /// The deadline of rendezvous and the default deadline of every later call (default:
    /// [`FERROGLOO_TIMEOUT`] when set, else 30 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// A secret every rank shares: connection handshakes are then authenticated (HMAC-SHA256
    /// over fresh nonces from both sides, proved by both sides, on TCP, shared memory and
    /// ibverbs) and a peer without the secret is refused. Default: the job's secret from the
    /// environment (`FERROGLOO_SECRET_FILE`, which launchers set, or `FERROGLOO_SECRET`; see
    /// [`credentials`](crate::credentials)), else none.
    pub fn secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Rendezvous through `store` and connect the full mesh on `device`.
    ///
    /// Each rank publishes an entry under `ferrogloo.rank.<r>`: the context id, the size, its
    /// backend, its host's identity, its endpoint's address and the cost model it was given, if
    /// any (wrap the store in a
    /// [`PrefixStore`](crate::rendezvous::PrefixStore) to form several contexts on one store).
    /// Rank 0 chooses a fresh random context id; every other rank confirms it by connecting to
    /// rank 0 and accepts only entries stamped with it, so entries left in the store by an
    /// earlier job are skipped rather than dialled. The higher rank of each pair connects to the
    /// lower. While it waits, a rank logs (through `tracing`, every few seconds) which ranks it
    /// still waits for and in which store.
    ///
    /// Errors: [`Error::InvalidArgument`] for `rank >= size` or `size == 0`, or a job secret
    /// in the environment that cannot be used (a file others can read, an empty one);
    /// [`Error::Timeout`] naming the missing ranks and keys when the mesh is not complete in
    /// time.
    pub fn connect<S: Store + ?Sized>(self, store: &S, device: &Device) -> Result<Context> {
        let ContextBuilder { rank, size, timeout, secret, busy_poll, heartbeat, cost } = self;
        if size == 0 {
            return Err(Error::invalid("context size must be at least 1"));
        }
        if rank >= size {
            return Err(Error::invalid(format!("rank {rank} is out of range for size {size}")));
        }
        if size > u32::MAX as usize {
            return Err(Error::invalid(format!("context size {size} is too large")));
        }
        let timeout = match timeout {
            Some(t) => t,
            None => default_timeout()?,
        };
        let heartbeat = match heartbeat {
            Some(h) => h,
            None => Vars::process()
                .seconds(FERROGLOO_HEARTBEAT, |s| s >= 0.0, "a number of seconds, 0 or more")?
                .unwrap_or(Duration::ZERO),
        };
        // A launched rank proves the job's secret without being told (see `credentials`).
        let secret = match secret {
            Some(s) => Some(s),
            None => crate::credentials::Credentials::secret_from_env().map_err(|e| match e {
                Error::InvalidArgument(m) => {
                    Error::invalid(format!("forming the context of rank {rank} of {size}: the job's secret: {m}"))
                }
                other => other,
            })?,
        };
        // A model given here or in the environment, checked before the mesh forms.
        let cost = match cost {
            Some(m) => Some(crate::cost::CostModel::new(m.latency, m.link_bytes_per_s, m.reduce_bytes_per_s)?),
            None => crate::cost::CostModel::from_env()?,
        };
        let spec = MeshSpec {
            rank,
            size,
            timeout,
            secret,
            host: device.host().to_string(),
            cost: cost.map(crate::cost::CostModel::to_exact_text),
        };
        let (mesh, hosts) = mesh::form(store, device.backend(), &spec)?;
        let spin = busy_wait(busy_poll, &hosts, rank);
        tracing::debug!(rank, size, backend = device.backend().name(), ?spin, "context connected");
        let shared = Arc::new(World::new(mesh, rank, hosts, spin));
        let comm = Comm::root(shared, timeout);
        // Set when a peer aborted or revoked the context as it formed: it is handed out failed.
        let mut failed = false;
        if size > 1 {
            // The links' cost model, for `Auto`'s choices: measured by every rank before the
            // context is handed out (on a message group of its own), so all hold it before
            // their first collective. Formation checked that every rank was given the same
            // model or none, so either all measure here or none does.
            let model = match cost {
                Some(m) => Some(m),
                None => match crate::cost::probe(&comm, std::time::Instant::now() + timeout) {
                    Ok(m) => Some(m),
                    // A rank that had formed its context aborted or revoked it while this one
                    // still measured: the context is formed, and failed; every call says why.
                    Err(e @ (Error::Aborted { .. } | Error::Revoked { .. })) => {
                        tracing::debug!(rank, error = %e, "the cost model was not measured: the context failed");
                        comm.fail(&e);
                        failed = true;
                        None
                    }
                    Err(e) => return Err(e),
                },
            };
            tracing::debug!(rank, size, ?model, "cost model");
            *crate::sync::lock(&comm.shared().cost) = model;
        }
        // Heartbeats before the hosts decide their copy paths: a host deciding for up to a
        // second must not look silent to ranks elsewhere that are done.
        let heartbeat = match heartbeat.is_zero() || size == 1 {
            true => None,
            false => Some(crate::comm::heartbeat::Heartbeat::start(&comm, heartbeat)?),
        };
        // The copy path of the host's shared-area collectives, decided by the host's members
        // together (a rank alone on its host has no area).
        if let (false, Some(area)) = (failed, comm.local_area()) {
            match crate::algorithms::calibrate::copy_plan(&comm, &**area, std::time::Instant::now() + timeout) {
                Ok(plan) => *crate::sync::lock(&comm.shared().copy_plan) = plan,
                Err(e @ (Error::Aborted { .. } | Error::Revoked { .. })) => {
                    tracing::debug!(rank, error = %e, "the copy path was not decided: the context failed");
                    comm.fail(&e);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Context { comm, device: device.clone(), hier: OnceLock::new(), survival: Default::default(), heartbeat })
    }
}

/// Spin when every rank on this machine can have a core, else yield (see
/// [`ContextBuilder::busy_poll`]). Measured with `ferrogloo-bench` on the 2-core machine: with
/// 2 ranks a 1 ms spin beats 20 µs at 64 KiB-1 MiB allreduce (62 vs 97 µs, 572 vs 890 µs); with
/// 4 ranks, 200 µs of yielding cuts 4 KiB allreduce from 293 to 226 µs and p99 from 2.2 ms to
/// 0.5 ms.
///
/// The ranks counted are those of this *machine* (one kernel, one set of cores), not only of
/// this host identity: ranks in other network namespaces or containers of the same kernel
/// (same boot id, see [`machine_of`]) share the cores too. Four ranks in four namespaces of the
/// 2-core machine, each counting only itself, spun, and starved the kernel's packet processing
/// between the namespaces: a 64 KiB allreduce took 3.2 ms, against 0.17 ms without spinning.
fn busy_wait(budget: Option<Duration>, hosts: &[String], rank: usize) -> BusyWait {
    let mine = machine_of(&hosts[rank]);
    let local = hosts.iter().filter(|h| machine_of(h) == mine).count();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let yield_cpu = local > cores;
    let default = if yield_cpu { Duration::from_micros(200) } else { Duration::from_millis(1) };
    BusyWait { budget: budget.unwrap_or(default), yield_cpu, alone: false }
}

/// The machine part of a host identity ([`host_id`](crate::device::host_id):
/// `NAME/BOOT_ID/NET_NS`): its boot id, which every namespace and container of one kernel
/// shares; an identity of another form (`FERROGLOO_HOST_ID`) is a machine of its own.
pub(crate) fn machine_of(host: &str) -> &str {
    let mut parts = host.split('/');
    match (parts.next(), parts.next()) {
        // A boot id (8-4-4-4-12 hex digits) or, where there is none, /etc/machine-id (32).
        (Some(_), Some(boot))
            if (boot.len() == 36 && boot.bytes().filter(|&b| b == b'-').count() == 4)
                || (boot.len() == 32 && boot.bytes().all(|b| b.is_ascii_hexdigit())) =>
        {
            boot
        }
        _ => host,
    }
}

/// This rank's membership in a job of `size` ranks: one connected pair per peer, a default
/// deadline, and the collectives and point-to-point calls.
///
/// Build one with [`Context::builder`]; make sub-groups with [`Context::split`] and
/// [`Context::subgroup`]. Every blocking call ends by its deadline ([`Error::Timeout`]); a
/// peer that dies makes calls involving it fail with [`Error::PeerClosed`]. A context is
/// `Sync`: threads may share it, using distinct tags for concurrent operations.
pub struct Context {
    comm: Comm,
    device: Device,
    /// How this context's ranks spread over hosts, for the hierarchical allreduce (made on
    /// first use).
    hier: OnceLock<Option<Hierarchy>>,
    /// The state of its agreements ([`Context::agree`]).
    survival: crate::comm::Survival,
    /// The mesh's heartbeats, shared by every context over it (see
    /// [`ContextBuilder::heartbeat`]); they stop with the last.
    heartbeat: Option<Arc<crate::comm::heartbeat::Heartbeat>>,
}

/// A context over several hosts whose ranks share memory within each host: the host leaders
/// (the lowest rank of each host) and, on a leader, the communicator of all leaders.
pub(crate) struct Hierarchy {
    /// The communicator of the leaders, on a leader; `None` elsewhere.
    pub(crate) leaders: Option<Comm>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("backend", &self.device.backend().name())
            .finish()
    }
}

impl Context {
    /// Starts describing the context of `rank` in a job of `size` ranks.
    pub fn builder(rank: usize, size: usize) -> ContextBuilder {
        ContextBuilder { rank, size, timeout: None, secret: None, busy_poll: None, heartbeat: None, cost: None }
    }

    pub(crate) fn comm(&self) -> &Comm {
        &self.comm
    }

    pub(crate) fn survival(&self) -> &crate::comm::Survival {
        &self.survival
    }

    /// The hierarchy for the hierarchical allreduce, when this context has one: it is the
    /// context a mesh was formed for, on a device that shares memory within a host and reaches
    /// other hosts otherwise ([`Backend::hierarchical`](crate::transport::Backend::hierarchical)),
    /// over two hosts or more, one of which has two ranks or more. Every rank decides alike:
    /// from the backend (the same on every rank) and the host identities every rank published.
    pub(crate) fn hierarchy(&self) -> Option<&Hierarchy> {
        self.hier
            .get_or_init(|| {
                if !self.comm.is_world() || !self.device.backend().hierarchical() {
                    return None;
                }
                let hosts = &self.comm.shared().hosts;
                let mut leaders: Vec<usize> = Vec::new();
                let mut shared_host = false;
                for (r, h) in hosts.iter().enumerate() {
                    match hosts[..r].iter().position(|x| x == h) {
                        None => leaders.push(r),
                        Some(_) => shared_host = true,
                    }
                }
                if leaders.len() < 2 || !shared_host {
                    return None;
                }
                let me = self.rank();
                let leaders = leaders
                    .contains(&me)
                    .then(|| Comm::over(self.comm.shared().clone(), LEADERS_GROUP, leaders.into(), self.timeout()));
                Some(Hierarchy { leaders })
            })
            .as_ref()
    }

    /// This rank, in `0..size`.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The default deadline of blocking calls.
    pub fn timeout(&self) -> Duration {
        self.comm.timeout()
    }

    /// The device this context's connections run on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The rank that rank `r` of this context has in the context the mesh was formed for (the
    /// job's "world"): `r` itself except in a sub-group. Errors name ranks this way.
    pub fn world_rank(&self, r: usize) -> Option<usize> {
        self.comm.world_rank(r)
    }

    /// The rank in this context of rank `w` of the context the mesh was formed for: the
    /// inverse of [`world_rank`](Self::world_rank), `None` for a rank that is not a member.
    /// Errors name ranks of the mesh's context; this maps such a rank back into a sub-group
    /// or a [shrunk](Self::shrink) context.
    pub fn rank_of_world(&self, w: usize) -> Option<usize> {
        self.comm.rank_of_world(w)
    }

    /// The host identity of rank `r` (see [`device::host_id`](crate::device::host_id)), as it
    /// published it when the mesh formed.
    pub fn host_of(&self, r: usize) -> Option<&str> {
        self.comm.world_rank(r).and_then(|w| self.comm.shared().hosts.get(w)).map(String::as_str)
    }

    /// The ranks of this context on this rank's host (this rank included), in rank order.
    pub fn local_ranks(&self) -> Vec<usize> {
        let me = self.host_of(self.rank());
        (0..self.size()).filter(|&r| self.host_of(r) == me).collect()
    }

    /// Makes the context unusable and tells every peer why: each peer's pending and future
    /// operations of this context fail with [`Error::Aborted`] naming this rank and `reason`,
    /// and so do this rank's own (including calls blocked in other threads right now, which
    /// return promptly).
    ///
    /// A collective that fails after it started communicating (a mismatch, a timeout, a dead
    /// peer) revokes the context itself ([`revoke`](Self::revoke)): the ranks' collective state
    /// no longer agrees, and every rank learns the first cause, at the latest at its next call.
    /// To go on after a failure, [`shrink`](Self::shrink) the context to its live members, or
    /// form a new one (for example under a new [`PrefixStore`] prefix). Aborting a sub-group
    /// leaves its parent and siblings working; aborting the context the mesh was formed for
    /// closes the connections, and every sub-group (and shrunk context) with them.
    ///
    /// [`PrefixStore`]: crate::rendezvous::PrefixStore
    pub fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }

    /// Whether the context was aborted (it then fails every call).
    pub fn is_aborted(&self) -> bool {
        self.comm.is_aborted()
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
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
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
        self.comm.scope(f)
    }

    /// Sends `buf` to `peer`, with `tag` (any `u32`) telling it apart from other messages to that
    /// peer. Returns once the data is handed to the transport (it may still be in flight).
    /// The peer must post a receive with the same tag that the message fits.
    pub fn send<T: Pod>(&self, peer: usize, tag: u32, buf: &[T]) -> Result<()> {
        self.scope(|s| s.isend(peer, tag, buf)?.wait())
    }

    /// Sends one message made of `parts`, one after the other, to `peer` with `tag`: the peer
    /// receives one message of their total length. Where the transport writes a message from
    /// several buffers (shared memory, TCP) nothing is copied first; elsewhere the parts are
    /// gathered into `scratch` (kept for the next call).
    pub(crate) fn send_parts(&self, peer: usize, tag: u32, parts: &[&[u8]], scratch: &mut Vec<u8>) -> Result<()> {
        if let [one] = parts {
            return self.send(peer, tag, one);
        }
        if !self.comm.pair(peer)?.gathers() {
            scratch.clear();
            for p in parts {
                scratch.extend_from_slice(p);
            }
            return self.send(peer, tag, scratch);
        }
        let bufs: SmallVec<[SendBuf; 8]> = parts.iter().map(|p| SendBuf::from_slice(p)).collect();
        let key = self.comm.p2p_key(tag);
        self.scope(|s| {
            // SAFETY: the parts are borrowed for the whole scope, which finishes or cancels
            // the send before it ends (Comm::scope).
            let idx = unsafe { s.isend_parts_raw(peer, key, OpDesc::P2P, &bufs, "send")? };
            s.wait_deadline(idx, Instant::now() + self.comm.timeout()).map(drop)
        })
    }

    /// Sends several messages at once, each `(peer, tag, parts)` made of its parts one after
    /// the other ([`send_parts`](Self::send_parts)), and waits for all of them: a large message
    /// to one peer does not wait for another's to be taken (the waits drive every pair).
    /// Messages to one peer arrive in their order here, and one whose earlier message to that
    /// peer failed is not sent (it fails the same way). `hold` is called before the messages are
    /// posted and what it returns is dropped once they are, before the waits (a lock that keeps
    /// other threads' messages from coming between them, say). Returns each message's outcome.
    pub(crate) fn send_all<G>(&self, messages: &[(usize, u32, &[&[u8]])], hold: impl FnOnce() -> G) -> Vec<Result<()>> {
        // Gathered first (one buffer each) where the pair writes from one buffer only.
        let gathered: Vec<Option<Vec<u8>>> = messages
            .iter()
            .map(|(peer, _, parts)| {
                let gathers = self.comm.pair(*peer).is_ok_and(|p| p.gathers());
                (parts.len() > 1 && !gathers).then(|| parts.concat())
            })
            .collect();
        let deadline = Instant::now() + self.comm.timeout();
        let n = messages.len();
        let outcome = self.scope(|s| {
            let held = hold();
            let mut posted: Vec<Result<usize>> = Vec::with_capacity(n);
            for (i, ((peer, tag, parts), joined)) in messages.iter().zip(&gathered).enumerate() {
                let earlier = (0..i).rev().find(|&j| messages[j].0 == *peer && posted[j].is_err());
                if let Some(j) = earlier {
                    let e = posted[j].as_ref().err().cloned().unwrap_or_else(|| Error::invalid("not sent"));
                    posted.push(Err(e));
                    continue;
                }
                let bufs: SmallVec<[SendBuf; 8]> = match joined {
                    Some(j) => smallvec::smallvec![SendBuf::from_slice(j)],
                    None => parts.iter().map(|p| SendBuf::from_slice(p)).collect(),
                };
                // SAFETY: the parts (and the gathered copies) are borrowed for the whole
                // scope, which finishes or cancels every send before it ends (Comm::scope).
                posted.push(unsafe { s.isend_parts_raw(*peer, self.comm.p2p_key(*tag), OpDesc::P2P, &bufs, "send") });
            }
            drop(held);
            // In order: a message that failed leaves the later ones to its peer unwaited (the
            // scope withdraws them), so that none goes without the one before it.
            let mut out: Vec<Result<()>> = Vec::with_capacity(n);
            for (i, p) in posted.into_iter().enumerate() {
                let earlier = (0..i).rev().find(|&j| messages[j].0 == messages[i].0 && out[j].is_err());
                out.push(match (earlier, p) {
                    (Some(j), _) => Err(out[j].as_ref().err().cloned().unwrap_or_else(|| Error::invalid("not sent"))),
                    (None, p) => p.and_then(|idx| s.wait_deadline(idx, deadline).map(drop)),
                });
            }
            Ok(out)
        });
        outcome.unwrap_or_else(|e| (0..n).map(|_| Err(e.clone())).collect())
    }

    /// Whether [`recv_sink`](Self::recv_sink) from `peer` hands the message over where it
    /// arrives (shared memory: from the ring; in-process: from the sender's buffer).
    pub(crate) fn sinks(&self, peer: usize) -> bool {
        self.comm.pair(peer).is_ok_and(|p| p.sinks())
    }

    /// Messages with `tag` from any peer that arrive before their receive wait in the
    /// transport until it is posted (nothing after them on that pair is read meanwhile),
    /// instead of being copied aside, on the pairs that can ([`sinks`](Self::sinks)): for a
    /// message whose receive is always posted right after the one before it is read.
    pub(crate) fn hold_until_posted(&self, tag: u32) {
        let key = self.comm.p2p_key(tag);
        for peer in 0..self.size() {
            if let Ok(p) = self.comm.pair(peer) {
                p.hold_until_posted(key);
            }
        }
    }

    /// Receives the next message from `peer` with `tag`, of exactly `len` bytes, handing its
    /// bytes to `sink` in order, in pieces as they arrive (no buffer of the message's length:
    /// the receiver folds them into its own state), until `deadline`. A message of another
    /// length is [`Error::Mismatch`]; a pair that cannot hand bytes over ([`sinks`](Self::sinks)
    /// false) is [`Error::InvalidArgument`]. The sink may be called from whichever thread
    /// drives the pair while this call waits, never after it returns.
    pub(crate) fn recv_sink(
        &self,
        peer: usize,
        tag: u32,
        len: usize,
        sink: &mut (dyn FnMut(&[u8]) + Send),
        deadline: Instant,
    ) -> Result<()> {
        if !self.sinks(peer) {
            return Err(Error::invalid(format!(
                "a receive from rank {peer} handed over piece by piece: its transport cannot"
            )));
        }
        let key = self.comm.p2p_key(tag);
        self.scope(|s| {
            // SAFETY: the sink is borrowed for the whole scope, which finishes or cancels the
            // receive on its pair before it ends (Comm::scope), so nothing calls it afterwards.
            let target = crate::transport::RecvTarget::Sink(unsafe { crate::transport::SinkRef::new(sink, len) });
            // SAFETY: as above: the target's consumer outlives the operation.
            let idx = unsafe { s.irecv_raw(&[peer], key, OpDesc::P2P, target, "recv")? };
            s.wait_deadline(idx, deadline).map(drop)
        })
    }

    /// Receives the next message from `peer` with `tag` into `buf`. A message of another
    /// byte length is [`Error::Mismatch`].
    pub fn recv<T: Pod>(&self, peer: usize, tag: u32, buf: &mut [T]) -> Result<()> {
        self.scope(|s| s.irecv(peer, tag, buf)?.wait().map(drop))
    }

    /// Receives the next message from `peer` with `tag` into the front of `buf`, whose length
    /// is the most it takes; returns the number of elements received. A longer message is
    /// [`Error::Mismatch`].
    pub fn recv_upto<T: Pod>(&self, peer: usize, tag: u32, buf: &mut [T]) -> Result<usize> {
        self.scope(|s| s.irecv_upto(peer, tag, buf)?.wait().map(|b| b.len()))
    }

    /// Receives the next message with `tag` from whichever rank of `peers` sends first, and
    /// returns that rank.
    pub fn recv_any<T: Pod>(&self, peers: &[usize], tag: u32, buf: &mut [T]) -> Result<usize> {
        self.scope(|s| s.irecv_any(peers, tag, buf)?.wait_from().map(|(r, _)| r))
    }

    /// Receives the next message from `peer` with `tag`, of whatever length the sender chose up
    /// to `max_bytes`, into a buffer allocated for it (the payload lands there directly, with no
    /// extra copy). A longer message is [`Error::Mismatch`].
    ///
    /// ```
    /// # use ferrogloo::{Context, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
    /// if ctx.size() > 1 {
    ///     if ctx.rank() == 1 {
    ///         ctx.send(0, 3, b"a value of any length")?;
    ///     } else if ctx.rank() == 0 {
    ///         let value = ctx.recv_bytes(1, 3, 1 << 20)?;
    ///         assert_eq!(value, b"a value of any length");
    ///     }
    /// }
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn recv_bytes(&self, peer: usize, tag: u32, max_bytes: usize) -> Result<Vec<u8>> {
        self.scope(|s| s.irecv_bytes(&[peer], tag, max_bytes)?.wait().map(|(_, v)| v))
    }

    /// The context of `members` (mesh ranks, in rank order; this rank is one of them) over
    /// this context's connections, with group id `group`.
    pub(crate) fn child(&self, group: u64, members: Arc<[usize]>) -> Context {
        let comm = Comm::over(self.comm.shared().clone(), group, members, self.timeout());
        Context {
            comm,
            device: self.device.clone(),
            hier: OnceLock::new(),
            survival: Default::default(),
            heartbeat: self.heartbeat.clone(),
        }
    }
}

/// Ranks of one job as threads of this process, for the crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::Context;
    use crate::device::Device;
    use crate::error::Result;
    use crate::rendezvous::HashStore;
    use std::time::Duration;

    /// Runs `f` on each of `n` ranks as threads, on contexts over `device` that meet through
    /// one store; returns their results in rank order (a rank that panics or fails fails the
    /// test).
    pub(crate) fn ranks<T: Send>(n: usize, device: &Device, f: impl Fn(Context) -> Result<T> + Sync) -> Vec<T> {
        ranks_with(n, device, |b| b, f)
    }

    /// [`ranks`], each rank's builder first given to `build`.
    pub(crate) fn ranks_with<T: Send>(
        n: usize,
        device: &Device,
        build: impl Fn(super::ContextBuilder) -> super::ContextBuilder + Sync,
        f: impl Fn(Context) -> Result<T> + Sync,
    ) -> Vec<T> {
        let store = HashStore::new();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|r| {
                    let (store, f, build) = (&store, &f, &build);
                    s.spawn(move || {
                        let ctx =
                            build(Context::builder(r, n).timeout(Duration::from_secs(20))).connect(store, device)?;
                        f(ctx)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a rank panicked").expect("a rank failed")).collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::testing::ranks;
    use super::*;
    use crate::device::ShmAttr;

    /// Ranks in other namespaces of this kernel share its cores: with more of them than
    /// cores, a wait yields instead of spinning; ranks of other machines do not count.
    #[test]
    fn ranks_of_other_namespaces_on_this_machine_count_for_the_busy_wait() {
        let boot = "3f1c2a9e-8d4b-4c7e-9a10-5b6c7d8e9f01";
        let other = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let ns = |i: usize| format!("host{i}/{boot}/net:[40265{i}]");
        // One rank per namespace, more ranks than cores: every one yields.
        let crowded: Vec<String> = (0..cores + 1).map(ns).collect();
        assert!(busy_wait(None, &crowded, 0).yield_cpu);
        // As many as the cores, the others on another machine: they spin.
        let mut spread: Vec<String> = (0..cores).map(ns).collect();
        spread.extend((0..3).map(|i| format!("far{i}/{other}/net:[1]")));
        assert!(!busy_wait(None, &spread, 0).yield_cpu);
        assert_eq!(machine_of(&ns(1)), boot);
        assert_eq!(machine_of("h/0123456789abcdef0123456789abcdef/net:[2]"), "0123456789abcdef0123456789abcdef");
        // An identity set by hand is a machine of its own.
        assert_eq!(machine_of("rack4-node17"), "rack4-node17");
        assert_eq!(machine_of("a/b/c"), "a/b/c");
    }

    /// A message handed to a consumer as it arrives: every byte, in order, once, on the
    /// transports that can (shared memory in fragments, and whole when it came before its
    /// receive; in-process), and refused on TCP; a message of another length is a mismatch.
    #[test]
    fn a_message_received_piece_by_piece_arrives_whole_and_in_order() {
        let sizes = [0usize, 5, 16 << 10, (300 << 10) + 3, 5 << 20];
        let devices = [Device::shared_memory(&ShmAttr::default()), Device::in_process()];
        for device in &devices {
            ranks(2, device, |ctx| -> Result<()> {
                let rank = ctx.rank();
                let msg = |n: usize| -> Vec<u8> { (0..n).map(|j| (j * 13 + n) as u8).collect() };
                let name = device.backend().name();
                if rank == 0 {
                    for &n in &sizes {
                        // Once the receive is posted (the receiver reads its ring
                        // only in its waits), so that it takes the fragments.
                        ctx.recv::<u8>(1, 7, &mut [])?;
                        ctx.send(1, 4, &msg(n))?;
                    }
                    // The last one is sent before the receiver posts (it waits
                    // for the barrier first): taken from where it came early.
                    ctx.send(1, 5, &msg(70 << 10))?;
                    ctx.barrier()?;
                    ctx.send(1, 6, &msg(10))?;
                } else {
                    let deadline = Instant::now() + Duration::from_secs(20);
                    for &n in &sizes {
                        ctx.send::<u8>(0, 7, &[])?;
                        let (mut got, mut pieces) = (Vec::new(), 0usize);
                        ctx.recv_sink(
                            1 - rank,
                            4,
                            n,
                            &mut |b: &[u8]| {
                                got.extend_from_slice(b);
                                pieces += 1;
                            },
                            deadline,
                        )?;
                        assert!(got == msg(n), "{name}: {n} bytes arrived altered");
                        if name == "shm" && n > 1 << 20 {
                            assert!(pieces > 1, "{name}: {n} bytes in {pieces} piece(s)");
                        }
                    }
                    ctx.barrier()?;
                    let mut got = Vec::new();
                    ctx.recv_sink(0, 5, 70 << 10, &mut |b: &[u8]| got.extend_from_slice(b), deadline)?;
                    assert!(got == msg(70 << 10), "{name}: the early message arrived altered");
                    let e = ctx.recv_sink(0, 6, 11, &mut |_: &[u8]| {}, deadline);
                    assert!(matches!(e, Err(Error::Mismatch { .. })), "{name}: {e:?}");
                }
                ctx.barrier()
            });
        }
        let tcp = Device::loopback().expect("a TCP device on loopback");
        ranks(2, &tcp, |ctx| -> Result<()> {
            let rank = ctx.rank();
            let e = ctx.recv_sink(1 - rank, 4, 1, &mut |_: &[u8]| {}, Instant::now());
            assert!(matches!(e, Err(Error::InvalidArgument(_))), "tcp: {e:?}");
            ctx.barrier()
        });
    }

    /// Several messages sent at once, large ones to two peers (neither waits for the other's
    /// to be taken), two to one peer on one tag arriving in their order, on every transport.
    #[test]
    fn messages_sent_at_once_arrive_whole_and_in_order_per_peer_on_every_transport() {
        let devices = [
            Device::shared_memory(&ShmAttr::default()),
            Device::loopback().expect("a TCP device on loopback"),
            Device::in_process(),
        ];
        let bytes = |n: usize, seed: usize| -> Vec<u8> { (0..n).map(|j| (j * 7 + seed) as u8).collect() };
        for device in &devices {
            ranks(3, device, |ctx| -> Result<()> {
                let rank = ctx.rank();
                let name = device.backend().name();
                let (a, b, c, d) = (bytes(3 << 20, 1), bytes(100, 2), bytes(2 << 20, 3), bytes(5, 4));
                if rank == 0 {
                    let first: [&[u8]; 2] = [&a, &b];
                    let (second, third): ([&[u8]; 1], [&[u8]; 2]) = ([&c], [&d, &b]);
                    let sent = ctx.send_all(&[(1, 9, &first), (2, 9, &second), (1, 9, &third)], || ());
                    assert!(sent.iter().all(Result::is_ok), "{name}: {sent:?}");
                } else if rank == 1 {
                    assert!(ctx.recv_bytes(0, 9, 8 << 20)? == [a, b.clone()].concat(), "{name}: first");
                    assert!(ctx.recv_bytes(0, 9, 8 << 20)? == [d, b].concat(), "{name}: third");
                } else {
                    assert!(ctx.recv_bytes(0, 9, 8 << 20)? == c, "{name}: second");
                }
                ctx.barrier()
            });
        }
    }

    /// A message whose peer is gone fails, the later messages to that peer fail with it (none
    /// goes without the one before), and those to other peers arrive.
    #[test]
    fn messages_sent_at_once_to_a_gone_peer_fail_and_the_others_arrive() {
        let device = Device::in_process();
        // Rank 2's context is gone before rank 0 sends (threads of this test).
        let left = std::sync::Barrier::new(2);
        ranks(3, &device, |ctx| -> Result<()> {
            let rank = ctx.rank();
            ctx.barrier()?;
            match rank {
                0 => {
                    left.wait();
                    let (a, b): ([&[u8]; 1], [&[u8]; 2]) = ([b"to two"], [b"to ", b"one"]);
                    let sent = ctx.send_all(&[(2, 9, &a), (1, 9, &b), (2, 9, &a)], || ());
                    assert!(sent[0].is_err() && sent[2].is_err(), "{sent:?}");
                    assert!(sent[1].is_ok(), "{sent:?}");
                }
                1 => assert_eq!(ctx.recv_bytes(0, 9, 64)?, b"to one"),
                _ => {
                    drop(ctx);
                    left.wait();
                }
            }
            Ok(())
        });
    }

    /// One message from several buffers: part boundaries inside shared-memory fragments and
    /// TCP writes, empty parts, and many small parts (gathered into the scratch in-process).
    #[test]
    fn a_message_sent_from_several_buffers_arrives_as_one_on_every_transport() {
        let shapes: [&[usize]; 3] = [&[40, 300 << 10, 0, 1024, 2 << 20, 3], &[7; 100], &[64, 100]];
        let devices = [
            Device::shared_memory(&ShmAttr::default()),
            Device::loopback().expect("a TCP device on loopback"),
            Device::in_process(),
        ];
        for device in &devices {
            ranks(2, device, |ctx| -> Result<()> {
                let rank = ctx.rank();
                for (n, shape) in shapes.iter().enumerate() {
                    let parts: Vec<Vec<u8>> = shape
                        .iter()
                        .enumerate()
                        .map(|(i, &len)| (0..len).map(|j| (j * 7 + i * 31 + n) as u8).collect())
                        .collect();
                    if rank == 0 {
                        let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
                        ctx.send_parts(1, 9, &views, &mut Vec::new())?;
                    } else {
                        let got = ctx.recv_bytes(0, 9, 8 << 20)?;
                        assert!(got == parts.concat(), "{}: shape {n} arrived altered", device.backend().name());
                    }
                }
                ctx.barrier()
            });
        }
    }
}
