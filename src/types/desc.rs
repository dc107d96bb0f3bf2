//! [`OpDesc`]: what every message of a call carries so that ranks which disagree on the call
//! find out, and how a difference is put in words.

use super::{Algorithm, DType};
use crate::codec::{BufMutExt, Codec, Decoded, Reader};
use bytes::BufMut;

/// The kinds of call a message can belong to (the first byte of an [`OpDesc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Call {
    /// A user's point-to-point message.
    P2p = 0,
    Barrier = 1,
    Allreduce = 2,
    ReduceScatter = 3,
    Allgather = 4,
    Broadcast = 5,
    Reduce = 6,
    Gather = 7,
    Scatter = 8,
    Alltoall = 9,
}

impl Call {
    const NAMES: [&'static str; 10] = [
        "point-to-point",
        "barrier",
        "allreduce",
        "reduce_scatter",
        "allgather",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "alltoall",
    ];
}

/// No root, in [`OpDesc::root`].
pub(crate) const NO_ROOT: u32 = u32::MAX;

/// What every message of one call carries, so that ranks which disagree on the call learn it
/// from the first message instead of reinterpreting bytes: which collective, element type,
/// reduction, algorithm, root, element count, and a hash of whatever else must agree
/// (per-rank counts, a member list). The transport compares it whole; [`OpDesc::explain`]
/// turns a difference into words.
///
/// Fields are raw codes, so a descriptor off the wire always decodes (an unknown code prints as
/// a number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct OpDesc {
    /// A [`Call`] code.
    pub(crate) call: u8,
    /// A [`DType`] code, 0 for none (untyped bytes).
    pub(crate) dtype: u8,
    /// A reduction's code (`Reduction::code`; 5 for a custom fold), 0 for none.
    pub(crate) reduce: u8,
    /// An [`Algorithm::code`].
    pub(crate) algo: u8,
    /// The root rank, or [`NO_ROOT`].
    pub(crate) root: u32,
    /// Elements in the call (the user's buffer, or the total of per-rank counts).
    pub(crate) count: u64,
    /// A hash of whatever else must agree, 0 when nothing does.
    pub(crate) extra: u64,
}

/// The bit of [`OpDesc::algo`] that marks a single-copy shared-area call.
const SINGLE_COPY: u8 = 0x80;
/// The bit of [`OpDesc::algo`] that marks a single-copy broadcast whose root writes a share
/// of the others' buffers ([`BroadcastPath::Split`](crate::types::BroadcastPath::Split)).
const ROOT_WRITES: u8 = 0x40;

/// Bytes in an encoded [`OpDesc`].
pub(crate) const DESC_LEN: usize = 24;

impl OpDesc {
    /// A user's point-to-point message: nothing to compare but the byte length.
    pub(crate) const P2P: OpDesc = OpDesc::new(Call::P2p);

    /// A descriptor of `call` with no type, reduction, root or count.
    pub(crate) const fn new(call: Call) -> Self {
        OpDesc { call: call as u8, dtype: 0, reduce: 0, algo: 0, root: NO_ROOT, count: 0, extra: 0 }
    }

