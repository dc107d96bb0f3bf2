//! The engine's messages: a rank's state in a cycle, and the coordinator's responses.
//!
//! Written and read with the crate's codec ([`crate::codec`]): little-endian, length-prefixed;
//! a count may not exceed what is left of the message, and a malformed message is
//! [`Error::Protocol`] naming the peer and the byte where it went wrong.

use super::meta::{Kind, Meta};
use super::tensor::Compression;
use crate::codec::{BufMutExt, Codec, DecodeError, Decoded, Reader};
use crate::error::{Error, Result};
use crate::types::{DType, Reduction};
use bytes::BufMut;

/// A rank woke itself (a submission arrived), or a peer woke it (a cycle began in the host's
/// area while it slept).
pub(crate) const WAKE: u8 = 0;
/// A rank's state in a cycle.
const STATE: u8 = 1;
/// The coordinator's responses in a cycle.
const RESPONSES: u8 = 2;

/// Longest tensor name.
pub(crate) const MAX_NAME: usize = 4096;
/// Longest message the engine receives.
pub(crate) const MAX_MESSAGE: usize = 256 << 20;

/// Status flags, ORed across ranks.
pub(crate) const JOINED: u8 = 1;
pub(crate) const SHUTDOWN: u8 = 2;
pub(crate) const REQUESTS: u8 = 4;

/// A name sent in full to the coordinator.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Request {
    pub(crate) name: String,
    pub(crate) meta: Meta,
}

/// One rank's state message of a cycle.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct State {
    pub(crate) cycle: u64,
    pub(crate) flags: u8,
    /// Cache slots this rank has pending (a bit per slot).
    pub(crate) pending: Vec<u64>,
    /// Cache slots this rank found out of date (ORed: every rank drops them).
    pub(crate) invalidate: Vec<u64>,
    /// Names not in the cache (only in the message to the coordinator).
    pub(crate) requests: Vec<Request>,
}

/// A coordinator decision about one name.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Response {
    pub(crate) name: String,
    pub(crate) meta: Meta,
    /// The cache slot every rank puts the name in, if it is cached.
    pub(crate) slot: Option<u32>,
    /// Each rank's first dimension (allgather).
    pub(crate) dims: Vec<u64>,
    /// The disagreement, when the ranks' submissions do not agree.
    pub(crate) error: Option<(u32, String)>,
}

/// A reduction's code in an engine message (the codes of the engine's own enum before
/// [`Reduction`] took its place, so the wire format is unchanged).
fn op_code(op: Reduction) -> u8 {
    match op {
        Reduction::Sum => 0,
        Reduction::Average => 1,
        Reduction::Min => 2,
        Reduction::Max => 3,
        Reduction::Product => 4,
    }
}

fn op_from_code(c: u8) -> Option<Reduction> {
    [Reduction::Sum, Reduction::Average, Reduction::Min, Reduction::Max, Reduction::Product]
        .into_iter()
        .find(|&o| op_code(o) == c)
}

/// Writes a name or an error text: its length as a `u32`, then its bytes.
fn write_str(out: &mut impl BufMut, s: &str) {
    out.write_u32_prefixed(s.as_bytes());
}

/// Reads what [`write_str`] wrote; its length may not exceed what is left.
fn read_str(r: &mut Reader<'_>) -> Decoded<String> {
    let n = r.count(1)?;
    let b = r.bytes(n)?;
    std::str::from_utf8(b).map(str::to_owned).map_err(|_| DecodeError::malformed("a name that is not UTF-8"))
}

/// Reads `u64` words after their count, which may not exceed what is left.
fn read_words(r: &mut Reader<'_>) -> Decoded<Vec<u64>> {
    let n = r.count(8)?;
    r.words(n)
}

/// Reads a code and what it stands for, `what` when it stands for nothing.
fn read_code<T>(r: &mut Reader<'_>, from: impl Fn(u8) -> Option<T>, what: &str) -> Decoded<T> {
    from(r.get()?).ok_or_else(|| DecodeError::malformed(what))
}

impl Codec for Meta {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let kind = read_code(r, Kind::from_code, "an unknown collective")?;
        let dtype = read_code(r, DType::from_code, "an unknown element type")?;
        let op = read_code(r, op_from_code, "an unknown reduction")?;
        let compression = read_code(r, Compression::from_code, "an unknown compression")?;
        let root = r.get()?;
        let prescale = f64::from_bits(r.get()?);
        let postscale = f64::from_bits(r.get()?);
        let group = r.get()?;
        let group_size = r.get()?;
        let shape = read_words(r)?;
        Ok(Meta { kind, dtype, shape, op, root, prescale, postscale, compression, group, group_size })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.put_slice(&[self.kind as u8, self.dtype as u8, op_code(self.op), self.compression.code()]);
        out.write(self.root);
        out.write(self.prescale.to_bits());
        out.write(self.postscale.to_bits());
        out.write(self.group);
        out.write(self.group_size);
        out.write_words(self.shape.iter().copied());
    }
}

