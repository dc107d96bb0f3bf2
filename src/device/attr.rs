//! What devices are built from: the TCP listener's address and socket settings ([`TcpAttr`]),
//! shared memory's and RDMA's settings ([`ShmAttr`], [`IbAttr`]), the choice of transport
//! ([`Transport`]), and this host's identity ([`host_id`]). `default()` never reads the
//! environment; `from_env()` does.

use crate::config::{
    FERROGLOO_ADDR, FERROGLOO_HOST_ID, FERROGLOO_HOSTNAME, FERROGLOO_IB_DEVICE, FERROGLOO_IB_GID_INDEX,
    FERROGLOO_IB_PORT, FERROGLOO_IFACE, FERROGLOO_SHM_SINGLE_COPY, FERROGLOO_TRANSPORT, Vars,
};
use crate::error::{Error, Result};
use crate::transport::CopyChoice;
use crate::transport::shm::ShmOptions;
use crate::types::CopyPlan;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, ToSocketAddrs};
use std::time::Duration;

/// This host's identity, which decides which ranks share memory (never IP addresses or
/// `LOCAL_WORLD_SIZE`): `FERROGLOO_HOST_ID` when set, else the host name, the kernel's boot id
/// (`/proc/sys/kernel/random/boot_id`; `/etc/machine-id` where there is none) and the network
/// namespace (`/proc/self/ns/net`: ranks in two namespaces of one host cannot reach each other's
/// abstract Unix sockets, so they talk TCP). Two processes with the same identity can share
/// memory.
pub fn host_id() -> String {
    host_id_in(&Vars::process())
}

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`), or `/etc/machine-id` where there
/// is none: what one boot of one machine shares, and the next boot does not.
pub(crate) fn boot_id() -> Option<String> {
    ["/proc/sys/kernel/random/boot_id", "/etc/machine-id"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()))
}

/// [`host_id`], with `FERROGLOO_HOST_ID` as `vars` give it.
pub(crate) fn host_id_in(vars: &Vars<'_>) -> String {
    if let Some(id) = vars.text(FERROGLOO_HOST_ID) {
        return id;
    }
    let name = hostname().unwrap_or_else(|| "localhost".to_string());
    let mut id = match boot_id() {
        Some(b) => format!("{name}/{b}"),
        None => name,
    };
    if let Ok(ns) = std::fs::read_link("/proc/self/ns/net") {
        id.push('/');
        id.push_str(&ns.to_string_lossy());
    }
    id
}

/// Settings of the shared-memory transport ([`Device::shared_memory`](super::Device::shared_memory); [`ShmAttr::from_env`]
/// for the devices of [`Device::from_env`](super::Device::from_env)).
#[derive(Debug, Clone)]
pub struct ShmAttr {
    /// Whether a rank reads a peer's large message (64 KiB or more) straight from the peer's
    /// memory (`process_vm_readv`, one copy) where the kernel allows it (a probe decides when a
    /// pair forms); otherwise large messages go through the rings in fragments (two copies,
    /// the sender's and the receiver's, overlapped). Default: off, unless
    /// `FERROGLOO_SHM_SINGLE_COPY=1`: on the 2-core machine this was measured on, the fragments
    /// were 3 to 4 times faster at every size from 64 KiB to 16 MiB (a 2-rank ping-pong of
    /// 1 MiB took 26 µs one way against 79; the kernel pins every page it copies).
    /// ([`ShmAttr::from_env`] reads the variable; `default()` does not.)
    pub single_copy: bool,
    /// How collectives through the host's shared area (broadcast, allgather, allreduce of a
    /// context whose ranks all share memory) copy: measured when a context forms, by default
    /// (see [`ShmCopy`]).
    pub collective_copy: ShmCopy,
}

/// How a host's ranks move a collective's bytes: through the shared area's slots (two copies,
/// into the owner's slot and out of it) or straight between the ranks' buffers
/// (`process_vm_readv` and `process_vm_writev`, one copy). Which is faster depends on the
/// machine: on the AMD EPYC machine the area was tuned on, single copy was 1.3 to 3 times
/// slower in every collective and size (the kernel pins every page it copies); on an Intel
/// Xeon with a 480 MiB L3, it wins from 64 KiB at 2 ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShmCopy {
    /// Measure the paths when a host's first context of this size forms (within a second:
    /// about 0.2 s for 2 ranks of the 2-core development machine; the result is kept per
    /// user, boot, rank count, slot size, whether the ranks have cores of their own, and
    /// build, in `/dev/shm`, and a later context takes it from there), and take the faster per
    /// collective and size (for broadcast, also whether the root writes a share). One rank
    /// measures and decides for its host, so every rank takes the same path.
    #[default]
    Measure,
    /// Single copy wherever the kernel allows the ranks to read and write each other's memory
    /// (it may not: Yama's `ptrace_scope`, containers); otherwise two copies, with one log
    /// line. The broadcast's root writes no share ([`CopyPlan::SINGLE`]).
    Single,
    /// Always two copies.
    Two,
    /// This plan, where the kernel allows single copies (otherwise two copies): to repeat a
    /// plan measured elsewhere ([`Context::copy_plan`](crate::Context::copy_plan)), or to test
    /// both paths around chosen sizes. Every rank of a host must be given the same.
    Given(CopyPlan),
}

impl Default for ShmAttr {
    /// Single copy off for messages; measured for collectives.
    fn default() -> Self {
        ShmAttr { single_copy: false, collective_copy: ShmCopy::Measure }
    }
}

impl ShmAttr {
    /// The defaults, with single copy forced for messages and collectives when
    /// `FERROGLOO_SHM_SINGLE_COPY=1`, and two copies forced for both when it is `0`.
    pub fn from_env() -> Self {
        Self::read(&Vars::process())
    }

    /// [`ShmAttr::from_env`] as `vars` give it.
    pub(crate) fn read(vars: &Vars<'_>) -> Self {
        match vars.on_off(FERROGLOO_SHM_SINGLE_COPY) {
            Some(true) => ShmAttr { single_copy: true, collective_copy: ShmCopy::Single },
            Some(false) => ShmAttr { single_copy: false, collective_copy: ShmCopy::Two },
            None => ShmAttr::default(),
        }
    }

    pub(crate) fn options(&self) -> ShmOptions {
        let collective_copy = match self.collective_copy {
            ShmCopy::Measure => CopyChoice::Measure,
            ShmCopy::Single => CopyChoice::Single,
            ShmCopy::Two => CopyChoice::Two,
            ShmCopy::Given(plan) => CopyChoice::Given(plan),
        };
        ShmOptions { single_copy: self.single_copy, collective_copy, ..ShmOptions::default() }
    }
}

/// Which transport a device uses between ranks (see [`Device::with_transport`](super::Device::with_transport)). Each has one
/// name, which is also the name of the device it makes ([`Device::backend_name`](super::Device::backend_name)); `auto`,
/// `ibverbs`, `rdma` and `shared-memory` are accepted for them when parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// `tcp`: TCP to every peer.
    Tcp,
    /// `shm`: shared memory to every peer: every rank must be on this host.
    Shm,
    /// `tcp+shm` (also `auto`): shared memory to peers on this host, TCP to the others.
    Auto,
    /// `ibverbs+shm` (also `ibverbs`, `rdma`): RDMA through ibverbs to the peers on other hosts,
    /// shared memory to those on this one; needs the cargo feature `ibverbs`.
    Ibverbs,
}

impl Transport {
    /// `FERROGLOO_TRANSPORT` (`tcp`, `shm`, `tcp+shm` or `ibverbs+shm`, or an alias: `auto`,
    /// `ibverbs`); [`Transport::Auto`] when unset or empty. Another value is an error.
    pub fn from_env() -> Result<Self> {
        Self::read(&Vars::process())
    }

    /// [`Transport::from_env`] as `vars` give it.
    pub(crate) fn read(vars: &Vars<'_>) -> Result<Self> {
        Ok(vars.parse_own(FERROGLOO_TRANSPORT)?.unwrap_or(Transport::Auto))
    }

    /// The name of the device it makes: `tcp`, `shm`, and for a transport of two parts the
    /// name of the part that reaches other hosts and that of the same-host part, joined by `+`,
    /// as a combined device names itself (`tcp+shm`, `ibverbs+shm`).
    pub fn name(self) -> String {
        match self.parts() {
            (remote, Some(local)) => format!("{remote}+{local}"),
            (only, None) => only.to_string(),
        }
    }

    /// The transport's parts: the one that reaches other hosts (or the only one), and the
    /// same-host one, if any.
    fn parts(self) -> (&'static str, Option<&'static str>) {
        match self {
            Transport::Tcp => (TCP, None),
            Transport::Shm => (SHM, None),
            Transport::Auto => (TCP, Some(SHM)),
            Transport::Ibverbs => (IBVERBS, Some(SHM)),
        }
    }
}

/// The parts' names, as their devices name themselves.
const TCP: &str = "tcp";
const SHM: &str = "shm";
const IBVERBS: &str = "ibverbs";

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl std::str::FromStr for Transport {
    type Err = Error;

    /// A transport's [name](Transport::name), or an alias: `auto` (`tcp+shm`), `ibverbs` and
    /// `rdma` (`ibverbs+shm`), `shared-memory` (`shm`). Case does not matter.
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        let named =
            [Transport::Tcp, Transport::Shm, Transport::Auto, Transport::Ibverbs].into_iter().find(|t| t.name() == s);
        let alias = || match s.as_str() {
            "auto" => Some(Transport::Auto),
            "ibverbs" | "rdma" => Some(Transport::Ibverbs),
            "shared-memory" => Some(Transport::Shm),
            _ => None,
        };
        named.or_else(alias).ok_or_else(|| {
            Error::invalid(format!(
                "unknown transport {s:?} (expected {}, {}, {} (or auto) or {} (or ibverbs))",
                Transport::Tcp,
                Transport::Shm,
                Transport::Auto,
                Transport::Ibverbs
            ))
        })
    }
}

/// How to build an ibverbs (RDMA) [`Device`](super::Device) ([`Device::ibverbs`](super::Device::ibverbs)).
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
        Self::read(&Vars::process())
    }

    /// [`IbAttr::from_env`] as `vars` give it.
    pub(crate) fn read(vars: &Vars<'_>) -> Result<Self> {
        let byte = "a number from 0 to 255";
        let defaults = IbAttr::default();
        Ok(IbAttr {
            device: vars.text(FERROGLOO_IB_DEVICE),
            port: vars.parse(FERROGLOO_IB_PORT, byte)?.unwrap_or(defaults.port),
            gid_index: vars.parse(FERROGLOO_IB_GID_INDEX, byte)?,
            tcp: TcpAttr::read(vars)?,
            ..defaults
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

/// How to build a TCP [`Device`](super::Device): which address to listen on and socket tunables.
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
        Self::read(&Vars::process())
    }

    /// [`TcpAttr::from_env`] as `vars` give it.
    pub(crate) fn read(vars: &Vars<'_>) -> Result<Self> {
        Ok(TcpAttr {
            ip: vars.ip(FERROGLOO_ADDR)?,
            iface: vars.text(FERROGLOO_IFACE),
            hostname: vars.text(FERROGLOO_HOSTNAME),
            ..Self::default()
        })
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
