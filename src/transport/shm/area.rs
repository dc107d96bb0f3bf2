//! The collective area of one host's ranks (see [`LocalArea`] for the rule its steps follow).
//!
//! Each rank's segment ends in its area: a page of control words, written only by the owner,
//! then its two slots.
//!
//! ```text
//! +0    arrived: the last step this rank arrived at       (its own cache line)
//! +64   asleep: nonzero while this rank sleeps in a wait  (its own cache line)
//! +128  the call of even steps, then of odd steps: 3 words each (an encoded OpDesc)
//! +192  writing: 1 + the member this rank is writing into (process_vm_writev), or 0
//! +256  withdrawn: nonzero once this rank left a call early (its wait or copy failed)
//! +320  idle: nonzero while this rank's engine waits idle, to be nudged when a step begins
//! ```
//!
//! The idle flag is the engine's (`engine/background.rs`): a rank about to wait idle sets it,
//! fences, and looks whether a member has begun a step it has not taken; a member that arrives
//! at a step fences and claims the flag of each member that set it (a compare-exchange from 1
//! to 0: of several arriving members one claims it), and the one that claims it sends a
//! wake-up over the pair. The waiter clears its flag when it stops waiting; finding it claimed,
//! it knows one wake-up is on its way (it takes it from its receive later: none piles up).
//!
//! Single-copy collectives write into members' buffers and read from them, straight. A member
//! whose call fails returns its buffer to its caller while the others may still be in the
//! call: so it first *withdraws* ([`LocalArea::withdraw`]). A writer announces its write
//! (`writing`), fences, and writes only if the member has not withdrawn; the member withdraws,
//! fences, and waits for any write it sees announced by a member whose process has not exited.
//! (Dekker's again: either the writer sees the withdrawal and does not write, or the member
//! sees the write and waits for its end.) A reader looks at `withdrawn` after its read: set,
//! the bytes may be from after the call.
//!
//! A rank writes its slot and the call of the step, then stores the step number with release
//! ordering; a waiter loads it with acquire ordering, after which the slot and the call are
//! visible to it. The sleep handshake is the ring's (Dekker's): the waiter announces it will
//! sleep, fences, and checks again; the arriving rank stores, fences, and rings the doorbell of
//! every member that announced it. Either the waiter sees the arrival or the arriver sees the
//! announcement.

use super::pair::ShmPair;
use super::segment::{LINE, Segment};
use crate::error::Error;
use crate::transport::wake::{EventFd, poll_fds};
use crate::transport::{AreaWait, BusyWait, CopyChoice, LocalArea};
use crate::types::{DESC_LEN, OpDesc};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

/// A sleep lasts at most this long: another thread of this rank may have taken the doorbell's
/// wake-up, and a local abort does not ring it.
const MAX_SLEEP: Duration = Duration::from_millis(5);
/// Spins between looks at the pairs' state (a lock each).
const SPINS_PER_CHECK: u32 = 1 << 12;
/// Spins between rounds of progress on the pairs' rings.
const SPINS_PER_DRIVE: u32 = 32;

const ARRIVED: usize = 0;
const ASLEEP: usize = LINE;
const CALLS: usize = 2 * LINE;
const WRITING: usize = 3 * LINE;
const WITHDRAWN: usize = 4 * LINE;
const IDLE: usize = 5 * LINE;
/// A write into a member goes in pieces of at most this many bytes, the member's withdrawal
/// looked at before each: a member that withdraws waits for one piece at most (about 0.1 ms)
/// from a writer that runs, and not at all for one whose process has exited.
const WRITE_PIECE: usize = 1 << 20;

/// One host's collective area, as this rank sees it.
pub(crate) struct ShmArea {
    /// Mesh ranks, ascending.
    members: Vec<usize>,
    me: usize,
    /// Each member's segment (this rank's own among them).
    segs: Vec<Arc<Segment>>,
    /// The pair to each member (`None` for this rank).
    pairs: Vec<Option<Arc<ShmPair>>>,
    bell: Arc<EventFd>,
    /// Each member's process id (this rank's own among them).
    pids: Vec<i32>,
    /// Whether each member's process still runs ([`ShmArea::alive`]).
    lives: Vec<Life>,
    choice: CopyChoice,
    flags_at: usize,
    data_at: usize,
    slot_bytes: usize,
    next: AtomicU64,
}

