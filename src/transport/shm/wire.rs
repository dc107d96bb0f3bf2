//! What travels in a shared-memory pair's rings and on its lifeline, as types with one encoding
//! through the transports' one codec ([`crate::transport::handshake::codec`]), each of a fixed
//! length so that a message's records are written from and read into arrays (nothing allocated
//! per message).
//!
//! Records in a ring (see [`super::ring`]; all integers little-endian):
//!
//! ```text
//! MSG   header + the payload: messages up to INLINE_MAX
//! START header; the payload follows in FRAG records: larger messages, without CMA
//! FRAG  fragment head (8 B: length u32, 4 zero bytes) + payload bytes
//! CMA   header + reference (16 B: address u64, sequence u64): the receiver copies the payload
//!       straight out of the sender's memory (process_vm_readv) and answers ACK
//! ACK   sequence u64 (8 B): a CMA message was read; its send completes
//!
//! header (48 B): group u64 | tag u64 | payload length u64 | call descriptor [24]
//! ```
//!
//! The lifeline (the pair's Unix socket) carries abort messages only:
//! `group u64 | cause length u32 (at most MAX_CAUSE) | cause` (an encoded
//! [`AbortCause`](crate::transport::AbortCause)).

use crate::transport::handshake::codec::{BufMutExt, Codec, DecodeError, Decoded, Reader, decode_all, to_array};
use crate::transport::matching::Header;
use crate::transport::{Key, MAX_CAUSE};
use crate::types::{DESC_LEN, OpDesc};
use bytes::BufMut;

/// Record kinds.
pub(crate) const MSG: u32 = 1;
pub(crate) const START: u32 = 2;
pub(crate) const FRAG: u32 = 3;
pub(crate) const CMA: u32 = 4;
pub(crate) const ACK: u32 = 5;

/// Bytes of a message header ([`MsgHeader`]).
pub(crate) const HDR: usize = 24 + DESC_LEN;
/// Bytes of a fragment's head ([`FragHead`]).
pub(crate) const FRAG_HEAD: usize = 8;
/// Bytes of a single-copy reference ([`CmaRef`]).
pub(crate) const CMA_REF: usize = 16;
/// Bytes of an answer to a single-copy message ([`Ack`]).
pub(crate) const ACK_LEN: usize = 8;

/// The header of a MSG, START or CMA record: which receive the message is for, its length and
/// the call it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MsgHeader(pub(crate) Header);

impl Codec for MsgHeader {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let key = Key { group: r.get()?, tag: r.get()? };
        let len = r.get()?;
        Ok(MsgHeader(Header { key, len, desc: OpDesc::decode(&r.get()?) }))
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write(self.0.key.group);
        out.write(self.0.key.tag);
        out.write(self.0.len);
        out.write(self.0.desc.encode());
    }
}

/// The head of a FRAG record: how many payload bytes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FragHead {
    pub(crate) len: u32,
}

impl Codec for FragHead {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let len = r.get()?;
        r.reserved(4, "a fragment head")?;
        Ok(FragHead { len })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write(self.len);
        out.write([0u8; 4]);
    }
}

/// What follows a CMA record's header: where the payload is in the sender's memory, and the
/// number the receiver's [`Ack`] names it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CmaRef {
    pub(crate) addr: u64,
    pub(crate) seq: u64,
}

impl Codec for CmaRef {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        Ok(CmaRef { addr: r.get()?, seq: r.get()? })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write(self.addr);
        out.write(self.seq);
    }
}

/// An ACK record's body: the single-copy message of this sequence number was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ack {
    pub(crate) seq: u64,
}

impl Codec for Ack {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        Ok(Ack { seq: r.get()? })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write(self.seq);
    }
}

/// The fixed-length types above, to and from arrays of their length.
pub(crate) trait Fixed<const N: usize>: Codec {
    /// The encoding.
    fn to_bytes(&self) -> [u8; N] {
        to_array(self)
    }

    /// Decodes an array read out of a record; what is wrong, in words.
    fn from_bytes(b: &[u8; N]) -> Result<Self, String> {
        decode_all(b, "a shared-memory record").map_err(|e| e.to_string())
    }
}

impl Fixed<HDR> for MsgHeader {}
impl Fixed<FRAG_HEAD> for FragHead {}
impl Fixed<CMA_REF> for CmaRef {}
impl Fixed<ACK_LEN> for Ack {}

