//! Surviving a dead rank inside the library: [`Context::revoke`], [`Context::agree`] and
//! [`Context::shrink`] (MPI ULFM's `MPIX_Comm_revoke`, `_agree` and `_shrink`).
//!
//! A failed collective already revokes its context: the rank that notices (a peer's connection
//! closed, a deadline passed, ranks disagreed) fails the context and tells every peer the first
//! cause, and each peer that fails relays it to all of its own. The connections stay up, so the
//! survivors can then agree on who failed and form a smaller context over the pairs they hold,
//! with no store and no new connection.
//!
//! # The agreement
//!
//! A coordinator with takeover, over the full mesh, with the pairs' failure detection (a closed
//! connection; on one host, the shared-memory lifeline and the kernel's end of a socket say it
//! at once) as a perfect failure detector:
//!
//! 1. Each member sends its proposal (its flag and the ranks it knows failed) to the
//!    coordinator: the lowest rank it does not know failed.
//! 2. The coordinator waits for a message from every member it does not know failed (their
//!    reports of failed ranks count too), then decides: the AND of the flags, the union of the
//!    failed ranks. It sends the decision, stamped with its own rank (the epoch), to every
//!    member whose connection is up.
//! 3. A member that receives a decision relays it to every member (but the sender) and only
//!    then returns it. So a decision that any member returned reached every live member, even
//!    if the coordinator died half-way through sending it (uniform agreement).
//! 4. A member whose coordinator dies proposes to the next one. A member that proposed to
//!    coordinator `c` accepts only decisions of epoch `c` or later: an older coordinator's
//!    decision that reaches it late (relayed by a member that has since died) is one that no
//!    live member returned without also relaying it to `c`, and `c` adopts any decision it
//!    receives before deciding, and sends it on under its own epoch.
//!
//! Messages of one pair arrive in order, so a member that returned a decision sent its relays
//! before anything of its next agreement; those are kept for the next call. Why not the
//! early-returning agreement (ERA) of Open MPI's ULFM: it saves a round when nobody fails, but
//! a job that calls agree calls it after a failure, where a coordinator takes one round trip and
//! the relay one message per pair, and it is much simpler to get right.
//!
//! A rank that the others decided failed (one whose connection looked dead to them) is told so
//! and fails: it must not go on in the shrunk context (fail-stop).

use crate::comm::{Comm, PersistentRecv, fnv};
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::rendezvous::{PrefixStore, Store};
use crate::sync::lock;
use crate::transport::group_id;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Marks the group ids of agreements and of shrunk contexts apart from others.
const AGREE: u64 = 0x4147_5245_4500_0001;
const SHRINK: u64 = 0x5348_5249_4e4b_0001;

/// Message kinds of the agreement.
const PROPOSE: u64 = 0x5052_4f50;
const DECIDE: u64 = 0x4445_4349;

/// Words before the bitmap of failed ranks: kind, agreement number, epoch, value.
const HEAD: usize = 4;

/// Store keys of [`Context::grow`]: a counter of grows, the open one, and each one's joiners.
const GROW_COUNT: &str = "ferrogloo.grow.count";
const GROW_OPEN: &str = "ferrogloo.grow.open";

fn grow_prefix(epoch: i64) -> String {
    format!("ferrogloo.grow.{epoch}")
}

/// What the live members of a context agreed on ([`Context::agree`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreement {
    /// The bitwise AND of the flags of the members that took part.
    pub value: u64,
    /// The ranks of the context known failed, in rank order (the same list on every member).
    pub failed: Vec<usize>,
}

/// A context's state for agreements: their count (every member counts alike) and the
/// receive they use, kept from one agreement to the next.
#[derive(Default)]
pub(crate) struct Survival {
    inner: Mutex<Option<Agreements>>,
}

struct Agreements {
    /// The communicator of the agreements: the context's members under a group id of its own,
    /// which a revoked context's abort does not touch.
    comm: Comm,
    recv: PersistentRecv,
    /// Agreements this context has run.
    count: u64,
    /// Messages of later agreements that arrived during one (sender, words).
    later: Vec<(usize, Vec<u64>)>,
}

/// One agreement message.
struct Msg {
    kind: u64,
    number: u64,
    epoch: usize,
    value: u64,
    failed: Vec<bool>,
}