impl ShmArea {
    /// The area of this rank (`me`, a mesh rank) with the peers of `pairs` (indexed by mesh
    /// rank; `Some` for every member but this rank). `None` when there is nobody to share with.
    pub(crate) fn new(
        me: usize,
        mine: Arc<Segment>,
        pairs: &[Option<Arc<ShmPair>>],
        bell: Arc<EventFd>,
        choice: CopyChoice,
    ) -> Option<Arc<Self>> {
        let members: Vec<usize> = (0..pairs.len()).filter(|&r| r == me || pairs[r].is_some()).collect();
        if members.len() < 2 {
            return None;
        }
        let layout = mine.layout();
        let segs = members
            .iter()
            .map(|&r| if r == me { Some(mine.clone()) } else { pairs[r].as_ref().map(|p| p.theirs()) })
            .collect::<Option<Vec<_>>>()?;
        let slot_bytes = (layout.coll_bytes / 2) / LINE * LINE;
        let own = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        let pids: Vec<i32> = members.iter().map(|&r| pairs[r].as_ref().map_or(own, |p| p.peer_pid())).collect();
        Some(Arc::new(ShmArea {
            lives: pids.iter().map(|&pid| Life::of(pid, own)).collect(),
            pids,
            choice,
            me: members.iter().position(|&r| r == me)?,
            pairs: members.iter().map(|&r| pairs[r].clone()).collect(),
            members,
            segs,
            bell,
            flags_at: layout.coll_flags_at(),
            data_at: layout.coll_data_at(),
            slot_bytes,
            next: AtomicU64::new(0),
        }))
    }

    /// Whether member `m`'s process has not exited: a write it announced may still be under
    /// way. (Not its pair's state: a pair closes when this rank's context aborts, or when a
    /// heartbeat suspects a peer that is only slow, while the peer's process still writes.)
    fn alive(&self, m: usize) -> bool {
        self.lives[m].alive()
    }

    fn word(&self, m: usize, off: usize) -> &AtomicU64 {
        self.segs[m].word(self.flags_at + off)
    }

    /// The call member `m` published for `step`.
    fn call(&self, m: usize, step: u64) -> OpDesc {
        let at = CALLS + (step % 2) as usize * DESC_LEN;
        let mut b = [0u8; DESC_LEN];
        for (i, chunk) in b.chunks_mut(8).enumerate() {
            chunk.copy_from_slice(&self.word(m, at + 8 * i).load(Ordering::Relaxed).to_le_bytes());
        }
        OpDesc::decode(&b)
    }

    /// Members that have not arrived at `step`.
    fn late(&self, step: u64) -> Vec<usize> {
        (0..self.members.len()).filter(|&m| self.word(m, ARRIVED).load(Ordering::Acquire) < step).collect()
    }

    /// The first failed pair to a member not `seen` at the step waited for.
    fn failed(&self, seen: &[bool]) -> Option<Error> {
        self.pairs.iter().zip(seen).filter(|(_, s)| !**s).find_map(|(p, _)| p.as_ref()?.failure())
    }

    /// Makes progress on the pairs to the members: a point-to-point message on its way to or
    /// from this rank goes on while it waits here (a peer may need it before it arrives).
    fn drive(&self) {
        for p in self.pairs.iter().flatten() {
            p.drive();
        }
    }

    /// Sleeps until a member arrives, a message comes in, a lifeline stirs or `until`.
    fn sleep(&self, step: u64, until: Instant, fds: &mut [libc::pollfd]) {
        let pairs: Vec<&Arc<ShmPair>> = self.pairs.iter().flatten().collect();
        let mut armed = 0;
        let quiet = pairs.iter().all(|p| {
            let ok = p.prepare_sleep();
            armed += usize::from(ok);
            ok
        });
        let asleep = self.word(self.me, ASLEEP);
        asleep.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if quiet && !self.late(step).is_empty() {
            for f in fds.iter_mut() {
                f.revents = 0;
            }
            // A closed pair's lifeline reports its end for ever: not polled.
            for (p, f) in pairs.iter().zip(&mut fds[1..]) {
                f.fd = if p.is_closed() { -1 } else { p.lifeline_fd() };
            }
            let hold = pairs.iter().filter_map(|p| p.hold_ends()).min();
            let until = hold.map_or(until, |h| h.min(until));
            let left = until.saturating_duration_since(Instant::now()).min(MAX_SLEEP);
            if poll_fds(fds, left).is_err() {
                std::thread::sleep(Duration::from_micros(100));
            }
            if fds[0].revents != 0 {
                self.bell.drain();
            }
            for (p, f) in self.pairs.iter().flatten().zip(&fds[1..]) {
                if f.revents != 0 {
                    p.check_lifeline();
                }
            }
        }
        asleep.store(0, Ordering::Relaxed);
        for p in pairs.iter().take(armed) {
            p.woke();
        }
    }
}

