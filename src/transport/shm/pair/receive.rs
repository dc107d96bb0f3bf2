//! The receiving side of a shared-memory pair: records read off the inbound ring in order
//! through the matching (payloads copied out, fragments gathered, single-copy messages read
//! straight from the sender's memory or held a moment for their receive), and answers given.

use super::super::ring::{Consumer, Published, Record, RingMem};
use super::super::segment::ShmRing;
use super::super::wire::{
    ACK, ACK_LEN, Ack, CMA, CMA_REF, CmaRef, FRAG, FRAG_HEAD, Fixed, FragHead, HDR, MSG, MsgHeader, START,
};
use super::{HOLD, HOLD_MIN, Inner, Rx, ShmPair};

use crate::error::{Error, Result};
use crate::transport::Done;
use crate::transport::matching::Dispatch;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl ShmPair {
    /// Reads the records that came in, as far as the matching lets.
    pub(super) fn read(&self, g: &mut Inner) -> Result<()> {
        g.blocked = false;
        while let Some(r) = g.rx.peek() {
            match r.kind {
                ACK => {
                    let Ack { seq } = self.decode::<ACK_LEN, Ack>(&g.rx, r, 0)?;
                    g.rx.consume(r);
                    match g.unacked.iter().position(|(s, _, _)| *s == seq) {
                        Some(i) => {
                            if let Some((_, done, len)) = g.unacked.remove(i) {
                                done.complete(Ok(Done { peer: self.peer, len }));
                            }
                        }
                        None => return Err(self.protocol(format!("an answer for message {seq}, never sent"))),
                    }
                }
                FRAG => {
                    let n = self.decode::<FRAG_HEAD, FragHead>(&g.rx, r, 0)?.len as usize;
                    if n + FRAG_HEAD > r.room {
                        return Err(self.protocol(format!("a fragment of {n} bytes in a record of {}", r.room)));
                    }
                    let src = g.inbound.data_at(r.off + FRAG_HEAD, n);
                    // SAFETY: a published record of the ring, ours until consumed.
                    let bytes = unsafe { std::slice::from_raw_parts(src, n) };
                    let done = match &mut g.rx_state {
                        Rx::Payload(d) => {
                            d.put(bytes);
                            d.is_full()
                        }
                        Rx::Early(e) => {
                            e.extend(bytes);
                            e.remaining() == 0
                        }
                        Rx::Discard { remaining } => {
                            *remaining = remaining.saturating_sub(n);
                            *remaining == 0
                        }
                        Rx::Idle => return Err(self.protocol("a fragment outside a message".into())),
                    };
                    g.rx.consume(r);
                    if done {
                        self.finish_fragments(g);
                    }
                }
                MSG | START | CMA => {
                    if !matches!(g.rx_state, Rx::Idle) {
                        return Err(self.protocol("a new message inside a fragmented one".into()));
                    }
                    let MsgHeader(h) = self.decode::<HDR, MsgHeader>(&g.rx, r, 0)?;
                    let len = usize::try_from(h.len).unwrap_or(usize::MAX);
                    if r.kind == MSG && len > r.room - HDR {
                        return Err(self.protocol(format!("a message of {len} bytes in a record of {}", r.room)));
                    }
                    if r.kind == CMA && self.keep_holding(g, len) {
                        g.blocked = true;
                        break;
                    }
                    g.held_since = None;
                    match g.matcher.incoming(h) {
                        Dispatch::Stall => {
                            g.blocked = true;
                            break;
                        }
                        Dispatch::Deliver(mut d) => match r.kind {
                            MSG => {
                                // SAFETY: a published record of the ring, ours until consumed.
                                let src =
                                    unsafe { std::slice::from_raw_parts(g.inbound.data_at(r.off + HDR, len), len) };
                                d.put(src);
                                g.rx.consume(r);
                                d.finish(self.peer);
                            }
                            CMA => {
                                let CmaRef { addr, seq } = self.decode::<CMA_REF, CmaRef>(&g.rx, r, HDR)?;
                                g.rx.consume(r);
                                if let Err(e) = self.cma_read(g, d.dst(), addr) {
                                    // The receive has left the matching: fail it here.
                                    d.done().complete(Err(e.clone()));
                                    return Err(e);
                                }
                                d.advance(len);
                                g.acks.push_back(seq);
                                d.finish(self.peer);
                            }
                            _ => {
                                g.rx.consume(r);
                                if d.is_full() {
                                    d.finish(self.peer);
                                } else {
                                    g.rx_state = Rx::Payload(d);
                                }
                            }
                        },
                        Dispatch::Early(mut e) => match r.kind {
                            MSG => {
                                // SAFETY: as above.
                                let src =
                                    unsafe { std::slice::from_raw_parts(g.inbound.data_at(r.off + HDR, len), len) };
                                e.extend(src);
                                g.rx.consume(r);
                                g.matcher.early_arrived(e);
                            }
                            CMA => {
                                let CmaRef { addr, seq } = self.decode::<CMA_REF, CmaRef>(&g.rx, r, HDR)?;
                                g.rx.consume(r);
                                let mut res = Ok(());
                                e.fill(len, |dst| {
                                    res = self.cma_read(g, dst, addr);
                                    Ok::<(), ()>(())
                                })
                                .ok();
                                if let Err(err) = res {
                                    // Its early budget goes back.
                                    g.matcher.early_dropped(e);
                                    return Err(err);
                                }
                                g.acks.push_back(seq);
                                g.matcher.early_arrived(e);
                            }
                            _ => {
                                g.rx.consume(r);
                                if e.remaining() == 0 {
                                    g.matcher.early_arrived(e);
                                } else {
                                    g.rx_state = Rx::Early(e);
                                }
                            }
                        },
                        Dispatch::Discard => {
                            if r.kind == CMA {
                                g.acks.push_back(self.decode::<CMA_REF, CmaRef>(&g.rx, r, HDR)?.seq);
                            } else if r.kind == START && len > 0 {
                                g.rx_state = Rx::Discard { remaining: len };
                            }
                            g.rx.consume(r);
                        }
                    }
                }
                k => return Err(self.protocol(format!("a record of unknown kind {k}"))),
            }
        }
        if g.rx.publish() == Published::WakeProducer {
            g.wake_peer = true;
        }
        Ok(())
    }

    /// A fragmented message is complete.
    pub(super) fn finish_fragments(&self, g: &mut Inner) {
        match std::mem::replace(&mut g.rx_state, Rx::Idle) {
            Rx::Payload(d) => d.finish(self.peer),
            Rx::Early(e) => g.matcher.early_arrived(e),
            _ => {}
        }
    }

    /// Whether a large CMA message stays in the ring for now (see [`HOLD_MIN`]).
    pub(super) fn keep_holding(&self, g: &mut Inner, len: usize) -> bool {
        if len < HOLD_MIN || g.matcher.has_posted() {
            return false;
        }
        let now = Instant::now();
        *g.held_since.get_or_insert(now) + HOLD > now
    }

    /// When a held message must be looked at again.
    pub(crate) fn hold_ends(&self) -> Option<Instant> {
        self.lock().held_since.map(|t| t + HOLD)
    }

    /// The value of `N` bytes at `at` of record `r`'s body; a protocol error where the record
    /// has no room for it or it does not decode.
    pub(super) fn decode<const N: usize, T: Fixed<N>>(
        &self,
        rx: &Consumer<ShmRing>,
        r: Record,
        at: usize,
    ) -> Result<T> {
        if at + N > r.room {
            return Err(self.protocol(format!("a record of kind {} with {} bytes of room", r.kind, r.room)));
        }
        let mut b = [0u8; N];
        rx.mem().read(r.off + at, &mut b);
        T::from_bytes(&b).map_err(|why| self.protocol(format!("a record of kind {}: {why}", r.kind)))
    }

    /// Copies `dst.len()` bytes from the peer's memory at `addr`, then makes sure the peer had
    /// not broken its side meanwhile (a send it cancelled while it was being read).
    pub(super) fn cma_read(&self, g: &Inner, dst: &mut [u8], addr: u64) -> Result<()> {
        let from = [nix::sys::uio::RemoteIoVec { base: addr as usize, len: dst.len() }];
        match crate::transport::shm::read_process(self.peer_pid, &from, &mut [std::io::IoSliceMut::new(dst)]) {
            Ok(()) => {}
            Err(nix::errno::Errno::EFAULT) => return Err(self.protocol("its memory could not be read".into())),
            Err(nix::errno::Errno::ESRCH) => {
                return Err(Error::PeerClosed {
                    rank: self.peer,
                    op: String::new(),
                    detail: "its process is gone".into(),
                });
            }
            Err(e) => {
                return Err(Error::io(format!("reading a message of rank {} from its memory", self.peer), e.into()));
            }
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        if g.inbound.broken().load(Ordering::SeqCst) != 0 {
            return Err(self.protocol("it cancelled a send while this rank read it".into()));
        }
        Ok(())
    }
}
