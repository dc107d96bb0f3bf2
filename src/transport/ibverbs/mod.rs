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
//! - this module: the device, the endpoint (queue pairs made per peer, the address blob in the
//!   store: where its TCP lifeline listens, nothing else), the one handshake
//!   ([`crate::transport::handshake`]) over a TCP connection that stays as the pair's
//!   lifeline: each side's queue pair address and ring (address and key) are its payload, handed
//!   only to a peer that proved the job's secret, and each side brings its queue pair up only
//!   then (the listening side handshakes with each connection on its own, several at once:
//!   [`crate::transport::accepting`]); and the progress thread that polls the completion queue (busy for a moment, then
//!   asleep on the completion channel and the lifelines).
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
    use crate::transport::accepting::{Accepting, Acceptor};
    use crate::transport::handshake::codec::{BufMutExt, Codec, DecodeError, Decoded, Reader, decode_all, to_vec};
    use crate::transport::handshake::messages::MAX_MESSAGE;
    use crate::transport::handshake::{BackendKind, Dial, Done, Event, Handshake, Local, Status};
    use crate::transport::wake::{EventFd, poll_fds};
    use crate::transport::{Backend, ConnectError, ContextId, Endpoint, EndpointSpec, Mesh, Pair, Passive, random16};
    use bytes::BufMut;
    use std::io::{Read, Write};
    use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
    use std::os::fd::{AsRawFd, RawFd};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    const BLOB_MAGIC: u32 = u32::from_le_bytes(*b"FGIB");
    /// The address blob's version (2: the lifeline's address only; the queue pairs and rings
    /// travel in the handshake).
    const BLOB_VERSION: u16 = 2;
    /// How long a handshake may take.
    const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
    /// Handshakes an endpoint runs at once; a new connection evicts the oldest.
    const MAX_PENDING: usize = 64;

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
        /// Connections in their handshake.
        accepting: Accepting<IbConn>,
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

    /// An endpoint's address blob: where its lifeline listens, for which context.
    /// `magic "FGIB" | version u16 | context id [16] | rank u32 | size u32 | IPv6 (or mapped
    /// IPv4) [16] | port u16`.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Blob {
        ctx: ContextId,
        rank: u32,
        size: u32,
        sock: SocketAddr,
    }

    impl Codec for Blob {
        fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
            if r.get::<u32>()? != BLOB_MAGIC {
                return Err(DecodeError::malformed(
                    "it is not an ibverbs endpoint's address (another transport's, or damaged)",
                ));
            }
            let version: u16 = r.get()?;
            if version != BLOB_VERSION {
                return Err(DecodeError::malformed(format!(
                    "its ibverbs address version is {version}, this rank's {BLOB_VERSION}"
                )));
            }
            let (ctx, rank, size) = (r.get()?, r.get()?, r.get()?);
            let ip = from_ip16(r.get()?);
            Ok(Blob { ctx, rank, size, sock: SocketAddr::new(ip, r.get()?) })
        }

        fn encode<B: BufMut>(&self, out: &mut B) {
            out.write(BLOB_MAGIC);
            out.write(BLOB_VERSION);
            out.write(self.ctx);
            out.write(self.rank);
            out.write(self.size);
            out.write(ip16(self.sock.ip()));
            out.write(self.sock.port());
        }
    }

    /// A side's handshake payload: its queue pair's address, and the ring the peer writes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Offer {
        qp: QpAddr,
        ring: u64,
        rkey: u32,
    }

    impl Codec for Offer {
        fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
            Ok(Offer { qp: r.get()?, ring: r.get()?, rkey: r.get()? })
        }

        fn encode<B: BufMut>(&self, out: &mut B) {
            out.write(self.qp);
            out.write(self.ring);
            out.write(self.rkey);
        }
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
                accepting: Accepting::new(BackendKind::Ibverbs, HANDSHAKE_TIMEOUT, MAX_PENDING),
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

        /// This side's payload for `peer`: its queue pair's address and its ring.
        fn offer(&self, peer: usize) -> Option<Offer> {
            let prep = self.preps.get(peer)?.as_ref()?;
            Some(Offer { qp: self.qp_addr(prep), ring: prep.ring.mr.addr(), rkey: prep.ring.mr.rkey() })
        }

        fn local(&self) -> Local {
            Local { ctx: self.spec.ctx, rank: self.spec.rank, size: self.spec.size, secret: self.spec.secret.clone() }
        }

        /// Brings the queue pair for `peer` up towards the offer in `payload` (from a peer that
        /// proved the secret); its ring, or the status to refuse the peer with.
        fn take_offer(&mut self, peer: usize, payload: &[u8]) -> std::result::Result<(u64, u32), Status> {
            let theirs: Offer = decode_all(payload, "an ibverbs offer").map_err(|e| {
                tracing::debug!(rank = self.spec.rank, peer, "an ibverbs offer that does not decode: {e}");
                Status::Settings
            })?;
            self.bring_up(peer, &theirs.qp).map_err(|e| {
                tracing::debug!(rank = self.spec.rank, peer, "its queue pair cannot connect: {e}");
                Status::Unavailable
            })?;
            Ok((theirs.ring, theirs.rkey))
        }
    }

    /// A connection the acceptor handshakes on, and the peer's ring once it proved the secret
    /// and this side's queue pair is up towards its own.
    pub(super) struct IbConn {
        stream: TcpStream,
        ring: Option<(u64, u32)>,
    }

    impl Acceptor for IbEndpoint {
        type Conn = IbConn;
        const NAME: &'static str = "ibverbs";

        fn accept(&mut self) -> std::io::Result<Option<IbConn>> {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(true)?;
                    Ok(Some(IbConn { stream, ring: None }))
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
                Err(e) => Err(e),
            }
        }

        fn listener_fd(&self) -> RawFd {
            self.listener.as_raw_fd()
        }

        fn fd(conn: &IbConn) -> RawFd {
            conn.stream.as_raw_fd()
        }

        fn send(&self, conn: &mut IbConn, bytes: &[u8], _: bool) -> std::io::Result<()> {
            match conn.stream.write(bytes)? {
                n if n == bytes.len() => Ok(()),
                _ => Err(std::io::ErrorKind::WriteZero.into()),
            }
        }

        fn recv(&self, conn: &mut IbConn, buf: &mut [u8]) -> std::io::Result<usize> {
            conn.stream.read(buf)
        }

        fn decide(&mut self, hs: &mut Handshake, ev: &Event, conn: &mut IbConn) {
            match ev {
                Event::Hello(h) => {
                    let taken = self.links.get(h.from as usize).is_some_and(Option::is_some);
                    hs.admit(Some(&self.local()), &self.address(), taken);
                }
                Event::Proved(p) if self.links.get(p.rank).is_some_and(Option::is_some) => hs.refuse(Status::Duplicate),
                Event::Proved(p) => match self.take_offer(p.rank, hs.payload()) {
                    Ok(r) => match self.offer(p.rank) {
                        Some(mine) => {
                            hs.respond(&to_vec(&mine));
                            conn.ring = Some(r);
                        }
                        None => hs.refuse(Status::BadRank),
                    },
                    Err(status) => hs.refuse(status),
                },
                _ => {}
            }
        }

        fn finished(&mut self, conn: IbConn, done: Done) {
            let peer = done.peer.rank;
            let Some(ring) = conn.ring else {
                return tracing::warn!(
                    rank = self.spec.rank,
                    peer,
                    "an ibverbs handshake ended without the peer's ring"
                );
            };
            if let Err(e) = self.make_link(peer, ring, conn.stream) {
                tracing::warn!(rank = self.spec.rank, peer, error = %e, "refused an ibverbs connection");
            }
        }
    }

    /// Runs `hs` over `s` until it ends, letting `decide` answer its questions. Errors: what
    /// went wrong, and whether it was the path (worth retrying) rather than a refusal.
    fn run(
        s: &mut TcpStream,
        hs: &mut Handshake,
        mut decide: impl FnMut(&mut Handshake, &Event),
    ) -> std::result::Result<Done, (String, bool)> {
        let mut buf = [0u8; MAX_MESSAGE];
        loop {
            match hs.poll() {
                Event::Send(o) => s.write_all(&o.bytes).map_err(|e| (format!("sending the handshake: {e}"), true))?,
                Event::Need(n) => {
                    let got = &mut buf[..n.min(MAX_MESSAGE)];
                    s.read_exact(got).map_err(|e| (format!("reading the handshake: {e}"), true))?;
                    hs.feed(got);
                }
                Event::Done(d) => return Ok(d),
                Event::Refused(why) => return Err((why.to_string(), false)),
                ev => decide(hs, &ev),
            }
        }
    }

    impl Endpoint for IbEndpoint {
        fn address(&self) -> Vec<u8> {
            let sock = self.listener.local_addr().unwrap_or(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0));
            let (rank, size) = (self.spec.rank as u32, self.spec.size as u32);
            to_vec(&Blob { ctx: self.spec.ctx, rank, size, sock })
        }

        fn connect(&mut self, peer: usize, addr: &[u8], deadline: Instant) -> std::result::Result<(), ConnectError> {
            let refused = |detail: String| ConnectError::Refused(Error::Protocol { peer: Some(peer), detail });
            let blob: Blob = decode_all(addr, "an ibverbs address").map_err(|e| refused(e.to_string()))?;
            if blob.ctx != self.spec.ctx {
                return Err(refused("its address belongs to another context (a stale store entry)".into()));
            }
            if blob.size as usize != self.spec.size || peer >= self.spec.rank {
                return Err(refused(format!(
                    "the world sizes or ranks do not fit (rank {} of {} connecting to rank {peer} of {})",
                    self.spec.rank, self.spec.size, blob.size
                )));
            }
            let mine = self.offer(peer).ok_or_else(|| refused(format!("no queue pair for rank {peer}")))?;
            let retry = |what: &str, e: String| {
                ConnectError::Retry(Error::Protocol {
                    peer: Some(peer),
                    detail: format!("{what} rank {peer} at {} (ibverbs handshake): {e}", blob.sock),
                })
            };
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
            let mut s = TcpStream::connect_timeout(&blob.sock, left.min(Duration::from_secs(2))).map_err(|e| {
                ConnectError::Retry(Error::io(format!("connecting to rank {peer} at {}", blob.sock), e))
            })?;
            s.set_read_timeout(Some(left.min(HANDSHAKE_TIMEOUT)))
                .and_then(|()| s.set_write_timeout(Some(left.min(HANDSHAKE_TIMEOUT))))
                .map_err(|e| retry("configuring the connection to", e.to_string()))?;
            let mut hs = Handshake::connect(Dial {
                kind: BackendKind::Ibverbs,
                local: self.local(),
                to: peer,
                lane: 0,
                address: addr,
                payload: to_vec(&mine),
                nonce: random16(),
            });
            let mut ring = None;
            // The acceptor's welcome carries its queue pair: bring this side's up before the
            // ready message lets it send.
            let done = run(&mut s, &mut hs, |hs, ev| {
                if let Event::Proved(_) = ev {
                    match self.take_offer(peer, hs.payload()) {
                        Ok(r) => {
                            ring = Some(r);
                            hs.respond(&[]);
                        }
                        Err(status) => hs.refuse(status),
                    }
                }
            });
            match done {
                Ok(_) => {}
                Err((why, true)) => return Err(retry("handshaking with", why)),
                Err((why, false)) => return Err(refused(why)),
            }
            let ring = ring.ok_or_else(|| refused("its welcome carried no ring".into()))?;
            self.make_link(peer, ring, s).map_err(ConnectError::Refused)
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

    #[cfg(test)]
    mod attack_tests {
        //! The attacks of [`crate::transport::handshake::attacks`] on ibverbs endpoints
        //! (simulated provider), with the rings' addresses as what must not reach a stranger.
        use super::*;
        use crate::transport::handshake::attacks::{Attack, Listener, attack, dial_tcp, spec};

        fn device() -> IbDevice {
            let verbs = sim::open();
            let regs = Arc::new(RegCache::new(verbs.clone()));
            IbDevice { verbs, regs, ip: IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), early_budget: 1 << 20 }
        }

        /// `blob` with the lifeline's address `at` instead.
        fn with_sock(blob: &[u8], at: SocketAddr) -> Vec<u8> {
            let blob: Blob = decode_all(blob, "an address").expect("an ibverbs address");
            to_vec(&Blob { sock: at, ..blob })
        }

        fn on_ib(relay: bool) -> Vec<String> {
            let (dev_a, dev_b) = (device(), device());
            let ctx = random16();
            let mut a = IbEndpoint::new(&dev_a, spec(ctx, 0)).expect("rank 0");
            let mut b = IbEndpoint::new(&dev_b, spec(ctx, 1)).expect("rank 1");
            let ring = |e: &IbEndpoint, p: usize| e.offer(p).map(|o| o.ring.to_le_bytes().to_vec());
            let (a_ring, b_ring) = (ring(&a, 1).expect("a ring"), ring(&b, 0).expect("a ring"));
            let (listener, at) = Listener::tcp();
            let real = decode_all::<Blob>(&a.address(), "an address").expect("rank 0's address").sock;
            let dial = move || dial_tcp(real);
            let mut wrong = Vec::new();
            if a.address().windows(8).any(|w| w == a_ring) {
                wrong.push("rank 0's address in the store carries its ring's address".to_string());
            }
            let fake = with_sock(&a.address(), at);
            let attack_ =
                Attack { listener, fake, dial: &dial, b_private: vec![b_ring], a_private: vec![a_ring], relay };
            wrong.extend(attack(&mut a, &mut b, &attack_));
            wrong
        }

        #[test]
        fn a_replayed_ibverbs_hello_is_refused() {
            let wrong = on_ib(false);
            assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        }

        #[test]
        fn a_fake_ibverbs_acceptor_gets_neither_the_ring_nor_a_link() {
            let wrong = on_ib(true);
            assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        }

        #[test]
        fn address_blobs_round_trip_and_garbage_does_not_decode() {
            let b = Blob { ctx: [3; 16], rank: 2, size: 5, sock: "[fe80::1]:7000".parse().expect("an address") };
            assert_eq!(decode_all::<Blob>(&to_vec(&b), "a blob"), Ok(b.clone()));
            let v4 = Blob { sock: "10.1.2.3:9".parse().expect("an address"), ..b };
            assert_eq!(decode_all::<Blob>(&to_vec(&v4), "a blob"), Ok(v4));
            assert!(decode_all::<Blob>(b"127.0.0.1:5000", "a blob").is_err());
        }
    }
}
