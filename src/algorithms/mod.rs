//! Collective algorithms, written once against the transport contract (through a
//! communicator's [`Scope`]) so they run unchanged on every backend. Nothing here knows a
//! backend or the [`Context`](crate::Context): a collective is a communicator, a key, a
//! descriptor and a deadline.

pub(crate) mod allgather;
pub(crate) mod allreduce;
pub(crate) mod barrier;
pub(crate) mod broadcast;
pub(crate) mod local;
pub(crate) mod personalized;
pub(crate) mod reduce;
pub(crate) mod steps;

pub use crate::types::Algorithm;

use crate::comm::{Comm, Scope, fnv};
use crate::error::{Error, Result};
use crate::transport::{Key, MemKind, RecvBuf, RecvTarget, SendBuf};
use crate::types::{Element, OpDesc};
use std::cell::RefCell;
use std::ops::Range;
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

/// One collective call in progress: its scope, key, descriptor, deadline and scratch.
pub(crate) struct Coll<'scope, 'env> {
    pub(crate) s: &'scope Scope<'scope, 'env>,
    key: Key,
    desc: OpDesc,
    deadline: Instant,
    what: &'static str,
    arena: &'scope Arena<'env>,
}

/// Most scratch buffers a context keeps for reuse.
const POOL_KEEP: usize = 8;

/// Scratch memory of one collective call. It is created before the call's scope and dropped
/// after it, so it outlives every operation the scope finishes or cancels: an algorithm that
/// returns early with an error cannot leave a receive writing into freed scratch. Its buffers
/// come from, and go back to, the context's pool, so repeated calls do not allocate.
pub(crate) struct Arena<'p> {
    pool: &'p Mutex<Vec<Vec<u64>>>,
    bufs: RefCell<Vec<Vec<u64>>>,
}

impl<'p> Arena<'p> {
    pub(crate) fn new(pool: &'p Mutex<Vec<Vec<u64>>>) -> Self {
        Arena { pool, bufs: RefCell::default() }
    }

    /// `len` elements of scratch, valid until the arena is dropped. Contents are arbitrary
    /// (any bit pattern is a valid `T`).
    fn seg<T: Element>(&self, len: usize) -> Seg<T> {
        const { assert!(std::mem::align_of::<T>() <= std::mem::align_of::<u64>()) };
        let words = (len * std::mem::size_of::<T>()).div_ceil(8);
        let mut v = {
            let mut pool = crate::sync::lock(self.pool);
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
        if v.len() < words {
            v = vec![0u64; words];
        }
        // The heap buffer does not move when the Vec is moved into `bufs`.
        let seg = Seg { ptr: v.as_mut_ptr().cast::<T>(), len };
        self.bufs.borrow_mut().push(v);
        seg
    }
}

impl Drop for Arena<'_> {
    fn drop(&mut self) {
        let mut pool = crate::sync::lock(self.pool);
        for b in self.bufs.get_mut().drain(..) {
            if pool.len() < POOL_KEEP {
                pool.push(b);
            }
        }
    }
}

/// Runs `body` as one collective `desc` on `comm`: takes the next sequence number of
/// `opts.tag`, one deadline for the whole call, and a scope that withdraws every operation left
/// if `body` fails. A failure aborts the communicator (the ranks' collective state no longer
/// agrees) and tells every peer its cause.
pub(crate) fn run<R>(
    comm: &Comm,
    what: &'static str,
    desc: OpDesc,
    opts: &CollectiveOptions,
    body: impl for<'scope, 'env> FnOnce(&Coll<'scope, 'env>) -> Result<R>,
) -> Result<R> {
    comm.check_usable()?;
    let key = comm.next_collective_key(opts.tag)?;
    let deadline = Instant::now() + opts.timeout.unwrap_or(comm.timeout());
    // Declared before the scope, so dropped after it (see `Arena`).
    let arena = Arena::new(comm.scratch_pool());
    let result = comm.scope(|s| body(&Coll { s, key, desc, deadline, what, arena: &arena }));
    if let Err(e) = &result {
        comm.fail(e);
    }
    result
}

impl<'scope, 'env> Coll<'scope, 'env> {
    /// This rank in the communicator.
    pub(crate) fn rank(&self) -> usize {
        self.s.comm().rank()
    }

