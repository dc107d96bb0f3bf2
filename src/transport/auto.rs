//! Choice by locality: one backend made of two, a *same-host* backend (shared memory) and a
//! *remote* one (TCP, or ibverbs). Each pair uses the same-host backend when both ranks have the
//! same host identity ([`host_id`](crate::device::host_id): the host, its boot and the network
//! namespace; never IP addresses or `LOCAL_WORLD_SIZE`), and the remote one otherwise, so one
//! context may mix both. Neither half is named here: any backend that
//! [reaches the same host](Backend::reaches_same_host) can be the first, any other the second.
//!
//! The endpoint's address carries the rank's host identity, its remote address and its
//! same-host address; the connecting (higher) rank compares host identities and connects
//! with the backend they call for. The lower rank accepts on both.
//!
//! Waits: a remote pair (TCP) makes progress on its device's event loop or on the waiting
//! thread, a shared-memory pair only on a thread that drives it. So a wait that involves a
//! same-host pair (its own or others with operations outstanding) is the same-host engine's,
//! which drives every same-host pair and leaves the remote ones to their event loop: an
//! operation that finishes there rings the doorbell the wait sleeps on. A wait on remote pairs
//! alone is the remote engine's, in slices of at most [`REMOTE_SLICE`], between which the
//! same-host pairs are driven once (a peer's message may be waiting for this rank to read it).
//! (An ibverbs remote makes progress on its own thread, which the same slicing serves.)

use crate::error::{Error, Result};
use crate::transport::handshake::codec::{BufMutExt, Reader};
use crate::transport::{Backend, BusyWait, Completion, ConnectError, Done, Endpoint, EndpointSpec, Mesh, Progress};
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long each of the two endpoints is waited on in turn while higher ranks connect.
const SLICE: Duration = Duration::from_millis(2);
/// How long a remote wait on a mesh with same-host pairs leaves those pairs alone at most.
const REMOTE_SLICE: Duration = Duration::from_millis(2);

/// A same-host backend within a host, a remote one between hosts.
pub(crate) struct AutoBackend {
    local: Arc<dyn Backend>,
    remote: Arc<dyn Backend>,
    /// `<remote>+<local>`: tcp+shm, ibverbs+shm.
    name: String,
}

impl AutoBackend {
    /// Peers on this host are reached through `local`, the others through `remote`. Fails when
    /// `local` does not reach exactly the ranks of its host, or `remote` is itself such a one.
    pub(crate) fn new(local: Arc<dyn Backend>, remote: Arc<dyn Backend>) -> Result<Self> {
        if !local.reaches_same_host() {
            return Err(Error::invalid(format!(
                "the {} transport cannot be the same-host half of a device: it does not connect the \
                 processes of one host (shared memory does)",
                local.name()
            )));
        }
        if remote.reaches_same_host() || remote.hierarchical() {
            return Err(Error::invalid(format!(
                "the {} transport cannot be the half of a device that reaches other hosts",
                remote.name()
            )));
        }
        let name = format!("{}+{}", remote.name(), local.name());
        Ok(AutoBackend { local, remote, name })
    }
}

impl Backend for AutoBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn host_only(&self) -> bool {
        self.remote.host_only()
    }

    fn endpoint(&self, spec: EndpointSpec) -> Result<Box<dyn Endpoint>> {
        let remote = self.remote.endpoint(spec.clone())?;
        let local = self.local.endpoint(spec.clone())?;
        Ok(Box::new(AutoEndpoint { host: spec.host, remote, local, size: spec.size }))
    }

    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.remote.local_addr()
    }

    fn hierarchical(&self) -> bool {
        true
    }
}

struct AutoEndpoint {
    host: String,
    remote: Box<dyn Endpoint>,
    local: Box<dyn Endpoint>,
    size: usize,
}

/// The address blob: `u16` length and host identity, `u32` length and remote address, then the
/// same-host address.
fn encode(host: &str, remote: &[u8], local: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(6 + host.len() + remote.len() + local.len());
    b.write_u16_prefixed(host.as_bytes());
    b.write_u32_prefixed(remote);
    b.extend_from_slice(local);
    b
}