impl Codec for Request {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        Ok(Request { name: read_str(r)?, meta: r.get()? })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        write_str(out, &self.name);
        self.meta.encode(out);
    }
}

impl Codec for Response {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let name = read_str(r)?;
        let meta = r.get()?;
        let slot = Some(r.get()?).filter(|&s| s != u32::MAX);
        let dims = read_words(r)?;
        let error = match r.get::<u8>()? {
            0 => None,
            1 => Some((r.get()?, read_str(r)?)),
            _ => return Err(DecodeError::malformed("an unknown response kind")),
        };
        Ok(Response { name, meta, slot, dims, error })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        write_str(out, &self.name);
        self.meta.encode(out);
        out.write(self.slot.unwrap_or(u32::MAX));
        out.write_words(self.dims.iter().copied());
        match &self.error {
            None => out.write(0u8),
            Some((rank, text)) => {
                out.write(1u8);
                out.write(*rank);
                write_str(out, text);
            }
        }
    }
}

/// Decodes a whole message from rank `peer` with `read`: a message that does not decode, or
/// has bytes after its end, is [`Error::Protocol`] saying what is wrong and at which byte.
pub(crate) fn decode_message<'a, T>(
    buf: &'a [u8],
    peer: usize,
    read: impl FnOnce(&mut Reader<'a>) -> Decoded<T>,
) -> Result<T> {
    let mut r = Reader::new(buf);
    let message = read(&mut r).and_then(|m| match r.remaining() {
        0 => Ok(m),
        _ => Err(DecodeError::malformed("trailing bytes")),
    });
    message.map_err(|e| {
        let what = match e {
            DecodeError::Short(_) => "cut short".to_string(),
            DecodeError::Malformed(what) => what,
        };
        let (at, len) = (buf.len() - r.remaining(), buf.len());
        Error::Protocol {
            peer: Some(peer),
            detail: format!("engine message from rank {peer}: {what} at byte {at} of {len}"),
        }
    })
}

/// Reads a message's type byte, which must be `want` (else `not`).
fn read_type(r: &mut Reader<'_>, want: u8, not: &str) -> Decoded<()> {
    if r.get::<u8>()? != want {
        return Err(DecodeError::malformed(not));
    }
    Ok(())
}

impl State {
    pub(crate) fn encode(&self, with_requests: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + 8 * self.pending.len());
        out.write(STATE);
        out.write(self.cycle);
        out.write(self.flags);
        out.write_words(self.pending.iter().copied());
        out.write_words(self.invalidate.iter().copied());
        let reqs: &[Request] = if with_requests { &self.requests } else { &[] };
        out.write_count(reqs.len());
        reqs.iter().for_each(|r| r.encode(&mut out));
        out
    }

    pub(crate) fn decode(buf: &[u8], peer: usize) -> Result<State> {
        decode_message(buf, peer, |r| {
            read_type(r, STATE, "not a state message")?;
            let cycle = r.get()?;
            let flags = r.get()?;
            let pending = read_words(r)?;
            let invalidate = read_words(r)?;
            let n = r.count(40)?;
            let requests = (0..n).map(|_| r.get()).collect::<Decoded<_>>()?;
            Ok(State { cycle, flags, pending, invalidate, requests })
        })
    }
}