    /// The number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.s.comm().size()
    }

    /// Scratch for this call: valid until the call's scope has finished every operation.
    pub(crate) fn scratch<T: Element>(&self, len: usize) -> Seg<T> {
        self.arena.seg(len)
    }

    /// Starts sending `buf` to `peer`.
    ///
    /// # Safety
    /// `buf`'s memory must stay valid and unwritten until the send is waited for or the
    /// collective's scope ends.
    pub(crate) unsafe fn send<T>(&self, peer: usize, buf: Seg<T>) -> Result<usize> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.s.isend_raw(peer, self.key, self.desc, buf.send_buf(), self.what) }
    }

    /// Starts receiving into `buf` from `peer`.
    ///
    /// # Safety
    /// `buf`'s memory must stay valid and untouched until the receive is waited for or the
    /// collective's scope ends.
    pub(crate) unsafe fn recv<T>(&self, peer: usize, buf: Seg<T>) -> Result<usize> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.s.irecv_raw(&[peer], self.key, self.desc, RecvTarget::Exact(buf.recv_buf()), self.what) }
    }

    /// Waits for an operation until the collective's deadline.
    pub(crate) fn wait(&self, idx: usize) -> Result<()> {
        self.s.wait_deadline(idx, self.deadline).map(drop)
    }

    /// Waits for several operations.
    pub(crate) fn wait_all(&self, idxs: impl IntoIterator<Item = usize>) -> Result<()> {
        idxs.into_iter().try_for_each(|i| self.wait(i))
    }
}

/// A raw view of a run of elements, for algorithms that send some parts of a buffer while they
/// reduce into others. Every access states why no pending operation overlaps it.
pub(crate) struct Seg<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> Clone for Seg<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Seg<T> {}

impl<T> Seg<T> {
    pub(crate) fn new(s: &mut [T]) -> Self {
        Seg { ptr: s.as_mut_ptr(), len: s.len() }
    }

    /// A view of memory that will only be sent, never written.
    pub(crate) fn of(s: &[T]) -> Self {
        Seg { ptr: s.as_ptr() as *mut T, len: s.len() }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `other` is the same run of memory.
    pub(crate) fn is(&self, other: Seg<T>) -> bool {
        self.ptr == other.ptr && self.len == other.len
    }

    /// The sub-run `r`; panics (a bug in the algorithm, never input-driven) if out of range.
    pub(crate) fn sub(&self, r: Range<usize>) -> Self {
        assert!(r.start <= r.end && r.end <= self.len, "segment {r:?} outside 0..{}", self.len);
        // SAFETY: in bounds (checked above), so the offset stays inside the same allocation.
        Seg { ptr: unsafe { self.ptr.add(r.start) }, len: r.end - r.start }
    }

    /// # Safety
    /// No pending receive may write this memory while the slice lives.
    pub(crate) unsafe fn get<'a>(&self) -> &'a [T] {
        // SAFETY: the pointer and length come from a live slice (see `new`/`sub`); the caller
        // guarantees no concurrent writer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// No pending operation may touch this memory while the slice lives.
    pub(crate) unsafe fn get_mut<'a>(&self) -> &'a mut [T] {
        // SAFETY: as in `get`, and the caller guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn send_buf(&self) -> SendBuf {
        SendBuf { ptr: self.ptr as *const u8, len: self.len * std::mem::size_of::<T>(), mem: MemKind::Host }
    }

    fn recv_buf(&self) -> RecvBuf {
        RecvBuf { ptr: self.ptr as *mut u8, len: self.len * std::mem::size_of::<T>(), mem: MemKind::Host }
    }
}

/// Splits `count` elements into `n` contiguous blocks whose sizes differ by at most one.
pub(crate) fn partition(count: usize, n: usize) -> Vec<Range<usize>> {
    let (q, r) = (count / n, count % n);
    (0..n).map(|i| (i * q + i.min(r))..((i + 1) * q + (i + 1).min(r))).collect()
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
pub(crate) fn segments(block: &Range<usize>, seg: usize) -> impl Iterator<Item = Range<usize>> + '_ {
    let n = block.len().div_ceil(seg).max(1);
    (0..n).map(move |j| (block.start + j * seg).min(block.end)..(block.start + (j + 1) * seg).min(block.end))
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
    let words: Vec<u64> = counts.iter().map(|&c| c as u64).collect();
    fnv(&words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_goes_to_the_call_it_fits_best_and_keeps_its_contents() {
        let pool = Mutex::default();
        let (big, small) = {
            let a = Arena::new(&pool);
            let big = a.seg::<u32>(1 << 20);
            let small = a.seg::<u32>(16);
            // SAFETY: arena scratch, no operation pending on it.
            unsafe { big.get_mut().fill(7) };
            (big.ptr, small.ptr)
        };
        // A small call between two large ones takes the small buffer, in either order.
        for _ in 0..2 {
            let a = Arena::new(&pool);
            assert_eq!(a.seg::<u32>(1).ptr, small);
            let b = a.seg::<u32>(1 << 20);
            assert_eq!(b.ptr, big);
            // SAFETY: as above.
            assert!(unsafe { b.get() }.iter().all(|&x| x == 7), "reused scratch was cleared");
        }
        // With one buffer, a small call takes it and the large one after it finds it whole.
        pool.lock().unwrap().retain(|b| b.len() > 16);
        {
            let a = Arena::new(&pool);
            a.seg::<u32>(1);
        }
        let a = Arena::new(&pool);
        let b = a.seg::<u32>(1 << 20);
        assert_eq!(b.ptr, big);
        // SAFETY: as above.
        assert!(unsafe { b.get() }.iter().all(|&x| x == 7), "reused scratch was cleared");
    }
}
