//! Choice by locality: one backend made of a *remote* device (TCP, or ibverbs) and a
//! shared-memory one. Each pair uses shared memory when both ranks have the same host identity
//! ([`host_id`](crate::device::host_id): the host, its boot and the network namespace; never IP
//! addresses or `LOCAL_WORLD_SIZE`), and the remote device otherwise, so one context may mix
//! both. (Below, "TCP" stands for the remote device; an ibverbs one makes progress on its own
//! thread, which the same slicing serves.)
//!
//! The endpoint's address carries the rank's host identity, its TCP address and its
//! shared-memory address; the connecting (higher) rank compares host identities and connects
//! with the backend they call for. The lower rank accepts on both.
//!
//! Waits: a TCP pair makes progress on the device's event loop or on the waiting thread, a
//! shared-memory pair only on a thread that drives it. So a wait that involves a
//! shared-memory pair (its own or others with operations outstanding) is the shared-memory
//! engine's, which drives every shared-memory pair and leaves the TCP ones to the event loop:
//! an operation that finishes there rings the shared-memory doorbell the wait sleeps on. A
//! wait on TCP pairs alone is the TCP engine's, in slices of at most [`TCP_SLICE`], between
//! which the shared-memory pairs are driven once (a peer's message may be waiting for this
//! rank to read it).

use crate::error::{Error, Result};
use crate::transport::handshake::codec::{BufMutExt, Reader};
use crate::transport::shm::ShmDevice;
use crate::transport::tcp::device::TcpDevice;
use crate::transport::{Backend, BusyWait, Completion, ConnectError, Done, Endpoint, EndpointSpec, Mesh, Progress};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long each of the two endpoints is waited on in turn while higher ranks connect.
const SLICE: Duration = Duration::from_millis(2);
/// How long a TCP wait on a mesh with shared-memory pairs leaves those pairs alone at most.
const TCP_SLICE: Duration = Duration::from_millis(2);

/// What reaches the ranks of other hosts.
pub(crate) enum Remote {
    Tcp(TcpDevice),
    /// Another backend (ibverbs).
    Other(Arc<dyn Backend>),
}

impl Remote {
    fn backend(&self) -> &dyn Backend {
        match self {
            Remote::Tcp(t) => t,
            Remote::Other(b) => &**b,
        }
    }
}

/// A remote device between hosts, shared memory within one.
pub(crate) struct AutoDevice {
    remote: Remote,
    shm: ShmDevice,
    host: String,
}

impl AutoDevice {
    /// Peers whose host identity is `host` are reached through `shm`, the others through `tcp`.
    pub(crate) fn new(tcp: TcpDevice, shm: ShmDevice, host: String) -> Self {
        AutoDevice { remote: Remote::Tcp(tcp), shm, host }
    }

    /// Peers whose host identity is `host` are reached through `shm`, the others through
    /// `remote`.
    pub(crate) fn with_remote(remote: Arc<dyn Backend>, shm: ShmDevice, host: String) -> Self {
        AutoDevice { remote: Remote::Other(remote), shm, host }
    }

    /// The TCP half, if the remote device is TCP.
    pub(crate) fn tcp(&self) -> Option<&TcpDevice> {
        match &self.remote {
            Remote::Tcp(t) => Some(t),
            Remote::Other(_) => None,
        }
    }
}

impl Backend for AutoDevice {
    fn name(&self) -> &'static str {
        match self.remote.backend().name() {
            "tcp" => "tcp+shm",
            "ibverbs" => "ibverbs+shm",
            _ => "remote+shm",
        }
    }

    fn host_only(&self) -> bool {
        self.remote.backend().host_only()
    }

    fn endpoint(&self, spec: EndpointSpec) -> Result<Box<dyn Endpoint>> {
        let tcp = self.remote.backend().endpoint(spec.clone())?;
        let shm = self.shm.endpoint(spec.clone())?;
        Ok(Box::new(AutoEndpoint { host: self.host.clone(), tcp, shm, size: spec.size }))
    }

    fn host(&self) -> Option<String> {
        Some(self.host.clone())
    }
}

struct AutoEndpoint {
    host: String,
    tcp: Box<dyn Endpoint>,
    shm: Box<dyn Endpoint>,
    size: usize,
}

/// The address blob: `u16` length and host identity, `u32` length and TCP address, then the
/// shared-memory address.
fn encode(host: &str, tcp: &[u8], shm: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(6 + host.len() + tcp.len() + shm.len());
    b.write_u16_prefixed(host.as_bytes());
    b.write_u32_prefixed(tcp);
    b.extend_from_slice(shm);
    b
}

