//! Allreduce: ring (pipelined) and recursive halving-doubling; the ring phases are shared
//! with reduce-scatter and allgather.

use super::{Coll, Phase, Sent, carve, carve2, partition, segments};
use crate::error::Result;
use crate::types::{Element, Fold};
use bytemuck::Pod;
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
    /// The step-0 segments, only read and sent.
    first: Vec<&'b [T]>,
    /// Where each received segment is reduced, in the order received.
    dsts: Vec<&'b mut [T]>,
    /// This rank's contribution to copy there first, when it is elsewhere.
    mine: Vec<Option<&'b [T]>>,
}

impl<'b, T> RingBufs<'b, T> {
    /// Cuts the runs: the step-0 segments `first`, and the destinations of the segments
    /// `items` received (in step k, at a range of the blocks); the block of the last step,
    /// `last_step`, starts at `last_start`. The step-0 block is never a destination
    /// (recv_block(k) == send_block(0) has no solution k in 0..n-1), so it is read while the
    /// others are written.
    fn runs(
        self,
        first: &[Range<usize>],
        items: &[(usize, Range<usize>)],
        last_step: usize,
        last_start: usize,
    ) -> RingRuns<'b, T> {
        let ranges = items.iter().map(|(_, s)| s.clone());
        match self {
            RingBufs::InPlace(buf) => {
                let mut runs = carve(buf, &first.iter().cloned().chain(ranges).collect::<Vec<_>>());
                let dsts = runs.split_off(first.len());
                let first = runs.into_iter().map(|r| &*r).collect();
                RingRuns { first, dsts, mine: vec![None; items.len()] }
            }
            RingBufs::Apart { input, work, last } => {
                // The last step's block lies in `last`, the others in `work`.
                let (early, late): (Vec<_>, Vec<_>) = items.iter().partition(|(k, _)| *k < last_step);
                let mut dsts = carve(work, &early.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>());
                let late: Vec<_> = late.iter().map(|(_, s)| s.start - last_start..s.end - last_start).collect();
                dsts.extend(carve(last, &late));
                RingRuns {
                    first: first.iter().map(|r| &input[r.clone()]).collect(),
                    dsts,
                    mine: ranges.map(|r| Some(&input[r])).collect(),
                }
            }
        }
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
    let (n, right, left) = (ring.n, ring.right, ring.left);
    // Every (step, segment) this rank receives, in order.
    let items: Vec<(usize, Range<usize>)> =
        (0..n - 1).flat_map(|k| segments(&blocks[ring.recv_block(k)], seg).map(move |s| (k, s))).collect();
    let first: Vec<Range<usize>> = segments(&blocks[ring.send_block(0)], seg).collect();
    let longest = items.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
    let mut slot_mem = c.scratch::<T>(longest * RING_SLOTS);
    let slot_ranges: Vec<Range<usize>> = (0..RING_SLOTS).map(|i| i * longest..(i + 1) * longest).collect();
    let slots = carve(&mut slot_mem, &slot_ranges);

    let RingRuns { first, dsts, mine } = bufs.runs(&first, &items, n - 2, blocks[ring.recv_block(n - 2)].start);
    c.phase(|p| {
        // Sends leave in one order (every step-0 segment, then each forwarded segment as it
        // is reduced), because the right neighbour matches them by order alone. They are
        // paced: one credit per receive slot to start, one more per segment received, so
        // segments land in the neighbour's posted slots instead of its early-arrival buffer.
        let mut queue: VecDeque<&[T]> = first.into();
        let mut credit = RING_SLOTS;
        let mut sends = Vec::new();
        pace(p, right, &mut queue, &mut credit, &mut sends, false)?;
        // Each slot has at most one receive pending, and is read only once it came back.
        let mut pending = VecDeque::new();
        let mut next = 0;
        for slot in slots {
            if next < items.len() {
                pending.push_back(p.recv_front(left, slot, items[next].1.len())?);
                next += 1;
            }
        }
        for (((k, range), dst), mine) in items.iter().zip(dsts).zip(mine) {
            let Some(got) = pending.pop_front() else { break };
            let slot = p.filled(got)?;
            // `dst` (block recv_block(k)) was never sent before step k+1, and no receive
            // targets it; in place it already holds this rank's contribution.
            if let Some(mine) = mine {
                dst.copy_from_slice(mine);
            }
            op.apply(dst, &slot[..range.len()]);
            if next < items.len() {
                pending.push_back(p.recv_front(left, slot, items[next].1.len())?);
                next += 1;
            }
            // A forwarded segment is final: nothing writes it again.
            if k + 1 < n - 1 {
                queue.push_back(dst);
            }
            credit += 1;
            pace(p, right, &mut queue, &mut credit, &mut sends, false)?;
        }
        pace(p, right, &mut queue, &mut credit, &mut sends, true)?;
        p.wait_all(sends)
    })
}

/// Sends queued segments to `right` while there is credit (all of them with `all`), one
/// credit each.
fn pace<'s, T: Pod>(
    p: &Phase<'s, '_>,
    right: usize,
    queue: &mut VecDeque<&'s [T]>,
    credit: &mut usize,
    sends: &mut Vec<Sent>,
    all: bool,
) -> Result<()> {
    while *credit > 0 || all {
        let Some(s) = queue.pop_front() else { break };
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
    let (n, right, left) = (ring.n, ring.right, ring.left);
    let first: Vec<Range<usize>> = segments(&blocks[ring.send_block(0)], seg).collect();
    // The blocks received are pairwise distinct and distinct from the block sent first.
    let items: Vec<(usize, Range<usize>)> =
        (0..n - 1).flat_map(|k| segments(&blocks[ring.recv_block(k)], seg).map(move |s| (k, s))).collect();
    let ranges: Vec<Range<usize>> = first.iter().cloned().chain(items.iter().map(|(_, s)| s.clone())).collect();
    c.phase(|p| {
        let mut runs = carve(buf, &ranges).into_iter();
        let mut sends = Vec::new();
        for s in runs.by_ref().take(first.len()) {
            sends.push(p.send(right, &*s)?);
        }
        // Post every receive up front: each lands in its own place in `buf`.
        let mut recvs = Vec::new();
        for ((k, _), s) in items.iter().zip(runs) {
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
    let blocks = partition(buf.len(), c.size());
    ring_reduce_scatter(c, RingBufs::InPlace(&mut *buf), &blocks, op, 0, seg)?;
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

    let blocks = partition(buf.len(), p);
    let span = |lo: usize, hi: usize| blocks[lo].start..blocks[hi - 1].end;
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
