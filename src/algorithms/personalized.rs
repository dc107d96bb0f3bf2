//! Gather, scatter and all-to-all: every block goes straight from its sender to its receiver.

use super::{Coll, Seg};
use crate::error::Result;
use std::ops::Range;

/// The root receives block i of `out` from rank i (its own block is already there: the caller
/// copies it while `out` is a plain slice). One step; the root receives everything, the others
/// send once.
pub(crate) fn gather<T: Copy>(
    c: &Coll<'_, '_>,
    input: &[T],
    out: Seg<T>,
    blocks: &[Range<usize>],
    root: usize,
) -> Result<()> {
    let r = c.rank();
    if r != root {
        // SAFETY: `input` is borrowed for this call and only read; the send is waited below.
        let s = unsafe { c.send(root, Seg::of(input))? };
        return c.wait(s);
    }
    let mut recvs = Vec::new();
    for (p, b) in blocks.iter().enumerate().filter(|&(p, _)| p != root) {
        // SAFETY: the blocks are disjoint parts of `out`, each written by one receive.
        recvs.push(unsafe { c.recv(p, out.sub(b.clone()))? });
    }
    c.wait_all(recvs)
}

/// The root sends block i of `input` to rank i; every rank's `out` gets its block.
pub(crate) fn scatter<T: Copy>(
    c: &Coll<'_, '_>,
    input: &[T],
    out: &mut [T],
    blocks: &[Range<usize>],
    root: usize,
) -> Result<()> {
    let r = c.rank();
    if r != root {
        let got = unsafe {
            // SAFETY: `out` is exclusively borrowed for this call and waited for below.
            c.recv(root, Seg::new(out))?
        };
        return c.wait(got);
    }
    out.copy_from_slice(&input[blocks[root].clone()]);
    let mut sends = Vec::new();
    for (p, b) in blocks.iter().enumerate().filter(|&(p, _)| p != root) {
        // SAFETY: the root's input is borrowed for this call and only read.
        sends.push(unsafe { c.send(p, Seg::of(&input[b.clone()]))? });
    }
    c.wait_all(sends)
}

/// Every rank sends block p of `input` to rank p and receives rank p's block into block p of
/// `out` (its own block is already there: the caller copies it while `out` is a plain slice).
/// One step of n-1 sends and n-1 receives per rank, peers visited in a rotated order so no
/// rank is everyone's first target.
pub(crate) fn alltoall<T: Copy>(
    c: &Coll<'_, '_>,
    input: Seg<T>,
    send_blocks: &[Range<usize>],
    out: Seg<T>,
    recv_blocks: &[Range<usize>],
) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    let mut ops = Vec::new();
    for i in 1..n {
        let from = (r + n - i) % n;
        // SAFETY: disjoint blocks of `out`, one receive each.
        ops.push(unsafe { c.recv(from, out.sub(recv_blocks[from].clone()))? });
    }
    for i in 1..n {
        let to = (r + i) % n;
        // SAFETY: `input` is only read.
        ops.push(unsafe { c.send(to, input.sub(send_blocks[to].clone()))? });
    }
    c.wait_all(ops)
}
