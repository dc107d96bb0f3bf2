//! The frame header that precedes every message on an established pair.
//!
//! ```text
//! offset size field
//!  0     1    kind      1 = data, 2 = abort (payload: the reason, UTF-8, at most 4 KiB),
//!                       3 = switch (no payload: the next frame comes on the pair's other
//!                       connection)
//!  1     3    reserved  must be zero
//!  4     4    meta      opaque word checked by the receiver (element type, collective, ...)
//!  8     8    tag       which receive the message is for
//! 16     8    len       payload bytes that follow the header
//! ```
//! All integers little-endian. The payload is streamed to the posted receive buffer; `len` never
//! sizes an allocation beyond the pair's early-arrival budget.

/// Bytes in an encoded header.
pub(crate) const HEADER_LEN: usize = 24;

const KIND_DATA: u8 = 1;
const KIND_ABORT: u8 = 2;
const KIND_SWITCH: u8 = 3;

/// Longest abort reason accepted (an abort frame's length is checked before anything is read).
pub(crate) const MAX_ABORT: u64 = 4096;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A message for a receive.
    Data,
    /// The sender gave up on the context; the payload says why.
    Abort,
    /// The sender's next frame is on the pair's other connection (see `pair::Lane`).
    Switch,
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub(crate) kind: Kind,
    pub(crate) meta: u32,
    pub(crate) tag: u64,
    pub(crate) len: u64,
}

impl FrameHeader {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = match self.kind {
            Kind::Data => KIND_DATA,
            Kind::Abort => KIND_ABORT,
            Kind::Switch => KIND_SWITCH,
        };
        b[4..8].copy_from_slice(&self.meta.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header; an unknown kind or nonzero reserved bytes are an error message.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        let kind = match b[0] {
            KIND_DATA => Kind::Data,
            KIND_ABORT => Kind::Abort,
            KIND_SWITCH => Kind::Switch,
            k => return Err(format!("unknown frame kind {k}")),
        };
        if b[1..4] != [0, 0, 0] {
            return Err("nonzero reserved bytes in frame header".into());
        }
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a[..r.len()].copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        let h = FrameHeader { kind, meta: word(4..8) as u32, tag: word(8..16), len: word(16..24) };
        if kind == Kind::Abort && h.len > MAX_ABORT {
            return Err(format!("abort frame of {} bytes (at most {MAX_ABORT})", h.len));
        }
        if kind == Kind::Switch && (h.len != 0 || h.meta != 0 || h.tag != 0) {
            return Err("switch frame with a payload, meta or tag".into());
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn header_round_trips(meta in any::<u32>(), tag in any::<u64>(), len in any::<u64>()) {
            let h = FrameHeader { kind: Kind::Data, meta, tag, len };
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn abort_headers_round_trip_within_their_bound(len in 0..=MAX_ABORT) {
            let h = FrameHeader { kind: Kind::Abort, meta: 0, tag: 0, len };
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
            let big = FrameHeader { len: MAX_ABORT + 1 + len, ..h };
            prop_assert!(FrameHeader::decode(&big.encode()).is_err());
        }

        #[test]
        fn switch_frames_carry_nothing(len in 1u64.., tag in 1u64..) {
            let h = FrameHeader { kind: Kind::Switch, meta: 0, tag: 0, len: 0 };
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
            let with_len = FrameHeader { len, ..h };
            let with_tag = FrameHeader { tag, ..h };
            prop_assert!(FrameHeader::decode(&with_len.encode()).is_err());
            prop_assert!(FrameHeader::decode(&with_tag.encode()).is_err());
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::array::uniform24(any::<u8>())) {
            match FrameHeader::decode(&bytes) {
                Ok(h) => prop_assert_eq!(h.encode(), bytes),
                Err(e) => prop_assert!(!e.is_empty()),
            }
        }
    }
}
