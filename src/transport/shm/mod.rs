//! Shared memory for ranks of one host: rings in `memfd` segments, handed over a Unix socket.
//!
//! Each rank's endpoint creates its segment ([`segment`]) and a doorbell (an eventfd), and
//! listens on an abstract Unix socket (no file anywhere, so a crashed job leaves nothing behind)
//! named after the context and the rank: the address it publishes. The higher rank of a pair
//! connects, and the two exchange, with `SCM_RIGHTS`, their segments and doorbells, each
//! checks whether it can read the other's memory with `process_vm_readv` (large messages then
//! move with one copy, [`pair`]), and they keep the socket as the pair's lifeline. Each maps the
//! other's segment and closes the descriptor: the memory lives as long as a mapping of it.
//!
//! Abstract Unix sockets belong to a network namespace: ranks on one host but in different
//! namespaces cannot meet this way, which is why the host identity includes the namespace.

pub(crate) mod area;
pub(crate) mod pair;
pub(crate) mod progress;
pub(crate) mod ring;
pub(crate) mod segment;

use crate::error::{Error, Result};
use crate::transport::auth::{mac, mac_eq};
use crate::transport::wake::{EventFd, poll_fds};
use crate::transport::{Backend, ConnectError, ContextId, Endpoint, EndpointSpec, Mesh, Pair, random16};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use pair::{PairParts, ShmPair};
use progress::ShmProgress;
use segment::{Layout, Segment};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tunables of a shared-memory device.
#[derive(Debug, Clone)]
pub(crate) struct ShmOptions {
    /// Bytes of each ring (one per peer, in each rank's segment).
    pub(crate) ring_bytes: usize,
    /// Bytes of each rank's collective area.
    pub(crate) coll_bytes: usize,
    /// Bytes per pair that may arrive before their receive is posted.
    pub(crate) early_budget: usize,
    /// Time a connection has to complete its handshake.
    pub(crate) handshake_timeout: Duration,
    /// Whether this rank reads its peers' large messages straight from their memory, where
    /// the kernel allows it.
    pub(crate) single_copy: bool,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            ring_bytes: 1 << 20,
            coll_bytes: 4 << 20,
            early_budget: 8 << 20,
            handshake_timeout: Duration::from_secs(10),
            single_copy: false,
        }
    }
}

/// The shared-memory backend of a [`Device`](crate::device::Device).
#[derive(Debug)]
pub(crate) struct ShmDevice {
    opts: ShmOptions,
}

impl ShmDevice {
    pub(crate) fn new(opts: ShmOptions) -> Self {
        ShmDevice { opts }
    }
}

/// A word whose address peers read with `process_vm_readv` to learn whether they may.
static PROBE: u64 = u64::from_le_bytes(*b"FGPROBE1");

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"FGSH");
const VERSION: u16 = 1;
const HELLO_LEN: usize = 96;
const ACK_LEN: usize = 96;
const FINAL_LEN: usize = 40;

impl Backend for ShmDevice {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn host_only(&self) -> bool {
        true
    }

    fn endpoint(&self, spec: EndpointSpec) -> Result<Box<dyn Endpoint>> {
        Ok(Box::new(ShmEndpoint::new(spec, self.opts.clone())?))
    }
}

/// One context's end: its segment, doorbell and listening socket, and the pairs made so far.
pub(crate) struct ShmEndpoint {
    spec: EndpointSpec,
    opts: ShmOptions,
    layout: Layout,
    name: Vec<u8>,
    listener: UnixListener,
    segment: Arc<Segment>,
    segment_fd: OwnedFd,
    bell: Arc<EventFd>,
    pairs: Vec<Option<Arc<ShmPair>>>,
}

/// Keeps a finished mesh's memory and doorbell alive, and closes its pairs' lifelines.
struct MeshGuard {
    _segment: Arc<Segment>,
    _bell: Arc<EventFd>,
    pairs: Vec<Option<Arc<ShmPair>>>,
}

impl Drop for MeshGuard {
    fn drop(&mut self) {
        for p in self.pairs.iter().flatten() {
            p.close();
        }
    }
}

