//! Allreduce: ring (pipelined) and recursive halving-doubling; the ring phases are shared
//! with reduce-scatter and allgather.

use super::{Around, Coll, Phase, Sends, block_of, carve2, segment_runs, segments};
use crate::error::Result;
use crate::types::{Element, Fold};
use bytemuck::Pod;
use smallvec::SmallVec;
use std::ops::Range;

/// Receive slots of the ring reduce-scatter: segments in flight towards this rank. Step-0
/// sends are paced to the same window, so segments arrive into posted slots rather than the
/// pair's early-arrival buffer (which costs an allocation and a copy each). Two are enough to
/// overlap receiving one segment with reducing the other, and keep less data in flight (in
/// socket buffers and caches): measured with `ferrogloo-bench` on the 2-core machine, median
/// p50 of five alternating runs, 2 slots against 8, 1 MiB segments: 2 ranks 16 MiB 9.2 vs
/// 10.0 ms, 64 MiB 44.3 vs 51.3 ms; 4 ranks 16 MiB 33.6 vs 35.0 ms, 64 MiB 138 vs 149 ms;
/// 8 MiB within 10%, in favour of 2. One slot was no better than two.
const RING_SLOTS: usize = 2;

/// This rank's place in the ring, and which block it receives in step k.
struct Ring {
    r: usize,
    n: usize,
    right: usize,
    left: usize,
    shift: usize,
}

impl Ring {
    /// `None` for a ring of one (nothing to exchange).
    fn of(c: &Coll<'_>, shift: usize) -> Option<Self> {
        let (r, n) = (c.rank(), c.size());
        (n > 1).then(|| Ring { r, n, right: (r + 1) % n, left: (r + n - 1) % n, shift })
    }

    /// The block sent in step k (the one received from the left in step k-1).
    fn send_block(&self, k: usize) -> usize {
        (self.r + self.n - k + self.shift) % self.n
    }

    /// The block received from the left in step k.
    fn recv_block(&self, k: usize) -> usize {
        self.send_block(k + 1)
    }
}

/// Where a ring reduce-scatter reads this rank's contribution and reduces what it receives.
pub(crate) enum RingBufs<'b, T> {
    /// Reducing in place: every block is reduced where it lies in the buffer.
    InPlace(&'b mut [T]),
    /// Reducing apart from the contribution.
    Apart {
        /// This rank's contribution, laid out in the blocks; only read and sent.
        input: &'b [T],
        /// Where each block received before the last step is reduced, indexed like `input`
        /// (empty when there is no such block: two ranks).
        work: &'b mut [T],
        /// Where the block received in the last step (the fully reduced one) is reduced: a
        /// run of that block's length.
        last: &'b mut [T],
    },
}

/// The runs of a ring reduce-scatter's buffers, each lent on its own.
struct RingRuns<'b, T> {
    /// The step-0 block, only read and sent.
    first: &'b [T],
    /// Where the blocks received are reduced (but the last step's, when it has `last`).
    around: Around<'b, T>,
    /// Where the block received in the last step is reduced, when apart.
    last: Option<&'b mut [T]>,
    /// This rank's contribution, to copy where a block is reduced first, when it lies apart.
    input: Option<&'b [T]>,
}

impl<'b, T> RingBufs<'b, T> {
    /// Cuts the runs around the step-0 block, block `b` at `at`. It is never a destination
    /// (recv_block(k) == send_block(0) has no solution k in 0..n-1), so it is read while the
    /// others are written.
    fn runs(self, b: usize, at: Range<usize>) -> RingRuns<'b, T> {
        match self {
            RingBufs::InPlace(buf) => {
                let (around, first) = Around::new(buf, b, at);
                RingRuns { first, around, last: None, input: None }
            }
            RingBufs::Apart { input, work, last } => {
                // `work` is empty with two ranks: their only block received is the last step's.
                let hole = if work.is_empty() { 0..0 } else { at.clone() };
                let (around, _) = Around::new(work, b, hole);
                RingRuns { first: &input[at], around, last: Some(last), input: Some(input) }
            }
        }
    }
}

/// Forwarded segments waiting for credit, first in, first out; a few kept inline.
struct Waiting<'s, T> {
    runs: SmallVec<[&'s [T]; 4]>,
    next: usize,
}

