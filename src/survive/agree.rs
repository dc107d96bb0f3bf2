//! The agreement of [`Context::agree`](crate::Context::agree) as a sans-IO state machine: one
//! member's part in one agreement, fed the messages it receives and the failures it observes,
//! giving back the messages to send and, in the end, the decision. The I/O around it is in
//! `super`; the tests here run many members through random schedules with random crashes.
//!
//! # The protocol
//!
//! Hierarchical uniform consensus (Cachin, Guerraoui and Rodrigues, *Reliable and Secure
//! Distributed Programming*, algorithm 5.4 in spirit) over the full mesh, with each pair's
//! failure detection (a closed connection) as a perfect failure detector. Messages of one pair
//! arrive in order, and a closed pair delivers what was sent before it closed first, so a
//! member that observes a peer's death has read everything that peer sent it.
//!
//! 1. **Propose.** Each member sends its flag to the coordinator, the lowest rank it has not
//!    seen die, with the proposal it has adopted, if any (below).
//! 2. **Adopt.** The coordinator waits until every member it has not seen die has proposed.
//!    Its proposal is the adopted one of the highest epoch among them (its own included),
//!    with that epoch, or, if none adopted any, a fresh one stamped with its own rank (the
//!    epoch): the AND of their flags and the ranks it has seen die. It adopts it itself and
//!    sends it to every live member; each adopts it if its epoch is at least that of what it
//!    holds. (An epoch names one proposal: the one its coordinator made fresh.)
//! 3. **Acknowledge, and decide.** A member that adopts a proposal tells every live member
//!    (the coordinator's own message counts as its acknowledgement). A member decides the
//!    proposal it holds once every member it has not seen die has acknowledged that epoch.
//! 4. **Take over.** A member that sees its coordinator die proposes to the next one.
//!
//! The ranks a proposal names failed were seen die by the coordinator that made it: a member
//! that receives the proposal counts them dead too (it does not wait for their
//! acknowledgements until its own connection to them says so).
//!
//! Why every member returns the same decision: a member decides only after every member it has
//! not seen die adopted its proposal, and a member that it saw die is dead. Adoptions only
//! move to later epochs, and a member adopts from a coordinator only before it sees that
//! coordinator die (a pair delivers what was sent before it closed first). So every member
//! alive when a decision was first made holds that proposal (or a later one of a coordinator
//! that chose it the same way) in every proposal it sends afterwards, and every later
//! coordinator hears it from all of them and proposes it again. Why it ends: once any member
//! decided, every live member holds that proposal and has told every other, so each of them
//! decides on the acknowledgements it gets, whatever became of the coordinators; before that,
//! a coordinator waits only for members it has not seen die, and none of them has returned.
//!
//! Without failures this is three message delays (propose, adopt, acknowledge) and, with `n`
//! members, `(n - 1)(n + 1)` messages; a member other than the coordinator with one peer
//! decides on the adopt already (the coordinator's adoption is the only other).

/// A proposal: the value (AND of flags) and the failed ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Proposal {
    pub(crate) value: u64,
    pub(crate) failed: Vec<bool>,
}

/// A proposal a member adopted, with the epoch (coordinator) it came from.
pub(crate) type Adopted = (usize, Proposal);

/// The agreement's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Msg {
    /// A member's flag, and the proposal it adopted (epoch, proposal) if any.
    Propose { flag: u64, adopted: Option<Adopted> },
    /// The coordinator `epoch`'s proposal, to adopt.
    Adopt { epoch: usize, proposal: Proposal },
    /// Adopted coordinator `epoch`'s proposal.
    Ack { epoch: usize },
}

const PROPOSE: u64 = 0x5052_4f50;
const ADOPT: u64 = 0x4144_4f50;
const ACK: u64 = 0x4143_4b21;
/// No epoch (a proposal without an adopted one).
const NONE: u64 = u64::MAX;
/// Words before the bitmap of failed ranks: kind, agreement number, epoch, value, flag.
pub(crate) const HEAD: usize = 5;

