//! Collective algorithms, written once against the transport contract (through a
//! communicator's [`Scope`]) so they run unchanged on every backend. Nothing here knows a
//! backend or the [`Context`](crate::Context): a collective is a communicator, a key, a
//! descriptor and a deadline.

pub(crate) mod allgather;
pub(crate) mod allreduce;
pub(crate) mod barrier;
pub(crate) mod broadcast;
pub(crate) mod calibrate;
pub(crate) mod local;
pub(crate) mod personalized;
pub(crate) mod reduce;
pub(crate) mod steps;

pub use crate::types::Algorithm;

use crate::comm::{Comm, Lent, Scope, fnv_of};
use crate::error::{Error, Result};
use crate::transport::Key;
use crate::types::{Element, OpDesc};
use bytemuck::Pod;
use smallvec::SmallVec;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut, Range};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Per-call options of a collective. `Default` gives tag 0, the context's timeout, `Auto`
/// and the default segment size.
#[derive(Debug, Clone, Default)]
pub struct CollectiveOptions {
    /// Collectives with different tags may run at the same time (from different threads);
    /// every rank must call the collectives of one tag in the same order. Below 2^30.
    pub tag: u32,
    /// Deadline of the whole call (default: the context's timeout).
    pub timeout: Option<Duration>,
    /// The algorithm (default: `Auto`).
    pub algorithm: Algorithm,
    /// Pipeline segment size in bytes for the pipelined algorithms (default 1 MiB).
    pub segment_bytes: Option<usize>,
}

impl CollectiveOptions {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }
    /// Sets the tag.
    pub fn tag(mut self, tag: u32) -> Self {
        self.tag = tag;
        self
    }
    /// Sets the deadline of the call.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    /// Sets the algorithm.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }
    /// Sets the pipeline segment size in bytes.
    pub fn segment_bytes(mut self, bytes: usize) -> Self {
        self.segment_bytes = Some(bytes);
        self
    }

    /// Segment length in elements of `T`.
    pub(crate) fn segment_elems<T>(&self) -> usize {
        let bytes = self.segment_bytes.unwrap_or(DEFAULT_SEGMENT);
        (bytes / std::mem::size_of::<T>().max(1)).max(1)
    }
}

/// Default pipeline segment: small enough to stay in cache while it is reduced, large enough
/// to amortise per-message costs. Measured with `ferrogloo-bench --segment-bytes` (ring
/// allreduce, f32, 2-core machine): 1 MiB beats 256 KiB by 25% at 16 MiB with 2 ranks
/// (0.93 vs 0.74 GB/s busbw) and by 10-20% at 8-64 MiB with 4 ranks; 64 KiB and 4 MiB are
/// slower than both.
pub(crate) const DEFAULT_SEGMENT: usize = 1 << 20;

/// One collective call in progress: its communicator, key, descriptor and deadline. Its
/// messages go in [`phase`](Coll::phase)s.
pub(crate) struct Coll<'a> {
    comm: &'a Comm,
    key: Key,
    desc: OpDesc,
    deadline: Instant,
    what: &'static str,
}

/// Runs `body` as one collective `desc` on `comm`: takes the next sequence number of
/// `opts.tag` and one deadline for the whole call. A failure aborts the communicator (the
/// ranks' collective state no longer agrees) and tells every peer its cause; the phase that
/// failed has withdrawn every operation it left.
pub(crate) fn run<R>(
    comm: &Comm,
    what: &'static str,
    desc: OpDesc,
    opts: &CollectiveOptions,
    body: impl FnOnce(&Coll<'_>) -> Result<R>,
) -> Result<R> {
    comm.check_usable()?;
    let key = comm.next_collective_key(opts.tag)?;
    let deadline = Instant::now() + opts.timeout.unwrap_or(comm.timeout());
    let result = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        body(&Coll { comm, key, desc, deadline, what })
    })) {
        Ok(r) => r,
        Err(panic) => {
            // A panic (a custom fold's) left the call half done: the ranks' collective state no
            // longer agrees, as after an error. The scope already withdrew its operations.
            let rank = comm.world_rank(comm.rank()).unwrap_or(comm.rank());
            comm.fail(&Error::Aborted { rank, reason: format!("{what} on rank {rank} panicked") });
            std::panic::resume_unwind(panic)
        }
    };
    if let Err(e) = &result {
        comm.fail(e);
    }
    result
}