impl<'s, T> Waiting<'s, T> {
    fn new() -> Self {
        Waiting { runs: SmallVec::new(), next: 0 }
    }

    fn push(&mut self, run: &'s [T]) {
        self.runs.push(run);
    }

    fn pop(&mut self) -> Option<&'s [T]> {
        let run = self.runs.get(self.next).copied();
        if run.is_some() {
            self.next += 1;
        } else {
            // Empty: start again from the front.
            self.runs.clear();
            self.next = 0;
        }
        run
    }
}

/// Ring reduce-scatter over `blocks`, pipelined in segments of `seg` elements.
///
/// In step k (of n-1) rank r sends block `(r - k + shift) mod n` to its right neighbour and
/// reduces block `(r - k - 1 + shift) mod n` from its left: its own contribution (from the
/// input; copied first when the destination is elsewhere) ⊕ what arrived. Each segment is
/// forwarded as soon as it is reduced, so reducing one segment overlaps moving the next.
/// Afterwards block `(r + 1 + shift) mod n` lies fully reduced in `last` (in place without
/// it). Every send is waited for before return.
pub(crate) fn ring_reduce_scatter<T: Element>(
    c: &Coll<'_>,
    bufs: RingBufs<'_, T>,
    blocks: &[Range<usize>],
    op: &Fold<'_, T>,
    shift: usize,
    seg: usize,
) -> Result<()> {
    let Some(ring) = Ring::of(c, shift) else { return Ok(()) };
    let n = ring.n;
    // The length of every segment this rank receives, in order.
    let lens = (0..n - 1).flat_map(|k| segments(blocks[ring.recv_block(k)].clone(), seg).map(|s| s.len()));
    let b0 = ring.send_block(0);
    let RingRuns { first, mut around, mut last, input } = bufs.runs(b0, blocks[b0].clone());
    // Where each segment received is reduced, in the order received, with its step and range.
    let dsts = (0..n - 1).flat_map(|k| {
        let b = ring.recv_block(k);
        let run = match last.take() {
            Some(l) if k == n - 2 => l,
            l => {
                last = l;
                around.take(b, blocks[b].clone())
            }
        };
        segment_runs(run, blocks[b].clone(), seg).map(move |(s, dst)| (k, s, dst))
    });
    let at = blocks[b0].start;
    let firsts = segments(blocks[b0].clone(), seg).map(|s| &first[s.start - at..s.end - at]);
    reduce_loop(c, &ring, firsts, dsts, lens, input, op)
}

/// The pipelined loop of a ring reduce-scatter: sends `firsts` (the step-0 segments) right;
/// receives segments of `lens` from the left into [`RING_SLOTS`] slots, in order; reduces
/// each into its `dsts` entry (step, range in the whole, run), after copying `input`'s
/// elements of that range there first when given; and forwards those of the steps before the
/// last. Every send is waited for before return.
fn reduce_loop<'s, T: Element>(
    c: &Coll<'_>,
    ring: &Ring,
    firsts: impl Iterator<Item = &'s [T]>,
    dsts: impl Iterator<Item = (usize, Range<usize>, &'s mut [T])>,
    lens: impl Iterator<Item = usize> + Clone,
    input: Option<&[T]>,
    op: &Fold<'_, T>,
) -> Result<()> {
    let (n, right, left) = (ring.n, ring.right, ring.left);
    let longest = lens.clone().max().unwrap_or(0);
    let mut slot_mem = c.scratch::<T>(longest * RING_SLOTS);
    let mut rest: &mut [T] = &mut slot_mem;
    let slots: [&mut [T]; RING_SLOTS] = std::array::from_fn(|_| {
        let (slot, tail) = std::mem::take(&mut rest).split_at_mut(longest);
        rest = tail;
        slot
    });
    c.phase(|p| {
        // Each run lent again for the phase's scope (an iterator's item type does not
        // shorten by itself; `pace` takes items of the scope's lifetime).
        #[allow(clippy::map_identity)]
        let mut firsts = firsts.map(|f| f);
        #[allow(clippy::map_identity)]
        let dsts = dsts.map(|(k, r, d)| (k, r, d));
        // Sends leave in one order (every step-0 segment, then each forwarded segment as it
        // is reduced), because the right neighbour matches them by order alone. They are
        // paced: one credit per receive slot to start, one more per segment received, so
        // segments land in the neighbour's posted slots instead of its early-arrival buffer.
        let mut queue = Waiting::new();
        let mut credit = RING_SLOTS;
        let mut sends = Sends::new();
        pace(p, right, &mut firsts, &mut queue, &mut credit, &mut sends, false)?;
        // Segment i is received into slot i mod RING_SLOTS, which has at most one receive
        // pending and is read only once it came back.
        let mut ahead = lens;
        let mut pending: [Option<_>; RING_SLOTS] = std::array::from_fn(|_| None);
        for (pending, slot) in pending.iter_mut().zip(slots) {
            if let Some(len) = ahead.next() {
                *pending = Some(p.recv_front(left, slot, len)?);
            }
        }
        for (i, (k, range, dst)) in dsts.enumerate() {
            let Some(got) = pending[i % RING_SLOTS].take() else { break };
            let slot = p.filled(got)?;
            // `dst` (block recv_block(k)) was never sent before step k+1, and no receive
            // targets it; in place it already holds this rank's contribution.
            if let Some(input) = input {
                dst.copy_from_slice(&input[range.clone()]);
            }
            op.apply(dst, &slot[..range.len()]);
            if let Some(len) = ahead.next() {
                pending[i % RING_SLOTS] = Some(p.recv_front(left, slot, len)?);
            }
            // A forwarded segment is final: nothing writes it again.
            if k + 1 < n - 1 {
                queue.push(dst);
            }
            credit += 1;
            pace(p, right, &mut firsts, &mut queue, &mut credit, &mut sends, false)?;
        }
        pace(p, right, &mut firsts, &mut queue, &mut credit, &mut sends, true)?;
        p.wait_all(sends)
    })
}

