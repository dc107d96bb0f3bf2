//! Collectives on GPU memory.
//!
//! With the cargo feature `cuda`, `Cuda` runs allreduce, allgather, broadcast,
//! reduce-scatter and reduce on CUDA device buffers (cudarc's `CudaSlice` and views), staged
//! through pinned host memory in chunks so that PCIe copies overlap the network (see
//! `staging.rs`). The CUDA library is loaded when first used, so the feature builds and runs on
//! machines without CUDA; there, `Cuda::new` is an error saying what is missing.
//!
//! Without the feature this module only holds the staging pipeline (crate-internal).

pub(crate) mod staging;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::{Cuda, CudaElement, DEFAULT_CHUNK_BYTES, cuda_available, default_stream};
/// The cudarc crate these collectives take buffers of (the same version, for `CudaSlice`,
/// `CudaStream` and friends).
#[cfg(feature = "cuda")]
pub use cudarc;
