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

use crate::transport::handshake::codec::{BufMutExt, DecodeError, Decoded, Reader};
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
        let mut out: &mut [u8] = &mut b;
        out.write(match self.kind {
            Kind::Data => KIND_DATA,
            Kind::Abort => KIND_ABORT,
            Kind::Switch => KIND_SWITCH,
        });
        out.write([0u8; 7]);
        out.write(self.key.group);
        out.write(self.key.tag);
        out.write(self.len);
        out.write(self.desc.encode());
        b
    }

    /// Decodes a header; an unknown kind, nonzero reserved bytes or a control frame with
    /// contents it may not have are an error message.
    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        Self::read(&mut Reader::new(b)).map_err(|e| e.to_string())
    }

    fn read(r: &mut Reader<'_>) -> Decoded<Self> {
        let kind = match r.get::<u8>()? {
            KIND_DATA => Kind::Data,
            KIND_ABORT => Kind::Abort,
            KIND_SWITCH => Kind::Switch,
            k => return Err(DecodeError::malformed(format!("unknown frame kind {k}"))),
        };
        r.reserved(7, "frame header")?;
        let key = Key { group: r.get()?, tag: r.get()? };
        let h = FrameHeader { kind, key, len: r.get()?, desc: OpDesc::decode(&r.get()?) };
        if kind != Kind::Data && h.desc != NO_DESC {
            return Err(DecodeError::malformed("control frame with a descriptor"));
        }
        if kind == Kind::Abort && (h.len > MAX_CAUSE as u64 || h.key.tag != 0) {
            return Err(DecodeError::malformed(format!(
                "abort frame of {} bytes (at most {MAX_CAUSE}) or with a tag",
                h.len
            )));
        }
        if kind == Kind::Switch && (h.len != 0 || h.key != Key { group: 0, tag: 0 }) {
            return Err(DecodeError::malformed("switch frame with a payload, group or tag"));
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
