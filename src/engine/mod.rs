//! The engine: named asynchronous collectives, negotiated across ranks (Horovod's core).
//!
//! With plain [`Context`] collectives every rank must make the same calls in the same order.
//! Training frameworks do not work that way: gradients become ready in different orders on
//! different ranks, from several threads. An [`Engine`] takes *named* submissions from any
//! thread, in any order; a background thread per rank agrees with the other ranks on which
//! names every rank has submitted, runs those in one order that every rank computes alike,
//! fuses small tensors into one buffer, and completes each [`Handle`].
//!
//! ```
//! use ferrogloo::engine::{Engine, EngineConfig, Reduction};
//! # use ferrogloo::{Context, device::Device, rendezvous::HashStore};
//! # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
//! let engine = Engine::new(ctx, EngineConfig::default())?;
//! // Two gradients, submitted in any order on each rank; each handle completes when every
//! // rank has submitted that name.
//! let b = engine.allreduce("layer2.grad", vec![2.0f32; 3], Reduction::Average)?;
//! let a = engine.allreduce("layer1.grad", vec![1.0f32; 4], Reduction::Average)?;
//! assert_eq!(a.wait()?.data, vec![1.0; 4]);
//! assert_eq!(b.wait()?.data, vec![2.0; 3]);
//! # Ok::<(), ferrogloo::Error>(())
//! ```
//!
//! # How it works
//!
//! - **Cycles, only when there is news.** A submission wakes the rank's background thread (a
//!   message to itself on the context, so one wait covers peers and submissions); a thread
//!   with new work starts a *cycle*: it sends a short state message to every rank, and an idle
//!   rank that receives one joins the cycle with its own. Idle ranks exchange nothing. While
//!   submissions keep arriving close together, the thread waits for the burst to end (at most
//!   [`EngineConfig::batch_window`]) so that one cycle negotiates all of it.
//! - **Response cache, one bitwise allreduce.** A name negotiated once gets a slot in every
//!   rank's cache (the same slot everywhere, kept until evicted). Later submissions of it only
//!   set their slot's bit in the state message; the bits of all ranks are ANDed (status bits:
//!   joined, shut down, requests pending, slots to invalidate ORed): a slot every rank has set
//!   is ready, with no coordinator round trip. The exchange *is* the allreduce: a direct
//!   all-to-all of the small vectors, which is also how an idle rank learns a cycle began.
//! - **Coordinator.** A name not in the cache (first time, or its type or shape changed, which
//!   invalidates its slot on every rank in the same cycle) travels in full to rank 0, which
//!   finds it ready once every rank has submitted it, checks that they agree (type, shape,
//!   operation, root, scale factors, compression, group) and sends the ready names, with their
//!   cache slots, to every rank. Disagreements fail that name on every rank with
//!   [`Error::Mismatch`] in words.
//! - **Fusion.** Ready allreduces with the same element type, reduction, scale factors and
//!   compression are packed into one buffer (allocated once, grown to at most
//!   [`EngineConfig::fusion_threshold`], reused), looking ahead past tensors that do not match,
//!   and run as one allreduce. Tensors above [`EngineConfig::fusion_max_tensor`] run alone, in
//!   place: their copies would cost more than the collective saved.
//! - **Stalls.** Rank 0 reports names that some ranks submitted and others have not, after
//!   [`EngineConfig::stall_check`] ([`Engine::stall_reports`], and a line on standard error);
//!   after [`EngineConfig::stall_shutdown`] it fails the engine on every rank.
//! - **First cause wins.** When anything fails on a rank (a peer died, a collective failed, a
//!   callback panicked, a stall reached its limit), that rank aborts the context with the
//!   cause, and every rank's pending and later calls report that cause and the rank it came
//!   from, never a generic "shut down".
//!
//! # Configuration
//!
//! [`EngineConfig::from_env`] reads these variables (Horovod's names where the meaning is the
//! same); [`EngineConfig`]'s fields set the same things in code.
//!
//! | Variable | Field | Default | Meaning |
//! |---|---|---|---|
//! | `HOROVOD_FUSION_THRESHOLD` | `fusion_threshold` | 67108864 | bytes of the fusion buffer; 0 turns fusion off |
//! | `FERROGLOO_FUSION_MAX_TENSOR` | `fusion_max_tensor` | 1048576 | larger allreduces run alone, in place |
//! | `HOROVOD_CYCLE_TIME` | `batch_window` | 1 (ms) | longest wait for a burst of submissions to end (there is no fixed cycle) |
//! | `FERROGLOO_ENGINE_BATCH_GAP_US` | `batch_gap` | 100 (µs) | a burst has ended when no submission came for this long |
//! | `HOROVOD_CACHE_CAPACITY` | `cache_capacity` | 1024 | response cache slots; 0 turns the cache off |
//! | `HOROVOD_STALL_CHECK_TIME_SECONDS` | `stall_check` | 60 | report names missing on some ranks after this long |
//! | `HOROVOD_STALL_CHECK_DISABLE` | `stall_check` | unset | `1` turns the stall report off |
//! | `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` | `stall_shutdown` | 0 (off) | fail the engine on every rank after this long |
//! | `HOROVOD_TIMELINE` | `timeline` | unset | write a Chrome-trace timeline to this file (rank 0) |
//! | `FERROGLOO_TIMELINE_ALL_RANKS` | `timeline_all_ranks` | unset | `1`: every rank writes its own, `<file>.<rank>` |
//!
//! # Not (yet) done
//!
//! Only allreduces are fused (allgather, broadcast and the others run one by one). Allgathers
//! are negotiated through the coordinator every time (their first dimension may change from
//! call to call), and so are barriers. Alltoall splits are equal (the first dimension must be a
//! multiple of the number of ranks).

