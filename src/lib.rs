#![doc = include_str!("../README.md")]
//!
//! # Layers
//!
//! Each module depends only on those listed after it:
//!
//! - [`Context`] (`context`): rank, size, rendezvous through a [store](rendezvous), sub-groups,
//!   point-to-point calls and the collectives (typed and runtime-typed).
//! - `algorithms`: ring, halving-doubling, trees… written against a communicator (the group of
//!   ranks, posting and waiting), never against a backend.
//! - `transport`: the contract every backend meets (endpoints, address blobs, pairs, buffer
//!   descriptors, progress), the matching of receives and messages shared by every backend, and
//!   the backends: TCP (a mio event loop per [`Device`]) and in-process.
//! - [`device`]: which backend, where it listens, which host it is on.
//! - [`rendezvous`]: the key-value stores ranks meet through.
//! - [`credentials`]: the job's secret and store token, from the environment.
//! - [`types`], [`error`]: element types, reductions, one error enum.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod algorithms;
mod collectives;
mod comm;
pub mod context;
pub mod credentials;
pub mod device;
pub mod engine;
pub mod error;
pub mod gpu;
mod groups;
pub mod launch;
mod mesh;
pub mod ps;
pub mod rendezvous;
mod sync;
pub(crate) mod transport;
pub mod types;

/// Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`; not a stable API).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use crate::transport::tcp::frame::{FrameHeader, HEADER_LEN};
    use crate::transport::tcp::handshake::{ACK_LEN, Ack, HELLO_LEN, Hello};

    /// Decodes `data` as a frame header, a hello and an ack (whatever prefix fits); whatever
    /// decodes must encode back to the same bytes, except where the decoder ignores reserved
    /// bytes. Panics only on a decoder bug.
    pub fn wire(data: &[u8]) {
        if let Some(b) = data.first_chunk::<HEADER_LEN>()
            && let Ok(h) = FrameHeader::decode(b)
        {
            assert_eq!(&h.encode(), b, "frame header does not round-trip");
        }
        if let Some(b) = data.first_chunk::<HELLO_LEN>()
            && let Ok(h) = Hello::decode(b)
        {
            assert_eq!(Hello::decode(&h.encode()).ok(), Some(h), "hello does not round-trip");
        }
        if let Some(b) = data.first_chunk::<ACK_LEN>()
            && let Ok(a) = Ack::decode(b)
        {
            assert_eq!(Ack::decode(&a.encode()).ok(), Some(a), "ack does not round-trip");
        }
    }

    #[cfg(test)]
    mod tests {
        use proptest::prelude::*;

        proptest! {
            // The fuzz target's body on random input, and on valid openings with bytes flipped
            // (random bytes alone rarely pass the magic and kind checks).
            #[test]
            fn the_fuzz_target_holds_on_random_input(data in proptest::collection::vec(any::<u8>(), 0..100)) {
                super::wire(&data);
            }

            #[test]
            fn the_fuzz_target_holds_on_mutated_valid_input(
                flips in proptest::collection::vec((0usize..64, any::<u8>()), 0..4),
                kind in 1u8..=2,
            ) {
                let mut frame = vec![kind, 0, 0, 0];
                frame.resize(64, 0);
                frame[24] = 11; // a small length
                let mut hello = b"FGLO\x01\x00".to_vec();
                hello.resize(64, 0);
                for (i, x) in &flips {
                    frame[*i] ^= x;
                    hello[*i] ^= x;
                }
                super::wire(&frame);
                super::wire(&hello);
            }
        }
    }
}

pub use algorithms::CollectiveOptions;
pub use comm::{BytesRequest, RecvRequest, Scope, SendRequest};
pub use context::{Context, ContextBuilder};
pub use device::Device;
pub use error::{Error, Result};
pub use types::{Algorithm, DType, Element, ReduceOp, Reduction, bf16, f16};
