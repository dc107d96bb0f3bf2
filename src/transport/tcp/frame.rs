//! The frame header that precedes every message on an established pair.
//!
//! ```text
//! offset size field
//!  0     1    kind      1 = data (the only kind in protocol version 1)
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

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    pub(crate) meta: u32,
    pub(crate) tag: u64,
    pub(crate) len: u64,
}

impl FrameHeader {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = KIND_DATA;
        b[4..8].copy_from_slice(&self.meta.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header; an unknown kind or nonzero reserved bytes are an error message.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        if b[0] != KIND_DATA {
            return Err(format!("unknown frame kind {}", b[0]));
        }
        if b[1..4] != [0, 0, 0] {
            return Err("nonzero reserved bytes in frame header".into());
        }
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a[..r.len()].copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        Ok(FrameHeader { meta: word(4..8) as u32, tag: word(8..16), len: word(16..24) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn header_round_trips(meta in any::<u32>(), tag in any::<u64>(), len in any::<u64>()) {
            let h = FrameHeader { meta, tag, len };
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
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
