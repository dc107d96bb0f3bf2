//! Shared memory's side of the one handshake ([`crate::transport::handshake`]), over the pair's
//! Unix socket. Each side's payload is an [`Offer`] (process id, the address of a word to test
//! `process_vm_readv` with, segment sizes), and its segment and doorbell descriptors go, with
//! `SCM_RIGHTS`, on the same message and on no other: the connector's on its proof (after the
//! acceptor proved the secret), the acceptor's on its welcome (after the connector proved it).
//! The connector's ready message says whether it can read the acceptor's memory.
//!
//! The connector runs its side blocking, with the socket's timeouts; the acceptor runs each
//! connection's without blocking, through [`crate::transport::accepting`] ([`ShmConn`]).

use super::pair::{PairParts, ShmPair};
use super::segment::Segment;
use super::{PROBE, ShmEndpoint};
use crate::error::Error;
use crate::transport::accepting::Acceptor;
use crate::transport::handshake::codec::{BufMutExt, Codec, Decoded, Reader, decode_all, to_vec};
use crate::transport::handshake::messages::MAX_MESSAGE;
use crate::transport::handshake::{BackendKind, Dial, Done, Event, Handshake, Local, Status};
use crate::transport::wake::EventFd;
use crate::transport::{ConnectError, random16};
use bytes::BufMut;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

/// What a side tells a proven peer about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Offer {
    pid: u32,
    /// The address of [`PROBE`] in this process.
    probe: u64,
    ring_bytes: u64,
    coll_bytes: u64,
    /// This side can read the other's memory (the acceptor's answer; the connector's comes in
    /// its ready message, once it knows where to look).
    reads_yours: bool,
}

impl Codec for Offer {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        Ok(Offer {
            pid: r.get()?,
            probe: r.get()?,
            ring_bytes: r.get()?,
            coll_bytes: r.get()?,
            reads_yours: r.get::<u8>()? != 0,
        })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write(self.pid);
        out.write(self.probe);
        out.write(self.ring_bytes);
        out.write(self.coll_bytes);
        out.write(u8::from(self.reads_yours));
    }
}

/// The peer's side, once its descriptors came and its segment is mapped.
struct Theirs {
    segment: Arc<Segment>,
    bell: OwnedFd,
    pid: i32,
    /// The peer reads this side's memory.
    reads_mine: bool,
}

/// How a handshake failed: the path (worth retrying), or a refusal.
enum Failed {
    Io(Error),
    Refused(String),
}

impl ShmEndpoint {
    /// The pair with `peer` over the segment and doorbell it handed over, with `lifeline` its
    /// end of the handshake's socket; `peer_reads_mine` when the peer reads this side's memory.
    fn pair_with(
        &self,
        peer: usize,
        theirs: Theirs,
        lifeline: UnixStream,
        peer_reads_mine: bool,
    ) -> std::io::Result<Arc<ShmPair>> {
        ShmPair::new(PairParts {
            me: self.spec.rank,
            peer,
            early_budget: self.opts.early_budget,
            mine: self.segment.clone(),
            theirs: theirs.segment,
            peer_bell: EventFd::from_fd(theirs.bell),
            lifeline,
            peer_pid: theirs.pid,
            peer_reads_mine,
        })
    }

    /// This side's offer.
    fn offer(&self, reads_yours: bool) -> Offer {
        Offer {
            pid: std::process::id(),
            probe: &PROBE as *const u64 as u64,
            ring_bytes: self.opts.ring_bytes as u64,
            coll_bytes: self.opts.coll_bytes as u64,
            reads_yours,
        }
    }

    fn local(&self) -> Local {
        Local { ctx: self.spec.ctx, rank: self.spec.rank, size: self.spec.size, secret: self.spec.secret.clone() }
    }

