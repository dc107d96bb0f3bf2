//! The engine's messages: a rank's state in a cycle, and the coordinator's responses.
//!
//! Little-endian, length-prefixed; every decode is bounds-checked and a malformed message is
//! [`Error::Protocol`] naming the peer.

use super::meta::{Kind, Meta};
use super::tensor::Compression;
use crate::error::{Error, Result};
use crate::types::{DType, Reduction};

/// A rank woke itself (a submission arrived).
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

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    fn str(&mut self, s: &str) {
        self.len(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn words(&mut self, w: &[u64]) {
        self.len(w.len());
        for &x in w {
            self.u64(x);
        }
    }
    fn meta(&mut self, m: &Meta) {
        self.u8(m.kind as u8);
        self.u8(m.dtype as u8);
        self.u8(op_code(m.op));
        self.u8(m.compression.code());
        self.u32(m.root);
        self.u64(m.prescale.to_bits());
        self.u64(m.postscale.to_bits());
        self.u64(m.group);
        self.u32(m.group_size);
        self.words(&m.shape);
    }
}

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    peer: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8], peer: usize) -> Self {
        Reader { buf, pos: 0, peer }
    }

    fn bad(&self, what: &str) -> Error {
        Error::Protocol {
            peer: Some(self.peer),
            detail: format!(
                "engine message from rank {}: {what} at byte {} of {}",
                self.peer,
                self.pos,
                self.buf.len()
            ),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| self.bad("cut short"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    /// A count of items of at least `min` bytes each (so a forged count cannot allocate more
    /// than the message holds).
    fn count(&mut self, min: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min.max(1)) > self.buf.len() - self.pos {
            return Err(self.bad("a count larger than the message"));
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String> {
        let n = self.count(1)?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.bad("a name that is not UTF-8"))
    }
    fn words(&mut self) -> Result<Vec<u64>> {
        let n = self.count(8)?;
        (0..n).map(|_| self.u64()).collect()
    }
    fn meta(&mut self) -> Result<Meta> {
        let kind = Kind::from_code(self.u8()?).ok_or_else(|| self.bad("an unknown collective"))?;
        let dtype = DType::from_code(self.u8()?).ok_or_else(|| self.bad("an unknown element type"))?;
        let op = op_from_code(self.u8()?).ok_or_else(|| self.bad("an unknown reduction"))?;
        let compression = Compression::from_code(self.u8()?).ok_or_else(|| self.bad("an unknown compression"))?;
        let root = self.u32()?;
        let prescale = f64::from_bits(self.u64()?);
        let postscale = f64::from_bits(self.u64()?);
        let group = self.u64()?;
        let group_size = self.u32()?;
        let shape = self.words()?;
        Ok(Meta { kind, dtype, shape, op, root, prescale, postscale, compression, group, group_size })
    }
    fn end(&self) -> Result<()> {
        if self.pos != self.buf.len() {
            return Err(self.bad("trailing bytes"));
        }
        Ok(())
    }
}

impl State {
    pub(crate) fn encode(&self, with_requests: bool) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(32 + 8 * self.pending.len()));
        w.u8(STATE);
        w.u64(self.cycle);
        w.u8(self.flags);
        w.words(&self.pending);
        w.words(&self.invalidate);
        let reqs: &[Request] = if with_requests { &self.requests } else { &[] };
        w.len(reqs.len());
        for r in reqs {
            w.str(&r.name);
            w.meta(&r.meta);
        }
        w.0
    }

    pub(crate) fn decode(buf: &[u8], peer: usize) -> Result<State> {
        let mut r = Reader::new(buf, peer);
        if r.u8()? != STATE {
            return Err(r.bad("not a state message"));
        }
        let cycle = r.u64()?;
        let flags = r.u8()?;
        let pending = r.words()?;
        let invalidate = r.words()?;
        let n = r.count(40)?;
        let mut requests = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.str()?;
            let meta = r.meta()?;
            requests.push(Request { name, meta });
        }
        r.end()?;
        Ok(State { cycle, flags, pending, invalidate, requests })
    }
}

pub(crate) fn encode_responses(cycle: u64, responses: &[Response]) -> Vec<u8> {
    let mut w = Writer(Vec::new());
    w.u8(RESPONSES);
    w.u64(cycle);
    w.len(responses.len());
    for x in responses {
        w.str(&x.name);
        w.meta(&x.meta);
        w.u32(x.slot.unwrap_or(u32::MAX));
        w.words(&x.dims);
        match &x.error {
            None => w.u8(0),
            Some((rank, text)) => {
                w.u8(1);
                w.u32(*rank);
                w.str(text);
            }
        }
    }
    w.0
}

pub(crate) fn decode_responses(buf: &[u8], peer: usize, cycle: u64) -> Result<Vec<Response>> {
    let mut r = Reader::new(buf, peer);
    if r.u8()? != RESPONSES {
        return Err(r.bad("not a response message"));
    }
    let c = r.u64()?;
    if c != cycle {
        return Err(r.bad(&format!("responses of cycle {c} in cycle {cycle}")));
    }
    let n = r.count(40)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str()?;
        let meta = r.meta()?;
        let slot = Some(r.u32()?).filter(|&s| s != u32::MAX);
        let dims = r.words()?;
        let error = match r.u8()? {
            0 => None,
            1 => Some((r.u32()?, r.str()?)),
            _ => return Err(r.bad("an unknown response kind")),
        };
        out.push(Response { name, meta, slot, dims, error });
    }
    r.end()?;
    Ok(out)
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