impl ShmEndpoint {
    pub(crate) fn new(spec: EndpointSpec, opts: ShmOptions) -> Result<Self> {
        let layout = Layout { size: spec.size, ring_bytes: opts.ring_bytes, coll_bytes: opts.coll_bytes };
        let (segment, segment_fd) = Segment::create(layout, spec.rank)?;
        let bell = Arc::new(EventFd::new().map_err(|e| Error::io("creating a doorbell", e))?);
        let hex: String = spec.ctx.iter().map(|b| format!("{b:02x}")).collect();
        let nonce: String = random16()[..4].iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("ferrogloo-shm-{hex}-{}-{nonce}", spec.rank).into_bytes();
        let addr = SocketAddr::from_abstract_name(&name).map_err(|e| Error::io("naming a Unix socket", e))?;
        let listener =
            UnixListener::bind_addr(&addr).map_err(|e| Error::io("listening on an abstract Unix socket", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io("configuring a Unix socket", e))?;
        let pairs = vec![None; spec.size];
        Ok(ShmEndpoint { spec, opts, layout, name, listener, segment, segment_fd, bell, pairs })
    }

    fn deadline_from(&self, deadline: Instant) -> Duration {
        deadline
            .saturating_duration_since(Instant::now())
            .min(self.opts.handshake_timeout)
            .max(Duration::from_millis(1))
    }

    /// Accepts one connection and runs the acceptor's side of the handshake.
    fn accept_one(&mut self, stream: UnixStream, deadline: Instant) -> Result<usize> {
        let t = self.deadline_from(deadline);
        stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(t)))
            .and_then(|()| stream.set_write_timeout(Some(t)))
            .map_err(|e| Error::io("configuring a Unix socket", e))?;
        let (hello, fds) = recv_with_fds::<HELLO_LEN>(&stream)?;
        let h = Hello::decode(&hello)
            .ok_or_else(|| Error::Protocol { peer: None, detail: "not a ferrogloo shared-memory handshake".into() })?;
        let (me, size) = (self.spec.rank, self.spec.size);
        let status = if h.ctx != self.spec.ctx {
            1
        } else if h.to as usize != me || h.size as usize != size || h.from as usize >= size || h.from as usize <= me {
            2
        } else if self.pairs[h.from as usize].is_some() {
            3
        } else if h.with_secret != self.spec.secret.is_some() {
            4
        } else if h.ring_bytes as usize != self.opts.ring_bytes || h.coll_bytes as usize != self.opts.coll_bytes {
            5
        } else {
            0
        };
        let [seg_fd, bell_fd]: [OwnedFd; 2] = fds.try_into().map_err(|_| Error::Protocol {
            peer: Some(h.from as usize),
            detail: "a handshake without its segment and doorbell".into(),
        })?;
        let peer = h.from as usize;
        let theirs = if status == 0 { Some(Segment::open(&seg_fd, self.layout, peer)?) } else { None };
        let can_read = status == 0 && self.opts.single_copy && cma_works(h.pid as i32, h.probe);
        let nonce = random16();
        let ack = Ack {
            status,
            pid: std::process::id(),
            probe: &PROBE as *const u64 as u64,
            can_read,
            nonce,
            mac: mac(self.spec.secret.as_deref(), &["ferrogloo-shm-ack".as_bytes(), &hello, &nonce]),
        };
        send_with_fds(&stream, &ack.encode(), &[self.segment_fd.as_fd(), self.bell.fd()])?;
        if status != 0 {
            return Err(Error::Protocol {
                peer: Some(peer),
                detail: format!("refused its handshake: {}", describe(status)),
            });
        }
        let (fin, _) = recv_with_fds::<FINAL_LEN>(&stream)?;
        let mut got = [0u8; 32];
        got.copy_from_slice(&fin[8..40]);
        if self.spec.secret.is_some()
            && !mac_eq(&mac(self.spec.secret.as_deref(), &["ferrogloo-shm-auth".as_bytes(), &hello, &nonce]), &got)
        {
            return Err(Error::Protocol { peer: Some(peer), detail: "it failed to prove the shared secret".into() });
        }
        let theirs = theirs.ok_or_else(|| Error::invalid("no segment"))?;
        let pair = ShmPair::new(PairParts {
            me,
            peer,
            early_budget: self.opts.early_budget,
            mine: self.segment.clone(),
            theirs,
            peer_bell: EventFd::from_fd(bell_fd),
            lifeline: stream,
            peer_pid: h.pid as i32,
            peer_reads_mine: fin[0] != 0,
        })
        .map_err(|e| Error::io("setting up a shared-memory pair", e))?;
        self.pairs[peer] = Some(pair);
        Ok(peer)
    }
}

impl Endpoint for ShmEndpoint {
    fn address(&self) -> Vec<u8> {
        self.name.clone()
    }