/// How this rank learns whether a member's process has exited.
enum Life {
    /// The member is this process (ranks as threads).
    Same,
    /// A pidfd of the member's process: readable once it has exited (zombies too).
    Fd(std::os::fd::OwnedFd),
    /// No pidfd (a kernel before 5.3): `kill(pid, 0)`, which sees an exited process only
    /// once its parent has reaped it.
    Pid(i32),
}

impl Life {
    fn of(pid: i32, own: i32) -> Life {
        if pid == own {
            return Life::Same;
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; the
        // descriptor is owned by the returned value alone.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        match i32::try_from(fd) {
            // SAFETY: `fd` is a descriptor this call just opened, owned by nobody else.
            Ok(fd) if fd >= 0 => Life::Fd(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }),
            _ => Life::Pid(pid),
        }
    }

    fn alive(&self) -> bool {
        use std::os::fd::AsRawFd;
        match self {
            Life::Same => true,
            Life::Fd(fd) => {
                let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd, no wait.
                let ready = unsafe { libc::poll(&mut p, 1, 0) };
                // Unknown (an error) counts as running: waiting longer is the safe side.
                ready != 1
            }
            Life::Pid(pid) => {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), None) != Err(nix::errno::Errno::ESRCH)
            }
        }
    }
}

/// The error of a member whose process is gone.
fn gone(rank: usize) -> Error {
    Error::PeerClosed { rank, op: String::new(), detail: "its process is gone".into() }
}

/// The error of a member that left the call before this rank `did` what it had to.
fn left(rank: usize, did: &str) -> Error {
    Error::PeerClosed {
        rank,
        op: String::new(),
        detail: format!("it left the call (its wait or copy failed) before this rank {did}"),
    }
}

impl LocalArea for ShmArea {
    fn members(&self) -> &[usize] {
        &self.members
    }

