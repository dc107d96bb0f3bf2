//! Allreduce: ring (pipelined) and recursive halving-doubling; the ring phases are shared
//! with reduce-scatter and allgather.

use super::{Coll, Seg, partition, segments};
use crate::error::Result;
use crate::types::{Element, ReduceOp};
use std::collections::VecDeque;
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
    fn of(c: &Coll<'_, '_>, shift: usize) -> Option<Self> {
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
#[derive(Clone, Copy)]
pub(crate) struct RingBufs<T> {
    /// This rank's contribution, laid out in the blocks; only read and sent.
    pub(crate) input: Seg<T>,
    /// Where each block received before the last step is reduced, indexed like `input`.
    pub(crate) work: Seg<T>,
    /// Where the block received in the last step (the fully reduced one) is reduced, if not in
    /// `work` like the others: a run of that block's length.
    pub(crate) last: Option<Seg<T>>,
}

impl<T> RingBufs<T> {
    /// Reducing in place: every block is reduced where it lies in `buf`.
    pub(crate) fn in_place(buf: Seg<T>) -> Self {
        RingBufs { input: buf, work: buf, last: None }
    }
}

/// Ring reduce-scatter over `blocks`, pipelined in segments of `seg` elements.
///
/// In step k (of n-1) rank r sends block `(r - k + shift) mod n` to its right neighbour and
/// reduces block `(r - k - 1 + shift) mod n` from its left: its own contribution (from
/// `bufs.input`; copied first when the destination is elsewhere) ⊕ what arrived. Each segment
/// is forwarded as soon as it is reduced, so reducing one segment overlaps moving the next.
/// Afterwards block `(r + 1 + shift) mod n` lies fully reduced in `bufs.last` (in `bufs.work`
/// without it). Every send is waited for before return.
pub(crate) fn ring_reduce_scatter<T: Element>(
    c: &Coll<'_, '_>,
    bufs: RingBufs<T>,
    blocks: &[Range<usize>],
    op: &ReduceOp<T>,
    shift: usize,
    seg: usize,
) -> Result<()> {
    let Some(ring) = Ring::of(c, shift) else { return Ok(()) };
    let (n, right, left) = (ring.n, ring.right, ring.left);
    let send_block = |k: usize| ring.send_block(k);
    let recv_block = |k: usize| ring.recv_block(k);
    // Every (step, segment) this rank receives, in order.
    let items: Vec<(usize, Range<usize>)> =
        (0..n - 1).flat_map(|k| segments(&blocks[recv_block(k)], seg).map(move |s| (k, s))).collect();
    let longest = items.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
    let slots = c.scratch::<T>(longest * RING_SLOTS);
    let slot = |i: usize, len: usize| slots.sub(i * longest..i * longest + len);

    // Sends leave in one order (every step-0 segment, then each forwarded segment as it is
    // reduced), because the right neighbour matches them by order alone. They are paced: one
    // credit per receive slot to start, one more per segment received, so segments land in
    // the neighbour's posted slots instead of its early-arrival buffer.
    let mut queue: VecDeque<Seg<T>> = segments(&blocks[send_block(0)], seg).map(|s| bufs.input.sub(s)).collect();
    let last_start = blocks[recv_block(n - 2)].start;
    // Where the segment `range` received in step k is reduced.
    let dst_of = |k: usize, range: &Range<usize>| match bufs.last {
        Some(last) if k == n - 2 => last.sub(range.start - last_start..range.end - last_start),
        _ => bufs.work.sub(range.clone()),
    };
    let mut credit = RING_SLOTS;
    let mut sends = Vec::new();
    // SAFETY (every send below): a queued segment is final for this phase. Step-0 segments
    // are block send_block(0) of `input`, which is never written here (recv_block(k) ==
    // send_block(0) has no solution k in 0..n-1, and a destination elsewhere is not `input`);
    // forwarded segments are queued only after their reduction, and nothing writes them again.
    let mut issue = |queue: &mut VecDeque<Seg<T>>, credit: &mut usize, all: bool| -> Result<()> {
        while *credit > 0 || all {
            let Some(s) = queue.pop_front() else { break };
            sends.push(unsafe { c.send(right, s)? });
            *credit = credit.saturating_sub(1);
        }
        Ok(())
    };
    issue(&mut queue, &mut credit, false)?;
    let mut pending: VecDeque<(usize, usize)> = VecDeque::new(); // (receive op, slot)
    let mut next = 0;
    while next < items.len().min(RING_SLOTS) {
        // SAFETY: each slot has at most one receive pending, and is read only after it is waited.
        pending.push_back((unsafe { c.recv(left, slot(next, items[next].1.len()))? }, next));
        next += 1;
    }
    for (k, range) in &items {
        let Some((req, i)) = pending.pop_front() else { break };
        c.wait(req)?;
        let dst = dst_of(*k, range);
        let mine = bufs.input.sub(range.clone());
        // SAFETY: slot `i` is complete; `dst` (block recv_block(k)) has no pending operation:
        // it was never sent before step k+1 and no receive targets it. `mine` is only read,
        // here and by step-0 sends of another block; it is `dst` itself when in place.
        unsafe {
            if !dst.is(mine) {
                dst.get_mut().copy_from_slice(mine.get());
            }
            op.apply(dst.get_mut(), slot(i, range.len()).get());
        }
        if next < items.len() {
            // SAFETY: slot `i` was just consumed; see above.
            pending.push_back((unsafe { c.recv(left, slot(i, items[next].1.len()))? }, i));
            next += 1;
        }
        if k + 1 < n - 1 {
            queue.push_back(dst);
        }
        credit += 1;
        issue(&mut queue, &mut credit, false)?;
    }
    issue(&mut queue, &mut credit, true)?;
    c.wait_all(sends)
}

/// Ring allgather over `blocks` of `buf`, pipelined in segments: rank r starts holding block
/// `(r + shift) mod n`, and in step k sends block `(r - k + shift) mod n` right while receiving
/// block `(r - k - 1 + shift) mod n` from the left straight into `buf`, forwarding each segment
/// as it lands.
pub(crate) fn ring_allgather<T: Element>(
    c: &Coll<'_, '_>,
    buf: Seg<T>,
    blocks: &[Range<usize>],
    shift: usize,
    seg: usize,
) -> Result<()> {
    let Some(ring) = Ring::of(c, shift) else { return Ok(()) };
    let (n, right, left) = (ring.n, ring.right, ring.left);
    let send_block = ring.send_block(0);
    let recv_block = |k: usize| ring.recv_block(k);
    let mut sends = Vec::new();
    for s in segments(&blocks[send_block], seg) {
        // SAFETY: this rank's own block is never received into.
        sends.push(unsafe { c.send(right, buf.sub(s))? });
    }
    // Post every receive up front: each lands in its own place in `buf`.
    let mut recvs = Vec::new();
    for k in 0..n - 1 {
        for s in segments(&blocks[recv_block(k)], seg) {
            // SAFETY: the blocks received are pairwise distinct and distinct from the block sent
            // first; a received segment is only sent after its receive completed.
            recvs.push((k, unsafe { c.recv(left, buf.sub(s.clone()))? }, s));
        }
    }
    for (k, req, s) in recvs {
        c.wait(req)?;
        if k + 1 < n - 1 {
            // SAFETY: the segment's receive has completed and nothing writes it again.
            sends.push(unsafe { c.send(right, buf.sub(s))? });
        }
    }
    c.wait_all(sends)
}

/// Ring allreduce: reduce-scatter then allgather. 2(n-1) steps; each rank sends and receives
/// 2(n-1)/n of the buffer.
pub(crate) fn ring<T: Element>(c: &Coll<'_, '_>, buf: Seg<T>, op: &ReduceOp<T>, seg: usize) -> Result<()> {
    let blocks = partition(buf.len(), c.size());
    ring_reduce_scatter(c, RingBufs::in_place(buf), &blocks, op, 0, seg)?;
    ring_allgather(c, buf, &blocks, 1, seg)
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
    fn enter<T: Element>(c: &Coll<'_, '_>, buf: Seg<T>, tmp: Seg<T>, op: &ReduceOp<T>) -> Result<Option<Self>> {
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
    fn leave<T>(&self, c: &Coll<'_, '_>, buf: Seg<T>) -> Result<()> {
        post_fold(c, buf, c.rank(), self.rem)
    }
}

/// Recursive doubling: in step k every rank swaps its whole buffer with the rank 2^k away (in
/// the power-of-two group) and both fold the two in rank order, so both hold the same bits.
/// log₂p steps (+2 when n is not a power of two); each rank sends S·log₂p bytes. Fewest steps:
/// the choice for small buffers.
pub(crate) fn recursive_doubling<T: Element>(c: &Coll<'_, '_>, buf: Seg<T>, op: &ReduceOp<T>) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let tmp = c.scratch::<T>(buf.len());
    let Some(g) = Group::enter(c, buf, tmp, op)? else { return Ok(()) };
    let (p, v) = (g.p, g.v);
    let mut mask = 1;
    while mask < p {
        let partner = g.real(v ^ mask);
        // SAFETY: `buf` is only read by the send and `tmp` only written by the receive; both
        // are waited for before either is touched.
        let s = unsafe { c.send(partner, buf)? };
        let got = unsafe { c.recv(partner, tmp)? };
        c.wait_all([got, s])?;
        // SAFETY: both operations are complete.
        unsafe {
            if v & mask == 0 {
                op.apply(buf.get_mut(), tmp.get()); // mine (lower group) ⊕ theirs
            } else {
                op.apply(tmp.get_mut(), buf.get()); // theirs (lower group) ⊕ mine
                buf.get_mut().copy_from_slice(tmp.get());
            }
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
    c: &Coll<'_, '_>,
    buf: Seg<T>,
    tmp: Seg<T>,
    op: &ReduceOp<T>,
    r: usize,
    rem: usize,
) -> Result<Option<usize>> {
    if r >= 2 * rem {
        return Ok(Some(r - rem));
    }
    if r.is_multiple_of(2) {
        // SAFETY: `buf` is only read by this send, which is waited for before the receive.
        let s = unsafe { c.send(r + 1, buf)? };
        c.wait(s)?;
        // SAFETY: nothing else touches `buf` until this receive completes.
        let got = unsafe { c.recv(r + 1, buf)? };
        c.wait(got)?;
        return Ok(None);
    }
    // SAFETY: `tmp` is private scratch, read only after the receive completes.
    let got = unsafe { c.recv(r - 1, tmp)? };
    c.wait(got)?;
    // SAFETY: no operation is pending on either.
    unsafe {
        op.apply(tmp.get_mut(), buf.get());
        buf.get_mut().copy_from_slice(tmp.get());
    }
    Ok(Some(r / 2))
}

/// Post-step: an odd rank among the first 2·rem gives the result to the even rank below.
fn post_fold<T>(c: &Coll<'_, '_>, buf: Seg<T>, r: usize, rem: usize) -> Result<()> {
    if r < 2 * rem {
        // SAFETY: `buf` is final and only read by this send.
        let s = unsafe { c.send(r - 1, buf)? };
        c.wait(s)?;
    }
    Ok(())
}

/// Recursive halving (reduce-scatter) then recursive doubling (allgather) over the largest
/// power of two p ≤ n. The first 2(n-p) ranks pair up first: even ones hand their buffer to
/// the odd one above and receive the result at the end. 2·log₂p steps (+2 when n is not a
/// power of two); each rank sends and receives 2(p-1)/p of the buffer.
pub(crate) fn halving_doubling<T: Element>(c: &Coll<'_, '_>, buf: Seg<T>, op: &ReduceOp<T>) -> Result<()> {
    if c.size() == 1 {
        return Ok(());
    }
    let tmp = c.scratch::<T>(buf.len());
    let Some(g) = Group::enter(c, buf, tmp, op)? else { return Ok(()) };
    let (p, v) = (g.p, g.v);

    let blocks = partition(buf.len(), p);
    let span = |lo: usize, hi: usize| blocks[lo].start..blocks[hi - 1].end;
    let (mut lo, mut hi) = (0, p);
    let mut mask = p / 2;
    while mask > 0 {
        let partner = g.real(v ^ mask);
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if v & mask == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
        let keep_r = span(keep.0, keep.1);
        // SAFETY: the half sent is not written again in this phase; the receive goes to scratch;
        // both are waited for before the kept half is reduced and before the next step.
        let s = unsafe { c.send(partner, buf.sub(span(give.0, give.1)))? };
        let got = unsafe { c.recv(partner, tmp.sub(0..keep_r.len()))? };
        c.wait(got)?;
        // SAFETY: the receive is complete, and the send reads the other half.
        unsafe { op.apply(buf.sub(keep_r.clone()).get_mut(), tmp.sub(0..keep_r.len()).get()) };
        c.wait(s)?;
        (lo, hi) = keep;
        mask /= 2;
    }
    // Now block v is fully reduced here; double it back up.
    let mut mask = 1;
    while mask < p {
        let partner = g.real(v ^ mask);
        let width = hi - lo;
        let (other_lo, other_hi) = if v & mask == 0 { (hi, hi + width) } else { (lo - width, lo) };
        // SAFETY: the part sent and the part received are disjoint, both waited for below.
        let s = unsafe { c.send(partner, buf.sub(span(lo, hi)))? };
        let got = unsafe { c.recv(partner, buf.sub(span(other_lo, other_hi)))? };
        c.wait_all([got, s])?;
        (lo, hi) = (lo.min(other_lo), hi.max(other_hi));
        mask *= 2;
    }
    g.leave(c, buf)
}
