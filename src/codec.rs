//! The one codec for the crate's wire types (the transports' handshake messages, frame headers,
//! abort causes and address blobs; the engine's, the parameter server's and the TCPStore's
//! messages): a [`Codec`] trait with little-endian encodings of the primitive
//! types, written through [`bytes::BufMut`], and a [`Reader`] over received bytes that never
//! panics: short input says how many more bytes it needs ([`DecodeError::Short`]), bad input
//! says what is wrong ([`DecodeError::Malformed`]). quinn-proto's `coding` module is the model.
//!
//! Besides the primitives it holds what several wire types share: bytes after a bounded length,
//! counts checked against what is left, and `u32`-counted runs of `u64` words.

use bytes::BufMut;
use std::fmt;

/// Why bytes do not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// At least this many more bytes are needed, and the value takes at least that many more:
    /// a reader may read exactly this many without reading past the value.
    Short(usize),
    /// The bytes are not a valid value: what is wrong, in words.
    Malformed(String),
}

impl DecodeError {
    /// A [`DecodeError::Malformed`] with this text.
    pub(crate) fn malformed(what: impl Into<String>) -> Self {
        DecodeError::Malformed(what.into())
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Short(n) => write!(f, "{n} more bytes needed"),
            DecodeError::Malformed(what) => f.write_str(what),
        }
    }
}

/// The result of a decode.
pub(crate) type Decoded<T> = Result<T, DecodeError>;

/// A value with one wire encoding.
pub(crate) trait Codec: Sized {
    /// Reads a value from `r`.
    fn decode(r: &mut Reader<'_>) -> Decoded<Self>;
    /// Appends the value's encoding to `out`.
    fn encode<B: BufMut>(&self, out: &mut B);
}

/// Writing [`Codec`] values into any [`BufMut`] (a `Vec<u8>`, or a `&mut [u8]` of a fixed
/// layout, which must have room: the layouts are fixed and tested).
pub(crate) trait BufMutExt: BufMut + Sized {
    /// Appends `v`'s encoding.
    fn write<T: Codec>(&mut self, v: T) {
        v.encode(self);
    }

    /// Appends `bytes` after their length as a `u16`; at most `u16::MAX` bytes are written
    /// (callers bound their lengths far below that).
    fn write_u16_prefixed(&mut self, bytes: &[u8]) {
        let n = u16::try_from(bytes.len()).unwrap_or(u16::MAX);
        self.put_u16_le(n);
        self.put_slice(&bytes[..usize::from(n)]);
    }

    /// Appends `bytes` after their length as a `u32` (at most `u32::MAX` bytes).
    fn write_u32_prefixed(&mut self, bytes: &[u8]) {
        let n = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        self.put_u32_le(n);
        self.put_slice(&bytes[..n as usize]);
    }

    /// Appends a count of items as a `u32` (at most `u32::MAX`: callers bound their counts far
    /// below that). [`Reader::count`] reads it back.
    fn write_count(&mut self, n: usize) {
        self.put_u32_le(u32::try_from(n).unwrap_or(u32::MAX));
    }

    /// Appends `words` after their count as a `u32` (at most `u32::MAX` of them).
    /// [`Reader::counted_words`] reads them back.
    fn write_words<I>(&mut self, words: I)
    where
        I: IntoIterator<Item = u64>,
        I::IntoIter: ExactSizeIterator,
    {
        let words = words.into_iter();
        let n = u32::try_from(words.len()).unwrap_or(u32::MAX);
        self.put_u32_le(n);
        words.take(n as usize).for_each(|w| self.put_u64_le(w));
    }
}

impl<B: BufMut> BufMutExt for B {}

/// Received bytes being decoded, front to back.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { rest: bytes }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// [`DecodeError::Short`] unless `n` bytes are left.
    pub(crate) fn require(&self, n: usize) -> Decoded<()> {
        match n.checked_sub(self.rest.len()) {
            Some(missing) if missing > 0 => Err(DecodeError::Short(missing)),
            _ => Ok(()),
        }
    }

    /// Reads a value.
    pub(crate) fn get<T: Codec>(&mut self) -> Decoded<T> {
        T::decode(self)
    }