/// Sends the step-0 segments left, then the forwarded ones queued, to `right` while there is
/// credit (all of them with `all`), one credit each.
fn pace<'s, T: Pod>(
    p: &Phase<'s, '_>,
    right: usize,
    firsts: &mut impl Iterator<Item = &'s [T]>,
    queue: &mut Waiting<'s, T>,
    credit: &mut usize,
    sends: &mut Sends,
    all: bool,
) -> Result<()> {
    while *credit > 0 || all {
        let Some(s) = firsts.next().or_else(|| queue.pop()) else { break };
        sends.push(p.send(right, s)?);
        *credit = credit.saturating_sub(1);
    }
    Ok(())
}

/// Ring allgather over `blocks` of `buf`, pipelined in segments: rank r starts holding block
/// `(r + shift) mod n`, and in step k sends block `(r - k + shift) mod n` right while receiving
/// block `(r - k - 1 + shift) mod n` from the left straight into `buf`, forwarding each segment
/// as it lands.
pub(crate) fn ring_allgather<T: Element>(
    c: &Coll<'_>,
    buf: &mut [T],
    blocks: &[Range<usize>],
    shift: usize,
    seg: usize,
) -> Result<()> {
    let Some(ring) = Ring::of(c, shift) else { return Ok(()) };
    let b0 = ring.send_block(0);
    // The blocks received are pairwise distinct and distinct from the block sent first.
    let (mut around, first) = Around::new(buf, b0, blocks[b0].clone());
    let firsts = segment_runs(first, blocks[b0].clone(), seg).map(|(_, s)| &*s);
    let targets = (0..ring.n - 1).flat_map(|k| {
        let b = ring.recv_block(k);
        segment_runs(around.take(b, blocks[b].clone()), blocks[b].clone(), seg).map(move |(_, s)| (k, s))
    });
    gather_loop(c, &ring, firsts, targets)
}

/// The loop of a ring allgather: sends `firsts` (the step-0 segments) right, receives each
/// segment from the left straight into its `targets` entry (with its step), and forwards
/// those of the steps before the last. Every send is waited for before return.
fn gather_loop<'s, T: Element>(
    c: &Coll<'_>,
    ring: &Ring,
    firsts: impl Iterator<Item = &'s [T]>,
    targets: impl Iterator<Item = (usize, &'s mut [T])>,
) -> Result<()> {
    let (n, right, left) = (ring.n, ring.right, ring.left);
    c.phase(|p| {
        let mut sends = Sends::new();
        for s in firsts {
            sends.push(p.send(right, s)?);
        }
        // Post every receive up front: each lands in its own place.
        let mut recvs: SmallVec<[_; 8]> = SmallVec::new();
        for (k, s) in targets {
            recvs.push((k, p.recv(left, s)?));
        }
        for (k, got) in recvs {
            let s = p.filled(got)?;
            if k + 1 < n - 1 {
                sends.push(p.send(right, &*s)?);
            }
        }
        p.wait_all(sends)
    })
}

