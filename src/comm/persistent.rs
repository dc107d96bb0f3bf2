//! Receives that stay posted from one wait to the next ([`PersistentRecv`]), and a wait for
//! whichever of several finishes first ([`wait_any`]).
//!
//! Background loops (the parameter server's loop and its workers' receiving threads, the
//! engine's idle wait) wait in slices, to send heartbeats or look at deadlines, stop flags and
//! stalls between them. A receive withdrawn at the end of a slice while its message is half
//! read loses the message: the transport reads and drops the rest of the payload. So a
//! persistent receive is posted once and waited for many times, each wait with its own
//! deadline (Gloo's unbound buffer `recv` + `waitRecv(timeout)`), and it is only withdrawn when
//! no message has claimed it: the claim is the transport's own arbiter (a claimed receive is
//! finished by the pair that claimed it; an unclaimed one is withdrawn with no message lost).
//!
//! Messages are received into buffers of their own length (at most the receive's limit), so a
//! persistent receive lends no memory of the caller's and needs no scope. Unlike the operations
//! of a [`Scope`](super::Scope) it does not count among the mesh's outstanding operations: it
//! stays posted for as long as its loop runs, and counted it would make every other wait on the
//! mesh (the engine's collectives, another process set's) poll its pairs too; its own waits
//! drive them.

use super::{Comm, Op, Pairs, World, post_recv_any};
use crate::error::{Error, Result};
use crate::transport::{BusyWait, Completion, Done, Key, Pair, RecvTarget};
use crate::types::OpDesc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A background thread's wait: busy-waits 50 µs before it sleeps, long enough to catch the
/// next fragment of a large message, short enough to leave the core to the threads that do the
/// work.
pub(crate) const QUIET: BusyWait = BusyWait { budget: Duration::from_micros(50), yield_cpu: false, alone: false };

/// The wait of the only thread that waits on its mesh, which waits long and rarely (the
/// engine's idle wait): sleeps at once.
pub(crate) const SLEEPING: BusyWait = BusyWait { budget: Duration::ZERO, yield_cpu: false, alone: true };

/// A received message: the sender's rank in the group, and the bytes.
pub(crate) type Message = (usize, Vec<u8>);

/// While several meshes are waited on at once, how long each is waited on in turn.
const MESH_SLICE: Duration = Duration::from_millis(2);

/// The next message with one tag from any of a set of ranks of a communicator, received into a
/// buffer of its own length; see the module documentation. Made by
/// [`Comm::persistent_recv`].
pub(crate) struct PersistentRecv {
    shared: Arc<World>,
    /// Mesh rank of each group rank.
    members: Arc<[usize]>,
    /// Indexed by group rank.
    pairs: Vec<Option<Arc<dyn Pair>>>,
    key: Key,
    max: usize,
    spin: BusyWait,
    /// The operation's name in errors.
    what: &'static str,
    /// How long a message may take to arrive once it began (the communicator's timeout).
    stall: Duration,
    posted: Option<Posted>,
    /// What an [`Interrupter`] completes to end the interruptible wait in progress.
    interrupt: Arc<Mutex<Option<Arc<Completion>>>>,
}

/// Ends another thread's [`PersistentRecv::wait_interruptibly`] early, so that the calling
/// thread can take over the receive (a parameter-server worker's thread that waits for its own
/// request receives the answer itself instead of being woken by the receiving thread).
#[derive(Clone)]
pub(crate) struct Interrupter {
    slot: Arc<Mutex<Option<Arc<Completion>>>>,
    shared: Arc<World>,
}

impl Interrupter {
    /// Ends the interruptible wait in progress, if one is: it returns `None` as at a deadline,
    /// with the receive still posted.
    pub(crate) fn interrupt(&self) {
        let listener = crate::sync::lock(&self.slot).take();
        if let Some(l) = listener {
            l.complete(Ok(Done { peer: 0, len: 0 }));
            self.shared.mesh.progress.interrupt();
        }
    }
}

/// A posted receive.
struct Posted {
    /// The group ranks it was posted for.
    from: Vec<usize>,
    op: Op,
    /// When a wait first found it claimed by a message still arriving.
    claimed_at: Option<Instant>,
}

