//! A cycle's agreement as a reduction (Horovod's bitwise allreduce of the cache's bits): what
//! the ranks' state messages say together, in a form that two partial results combine into
//! one (ANDs and ORs of bit vectors), so that the ranks can agree in `floor(log2 n)` rounds of
//! one message each (recursive doubling, [`rounds`]; two more for the ranks paired up first
//! where `n` is not a power of two) instead of each sending its state to every other rank.
//! The coordinator keeps its role: ranks with names not in the cache send them to rank 0 in
//! full, and rank 0's responses go down a binomial tree ([`tree_parent`], [`tree_children`]).

use super::cache::set_index;
use super::wire::{self, JOINED, REQUESTS, SHUTDOWN, State};
use crate::Context;
use crate::codec::{BufMutExt, DecodeError, Decoded, Reader};
use crate::error::{Error, Result};
use crate::types::Reduction;
use smallvec::SmallVec;
use std::time::{Duration, Instant};

/// A bit vector (over cache slots or ranks), inline up to 1,024 bits.
pub(crate) type Bits = SmallVec<[u64; 16]>;

/// What every rank's state says together: the part of a cycle's decision that does not need
/// any one rank's message (only the coordinator needs the names sent in full).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Summary {
    /// The cycle (every rank's must be the same).
    pub(crate) cycle: u64,
    /// Cache slots every rank has pending.
    pub(crate) pending_all: Bits,
    /// Cache slots every rank that has not joined has pending (a joined rank counts as having
    /// all: an allreduce runs without it).
    pub(crate) pending_unjoined: Bits,
    /// Cache slots some rank has pending.
    pub(crate) pending_any: Bits,
    /// Cache slots some rank found out of date.
    pub(crate) invalidate: Bits,
    /// Per rank (a bit each): it has joined.
    pub(crate) joined: Bits,
    /// Per rank: it shuts the engine down.
    pub(crate) shutdown: Bits,
    /// Per rank: it sends names in full to the coordinator this cycle.
    pub(crate) requests: Bits,
}

/// The root of the responses' tree: the coordinator, rank 0 (`controller::COORDINATOR`, which
/// this module does not import: the controller uses it).
const ROOT: usize = 0;

/// The message type of a summary (after the engine's [`wire`] types).
const SUMMARY: u8 = 3;

fn rank_words(n: usize) -> usize {
    n.div_ceil(64)
}

impl Summary {
    /// Nothing yet, for `n` ranks and `words` words of cache bits: what combining with any
    /// summary leaves as that summary.
    pub(crate) fn empty(cycle: u64, words: usize, n: usize) -> Summary {
        let zeros = |k: usize| -> Bits { smallvec::smallvec![0; k] };
        let ones: Bits = smallvec::smallvec![u64::MAX; words];
        Summary {
            cycle,
            pending_all: ones.clone(),
            pending_unjoined: ones,
            pending_any: zeros(words),
            invalidate: zeros(words),
            joined: zeros(rank_words(n)),
            shutdown: zeros(rank_words(n)),
            requests: zeros(rank_words(n)),
        }
    }

    /// Combines rank `rank`'s state into this summary (of the same cycle and cache size: the
    /// caller has checked).
    fn fold(&mut self, s: &State, rank: usize) {
        let joined = s.flags & JOINED != 0;
        for (i, &w) in s.pending.iter().enumerate().take(self.pending_all.len()) {
            self.pending_all[i] &= w;
            if !joined {
                self.pending_unjoined[i] &= w;
            }
            self.pending_any[i] |= w;
        }
        self.invalidate.iter_mut().zip(&s.invalidate).for_each(|(a, b)| *a |= b);
        for (flag, bits) in [(JOINED, &mut self.joined), (SHUTDOWN, &mut self.shutdown), (REQUESTS, &mut self.requests)]
        {
            if s.flags & flag != 0 {
                set_index(bits, rank);
            }
        }
    }

    /// Rank `rank`'s own state of `n` ranks, as a summary of one.
    pub(crate) fn of(s: &State, rank: usize, n: usize) -> Summary {
        let mut one = Summary::empty(s.cycle, s.pending.len(), n);
        one.fold(s, rank);
        one
    }