    /// Reads `n` bytes.
    pub(crate) fn bytes(&mut self, n: usize) -> Decoded<&'a [u8]> {
        self.require(n)?;
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    /// Reads `N` bytes.
    pub(crate) fn array<const N: usize>(&mut self) -> Decoded<[u8; N]> {
        self.require(N)?;
        let Some((head, rest)) = self.rest.split_first_chunk::<N>() else {
            return Err(DecodeError::Short(N - self.rest.len()));
        };
        self.rest = rest;
        Ok(*head)
    }

    /// Reads everything that is left.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.rest)
    }

    /// Reads `n` reserved bytes, which must be zero.
    pub(crate) fn reserved(&mut self, n: usize, what: &str) -> Decoded<()> {
        if self.bytes(n)?.iter().any(|&b| b != 0) {
            return Err(DecodeError::malformed(format!("nonzero reserved bytes in {what}")));
        }
        Ok(())
    }

    /// Reads bytes after their length as a `u16`, refusing a length over `max`.
    pub(crate) fn u16_prefixed(&mut self, max: usize, what: &str) -> Decoded<&'a [u8]> {
        let n = usize::from(self.get::<u16>()?);
        if n > max {
            return Err(DecodeError::malformed(format!("{what} of {n} bytes (at most {max})")));
        }
        self.bytes(n)
    }

    /// Reads bytes after their length as a `u32`, refusing a length over `max`.
    pub(crate) fn u32_prefixed(&mut self, max: usize, what: &str) -> Decoded<&'a [u8]> {
        let n = self.get::<u32>()? as usize;
        if n > max {
            return Err(DecodeError::malformed(format!("{what} of {n} bytes (at most {max})")));
        }
        self.bytes(n)
    }

    /// Reads a count of items as a `u32`, for a message held whole: a count of items of at
    /// least `min` bytes each that cannot fit in what is left is malformed, so a forged count
    /// never sizes an allocation larger than the message. The count is read either way.
    pub(crate) fn count(&mut self, min: usize) -> Decoded<usize> {
        let n = self.get::<u32>()? as usize;
        if n.saturating_mul(min.max(1)) > self.rest.len() {
            return Err(DecodeError::malformed("a count larger than the message"));
        }
        Ok(n)
    }

    /// Reads `n` `u64` words. All their bytes must be there first ([`DecodeError::Short`]
    /// otherwise), so nothing is allocated for words that did not arrive.
    pub(crate) fn words(&mut self, n: usize) -> Decoded<Vec<u64>> {
        let len = n.checked_mul(8).ok_or_else(|| DecodeError::malformed("a count too large"))?;
        let (words, _) = self.bytes(len)?.as_chunks::<8>();
        Ok(words.iter().map(|&w| u64::from_le_bytes(w)).collect())
    }

    /// Reads `u64` words after their count as a `u32` ([`BufMutExt::write_words`]); a count
    /// larger than what is left is [`DecodeError::Short`], as the words may yet arrive.
    pub(crate) fn counted_words(&mut self) -> Decoded<Vec<u64>> {
        let n = self.get::<u32>()? as usize;
        self.words(n)
    }

    /// Succeeds when every byte was read.
    pub(crate) fn end(&self, what: &str) -> Decoded<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::malformed(format!("{} bytes after the end of {what}", self.rest.len())))
        }
    }
}

/// Decodes a whole value from `bytes`: nothing may be left over.
pub(crate) fn decode_all<T: Codec>(bytes: &[u8], what: &str) -> Decoded<T> {
    let mut r = Reader::new(bytes);
    let v = r.get()?;
    r.end(what)?;
    Ok(v)
}

/// A value's encoding in a fixed array of exactly its length: what the per-message headers
/// use, so that encoding them allocates nothing. (`N` is the type's encoded length, which its
/// round-trip tests check: a shorter encoding leaves zeros, a longer one is a bug that panics.)
pub(crate) fn to_array<const N: usize, T: Codec>(v: &T) -> [u8; N] {
    let mut b = [0u8; N];
    let mut out: &mut [u8] = &mut b;
    v.encode(&mut out);
    debug_assert!(out.is_empty(), "an encoding {} bytes short of its fixed length {N}", out.len());
    b
}

/// A value's encoding.
pub(crate) fn to_vec<T: Codec>(v: &T) -> Vec<u8> {
    let mut out = Vec::new();
    v.encode(&mut out);
    out
}

