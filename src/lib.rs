#![doc = include_str!("../README.md")]
//!
//! # Layers
//!
//! Each layer uses only those below it (`.ci/module_cycles.py` refuses an import circle):
//!
//! - **Binaries** (the `ferrogloo-cli` crate): `ferrogloo-run` (the launcher),
//!   `ferrogloo-bench`, `ferrogloo-store-server`.
//! - [`engine`]: named asynchronous collectives negotiated across ranks (Horovod's core): a
//!   sans-IO controller (response cache, coordinator, stall inspector) driven by a thin I/O
//!   loop, fusion, timeline, join, process sets. [`ps`]: the parameter server (ps-lite's
//!   push/pull), in files for its config, rendezvous, worker, server and handlers.
//!   [`launch`]: [`RankEnv::from_env`](launch::RankEnv::from_env) for jobs started by
//!   torchrun, horovodrun, mpirun, Slurm or `ferrogloo-run`, spawning with lifelines, and the
//!   elastic protocol. [`gpu`]: collectives on CUDA buffers (feature `cuda`; a stub without).
//! - [`Context`] (`context`, `collectives`, `groups`): rank, size, sub-groups, point-to-point
//!   calls and the collectives (typed, runtime-typed on bytes, custom folds).
//! - [`algorithms`]: ring, halving-doubling, recursive doubling, trees, the shared-memory area
//!   and the hierarchical allreduce, on safe borrows through a communicator's [`Scope`].
//! - `comm`: the communicator every upper layer uses: scopes, waits with deadlines,
//!   persistent receives and waits for any of several, sequence numbers, abort. `mesh`: forming
//!   a mesh of any backend through a store.
//! - [`device`]: a [`Device`] is one backend object and a host identity.
//! - `transport`: the contract every backend meets (backend, endpoint, address blob, pair,
//!   progress), the matching of receives and messages, one sans-IO handshake for every backend,
//!   and the backends: TCP (a mio event loop per [`Device`]), shared memory, ibverbs (feature
//!   `ibverbs`; a stub without), in-process, and the one that combines a same-host backend
//!   with a remote one.
//! - [`rendezvous`]: the stores ranks meet through (file, prefix, in-process, Horovod's HTTP,
//!   PyTorch's TCPStore), and [`credentials`]: the job's secret and store token.
//! - [`config`]: every environment variable ferrogloo reads, named once, and the one place the
//!   environment is read.
//! - [`types`], [`error`], `codec`: element types and the one reduction type, the one error
//!   enum, the one codec of every wire type.
#![deny(unsafe_op_in_unsafe_fn)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

pub mod algorithms;
mod codec;
mod collectives;
mod comm;
pub mod config;
pub mod context;
pub mod cost;
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
mod survive;
mod sync;
pub(crate) mod transport;
pub mod types;

/// Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`; not a stable API).
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use crate::transport::handshake::codec::{Codec, Reader, decode_all, to_vec};
    use crate::transport::handshake::messages::{Message, Status};
    use crate::transport::handshake::{BackendKind, Dial, Event, Handshake, Local};
    use crate::transport::tcp::frame::{FrameHeader, HEADER_LEN};

    /// Decodes `data` as a frame header, as a handshake message, as the shared-memory and
    /// ibverbs pairs' per-message headers and as their lifelines' abort messages (whatever
    /// prefix fits); whatever decodes must encode back to the same bytes. Then feeds `data` to both sides of
    /// a handshake, with and without a secret: they may refuse, never panic, never ask for more
    /// than a message holds, and never finish on bytes that did not prove the secret. Panics
    /// only on a bug.
    pub fn wire(data: &[u8]) {
        if let Some(b) = data.first_chunk::<HEADER_LEN>()
            && let Ok(h) = FrameHeader::decode(b)
        {
            assert_eq!(&h.encode(), b, "frame header does not round-trip");
        }
        if let Ok(m) = Reader::new(data).get::<Message>() {
            let bytes = to_vec(&m);
            assert_eq!(&data[..bytes.len().min(data.len())], &bytes[..], "handshake message does not round-trip");
        }
        per_message(data);
        for (secret, kind) in [None, Some(b"k".to_vec())]
            .into_iter()
            .flat_map(|s| [BackendKind::Tcp, BackendKind::Shm].map(|k| (s.clone(), k)))
        {
            let local = Local { ctx: [1; 16], rank: 1, size: 2, secret: secret.clone() };
            let connector = Handshake::connect(Dial {
                kind,
                local: local.clone(),
                to: 0,
                lane: 0,
                address: b"a",
                payload: vec![1, 2, 3],
                nonce: [2; 16],
            });
            let acceptor = Handshake::accept(kind, [3; 16]);
            let local = Local { rank: 0, ..local };
            for mut hs in [connector, acceptor] {
                let mut fed = 0;
                for _ in 0..64 {
                    match hs.poll() {
                        Event::Send(o) => assert!(!o.payload || secret.is_none(), "a payload for unproven bytes"),
                        Event::Need(n) => {
                            assert!(n <= crate::transport::handshake::messages::MAX_MESSAGE, "asked for {n} bytes");
                            let k = n.min(data.len() - fed);
                            if k == 0 {
                                break;
                            }
                            assert_eq!(hs.feed(&data[fed..fed + k]), k);
                            fed += k;
                        }
                        Event::Hello(_) => hs.admit(Some(&local), b"a", false),
                        Event::Proved(_) => hs.respond(if kind.welcomes() { &[4, 5] } else { &[] }),
                        Event::Done(_) => {
                            assert!(secret.is_none(), "bytes that did not prove the secret finished a handshake");
                            break;
                        }
                        Event::Refused(why) => {
                            assert!(
                                !why.to_string().is_empty()
                                    && why != crate::transport::handshake::machine::Refusal::ByPeer(Status::Ok)
                            );
                            break;
                        }
                    }
                }
            }
        }
    }

    /// The pairs' per-message wire types: a fixed-length value decodes from the first bytes
    /// that fit it, a length-prefixed one from the front; each encodes back to its bytes.
    fn per_message(data: &[u8]) {
        use crate::transport::ibverbs::wire::{HDR, Imm, LifelineFrame, SlotHeader, next_frame};
        use crate::transport::shm::wire::{
            ACK_LEN, AbortMsg, Ack, CMA_REF, CmaRef, FRAG_HEAD, Fixed, FragHead, HDR as MSG_HDR, MsgHeader, next_abort,
        };
        fn fixed<const N: usize, T: Fixed<N> + std::fmt::Debug>(data: &[u8]) {
            if let Some(b) = data.first_chunk::<N>()
                && let Ok(v) = T::from_bytes(b)
            {
                assert_eq!(&v.to_bytes(), b, "{v:?} does not round-trip");
            }
        }
        fixed::<MSG_HDR, MsgHeader>(data);
        fixed::<FRAG_HEAD, FragHead>(data);
        fixed::<CMA_REF, CmaRef>(data);
        fixed::<ACK_LEN, Ack>(data);
        if let Some(b) = data.first_chunk::<HDR>()
            && let Ok(h) = SlotHeader::from_bytes(b)
        {
            assert_eq!(&h.to_bytes(), b, "slot header does not round-trip");
        }
        if let Some(b) = data.first_chunk::<4>()
            && let Some(imm) = Imm::decode(u32::from_le_bytes(*b))
        {
            assert_eq!(imm.encode(), u32::from_le_bytes(*b), "immediate does not round-trip");
        }
        fn prefixed<T: Codec>(data: &[u8], next: Result<Option<(T, usize)>, String>) {
            if let Ok(Some((v, used))) = next {
                assert_eq!(to_vec(&v), data[..used], "a lifeline message does not round-trip");
                assert!(decode_all::<T>(&data[..used], "a lifeline message").is_ok());
            }
        }
        prefixed::<AbortMsg>(data, next_abort(data));
        prefixed::<LifelineFrame>(data, next_frame(data));
        for cause in [
            next_abort(data).ok().flatten().map(|(m, _)| m.cause),
            next_frame(data).ok().flatten().map(|(f, _)| f.cause),
        ]
        .into_iter()
        .flatten()
        {
            let _ = crate::transport::AbortCause::decode(&cause).map(|c| c.into_error());
        }
    }

    #[cfg(test)]
    mod tests {
        use proptest::prelude::*;

        proptest! {
            // The fuzz target's body on random input, and on valid openings with bytes flipped
            // (random bytes alone rarely pass the magic and kind checks).
            #[test]
            fn the_fuzz_target_holds_on_random_input(data in proptest::collection::vec(any::<u8>(), 0..200)) {
                super::wire(&data);
            }

            #[test]
            fn the_fuzz_target_holds_on_mutated_valid_input(
                flips in proptest::collection::vec((0usize..120, any::<u8>()), 0..4),
                kind in 1u8..=2,
                ty in 1u8..=5,
                backend in 1u8..=2,
            ) {
                let mut frame = vec![kind, 0, 0, 0];
                frame.resize(64, 0);
                frame[24] = 11; // a small length
                // A message head, a hello's or challenge's body (a valid backend and lane),
                // and a sealed message's length.
                let mut msg = b"FGLO".to_vec();
                msg.extend_from_slice(&crate::transport::handshake::messages::VERSION.to_le_bytes());
                msg.extend_from_slice(&[ty, 0, backend, 0]);
                msg.resize(120, 0);
                for (i, x) in &flips {
                    frame[*i % 64] ^= x;
                    msg[*i] ^= x;
                }
                super::wire(&frame);
                super::wire(&msg);
            }

            #[test]
            fn the_fuzz_target_holds_on_mutated_per_message_headers(
                flips in proptest::collection::vec((0usize..96, any::<u8>()), 0..4),
                kind in 1u8..=2,
                len in any::<u16>(),
            ) {
                // An ibverbs slot header (kind, a length, zero elsewhere), then the start of
                // a lifeline message of `len` bytes (both lifelines' layouts).
                let mut slot = vec![kind, 0, 0, 0, 0, 0, 0, 0];
                slot.resize(96, 0);
                slot[48..50].copy_from_slice(&len.to_le_bytes());
                let mut ib_frame = (u32::from(len % 64) + 8).to_le_bytes().to_vec();
                ib_frame.resize(96, 7);
                let mut shm_abort = vec![0u8; 8];
                shm_abort.extend_from_slice(&u32::from(len % 64).to_le_bytes());
                shm_abort.resize(96, 7);
                for (i, x) in &flips {
                    slot[*i] ^= x;
                    ib_frame[*i] ^= x;
                    shm_abort[*i] ^= x;
                }
                super::wire(&slot);
                super::wire(&ib_frame);
                super::wire(&shm_abort);
            }
        }
    }
}

pub use algorithms::CollectiveOptions;
pub use comm::{BytesRequest, RecvRequest, Scope, SendRequest};
pub use context::{Context, ContextBuilder};
pub use cost::CostModel;
pub use device::Device;
pub use error::{Error, Result};
pub use survive::Agreement;
pub use types::{Algorithm, DType, Element, Reduction, bf16, f16};
