//! Collectives through memory the ranks of one host share ([`LocalArea`]): the scheme of
//! DeepSpeed's and vLLM's CPU allreduce. Every rank copies its part into its own slot once;
//! then each reduces, or copies out, straight from the others' slots. No message is sent: a
//! step costs one store of a step number and one look at the others'.
//!
//! Large buffers go through in chunks of a slot each; every chunk is one step (two for a
//! large allreduce: reduce-scatter, then allgather).

use super::{CollectiveOptions, partition};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::transport::{AreaWait, BusyWait, LocalArea};
use crate::types::{Element, OpDesc, ReduceOp};
use std::time::{Duration, Instant};

/// Up to this many bytes (times the members), allreduce takes one step: every rank reduces
/// the whole buffer from every slot, in member order, so the results agree bit for bit.
/// Above it, each rank reduces a slice and the others copy it (two steps).
const ONE_STEP_BYTES: usize = 64 << 10;

/// One collective call through an area.
pub(crate) struct Local<'a> {
    area: &'a dyn LocalArea,
    desc: OpDesc,
    deadline: Instant,
    timeout: Duration,
    busy: BusyWait,
    what: &'static str,
}

/// Runs `body` as the collective `desc` through `area`, for `comm`'s ranks (the members of the
/// area, or a superset for the hierarchical allreduce). Takes the tag's next sequence number
/// like every collective, one deadline for the whole call; a failure aborts `comm` and tells
/// every peer, as for the other algorithms.
pub(crate) fn run<R>(
    comm: &Comm,
    area: &dyn LocalArea,
    what: &'static str,
    desc: OpDesc,
    opts: &CollectiveOptions,
    body: impl FnOnce(&Local<'_>) -> Result<R>,
) -> Result<R> {
    comm.check_usable()?;
    comm.next_collective_key(opts.tag)?;
    let timeout = opts.timeout.unwrap_or(comm.timeout());
    let l = Local { area, desc, deadline: Instant::now() + timeout, timeout, busy: comm.shared().spin, what };
    let result = body(&l);
    if let Err(e) = &result {
        comm.fail(e);
    }
    result
}

impl<'a> Local<'a> {
    /// A call through `area` of `comm`'s ranks, without `run`'s bookkeeping (for an algorithm
    /// that does it itself: the hierarchical allreduce).
    pub(crate) fn new(
        comm: &Comm,
        area: &'a dyn LocalArea,
        what: &'static str,
        desc: OpDesc,
        deadline: Instant,
        timeout: Duration,
    ) -> Self {
        Local { area, desc, deadline, timeout, busy: comm.shared().spin, what }
    }

    /// Members of the area.
    fn n(&self) -> usize {
        self.area.members().len()
    }

    /// This rank's index among them.
    fn me(&self) -> usize {
        self.area.me()
    }

    /// Elements of `T` in a slot.
    fn elems<T>(&self) -> usize {
        (self.area.slot_bytes() / std::mem::size_of::<T>().max(1)).max(1)
    }

    /// One step: `write` fills this rank's slot of the step (given the step), then this rank
    /// arrives and waits for the others. Returns the step, whose slots may be read until the
    /// next step.
    fn step(&self, write: impl FnOnce(u64)) -> Result<u64> {
        let t = self.area.next_step();
        write(t);
        self.area.arrive(t, &self.desc);
        self.area.wait_all(t, &self.desc, self.deadline, self.busy).map_err(|w| self.error(w))?;
        Ok(t)
    }

    fn error(&self, w: AreaWait) -> Error {
        let me = self.area.members()[self.me()];
        match w {
            AreaWait::Late(ranks) => Error::Timeout {
                op: format!("{} through shared memory on rank {me}", self.what),
                ranks,
                keys: Vec::new(),
                waited: self.timeout,
            },
            AreaWait::Disagree(rank, theirs) => {
                Error::Mismatch { rank, detail: OpDesc::explain(me, &self.desc, rank, &theirs) }
            }
            AreaWait::Failed(Error::PeerClosed { rank, op, detail }) if op.is_empty() => {
                Error::PeerClosed { rank, op: self.what.to_string(), detail }
            }
            AreaWait::Failed(e) => e,
        }
    }

    /// Member `m`'s slot of step `t`, `len` elements of `T` from element `from`.
    ///
    /// # Safety
    /// The caller follows the area's rule: it reads another member's slot only between
    /// `wait_all(t)` and its arrival at `t + 1`, and writes only its own, of the step it is
    /// about to arrive at. `from + len` elements fit the slot.
    unsafe fn slot<'s, T: Element>(&self, m: usize, t: u64, from: usize, len: usize) -> &'s mut [T] {
        debug_assert!((from + len) * std::mem::size_of::<T>() <= self.area.slot_bytes());
        // SAFETY: the slot is 64-byte aligned (so aligned for every element type) and holds
        // `from + len` elements (the caller's contract); no other rank writes it while the
        // caller may touch it (the area's rule), and any bit pattern is a valid `T`.
        unsafe { std::slice::from_raw_parts_mut(self.area.slot(m, t).cast::<T>().add(from), len) }
    }
}

/// Allreduce of `buf` across the members, in place. Small buffers take one step (each rank
/// reduces everything, in member order); larger ones two steps per slot-sized chunk: each rank
/// reduces its slice of the chunk, then copies everyone's slices.
pub(crate) fn allreduce<T: Element>(l: &Local<'_>, buf: &mut [T], op: &ReduceOp<T>) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let c = l.elems::<T>();
    let bytes = std::mem::size_of_val(buf);
    if bytes <= l.area.slot_bytes() && bytes.saturating_mul(n) <= ONE_STEP_BYTES {
        let len = buf.len();
        // SAFETY (all slot accesses): this rank's slot of step t is written before arriving
        // at t; the others' are read after wait_all(t), before the next step.
        let t = l.step(|t| unsafe { l.slot::<T>(me, t, 0, len) }.copy_from_slice(buf))?;
        buf.copy_from_slice(unsafe { l.slot::<T>(0, t, 0, len) });
        for m in 1..n {
            op.apply(buf, unsafe { l.slot::<T>(m, t, 0, len) });
        }
        return Ok(());
    }
    for chunk in buf.chunks_mut(c) {
        let len = chunk.len();
        // SAFETY: as above; in step u this rank writes only its own slice of its own slot.
        let t = l.step(|t| unsafe { l.slot::<T>(me, t, 0, len) }.copy_from_slice(chunk))?;
        let parts = partition(len, n);
        let mine = parts[me].clone();
        let u = l.step(|u| {
            let out = unsafe { l.slot::<T>(me, u, mine.start, mine.len()) };
            out.copy_from_slice(unsafe { l.slot::<T>(0, t, mine.start, mine.len()) });
            for m in 1..n {
                op.apply(out, unsafe { l.slot::<T>(m, t, mine.start, mine.len()) });
            }
        })?;
        for (m, p) in parts.iter().enumerate() {
            chunk[p.clone()].copy_from_slice(unsafe { l.slot::<T>(m, u, p.start, p.len()) });
        }
    }
    Ok(())
}

/// Allgather of equal blocks: `output` (n blocks of `input.len()`) gets every member's
/// `input`, in member order (this rank's own block is the caller's to fill). One step per
/// slot-sized chunk.
pub(crate) fn allgather<T: Element>(l: &Local<'_>, input: &[T], output: &mut [T]) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let (b, c) = (input.len(), l.elems::<T>());
    let mut at = 0;
    loop {
        let len = c.min(b - at);
        // SAFETY: as in `allreduce`.
        let t = l.step(|t| unsafe { l.slot::<T>(me, t, 0, len) }.copy_from_slice(&input[at..at + len]))?;
        for m in (0..n).filter(|&m| m != me) {
            output[m * b + at..m * b + at + len].copy_from_slice(unsafe { l.slot::<T>(m, t, 0, len) });
        }
        at += len;
        if at >= b {
            return Ok(());
        }
    }
}

/// Broadcast of `buf` from member `root`. One step per slot-sized chunk.
pub(crate) fn broadcast<T: Element>(l: &Local<'_>, buf: &mut [T], root: usize) -> Result<()> {
    let me = l.me();
    let c = l.elems::<T>();
    let mut at = 0;
    loop {
        let len = c.min(buf.len() - at);
        let chunk = &mut buf[at..at + len];
        // SAFETY: as in `allreduce`.
        let t = l.step(|t| {
            if me == root {
                unsafe { l.slot::<T>(me, t, 0, len) }.copy_from_slice(chunk);
            }
        })?;
        if me != root {
            chunk.copy_from_slice(unsafe { l.slot::<T>(root, t, 0, len) });
        }
        at += len;
        if at >= buf.len() {
            return Ok(());
        }
    }
}

/// Reduce-scatter of equal blocks: `input` is n blocks of `output.len()`; this rank's
/// `output` gets block `me` reduced over every member, in member order. One step per chunk
/// (a chunk of every block fills a slot).
pub(crate) fn reduce_scatter<T: Element>(l: &Local<'_>, input: &[T], output: &mut [T], op: &ReduceOp<T>) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let b = output.len();
    let c = (l.elems::<T>() / n).max(1);
    let mut at = 0;
    loop {
        let len = c.min(b - at);
        // SAFETY: as in `allreduce`; chunk k of block k lies at k·len in the slot.
        let t = l.step(|t| {
            let slot = unsafe { l.slot::<T>(me, t, 0, n * len) };
            for k in 0..n {
                slot[k * len..(k + 1) * len].copy_from_slice(&input[k * b + at..k * b + at + len]);
            }
        })?;
        let out = &mut output[at..at + len];
        out.copy_from_slice(unsafe { l.slot::<T>(0, t, me * len, len) });
        for m in 1..n {
            op.apply(out, unsafe { l.slot::<T>(m, t, me * len, len) });
        }
        at += len;
        if at >= b {
            return Ok(());
        }
    }
}

/// Barrier: one step.
pub(crate) fn barrier(l: &Local<'_>) -> Result<()> {
    l.step(|_| {}).map(drop)
}