/// Ring allreduce: reduce-scatter then allgather. 2(n-1) steps; each rank sends and receives
/// 2(n-1)/n of the buffer.
pub(crate) fn ring<T: Element>(c: &Coll<'_>, buf: &mut [T], op: &Fold<'_, T>, seg: usize) -> Result<()> {
    let n = c.size();
    let blocks: SmallVec<[Range<usize>; 8]> = (0..n).map(|i| block_of(buf.len(), n, i)).collect();
    ring_reduce_scatter(c, RingBufs::InPlace(&mut *buf), &blocks, op, 0, seg)?;
    ring_allgather(c, buf, &blocks, 1, seg)
}

/// Ring allreduce of buffers taken as one (a fused batch's tensors), in place in each, with
/// no buffer for their concatenation: [`ring`]'s blocks and segments, every segment also cut
/// where a part ends, so that each message is a run of one part (sent from it, received or
/// reduced into it). Every rank must cut the whole at the same places (parts of the same
/// lengths, in the same order): a neighbour's messages are cut where this rank's parts end.
pub(crate) fn ring_parts<T: Element>(c: &Coll<'_>, parts: &mut [&mut [T]], op: &Fold<'_, T>, seg: usize) -> Result<()> {
    let n = c.size();
    let (Some(scatter), Some(gather)) = (Ring::of(c, 0), Ring::of(c, 1)) else { return Ok(()) };
    let ends: Vec<usize> = parts
        .iter()
        .scan(0, |at, p| {
            *at += p.len();
            Some(*at)
        })
        .collect();
    let total = ends.last().copied().unwrap_or(0);
    // Every block's segments, each lent from its part.
    let mut lend = Lend::new(parts);
    let mut blocks: SmallVec<[Segs<'_, T>; 8]> = (0..n)
        .map(|b| cut_at_ends(block_of(total, n, b), seg, &ends).map(|r| (r.clone(), lend.take(r.len()))).collect())
        .collect();
    // Reduce-scatter, then allgather, each lending the block it sends first apart from the
    // blocks it receives (pairwise distinct, and distinct from that one).
    let lens: Vec<usize> =
        (0..n - 1).flat_map(|k| blocks[scatter.recv_block(k)].iter().map(|(r, _)| r.len())).collect();
    {
        let (first, mut others) = lend_blocks(&mut blocks, scatter.send_block(0));
        let dsts = (0..n - 1).flat_map(|k| {
            let segs = others[scatter.recv_block(k)].take().into_iter().flatten();
            segs.map(move |(r, d)| (k, r.clone(), &mut **d))
        });
        reduce_loop(c, &scatter, first.iter().map(|(_, s)| &**s), dsts, lens.into_iter(), None, op)?;
    }
    let (first, mut others) = lend_blocks(&mut blocks, gather.send_block(0));
    let targets = (0..n - 1)
        .flat_map(|k| others[gather.recv_block(k)].take().into_iter().flatten().map(move |(_, d)| (k, &mut **d)));
    gather_loop(c, &gather, first.iter().map(|(_, s)| &**s), targets)
}

/// The segments of `block` ([`segments`]), each also cut where a part ends (`ends`, the ends of
/// the parts in the whole, ascending): at least one, possibly empty.
fn cut_at_ends(block: Range<usize>, seg: usize, ends: &[usize]) -> impl Iterator<Item = Range<usize>> + '_ {
    segments(block, seg).flat_map(move |s| {
        let mut from = s.start;
        let empty = s.is_empty();
        std::iter::from_fn(move || {
            if empty {
                return None;
            }
            (from < s.end).then(|| {
                let end = ends.get(ends.partition_point(|&e| e <= from)).map_or(s.end, |&e| e.min(s.end));
                let r = from..end;
                from = end;
                r
            })
        })
        .chain(empty.then_some(s.clone()))
    })
}

