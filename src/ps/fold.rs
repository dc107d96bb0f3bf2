//! Summing a push's values into a handler's slices as they arrive ([`Folder`]): the bytes come
//! in pieces of any length (a shared-memory fragment straight from the ring), which need not
//! end on a value's boundary nor start aligned for the value type.

use crate::types::{Element, Reduction};

/// Values handled per step when the bytes are not aligned for the value type (copied through a
/// buffer on the stack of this many values first).
const UNALIGNED_STEP: usize = 256;

/// Sums (or copies) a stream of values, in bytes, into one slice per key, key after key.
pub(super) struct Folder<'a, T> {
    dests: Vec<&'a mut [T]>,
    /// Values are copied into the slices instead of summed.
    copy: bool,
    /// The key whose values come next, and how many of them came already.
    key: usize,
    at: usize,
    /// The bytes of a value cut between two pieces.
    carry: [u8; 16],
    carried: usize,
    /// Values summed in so far.
    summed: usize,
}

impl<'a, T: Element> Folder<'a, T> {
    /// A folder into `dests`, one slice per key in the order their values come.
    pub(super) fn new(dests: Vec<&'a mut [T]>) -> Self {
        let mut f = Folder { dests, copy: false, key: 0, at: 0, carry: [0; 16], carried: 0, summed: 0 };
        f.skip_empty();
        f
    }

    /// A folder that copies the values into `dests` (an answer scattered into a caller's
    /// buffer) instead of summing them.
    pub(super) fn copying(dests: Vec<&'a mut [T]>) -> Self {
        Folder { copy: true, ..Self::new(dests) }
    }

    /// Values summed in so far.
    pub(super) fn summed(&self) -> usize {
        self.summed
    }

    /// Adds the next `bytes` of the stream; bytes past the last slice are ignored (the
    /// receive takes exactly the slices' length, so none come).
    pub(super) fn feed(&mut self, mut bytes: &[u8]) {
        let size = size_of::<T>();
        if size == 0 || size > self.carry.len() {
            return;
        }
        if self.carried > 0 {
            let take = (size - self.carried).min(bytes.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&bytes[..take]);
            self.carried += take;
            bytes = &bytes[take..];
            if self.carried < size {
                return;
            }
            self.carried = 0;
            let v: T = bytemuck::pod_read_unaligned(&self.carry[..size]);
            self.sum(std::slice::from_ref(&v));
        }
        let whole = bytes.len() / size * size;
        let (values, rest) = bytes.split_at(whole);
        match bytemuck::try_cast_slice::<u8, T>(values) {
            Ok(v) => self.sum(v),
            Err(_) => {
                let mut buf = [T::zeroed(); UNALIGNED_STEP];
                for chunk in values.chunks(UNALIGNED_STEP * size) {
                    let n = chunk.len() / size;
                    bytemuck::cast_slice_mut::<T, u8>(&mut buf[..n]).copy_from_slice(chunk);
                    self.sum(&buf[..n]);
                }
            }
        }
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carried = rest.len();
    }

    /// Sums `values` into the slices, from where the last values ended.
    fn sum(&mut self, mut values: &[T]) {
        while !values.is_empty() {
            let Some(dest) = self.dests.get_mut(self.key) else { return };
            let n = (dest.len() - self.at).min(values.len());
            if self.copy {
                dest[self.at..self.at + n].copy_from_slice(&values[..n]);
            } else {
                T::fold(Reduction::Sum, &mut dest[self.at..self.at + n], &values[..n]);
            }
            values = &values[n..];
            self.at += n;
            self.summed += n;
            if self.at == dest.len() {
                self.key += 1;
                self.at = 0;
                self.skip_empty();
            }
        }
    }

    /// Moves past keys with no values.
    fn skip_empty(&mut self) {
        while self.dests.get(self.key).is_some_and(|d| d.is_empty()) {
            self.key += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `values` (as bytes, starting `skew` bytes into a buffer so that they may be
    /// misaligned) in pieces cut at `cuts`, into slices of `lens` starting at `base`; returns
    /// the slices' contents.
    fn fold_in<T: Element>(base: &[T], lens: &[usize], values: &[T], cuts: &[usize], skew: usize) -> Vec<T> {
        let mut store = base.to_vec();
        let mut bytes = vec![0u8; skew];
        bytes.extend_from_slice(bytemuck::cast_slice(values));
        let stream = &bytes[skew..];
        {
            let mut dests = Vec::new();
            let mut rest = &mut store[..];
            for &l in lens {
                let (d, r) = rest.split_at_mut(l);
                dests.push(d);
                rest = r;
            }
            let mut f = Folder::new(dests);
            let mut at = 0;
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
            cuts.sort_unstable();
            for c in cuts.into_iter().chain([stream.len()]) {
                f.feed(&stream[at..c.max(at)]);
                at = c.max(at);
            }
            assert_eq!(f.summed(), values.len());
        }
        store
    }

    fn check<T: Element + std::ops::Add<Output = T> + PartialEq + std::fmt::Debug>(
        lens: &[usize],
        seed: u64,
        cuts: &[usize],
        skew: usize,
        of: impl Fn(u64) -> T,
    ) {
        let n: usize = lens.iter().sum();
        let base: Vec<T> = (0..n as u64).map(|i| of(i * 3 + seed)).collect();
        let values: Vec<T> = (0..n as u64).map(|i| of(i * 7 + seed + 1)).collect();
        let want: Vec<T> = base.iter().zip(&values).map(|(&a, &b)| a + b).collect();
        assert_eq!(fold_in(&base, lens, &values, cuts, skew), want, "lens {lens:?}, cuts {cuts:?}, skew {skew}");
    }

    proptest! {
        /// Whatever the pieces (cut inside values, misaligned, empty), every value is added to
        /// its key's place once: the sequential sum, for values of 2, 4 and 8 bytes.
        #[test]
        fn pieces_of_any_length_sum_like_the_whole(
            lens in proptest::collection::vec(0usize..300, 0..6),
            cuts in proptest::collection::vec(0usize..10_000, 0..8),
            skew in 0usize..8,
            seed in 0u64..1000,
        ) {
            check::<f32>(&lens, seed, &cuts, skew, |i| (i % 1000) as f32);
            check::<f64>(&lens, seed, &cuts, skew, |i| (i % 1000) as f64 * 0.5);
            check::<i64>(&lens, seed, &cuts, skew, |i| i as i64 - 500);
            check::<u16>(&lens, seed, &cuts, skew, |i| (i % 100) as u16);
        }
    }

    #[test]
    fn a_copying_folder_scatters_values_over_its_slices() {
        let mut buf = [9u16; 7];
        let (a, rest) = buf.split_at_mut(2);
        let (_, b) = rest.split_at_mut(2);
        let mut f = Folder::copying(vec![a, b]);
        let values: [u16; 5] = [1, 2, 3, 4, 5];
        let bytes: &[u8] = bytemuck::cast_slice(&values);
        f.feed(&bytes[..3]);
        f.feed(&bytes[3..]);
        assert_eq!(f.summed(), 5);
        drop(f);
        assert_eq!(buf, [1, 2, 9, 9, 3, 4, 5]);
    }

    #[test]
    fn more_values_than_the_slices_hold_are_ignored() {
        let mut store = [1i32, 2];
        let mut f = Folder::new(vec![&mut store[..]]);
        f.feed(bytemuck::cast_slice(&[10i32, 20, 30]));
        assert_eq!(f.summed(), 2);
        drop(f);
        assert_eq!(store, [11, 22]);
    }
}