impl Comm {
    /// A persistent receive of the point-to-point messages with `tag` (those
    /// [`Context::send`](crate::Context::send) sends), of at most `max` bytes each, waiting as
    /// `spin` says; `what` names the operation in errors. Nothing is posted until its first wait.
    pub(crate) fn persistent_recv(&self, tag: u32, max: usize, spin: BusyWait, what: &'static str) -> PersistentRecv {
        PersistentRecv {
            shared: self.shared.clone(),
            members: self.members.clone(),
            pairs: self.pairs.clone(),
            key: self.p2p_key(tag),
            max,
            // Ranks that share cores yield while they busy-wait, whatever the caller asked.
            spin: BusyWait { yield_cpu: spin.yield_cpu || self.shared.spin.yield_cpu, ..spin },
            what,
            stall: self.timeout,
            posted: None,
            interrupt: Arc::default(),
        }
    }
}

impl PersistentRecv {
    /// Whether a receive is posted (one that a wait left posted at its deadline, or that
    /// [`withdraw`](Self::withdraw) kept because a message claimed it).
    pub(crate) fn is_posted(&self) -> bool {
        self.posted.is_some()
    }

    /// Waits until `deadline` for the next message from any of the group ranks `from`; returns
    /// the sender's group rank and the message, or `None` at the deadline with the receive still
    /// posted for the next wait. A receive posted for another set of ranks is withdrawn first,
    /// unless a message already claimed it: then that message is what this wait waits for.
    ///
    /// A message that began arriving and has not finished within the communicator's timeout
    /// (its sender stopped mid-message) is given up: the receive is withdrawn, which drops the
    /// message, and the wait fails with [`Error::Timeout`]; the next wait posts a new one, so
    /// one stalled sender does not keep the others' messages out for longer than that.
    ///
    /// It busy-waits as `spin` says, not as the receive was made to (a caller that waits for
    /// its own answer spins as callers do; yielding, where ranks share cores, whatever `spin`
    /// says).
    pub(crate) fn wait_as(&mut self, from: &[usize], deadline: Instant, spin: BusyWait) -> Option<Result<Message>> {
        if let Err(e) = self.ensure_posted(from) {
            return Some(Err(e));
        }
        let posted = self.posted.as_ref()?;
        let own = posted.op.peers();
        let spin = BusyWait { yield_cpu: spin.yield_cpu || self.shared.spin.yield_cpu, ..spin };
        match Op::wait_for(&posted.op.done, &own, deadline, &self.shared, spin) {
            Some(outcome) => Some(self.finished(outcome)),
            None => self.check_stall(),
        }
    }

    /// What ends a [`wait_interruptibly`](Self::wait_interruptibly) of this receive from
    /// another thread.
    pub(crate) fn interrupter(&self) -> Interrupter {
        Interrupter { slot: self.interrupt.clone(), shared: self.shared.clone() }
    }

    /// [`wait_as`](Self::wait_as), which an [`Interrupter`] of this receive ends early (`None`, the
    /// receive still posted). `go_on` is asked once the wait can be interrupted: `false` ends
    /// it at once. A thread that wants the wait to end sets what `go_on` reads before it
    /// interrupts, so that either the wait sees it or the interrupt sees the wait.
    pub(crate) fn wait_interruptibly(
        &mut self,
        from: &[usize],
        deadline: Instant,
        go_on: impl FnOnce() -> bool,
    ) -> Option<Result<Message>> {
        if let Err(e) = self.ensure_posted(from) {
            return Some(Err(e));
        }
        let listener = Completion::new();
        *crate::sync::lock(&self.interrupt) = Some(listener.clone());
        if go_on() {
            let posted = self.posted.as_ref()?;
            posted.op.done.finish_with(&listener);
            let own = posted.op.peers();
            // Ends when the receive finishes, when interrupted, or at the deadline.
            let _ = Op::wait_for(&listener, &own, deadline, &self.shared, self.spin);
        }
        crate::sync::lock(&self.interrupt).take();
        if let Some(found) = self.ready() {
            return Some(found);
        }
        if Instant::now() < deadline {
            return None; // interrupted, or told not to wait
        }
        self.check_stall()
    }