macro_rules! le_int {
    ($($t:ty => $put:ident),*) => {$(
        impl Codec for $t {
            fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
                Ok(<$t>::from_le_bytes(r.array()?))
            }
            fn encode<B: BufMut>(&self, out: &mut B) {
                out.$put(*self);
            }
        }
    )*};
}

le_int!(u16 => put_u16_le, u32 => put_u32_le, u64 => put_u64_le, i32 => put_i32_le, i64 => put_i64_le);

impl Codec for u8 {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        let [b] = r.array()?;
        Ok(b)
    }
    fn encode<B: BufMut>(&self, out: &mut B) {
        out.put_u8(*self);
    }
}

impl<const N: usize> Codec for [u8; N] {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        r.array()
    }
    fn encode<B: BufMut>(&self, out: &mut B) {
        out.put_slice(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn short_input_says_how_much_is_missing_and_never_reads_past_the_value() {
        let b = [1u8, 2, 3];
        let mut r = Reader::new(&b);
        assert_eq!(r.get::<u64>(), Err(DecodeError::Short(5)));
        assert_eq!(r.clone().rest().len(), 3, "a failed read consumes nothing");
        assert_eq!(r.get::<u16>(), Ok(0x0201));
        assert_eq!(r.get::<u16>(), Err(DecodeError::Short(1)));
        assert_eq!(r.get::<u8>(), Ok(3));
        assert_eq!(r.end("x"), Ok(()));
        assert_eq!(Reader::new(&[9; 4]).bytes(6), Err(DecodeError::Short(2)));
    }

    #[test]
    fn prefixed_bytes_are_bounded_before_anything_is_sized() {
        let mut out = Vec::new();
        out.write_u16_prefixed(b"abc");
        out.write_u32_prefixed(b"de");
        let mut r = Reader::new(&out);
        assert_eq!(r.u16_prefixed(3, "a name"), Ok(&b"abc"[..]));
        assert_eq!(r.u32_prefixed(8, "an address"), Ok(&b"de"[..]));
        assert_eq!(r.end("the blob"), Ok(()));
        // A length over the bound is malformed at once, before the bytes arrive.
        let huge = [0xff, 0xff, 0xff, 0x7f];
        assert!(
            matches!(Reader::new(&huge).u32_prefixed(1 << 20, "an address"), Err(DecodeError::Malformed(e)) if e.contains("an address"))
        );
        assert!(matches!(Reader::new(&out).u16_prefixed(2, "a name"), Err(DecodeError::Malformed(_))));
        // Short: the length first, then the bytes.
        assert_eq!(Reader::new(&out[..1]).u16_prefixed(3, "a name"), Err(DecodeError::Short(1)));
        assert_eq!(Reader::new(&out[..3]).u16_prefixed(3, "a name"), Err(DecodeError::Short(2)));
    }

    #[test]
    fn reserved_bytes_and_trailing_bytes_are_malformed() {
        assert!(Reader::new(&[0, 0]).reserved(2, "x").is_ok());
        assert!(
            matches!(Reader::new(&[0, 1]).reserved(2, "x"), Err(DecodeError::Malformed(e)) if e.contains("reserved"))
        );
        assert!(
            matches!(decode_all::<u16>(&[1, 2, 3], "a u16"), Err(DecodeError::Malformed(e)) if e.contains("after the end"))
        );
    }

    #[test]
    fn counts_are_checked_against_what_is_left_and_words_against_what_arrived() {
        let mut out = Vec::new();
        out.write_count(2);
        out.write_words([7u64, u64::MAX]);
        assert_eq!(out.len(), 4 + 4 + 16);
        let mut r = Reader::new(&out);
        assert_eq!(r.count(8), Ok(2), "2 items of 8 bytes fit in the 20 left");
        assert_eq!(r.counted_words(), Ok(vec![7, u64::MAX]));
        assert_eq!(r.remaining(), 0);
        // Items of 12 bytes do not fit: malformed, and the count is read.
        let mut r = Reader::new(&out);
        assert_eq!(r.count(12), Err(DecodeError::malformed("a count larger than the message")));
        assert_eq!(r.remaining(), 20);
        // A zero minimum counts items as one byte each.
        assert_eq!(Reader::new(&[1, 0, 0, 0]).count(0), Err(DecodeError::malformed("a count larger than the message")));
        // Words that did not all arrive are short by exactly the missing bytes, and nothing is
        // read; a count of 4 billion words allocates nothing.
        let mut r = Reader::new(&out[4..20]);
        assert_eq!(r.counted_words(), Err(DecodeError::Short(4)));
        assert_eq!(Reader::new(&[0xff; 12]).counted_words(), Err(DecodeError::Short(0xffff_ffff * 8 - 8)));
        assert_eq!(Reader::new(&[]).words(0), Ok(vec![]));
    }

    #[test]
    fn signed_integers_are_little_endian_twos_complement() {
        let mut out = Vec::new();
        out.write(-2i32);
        out.write(-3i64);
        out.write(i64::MIN);
        assert_eq!(
            out,
            [
                &[0xfe, 0xff, 0xff, 0xff][..],
                &[0xfd, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                &[0, 0, 0, 0, 0, 0, 0, 0x80]
            ]
            .concat()
        );
        let mut r = Reader::new(&out);
        assert_eq!((r.get::<i32>(), r.get::<i64>(), r.get::<i64>()), (Ok(-2), Ok(-3), Ok(i64::MIN)));
    }

    proptest! {
        #[test]
        fn counted_words_round_trip_and_any_cut_is_short_by_what_is_missing(
            words in proptest::collection::vec(any::<u64>(), 0..20),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut out = Vec::new();
            out.write_words(words.iter().copied());
            prop_assert_eq!(out.len(), 4 + 8 * words.len());
            let mut r = Reader::new(&out);
            prop_assert_eq!(r.counted_words(), Ok(words.clone()));
            prop_assert_eq!(r.end("the words"), Ok(()));
            let at = cut.index(out.len());
            let want = if at < 4 { 4 - at } else { out.len() - at };
            prop_assert_eq!(Reader::new(&out[..at]).counted_words(), Err(DecodeError::Short(want)));
            let mut r = Reader::new(&out);
            prop_assert_eq!(r.count(8), Ok(words.len()));
            prop_assert_eq!(r.words(words.len()), Ok(words));
        }

        #[test]
        fn a_count_is_accepted_exactly_when_its_items_fit(n in 0u32..64, min in 0usize..16, left in 0usize..128) {
            let mut out = Vec::new();
            out.write_count(n as usize);
            out.resize(4 + left, 0);
            let got = Reader::new(&out).count(min);
            if (n as usize) * min.max(1) <= left {
                prop_assert_eq!(got, Ok(n as usize));
            } else {
                prop_assert!(matches!(got, Err(DecodeError::Malformed(_))));
            }
        }

        #[test]
        fn integers_and_arrays_round_trip(a in any::<u8>(), b in any::<u16>(), c in any::<u32>(), d in any::<u64>(), e in any::<[u8; 16]>(), f in any::<i32>(), g in any::<i64>()) {
            let mut out = Vec::new();
            out.write(a);
            out.write(b);
            out.write(c);
            out.write(d);
            out.write(e);
            out.write(f);
            out.write(g);
            prop_assert_eq!(out.len(), 1 + 2 + 4 + 8 + 16 + 4 + 8);
            prop_assert_eq!(&out[15..31], &e[..]);
            prop_assert_eq!(&out[7..15], &d.to_le_bytes()[..]);
            prop_assert_eq!(&out[31..35], &f.to_le_bytes()[..]);
            let mut r = Reader::new(&out);
            prop_assert_eq!(r.get::<u8>(), Ok(a));
            prop_assert_eq!(r.get::<u16>(), Ok(b));
            prop_assert_eq!(r.get::<u32>(), Ok(c));
            prop_assert_eq!(r.get::<u64>(), Ok(d));
            prop_assert_eq!(r.get::<[u8; 16]>(), Ok(e));
            prop_assert_eq!(r.get::<i32>(), Ok(f));
            prop_assert_eq!(r.get::<i64>(), Ok(g));
            prop_assert_eq!(r.end("x"), Ok(()));
        }

        #[test]
        fn fixed_buffers_take_the_same_encoding(v in any::<u64>(), w in any::<u32>()) {
            let mut fixed = [0u8; 12];
            let mut out: &mut [u8] = &mut fixed;
            out.write(v);
            out.write(w);
            prop_assert_eq!(fixed.to_vec(), [to_vec(&v), to_vec(&w)].concat());
        }
    }
}