mod core;
mod exec;
mod timeline;
mod wire;

use crate::error::{Error, Result};
use crate::types::{DType, Element};
use crate::{Context, sync::lock};
use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The tag of the engine's own messages (state messages and responses) on its context.
pub(crate) const CONTROL_TAG: u32 = 0x4647_454e; // "FGEN"

/// How an allreduce (or reduce-scatter) combines the ranks' tensors: the crate's one
/// reduction type. [`Reduction::Average`] sums and divides by the number of ranks that
/// contributed (ranks that [joined](Engine::join) contribute nothing and are not counted);
/// floating-point types only.
pub use crate::types::Reduction;

/// Wire compression of `f32` allreduces: the tensor travels and is summed as 16-bit floats
/// (half the bytes, less precision), and comes back as `f32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Compression {
    /// Full precision.
    #[default]
    None,
    /// IEEE binary16 ([`f16`](crate::f16)).
    F16,
    /// bfloat16 ([`bf16`](crate::bf16)).
    BF16,
}

impl Compression {
    fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::F16 => 1,
            Compression::BF16 => 2,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        [Compression::None, Compression::F16, Compression::BF16].into_iter().find(|x| x.code() == c)
    }

    /// The element type on the wire.
    fn wire(self) -> Option<DType> {
        match self {
            Compression::None => None,
            Compression::F16 => Some(DType::F16),
            Compression::BF16 => Some(DType::BF16),
        }
    }
}

/// The options of an allreduce: the reduction, scale factors and wire compression.
///
/// ```
/// use ferrogloo::engine::{AllreduceOptions, Compression, Reduction};
/// // Horovod's "divide by N before summing" for fp16 gradients:
/// let opts = AllreduceOptions::new(Reduction::Sum).prescale(0.25).compression(Compression::F16);
/// assert_eq!(opts.op, Reduction::Sum);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllreduceOptions {
    /// The reduction.
    pub op: Reduction,
    /// Each rank's tensor is multiplied by this before the reduction (floating-point types
    /// only when not 1).
    pub prescale: f64,
    /// The result is multiplied by this (after [`Reduction::Average`]'s division).
    pub postscale: f64,
    /// Wire compression (`f32` tensors only).
    pub compression: Compression,
}

impl AllreduceOptions {
    /// `op`, no scaling, no compression.
    pub fn new(op: Reduction) -> Self {
        AllreduceOptions { op, prescale: 1.0, postscale: 1.0, compression: Compression::None }
    }

    /// Sets the factor applied before the reduction.
    pub fn prescale(mut self, f: f64) -> Self {
        self.prescale = f;
        self
    }

    /// Sets the factor applied after the reduction.
    pub fn postscale(mut self, f: f64) -> Self {
        self.postscale = f;
        self
    }

    /// Sets the wire compression.
    pub fn compression(mut self, c: Compression) -> Self {
        self.compression = c;
        self
    }
}

