//! A context's mesh over TCP: the [`Backend`] side of the TCP device. An endpoint is a route in
//! the device (where accepted connections for its context id go); connecting opens a pair's two
//! lanes with the connector's side of the handshake; the finished mesh drives its pairs with
//! [`TcpProgress`].

use super::device::{Route, Shared, TcpDevice, configure};
use super::handshake::{self, ACK_LEN, Ack, Hello, Status};
use super::pair::{Lane, TcpPair};
use super::progress::TcpProgress;
use crate::error::{Error, Result};
use crate::transport::{Backend, ConnectError, ContextId, Endpoint, EndpointSpec, Mesh, Pair, random16};
use mio::net::TcpStream;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Backend for TcpDevice {
    fn name(&self) -> &str {
        "tcp"
    }

    fn host_only(&self) -> bool {
        self.shared.addr.ip().is_loopback()
    }

    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        Some(self.shared.addr)
    }

    fn endpoint(&self, spec: EndpointSpec) -> Result<Box<dyn Endpoint>> {
        let shared = &self.shared;
        let EndpointSpec { ctx, rank, size, secret, .. } = spec;
        let pairs = (0..size)
            .map(|p| {
                (p != rank)
                    .then(|| {
                        TcpPair::new(rank, p, shared.opts.early_budget, shared.registry.clone(), shared.parking.clone())
                    })
                    .transpose()
            })
            .collect::<io::Result<_>>()
            .map_err(|e| Error::io("creating a pair's wake-up descriptor", e))?;
        let route = Route::new(rank, size, secret, pairs);
        shared.add_route(ctx, route.clone())?;
        Ok(Box::new(TcpEndpoint { shared: shared.clone(), ctx, route, armed: true }))
    }
}

/// One context's route in the TCP device while its mesh forms.
struct TcpEndpoint {
    shared: Arc<Shared>,
    ctx: ContextId,
    route: Arc<Route>,
    /// Withdraw the route on drop (until the mesh is finished and owns it).
    armed: bool,
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        if self.armed {
            self.shared.remove_route(&self.ctx, self.route.rank);
        }
    }
}

/// Closes a finished mesh's pairs and withdraws its route when the mesh is dropped.
struct RouteGuard {
    shared: Arc<Shared>,
    ctx: ContextId,
    rank: usize,
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        self.shared.remove_route(&self.ctx, self.rank);
    }
}

impl Endpoint for TcpEndpoint {
    fn address(&self) -> Vec<u8> {
        self.shared.addr.to_string().into_bytes()
    }

    fn connect(&mut self, peer: usize, addr: &[u8], deadline: Instant) -> std::result::Result<(), ConnectError> {
        let addr: SocketAddr = std::str::from_utf8(addr).ok().and_then(|a| a.parse().ok()).ok_or_else(|| {
            ConnectError::Refused(Error::Protocol {
                peer: Some(peer),
                detail: format!("its address {:?} is not a TCP address", String::from_utf8_lossy(addr)),
            })
        })?;
        let pair = self
            .route
            .pairs
            .get(peer)
            .and_then(|p| p.clone())
            .ok_or_else(|| ConnectError::Refused(Error::invalid(format!("no pair for rank {peer}"))))?;
        for lane in [Lane::Main, Lane::Bulk] {
            if !pair.lane_attached(lane) {
                let s = self.connect_lane(peer, addr, deadline, lane)?;
                if self.shared.attach(&pair, lane, TcpStream::from_std(s), None).map_err(ConnectError::Refused)? {
                    self.route.notify();
                }
            }
        }
        Ok(())
    }

    fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize> {
        self.route.wait_attached(peers, until)
    }

    fn finish(mut self: Box<Self>) -> Mesh {
        self.armed = false;
        let route = &self.route;
        let pairs = route.pairs.iter().map(|p| p.clone().map(|p| p as Arc<dyn Pair>)).collect();
        let progress = Arc::new(TcpProgress::new(route.pairs.clone(), self.shared.parking.clone()));
        let guard = RouteGuard { shared: self.shared.clone(), ctx: self.ctx, rank: route.rank };
        Mesh { pairs, progress, local: None, _guard: Box::new(guard) }
    }
}

impl TcpEndpoint {
    /// Opens the pair's `lane` connection to `peer` and runs the connector's handshake. A
    /// connection that fails or breaks is worth retrying; an answer that refuses is not.
    fn connect_lane(
        &self,
        peer: usize,
        addr: SocketAddr,
        deadline: Instant,
        lane: Lane,
    ) -> std::result::Result<std::net::TcpStream, ConnectError> {
        let opts = &self.shared.opts;
        let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let io_err =
            |what: &str, e: io::Error| ConnectError::Retry(Error::io(format!("{what} rank {peer} at {addr}"), e));
        let refused = |detail: String| ConnectError::Refused(Error::Protocol { peer: Some(peer), detail });
        let mut s = std::net::TcpStream::connect_timeout(&addr, left().min(opts.handshake_timeout))
            .map_err(|e| io_err("connecting to", e))?;
        configure(&socket2::SockRef::from(&s), opts).map_err(|e| io_err("configuring the socket to", e))?;
        let hs_deadline = left().min(opts.handshake_timeout);
        s.set_read_timeout(Some(hs_deadline)).map_err(|e| io_err("configuring the socket to", e))?;
        s.set_write_timeout(Some(hs_deadline)).map_err(|e| io_err("configuring the socket to", e))?;
        let route = &self.route;
        let secret = route.secret.as_deref();
        let hello = Hello {
            with_secret: secret.is_some(),
            ctx: self.ctx,
            from: route.rank as u32,
            to: peer as u32,
            size: route.size as u32,
            nonce: random16(),
            bulk: lane == Lane::Bulk,
        }
        .encode();
        s.write_all(&hello).map_err(|e| io_err("sending the handshake to", e))?;
        let mut raw = [0u8; ACK_LEN];
        s.read_exact(&mut raw).map_err(|e| io_err("reading the handshake answer of", e))?;
        let ack = Ack::decode(&raw).map_err(refused)?;
        if ack.status != Status::Ok {
            return Err(refused(format!("handshake refused: {}", ack.status.describe())));
        }
        if secret.is_some() {
            let want = handshake::mac(secret, "ferrogloo-ack", &hello, &ack.nonce);
            if !handshake::mac_eq(&want, &ack.mac) {
                return Err(refused("the peer failed to prove the shared secret".into()));
            }
            let auth = handshake::mac(secret, "ferrogloo-auth", &hello, &ack.nonce);
            s.write_all(&auth).map_err(|e| io_err("sending the handshake proof to", e))?;
        }
        s.set_nonblocking(true).map_err(|e| io_err("configuring the socket to", e))?;
        Ok(s)
    }
}