impl Msg {
    fn encode(&self) -> Vec<u64> {
        let mut w = vec![self.kind, self.number, self.epoch as u64, self.value];
        w.resize(HEAD + self.failed.len().div_ceil(64), 0);
        for (r, _) in self.failed.iter().enumerate().filter(|(_, f)| **f) {
            w[HEAD + r / 64] |= 1 << (r % 64);
        }
        w
    }

    fn decode(w: &[u64], n: usize, from: usize) -> Result<Msg> {
        let bad = |why: &str| Error::Protocol { peer: Some(from), detail: format!("an agreement message {why}") };
        if w.len() != HEAD + n.div_ceil(64) {
            return Err(bad(&format!("of {} words, not {}", w.len(), HEAD + n.div_ceil(64))));
        }
        if w[0] != PROPOSE && w[0] != DECIDE {
            return Err(bad(&format!("of unknown kind {:#x}", w[0])));
        }
        let epoch = usize::try_from(w[2]).ok().filter(|&e| e < n).ok_or_else(|| bad("names no rank"))?;
        let failed = (0..n).map(|r| w[HEAD + r / 64] >> (r % 64) & 1 == 1).collect();
        Ok(Msg { kind: w[0], number: w[1], epoch, value: w[3], failed })
    }
}

/// The group rank of the peer that an error says failed, if it says one did: its connection
/// closed, or it closed or aborted it. Other errors (a message that does not fit) are not a
/// peer's death.
fn failed_peer(err: &Error, members: &[usize]) -> Option<usize> {
    let rank = match err {
        Error::PeerClosed { rank, .. } | Error::PeerTimedOut { rank, .. } | Error::Aborted { rank, .. } => *rank,
        _ => return None,
    };
    members.iter().position(|&m| m == rank)
}

/// One agreement on one member, as it runs.
struct Round<'a> {
    me: usize,
    n: usize,
    number: u64,
    flag: u64,
    comm: &'a Comm,
    /// Ranks this member saw fail (their connection is gone).
    dead: Vec<bool>,
    /// Ranks known failed: seen, or reported in a proposal.
    failed: Vec<bool>,
    /// Flags proposed to this member, by rank.
    proposals: Vec<Option<u64>>,
    /// The coordinator this member last proposed to.
    proposed_to: Option<usize>,
}

impl Round<'_> {
    fn coordinator(&self) -> usize {
        (0..self.n).find(|&r| !self.failed[r]).unwrap_or(self.me)
    }

    fn mark_failed(&mut self, r: usize) {
        if r != self.me {
            self.dead[r] = true;
            self.failed[r] = true;
        }
    }

    /// Sends `msg` to each of `to`; a rank whose connection is gone is marked failed.
    fn send(&mut self, to: &[usize], msg: &Msg) -> Result<()> {
        let words = msg.encode();
        let members = self.comm.members();
        let outcomes: Vec<(usize, Result<()>)> = self.comm.scope(|s| {
            let mut sent = Vec::with_capacity(to.len());
            for &r in to {
                sent.push((r, s.isend(r, 0, &words)));
            }
            Ok(sent.into_iter().map(|(r, req)| (r, req.and_then(|q| q.wait()))).collect())
        })?;
        for (r, outcome) in outcomes {
            if let Err(e) = outcome {
                match failed_peer(&e, &members) {
                    Some(_) => self.mark_failed(r),
                    None => return Err(e.during("agree")),
                }
            }
        }
        Ok(())
    }

    /// Relays or sends decision `msg` to every member whose connection is up but `except`.
    fn announce(&mut self, msg: &Msg, except: Option<usize>) -> Result<()> {
        let to: Vec<usize> = (0..self.n).filter(|&r| r != self.me && Some(r) != except && !self.dead[r]).collect();
        self.send(&to, msg)
    }

    /// What a decision becomes on this member.
    fn outcome(&self, msg: &Msg) -> Result<Agreement> {
        let failed: Vec<usize> = (0..self.n).filter(|&r| msg.failed[r]).collect();
        if failed.contains(&self.me) {
            return Err(Error::Revoked {
                rank: self.comm.world_rank(msg.epoch).unwrap_or(msg.epoch),
                reason: format!(
                    "the other members agreed that rank {} failed (its connections looked dead to them); it must \
                     not go on in this context",
                    self.me
                ),
            });
        }
        Ok(Agreement { value: msg.value, failed })
    }

    /// Acts on message `msg` from `from`: a decision ends the agreement (`Some`).
    fn take(&mut self, from: usize, msg: Msg) -> Result<Option<Agreement>> {
        if msg.kind == PROPOSE {
            self.proposals[from] = Some(msg.value);
            for r in (0..self.n).filter(|&r| msg.failed[r] && r != self.me) {
                self.failed[r] = true;
            }
            return Ok(None);
        }
        let coordinating = self.coordinator() == self.me;
        if !coordinating && self.proposed_to.is_some_and(|c| msg.epoch < c) {
            // An older coordinator's decision: the coordinator this member proposed to has it
            // too if a live member returned it, and sends it on under its own epoch.
            return Ok(None);
        }
        // A coordinator that adopts a decision sends it on as its own.
        let msg = if coordinating { Msg { epoch: self.me, ..msg } } else { msg };
        self.announce(&msg, Some(from))?;
        self.outcome(&msg).map(Some)
    }

    /// As coordinator: the decision, once every member not known failed has proposed.
    fn decide(&mut self) -> Result<Option<Agreement>> {
        if (0..self.n).any(|r| !self.failed[r] && self.proposals[r].is_none()) {
            return Ok(None);
        }
        let value = (0..self.n).filter(|&r| !self.failed[r]).filter_map(|r| self.proposals[r]).fold(!0, |a, f| a & f);
        let msg = Msg { kind: DECIDE, number: self.number, epoch: self.me, value, failed: self.failed.clone() };
        self.announce(&msg, None)?;
        self.outcome(&msg).map(Some)
    }
}