impl<'a> Coll<'a> {
    /// This rank in the communicator.
    pub(crate) fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.comm.size()
    }

    /// `len` elements of scratch from the context's pool, back to it when dropped. Contents
    /// are arbitrary (any bit pattern is a valid `T`).
    pub(crate) fn scratch<T: Element>(&self, len: usize) -> Scratch<'a, T> {
        Scratch::take(self.comm.scratch_pool(), len)
    }

    /// Runs `f` as one phase of the call: a [`Scope`] whose sends and receives borrow buffers
    /// until it ends. It ends when `f` returns: waiting for what `f` left in flight, or
    /// withdrawing it if `f` failed. A part of a buffer sent or received in one phase may be
    /// written again in the next.
    pub(crate) fn phase<'c, R>(&'c self, f: impl for<'scope> FnOnce(&Phase<'scope, 'c>) -> Result<R>) -> Result<R> {
        let comm: &'c Comm = self.comm;
        comm.scope(|s| f(&Phase { s, c: self }))
    }
}

/// One phase of a collective call (see [`Coll::phase`]): messages with the call's key and
/// descriptor, buffers borrowed for the phase's scope, waits until the call's deadline.
pub(crate) struct Phase<'scope, 'env: 'scope> {
    s: &'scope Scope<'scope, 'env>,
    c: &'env Coll<'env>,
}

/// A send started in a [`Phase`], to wait for.
#[must_use = "a send is waited for before the phase's result is known"]
pub(crate) struct Sent(usize);

/// The sends of a phase, to wait for at its end: those of a call on a few ranks inline.
pub(crate) type Sends = SmallVec<[Sent; 8]>;

/// The receives of a phase posted up front, to wait for in order: those of a call on a few
/// ranks inline.
pub(crate) type Receives<'scope, 'env, T> = SmallVec<[Lent<'scope, 'env, T>; 8]>;

impl<'scope, 'env> Phase<'scope, 'env> {
    /// Starts sending `buf` to `peer`. `buf` stays borrowed (readable, not writable) for the
    /// rest of the phase.
    pub(crate) fn send<T: Pod>(&self, peer: usize, buf: &'scope [T]) -> Result<Sent> {
        let c = self.c;
        self.s.send_borrowed(peer, c.key, c.desc, buf, c.what).map(Sent)
    }

    /// Starts receiving a message of `buf.len()` elements from `peer` into `buf`.
    pub(crate) fn recv<T: Pod>(&self, peer: usize, buf: &'scope mut [T]) -> Result<Lent<'scope, 'env, T>> {
        let len = buf.len();
        self.recv_front(peer, buf, len)
    }

    /// Starts receiving a message of `len` elements from `peer` into the front of `buf`;
    /// [`filled`](Self::filled) gives all of `buf` back.
    pub(crate) fn recv_front<T: Pod>(
        &self,
        peer: usize,
        buf: &'scope mut [T],
        len: usize,
    ) -> Result<Lent<'scope, 'env, T>> {
        let c = self.c;
        self.s.recv_borrowed(peer, c.key, c.desc, buf, len, c.what)
    }

    /// Waits for a send until the call's deadline.
    pub(crate) fn wait(&self, sent: Sent) -> Result<()> {
        self.s.wait_deadline(sent.0, self.c.deadline).map(drop)
    }

    /// Waits for several sends, in order.
    pub(crate) fn wait_all(&self, sent: impl IntoIterator<Item = Sent>) -> Result<()> {
        sent.into_iter().try_for_each(|s| self.wait(s))
    }

    /// Waits for a receive until the call's deadline; gives its buffer back, filled.
    pub(crate) fn filled<T>(&self, recv: Lent<'scope, 'env, T>) -> Result<&'scope mut [T]> {
        recv.wait_until(self.c.deadline)
    }
}

