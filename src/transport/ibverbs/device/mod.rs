//! The ibverbs backend's device (a verbs device, its registration cache, where handshakes
//! listen) and its endpoint: a queue pair and rings made per peer before it connects, brought
//! up once the handshake ([`handshake`]) is through, and the mesh made of the links.

mod handshake;

use super::IbOptions;
use super::pair::{self, IbPair, Link, LinkParts, RQ_DEPTH, Region, SLOT_BYTES, SLOTS, SQ_DEPTH, WrKind};
use super::progress::{Guard, progress};
use super::reg::RegCache;
use super::verbs::{Access, CompletionQueue, QpAddr, QueuePair, VerbsDevice};
use super::{rdma, sim};
use crate::error::{Error, Result};
use crate::transport::accepting::Accepting;
use crate::transport::handshake::BackendKind;
use crate::transport::handshake::codec::to_vec;
use crate::transport::wake::EventFd;
use crate::transport::{Backend, ConnectError, Endpoint, EndpointSpec, Mesh, Pair, Passive, random16};
use handshake::{Blob, HANDSHAKE_TIMEOUT, IbConn, MAX_PENDING};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

/// Opens the backend `attr` describes.
pub(crate) fn open(attr: &IbOptions) -> Result<Arc<dyn Backend>> {
    let verbs = match attr.device.as_deref() {
        Some("sim") => sim::open(),
        name => rdma::open(name, attr.port, attr.gid_index)?,
    };
    open_on(verbs, attr)
}

/// The backend on an opened verbs device (`attr.device` is not looked at).
pub(crate) fn open_on(verbs: Arc<dyn VerbsDevice>, attr: &IbOptions) -> Result<Arc<dyn Backend>> {
    let ip = attr.ip;
    if ip.is_unspecified() {
        return Err(Error::invalid(format!(
            "{ip} is not an address peers can reach for the ibverbs handshake; name an interface or host"
        )));
    }
    let regs = Arc::new(RegCache::new(verbs.clone()));
    Ok(Arc::new(IbDevice { verbs, regs, ip, early_budget: attr.early_budget }))
}

pub(super) struct IbDevice {
    pub(super) verbs: Arc<dyn VerbsDevice>,
    pub(super) regs: Arc<RegCache>,
    /// Where endpoints listen for handshakes.
    pub(super) ip: IpAddr,
    pub(super) early_budget: usize,
}

impl Backend for IbDevice {
    fn name(&self) -> &str {
        "ibverbs"
    }

    fn host_only(&self) -> bool {
        self.ip.is_loopback()
    }

    fn endpoint(&self, spec: EndpointSpec) -> Result<Box<dyn Endpoint>> {
        IbEndpoint::new(self, spec).map(|e| Box::new(e) as Box<dyn Endpoint>)
    }
}

/// A queue pair and its memory, made for one peer before it connects.
pub(super) struct Prep {
    pub(super) qp: Arc<dyn QueuePair>,
    pub(super) psn: u32,
    pub(super) ring: Region,
    pub(super) staging: Region,
    pub(super) connected: bool,
}

pub(super) struct IbEndpoint {
    pub(super) spec: EndpointSpec,
    pub(super) verbs: Arc<dyn VerbsDevice>,
    pub(super) regs: Arc<RegCache>,
    pub(super) budget: usize,
    pub(super) cq: Arc<dyn CompletionQueue>,
    pub(super) listener: TcpListener,
    pub(super) preps: Vec<Option<Prep>>,
    pub(super) links: Vec<Option<Arc<Link>>>,
    /// Connections in their handshake.
    pub(super) accepting: Accepting<IbConn>,
}

fn psn() -> u32 {
    u32::from_le_bytes(random16()[..4].try_into().unwrap_or([1, 0, 0, 0])) & 0x00ff_ffff
}