    /// With element type `dtype`.
    pub(crate) fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype as u8;
        self
    }

    /// With `count` elements.
    pub(crate) fn count(mut self, count: usize) -> Self {
        self.count = count as u64;
        self
    }

    /// With reduction code `code` (`Reduction::code`, or 5 for a custom fold).
    pub(crate) fn reduce(mut self, code: u8) -> Self {
        self.reduce = code;
        self
    }

    /// With algorithm `algo`.
    pub(crate) fn algo(mut self, algo: Algorithm) -> Self {
        self.algo = algo.code();
        self
    }

    /// Marked as a shared-area call that reads peers' buffers straight (`on`), so that a
    /// member that took the other copy path is a mismatch, never a misread slot.
    pub(crate) fn single_copy(mut self, on: bool) -> Self {
        if on {
            self.algo |= SINGLE_COPY;
        }
        self
    }

    /// Marked as a single-copy broadcast whose root writes a share of the others' buffers
    /// (`on`): a member that took the plain single-copy path would leave that share unread.
    /// (The two-level allreduce's last host step, a broadcast, is not marked: its path comes
    /// from the same host plan on every member.)
    pub(crate) fn root_writes(mut self, on: bool) -> Self {
        if on {
            self.algo |= SINGLE_COPY | ROOT_WRITES;
        }
        self
    }

    /// With root `root`.
    pub(crate) fn root(mut self, root: usize) -> Self {
        self.root = u32::try_from(root).unwrap_or(NO_ROOT - 1);
        self
    }

    /// With `extra`, a hash of whatever else must agree.
    pub(crate) fn extra(mut self, extra: u64) -> Self {
        self.extra = extra;
        self
    }

    /// The descriptor's bytes, as every message of its call carries them.
    pub(crate) fn encode(&self) -> [u8; DESC_LEN] {
        let mut b = [0u8; DESC_LEN];
        Codec::encode(self, &mut &mut b[..]);
        b
    }

    /// A descriptor from its bytes. Any bytes are one: its fields are raw codes.
    pub(crate) fn decode(b: &[u8; DESC_LEN]) -> Self {
        // `DESC_LEN` bytes are exactly one descriptor, so the codec cannot find them short.
        <Self as Codec>::decode(&mut Reader::new(b)).unwrap_or(OpDesc::P2P)
    }

    fn call_name(&self) -> String {
        Call::NAMES.get(usize::from(self.call)).map_or_else(|| format!("call #{}", self.call), |n| n.to_string())
    }

    fn dtype_name(&self) -> String {
        DType::from_code(self.dtype).map_or_else(|| format!("type #{}", self.dtype), |d| d.name().to_string())
    }

    fn reduce_name(&self) -> String {
        match self.reduce {
            1 => "sum".into(),
            2 => "product".into(),
            3 => "min".into(),
            4 => "max".into(),
            5 => "a custom reduction".into(),
            6 => "average".into(),
            c => format!("reduction #{c}"),
        }
    }

    fn algo_name(&self) -> String {
        let code = self.algo & !(SINGLE_COPY | ROOT_WRITES);
        let name =
            Algorithm::long_name(code).map_or_else(|| format!("algorithm #{code}"), |n| format!("the {n} algorithm"));
        match (self.algo & SINGLE_COPY, self.algo & ROOT_WRITES) {
            (0, _) => name,
            (_, 0) => format!("{name}, reading the others' buffers straight (single copy)"),
            _ => format!("{name}, reading the root's buffer straight while the root writes a share (single copy)"),
        }
    }

    /// The call in words: "allreduce of 1000 f32 elements (sum)", "broadcast of 16 u8
    /// elements from root 2", "barrier".
    pub(crate) fn describe(&self) -> String {
        let mut s = self.call_name();
        if self.dtype != 0 {
            s += &format!(" of {} {} elements", self.count, self.dtype_name());
        }
        if self.root != NO_ROOT {
            s += &format!(" from root {}", self.root);
        }
        if self.reduce != 0 {
            s += &format!(" ({})", self.reduce_name());
        }
        s
    }

    /// How rank `peer`'s call (`theirs`) differs from this rank's (`mine`), in words: "rank 1
    /// called allreduce with 1001 f32 elements, rank 0 with 1000".
    pub(crate) fn explain(me: usize, mine: &OpDesc, peer: usize, theirs: &OpDesc) -> String {
        if mine.call != theirs.call {
            return format!("rank {peer} called {}, rank {me} {}", theirs.describe(), mine.describe());
        }
        let call = theirs.call_name();
        let with = |t: String, m: String| format!("rank {peer} called {call} with {t}, rank {me} with {m}");
        if mine.dtype != theirs.dtype {
            with(format!("{} elements", theirs.dtype_name()), mine.dtype_name())
        } else if mine.count != theirs.count {
            with(format!("{} {} elements", theirs.count, theirs.dtype_name()), mine.count.to_string())
        } else if mine.root != theirs.root {
            with(format!("root {}", theirs.root), format!("root {}", mine.root))
        } else if mine.reduce != theirs.reduce {
            with(theirs.reduce_name(), mine.reduce_name())
        } else if mine.algo != theirs.algo {
            with(theirs.algo_name(), mine.algo_name())
        } else {
            format!(
                "rank {peer} called {call} with other per-rank counts, members or numbers of inputs than rank {me} \
                 ({:#018x} against {:#018x})",
                theirs.extra, mine.extra
            )
        }
    }
}

/// `call u8 | dtype u8 | reduce u8 | algo u8 | root u32 | count u64 | extra u64`, little-endian:
/// [`DESC_LEN`] bytes.
impl Codec for OpDesc {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let [call, dtype, reduce, algo] = r.get()?;
        Ok(OpDesc { call, dtype, reduce, algo, root: r.get()?, count: r.get()?, extra: r.get()? })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        out.write([self.call, self.dtype, self.reduce, self.algo]);
        out.write(self.root);
        out.write(self.count);
        out.write(self.extra);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn descriptor_bytes_are_unchanged() {
        // The encoding of 329d2e9, before the descriptor used the crate's codec.
        let d =
            OpDesc::new(Call::Broadcast).dtype(DType::F32).count(1000).reduce(6).root(2).extra(0x0102_0304_0506_0708);
        let d = OpDesc { algo: 0xa5, ..d };
        assert_eq!(d.encode(), [5, 1, 6, 0xa5, 2, 0, 0, 0, 0xe8, 3, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(
            OpDesc::P2P.encode(),
            [0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    proptest! {
        #[test]
        fn descriptors_round_trip(
            call in any::<u8>(), dtype in any::<u8>(), reduce in any::<u8>(), algo in any::<u8>(),
            root in any::<u32>(), count in any::<u64>(), extra in any::<u64>(),
        ) {
            let d = OpDesc { call, dtype, reduce, algo, root, count, extra };
            prop_assert_eq!(OpDesc::decode(&d.encode()), d);
        }

        #[test]
        fn any_bytes_decode_and_encode_back(b in any::<[u8; DESC_LEN]>()) {
            prop_assert_eq!(OpDesc::decode(&b).encode(), b);
        }
    }
}
