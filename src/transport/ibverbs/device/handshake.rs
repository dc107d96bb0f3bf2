//! The ibverbs side of the one handshake ([`crate::transport::handshake`]), over a TCP
//! connection that stays as the pair's lifeline: the address blob an endpoint publishes (where
//! it listens, nothing else), each side's payload (its queue pair's address and its ring's
//! address and key, handed only to a peer that proved the secret), the connector's side
//! (blocking, with the socket's timeouts) and the acceptor's (each connection on its own,
//! without blocking: [`crate::transport::accepting`]).

use super::IbEndpoint;
use crate::error::Error;
use crate::transport::accepting::Acceptor;
use crate::transport::handshake::codec::{BufMutExt, Codec, DecodeError, Decoded, Reader, decode_all, to_vec};
use crate::transport::handshake::messages::MAX_MESSAGE;
use crate::transport::handshake::{BackendKind, Dial, Done, Event, Handshake, Local, Status};
use crate::transport::ibverbs::verbs::QpAddr;
use crate::transport::{ConnectError, ContextId, Endpoint, random16};
use bytes::BufMut;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

const BLOB_MAGIC: u32 = u32::from_le_bytes(*b"FGIB");
/// The address blob's version (2: the lifeline's address only; the queue pairs and rings
/// travel in the handshake).
const BLOB_VERSION: u16 = 2;
/// How long a handshake may take.
pub(in crate::transport::ibverbs) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes an endpoint runs at once; a new connection evicts the oldest.
pub(in crate::transport::ibverbs) const MAX_PENDING: usize = 64;

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
pub(in crate::transport::ibverbs) struct Blob {
    pub(in crate::transport::ibverbs) ctx: ContextId,
    pub(in crate::transport::ibverbs) rank: u32,
    pub(in crate::transport::ibverbs) size: u32,
    pub(in crate::transport::ibverbs) sock: SocketAddr,
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

    /// Connects to `peer`, whose endpoint published `addr`, and runs the connector's side of
    /// the handshake over a TCP connection that stays as the pair's lifeline.
    pub(in crate::transport::ibverbs) fn connect_to(
        &mut self,
        peer: usize,
        addr: &[u8],
        deadline: Instant,
    ) -> std::result::Result<(), ConnectError> {
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
        let mut s = TcpStream::connect_timeout(&blob.sock, left.min(Duration::from_secs(2)))
            .map_err(|e| ConnectError::Retry(Error::io(format!("connecting to rank {peer} at {}", blob.sock), e)))?;
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
}

/// A connection the acceptor handshakes on, and the peer's ring once it proved the secret
/// and this side's queue pair is up towards its own.
pub(in crate::transport::ibverbs) struct IbConn {
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
            return tracing::warn!(rank = self.spec.rank, peer, "an ibverbs handshake ended without the peer's ring");
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

#[cfg(test)]
mod attack_tests {
    //! The attacks of [`crate::transport::handshake::attacks`] on ibverbs endpoints
    //! (simulated provider), with the rings' addresses as what must not reach a stranger.
    use super::super::IbDevice;
    use super::*;
    use crate::transport::handshake::attacks::{Attack, Listener, attack, dial_tcp, spec};
    use crate::transport::ibverbs::reg::RegCache;
    use crate::transport::ibverbs::sim;
    use std::sync::Arc;

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
        let attack_ = Attack { listener, fake, dial: &dial, b_private: vec![b_ring], a_private: vec![a_ring], relay };
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
