//! Running the names a cycle found ready: fusion of allreduces, scaling, compression, and the
//! other collectives.

use super::controller::Ready;
use super::handle::{Deferred, Output, Payload, Promise};
use super::meta::{Kind, Meta};
use super::shared::EngineStats;
use super::tensor::Compression;
use crate::Context;
use crate::algorithms::CollectiveOptions;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::types::{DType, Reduction, bf16, f16};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The largest tensor a rank allocates on another's word (a joined rank's zeros, an output).
const MAX_TENSOR_BYTES: u64 = 1 << 40;

/// This rank's submission of a ready name: its tensor, its completion, when it was submitted.
pub(crate) type Own = (Option<Box<dyn Payload>>, Arc<Promise>, Instant);

/// One ready name on this rank: its input (this rank's tensor, or zeros for a rank that joined)
/// and, once run, its output.
pub(crate) struct Item {
    pub(crate) name: String,
    pub(crate) meta: Meta,
    dims: Vec<u64>,
    error: Option<Error>,
    payload: Option<Box<dyn Payload>>,
    out: Option<Result<Output>>,
    done: Option<Arc<Promise>>,
    /// When this rank submitted it (`None`: it did not, having joined).
    pub(crate) submitted: Option<Instant>,
    /// When each rank was first seen with it (rank 0, or ranks writing a timeline).
    pub(crate) seen: Option<Vec<Option<Instant>>>,
    /// When the cycle found it ready.
    pub(crate) decided: Instant,
}

/// A stretch of time spent on an item, for the timeline.
pub(crate) struct Span {
    pub(crate) item: usize,
    pub(crate) phase: &'static str,
    pub(crate) start: Instant,
    pub(crate) end: Instant,
}

impl Item {
    /// A name a cycle decided at `decided`.
    pub(crate) fn new(r: Ready<Own>, decided: Instant) -> Item {
        let mut out = None;
        let seen = r.seen;
        let (payload, done, submitted) = match r.own {
            Some((payload, done, submitted)) => (payload, Some(done), Some(submitted)),
            None if r.meta.kind == Kind::Allreduce && r.error.is_none() => {
                match zeros(r.meta.dtype, r.meta.elements(), &r.name) {
                    Ok(z) => (Some(z), None, None),
                    Err(e) => {
                        out = Some(Err(e));
                        (None, None, None)
                    }
                }
            }
            None => (None, None, None),
        };
        Item { name: r.name, meta: r.meta, dims: r.dims, error: r.error, payload, out, done, submitted, seen, decided }
    }

    /// Gives an item that has no outcome yet the failure that stopped the cycle.
    pub(crate) fn fail_unrun(&mut self, e: &Error) {
        if self.out.is_none() {
            self.out = Some(Err(e.clone()));
        }
    }

    /// Hands the outcome to the submitter; returns a callback's panic message.
    pub(crate) fn finish(self) -> Option<String> {
        let (_, done, out) = self.outcome();
        done.and_then(|d| d.finish(out))
    }

    /// [`finish`](Self::finish), but a callback is returned (with the name), not run.
    pub(crate) fn finish_deferring(self) -> Option<(String, Deferred)> {
        let (name, done, out) = self.outcome();
        done.and_then(|d| d.finish_deferring(out)).map(|d| (name, d))
    }

    /// The name, the completion and the outcome (an item never run is a bug, in words).
    fn outcome(self) -> (String, Option<Arc<Promise>>, Result<Output>) {
        let out =
            self.out.unwrap_or_else(|| Err(Error::invalid(format!("engine: '{}' was not run (a bug)", self.name))));
        (self.name, self.done, out)
    }

    fn shape(&self) -> Vec<usize> {
        self.meta.shape.iter().map(|&d| d as usize).collect()
    }

    fn input(&mut self) -> Result<&mut Box<dyn Payload>> {
        let name = &self.name;
        self.payload
            .as_mut()
            .ok_or_else(|| Error::invalid(format!("engine: '{name}' has no tensor on this rank (a bug)")))
    }
}

