//! Devices: where a rank listens and how it reaches its peers.
//!
//! A [`Device`] owns one listening socket and one event-loop thread; every
//! [`Context`](crate::Context) made on it shares them. Build one from [`TcpAttr`]:
//!
//! ```
//! use ferrogloo::device::{Device, TcpAttr};
//! let dev = Device::new(&TcpAttr::loopback()).unwrap();
//! assert!(dev.local_addr().ip().is_loopback());
//! ```

use crate::error::{Error, Result};
use crate::transport::tcp::device::{DeviceCore, Shared, TcpOptions};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

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
/// first address of `family`), `hostname` (resolved), else the loopback address of `family`.
/// [`TcpAttr::from_env`] fills `iface` and `hostname` from `FERROGLOO_IFACE` and
/// `FERROGLOO_HOSTNAME`, the usual way to point a multi-host job at the right network.
#[derive(Debug, Clone)]
pub struct TcpAttr {
    /// Listen on this address.
    pub ip: Option<IpAddr>,
    /// Listen on this network interface (for example `eth0`).
    pub iface: Option<String>,
    /// Listen on the address this host name resolves to.
    pub hostname: Option<String>,
    /// Address family when choosing by interface, hostname or loopback (default IPv4).
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
        Self::default()
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

    /// Defaults, with `iface` from `FERROGLOO_IFACE` and `hostname` from
    /// `FERROGLOO_HOSTNAME` when set.
    pub fn from_env() -> Self {
        TcpAttr {
            iface: std::env::var("FERROGLOO_IFACE").ok().filter(|s| !s.is_empty()),
            hostname: std::env::var("FERROGLOO_HOSTNAME").ok().filter(|s| !s.is_empty()),
            ..Self::default()
        }
    }

    fn wants(&self, ip: &IpAddr) -> bool {
        matches!((self.family, ip), (Family::V4, IpAddr::V4(_)) | (Family::V6, IpAddr::V6(_)))
    }

    /// The IP address to listen on.
    pub fn resolve(&self) -> Result<IpAddr> {
        if let Some(ip) = self.ip {
            return Ok(ip);
        }
        if let Some(name) = &self.iface {
            let ifs = if_addrs::get_if_addrs().map_err(|e| Error::io("listing network interfaces", e))?;
            return ifs
                .iter()
                .filter(|i| &i.name == name)
                .map(|i| i.ip())
                .find(|ip| self.wants(ip))
                .ok_or_else(|| Error::invalid(format!("network interface {name:?} has no {:?} address", self.family)));
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
        Ok(match self.family {
            Family::V4 => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Family::V6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
        })
    }
}

/// A TCP device: a listening socket plus the event-loop thread that drives every connection of
/// every context made on it. Cheap to clone; the thread stops (and every socket closes) when the
/// last clone and the last context using it are dropped.
#[derive(Clone)]
pub struct Device {
    core: Arc<DeviceCore>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("addr", &self.local_addr()).finish()
    }
}

impl Device {
    /// Binds the listener described by `attr` and starts its event loop.
    pub fn new(attr: &TcpAttr) -> Result<Self> {
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
        Ok(Device { core: Arc::new(DeviceCore::start(&addrs, opts)?) })
    }

    /// A device on loopback with default settings.
    pub fn loopback() -> Result<Self> {
        Self::new(&TcpAttr::loopback())
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.core.shared.addr
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.core.shared
    }
}
