//! The CUDA path: staged collectives on cudarc device buffers.
//!
//! **Streams.** Every call takes effect in order on the stream given to [`Cuda::new`] (the
//! stream the data is produced and consumed on): the call records an event on it and its
//! copies (on a staging stream of their own) wait for that event, so work queued on the stream
//! before the call is finished before the data is read; at the end the stream waits for an
//! event recorded after the last copy back, so work queued after the call sees the result. No
//! device-wide synchronise. The host thread returns once the last copy back has finished
//! (the pipeline waits for every copy it started); the exit event keeps the order on the stream
//! should that change.
//!
//! **Pieces.** A call is cut into the number of pieces `staging::Rates::pieces` gives for its
//! size, from costs measured at a `Cuda`'s first call (copies each way, a tiny host collective)
//! and agreed by the ranks (the largest of each figure), so every rank cuts every call alike.
//!
//! Ran on an NVIDIA H200 (`tests/cuda.rs`, the example, the benchmark: README, "What ran on a
//! GPU"); CI has no GPU and runs the pipeline in `staging.rs` on host-simulated device memory.

use super::staging::{self, Op, Rates, Staging};
use crate::algorithms::CollectiveOptions;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::types::{DType, Element, Reduction};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, PinnedHostSlice, result, sys,
};
use std::sync::Arc;
use std::time::Instant;

/// Bytes per pinned staging buffer (there are three).
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// Whether the CUDA driver library (`libcuda.so`) can be loaded on this machine. Everything
/// else in this module needs it; [`Cuda::new`] and [`default_stream`] check it and say so.
pub fn cuda_available() -> bool {
    // SAFETY: only tries to load the library by its known names; loading runs its initialisers,
    // which is what using CUDA at all requires.
    unsafe { sys::is_culib_present() }
}

fn cuda_error(what: impl std::fmt::Display, e: result::DriverError) -> Error {
    Error::io(format!("CUDA: {what}"), std::io::Error::other(format!("{e:?}")))
}

fn require_cuda() -> Result<()> {
    if cuda_available() {
        Ok(())
    } else {
        Err(Error::unsupported(
            "CUDA collectives on this machine (no CUDA driver library, libcuda.so, was found: no NVIDIA driver, or no \
             GPU)",
            None,
        ))
    }
}

/// The default stream of GPU `ordinal`, with clear errors where there is no CUDA driver or no
/// such GPU (instead of cudarc's panic when the library is missing).
pub fn default_stream(ordinal: usize) -> Result<Arc<CudaStream>> {
    require_cuda()?;
    let count = CudaContext::device_count().map_err(|e| cuda_error("counting GPUs", e))?;
    if ordinal >= count.max(0) as usize {
        return Err(Error::invalid(format!("no GPU {ordinal}: this machine has {count}")));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| cuda_error(format!("opening GPU {ordinal}"), e))?;
    Ok(ctx.default_stream())
}

/// Element types the CUDA collectives take: f32, f64, f16, bf16, i32, i64, u8.
pub trait CudaElement: Element + DeviceRepr {}
impl CudaElement for f32 {}
impl CudaElement for f64 {}
impl CudaElement for half::f16 {}
impl CudaElement for half::bf16 {}
impl CudaElement for i32 {}
impl CudaElement for i64 {}
impl CudaElement for u8 {}

/// Collectives of one [`Context`] on the buffers of one GPU stream: `CudaSlice<T>` and its
/// views (`slice_mut(a..b)` for part of a buffer), through cudarc's `DevicePtr` traits. Make it once and reuse it:
/// it holds the pinned staging buffers (three of [`DEFAULT_CHUNK_BYTES`], page-locked with
/// default flags, not write-combined: the CPU reads them). Its first call also measures what
/// pieces of a call cost (about a millisecond: a few copies each way and three tiny host
/// collectives) and agrees the figures with the other ranks inside that call: every rank's
/// first call of its `Cuda` must be the same call (as every call must), and the ranks' `Cuda`s
/// must have staging buffers of one size ([`with_chunk_bytes`](Self::with_chunk_bytes)), since
/// the buffers bound the pieces.
///
/// ```no_run
/// # fn main() -> ferrogloo::Result<()> {
/// use ferrogloo::gpu::{Cuda, default_stream};
/// use ferrogloo::{Context, Reduction, device::Device, rendezvous::HashStore};
/// let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
/// let stream = default_stream(0)?;
/// let mut grads = stream.clone_htod(&[1.0f32; 1024]).map_err(|e| ferrogloo::Error::invalid(format!("{e:?}")))?;
/// let mut cuda = Cuda::new(&ctx, stream)?;
/// cuda.allreduce(&mut grads, Reduction::Sum)?;
/// # Ok(()) }
/// ```
pub struct Cuda<'c> {
    ctx: &'c Context,
    stream: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    /// The pinned buffers (`ptrs` point into them).
    _pool: Vec<PinnedHostSlice<u8>>,
    ptrs: Vec<*mut u8>,
    chunk: usize,
    opts: CollectiveOptions,
    /// What pieces cost here, measured and agreed at the first call.
    rates: Option<Rates>,
}

