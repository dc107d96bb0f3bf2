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
//! A hierarchical uniform consensus over the full mesh (see [`agree`] for the protocol and why
//! it is right), with each pair's failure detection as a perfect failure detector: a closed
//! connection, which on one host the shared-memory lifeline and the kernel's end of a socket
//! say at once. The protocol is a sans-IO state machine ([`agree::Machine`]), run through
//! random schedules with random crashes in its tests; this module feeds it what the pairs
//! deliver. Without failures it takes three message delays (propose to the coordinator, its
//! adopt, everyone's acknowledgement to everyone), the members deciding on the
//! acknowledgements rather than on a fourth message from the coordinator. Why not the
//! early-returning agreement (ERA) of Open MPI's ULFM: its tree saves messages at thousands of
//! ranks, but it needs a repair protocol for the tree when members die inside it, and this
//! one is much simpler to get right (and to check exhaustively on small meshes).
//!
//! A rank that the others decided failed (one whose connection looked dead to them) is told so
//! and fails: it must not go on in the shrunk context (fail-stop).

mod agree;

use crate::comm::{Agreements, PersistentRecv, fnv, wait_any};
use crate::context::Context;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::rendezvous::{PrefixStore, Store};
use crate::sync::lock;
use crate::transport::group_id;
use agree::{Machine, Msg};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Marks the group ids of agreements and of shrunk contexts apart from others.
const AGREE: u64 = 0x4147_5245_4500_0001;
const SHRINK: u64 = 0x5348_5249_4e4b_0001;

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

