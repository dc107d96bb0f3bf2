//! The [`Engine`]: submissions from any thread, checked and queued for the background thread.

use super::config::EngineConfig;
use super::drive::Driver;
use super::handle::{Drive, Handle, Output, Payload, Promise, rank_of, tensor_of, unit_of};
use super::meta::{Kind, Meta};
use super::shared::{EngineState, EngineStats, Queue, Submission, TimelineCommand, Turn};
use super::stall::StallReport;
use super::tensor::{AllreduceOptions, Compression, Tensor, fmt_shape};
use super::{CONTROL_TAG, background, timeline, wire};
use crate::error::{Error, Result};
use crate::types::{DType, Element, Reduction};
use crate::{Context, sync::lock};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use smallvec::SmallVec;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

/// Named asynchronous collectives over a [`Context`]; see the [module documentation](crate::engine).
///
/// Submit from any thread. Dropping the engine (or [`shutdown`](Self::shutdown)) stops it on
/// every rank: the others' pending and later submissions fail with [`Error::Aborted`] naming
/// this rank.
pub struct Engine {
    shared: Arc<EngineState>,
    /// The engine's loop: run by its background thread, or by a caller waiting on a handle.
    driver: Arc<Driver>,
    ctx: Arc<Context>,
    thread: Option<JoinHandle<()>>,
    /// Its configuration, for [`recover`](Engine::recover).
    config: EngineConfig,
    /// Whether the ranks agree by reduction ([`agrees_by_reduction`](Engine::agrees_by_reduction)).
    tree: bool,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("rank", &self.ctx.rank()).field("size", &self.ctx.size()).finish()
    }
}