    /// Combines `other` (of other ranks) into this summary: the order does not matter, so
    /// every rank that combines the same summaries in any order holds the same result. Two
    /// summaries of different cycles, or of caches of different sizes, are a protocol error
    /// naming rank `peer` (whose summary `other` came with).
    pub(crate) fn merge(&mut self, other: &Summary, me: usize, peer: usize) -> Result<()> {
        self.same_cycle(other, me, peer)?;
        if other.pending_all.len() != self.pending_all.len() || other.joined.len() != self.joined.len() {
            return Err(Error::Protocol {
                peer: Some(peer),
                detail: format!(
                    "engine: rank {peer} has {} cache words and {} rank words, rank {me} {} and {} (the response caches \
                     or the engines' sizes diverged)",
                    other.pending_all.len(),
                    other.joined.len(),
                    self.pending_all.len(),
                    self.joined.len()
                ),
            });
        }
        let and = |a: &mut Bits, b: &Bits| a.iter_mut().zip(b).for_each(|(a, b)| *a &= b);
        let or = |a: &mut Bits, b: &Bits| a.iter_mut().zip(b).for_each(|(a, b)| *a |= b);
        and(&mut self.pending_all, &other.pending_all);
        and(&mut self.pending_unjoined, &other.pending_unjoined);
        or(&mut self.pending_any, &other.pending_any);
        or(&mut self.invalidate, &other.invalidate);
        or(&mut self.joined, &other.joined);
        or(&mut self.shutdown, &other.shutdown);
        or(&mut self.requests, &other.requests);
        Ok(())
    }

    /// Whether `other` (rank `peer`'s) is of this summary's cycle: a protocol error naming
    /// `peer` where it is not (rank `me` is this one).
    pub(crate) fn same_cycle(&self, other: &Summary, me: usize, peer: usize) -> Result<()> {
        match other.cycle == self.cycle {
            true => Ok(()),
            false => Err(Error::Protocol {
                peer: Some(peer),
                detail: format!(
                    "engine: rank {peer} agrees on cycle {}, rank {me} on cycle {}",
                    other.cycle, self.cycle
                ),
            }),
        }
    }

    /// The states of all `n` ranks at once (the direct exchange: `(rank, state)`, each of
    /// cycle `cycle` with `words` words of cache bits, which the caller has checked), combined.
    pub(crate) fn of_all<'s>(
        states: impl IntoIterator<Item = (usize, &'s State)>,
        cycle: u64,
        words: usize,
        n: usize,
    ) -> Summary {
        let mut all = Summary::empty(cycle, words, n);
        for (r, s) in states {
            all.fold(s, r);
        }
        all
    }

    /// The message.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let words = 4 * self.pending_all.len() + 3 * self.joined.len();
        let mut out = Vec::with_capacity(24 + 8 * words);
        out.write(SUMMARY);
        out.write(self.cycle);
        out.write_count(self.pending_all.len());
        out.write_count(self.joined.len());
        for v in self.vectors() {
            v.iter().for_each(|&w| out.write(w));
        }
        out
    }

    fn vectors(&self) -> [&Bits; 7] {
        [
            &self.pending_all,
            &self.pending_unjoined,
            &self.pending_any,
            &self.invalidate,
            &self.joined,
            &self.shutdown,
            &self.requests,
        ]
    }

    /// Rank `peer`'s summary message, for an engine of `n` ranks; a malformed one is
    /// [`Error::Protocol`] naming `peer` and the byte.
    pub(crate) fn decode(buf: &[u8], peer: usize, n: usize) -> Result<Summary> {
        wire::decode_message(buf, peer, |r: &mut Reader<'_>| -> Decoded<Summary> {
            if r.get::<u8>()? != SUMMARY {
                return Err(DecodeError::malformed("not a summary message"));
            }
            let cycle = r.get()?;
            let words = r.count(4 * 8)?;
            let ranks = r.count(3 * 8)?;
            if ranks != rank_words(n) {
                return Err(DecodeError::malformed(format!("bits for {ranks} words of ranks in an engine of {n}")));
            }
            let mut bits = |k: usize| r.words(k).map(Bits::from_vec);
            Ok(Summary {
                cycle,
                pending_all: bits(words)?,
                pending_unjoined: bits(words)?,
                pending_any: bits(words)?,
                invalidate: bits(words)?,
                joined: bits(ranks)?,
                shutdown: bits(ranks)?,
                requests: bits(ranks)?,
            })
        })
    }
}

/// One step of a rank's part in the recursive-doubling reduction of `n` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Round {
    /// Send this rank's summary to the peer and take the peer's (combined into this rank's
    /// when `merge`: a rank left out of the doubling gives its own and takes its partner's
    /// without combining, then waits for the result).
    Swap { peer: usize, merge: bool },
    /// Send the result to the peer (a rank left out of the doubling).
    Give(usize),
    /// The result comes from the peer (this rank was left out).
    Take(usize),
}