/// The three parts of an address blob; `None` when it is not one.
fn decode(b: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let mut r = Reader::new(b);
    let host = r.u16_prefixed(usize::from(u16::MAX), "a host identity").ok()?;
    let remote = r.u32_prefixed(b.len(), "a remote address").ok()?;
    Some((host, remote, r.rest()))
}

impl Endpoint for AutoEndpoint {
    fn address(&self) -> Vec<u8> {
        encode(&self.host, &self.remote.address(), &self.local.address())
    }

    fn connect(&mut self, peer: usize, addr: &[u8], deadline: Instant) -> std::result::Result<(), ConnectError> {
        let Some((host, remote, local)) = decode(addr) else {
            return Err(ConnectError::Refused(Error::Protocol {
                peer: Some(peer),
                detail: format!("its address ({} bytes) is not a remote-and-shared-memory address", addr.len()),
            }));
        };
        if host == self.host.as_bytes() {
            tracing::debug!(peer, "same host: connecting through the same-host transport");
            self.local.connect(peer, local, deadline)
        } else {
            self.remote.connect(peer, remote, deadline)
        }
    }

    fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize> {
        let mut missing = peers.to_vec();
        loop {
            let slice = until.min(Instant::now() + SLICE);
            missing = self.remote.wait_connected(&missing, slice);
            let slice = until.min(Instant::now() + SLICE);
            missing = self.local.wait_connected(&missing, slice);
            if missing.is_empty() || Instant::now() >= until {
                return missing;
            }
        }
    }

    fn finish(self: Box<Self>) -> Mesh {
        let (remote, local) = (self.remote.finish(), self.local.finish());
        let via_local: Vec<bool> = local.pairs.iter().map(Option::is_some).collect();
        let pairs = (0..self.size).map(|r| local.pairs[r].clone().or_else(|| remote.pairs[r].clone())).collect();
        let progress = Arc::new(AutoProgress { remote: remote.progress, local: local.progress, via_local });
        Mesh { pairs, progress, local: local.local, _guard: Box::new((remote._guard, local._guard)) }
    }
}

/// Routes each wait to the engine that can finish it (see the module's documentation).
struct AutoProgress {
    remote: Arc<dyn Progress>,
    local: Arc<dyn Progress>,
    /// Per rank: whether its pair is a same-host one.
    via_local: Vec<bool>,
}

impl Progress for AutoProgress {
    fn interrupt(&self) {
        self.remote.interrupt();
        self.local.interrupt();
    }

    fn lend(&self, peers: &[usize]) {
        self.remote.lend(peers);
        self.local.lend(peers);
    }

    fn wait(
        &self,
        done: &Completion,
        own: &[usize],
        others: &[usize],
        deadline: Instant,
        busy: BusyWait,
    ) -> Option<Result<Done>> {
        let local = |r: &usize| self.via_local.get(*r).copied().unwrap_or(false);
        if own.iter().chain(others).any(local) {
            // The remote pairs of the wait move on their event loop meanwhile, and what
            // finishes there rings the doorbell the same-host engine sleeps on. A pair a
            // remote wait left parked would otherwise lie still until the loop took it back
            // (a ring step's receive over TCP, its send through shared memory: 1 ms a step).
            let remote: SmallVec<[usize; 8]> = own.iter().chain(others).copied().filter(|r| !local(r)).collect();
            if !remote.is_empty() {
                self.remote.lend(&remote);
            }
            return self.local.wait(done, own, others, deadline, busy);
        }
        if !self.via_local.iter().any(|&s| s) {
            return self.remote.wait(done, own, others, deadline, busy);
        }
        // A remote wait, on a mesh with same-host pairs that nothing else may read: a peer's
        // large message waits for this rank to copy it, and may hold up what this wait waits
        // for. The remote engine waits in slices; between them the same-host pairs move.
        let mut busy = busy;
        loop {
            let slice = deadline.min(Instant::now() + REMOTE_SLICE);
            if let Some(o) = self.remote.wait(done, own, others, slice, busy) {
                return Some(o);
            }
            if Instant::now() >= deadline {
                return None;
            }
            // Busy-waiting was the first slice's; the later ones sleep at once.
            busy.budget = Duration::ZERO;
            // A wait on nothing that ends now: one round over every same-host pair.
            if let Some(o) = self.local.wait(done, &[], &[], Instant::now(), busy) {
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
