//! What travels between the two sides of an ibverbs pair besides payloads, as types with one
//! encoding through the transports' one codec ([`crate::transport::handshake::codec`]): the
//! ring's shape, the header at the start of a ring slot, the control messages in a write's
//! 32-bit immediate, and the abort frames on the lifeline. (Plain data: compiled, tested and
//! fuzzed without the `ibverbs` feature too.)
//!
//! ```text
//! slot header (80 B): kind u8 (1 eager, 2 rendezvous) | 7 zero bytes | group u64 | tag u64 |
//!                     call descriptor [24] | payload length u64 | address u64 | remote key u32 |
//!                     send id u32 | 8 zero bytes       (eager: the payload follows; address,
//!                                                       key and id are zero)
//! immediate (u32):    kind in the top 4 bits (1 data, 2 credit, 3 done) | 28 bits: the slot
//!                     written, the mask of slots freed, the rendezvous send that was read
//! lifeline frame:     length u32 (8 + cause, at most 8 + MAX_CAUSE) | group u64 | cause
//! ```
//! All integers little-endian.

use crate::transport::handshake::codec::{BufMutExt, Codec, DecodeError, Decoded, Reader, decode_all};
use crate::transport::matching::Header;
use crate::transport::{Key, MAX_CAUSE};
use crate::types::OpDesc;
use bytes::BufMut;

/// Slots in each ring (at most 28: a credit's mask travels in the immediate).
pub(crate) const SLOTS: usize = 16;
/// Bytes per slot.
pub(crate) const SLOT_BYTES: usize = 32 << 10;
/// Bytes of a message header in its slot.
pub(crate) const HDR: usize = 80;
/// The largest payload sent eagerly.
pub(crate) const EAGER_MAX: usize = SLOT_BYTES - HDR;

const KIND_EAGER: u8 = 1;
const KIND_RTS: u8 = 2;

const IMM_DATA: u32 = 1 << 28;
const IMM_CREDIT: u32 = 2 << 28;
const IMM_DONE: u32 = 3 << 28;
/// The immediate's low bits: what its kind is about.
pub(crate) const IMM_LOW: u32 = (1 << 28) - 1;

/// How a message's payload travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotKind {
    /// In the slot, after the header.
    Eager,
    /// In the sender's registered buffer, which the receiver reads (rendezvous).
    Rts,
}

/// The header at the start of a ring slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotHeader {
    pub(crate) kind: SlotKind,
    pub(crate) header: Header,
    /// (Rendezvous) The send buffer: its address and remote key, and the send's id, which the
    /// receiver's `DONE` names.
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    pub(crate) id: u32,
}

impl SlotHeader {
    /// An eager message's header.
    #[cfg(any(test, feature = "ibverbs"))]
    pub(crate) fn eager(header: Header) -> Self {
        SlotHeader { kind: SlotKind::Eager, header, addr: 0, rkey: 0, id: 0 }
    }

    /// The encoding (the pair encodes in place, into its staging slot).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn to_bytes(self) -> [u8; HDR] {
        crate::transport::handshake::codec::to_array(&self)
    }

    /// Decodes a header read out of a slot; what is wrong, in words.
    pub(crate) fn from_bytes(b: &[u8; HDR]) -> Result<Self, String> {
        decode_all(b, "a slot header").map_err(|e| e.to_string())
    }
}

