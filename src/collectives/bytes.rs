//! The runtime-typed collectives: the typed calls on bytes holding elements of a [`DType`],
//! for engines and bindings that learn the element type at run time.

use crate::algorithms::CollectiveOptions;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::types::{DType, Element, Reduction};
use std::borrow::Cow;

/// The runtime-typed collectives: the same calls on bytes holding elements of a [`DType`] (in
/// native byte order), for engines and bindings that learn the type at run time. Lengths are
/// in bytes and must be whole elements. A buffer not aligned for its element type works too,
/// through an aligned copy (allocate with the type's alignment to avoid it).
///
/// ```
/// # use ferrogloo::{Context, DType, Reduction, CollectiveOptions, device::Device, rendezvous::HashStore};
/// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
/// let mut grads: Vec<u8> = [1.5f32, 2.0].iter().flat_map(|x| x.to_ne_bytes()).collect();
/// ctx.allreduce_bytes(&mut grads, DType::F32, Reduction::Sum, &CollectiveOptions::default())?;
/// assert_eq!(grads[..4], (1.5 * ctx.size() as f32).to_ne_bytes());
/// # Ok::<(), ferrogloo::Error>(())
/// ```
impl Context {
    /// [`allreduce_with`](Self::allreduce_with) on bytes of `dtype`.
    /// [`Reduction::Average`] sums, then scales every rank's result by 1 / [`size`](Self::size).
    pub fn allreduce_bytes(&self, buf: &mut [u8], dtype: DType, op: Reduction, opts: &CollectiveOptions) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            typed_mut::<T, _>(buf, "allreduce", |b| self.allreduce_with(b, op, opts))
        })
    }

    /// [`allreduce_many`](Self::allreduce_many) on bytes of `dtype`: each buffer a whole number
    /// of elements. Buffers not aligned for `dtype` are copied into aligned ones and back.
    pub fn allreduce_many_bytes(
        &self,
        bufs: &mut [&mut [u8]],
        dtype: DType,
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        self.allreduce_parts_bytes(bufs, dtype, op, opts, false)
    }

    /// [`allreduce_many_bytes`](Self::allreduce_many_bytes), with `alike` as for
    /// [`allreduce_parts`](Self::allreduce_parts).
    pub(crate) fn allreduce_parts_bytes(
        &self,
        bufs: &mut [&mut [u8]],
        dtype: DType,
        op: Reduction,
        opts: &CollectiveOptions,
        alike: bool,
    ) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            for b in bufs.iter() {
                whole::<T>(b.len(), "allreduce_many")?;
            }
            if bufs.iter().all(|b| bytemuck::try_cast_slice::<u8, T>(b).is_ok()) {
                let mut typed: Vec<&mut [T]> = bufs.iter_mut().map(|b| bytemuck::cast_slice_mut::<u8, T>(b)).collect();
                self.allreduce_parts(&mut typed, op, opts, alike)
            } else {
                let mut copies: Vec<Vec<T>> = bufs.iter().map(|b| bytemuck::pod_collect_to_vec(b)).collect();
                let mut typed: Vec<&mut [T]> = copies.iter_mut().map(Vec::as_mut_slice).collect();
                self.allreduce_parts(&mut typed, op, opts, alike)?;
                for (b, c) in bufs.iter_mut().zip(&copies) {
                    b.copy_from_slice(bytemuck::cast_slice(c));
                }
                Ok(())
            }
        })
    }

    /// [`reduce_scatter`](Self::reduce_scatter) on bytes of `dtype`.
    /// [`Reduction::Average`] sums, then scales every rank's block by 1 / [`size`](Self::size).
    pub fn reduce_scatter_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            let input = typed::<T>(input, "reduce_scatter")?;
            typed_mut::<T, _>(output, "reduce_scatter", |o| self.reduce_scatter(&input, o, op, opts))
        })
    }

    /// [`allgather`](Self::allgather) on bytes of `dtype`.
    pub fn allgather_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            let input = typed::<T>(input, "allgather")?;
            typed_mut::<T, _>(output, "allgather", |o| self.allgather(&input, o, opts))
        })
    }

    /// [`broadcast`](Self::broadcast) on bytes of `dtype`.
    pub fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize, opts: &CollectiveOptions) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            typed_mut::<T, _>(buf, "broadcast", |b| self.broadcast(b, root, opts))
        })
    }

    /// [`reduce`](Self::reduce) on bytes of `dtype`.
    /// [`Reduction::Average`] sums, then scales the root's result by 1 / [`size`](Self::size).
    pub fn reduce_bytes(
        &self,
        buf: &mut [u8],
        dtype: DType,
        root: usize,
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            typed_mut::<T, _>(buf, "reduce", |b| self.reduce(b, root, op, opts))
        })
    }

    /// [`gather`](Self::gather) on bytes of `dtype`.
    pub fn gather_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        root: usize,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            let input = typed::<T>(input, "gather")?;
            typed_mut::<T, _>(output, "gather", |o| self.gather(&input, o, root, opts))
        })
    }

    /// [`scatter`](Self::scatter) on bytes of `dtype`.
    pub fn scatter_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        root: usize,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            let input = typed::<T>(input, "scatter")?;
            typed_mut::<T, _>(output, "scatter", |o| self.scatter(&input, o, root, opts))
        })
    }

    /// [`alltoall`](Self::alltoall) on bytes of `dtype`.
    pub fn alltoall_bytes(
        &self,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        crate::dispatch_dtype!(dtype, T => {
            let input = typed::<T>(input, "alltoall")?;
            typed_mut::<T, _>(output, "alltoall", |o| self.alltoall(&input, o, opts))
        })
    }
}

/// `bytes` viewed as elements of `T`: borrowed when aligned, else an aligned copy.
fn typed<'a, T: Element>(bytes: &'a [u8], what: &str) -> Result<Cow<'a, [T]>> {
    whole::<T>(bytes.len(), what)?;
    Ok(crate::types::view_or_copy(bytes))
}

/// Runs `f` on `bytes` viewed as elements of `T`: in place when aligned, else on an aligned
/// copy that is copied back afterwards.
fn typed_mut<T: Element, R>(bytes: &mut [u8], what: &str, f: impl FnOnce(&mut [T]) -> Result<R>) -> Result<R> {
    whole::<T>(bytes.len(), what)?;
    if let Ok(t) = bytemuck::try_cast_slice_mut::<u8, T>(bytes) {
        return f(t);
    }
    let mut copy: Vec<T> = bytemuck::pod_collect_to_vec(bytes);
    let r = f(&mut copy);
    bytes.copy_from_slice(bytemuck::cast_slice(&copy));
    r
}

/// Checks that `len` bytes are whole elements of `T`.
fn whole<T: Element>(len: usize, what: &str) -> Result<()> {
    let size = std::mem::size_of::<T>();
    if !len.is_multiple_of(size) {
        return Err(Error::invalid(format!(
            "{what}: {len} bytes are not a whole number of {}-byte {} elements",
            size,
            T::DTYPE
        )));
    }
    Ok(())
}