    /// Withdraws the posted receive unless a message has claimed it (or it finished): that one
    /// stays, for the next [`wait_as`](Self::wait_as) to return.
    pub(crate) fn withdraw(&mut self) {
        let Some(p) = self.posted.take() else { return };
        if p.op.done.try_claim() {
            // Claimed here, so no pair can claim it any more: nothing is lost.
            p.op.cancel();
        } else {
            self.posted = Some(p);
        }
    }

    /// Posts the receive for `from` unless one is posted for it (or claimed for another set).
    fn ensure_posted(&mut self, from: &[usize]) -> Result<()> {
        if self.posted.as_ref().is_some_and(|p| p.from != from) {
            self.withdraw();
        }
        if self.posted.is_none() {
            self.posted = Some(self.post(from)?);
        }
        Ok(())
    }

    /// Posts a receive on the pairs of `from`.
    fn post(&self, from: &[usize]) -> Result<Posted> {
        if from.is_empty() {
            return Err(Error::invalid(format!("{} from no rank", self.what)));
        }
        let pairs = from
            .iter()
            .map(|&r| {
                self.pairs.get(r).cloned().flatten().ok_or_else(|| {
                    Error::invalid(format!("{}: rank {r} is out of range for size {}", self.what, self.pairs.len()))
                })
            })
            .collect::<Result<Pairs>>()?;
        let done = Completion::for_pairs(pairs.len());
        let target = RecvTarget::Owned { max: self.max };
        // SAFETY: an owned receive lends no memory: the pair allocates the message's buffer and
        // hands it over with the completion.
        let posted =
            unsafe { post_recv_any(pairs, self.key, OpDesc::P2P, target, &done) }.map_err(|e| e.during(self.what))?;
        Ok(Posted { from: from.to_vec(), op: Op::uncounted(posted, done, self.what), claimed_at: None })
    }

    /// The message of the finished receive (or its error); nothing is posted afterwards.
    fn finished(&mut self, outcome: Result<Done>) -> Result<Message> {
        let Some(posted) = self.posted.take() else {
            return Err(Error::invalid(format!("{}: nothing posted", self.what)));
        };
        if posted.op.pairs.len() > 1 {
            // A receive from any: withdraw what the winner left on the other pairs (the
            // receive is finished, so no message can claim it there any more).
            posted.op.cancel();
        }
        let done = outcome.map_err(|e| e.during(self.what))?;
        // The pair names its peer by mesh rank; the caller knows ranks of its group.
        let peer = self.members.iter().position(|&m| m == done.peer).unwrap_or(done.peer);
        Ok((peer, posted.op.done.take_payload().unwrap_or_default()))
    }

    /// At a wait's deadline: gives up a message that began arriving too long ago.
    fn check_stall(&mut self) -> Option<Result<Message>> {
        let posted = self.posted.as_mut()?;
        if posted.op.done.is_open() {
            return None;
        }
        // A message claimed it and is arriving.
        let since = *posted.claimed_at.get_or_insert_with(Instant::now);
        if since.elapsed() < self.stall {
            return None;
        }
        posted.op.cancel();
        // It may have finished between the wait and the withdrawal.
        if let Some(outcome) = posted.op.done.outcome() {
            return Some(self.finished(outcome));
        }
        let ranks = posted.op.peers();
        let e = Error::Timeout {
            op: format!("{}: a message began arriving and stopped; dropped", self.what),
            ranks: ranks.to_vec(),
            keys: Vec::new(),
            waited: since.elapsed(),
        };
        posted.op.done.complete(Err(e.clone()));
        self.posted = None;
        Some(Err(e))
    }

    /// The finished receive's outcome, if it has one.
    fn ready(&mut self) -> Option<Result<Message>> {
        let outcome = self.posted.as_ref()?.op.done.outcome()?;
        Some(self.finished(outcome))
    }
}

impl Drop for PersistentRecv {
    fn drop(&mut self) {
        if let Some(p) = self.posted.take() {
            // Going away: a message arriving now has nobody to read it.
            p.op.cancel();
        }
    }
}

