//! Broadcast: binomial tree for small messages, a pipelined chain for large ones.

use super::{Coll, Receives, Sends, segment_runs, segments};
use crate::error::Result;
use bytemuck::Pod;

/// Binomial tree from `root`: ⌈log₂ n⌉ steps; the root sends the whole buffer ⌈log₂ n⌉ times.
pub(crate) fn tree<T: Pod>(c: &Coll<'_>, buf: &mut [T], root: usize) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let vr = (r + n - root) % n;
    let real = |v: usize| (v + root) % n;
    // The parent: the rank below at this rank's lowest set bit (none for the root).
    let mut mask = 1;
    while mask < n && vr & mask == 0 {
        mask <<= 1;
    }
    let parent = (mask < n).then(|| real(vr - mask));
    c.phase(|p| {
        // Nothing else touches `buf` until the receive completes; it is only read after.
        let buf: &[T] = match parent {
            Some(parent) => {
                let got = p.recv(parent, buf)?;
                p.filled(got)?
            }
            None => buf,
        };
        let mut sends = Sends::new();
        let mut mask = mask >> 1;
        while mask > 0 {
            if vr + mask < n {
                sends.push(p.send(real(vr + mask), buf)?);
            }
            mask >>= 1;
        }
        p.wait_all(sends)
    })
}

/// A chain root → root+1 → … pipelined in segments: n-1+S-1 segment steps for S segments; every
/// rank but the last sends the buffer once.
pub(crate) fn pipeline<T: Pod>(c: &Coll<'_>, buf: &mut [T], root: usize, seg: usize) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let vr = (r + n - root) % n;
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let whole = 0..buf.len();
    c.phase(|p| {
        let mut sends = Sends::new();
        if vr == 0 {
            // The root's buffer is only read.
            let buf: &[T] = buf;
            for s in segments(whole, seg) {
                sends.push(p.send(next, &buf[s])?);
            }
            return p.wait_all(sends);
        }
        let mut recvs = Receives::new();
        for (_, s) in segment_runs(buf, whole, seg) {
            recvs.push(p.recv(prev, s)?);
        }
        for got in recvs {
            let s = p.filled(got)?;
            // The segment is complete and not written again.
            if vr + 1 < n {
                sends.push(p.send(next, &*s)?);
            }
        }
        p.wait_all(sends)
    })
}