/// A tensor: elements in row-major order and a shape. A `Vec<T>` converts into a
/// one-dimensional tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T> {
    /// The elements.
    pub data: Vec<T>,
    /// The dimensions (their product is `data.len()`).
    pub shape: Vec<usize>,
}

impl<T: Element> Tensor<T> {
    /// A tensor of `shape` over `data`; errors when the shape's product is not `data.len()`.
    pub fn new(data: Vec<T>, shape: Vec<usize>) -> Result<Self> {
        let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        // Dimensions whose product overflows are refused even beside a zero.
        if shape.iter().filter(|&&d| d != 0).try_fold(1usize, |a, &d| a.checked_mul(d)).is_none() {
            return Err(Error::invalid(format!(
                "a tensor of shape {} has more elements than usize holds",
                fmt_shape(&shape)
            )));
        }
        if count != Some(data.len()) {
            return Err(Error::invalid(format!(
                "a tensor of shape {} needs {} elements, got {}",
                fmt_shape(&shape),
                count.map_or("more than usize::MAX".to_string(), |c| c.to_string()),
                data.len()
            )));
        }
        Ok(Tensor { data, shape })
    }
}

impl<T> From<Vec<T>> for Tensor<T> {
    fn from(data: Vec<T>) -> Self {
        let shape = vec![data.len()];
        Tensor { data, shape }
    }
}

/// `[64, 3]`
pub(crate) fn fmt_shape(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

/// The engine's configuration; see the [module documentation](self) for the environment
/// variables that set each field.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Bytes of the fusion buffer: ready allreduces that fit together are run as one. 0 turns
    /// fusion off.
    pub fusion_threshold: usize,
    /// Allreduces larger than this many bytes are not fused: they run alone, in place
    /// (copying them through the fusion buffer costs more than the collective it saves).
    pub fusion_max_tensor: usize,
    /// The longest a rank waits for a burst of submissions to end before it negotiates them.
    pub batch_window: Duration,
    /// A burst has ended when no submission came for this long (a single submission after a
    /// quiet spell is negotiated at once).
    pub batch_gap: Duration,
    /// Response cache slots (0: every round goes through the coordinator).
    pub cache_capacity: usize,
    /// Report names that some ranks submitted and others have not after this long (`None`:
    /// never).
    pub stall_check: Option<Duration>,
    /// Fail the engine on every rank when a name waited this long (`None`: never).
    pub stall_shutdown: Option<Duration>,
    /// Write a Chrome-trace timeline to this file from the start (rank 0 only, unless
    /// `timeline_all_ranks`).
    pub timeline: Option<PathBuf>,
    /// Every rank writes a timeline, to the file name with `.<rank>` appended.
    pub timeline_all_ranks: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            fusion_threshold: 64 << 20,
            fusion_max_tensor: 1 << 20,
            batch_window: Duration::from_millis(1),
            batch_gap: Duration::from_micros(100),
            cache_capacity: 1024,
            stall_check: Some(Duration::from_secs(60)),
            stall_shutdown: None,
            timeline: None,
            timeline_all_ranks: false,
        }
    }
}

impl EngineConfig {
    /// The defaults, changed by the environment variables of the [module documentation](self).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        fn num(var: &dyn Fn(&str) -> Option<String>, k: &str) -> Result<Option<f64>> {
            match var(k) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => match v.trim().parse::<f64>() {
                    Ok(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
                    _ => Err(Error::invalid(format!("{k}={v:?} is not a non-negative number"))),
                },
            }
        }
        let secs = |x: f64| Duration::from_secs_f64(x.min(1e9));
        let mut c = EngineConfig::default();
        if let Some(x) = num(var, "HOROVOD_FUSION_THRESHOLD")? {
            c.fusion_threshold = x.min(usize::MAX as f64) as usize;
        }
        if let Some(x) = num(var, "FERROGLOO_FUSION_MAX_TENSOR")? {
            c.fusion_max_tensor = x.min(usize::MAX as f64) as usize;
        }
        if let Some(x) = num(var, "HOROVOD_CYCLE_TIME")? {
            c.batch_window = secs(x / 1000.0);
        }
        if let Some(x) = num(var, "FERROGLOO_ENGINE_BATCH_GAP_US")? {
            c.batch_gap = secs(x / 1e6);
        }
        if let Some(x) = num(var, "HOROVOD_CACHE_CAPACITY")? {
            c.cache_capacity = x.min(1e7) as usize;
        }
        if let Some(x) = num(var, "HOROVOD_STALL_CHECK_TIME_SECONDS")? {
            c.stall_check = Some(secs(x));
        }
        if var("HOROVOD_STALL_CHECK_DISABLE").is_some_and(|v| truthy(&v)) {
            c.stall_check = None;
        }
        if let Some(x) = num(var, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")? {
            c.stall_shutdown = (x > 0.0).then(|| secs(x));
        }
        if let Some(p) = var("HOROVOD_TIMELINE").filter(|p| !p.is_empty()) {
            c.timeline = Some(PathBuf::from(p));
        }
        c.timeline_all_ranks = var("FERROGLOO_TIMELINE_ALL_RANKS").is_some_and(|v| truthy(&v));
        Ok(c)
    }
}

