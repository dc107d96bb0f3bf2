//! Devices: which transport a rank's contexts use, where it listens, and which host it is on.
//!
//! A [`Device`] is one transport backend, shared by every [`Context`](crate::Context) made on
//! it, and the host identity its ranks publish (ranks with equal identities share memory):
//!
//! - [`Device::auto`]: shared memory between ranks on one host and TCP between hosts, chosen
//!   per peer by host identity ([`host_id`]). What [`Device::from_env`] gives by default.
//! - [`Device::tcp`] with a [`TcpAttr`]: TCP only (one listening socket and one event-loop
//!   thread); [`Device::loopback`] for ranks that all run on this host.
//! - [`Device::shared_memory`]: shared memory only, for jobs on one host.
//! - [`Device::ibverbs`]: RDMA (cargo feature `ibverbs`).
//! - [`Device::combine`]: a same-host device (shared memory) and a device for the other hosts
//!   (TCP, RDMA) as one, as [`Device::auto`] does.
//! - [`Device::in_process`]: ranks as threads of one process (no sockets).
//!
//! [`Device::on_host`] is the one way to give a device another host identity than this
//! host's. `FERROGLOO_TRANSPORT=tcp|shm|tcp+shm|ibverbs+shm` ([`Transport::from_env`]) forces
//! the choice of [`Device::from_env`] for a whole job, for testing or to work around a host
//! where shared memory does not work.
//!
//! ```
//! use ferrogloo::device::{Device, TcpAttr, Transport};
//! let dev = Device::tcp(&TcpAttr::loopback())?;
//! assert_eq!(dev.backend_name(), "tcp");
//! assert!(dev.local_addr().is_some_and(|a| a.ip().is_loopback()));
//! assert_eq!(Device::in_process().backend_name(), "memory");
//! let auto = Device::with_transport(Transport::Auto, &TcpAttr::loopback())?;
//! assert_eq!(auto.backend_name(), Transport::Auto.name());
//! assert_eq!(auto.on_host("node-7").host(), "node-7");
//! # Ok::<(), ferrogloo::Error>(())
//! ```

mod attr;

pub use crate::types::{CopyPlan, SizeRange};
pub(crate) use attr::boot_id;
#[cfg(test)]
pub(crate) use attr::host_id_in;
pub use attr::{Family, IbAttr, ShmAttr, ShmCopy, TcpAttr, Transport, host_id};

use crate::error::{Error, Result};
use crate::transport::Backend;
use crate::transport::auto::AutoBackend;
use crate::transport::memory::MemoryDevice;
use crate::transport::shm::ShmDevice;
use crate::transport::tcp::device::{TcpDevice, TcpOptions};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

/// A transport backend shared by every context made on it, and the host identity its ranks
/// publish. Cheap to clone; the backend stops (its thread ends, its sockets close) when the
/// last clone and the last context using it are dropped.
#[derive(Clone)]
pub struct Device {
    backend: Arc<dyn Backend>,
    host: Arc<str>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("backend", &self.backend_name())
            .field("host", &self.host())
            .field("addr", &self.local_addr())
            .finish()
    }
}

impl Device {
    /// A device on `backend`, on this host ([`host_id`]).
    pub(crate) fn from_backend(backend: Arc<dyn Backend>) -> Self {
        Device { backend, host: host_id().into() }
    }

    /// A TCP device: binds the listener described by `attr` and starts its event loop.
    pub fn tcp(attr: &TcpAttr) -> Result<Self> {
        let ip = attr.resolve()?;
        if ip.is_unspecified() {
            return Err(Error::invalid(format!(
                "{ip} is not an address peers can connect to; name an interface or host"
            )));
        }
        let addrs: Vec<SocketAddr> = attr.ports.clone().map(|p| SocketAddr::new(ip, p)).collect();
        let opts = TcpOptions {
            send_buffer: attr.send_buffer,
            recv_buffer: attr.recv_buffer,
            early_budget: attr.early_budget,
            handshake_timeout: attr.handshake_timeout,
            max_pending: attr.max_pending.max(1),
        };
        Ok(Self::from_backend(Arc::new(TcpDevice::start(&addrs, opts)?)))
    }

    /// A TCP device on loopback with default settings ([`TcpAttr::loopback`]): for ranks that
    /// all run on this host.
    pub fn loopback() -> Result<Self> {
        Self::tcp(&TcpAttr::loopback())
    }

    /// Shared memory, for ranks (processes or threads) that all run on this host: each rank's
    /// messages to a peer go through a ring in the peer's memory (large ones in fragments, or
    /// in one copy straight from the sender's memory with [`ShmAttr::single_copy`]). Nothing is
    /// left behind when a job dies: the memory has no name.
    pub fn shared_memory(attr: &ShmAttr) -> Self {
        Self::from_backend(Arc::new(ShmDevice::new(attr.options())))
    }

