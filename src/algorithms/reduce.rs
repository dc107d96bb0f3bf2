//! Reduce to a root: binomial tree.

use super::Coll;
use crate::error::Result;
use crate::types::{Element, Fold};

/// Binomial tree towards `root`: ⌈log₂ n⌉ steps; an inner node receives one buffer per child
/// and sends one. The root's `buf` gets the result; other ranks' buffers are left unchanged.
pub(crate) fn tree<T: Element>(c: &Coll<'_>, buf: &mut [T], root: usize, op: &Fold<'_, T>) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let vr = (r + n - root) % n;
    let real = |v: usize| (v + root) % n;
    // Children of vr: vr + 2^i for every 2^i below vr's lowest set bit (all, for the root).
    let has_children = (0..usize::BITS).map(|i| 1usize << i).take_while(|&m| vr & m == 0 && m < n).any(|m| vr + m < n);
    // A non-root with children folds into a copy, so its caller's buffer stays unchanged.
    let len = buf.len();
    let mut own = (vr != 0 && has_children).then(|| c.scratch::<T>(len));
    let acc: &mut [T] = match &mut own {
        Some(own) => {
            own.copy_from_slice(buf);
            own
        }
        None => buf,
    };
    let mut tmp = c.scratch::<T>(if has_children { len } else { 0 });
    c.phase(|p| {
        let mut tmp: &mut [T] = &mut tmp;
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                // `acc` is final and only read by this send.
                let s = p.send(real(vr - mask), &*acc)?;
                return p.wait(s);
            }
            if vr + mask < n {
                // `tmp` is private scratch, read only after the receive completes.
                let got = p.recv(real(vr + mask), tmp)?;
                tmp = p.filled(got)?;
                op.apply(acc, tmp);
            }
            mask <<= 1;
        }
        Ok(())
    })
}
