//! Shared memory for ranks of one host: rings in `memfd` segments, handed over a Unix socket.
//!
//! Each rank's endpoint creates its segment ([`segment`]) and a doorbell (an eventfd), and
//! listens on an abstract Unix socket (no file anywhere, so a crashed job leaves nothing behind)
//! named after the context and the rank: the address it publishes. The higher rank of a pair
//! connects, and the two run the one handshake over it ([`handshake`]; the listening side
//! handshakes with each connection on its own, several at once, [`crate::transport::accepting`],
//! so that a silent stranger holds up no peer): once each has proved
//! the job's secret to the other, they exchange, with `SCM_RIGHTS`, their segments and
//! doorbells, each checks whether it can read the other's memory with `process_vm_readv`
//! (large messages then move with one copy, [`pair`]), and they keep the socket as the pair's
//! lifeline. Each maps the other's segment and closes the descriptor: the memory lives as long
//! as a mapping of it.
//!
//! Abstract Unix sockets belong to a network namespace: ranks on one host but in different
//! namespaces cannot meet this way, which is why the host identity includes the namespace.

pub(crate) mod area;
mod handshake;
pub(crate) mod pair;
pub(crate) mod progress;
pub(crate) mod ring;
pub(crate) mod segment;
pub(crate) mod wire;

use crate::error::{Error, Result};
use crate::transport::accepting::Accepting;
use crate::transport::handshake::BackendKind;
use crate::transport::wake::EventFd;
use crate::transport::{Backend, ConnectError, Endpoint, EndpointSpec, Mesh, Pair, random16};
use handshake::ShmConn;
use nix::sys::uio::RemoteIoVec;
use pair::ShmPair;
use progress::ShmProgress;
use segment::{Layout, Segment};
use std::io::IoSliceMut;
use std::os::fd::OwnedFd;
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
    /// Handshakes an endpoint runs at once; a new connection evicts the oldest.
    pub(crate) max_pending: usize,
    /// Whether this rank reads its peers' large messages straight from their memory, where
    /// the kernel allows it.
    pub(crate) single_copy: bool,
    /// How the collective area's collectives copy.
    pub(crate) collective_copy: crate::transport::CopyChoice,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            ring_bytes: 1 << 20,
            coll_bytes: 4 << 20,
            early_budget: 8 << 20,
            handshake_timeout: Duration::from_secs(10),
            max_pending: 64,
            single_copy: false,
            collective_copy: crate::transport::CopyChoice::Measure,
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

impl Backend for ShmDevice {
    fn name(&self) -> &str {
        "shm"
    }

    fn host_only(&self) -> bool {
        true
    }

    fn reaches_same_host(&self) -> bool {
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
    /// Connections in their handshake.
    accepting: Accepting<ShmConn>,
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
        let accepting = Accepting::new(BackendKind::Shm, opts.handshake_timeout, opts.max_pending);
        Ok(ShmEndpoint { spec, opts, layout, name, listener, segment, segment_fd, bell, pairs, accepting })
    }

    fn deadline_from(&self, deadline: Instant) -> Duration {
        deadline
            .saturating_duration_since(Instant::now())
            .min(self.opts.handshake_timeout)
            .max(Duration::from_millis(1))
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
        self.connect_on(peer, addr, stream)
    }

    fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize> {
        // Each connection handshakes on its own, with its own time (not what is left of this
        // wait: the auto backend waits in short slices), and several at once.
        let mut accepting = self.accepting.take();
        let missing =
            accepting.wait(self, until, |ep| peers.iter().copied().filter(|&p| ep.pairs[p].is_none()).collect());
        self.accepting = accepting;
        missing
    }

    fn finish(self: Box<Self>) -> Mesh {
        let dyn_pairs = self.pairs.iter().map(|p| p.clone().map(|p| p as Arc<dyn Pair>)).collect();
        let progress = Arc::new(ShmProgress::new(self.pairs.clone(), self.bell.clone()));
        let local = area::ShmArea::new(
            self.spec.rank,
            self.segment.clone(),
            &self.pairs,
            self.bell.clone(),
            self.opts.collective_copy,
        )
        .map(|a| a as Arc<dyn crate::transport::LocalArea>);
        let guard = MeshGuard { _segment: self.segment, _bell: self.bell, pairs: self.pairs };
        Mesh { pairs: dyn_pairs, progress, local, _guard: Box::new(guard) }
    }
}

/// Copies the bytes of process `pid` at `from` (runs of its memory, in order) into `into` (in
/// order, as many bytes in all: else `EINVAL`), with `process_vm_readv`, until all are read.
/// `ESRCH` when the process is gone; `EFAULT` when it has no such memory.
pub(crate) fn read_process(
    pid: i32,
    from: &[RemoteIoVec],
    mut into: &mut [IoSliceMut<'_>],
) -> std::result::Result<(), nix::errno::Errno> {
    if into.iter().map(|b| b.len()).sum::<usize>() != from.iter().map(|r| r.len).sum::<usize>() {
        return Err(nix::errno::Errno::EINVAL);
    }
    whole(from, |window| {
        // (An empty slice in front would make a window that copies nothing.)
        while into.first().is_some_and(|b| b.is_empty()) {
            into = &mut std::mem::take(&mut into)[1..];
        }
        let local = into.len().min(IOV_MAX);
        let n = nix::sys::uio::process_vm_readv(nix::unistd::Pid::from_raw(pid), &mut into[..local], window)?;
        IoSliceMut::advance_slices(&mut into, n);
        Ok(n)
    })
}

/// Runs a call of `process_vm_readv` or `process_vm_writev` takes on either side (Linux's
/// `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Copies `src` to `addr` of process `pid` (`process_vm_writev`, until all are written).
/// `ESRCH` when the process is gone; `EFAULT` when it has no such memory.
pub(crate) fn write_process(pid: i32, addr: u64, src: &[u8]) -> std::result::Result<(), nix::errno::Errno> {
    let mut done = 0;
    whole(&[RemoteIoVec { base: addr as usize, len: src.len() }], |window| {
        let n = nix::sys::uio::process_vm_writev(
            nix::unistd::Pid::from_raw(pid),
            &[std::io::IoSlice::new(&src[done..])],
            window,
        )?;
        done += n;
        Ok(n)
    })
}

/// Runs a cross-process copy of the remote runs `from` until all are copied: `copy` gets the
/// remote runs not yet copied (at most [`IOV_MAX`], the first not empty), moves its own side
/// on by what it copied, and returns how much that was (a partial copy goes on; an
/// interrupted one is tried again; none at all is `EFAULT`).
fn whole(
    from: &[RemoteIoVec],
    mut copy: impl FnMut(&[RemoteIoVec]) -> nix::Result<usize>,
) -> std::result::Result<(), nix::errno::Errno> {
    let len: usize = from.iter().map(|r| r.len).sum();
    let (mut remote, mut done, mut next) = (from.to_vec(), 0, 0);
    while done < len {
        while remote[next].len == 0 {
            next += 1;
        }
        match copy(&remote[next..remote.len().min(next + IOV_MAX)]) {
            Ok(0) => return Err(nix::errno::Errno::EFAULT),
            Ok(n) => {
                done += n;
                let mut n = n;
                while n > 0 {
                    let r = &mut remote[next];
                    let k = n.min(r.len);
                    (r.base, r.len, n) = (r.base + k, r.len - k, n - k);
                    if r.len == 0 && n > 0 {
                        next += 1;
                    }
                }
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
