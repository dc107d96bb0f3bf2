//! Dissemination barrier.

use super::{Coll, Seg};
use crate::error::Result;

/// Dissemination barrier (Hensgen, Finkel, Manber): in round k every rank sends an empty message
/// to `rank + 2^k` and waits for one from `rank - 2^k`. After ⌈log₂ N⌉ rounds every rank has
/// heard, directly or through others, from every rank. Cost: ⌈log₂ N⌉ latencies, 0 payload
/// bytes.
pub(crate) fn dissemination(c: &Coll<'_, '_>) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let empty = Seg::<u8>::new(&mut []);
    let mut dist = 1;
    while dist < n {
        // SAFETY: empty buffers: nothing is read or written.
        let s = unsafe { c.send((r + dist) % n, empty)? };
        let got = unsafe { c.recv((r + n - dist) % n, empty)? };
        c.wait_all([s, got])?;
        dist *= 2;
    }
    Ok(())
}
