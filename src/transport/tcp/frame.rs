//! The frame header that precedes every message on an established pair.
//!
//! ```text
//! offset size field
//!  0     1    kind      1 = data, 2 = abort (payload: an encoded AbortCause, at most 4 KiB),
//!                       3 = switch (no payload: the next frame comes on the pair's other
//!                       connection)
//!  1     7    reserved  must be zero
//!  8     8    group     the context (0) or sub-group the message belongs to; an abort frame's
//!                       group is the one aborted
//! 16     8    tag       which receive of the group the message is for
//! 24     8    len       payload bytes that follow the header
//! 32    24    desc      the call's descriptor (collective, element type, count, root, ...),
//!                       checked by the receiver; zero for abort and switch frames
//! ```
//! All integers little-endian. The payload is streamed to the posted receive buffer; `len` never
//! sizes an allocation beyond the pair's early-arrival budget (or an owned receive's limit).

use crate::transport::matching::Header;
use crate::transport::{Key, MAX_CAUSE};
use crate::types::{DESC_LEN, OpDesc};

/// Bytes in an encoded header.
pub(crate) const HEADER_LEN: usize = 32 + DESC_LEN;

const KIND_DATA: u8 = 1;
const KIND_ABORT: u8 = 2;
const KIND_SWITCH: u8 = 3;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A message for a receive.
    Data,
    /// The sender gave up on the group; the payload says why.
    Abort,
    /// The sender's next frame is on the pair's other connection (see `pair::Lane`).
    Switch,
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub(crate) kind: Kind,
    pub(crate) key: Key,
    pub(crate) len: u64,
    pub(crate) desc: OpDesc,
}

/// An all-zero descriptor, for frames that carry none.
const NO_DESC: OpDesc = OpDesc { call: 0, dtype: 0, reduce: 0, algo: 0, root: 0, count: 0, extra: 0 };

impl FrameHeader {
    /// A data frame.
    pub(crate) fn data(key: Key, desc: OpDesc, len: usize) -> Self {
        FrameHeader { kind: Kind::Data, key, len: len as u64, desc }
    }

    /// An abort frame for `group` with a cause of `len` bytes.
    pub(crate) fn abort(group: u64, len: usize) -> Self {
        FrameHeader { kind: Kind::Abort, key: Key { group, tag: 0 }, len: len as u64, desc: NO_DESC }
    }

    /// A switch frame.
    pub(crate) fn switch() -> Self {
        FrameHeader { kind: Kind::Switch, key: Key { group: 0, tag: 0 }, len: 0, desc: NO_DESC }
    }

    /// The matching view of a data frame.
    pub(crate) fn header(&self) -> Header {
        Header { key: self.key, desc: self.desc, len: self.len }
    }

    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = match self.kind {
            Kind::Data => KIND_DATA,
            Kind::Abort => KIND_ABORT,
            Kind::Switch => KIND_SWITCH,
        };
        b[8..16].copy_from_slice(&self.key.group.to_le_bytes());
        b[16..24].copy_from_slice(&self.key.tag.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..].copy_from_slice(&self.desc.encode());
        b
    }

    /// Decodes a header; an unknown kind, nonzero reserved bytes or a control frame with
    /// contents it may not have are an error message.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        let kind = match b[0] {
            KIND_DATA => Kind::Data,
            KIND_ABORT => Kind::Abort,
            KIND_SWITCH => Kind::Switch,
            k => return Err(format!("unknown frame kind {k}")),
        };
        if b[1..8].iter().any(|&x| x != 0) {
            return Err("nonzero reserved bytes in frame header".into());
        }
        let word = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let mut desc = [0u8; DESC_LEN];
        desc.copy_from_slice(&b[32..]);
        let h = FrameHeader {
            kind,
            key: Key { group: word(8), tag: word(16) },
            len: word(24),
            desc: OpDesc::decode(&desc),
        };
        if kind != Kind::Data && h.desc != NO_DESC {
            return Err("control frame with a descriptor".into());
        }
        if kind == Kind::Abort && (h.len > MAX_CAUSE as u64 || h.key.tag != 0) {
            return Err(format!("abort frame of {} bytes (at most {MAX_CAUSE}) or with a tag", h.len));
        }
        if kind == Kind::Switch && (h.len != 0 || h.key != Key { group: 0, tag: 0 }) {
            return Err("switch frame with a payload, group or tag".into());
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn desc_strategy() -> impl Strategy<Value = OpDesc> {
        (any::<[u8; 4]>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(c, root, count, extra)| OpDesc {
            call: c[0],
            dtype: c[1],
            reduce: c[2],
            algo: c[3],
            root,
            count,
            extra,
        })
    }

    proptest! {
        #[test]
        fn data_headers_round_trip(group in any::<u64>(), tag in any::<u64>(), len in any::<u64>(), desc in desc_strategy()) {
            let h = FrameHeader { kind: Kind::Data, key: Key { group, tag }, len, desc };
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn abort_headers_round_trip_within_their_bound(group in any::<u64>(), len in 0..=MAX_CAUSE) {
            let h = FrameHeader::abort(group, len);
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
            let big = FrameHeader::abort(group, MAX_CAUSE + 1 + len);
            prop_assert!(FrameHeader::decode(&big.encode()).is_err());
        }

        #[test]
        fn switch_frames_carry_nothing(len in 1u64.., tag in 1u64..) {
            let h = FrameHeader::switch();
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
            let with_len = FrameHeader { len, ..h };
            let with_tag = FrameHeader { key: Key { group: 0, tag }, ..h };
            prop_assert!(FrameHeader::decode(&with_len.encode()).is_err());
            prop_assert!(FrameHeader::decode(&with_tag.encode()).is_err());
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let arr: [u8; HEADER_LEN] = bytes.try_into().unwrap();
            match FrameHeader::decode(&arr) {
                Ok(h) => prop_assert_eq!(h.encode(), arr),
                Err(e) => prop_assert!(!e.is_empty()),
            }
        }
    }
}