/// Most scratch buffers a context keeps for reuse.
const POOL_KEEP: usize = 8;

/// Scratch memory of a collective call, from the context's pool and back to it when dropped,
/// so that repeated calls do not allocate. It is a value of the algorithm that uses it, so the
/// borrow checker sees that it outlives every phase it is lent to.
pub(crate) struct Scratch<'p, T> {
    pool: &'p Mutex<Vec<Vec<u64>>>,
    buf: Vec<u64>,
    len: usize,
    _t: PhantomData<T>,
}

impl<'p, T: Element> Scratch<'p, T> {
    fn take(pool: &'p Mutex<Vec<Vec<u64>>>, len: usize) -> Self {
        // Any element type is a whole number of bytes dividing a word, aligned within one.
        const { assert!(std::mem::align_of::<T>() <= 8 && 8 % std::mem::size_of::<T>() == 0) };
        let words = (len * std::mem::size_of::<T>()).div_ceil(8);
        let mut buf = {
            let mut pool = crate::sync::lock(pool);
            // Best fit: the shortest buffer long enough, so that a small call (a scalar
            // allreduce between gradient ones) does not take the buffer the next large call
            // needs. When none is, the longest is replaced.
            let fit = pool.iter().enumerate().filter(|(_, b)| b.len() >= words).min_by_key(|(_, b)| b.len());
            let longest = || pool.iter().enumerate().max_by_key(|(_, b)| b.len());
            match fit.or_else(longest).map(|(i, _)| i) {
                Some(i) => pool.swap_remove(i),
                None => Vec::new(),
            }
        };
        // A buffer keeps its whole length, so it is zeroed once, when it is allocated (by
        // the allocator: fresh pages for a large one), never again on reuse.
        if buf.len() < words {
            buf = vec![0u64; words];
        }
        Scratch { pool, buf, len, _t: PhantomData }
    }
}

impl<T: Pod> Deref for Scratch<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &bytemuck::cast_slice(&self.buf)[..self.len]
    }
}

impl<T: Pod> DerefMut for Scratch<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut bytemuck::cast_slice_mut(&mut self.buf)[..self.len]
    }
}

impl<T> Drop for Scratch<'_, T> {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut pool = crate::sync::lock(self.pool);
        if pool.len() < POOL_KEEP {
            pool.push(buf);
        }
    }
}

/// Hands out runs of a buffer in the order of their place in it, each lent on its own (one sent
/// while another is received into or reduced). Runs must be disjoint and come in ascending
/// order (an empty run may lie anywhere between); a violation is a bug in the algorithm, never
/// input-driven, and panics.
pub(crate) struct Upward<'b, T> {
    rest: &'b mut [T],
    /// Where `rest` starts in the buffer.
    at: usize,
}

impl<'b, T> Upward<'b, T> {
    /// Runs of `buf`, indexed from its start.
    pub(crate) fn new(buf: &'b mut [T]) -> Self {
        Upward { rest: buf, at: 0 }
    }

    /// The run `r`: after every run handed out before, inside the buffer.
    pub(crate) fn cut(&mut self, r: Range<usize>) -> &'b mut [T] {
        assert!(
            self.at <= r.start && r.start <= r.end && r.end - self.at <= self.rest.len(),
            "run {r:?} overlaps an earlier run, comes before it, is reversed or lies outside the buffer"
        );
        let (_, tail) = std::mem::take(&mut self.rest).split_at_mut(r.start - self.at);
        let (piece, tail) = tail.split_at_mut(r.len());
        (self.rest, self.at) = (tail, r.end);
        piece
    }
}

/// Hands out the blocks of a buffer around one of them, the hole, in the order a ring receives
/// them (block `hole - 1 - k mod n` in step k): down from the block below the hole to the first,
/// then down from the last to the block above the hole. Blocks are named by index, with their
/// runs; blocks of lower index lie lower in the buffer, disjoint (those of [`partition`] and
/// [`blocks_of`]). A block out of that order, or overlapping one handed out before, is a bug in
/// the algorithm, never input-driven, and panics.
pub(crate) struct Around<'b, T> {
    /// What is left below the hole.
    below: &'b mut [T],
    /// What is left above the hole, from `above_at` in the buffer.
    above: &'b mut [T],
    above_at: usize,
    hole: usize,
}

