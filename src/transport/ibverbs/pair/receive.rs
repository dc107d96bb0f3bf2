//! The receiving side of a pair: what the immediates say (a slot arrived, credits, a
//! rendezvous send done), slots taken in arrival order through the matching (eager payloads
//! copied out, rendezvous payloads read by RDMA straight into the receive or an early buffer),
//! and freed slots reported back as credits.

use super::super::verbs::{Access, MemoryRegion, SendOp, Sge};
use super::super::wire::{HDR, Imm, SLOT_BYTES, SlotHeader, SlotKind};
use super::{Link, MAX_READ, State, Wr, WrKind, wr_id};
use crate::error::Error;
use crate::transport::matching::{Delivery, Dispatch, EarlyRx};
use crate::transport::{Completion, Done};
use std::sync::Arc;

/// Where a read lands.
pub(super) enum ReadInto {
    Deliver(Delivery),
    /// An early message, read straight into its early buffer (registered per read).
    Early(EarlyRx),
}

/// A rendezvous payload being read.
pub(super) struct Reading {
    pub(super) into: ReadInto,
    pub(super) send_id: u32,
    pub(super) len: usize,
    /// Read requests of this payload not yet completed (one per [`MAX_READ`] bytes).
    pub(super) parts: usize,
    /// The first failure of a part.
    pub(super) error: Option<Error>,
    pub(super) _mr: Arc<dyn MemoryRegion>,
}

impl Reading {
    pub(super) fn is_for(&self, done: &Arc<Completion>) -> bool {
        matches!(&self.into, ReadInto::Deliver(d) if Arc::ptr_eq(d.done(), done))
    }
}

impl Link {
    /// A write with immediate `imm` arrived.
    pub(super) fn arrived(&self, st: &mut State, imm: u32) {
        match Imm::decode(imm) {
            Some(Imm::Data(slot)) => {
                st.arrived.push_back(slot);
                self.take_arrived(st);
            }
            Some(Imm::Credit(mask)) => {
                st.free |= mask;
                self.pump(st);
            }
            Some(Imm::Done(id)) => {
                if let Some(s) = st.rts.remove(&id) {
                    s.done.complete(Ok(Done { peer: self.peer, len: s.len }));
                }
            }
            None => {
                let err = Error::Protocol { peer: Some(self.peer), detail: format!("an RDMA immediate {imm:#010x}") };
                self.fail(st, err);
            }
        }
    }

    /// Takes arrived messages in order until one cannot be taken yet.
    pub(super) fn take_arrived(&self, st: &mut State) {
        while st.failed.is_none() && st.early_reads == 0 {
            let Some(&slot) = st.arrived.front() else { break };
            let base = slot * SLOT_BYTES;
            // SAFETY: the peer wrote this slot completely before its completion arrived, and
            // writes it again only after this side frees it (credits); `HDR <= SLOT_BYTES`.
            let raw = unsafe { &*self.ring.ptr(base).cast::<[u8; HDR]>() };
            let hdr = match SlotHeader::from_bytes(raw) {
                Ok(h) => h,
                Err(why) => {
                    let detail = format!("{why} in ring slot {slot}");
                    self.fail_and_tell(st, Error::Protocol { peer: Some(self.peer), detail });
                    return;
                }
            };
            // At most `EAGER_MAX`, or addressable: checked by the decoding.
            let len = hdr.header.len as usize;
            let dispatch = st.matcher.incoming(hdr.header);
            if matches!(dispatch, Dispatch::Stall) {
                return;
            }
            st.arrived.pop_front();
            if hdr.kind == SlotKind::Eager {
                // SAFETY: as for the header; the payload follows it within the slot.
                let payload = unsafe { std::slice::from_raw_parts(self.ring.ptr(base + HDR), len) };
                match dispatch {
                    Dispatch::Deliver(mut d) => {
                        d.dst().copy_from_slice(payload);
                        d.advance(len);
                        d.finish(self.peer);
                    }
                    Dispatch::Early(mut e) => {
                        e.extend(payload);
                        st.matcher.early_arrived(e);
                    }
                    Dispatch::Discard | Dispatch::Stall => {}
                }
            } else {
                match dispatch {
                    Dispatch::Deliver(d) => self.read(st, ReadInto::Deliver(d), &hdr, len),
                    Dispatch::Early(e) => self.read(st, ReadInto::Early(e), &hdr, len),
                    Dispatch::Discard | Dispatch::Stall => self.control(st, Imm::Done(hdr.id)),
                }
            }
            st.unreported |= 1 << slot;
        }
    }