/// Waits until `deadline` for whichever of `recvs` finishes first, each posted for the group
/// ranks `from[i]` (see [`PersistentRecv::wait`]); returns its index and its message (sender,
/// bytes) or error, or `None` at the deadline with every receive still posted.
///
/// Of several finished receives the first in `recvs`' order is returned: a caller that wants
/// fairness rotates the order. Receives on one mesh are waited on together (one sleep that any
/// of them ends); receives on several meshes are waited on in turns of a few milliseconds.
pub(crate) fn wait_any(
    recvs: &mut [&mut PersistentRecv],
    from: &[&[usize]],
    deadline: Instant,
) -> Option<(usize, Result<Message>)> {
    if recvs.len() != from.len() {
        let e = Error::invalid(format!("wait_any: {} receives and {} rank sets", recvs.len(), from.len()));
        return Some((0, Err(e)));
    }
    for (i, r) in recvs.iter_mut().enumerate() {
        if let Err(e) = r.ensure_posted(from[i]) {
            return Some((i, Err(e)));
        }
    }
    // The receives by mesh, in order of first appearance.
    let mut meshes: Vec<Vec<usize>> = Vec::new();
    for i in 0..recvs.len() {
        match meshes.iter_mut().find(|m| Arc::ptr_eq(&recvs[m[0]].shared, &recvs[i].shared)) {
            Some(m) => m.push(i),
            None => meshes.push(vec![i]),
        }
    }
    let mut first = true;
    loop {
        for mesh in &meshes {
            if let Some(found) = ready_of(recvs, mesh) {
                return Some(found);
            }
            let slice = if meshes.len() == 1 { deadline } else { deadline.min(Instant::now() + MESH_SLICE) };
            let listener = Completion::new();
            let mut own = Vec::new();
            for &i in mesh {
                if let Some(p) = &recvs[i].posted {
                    p.op.done.finish_with(&listener);
                    for r in p.op.peers() {
                        if !own.contains(&r) {
                            own.push(r);
                        }
                    }
                }
            }
            let lead = &recvs[mesh[0]];
            let mut spin = lead.spin;
            if !first {
                // Busy-waiting was the first turn's; the later ones sleep at once.
                spin.budget = Duration::ZERO;
            }
            let _ = Op::wait_for(&listener, &own, slice, &lead.shared, spin);
            if let Some(found) = ready_of(recvs, mesh) {
                return Some(found);
            }
        }
        first = false;
        if Instant::now() >= deadline {
            for (i, r) in recvs.iter_mut().enumerate() {
                if let Some(outcome) = r.check_stall() {
                    return Some((i, outcome));
                }
            }
            return None;
        }
    }
}