/// The three parts of an address blob; `None` when it is not one.
fn decode(b: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let mut r = Reader::new(b);
    let host = r.u16_prefixed(usize::from(u16::MAX), "a host identity").ok()?;
    let tcp = r.u32_prefixed(b.len(), "a remote address").ok()?;
    Some((host, tcp, r.rest()))
}

impl Endpoint for AutoEndpoint {
    fn address(&self) -> Vec<u8> {
        encode(&self.host, &self.tcp.address(), &self.shm.address())
    }

    fn connect(&mut self, peer: usize, addr: &[u8], deadline: Instant) -> std::result::Result<(), ConnectError> {
        let Some((host, tcp, shm)) = decode(addr) else {
            return Err(ConnectError::Refused(Error::Protocol {
                peer: Some(peer),
                detail: format!("its address ({} bytes) is not a remote-and-shared-memory address", addr.len()),
            }));
        };
        if host == self.host.as_bytes() {
            tracing::debug!(peer, "same host: connecting through shared memory");
            self.shm.connect(peer, shm, deadline)
        } else {
            self.tcp.connect(peer, tcp, deadline)
        }
    }

    fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize> {
        let mut missing = peers.to_vec();
        loop {
            let slice = until.min(Instant::now() + SLICE);
            missing = self.tcp.wait_connected(&missing, slice);
            let slice = until.min(Instant::now() + SLICE);
            missing = self.shm.wait_connected(&missing, slice);
            if missing.is_empty() || Instant::now() >= until {
                return missing;
            }
        }
    }

    fn finish(self: Box<Self>) -> Mesh {
        let (tcp, shm) = (self.tcp.finish(), self.shm.finish());
        let via_shm: Vec<bool> = shm.pairs.iter().map(Option::is_some).collect();
        let pairs = (0..self.size).map(|r| shm.pairs[r].clone().or_else(|| tcp.pairs[r].clone())).collect();
        let progress = Arc::new(AutoProgress { tcp: tcp.progress, shm: shm.progress, via_shm });
        Mesh { pairs, progress, local: shm.local, _guard: Box::new((tcp._guard, shm._guard)) }
    }
}

/// Routes each wait to the engine that can finish it (see the module's documentation).
struct AutoProgress {
    tcp: Arc<dyn Progress>,
    shm: Arc<dyn Progress>,
    via_shm: Vec<bool>,
}

impl Progress for AutoProgress {
    fn wait(
        &self,
        done: &Completion,
        own: &[usize],
        others: &[usize],
        deadline: Instant,
        busy: BusyWait,
    ) -> Option<Result<Done>> {
        let shm = |r: &usize| self.via_shm.get(*r).copied().unwrap_or(false);
        if own.iter().chain(others).any(shm) {
            return self.shm.wait(done, own, others, deadline, busy);
        }
        if !self.via_shm.iter().any(|&s| s) {
            return self.tcp.wait(done, own, others, deadline, busy);
        }
        // A TCP wait, on a mesh with shared-memory pairs that nothing else may read: a peer's
        // large message waits for this rank to copy it, and may hold up what this wait waits
        // for. The TCP engine waits in slices; between them the shared-memory pairs move.
        let mut busy = busy;
        loop {
            let slice = deadline.min(Instant::now() + TCP_SLICE);
            if let Some(o) = self.tcp.wait(done, own, others, slice, busy) {
                return Some(o);
            }
            if Instant::now() >= deadline {
                return None;
            }
            // Busy-waiting was the first slice's; the later ones sleep at once.
            busy.budget = Duration::ZERO;
            // A wait on nothing that ends now: one round over every shared-memory pair.
            if let Some(o) = self.shm.wait(done, &[], &[], Instant::now(), busy) {
                return Some(o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_and_garbage_does_not_decode() {
        let b = encode("node/boot/net:[1]", b"127.0.0.1:5000", b"\0ferrogloo-shm-x");
        assert_eq!(decode(&b), Some((&b"node/boot/net:[1]"[..], &b"127.0.0.1:5000"[..], &b"\0ferrogloo-shm-x"[..])));
        for bad in [&b""[..], b"\x05\x00ab", b"\x01\x00a\xff\xff\xff\xff"] {
            assert_eq!(decode(bad), None);
        }
    }
}