/// Zeroed storage for `n` elements of `dtype`.
fn zeros(dtype: DType, n: u64, name: &str) -> Result<Box<dyn Payload>> {
    if n.saturating_mul(dtype.size() as u64) > MAX_TENSOR_BYTES {
        return Err(Error::invalid(format!("engine: '{name}' would need {n} {dtype} elements")));
    }
    let n = n as usize;
    Ok(
        crate::dispatch_dtype!(dtype, T => { Box::new(vec![<T as bytemuck::Zeroable>::zeroed(); n]) as Box<dyn Payload> }),
    )
}

/// Allreduces that may share a fusion buffer.
fn fusable(a: &Meta, b: &Meta) -> bool {
    a.kind == Kind::Allreduce
        && b.kind == Kind::Allreduce
        && a.dtype == b.dtype
        && a.op == b.op
        && a.prescale.to_bits() == b.prescale.to_bits()
        && a.postscale.to_bits() == b.postscale.to_bits()
        && a.compression == b.compression
}

fn wire_bytes(m: &Meta) -> u64 {
    m.elements().saturating_mul(m.compression.wire().unwrap_or(m.dtype).size() as u64)
}

/// The fused batches: each allreduce joins the first batch, in order, whose tensors it matches
/// and whose bytes stay within the threshold (looking past tensors that do not match); a
/// tensor larger than `max_tensor` bytes runs alone, in place (copying it in and out would
/// cost more than the collective it saves). Every rank computes the same batches from the
/// same list.
pub(crate) fn plan(metas: &[&Meta], threshold: usize, max_tensor: usize) -> Vec<Vec<usize>> {
    let alone = |m: &Meta| wire_bytes(m) > max_tensor as u64;
    let n = metas.len();
    let mut taken = vec![false; n];
    let mut batches = Vec::new();
    for i in 0..n {
        if taken[i] || metas[i].kind != Kind::Allreduce {
            continue;
        }
        taken[i] = true;
        let mut batch = vec![i];
        let mut total = wire_bytes(metas[i]);
        for j in i + 1..n {
            if total >= threshold as u64 || alone(metas[i]) {
                break;
            }
            if !taken[j]
                && !alone(metas[j])
                && fusable(metas[i], metas[j])
                && total + wire_bytes(metas[j]) <= threshold as u64
            {
                taken[j] = true;
                total += wire_bytes(metas[j]);
                batch.push(j);
            }
        }
        batches.push(batch);
    }
    batches
}

/// Runs `items` in order; returns the time spent on each, and the first failure (which
/// leaves the rest not run).
pub(crate) fn run(
    ctx: &Context,
    fusion: &mut Vec<u64>,
    items: &mut [Item],
    contributors: usize,
    (threshold, max_tensor): (usize, usize),
    stats: &Mutex<EngineStats>,
) -> (Vec<Span>, Result<()>) {
    let mut spans = Vec::new();
    // Items with an outcome already (reduced from the state messages) are not run again.
    let runnable: Vec<usize> =
        (0..items.len()).filter(|&i| items[i].error.is_none() && items[i].out.is_none()).collect();
    let metas: Vec<&Meta> = runnable.iter().map(|&i| &items[i].meta).collect();
    // Where a batch of a tensor too large to copy runs on its tensors themselves (through the
    // host's area, or the ring over the pairs, chosen for larger sizes too) it costs no
    // copies, so no tensor is too large to join one (a compressed tensor is converted whether
    // it runs alone or not).
    let max_tensor = if in_place(ctx, max_tensor.saturating_add(1)) { usize::MAX } else { max_tensor };
    let batches: Vec<Vec<usize>> =
        plan(&metas, threshold, max_tensor).into_iter().map(|b| b.into_iter().map(|k| runnable[k]).collect()).collect();
    let mut leader = vec![None; items.len()];
    for (b, batch) in batches.iter().enumerate() {
        leader[batch[0]] = Some(b);
    }
    for i in 0..items.len() {
        if items[i].out.is_some() {
            continue;
        }
        if let Some(e) = items[i].error.clone() {
            items[i].out = Some(Err(e));
            continue;
        }
        let r = match (items[i].meta.kind, leader[i]) {
            (Kind::Allreduce, Some(b)) => {
                allreduce(ctx, (&mut *fusion, threshold), items, &batches[b], contributors, &mut spans, stats)
            }
            (Kind::Allreduce, None) => Ok(()), // run with its batch
            _ => single(ctx, items, i, &mut spans, stats),
        };
        if let Err(e) = r {
            return (spans, Err(e));
        }
    }
    (spans, Ok(()))
}