/// The first finished receive among `recvs[idx]` for `idx` in `mesh`.
fn ready_of(recvs: &mut [&mut PersistentRecv], mesh: &[usize]) -> Option<(usize, Result<Message>)> {
    mesh.iter().find_map(|&i| recvs[i].ready().map(|r| (i, r)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Context;
    use crate::context::testing::ranks;
    use crate::device::Device;
    use crate::rendezvous::HashStore;

    fn bytes(seed: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 + seed * 7) as u8).collect()
    }

    #[test]
    fn a_large_message_waited_for_in_short_slices_with_withdrawals_between_them_arrives_whole() {
        // Over TCP a 48 MiB message takes many 1 ms slices to arrive; between slices the
        // receive is withdrawn, which must keep it once the message has claimed it.
        let device = Device::loopback().expect("a TCP device on loopback");
        const LEN: usize = 48 << 20;
        let got = ranks(2, &device, |ctx| {
            if ctx.rank() == 1 {
                ctx.send(0, 3, &bytes(1, LEN))?;
                return Ok(0);
            }
            let mut recv = ctx.comm().persistent_recv(3, LEN, QUIET, "test receive");
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut slices = 0;
            loop {
                slices += 1;
                match recv.wait_as(&[1], Instant::now() + Duration::from_millis(1), QUIET) {
                    Some(got) => {
                        let (from, msg) = got?;
                        assert_eq!(from, 1);
                        assert!(msg == bytes(1, LEN), "the message arrived altered");
                        return Ok(slices);
                    }
                    None => {
                        recv.withdraw();
                        assert!(Instant::now() < deadline, "no message in 20 s");
                    }
                }
            }
        });
        assert!(got[0] > 1, "the message arrived within one slice; the test shows nothing");
    }

    #[test]
    fn a_wait_ends_at_its_deadline_and_the_receive_stays_posted_for_the_next() {
        let got = ranks(2, &Device::in_process(), |ctx| {
            if ctx.rank() == 1 {
                ctx.barrier()?;
                ctx.send(0, 5, b"late")?;
                return Ok(Duration::ZERO);
            }
            let mut recv = ctx.comm().persistent_recv(5, 64, QUIET, "test receive");
            let start = Instant::now();
            assert!(recv.wait_as(&[1], start + Duration::from_millis(30), QUIET).is_none());
            let waited = start.elapsed();
            assert!(recv.is_posted());
            ctx.barrier()?;
            let (from, msg) =
                recv.wait_as(&[1], Instant::now() + Duration::from_secs(10), QUIET).expect("no message")?;
            assert_eq!((from, msg.as_slice()), (1, &b"late"[..]));
            assert!(!recv.is_posted());
            Ok(waited)
        });
        assert!(got[0] >= Duration::from_millis(30) && got[0] < Duration::from_secs(5), "waited {:?}", got[0]);
    }

    #[test]
    fn a_persistent_receive_in_a_sub_group_names_senders_by_their_sub_group_rank() {
        ranks(4, &Device::in_process(), |ctx| {
            if ctx.rank() == 0 {
                return Ok(());
            }
            // Sub-group ranks 0, 1, 2 are the job's ranks 3, 2, 1.
            let sub = ctx.subgroup(&[3, 2, 1])?;
            if sub.rank() == 0 {
                let mut recv = sub.comm().persistent_recv(2, 64, QUIET, "test receive");
                let mut seen = Vec::new();
                for _ in 0..2 {
                    let (from, msg) =
                        recv.wait_as(&[1, 2], Instant::now() + Duration::from_secs(10), QUIET).expect("none")?;
                    assert_eq!(msg, vec![from as u8; 3]);
                    seen.push(from);
                }
                seen.sort_unstable();
                assert_eq!(seen, [1, 2]);
            } else {
                sub.send(0, 2, &[sub.rank() as u8; 3])?;
            }
            sub.barrier()
        });
    }

    #[test]
    fn wait_any_returns_whichever_receive_finishes_on_one_mesh_and_across_two() {
        // Rank 0 waits on two tags of the job's context and on a second context; rank 1 sends
        // one message to each, in an order rank 0 does not know. A wait that slept through
        // a message on another receive would run to its 20 s deadline.
        let device = Device::loopback().expect("a TCP device on loopback");
        let store2 = HashStore::new();
        ranks(2, &device, |ctx| {
            let other = Context::builder(ctx.rank(), 2).timeout(Duration::from_secs(20)).connect(&store2, &device)?;
            if ctx.rank() == 1 {
                for round in 0..3u8 {
                    match round {
                        0 => ctx.send(0, 11, &[round])?,
                        1 => other.send(0, 13, &[round])?,
                        _ => ctx.send(0, 12, &[round])?,
                    }
                    ctx.barrier()?;
                }
                // Stays connected while rank 0 checks that nothing more arrives.
                return ctx.barrier();
            }
            let mut a = ctx.comm().persistent_recv(11, 64, QUIET, "a");
            let mut b = ctx.comm().persistent_recv(12, 64, QUIET, "b");
            let mut c = other.comm().persistent_recv(13, 64, QUIET, "c");
            for round in 0..3u8 {
                let start = Instant::now();
                let (which, got) =
                    wait_any(&mut [&mut a, &mut b, &mut c], &[&[1], &[1], &[1]], start + Duration::from_secs(20))
                        .expect("nothing arrived");
                assert!(start.elapsed() < Duration::from_secs(10), "round {round} took {:?}", start.elapsed());
                assert_eq!(got?, (1, vec![round]));
                assert_eq!(which, [0, 2, 1][round as usize], "round {round}");
                ctx.barrier()?;
            }
            assert!(
                wait_any(&mut [&mut a, &mut b], &[&[1], &[1]], Instant::now() + Duration::from_millis(5)).is_none()
            );
            ctx.barrier()
        });
    }
}