impl Engine {
    /// Starts an engine over `ctx` (the engine owns the context's traffic from now
    /// on: make no other calls on it). A process set is an engine over a sub-group made with
    /// [`Context::split`] or [`Context::subgroup`].
    pub fn new(ctx: Context, config: EngineConfig) -> Result<Engine> {
        let ctx = Arc::new(ctx);
        let shared = Arc::new(EngineState {
            queue: Mutex::new(Queue::default()),
            arrived: Condvar::new(),
            wake_pending: AtomicBool::new(false),
            on_inbox: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            turn: Mutex::new(Turn::default()),
            turn_changed: Condvar::new(),
            failed: Mutex::new(None),
            inflight: Mutex::new(HashSet::default()),
            stats: Mutex::new(EngineStats::default()),
            stalls: Mutex::new(Vec::new()),
            barriers: AtomicU64::new(0),
            groups: Mutex::new(HashMap::default()),
            joined: AtomicBool::new(false),
            epoch: Instant::now(),
        });
        // Fusion decides the sequence of collectives, and the area setting how the cycles'
        // states travel: every rank must use the same.
        let area = background::exchange_area_of(&ctx, &config);
        // How the cycles' states travel: 0 each rank to every other, 1 through the area, 2 by
        // reduction, 3 to be measured (by every rank together, once all agree to).
        let how = match (&area, config.tree_for(ctx.size())) {
            (Some(_), _) => 1,
            (None, Some(false)) => 0,
            (None, Some(true)) => 2,
            (None, None) => 3,
        };
        let mine = [config.fusion_threshold as u64, config.fusion_max_tensor as u64, how];
        let mut all = vec![0u64; 3 * ctx.size()];
        ctx.allgather(&mine, &mut all, &crate::CollectiveOptions::default())?;
        if let Some(r) = (0..ctx.size()).find(|&r| all[3 * r..3 * r + 2] != mine[..2]) {
            let w = |r: usize| ctx.world_rank(r).unwrap_or(r);
            return Err(Error::Mismatch {
                rank: w(r),
                detail: format!(
                    "engine: rank {} has a fusion threshold of {} bytes and fuses tensors up to {} bytes, rank {} {} and {} \
                     (set HOROVOD_FUSION_THRESHOLD and FERROGLOO_FUSION_MAX_TENSOR alike everywhere)",
                    w(r),
                    all[3 * r],
                    all[3 * r + 1],
                    w(ctx.rank()),
                    mine[0],
                    mine[1]
                ),
            });
        }
        if let Some(r) = (0..ctx.size()).find(|&r| all[3 * r + 2] != mine[2]) {
            let w = |r: usize| ctx.world_rank(r).unwrap_or(r);
            let say = |how: u64| match how {
                1 => "through the shared-memory area",
                2 => "over the pairs by reduction",
                3 => "over the pairs, by reduction or not as measured",
                _ => "over the pairs, each rank to every other",
            };
            return Err(Error::Mismatch {
                rank: w(r),
                detail: format!(
                    "engine: rank {} negotiates {}, rank {} {} (set FERROGLOO_ENGINE_AREA and FERROGLOO_ENGINE_TREE_FROM \
                     alike everywhere; with the area on, the ranks of a host that do not all share its shared-memory \
                     area go over the pairs)",
                    w(r),
                    say(all[3 * r + 2]),
                    w(ctx.rank()),
                    say(mine[2])
                ),
            });
        }
        let tree = match how {
            2 => true,
            3 => {
                let words = config.cache_capacity.div_ceil(64).clamp(1, 1 << 14);
                // A rank whose measurement fails tells the others (they would wait for its
                // messages until their deadline).
                let probe = super::agree::measure(&ctx, words).inspect_err(|e| ctx.comm().fail(e))?;
                tracing::debug!(
                    rank = ctx.rank(),
                    size = ctx.size(),
                    ?probe,
                    "engine: an agreement each rank to every other against one by reduction"
                );
                // Clearly faster, or not at all: the direct exchange also carries small
                // tensors, which the measurement does not count. (Every rank holds the same
                // figures.)
                probe.reduced.as_secs_f64() < 0.8 * probe.direct.as_secs_f64()
            }
            _ => false,
        };
        let world = ctx.world_rank(ctx.rank()).unwrap_or(ctx.rank());
        let timeline = match &config.timeline {
            Some(p) if config.timeline_all_ranks => Some(timeline::rank_path(p, world)),
            Some(p) if ctx.rank() == 0 => Some(p.clone()),
            _ => None,
        };
        let core = background::Core::new(ctx.clone(), shared.clone(), config.clone(), timeline, area, tree)?;
        let driver = Driver::new(core, shared.clone());
        let d = driver.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ferrogloo-engine-{}", ctx.rank()))
            .spawn(move || d.background())
            .map_err(|e| Error::io("starting the engine's thread", e))?;
        Ok(Engine { shared, driver, ctx, thread: Some(thread), config, tree })
    }

    /// Goes on after a failure, without the ranks that failed: stops this engine (revoking its
    /// context, if it has not failed already, so that every member's engine stops too), lets
    /// the live members [`shrink`](Context::shrink) its context, and starts a new engine with
    /// the same configuration on the shrunk one. Submissions pending in the old engine have
    /// failed with its cause; the new engine starts with an empty response cache. Every live
    /// member calls it; ranks are renumbered as the shrunk context says ([`rank`](Self::rank),
    /// [`size`](Self::size)).
    ///
    /// Errors: those of [`Context::shrink`] (a member that does not recover in time, a minority
    /// of survivors), and of starting an engine.
    pub fn recover(&mut self) -> Result<()> {
        if self.error().is_none() {
            self.ctx.revoke("the engine recovers");
        }
        // The thread ends once it sees the revoked context (its waits fail at once).
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let small = self.ctx.shrink()?;
        let fresh = Engine::new(small, self.config.clone())?;
        drop(std::mem::replace(self, fresh));
        Ok(())
    }

