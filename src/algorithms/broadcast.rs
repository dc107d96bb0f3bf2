//! Broadcast: binomial tree for small messages, a pipelined chain for large ones.

use super::{Coll, Seg, segments};
use crate::error::Result;

/// Binomial tree from `root`: ⌈log₂ n⌉ steps; the root sends the whole buffer ⌈log₂ n⌉ times.
pub(crate) fn tree<T>(c: &Coll<'_, '_>, buf: Seg<T>, root: usize) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let vr = (r + n - root) % n;
    let real = |v: usize| (v + root) % n;
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            // SAFETY: nothing else touches `buf` until this receive completes.
            let got = unsafe { c.recv(real(vr - mask), buf)? };
            c.wait(got)?;
            break;
        }
        mask <<= 1;
    }
    let mut sends = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if vr + mask < n {
            // SAFETY: `buf` is complete and only read from here on.
            sends.push(unsafe { c.send(real(vr + mask), buf)? });
        }
        mask >>= 1;
    }
    c.wait_all(sends)
}

/// A chain root → root+1 → … pipelined in segments: n-1+S-1 segment steps for S segments; every
/// rank but the last sends the buffer once.
pub(crate) fn pipeline<T>(c: &Coll<'_, '_>, buf: Seg<T>, root: usize, seg: usize) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let vr = (r + n - root) % n;
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let whole = 0..buf.len();
    let mut sends = Vec::new();
    if vr == 0 {
        for s in segments(&whole, seg) {
            // SAFETY: the root's buffer is only read.
            sends.push(unsafe { c.send(next, buf.sub(s))? });
        }
        return c.wait_all(sends);
    }
    let mut recvs = Vec::new();
    for s in segments(&whole, seg) {
        // SAFETY: segments are disjoint; each is sent on only after its receive completed.
        recvs.push((unsafe { c.recv(prev, buf.sub(s.clone()))? }, s));
    }
    for (got, s) in recvs {
        c.wait(got)?;
        if vr + 1 < n {
            // SAFETY: the segment is complete and not written again.
            sends.push(unsafe { c.send(next, buf.sub(s))? });
        }
    }
    c.wait_all(sends)
}