/// Lends consecutive runs of a list of parts, in order (each run within one part).
struct Lend<'p, 'b, T> {
    parts: std::slice::IterMut<'p, &'b mut [T]>,
    cur: &'p mut [T],
}

impl<'p, 'b: 'p, T> Lend<'p, 'b, T> {
    fn new(parts: &'p mut [&'b mut [T]]) -> Self {
        Lend { parts: parts.iter_mut(), cur: &mut [] }
    }

    /// The next `len` elements (within one part: the caller cuts at the parts' ends).
    fn take(&mut self, len: usize) -> &'p mut [T] {
        if len == 0 {
            return &mut [];
        }
        while self.cur.is_empty() {
            match self.parts.next() {
                Some(p) => self.cur = &mut **p,
                None => break,
            }
        }
        let k = len.min(self.cur.len());
        let (run, rest) = std::mem::take(&mut self.cur).split_at_mut(k);
        self.cur = rest;
        run
    }
}

/// A segment: its range in the whole, lent from its part.
type Seg<'p, T> = (Range<usize>, &'p mut [T]);

/// A block's segments.
type Segs<'p, T> = Vec<Seg<'p, T>>;

/// Every block's segments but one, each to take once.
type Taken<'v, 'p, T> = SmallVec<[Option<&'v mut Segs<'p, T>>; 8]>;

/// The segments of block `b` to read, and every other block's to take (once).
fn lend_blocks<'v, 'p, T>(blocks: &'v mut [Segs<'p, T>], b: usize) -> (&'v [Seg<'p, T>], Taken<'v, 'p, T>) {
    let mut first: &[Seg<'p, T>] = &[];
    let mut others = SmallVec::new();
    for (i, segs) in blocks.iter_mut().enumerate() {
        if i == b {
            first = segs;
            others.push(None);
        } else {
            others.push(Some(segs));
        }
    }
    (first, others)
}

/// The power-of-two group the doubling algorithms work in: p, the largest power of two ≤ n,
/// virtual ranks `0..p`, and this rank's place `v` in it.
struct Group {
    p: usize,
    rem: usize,
    v: usize,
}

impl Group {
    /// Enters the group: ranks beyond the first p fold in (see [`pre_fold`]). `None` for a
    /// rank that folded into its neighbour and already holds the result.
    fn enter<T: Element>(c: &Coll<'_>, buf: &mut [T], tmp: &mut [T], op: &Fold<'_, T>) -> Result<Option<Self>> {
        let (r, n) = (c.rank(), c.size());
        let p = 1usize << n.ilog2();
        let rem = n - p;
        Ok(pre_fold(c, buf, tmp, op, r, rem)?.map(|v| Group { p, rem, v }))
    }

    /// The real rank of virtual rank `v`.
    fn real(&self, v: usize) -> usize {
        if v < self.rem { 2 * v + 1 } else { v + self.rem }
    }

    /// Leaves the group: hands the result to the rank folded in at the start.
    fn leave<T: Element>(&self, c: &Coll<'_>, buf: &[T]) -> Result<()> {
        post_fold(c, buf, c.rank(), self.rem)
    }
}

/// Recursive doubling: in step k every rank swaps its whole buffer with the rank 2^k away (in
/// the power-of-two group) and both fold the two in rank order, so both hold the same bits.
/// log₂p steps (+2 when n is not a power of two); each rank sends S·log₂p bytes. Fewest steps:
/// the choice for small buffers.
pub(crate) fn recursive_doubling<T: Element>(c: &Coll<'_>, buf: &mut [T], op: &Fold<'_, T>) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let mut tmp = c.scratch::<T>(buf.len());
    let Some(g) = Group::enter(c, buf, &mut tmp, op)? else { return Ok(()) };
    let (p, v) = (g.p, g.v);
    let mut mask = 1;
    while mask < p {
        let partner = g.real(v ^ mask);
        // `buf` is only read by the send and `tmp` only written by the receive, until both
        // are waited for.
        c.phase(|ph| {
            let s = ph.send(partner, &*buf)?;
            let got = ph.recv(partner, &mut tmp)?;
            ph.filled(got)?;
            ph.wait(s)
        })?;
        if v & mask == 0 {
            op.apply(buf, &tmp); // mine (lower group) ⊕ theirs
        } else {
            op.apply(&mut tmp, buf); // theirs (lower group) ⊕ mine
            buf.copy_from_slice(&tmp);
        }
        mask *= 2;
    }
    g.leave(c, buf)
}

