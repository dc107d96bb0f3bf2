//! The ibverbs (RDMA) transport, behind the cargo feature `ibverbs` (without it, a stub that
//! answers every request with [`Error::Unsupported`]).
//!
//! Layers, bottom up:
//!
//! - [`verbs`]: the verbs the backend uses, as traits, with two providers: [`rdma`] over
//!   `rdma-sys` (libibverbs) and [`sim`], a simulated fabric in this process that the tests run
//!   on (no machine here has an RDMA device).
//! - [`reg`]: registration of user buffers, cached where that is sound.
//! - [`pair`]: the protocol of one pair over a reliable-connected queue pair (eager messages
//!   through registered rings, large ones read by the receiver straight from the sender's
//!   buffer, credits, aborts on a TCP lifeline).
//! - this module: the device, the endpoint (queue pairs made per peer, the address blob in the
//!   store, a TCP handshake that moves the lower rank's queue pair to RTS and stays as the
//!   pair's lifeline), and the progress thread that polls the completion queue (busy for a
//!   moment, then asleep on the completion channel and the lifelines).
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
pub(crate) use backend::open;
#[cfg(all(test, feature = "ibverbs"))]
pub(crate) use backend::open_on;

#[cfg(feature = "ibverbs")]
mod backend {
    use super::IbOptions;
    use super::pair::{self, IbPair, Link, LinkParts, RQ_DEPTH, Region, SLOT_BYTES, SLOTS, SQ_DEPTH, WrKind};
    use super::reg::RegCache;
    use super::verbs::{Access, CompletionQueue, QpAddr, QueuePair, VerbsDevice, Wc};
    use super::{rdma, sim};
    use crate::error::{Error, Result};
    use crate::transport::auth::{mac, mac_eq};
    use crate::transport::handshake::codec::{Codec, Reader};
    use crate::transport::wake::{EventFd, poll_fds};
    use crate::transport::{Backend, ConnectError, Endpoint, EndpointSpec, Mesh, Pair, Passive, random16};
    use std::io::{Read, Write};
    use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    const BLOB_MAGIC: &[u8; 4] = b"FGIB";
    const HELLO_MAGIC: &[u8; 4] = b"FGIH";
    const VERSION: u16 = 1;
    /// Magic, version, context, rank, size, LID, GID, MTU, IP, port.
    const BLOB_HEAD: usize = 4 + 2 + 16 + 4 + 4 + 2 + 16 + 1 + 16 + 2;
    /// Per rank: QPN, PSN, ring address, ring key.
    const BLOB_ENTRY: usize = 4 + 4 + 8 + 4;
    /// Magic, version, context, from, to, size, queue pair address, ring address and key, MAC.
    const HELLO_LEN: usize = 4 + 2 + 16 + 4 + 4 + 4 + QpAddr::LEN + 8 + 4 + 32;
    const MAC_LABEL: &str = "ferrogloo-ibverbs-hello";
    /// How long a handshake's reads may take.
    const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

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

    struct IbDevice {
        verbs: Arc<dyn VerbsDevice>,
        regs: Arc<RegCache>,
        /// Where endpoints listen for handshakes.
        ip: IpAddr,
        early_budget: usize,
    }

    impl Backend for IbDevice {
        fn name(&self) -> &'static str {
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
    struct Prep {
        qp: Arc<dyn QueuePair>,
        psn: u32,
        ring: Region,
        staging: Region,
        connected: bool,
    }

    struct IbEndpoint {
        spec: EndpointSpec,
        verbs: Arc<dyn VerbsDevice>,
        regs: Arc<RegCache>,
        budget: usize,
        cq: Arc<dyn CompletionQueue>,
        listener: TcpListener,
        preps: Vec<Option<Prep>>,
        links: Vec<Option<Arc<Link>>>,
    }

    fn psn() -> u32 {
        u32::from_le_bytes(random16()[..4].try_into().unwrap_or([1, 0, 0, 0])) & 0x00ff_ffff
    }

    fn ip16(ip: IpAddr) -> [u8; 16] {
        match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            IpAddr::V6(v6) => v6.octets(),
        }
    }

