//! Devices: which transport a rank's contexts use, where it listens, and which host it is on.
//!
//! A [`Device`] is one transport backend that every [`Context`](crate::Context) made on it
//! shares:
//!
//! - [`Device::auto`]: shared memory between ranks on one host and TCP between hosts, chosen
//!   per peer by host identity ([`host_id`]). What [`Device::from_env`] gives by default.
//! - [`Device::new`] with a [`TcpAttr`]: TCP only (one listening socket and one event-loop
//!   thread).
//! - [`Device::shared_memory`]: shared memory only, for jobs on one host.
//! - [`Device::in_process`]: ranks as threads of one process (no sockets).
//!
//! `FERROGLOO_TRANSPORT=tcp|shm|auto` ([`Transport::from_env`]) forces the choice of
//! [`Device::from_env`] for a whole job, for testing or to work around a host where shared
//! memory does not work.
//!
//! ```
//! use ferrogloo::device::{Device, TcpAttr, Transport};
//! let dev = Device::new(&TcpAttr::loopback())?;
//! assert_eq!(dev.backend_name(), "tcp");
//! assert!(dev.local_addr().is_some_and(|a| a.ip().is_loopback()));
//! assert_eq!(Device::in_process().backend_name(), "memory");
//! let auto = Device::with_transport(Transport::Auto, &TcpAttr::loopback())?;
//! assert_eq!(auto.backend_name(), "tcp+shm");
//! # Ok::<(), ferrogloo::Error>(())
//! ```

use crate::error::{Error, Result};
use crate::transport::Backend;
use crate::transport::auto::AutoDevice;
use crate::transport::memory::MemoryDevice;
use crate::transport::shm::{ShmDevice, ShmOptions};
use crate::transport::tcp::device::{TcpDevice, TcpOptions};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

/// The environment variable that names the network interface to listen on.
pub const IFACE_ENV: &str = "FERROGLOO_IFACE";
/// The environment variable that names a host name whose address to listen on.
pub const HOSTNAME_ENV: &str = "FERROGLOO_HOSTNAME";
/// The environment variable that gives the IP address to listen on.
pub const ADDR_ENV: &str = "FERROGLOO_ADDR";
/// The environment variable that overrides this host's identity (see [`host_id`]).
pub const HOST_ID_ENV: &str = "FERROGLOO_HOST_ID";

/// The environment variable that chooses the transport of [`Device::from_env`]
/// ([`Transport::from_env`]).
pub const TRANSPORT_ENV: &str = "FERROGLOO_TRANSPORT";

/// This host's identity, which decides which ranks share memory (never IP addresses or
/// `LOCAL_WORLD_SIZE`): `FERROGLOO_HOST_ID` when set, else the host name, the kernel's boot id
/// (`/proc/sys/kernel/random/boot_id`; `/etc/machine-id` where there is none) and the network
/// namespace (`/proc/self/ns/net`: ranks in two namespaces of one host cannot reach each other's
/// abstract Unix sockets, so they talk TCP). Two processes with the same identity can share
/// memory.
pub fn host_id() -> String {
    if let Ok(id) = std::env::var(HOST_ID_ENV)
        && !id.is_empty()
    {
        return id;
    }
    let name = hostname().unwrap_or_else(|| "localhost".to_string());
    let boot = ["/proc/sys/kernel/random/boot_id", "/etc/machine-id"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()));
    let mut id = match boot {
        Some(b) => format!("{name}/{b}"),
        None => name,
    };
    if let Ok(ns) = std::fs::read_link("/proc/self/ns/net") {
        id.push('/');
        id.push_str(&ns.to_string_lossy());
    }
    id
}

/// The environment variable that turns on single-copy transfers between processes on one
/// host ([`ShmAttr::single_copy`]): `1`.
pub const SINGLE_COPY_ENV: &str = "FERROGLOO_SHM_SINGLE_COPY";