    /// Joins the job this process was started in ([`RankEnv::from_env`](crate::launch::RankEnv::from_env):
    /// ferrogloo-run, torchrun, horovodrun, mpirun, srun) and starts an engine over it,
    /// configured by [`EngineConfig::from_env`].
    pub fn from_env() -> Result<Engine> {
        let env = crate::launch::RankEnv::from_env()?;
        let ctx = env.connect(&crate::device::TcpAttr::from_env()?, crate::context::default_timeout()?)?;
        Engine::new(ctx, EngineConfig::from_env()?)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.ctx.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.ctx.size()
    }

    /// Sums (or [`Reduction`]s) `tensor` across the ranks; every rank gets the result.
    pub fn allreduce<T: Element>(
        &self,
        name: &str,
        tensor: impl Into<Tensor<T>>,
        op: Reduction,
    ) -> Result<Handle<Tensor<T>>> {
        self.allreduce_with(name, tensor, &AllreduceOptions::new(op))
    }

    /// [`allreduce`](Self::allreduce) with scale factors and compression.
    pub fn allreduce_with<T: Element>(
        &self,
        name: &str,
        tensor: impl Into<Tensor<T>>,
        opts: &AllreduceOptions,
    ) -> Result<Handle<Tensor<T>>> {
        let t = tensor.into();
        let meta = self.reduce_meta::<T>(Kind::Allreduce, name, &t, opts)?;
        self.submit(name, meta, t, 0, 0)
    }

    /// Submits several allreduces as one group: they are negotiated together (none runs
    /// before every rank has submitted all of them) and fused together where they fit.
    /// `group` names the group; it must be the same on every rank.
    pub fn grouped_allreduce<T: Element>(
        &self,
        group: &str,
        tensors: Vec<(String, Tensor<T>)>,
        opts: &AllreduceOptions,
    ) -> Result<Vec<Handle<Tensor<T>>>> {
        let n = u32::try_from(tensors.len())
            .map_err(|_| Error::invalid(format!("group '{group}': more than {} tensors", u32::MAX)))?;
        // The k-th call with this group name on every rank has the same id (calls with one
        // name that overlap do not mix).
        let k = {
            let mut calls = lock(&self.shared.groups);
            let c = calls.entry(group.to_string()).or_insert(0);
            *c += 1;
            *c
        };
        let mut words: Vec<u64> = group.bytes().map(u64::from).collect();
        words.push(k);
        let gid = crate::comm::fnv(&words) | 1;
        let mut staged = SmallVec::with_capacity(tensors.len());
        for (name, t) in tensors {
            let t = Tensor::new(t.data, t.shape)?;
            let mut meta = self.reduce_meta::<T>(Kind::Allreduce, &name, &t, opts)?;
            meta.group = gid;
            meta.group_size = n;
            staged.push((name, meta, Some(Box::new(t.data) as Box<dyn Payload>)));
        }
        self.submit_many(staged, tensor_of::<T>).map(SmallVec::into_vec)
    }

    /// Concatenates the ranks' tensors along the first dimension, in rank order; the first
    /// dimension may differ between ranks, the others must agree.
    pub fn allgather<T: Element>(&self, name: &str, tensor: impl Into<Tensor<T>>) -> Result<Handle<Tensor<T>>> {
        let t = tensor.into();
        if t.shape.is_empty() {
            return Err(Error::invalid(format!("allgather '{name}': a tensor of no dimensions has no first one")));
        }
        let meta = self.meta::<T>(Kind::Allgather, &t);
        self.submit(name, meta, t, 0, 0)
    }

    /// Every rank gets rank `root`'s tensor (the others' tensors give the shape and receive
    /// it).
    pub fn broadcast<T: Element>(
        &self,
        name: &str,
        tensor: impl Into<Tensor<T>>,
        root: usize,
    ) -> Result<Handle<Tensor<T>>> {
        let t = tensor.into();
        if root >= self.size() {
            return Err(Error::invalid(format!(
                "broadcast '{name}': root {root} is not a rank of {} ranks",
                self.size()
            )));
        }
        let mut meta = self.meta::<T>(Kind::Broadcast, &t);
        meta.root = root as u32;
        self.submit(name, meta, t, 0, 0)
    }