fn truthy(v: &str) -> bool {
    matches!(v.trim(), "1" | "true" | "yes" | "on")
}

/// A name that some ranks submitted and others had not, as rank 0's stall inspector saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct StallReport {
    /// The tensor's name.
    pub name: String,
    /// The collective ("allreduce", ...).
    pub op: &'static str,
    /// The ranks that had submitted it.
    pub submitted: Vec<usize>,
    /// The ranks that had not.
    pub missing: Vec<usize>,
    /// How long it had waited when reported.
    pub waited: Duration,
}

impl std::fmt::Display for StallReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} '{}' waited {:.1} s: submitted by ranks {:?}, missing on ranks {:?}",
            self.op,
            self.name,
            self.waited.as_secs_f64(),
            self.submitted,
            self.missing
        )
    }
}

/// Counters of what an engine did on this rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Negotiation cycles this rank took part in.
    pub cycles: u64,
    /// Cycles that went to the coordinator (some name was not in the cache).
    pub coordinated_cycles: u64,
    /// Names found ready through the response cache's bits.
    pub cache_hits: u64,
    /// Names found ready by the coordinator.
    pub coordinated: u64,
    /// Collectives run (a fused batch counts once).
    pub collectives: u64,
    /// Allreduce batches of more than one tensor.
    pub fused_batches: u64,
    /// Tensors that went through those batches.
    pub fused_tensors: u64,
}

/// What a finished submission produced, before it is given its type.
pub(crate) enum Output {
    Tensor { payload: Box<dyn Payload>, shape: Vec<usize> },
    Unit,
    Rank(usize),
}

/// A tensor's storage, owned by the engine while the submission is in flight.
pub(crate) trait Payload: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

impl<T: Element> Payload for Vec<T> {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

type Callback = Box<dyn FnOnce(Result<Output>) + Send>;

/// The completion of one submission.
pub(crate) struct Completion {
    state: Mutex<(Option<Result<Output>>, Option<Callback>)>,
    cond: Condvar,
}

impl Completion {
    fn new() -> Arc<Self> {
        Arc::new(Completion { state: Mutex::new((None, None)), cond: Condvar::new() })
    }

    /// Finishes the submission (first outcome wins); runs its callback, if one is set, on
    /// this thread. Returns the callback's panic message, if it panicked.
    pub(crate) fn finish(&self, outcome: Result<Output>) -> Option<String> {
        let mut s = lock(&self.state);
        if s.0.is_some() {
            return None;
        }
        if let Some(cb) = s.1.take() {
            drop(s);
            return std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(outcome)))
                .err()
                .map(|p| panic_message(&*p));
        }
        s.0 = Some(outcome);
        drop(s);
        self.cond.notify_all();
        None
    }

    fn is_done(&self) -> bool {
        lock(&self.state).0.is_some()
    }
}

pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// The result of one submission, available once every rank has submitted the name and the
/// collective ran. Dropping a handle leaves the submission in flight (its result is dropped).
#[must_use = "a handle is how the result comes back"]
pub struct Handle<O> {
    done: Arc<Completion>,
    name: String,
    convert: fn(Output) -> Result<O>,
    _o: PhantomData<fn() -> O>,
}