impl Round {
    /// The peer of this step, whether this rank sends to it, and whether it takes a message
    /// from it.
    pub(crate) fn parts(self) -> (usize, bool, bool) {
        match self {
            Round::Swap { peer, .. } => (peer, true, true),
            Round::Give(peer) => (peer, true, false),
            Round::Take(peer) => (peer, false, true),
        }
    }
}

/// Rank `me`'s rounds of the recursive doubling over `n` ranks: with `p` the largest power of
/// two not above `n` and `e = n - p`, the first `2e` ranks pair up (each even one swaps with
/// the next; the odd one goes on for both), the `p` left double (round k with the rank whose
/// index among them differs in bit k), and each odd one of the first `2e` gives the result to
/// its even partner. Every message is answered by one the other way in the same round, but
/// the last (so a rank that waits idle is woken by whichever of its peers begins first).
pub(crate) fn rounds(me: usize, n: usize) -> Vec<Round> {
    if n < 2 || me >= n {
        return Vec::new();
    }
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p;
    let mut out = Vec::new();
    let index = if me < 2 * extra {
        if me.is_multiple_of(2) {
            out.push(Round::Swap { peer: me + 1, merge: false });
            out.push(Round::Take(me + 1));
            return out;
        }
        out.push(Round::Swap { peer: me - 1, merge: true });
        me / 2
    } else {
        me - extra
    };
    // Index among the p back to a rank.
    let rank = |i: usize| if i < extra { 2 * i + 1 } else { i + extra };
    let mut bit = 1;
    while bit < p {
        out.push(Round::Swap { peer: rank(index ^ bit), merge: true });
        bit <<= 1;
    }
    if me < 2 * extra {
        out.push(Round::Give(me - 1));
    }
    out
}

/// The parent of rank `r` in the binomial tree rooted at the coordinator (rank 0): `r`
/// without its highest set bit. `None` for the root.
pub(crate) fn tree_parent(r: usize) -> Option<usize> {
    (r != ROOT).then(|| r & !(1usize << (usize::BITS - 1 - r.leading_zeros())))
}

/// The children of rank `r` in that tree, of `n` ranks: `r` with one more bit set above its
/// highest, within `n`.
pub(crate) fn tree_children(r: usize, n: usize) -> impl Iterator<Item = usize> {
    let low = if r == 0 { 1 } else { 1usize << (usize::BITS - r.leading_zeros()) };
    std::iter::successors(Some(low), |b| b.checked_mul(2)).map_while(move |b| (r + b < n).then_some(r + b))
}

/// The tag of the messages that time the two ways of agreeing as an engine starts.
const PROBE_TAG: u32 = 0x4647_4550; // "FGEP"
/// Timed exchanges of each way (after one untimed).
const PROBE_REPS: usize = 7;

/// How long one cycle's agreement takes the ranks of `ctx`, each rank sending its state to
/// every other (`direct`) and by reduction (`reduced`), as this host and network measure it:
/// exchanges of messages of a state's and a summary's size for a cache of `words` words, the
/// mean of [`PROBE_REPS`] back to back on each rank, the slowest rank's. Every rank gets the same
/// figures (an allreduce of them), so every rank makes the same choice. A few exchanges of
/// each: well under a millisecond on one host, `log2(n)` and `n` round trips across hosts.
pub(crate) fn measure(ctx: &Context, words: usize) -> Result<Probe> {
    let (me, n) = (ctx.rank(), ctx.size());
    // A state of `words` words (the direct message) and a summary of them (the reduction's).
    let state = vec![0u8; 24 + 16 * words];
    let summary = Summary::empty(0, words, n).encode();
    let rounds = rounds(me, n);
    let direct = |ctx: &Context| -> Result<()> {
        ctx.scope(|s| {
            let sends =
                (0..n).filter(|&p| p != me).map(|p| s.isend(p, PROBE_TAG, &state)).collect::<Result<Vec<_>>>()?;
            for p in (0..n).filter(|&p| p != me) {
                // Bounded by any message, not this rank's size: the ranks' caches may differ.
                s.irecv_bytes(&[p], PROBE_TAG, wire::MAX_MESSAGE)?.wait()?;
            }
            sends.into_iter().try_for_each(|s| s.wait())
        })
    };
    let reduced = |ctx: &Context| -> Result<()> {
        ctx.scope(|s| {
            for &round in &rounds {
                let (peer, sends, takes) = round.parts();
                let sent = sends.then(|| s.isend(peer, PROBE_TAG, &summary)).transpose()?;
                if takes {
                    s.irecv_bytes(&[peer], PROBE_TAG, wire::MAX_MESSAGE)?.wait()?;
                }
                sent.map_or(Ok(()), |s| s.wait())?;
            }
            Ok(())
        })
    };
    // Each way on its own, after one untimed exchange and a barrier (so that neither times the
    // other's stragglers): the mean of back-to-back exchanges, as cycles follow each other.
    let mut means = [0f64; 2];
    for (way, run) in [&direct as &dyn Fn(&Context) -> Result<()>, &reduced].into_iter().enumerate() {
        run(ctx)?;
        ctx.barrier()?;
        let t = Instant::now();
        for _ in 0..PROBE_REPS {
            run(ctx)?;
        }
        means[way] = t.elapsed().as_secs_f64() / PROBE_REPS as f64;
    }
    ctx.allreduce(&mut means, Reduction::Max)?;
    let [direct, reduced] = means.map(|s| Duration::from_secs_f64(s.clamp(0.0, 1e6)));
    Ok(Probe { direct, reduced })
}