/// Settings of the shared-memory transport ([`Device::shared_memory_with`]; auto devices use
/// the defaults).
#[derive(Debug, Clone)]
pub struct ShmAttr {
    /// Whether a rank reads a peer's large message (64 KiB or more) straight from the peer's
    /// memory (`process_vm_readv`, one copy) where the kernel allows it (a probe decides when a
    /// pair forms); otherwise large messages go through the rings in fragments (two copies,
    /// the sender's and the receiver's, overlapped). Default: off, unless
    /// `FERROGLOO_SHM_SINGLE_COPY=1`: on the 2-core machine this was measured on, the fragments
    /// were 3 to 4 times faster at every size from 64 KiB to 16 MiB (a 2-rank ping-pong of
    /// 1 MiB took 26 µs one way against 79; the kernel pins every page it copies).
    pub single_copy: bool,
}

impl Default for ShmAttr {
    fn default() -> Self {
        ShmAttr { single_copy: std::env::var(SINGLE_COPY_ENV).is_ok_and(|v| v.trim() == "1") }
    }
}

impl ShmAttr {
    fn options(&self) -> ShmOptions {
        ShmOptions { single_copy: self.single_copy, ..ShmOptions::default() }
    }
}

/// Which transport a device uses between ranks (see [`Device::with_transport`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// TCP to every peer.
    Tcp,
    /// Shared memory to every peer: every rank must be on this host.
    Shm,
    /// Shared memory to peers on this host, TCP to the others.
    Auto,
    /// RDMA through ibverbs to the peers on other hosts, shared memory to those on this one
    /// ([`Device::ibverbs_auto`] with [`IbAttr::from_env`]); needs the cargo feature `ibverbs`.
    Ibverbs,
}

impl Transport {
    /// `FERROGLOO_TRANSPORT` (`tcp`, `shm`, `auto` or `ibverbs`); [`Transport::Auto`] when unset
    /// or empty.
    /// Another value is an error.
    pub fn from_env() -> Result<Self> {
        match std::env::var(TRANSPORT_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                v.parse().map_err(|e: Error| Error::invalid(format!("{TRANSPORT_ENV}: {e}")))
            }
            _ => Ok(Transport::Auto),
        }
    }

    /// `"tcp"`, `"shm"`, `"auto"` or `"ibverbs"`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
            Transport::Auto => "auto",
            Transport::Ibverbs => "ibverbs",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Transport {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tcp" => Ok(Transport::Tcp),
            "shm" | "shared-memory" => Ok(Transport::Shm),
            "auto" => Ok(Transport::Auto),
            "ibverbs" | "rdma" => Ok(Transport::Ibverbs),
            other => Err(Error::invalid(format!("unknown transport {other:?} (expected tcp, shm, auto or ibverbs)"))),
        }
    }
}

/// The environment variable that names the RDMA device ([`IbAttr::from_env`]): `mlx5_0`,
/// or `sim` for the simulated provider.
pub const IB_DEVICE_ENV: &str = "FERROGLOO_IB_DEVICE";
/// The environment variable that gives the RDMA port number (default 1).
pub const IB_PORT_ENV: &str = "FERROGLOO_IB_PORT";
/// The environment variable that gives the GID table index (RoCE v2 address choice).
pub const IB_GID_INDEX_ENV: &str = "FERROGLOO_IB_GID_INDEX";

/// How to build an ibverbs (RDMA) [`Device`] ([`Device::ibverbs_with`]).
///
/// Pairs are reliable-connected queue pairs. The store entry says where the rank's TCP
/// handshake listens; the handshake hands the queue pairs' addresses (LID, GID, queue pair
/// number, packet sequence number, MTU) and rings to peers that proved the context's secret,
/// brings each pair up and stays open as the pair's lifeline (it carries aborts and tells when
/// a peer is gone). Needs the cargo feature `ibverbs`.
///
/// `device: Some("sim")` chooses the *simulated* provider: RDMA modelled in this process (for
/// tests of ranks that are threads; nothing leaves the process).
///
/// ```
/// use ferrogloo::device::IbAttr;
/// let attr = IbAttr { device: Some("mlx5_0".into()), gid_index: Some(3), ..IbAttr::default() };
/// assert_eq!(attr.port, 1);
/// assert_eq!(IbAttr::simulated().device.as_deref(), Some("sim"));
/// ```
#[derive(Debug, Clone)]
pub struct IbAttr {
    /// The RDMA device (`mlx5_0`); `None`: the first with an active port; `"sim"`: the
    /// simulated provider.
    pub device: Option<String>,
    /// The port on the device (default 1).
    pub port: u8,
    /// The GID table index; `None`: for RoCE the first RoCE v2 entry with an IPv4 address,
    /// else 0.
    pub gid_index: Option<u8>,
    /// Where the handshake listens (default: as [`TcpAttr::default`]).
    pub tcp: TcpAttr,
    /// Bytes per pair that may arrive before their receive is posted (default 8 MiB).
    pub early_budget: usize,
}