impl<O: Send + 'static> Handle<O> {
    /// The name it was submitted under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the result is there (a [`wait`](Self::wait) would not block). This is the
    /// polling form.
    pub fn is_done(&self) -> bool {
        self.done.is_done()
    }

    /// Blocks until the result is there. A name that other ranks never submit blocks until
    /// the stall shutdown, if one is configured; use [`wait_timeout`](Self::wait_timeout) for
    /// a deadline of your own.
    pub fn wait(self) -> Result<O> {
        self.wait_until(None)
    }

    /// Like [`wait`](Self::wait), but gives up after `timeout` with [`Error::Timeout`] naming
    /// the tensor (the submission stays in flight; its result is then dropped).
    pub fn wait_timeout(self, timeout: Duration) -> Result<O> {
        self.wait_until(Instant::now().checked_add(timeout))
    }

    fn wait_until(self, deadline: Option<Instant>) -> Result<O> {
        let start = Instant::now();
        let mut s = lock(&self.done.state);
        loop {
            if let Some(out) = s.0.take() {
                return out.and_then(self.convert);
            }
            match deadline {
                None => s = crate::sync::wait(&self.done.cond, s),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::Timeout {
                            op: format!("engine: waiting for '{}'", self.name),
                            ranks: Vec::new(),
                            keys: Vec::new(),
                            waited: start.elapsed(),
                        });
                    }
                    s = crate::sync::wait_timeout(&self.done.cond, s, d - now);
                }
            }
        }
    }

    /// The callback form: `f` gets the result, on the engine's background thread as soon as
    /// it is there (here and now, on the calling thread, if it already is). Keep it short: the
    /// engine waits for it. A callback that panics on the engine's thread fails the engine on
    /// every rank, with the panic as the cause (one run here panics here).
    pub fn then(self, f: impl FnOnce(Result<O>) + Send + 'static) {
        let convert = self.convert;
        let mut s = lock(&self.done.state);
        if let Some(out) = s.0.take() {
            drop(s);
            f(out.and_then(convert));
            return;
        }
        s.1 = Some(Box::new(move |out: Result<Output>| f(out.and_then(convert))));
    }
}

fn tensor_of<T: Element>(out: Output) -> Result<Tensor<T>> {
    match out {
        Output::Tensor { payload, shape } => match payload.into_any().downcast::<Vec<T>>() {
            Ok(data) => Ok(Tensor { data: *data, shape }),
            Err(_) => Err(Error::invalid("engine: a result of another element type (a bug)")),
        },
        _ => Err(Error::invalid("engine: a result of another kind (a bug)")),
    }
}

fn unit_of(out: Output) -> Result<()> {
    match out {
        Output::Unit => Ok(()),
        _ => Err(Error::invalid("engine: a result of another kind (a bug)")),
    }
}

fn rank_of(out: Output) -> Result<usize> {
    match out {
        Output::Rank(r) => Ok(r),
        _ => Err(Error::invalid("engine: a result of another kind (a bug)")),
    }
}

/// The collectives the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Allreduce = 1,
    Allgather = 2,
    Broadcast = 3,
    Alltoall = 4,
    ReduceScatter = 5,
    Barrier = 6,
    Join = 7,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Allreduce => "allreduce",
            Kind::Allgather => "allgather",
            Kind::Broadcast => "broadcast",
            Kind::Alltoall => "alltoall",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Barrier => "barrier",
            Kind::Join => "join",
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        [
            Kind::Allreduce,
            Kind::Allgather,
            Kind::Broadcast,
            Kind::Alltoall,
            Kind::ReduceScatter,
            Kind::Barrier,
            Kind::Join,
        ]
        .into_iter()
        .find(|k| *k as u8 == c)
    }

    /// Whether a negotiated name of this kind may be kept in the response cache.
    pub(crate) fn cacheable(self) -> bool {
        matches!(self, Kind::Allreduce | Kind::Broadcast | Kind::Alltoall | Kind::ReduceScatter)
    }
}

/// What every rank must agree on for one name.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Meta {
    pub(crate) kind: Kind,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    pub(crate) op: Reduction,
    pub(crate) root: u32,
    pub(crate) prescale: f64,
    pub(crate) postscale: f64,
    pub(crate) compression: Compression,
    /// Group id (0: none) and the number of tensors in the group.
    pub(crate) group: u64,
    pub(crate) group_size: u32,
}