/// What [`measure`] found: one agreement's time each way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Probe {
    /// Each rank sending its state to every other.
    pub(crate) direct: Duration,
    /// By reduction.
    pub(crate) reduced: Duration,
}

#[cfg(test)]
mod tests {
    use super::super::cache::is_set;
    use super::*;
    use proptest::prelude::*;

    /// Runs every rank's rounds together, each rank holding a set of ranks (a bit each) that
    /// the rounds combine by union: every rank must end with every rank, each message must
    /// meet the step that takes it, and no rank may wait on one that waits on it.
    fn simulate(n: usize) -> Vec<Vec<u64>> {
        let mut have: Vec<Vec<u64>> = (0..n)
            .map(|r| {
                let mut v = vec![0; rank_words(n)];
                set_index(&mut v, r);
                v
            })
            .collect();
        let plans: Vec<Vec<Round>> = (0..n).map(|r| rounds(r, n)).collect();
        let mut at = vec![0usize; n];
        // In flight: (from, to) -> what was sent, in order.
        let mut wires: std::collections::HashMap<(usize, usize), std::collections::VecDeque<Vec<u64>>> =
            Default::default();
        let mut sent = vec![false; n];
        loop {
            let mut moved = false;
            for r in 0..n {
                let Some(&step) = plans[r].get(at[r]) else { continue };
                match step {
                    Round::Swap { peer, merge } => {
                        if !sent[r] {
                            wires.entry((r, peer)).or_default().push_back(have[r].clone());
                            sent[r] = true;
                            moved = true;
                        }
                        if let Some(got) = wires.get_mut(&(peer, r)).and_then(|q| q.pop_front()) {
                            if merge {
                                have[r].iter_mut().zip(&got).for_each(|(a, b)| *a |= b);
                            }
                            at[r] += 1;
                            sent[r] = false;
                            moved = true;
                        }
                    }
                    Round::Give(peer) => {
                        wires.entry((r, peer)).or_default().push_back(have[r].clone());
                        at[r] += 1;
                        moved = true;
                    }
                    Round::Take(peer) => {
                        if let Some(got) = wires.get_mut(&(peer, r)).and_then(|q| q.pop_front()) {
                            have[r] = got;
                            at[r] += 1;
                            moved = true;
                        }
                    }
                }
            }
            if !moved {
                break;
            }
        }
        assert!((0..n).all(|r| at[r] == plans[r].len()), "n = {n}: a rank is stuck: {at:?}");
        assert!(wires.values().all(|q| q.is_empty()), "n = {n}: a message nobody took");
        have
    }

    #[test]
    fn every_rank_ends_with_every_rank_in_log_rounds() {
        for n in 1..=70 {
            let all = simulate(n);
            for (r, v) in all.iter().enumerate() {
                assert!((0..n).all(|i| is_set(v, i)), "n = {n}, rank {r}: {v:?}");
                let swaps = rounds(r, n).iter().filter(|s| matches!(s, Round::Swap { .. })).count();
                let log = usize::BITS - (n.max(1) - 1).leading_zeros();
                assert!(swaps <= log as usize + 1, "n = {n}, rank {r}: {swaps} rounds");
            }
        }
    }

