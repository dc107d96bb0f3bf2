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
pub(crate) mod transport;
pub mod types;

pub use algorithms::{Algorithm, CollectiveOptions};
pub use context::{Context, ContextBuilder, RecvRequest, Scope, SendRequest};
pub use device::Device;
pub use error::{Error, Result};
pub use types::{DType, Element, ReduceOp, bf16, f16};