impl Context {
    /// Revokes the context: every pending and later operation of it fails, on every live
    /// member, with [`Error::Revoked`] naming this rank and `reason` (ULFM's
    /// `MPIX_Comm_revoke`). This rank tells every peer at once; a peer whose operation fails
    /// because of it tells its own peers, so the revocation reaches every member that has an
    /// operation pending, also when this rank dies right after. A peer with nothing pending
    /// learns it at its next call. The connections stay up: the members can then
    /// [`agree`](Self::agree) and [`shrink`](Self::shrink).
    ///
    /// A collective that fails (a peer died, a deadline passed, ranks disagreed) revokes the
    /// context the same way, with its first cause instead of [`Error::Revoked`].
    pub fn revoke(&self, reason: &str) {
        self.comm().revoke(reason);
    }

    /// A fault-tolerant agreement of the context's live members (ULFM's `MPIX_Comm_agree`):
    /// every member that returns `Ok` returns the same [`Agreement`]: the bitwise AND of the
    /// flags of the members that took part, and the ranks known failed. It works on a revoked
    /// or aborted context (over the same connections, in a group of its own), and when members
    /// die during the agreement itself: see the module documentation of the algorithm.
    ///
    /// Every live member must call it (it is a collective: agreements are numbered). It ends
    /// within the context's timeout ([`Error::Timeout`] naming the members still awaited: a
    /// live member that does not call it). A member that the others decided failed gets
    /// [`Error::Revoked`] saying so.
    ///
    /// ```
    /// # use ferrogloo::{Context, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
    /// let a = ctx.agree(0b11)?;
    /// assert_eq!((a.value, a.failed), (0b11, vec![]));
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn agree(&self, flag: u64) -> Result<Agreement> {
        let mut slot = lock(&self.survival().inner);
        let state = slot.get_or_insert_with(|| {
            let comm = self.comm().sibling(group_id(fnv(&[self.comm().group(), AGREE])));
            let n = self.size();
            let recv = comm.persistent_recv(0, 8 * (HEAD + n.div_ceil(64)), comm.spin(), "agree");
            Agreements { comm, recv, count: 0, later: Vec::new() }
        });
        state.count += 1;
        let (n, me, number) = (self.size(), self.rank(), state.count);
        let deadline = Instant::now() + self.timeout();
        let members = state.comm.members();
        let mut round = Round {
            me,
            n,
            number,
            flag,
            comm: &state.comm,
            dead: vec![false; n],
            failed: vec![false; n],
            proposals: vec![None; n],
            proposed_to: None,
        };
        round.proposals[me] = Some(flag);
        let mut later = std::mem::take(&mut state.later);
        let mut early = std::mem::take(&mut later).into_iter();
        loop {
            let coordinator = round.coordinator();
            if coordinator == me {
                if let Some(a) = round.decide()? {
                    state.later = early.chain(later).collect();
                    return Ok(a);
                }
            } else if round.proposed_to != Some(coordinator) {
                let msg =
                    Msg { kind: PROPOSE, number, epoch: coordinator, value: round.flag, failed: round.failed.clone() };
                round.send(&[coordinator], &msg)?;
                if !round.failed[coordinator] {
                    round.proposed_to = Some(coordinator);
                }
                continue;
            }
            // The next message: one kept from the last agreement, else from the wire.
            let (from, words) = match early.next() {
                Some(m) => m,
                None => {
                    let from: Vec<usize> = (0..n).filter(|&r| r != me && !round.dead[r]).collect();
                    if from.is_empty() {
                        continue; // alone: the coordinator, deciding now
                    }
                    match state.recv.wait(&from, deadline) {
                        None => {
                            // The coordinator waits for proposals, the others for its decision.
                            let (waiting, what): (Vec<usize>, _) = if coordinator == me {
                                let w = (0..n).filter(|&r| !round.failed[r] && round.proposals[r].is_none());
                                (w.collect(), "the proposals of the members")
                            } else {
                                (vec![coordinator], "the decision of its coordinator")
                            };
                            return Err(Error::Timeout {
                                op: format!("agreement {number} of rank {me}, waiting for {what}"),
                                ranks: waiting.iter().map(|&r| members.get(r).copied().unwrap_or(r)).collect(),
                                keys: Vec::new(),
                                waited: self.timeout(),
                            });
                        }
                        Some(Err(e)) => match failed_peer(&e, &members) {
                            Some(r) => {
                                round.mark_failed(r);
                                continue;
                            }
                            None => return Err(e.during("agree")),
                        },
                        Some(Ok((from, bytes))) => {
                            let words = bytes
                                .chunks_exact(8)
                                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                                .collect();
                            (from, words)
                        }
                    }
                }
            };
            let msg = Msg::decode(&words, n, members.get(from).copied().unwrap_or(from))?;
            if msg.number < number {
                continue; // a relay of an agreement this member has returned
            }
            if msg.number > number {
                later.push((from, words)); // a peer that returned this one already
                continue;
            }
            if let Some(a) = round.take(from, msg)? {
                state.later = early.chain(later).collect();
                return Ok(a);
            }
        }
    }

