//! A parameter server in the style of ps-lite: workers push values for the keys they touched
//! and pull fresh ones; servers own shards of the key space and answer through a handler.
//!
//! Servers and workers meet through a [`Store`] like any [`Context`] (no scheduler process):
//! server `i` is rank `i` of one context, worker `j` is rank `servers + j`. A role that never
//! arrives makes the others' [`Node::connect`] time out naming the role and who is missing.
//!
//! ```
//! use ferrogloo::ps::{Node, PsConfig, Role, SumStore};
//! use ferrogloo::{device::Device, rendezvous::HashStore};
//! let store = HashStore::new();
//! let cfg = PsConfig::new(1, 1);
//! std::thread::scope(|s| -> ferrogloo::Result<()> {
//!     let server = s.spawn(|| {
//!         let node = Node::connect(&store, &Device::in_process(), Role::Server, 0, cfg.clone())?;
//!         node.server(SumStore::<f32>::default())?.run()
//!     });
//!     let node = Node::connect(&store, &Device::in_process(), Role::Worker, 0, cfg.clone())?;
//!     let w = node.worker::<f32>()?;
//!     // Keys sorted and unique; two values for key 3, one for key 8.
//!     let ts = w.push(&[3, 8], &[1.0, 2.0, 5.0], &[2, 1])?;
//!     w.wait(ts)?;
//!     let pulled = w.wait(w.pull(&[3, 8])?)?;
//!     assert_eq!((pulled.values, pulled.lens), (vec![1.0, 2.0, 5.0], vec![2, 1]));
//!     drop(w); // says goodbye: the server's run returns once every worker has
//!     server.join().expect("server thread")?;
//!     Ok(())
//! })?;
//! # Ok::<(), ferrogloo::Error>(())
//! ```
//!
//! - **Requests** carry a timestamp ([`KvWorker::push`], [`pull`](KvWorker::pull),
//!   [`push_pull`](KvWorker::push_pull) return it; [`KvWorker::wait`] waits with the request's
//!   deadline, [`KvWorker::then`] is the callback form), a command id of the caller's, sorted
//!   unique `u64` keys (checked) and variable-length values per key.
//! - **Sharding** is by a hash of the key by default (dense small keys spread over every
//!   server), by key range on request, or by a function of yours; a request whose keys span
//!   several servers completes when every part has.
//! - **Servers** run a [`Handler`]: [`SumStore`] (pushes are summed into the stored values,
//!   pulls read them), [`SyncSgd`] (a key's update is applied when every live worker pushed
//!   its gradient, and every pusher gets the new weights), [`AsyncSgd`] (each push applied at
//!   once), or your own, which may answer later ([`Responder`]).
//! - **Faults**: a server that dies (its process killed: the connection closes) fails every
//!   pending and later request that needs it, naming the server and the keys; a server that
//!   hangs fails them at their deadline. Servers send heartbeats (every
//!   [`PsConfig::heartbeat`]); [`KvWorker::dead_servers`] lists those closed or silent for three
//!   heartbeats. A worker that dies (also one an answer can no longer reach) is dropped from
//!   the servers' synchronous rounds; the others go on. A malformed request is refused (its
//!   wait fails saying why) and a message that is no request is logged and skipped: neither
//!   ends a server's run. Messages are at most 1 GiB: a request that would be larger fails
//!   at once naming its size.
//! - **Replication** ([`PsConfig::replication`]): server `s+1` keeps a copy of server `s`'s
//!   state and answers for it once it dies.
//! - **ps-lite's environment** (`DMLC_ROLE`, ...): [`Node::from_env`] and [`run_scheduler`].
//! - **Rejoining**: a worker whose process died, restarted, calls [`Node::rejoin`]; servers
//!   with [`PsConfig::rejoin_wait`] meet it in a new context of its own (in the background,
//!   serving the others meanwhile; a meeting that fails is logged, and the server goes on
//!   waiting for the worker).

mod env;
mod handlers;
mod wire;

pub use env::{EnvRole, config_from_env, role_from_env, run_scheduler};
pub use handlers::{AsyncSgd, SumStore, SyncSgd};

use crate::Context;
use crate::comm::{PersistentRecv, QUIET, wait_any};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::rendezvous::Store;
use crate::sync::lock;
use crate::types::Element;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use wire::{Kind, Message};

/// Where rejoining workers announce themselves in the store.
const REJOIN: &str = "ferrogloo-ps/rejoin";

/// The tag of parameter-server messages on the nodes' context.
const PS_TAG: u32 = 0x5053_0001;
/// The parameter server's receives, as errors name them.
const PS_RECEIVE: &str = "parameter-server receive";
/// How often the receiving threads look at deadlines and stop flags.
const SLICE: Duration = Duration::from_millis(100);

/// A node's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Pushes and pulls.
    Worker,
    /// Owns a shard of the keys.
    Server,
}

/// Which server owns a key.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum Sharding {
    /// A hash of the key (dense small keys spread over every server).
    #[default]
    Hash,
    /// Equal ranges of the `u64` key space (ps-lite's way: small keys all land on server 0).
    Range,
    /// `f(key, servers)`, which must be below `servers` and the same on every node.
    Custom(Arc<dyn Fn(u64, usize) -> usize + Send + Sync>),
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Sharding::Hash => "Hash",
            Sharding::Range => "Range",
            Sharding::Custom(_) => "Custom",
        })
    }
}

impl Sharding {
    /// The server of `key` among `servers`.
    pub fn server_of(&self, key: u64, servers: usize) -> usize {
        let s = servers.max(1);
        match self {
            Sharding::Hash => (splitmix(key) % s as u64) as usize,
            Sharding::Range => ((u128::from(key) * s as u128) >> 64) as usize,
            Sharding::Custom(f) => f(key, s),
        }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The job's shape and behaviour; every node must use the same.
#[derive(Debug, Clone)]
pub struct PsConfig {
    /// Number of workers.
    pub workers: usize,
    /// Number of servers.
    pub servers: usize,
    /// Deadline of the rendezvous and of each request.
    pub timeout: Duration,
    /// How keys map to servers.
    pub sharding: Sharding,
    /// How often servers tell workers they are alive (`None`: never).
    pub heartbeat: Option<Duration>,
    /// Keep a copy of each server's state on the next server (its backup), which answers for
    /// it once it dies. Workers send every push to both; handlers must be deterministic in
    /// what they store (the ones here are; float sums may differ in the last bits).
    pub replication: bool,
    /// How long a server waits for a worker whose process died to come back
    /// ([`Node::rejoin`]) before counting it gone (`None`: it is gone at once). Needs a
    /// node made with [`Node::connect_shared`] (or [`Node::from_env`]), which keeps the store.
    pub rejoin_wait: Option<Duration>,
}

impl PsConfig {
    /// `workers` workers and `servers` servers, hash sharding, 30 s deadlines, a heartbeat
    /// every second.
    pub fn new(workers: usize, servers: usize) -> Self {
        PsConfig {
            workers,
            servers,
            timeout: Duration::from_secs(30),
            sharding: Sharding::Hash,
            heartbeat: Some(Duration::from_secs(1)),
            replication: false,
            rejoin_wait: None,
        }
    }
}

/// The nodes a [`Node::barrier`] waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// Every worker.
    Workers,
    /// Every server.
    Servers,
    /// Everyone.
    All,
}

/// A node of the job: a server or a worker, connected to every other node.
pub struct Node {
    ctx: Arc<Context>,
    role: Role,
    id: usize,
    cfg: PsConfig,
    /// The job's store, when the node keeps it (for workers rejoining).
    store: Option<Arc<dyn Store>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("role", &self.role).field("id", &self.id).finish()
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Worker => "worker",
        Role::Server => "server",
    }
}