impl Codec for SlotHeader {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let kind = match r.get::<u8>()? {
            KIND_EAGER => SlotKind::Eager,
            KIND_RTS => SlotKind::Rts,
            k => return Err(DecodeError::malformed(format!("a message header of unknown kind {k}"))),
        };
        r.reserved(7, "a slot header")?;
        let key = Key { group: r.get()?, tag: r.get()? };
        let desc = OpDesc::decode(&r.get()?);
        let len: u64 = r.get()?;
        let h = SlotHeader { kind, header: Header { key, desc, len }, addr: r.get()?, rkey: r.get()?, id: r.get()? };
        r.reserved(8, "a slot header")?;
        match kind {
            SlotKind::Eager if len > EAGER_MAX as u64 => {
                Err(DecodeError::malformed(format!("an eager message of {len} bytes (at most {EAGER_MAX})")))
            }
            SlotKind::Eager if (h.addr, h.rkey, h.id) != (0, 0, 0) => {
                Err(DecodeError::malformed("an eager message with a remote buffer"))
            }
            SlotKind::Rts if len <= EAGER_MAX as u64 || usize::try_from(len).is_err() => Err(DecodeError::malformed(
                format!("a rendezvous message of {len} bytes (more than {EAGER_MAX}, and addressable)"),
            )),
            _ => Ok(h),
        }
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write(match self.kind {
            SlotKind::Eager => KIND_EAGER,
            SlotKind::Rts => KIND_RTS,
        });
        out.write([0u8; 7]);
        out.write(self.header.key.group);
        out.write(self.header.key.tag);
        out.write(self.header.desc.encode());
        out.write(self.header.len);
        out.write(self.addr);
        out.write(self.rkey);
        out.write(self.id);
        out.write([0u8; 8]);
    }
}

/// A control message in a zero-length write's immediate, or a data write's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Imm {
    /// A message was written into this slot of the receiver's ring.
    Data(usize),
    /// The receiver freed these slots (a mask): the sender may write them again.
    Credit(u32),
    /// The receiver read this rendezvous send: it is complete.
    Done(u32),
}

impl Imm {
    pub(crate) fn encode(self) -> u32 {
        match self {
            Imm::Data(slot) => IMM_DATA | (slot as u32 & IMM_LOW),
            Imm::Credit(mask) => IMM_CREDIT | (mask & IMM_LOW),
            Imm::Done(id) => IMM_DONE | (id & IMM_LOW),
        }
    }

    /// `None`: not an immediate this side sends (an unknown kind, a slot or mask outside the
    /// ring).
    pub(crate) fn decode(imm: u32) -> Option<Self> {
        let low = imm & IMM_LOW;
        match imm & !IMM_LOW {
            IMM_DATA if (low as usize) < SLOTS => Some(Imm::Data(low as usize)),
            IMM_CREDIT if low >> SLOTS == 0 => Some(Imm::Credit(low)),
            IMM_DONE => Some(Imm::Done(low)),
            _ => None,
        }
    }
}

/// An abort frame on the lifeline: the group given up on, and the encoded cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LifelineFrame {
    pub(crate) group: u64,
    pub(crate) cause: Vec<u8>,
}

impl Codec for LifelineFrame {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let len = r.get::<u32>()? as usize;
        if !(8..=8 + MAX_CAUSE).contains(&len) {
            return Err(DecodeError::malformed(format!("a lifeline frame of {len} bytes")));
        }
        let group = r.get()?;
        Ok(LifelineFrame { group, cause: r.bytes(len - 8)?.to_vec() })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        let cause = &self.cause[..self.cause.len().min(MAX_CAUSE)];
        out.write((8 + cause.len()) as u32);
        out.write(self.group);
        out.put_slice(cause);
    }
}

