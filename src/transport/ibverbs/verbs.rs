//! The verbs layer: the few RDMA verbs the ibverbs backend uses, behind traits with two
//! providers: the real one over `rdma-sys` ([`super::rdma`]) and a simulated one in Rust
//! ([`super::sim`]) that tests run on where no RDMA device exists.
//!
//! The shapes follow libibverbs closely (a device opened once, one protection domain, memory
//! regions with local and remote keys, reliable-connected queue pairs moved through
//! INIT → RTR → RTS, completion queues polled and armed on a completion channel), so that the
//! backend's protocol is the same over both providers.

use crate::error::Result;
use crate::transport::handshake::codec::{BufMutExt, Codec, Decoded, Reader};
use bytes::BufMut;
use std::os::fd::RawFd;
use std::sync::Arc;

/// What a queue pair's peer needs to reach it: the port's LID (InfiniBand) or GID (RoCE, or
/// InfiniBand across subnets), the queue pair number, its first packet sequence number and
/// the path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QpAddr {
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
    /// `ibv_mtu` code: 1 = 256 bytes … 5 = 4096 bytes.
    pub(crate) mtu: u8,
}

impl Codec for QpAddr {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        Ok(QpAddr { lid: r.get()?, gid: r.get()?, qpn: r.get()?, psn: r.get()?, mtu: r.get()? })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write(self.lid);
        out.write(self.gid);
        out.write(self.qpn);
        out.write(self.psn);
        out.write(self.mtu);
    }
}

/// The port a device's queue pairs use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PortInfo {
    /// The device's name (`mlx5_0`, `sim0`).
    pub(crate) device: String,
    pub(crate) port: u8,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    /// The GID table index used (RoCE v2 picks an IPv4- or IPv6-mapped entry).
    pub(crate) gid_index: u8,
    /// Active MTU (`ibv_mtu` code).
    pub(crate) mtu: u8,
    /// Whether the link layer is Ethernet (RoCE): addressing must use the GID.
    pub(crate) roce: bool,
}

/// What a memory region allows, besides local reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Access {
    /// Local reads only (staging areas the NIC sends from).
    LocalRead,
    /// The peer reads it (a send buffer a rendezvous reads from). Needs no write permission,
    /// so read-only memory can be sent from.
    RemoteRead,
    /// The NIC writes it locally (the destination of a read).
    LocalWrite,
    /// The peer writes it (a ring), and the NIC locally.
    RemoteWrite,
}

impl Access {
    /// Whether a region of this access may be written by the local NIC.
    pub(crate) fn local_write(self) -> bool {
        matches!(self, Access::LocalWrite | Access::RemoteWrite)
    }
}

/// A registered memory region. Dropping it deregisters it; from then on the remote key no
/// longer grants access.
pub(crate) trait MemoryRegion: Send + Sync {
    /// The first byte's address.
    fn addr(&self) -> u64;
    /// Bytes registered.
    fn len(&self) -> usize;
    /// The key local work requests name it by.
    fn lkey(&self) -> u32;
    /// The key a peer's RDMA operations name it by.
    fn rkey(&self) -> u32;
}

/// What a send-queue work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendOp {
    /// RDMA write of the local bytes to `remote_addr` in the peer's region `rkey`, consuming a
    /// receive work request there, which completes with `imm`.
    WriteImm { remote_addr: u64, rkey: u32, imm: u32 },
    /// RDMA read of the peer's bytes at `remote_addr` (region `rkey`) into the local bytes.
    Read { remote_addr: u64, rkey: u32 },
}

/// Local bytes of a work request: `len` bytes at `addr` of the region with key `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sge {
    pub(crate) addr: u64,
    pub(crate) len: u32,
    pub(crate) lkey: u32,
}

/// How a work request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WcStatus {
    Success,
    /// The peer refused the access (bad remote key, out of its region's bounds, or not
    /// permitted): `IBV_WC_REM_ACCESS_ERR`.
    RemoteAccess,
    /// The queue pair went to the error state before this request ran: `IBV_WC_WR_FLUSH_ERR`.
    Flushed,
    /// The peer did not answer (gone, or its queue pair is in error): `IBV_WC_RETRY_EXC_ERR`.
    RetryExceeded,
    /// Any other status, with the provider's words.
    Other(String),
}

/// Which queue a completion is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WcKind {
    /// A send-queue request ([`SendOp`]) finished.
    Send,
    /// A receive request was consumed by a peer's write with immediate data.
    RecvImm,
}

/// One work completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Wc {
    pub(crate) wr_id: u64,
    pub(crate) status: WcStatus,
    pub(crate) kind: WcKind,
    /// The immediate data of a [`WcKind::RecvImm`] (host order).
    pub(crate) imm: u32,
    /// Bytes written by the peer, for [`WcKind::RecvImm`].
    pub(crate) byte_len: u32,
    /// The local queue pair the completion belongs to.
    pub(crate) qpn: u32,
}

/// A completion queue with a completion channel.
pub(crate) trait CompletionQueue: Send + Sync + std::any::Any {
    /// Itself, for a provider to find its own type behind the trait object.
    fn as_any(&self) -> &dyn std::any::Any;
    /// Appends up to `max` completions to `out`; returns how many.
    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<usize>;
    /// Asks for an event on [`fd`](CompletionQueue::fd) at the next completion. Poll once more
    /// after arming: a completion that came in between raised no event.
    fn arm(&self) -> Result<()>;
    /// The completion channel's descriptor: readable once an event is due.
    fn fd(&self) -> RawFd;
    /// Takes the pending event off the channel (after `fd` was readable), so that the next
    /// [`arm`](CompletionQueue::arm) can raise another.
    fn ack(&self);
}

/// A reliable-connected queue pair.
pub(crate) trait QueuePair: Send + Sync {
    /// Its number, for the peer's [`QpAddr`].
    fn qpn(&self) -> u32;
    /// Moves it from RESET through INIT and RTR to RTS, connected to `remote`; `psn` is this
    /// side's first packet sequence number.
    fn connect(&self, psn: u32, remote: &QpAddr) -> Result<()>;
    /// Posts a send-queue request; its completion (always signalled) carries `wr_id`.
    fn post_send(&self, wr_id: u64, sge: Sge, op: SendOp) -> Result<()>;
    /// Posts a receive request (no buffer: it is consumed by writes with immediate data).
    fn post_recv(&self, wr_id: u64) -> Result<()>;
    /// Moves it to the error state: outstanding requests complete as flushed and the peer's
    /// next request to it fails.
    fn set_error(&self);
}

/// An opened device: a protection domain on one port.
pub(crate) trait VerbsDevice: Send + Sync {
    /// The port in use.
    fn port(&self) -> &PortInfo;
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// The memory must stay allocated while the region is registered and work requests may
    /// touch it (the simulated provider reads and writes it directly).
    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<Arc<dyn MemoryRegion>>;
    /// Whether a registration follows the process's page tables (on-demand paging): a region
    /// stays valid when the memory under it is unmapped and mapped again, so registrations of
    /// user buffers may be cached.
    fn coherent_registrations(&self) -> bool;
    /// A completion queue of at least `depth` entries with its own completion channel.
    fn create_cq(&self, depth: usize) -> Result<Arc<dyn CompletionQueue>>;
    /// A reliable-connected queue pair in the INIT-ready state, its completions on `cq`.
    fn create_qp(&self, cq: &Arc<dyn CompletionQueue>, max_send: u32, max_recv: u32) -> Result<Arc<dyn QueuePair>>;
}