fn timed<R>(spans: &mut Vec<Span>, items: &[usize], phase: &'static str, f: impl FnOnce() -> R) -> R {
    let start = Instant::now();
    let r = f();
    let end = Instant::now();
    spans.extend(items.iter().map(|&item| Span { item, phase, start, end }));
    r
}

fn allreduce(
    ctx: &Context,
    (fusion, threshold): (&mut Vec<u64>, usize),
    items: &mut [Item],
    batch: &[usize],
    contributors: usize,
    spans: &mut Vec<Span>,
    stats: &Mutex<EngineStats>,
) -> Result<()> {
    let m = items[batch[0]].meta.clone();
    let wire = m.compression.wire().unwrap_or(m.dtype);
    let red = m.op.pairwise();
    let post = m.postscale * if m.op == Reduction::Average { 1.0 / contributors as f64 } else { 1.0 };
    let opts = CollectiveOptions::default();
    let mut buffered = false;
    if batch.len() == 1 && wire == m.dtype {
        let i = batch[0];
        let p = items[i].input()?.bytes_mut();
        if m.prescale != 1.0 {
            scale(m.dtype, p, m.prescale)?;
        }
        timed(spans, batch, "ALLREDUCE", || ctx.allreduce_bytes(p, m.dtype, red, &opts))?;
        if post != 1.0 {
            scale(m.dtype, p, post)?;
        }
    } else if wire == m.dtype && in_place(ctx, batch.iter().map(|&i| wire_bytes(&items[i].meta) as usize).sum()) {
        // Through the host's area the tensors are copied straight in and out, and the ring
        // over the pairs runs on them: no fusion buffer, no copies of its own (on one host the
        // collective is bound by memory, so the fusion buffer's two copies would double its
        // traffic; over the pairs they cost as much as the ring's own reductions).
        let mut taken: Vec<Option<&mut Item>> = items.iter_mut().map(Some).collect();
        let mut parts = Vec::with_capacity(batch.len());
        for &i in batch {
            let item = taken
                .get_mut(i)
                .and_then(Option::take)
                .ok_or_else(|| Error::invalid("engine: a batch names a tensor twice (a bug)"))?;
            let p = item.input()?.bytes_mut();
            if m.prescale != 1.0 {
                scale(m.dtype, p, m.prescale)?;
            }
            parts.push(p);
        }
        // Every rank's batch holds the same tensors in the same order: cut alike.
        timed(spans, batch, "ALLREDUCE", || ctx.allreduce_parts_bytes(&mut parts, m.dtype, red, &opts, true))?;
        if post != 1.0 {
            for p in parts {
                scale(m.dtype, p, post)?;
            }
        }
    } else {
        buffered = true;
        let total: usize = batch.iter().map(|&i| wire_bytes(&items[i].meta) as usize).sum();
        // The fusion buffer grows to the threshold at most; a lone compressed tensor larger
        // than that gets a buffer of its own.
        let mut own = Vec::new();
        let words = if total <= threshold.max(fusion.len() * 8) {
            if fusion.len() * 8 < total {
                fusion.resize(total.div_ceil(8), 0);
            }
            fusion
        } else {
            own.resize(total.div_ceil(8), 0u64);
            &mut own
        };
        let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(words)[..total];
        let mut at = 0;
        for &i in batch {
            let len = wire_bytes(&items[i].meta) as usize;
            let src = items[i].input()?.bytes();
            timed(spans, &[i], "MEMCPY_IN_FUSION_BUFFER", || {
                convert(&mut buf[at..at + len], wire, src, m.dtype, m.prescale)
            })?;
            at += len;
        }
        timed(spans, batch, "ALLREDUCE", || ctx.allreduce_bytes(buf, wire, red, &opts))?;
        let mut at = 0;
        for &i in batch {
            let len = wire_bytes(&items[i].meta) as usize;
            let dst = items[i].input()?.bytes_mut();
            timed(spans, &[i], "MEMCPY_OUT_FUSION_BUFFER", || convert(dst, m.dtype, &buf[at..at + len], wire, post))?;
            at += len;
        }
    }
    {
        let mut st = lock(stats);
        st.collectives += 1;
        if batch.len() > 1 {
            st.fused_batches += 1;
            st.fused_tensors += batch.len() as u64;
            st.fusion_buffer_batches += u64::from(buffered);
        }
    }
    for &i in batch {
        let shape = items[i].shape();
        let payload = items[i].payload.take();
        items[i].out = Some(
            payload
                .map(|payload| Output::Tensor { payload, shape })
                .ok_or_else(|| Error::invalid("engine: no tensor (a bug)")),
        );
    }
    Ok(())
}

