//! Collectives through memory the ranks of one host share ([`LocalArea`]): the scheme of
//! DeepSpeed's and vLLM's CPU allreduce. Every rank copies its part into its own slot once;
//! then each reduces, or copies out, straight from the others' slots. No message is sent: a
//! step costs one store of a step number and one look at the others'. The slots are reached
//! only through [`steps`](super::steps), which keeps to the area's rule.
//!
//! Large buffers go through in chunks of a slot each; every chunk is one step (two for a
//! large allreduce: reduce-scatter, then allgather).

use super::steps::Local;
use super::{CollectiveOptions, block_of};
use crate::comm::Comm;
use crate::error::Result;
use crate::transport::LocalArea;
use crate::types::{Element, Fold, OpDesc};
use nix::sys::uio::RemoteIoVec;
use std::io::IoSliceMut;
use std::ops::Range;
use std::time::Instant;

/// Up to this many bytes (times the members), allreduce takes one step: every rank reduces
/// the whole buffer from every slot, in member order, so the results agree bit for bit.
/// Above it, each rank reduces a slice and the others copy it (two steps).
const ONE_STEP_BYTES: usize = 64 << 10;

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
    body: impl FnOnce(&mut Local<'_>) -> Result<R>,
) -> Result<R> {
    let timeout = opts.timeout.unwrap_or(comm.timeout());
    // Refused while another thread's call runs through the area, before this one takes a
    // sequence number; and, once this call holds the area, when the context was aborted.
    let mut l = Local::new(comm, area, what, desc, Instant::now() + timeout, timeout)?;
    comm.next_collective_key(opts.tag)?;
    let result = body(&mut l);
    if let Err(e) = &result {
        comm.fail(e);
    }
    result
}

/// Allreduce of `buf` across the members, in place: [`allreduce_parts`] of one part.
pub(crate) fn allreduce<T: Element>(l: &mut Local<'_>, buf: &mut [T], op: &Fold<'_, T>) -> Result<()> {
    allreduce_parts(l, &mut Parts::new(&mut [buf]), op)
}

/// Buffers taken as one: element `i` of the whole is in the part that holds it, the parts in
/// order. The area's collectives copy straight between the parts and the slots, so a fused
/// batch of tensors needs no buffer of its own.
pub(crate) struct Parts<'p, 'b, T> {
    parts: &'p mut [&'b mut [T]],
    /// Where each part starts in the whole.
    starts: smallvec::SmallVec<[usize; 4]>,
    len: usize,
}

impl<'p, 'b, T: Element> Parts<'p, 'b, T> {
    pub(crate) fn new(parts: &'p mut [&'b mut [T]]) -> Self {
        let mut len = 0;
        let starts = parts
            .iter()
            .map(|p| {
                let at = len;
                len += p.len();
                at
            })
            .collect();
        Parts { parts, starts, len }
    }

    /// Elements in the whole.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The pieces of elements `range` of the whole, in order: each with its range in the whole.
    fn runs(&mut self, range: Range<usize>) -> impl Iterator<Item = (Range<usize>, &mut [T])> {
        // Part i ends where part i + 1 starts: skip those that end before the range.
        let first = self.starts.get(1..).unwrap_or_default().partition_point(|&end| end <= range.start);
        self.parts.iter_mut().zip(&self.starts).skip(first).take_while(move |(_, at)| **at < range.end).filter_map(
            move |(part, &at)| {
                let (from, to) = (range.start.max(at), range.end.min(at + part.len()));
                (from < to).then(|| (from..to, &mut part[from - at..to - at]))
            },
        )
    }

    /// The whole, in a buffer of its own.
    pub(crate) fn to_vec(&self) -> Vec<T> {
        self.parts.concat()
    }

    /// Copies elements `range` of the whole into `dst` (of `range.len()`).
    fn gather(&mut self, range: Range<usize>, dst: &mut [T]) {
        let base = range.start;
        for (r, run) in self.runs(range) {
            dst[r.start - base..r.end - base].copy_from_slice(run);
        }
    }

    /// Copies `src` (of `range.len()`) into elements `range` of the whole.
    pub(crate) fn scatter(&mut self, range: Range<usize>, src: &[T]) {
        let base = range.start;
        for (r, run) in self.runs(range) {
            run.copy_from_slice(&src[r.start - base..r.end - base]);
        }
    }
}