    fn connect(&mut self, peer: usize, addr: &[u8], deadline: Instant) -> std::result::Result<(), ConnectError> {
        let refused = |detail: String| ConnectError::Refused(Error::Protocol { peer: Some(peer), detail });
        let retry = |what: &str, e: std::io::Error| ConnectError::Retry(Error::io(format!("{what} rank {peer}"), e));
        let sa = SocketAddr::from_abstract_name(addr)
            .map_err(|e| refused(format!("its address is not a Unix socket name: {e}")))?;
        let stream = UnixStream::connect_addr(&sa).map_err(|e| retry("connecting to", e))?;
        let t = self.deadline_from(deadline);
        stream
            .set_read_timeout(Some(t))
            .and_then(|()| stream.set_write_timeout(Some(t)))
            .map_err(|e| retry("configuring the socket to", e))?;
        let hello = Hello {
            with_secret: self.spec.secret.is_some(),
            ctx: self.spec.ctx,
            from: self.spec.rank as u32,
            to: peer as u32,
            size: self.spec.size as u32,
            pid: std::process::id(),
            probe: &PROBE as *const u64 as u64,
            ring_bytes: self.opts.ring_bytes as u64,
            coll_bytes: self.opts.coll_bytes as u64,
            nonce: random16(),
        }
        .encode();
        send_with_fds(&stream, &hello, &[self.segment_fd.as_fd(), self.bell.fd()]).map_err(ConnectError::Retry)?;
        let (raw, fds) = recv_with_fds::<ACK_LEN>(&stream).map_err(ConnectError::Retry)?;
        let ack = Ack::decode(&raw).ok_or_else(|| refused("its handshake answer is malformed".into()))?;
        if ack.status != 0 {
            return Err(refused(format!("it refused the handshake: {}", describe(ack.status))));
        }
        if self.spec.secret.is_some()
            && !mac_eq(
                &mac(self.spec.secret.as_deref(), &["ferrogloo-shm-ack".as_bytes(), &hello, &ack.nonce]),
                &ack.mac,
            )
        {
            return Err(refused("it failed to prove the shared secret".into()));
        }
        let [seg_fd, bell_fd]: [OwnedFd; 2] =
            fds.try_into().map_err(|_| refused("its answer carries no segment and doorbell".into()))?;
        let theirs = Segment::open(&seg_fd, self.layout, peer).map_err(ConnectError::Refused)?;
        let can_read = self.opts.single_copy && cma_works(ack.pid as i32, ack.probe);
        let mut fin = [0u8; FINAL_LEN];
        fin[0] = u8::from(can_read);
        fin[8..40]
            .copy_from_slice(&mac(self.spec.secret.as_deref(), &["ferrogloo-shm-auth".as_bytes(), &hello, &ack.nonce]));
        send_with_fds(&stream, &fin, &[]).map_err(ConnectError::Retry)?;
        let pair = ShmPair::new(PairParts {
            me: self.spec.rank,
            peer,
            early_budget: self.opts.early_budget,
            mine: self.segment.clone(),
            theirs,
            peer_bell: EventFd::from_fd(bell_fd),
            lifeline: stream,
            peer_pid: ack.pid as i32,
            peer_reads_mine: ack.can_read,
        })
        .map_err(|e| retry("setting up the pair with", e))?;
        self.pairs[peer] = Some(pair);
        Ok(())
    }

    fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize> {
        loop {
            let missing: Vec<usize> = peers.iter().copied().filter(|&p| self.pairs[p].is_none()).collect();
            let now = Instant::now();
            if missing.is_empty() || now >= until {
                return missing;
            }
            match self.listener.accept() {
                Ok((stream, _)) => {
                    // The handshake gets its own time, not what is left of this wait (the
                    // auto backend waits in short slices).
                    if let Err(e) = self.accept_one(stream, Instant::now() + self.opts.handshake_timeout) {
                        tracing::warn!(error = %e, "refused a shared-memory connection");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let mut fds = [libc::pollfd { fd: self.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
                    let _ = poll_fds(&mut fds, until.saturating_duration_since(now));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a shared-memory connection failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    fn finish(self: Box<Self>) -> Mesh {
        let dyn_pairs = self.pairs.iter().map(|p| p.clone().map(|p| p as Arc<dyn Pair>)).collect();
        let progress = Arc::new(ShmProgress::new(self.pairs.clone(), self.bell.clone()));
        let local = area::ShmArea::new(self.spec.rank, self.segment.clone(), &self.pairs, self.bell.clone())
            .map(|a| a as Arc<dyn crate::transport::LocalArea>);
        let guard = MeshGuard { _segment: self.segment, _bell: self.bell, pairs: self.pairs };
        Mesh { pairs: dyn_pairs, progress, local, _guard: Box::new(guard) }
    }
}

fn describe(status: u16) -> &'static str {
    match status {
        1 => "it has no context with this id (a stale or foreign rendezvous)",
        2 => "the ranks or world size do not fit its context",
        3 => "it already has a connection for this pair",
        4 => "one side uses a shared secret and the other does not",
        5 => "the two sides' segment sizes differ",
        _ => "an unknown reason",
    }
}

/// Whether this process may read process `pid`'s memory: the word at `probe` must read back as
/// [`PROBE`]'s value.
fn cma_works(pid: i32, probe: u64) -> bool {
    let mut word = [0u8; 8];
    let remote = [nix::sys::uio::RemoteIoVec { base: probe as usize, len: 8 }];
    let read =
        nix::sys::uio::process_vm_readv(nix::unistd::Pid::from_raw(pid), &mut [IoSliceMut::new(&mut word)], &remote);
    let ok = matches!(read, Ok(8)) && u64::from_le_bytes(word) == PROBE;
    if !ok {
        tracing::debug!(pid, ?read, "reading a peer's memory is not allowed here: large messages go through the rings");
    }
    ok
}

/// Sends `bytes` with descriptors `fds` attached.
fn send_with_fds(s: &UnixStream, bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<()> {
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let iov = [IoSlice::new(bytes)];
    let n = sendmsg::<()>(s.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
        .map_err(|e| Error::io("sending a shared-memory handshake", e.into()))?;
    if n != bytes.len() {
        return Err(Error::io(
            "sending a shared-memory handshake",
            std::io::Error::from(std::io::ErrorKind::WriteZero),
        ));
    }
    Ok(())
}

/// Receives exactly `N` bytes and the descriptors that came with them.
fn recv_with_fds<const N: usize>(s: &UnixStream) -> Result<([u8; N], Vec<OwnedFd>)> {
    let mut buf = [0u8; N];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < N {
        let mut space = nix::cmsg_space!([i32; 4]);
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(|e| Error::io("receiving a shared-memory handshake", e.into()))?;
        if msg.bytes == 0 {
            return Err(Error::io(
                "receiving a shared-memory handshake",
                std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
            ));
        }
        for c in msg.cmsgs().map_err(|e| Error::io("reading descriptors", e.into()))? {
            if let ControlMessageOwned::ScmRights(list) = c {
                // SAFETY: the kernel installed these descriptors in this process for us alone.
                fds.extend(list.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        got += msg.bytes;
    }
    Ok((buf, fds))
}

/// The connector's opening message.
struct Hello {
    with_secret: bool,
    ctx: ContextId,
    from: u32,
    to: u32,
    size: u32,
    pid: u32,
    probe: u64,
    ring_bytes: u64,
    coll_bytes: u64,
    nonce: [u8; 16],
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&u16::from(self.with_secret).to_le_bytes());
        b[8..24].copy_from_slice(&self.ctx);
        b[24..28].copy_from_slice(&self.from.to_le_bytes());
        b[28..32].copy_from_slice(&self.to.to_le_bytes());
        b[32..36].copy_from_slice(&self.size.to_le_bytes());
        b[36..40].copy_from_slice(&self.pid.to_le_bytes());
        b[40..48].copy_from_slice(&self.probe.to_le_bytes());
        b[48..56].copy_from_slice(&self.ring_bytes.to_le_bytes());
        b[56..64].copy_from_slice(&self.coll_bytes.to_le_bytes());
        b[64..80].copy_from_slice(&self.nonce);
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> Option<Self> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        if u32_at(0) != HELLO_MAGIC || u16::from_le_bytes([b[4], b[5]]) != VERSION {
            return None;
        }
        let mut ctx = [0u8; 16];
        ctx.copy_from_slice(&b[8..24]);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[64..80]);
        Some(Hello {
            with_secret: u16::from_le_bytes([b[6], b[7]]) != 0,
            ctx,
            from: u32_at(24),
            to: u32_at(28),
            size: u32_at(32),
            pid: u32_at(36),
            probe: u64_at(40),
            ring_bytes: u64_at(48),
            coll_bytes: u64_at(56),
            nonce,
        })
    }
}

/// The acceptor's answer.
struct Ack {
    status: u16,
    pid: u32,
    probe: u64,
    /// The acceptor can read the connector's memory.
    can_read: bool,
    nonce: [u8; 16],
    mac: [u8; 32],
}

impl Ack {
    fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12] = u8::from(self.can_read);
        b[16..24].copy_from_slice(&self.probe.to_le_bytes());
        b[24..40].copy_from_slice(&self.nonce);
        b[40..72].copy_from_slice(&self.mac);
        b
    }

    fn decode(b: &[u8; ACK_LEN]) -> Option<Self> {
        if u32::from_le_bytes(b[0..4].try_into().ok()?) != HELLO_MAGIC || u16::from_le_bytes([b[4], b[5]]) != VERSION {
            return None;
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[24..40]);
        let mut mac = [0u8; 32];
        mac.copy_from_slice(&b[40..72]);
        Some(Ack {
            status: u16::from_le_bytes([b[6], b[7]]),
            pid: u32::from_le_bytes(b[8..12].try_into().ok()?),
            can_read: b[12] != 0,
            probe: u64::from_le_bytes(b[16..24].try_into().ok()?),
            nonce,
            mac,
        })
    }
}