impl Node {
    /// Joins the job as `role` number `id` (servers `0..servers`, workers `0..workers`),
    /// meeting the others through `store` on `device`. Times out (after `cfg.timeout`) naming
    /// the roles and ids that did not arrive.
    pub fn connect<S: Store + ?Sized>(
        store: &S,
        device: &Device,
        role: Role,
        id: usize,
        cfg: PsConfig,
    ) -> Result<Node> {
        if cfg.servers == 0 || cfg.workers == 0 {
            return Err(Error::invalid(format!(
                "a parameter server needs at least one server and one worker, not {} and {}",
                cfg.servers, cfg.workers
            )));
        }
        let count = match role {
            Role::Worker => cfg.workers,
            Role::Server => cfg.servers,
        };
        if id >= count {
            return Err(Error::invalid(format!("{} {id} of {count}: no such {}", role_name(role), role_name(role))));
        }
        let rank = match role {
            Role::Server => id,
            Role::Worker => cfg.servers + id,
        };
        let ctx = Context::builder(rank, cfg.servers + cfg.workers)
            .timeout(cfg.timeout)
            .connect(store, device)
            .map_err(|e| name_roles(e, &cfg))?;
        Ok(Node { ctx: Arc::new(ctx), role, id, cfg, store: None })
    }

    /// [`connect`](Self::connect), keeping the store: a server made this way watches it for
    /// workers that rejoin ([`PsConfig::rejoin_wait`]).
    pub fn connect_shared(
        store: Arc<dyn Store>,
        device: &Device,
        role: Role,
        id: usize,
        cfg: PsConfig,
    ) -> Result<Node> {
        let mut node = Node::connect(&*store, device, role, id, cfg)?;
        node.store = Some(store);
        Ok(node)
    }

    /// Worker `id`, restarted after its process died, joins the running job again: it meets
    /// every server (which must have [`PsConfig::rejoin_wait`] set and still be waiting for
    /// it) in a new context of its own. Handlers hear of it through
    /// [`Handler::worker_joined`].
    pub fn rejoin<S: Store + ?Sized>(store: &S, device: &Device, id: usize, cfg: PsConfig) -> Result<Node> {
        if id >= cfg.workers {
            return Err(Error::invalid(format!("worker {id} of {}: no such worker", cfg.workers)));
        }
        let generation = store.add(&format!("{REJOIN}/{id}/generations"), 1)? - 1;
        store.set(&format!("{REJOIN}/{id}/{generation}"), b"rejoin")?;
        let prefixed = crate::rendezvous::PrefixStore::new(format!("{REJOIN}/{id}/{generation}/"), store);
        let ctx = Context::builder(cfg.servers, cfg.servers + 1)
            .timeout(cfg.timeout)
            .connect(&prefixed, device)
            .map_err(|e| name_roles(e, &cfg))?;
        Ok(Node { ctx: Arc::new(ctx), role: Role::Worker, id, cfg, store: None })
    }

    /// This node's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// This node's number among its role.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Blocks until every node of `group` (this node's role must be in it) has called
    /// `barrier` with it as often as this one, or the deadline passes naming who did not.
    pub fn barrier(&self, group: Group) -> Result<()> {
        barrier(&self.ctx, &self.cfg, self.role, group)
    }

    /// The node as a worker of values of type `T`.
    pub fn worker<T: Element>(self) -> Result<KvWorker<T>> {
        if self.role != Role::Worker {
            return Err(Error::invalid(format!("server {} cannot be a worker", self.id)));
        }
        KvWorker::start(self)
    }

    /// The node as a server answering requests for values of type `T` with `handler`; call
    /// [`KvServer::run`].
    pub fn server<T: Element, H: Handler<T> + Clone>(self, handler: H) -> Result<KvServer<T, H>> {
        if self.role != Role::Server {
            return Err(Error::invalid(format!("worker {} cannot be a server", self.id)));
        }
        Ok(KvServer { node: self, handler, _t: PhantomData })
    }
}

fn barrier(ctx: &Context, cfg: &PsConfig, role: Role, group: Group) -> Result<()> {
    let ranks: Vec<usize> = match (group, role) {
        (Group::All, _) => return ctx.barrier(),
        (Group::Workers, Role::Worker) => (cfg.servers..cfg.servers + cfg.workers).collect(),
        (Group::Servers, Role::Server) => (0..cfg.servers).collect(),
        (g, r) => return Err(Error::invalid(format!("a {} is not in the group {g:?}", role_name(r)))),
    };
    ctx.subgroup(&ranks)?.barrier().map_err(|e| name_roles(e, cfg))
}

/// A rendezvous timeout in the parameter server's words: which roles are missing.
fn name_roles(e: Error, cfg: &PsConfig) -> Error {
    match e {
        Error::Timeout { op, ranks, keys, waited } if !ranks.is_empty() => {
            let servers: Vec<usize> = ranks.iter().copied().filter(|&r| r < cfg.servers).collect();
            let workers: Vec<usize> = ranks.iter().filter(|&&r| r >= cfg.servers).map(|r| r - cfg.servers).collect();
            let mut parts = Vec::new();
            if !servers.is_empty() {
                parts.push(format!("{} of {} servers missing (servers {servers:?})", servers.len(), cfg.servers));
            }
            if !workers.is_empty() {
                parts.push(format!("{} of {} workers missing (workers {workers:?})", workers.len(), cfg.workers));
            }
            Error::Timeout { op: format!("parameter-server {op}: {}", parts.join(", ")), ranks, keys, waited }
        }
        other => other,
    }
}

/// A request's identity, returned by the worker's calls: unique and increasing among one
/// worker's requests (not consecutive).
pub type Timestamp = u64;

/// A timestamp from a worker's request counter: the lowest bit says whether the request is a
/// push (which gives nothing back, so that its entry can go once acknowledged).
fn timestamp_of(counter: u64, push: bool) -> Timestamp {
    counter << 1 | u64::from(push)
}

/// What a finished request gives back: for a pull or push-pull, the values of the keys asked
/// for (concatenated in key order) and each key's length; empty for a push (no keys either).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply<T> {
    /// The keys.
    pub keys: Vec<u64>,
    /// Their values, concatenated.
    pub values: Vec<T>,
    /// Each key's number of values.
    pub lens: Vec<usize>,
}

impl<T> Default for Reply<T> {
    fn default() -> Self {
        Reply { keys: Vec::new(), values: Vec::new(), lens: Vec::new() }
    }
}

type Callback<T> = Box<dyn FnOnce(Result<Reply<T>>) + Send>;

/// A request in flight.
struct Pending<T> {
    keys: Vec<u64>,
    /// Per server: the positions (in `keys`) of the keys sent to it; `None` once answered.
    parts: HashMap<usize, Vec<usize>>,
    /// The answers so far: the key positions each covers, and the message.
    answers: Vec<(Vec<usize>, Message)>,
    wants_values: bool,
    deadline: Instant,
    what: &'static str,
    outcome: Option<Result<Reply<T>>>,
    callback: Option<Callback<T>>,
    /// A backup's answers for a shard whose primary is still alive (used if it dies).
    stash: HashMap<usize, Message>,
    /// Pull parts, to ask the backup if the primary dies (replication only).
    pulls: HashMap<usize, Vec<u8>>,
}

struct WorkerShared<T> {
    ctx: Arc<Context>,
    cfg: PsConfig,
    id: usize,
    next: AtomicU64,
    pending: Mutex<HashMap<Timestamp, Pending<T>>>,
    done: Condvar,
    /// Servers whose connection closed.
    closed: Mutex<HashMap<usize, Error>>,
    /// When each server was last heard from.
    heard: Mutex<Vec<Instant>>,
    /// A message buffer to reuse (large fresh buffers cost their page faults every time).
    scratch: Mutex<Vec<u8>>,
    /// Pushes whose failure was handed out (to `wait` or a callback): waiting for one again is
    /// an error, not the empty success of an acknowledged push.
    spent_failures: Mutex<HashSet<Timestamp>>,
    stop: AtomicBool,
}

/// A worker: pushes and pulls values of type `T`. Calls are thread-safe.
pub struct KvWorker<T: Element> {
    sh: Arc<WorkerShared<T>>,
    thread: Option<JoinHandle<()>>,
}

impl<T: Element> std::fmt::Debug for KvWorker<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvWorker").field("id", &self.sh.id).finish()
    }
}