impl Msg {
    /// Its words on the wire, for agreement `number` of a context of `n` ranks.
    pub(crate) fn encode(&self, number: u64, n: usize) -> Vec<u64> {
        let (kind, epoch, proposal, flag) = match self {
            Msg::Propose { flag, adopted } => {
                (PROPOSE, adopted.as_ref().map_or(NONE, |a| a.0 as u64), adopted.as_ref().map(|a| &a.1), *flag)
            }
            Msg::Adopt { epoch, proposal } => (ADOPT, *epoch as u64, Some(proposal), 0),
            Msg::Ack { epoch } => (ACK, *epoch as u64, None, 0),
        };
        let mut w = vec![kind, number, epoch, proposal.map_or(0, |p| p.value), flag];
        w.resize(HEAD + n.div_ceil(64), 0);
        if let Some(p) = proposal {
            for (r, _) in p.failed.iter().enumerate().filter(|(_, f)| **f) {
                w[HEAD + r / 64] |= 1 << (r % 64);
            }
        }
        w
    }

    /// The agreement number and message of `w`, for a context of `n` ranks; what is wrong
    /// with it otherwise.
    pub(crate) fn decode(w: &[u64], n: usize) -> Result<(u64, Msg), String> {
        if w.len() != HEAD + n.div_ceil(64) {
            return Err(format!("of {} words, not {}", w.len(), HEAD + n.div_ceil(64)));
        }
        let epoch = |e: u64| usize::try_from(e).ok().filter(|&e| e < n).ok_or_else(|| format!("of epoch {e}"));
        let proposal =
            || Proposal { value: w[3], failed: (0..n).map(|r| w[HEAD + r / 64] >> (r % 64) & 1 == 1).collect() };
        let msg = match w[0] {
            PROPOSE if w[2] == NONE => Msg::Propose { flag: w[4], adopted: None },
            PROPOSE => Msg::Propose { flag: w[4], adopted: Some((epoch(w[2])?, proposal())) },
            ADOPT => Msg::Adopt { epoch: epoch(w[2])?, proposal: proposal() },
            ACK => Msg::Ack { epoch: epoch(w[2])? },
            k => return Err(format!("of unknown kind {k:#x}")),
        };
        Ok((w[1], msg))
    }
}

/// One member's part in one agreement.
#[derive(Debug)]
pub(crate) struct Machine {
    me: usize,
    n: usize,
    flag: u64,
    /// Ranks this member saw die (their connection closed, after everything they sent).
    dead: Vec<bool>,
    adopted: Option<Adopted>,
    /// What each member proposed to this one (flag, adopted).
    proposals: Vec<Option<(u64, Option<Adopted>)>>,
    /// The epochs each member acknowledged to this one (a coordinator's adopt included).
    acked: Vec<Vec<usize>>,
    proposed_to: Option<usize>,
    /// As coordinator: every live member proposed, and its proposal went out.
    collected: bool,
    out: Vec<(usize, Msg)>,
    decided: Option<Proposal>,
}

impl Machine {
    /// Member `me` of `n`, proposing `flag`, knowing the ranks `dead` (earlier agreements'
    /// failed ranks, whose connections are closed) dead; call [`step`](Self::step) to start.
    pub(crate) fn with_dead(me: usize, n: usize, flag: u64, dead: &[bool]) -> Self {
        let mut m = Machine::new(me, n, flag);
        for (r, _) in dead.iter().enumerate().filter(|(r, d)| **d && *r != me && *r < n) {
            m.dead[r] = true;
        }
        m
    }

    /// Member `me` of `n`, proposing `flag`; call [`step`](Self::step) to start.
    pub(crate) fn new(me: usize, n: usize, flag: u64) -> Self {
        let mut proposals = vec![None; n];
        if let Some(p) = proposals.get_mut(me) {
            *p = Some((flag, None));
        }
        Machine {
            me,
            n,
            flag,
            dead: vec![false; n],
            adopted: None,
            proposals,
            acked: vec![Vec::new(); n],
            proposed_to: None,
            collected: false,
            out: Vec::new(),
            decided: None,
        }
    }

