//! Dissemination barrier.

use super::Coll;
use crate::error::Result;

/// Dissemination barrier (Hensgen, Finkel, Manber): in round k every rank sends an empty message
/// to `rank + 2^k` and waits for one from `rank - 2^k`. After ⌈log₂ N⌉ rounds every rank has
/// heard, directly or through others, from every rank. Cost: ⌈log₂ N⌉ latencies, 0 payload
/// bytes.
pub(crate) fn dissemination(c: &Coll<'_>) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    c.phase(|p| {
        let mut dist = 1;
        while dist < n {
            let s = p.send::<u8>((r + dist) % n, &[])?;
            let got = p.recv::<u8>((r + n - dist) % n, &mut [])?;
            p.wait(s)?;
            p.filled(got)?;
            dist *= 2;
        }
        Ok(())
    })
}