impl<'b, T> Around<'b, T> {
    /// The blocks of `buf` around block `hole`, whose run `at` is returned too.
    pub(crate) fn new(buf: &'b mut [T], hole: usize, at: Range<usize>) -> (Self, &'b mut [T]) {
        let (below, rest) = buf.split_at_mut(at.start);
        let (mid, above) = rest.split_at_mut(at.len());
        (Around { below, above, above_at: at.end, hole }, mid)
    }

    /// Block `b`, the run `r` of the buffer: each block handed out lies below the ones before it
    /// on its side of the hole.
    pub(crate) fn take(&mut self, b: usize, r: Range<usize>) -> &'b mut [T] {
        let (part, at) = if b < self.hole { (&mut self.below, 0) } else { (&mut self.above, self.above_at) };
        assert!(
            b != self.hole && at <= r.start && r.start <= r.end && r.end - at <= part.len(),
            "block {b} at {r:?} is the hole ({}), overlaps a block handed out before, is reversed or lies \
             outside the buffer",
            self.hole
        );
        let (rest, tail) = std::mem::take(part).split_at_mut(r.start - at);
        *part = rest;
        tail.split_at_mut(r.len()).0
    }
}

/// Two disjoint runs `a` and `b` of `buf`, each lent on its own, in the order asked (an empty
/// run may lie anywhere outside the other). Overlapping runs are a bug in the algorithm, never
/// input-driven, and panic.
pub(crate) fn carve2<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&mut [T], &mut [T]) {
    // An empty run at the start of the other goes first.
    let swap = (b.start, b.end) < (a.start, a.end);
    let (lo, hi) = if swap { (b, a) } else { (a, b) };
    assert!(lo.start <= lo.end && lo.end <= hi.start && hi.start <= hi.end, "runs {lo:?} and {hi:?} overlap");
    let (head, tail) = buf.split_at_mut(hi.start);
    let (lo, hi) = (&mut head[lo], &mut tail[..hi.end - hi.start]);
    if swap { (hi, lo) } else { (lo, hi) }
}

/// Splits `count` elements into `n` contiguous blocks whose sizes differ by at most one.
pub(crate) fn partition(count: usize, n: usize) -> Vec<Range<usize>> {
    (0..n).map(|i| block_of(count, n, i)).collect()
}

/// Block `i` of [`partition`]`(count, n)`, computed on its own.
pub(crate) fn block_of(count: usize, n: usize, i: usize) -> Range<usize> {
    let (q, r) = (count / n, count % n);
    (i * q + i.min(r))..((i + 1) * q + (i + 1).min(r))
}

/// Blocks from per-rank counts.
pub(crate) fn blocks_of(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect()
}

/// The segments of a block for pipelining: at least one (possibly empty) segment.
pub(crate) fn segments(block: Range<usize>, seg: usize) -> impl Iterator<Item = Range<usize>> + Clone {
    let n = block.len().div_ceil(seg).max(1);
    (0..n).map(move |j| (block.start + j * seg).min(block.end)..(block.start + (j + 1) * seg).min(block.end))
}

/// The [`segments`] of `block` with their runs of `run`, which holds the block.
pub(crate) fn segment_runs<T>(
    run: &mut [T],
    block: Range<usize>,
    seg: usize,
) -> impl Iterator<Item = (Range<usize>, &mut [T])> {
    let start = block.start;
    let mut runs = Upward::new(run);
    segments(block, seg).map(move |s| {
        let piece = runs.cut(s.start - start..s.end - start);
        (s, piece)
    })
}