    /// Splits the tensor along its first dimension into one equal block per rank and sends
    /// block p to rank p; the result holds the blocks received, in rank order.
    pub fn alltoall<T: Element>(&self, name: &str, tensor: impl Into<Tensor<T>>) -> Result<Handle<Tensor<T>>> {
        let t = tensor.into();
        let n = self.size();
        if t.shape.first().is_none_or(|d| d % n != 0) {
            return Err(Error::invalid(format!(
                "alltoall '{name}': the first dimension of shape {} is not a multiple of {n} ranks",
                fmt_shape(&t.shape)
            )));
        }
        let meta = self.meta::<T>(Kind::Alltoall, &t);
        self.submit(name, meta, t, 0, 0)
    }

    /// Reduces the tensors across ranks and leaves rank r the r-th part of the result, split
    /// along the first dimension (the first `d0 % size` ranks get one row more).
    pub fn reduce_scatter<T: Element>(
        &self,
        name: &str,
        tensor: impl Into<Tensor<T>>,
        op: Reduction,
    ) -> Result<Handle<Tensor<T>>> {
        let t = tensor.into();
        if t.shape.is_empty() {
            return Err(Error::invalid(format!("reduce_scatter '{name}': a tensor of no dimensions cannot be split")));
        }
        let meta = self.reduce_meta::<T>(Kind::ReduceScatter, name, &t, &AllreduceOptions::new(op))?;
        self.submit(name, meta, t, 0, 0)
    }

    /// Completes once every rank has called `barrier` as often as this rank has.
    pub fn barrier(&self) -> Result<Handle<()>> {
        let k = self.shared.barriers.fetch_add(1, Ordering::Relaxed);
        let meta =
            Meta { dtype: DType::U8, shape: vec![0], ..self.meta::<u8>(Kind::Barrier, &Tensor::from(Vec::new())) };
        self.submit_raw(&format!("ferrogloo.barrier.{k}"), meta, None, unit_of)
    }

    /// Says this rank has no more data this round (uneven data across ranks): until every
    /// rank has joined, allreduces the others submit run with zeros in this rank's place (and
    /// [`Reduction::Average`] divides by the ranks that did contribute). Completes when every rank
    /// has joined, with the last rank to join (the highest, when several joined at once).
    pub fn join(&self) -> Result<Handle<usize>> {
        let meta = self.meta::<u8>(Kind::Join, &Tensor::from(Vec::new()));
        // Marked before the submission: the engine's thread clears the mark when the join
        // completes, which for the last rank to join can be at once (marked after, the mark
        // would outlive the join and refuse every later allreduce).
        let was = self.shared.joined.swap(true, Ordering::SeqCst);
        let h = self.submit_raw("ferrogloo.join", meta, None, rank_of);
        if h.is_err() && !was {
            self.shared.joined.store(false, Ordering::SeqCst);
        }
        h
    }

    /// Starts writing a Chrome-trace timeline to `path` (replacing the one being written, if
    /// any): on rank 0, or on every rank to `<path>.<rank>` with
    /// [`EngineConfig::timeline_all_ranks`]. Call it on every rank (or only where it applies).
    pub fn start_timeline(&self, path: impl AsRef<Path>) -> Result<()> {
        self.check_alive()?;
        let path = path.as_ref().to_path_buf();
        self.command(|q| q.timeline.push(TimelineCommand::Start(path)));
        Ok(())
    }

    /// Stops writing the timeline (the file is complete JSON).
    pub fn stop_timeline(&self) -> Result<()> {
        self.check_alive()?;
        self.command(|q| q.timeline.push(TimelineCommand::Stop));
        Ok(())
    }

    /// What rank 0's stall inspector reported so far (empty on other ranks).
    pub fn stall_reports(&self) -> Vec<StallReport> {
        lock(&self.shared.stalls).clone()
    }