/// Checks that keys are sorted and unique and that `lens` splits `values`; returns the lengths.
fn check_keys(what: &str, keys: &[u64], values: Option<(usize, &[usize])>) -> Result<Vec<usize>> {
    if let Some(i) = (1..keys.len()).find(|&i| keys[i] <= keys[i - 1]) {
        let how = if keys[i] == keys[i - 1] { "repeats" } else { "comes after" };
        return Err(Error::invalid(format!(
            "{what}: keys must be sorted and unique: key {} at index {i} {how} key {} at index {}",
            keys[i],
            keys[i - 1],
            i - 1
        )));
    }
    let Some((n, lens)) = values else { return Ok(Vec::new()) };
    if lens.is_empty() {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if n % keys.len() != 0 {
            return Err(Error::invalid(format!(
                "{what}: {n} values do not split evenly over {} keys (give their lengths)",
                keys.len()
            )));
        }
        return Ok(vec![n / keys.len(); keys.len()]);
    }
    if lens.len() != keys.len() {
        return Err(Error::invalid(format!("{what}: {} lengths for {} keys", lens.len(), keys.len())));
    }
    let total = lens.iter().try_fold(0usize, |a, &l| a.checked_add(l));
    if total != Some(n) {
        return Err(Error::invalid(format!("{what}: the lengths add up to {total:?} values, not the {n} given")));
    }
    Ok(lens.to_vec())
}

impl<T: Element> KvWorker<T> {
    fn start(node: Node) -> Result<Self> {
        let sh = Arc::new(WorkerShared {
            ctx: node.ctx,
            next: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
            done: Condvar::new(),
            closed: Mutex::new(HashMap::new()),
            heard: Mutex::new(vec![Instant::now(); node.cfg.servers]),
            scratch: Mutex::new(Vec::new()),
            spent_failures: Mutex::new(HashSet::new()),
            stop: AtomicBool::new(false),
            id: node.id,
            cfg: node.cfg,
        });
        let s = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ferrogloo-ps-worker-{}", node.id))
            .spawn(move || receive_replies(&s))
            .map_err(|e| Error::io("starting the worker's receiving thread", e))?;
        Ok(KvWorker { sh, thread: Some(thread) })
    }

    /// This worker's number.
    pub fn id(&self) -> usize {
        self.sh.id
    }

    /// Blocks until every worker has called `barrier` as often as this one (the servers go on
    /// serving).
    pub fn barrier(&self) -> Result<()> {
        barrier(&self.sh.ctx, &self.sh.cfg, Role::Worker, Group::Workers)
    }

    /// Pushes `values` for `keys` (sorted, unique); `lens[i]` values belong to `keys[i]`
    /// (empty `lens`: equal lengths). Returns at once with the request's timestamp.
    pub fn push(&self, keys: &[u64], values: &[T], lens: &[usize]) -> Result<Timestamp> {
        self.push_with(keys, values, lens, 0)
    }

    /// [`push`](Self::push) with a command id the server's handler sees.
    pub fn push_with(&self, keys: &[u64], values: &[T], lens: &[usize], cmd: i32) -> Result<Timestamp> {
        let lens = check_keys("push", keys, Some((values.len(), lens)))?;
        self.send(Kind::Push, keys, values, &lens, cmd, false, "push")
    }

    /// Asks for the values of `keys` (sorted, unique); [`wait`](Self::wait) returns them.
    pub fn pull(&self, keys: &[u64]) -> Result<Timestamp> {
        self.pull_with(keys, 0)
    }

    /// [`pull`](Self::pull) with a command id.
    pub fn pull_with(&self, keys: &[u64], cmd: i32) -> Result<Timestamp> {
        check_keys("pull", keys, None)?;
        self.send(Kind::Pull, keys, &[], &[], cmd, true, "pull")
    }

    /// Pushes, and gets back the values after the push (as the server's handler answers).
    pub fn push_pull(&self, keys: &[u64], values: &[T], lens: &[usize]) -> Result<Timestamp> {
        self.push_pull_with(keys, values, lens, 0)
    }