impl Default for IbAttr {
    fn default() -> Self {
        IbAttr { device: None, port: 1, gid_index: None, tcp: TcpAttr::default(), early_budget: 8 << 20 }
    }
}

impl IbAttr {
    /// The simulated provider, handshakes on loopback.
    pub fn simulated() -> Self {
        IbAttr { device: Some("sim".into()), tcp: TcpAttr::loopback(), ..IbAttr::default() }
    }

    /// `FERROGLOO_IB_DEVICE`, `FERROGLOO_IB_PORT`, `FERROGLOO_IB_GID_INDEX` and the handshake
    /// address of [`TcpAttr::from_env`]; unset ones keep their defaults. A value that does not
    /// parse is an error.
    pub fn from_env() -> Result<Self> {
        let var = |name: &str| std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let num = |name: &str| -> Result<Option<u8>> {
            var(name)
                .map(|v| v.parse::<u8>().map_err(|e| Error::invalid(format!("{name}={v:?}: {e} (expected 0 to 255)"))))
                .transpose()
        };
        Ok(IbAttr {
            device: var(IB_DEVICE_ENV),
            port: num(IB_PORT_ENV)?.unwrap_or(1),
            gid_index: num(IB_GID_INDEX_ENV)?,
            tcp: TcpAttr::from_env()?,
            ..IbAttr::default()
        })
    }
}

/// This host's name (`gethostname`).
fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is a live, writable buffer and we pass its exact length; gethostname
    // writes at most that many bytes.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    std::str::from_utf8(&buf[..end]).ok().map(str::to_string).filter(|s| !s.is_empty())
}

/// IPv4 or IPv6.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

/// How to build a TCP [`Device`]: which address to listen on and socket tunables.
///
/// The address comes from the first of these that is set: `ip`, `iface` (the interface's
/// first address of `family`), `hostname` (resolved). With none of them (the default) the
/// device listens where other hosts can reach it, as Gloo does: on the address this host's name
/// resolves to unless that is a loopback address, else on the address of the interface of the
/// default route, else (a host without a network) on loopback. [`TcpAttr::loopback`] is the
/// choice for ranks that all run on one host. [`TcpAttr::from_env`] fills `ip`, `iface` and
/// `hostname` from `FERROGLOO_ADDR`, `FERROGLOO_IFACE` and `FERROGLOO_HOSTNAME`.
#[derive(Debug, Clone)]
pub struct TcpAttr {
    /// Listen on this address.
    pub ip: Option<IpAddr>,
    /// Listen on this network interface (for example `eth0`).
    pub iface: Option<String>,
    /// Listen on the address this host name resolves to.
    pub hostname: Option<String>,
    /// Address family when choosing by interface, hostname or default (default IPv4).
    pub family: Family,
    /// Ports to try, in order; `0..=0` (the default) lets the OS choose.
    pub ports: std::ops::RangeInclusive<u16>,
    /// `SO_SNDBUF` for every connection. Default: 512 KiB for connections between ranks
    /// on one host (same address at both ends): on a 2-core machine it made 16 and 64 MiB
    /// allreduce and allgather 1.25 to 1.75 times faster than the kernel's autotuning, and
    /// smaller sizes no slower. Connections to other hosts keep the autotuning.
    pub send_buffer: Option<usize>,
    /// `SO_RCVBUF` for every connection (default: the kernel's autotuning).
    pub recv_buffer: Option<usize>,
    /// Bytes per pair that may arrive before their receive is posted (default 8 MiB). Beyond
    /// it, the pair stops reading until a matching receive is posted.
    pub early_budget: usize,
    /// Time a new connection has to complete its handshake (default 10 s); a silent
    /// connection is closed after it and never blocks the listener meanwhile.
    pub handshake_timeout: Duration,
    /// Most handshakes in progress at once (default 1024); a new connection beyond it evicts
    /// the oldest one still in its handshake.
    pub max_pending: usize,
}