impl<'c> Cuda<'c> {
    /// Collectives of `ctx` on buffers used on the default stream of GPU `ordinal`
    /// ([`default_stream`]). Builds with or without the cargo feature `cuda`: without it, this
    /// is [`Error::Unsupported`] naming the feature.
    pub fn on_gpu(ctx: &'c Context, ordinal: usize) -> Result<Self> {
        Self::new(ctx, default_stream(ordinal)?)
    }

    /// Collectives of `ctx` on buffers used on `stream`.
    pub fn new(ctx: &'c Context, stream: Arc<CudaStream>) -> Result<Self> {
        Self::with_chunk_bytes(ctx, stream, DEFAULT_CHUNK_BYTES)
    }

    /// [`Cuda::new`] with staging buffers of `chunk` bytes (at least 64 KiB).
    pub fn with_chunk_bytes(ctx: &'c Context, stream: Arc<CudaStream>, chunk: usize) -> Result<Self> {
        require_cuda()?;
        let chunk = chunk.max(64 << 10);
        let gpu = stream.context().clone();
        let copy = stream.fork().map_err(|e| cuda_error("creating the staging stream", e))?;
        let mut pool = Vec::with_capacity(staging::POOL);
        let mut ptrs = Vec::with_capacity(staging::POOL);
        for _ in 0..staging::POOL {
            // SAFETY: the memory is written by downloads before anything reads it.
            let mut p = unsafe { gpu.alloc_pinned_with_flags::<u8>(chunk, 0) }
                .map_err(|e| cuda_error(format!("allocating {chunk} bytes of pinned host memory"), e))?;
            ptrs.push(p.as_mut_ptr().map_err(|e| cuda_error("pinned memory", e))?);
            pool.push(p);
        }
        Ok(Cuda { ctx, stream, copy, _pool: pool, ptrs, chunk, opts: CollectiveOptions::default(), rates: None })
    }

    /// The options the host collectives run with (algorithm, tag, timeout).
    pub fn set_options(&mut self, opts: CollectiveOptions) {
        self.opts = opts;
    }

    fn check_gpu<T>(&self, what: &str, buf: &impl DeviceSlice<T>) -> Result<()> {
        let (theirs, ours) = (buf.stream().context().ordinal(), self.stream.context().ordinal());
        if theirs != ours {
            return Err(Error::invalid(format!("{what}: the buffer is on GPU {theirs}, the stream on GPU {ours}")));
        }
        Ok(())
    }

    /// Runs `op` with `src` as input and `dst` as output device addresses.
    fn staged(&mut self, op: Op, dtype: DType, len: usize, src: (u64, usize), dst: (u64, usize)) -> Result<()> {
        // The raw copies below need the GPU's context current on this thread.
        self.stream.context().bind_to_thread().map_err(|e| cuda_error("binding the GPU's context", e))?;
        // Measured (at the first call) before the staging stream waits for the user's work,
        // so that the timed copies wait for none of it (with cudarc's event tracking, taking
        // the buffer's address may already have made the staging stream wait for its last
        // writer: the first of the three timings then runs late, not the best).
        let rates = self.rates()?;
        // The copies wait for the work already queued on the user's stream.
        let entry = self.stream.record_event(None).map_err(|e| cuda_error("recording an event", e))?;
        self.copy.wait(&entry).map_err(|e| cuda_error("ordering the staging stream", e))?;
        let mut s = CudaStaging { copy: &self.copy, src, dst, ptrs: &self.ptrs, chunk: self.chunk };
        let outcome = staging::collective(self.ctx, &mut s, op, dtype, len, &self.opts, Some(&rates));
        // Later work on the user's stream waits for the copies back.
        let exit = self.copy.record_event(None).map_err(|e| cuda_error("recording an event", e))?;
        self.stream.wait(&exit).map_err(|e| cuda_error("ordering the user's stream", e))?;
        outcome
    }