    fn from_ip16(b: [u8; 16]) -> IpAddr {
        let v6 = Ipv6Addr::from(b);
        v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
    }

    fn u32_at(b: &[u8], at: usize) -> u32 {
        let mut x = [0u8; 4];
        x.copy_from_slice(&b[at..at + 4]);
        u32::from_le_bytes(x)
    }

    fn u64_at(b: &[u8], at: usize) -> u64 {
        let mut x = [0u8; 8];
        x.copy_from_slice(&b[at..at + 8]);
        u64::from_le_bytes(x)
    }

    /// A peer's address blob, decoded.
    struct Blob {
        ctx: [u8; 16],
        size: usize,
        lid: u16,
        gid: [u8; 16],
        mtu: u8,
        sock: SocketAddr,
        /// (QPN, PSN, ring address, ring key) per rank.
        entries: Vec<(u32, u32, u64, u32)>,
    }

    fn decode_blob(b: &[u8]) -> std::result::Result<Blob, String> {
        if b.len() < BLOB_HEAD || &b[..4] != BLOB_MAGIC {
            return Err("it is not an ibverbs endpoint's address (another transport's, or damaged)".into());
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(format!("its ibverbs protocol version is {version}, this rank's {VERSION}"));
        }
        let mut ctx = [0u8; 16];
        ctx.copy_from_slice(&b[6..22]);
        let size = u32_at(b, 26) as usize;
        if b.len() != BLOB_HEAD + size * BLOB_ENTRY {
            return Err(format!("its address has {} bytes, not what {size} ranks take", b.len()));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[32..48]);
        let mut ip = [0u8; 16];
        ip.copy_from_slice(&b[49..65]);
        let port = u16::from_le_bytes([b[65], b[66]]);
        let entries = (0..size)
            .map(|r| {
                let at = BLOB_HEAD + r * BLOB_ENTRY;
                (u32_at(b, at), u32_at(b, at + 4), u64_at(b, at + 8), u32_at(b, at + 16))
            })
            .collect();
        Ok(Blob {
            ctx,
            size,
            lid: u16::from_le_bytes([b[30], b[31]]),
            gid,
            mtu: b[48],
            sock: SocketAddr::new(from_ip16(ip), port),
            entries,
        })
    }