    /// The decision, once there is one (the machine then does nothing more).
    pub(crate) fn decided(&self) -> Option<&Proposal> {
        self.decided.as_ref()
    }

    /// The messages to send, in order (the caller reports a send that fails as the peer's
    /// failure).
    pub(crate) fn take_sends(&mut self) -> Vec<(usize, Msg)> {
        std::mem::take(&mut self.out)
    }

    /// The ranks whose messages this member may still need (the live ones but itself).
    pub(crate) fn live_peers(&self) -> Vec<usize> {
        (0..self.n).filter(|&r| r != self.me && !self.dead[r]).collect()
    }

    /// Whom it waits for, and for what, in words (for a timeout's message).
    pub(crate) fn waiting_for(&self) -> (Vec<usize>, &'static str) {
        if let Some((e, _)) = &self.adopted {
            let missing: Vec<usize> = self.live_peers().into_iter().filter(|&r| !self.acked[r].contains(e)).collect();
            return (missing, "the members to adopt the proposal it holds");
        }
        let c = self.coordinator();
        if c != self.me {
            return (vec![c], "the proposal of its coordinator");
        }
        (
            (0..self.n).filter(|&r| !self.dead[r] && self.proposals[r].is_none()).collect(),
            "the proposals of the members",
        )
    }

    fn coordinator(&self) -> usize {
        (0..self.n).find(|&r| !self.dead[r]).unwrap_or(self.me)
    }

    fn send_all(&mut self, msg: &Msg) {
        for r in self.live_peers() {
            self.out.push((r, msg.clone()));
        }
    }

    /// Decides the proposal it holds once every member it has not seen die acknowledged it.
    fn try_decide(&mut self) {
        let Some((e, p)) = &self.adopted else { return };
        if self.live_peers().iter().all(|&r| self.acked[r].contains(e)) {
            self.decided = Some(p.clone());
        }
    }

    /// Peer `r` died: its connection closed, after everything it sent was read.
    pub(crate) fn on_failure(&mut self, r: usize) {
        if r < self.n && r != self.me && self.decided.is_none() {
            self.dead[r] = true;
            self.step();
        }
    }

    /// A message of this agreement from `from`.
    pub(crate) fn on_message(&mut self, from: usize, msg: Msg) {
        if from >= self.n || from == self.me || self.dead[from] || self.decided.is_some() {
            return;
        }
        // A proposal's failed ranks were seen die by its coordinator: they are dead, whether
        // this member has seen it yet or not (nothing to wait for from them).
        let learned = match &msg {
            Msg::Propose { adopted: Some((_, p)), .. } | Msg::Adopt { proposal: p, .. } => Some(&p.failed),
            _ => None,
        };
        for r in learned.into_iter().flat_map(|f| (0..self.n).filter(|&r| f.get(r) == Some(&true))) {
            if r != self.me {
                self.dead[r] = true;
            }
        }
        match msg {
            Msg::Propose { flag, adopted } => self.proposals[from] = Some((flag, adopted)),
            Msg::Adopt { epoch, proposal } => {
                // The coordinator's adopt is its own acknowledgement.
                self.acked[from].push(epoch);
                if self.adopted.as_ref().is_none_or(|(e, _)| epoch >= *e) {
                    self.adopted = Some((epoch, proposal));
                    self.send_all(&Msg::Ack { epoch });
                }
            }
            Msg::Ack { epoch } => self.acked[from].push(epoch),
        }
        self.step();
    }