/// A state message as it travels, with the tensors that travel with it: the state message
/// after its length (a `u32`), then a count of tensors (a `u32`, and 4 bytes of zeros), and
/// each tensor's cache slot and length (`u32`s) and bytes. Each part starts 8-byte aligned
/// from the message's start (zeros in between), so a tensor in a received message can be
/// folded where it lies. Small cached allreduces travel this way, so that the cycle that
/// finds them ready on every rank brought every rank's tensor (`background.rs`). Written into
/// `out`, cleared first: a buffer reused from cycle to cycle.
pub(crate) fn envelope_into(out: &mut Vec<u8>, state: &[u8], eager: &[Travelling<'_>]) {
    let data: usize = eager.iter().map(|(_, b)| 8 + b.len().next_multiple_of(8)).sum();
    out.clear();
    out.reserve(16 + state.len() + data);
    let pad = |out: &mut Vec<u8>| out.resize(out.len().next_multiple_of(8), 0);
    out.write_u32_prefixed(state);
    pad(out);
    out.write_count(eager.len());
    out.write(0u32);
    for (slot, bytes) in eager {
        out.write(*slot);
        out.write_u32_prefixed(bytes);
        pad(out);
    }
}

/// [`envelope_into`] a buffer that held something else before.
#[cfg(test)]
pub(crate) fn envelope(state: &[u8], eager: &[Travelling<'_>]) -> Vec<u8> {
    let mut out = vec![0xEE; 3];
    envelope_into(&mut out, state, eager);
    out
}

/// A tensor travelling with a state message: its cache slot and its bytes.
pub(crate) type Travelling<'a> = (u32, &'a [u8]);

/// [`envelope`]'s parts: the state message, and each tensor's slot and bytes (in slot order).
/// A malformed envelope, or one naming a slot twice, is [`Error::Protocol`] naming rank
/// `peer`.
pub(crate) fn open_envelope(msg: &[u8], peer: usize) -> Result<(&[u8], Vec<Travelling<'_>>)> {
    decode_message(msg, peer, |r| {
        let pad = |r: &mut Reader<'_>| {
            let at = msg.len() - r.remaining();
            r.reserved(at.next_multiple_of(8) - at, "padding")
        };
        let state = r.u32_prefixed(MAX_MESSAGE, "a state message")?;
        pad(r)?;
        let n = r.count(8)?;
        r.reserved(4, "padding")?;
        let mut eager: Vec<Travelling<'_>> = Vec::with_capacity(n);
        for _ in 0..n {
            let slot = r.get::<u32>()?;
            let bytes = r.u32_prefixed(MAX_MESSAGE, "a tensor")?;
            pad(r)?;
            eager.push((slot, bytes));
        }
        eager.sort_unstable_by_key(|e| e.0);
        if let Some(w) = eager.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(DecodeError::malformed(format!("cache slot {} twice", w[0].0)));
        }
        Ok((state, eager))
    })
}

pub(crate) fn encode_responses(cycle: u64, responses: &[Response]) -> Vec<u8> {
    let mut out = Vec::new();
    out.write(RESPONSES);
    out.write(cycle);
    out.write_count(responses.len());
    responses.iter().for_each(|x| x.encode(&mut out));
    out
}