    /// [`push_pull`](Self::push_pull) with a command id.
    pub fn push_pull_with(&self, keys: &[u64], values: &[T], lens: &[usize], cmd: i32) -> Result<Timestamp> {
        let lens = check_keys("push_pull", keys, Some((values.len(), lens)))?;
        self.send(Kind::PushPull, keys, values, &lens, cmd, true, "push_pull")
    }

    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        kind: Kind,
        keys: &[u64],
        values: &[T],
        lens: &[usize],
        cmd: i32,
        wants_values: bool,
        what: &'static str,
    ) -> Result<Timestamp> {
        let sh = &self.sh;
        let servers = sh.cfg.servers;
        let mut parts: HashMap<usize, Vec<usize>> = HashMap::new();
        for (i, &k) in keys.iter().enumerate() {
            let s = sh.cfg.sharding.server_of(k, servers);
            if s >= servers {
                return Err(Error::invalid(format!("{what}: the sharding put key {k} on server {s} of {servers}")));
            }
            parts.entry(s).or_default().push(i);
        }
        // Every part must fit a message before any is sent.
        let carries = kind != Kind::Pull;
        for (s, idx) in &parts {
            let payload = if carries {
                idx.iter().try_fold(0usize, |a, &i| a.checked_add(lens[i])).and_then(|n| n.checked_mul(size_of::<T>()))
            } else {
                Some(0)
            };
            if let Some(size) = wire::oversize(idx.len(), if carries { idx.len() } else { 0 }, payload) {
                return Err(Error::invalid(format!(
                    "{what} of {} keys: the message to server {s} ({} of the keys) would be {size}, more \
                     than the {} bytes a parameter-server message may have (split the request)",
                    keys.len(),
                    idx.len(),
                    wire::MAX_MESSAGE
                )));
            }
        }
        let ts = timestamp_of(sh.next.fetch_add(1, Ordering::Relaxed), kind == Kind::Push);
        let replicate = sh.cfg.replication && servers > 1;
        let closed: HashMap<usize, Error> = lock(&sh.closed).clone();
        for s in parts.keys() {
            if let Some(e) = closed.get(s)
                && (!replicate || closed.contains_key(&backup_of(*s, servers)))
            {
                let ks: Vec<u64> = parts[s].iter().map(|&i| keys[i]).collect();
                return Err(server_gone(what, *s, &ks, e));
            }
        }
        let offsets: Vec<usize> = lens
            .iter()
            .scan(0usize, |at, &l| {
                let o = *at;
                *at += l;
                Some(o)
            })
            .collect();
        let pending = Pending {
            keys: keys.to_vec(),
            answers: Vec::new(),
            parts: parts.clone(),
            wants_values,
            deadline: Instant::now() + sh.cfg.timeout,
            what,
            outcome: if keys.is_empty() { Some(Ok(Reply::default())) } else { None },
            callback: None,
            stash: HashMap::new(),
            pulls: HashMap::new(),
        };
        if keys.is_empty() && kind == Kind::Push {
            // Done already, and a push's success is not kept (see `wait`).
            return Ok(ts);
        }
        lock(&sh.pending).insert(ts, pending);
        let mut failed: Vec<(usize, Error)> = Vec::new();
        for (s, idx) in parts {
            let ks: Vec<u64> = idx.iter().map(|&i| keys[i]).collect();
            let ls: Vec<usize> = if kind == Kind::Pull { Vec::new() } else { idx.iter().map(|&i| lens[i]).collect() };
            let msg = Message {
                kind,
                cmd,
                ts,
                shard: s as u32,
                keys: ks,
                lens: ls,
                values: Vec::new(),
                at: 0,
                dtype: T::DTYPE as u8,
            };
            // The values go straight from the caller's slice into the message.
            let extra =
                if kind == Kind::Pull { 0 } else { idx.iter().map(|&i| lens[i]).sum::<usize>() * size_of::<T>() };
            let mut bytes = std::mem::take(&mut *lock(&sh.scratch));
            msg.encode_head_into(&mut bytes, extra);
            if kind != Kind::Pull {
                for &i in &idx {
                    bytes.extend_from_slice(bytemuck::cast_slice(&values[offsets[i]..offsets[i] + lens[i]]));
                }
            }
            let primary_gone = closed.contains_key(&s);
            let b = backup_of(s, servers);
            if replicate
                && kind == Kind::Pull
                && !primary_gone
                && let Some(p) = lock(&sh.pending).get_mut(&ts)
            {
                p.pulls.insert(s, bytes.clone());
            }
            if !primary_gone && let Err(e) = sh.ctx.send(s, PS_TAG, &bytes) {
                failed.push((s, e));
            }
            // The backup gets every push (to keep its copy) and what its dead primary would.
            if replicate && (primary_gone || kind != Kind::Pull) && !closed.contains_key(&b) {
                let _ = sh.ctx.send(b, PS_TAG, &bytes);
            }
            let mut slot = lock(&sh.scratch);
            if slot.capacity() < bytes.capacity() {
                *slot = bytes;
            }
        }
        for (s, e) in failed {
            fail_server(sh, s, e);
        }
        Ok(ts)
    }

    /// Waits for request `ts` until its deadline ([`PsConfig::timeout`] after it was sent),
    /// then fails it with [`Error::Timeout`] naming the request, the servers that did not
    /// answer and their keys; a pull's values come back.
    ///
    /// A push that succeeded is not kept once acknowledged (so that pushes nobody waits for
    /// cost nothing): waiting for one returns an empty reply at once, also when it was already
    /// waited for or given to [`then`](Self::then). A push that failed is kept until waited for
    /// (or given to `then`), as is every pull; waiting for it again is an error.
    pub fn wait(&self, ts: Timestamp) -> Result<Reply<T>> {
        let sh = &self.sh;
        let mut p = lock(&sh.pending);
        loop {
            let Some(req) = p.get_mut(&ts) else {
                if self.is_issued_push(ts) {
                    return Ok(Reply::default());
                }
                return Err(Error::invalid(format!(
                    "worker {}: no request {ts} in flight (already waited for, or given a callback)",
                    sh.id
                )));
            };
            if req.outcome.is_some() {
                let out = p.remove(&ts).and_then(|r| r.outcome).unwrap_or_else(|| Err(Error::invalid("no outcome")));
                drop(p);
                spend(sh, ts, &out);
                return out;
            }
            let now = Instant::now();
            if now >= req.deadline {
                // The receiving thread fails late requests too; this wait does not depend on it.
                let e = overdue(ts, req, sh.cfg.timeout);
                p.remove(&ts);
                return Err(e);
            }
            let left = req.deadline - now;
            p = crate::sync::wait_timeout(&sh.done, p, left);
        }
    }

    /// The callback form: `f` gets the outcome of request `ts` on the worker's receiving thread
    /// (here and now if it is already there). Keep it short.
    ///
    /// A panic in `f` is caught: here, `then` returns it as [`Error::Panicked`] naming the
    /// request; on the receiving thread it is logged (`tracing`, error level) and the thread
    /// goes on with the other requests.
    pub fn then(&self, ts: Timestamp, f: impl FnOnce(Result<Reply<T>>) + Send + 'static) -> Result<()> {
        let id = self.sh.id;
        let mut p = lock(&self.sh.pending);
        let Some(req) = p.get_mut(&ts) else {
            drop(p);
            if self.is_issued_push(ts) {
                return run_callback(id, ts, "push", Box::new(f), Ok(Reply::default()));
            }
            return Err(Error::invalid(format!("worker {id}: no request {ts} in flight")));
        };
        if req.outcome.is_some() {
            let what = req.what;
            let out = p.remove(&ts).and_then(|r| r.outcome).unwrap_or_else(|| Err(Error::invalid("no outcome")));
            drop(p);
            spend(&self.sh, ts, &out);
            run_callback(id, ts, what, Box::new(f), out)
        } else {
            req.callback = Some(Box::new(f));
            Ok(())
        }
    }

    /// Whether `ts` is a push this worker sent that, once not in flight, succeeded (a failed
    /// one stays in flight until its failure is handed out, and is then remembered).
    fn is_issued_push(&self, ts: Timestamp) -> bool {
        let counter = ts >> 1;
        ts & 1 == 1
            && counter >= 1
            && counter < self.sh.next.load(Ordering::Relaxed)
            && !lock(&self.sh.spent_failures).contains(&ts)
    }

    /// Servers this worker knows to be gone: their connection closed, or (with heartbeats)
    /// nothing heard from them for three heartbeats.
    pub fn dead_servers(&self) -> Vec<usize> {
        let closed = lock(&self.sh.closed);
        let heard = lock(&self.sh.heard);
        let silent = |s: usize| self.sh.cfg.heartbeat.is_some_and(|h| heard[s].elapsed() > h * 3);
        (0..self.sh.cfg.servers).filter(|&s| closed.contains_key(&s) || silent(s)).collect()
    }
}

impl<T: Element> Drop for KvWorker<T> {
    fn drop(&mut self) {
        // Goodbye to every live server (their run ends when every worker has said it).
        let closed: HashSet<usize> = lock(&self.sh.closed).keys().copied().collect();
        let bye = Message::control(Kind::Bye).encode();
        for s in (0..self.sh.cfg.servers).filter(|s| !closed.contains(s)) {
            let _ = self.sh.ctx.send(s, PS_TAG, &bye);
        }
        self.sh.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The server that keeps a copy of server `s`'s state.
fn backup_of(s: usize, servers: usize) -> usize {
    (s + 1) % servers.max(1)
}

fn server_gone(what: &str, server: usize, keys: &[u64], cause: &Error) -> Error {
    let shown: Vec<u64> = keys.iter().copied().take(8).collect();
    let more = if keys.len() > 8 { format!(" and {} more", keys.len() - 8) } else { String::new() };
    Error::PeerClosed {
        rank: server,
        op: format!("parameter-server {what}"),
        detail: format!("server {server} is gone with keys {shown:?}{more} of this request outstanding ({cause})"),
    }
}

/// Completes request `ts` (the first outcome wins): runs its callback, or keeps the outcome
/// for `wait` (a push's success is not kept: waiting for it returns at once).
fn finish<T: Element>(sh: &WorkerShared<T>, ts: Timestamp, out: Result<Reply<T>>) {
    let cb = {
        let mut p = lock(&sh.pending);
        let Some(req) = p.get_mut(&ts) else { return };
        if req.outcome.is_some() {
            return;
        }
        match req.callback.take() {
            Some(cb) => {
                let what = req.what;
                p.remove(&ts);
                Some((cb, what, out))
            }
            None if out.is_ok() && !req.wants_values => {
                p.remove(&ts);
                None
            }
            None => {
                req.outcome = Some(out);
                None
            }
        }
    };
    match cb {
        Some((cb, what, out)) => {
            spend(sh, ts, &out);
            if let Err(e) = run_callback(sh.id, ts, what, cb, out) {
                tracing::error!(worker = sh.id, request = ts, error = %e, "parameter-server callback panicked");
            }
        }
        None => sh.done.notify_all(),
    }
}

/// Remembers a push's failure once handed out (see [`WorkerShared::spent_failures`]).
fn spend<T>(sh: &WorkerShared<T>, ts: Timestamp, out: &Result<Reply<T>>) {
    if ts & 1 == 1 && out.is_err() {
        lock(&sh.spent_failures).insert(ts);
    }
}

/// Runs request `ts`'s callback, catching a panic as [`Error::Panicked`].
fn run_callback<T>(worker: usize, ts: Timestamp, what: &str, cb: Callback<T>, out: Result<Reply<T>>) -> Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(out))).map_err(|p| Error::Panicked {
        what: format!("the callback of parameter-server {what} request {ts} on worker {worker}"),
        message: crate::engine::panic_message(&*p),
    })
}