impl IbEndpoint {
    pub(super) fn new(dev: &IbDevice, spec: EndpointSpec) -> Result<Self> {
        let peers = spec.size.saturating_sub(1).max(1);
        let cq = dev.verbs.create_cq(peers * (SQ_DEPTH + RQ_DEPTH) + 16)?;
        let listener = TcpListener::bind(SocketAddr::new(dev.ip, 0))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::io(format!("listening for ibverbs handshakes on {}", dev.ip), e))?;
        let mut preps = Vec::with_capacity(spec.size);
        for p in 0..spec.size {
            if p == spec.rank {
                preps.push(None);
                continue;
            }
            let qp = dev.verbs.create_qp(&cq, (SQ_DEPTH + 1) as u32, RQ_DEPTH as u32)?;
            let ring = Region::new(&*dev.verbs, SLOTS * SLOT_BYTES, Access::RemoteWrite)?;
            let staging = Region::new(&*dev.verbs, SLOTS * SLOT_BYTES, Access::LocalRead)?;
            preps.push(Some(Prep { qp, psn: psn(), ring, staging, connected: false }));
        }
        Ok(IbEndpoint {
            links: vec![None; spec.size],
            spec,
            verbs: dev.verbs.clone(),
            regs: dev.regs.clone(),
            budget: dev.early_budget,
            cq,
            listener,
            preps,
            accepting: Accepting::new(BackendKind::Ibverbs, HANDSHAKE_TIMEOUT, MAX_PENDING),
        })
    }

    /// This side's queue pair address for `peer`.
    pub(super) fn qp_addr(&self, prep: &Prep) -> QpAddr {
        let port = self.verbs.port();
        QpAddr { lid: port.lid, gid: port.gid, qpn: prep.qp.qpn(), psn: prep.psn, mtu: port.mtu }
    }

    /// Moves the queue pair for `peer` to RTS towards `remote` and posts its receives.
    pub(super) fn bring_up(&mut self, peer: usize, remote: &QpAddr) -> Result<()> {
        let Some(prep) = self.preps.get_mut(peer).and_then(Option::as_mut) else {
            return Err(Error::invalid(format!("no queue pair for rank {peer}")));
        };
        if prep.connected {
            return Ok(());
        }
        prep.qp.connect(prep.psn, remote)?;
        for _ in 0..RQ_DEPTH {
            prep.qp.post_recv(pair::wr_id(peer, WrKind::Recv, 0))?;
        }
        prep.connected = true;
        Ok(())
    }

    /// The link to `peer` over its prepared queue pair.
    pub(super) fn make_link(&mut self, peer: usize, remote_ring: (u64, u32), lifeline: TcpStream) -> Result<()> {
        let Some(prep) = self.preps.get_mut(peer).and_then(Option::take) else {
            return Err(Error::invalid(format!("rank {peer} connected twice")));
        };
        lifeline.set_nonblocking(true).map_err(|e| Error::io(format!("setting up the lifeline to rank {peer}"), e))?;
        let _ = lifeline.set_nodelay(true);
        let link = Link::new(LinkParts {
            me: self.spec.rank,
            peer,
            qp: prep.qp,
            ring: prep.ring,
            staging: prep.staging,
            remote_ring,
            regs: self.regs.clone(),
            lifeline,
            budget: self.budget,
        });
        self.links[peer] = Some(Arc::new(link));
        Ok(())
    }
}

impl Endpoint for IbEndpoint {
    fn address(&self) -> Vec<u8> {
        let sock = self.listener.local_addr().unwrap_or(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0));
        let (rank, size) = (self.spec.rank as u32, self.spec.size as u32);
        to_vec(&Blob { ctx: self.spec.ctx, rank, size, sock })
    }

    fn connect(&mut self, peer: usize, addr: &[u8], deadline: Instant) -> std::result::Result<(), ConnectError> {
        self.connect_to(peer, addr, deadline)
    }

    fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize> {
        // Each connection handshakes on its own, with its own time, several at once.
        let mut accepting = self.accepting.take();
        let missing =
            accepting.wait(self, until, |ep| peers.iter().copied().filter(|&p| ep.links[p].is_none()).collect());
        self.accepting = accepting;
        missing
    }

    fn finish(self: Box<Self>) -> Mesh {
        let me = self.spec.rank;
        let links = self.links;
        let pairs = links.iter().map(|l| l.clone().map(|link| Arc::new(IbPair { link }) as Arc<dyn Pair>)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let wake = EventFd::new().ok().map(Arc::new);
        let thread = {
            let (cq, mine, stop, wake) = (self.cq.clone(), links.clone(), stop.clone(), wake.clone());
            std::thread::Builder::new()
                .name(format!("ferrogloo-ib-{me}"))
                .spawn(move || progress(&*cq, &mine, &stop, wake.as_deref()))
                .map_err(|e| {
                    let err = Error::io(format!("rank {me}: starting the ibverbs progress thread"), e);
                    for l in links.iter().flatten() {
                        l.fail_with(err.clone());
                    }
                })
                .ok()
        };
        let guard = Guard { links, stop, wake, thread, _cq: self.cq, regs: self.regs };
        Mesh { pairs, progress: Arc::new(Passive), local: None, _guard: Box::new(guard) }
    }
}
