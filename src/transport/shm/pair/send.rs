//! The sending side of a shared-memory pair: the send queue written into the peer's ring as
//! far as it fits (small messages whole, large ones in fragments or as a reference the peer
//! reads with one copy), and the answers to single-copy messages this side read.

use super::super::ring::Pushed;
use super::super::wire::{ACK, Ack, CMA, CmaRef, FRAG, FRAG_HEAD, Fixed, FragHead, MSG, MsgHeader, START};
use super::{FRAG_MAX, INLINE_MAX, Inner, ShmPair};

use crate::error::Result;
use crate::transport::Done;
use crate::transport::matching::Header;
use crate::transport::span;
use smallvec::SmallVec;

impl ShmPair {
    /// Writes the send queue into the ring, as far as it fits.
    pub(super) fn flush(&self, g: &mut Inner) -> Result<()> {
        while let Some(seq) = g.acks.front().copied() {
            match g.tx.push(ACK, &[&Ack { seq }.to_bytes()]) {
                Pushed::Full => return Ok(()),
                pushed => {
                    g.wake_peer |= pushed == Pushed::Wake;
                    g.acks.pop_front();
                }
            }
        }
        while let Some(o) = g.sendq.front_mut() {
            let len = o.len;
            let hdr = MsgHeader(Header { key: o.key, desc: o.desc, len: len as u64 }).to_bytes();
            // SAFETY: the poster lent the buffers until the send completes (Pair::post_send).
            let payload: SmallVec<[&[u8]; 4]> =
                o.parts.iter().map(|b| unsafe { std::slice::from_raw_parts(b.ptr, b.len) }).collect();
            if len <= INLINE_MAX {
                let mut record: SmallVec<[&[u8]; 5]> = smallvec::smallvec![&hdr[..]];
                record.extend(payload.iter().copied());
                match g.tx.push(MSG, &record) {
                    Pushed::Full => return Ok(()),
                    pushed => g.wake_peer |= pushed == Pushed::Wake,
                }
                if let Some(o) = g.sendq.pop_front() {
                    o.done.complete(Ok(Done { peer: self.peer, len }));
                }
            } else if self.peer_reads_mine
                && o.sent.is_none()
                && let [one] = o.parts[..]
            {
                let seq = g.next_seq;
                let cma = CmaRef { addr: one.ptr as u64, seq }.to_bytes();
                match g.tx.push(CMA, &[&hdr, &cma]) {
                    Pushed::Full => return Ok(()),
                    pushed => g.wake_peer |= pushed == Pushed::Wake,
                }
                g.next_seq += 1;
                if let Some(o) = g.sendq.pop_front() {
                    g.unacked.push_back((seq, o.done, len));
                }
            } else {
                let frag_max = FRAG_MAX.min(g.tx.max_body() - FRAG_HEAD);
                if o.sent.is_none() {
                    match g.tx.push(START, &[&hdr]) {
                        Pushed::Full => return Ok(()),
                        pushed => g.wake_peer |= pushed == Pushed::Wake,
                    }
                    o.sent = Some(0);
                }
                while let Some(sent) = o.sent.filter(|&s| s < len) {
                    let n = frag_max.min(len - sent);
                    let head = FragHead { len: n as u32 }.to_bytes();
                    let mut record: SmallVec<[&[u8]; 5]> = smallvec::smallvec![&head[..]];
                    record.extend(span(&payload, sent - o.base, n));
                    match g.tx.push(FRAG, &record) {
                        Pushed::Full => return Ok(()),
                        pushed => g.wake_peer |= pushed == Pushed::Wake,
                    }
                    o.sent = Some(sent + n);
                }
                if let Some(o) = g.sendq.pop_front() {
                    o.done.complete(Ok(Done { peer: self.peer, len }));
                }
            }
        }
        Ok(())
    }
}