/// The worker's receiving thread: replies, heartbeats, closed servers, deadlines.
fn receive_replies<T: Element>(sh: &WorkerShared<T>) {
    // One receive stays posted from slice to slice: a reply half read is not lost.
    let mut inbox = sh.ctx.comm().persistent_recv(PS_TAG, wire::MAX_MESSAGE, QUIET, PS_RECEIVE);
    while !sh.stop.load(Ordering::SeqCst) {
        let live: Vec<usize> = {
            let closed = lock(&sh.closed);
            (0..sh.cfg.servers).filter(|s| !closed.contains_key(s)).collect()
        };
        let got = if live.is_empty() {
            inbox.withdraw();
            std::thread::sleep(SLICE);
            None
        } else {
            inbox.wait(&live, Instant::now() + SLICE)
        };
        match got {
            Some(Ok((server, bytes))) => {
                if let Some(h) = lock(&sh.heard).get_mut(server) {
                    *h = Instant::now();
                }
                match Message::decode(bytes, server) {
                    Ok(m) => on_reply(sh, server, m),
                    Err(e) => fail_server(sh, server, e),
                }
            }
            // A quiet slice, or a reply that began arriving and stopped (dropped).
            None | Some(Err(Error::Timeout { .. })) => {}
            Some(Err(e)) => {
                // Which server: the error names it (a closed connection), else every live one
                // is suspect; the context itself is unusable then.
                let server = match &e {
                    Error::PeerClosed { rank, .. } | Error::PeerTimedOut { rank, .. } if *rank < sh.cfg.servers => {
                        Some(*rank)
                    }
                    _ => None,
                };
                match server {
                    Some(s) => fail_server(sh, s, e),
                    None => {
                        for s in live {
                            fail_server(sh, s, e.clone());
                        }
                    }
                }
            }
        }
        expire(sh);
    }
}

/// Marks `server` gone: requests waiting for it go to its backup (with replication, when the
/// backup lives) or fail naming it and their keys.
fn fail_server<T: Element>(sh: &WorkerShared<T>, server: usize, cause: Error) {
    let servers = sh.cfg.servers;
    let replicate = sh.cfg.replication && servers > 1;
    let closed: HashMap<usize, Error> = {
        let mut c = lock(&sh.closed);
        c.entry(server).or_insert(cause.clone());
        c.clone()
    };
    // The shards this server answered for: its own, and its dead primary's.
    let answered_by = |shard: usize| {
        if closed.contains_key(&shard) && replicate { backup_of(shard, servers) } else { shard }
    };
    let mut resend: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut stashed: Vec<(Timestamp, usize, Message)> = Vec::new();
    let mut doomed: Vec<(Timestamp, Vec<u64>, &'static str, usize)> = Vec::new();
    {
        let mut p = lock(&sh.pending);
        for (ts, req) in p.iter_mut().filter(|(_, r)| r.outcome.is_none()) {
            for (&shard, idx) in &req.parts {
                if answered_by(shard) != server && shard != server {
                    continue;
                }
                let b = backup_of(shard, servers);
                if replicate && shard == server && !closed.contains_key(&b) {
                    if let Some(m) = req.stash.remove(&shard) {
                        stashed.push((*ts, shard, m));
                    } else if let Some(bytes) = req.pulls.remove(&shard) {
                        resend.push((b, bytes));
                    }
                    // A push: the backup has it and answers.
                } else {
                    doomed.push((*ts, idx.iter().map(|&i| req.keys[i]).collect(), req.what, shard));
                }
            }
        }
    }
    for (b, bytes) in resend {
        if let Err(e) = sh.ctx.send(b, PS_TAG, &bytes) {
            tracing::debug!(server = b, error = %e, "asking a backup failed");
        }
    }
    for (ts, shard, m) in stashed {
        apply_part(sh, ts, shard, m);
    }
    for (ts, keys, what, shard) in doomed {
        finish(sh, ts, Err(server_gone(what, shard, &keys, &cause)));
    }
}

/// Request `ts`'s deadline passed: the error names it, the servers that did not answer and
/// their keys.
fn overdue<T>(ts: Timestamp, p: &Pending<T>, waited: Duration) -> Error {
    let mut servers: Vec<usize> = p.parts.keys().copied().collect();
    servers.sort_unstable();
    let mut keys: Vec<u64> = p.parts.values().flatten().filter_map(|&i| p.keys.get(i).copied()).collect();
    keys.sort_unstable();
    let more = if keys.len() > 8 { format!(" and {} more", keys.len() - 8) } else { String::new() };
    keys.truncate(8);
    Error::Timeout {
        op: format!(
            "parameter-server {} request {ts} (server(s) {servers:?} did not answer for keys {keys:?}{more})",
            p.what
        ),
        ranks: servers,
        keys: Vec::new(),
        waited,
    }
}

/// Fails requests past their deadline, naming the servers and keys still outstanding.
fn expire<T: Element>(sh: &WorkerShared<T>) {
    let now = Instant::now();
    let late: Vec<(Timestamp, Error)> = lock(&sh.pending)
        .iter()
        .filter(|(_, p)| p.outcome.is_none() && p.deadline <= now)
        .map(|(ts, p)| (*ts, overdue(*ts, p, sh.cfg.timeout)))
        .collect();
    for (ts, e) in late {
        finish(sh, ts, Err(e));
    }
}

fn on_reply<T: Element>(sh: &WorkerShared<T>, server: usize, m: Message) {
    match m.kind {
        Kind::Heartbeat => return,
        Kind::Reply | Kind::Error => {}
        other => {
            fail_server(
                sh,
                server,
                Error::Protocol { peer: Some(server), detail: format!("a {other:?} message to a worker") },
            );
            return;
        }
    }
    let shard = m.shard as usize;
    if shard != server {
        // A backup's answer: it counts once the primary is gone, until then it waits.
        if !sh.cfg.replication || shard >= sh.cfg.servers || backup_of(shard, sh.cfg.servers) != server {
            fail_server(
                sh,
                server,
                Error::Protocol { peer: Some(server), detail: format!("an answer for server {shard}'s keys") },
            );
            return;
        }
        if !lock(&sh.closed).contains_key(&shard) {
            let mut p = lock(&sh.pending);
            if let Some(req) = p.get_mut(&m.ts).filter(|r| r.outcome.is_none() && r.parts.contains_key(&shard)) {
                req.stash.insert(shard, m);
                return;
            }
            return;
        }
    }
    apply_part(sh, m.ts, shard, m);
}

/// Takes the answer `m` for `shard`'s part of request `ts`; completes the request when it was
/// the last part.
fn apply_part<T: Element>(sh: &WorkerShared<T>, ts: Timestamp, shard: usize, m: Message) {
    let server = shard;
    let outcome = {
        let mut p = lock(&sh.pending);
        let Some(req) = p.get_mut(&ts) else { return };
        if req.outcome.is_some() {
            return;
        }
        let Some(idx) = req.parts.remove(&shard) else { return };
        req.pulls.remove(&shard);
        req.stash.remove(&shard);
        if m.kind == Kind::Error {
            let text = String::from_utf8_lossy(m.payload()).into_owned();
            Some(Err(Error::Aborted {
                rank: server,
                reason: format!("server {server} refused the {}: {text}", req.what),
            }))
        } else if req.wants_values {
            let size = std::mem::size_of::<T>().max(1);
            let fits = m.keys.len() == idx.len()
                && m.lens.len() == idx.len()
                && m.keys.iter().zip(&idx).all(|(k, &i)| *k == req.keys[i])
                && m.lens.iter().try_fold(0usize, |a, &l| a.checked_add(l)).and_then(|n| n.checked_mul(size))
                    == Some(m.payload().len());
            if !fits {
                Some(Err(Error::Protocol {
                    peer: Some(server),
                    detail: format!("server {server} answered the {} with other keys or lengths", req.what),
                }))
            } else {
                req.answers.push((idx, m));
                None
            }
        } else {
            None
        }
        .or_else(|| req.parts.is_empty().then(|| Ok(assemble(req))))
    };
    if let Some(out) = outcome {
        finish(sh, ts, out);
    }
}

/// The reply of a request whose every part has been answered: the values in key order, read
/// once from the answers' buffers into one allocation.
fn assemble<T: Element>(req: &mut Pending<T>) -> Reply<T> {
    if !req.wants_values {
        return Reply::default();
    }
    let n = req.keys.len();
    let mut reply = Reply { keys: req.keys.clone(), ..Reply::default() };
    let answers = std::mem::take(&mut req.answers);
    let typed: Vec<std::borrow::Cow<'_, [T]>> = answers
        .iter()
        .map(|(_, m)| match bytemuck::try_cast_slice::<u8, T>(m.payload()) {
            Ok(v) => std::borrow::Cow::Borrowed(v),
            Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(m.payload())),
        })
        .collect();
    let mut lens = vec![0usize; n];
    let mut from = vec![(0usize, 0usize); n];
    for (a, (idx, m)) in answers.iter().enumerate() {
        let mut at = 0;
        for (&i, &l) in idx.iter().zip(&m.lens) {
            if let (Some(len), Some(f)) = (lens.get_mut(i), from.get_mut(i)) {
                *len = l;
                *f = (a, at);
            }
            at += l;
        }
    }
    reply.values.reserve(lens.iter().sum());
    for (i, &l) in lens.iter().enumerate() {
        let (a, at) = from[i];
        if let Some(v) = typed.get(a).and_then(|t| t.get(at..at + l)) {
            reply.values.extend_from_slice(v);
        }
    }
    reply.lens = lens;
    reply
}

