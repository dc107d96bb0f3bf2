//! Dissemination barrier.

use super::meta;
use crate::context::Context;
use crate::error::Result;

/// Dissemination barrier (Hensgen, Finkel, Manber): in round k every rank sends an empty message
/// to `rank + 2^k` and waits for one from `rank - 2^k`. After ⌈log₂ N⌉ rounds every rank has
/// heard, directly or through others, from every rank. Cost: ⌈log₂ N⌉ latencies, 0 payload
/// bytes.
pub(crate) fn barrier(ctx: &Context, tag: u32) -> Result<()> {
    let n = ctx.size();
    if n == 1 {
        return Ok(());
    }
    let wire = ctx.next_collective_tag(tag)?;
    let r = ctx.rank();
    let mut dist = 1;
    let mut round = 0;
    while dist < n {
        let to = (r + dist) % n;
        let from = (r + n - dist) % n;
        let m = meta::barrier(round);
        ctx.scope(|s| {
            let sent = s.isend_wire(to, wire, m, &[], "barrier send")?;
            let got = s.irecv_wire(&[from], wire, m, &mut [], "barrier recv")?;
            s.wait_all(&[sent, got])
        })?;
        dist *= 2;
        round += 1;
    }
    Ok(())
}