    impl IbEndpoint {
        fn new(dev: &IbDevice, spec: EndpointSpec) -> Result<Self> {
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
            })
        }

        /// This side's queue pair address for `peer`.
        fn qp_addr(&self, prep: &Prep) -> QpAddr {
            let port = self.verbs.port();
            QpAddr { lid: port.lid, gid: port.gid, qpn: prep.qp.qpn(), psn: prep.psn, mtu: port.mtu }
        }

        /// Moves the queue pair for `peer` to RTS towards `remote` and posts its receives.
        fn bring_up(&mut self, peer: usize, remote: &QpAddr) -> Result<()> {
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
        fn make_link(&mut self, peer: usize, remote_ring: (u64, u32), lifeline: TcpStream) -> Result<()> {
            let Some(prep) = self.preps.get_mut(peer).and_then(Option::take) else {
                return Err(Error::invalid(format!("rank {peer} connected twice")));
            };
            lifeline
                .set_nonblocking(true)
                .map_err(|e| Error::io(format!("setting up the lifeline to rank {peer}"), e))?;
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

        fn hello(&self, peer: usize) -> Vec<u8> {
            let mut h = Vec::with_capacity(HELLO_LEN);
            h.extend_from_slice(HELLO_MAGIC);
            h.extend_from_slice(&VERSION.to_le_bytes());
            h.extend_from_slice(&self.spec.ctx);
            h.extend_from_slice(&(self.spec.rank as u32).to_le_bytes());
            h.extend_from_slice(&(peer as u32).to_le_bytes());
            h.extend_from_slice(&(self.spec.size as u32).to_le_bytes());
            if let Some(prep) = self.preps[peer].as_ref() {
                self.qp_addr(prep).encode(&mut h);
                h.extend_from_slice(&prep.ring.mr.addr().to_le_bytes());
                h.extend_from_slice(&prep.ring.mr.rkey().to_le_bytes());
            }
            let m = mac(self.spec.secret.as_deref(), &[MAC_LABEL.as_bytes(), &h, &self.spec.ctx]);
            h.extend_from_slice(&m);
            h
        }

        /// Answers one handshake on the listener (the lower rank's side).
        fn accept(&mut self, mut s: TcpStream) -> std::result::Result<(), String> {
            s.set_nonblocking(false).map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| e.to_string())?;
            s.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| e.to_string())?;
            let mut h = [0u8; HELLO_LEN];
            s.read_exact(&mut h).map_err(|e| format!("reading a hello: {e}"))?;
            let refuse = |s: &mut TcpStream, why: String| {
                let mut r = vec![1u8];
                r.extend_from_slice(&(why.len() as u16).to_le_bytes());
                r.extend_from_slice(why.as_bytes());
                let _ = s.write_all(&r);
                why
            };
            if &h[..4] != HELLO_MAGIC || u16::from_le_bytes([h[4], h[5]]) != VERSION {
                return Err(refuse(&mut s, "not an ibverbs hello of this version".into()));
            }
            if h[6..22] != self.spec.ctx {
                return Err(refuse(&mut s, "this endpoint belongs to another context (a stale address)".into()));
            }
            let (from, to, size) = (u32_at(&h, 22) as usize, u32_at(&h, 26) as usize, u32_at(&h, 30) as usize);
            if to != self.spec.rank || size != self.spec.size || from <= self.spec.rank || from >= size {
                return Err(refuse(
                    &mut s,
                    format!(
                        "rank {from} of {size} asked for rank {to}; this is rank {} of {}",
                        self.spec.rank, self.spec.size
                    ),
                ));
            }
            let body = &h[..HELLO_LEN - 32];
            let mut theirs = [0u8; 32];
            theirs.copy_from_slice(&h[HELLO_LEN - 32..]);
            if !mac_eq(&mac(self.spec.secret.as_deref(), &[MAC_LABEL.as_bytes(), body, &self.spec.ctx]), &theirs) {
                return Err(refuse(&mut s, "the shared secrets differ".into()));
            }
            if self.links[from].is_some() {
                return Err(refuse(&mut s, format!("rank {from} is already connected")));
            }
            let at = 34;
            let Ok(remote) = Reader::new(&h[at..]).get::<QpAddr>() else {
                return Err(refuse(&mut s, "a bad address".into()));
            };
            let ring = (u64_at(&h, at + QpAddr::LEN), u32_at(&h, at + QpAddr::LEN + 8));
            if let Err(e) = self.bring_up(from, &remote) {
                return Err(refuse(&mut s, format!("its queue pair cannot connect: {e}")));
            }
            s.write_all(&[0, 0, 0]).map_err(|e| format!("answering rank {from}: {e}"))?;
            self.make_link(from, ring, s).map_err(|e| e.to_string())
        }
    }

    impl Endpoint for IbEndpoint {
        fn address(&self) -> Vec<u8> {
            let port = self.verbs.port();
            let sock = self.listener.local_addr().ok();
            let mut b = Vec::with_capacity(BLOB_HEAD + self.spec.size * BLOB_ENTRY);
            b.extend_from_slice(BLOB_MAGIC);
            b.extend_from_slice(&VERSION.to_le_bytes());
            b.extend_from_slice(&self.spec.ctx);
            b.extend_from_slice(&(self.spec.rank as u32).to_le_bytes());
            b.extend_from_slice(&(self.spec.size as u32).to_le_bytes());
            b.extend_from_slice(&port.lid.to_le_bytes());
            b.extend_from_slice(&port.gid);
            b.push(port.mtu);
            b.extend_from_slice(&ip16(sock.map_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED), |s| s.ip())));
            b.extend_from_slice(&sock.map_or(0, |s| s.port()).to_le_bytes());
            for p in &self.preps {
                match p {
                    Some(p) => {
                        b.extend_from_slice(&p.qp.qpn().to_le_bytes());
                        b.extend_from_slice(&p.psn.to_le_bytes());
                        b.extend_from_slice(&p.ring.mr.addr().to_le_bytes());
                        b.extend_from_slice(&p.ring.mr.rkey().to_le_bytes());
                    }
                    None => b.extend_from_slice(&[0u8; BLOB_ENTRY]),
                }
            }
            b
        }

        fn connect(&mut self, peer: usize, addr: &[u8], deadline: Instant) -> std::result::Result<(), ConnectError> {
            let refused = |detail: String| ConnectError::Refused(Error::Protocol { peer: Some(peer), detail });
            let blob = decode_blob(addr).map_err(refused)?;
            if blob.ctx != self.spec.ctx {
                return Err(refused("its address belongs to another context (a stale store entry)".into()));
            }
            if blob.size != self.spec.size || peer >= self.spec.rank {
                return Err(refused(format!(
                    "the world sizes or ranks do not fit (rank {} of {} connecting to rank {peer} of {})",
                    self.spec.rank, self.spec.size, blob.size
                )));
            }
            let (qpn, psn, ring_addr, ring_key) = blob.entries[self.spec.rank];
            let remote = QpAddr { lid: blob.lid, gid: blob.gid, qpn, psn, mtu: blob.mtu };
            self.bring_up(peer, &remote).map_err(ConnectError::Refused)?;
            let retry = |what: &str, e: std::io::Error| {
                ConnectError::Retry(Error::io(format!("{what} rank {peer} at {} (ibverbs handshake)", blob.sock), e))
            };
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
            let mut s = TcpStream::connect_timeout(&blob.sock, left.min(Duration::from_secs(2)))
                .map_err(|e| retry("connecting to", e))?;
            let hello = self.hello(peer);
            let io = s
                .set_read_timeout(Some(left.min(HANDSHAKE_TIMEOUT)))
                .and_then(|()| s.set_write_timeout(Some(left.min(HANDSHAKE_TIMEOUT))))
                .and_then(|()| s.write_all(&hello));
            io.map_err(|e| retry("greeting", e))?;
            let mut head = [0u8; 3];
            s.read_exact(&mut head).map_err(|e| retry("reading the answer of", e))?;
            if head[0] != 0 {
                let n = u16::from_le_bytes([head[1], head[2]]) as usize;
                let mut why = vec![0u8; n.min(1024)];
                let _ = s.read_exact(&mut why);
                return Err(refused(format!("it refused the handshake: {}", String::from_utf8_lossy(&why))));
            }
            self.make_link(peer, (ring_addr, ring_key), s).map_err(ConnectError::Refused)
        }

        fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize> {
            loop {
                let missing: Vec<usize> = peers.iter().copied().filter(|&p| self.links[p].is_none()).collect();
                let now = Instant::now();
                if missing.is_empty() || now >= until {
                    return missing;
                }
                match self.listener.accept() {
                    Ok((s, from)) => {
                        if let Err(why) = self.accept(s) {
                            tracing::debug!(rank = self.spec.rank, %from, "ibverbs handshake refused: {why}");
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        let mut fds =
                            [libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
                        let _ = poll_fds(&mut fds, (until - now).min(Duration::from_millis(100)));
                    }
                    Err(e) => {
                        tracing::debug!(rank = self.spec.rank, "accepting an ibverbs handshake: {e}");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
        }

        fn finish(self: Box<Self>) -> Mesh {
            let me = self.spec.rank;
            let links = self.links;
            let pairs =
                links.iter().map(|l| l.clone().map(|link| Arc::new(IbPair { link }) as Arc<dyn Pair>)).collect();
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

    /// Stops the progress thread and closes the links when the mesh is dropped.
    struct Guard {
        links: Vec<Option<Arc<Link>>>,
        stop: Arc<AtomicBool>,
        wake: Option<Arc<EventFd>>,
        thread: Option<JoinHandle<()>>,
        _cq: Arc<dyn CompletionQueue>,
        regs: Arc<RegCache>,
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            for l in self.links.iter().flatten() {
                pair::close(l);
            }
            self.stop.store(true, Ordering::Release);
            if let Some(w) = &self.wake {
                w.signal();
            }
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
            // Cached registrations of user buffers end with the last context that could use
            // them (the links hold the cache too: they go first); the next context registers
            // again.
            self.links.clear();
            if Arc::strong_count(&self.regs) <= 2 {
                self.regs.clear();
            }
        }
    }

    /// How often a busy progress thread looks at the lifelines.
    const LIFELINE_EVERY: Duration = Duration::from_millis(2);

    /// Reads the lifelines `poll` found readable (`fds[i]` is peer `i`'s).
    fn read_lifelines(fds: &mut [libc::pollfd], links: &[Option<Arc<Link>>]) {
        for (fd, link) in fds.iter_mut().zip(links) {
            if fd.revents == 0 {
                continue;
            }
            fd.revents = 0;
            if let Some(l) = link {
                l.lifeline_readable();
                if l.is_failed() {
                    fd.fd = -1; // its end was read: nothing more to watch
                }
            }
        }
    }

    /// How long the progress thread polls the completion queue before it sleeps.
    const SPIN: Duration = Duration::from_micros(50);

    /// The progress thread: completions to their links, lifelines read, until stopped.
    fn progress(cq: &dyn CompletionQueue, links: &[Option<Arc<Link>>], stop: &AtomicBool, wake: Option<&EventFd>) {
        let mut wcs: Vec<Wc> = Vec::with_capacity(64);
        let dispatch = |wcs: &mut Vec<Wc>| {
            for wc in wcs.drain(..) {
                if let Some(Some(l)) = links.get(pair::wr_peer(wc.wr_id)) {
                    l.completed(&wc);
                }
            }
        };
        // Descriptors: the completion channel, the wake-up, then each peer's lifeline.
        let mut fds: Vec<libc::pollfd> = [Some(cq.fd()), wake.map(EventFd::raw)]
            .into_iter()
            .chain(links.iter().map(|l| l.as_ref().map(|l| l.lifeline().as_raw_fd())))
            .map(|fd| libc::pollfd { fd: fd.unwrap_or(-1), events: libc::POLLIN, revents: 0 })
            .collect();
        let mut idle_since = Instant::now();
        let mut lifelines_seen = Instant::now();
        while !stop.load(Ordering::Acquire) {
            if let Err(e) = cq.poll(&mut wcs, 64) {
                for l in links.iter().flatten() {
                    l.fail_with(e.clone());
                }
                return;
            }
            if !wcs.is_empty() {
                dispatch(&mut wcs);
                idle_since = Instant::now();
                // Under steady traffic the completion queue is never idle: look at the
                // lifelines now and then anyway (aborts, a peer's end).
                if lifelines_seen.elapsed() >= LIFELINE_EVERY {
                    lifelines_seen = Instant::now();
                    if poll_fds(&mut fds[2..], Duration::ZERO).is_ok_and(|n| n > 0) {
                        // Completions first, as below: what a peer wrote before its lifeline
                        // ended is taken before the end fails the pair.
                        let _ = cq.poll(&mut wcs, usize::MAX);
                        dispatch(&mut wcs);
                        read_lifelines(&mut fds[2..], links);
                    }
                }
                continue;
            }
            if idle_since.elapsed() < SPIN {
                std::thread::yield_now();
                continue;
            }
            // Arm, then look once more: a completion between the last poll and the arming
            // raised no event.
            if cq.arm().is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = cq.poll(&mut wcs, 64);
            if !wcs.is_empty() {
                dispatch(&mut wcs);
                idle_since = Instant::now();
                continue;
            }
            if poll_fds(&mut fds, Duration::from_millis(200)).is_err() {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            if fds[0].revents != 0 {
                cq.ack();
            }
            if fds[1].revents != 0
                && let Some(w) = wake
            {
                w.drain();
            }
            // Completions first: what a peer wrote before its lifeline ended is taken before the
            // end fails the pair.
            let _ = cq.poll(&mut wcs, usize::MAX);
            dispatch(&mut wcs);
            read_lifelines(&mut fds[2..], links);
            lifelines_seen = Instant::now();
            idle_since = Instant::now();
        }
        // Completions still queued (reads that finished) reach their links, so that nothing
        // waits for them.
        let _ = cq.poll(&mut wcs, usize::MAX);
        dispatch(&mut wcs);
    }
}