    /// Checks a proven peer's offer and maps the segment it sent; the status to refuse it
    /// with otherwise.
    fn take_offer(&self, peer: usize, payload: &[u8], fds: &mut Vec<OwnedFd>) -> std::result::Result<Theirs, Status> {
        let offer: Offer = decode_all(payload, "a shared-memory offer").map_err(|e| {
            tracing::warn!(peer, "a shared-memory offer that does not decode: {e}");
            Status::Settings
        })?;
        if offer.ring_bytes != self.opts.ring_bytes as u64 || offer.coll_bytes != self.opts.coll_bytes as u64 {
            tracing::warn!(
                peer,
                "its segment sizes (rings {} B, area {} B) differ from this rank's ({} B, {} B)",
                offer.ring_bytes,
                offer.coll_bytes,
                self.opts.ring_bytes,
                self.opts.coll_bytes
            );
            return Err(Status::Settings);
        }
        let [seg_fd, bell]: [OwnedFd; 2] = std::mem::take(fds).try_into().map_err(|_| Status::Unavailable)?;
        let segment = Segment::open(&seg_fd, self.layout, peer).map_err(|e| {
            tracing::warn!(peer, "cannot map its segment: {e}");
            Status::Unavailable
        })?;
        Ok(Theirs { segment, bell, pid: offer.pid as i32, reads_mine: offer.reads_yours })
    }

    /// Whether this process may read the memory of the peer that offered `payload`.
    fn can_read(&self, payload: &[u8]) -> bool {
        self.opts.single_copy
            && decode_all::<Offer>(payload, "a shared-memory offer")
                .is_ok_and(|o| super::cma_works(o.pid as i32, o.probe))
    }

    /// Connects to `peer`, whose endpoint listens at the abstract name `addr`, and runs the
    /// connector's side of the handshake on `stream`.
    pub(super) fn connect_on(
        &mut self,
        peer: usize,
        addr: &[u8],
        stream: UnixStream,
    ) -> std::result::Result<(), ConnectError> {
        let mut hs = Handshake::connect(Dial {
            kind: BackendKind::Shm,
            local: self.local(),
            to: peer,
            lane: 0,
            address: addr,
            payload: to_vec(&self.offer(false)),
            nonce: random16(),
        });
        let mut theirs = None;
        let done = run(&stream, &mut hs, [self.segment_fd.as_fd(), self.bell.fd()], |hs, ev, fds| {
            if let Event::Proved(_) = ev {
                match self.take_offer(peer, hs.payload(), fds) {
                    Ok(t) => {
                        hs.respond(&[u8::from(self.can_read(hs.payload()))]);
                        theirs = Some(t);
                    }
                    Err(status) => hs.refuse(status),
                }
            }
        });
        let refused = |detail: String| ConnectError::Refused(Error::Protocol { peer: Some(peer), detail });
        done.map_err(|f| match f {
            Failed::Io(e) => ConnectError::Retry(e),
            Failed::Refused(why) => refused(why),
        })?;
        let theirs = theirs.ok_or_else(|| refused("its answer carries no segment and doorbell".into()))?;
        let reads_mine = theirs.reads_mine;
        let pair = self
            .pair_with(peer, theirs, stream, reads_mine)
            .map_err(|e| ConnectError::Retry(Error::io(format!("setting up the pair with rank {peer}"), e)))?;
        self.pairs[peer] = Some(pair);
        Ok(())
    }
}