    /// Forms the context of the live members (ULFM's `MPIX_Comm_shrink`): they
    /// [`agree`](Self::agree) on who failed and continue, ranks renumbered in order, over the
    /// connections they hold (no store, no new connection). Every live member calls it, also on
    /// a revoked or aborted context. Sub-groups and an engine can be made on the new context as
    /// on any.
    ///
    /// No split brain: the survivors must be a majority of the members, or exactly half of them
    /// including rank 0; otherwise every survivor gets [`Error::RanksFailed`] naming the failed
    /// ranks, and no survivor continues.
    ///
    /// The new context runs its collectives over the pairs (not the same-host area of the
    /// context the mesh was formed for), and its errors name ranks as every context's do: by
    /// their rank in the context the mesh was formed for
    /// ([`world_rank`](Self::world_rank)).
    pub fn shrink(&self) -> Result<Context> {
        let agreed = self.agree(!0)?;
        let n = self.size();
        let live: Vec<usize> = (0..n).filter(|r| !agreed.failed.contains(r)).collect();
        if live.len() * 2 < n || (live.len() * 2 == n && !live.contains(&0)) {
            return Err(Error::RanksFailed {
                ranks: agreed.failed.iter().map(|&r| self.world_rank(r).unwrap_or(r)).collect(),
                detail: format!(
                    "{} of the {n} members survive, not a majority (or half with rank 0): this side does not go on",
                    live.len()
                ),
            });
        }
        let members: Arc<[usize]> = live.iter().map(|&r| self.world_rank(r).unwrap_or(r)).collect();
        // The survivors go on: closing the mesh later is no longer news of the failure.
        lock(&self.comm().shared().failure).take();
        let group = self.comm().subgroup_id(SHRINK);
        Ok(self.child(group, members))
    }
}

