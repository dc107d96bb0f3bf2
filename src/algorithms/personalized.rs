//! Gather, scatter and all-to-all: every block goes straight from its sender to its receiver.

use super::{Around, Coll, Receives, Sends, Upward};
use crate::error::Result;
use bytemuck::Pod;
use std::ops::Range;

/// The root receives block i of `out` from rank i (its own block is already there: the caller
/// copies it). One step; the root receives everything, the others send once.
pub(crate) fn gather<T: Pod>(
    c: &Coll<'_>,
    input: &[T],
    out: &mut [T],
    blocks: &[Range<usize>],
    root: usize,
) -> Result<()> {
    let r = c.rank();
    c.phase(|p| {
        if r != root {
            let s = p.send(root, input)?;
            return p.wait(s);
        }
        // The blocks are disjoint parts of `out`, each written by one receive.
        let mut runs = Upward::new(out);
        let mut recvs = Receives::new();
        for (peer, b) in blocks.iter().enumerate().filter(|&(p, _)| p != root) {
            recvs.push(p.recv(peer, runs.cut(b.clone()))?);
        }
        recvs.into_iter().try_for_each(|got| p.filled(got).map(drop))
    })
}

/// The root sends block i of `input` to rank i; every rank's `out` gets its block.
pub(crate) fn scatter<T: Pod>(
    c: &Coll<'_>,
    input: &[T],
    out: &mut [T],
    blocks: &[Range<usize>],
    root: usize,
) -> Result<()> {
    let r = c.rank();
    if r == root {
        out.copy_from_slice(&input[blocks[root].clone()]);
    }
    c.phase(|p| {
        if r != root {
            let got = p.recv(root, out)?;
            return p.filled(got).map(drop);
        }
        let mut sends = Sends::new();
        for (peer, b) in blocks.iter().enumerate().filter(|&(peer, _)| peer != root) {
            sends.push(p.send(peer, &input[b.clone()])?);
        }
        p.wait_all(sends)
    })
}

/// Every rank sends block p of `input` to rank p and receives rank p's block into block p of
/// `out` (its own block is already there: the caller copies it). One step of n-1 sends and
/// n-1 receives per rank, peers visited in a rotated order so no rank is everyone's first
/// target.
pub(crate) fn alltoall<T: Pod>(
    c: &Coll<'_>,
    input: &[T],
    send_blocks: &[Range<usize>],
    out: &mut [T],
    recv_blocks: &[Range<usize>],
) -> Result<()> {
    let (r, n) = (c.rank(), c.size());
    c.phase(|p| {
        // Disjoint blocks of `out`, one receive each, from rank r-1 down and around to r+1;
        // `input` is only read.
        let (mut runs, _) = Around::new(out, r, recv_blocks[r].clone());
        let mut recvs = Receives::new();
        for f in (1..n).map(|i| (r + n - i) % n) {
            recvs.push(p.recv(f, runs.take(f, recv_blocks[f].clone()))?);
        }
        let mut sends = Sends::new();
        for i in 1..n {
            let to = (r + i) % n;
            sends.push(p.send(to, &input[send_blocks[to].clone()])?);
        }
        for got in recvs {
            p.filled(got)?;
        }
        p.wait_all(sends)
    })
}