impl Meta {
    pub(crate) fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Whether two ranks' submissions of one name agree (an allgather's first dimension may
    /// differ).
    pub(crate) fn agrees(&self, o: &Meta) -> bool {
        let shapes = if self.kind == Kind::Allgather && o.kind == Kind::Allgather {
            self.shape.get(1..) == o.shape.get(1..) && !self.shape.is_empty() && !o.shape.is_empty()
        } else {
            self.shape == o.shape
        };
        shapes
            && self.kind == o.kind
            && self.dtype == o.dtype
            && self.op == o.op
            && self.root == o.root
            && self.prescale.to_bits() == o.prescale.to_bits()
            && self.postscale.to_bits() == o.postscale.to_bits()
            && self.compression == o.compression
            && self.group == o.group
            && self.group_size == o.group_size
    }

    /// This submission in words, with the fields where it differs from `other`: "f16 [64, 3]",
    /// "f32 [8] op average".
    pub(crate) fn describe(&self, other: &Meta) -> String {
        let shape: Vec<usize> = self.shape.iter().map(|&d| d as usize).collect();
        let mut s = String::new();
        if self.kind != other.kind {
            s.push_str(self.kind.name());
            s.push(' ');
        }
        s.push_str(&format!("{} {}", self.dtype, fmt_shape(&shape)));
        if self.op != other.op {
            s.push_str(&format!(" op {}", self.op.name()));
        }
        if self.root != other.root {
            s.push_str(&format!(" root {}", self.root));
        }
        if self.prescale.to_bits() != other.prescale.to_bits() {
            s.push_str(&format!(" prescale {}", self.prescale));
        }
        if self.postscale.to_bits() != other.postscale.to_bits() {
            s.push_str(&format!(" postscale {}", self.postscale));
        }
        if self.compression != other.compression {
            s.push_str(&format!(" compression {:?}", self.compression));
        }
        if self.group != other.group || self.group_size != other.group_size {
            s.push_str(&format!(" group {:#x} of {}", self.group, self.group_size));
        }
        s
    }
}

/// One submission, on its way to the background thread.
pub(crate) struct Submission {
    pub(crate) name: String,
    pub(crate) meta: Meta,
    pub(crate) payload: Option<Box<dyn Payload>>,
    pub(crate) done: Arc<Completion>,
    pub(crate) submitted: Instant,
}

/// What user threads and the background thread share.
pub(crate) struct Shared {
    pub(crate) queue: Mutex<Queue>,
    pub(crate) arrived: Condvar,
    /// A wake-up message to this rank is on its way and not yet received.
    pub(crate) wake_pending: AtomicBool,
    /// The engine's first failure; every later submission reports it.
    pub(crate) failed: Mutex<Option<Error>>,
    /// Names in flight on this rank.
    pub(crate) inflight: Mutex<HashSet<String>>,
    pub(crate) stats: Mutex<EngineStats>,
    pub(crate) stalls: Mutex<Vec<StallReport>>,
    pub(crate) barriers: AtomicU64,
    /// Calls of `grouped_allreduce` per group name.
    pub(crate) groups: Mutex<HashMap<String, u64>>,
    /// This rank has joined and its join has not completed.
    pub(crate) joined: AtomicBool,
    pub(crate) epoch: Instant,
}

#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) items: Vec<Submission>,
    pub(crate) shutdown: bool,
    /// The background thread has stopped: nothing more is taken.
    pub(crate) closed: bool,
    pub(crate) timeline: Vec<TimelineCommand>,
    /// When the last submission came, and how long after the one before.
    pub(crate) last: Option<Instant>,
    pub(crate) gap: Option<Duration>,
}

pub(crate) enum TimelineCommand {
    Start(PathBuf),
    Stop,
}

/// Named asynchronous collectives over a [`Context`]; see the [module documentation](self).
///
/// Submit from any thread. Dropping the engine (or [`shutdown`](Self::shutdown)) stops it on
/// every rank: the others' pending and later submissions fail with [`Error::Aborted`] naming
/// this rank.
pub struct Engine {
    shared: Arc<Shared>,
    ctx: Arc<Context>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("rank", &self.ctx.rank()).field("size", &self.ctx.size()).finish()
    }
}