/// Whether `item` may be reduced from tensors that travelled with the state messages: an
/// uncompressed allreduce that every rank agreed on and this rank submitted.
pub(crate) fn eager_kind(meta: &Meta) -> bool {
    meta.kind == Kind::Allreduce && meta.compression == Compression::None
}

impl Item {
    /// Whether this item may be reduced from the state messages' tensors ([`eager_kind`]),
    /// and its bytes.
    pub(crate) fn eager_bytes(&self) -> Option<usize> {
        (eager_kind(&self.meta) && self.error.is_none() && self.done.is_some())
            .then(|| self.payload.as_ref().map(|p| p.bytes().len()))
            .flatten()
    }

    /// Reduces this allreduce from every rank's tensor (`peers[r]`: rank `r`'s bytes, `None`
    /// for this rank, whose tensor is the item's own), folding in rank order so that every
    /// rank computes the same bits; scales as [`run`]'s allreduces do. `scratch`: reused
    /// storage (aligned for every element type).
    pub(crate) fn reduce_from(
        &mut self,
        peers: &[Option<&[u8]>],
        scratch: &mut Vec<u64>,
        spans: Option<&mut Vec<Span>>,
        at: usize,
    ) -> Result<()> {
        let m = &self.meta;
        let (dtype, red, prescale) = (m.dtype, m.op.pairwise(), m.prescale);
        let post = m.postscale * if m.op == Reduction::Average { 1.0 / peers.len() as f64 } else { 1.0 };
        // Timed only for a timeline (two clock reads of a warm cycle's few dozen nanoseconds).
        let start = spans.is_some().then(Instant::now);
        let name = &self.name;
        let own = self
            .payload
            .as_mut()
            .ok_or_else(|| Error::invalid(format!("engine: '{name}' has no tensor on this rank (a bug)")))?
            .bytes_mut();
        let len = own.len();
        if let Some((r, b)) = peers.iter().enumerate().find_map(|(r, p)| p.filter(|b| b.len() != len).map(|b| (r, b))) {
            return Err(Error::invalid(format!(
                "engine: allreduce '{name}' came with {} bytes from rank {r}, {len} here (a bug)",
                b.len()
            )));
        }
        let words = len.div_ceil(8);
        // What the scratch held is overwritten before it is read (copied into first).
        if scratch.len() < 2 * words {
            scratch.resize(2 * words, 0);
        }
        let (acc, next) = scratch.split_at_mut(words);
        let acc = &mut bytemuck::cast_slice_mut::<u64, u8>(acc)[..len];
        let next = &mut bytemuck::cast_slice_mut::<u64, u8>(next)[..len];
        // Folds `src` into `acc` (copied into `next` first where it is not aligned for the
        // type, or must be scaled).
        let fold = |acc: &mut [u8], src: &[u8], next: &mut [u8]| -> Result<()> {
            crate::dispatch_dtype!(dtype, T => {
                let src: &[T] = match bytemuck::try_cast_slice::<u8, T>(src) {
                    Ok(s) if prescale == 1.0 => s,
                    _ => {
                        next.copy_from_slice(src);
                        if prescale != 1.0 {
                            scale(dtype, next, prescale)?;
                        }
                        bytemuck::cast_slice::<u8, T>(next)
                    }
                };
                red.apply(bytemuck::cast_slice_mut::<u8, T>(acc), src);
            });
            Ok(())
        };
        let me = peers.iter().position(Option::is_none).unwrap_or(0);
        if prescale == 1.0 && (me == 0 || !dtype.is_float()) {
            // Into this rank's tensor where it lies: it is the first of the rank order, or
            // the order does not change the bits (integers).
            for p in peers.iter().flatten() {
                fold(own, p, next)?;
            }
        } else {
            for (r, p) in peers.iter().enumerate() {
                let src = p.unwrap_or(own);
                if r == 0 {
                    acc.copy_from_slice(src);
                    if prescale != 1.0 {
                        scale(dtype, acc, prescale)?;
                    }
                } else {
                    fold(acc, src, next)?;
                }
            }
            own.copy_from_slice(acc);
        }
        if post != 1.0 {
            scale(dtype, own, post)?;
        }
        if let (Some(spans), Some(start)) = (spans, start) {
            spans.push(Span { item: at, phase: "ALLREDUCE_WITH_NEGOTIATION", start, end: Instant::now() });
        }
        let shape = self.shape();
        self.out = Some(
            self.payload
                .take()
                .map(|payload| Output::Tensor { payload, shape })
                .ok_or_else(|| Error::invalid("engine: no tensor (a bug)")),
        );
        Ok(())
    }
}