/// Checks that `counts` has one entry per rank, and returns their sum.
pub(crate) fn check_counts(counts: &[usize], n: usize, what: &str) -> Result<usize> {
    if counts.len() != n {
        return Err(Error::invalid(format!("{what}: {} counts given for {n} ranks", counts.len())));
    }
    counts
        .iter()
        .try_fold(0usize, |a, &c| a.checked_add(c))
        .ok_or_else(|| Error::invalid(format!("{what}: counts overflow")))
}

/// A hash of per-rank counts, for [`OpDesc::extra`].
pub(crate) fn counts_hash(counts: &[usize]) -> u64 {
    fnv_of(counts.iter().map(|&c| c as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn scratch_goes_to_the_call_it_fits_best_and_keeps_its_contents() {
        let pool = Mutex::default();
        let (big, small) = {
            let mut big = Scratch::<u32>::take(&pool, 1 << 20);
            let small = Scratch::<u32>::take(&pool, 16);
            big.fill(7);
            (big.as_ptr(), small.as_ptr())
        };
        // A small call between two large ones takes the small buffer, in either order.
        for _ in 0..2 {
            let a = Scratch::<u32>::take(&pool, 1);
            assert_eq!(a.as_ptr(), small);
            let b = Scratch::<u32>::take(&pool, 1 << 20);
            assert_eq!(b.as_ptr(), big);
            assert!(b.iter().all(|&x| x == 7), "reused scratch was cleared");
        }
        // With one buffer, a small call takes it and the large one after it finds it whole.
        pool.lock().unwrap().retain(|b| b.len() > 16);
        drop(Scratch::<u32>::take(&pool, 1));
        let b = Scratch::<u32>::take(&pool, 1 << 20);
        assert_eq!(b.as_ptr(), big);
        assert_eq!(b.len(), 1 << 20);
        assert!(b.iter().all(|&x| x == 7), "reused scratch was cleared");
    }

    #[test]
    fn scratch_of_every_element_size_has_its_length_and_alignment() {
        let pool = Mutex::default();
        for len in [0usize, 1, 3, 7, 8, 9, 1000] {
            let mut a = Scratch::<u8>::take(&pool, len);
            let mut b = Scratch::<half::f16>::take(&pool, len);
            let mut c = Scratch::<f64>::take(&pool, len);
            assert_eq!((a.len(), b.len(), c.len()), (len, len, len));
            assert!(c.as_ptr().is_aligned());
            a.fill(1);
            b.fill(half::f16::ONE);
            c.fill(2.0);
            assert!(a.iter().all(|&x| x == 1) && c.iter().all(|&x| x == 2.0));
        }
        assert!(pool.lock().unwrap().len() <= POOL_KEEP);
    }

    #[test]
    fn upward_hands_out_each_run_in_order_empty_ones_anywhere_between() {
        let mut v: Vec<u32> = (0..10).collect();
        let runs = [0..0, 0..2, 2..2, 2..6, 6..6, 6..9, 9..10, 10..10];
        let mut up = Upward::new(&mut v);
        let got: Vec<Vec<u32>> = runs.iter().map(|r| up.cut(r.clone()).to_vec()).collect();
        let want: Vec<Vec<u32>> = runs.iter().map(|r| (r.start as u32..r.end as u32).collect()).collect();
        assert_eq!(got, want);
        // Gaps are skipped; the pieces are the buffer's own memory.
        let mut up = Upward::new(&mut v);
        let (a, b) = (up.cut(1..3), up.cut(4..5));
        a.fill(10);
        b[0] = 40;
        assert_eq!(v, [0, 10, 10, 3, 40, 5, 6, 7, 8, 9]);
    }

    #[test]
    fn around_hands_out_every_block_but_the_hole_in_ring_order() {
        // Blocks as the ring has them, empty ones included (fewer elements than blocks).
        for (count, n) in [(10usize, 4usize), (3, 5), (0, 3), (7, 1), (1, 2)] {
            let blocks = partition(count, n);
            for hole in 0..n {
                let mut v: Vec<usize> = (0..count).collect();
                let (mut around, mid) = Around::new(&mut v, hole, blocks[hole].clone());
                assert_eq!(mid, &(blocks[hole].clone()).collect::<Vec<_>>()[..]);
                mid.fill(usize::MAX);
                for k in 0..n - 1 {
                    let b = (hole + n - 1 - k) % n;
                    let run = around.take(b, blocks[b].clone());
                    assert_eq!(run, &(blocks[b].clone()).collect::<Vec<_>>()[..], "{count} in {n}, hole {hole}");
                    run.fill(usize::MAX);
                }
                assert!(v.iter().all(|&x| x == usize::MAX), "{count} in {n}, hole {hole}: a block was left out");
            }
        }
    }

    #[test]
    fn carve2_hands_out_two_runs_in_the_order_asked_empty_ones_anywhere_between() {
        let mut v: Vec<u32> = (0..8).collect();
        for (a, b) in [(0..3, 3..8), (3..8, 0..3), (3..3, 3..8), (3..8, 3..3), (5..5, 5..5), (8..8, 0..8), (2..4, 6..7)]
        {
            let (x, y) = carve2(&mut v, a.clone(), b.clone());
            assert_eq!((x.len(), y.len()), (a.len(), b.len()));
            assert_eq!(x.first().map(|&e| e as usize), (!a.is_empty()).then_some(a.start));
            assert_eq!(y.first().map(|&e| e as usize), (!b.is_empty()).then_some(b.start));
        }
    }

    #[test]
    #[should_panic(expected = "overlap")]
    fn carve2_refuses_overlapping_runs() {
        let mut v = [0u8; 8];
        carve2(&mut v, 2..5, 0..3);
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn upward_refuses_a_run_below_an_earlier_one() {
        let mut v = [0u8; 8];
        let mut up = Upward::new(&mut v);
        up.cut(0..4);
        up.cut(3..5);
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn upward_refuses_a_run_past_the_end() {
        let mut v = [0u8; 8];
        Upward::new(&mut v).cut(6..9);
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn around_refuses_blocks_out_of_ring_order() {
        let blocks = partition(12, 4);
        let mut v = [0u8; 12];
        let (mut around, _) = Around::new(&mut v, 3, blocks[3].clone());
        around.take(1, blocks[1].clone());
        around.take(2, blocks[2].clone());
    }

    #[test]
    #[should_panic(expected = "hole")]
    fn around_refuses_the_hole() {
        let blocks = partition(12, 4);
        let mut v = [0u8; 12];
        let (mut around, _) = Around::new(&mut v, 2, blocks[2].clone());
        around.take(2, blocks[2].clone());
    }

    proptest! {
        #[test]
        fn the_pipeline_segments_of_the_blocks_around_a_hole_cover_the_buffer_once(
            counts in proptest::collection::vec(0usize..40, 1..9), seg in 1usize..16, hole in 0usize..8,
        ) {
            let n = counts.len();
            let hole = hole % n;
            let blocks = blocks_of(&counts);
            let total: usize = counts.iter().sum();
            let mut v = vec![0usize; total];
            let mut runs = Vec::new();
            let (mut around, mid) = Around::new(&mut v, hole, blocks[hole].clone());
            let mut pieces: Vec<(Range<usize>, &mut [usize])> = segment_runs(mid, blocks[hole].clone(), seg).collect();
            for k in 0..n - 1 {
                let b = (hole + n - 1 - k) % n;
                pieces.extend(segment_runs(around.take(b, blocks[b].clone()), blocks[b].clone(), seg));
            }
            for (i, (r, piece)) in pieces.into_iter().enumerate() {
                prop_assert_eq!(piece.len(), r.len());
                prop_assert!(piece.len() <= seg);
                piece.iter_mut().for_each(|x| *x += i + 1);
                runs.push(r);
            }
            // One (possibly empty) segment at least per block, each where its range says, and
            // every element in exactly one.
            prop_assert!(runs.len() >= n);
            for (i, r) in runs.iter().enumerate() {
                prop_assert!(v[r.clone()].iter().all(|&x| x == i + 1));
            }
            prop_assert!(v.iter().all(|&x| x > 0));
        }
    }
}