    /// What a piece of a staged call costs here: measured at the first call (a few copies
    /// between the GPU and the pool, a few tiny host collectives; about a millisecond) and the
    /// largest of every rank's figures taken, so that all ranks cut every call alike.
    fn rates(&mut self) -> Result<Rates> {
        if let Some(r) = self.rates {
            return Ok(r);
        }
        // Every rank enters the agreement, also one whose measurement failed (it would
        // otherwise leave the others waiting in it): that one offers infinite fixed costs,
        // which make every call one piece per pool buffer on every rank, as before pieces
        // were measured.
        let (down, up) = self.time_copies().unwrap_or_else(|e| {
            tracing::warn!(rank = self.ctx.rank(), error = %e, "GPU staging: the copies could not be timed; \
                pieces as large as the staging buffers");
            ((f64::INFINITY, 0.0), (f64::INFINITY, 0.0))
        });
        let r = Rates::agree(self.ctx, down, up, &self.opts)?;
        tracing::debug!(
            rank = self.ctx.rank(),
            "GPU staging: copies from the GPU {:.1} µs + {:.1} GB/s, to it {:.1} µs + {:.1} GB/s, a host collective \
             {:.1} µs: 1 MiB allreduces in {} pieces, 64 MiB in {}",
            r.down.0 * 1e6,
            1e-9 / r.down.1,
            r.up.0 * 1e6,
            1e-9 / r.up.1,
            r.host * 1e6,
            r.pieces(1 << 20, 1 << 20),
            r.pieces(64 << 20, 64 << 20)
        );
        self.rates = Some(r);
        Ok(r)
    }

    /// The fixed time and time per byte of a copy from the GPU and of one to it, between a
    /// scratch device buffer and the first pool buffer (the best of three of each).
    fn time_copies(&self) -> Result<((f64, f64), (f64, f64))> {
        let (small, big) = (4096usize, self.chunk);
        let scratch = self.copy.alloc_zeros::<u8>(big).map_err(|e| cuda_error(format!("allocating {big} bytes"), e))?;
        let (dev, _guard) = scratch.device_ptr(&self.copy);
        let best = |down: bool, len: usize| -> Result<f64> {
            let mut t = f64::INFINITY;
            for _ in 0..3 {
                let start = Instant::now();
                // SAFETY: pool buffer 0 holds `chunk >= len` bytes and no staged call is running
                // (this runs before one, on its thread); the scratch buffer holds `big >= len`
                // bytes and lives until after the stream's synchronise below.
                unsafe {
                    if down {
                        let host = std::slice::from_raw_parts_mut(self.ptrs[0], len);
                        result::memcpy_dtoh_async(host, dev, self.copy.cu_stream())
                    } else {
                        let host = std::slice::from_raw_parts(self.ptrs[0], len);
                        result::memcpy_htod_async(dev, host, self.copy.cu_stream())
                    }
                }
                .map_err(|e| cuda_error(format!("timing a copy of {len} bytes"), e))?;
                self.copy.synchronize().map_err(|e| cuda_error("timing a copy", e))?;
                t = t.min(start.elapsed().as_secs_f64());
            }
            Ok(t)
        };
        let line = |down: bool| -> Result<(f64, f64)> {
            let (ts, tb) = (best(down, small)?, best(down, big)?);
            Ok((ts, ((tb - ts) / (big - small) as f64).max(0.0)))
        };
        Ok((line(true)?, line(false)?))
    }

    /// Allreduce of `buf` in place.
    pub fn allreduce<T: CudaElement>(&mut self, buf: &mut impl DevicePtrMut<T>, op: Reduction) -> Result<()> {
        self.check_gpu("allreduce", buf)?;
        let len = buf.num_bytes();
        let copy = self.copy.clone();
        let (ptr, _sync) = buf.device_ptr_mut(&copy);
        self.staged(Op::Allreduce(op), T::DTYPE, len, (ptr, len), (ptr, len))
    }