/// Whether the engine's allreduce of `bytes` runs on the tensors themselves, with no fusion
/// buffer ([`Context::allreduce_parts_bytes`]): through the host's shared area (every rank on
/// this host, tag 0, `Auto`), which copies the tensors straight in and out (or reads them
/// straight), or over the pairs where `Auto` runs the ring, cut at the tensors' ends (the
/// smallest tensors copied together: see [`Context::allreduce_many_alike`]).
fn in_place(ctx: &Context, bytes: usize) -> bool {
    ctx.size() > 1
        && (ctx.whole_area(0).is_some()
            || matches!(ctx.allreduce_algorithm(bytes, crate::Algorithm::Auto), Ok(crate::Algorithm::Ring)))
}

/// A collective other than a fused allreduce.
fn single(
    ctx: &Context,
    items: &mut [Item],
    i: usize,
    spans: &mut Vec<Span>,
    stats: &Mutex<EngineStats>,
) -> Result<()> {
    let opts = CollectiveOptions::default();
    let (n, me) = (ctx.size(), ctx.rank());
    let meta = items[i].meta.clone();
    let name = items[i].name.clone();
    let shape = items[i].shape();
    let out = match meta.kind {
        Kind::Barrier => Output::Unit,
        Kind::Broadcast => {
            let p = items[i].input()?;
            timed(spans, &[i], "BROADCAST", || {
                ctx.broadcast_bytes(p.bytes_mut(), DType::U8, meta.root as usize, &opts)
            })?;
            Output::Tensor {
                payload: items[i].payload.take().ok_or_else(|| Error::invalid("engine: no tensor (a bug)"))?,
                shape,
            }
        }
        Kind::Alltoall => {
            let mut out = zeros(meta.dtype, meta.elements(), &name)?;
            let p = items[i].input()?;
            timed(spans, &[i], "ALLTOALL", || ctx.alltoall_bytes(p.bytes(), out.bytes_mut(), DType::U8, &opts))?;
            Output::Tensor { payload: out, shape }
        }
        Kind::Allgather => {
            if items[i].dims.len() != n {
                // The dimensions come in the coordinator's responses: named by its job rank.
                return Err(Error::Protocol {
                    peer: Some(ctx.world_rank(0).unwrap_or(0)),
                    detail: format!(
                        "engine: allgather '{name}' came with {} first dimensions for {n} ranks",
                        items[i].dims.len()
                    ),
                });
            }
            let too_big =
                || Error::invalid(format!("engine: allgather '{name}' would be larger than {MAX_TENSOR_BYTES} bytes"));
            let row = meta
                .shape
                .get(1..)
                .unwrap_or(&[])
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(too_big)?;
            let rows = items[i].dims.iter().try_fold(0u64, |a, &d| a.checked_add(d)).ok_or_else(too_big)?;
            let mut out = zeros(meta.dtype, rows.saturating_mul(row), &name)?;
            let esize = meta.dtype.size() as u64;
            let counts = items[i]
                .dims
                .iter()
                .map(|&d| d.checked_mul(row).and_then(|x| x.checked_mul(esize)).map(|x| x as usize).ok_or_else(too_big))
                .collect::<Result<Vec<usize>>>()?;
            let p = items[i].input()?;
            timed(spans, &[i], "ALLGATHER", || ctx.allgatherv::<u8>(p.bytes(), out.bytes_mut(), &counts, &opts))?;
            let mut shape = shape;
            if let Some(d) = shape.first_mut() {
                *d = rows as usize;
            }
            Output::Tensor { payload: out, shape }
        }
        Kind::ReduceScatter => {
            let d0 = shape.first().copied().unwrap_or(0);
            let row = shape
                .get(1..)
                .unwrap_or(&[])
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| Error::invalid(format!("engine: reduce_scatter '{name}': a shape too large")))?;
            let parts = crate::algorithms::partition(d0, n);
            let counts: Vec<usize> = parts.iter().map(|p| p.len() * row).collect();
            let mut out = zeros(meta.dtype, counts[me] as u64, &name)?;
            let red = meta.op.pairwise();
            let p = items[i].input()?;
            timed(spans, &[i], "REDUCE_SCATTER", || {
                crate::dispatch_dtype!(meta.dtype, T => {
                    let input: &[T] = cast(p.bytes())?;
                    let output: &mut [T] = cast_mut(out.bytes_mut())?;
                    ctx.reduce_scatterv(input, output, &counts, red, &opts)
                })
            })?;
            meta.op.finish_bytes(meta.dtype, out.bytes_mut(), n)?;
            let mut shape = shape;
            if let Some(d) = shape.first_mut() {
                *d = parts[me].len();
            }
            Output::Tensor { payload: out, shape }
        }
        Kind::Allreduce | Kind::Join => return Err(Error::invalid("engine: not a single collective (a bug)")),
    };
    lock(stats).collectives += u64::from(meta.kind != Kind::Barrier);
    items[i].out = Some(Ok(out));
    Ok(())
}