    /// Does what the state calls for: propose to a new coordinator, or, as coordinator,
    /// propose once all proposed and decide once all adopted.
    pub(crate) fn step(&mut self) {
        if self.decided.is_some() {
            return;
        }
        let c = self.coordinator();
        if c != self.me {
            if self.proposed_to != Some(c) {
                self.proposed_to = Some(c);
                self.out.push((c, Msg::Propose { flag: self.flag, adopted: self.adopted.clone() }));
            }
            return self.try_decide();
        }
        if !self.collected {
            if (0..self.n).any(|r| !self.dead[r] && self.proposals[r].is_none()) {
                return self.try_decide();
            }
            let live = || (0..self.n).filter(|&r| !self.dead[r]);
            let newest = live()
                .filter_map(|r| self.proposals[r].as_ref().and_then(|p| p.1.clone()))
                .chain(self.adopted.clone())
                .max_by_key(|(e, _)| *e);
            // An adopted proposal keeps its epoch: members that decided on it acknowledged
            // that epoch, and may have returned.
            let (epoch, proposal) = newest.unwrap_or_else(|| {
                let value = live().filter_map(|r| self.proposals[r].as_ref().map(|p| p.0)).fold(!0, |a, f| a & f);
                (self.me, Proposal { value, failed: self.dead.clone() })
            });
            self.adopted = Some((epoch, proposal.clone()));
            self.send_all(&Msg::Adopt { epoch, proposal });
            self.collected = true;
        }
        self.try_decide();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// A run of `n` members under a random schedule: `crashes` names members that crash, and
    /// after how many of their own sends at the latest (a crash in the middle of a broadcast
    /// included); they may also crash at any moment before, while waiting, or after they
    /// returned. A crash is observed by a live member when it has read everything the crashed
    /// one sent it, or earlier (losing the rest), or at once by a member whose send to it
    /// fails, as the driver does. Returns every decision made (by rank) and whether every
    /// live member decided.
    fn simulate(n: usize, flags: &[u64], crashes: &[(usize, usize)], seed: u64) -> (Vec<Option<Proposal>>, bool) {
        let mut rng = seed | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut m: Vec<Machine> = (0..n).map(|r| Machine::new(r, n, flags[r])).collect();
        // queue[a][b]: messages from a to b, in order.
        let mut queue: Vec<Vec<VecDeque<Msg>>> = vec![vec![VecDeque::new(); n]; n];
        let mut crashed = vec![false; n];
        let mut sent = vec![0usize; n];
        // seen[b][a]: b observed a's death.
        let mut seen = vec![vec![false; n]; n];
        let budget = |r: usize| crashes.iter().find(|c| c.0 == r).map(|c| c.1);
        // Sends what member `r` queued, until it crashes; a send to a crashed member may be
        // seen to fail at once (`fail_fast`), which may queue more.
        let flush = |r: usize,
                     m: &mut Vec<Machine>,
                     queue: &mut Vec<Vec<VecDeque<Msg>>>,
                     crashed: &mut Vec<bool>,
                     sent: &mut Vec<usize>,
                     seen: &mut Vec<Vec<bool>>,
                     fail_fast: bool| {
            loop {
                let sends = m[r].take_sends();
                if sends.is_empty() || crashed[r] {
                    return;
                }
                for (to, msg) in sends {
                    if budget(r).is_some_and(|b| sent[r] >= b) {
                        crashed[r] = true;
                        return;
                    }
                    sent[r] += 1;
                    if crashed[to] && fail_fast && !seen[r][to] {
                        seen[r][to] = true;
                        m[r].on_failure(to);
                    } else {
                        queue[r][to].push_back(msg);
                    }
                }
            }
        };
        for r in 0..n {
            if budget(r) == Some(0) {
                crashed[r] = true;
            }
            m[r].step();
            flush(r, &mut m, &mut queue, &mut crashed, &mut sent, &mut seen, false);
        }
        for _ in 0..200_000 {
            // Enabled events: a delivery to a live member that has not returned; a live member
            // observing a crashed one (after reading all it sent, or early, losing the rest).
            let mut events = Vec::new();
            for a in 0..n {
                for b in 0..n {
                    let active = !crashed[b] && m[b].decided().is_none();
                    if !active || a == b {
                        continue;
                    }
                    if !queue[a][b].is_empty() {
                        events.push((a, b, true));
                    }
                    if crashed[a] && !seen[b][a] && (queue[a][b].is_empty() || next() % 8 == 0) {
                        events.push((a, b, false));
                    }
                }
            }
            if events.is_empty() {
                break;
            }
            let (a, b, deliver) = events[(next() % events.len() as u64) as usize];
            if deliver {
                if let Some(msg) = queue[a][b].pop_front() {
                    m[b].on_message(a, msg);
                }
            } else {
                queue[a][b].clear();
                seen[b][a] = true;
                m[b].on_failure(a);
            }
            let fail_fast = next() % 2 == 0;
            flush(b, &mut m, &mut queue, &mut crashed, &mut sent, &mut seen, fail_fast);
            // A member that may crash does so now and then: while waiting, or after it returned.
            for (r, c) in crashed.iter_mut().enumerate() {
                if !*c && budget(r).is_some() && next() % 16 == 0 {
                    *c = true;
                }
            }
        }
        let all_live_decided = (0..n).all(|r| crashed[r] || m[r].decided().is_some());

        (m.iter().map(|x| x.decided().cloned()).collect(), all_live_decided)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        #[test]
        fn every_member_that_decides_decides_the_same_and_every_live_member_decides(
            n in 1usize..8,
            flags in proptest::collection::vec(any::<u64>(), 8),
            crash in proptest::collection::vec((0usize..8, 0usize..12), 0..6),
            seed in any::<u64>(),
        ) {
            let crashes: Vec<(usize, usize)> = crash.into_iter().filter(|c| c.0 < n).collect();
            let (decisions, ended) = simulate(n, &flags, &crashes, seed);
            prop_assert!(ended, "a live member did not decide: {:?}", decisions);
            let made: Vec<&Proposal> = decisions.iter().flatten().collect();
            for d in &made {
                prop_assert_eq!(*d, made[0], "two decisions");
            }
            let crashed: Vec<usize> = crashes.iter().map(|c| c.0).collect();
            if let Some(d) = made.first() {
                for (r, f) in d.failed.iter().enumerate() {
                    prop_assert!(!f || crashed.contains(&r), "rank {} decided failed but never crashed", r);
                }
                // The value is the AND of the flags of the members not failed.
                let live_and = (0..n).filter(|&r| !d.failed[r]).fold(!0u64, |a, r| a & flags[r]);
                prop_assert_eq!(d.value, live_and);
            }
            if crashes.is_empty() {
                let all = flags[..n].iter().fold(!0u64, |a, f| a & f);
                prop_assert_eq!(made.len(), n);
                prop_assert_eq!(made[0], &Proposal { value: all, failed: vec![false; n] });
            }
        }

        #[test]
        fn messages_round_trip_and_bad_words_never_panic(
            n in 1usize..200, value in any::<u64>(), flag in any::<u64>(), bits in any::<u64>(),
            epoch in 0usize..200, number in any::<u64>(), junk in proptest::collection::vec(any::<u64>(), 0..12),
        ) {
            let epoch = epoch % n;
            let p = Proposal { value, failed: (0..n).map(|r| bits >> (r % 64) & 1 == 1).collect() };
            for msg in [
                Msg::Propose { flag, adopted: None },
                Msg::Propose { flag, adopted: Some((epoch, p.clone())) },
                Msg::Adopt { epoch, proposal: p.clone() },
                Msg::Ack { epoch },
            ] {
                let w = msg.encode(number, n);
                prop_assert_eq!(Msg::decode(&w, n), Ok((number, msg)));
            }
            let _ = Msg::decode(&junk, n);
        }
    }

    #[test]
    fn a_coordinator_that_dies_mid_decision_leaves_its_decision_to_the_next() {
        // Rank 0, the coordinator, crashes after its 3 adopts: the members decide on each
        // other's acknowledgements (and the next coordinator, waiting for proposals, too).
        for seed in 0..200 {
            let (d, ended) = simulate(4, &[0b111, 0b110, 0b011, 0b111], &[(0, 4)], seed);
            assert!(ended);
            let made: Vec<&Proposal> = d.iter().flatten().collect();
            assert!(made.iter().all(|p| *p == made[0]), "seed {seed}: {d:?}");
            // Everyone adopted rank 0's proposal before it decided: the value is all four flags'.
            assert_eq!(made[0].value, 0b010, "seed {seed}");
        }
    }
}