/// Sends `m`'s messages until `deadline`; a peer whose send fails is closed and reported
/// to `m` as failed (which may queue more messages).
fn send(state: &Agreements, m: &mut Machine, number: u64, deadline: Instant) -> Result<()> {
    let n = state.comm.size();
    loop {
        let sends = m.take_sends();
        if sends.is_empty() {
            return Ok(());
        }
        let words: Vec<(usize, Vec<u64>)> = sends.iter().map(|(r, msg)| (*r, msg.encode(number, n))).collect();
        let outcomes: Vec<(usize, Result<()>)> = state.comm.scope(|s| {
            let posted: Vec<_> = words.iter().map(|(r, w)| (*r, s.isend(*r, 0, w))).collect();
            Ok(posted
                .into_iter()
                .map(|(r, q)| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    (r, q.and_then(|q| q.wait_timeout(left.max(Duration::from_millis(1)))))
                })
                .collect())
        })?;
        for (r, outcome) in outcomes {
            match outcome {
                Ok(()) => {}
                // A peer too slow to take a few words by the deadline: the agreement gives up.
                Err(e) if e.is_timeout() => return Err(e),
                Err(e) => {
                    state.close(r, &e);
                    m.on_failure(r);
                }
            }
        }
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
    /// live member that does not call it); after a timed-out agreement the members' numbering
    /// may differ, so revoke or rebuild the context rather than agree on it again.
    ///
    /// Fail-stop: the ranks decided failed are cut off for good (their connections closed, and
    /// failed in every later agreement); a member that the others decided failed (its
    /// connections looked dead to them) gets [`Error::Revoked`] saying so, and cannot go on in
    /// the context. No split brain: when the live members are not a majority, or exactly half
    /// without rank 0, every one of them gets [`Error::RanksFailed`] naming the failed ranks
    /// (so two sides cut off from each other never both go on). An agreement on a context
    /// this rank [aborted](Self::abort) fails with that abort.
    ///
    /// ```
    /// # use ferrogloo::{Context, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
    /// let a = ctx.agree(0b11)?;
    /// assert_eq!((a.value, a.failed), (0b11, vec![]));
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn agree(&self, flag: u64) -> Result<Agreement> {
        let (n, me) = (self.size(), self.rank());
        if self.comm().is_closed() {
            // This rank closed the context's connections: it has left.
            return Err(self.comm().revoked().unwrap_or_else(|| Error::invalid("agree on a closed context")));
        }
        let mut slot = lock(&self.survival().inner);
        let state = slot.get_or_insert_with(|| {
            let comm = self.comm().sibling(group_id(fnv(&[self.comm().group(), AGREE])));
            let max = 8 * (agree::HEAD + n.div_ceil(64));
            let recvs = (0..n).map(|r| (r != me).then(|| comm.persistent_recv(0, max, comm.spin(), "agree"))).collect();
            Agreements { comm, recvs, count: 0, later: Vec::new(), failed: vec![false; n] }
        });
        state.count += 1;
        let number = state.count;
        let deadline = Instant::now() + self.timeout();
        let members = state.comm.members();
        let world = |r: usize| members.get(r).copied().unwrap_or(r);
        // Ranks an earlier agreement decided failed stay failed (their connections are closed).
        let mut m = Machine::with_dead(me, n, flag, &state.failed);
        m.step();
        // Messages of this agreement that came during the last one.
        let early = std::mem::take(&mut state.later);
        for (from, words) in early {
            match Msg::decode(&words, n) {
                Ok((k, msg)) if k == number => m.on_message(from, msg),
                _ => {}
            }
        }
        loop {
            send(state, &mut m, number, deadline)?;
            if let Some(p) = m.decided() {
                let failed: Vec<usize> = (0..n).filter(|&r| p.failed.get(r).copied().unwrap_or(false)).collect();
                let value = p.value;
                // Fail-stop: the failed are cut off for good, also those whose connection to
                // this rank still looked fine (and this rank, if it is one of them).
                let cut: Vec<usize> = if failed.contains(&me) { (0..n).collect() } else { failed.clone() };
                let why = |r: usize| Error::Revoked {
                    rank: world(r),
                    reason: format!("the members agreed that rank {} failed", world(r)),
                };
                for &r in cut.iter().filter(|&&r| r != me) {
                    state.failed[r] = true;
                    state.close(r, &why(r));
                }
                if failed.contains(&me) {
                    return Err(Error::Revoked {
                        rank: world(me),
                        reason: format!(
                            "the other members agreed that rank {} failed (its connections looked dead to them); it \
                             must not go on in this context",
                            world(me)
                        ),
                    });
                }
                let live = n - failed.len();
                if live * 2 < n || (live * 2 == n && failed.contains(&0)) {
                    // No split brain: a minority (or the half without rank 0) does not go on.
                    return Err(Error::RanksFailed {
                        ranks: failed.iter().map(|&r| world(r)).collect(),
                        detail: format!(
                            "{live} of the {n} members are live, not a majority (or half with rank 0): this side does \
                             not go on"
                        ),
                    });
                }
                return Ok(Agreement { value, failed });
            }
            let peers = m.live_peers();
            let mut mine: Vec<&mut PersistentRecv> = Vec::with_capacity(peers.len());
            let mut from: Vec<[usize; 1]> = Vec::with_capacity(peers.len());
            for (r, recv) in state.recvs.iter_mut().enumerate() {
                if let Some(recv) = recv
                    && peers.contains(&r)
                {
                    mine.push(recv);
                    from.push([r]);
                }
            }
            let from: Vec<&[usize]> = from.iter().map(|f| &f[..]).collect();
            let got = if mine.is_empty() { None } else { wait_any(&mut mine, &from, deadline) };
            let Some((i, got)) = got else {
                let (waiting, what) = m.waiting_for();
                return Err(Error::Timeout {
                    op: format!("agreement {number} of rank {me}, waiting for {what}"),
                    ranks: waiting.iter().map(|&r| members.get(r).copied().unwrap_or(r)).collect(),
                    keys: Vec::new(),
                    waited: self.timeout(),
                });
            };
            let r = from[i][0];
            let decoded = got.and_then(|(_, bytes)| {
                let words: Vec<u64> =
                    bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
                Msg::decode(&words, n).map(|(k, msg)| (k, msg, words)).map_err(|why| Error::Protocol {
                    peer: Some(world(r)),
                    detail: format!("an agreement message {why}"),
                })
            });
            match decoded {
                // A message that began and stalled: the agreement gives up as at its deadline.
                Err(e) if e.is_timeout() => return Err(e),
                // A failed pair (it closed after everything it sent was read), or a message
                // that breaks the protocol: that peer is failed from now on.
                Err(e) => {
                    state.close(r, &e);
                    m.on_failure(r);
                }
                Ok((k, msg, _)) if k == number => m.on_message(r, msg),
                // The next agreement's (a peer that returned this one already): kept.
                Ok((k, _, words)) if k == number + 1 => state.later.push((r, words)),
                // A late acknowledgement of one this member returned, or junk from the future:
                // dropped.
                Ok(_) => {}
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
    /// ranks (from [`agree`](Self::agree)), and no survivor continues.
    ///
    /// The new context runs its collectives over the pairs (not the same-host area of the
    /// context the mesh was formed for), and its errors name ranks as every context's do: by
    /// their rank in the context the mesh was formed for
    /// ([`world_rank`](Self::world_rank)).
    pub fn shrink(&self) -> Result<Context> {
        let agreed = self.agree(!0)?;
        let n = self.size();
        let live: Vec<usize> = (0..n).filter(|r| !agreed.failed.contains(r)).collect();
        let members: Arc<[usize]> = live.iter().map(|&r| self.world_rank(r).unwrap_or(r)).collect();
        // The survivors go on: closing the mesh later is no longer news of the failure.
        lock(&self.comm().shared().failure).take();
        // The id binds the members too: survivors that disagreed could never mix messages.
        let kind: Vec<u64> = std::iter::once(SHRINK).chain(members.iter().map(|&m| m as u64)).collect();
        let group = self.comm().subgroup_id(fnv(&kind));
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
        // The grown context takes this one's cost model rather than measuring (newcomers read
        // it from the store): every rank uses the model parsed from the same text.
        let model = self.cost_model().map(|m| m.to_exact_text());
        if self.rank() == 0 {
            let text = format!("{epoch} {size} {n} {}", model.as_deref().unwrap_or("-"));
            store.set(GROW_OPEN, text.as_bytes())?;
        }
        let mut builder = Context::builder(self.rank(), size + n).timeout(self.timeout());
        if let Some(m) = model {
            builder = builder.cost_model(m.parse()?);
        }
        let grown = builder.connect(&PrefixStore::new(grow_prefix(epoch), store), self.device());
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
                    let mut builder = Context::builder(rank, new_size).timeout(timeout);
                    if let Some(m) = text.split(' ').nth(3).filter(|m| *m != "-") {
                        builder = builder.cost_model(m.parse()?);
                    }
                    return builder.connect(&PrefixStore::new(grow_prefix(epoch), store), device);
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