/// Allreduce of the whole of `parts` across the members, in place, copying straight between
/// the parts and the slots. Small wholes take one step (each rank reduces everything, in member
/// order); larger ones two steps per slot-sized chunk: each rank reduces its slice of the
/// chunk, then copies everyone's slices.
pub(crate) fn allreduce_parts<T: Element>(
    l: &mut Local<'_>,
    parts: &mut Parts<'_, '_, T>,
    op: &Fold<'_, T>,
) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let c = l.elems::<T>();
    let len = parts.len();
    let bytes = len * std::mem::size_of::<T>();
    if bytes <= l.slot_bytes() && bytes.saturating_mul(n) <= ONE_STEP_BYTES {
        let t = l.step(|own: &mut [T]| parts.gather(0..len, &mut own[..len]))?;
        for (r, run) in parts.runs(0..len) {
            run.copy_from_slice(t.read(0, r.clone()));
            for m in 1..n {
                op.apply(run, t.read(m, r.clone()));
            }
        }
        return Ok(());
    }
    let mut at = 0;
    while at < len {
        let k = c.min(len - at);
        let t = l.step(|own: &mut [T]| parts.gather(at..at + k, &mut own[..k]))?;
        let mine = block_of(k, n, me);
        // In step u this rank writes only its own slice of its own slot.
        let u = t.next(|own: &mut [T], t| {
            let out = &mut own[mine.clone()];
            out.copy_from_slice(t.read(0, mine.clone()));
            for m in 1..n {
                op.apply(out, t.read(m, mine.clone()));
            }
        })?;
        for m in 0..n {
            let p = block_of(k, n, m);
            parts.scatter(at + p.start..at + p.end, u.read(m, p));
        }
        at += k;
    }
    Ok(())
}

/// Allgather of equal blocks: `output` (n blocks of `input.len()`) gets every member's
/// `input`, in member order (this rank's own block is the caller's to fill). One step per
/// piece ([`Local::piece_elems`]): a member copies its next piece in while the others copy
/// the last one out.
pub(crate) fn allgather<T: Element>(l: &mut Local<'_>, input: &[T], output: &mut [T]) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let (b, c) = (input.len(), l.piece_elems::<T>(input.len()));
    let mut at = 0;
    loop {
        let len = c.min(b - at);
        let t = l.step(|own: &mut [T]| own[..len].copy_from_slice(&input[at..at + len]))?;
        for m in (0..n).filter(|&m| m != me) {
            output[m * b + at..m * b + at + len].copy_from_slice(t.read(m, 0..len));
        }
        at += len;
        if at >= b {
            return Ok(());
        }
    }
}