/// A request as a server's handler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request<T> {
    /// Who sent it, and how to answer.
    pub meta: RequestMeta,
    /// The keys (sorted, unique), this server's share of them.
    pub keys: Vec<u64>,
    /// The pushed values, concatenated (empty for a pull).
    pub values: Vec<T>,
    /// Each key's number of values (empty for a pull).
    pub lens: Vec<usize>,
}

/// Who sent a request and what it asks; [`Responder::respond`] answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestMeta {
    /// The worker's number.
    pub worker: usize,
    /// The caller's command id.
    pub cmd: i32,
    /// The request's timestamp (the worker's).
    pub timestamp: Timestamp,
    /// Whether it carries values.
    pub push: bool,
    /// Whether it wants values back.
    pub pull: bool,
    /// The server whose keys these are: this one, or (with replication) the dead or living
    /// primary this server keeps a copy for.
    pub shard: usize,
}

/// How a handler answers, now or later.
///
/// A worker that cannot be reached any more (its connection failed, or a send to it timed
/// out) counts as gone: the answer is dropped, the call returns `Ok`, and the server tells the
/// handler ([`Handler::worker_left`]) once the handler's call returns.
pub struct Responder<T> {
    ctx: Arc<Context>,
    servers: usize,
    workers: usize,
    scratch: Mutex<Vec<u8>>,
    /// Workers that rejoined: the context and rank they are reached at now.
    routes: Mutex<HashMap<usize, (Arc<Context>, usize)>>,
    /// Workers a send to failed, and why: the server counts them gone.
    unreachable: Mutex<Vec<(usize, Error)>>,
    _t: PhantomData<fn(T)>,
}

impl<T: Element> Responder<T> {
    /// Answers a request: for a push, with nothing (`keys` empty); for a pull, with the values
    /// of the keys asked for, in their order. An answer larger than a parameter-server message
    /// may be is not sent: the worker's request fails with an error naming both sizes.
    pub fn respond(&self, meta: &RequestMeta, keys: &[u64], values: &[T], lens: &[usize]) -> Result<()> {
        self.send_reply(meta, keys, lens.to_vec(), &[values])
    }

    /// [`respond`](Self::respond) with each key's values as a slice of its own (no gathering
    /// copy before the message is written).
    pub fn respond_parts(&self, meta: &RequestMeta, keys: &[u64], parts: &[&[T]]) -> Result<()> {
        self.send_reply(meta, keys, parts.iter().map(|p| p.len()).collect(), parts)
    }

    /// Sends to worker `worker`; a failed send makes the worker unreachable, not an error.
    fn send_to(&self, worker: usize, bytes: &[u8]) -> Result<()> {
        if worker >= self.workers {
            return Err(Error::invalid(format!("an answer to worker {worker} of {}: no such worker", self.workers)));
        }
        let route = lock(&self.routes).get(&worker).cloned();
        let sent = match route {
            Some((ctx, rank)) => ctx.send(rank, PS_TAG, bytes),
            None => self.ctx.send(self.servers + worker, PS_TAG, bytes),
        };
        if let Err(e) = sent {
            tracing::debug!(worker, error = %e, "a parameter-server answer could not be sent; the worker counts as gone");
            lock(&self.unreachable).push((worker, e));
        }
        Ok(())
    }

    fn send_reply(&self, meta: &RequestMeta, keys: &[u64], lens: Vec<usize>, parts: &[&[T]]) -> Result<()> {
        let total = parts.iter().try_fold(0usize, |a, p| a.checked_add(std::mem::size_of_val(*p)));
        if let Some(size) = wire::oversize(keys.len(), lens.len(), total) {
            let reason = format!(
                "the answer for {} keys would be {size}, more than the {} bytes a parameter-server message \
                 may have",
                keys.len(),
                wire::MAX_MESSAGE
            );
            tracing::warn!(worker = meta.worker, request = meta.timestamp, "{reason}");
            return self.refuse(meta, &reason);
        }
        let msg = Message {
            kind: Kind::Reply,
            cmd: meta.cmd,
            ts: meta.timestamp,
            shard: meta.shard as u32,
            keys: keys.to_vec(),
            lens,
            values: Vec::new(),
            at: 0,
            dtype: T::DTYPE as u8,
        };
        let mut bytes = std::mem::take(&mut *lock(&self.scratch));
        msg.encode_head_into(&mut bytes, total.unwrap_or(0));
        for p in parts {
            bytes.extend_from_slice(bytemuck::cast_slice(p));
        }
        let sent = self.send_to(meta.worker, &bytes);
        let mut slot = lock(&self.scratch);
        if slot.capacity() < bytes.capacity() {
            *slot = bytes;
        }
        sent
    }

    /// Refuses a request: the worker's wait fails with `reason`.
    pub fn refuse(&self, meta: &RequestMeta, reason: &str) -> Result<()> {
        let msg = Message {
            kind: Kind::Error,
            cmd: meta.cmd,
            ts: meta.timestamp,
            shard: meta.shard as u32,
            keys: Vec::new(),
            lens: Vec::new(),
            values: reason.as_bytes().to_vec(),
            at: 0,
            dtype: 0,
        };
        self.send_to(meta.worker, &msg.encode())
    }

    /// The workers found unreachable since the last call.
    fn take_unreachable(&self) -> Vec<(usize, Error)> {
        std::mem::take(&mut *lock(&self.unreachable))
    }
}

/// What a server does with requests.
pub trait Handler<T: Element>: Send {
    /// Handles one request; answers it through `responder` now or later (every request must
    /// be answered once, or its worker fails it at the deadline). The server checks requests
    /// before they get here (sorted unique keys, lengths that add up to the values, no values
    /// in a pull) and refuses those that fail.
    fn handle(&mut self, request: Request<T>, responder: &Responder<T>) -> Result<()>;

    /// Worker `worker` is gone (it said goodbye, its connection closed, or an answer to it
    /// could not be sent): a handler that waits for every worker (synchronous SGD) stops
    /// waiting for it.
    fn worker_left(&mut self, worker: usize, responder: &Responder<T>) -> Result<()> {
        let _ = (worker, responder);
        Ok(())
    }

    /// Worker `worker`, which had left, rejoined ([`Node::rejoin`]).
    fn worker_joined(&mut self, worker: usize, responder: &Responder<T>) -> Result<()> {
        let _ = (worker, responder);
        Ok(())
    }
}

/// A server: runs its handler on the requests until every worker has left.
pub struct KvServer<T: Element, H: Handler<T> + Clone> {
    node: Node,
    handler: H,
    _t: PhantomData<fn(T)>,
}

