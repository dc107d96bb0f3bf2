//! A context's mesh over TCP: the [`Backend`] side of the TCP device. An endpoint is a route in
//! the device (where accepted connections for its context id go); connecting opens a pair's two
//! lanes with the connector's side of the handshake; the finished mesh drives its pairs with
//! [`TcpProgress`].

use super::device::{DeviceState, Route, TcpDevice, configure};
use super::pair::{Lane, TcpPair};
use super::progress::TcpProgress;
use crate::error::{Error, Result};
use crate::transport::handshake::messages::MAX_MESSAGE;
use crate::transport::handshake::{BackendKind, Dial, Event, Handshake, Local};
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
    shared: Arc<DeviceState>,
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
    shared: Arc<DeviceState>,
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
        let raw = addr;
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
        // Both lanes' handshakes run side by side: their round trips overlap.
        let mut lanes = Vec::with_capacity(2);
        for lane in [Lane::Main, Lane::Bulk] {
            if !pair.lane_attached(lane) {
                lanes.push(self.open_lane(peer, (addr, raw), deadline, lane)?);
            }
        }
        let mut first_err = None;
        for (lane, result) in run_side_by_side(peer, addr, lanes) {
            match result {
                Ok(s) => {
                    if self.shared.attach(&pair, lane, TcpStream::from_std(s), None).map_err(ConnectError::Refused)? {
                        self.route.notify();
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
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

/// A lane being connected: its socket and its handshake.
struct Opening {
    lane: Lane,
    stream: std::net::TcpStream,
    hs: Handshake,
}

/// Runs the connector's handshakes of `lanes` together, so that the lanes' round trips
/// overlap: every lane sends what its handshake has to send before this thread blocks reading
/// any lane's answer (each acceptor answers its own lane whatever the other does). Returns each
/// lane's connection, nonblocking, or why it failed: a connection that fails or breaks is worth
/// retrying; an answer that refuses is not.
fn run_side_by_side(
    peer: usize,
    addr: SocketAddr,
    lanes: Vec<Opening>,
) -> Vec<(Lane, std::result::Result<std::net::TcpStream, ConnectError>)> {
    let io_err = |what: &str, e: io::Error| ConnectError::Retry(Error::io(format!("{what} rank {peer} at {addr}"), e));
    let refused = |detail: String| ConnectError::Refused(Error::Protocol { peer: Some(peer), detail });
    // Each open lane, with the bytes its handshake waits for (once it has sent what it had).
    let mut open: Vec<Option<(Opening, Option<usize>)>> = lanes.into_iter().map(|o| Some((o, None))).collect();
    let mut out = Vec::with_capacity(open.len());
    let mut buf = [0u8; MAX_MESSAGE];
    while open.iter().any(Option::is_some) {
        // Every lane sends what it has, up to the answer it waits for.
        for slot in &mut open {
            let Some((o, need)) = slot.as_mut() else { continue };
            let end = loop {
                match o.hs.poll() {
                    Event::Send(m) => {
                        if let Err(e) = o.stream.write_all(&m.bytes) {
                            break Some(Err(io_err("sending the handshake to", e)));
                        }
                    }
                    Event::Need(n) => {
                        *need = Some(n.min(MAX_MESSAGE));
                        break None;
                    }
                    // A TCP connector is not asked to decide: its handshake ends with its proof.
                    Event::Hello(_) | Event::Proved(_) => {
                        break Some(Err(refused("the handshake went out of order".into())));
                    }
                    Event::Done(_) => {
                        break Some(o.stream.set_nonblocking(true).map_err(|e| io_err("configuring the socket to", e)));
                    }
                    Event::Refused(why) => break Some(Err(refused(why.to_string()))),
                }
            };
            if let Some(end) = end
                && let Some((o, _)) = slot.take()
            {
                out.push((o.lane, end.map(|()| o.stream)));
            }
        }
        // Then each reads the answer it waits for.
        for slot in &mut open {
            let Some((o, need)) = slot.as_mut() else { continue };
            let Some(n) = need.take() else { continue };
            let got = &mut buf[..n];
            if let Err(e) = o.stream.read_exact(got) {
                if let Some((o, _)) = slot.take() {
                    out.push((o.lane, Err(io_err("reading the handshake answer of", e))));
                }
                continue;
            }
            o.hs.feed(got);
        }
    }
    out.sort_by_key(|(lane, _)| *lane as u8);
    out
}

impl TcpEndpoint {
    /// Opens the pair's `lane` connection to `peer` at `addr` (and as its store entry has it)
    /// and makes the connector's side of its handshake.
    fn open_lane(
        &self,
        peer: usize,
        (addr, published): (SocketAddr, &[u8]),
        deadline: Instant,
        lane: Lane,
    ) -> std::result::Result<Opening, ConnectError> {
        let opts = &self.shared.opts;
        let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let io_err =
            |what: &str, e: io::Error| ConnectError::Retry(Error::io(format!("{what} rank {peer} at {addr}"), e));
        let s = std::net::TcpStream::connect_timeout(&addr, left().min(opts.handshake_timeout))
            .map_err(|e| io_err("connecting to", e))?;
        configure(&socket2::SockRef::from(&s), opts).map_err(|e| io_err("configuring the socket to", e))?;
        let hs_deadline = left().min(opts.handshake_timeout);
        s.set_read_timeout(Some(hs_deadline)).map_err(|e| io_err("configuring the socket to", e))?;
        s.set_write_timeout(Some(hs_deadline)).map_err(|e| io_err("configuring the socket to", e))?;
        let route = &self.route;
        let hs = Handshake::connect(Dial {
            kind: BackendKind::Tcp,
            local: Local { ctx: self.ctx, rank: route.rank, size: route.size, secret: route.secret.clone() },
            to: peer,
            lane: lane as u8,
            address: published,
            payload: Vec::new(),
            nonce: random16(),
        });
        Ok(Opening { lane, stream: s, hs })
    }
}