pub(crate) fn decode_responses(buf: &[u8], peer: usize, cycle: u64) -> Result<Vec<Response>> {
    decode_message(buf, peer, |r| {
        read_type(r, RESPONSES, "not a response message")?;
        let c = r.get::<u64>()?;
        if c != cycle {
            return Err(DecodeError::malformed(format!("responses of cycle {c} in cycle {cycle}")));
        }
        let n = r.count(40)?;
        (0..n).map(|_| r.get()).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn meta() -> Meta {
        Meta {
            kind: Kind::Allreduce,
            dtype: DType::F32,
            shape: vec![64, 3],
            op: Reduction::Average,
            root: 0,
            prescale: 0.5,
            postscale: 2.0,
            compression: Compression::F16,
            group: 7,
            group_size: 2,
        }
    }

    #[test]
    fn envelopes_round_trip_and_malformed_ones_are_refused_naming_the_peer() {
        let state = State { cycle: 3, flags: 0, pending: vec![6], invalidate: vec![0], requests: vec![] }.encode(true);
        let (a, b) = (vec![1u8, 2, 3, 4], vec![]);
        let msg = envelope(&state, &[(1, &a), (2, &b)]);
        let (s, eager) = open_envelope(&msg, 2).expect("opens");
        assert_eq!(s, &state[..]);
        assert_eq!(eager, vec![(1, &a[..]), (2, &b[..])]);
        // Each tensor starts 8-byte aligned from the message's start.
        assert!(eager.iter().all(|(_, t)| (t.as_ptr() as usize - msg.as_ptr() as usize).is_multiple_of(8)));
        assert_eq!(open_envelope(&envelope(&state, &[]), 2).map(|(_, e)| e.len()).ok(), Some(0));
        // Cut anywhere, with a byte too many, or naming a slot twice: refused in words.
        for cut in 0..msg.len() {
            assert!(matches!(open_envelope(&msg[..cut], 2), Err(Error::Protocol { peer: Some(2), .. })), "{cut}");
        }
        let mut long = msg.clone();
        long.push(0);
        assert!(open_envelope(&long, 2).is_err());
        let twice = envelope(&state, &[(1, &a), (1, &a)]);
        let e = open_envelope(&twice, 5).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("rank 5") && e.contains("slot 1 twice"), "{e}");
    }

    #[test]
    fn state_and_responses_round_trip() {
        let s = State {
            cycle: 9,
            flags: JOINED | REQUESTS,
            pending: vec![5, 0, u64::MAX],
            invalidate: vec![0, 2, 0],
            requests: vec![Request { name: "layer3.grad".into(), meta: meta() }],
        };
        assert_eq!(State::decode(&s.encode(true), 1).ok(), Some(s.clone()));
        let without = State::decode(&s.encode(false), 1).ok().map(|d| d.requests.len());
        assert_eq!(without, Some(0));
        let rs = vec![
            Response { name: "a".into(), meta: meta(), slot: Some(3), dims: vec![], error: None },
            Response { name: "b".into(), meta: meta(), slot: None, dims: vec![1, 2], error: Some((2, "no".into())) },
        ];
        assert_eq!(decode_responses(&encode_responses(4, &rs), 0, 4).ok(), Some(rs.clone()));
        assert!(matches!(
            decode_responses(&encode_responses(4, &rs), 0, 5),
            Err(Error::Protocol { peer: Some(0), .. })
        ));
    }

    /// Bytes from hex, spaces ignored.
    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    // The encoding of 329d2e9, before the engine used the crate's codec: it must not change.
    const META: &str = "01 01 01 01 00000000 000000000000e03f 0000000000000040 0700000000000000 02000000
                        02000000 4000000000000000 0300000000000000";

    #[test]
    fn state_and_responses_bytes_are_unchanged() {
        let s = State {
            cycle: 9,
            flags: JOINED | REQUESTS,
            pending: vec![5],
            invalidate: vec![],
            requests: vec![Request { name: "ab".into(), meta: meta() }],
        };
        let want =
            hex(&format!("01 0900000000000000 05 01000000 0500000000000000 00000000 01000000 02000000 6162 {META}"));
        assert_eq!(s.encode(true), want);
        let rs =
            vec![Response { name: "b".into(), meta: meta(), slot: None, dims: vec![1], error: Some((2, "no".into())) }];
        let want = hex(&format!(
            "02 0400000000000000 01000000 01000000 62 {META} ffffffff 01000000 0100000000000000
             01 02000000 02000000 6e6f"
        ));
        assert_eq!(encode_responses(4, &rs), want);
        let rs = vec![Response { name: "".into(), meta: meta(), slot: Some(3), dims: vec![], error: None }];
        let want = hex(&format!("02 0400000000000000 01000000 00000000 {META} 03000000 00000000 00"));
        assert_eq!(encode_responses(4, &rs), want);
    }

    #[test]
    fn malformed_messages_say_what_and_where() {
        let text = |r: Result<State>| match r {
            Err(Error::Protocol { peer: Some(3), detail }) => detail,
            other => panic!("{other:?}"),
        };
        let good = State { cycle: 1, flags: 0, pending: vec![], invalidate: vec![], requests: vec![] }.encode(false);
        assert_eq!(text(State::decode(&good[..5], 3)), "engine message from rank 3: cut short at byte 1 of 5");
        assert_eq!(text(State::decode(&[2], 3)), "engine message from rank 3: not a state message at byte 1 of 1");
        let mut long = good.clone();
        long.push(0);
        assert_eq!(text(State::decode(&long, 3)), "engine message from rank 3: trailing bytes at byte 22 of 23");
        let mut count = good[..10].to_vec();
        count.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            text(State::decode(&count, 3)),
            "engine message from rank 3: a count larger than the message at byte 14 of 18"
        );
        let mut name = good[..18].to_vec();
        name.extend_from_slice(&[1, 0, 0, 0, 1, 0, 0, 0, 0xff]);
        name.extend_from_slice(&[0; 40]);
        assert_eq!(
            text(State::decode(&name, 3)),
            "engine message from rank 3: a name that is not UTF-8 at byte 27 of 67"
        );
        let mut kind = good[..18].to_vec();
        kind.extend_from_slice(&[1, 0, 0, 0, 1, 0, 0, 0, b'a', 99]);
        kind.extend_from_slice(&[0; 40]);
        assert_eq!(text(State::decode(&kind, 3)), "engine message from rank 3: an unknown collective at byte 28 of 68");
        match decode_responses(&encode_responses(4, &[]), 0, 5) {
            Err(Error::Protocol { peer: Some(0), detail }) => {
                assert_eq!(detail, "engine message from rank 0: responses of cycle 4 in cycle 5 at byte 9 of 13")
            }
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        // Any bytes decode to a message or a protocol error naming the peer, never a panic or
        // a huge allocation.
        #[test]
        fn garbage_is_a_protocol_error(data in proptest::collection::vec(any::<u8>(), 0..200), cycle in 0u64..3) {
            for r in [State::decode(&data, 3).map(drop), decode_responses(&data, 3, cycle).map(drop)] {
                if let Err(e) = r {
                    prop_assert!(matches!(e, Error::Protocol { peer: Some(3), .. }), "{e}");
                }
            }
        }
    }
}