    /// Broadcast of `buf` from `root`.
    pub fn broadcast<T: CudaElement>(&mut self, buf: &mut impl DevicePtrMut<T>, root: usize) -> Result<()> {
        self.check_gpu("broadcast", buf)?;
        let len = buf.num_bytes();
        let copy = self.copy.clone();
        let (ptr, _sync) = buf.device_ptr_mut(&copy);
        self.staged(Op::Broadcast { root }, T::DTYPE, len, (ptr, len), (ptr, len))
    }

    /// Reduce of `buf` to `root` (only the root's buffer changes).
    pub fn reduce<T: CudaElement>(&mut self, buf: &mut impl DevicePtrMut<T>, root: usize, op: Reduction) -> Result<()> {
        self.check_gpu("reduce", buf)?;
        let len = buf.num_bytes();
        let copy = self.copy.clone();
        let (ptr, _sync) = buf.device_ptr_mut(&copy);
        self.staged(Op::Reduce { root, op }, T::DTYPE, len, (ptr, len), (ptr, len))
    }

    /// Allgather: every rank's `input` into `output` (size × input's length), in rank order.
    pub fn allgather<T: CudaElement>(
        &mut self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.check_gpu("allgather input", input)?;
        self.check_gpu("allgather output", output)?;
        let n = self.ctx.size();
        if output.len() != n * input.len() {
            return Err(Error::invalid(format!(
                "allgather: the output holds {} elements, {n} ranks × {} input elements need {}",
                output.len(),
                input.len(),
                n * input.len()
            )));
        }
        let (ilen, olen) = (input.num_bytes(), output.num_bytes());
        let copy = self.copy.clone();
        let (iptr, _si) = input.device_ptr(&copy);
        let (optr, _so) = output.device_ptr_mut(&copy);
        self.staged(Op::Allgather, T::DTYPE, ilen, (iptr, ilen), (optr, olen))
    }

    /// Reduce-scatter: `input` (size × output's length) reduced, this rank's block in `output`.
    pub fn reduce_scatter<T: CudaElement>(
        &mut self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        op: Reduction,
    ) -> Result<()> {
        self.check_gpu("reduce_scatter input", input)?;
        self.check_gpu("reduce_scatter output", output)?;
        let n = self.ctx.size();
        if input.len() != n * output.len() {
            return Err(Error::invalid(format!(
                "reduce_scatter: the input holds {} elements, {n} ranks × {} output elements need {}",
                input.len(),
                output.len(),
                n * output.len()
            )));
        }
        let (ilen, olen) = (input.num_bytes(), output.num_bytes());
        let copy = self.copy.clone();
        let (iptr, _si) = input.device_ptr(&copy);
        let (optr, _so) = output.device_ptr_mut(&copy);
        self.staged(Op::ReduceScatter(op), T::DTYPE, ilen, (iptr, ilen), (optr, olen))
    }

    /// [`allreduce`](Self::allreduce) on a byte buffer holding elements of `dtype` (the
    /// runtime-typed twin, for bindings that learn the type at run time).
    pub fn allreduce_bytes(&mut self, buf: &mut impl DevicePtrMut<u8>, dtype: DType, op: Reduction) -> Result<()> {
        self.check_gpu("allreduce", buf)?;
        let len = buf.len();
        let copy = self.copy.clone();
        let (ptr, _sync) = buf.device_ptr_mut(&copy);
        self.staged(Op::Allreduce(op), dtype, len, (ptr, len), (ptr, len))
    }

    /// [`broadcast`](Self::broadcast) on bytes of `dtype`.
    pub fn broadcast_bytes(&mut self, buf: &mut impl DevicePtrMut<u8>, dtype: DType, root: usize) -> Result<()> {
        self.check_gpu("broadcast", buf)?;
        let len = buf.len();
        let copy = self.copy.clone();
        let (ptr, _sync) = buf.device_ptr_mut(&copy);
        self.staged(Op::Broadcast { root }, dtype, len, (ptr, len), (ptr, len))
    }

    /// [`reduce`](Self::reduce) on bytes of `dtype`.
    pub fn reduce_bytes(
        &mut self,
        buf: &mut impl DevicePtrMut<u8>,
        dtype: DType,
        root: usize,
        op: Reduction,
    ) -> Result<()> {
        self.check_gpu("reduce", buf)?;
        let len = buf.len();
        let copy = self.copy.clone();
        let (ptr, _sync) = buf.device_ptr_mut(&copy);
        self.staged(Op::Reduce { root, op }, dtype, len, (ptr, len), (ptr, len))
    }

