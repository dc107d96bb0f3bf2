//! Allgather: the ring of `allreduce::ring_allgather`, starting from each rank's own block.

use super::allreduce::ring_allgather;
use super::{Coll, Seg};
use crate::error::Result;
use crate::types::Element;
use std::ops::Range;

/// Copies `input` into this rank's block of `out`, then runs the pipelined ring: n-1 steps;
/// every rank sends and receives everything but its own block.
pub(crate) fn ring<T: Element>(
    c: &Coll<'_, '_>,
    input: &[T],
    out: Seg<T>,
    blocks: &[Range<usize>],
    seg: usize,
) -> Result<()> {
    let r = c.ctx().rank();
    // SAFETY: no operation is pending yet.
    unsafe { out.sub(blocks[r].clone()).get_mut().copy_from_slice(input) };
    ring_allgather(c, out, blocks, 0, seg)
}
