//! Reduce to a root: binomial tree.

use super::{Coll, Seg};
use crate::error::Result;
use crate::types::{Element, ReduceOp};

/// Binomial tree towards `root`: ⌈log₂ n⌉ steps; an inner node receives one buffer per child
/// and sends one. The root's `buf` gets the result; other ranks' buffers are left unchanged.
pub(crate) fn tree<T: Element>(c: &Coll<'_, '_>, buf: Seg<T>, root: usize, op: &ReduceOp<T>) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let vr = (r + n - root) % n;
    let real = |v: usize| (v + root) % n;
    // Children of vr: vr + 2^i for every 2^i below vr's lowest set bit (all, for the root).
    let has_children = (0..usize::BITS).map(|i| 1usize << i).take_while(|&m| vr & m == 0 && m < n).any(|m| vr + m < n);
    // A non-root with children folds into a copy, so its caller's buffer stays unchanged.
    let acc = if vr == 0 || !has_children {
        buf
    } else {
        let own = c.scratch::<T>(buf.len());
        // SAFETY: no operation is pending on either yet.
        unsafe { own.get_mut().copy_from_slice(buf.get()) };
        own
    };
    let tmp = c.scratch::<T>(if has_children { buf.len() } else { 0 });
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            // SAFETY: `acc` is final and only read by this send, waited for below.
            let s = unsafe { c.send(real(vr - mask), acc)? };
            return c.wait(s);
        }
        if vr + mask < n {
            // SAFETY: `tmp` is private scratch, read only after the receive completes.
            let got = unsafe { c.recv(real(vr + mask), tmp)? };
            c.wait(got)?;
            // SAFETY: both complete; nothing pending on either.
            unsafe { op.apply(acc.get_mut(), tmp.get()) };
        }
        mask <<= 1;
    }
    Ok(())
}
