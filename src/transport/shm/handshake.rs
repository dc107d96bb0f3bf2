//! Shared memory's side of the one handshake ([`crate::transport::handshake`]), over the pair's
//! Unix socket. Each side's payload is an [`Offer`] (process id, the address of a word to test
//! `process_vm_readv` with, segment sizes), and its segment and doorbell descriptors go, with
//! `SCM_RIGHTS`, on the same message and on no other: the connector's on its proof (after the
//! acceptor proved the secret), the acceptor's on its welcome (after the connector proved it).
//! The connector's ready message says whether it can read the acceptor's memory.

use super::pair::{PairParts, ShmPair};
use super::segment::Segment;
use super::{PROBE, ShmEndpoint};
use crate::error::{Error, Result};
use crate::transport::handshake::codec::{BufMutExt, Codec, Decoded, Reader, decode_all, to_vec};
use crate::transport::handshake::messages::MAX_MESSAGE;
use crate::transport::handshake::{BackendKind, Dial, Done, Event, Handshake, Local, Status};
use crate::transport::wake::EventFd;
use crate::transport::{ConnectError, random16};
use bytes::BufMut;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

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

    /// Accepts one connection and runs the acceptor's side of the handshake.
    pub(super) fn accept_one(&mut self, stream: UnixStream, deadline: Instant) -> Result<usize> {
        let t = self.deadline_from(deadline);
        stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(t)))
            .and_then(|()| stream.set_write_timeout(Some(t)))
            .map_err(|e| Error::io("configuring a Unix socket", e))?;
        let mut hs = Handshake::accept(BackendKind::Shm, random16());
        let mut theirs = None;
        let local = self.local();
        let done = run(&stream, &mut hs, [self.segment_fd.as_fd(), self.bell.fd()], |hs, ev, fds| match ev {
            Event::Hello(h) => {
                let taken = self.pairs.get(h.from as usize).is_some_and(Option::is_some);
                hs.admit(Some(&local), &self.name, taken);
            }
            Event::Proved(p) => match self.take_offer(p.rank, hs.payload(), fds) {
                Ok(t) => {
                    let reads_yours = self.can_read(hs.payload());
                    hs.respond(&to_vec(&self.offer(reads_yours)));
                    theirs = Some(t);
                }
                Err(status) => hs.refuse(status),
            },
            _ => {}
        });
        let done = done.map_err(|f| match f {
            Failed::Io(e) => e,
            Failed::Refused(detail) => Error::Protocol { peer: None, detail },
        })?;
        let peer = done.peer.rank;
        let theirs = theirs.ok_or_else(|| Error::Protocol { peer: Some(peer), detail: "no segment".into() })?;
        let pair = ShmPair::new(PairParts {
            me: self.spec.rank,
            peer,
            early_budget: self.opts.early_budget,
            mine: self.segment.clone(),
            theirs: theirs.segment,
            peer_bell: EventFd::from_fd(theirs.bell),
            lifeline: stream,
            peer_pid: theirs.pid,
            // The connector's ready message: whether it reads this side's memory.
            peer_reads_mine: done.ready.first().is_some_and(|&b| b != 0),
        })
        .map_err(|e| Error::io("setting up a shared-memory pair", e))?;
        self.pairs[peer] = Some(pair);
        Ok(peer)
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
        let pair = ShmPair::new(PairParts {
            me: self.spec.rank,
            peer,
            early_budget: self.opts.early_budget,
            mine: self.segment.clone(),
            theirs: theirs.segment,
            peer_bell: EventFd::from_fd(theirs.bell),
            lifeline: stream,
            peer_pid: theirs.pid,
            peer_reads_mine: theirs.reads_mine,
        })
        .map_err(|e| ConnectError::Retry(Error::io(format!("setting up the pair with rank {peer}"), e)))?;
        self.pairs[peer] = Some(pair);
        Ok(())
    }
}

/// Runs `hs` over `stream` until it ends: sends what it says (with `mine`, this side's
/// descriptors, on the message that carries this side's payload and on no other), reads what
/// it needs (keeping the descriptors that come), and lets `decide` answer its questions with
/// the descriptors received so far.
fn run(
    stream: &UnixStream,
    hs: &mut Handshake,
    mine: [BorrowedFd<'_>; 2],
    mut decide: impl FnMut(&mut Handshake, &Event, &mut Vec<OwnedFd>),
) -> std::result::Result<Done, Failed> {
    let mut fds = Vec::new();
    loop {
        match hs.poll() {
            Event::Send(o) => {
                let with: &[BorrowedFd<'_>] = if o.payload { &mine } else { &[] };
                send_with_fds(stream, &o.bytes, with).map_err(Failed::Io)?;
            }
            Event::Need(n) => {
                let (bytes, got) = recv_with_fds(stream, n.min(MAX_MESSAGE)).map_err(Failed::Io)?;
                fds.extend(got);
                hs.feed(&bytes);
            }
            Event::Done(d) => return Ok(d),
            Event::Refused(why) => return Err(Failed::Refused(why.to_string())),
            ev => decide(hs, &ev, &mut fds),
        }
    }
}

/// Sends `bytes` with descriptors `fds` attached.
fn send_with_fds(s: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
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

/// Receives exactly `n` bytes and the descriptors that came with them.
fn recv_with_fds(s: &UnixStream, n: usize) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; n];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < n {
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