    #[test]
    fn the_binomial_tree_reaches_every_rank_once() {
        for n in 1..=70 {
            let mut reached = vec![0; n];
            reached[0] = 1;
            let mut depth = vec![0usize; n];
            for r in 0..n {
                for c in tree_children(r, n) {
                    assert_eq!(tree_parent(c), Some(r), "n = {n}: child {c} of {r}");
                    reached[c] += 1;
                    depth[c] = depth[r] + 1;
                }
            }
            assert!(reached.iter().all(|&k| k == 1), "n = {n}: {reached:?}");
            let log = (usize::BITS - (n.max(1) - 1).leading_zeros()) as usize;
            assert!(depth.iter().all(|&d| d <= log), "n = {n}: {depth:?}");
        }
        assert_eq!(tree_parent(0), None);
    }

    fn state(cycle: u64, flags: u8, pending: Vec<u64>, invalidate: Vec<u64>) -> State {
        State { cycle, flags, pending, invalidate, requests: Vec::new() }
    }

    proptest! {
        /// Combined in any grouping and order, the summaries say what the states say one by
        /// one (the direct exchange's reading of them).
        #[test]
        fn summaries_combine_to_what_the_states_say(
            n in 1usize..10,
            words in 1usize..4,
            seed in any::<u64>(),
            order in any::<u64>(),
        ) {
            let mut x = seed | 1;
            let mut next = move || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x };
            let states: Vec<State> = (0..n)
                .map(|_| {
                    let flags = (next() % 8) as u8;
                    let pending = (0..words).map(|_| next() | next()).collect();
                    let invalidate = (0..words).map(|_| next() & next() & next()).collect();
                    state(7, flags, pending, invalidate)
                })
                .collect();
            let all = Summary::of_all(states.iter().enumerate(), 7, words, n);
            // The same, combined pairwise in a shuffled order.
            let mut parts: Vec<Summary> = states.iter().enumerate().map(|(r, s)| Summary::of(s, r, n)).collect();
            let mut o = order;
            while parts.len() > 1 {
                let i = (o as usize) % parts.len();
                o = o.rotate_left(7) ^ 0x9e37;
                let a = parts.swap_remove(i);
                let j = (o as usize) % parts.len();
                parts[j].merge(&a, 0, 1).unwrap();
            }
            prop_assert_eq!(&parts[0], &all);
            let back = Summary::decode(&all.encode(), 3, n).unwrap();
            prop_assert_eq!(&back, &all);
            for slot in 0..64 * words {
                let has = |r: usize| is_set(&states[r].pending, slot);
                let joined = |r: usize| states[r].flags & JOINED != 0;
                prop_assert_eq!(is_set(&all.pending_all, slot), (0..n).all(has));
                prop_assert_eq!(is_set(&all.pending_any, slot), (0..n).any(has));
                prop_assert_eq!(is_set(&all.pending_unjoined, slot), (0..n).filter(|&r| !joined(r)).all(has));
                prop_assert_eq!(
                    is_set(&all.invalidate, slot),
                    (0..n).any(|r| is_set(&states[r].invalidate, slot))
                );
            }
            for (r, s) in states.iter().enumerate() {
                prop_assert_eq!(is_set(&all.joined, r), s.flags & JOINED != 0);
                prop_assert_eq!(is_set(&all.shutdown, r), s.flags & SHUTDOWN != 0);
                prop_assert_eq!(is_set(&all.requests, r), s.flags & REQUESTS != 0);
            }
        }

        #[test]
        fn garbage_is_a_protocol_error_naming_the_peer(data in proptest::collection::vec(any::<u8>(), 0..120)) {
            if let Err(e) = Summary::decode(&data, 5, 3) {
                prop_assert!(matches!(e, Error::Protocol { peer: Some(5), .. }), "{e}");
            }
        }
    }

    #[test]
    fn summaries_of_other_cycles_or_caches_are_refused_in_words() {
        let a = Summary::of(&state(3, 0, vec![1], vec![0]), 0, 2);
        assert_eq!(Summary::of_all([(0, &state(3, 0, vec![1], vec![0]))], 3, 1, 2), a);
        let mut b = a.clone();
        let e = b.merge(&Summary::of(&state(4, 0, vec![1], vec![0]), 1, 2), 0, 1).unwrap_err();
        assert!(e.to_string().contains("rank 1 agrees on cycle 4, rank 0 on cycle 3"), "{e}");
        let e = b.merge(&Summary::of(&state(3, 0, vec![1, 2], vec![0, 0]), 1, 2), 0, 1).unwrap_err();
        assert!(e.to_string().contains("response caches"), "{e}");
        let e = Summary::decode(&a.encode(), 1, 200).unwrap_err();
        assert!(e.to_string().contains("words of ranks in an engine of 200"), "{e}");
    }
}
