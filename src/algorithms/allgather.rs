//! Allgather: the ring of `allreduce::ring_allgather`, starting from each rank's own block, and
//! recursive doubling for power-of-two world sizes. Both start with this rank's input already
//! in its block of the output (the caller copies it there).

use super::allreduce::ring_allgather;
use super::{Coll, carve2};
use crate::error::Result;
use crate::types::Element;
use std::ops::Range;

/// The pipelined ring: n-1 steps; every rank sends and receives everything but its own block.
pub(crate) fn ring<T: Element>(c: &Coll<'_>, out: &mut [T], blocks: &[Range<usize>], seg: usize) -> Result<()> {
    ring_allgather(c, out, blocks, 0, seg)
}

/// Recursive doubling, for a power-of-two n: in step k every rank swaps the 2^k blocks it holds
/// (one contiguous range of `out`, since blocks are in rank order) with the rank 2^k away.
/// log₂n steps instead of the ring's n-1, the same bytes; no pipelining.
pub(crate) fn recursive_doubling<T: Element>(c: &Coll<'_>, out: &mut [T], blocks: &[Range<usize>]) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    debug_assert!(n.is_power_of_two());
    // The `count` blocks from `first` on, as one range of `out`.
    let span = |first: usize, count: usize| blocks[first].start..blocks[first + count - 1].end;
    let mut dist = 1;
    while dist < n {
        let partner = r ^ dist;
        // The two spans are disjoint (aligned groups of `dist` blocks on either side of bit
        // `dist`); ours is complete (ours, or received in earlier steps) and only read, theirs
        // only written, until both are waited for.
        let (theirs, ours) = carve2(out, span(partner & !(dist - 1), dist), span(r & !(dist - 1), dist));
        c.phase(|p| {
            let got = p.recv(partner, theirs)?;
            let sent = p.send(partner, &*ours)?;
            p.filled(got)?;
            p.wait(sent)
        })?;
        dist <<= 1;
    }
    Ok(())
}
