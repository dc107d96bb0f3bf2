//! The ibverbs (RDMA) transport, behind the cargo feature `ibverbs` (without it, a stub that
//! answers every request with [`Error::Unsupported`]).
//!
//! Layers, bottom up:
//!
//! - [`verbs`]: the verbs the backend uses, as traits, with two providers: [`rdma`] over
//!   `rdma-sys` (libibverbs) and [`sim`], a simulated fabric in this process that the tests run
//!   on (no machine here has an RDMA device).
//! - [`reg`]: registration of user buffers, cached where that is sound.
//! - [`wire`]: what the two sides of a pair send each other besides payloads (slot headers,
//!   immediates, lifeline frames), through the one codec.
//! - [`pair`]: the protocol of one pair over a reliable-connected queue pair (eager messages
//!   through registered rings, large ones read by the receiver straight from the sender's
//!   buffer, credits, aborts on a TCP lifeline).
//! - [`device`]: the device and the endpoint (a queue pair and rings made per peer, brought up
//!   once the handshake is through; the mesh made of the links).
//! - `device/handshake.rs`: the one handshake ([`crate::transport::handshake`]) over a TCP connection
//!   that stays as the pair's lifeline; the address blob in the store says where it listens,
//!   nothing else. Each side's queue pair address and ring (address and key) are its payload,
//!   handed only to a peer that proved the job's secret, and each side brings its queue pair up
//!   only then. The listening side handshakes with each connection on its own, several at once
//!   ([`crate::transport::accepting`]).
//! - [`progress`]: the thread that polls the completion queue (busy for a moment, then asleep on
//!   the completion channel and the lifelines).
//!
//! What is verified where: the whole backend runs the transport contract suite and the
//! collectives on the simulated provider. The real provider is compiled, and its "no device"
//! path runs; nothing has run on RDMA hardware.

#[cfg(feature = "ibverbs")]
pub(crate) mod verbs;

#[cfg(feature = "ibverbs")]
pub(crate) mod pair;
#[cfg(feature = "ibverbs")]
pub(crate) mod rdma;
#[cfg(feature = "ibverbs")]
pub(crate) mod reg;
#[cfg(feature = "ibverbs")]
pub(crate) mod sim;
#[cfg(all(test, feature = "ibverbs"))]
mod tests;
#[cfg(any(feature = "ibverbs", feature = "fuzzing", test))]
pub(crate) mod wire;

/// What an ibverbs device is opened with (what `IbAttr` says, with
/// the handshake address resolved).
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "ibverbs"), allow(dead_code))]
pub(crate) struct IbOptions {
    /// The RDMA device; `None`: the first with an active port; `"sim"`: the simulated provider.
    pub(crate) device: Option<String>,
    pub(crate) port: u8,
    pub(crate) gid_index: Option<u8>,
    /// Where handshakes listen.
    pub(crate) ip: std::net::IpAddr,
    pub(crate) early_budget: usize,
}

/// The ibverbs backend `attr` describes.
#[cfg(not(feature = "ibverbs"))]
pub(crate) fn open(attr: &IbOptions) -> crate::error::Result<std::sync::Arc<dyn crate::transport::Backend>> {
    use crate::error::Error;
    let device = attr.device.as_ref().map_or_else(String::new, |n| format!(" on device {n:?}"));
    Err(Error::unsupported(format!("the ibverbs (RDMA) transport{device}"), Some("ibverbs")))
}

#[cfg(feature = "ibverbs")]
mod device;
#[cfg(feature = "ibverbs")]
mod progress;

#[cfg(feature = "ibverbs")]
pub(crate) use device::open;
#[cfg(all(test, feature = "ibverbs"))]
pub(crate) use device::open_on;