impl Default for TcpAttr {
    fn default() -> Self {
        TcpAttr {
            ip: None,
            iface: None,
            hostname: None,
            family: Family::V4,
            ports: 0..=0,
            send_buffer: None,
            recv_buffer: None,
            early_budget: 8 << 20,
            handshake_timeout: Duration::from_secs(10),
            max_pending: 1024,
        }
    }
}

impl TcpAttr {
    /// Loopback (127.0.0.1), any port: every rank on this host.
    pub fn loopback() -> Self {
        Self::ip(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    /// Listen on `ip`.
    pub fn ip(ip: IpAddr) -> Self {
        TcpAttr { ip: Some(ip), ..Self::default() }
    }

    /// Listen on network interface `name`.
    pub fn iface(name: impl Into<String>) -> Self {
        TcpAttr { iface: Some(name.into()), ..Self::default() }
    }

    /// Listen on the address `name` resolves to.
    pub fn hostname(name: impl Into<String>) -> Self {
        TcpAttr { hostname: Some(name.into()), ..Self::default() }
    }

    /// Defaults, with `ip` from `FERROGLOO_ADDR`, `iface` from `FERROGLOO_IFACE` and
    /// `hostname` from `FERROGLOO_HOSTNAME` when set. An address that does not parse is an
    /// error.
    pub fn from_env() -> Result<Self> {
        let var = |name| std::env::var(name).ok().filter(|s: &String| !s.is_empty());
        let ip = match var(ADDR_ENV) {
            Some(a) => Some(a.parse().map_err(|_| Error::invalid(format!("{ADDR_ENV}={a:?} is not an IP address")))?),
            None => None,
        };
        Ok(TcpAttr { ip, iface: var(IFACE_ENV), hostname: var(HOSTNAME_ENV), ..Self::default() })
    }

    fn wants(&self, ip: &IpAddr) -> bool {
        matches!((self.family, ip), (Family::V4, IpAddr::V4(_)) | (Family::V6, IpAddr::V6(_)))
    }

    fn loopback_of(&self) -> IpAddr {
        match self.family {
            Family::V4 => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Family::V6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
        }
    }

    /// The IP address to listen on.
    pub fn resolve(&self) -> Result<IpAddr> {
        if let Some(ip) = self.ip {
            return Ok(ip);
        }
        if let Some(name) = &self.iface {
            let ifs = if_addrs::get_if_addrs().map_err(|e| Error::io("listing network interfaces", e))?;
            let listed = || {
                let mut all: Vec<String> = ifs.iter().map(|i| format!("{} ({})", i.name, i.ip())).collect();
                all.sort();
                all.join(", ")
            };
            if !ifs.iter().any(|i| &i.name == name) {
                return Err(Error::invalid(format!(
                    "network interface {name:?} does not exist; this host has: {}",
                    listed()
                )));
            }
            return ifs.iter().filter(|i| &i.name == name).map(|i| i.ip()).find(|ip| self.wants(ip)).ok_or_else(|| {
                Error::invalid(format!(
                    "network interface {name:?} has no {:?} address; this host has: {}",
                    self.family,
                    listed()
                ))
            });
        }
        if let Some(host) = &self.hostname {
            let addrs = (host.as_str(), 0)
                .to_socket_addrs()
                .map_err(|e| Error::io(format!("resolving host name {host:?}"), e))?;
            return addrs
                .map(|a| a.ip())
                .find(|ip| self.wants(ip))
                .ok_or_else(|| Error::invalid(format!("host name {host:?} has no {:?} address", self.family)));
        }
        Ok(self.default_address())
    }

    /// Gloo's choice: this host name's address unless it is loopback, else the default route's
    /// interface, else loopback.
    fn default_address(&self) -> IpAddr {
        let by_name = hostname()
            .and_then(|h| (h.as_str(), 0).to_socket_addrs().ok())
            .and_then(|addrs| addrs.map(|a| a.ip()).find(|ip| self.wants(ip) && !ip.is_loopback()));
        if let Some(ip) = by_name {
            return ip;
        }
        let by_route = default_route_iface().and_then(|name| {
            if_addrs::get_if_addrs()
                .ok()?
                .into_iter()
                .filter(|i| i.name == name)
                .map(|i| i.ip())
                .find(|ip| self.wants(ip) && !ip.is_loopback())
        });
        by_route.unwrap_or_else(|| {
            tracing::debug!("no host name address and no default route: listening on loopback");
            self.loopback_of()
        })
    }
}

/// The interface of the IPv4 default route (`/proc/net/route`), if any.
fn default_route_iface() -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    table.lines().skip(1).find_map(|line| {
        let mut f = line.split_whitespace();
        let (iface, dest) = (f.next()?, f.next()?);
        (dest == "00000000").then(|| iface.to_string())
    })
}

/// What a device is made of.
enum Kind {
    Tcp(TcpDevice),
    Memory(MemoryDevice),
    Shm(ShmDevice),
    Auto(AutoDevice),
    /// A backend with no constructor of its own here.
    Other(Arc<dyn Backend>),
}

/// A transport backend shared by every context made on it. Cheap to clone; the backend stops
/// (its thread ends, its sockets close) when the last clone and the last context using it
/// are dropped.
#[derive(Clone)]
pub struct Device {
    kind: Arc<Kind>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("backend", &self.backend_name()).field("addr", &self.local_addr()).finish()
    }
}