fn cast<T: bytemuck::Pod>(b: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(b)
        .map_err(|e| Error::invalid(format!("engine: a buffer of the wrong size or alignment ({e:?})")))
}

fn cast_mut<T: bytemuck::Pod>(b: &mut [u8]) -> Result<&mut [T]> {
    bytemuck::try_cast_slice_mut(b)
        .map_err(|e| Error::invalid(format!("engine: a buffer of the wrong size or alignment ({e:?})")))
}

/// The floating-point element types, through `f64`.
trait Float: bytemuck::Pod {
    fn get(self) -> f64;
    fn put(x: f64) -> Self;
}

impl Float for f32 {
    fn get(self) -> f64 {
        f64::from(self)
    }
    fn put(x: f64) -> Self {
        x as f32
    }
}
impl Float for f64 {
    fn get(self) -> f64 {
        self
    }
    fn put(x: f64) -> Self {
        x
    }
}
impl Float for f16 {
    fn get(self) -> f64 {
        self.to_f64()
    }
    fn put(x: f64) -> Self {
        f16::from_f64(x)
    }
}
impl Float for bf16 {
    fn get(self) -> f64 {
        self.to_f64()
    }
    fn put(x: f64) -> Self {
        bf16::from_f64(x)
    }
}

fn conv<S: Float, D: Float>(dst: &mut [u8], src: &[u8], f: f64) -> Result<()> {
    let (d, s) = (cast_mut::<D>(dst)?, cast::<S>(src)?);
    if d.len() != s.len() {
        return Err(Error::invalid("engine: fusion copy of unequal lengths (a bug)"));
    }
    if f == 1.0 {
        for (d, s) in d.iter_mut().zip(s) {
            *d = D::put(s.get());
        }
    } else {
        for (d, s) in d.iter_mut().zip(s) {
            *d = D::put(s.get() * f);
        }
    }
    Ok(())
}