/// Runs `hs` over `stream` (blocking, with the socket's timeouts) until it ends: sends what it
/// says (with `mine`, this side's descriptors, on the message that carries this side's payload
/// and on no other), reads what it needs (keeping the descriptors that come), and lets
/// `decide` answer its questions with the descriptors received so far.
fn run(
    stream: &UnixStream,
    hs: &mut Handshake,
    mine: [BorrowedFd<'_>; 2],
    mut decide: impl FnMut(&mut Handshake, &Event, &mut Vec<OwnedFd>),
) -> std::result::Result<Done, Failed> {
    let mut fds = Vec::new();
    let mut buf = [0u8; MAX_MESSAGE];
    let io = |what: &str, e: std::io::Error| Failed::Io(Error::io(format!("{what} a shared-memory handshake"), e));
    loop {
        match hs.poll() {
            Event::Send(o) => {
                let with: &[BorrowedFd<'_>] = if o.payload { &mine } else { &[] };
                send_with_fds(stream, &o.bytes, with).map_err(|e| io("sending", e))?;
            }
            Event::Need(n) => {
                let k =
                    recv_with_fds(stream, &mut buf[..n.min(MAX_MESSAGE)], &mut fds).map_err(|e| io("receiving", e))?;
                if k == 0 {
                    return Err(io("receiving", std::io::ErrorKind::UnexpectedEof.into()));
                }
                hs.feed(&buf[..k]);
            }
            Event::Done(d) => return Ok(d),
            Event::Refused(why) => return Err(Failed::Refused(why.to_string())),
            ev => decide(hs, &ev, &mut fds),
        }
    }
}

/// Sends the whole of `bytes` with descriptors `fds` attached, in one message.
fn send_with_fds(s: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let iov = [IoSlice::new(bytes)];
    let n = sendmsg::<()>(s.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    if n != bytes.len() {
        return Err(std::io::ErrorKind::WriteZero.into());
    }
    Ok(())
}

/// Receives at most `buf.len()` bytes, keeping the descriptors that come with them in `fds`;
/// `Ok(0)` at the end of the stream.
fn recv_with_fds(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> std::io::Result<usize> {
    let mut space = nix::cmsg_space!([i32; 4]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)?;
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(list) = c {
            // SAFETY: the kernel installed these descriptors in this process for us alone.
            fds.extend(list.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    Ok(msg.bytes)
}

/// A connection the acceptor handshakes on: the descriptors that came on it, and the peer's
/// side once it proved the secret and its segment is mapped.
pub(crate) struct ShmConn {
    stream: UnixStream,
    fds: Vec<OwnedFd>,
    theirs: Option<Theirs>,
}

impl Acceptor for ShmEndpoint {
    type Conn = ShmConn;
    const NAME: &'static str = "shm";

    fn accept(&mut self) -> std::io::Result<Option<ShmConn>> {
        match self.listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(true)?;
                Ok(Some(ShmConn { stream, fds: Vec::new(), theirs: None }))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn listener_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    fn fd(conn: &ShmConn) -> RawFd {
        conn.stream.as_raw_fd()
    }

    fn send(&self, conn: &mut ShmConn, bytes: &[u8], payload: bool) -> std::io::Result<()> {
        let mine = [self.segment_fd.as_fd(), self.bell.fd()];
        send_with_fds(&conn.stream, bytes, if payload { &mine } else { &[] })
    }

    fn recv(&self, conn: &mut ShmConn, buf: &mut [u8]) -> std::io::Result<usize> {
        recv_with_fds(&conn.stream, buf, &mut conn.fds)
    }

    fn decide(&mut self, hs: &mut Handshake, ev: &Event, conn: &mut ShmConn) {
        match ev {
            Event::Hello(h) => {
                let taken = self.pairs.get(h.from as usize).is_some_and(Option::is_some);
                hs.admit(Some(&self.local()), &self.name, taken);
            }
            Event::Proved(p) if self.pairs.get(p.rank).is_some_and(Option::is_some) => hs.refuse(Status::Duplicate),
            Event::Proved(p) => match self.take_offer(p.rank, hs.payload(), &mut conn.fds) {
                Ok(t) => {
                    let reads_yours = self.can_read(hs.payload());
                    hs.respond(&to_vec(&self.offer(reads_yours)));
                    conn.theirs = Some(t);
                }
                Err(status) => hs.refuse(status),
            },
            _ => {}
        }
    }

    fn finished(&mut self, conn: ShmConn, done: Done) {
        let peer = done.peer.rank;
        let Some(theirs) = conn.theirs else {
            return tracing::warn!(peer, "a shared-memory handshake ended without the peer's segment");
        };
        if self.pairs.get(peer).is_none_or(Option::is_some) {
            return tracing::warn!(peer, "refused a second shared-memory connection for one pair");
        }
        // The connector's ready message: whether it reads this side's memory.
        let reads_mine = done.ready.first().is_some_and(|&b| b != 0);
        let pair = self.pair_with(peer, theirs, conn.stream, reads_mine);
        match pair {
            Ok(pair) => self.pairs[peer] = Some(pair),
            Err(e) => tracing::warn!(peer, error = %e, "setting up a shared-memory pair failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn offers_round_trip(pid in any::<u32>(), probe in any::<u64>(), ring in any::<u64>(), coll in any::<u64>(), reads in any::<bool>()) {
            let o = Offer { pid, probe, ring_bytes: ring, coll_bytes: coll, reads_yours: reads };
            prop_assert_eq!(decode_all::<Offer>(&to_vec(&o), "an offer"), Ok(o));
        }
    }
}