    /// Starts reading a rendezvous payload.
    pub(super) fn read(&self, st: &mut State, mut into: ReadInto, hdr: &SlotHeader, len: usize) {
        let (dst, once) = match &mut into {
            // An owned receive's buffer is allocated (and freed) per message: never cached.
            ReadInto::Deliver(d) => (d.dst().as_mut_ptr(), d.is_owned()),
            ReadInto::Early(e) => (e.room_for_all(), true),
        };
        // SAFETY: `dst` is a claimed receive's buffer (lent until it completes, which happens
        // when this read finishes or fails) or the early buffer the reading entry owns; either
        // stays allocated while the region is used. Buffers of this library's own (early and
        // owned) are registered per read, as they are freed right after.
        let mr = if once {
            unsafe { self.regs.register_once(dst, len, Access::LocalWrite) }
        } else {
            unsafe { self.regs.get(dst, len, Access::LocalWrite) }
        };
        let mr = match mr {
            Ok(mr) => mr,
            Err(e) => {
                match into {
                    ReadInto::Deliver(d) => d.done().complete(Err(e)),
                    ReadInto::Early(e) => st.matcher.early_dropped(e),
                }
                self.control(st, Imm::Done(hdr.id));
                return;
            }
        };
        if matches!(into, ReadInto::Early(_)) {
            // Later messages wait until this one is in the early list: one of the same key
            // must not overtake it (contract rule 2).
            st.early_reads += 1;
        }
        st.next_id = st.next_id.wrapping_add(1);
        let id = st.next_id;
        let parts = len.div_ceil(MAX_READ);
        let lkey = mr.lkey();
        st.reads.insert(id, Reading { into, send_id: hdr.id, len, parts, error: None, _mr: mr });
        for part in 0..parts {
            let at = part * MAX_READ;
            let n = (len - at).min(MAX_READ);
            let wr = Wr {
                wr_id: wr_id(self.peer, WrKind::Read, id),
                sge: Sge { addr: dst as u64 + at as u64, len: n as u32, lkey },
                op: SendOp::Read { remote_addr: hdr.addr + at as u64, rkey: hdr.rkey },
            };
            self.post(st, wr);
        }
    }

    /// the sender is told.
    pub(super) fn finish_read(&self, st: &mut State, r: Reading, err: Option<Error>) {
        let Reading { into, send_id, len, _mr, .. } = r;
        drop(_mr);
        match (into, err) {
            (ReadInto::Deliver(d), Some(e)) => d.done().complete(Err(e)),
            (ReadInto::Early(e), Some(_)) => {
                st.early_reads -= 1;
                st.matcher.early_dropped(e);
            }
            (ReadInto::Deliver(mut d), None) => {
                d.advance(len);
                d.finish(self.peer);
            }
            (ReadInto::Early(e), None) => {
                st.early_reads -= 1;
                st.matcher.early_arrived(e);
            }
        }
        self.read_done.notify_all();
        if st.failed.is_none() {
            self.control(st, Imm::Done(send_id));
            // Messages held behind an early read go on.
            self.take_arrived(st);
        }
    }

    /// Tells the peer which slots were freed, if any.
    pub(super) fn report(&self, st: &mut State) {
        if st.unreported != 0 && st.failed.is_none() {
            let mask = std::mem::take(&mut st.unreported);
            self.control(st, Imm::Credit(mask));
        }
    }
}