    fn me(&self) -> usize {
        self.me
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn next_step(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn slot(&self, m: usize, step: u64) -> *mut u8 {
        let at = self.data_at + (step % 2) as usize * self.slot_bytes;
        self.segs[m].at(at, self.slot_bytes)
    }

    fn read_member(
        &self,
        m: usize,
        from: &[nix::sys::uio::RemoteIoVec],
        into: &mut [std::io::IoSliceMut<'_>],
    ) -> crate::error::Result<()> {
        let rank = self.members[m];
        let (len, runs) = (from.iter().map(|r| r.len).sum::<usize>(), from.len());
        super::read_process(self.pids[m], from, into).map_err(|e| match e {
            nix::errno::Errno::ESRCH => gone(rank),
            e => Error::io(
                format!(
                    "reading {len} bytes in {runs} run(s) of rank {rank}'s buffers from its memory (process_vm_readv)"
                ),
                e.into(),
            ),
        })?;
        // Withdrawn before the read ended: its buffer may have changed under the read. (The
        // fence keeps the copy's loads before the look, as a seqlock's reader does.)
        fence(Ordering::SeqCst);
        match self.word(m, WITHDRAWN).load(Ordering::SeqCst) {
            0 => Ok(()),
            _ => Err(left(rank, "read its buffer")),
        }
    }

    fn write_member(&self, m: usize, addr: u64, src: &[u8]) -> crate::error::Result<()> {
        let rank = self.members[m];
        let writing = self.word(self.me, WRITING);
        let mut done = 0;
        while done < src.len() {
            let piece = &src[done..src.len().min(done + WRITE_PIECE)];
            writing.store(m as u64 + 1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if self.word(m, WITHDRAWN).load(Ordering::SeqCst) != 0 {
                writing.store(0, Ordering::Release);
                return Err(left(rank, "wrote into its buffer"));
            }
            let wrote = super::write_process(self.pids[m], addr + done as u64, piece);
            writing.store(0, Ordering::Release);
            wrote.map_err(|e| match e {
                nix::errno::Errno::ESRCH => gone(rank),
                e => Error::io(
                    format!("writing {} bytes into rank {rank}'s buffer in its memory (process_vm_writev)", src.len()),
                    e.into(),
                ),
            })?;
            done += piece.len();
        }
        Ok(())
    }

    fn withdraw(&self, until: Instant) -> bool {
        self.word(self.me, WITHDRAWN).store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let me = self.me as u64 + 1;
        loop {
            // A write announced into this rank, by a member whose process still runs (a
            // process's writes have ended once it has exited).
            let busy = (0..self.members.len())
                .any(|m| m != self.me && self.word(m, WRITING).load(Ordering::SeqCst) == me && self.alive(m));
            if !busy {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::yield_now();
        }
    }

    fn copy_choice(&self) -> CopyChoice {
        self.choice
    }

    fn signals(&self) -> bool {
        true
    }

    fn started(&self) -> bool {
        let next = self.next.load(Ordering::Relaxed) + 1;
        (0..self.members.len()).any(|m| m != self.me && self.word(m, ARRIVED).load(Ordering::SeqCst) >= next)
    }

    fn set_idle(&self) {
        self.word(self.me, IDLE).store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    fn clear_idle(&self) -> bool {
        self.word(self.me, IDLE).swap(0, Ordering::SeqCst) == 0
    }

    fn claim_idle(&self, m: usize) -> bool {
        // Looked at before it is claimed: a member that is not idle keeps its word's line (a
        // compare-exchange would take the line even where it fails).
        let w = self.word(m, IDLE);
        w.load(Ordering::SeqCst) == 1 && w.compare_exchange(1, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    fn arrive(&self, step: u64, desc: &OpDesc) {
        let at = CALLS + (step % 2) as usize * DESC_LEN;
        for (i, chunk) in desc.encode().chunks(8).enumerate() {
            let w = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
            self.word(self.me, at + 8 * i).store(w, Ordering::Relaxed);
        }
        self.word(self.me, ARRIVED).store(step, Ordering::Release);
        fence(Ordering::SeqCst);
        for (m, p) in self.pairs.iter().enumerate() {
            if let Some(p) = p
                && self.word(m, ASLEEP).load(Ordering::Relaxed) != 0
            {
                p.wake_peer();
            }
        }
    }

    fn wait_all(&self, step: u64, desc: &OpDesc, deadline: Instant, busy: BusyWait) -> Result<(), AreaWait> {
        let busy_until = Instant::now() + busy.budget;
        let mut fds: Option<Vec<libc::pollfd>> = None;
        let mut spins = 0u32;
        let mut slept = false;
        // Members already seen at this step (their calls checked).
        let mut seen: smallvec::SmallVec<[bool; 16]> = smallvec::smallvec![false; self.members.len()];
        seen[self.me] = true;
        loop {
            let mut all = true;
            for (m, seen) in seen.iter_mut().enumerate() {
                if *seen {
                    continue;
                }
                if self.word(m, ARRIVED).load(Ordering::Acquire) >= step {
                    let theirs = self.call(m, step);
                    if theirs != *desc {
                        return Err(AreaWait::Disagree(self.members[m], theirs));
                    }
                    *seen = true;
                } else {
                    all = false;
                }
            }
            if all {
                return Ok(());
            }
            // A member that arrived and then went away (its job done) has done its part: a
            // failed pair counts only while its member is late.
            spins += 1;
            if (slept || spins.is_multiple_of(SPINS_PER_CHECK))
                && let Some(e) = self.failed(&seen)
            {
                return Err(AreaWait::Failed(e));
            }
            slept = false;
            if spins.is_multiple_of(SPINS_PER_DRIVE) {
                self.drive();
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(AreaWait::Late(self.late(step).into_iter().map(|m| self.members[m]).collect()));
            }
            if now < busy_until {
                if busy.yield_cpu {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let fds = fds.get_or_insert_with(|| {
                std::iter::once(self.bell.raw())
                    .chain(self.pairs.iter().flatten().map(|p| p.lifeline_fd()))
                    .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
                    .collect()
            });
            self.drive();
            self.sleep(step, deadline, fds);
            self.drive();
            slept = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Life;

    /// A member's process counts as running until it exits, zombie or reaped; this process
    /// always runs.
    #[test]
    fn a_process_is_alive_until_it_exits() {
        let own = std::process::id() as i32;
        assert!(Life::of(own, own).alive());
        let mut child = std::process::Command::new("cat")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("cat");
        let life = Life::of(child.id() as i32, own);
        assert!(matches!(life, Life::Fd(_)), "pidfd_open is there on the kernels this runs on");
        assert!(life.alive());
        // cat ends at the end of its input; the zombie already counts as exited.
        drop(child.stdin.take());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while life.alive() {
            assert!(std::time::Instant::now() < deadline, "cat did not end");
            std::thread::yield_now();
        }
        child.wait().expect("wait");
        assert!(!life.alive());
        assert!(!Life::Pid(child.id() as i32).alive(), "reaped: kill(pid, 0) says ESRCH");
    }
}