impl Context {
    /// Grows the context by `n` new ranks that join through `store` with
    /// [`Context::join_existing`] (the rendezvous a shrink does not need): every member calls
    /// it with the same `n`, and gets the context of the members (ranks unchanged) followed by
    /// the newcomers (ranks `size..size + n`, in the order they joined). It is formed afresh
    /// through the store, on this context's device, within this context's timeout; this
    /// context stays as it was. Use a store (or [`PrefixStore`] prefix) of this job only.
    ///
    /// The new context's connections are authenticated with the job's secret from the
    /// environment (as [`ContextBuilder::secret`](crate::context::ContextBuilder::secret)
    /// defaults to), not with a secret given to this context's builder.
    ///
    /// Errors: [`Error::Mismatch`] when members pass different `n`; [`Error::Timeout`] when
    /// the newcomers do not come in time; a store's errors.
    pub fn grow<S: Store + ?Sized>(&self, store: &S, n: usize) -> Result<Context> {
        let size = self.size();
        // Rank 0 opens a grow of its own number; every member learns it and checks `n`.
        let mut open = [0u64, n as u64];
        if self.rank() == 0 {
            open[0] = u64::try_from(store.add(GROW_COUNT, 1)?).unwrap_or(0);
        }
        self.broadcast(&mut open, 0, &Default::default())?;
        if open[1] != n as u64 {
            return Err(Error::Mismatch {
                rank: self.world_rank(0).unwrap_or(0),
                detail: format!("grow: rank 0 grows by {} ranks, rank {} by {n}", open[1], self.rank()),
            });
        }
        let epoch = i64::try_from(open[0]).map_err(|_| Error::invalid("grow: a grow number out of range"))?;
        if self.rank() == 0 {
            store.set(GROW_OPEN, format!("{epoch} {size} {n}").as_bytes())?;
        }
        let grown = Context::builder(self.rank(), size + n)
            .timeout(self.timeout())
            .connect(&PrefixStore::new(grow_prefix(epoch), store), self.device());
        if self.rank() == 0 {
            // Closed: a newcomer that comes now waits for the next grow.
            let _ = store.delete(GROW_OPEN);
        }
        grown
    }

    /// Joins a live context that grows ([`Context::grow`]) as a new rank, through `store` (the
    /// one the members pass), on `device`: waits, up to `timeout`, for a grow that has room,
    /// takes the next rank in it and forms the grown context with the members and the other
    /// newcomers (its deadline, and the new context's default one, is `timeout`).
    ///
    /// ```no_run
    /// # use ferrogloo::{Context, Reduction, device::Device, rendezvous::FileStore};
    /// # use std::time::Duration;
    /// let store = FileStore::new("/shared/job-42")?;
    /// let ctx = Context::join_existing(&store, &Device::from_env()?, Duration::from_secs(60))?;
    /// // Catch up with the others, for example: the step and the weights from rank 0.
    /// let mut step = [0u64];
    /// ctx.broadcast(&mut step, 0, &Default::default())?;
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn join_existing<S: Store + ?Sized>(store: &S, device: &Device, timeout: Duration) -> Result<Context> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            if let Some(open) = store.try_get(GROW_OPEN)? {
                let text = String::from_utf8_lossy(&open).into_owned();
                let parsed: Vec<i64> = text.split(' ').filter_map(|w| w.parse().ok()).collect();
                let [epoch, size, n] = parsed[..] else {
                    return Err(Error::store(GROW_OPEN, format!("holds {text:?}, not a grow")));
                };
                let joined = store.add(&format!("{}/joined", grow_prefix(epoch)), 1)?;
                if (1..=n).contains(&joined) {
                    let (rank, new_size) = (size + joined - 1, size + n);
                    let (rank, new_size) = (
                        usize::try_from(rank).map_err(|_| Error::store(GROW_OPEN, "a rank out of range"))?,
                        usize::try_from(new_size).map_err(|_| Error::store(GROW_OPEN, "a size out of range"))?,
                    );
                    return Context::builder(rank, new_size)
                        .timeout(timeout)
                        .connect(&PrefixStore::new(grow_prefix(epoch), store), device);
                }
                // That grow is full: wait for the next.
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    op: format!("joining a live context through {} (no grow with room was open)", store.describe()),
                    ranks: Vec::new(),
                    keys: vec![GROW_OPEN.to_string()],
                    waited: timeout,
                });
            }
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
}
