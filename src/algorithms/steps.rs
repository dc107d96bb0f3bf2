//! One collective call through a same-host area ([`LocalArea`]), with the area's step rule
//! made into types: the only raw memory access of the algorithms.
//!
//! The rule ([`LocalArea`]): a member writes its slot of step `t` only after `wait_all(t - 1)`
//! returned and before it arrives at `t`; it reads the others' slots of step `t` only after
//! `wait_all(t)` returned and before it arrives at `t + 1`. Here:
//!
//! - this rank's slot is written only inside [`Local::step`] (and [`Local::step_then`], the
//!   same with a call between the arrival and the wait) and [`Step::next`], through a
//!   `&mut [T]` that lives for the `write` closure they run just before arriving (every earlier
//!   step of this area was waited for: a [`Step`] exists only once its `wait_all` returned, and
//!   a call that failed a wait, or that a panic left (a custom fold that panicked), aborts the
//!   communicator ([`Local`]'s drop), so no later call takes a step: [`Local::new`] looks at the
//!   abort state once it holds the area);
//! - a slot of step `t` is read only through a [`Step`] of `t`, as `&[T]` borrowed from it;
//!   arriving at `t + 1` consumes it ([`Step::next`]), and a fresh step needs the `&mut Local`
//!   the [`Step`] borrows, so no view of `t` outlives the arrival at `t + 1`.
//!
//! So a slot is never written while another member may read it, nor read while its owner may
//! write it. The synchronisation itself (the release store of the step number, the acquire
//! loads that see it) is the area's, unchanged; what makes sharing sound across processes is
//! that rule, exercised on every backend by the shared-memory cases of `tests/collectives.rs`.
//!
//! Single-copy collectives also read and write the members' own buffers, straight
//! ([`Step::read_member`], [`Step::write_member`]), at addresses published in a step of the
//! call, for bytes the owner leaves alone until a later step. A call that fails (a wait, a
//! copy, a panic) withdraws this rank before its buffers go back to the caller
//! ([`LocalArea::withdraw`]): no member writes into them after that, and a read that ended
//! after it fails.

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::transport::{AreaWait, BusyWait, LocalArea};
use crate::types::{Element, OpDesc};
use nix::sys::uio::RemoteIoVec;
use std::io::IoSliceMut;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Pieces a pipelined collective's buffer is cut into ([`Local::piece_elems`]).
const PIECES: usize = 16;
/// The smallest piece (smaller ones cost more in steps than they gain in overlap).
const PIECE_MIN_BYTES: usize = 64 << 10;

/// One collective call through an area: its steps go through `&mut self`, one at a time.
pub(crate) struct Local<'a> {
    area: &'a dyn LocalArea,
    /// The communicator to abort if a panic leaves the call half done (`None` in unit tests).
    comm: Option<&'a Comm>,
    /// Held while the call runs (see [`World::area_busy`](crate::comm::World)).
    busy_flag: &'a AtomicBool,
    desc: OpDesc,
    deadline: Instant,
    timeout: Duration,
    busy: BusyWait,
    /// Whether pipelined collectives go in pieces ([`World::area_pieces`](crate::comm::World)).
    pieces: bool,
    what: &'static str,
}

impl Drop for Local<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.busy_flag.store(false, Ordering::Release);
            return;
        }
        // A panic left the call: no member may write into this rank's buffers any more.
        self.leave();
        if let Some(comm) = self.comm {
            // A panic left the call between steps: the members' step numbers no longer agree,
            // and a later call of this rank would take steps the others read as this one's.
            let rank = comm.world_rank(comm.rank()).unwrap_or(comm.rank());
            comm.fail(&Error::Aborted {
                rank,
                reason: format!("{} on rank {rank} panicked inside the shared-memory area", self.what),
            });
        }
        self.busy_flag.store(false, Ordering::Release);
    }
}