impl Device {
    /// A TCP device: binds the listener described by `attr` and starts its event loop.
    pub fn new(attr: &TcpAttr) -> Result<Self> {
        Ok(Device { kind: Arc::new(Kind::Tcp(Self::tcp(attr)?)) })
    }

    fn tcp(attr: &TcpAttr) -> Result<TcpDevice> {
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
        TcpDevice::start(&addrs, opts)
    }

    /// Shared memory to the peers on this host (same [`host_id`]) and TCP, on the listener
    /// `attr` describes, to the others.
    pub fn auto(attr: &TcpAttr) -> Result<Self> {
        Self::auto_on_host(attr, host_id())
    }

    /// [`Device::auto`] with `host` as this rank's host identity instead of [`host_id`]: ranks
    /// whose devices name the same host use shared memory between them. For a launcher that
    /// knows the hosts better, and for tests that make one machine look like several (ranks of
    /// one process on "two hosts" talk TCP across).
    pub fn auto_on_host(attr: &TcpAttr, host: impl Into<String>) -> Result<Self> {
        let shm = ShmDevice::new(ShmAttr::default().options());
        Ok(Device { kind: Arc::new(Kind::Auto(AutoDevice::new(Self::tcp(attr)?, shm, host.into()))) })
    }

    /// The device `transport` names: [`Device::new`], [`Device::shared_memory`],
    /// [`Device::auto`] (`attr` is unused for shared memory) or [`Device::ibverbs_auto`] (the
    /// RDMA device from [`IbAttr::from_env`], with `attr` as the handshake's address).
    pub fn with_transport(transport: Transport, attr: &TcpAttr) -> Result<Self> {
        match transport {
            Transport::Tcp => Self::new(attr),
            Transport::Shm => Ok(Self::shared_memory()),
            Transport::Auto => Self::auto(attr),
            Transport::Ibverbs => Self::ibverbs_auto(&IbAttr { tcp: attr.clone(), ..IbAttr::from_env()? }, None),
        }
    }

    /// The device a rank of a job gets from its environment: the transport of
    /// `FERROGLOO_TRANSPORT` (default `auto`) with the TCP listener of [`TcpAttr::from_env`].
    pub fn from_env() -> Result<Self> {
        Self::with_transport(Transport::from_env()?, &TcpAttr::from_env()?)
    }