/// An abort message on the lifeline: the group given up on, and the encoded cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AbortMsg {
    pub(crate) group: u64,
    pub(crate) cause: Vec<u8>,
}

impl Codec for AbortMsg {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let group = r.get()?;
        let cause = r.u32_prefixed(MAX_CAUSE, "an abort message's cause")?;
        Ok(AbortMsg { group, cause: cause.to_vec() })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write(self.group);
        out.write_u32_prefixed(&self.cause[..self.cause.len().min(MAX_CAUSE)]);
    }
}

/// The first whole abort message at the front of `buf` and its length; `Ok(None)` while it
/// has not all come.
pub(crate) fn next_abort(buf: &[u8]) -> Result<Option<(AbortMsg, usize)>, String> {
    let mut r = Reader::new(buf);
    match r.get::<AbortMsg>() {
        Ok(m) => Ok(Some((m, buf.len() - r.remaining()))),
        Err(DecodeError::Short(_)) => Ok(None),
        Err(DecodeError::Malformed(why)) => Err(why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::handshake::codec::to_vec;
    use proptest::prelude::*;

    fn desc() -> impl Strategy<Value = OpDesc> {
        (any::<[u8; 4]>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(b, root, count, extra)| OpDesc {
            call: b[0],
            dtype: b[1],
            reduce: b[2],
            algo: b[3],
            root,
            count,
            extra,
        })
    }

    #[test]
    fn the_layouts_are_the_documented_ones() {
        let h = Header { key: Key { group: 1, tag: 2 }, len: 3, desc: OpDesc::decode(&[9; DESC_LEN]) };
        let b = MsgHeader(h).to_bytes();
        assert_eq!((b[0], b[8], b[16], b[24], b[47]), (1, 2, 3, 9, 9));
        assert_eq!(FragHead { len: 0x0102_0304 }.to_bytes(), [4, 3, 2, 1, 0, 0, 0, 0]);
        assert_eq!(CmaRef { addr: 1, seq: 2 }.to_bytes(), [1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Ack { seq: 7 }.to_bytes(), 7u64.to_le_bytes());
        assert_eq!(to_vec(&AbortMsg { group: 5, cause: vec![1, 2] }), [5, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 2]);
    }

    #[test]
    fn a_fragment_head_with_padding_and_an_oversized_abort_are_malformed() {
        assert!(FragHead::from_bytes(&[1, 0, 0, 0, 0, 0, 1, 0]).is_err_and(|e| e.contains("reserved")));
        let mut big = 3u64.to_le_bytes().to_vec();
        big.extend_from_slice(&(MAX_CAUSE as u32 + 1).to_le_bytes());
        assert!(next_abort(&big).is_err_and(|e| e.contains("at most")), "refused before its bytes come");
    }

    proptest! {
        #[test]
        fn message_headers_round_trip(group in any::<u64>(), tag in any::<u64>(), len in any::<u64>(), desc in desc()) {
            let h = Header { key: Key { group, tag }, len, desc };
            prop_assert_eq!(MsgHeader::from_bytes(&MsgHeader(h).to_bytes()), Ok(MsgHeader(h)));
        }

        #[test]
        fn fragment_heads_references_and_acks_round_trip(len in any::<u32>(), addr in any::<u64>(), seq in any::<u64>()) {
            prop_assert_eq!(FragHead::from_bytes(&FragHead { len }.to_bytes()), Ok(FragHead { len }));
            prop_assert_eq!(CmaRef::from_bytes(&CmaRef { addr, seq }.to_bytes()), Ok(CmaRef { addr, seq }));
            prop_assert_eq!(Ack::from_bytes(&Ack { seq }.to_bytes()), Ok(Ack { seq }));
        }

        #[test]
        fn abort_messages_round_trip_and_wait_for_their_end(
            group in any::<u64>(), cause in proptest::collection::vec(any::<u8>(), 0..300), cut in 0usize..400,
        ) {
            let m = AbortMsg { group, cause };
            let mut b = to_vec(&m);
            let whole = b.len();
            b.extend_from_slice(&[0xAB; 5]); // the start of the next message
            prop_assert_eq!(next_abort(&b), Ok(Some((m, whole))));
            let cut = cut.min(whole - 1);
            prop_assert_eq!(next_abort(&b[..cut]), Ok(None), "a message cut at {}", cut);
        }
    }
}