impl<'a> Local<'a> {
    /// A call `desc` through `area` of `comm`'s ranks, ending at `deadline` (`timeout` after
    /// its start). Only one call goes through an area at a time: its steps are numbered per
    /// area, so a second call from another thread of this rank (collectives of tag 0 on two
    /// threads at once, which the ranks could not order alike anyway) would write slots the first
    /// reads. It is refused instead, before it takes a sequence number or sends anything.
    #[inline]
    pub(crate) fn new(
        comm: &'a Comm,
        area: &'a dyn LocalArea,
        what: &'static str,
        desc: OpDesc,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Self> {
        let busy_flag = &comm.shared().area_busy;
        if busy_flag.swap(true, Ordering::Acquire) {
            return Err(Error::invalid(format!(
                "{what} on rank {}: another collective of tag 0 is running through this host's \
                 shared-memory area (from another thread): collectives of one tag run one at a time, \
                 in the same order on every rank; give concurrent collectives different tags",
                comm.rank()
            )));
        }
        let pieces = comm.shared().area_pieces.load(Ordering::Relaxed);
        let local = Local {
            area,
            comm: Some(comm),
            busy_flag,
            desc,
            deadline,
            timeout,
            busy: comm.shared().spin,
            pieces,
            what,
        };
        // A call that failed (or panicked) in the area aborted the communicator before it let go
        // of the area: looked at only now, no call slips in between.
        comm.check_usable()?;
        Ok(local)
    }

    /// Members of the area.
    #[inline]
    pub(crate) fn n(&self) -> usize {
        self.area.members().len()
    }

    /// This rank's index among them.
    #[inline]
    pub(crate) fn me(&self) -> usize {
        self.area.me()
    }

    /// Elements of `T` in a slot.
    #[inline]
    pub(crate) fn elems<T>(&self) -> usize {
        (self.area.slot_bytes() / std::mem::size_of::<T>().max(1)).max(1)
    }

    /// Elements of `T` per step for a pipelined collective of `len` elements (a member copies
    /// one piece into its slot while the others copy the last one out): about a sixteenth of
    /// the buffer, 64 KiB at least and a slot at most, where the host's ranks each have a core
    /// to wait on (a step then costs a look at the others' words); a whole slot where they
    /// outnumber the cores (a step costs a yield or a sleep, so fewer are better). The host's
    /// first rank says which as the context forms, for all (ranks pinned to different numbers
    /// of cores could not cut a buffer alike otherwise). Measured with `ferrogloo-bench
    /// --transport shm --op broadcast` on the 2-core machine: a 1 MiB 2-rank broadcast took
    /// 19 µs in 64 KiB pieces, 37 µs in one; at 4 ranks, 64 KiB pieces made 64 MiB 40% slower
    /// than slots.
    #[inline]
    pub(crate) fn piece_elems<T>(&self, len: usize) -> usize {
        let slot = self.elems::<T>();
        if !self.pieces {
            return slot;
        }
        let least = (PIECE_MIN_BYTES / std::mem::size_of::<T>().max(1)).max(1);
        (len / PIECES).clamp(least.min(slot), slot)
    }

    /// Bytes in a slot.
    #[inline]
    pub(crate) fn slot_bytes(&self) -> usize {
        self.area.slot_bytes()
    }

    /// A step: `write` fills this rank's slot of it (all [`elems`](Self::elems) of them are
    /// its), then this rank arrives and waits for the others. The step's slots may be read
    /// through the returned [`Step`] until the next step.
    #[inline]
    pub(crate) fn step<T: Element>(&mut self, write: impl FnOnce(&mut [T])) -> Result<Step<'_, 'a>> {
        self.step_then(write, || {})
    }

    /// [`step`](Self::step), with `arrived` run between this rank's arrival and its wait
    /// (to wake members that are not waiting in the area).
    #[inline]
    pub(crate) fn step_then<T: Element>(
        &mut self,
        write: impl FnOnce(&mut [T]),
        arrived: impl FnOnce(),
    ) -> Result<Step<'_, 'a>> {
        let t = self.area.next_step();
        write_own(self.area, t, write);
        self.area.arrive(t, &self.desc);
        arrived();
        self.wait(t)?;
        Ok(Step { l: self, t })
    }

    #[inline]
    fn arrive_and_wait(&self, t: u64) -> Result<()> {
        self.area.arrive(t, &self.desc);
        self.wait(t)
    }

    /// The wait of step `t`, which this rank has arrived at.
    #[inline]
    fn wait(&self, t: u64) -> Result<()> {
        self.area.wait_all(t, &self.desc, self.deadline, self.busy).map_err(|w| {
            self.leave();
            self.error(w)
        })
    }

    /// `e`, a copy's failure, named for this call; this rank leaves the call.
    fn failed(&self, e: Error) -> Error {
        self.leave();
        match e {
            Error::PeerClosed { rank, op, detail } if op.is_empty() => {
                Error::PeerClosed { rank, op: self.what.to_string(), detail }
            }
            e => e,
        }
    }

    /// This rank leaves the call early: it withdraws from the area, so that no member writes
    /// into its buffers once the caller has them back (see [`LocalArea::withdraw`]).
    fn leave(&self) {
        // A writer that runs ends its piece in well under a millisecond; one whose process
        // has exited has ended. What is left is a writer stopped (or hung) inside its write
        // for the whole call's timeout again: said, and the buffer goes back all the same.
        if !self.area.withdraw(Instant::now() + self.timeout) {
            tracing::error!(
                op = self.what,
                "a member whose process still runs announced a write into this rank's buffer and had not \
                 finished it {:?} after this call failed: the buffer is returned all the same",
                self.timeout
            );
        }
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
}

/// A step every member has arrived at: its slots may be read until this rank arrives at the
/// next one ([`next`](Self::next), which consumes it).
pub(crate) struct Step<'s, 'a> {
    l: &'s mut Local<'a>,
    t: u64,
}

impl<'s, 'a> Step<'s, 'a> {
    /// Elements `range` of member `m`'s slot of this step (this rank's own too). Panics if
    /// `range` is outside the slot (a bug in the algorithm, never input-driven).
    #[inline]
    pub(crate) fn read<T: Element>(&self, m: usize, range: Range<usize>) -> &[T] {
        let area = self.l.area;
        // SAFETY: the area maps `slot_bytes` bytes at `slot(m, t)` for as long as it lives
        // (which `'a` outlives), and no member writes them while this view lives: step t was
        // waited for (a Step exists only after its wait_all returned), and this rank has not
        // arrived at t + 1 (arriving consumes this Step, which the view borrows), so by the
        // area's rule member m does not write its slot of t (the same memory as its t + 2)
        // yet. A shared view of memory nobody writes is sound even across processes.
        let bytes = unsafe { std::slice::from_raw_parts(area.slot(m, self.t), area.slot_bytes()) };
        // The slot is 64-byte aligned and a multiple of 64 bytes: whole, aligned elements.
        &bytemuck::cast_slice(bytes)[range]
    }

    /// Copies member `m`'s bytes at `addr` (an address it published in this step or an
    /// earlier one of this call, for bytes it keeps unchanged until every member has arrived
    /// at a later step: until this rank is done reading) into `dst`, straight from its memory.
    /// This rank's own bytes are the caller's.
    pub(crate) fn read_member(&self, m: usize, addr: u64, dst: &mut [u8]) -> Result<()> {
        let from = [RemoteIoVec { base: addr as usize, len: dst.len() }];
        self.read_member_runs(m, &from, &mut [IoSliceMut::new(dst)])
    }

    /// [`read_member`](Self::read_member) of several runs of member `m`'s memory, in order,
    /// into several of this rank's (as many bytes in all), in as few system calls as the
    /// kernel allows.
    pub(crate) fn read_member_runs(&self, m: usize, from: &[RemoteIoVec], into: &mut [IoSliceMut<'_>]) -> Result<()> {
        self.l.area.read_member(m, from, into).map_err(|e| self.l.failed(e))
    }

    /// Copies `src` to member `m`'s address `addr` (an address it published in this step or
    /// an earlier one of this call, for bytes it leaves alone until every member has arrived
    /// at a later step), straight into its memory.
    pub(crate) fn write_member(&self, m: usize, addr: u64, src: &[u8]) -> Result<()> {
        self.l.area.write_member(m, addr, src).map_err(|e| self.l.failed(e))
    }

    /// The next step: `write` fills this rank's slot of it, and may still read this step's
    /// slots (a different slot of each member); then this rank arrives and waits for the
    /// others.
    #[inline]
    pub(crate) fn next<T: Element>(self, write: impl FnOnce(&mut [T], &Self)) -> Result<Self> {
        let area = self.l.area;
        let u = area.next_step();
        debug_assert_eq!(u, self.t + 1, "a step of this area was taken outside the call");
        write_own(area, u, |own| write(own, &self));
        self.l.arrive_and_wait(u)?;
        Ok(Step { l: self.l, t: u })
    }
}

/// Runs `write` on this rank's slot of step `t`, just before it arrives at `t`. Called only by
/// [`Local::step`] and [`Step::next`], after every earlier step was waited for.
#[inline]
fn write_own<T: Element>(area: &dyn LocalArea, t: u64, write: impl FnOnce(&mut [T])) {
    // SAFETY: the area maps `slot_bytes` bytes at this rank's `slot(me, t)` while it lives
    // (longer than this call), and only this rank writes them. No other member reads them
    // now: by the callers' contract step t - 1 was waited for (every member arrived at it, so
    // all are done reading this slot's previous content, step t - 2), and this rank has not
    // arrived at t, which others wait for before they read it. Within this rank, a Step of
    // t - 1 reads only the other slot (t - 1 has the other parity), and no Step of t - 2 is
    // left (it was consumed to make the step of t - 1). The view lives only for `write`.
    let own = unsafe { std::slice::from_raw_parts_mut(area.slot(area.me(), t), area.slot_bytes()) };
    // The slot is 64-byte aligned and a multiple of 64 bytes: whole, aligned elements.
    write(bytemuck::cast_slice_mut(own));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Call;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Barrier};

    /// An in-process area of `n` members (threads): two slots each, arrival words stored with
    /// release and loaded with acquire, as the shared-memory backend's.
    struct Checked {
        me: usize,
        members: Vec<usize>,
        shared: Arc<Mem>,
        next: AtomicU64,
    }

    struct Mem {
        slots: Vec<Vec<AtomicU64>>,
        arrived: Vec<AtomicU64>,
        barrier: Barrier,
    }

    const SLOT_WORDS: usize = 8;

    impl LocalArea for Checked {
        fn members(&self) -> &[usize] {
            &self.members
        }
        fn me(&self) -> usize {
            self.me
        }
        fn slot_bytes(&self) -> usize {
            SLOT_WORDS * 8
        }
        fn next_step(&self) -> u64 {
            self.next.fetch_add(1, Ordering::Relaxed) + 1
        }
        fn slot(&self, m: usize, step: u64) -> *mut u8 {
            self.shared.slots[2 * m + (step % 2) as usize].as_ptr().cast_mut().cast::<u8>()
        }
        fn arrive(&self, step: u64, _: &OpDesc) {
            self.shared.arrived[self.me].store(step, Ordering::Release);
        }
        fn wait_all(&self, step: u64, _: &OpDesc, deadline: Instant, _: BusyWait) -> Result<(), AreaWait> {
            while self.shared.arrived.iter().any(|a| a.load(Ordering::Acquire) < step) {
                if Instant::now() > deadline {
                    return Err(AreaWait::Late(Vec::new()));
                }
                std::thread::yield_now();
            }
            Ok(())
        }
    }

    #[test]
    fn steps_see_every_member_s_write_of_that_step_never_a_later_one() {
        // Every member writes (rank, step) patterns and checks, at each step, that every
        // member's slot holds exactly that step's pattern: a slot written while another member
        // still reads it would show the next-but-one step's pattern.
        for n in [2usize, 3, 5] {
            let mem = Arc::new(Mem {
                slots: (0..2 * n).map(|_| (0..SLOT_WORDS).map(|_| AtomicU64::new(0)).collect()).collect(),
                arrived: (0..n).map(|_| AtomicU64::new(0)).collect(),
                barrier: Barrier::new(n),
            });
            let threads: Vec<_> = (0..n)
                .map(|me| {
                    let shared = mem.clone();
                    std::thread::spawn(move || -> Result<()> {
                        let area =
                            Checked { me, members: (0..n).collect(), shared: shared.clone(), next: AtomicU64::new(0) };
                        let desc = OpDesc::new(Call::Barrier);
                        let deadline = Instant::now() + Duration::from_secs(60);
                        let flag = AtomicBool::new(false);
                        let mut l = Local {
                            area: &area,
                            comm: None,
                            busy_flag: &flag,
                            desc,
                            deadline,
                            timeout: Duration::from_secs(60),
                            busy: BusyWait { budget: Duration::ZERO, yield_cpu: true, alone: false },
                            pieces: false,
                            what: "test",
                        };
                        shared.barrier.wait();
                        let pattern = |m: usize, t: u64| (m as u64) << 32 | t;
                        let check = |s: &Step<'_, '_>, t: u64| {
                            for m in 0..n {
                                let got = s.read::<u64>(m, 0..SLOT_WORDS);
                                assert!(got.iter().all(|&w| w == pattern(m, t)), "member {m} at step {t}: {got:?}");
                            }
                        };
                        let mut t = 0;
                        for round in 0..300 {
                            t += 1;
                            let mut s = l.step::<u64>(|own| own.fill(pattern(me, t)))?;
                            check(&s, t);
                            for _ in 0..round % 3 {
                                t += 1;
                                s = s.next::<u64>(|own, prev| {
                                    own.fill(pattern(me, t));
                                    check(prev, t - 1);
                                })?;
                                check(&s, t);
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            for th in threads {
                th.join().expect("member thread panicked").expect("member failed");
            }
        }
    }
}