/// Broadcast of `buf` from member `root`. One step per piece ([`Local::piece_elems`]): the
/// root copies a piece in while the others copy the last one out.
pub(crate) fn broadcast<T: Element>(l: &mut Local<'_>, buf: &mut [T], root: usize) -> Result<()> {
    let me = l.me();
    let c = l.piece_elems::<T>(buf.len());
    let mut at = 0;
    loop {
        let len = c.min(buf.len() - at);
        let chunk = &mut buf[at..at + len];
        let t = l.step(|own: &mut [T]| {
            if me == root {
                own[..len].copy_from_slice(chunk);
            }
        })?;
        if me != root {
            chunk.copy_from_slice(t.read(root, 0..len));
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
pub(crate) fn reduce_scatter<T: Element>(
    l: &mut Local<'_>,
    input: &[T],
    output: &mut [T],
    op: &Fold<'_, T>,
) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let b = output.len();
    let c = (l.elems::<T>() / n).max(1);
    let mut at = 0;
    loop {
        let len = c.min(b - at);
        // Chunk k of block k lies at k·len in the slot.
        let t = l.step(|own: &mut [T]| {
            for k in 0..n {
                own[k * len..(k + 1) * len].copy_from_slice(&input[k * b + at..k * b + at + len]);
            }
        })?;
        let out = &mut output[at..at + len];
        out.copy_from_slice(t.read(0, me * len..me * len + len));
        for m in 1..n {
            op.apply(out, t.read(m, me * len..me * len + len));
        }
        at += len;
        if at >= b {
            return Ok(());
        }
    }
}

/// Barrier: one step.
pub(crate) fn barrier(l: &mut Local<'_>) -> Result<()> {
    l.step::<u8>(|_| {}).map(drop)
}

/// Pieces in which the single-copy allreduce reads and reduces a block (a piece of every
/// member's, then the next: they stay in cache between the read and the reduction).
const PIECE_BYTES: usize = 128 << 10;

/// Pieces in which the single-copy allgather copies a member's input to its own output and
/// on to the others': small enough to stay in any core's L2 cache between the two uses (512
/// KiB and 4 MiB per core on the machines measured), large enough that a write's system call
/// is a small part of it (64 KiB pieces measured 5% slower, 1 MiB 15%).
const PUSH_PIECE_BYTES: usize = 256 << 10;

/// The root's share of a split broadcast ends at a multiple of this many bytes in the
/// member's address space (a page: no page of a member's buffer is copied into by both).
const SPLIT_GRAIN: usize = 4096;

/// The address a member publishes for its buffer `s`.
fn address_of<T>(s: &[T]) -> u64 {
    s.as_ptr() as u64
}

/// Single-copy broadcast of `buf` from member `root`: every member publishes its buffer's
/// address, and every other member reads the root's buffer straight into its own (one copy).
/// With `split` the root shares the copying: it writes the first part of each member's
/// buffer straight into it while they read the rest, about 1/n of the buffer (cut at a page
/// of the member's buffer, which both sides find from its address), so that every member
/// copies about as much, `(n - 1)/n`: two cores copy where one would. Then the root waits
/// until all are done. Two steps, whatever the size.
///
/// A member's buffer is written by the root while its call runs (like a device's DMA into
/// it): the member does not touch the root's part between publishing its address and the
/// last step, and a member whose call fails withdraws before it returns (see
/// [`LocalArea::withdraw`]).
pub(crate) fn broadcast_single<T: Element>(l: &mut Local<'_>, buf: &mut [T], root: usize, split: bool) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let bytes = std::mem::size_of_val(buf);
    // The root's share of the member whose buffer is at `addr`.
    let share = |addr: u64| match split {
        true => {
            let end = (addr + (bytes / n) as u64) / SPLIT_GRAIN as u64 * SPLIT_GRAIN as u64;
            usize::try_from(end.saturating_sub(addr)).unwrap_or(0).min(bytes)
        }
        false => 0,
    };
    let addr = address_of(buf);
    let t = l.step(|own: &mut [u64]| own[0] = addr)?;
    let whole: &mut [u8] = bytemuck::cast_slice_mut(buf);
    if me == root {
        for m in (0..n).filter(|&m| m != root) {
            let to = t.read::<u64>(m, 0..1)[0];
            let part = share(to);
            if part > 0 {
                t.write_member(m, to, &whole[..part])?;
            }
        }
    } else {
        let (from, part) = (t.read::<u64>(root, 0..1)[0], share(addr));
        t.read_member(root, from + part as u64, &mut whole[part..])?;
    }
    // The root's buffer stays as it is until every member has read it, and no member looks
    // at the share the root writes before the root is done.
    t.next::<u8>(|_, _| {})?;
    Ok(())
}

/// Single-copy allgather of equal blocks, pushed: every member publishes its `output`'s
/// address; then, piece by piece of its `input` ([`PUSH_PIECE_BYTES`]), copies the piece
/// into its own block of `output` and writes it straight into every other member's output
/// (`process_vm_writev`), so that each piece is read from memory once and used from the
/// cache after (measured on the 2-core Xeon, 2 ranks: 16 MiB 1543 -> 1340 us, 1 MiB 42 -> 30
/// us against reading the others' inputs). Fills the whole of `output`, this rank's block
/// too. Two steps: the addresses, and every write done (no member reads its output before).
pub(crate) fn allgather_single<T: Element>(l: &mut Local<'_>, input: &[T], output: &mut [T]) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let b = input.len();
    let size = std::mem::size_of::<T>();
    let addr = address_of(output);
    let t = l.step(|own: &mut [u64]| own[0] = addr)?;
    let piece = (PUSH_PIECE_BYTES / size).max(1);
    let mut at = 0;
    while at < b {
        let k = piece.min(b - at);
        let src = &input[at..at + k];
        output[me * b + at..me * b + at + k].copy_from_slice(src);
        // Each member starts with the next one's output: n - 1 writers, n - 1 destinations.
        for m in (1..n).map(|d| (me + d) % n) {
            let to = t.read::<u64>(m, 0..1)[0] + ((me * b + at) * size) as u64;
            t.write_member(m, to, bytemuck::cast_slice(src))?;
        }
        at += k;
    }
    // No member's output is read (returned) before every member has written its block.
    t.next::<u8>(|_, _| {})?;
    Ok(())
}

/// Single-copy allreduce of `buf`, in place: [`allreduce_single_parts`] of one part.
pub(crate) fn allreduce_single<T: Element>(l: &mut Local<'_>, buf: &mut [T], op: &Fold<'_, T>) -> Result<()> {
    allreduce_single_parts(l, &mut Parts::new(&mut [buf]), op)
}

/// Where another member's parts lie in its memory, in order: each non-empty run's address,
/// and where it starts and ends in the whole (as it published them in its slot: a count, then
/// an address and a length in elements per run).
struct Remote {
    runs: smallvec::SmallVec<[(usize, Range<usize>); 4]>,
}

impl Remote {
    /// Reads member `m`'s runs from the slot `words`: their lengths must add up to `len`
    /// elements of `size` bytes, and each must lie in the address space.
    fn of(words: &[u64], m: usize, len: usize, size: usize) -> Result<Self> {
        let bad = || crate::error::Error::Protocol {
            peer: None,
            detail: format!(
                "allreduce: member {m} of the host's area published runs of its buffers that do not add up to the call's {len} elements"
            ),
        };
        let count = usize::try_from(words[0]).map_err(|_| bad())?;
        let list =
            words.get(1..count.checked_mul(2).and_then(|c| c.checked_add(1)).ok_or_else(bad)?).ok_or_else(bad)?;
        let mut at = 0usize;
        let mut runs = smallvec::SmallVec::new();
        for w in list.chunks_exact(2) {
            let k = usize::try_from(w[1]).map_err(|_| bad())?;
            let end = at.checked_add(k).filter(|&e| e <= len).ok_or_else(bad)?;
            let base = usize::try_from(w[0]).map_err(|_| bad())?;
            k.checked_mul(size).and_then(|bytes| base.checked_add(bytes)).ok_or_else(bad)?;
            if k > 0 {
                runs.push((base, at..end));
            }
            at = end;
        }
        if at != len {
            return Err(bad());
        }
        Ok(Remote { runs })
    }

    /// The runs of the member's memory that hold elements `range` of the whole, in order.
    fn at(&self, range: Range<usize>, size: usize) -> smallvec::SmallVec<[RemoteIoVec; 4]> {
        let first = self.runs.partition_point(|(_, r)| r.end <= range.start);
        self.runs[first..]
            .iter()
            .take_while(|(_, r)| r.start < range.end)
            .filter_map(|(base, r)| {
                let (from, to) = (range.start.max(r.start), range.end.min(r.end));
                // Within the run, which `of` checked lies in the address space.
                (from < to).then(|| RemoteIoVec { base: base + (from - r.start) * size, len: (to - from) * size })
            })
            .collect()
    }
}

/// Single-copy allreduce of the whole of `parts`, in place. Every member publishes where its
/// parts lie; each reduces its block of the whole (as [`block_of`] cuts it), reading every
/// member's piece of it straight from that member's parts, in member order (so the results
/// agree bit for bit), and writes the result into its own parts; then each reads the others'
/// results straight into its parts. The members may cut the whole into parts differently. A
/// member with more parts than its slot can list gathers them into one buffer of its own
/// first and copies the result back after (what it does is its own: the others read one
/// part). Three steps: the addresses, the blocks reduced (no member reads a block that is
/// still being written: in the first phase a member reads only the others' blocks of each
/// buffer, never the one its owner writes), and every read done.
pub(crate) fn allreduce_single_parts<T: Element>(
    l: &mut Local<'_>,
    parts: &mut Parts<'_, '_, T>,
    op: &Fold<'_, T>,
) -> Result<()> {
    // A count, then an address and a length per part.
    if 2 * parts.parts.len() < l.slot_bytes() / 8 {
        return allreduce_single_listed(l, parts, op);
    }
    let mut packed = parts.to_vec();
    allreduce_single_listed(l, &mut Parts::new(&mut [&mut packed[..]]), op)?;
    parts.scatter(0..packed.len(), &packed);
    Ok(())
}

/// [`allreduce_single_parts`] of parts that this rank's slot can list.
fn allreduce_single_listed<T: Element>(
    l: &mut Local<'_>,
    mine_parts: &mut Parts<'_, '_, T>,
    op: &Fold<'_, T>,
) -> Result<()> {
    let (n, me) = (l.n(), l.me());
    let len = mine_parts.len();
    let size = std::mem::size_of::<T>();
    let words = l.slot_bytes() / 8;
    let t = l.step(|own: &mut [u64]| {
        own[0] = mine_parts.parts.len() as u64;
        for (i, p) in mine_parts.parts.iter().enumerate() {
            own[1 + 2 * i] = address_of(p);
            own[2 + 2 * i] = p.len() as u64;
        }
    })?;
    let remotes = (0..n)
        .map(|m| match m == me {
            true => Ok(Remote { runs: smallvec::SmallVec::new() }),
            false => Remote::of(t.read::<u64>(m, 0..words), m, len, size),
        })
        .collect::<Result<Vec<_>>>()?;
    let mine = block_of(len, n, me);
    let piece = (PIECE_BYTES / size).max(1).min(mine.len());
    let (mut acc, mut got) = (vec![T::zeroed(); piece], vec![T::zeroed(); piece]);
    let mut at = mine.start;
    while at < mine.end {
        let k = piece.min(mine.end - at);
        let (acc, got) = (&mut acc[..k], &mut got[..k]);
        for (m, remote) in remotes.iter().enumerate() {
            let into = if m == 0 { &mut *acc } else { &mut *got };
            if m == me {
                mine_parts.gather(at..at + k, into);
            } else {
                let into = bytemuck::cast_slice_mut(into);
                t.read_member_runs(m, &remote.at(at..at + k, size), &mut [IoSliceMut::new(into)])?;
            }
            if m > 0 {
                op.apply(acc, got);
            }
        }
        mine_parts.scatter(at..at + k, acc);
        at += k;
    }
    // Every block is reduced, in its owner's parts.
    let u = t.next::<u8>(|_, _| {})?;
    for (m, remote) in remotes.iter().enumerate().filter(|&(m, _)| m != me) {
        let p = block_of(len, n, m);
        let mut into: smallvec::SmallVec<[IoSliceMut<'_>; 4]> =
            mine_parts.runs(p.clone()).map(|(_, run)| IoSliceMut::new(bytemuck::cast_slice_mut(run))).collect();
        u.read_member_runs(m, &remote.at(p, size), &mut into)?;
    }
    u.next::<u8>(|_, _| {})?;
    Ok(())
}