/// Pre-step for world sizes that are not powers of two: among the first 2·rem ranks, even ones
/// hand their buffer to the odd one above, which folds it in (lower rank first) and takes the
/// place `r / 2`; an even rank then waits for the result (`None`). Other ranks take
/// `r - rem`.
fn pre_fold<T: Element>(
    c: &Coll<'_>,
    buf: &mut [T],
    tmp: &mut [T],
    op: &Fold<'_, T>,
    r: usize,
    rem: usize,
) -> Result<Option<usize>> {
    if r >= 2 * rem {
        return Ok(Some(r - rem));
    }
    if r.is_multiple_of(2) {
        // The send is waited for before the receive into the same buffer is posted.
        c.phase(|p| {
            let s = p.send(r + 1, &*buf)?;
            p.wait(s)
        })?;
        c.phase(|p| {
            let got = p.recv(r + 1, buf)?;
            p.filled(got).map(drop)
        })?;
        return Ok(None);
    }
    c.phase(|p| {
        let got = p.recv(r - 1, tmp)?;
        p.filled(got).map(drop)
    })?;
    op.apply(tmp, buf);
    buf.copy_from_slice(tmp);
    Ok(Some(r / 2))
}

/// Post-step: an odd rank among the first 2·rem gives the result to the even rank below.
fn post_fold<T: Element>(c: &Coll<'_>, buf: &[T], r: usize, rem: usize) -> Result<()> {
    if r < 2 * rem {
        c.phase(|p| {
            let s = p.send(r - 1, buf)?;
            p.wait(s)
        })?;
    }
    Ok(())
}

/// Recursive halving (reduce-scatter) then recursive doubling (allgather) over the largest
/// power of two p ≤ n. The first 2(n-p) ranks pair up first: even ones hand their buffer to
/// the odd one above and receive the result at the end. 2·log₂p steps (+2 when n is not a
/// power of two); each rank sends and receives 2(p-1)/p of the buffer.
pub(crate) fn halving_doubling<T: Element>(c: &Coll<'_>, buf: &mut [T], op: &Fold<'_, T>) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let mut tmp = c.scratch::<T>(buf.len());
    let Some(g) = Group::enter(c, buf, &mut tmp, op)? else { return Ok(()) };
    let (p, v) = (g.p, g.v);

    let len = buf.len();
    // Blocks lo..hi of the buffer split into p, as one run.
    let span = |lo: usize, hi: usize| block_of(len, p, lo).start..block_of(len, p, hi - 1).end;
    let (mut lo, mut hi) = (0, p);
    let mut mask = p / 2;
    while mask > 0 {
        let partner = g.real(v ^ mask);
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if v & mask == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
        let (kept, given) = carve2(buf, span(keep.0, keep.1), span(give.0, give.1));
        // The half given is sent (and not written again in this phase); the receive goes to
        // scratch and is reduced into the kept half while the send may still be in flight.
        c.phase(|ph| {
            let s = ph.send(partner, &*given)?;
            let got = ph.recv(partner, &mut tmp[..kept.len()])?;
            op.apply(kept, ph.filled(got)?);
            ph.wait(s)
        })?;
        (lo, hi) = keep;
        mask /= 2;
    }
    // Now block v is fully reduced here; double it back up.
    let mut mask = 1;
    while mask < p {
        let partner = g.real(v ^ mask);
        let width = hi - lo;
        let (other_lo, other_hi) = if v & mask == 0 { (hi, hi + width) } else { (lo - width, lo) };
        // The part sent and the part received are disjoint, both waited for.
        let (mine, theirs) = carve2(buf, span(lo, hi), span(other_lo, other_hi));
        c.phase(|ph| {
            let s = ph.send(partner, &*mine)?;
            let got = ph.recv(partner, theirs)?;
            ph.filled(got)?;
            ph.wait(s)
        })?;
        (lo, hi) = (lo.min(other_lo), hi.max(other_hi));
        mask *= 2;
    }
    g.leave(c, buf)
}