    /// Whether the ranks agree each cycle by reduction, in `log2(n)` rounds of one message
    /// each, rather than each sending its state to every other
    /// ([`EngineConfig::tree_negotiation_from`]: as configured, or as measured when the engine
    /// started). Always `false` where the cycles go through a host's shared-memory area.
    pub fn agrees_by_reduction(&self) -> bool {
        self.tree
    }

    /// What this rank's engine did so far.
    pub fn stats(&self) -> EngineStats {
        lock(&self.shared.stats).clone()
    }

    /// The error the engine failed with, if it did.
    pub fn error(&self) -> Option<Error> {
        lock(&self.shared.failed).clone()
    }

    /// Stops the engine on every rank (as dropping it does) and waits for its thread. Pending
    /// submissions of this rank fail with [`Error::Aborted`].
    pub fn shutdown(mut self) -> Result<()> {
        self.stop();
        Ok(())
    }

    fn stop(&mut self) {
        self.command(|q| q.shutdown = true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    fn command(&self, f: impl FnOnce(&mut Queue)) {
        f(&mut lock(&self.shared.queue));
        self.shared.arrived.notify_all();
        self.wake();
        // Whoever runs the engine's loop now sees the command; if nobody does, the
        // background thread takes it at once.
        self.driver.kick();
    }

    fn wake(&self) {
        if !self.shared.wake_pending.swap(true, Ordering::SeqCst) {
            // A failure here means the context is unusable; the background thread finds out on
            // its own (and the next submission tries again).
            if self.ctx.send(self.ctx.rank(), CONTROL_TAG, &[wire::WAKE]).is_err() {
                self.shared.wake_pending.store(false, Ordering::SeqCst);
            }
        }
    }

    fn check_alive(&self) -> Result<()> {
        match &*lock(&self.shared.failed) {
            Some(e) => Err(e.clone()),
            None if self.thread.as_ref().is_none_or(|t| t.is_finished()) => {
                Err(Error::Aborted { rank: self.rank(), reason: "the engine was shut down".to_string() })
            }
            None => Ok(()),
        }
    }

    fn meta<T: Element>(&self, kind: Kind, t: &Tensor<T>) -> Meta {
        Meta {
            kind,
            dtype: T::DTYPE,
            shape: t.shape.iter().map(|&d| d as u64).collect(),
            op: Reduction::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            compression: Compression::None,
            group: 0,
            group_size: 0,
        }
    }

    fn reduce_meta<T: Element>(&self, kind: Kind, name: &str, t: &Tensor<T>, o: &AllreduceOptions) -> Result<Meta> {
        let float = T::DTYPE.is_float();
        let what = kind.name();
        if !float && o.op == Reduction::Average {
            return Err(Error::invalid(format!(
                "{what} '{name}': average of {} is not defined (use Sum and divide)",
                T::DTYPE
            )));
        }
        if !float && (o.prescale != 1.0 || o.postscale != 1.0) {
            return Err(Error::invalid(format!(
                "{what} '{name}': scale factors need a floating-point type, not {}",
                T::DTYPE
            )));
        }
        if !o.prescale.is_finite() || !o.postscale.is_finite() {
            return Err(Error::invalid(format!("{what} '{name}': scale factors must be finite")));
        }
        if o.compression != Compression::None && T::DTYPE != DType::F32 {
            return Err(Error::invalid(format!(
                "{what} '{name}': compression {:?} is for f32 tensors, not {}",
                o.compression,
                T::DTYPE
            )));
        }
        Ok(Meta {
            op: o.op,
            prescale: o.prescale,
            postscale: o.postscale,
            compression: o.compression,
            ..self.meta(kind, t)
        })
    }

    fn submit<T: Element>(
        &self,
        name: &str,
        mut meta: Meta,
        t: Tensor<T>,
        group: u64,
        size: u32,
    ) -> Result<Handle<Tensor<T>>> {
        let Tensor { data, shape } = Tensor::new(t.data, t.shape)?;
        meta.group = group;
        meta.group_size = size;
        let _ = shape;
        self.submit_raw(name, meta, Some(Box::new(data)), tensor_of::<T>)
    }

    fn submit_raw<O>(
        &self,
        name: &str,
        meta: Meta,
        payload: Option<Box<dyn Payload>>,
        convert: fn(Output) -> Result<O>,
    ) -> Result<Handle<O>> {
        let mut hs = self.submit_many(smallvec::smallvec![(name.to_string(), meta, payload)], convert)?;
        hs.pop().ok_or_else(|| Error::invalid("engine: no handle (a bug)"))
    }

    /// Submits all of `subs` or none: names are checked and reserved together, and the
    /// submissions enter the queue together (unless the engine has stopped).
    fn submit_many<O>(&self, subs: Subs, convert: fn(Output) -> Result<O>) -> Result<SmallVec<[Handle<O>; 1]>> {
        self.check_alive()?;
        let me = self.rank();
        for (name, meta, _) in &subs {
            if name.is_empty() || name.len() > wire::MAX_NAME {
                return Err(Error::invalid(format!(
                    "a tensor name must have 1 to {} bytes, '{name}' has {}",
                    wire::MAX_NAME,
                    name.len()
                )));
            }
            let internal = matches!(meta.kind, Kind::Barrier | Kind::Join);
            if !internal && name.starts_with(RESERVED) {
                return Err(Error::invalid(format!(
                    "tensor names starting with '{RESERVED}' are the engine's ('{name}')"
                )));
            }
            if meta.kind == Kind::Allreduce && self.shared.joined.load(Ordering::SeqCst) {
                return Err(Error::invalid(format!(
                    "allreduce '{name}': rank {me} has joined; submit again once its join has completed"
                )));
            }
        }
        {
            let mut inflight = lock(&self.shared.inflight);
            // A name twice among these (a set only where there are several).
            let mut names = HashSet::default();
            let several = subs.len() > 1;
            if let Some((name, meta, _)) =
                subs.iter().find(|(n, _, _)| inflight.contains(n) || (several && !names.insert(n.as_str())))
            {
                return Err(Error::invalid(format!(
                    "{} '{name}' is already in flight on rank {me}: wait for its handle before submitting the name again",
                    meta.kind.name(),
                )));
            }
            inflight.extend(subs.iter().map(|(n, _, _)| n.clone()));
        }
        let now = Instant::now();
        let mut handles = SmallVec::with_capacity(subs.len());
        let driver = Arc::downgrade(&self.driver) as Weak<dyn Drive>;
        let batching;
        {
            let mut q = lock(&self.shared.queue);
            if q.closed {
                drop(q);
                let mut inflight = lock(&self.shared.inflight);
                for (n, _, _) in &subs {
                    inflight.remove(n);
                }
                drop(inflight);
                return Err(self.check_alive().err().unwrap_or_else(|| Error::invalid("the engine has stopped")));
            }
            q.gap = q.last.map(|l| now.saturating_duration_since(l));
            q.last = Some(now);
            batching = q.batching;
            for (name, meta, payload) in subs {
                let done = Promise::new();
                handles.push(Handle {
                    done: done.clone(),
                    name: name.clone(),
                    convert,
                    driver: driver.clone(),
                    _o: PhantomData,
                });
                q.items.push(Submission { name, meta, payload, done, submitted: now });
            }
        }
        if batching {
            self.shared.arrived.notify_all();
        }
        // The loop's holder needs waking only in its wait for messages (the flag is set before
        // it looks at the queue: it sees these submissions, or is woken); a caller about to
        // wait runs them itself.
        if self.shared.on_inbox.load(Ordering::SeqCst) {
            self.wake();
        }
        Ok(handles)
    }
}

/// A submission before it is queued: name, what must agree, tensor.
type Staged = (String, Meta, Option<Box<dyn Payload>>);

/// Submissions made together (one, as a rule: kept inline).
type Subs = SmallVec<[Staged; 1]>;

/// The prefix of the engine's own names (barriers, join).
const RESERVED: &str = "ferrogloo.";

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}