impl<T: Element, H: Handler<T> + Clone> KvServer<T, H> {
    /// Serves until every worker has said goodbye or gone; returns the handler's first error,
    /// or the error that made the server's own context unusable.
    ///
    /// What one worker does wrong or suffers ends nothing but that worker's part: a malformed
    /// request is refused (the worker's wait fails with why), a message that is not a request
    /// or does not fit a message is logged (`tracing`) and skipped, and a worker whose
    /// connection fails, or that an answer cannot reach, counts as gone. A worker that fails
    /// to rejoin is logged and waited for until its [`PsConfig::rejoin_wait`] ends.
    pub fn run(self) -> Result<()> {
        let (servers, workers) = (self.node.cfg.servers, self.node.cfg.workers);
        let ctx = self.node.ctx.clone();
        let responder = Responder {
            ctx: ctx.clone(),
            servers,
            workers,
            scratch: Mutex::new(Vec::new()),
            routes: Mutex::new(HashMap::new()),
            unreachable: Mutex::new(Vec::new()),
            _t: PhantomData,
        };
        // The copy of the shard this server backs up exists from the start, so that it sees
        // every worker leave and join, as the shard's own handler does (made at its first
        // request, it waited in synchronous rounds for workers gone before).
        let mut replicas = HashMap::new();
        if self.node.cfg.replication && servers > 1 {
            let backed = (0..servers).filter(|&s| s != self.node.id && backup_of(s, servers) == self.node.id);
            replicas.extend(backed.map(|s| (s, self.handler.clone())));
        }
        let mut serving = Serving {
            links: vec![Link {
                inbox: ctx.comm().persistent_recv(PS_TAG, wire::MAX_MESSAGE, QUIET, PS_RECEIVE),
                ctx,
                workers: (0..workers).map(|w| (servers + w, w)).collect(),
            }],
            node: self.node,
            handler: self.handler,
            responder,
            dead: HashMap::new(),
            generations: HashMap::new(),
            rejoining: HashMap::new(),
            store_failing: false,
            replicas,
        };
        serving.run()
    }
}

/// A context the server reaches workers through: the job's, or a rejoined worker's own.
struct Link {
    ctx: Arc<Context>,
    /// Its live workers: rank in `ctx` → worker number.
    workers: HashMap<usize, usize>,
    /// The receive from them, posted from one slice to the next.
    inbox: PersistentRecv,
}

/// A server's state while it runs.
struct Serving<T: Element, H: Handler<T> + Clone> {
    node: Node,
    handler: H,
    responder: Responder<T>,
    links: Vec<Link>,
    /// Workers whose process died, waited for until the deadline (rejoin).
    dead: HashMap<usize, Instant>,
    /// The next generation each dead worker may come back as.
    generations: HashMap<usize, i64>,
    /// Rejoins being met (a context forming in the background).
    rejoining: HashMap<usize, JoinHandle<Result<Context>>>,
    /// Whether the last look at the store for rejoins failed (said once, not at every look).
    store_failing: bool,
    /// The copy of the shard this server backs up (with replication), made from the handler
    /// as it started.
    replicas: HashMap<usize, H>,
}

impl<T: Element, H: Handler<T> + Clone> Serving<T, H> {
    fn run(&mut self) -> Result<()> {
        let beat = self.node.cfg.heartbeat;
        let mut last_beat = Instant::now();
        let mut last_look = Instant::now();
        let heartbeat = Message::control(Kind::Heartbeat).encode();
        let mut turn = 0usize;
        while self.links.iter().any(|l| !l.workers.is_empty()) || !self.dead.is_empty() || !self.rejoining.is_empty() {
            if let Some(b) = beat
                && last_beat.elapsed() >= b
            {
                last_beat = Instant::now();
                for link in &self.links {
                    for (&r, &w) in &link.workers {
                        if let Err(e) = link.ctx.send(r, PS_TAG, &heartbeat) {
                            lock(&self.responder.unreachable).push((w, e));
                        }
                    }
                }
                self.settle()?;
            }
            if (!self.dead.is_empty() || !self.rejoining.is_empty()) && last_look.elapsed() >= SLICE {
                last_look = Instant::now();
                self.look_for_rejoins()?;
            }
            let active: Vec<usize> = (0..self.links.len()).filter(|&i| !self.links[i].workers.is_empty()).collect();
            if active.is_empty() {
                // Only workers that may rejoin are left: look for them again shortly.
                std::thread::sleep(SLICE.min(Duration::from_millis(20)));
                continue;
            }
            // Every link with workers at once; the first to answer is served, and the turn
            // rotates which one comes first when several have a message waiting.
            turn = (turn + 1) % active.len();
            let order: Vec<usize> = active[turn..].iter().chain(&active[..turn]).copied().collect();
            let mut slice = beat.map_or(SLICE, |b| b.min(SLICE));
            if !self.dead.is_empty() || !self.rejoining.is_empty() {
                slice = slice.min(Duration::from_millis(2));
            }
            let ranks: Vec<Vec<usize>> = order
                .iter()
                .map(|&li| {
                    let mut r: Vec<usize> = self.links[li].workers.keys().copied().collect();
                    r.sort_unstable();
                    r
                })
                .collect();
            let from: Vec<&[usize]> = ranks.iter().map(Vec::as_slice).collect();
            let mut inboxes: Vec<Option<&mut PersistentRecv>> =
                self.links.iter_mut().map(|l| Some(&mut l.inbox)).collect();
            let mut recvs: Vec<&mut PersistentRecv> = order.iter().filter_map(|&li| inboxes[li].take()).collect();
            let got = wait_any(&mut recvs, &from, Instant::now() + slice);
            drop(recvs);
            if let Some((k, got)) = got {
                self.take(order[k], got)?;
            }
            self.settle()?;
        }
        Ok(())
    }

    /// What the receive on link `li` gave.
    fn take(&mut self, li: usize, got: Result<(usize, Vec<u8>)>) -> Result<()> {
        let id = self.node.id;
        let worker_at = |rank: usize| self.links[li].workers.get(&rank).copied();
        match got {
            Ok((rank, bytes)) => {
                let Some(w) = worker_at(rank) else {
                    tracing::debug!(server = id, rank, "a message from a worker that has left; skipped");
                    return Ok(());
                };
                match Message::decode(bytes, rank) {
                    Err(e) => {
                        tracing::warn!(server = id, worker = w, error = %e, "an undecodable message; skipped");
                        Ok(())
                    }
                    Ok(m) => match m.kind {
                        Kind::Bye => self.depart(w, false),
                        Kind::Push | Kind::Pull | Kind::PushPull => self.serve_one(m, w),
                        other => {
                            tracing::warn!(server = id, worker = w, "a {other:?} message to a server; skipped");
                            Ok(())
                        }
                    },
                }
            }
            Err(Error::Timeout { .. }) => Ok(()),
            Err(Error::Mismatch { rank, detail }) if worker_at(rank).is_some() => {
                // The pair reads past the message and goes on: only that message is lost.
                tracing::warn!(server = id, worker = worker_at(rank), "{detail}; skipped");
                Ok(())
            }
            Err(e) => match e.rank().and_then(worker_at) {
                Some(w) => {
                    tracing::debug!(server = id, worker = w, error = %e, "a worker's connection failed");
                    self.depart(w, true)
                }
                None if li > 0 => {
                    // A rejoined worker's own context failed: that worker is gone again.
                    tracing::debug!(server = id, error = %e, "a rejoined worker's context failed");
                    let gone: Vec<usize> = self.links[li].workers.values().copied().collect();
                    gone.into_iter().try_for_each(|w| self.depart(w, true))
                }
                None if e.rank().is_some_and(|r| r != self.links[li].ctx.rank()) => {
                    tracing::debug!(server = id, error = %e, "an error from a rank that is no live worker; ignored");
                    Ok(())
                }
                None => Err(e),
            },
        }
    }

    /// Worker `w` is gone (`died`: without a goodbye, so it may rejoin).
    fn depart(&mut self, w: usize, died: bool) -> Result<()> {
        let Some(li) = self.links.iter().position(|l| l.workers.values().any(|&x| x == w)) else {
            return Ok(()); // gone already
        };
        let link = &mut self.links[li];
        link.workers.retain(|_, x| *x != w);
        if link.workers.is_empty() {
            if li > 0 {
                // A rejoined worker's own context: nothing more comes through it.
                self.links.remove(li);
            } else {
                link.inbox.withdraw();
            }
        }
        lock(&self.responder.routes).remove(&w);
        if died
            && self.node.store.is_some()
            && let Some(wait) = self.node.cfg.rejoin_wait
        {
            self.dead.insert(w, Instant::now() + wait);
        }
        self.handler.worker_left(w, &self.responder)?;
        for r in self.replicas.values_mut() {
            r.worker_left(w, &self.responder)?;
        }
        Ok(())
    }

    /// Counts the workers that answers could not reach as gone (which may make more answers
    /// go out, and fail).
    fn settle(&mut self) -> Result<()> {
        loop {
            let gone = self.responder.take_unreachable();
            if gone.is_empty() {
                return Ok(());
            }
            for (w, e) in gone {
                tracing::debug!(server = self.node.id, worker = w, error = %e, "a worker cannot be reached");
                self.depart(w, true)?;
            }
        }
    }