    /// A TCP device on loopback with default settings: for ranks that all run on this host.
    pub fn loopback() -> Result<Self> {
        Self::new(&TcpAttr::loopback())
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
        Device { kind: Arc::new(Kind::Memory(MemoryDevice::new(early_budget))) }
    }

    /// Shared memory, for ranks (processes or threads) that all run on this host: each rank's
    /// messages to a peer go through a ring in the peer's memory (large ones in fragments, or
    /// in one copy straight from the sender's memory with [`ShmAttr::single_copy`]). Nothing is
    /// left behind when a job dies: the memory has no name.
    pub fn shared_memory() -> Self {
        Self::shared_memory_with(&ShmAttr::default())
    }

    /// [`Device::shared_memory`] with settings.
    pub fn shared_memory_with(attr: &ShmAttr) -> Self {
        Device { kind: Arc::new(Kind::Shm(ShmDevice::new(attr.options()))) }
    }

    /// The ibverbs (RDMA) transport on device `name` (the first one with an active port for
    /// `None`; `"sim"` for the simulated provider), with the other settings of
    /// [`IbAttr::from_env`]. Needs the cargo feature `ibverbs` ([`Error::Unsupported`] without
    /// it); with no RDMA device on the host the error says so.
    pub fn ibverbs(name: Option<&str>) -> Result<Self> {
        Self::ibverbs_with(&IbAttr { device: name.map(str::to_string), ..IbAttr::from_env()? })
    }

    /// A device on a backend made elsewhere in the crate (tests).
    #[cfg(all(test, feature = "ibverbs"))]
    pub(crate) fn from_backend(b: Arc<dyn Backend>) -> Self {
        Device { kind: Arc::new(Kind::Other(b)) }
    }

    /// Shared memory to the peers on this host and ibverbs (RDMA, `attr`) to the others, chosen
    /// per peer by host identity as [`Device::auto`] does with TCP: what a job with several
    /// ranks per node on an RDMA cluster wants. `host` overrides [`host_id`] (`None`: this
    /// host's).
    pub fn ibverbs_auto(attr: &IbAttr, host: Option<String>) -> Result<Self> {
        let rdma = Self::ibverbs_with(attr)?;
        let Kind::Other(remote) = &*rdma.kind else {
            return Err(Error::invalid("the ibverbs device is not a backend of its own"));
        };
        let shm = ShmDevice::new(ShmAttr::default().options());
        let host = host.unwrap_or_else(host_id);
        Ok(Device { kind: Arc::new(Kind::Auto(AutoDevice::with_remote(remote.clone(), shm, host))) })
    }

    /// The ibverbs (RDMA) transport `attr` describes. See [`IbAttr`].
    pub fn ibverbs_with(attr: &IbAttr) -> Result<Self> {
        // The handshake address matters only where the transport exists.
        let ip = if cfg!(feature = "ibverbs") { attr.tcp.resolve()? } else { IpAddr::V4(Ipv4Addr::LOCALHOST) };
        let opts = crate::transport::ibverbs::IbOptions {
            device: attr.device.clone(),
            port: attr.port,
            gid_index: attr.gid_index,
            ip,
            early_budget: attr.early_budget,
        };
        crate::transport::ibverbs::open(&opts).map(|b| Device { kind: Arc::new(Kind::Other(b)) })
    }

    /// The backend's name: `"tcp"`, `"shm"`, `"tcp+shm"` (auto), `"memory"`, `"ibverbs"` or
    /// `"ibverbs+shm"`.
    pub fn backend_name(&self) -> &'static str {
        self.backend().name()
    }

    /// The address peers connect to over TCP (for a TCP or auto device).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match &*self.kind {
            Kind::Tcp(t) => Some(t.local_addr()),
            Kind::Auto(a) => a.tcp().map(TcpDevice::local_addr),
            Kind::Memory(_) | Kind::Shm(_) | Kind::Other(_) => None,
        }
    }

    pub(crate) fn backend(&self) -> &dyn Backend {
        match &*self.kind {
            Kind::Tcp(t) => t,
            Kind::Memory(m) => m,
            Kind::Shm(s) => s,
            Kind::Auto(a) => a,
            Kind::Other(b) => &**b,
        }
    }
}
