//! # ferrogloo
//!
//! Collective communication for Rust programs, in the style of Facebook's Gloo: processes find
//! each other through a key-value [store](rendezvous), connect a full mesh of TCP pairs driven
//! by a mio event loop (a [`Device`]), and exchange buffers through a [`Context`].
//!
//! ```
//! use ferrogloo::{Context, device::Device, rendezvous::HashStore};
//! use std::thread;
//!
//! // Four ranks as threads of one process, meeting through an in-process store.
//! let store = HashStore::new();
//! let device = Device::loopback()?;
//! let sums: Vec<u64> = thread::scope(|s| {
//!     let handles: Vec<_> = (0..4)
//!         .map(|rank| {
//!             let (store, device) = (&store, &device);
//!             s.spawn(move || -> ferrogloo::Result<u64> {
//!                 let ctx = Context::builder(rank, 4).connect(store, device)?;
//!                 // Pass a token around the ring, each rank adding its rank.
//!                 let (right, left) = ((rank + 1) % 4, (rank + 3) % 4);
//!                 let mut token = [0u64];
//!                 if rank == 0 {
//!                     ctx.send(right, 0, &token)?;
//!                     ctx.recv(left, 0, &mut token)?;
//!                 } else {
//!                     ctx.recv(left, 0, &mut token)?;
//!                     token[0] += rank as u64;
//!                     ctx.send(right, 0, &token)?;
//!                 }
//!                 ctx.barrier()?;
//!                 Ok(token[0])
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect::<ferrogloo::Result<_>>()
//! })?;
//! assert_eq!(sums[0], 1 + 2 + 3);
//! # Ok::<(), ferrogloo::Error>(())
//! ```
//!
//! Ranks that are separate processes use a [`FileStore`](rendezvous::FileStore) on a shared
//! directory or an [`HttpStore`](rendezvous::HttpStore); [`launch`] starts N local rank
//! processes for you.
//!
//! ## Contracts
//! - Every blocking call has a deadline (the context's timeout unless given) and ends with
//!   [`Error::Timeout`] naming what is missing.
//! - A peer that dies makes operations involving it fail with [`Error::PeerClosed`].
//! - Connections carry a handshake (magic, version, context id, ranks, optional HMAC secret);
//!   strangers are refused and logged through `tracing` while the job goes on.
//! - Memory is bounded: receives land in the caller's buffer; early arrivals are capped per pair.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod algorithms;
mod collectives;
pub mod context;
pub mod device;
pub mod error;
pub mod launch;
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
                frame[16] = 9; // a small length
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

pub use algorithms::{Algorithm, CollectiveOptions};
pub use context::{Context, ContextBuilder, RecvRequest, Scope, SendRequest};
pub use device::Device;
pub use error::{Error, Result};
pub use types::{DType, Element, ReduceOp, bf16, f16};
