//! The sending side of a pair: sends wait for a slot of the peer's ring (credits), then go out
//! eagerly (header and payload copied into the slot) or as a rendezvous header that lends the
//! send buffer until the peer's `DONE`.

use super::super::verbs::{Access, MemoryRegion, SendOp, Sge};
use super::super::wire::{EAGER_MAX, HDR, IMM_LOW, Imm, SLOT_BYTES, SlotHeader, SlotKind};
use super::{Link, State, Wr, WrKind, wr_id};
use crate::transport::handshake::codec::Codec;
use crate::transport::matching::Header;
use crate::transport::{Completion, Done, SendBuf};
use std::sync::Arc;

/// A send waiting for a slot of the peer's ring.
pub(super) struct PendingSend {
    pub(super) header: Header,
    pub(super) buf: SendBuf,
    pub(super) done: Arc<Completion>,
}

/// A rendezvous send whose header went out: its buffer stays lent until `DONE`.
pub(super) struct RtsSend {
    pub(super) done: Arc<Completion>,
    pub(super) len: usize,
    pub(super) _mr: Arc<dyn MemoryRegion>,
}

impl Link {
    /// Sends waiting for a slot go out while the peer has slots free, in order.
    pub(super) fn pump(&self, st: &mut State) {
        while st.failed.is_none() && st.free != 0 {
            let Some(send) = st.sends.pop_front() else { break };
            let slot = st.free.trailing_zeros() as usize;
            st.free &= !(1 << slot);
            let len = send.buf.len;
            let base = slot * SLOT_BYTES;
            // SAFETY: the staging slot is this side's and not in use (its ring slot was free:
            // the previous write from it has arrived); `HDR` bytes fit in a slot.
            let hdr = unsafe { std::slice::from_raw_parts_mut(self.staging.ptr(base), HDR) };
            let (addr, rkey) = self.remote_ring;
            let write = |bytes: usize| Wr {
                wr_id: wr_id(self.peer, WrKind::Write, 0),
                sge: Sge { addr: self.staging.addr(base), len: bytes as u32, lkey: self.staging.mr.lkey() },
                op: SendOp::WriteImm { remote_addr: addr + base as u64, rkey, imm: Imm::Data(slot).encode() },
            };
            // The header is written in place (its `HDR` bytes are exactly the slot header's).
            let mut out: &mut [u8] = hdr;
            if len <= EAGER_MAX {
                SlotHeader::eager(send.header).encode(&mut out);
                if len > 0 {
                    // SAFETY: the poster lent the send buffer until its completion (contract
                    // rule 5), completed below after this copy; the staging slot holds
                    // `HDR + EAGER_MAX` bytes.
                    unsafe { std::ptr::copy_nonoverlapping(send.buf.ptr, self.staging.ptr(base + HDR), len) };
                }
                self.post(st, write(HDR + len));
                send.done.complete(Ok(Done { peer: self.peer, len }));
            } else {
                // SAFETY: the buffer stays lent until the send completes, which happens only
                // after `DONE` (the peer finished reading) or once the queue pair is in error.
                let mr = match unsafe { self.regs.get(send.buf.ptr.cast_mut(), len, Access::RemoteRead) } {
                    Ok(mr) => mr,
                    Err(e) => {
                        send.done.complete(Err(e));
                        st.free |= 1 << slot;
                        continue;
                    }
                };
                st.next_id = (st.next_id + 1) & IMM_LOW;
                let id = st.next_id;
                let (addr, rkey) = (send.buf.ptr as u64, mr.rkey());
                SlotHeader { kind: SlotKind::Rts, header: send.header, addr, rkey, id }.encode(&mut out);
                self.post(st, write(HDR));
                st.rts.insert(id, RtsSend { done: send.done, len, _mr: mr });
            }
        }
    }
}
