//! The engine: named asynchronous collectives, negotiated across ranks (Horovod's core).
//!
//! With plain [`Context`](crate::Context) collectives every rank must make the same calls in the same order.
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
//! - **Cycles, only when there is news.** A rank with new work starts a *cycle*: it sends a
//!   short state message to every rank, and an idle rank that receives one joins the cycle
//!   with its own. Idle ranks exchange nothing. While submissions keep arriving close together,
//!   the engine waits for the burst to end (at most [`EngineConfig::batch_window`]) so that one
//!   cycle negotiates all of it.
//! - **The caller runs.** A thread waiting on a [`Handle`] runs the engine's loop itself (its
//!   cycles, collectives and completions), so a result does not cross threads; the background
//!   thread runs it while nobody waits (peers' cycles, handles never waited on), lets go when a
//!   caller comes, and takes it back one to two milliseconds after the last caller left. A
//!   submission wakes the loop (a message to itself on the context) only while it waits for
//!   messages. Several threads of a rank waiting at once take turns. Callbacks always run on
//!   the background thread, and a wait with a deadline
//!   ([`Handle::wait_timeout`]) leaves the loop to it (a cycle, once begun, could outlast the
//!   deadline).
//! - **Response cache, one bitwise allreduce.** A name negotiated once gets a slot in every
//!   rank's cache (the same slot everywhere, kept until evicted). Later submissions of it only
//!   set their slot's bit in the state message; the bits of all ranks are ANDed (status bits:
//!   joined, shut down, requests pending, slots to invalidate ORed): a slot every rank has set
//!   is ready, with no coordinator round trip. The exchange *is* the allreduce: a direct
//!   all-to-all of the small vectors, which is also how an idle rank learns a cycle began.
//!   Where every rank of the context shares one host's shared-memory area, the exchange is one
//!   step of the area instead (each rank writes its state into its slot and reads the others'):
//!   a rank idle in its loop notices a peer's arrival, and one that sleeps says so in the area
//!   and gets a one-byte nudge over its pair; a state too large for a slot goes over the pairs
//!   for that cycle ([`EngineConfig::negotiate_through_area`]).
//! - **Agreement by reduction.** Over the pairs the direct exchange costs each rank `n - 1`
//!   messages a cycle. Instead, the ranks may combine their states as a reduction: a summary
//!   (the cache's bits ANDed over every rank and over the ranks not joined, the pending and
//!   invalidated bits ORed, a bit per rank for joined, shut down and names in full), by
//!   recursive doubling in `log2 n` rounds of one message each (two more for some ranks
//!   where `n` is not a power of two), after which every rank holds the same summary; ranks
//!   with names in full send them to the coordinator beside the rounds, and its responses go
//!   down a binomial tree. An idle rank joins when a round's
//!   message reaches it (every rank that begins sends in every round). By default the ranks
//!   time both ways as the engine starts, from 8 ranks, and take the reduction where it is at
//!   least a fifth faster ([`EngineConfig::tree_negotiation_from`],
//!   [`Engine::agrees_by_reduction`]). Rank 0 then learns only that *some* rank has a cached
//!   name pending; past half the stall threshold it drops such a slot (on every rank, next
//!   cycle), so that the name's submissions come to it in full and a stall report names the
//!   ranks missing. Small tensors do not travel with the summaries.
//! - **Small tensors travel with the negotiation.** A cached allreduce small enough, by the
//!   context's [cost model](crate::cost), that sending it to every rank costs less than the
//!   allreduce it replaces rides in this rank's state message. When a cycle finds it ready and
//!   every rank's message carried it, every rank folds the tensors in rank order (the same bits
//!   everywhere) and no collective runs: the warm path is one exchange, not a negotiation and
//!   then an allreduce. Nothing depends on the ranks' order of submission: a tensor that did
//!   not come from every rank in that cycle runs as an allreduce, decided alike on every rank
//!   from the same messages. [`EngineStats::eager`] counts the tensors reduced this way.
//! - **Coordinator.** A name not in the cache (first time, or its type or shape changed, which
//!   invalidates its slot on every rank in the same cycle) travels in full to rank 0, which
//!   finds it ready once every rank has submitted it, checks that they agree (type, shape,
//!   operation, root, scale factors, compression, group) and sends the ready names, with their
//!   cache slots, to every rank. Disagreements fail that name on every rank with
//!   [`Error::Mismatch`](crate::Error::Mismatch) in words.
//! - **Fusion.** Ready allreduces with the same element type, reduction, scale factors and
//!   compression are packed into one buffer (allocated once, grown to at most
//!   [`EngineConfig::fusion_threshold`], reused), looking ahead past tensors that do not match,
//!   and run as one allreduce. Tensors above [`EngineConfig::fusion_max_tensor`] run alone, in
//!   place: their copies would cost more than the collective saved. An uncompressed batch
//!   needs no fusion buffer, and any size joins a batch, where it runs on the tensors
//!   themselves: where every rank shares one host's area (its tensors are copied straight
//!   into the area and the results straight out, or read straight from the other ranks'
//!   tensors where the copy plan takes single copies), and over the pairs where `Auto` runs
//!   the ring (its segments cut where the tensors end, each message sent from a tensor and
//!   received or reduced into one: every rank's batch holds the same tensors in the same
//!   order; tensors so small that the messages their ends add would cost more than copying
//!   them, by the cost model, are copied together into one buffer and out:
//!   [`Context::allreduce_many_alike`](crate::Context::allreduce_many_alike)).
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
//! [`EngineConfig`]'s fields set the engine's behaviour in code; [`EngineConfig::from_env`]
//! reads them from environment variables (Horovod's names where the meaning is the same:
//! `HOROVOD_FUSION_THRESHOLD`, `HOROVOD_CYCLE_TIME`, `HOROVOD_CACHE_CAPACITY`,
//! `HOROVOD_STALL_CHECK_TIME_SECONDS`, `HOROVOD_TIMELINE`, ...). Each field names its variable and
//! default; the README's table of [environment variables](crate#environment-variables) (in the
//! crate's documentation) lists them all.
//!
//! # Not (yet) done
//!
//! Only allreduces are fused (allgather, broadcast and the others run one by one). Allgathers
//! are negotiated through the coordinator every time (their first dimension may change from
//! call to call), and so are barriers. Alltoall splits are equal (the first dimension must be a
//! multiple of the number of ranks).
//!
//! # Inside
//!
//! The negotiation is a plain state machine, tested without a [`Context`](crate::Context):
//! `controller.rs` (one rank's cycle: the state message to send, the messages received, the
//! names to run) over `cache.rs` (the response cache and its bit vectors), `coordinator.rs`
//! (rank 0's table of requests) and `stall.rs` (the stall inspector). `background.rs` is the
//! thread around it: idle waiting, the sends and receives through `comm` (a cycle's exchange of
//! states in `background/exchange.rs`), running what a cycle decided (`exec.rs`: fusion,
//! scaling, the collectives) and the timeline (`timeline.rs`). `agree.rs` holds the agreement
//! by reduction (the summary, the rounds, the tree, the measurement that chooses it).
//! `wire.rs` encodes the messages; `api.rs`, `config.rs`, `handle.rs` and `tensor.rs` hold
//! what users call and get back; `shared.rs` what their threads share with the background
//! thread; `meta.rs` what every rank must agree on for a name.

mod agree;
mod api;
mod background;
mod cache;
mod config;
mod controller;
mod coordinator;
mod drive;
mod exec;
mod handle;
mod meta;
mod shared;
mod stall;
mod tensor;
mod timeline;
mod wire;

pub use api::Engine;
pub use config::EngineConfig;
pub use handle::Handle;
/// Also the parameter server's words for a panic.
pub(crate) use handle::panic_message;
pub use shared::EngineStats;
pub use stall::StallReport;
pub use tensor::{AllreduceOptions, Compression, Tensor};

/// How an allreduce (or reduce-scatter) combines the ranks' tensors: the crate's one
/// reduction type. [`Reduction::Average`] sums and divides by the number of ranks that
/// contributed (ranks that [joined](Engine::join) contribute nothing and are not counted);
/// floating-point types only.
pub use crate::types::Reduction;

/// The tag of the engine's own messages (state messages and responses) on its context.
pub(crate) const CONTROL_TAG: u32 = 0x4647_454e; // "FGEN"

/// The tag of the states with names in full that ranks send to the coordinator beside the
/// rounds of a cycle agreed by reduction (`agree.rs`).
pub(crate) const REQUEST_TAG: u32 = 0x4647_4551; // "FGEQ"