    /// The in-process transport: for ranks that are threads of this process (tests, examples,
    /// a job inside one program). No sockets and no thread; a send is copied straight into a
    /// posted receive. Holds up to 8 MiB per pair and direction of messages sent before their
    /// receive is posted.
    pub fn in_process() -> Self {
        Self::in_process_with(8 << 20)
    }

    /// [`Device::in_process`] with `early_budget` bytes per pair and direction for messages
    /// sent before their receive is posted (a larger one waits until it is).
    pub fn in_process_with(early_budget: usize) -> Self {
        Self::from_backend(Arc::new(MemoryDevice::new(early_budget)))
    }

    /// The ibverbs (RDMA) transport `attr` describes (see [`IbAttr`]). Needs the cargo feature
    /// `ibverbs` ([`Error::Unsupported`] without it); with no RDMA device on the host the error
    /// says so.
    pub fn ibverbs(attr: &IbAttr) -> Result<Self> {
        // The handshake address matters only where the transport exists.
        let ip = if cfg!(feature = "ibverbs") { attr.tcp.resolve()? } else { IpAddr::V4(Ipv4Addr::LOCALHOST) };
        let opts = crate::transport::ibverbs::IbOptions {
            device: attr.device.clone(),
            port: attr.port,
            gid_index: attr.gid_index,
            ip,
            early_budget: attr.early_budget,
        };
        crate::transport::ibverbs::open(&opts).map(Self::from_backend)
    }

    /// One device of two: `same_host` (shared memory) to the peers whose host identity is this
    /// device's, `other_hosts` (TCP, RDMA) to the others, chosen per peer when a context
    /// forms. The result has `same_host`'s host identity and is named after both
    /// (`tcp+shm`). Fails when `same_host` does not connect the processes of one host, or
    /// `other_hosts` is itself a same-host or combined device.
    ///
    /// ```
    /// use ferrogloo::device::{Device, ShmAttr, Transport};
    /// let dev = Device::combine(&Device::shared_memory(&ShmAttr::default()), &Device::loopback()?)?;
    /// assert_eq!(dev.backend_name(), Transport::Auto.name());
    /// assert!(Device::combine(&Device::in_process(), &Device::loopback()?).is_err());
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn combine(same_host: &Device, other_hosts: &Device) -> Result<Self> {
        let backend = AutoBackend::new(same_host.backend.clone(), other_hosts.backend.clone())?;
        Ok(Device { backend: Arc::new(backend), host: same_host.host.clone() })
    }

    /// Shared memory to the peers on this host (same [`host_id`]) and TCP, on the listener
    /// `attr` describes, to the others: [`Device::combine`] of
    /// [`Device::shared_memory`] and [`Device::tcp`].
    pub fn auto(attr: &TcpAttr) -> Result<Self> {
        Self::combine(&Self::shared_memory(&ShmAttr::default()), &Self::tcp(attr)?)
    }

    /// The device `transport` names, with `attr` as its TCP listener (or RDMA handshake
    /// address): [`Device::tcp`], [`Device::shared_memory`] (`attr` unused), [`Device::auto`],
    /// or shared memory combined with [`Device::ibverbs`] (the RDMA device from
    /// [`IbAttr::from_env`]). Shared memory takes [`ShmAttr::from_env`].
    pub fn with_transport(transport: Transport, attr: &TcpAttr) -> Result<Self> {
        let shm = || Self::shared_memory(&ShmAttr::from_env());
        match transport {
            Transport::Tcp => Self::tcp(attr),
            Transport::Shm => Ok(shm()),
            Transport::Auto => Self::combine(&shm(), &Self::tcp(attr)?),
            Transport::Ibverbs => {
                Self::combine(&shm(), &Self::ibverbs(&IbAttr { tcp: attr.clone(), ..IbAttr::from_env()? })?)
            }
        }
    }

    /// The device a rank of a job gets from its environment: the transport of
    /// `FERROGLOO_TRANSPORT` (default `tcp+shm`) with the TCP listener of [`TcpAttr::from_env`].
    pub fn from_env() -> Result<Self> {
        Self::with_transport(Transport::from_env()?, &TcpAttr::from_env()?)
    }

    /// This device with `host` as its host identity instead of [`host_id`]: ranks whose devices
    /// name the same host use shared memory between them (on a device that has it). For a
    /// launcher that knows the hosts better, and for tests that make one machine look like
    /// several (ranks of one process on "two hosts" talk TCP across). The backend is shared
    /// with `self`.
    pub fn on_host(self, host: impl Into<String>) -> Self {
        Device { host: host.into().into(), ..self }
    }

    /// The backend's name: `tcp`, `shm`, `tcp+shm` (auto), `memory`, `ibverbs` or
    /// `ibverbs+shm`. A device made from a [`Transport`] has that transport's name.
    pub fn backend_name(&self) -> &str {
        self.backend.name()
    }

    /// The host identity this device's ranks publish (see [`host_id`], [`Device::on_host`]).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The address peers connect to over TCP (for a TCP or auto device).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.backend.local_addr()
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        &*self.backend
    }
}