    /// Starts meeting dead workers that announced a rejoin in the store, and takes in those met.
    fn look_for_rejoins(&mut self) -> Result<()> {
        let now = Instant::now();
        self.dead.retain(|_, until| now < *until);
        let id = self.node.id;
        let met: Vec<usize> = self.rejoining.iter().filter(|(_, h)| h.is_finished()).map(|(&w, _)| w).collect();
        for w in met {
            let Some(h) = self.rejoining.remove(&w) else { continue };
            match h.join() {
                Ok(Ok(ctx)) => self.admit(w, Arc::new(ctx))?,
                Ok(Err(e)) => tracing::warn!(server = id, worker = w, error = %e, "a rejoining worker did not connect"),
                Err(p) => tracing::warn!(
                    server = id,
                    worker = w,
                    "the thread meeting a rejoining worker panicked: {}",
                    crate::engine::panic_message(&*p)
                ),
            }
        }
        let Some(store) = self.node.store.clone() else { return Ok(()) };
        let waiting: Vec<usize> = self.dead.keys().copied().filter(|w| !self.rejoining.contains_key(w)).collect();
        for w in waiting {
            let g = self.generations.entry(w).or_insert(0);
            match store.try_get(&format!("{REJOIN}/{w}/{g}")) {
                Ok(found) => {
                    self.store_failing = false;
                    if found.is_none() {
                        continue;
                    }
                }
                Err(e) => {
                    if !std::mem::replace(&mut self.store_failing, true) {
                        tracing::warn!(server = id, worker = w, error = %e, "reading the store for rejoins failed");
                    }
                    continue;
                }
            }
            let prefixed = crate::rendezvous::PrefixStore::new(format!("{REJOIN}/{w}/{g}/"), store.clone());
            *g += 1;
            let (cfg, device) = (self.node.cfg.clone(), self.node.ctx.device().clone());
            let meet = std::thread::Builder::new().name(format!("ferrogloo-ps-rejoin-{w}")).spawn(move || {
                Context::builder(id, cfg.servers + 1).timeout(cfg.timeout).connect(&prefixed, &device).map_err(|e| {
                    match e {
                        // Rank `servers` of this context is the worker (not worker 0).
                        Error::Timeout { op, ranks, keys, waited } => Error::Timeout {
                            op: format!("parameter-server server {id} meeting rejoining worker {w}: {op}"),
                            ranks,
                            keys,
                            waited,
                        },
                        other => other,
                    }
                })
            });
            match meet {
                Ok(h) => {
                    self.rejoining.insert(w, h);
                }
                Err(e) => {
                    tracing::warn!(server = id, worker = w, error = %e, "cannot start meeting a rejoining worker")
                }
            }
        }
        Ok(())
    }

    /// Worker `w` rejoined in its own context `ctx`.
    fn admit(&mut self, w: usize, ctx: Arc<Context>) -> Result<()> {
        let rank = self.node.cfg.servers;
        self.dead.remove(&w);
        lock(&self.responder.routes).insert(w, (ctx.clone(), rank));
        self.links.push(Link {
            inbox: ctx.comm().persistent_recv(PS_TAG, wire::MAX_MESSAGE, QUIET, PS_RECEIVE),
            ctx,
            workers: HashMap::from([(rank, w)]),
        });
        self.handler.worker_joined(w, &self.responder)?;
        for r in self.replicas.values_mut() {
            r.worker_joined(w, &self.responder)?;
        }
        Ok(())
    }

    /// Hands one request to the handler (or the backup copy it is for), or refuses it.
    fn serve_one(&mut self, m: Message, worker: usize) -> Result<()> {
        let responder = &self.responder;
        let meta = meta_of(&m, worker);
        if m.dtype != T::DTYPE as u8 {
            return responder.refuse(
                &meta,
                &format!("this server holds {} values, the request has type code {}", T::DTYPE, m.dtype),
            );
        }
        let size = size_of::<T>().max(1);
        if !m.payload().len().is_multiple_of(size) {
            return responder.refuse(
                &meta,
                &format!(
                    "the request's values are {} bytes, not a whole number of {size}-byte values",
                    m.payload().len()
                ),
            );
        }
        let values: Vec<T> = match bytemuck::try_cast_slice::<u8, T>(m.payload()) {
            Ok(v) => v.to_vec(),
            Err(_) => bytemuck::pod_collect_to_vec(m.payload()),
        };
        let req = Request { meta, keys: m.keys, values, lens: m.lens };
        let me = self.node.id;
        if let Err(e) = check_request(&req) {
            responder.refuse(&meta, &e.to_string())
        } else if meta.shard == me {
            self.handler.handle(req, responder)
        } else if let Some(replica) = self.replicas.get_mut(&meta.shard) {
            replica.handle(req, responder)
        } else {
            responder.refuse(&meta, &format!("server {me} does not hold server {}'s keys", meta.shard))
        }
    }
}

fn meta_of(m: &Message, worker: usize) -> RequestMeta {
    RequestMeta {
        worker,
        cmd: m.cmd,
        timestamp: m.ts,
        push: matches!(m.kind, Kind::Push | Kind::PushPull),
        pull: matches!(m.kind, Kind::Pull | Kind::PushPull),
        shard: m.shard as usize,
    }
}

/// A request's keys, lengths and values hold together (a worker checks them before sending;
/// this is for requests that did not come from one): keys sorted and unique, a push's
/// lengths one per key and adding up to its values, a pull with neither.
pub(crate) fn check_request<T>(r: &Request<T>) -> Result<()> {
    let what = match (r.meta.push, r.meta.pull) {
        (true, true) => "push_pull",
        (true, false) => "push",
        _ => "pull",
    };
    let refused =
        |why: String| Error::invalid(format!("{what} request {} of worker {}: {why}", r.meta.timestamp, r.meta.worker));
    if !r.meta.push {
        check_keys(what, &r.keys, None)?;
        if !r.lens.is_empty() || !r.values.is_empty() {
            return Err(refused(format!(
                "a pull carries no values, this one has {} values and {} lengths",
                r.values.len(),
                r.lens.len()
            )));
        }
        return Ok(());
    }
    if r.lens.len() != r.keys.len() {
        return Err(refused(format!("{} lengths for {} keys", r.lens.len(), r.keys.len())));
    }
    check_keys(what, &r.keys, Some((r.values.len(), &r.lens))).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::HashStore;

    #[test]
    fn pushes_nobody_waits_for_are_forgotten_once_acknowledged() -> Result<()> {
        let store = HashStore::new();
        let cfg = PsConfig::new(1, 1);
        std::thread::scope(|s| {
            let server = s.spawn(|| {
                let node = Node::connect(&store, &Device::in_process(), Role::Server, 0, cfg.clone())?;
                node.server(SumStore::<f32>::default())?.run()
            });
            let w = Node::connect(&store, &Device::in_process(), Role::Worker, 0, cfg.clone())?.worker::<f32>()?;
            let first = w.push(&[1], &[1.0], &[])?;
            for _ in 0..99 {
                w.push(&[1], &[1.0], &[])?;
            }
            // One server answers in order: the pull's answer comes after every acknowledgement.
            assert_eq!(w.wait(w.pull(&[1])?)?.values, [100.0]);
            assert_eq!(lock(&w.sh.pending).len(), 0, "requests kept after their answers");
            // Waiting for an acknowledged push still works.
            assert_eq!(w.wait(first)?, Reply::default());
            assert!(w.wait(first + 1).is_err(), "a pull that was never sent");
            // A push that failed (refused: key 1 holds one value) fails each time it is waited
            // for, not only the first.
            let bad = w.push(&[1], &[1.0, 2.0], &[])?;
            let first_wait = w.wait(bad).map_err(|e| e.to_string());
            assert!(first_wait.as_ref().is_err_and(|e| e.contains("key 1 holds 1 values")), "{first_wait:?}");
            assert!(w.wait(bad).is_err(), "a failed push waited for again");
            drop(w);
            server.join().expect("server thread")
        })
    }
}
