//! Collectives on GPU memory.
//!
//! With the cargo feature `cuda`, [`Cuda`] runs allreduce, allgather, broadcast,
//! reduce-scatter and reduce on CUDA device buffers (cudarc's `CudaSlice` and views), staged
//! through pinned host memory in chunks so that PCIe copies overlap the network (see
//! `staging.rs`). The CUDA library is loaded when first used, so the feature builds and runs on
//! machines without CUDA; there, [`Cuda::on_gpu`] is an error saying what is missing.
//!
//! Without the feature the module is a stub, as the ibverbs transport is: [`cuda_available`]
//! is `false` and [`Cuda::on_gpu`] is [`Error::Unsupported`](crate::Error::Unsupported) naming
//! the feature, so a program that tries the GPU and falls back to host memory builds either way.
//!
//! ```
//! # use ferrogloo::{Context, device::Device, rendezvous::HashStore};
//! let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
//! match ferrogloo::gpu::Cuda::on_gpu(&ctx, 0) {
//!     Ok(_cuda) => println!("collectives on GPU 0"),
//!     Err(e) => println!("host memory instead: {e}"),
//! }
//! # Ok::<(), ferrogloo::Error>(())
//! ```

pub(crate) mod staging;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cuda::{Cuda, CudaElement, DEFAULT_CHUNK_BYTES, cuda_available, default_stream};
/// The cudarc crate these collectives take buffers of (the same version, for `CudaSlice`,
/// `CudaStream` and friends).
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cudarc;

#[cfg(not(feature = "cuda"))]
pub use stub::{Cuda, cuda_available};

/// What the module holds without the cargo feature `cuda`.
#[cfg(not(feature = "cuda"))]
mod stub {
    use crate::context::Context;
    use crate::error::{Error, Result};

    /// Whether CUDA can be used: never, without the cargo feature `cuda`.
    pub fn cuda_available() -> bool {
        false
    }

    /// Collectives on GPU memory: without the cargo feature `cuda` there is no way to make one.
    #[derive(Debug)]
    pub struct Cuda<'c> {
        _ctx: &'c Context,
        _none: std::convert::Infallible,
    }

    impl<'c> Cuda<'c> {
        /// [`Error::Unsupported`] naming the cargo feature `cuda`, which this build lacks.
        pub fn on_gpu(_ctx: &'c Context, ordinal: usize) -> Result<Self> {
            Err(Error::unsupported(format!("collectives on GPU {ordinal}'s memory"), Some("cuda")))
        }
    }

    #[cfg(test)]
    mod tests {
        use crate::device::Device;
        use crate::rendezvous::HashStore;
        use crate::{Context, Error};

        #[test]
        fn without_the_feature_the_gpu_is_refused_naming_it() {
            let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process()).unwrap();
            assert!(!super::cuda_available());
            match super::Cuda::on_gpu(&ctx, 0) {
                Err(Error::Unsupported { what, feature }) => {
                    assert!(what.contains("GPU 0"), "{what}");
                    assert_eq!(feature.as_deref(), Some("cuda"));
                }
                other => panic!("expected Unsupported naming the feature, got {other:?}"),
            }
        }
    }
}