/// `dst = src · f`, converting between element types (floating-point ones when they differ
/// or `f` is not 1).
fn convert(dst: &mut [u8], dd: DType, src: &[u8], sd: DType, f: f64) -> Result<()> {
    if dd == sd && f == 1.0 {
        if dst.len() != src.len() {
            return Err(Error::invalid("engine: fusion copy of unequal lengths (a bug)"));
        }
        dst.copy_from_slice(src);
        return Ok(());
    }
    macro_rules! to {
        ($s:ty) => {
            match dd {
                DType::F32 => conv::<$s, f32>(dst, src, f),
                DType::F64 => conv::<$s, f64>(dst, src, f),
                DType::F16 => conv::<$s, f16>(dst, src, f),
                DType::BF16 => conv::<$s, bf16>(dst, src, f),
                _ => Err(Error::invalid(format!("engine: cannot scale or convert {sd} to {dd}"))),
            }
        };
    }
    match sd {
        DType::F32 => to!(f32),
        DType::F64 => to!(f64),
        DType::F16 => to!(f16),
        DType::BF16 => to!(bf16),
        _ => Err(Error::invalid(format!("engine: cannot scale or convert {sd} to {dd}"))),
    }
}

/// Multiplies floating-point elements in place.
fn scale(dtype: DType, b: &mut [u8], f: f64) -> Result<()> {
    crate::types::scale_bytes(dtype, b, f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Compression;

    fn m(dtype: DType, n: u64, op: Reduction) -> Meta {
        Meta {
            kind: Kind::Allreduce,
            dtype,
            shape: vec![n],
            op,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            compression: Compression::None,
            group: 0,
            group_size: 0,
        }
    }

    #[test]
    fn fusion_respects_the_threshold_and_looks_past_misfits() {
        let a = m(DType::F32, 100, Reduction::Sum); // 400 bytes
        let b = m(DType::F64, 10, Reduction::Sum); // another type
        let c = m(DType::F32, 50, Reduction::Sum); // 200 bytes
        let d = m(DType::F32, 200, Reduction::Sum); // 800 bytes: over with a and c
        let e = m(DType::F32, 10, Reduction::Average); // another op
        let metas = [&a, &b, &c, &d, &e];
        assert_eq!(plan(&metas, 1000, usize::MAX), vec![vec![0, 2], vec![1], vec![3], vec![4]]);
        assert_eq!(plan(&metas, 2000, usize::MAX), vec![vec![0, 2, 3], vec![1], vec![4]]);
        // Threshold 0: no fusion.
        assert_eq!(plan(&metas, 0, usize::MAX), vec![vec![0], vec![1], vec![2], vec![3], vec![4]]);
        // Compression halves the bytes that count.
        let mut h = m(DType::F32, 250, Reduction::Sum);
        h.compression = Compression::F16;
        let h2 = h.clone();
        assert_eq!(plan(&[&h, &h2], 1000, usize::MAX), vec![vec![0, 1]]);
        assert_eq!(plan(&[&a, &h], 10_000, usize::MAX), vec![vec![0], vec![1]]);
        // Tensors above the size limit run alone; the others still fuse around them.
        assert_eq!(plan(&metas, 2000, 500), vec![vec![0, 2], vec![1], vec![3], vec![4]]);
    }

    #[test]
    fn conversion_and_scaling() {
        let src: Vec<f32> = vec![1.0, -2.5, 3.0];
        let mut half = vec![f16::ZERO; 3];
        convert(bytemuck::cast_slice_mut(&mut half), DType::F16, bytemuck::cast_slice(&src), DType::F32, 0.5).unwrap();
        assert_eq!(half, vec![f16::from_f32(0.5), f16::from_f32(-1.25), f16::from_f32(1.5)]);
        let mut back = vec![0f32; 3];
        convert(bytemuck::cast_slice_mut(&mut back), DType::F32, bytemuck::cast_slice(&half), DType::F16, 2.0).unwrap();
        assert_eq!(back, src);
        let mut ints = vec![1i32, 2];
        assert!(scale(DType::I32, bytemuck::cast_slice_mut(&mut ints), 2.0).is_err());
        let mut xs = vec![1.0f64, 4.0];
        scale(DType::F64, bytemuck::cast_slice_mut(&mut xs), 0.25).unwrap();
        assert_eq!(xs, vec![0.25, 1.0]);
    }
}