    /// [`allgather`](Self::allgather) on bytes of `dtype`.
    pub fn allgather_bytes(
        &mut self,
        input: &impl DevicePtr<u8>,
        output: &mut impl DevicePtrMut<u8>,
        dtype: DType,
    ) -> Result<()> {
        self.check_gpu("allgather input", input)?;
        self.check_gpu("allgather output", output)?;
        let n = self.ctx.size();
        if output.len() != n * input.len() {
            return Err(Error::invalid(format!(
                "allgather: the output holds {} bytes, {n} ranks × {} input bytes need {}",
                output.len(),
                input.len(),
                n * input.len()
            )));
        }
        let (ilen, olen) = (input.len(), output.len());
        let copy = self.copy.clone();
        let (iptr, _si) = input.device_ptr(&copy);
        let (optr, _so) = output.device_ptr_mut(&copy);
        self.staged(Op::Allgather, dtype, ilen, (iptr, ilen), (optr, olen))
    }

    /// [`reduce_scatter`](Self::reduce_scatter) on bytes of `dtype`.
    pub fn reduce_scatter_bytes(
        &mut self,
        input: &impl DevicePtr<u8>,
        output: &mut impl DevicePtrMut<u8>,
        dtype: DType,
        op: Reduction,
    ) -> Result<()> {
        self.check_gpu("reduce_scatter input", input)?;
        self.check_gpu("reduce_scatter output", output)?;
        let n = self.ctx.size();
        if input.len() != n * output.len() {
            return Err(Error::invalid(format!(
                "reduce_scatter: the input holds {} bytes, {n} ranks × {} output bytes need {}",
                input.len(),
                output.len(),
                n * output.len()
            )));
        }
        let (ilen, olen) = (input.len(), output.len());
        let copy = self.copy.clone();
        let (iptr, _si) = input.device_ptr(&copy);
        let (optr, _so) = output.device_ptr_mut(&copy);
        self.staged(Op::ReduceScatter(op), dtype, ilen, (iptr, ilen), (optr, olen))
    }

    /// The stream the calls are ordered on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Bytes per staging buffer.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }
}

/// Device memory of one staged call, copied on the staging stream.
struct CudaStaging<'a> {
    copy: &'a CudaStream,
    src: (u64, usize),
    dst: (u64, usize),
    ptrs: &'a [*mut u8],
    chunk: usize,
}

impl Staging for CudaStaging<'_> {
    type Ticket = CudaEvent;

    fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    fn buffer(&mut self, i: usize) -> *mut u8 {
        self.ptrs[i]
    }

    fn download(&mut self, dev: usize, buf: usize, host: usize, len: usize) -> Result<CudaEvent> {
        if dev + len > self.src.1 || host + len > self.chunk {
            return Err(Error::invalid(format!("a download of {len} bytes at {dev} outside the buffers")));
        }
        // SAFETY: the pool buffer holds `chunk` bytes (checked) and the pipeline does not touch
        // it until this copy's event completed; the device range lies in the input (checked),
        // which the caller holds borrowed for the whole call.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(self.ptrs[buf].add(host), len);
            result::memcpy_dtoh_async(dst, self.src.0 + dev as u64, self.copy.cu_stream())
        }
        .map_err(|e| cuda_error(format!("copying {len} bytes from the GPU"), e))?;
        self.copy.record_event(None).map_err(|e| cuda_error("recording an event", e))
    }

    fn upload(&mut self, buf: usize, host: usize, dev: usize, len: usize) -> Result<CudaEvent> {
        if dev + len > self.dst.1 || host + len > self.chunk {
            return Err(Error::invalid(format!("an upload of {len} bytes at {dev} outside the buffers")));
        }
        // SAFETY: as for downloads, the other way.
        unsafe {
            let src = std::slice::from_raw_parts(self.ptrs[buf].add(host), len);
            result::memcpy_htod_async(self.dst.0 + dev as u64, src, self.copy.cu_stream())
        }
        .map_err(|e| cuda_error(format!("copying {len} bytes to the GPU"), e))?;
        self.copy.record_event(None).map_err(|e| cuda_error("recording an event", e))
    }

    fn wait(&mut self, t: CudaEvent) -> Result<()> {
        t.synchronize().map_err(|e| cuda_error("waiting for a copy", e))
    }
}