impl Engine {
    /// Starts an engine over `ctx` (its background thread owns the context's traffic from now
    /// on: make no other calls on it). A process set is an engine over a sub-group made with
    /// [`Context::split`] or [`Context::subgroup`].
    pub fn new(ctx: Context, config: EngineConfig) -> Result<Engine> {
        let ctx = Arc::new(ctx);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            arrived: Condvar::new(),
            wake_pending: AtomicBool::new(false),
            failed: Mutex::new(None),
            inflight: Mutex::new(HashSet::new()),
            stats: Mutex::new(EngineStats::default()),
            stalls: Mutex::new(Vec::new()),
            barriers: AtomicU64::new(0),
            groups: Mutex::new(HashMap::new()),
            joined: AtomicBool::new(false),
            epoch: Instant::now(),
        });
        // Fusion decides the sequence of collectives: every rank must use the same limits.
        let mine = [config.fusion_threshold as u64, config.fusion_max_tensor as u64];
        let mut all = vec![0u64; 2 * ctx.size()];
        ctx.allgather(&mine, &mut all, &crate::CollectiveOptions::default())?;
        if let Some(r) = (0..ctx.size()).find(|&r| all[2 * r..2 * r + 2] != mine) {
            let w = |r: usize| ctx.world_rank(r).unwrap_or(r);
            return Err(Error::Mismatch {
                rank: w(r),
                detail: format!(
                    "engine: rank {} has a fusion threshold of {} bytes and fuses tensors up to {} bytes, rank {} {} and {} \
                     (set HOROVOD_FUSION_THRESHOLD and FERROGLOO_FUSION_MAX_TENSOR alike everywhere)",
                    w(r),
                    all[2 * r],
                    all[2 * r + 1],
                    w(ctx.rank()),
                    mine[0],
                    mine[1]
                ),
            });
        }
        let world = ctx.world_rank(ctx.rank()).unwrap_or(ctx.rank());
        let timeline = match &config.timeline {
            Some(p) if config.timeline_all_ranks => Some(timeline::rank_path(p, world)),
            Some(p) if ctx.rank() == 0 => Some(p.clone()),
            _ => None,
        };
        let core = core::Core::new(ctx.clone(), shared.clone(), config, timeline)?;
        let thread = std::thread::Builder::new()
            .name(format!("ferrogloo-engine-{}", ctx.rank()))
            .spawn(move || core.run())
            .map_err(|e| Error::io("starting the engine's thread", e))?;
        Ok(Engine { shared, ctx, thread: Some(thread) })
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
        let mut staged = Vec::with_capacity(tensors.len());
        for (name, t) in tensors {
            let t = Tensor::new(t.data, t.shape)?;
            let mut meta = self.reduce_meta::<T>(Kind::Allreduce, &name, &t, opts)?;
            meta.group = gid;
            meta.group_size = n;
            staged.push((name, meta, Some(Box::new(t.data) as Box<dyn Payload>)));
        }
        self.submit_many(staged, tensor_of::<T>)
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
        let h = self.submit_raw("ferrogloo.join", meta, None, rank_of)?;
        self.shared.joined.store(true, Ordering::SeqCst);
        Ok(h)
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
        let mut hs = self.submit_many(vec![(name.to_string(), meta, payload)], convert)?;
        hs.pop().ok_or_else(|| Error::invalid("engine: no handle (a bug)"))
    }

    /// Submits all of `subs` or none: names are checked and reserved together, and the
    /// submissions enter the queue together (unless the engine has stopped).
    fn submit_many<O>(&self, subs: Vec<Staged>, convert: fn(Output) -> Result<O>) -> Result<Vec<Handle<O>>> {
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
            let mut names = HashSet::new();
            if let Some((name, meta, _)) =
                subs.iter().find(|(n, _, _)| inflight.contains(n) || !names.insert(n.as_str()))
            {
                return Err(Error::invalid(format!(
                    "{} '{name}' is already in flight on rank {me}: wait for its handle before submitting the name again",
                    meta.kind.name(),
                )));
            }
            inflight.extend(subs.iter().map(|(n, _, _)| n.clone()));
        }
        let now = Instant::now();
        let mut handles = Vec::with_capacity(subs.len());
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
            for (name, meta, payload) in subs {
                let done = Completion::new();
                handles.push(Handle { done: done.clone(), name: name.clone(), convert, _o: PhantomData });
                q.items.push(Submission { name, meta, payload, done, submitted: now });
            }
        }
        self.shared.arrived.notify_all();
        self.wake();
        Ok(handles)
    }
}

/// A submission before it is queued: name, what must agree, tensor.
type Staged = (String, Meta, Option<Box<dyn Payload>>);

/// The prefix of the engine's own names (barriers, join).
const RESERVED: &str = "ferrogloo.";

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}