/// The first whole frame at the front of `buf` and its length; `Ok(None)` while it has not
/// all come.
pub(crate) fn next_frame(buf: &[u8]) -> Result<Option<(LifelineFrame, usize)>, String> {
    let mut r = Reader::new(buf);
    match r.get::<LifelineFrame>() {
        Ok(f) => Ok(Some((f, buf.len() - r.remaining()))),
        Err(DecodeError::Short(_)) => Ok(None),
        Err(DecodeError::Malformed(why)) => Err(why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::handshake::codec::to_vec;
    use crate::types::DESC_LEN;
    use proptest::prelude::*;

    fn header(group: u64, tag: u64, len: u64, desc: [u8; DESC_LEN]) -> Header {
        Header { key: Key { group, tag }, desc: OpDesc::decode(&desc), len }
    }

    #[test]
    fn the_slot_layout_is_the_documented_one() {
        let h =
            SlotHeader { kind: SlotKind::Rts, header: header(1, 2, 1 << 20, [3; DESC_LEN]), addr: 4, rkey: 5, id: 6 };
        let b = h.to_bytes();
        assert_eq!(
            (b[0], b[8], b[16], b[24], b[47], b[48], b[50], b[56], b[64], b[68]),
            (2, 1, 2, 3, 3, 0, 16, 4, 5, 6)
        );
        assert!(b[1..8].iter().chain(&b[72..]).all(|&x| x == 0));
    }

    #[test]
    fn headers_that_lie_about_their_kind_or_length_are_malformed() {
        let eager = SlotHeader::eager(header(0, 0, 10, [0; DESC_LEN]));
        let with = |f: &dyn Fn(&mut SlotHeader)| {
            let mut h = eager;
            f(&mut h);
            SlotHeader::from_bytes(&h.to_bytes())
        };
        assert!(with(&|h| h.header.len = EAGER_MAX as u64 + 1).is_err_and(|e| e.contains("eager message of")));
        assert!(with(&|h| h.rkey = 1).is_err_and(|e| e.contains("remote buffer")));
        assert!(with(&|h| h.kind = SlotKind::Rts).is_err_and(|e| e.contains("rendezvous message of 10 bytes")));
        let mut b = eager.to_bytes();
        b[0] = 9;
        assert!(SlotHeader::from_bytes(&b).is_err_and(|e| e.contains("unknown kind 9")));
        let mut b = eager.to_bytes();
        b[75] = 1;
        assert!(SlotHeader::from_bytes(&b).is_err_and(|e| e.contains("reserved")));
    }

    #[test]
    fn immediates_outside_the_ring_or_of_no_kind_do_not_decode() {
        assert_eq!(Imm::decode(Imm::Data(SLOTS - 1).encode()), Some(Imm::Data(SLOTS - 1)));
        assert_eq!(Imm::decode(IMM_DATA | SLOTS as u32), None);
        assert_eq!(Imm::decode(IMM_CREDIT | 1 << SLOTS), None);
        assert_eq!(Imm::decode(0), None);
        assert_eq!(Imm::decode(4 << 28), None);
    }

    #[test]
    fn a_lifeline_frame_of_a_wrong_length_is_refused_before_its_bytes_come() {
        assert!(next_frame(&7u32.to_le_bytes()).is_err_and(|e| e.contains("of 7 bytes")));
        assert!(next_frame(&(9 + MAX_CAUSE as u32).to_le_bytes()).is_err());
        assert_eq!(to_vec(&LifelineFrame { group: 1, cause: vec![9] }), [9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9]);
    }

    proptest! {
        #[test]
        fn slot_headers_round_trip(
            group in any::<u64>(), tag in any::<u64>(), desc in any::<[u8; DESC_LEN]>(), eager_len in 0..=EAGER_MAX as u64,
            rts_len in EAGER_MAX as u64 + 1..u64::MAX, addr in any::<u64>(), rkey in any::<u32>(), id in any::<u32>(),
        ) {
            let e = SlotHeader::eager(header(group, tag, eager_len, desc));
            prop_assert_eq!(SlotHeader::from_bytes(&e.to_bytes()), Ok(e));
            let r = SlotHeader { kind: SlotKind::Rts, header: header(group, tag, rts_len, desc), addr, rkey, id };
            prop_assert_eq!(SlotHeader::from_bytes(&r.to_bytes()), Ok(r));
        }

        #[test]
        fn immediates_round_trip(slot in 0..SLOTS, mask in 0u32..1 << SLOTS, id in 0..=IMM_LOW) {
            for imm in [Imm::Data(slot), Imm::Credit(mask), Imm::Done(id)] {
                prop_assert_eq!(Imm::decode(imm.encode()), Some(imm));
            }
        }

        #[test]
        fn lifeline_frames_round_trip_and_wait_for_their_end(
            group in any::<u64>(), cause in proptest::collection::vec(any::<u8>(), 0..300), cut in 0usize..400,
        ) {
            let f = LifelineFrame { group, cause };
            let mut b = to_vec(&f);
            let whole = b.len();
            b.extend_from_slice(&[0xAB; 5]);
            prop_assert_eq!(next_frame(&b), Ok(Some((f, whole))));
            let cut = cut.min(whole - 1);
            prop_assert_eq!(next_frame(&b[..cut]), Ok(None), "a frame cut at {}", cut);
        }
    }
}
