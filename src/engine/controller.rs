//! The engine's negotiation as a sans-IO state machine (Horovod's Controller): given this
//! rank's submissions and the state messages the ranks exchange, it decides the messages to
//! send and the names to run, in one order every rank computes alike. It holds the response
//! cache, the coordinator's table (on rank 0) and the stall inspector, and does no I/O: the
//! background thread (`background.rs`) moves its messages and runs what it decides.
//!
//! One cycle, on every rank:
//!
//! 1. [`begin`](Controller::begin): this rank's state message (cache bits of the names it has
//!    pending, slots it found out of date, status flags; names not in the cache in full, for
//!    rank 0 only), to send to every other rank.
//! 2. [`receive_state`](Controller::receive_state) for each rank in
//!    [`awaiting`](Controller::awaiting), then [`exchanged`](Controller::exchanged): the ANDed
//!    bits say which cached names are ready; whether the coordinator takes part this cycle
//!    (some rank sent names in full, or some rank has joined), and if so, what rank 0 sends
//!    ([`Responses::Send`]) or this rank receives ([`Responses::Receive`]).
//! 3. [`conclude`](Controller::conclude), with the coordinator's message on the other ranks:
//!    the [`Decision`] (names to run, in order; a join that completed; a rank that shut down).
//!
//! [`inspect_stalls`](Controller::inspect_stalls) between and after cycles (rank 0).

use super::agree::Summary;
use super::cache::{Cache, bits, has_bit, is_set, set_bit};
use super::coordinator::Coordinator;
use super::meta::{Kind, Meta};
use super::stall::{StallInspector, Stalls};
use super::wire::{self, JOINED, REQUESTS, Request, Response, SHUTDOWN, State};
use crate::error::{Error, Result};
use crate::types::Reduction;
use rustc_hash::FxHashMap as HashMap;
use smallvec::SmallVec;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// The coordinator's rank.
pub(crate) const COORDINATOR: usize = 0;

/// How a pending name is being negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// Its cache slot's bit, every cycle.
    Cached(u32),
    /// In full to the coordinator, which keeps it.
    Requested,
    /// In full to the coordinator in the next cycle.
    Unsent,
}

/// A submission of this rank the others have not all made yet, with the caller's `ticket`
/// (its tensor and completion, in the engine).
struct Entry<T> {
    meta: Meta,
    ticket: T,
    via: Via,
}

/// This rank's state messages of a cycle: in full to the coordinator, without the names sent
/// in full to the others.
#[derive(Debug)]
pub(crate) struct Outbox {
    full: Vec<u8>,
    short: Option<Vec<u8>>,
}

impl Outbox {
    /// The message for rank `peer`.
    pub(crate) fn to(&self, peer: usize) -> &[u8] {
        match &self.short {
            Some(s) if peer != COORDINATOR => s,
            _ => &self.full,
        }
    }
}

/// What happens with the coordinator's responses this cycle.
#[derive(Debug)]
pub(crate) enum Responses {
    /// The coordinator does not take part: [`conclude`](Controller::conclude) with `None`.
    None,
    /// Rank 0: send this to every other rank, then [`conclude`](Controller::conclude) with
    /// `None`.
    Send(Vec<u8>),
    /// Receive the coordinator's message and [`conclude`](Controller::conclude) with it.
    Receive,
}

/// A name to run this cycle.
#[derive(Debug)]
pub(crate) struct Ready<T> {
    pub(crate) name: String,
    pub(crate) meta: Meta,
    /// Each rank's first dimension (allgather).
    pub(crate) dims: Vec<u64>,
    /// Why it fails on every rank (the ranks disagree, or it cannot run with joined ranks).
    pub(crate) error: Option<Error>,
    /// This rank's ticket (`None`: this rank joined and did not submit it).
    pub(crate) own: Option<T>,
    /// When each rank was first seen with it (rank 0, or when asked to record).
    pub(crate) seen: Option<Vec<Option<Instant>>>,
    /// The cache slot whose bits found it ready this cycle (`None`: the coordinator did).
    pub(crate) slot: Option<u32>,
}

/// What a cycle decided.
#[derive(Debug)]
pub(crate) struct Decision<T> {
    /// The names to run, in the order every rank runs them.
    pub(crate) ready: Vec<Ready<T>>,
    /// How many of them the coordinator decided (the rest came through the cache's bits).
    pub(crate) from_coordinator: usize,
    /// Whether the coordinator took part.
    pub(crate) coordinated: bool,
    /// The ranks whose tensors make an allreduce (the others joined; at least 1).
    pub(crate) contributors: usize,
    /// Every rank has joined: this rank's join completes with the last rank to join (in the
    /// job's numbering).
    pub(crate) join_done: Option<usize>,
    /// A rank shut the engine down (in the job's numbering).
    pub(crate) shut_by: Option<usize>,
}

/// The cycle in progress.
struct Cycle {
    states: Vec<Option<State>>,
    /// Filled by [`Controller::exchanged`].
    joined: Vec<bool>,
    hits: Vec<u32>,
    coordinated: bool,
    shut_by: Option<usize>,
    /// Rank 0's decisions, until [`Controller::conclude`].
    decided: Option<Vec<Response>>,
    exchanged: bool,
    /// What every rank's state says together, where the ranks agreed by reduction
    /// ([`agreed`](Controller::agreed)): then `states` holds only this rank's and (on rank 0)
    /// those of the ranks that sent names in full.
    summary: Option<Box<Summary>>,
}

/// One rank's negotiation state.
pub(crate) struct Controller<T> {
    rank: usize,
    /// Each rank's rank in the job (errors and reports name ranks this way).
    world: Vec<usize>,
    cycle: u64,
    entries: HashMap<String, Entry<T>>,
    cache: Cache,
    unsent: Vec<String>,
    invalidate: BTreeSet<u32>,
    /// This rank has joined and its join has not completed.
    joined: bool,
    /// The cycle in which each rank was first seen joined (for "the last rank to join").
    joined_at: Vec<Option<u64>>,
    shutdown: bool,
    /// Rank 0 only.
    coordinator: Option<Coordinator>,
    stalls: StallInspector,
    /// Which ranks had joined in the last cycle (the stall inspector's view).
    last_joined: Vec<bool>,
    current: Option<Cycle>,
    /// Rank 0, where the ranks agree by reduction: since when each cache slot has been pending
    /// on some rank but not ready (the reduction does not say on which ranks: past half the
    /// stall threshold the slot is dropped, so that its names come to the coordinator in full,
    /// which names the ranks missing).
    stalled_slots: HashMap<u32, (u64, Instant)>,
}

impl<T> Controller<T> {
    /// Rank `rank` of `world.len()` ranks (`world[r]`: rank r's rank in the job), a response
    /// cache of `cache_capacity` slots, stalls reported after `stall_check` and fatal after
    /// `stall_shutdown`.
    pub(crate) fn new(
        rank: usize,
        world: Vec<usize>,
        cache_capacity: usize,
        stall_check: Option<Duration>,
        stall_shutdown: Option<Duration>,
    ) -> Self {
        let size = world.len();
        Controller {
            rank,
            cycle: 0,
            entries: HashMap::default(),
            cache: Cache::new(cache_capacity.min(u32::MAX as usize - 1)),
            unsent: Vec::new(),
            invalidate: BTreeSet::new(),
            joined: false,
            joined_at: vec![None; size],
            shutdown: false,
            coordinator: (rank == COORDINATOR).then(|| Coordinator::new(size)),
            stalls: StallInspector::new(size, stall_check, stall_shutdown),
            last_joined: vec![false; size],
            current: None,
            stalled_slots: HashMap::default(),
            world,
        }
    }

    fn size(&self) -> usize {
        self.world.len()
    }

    fn w(&self, r: usize) -> usize {
        self.world.get(r).copied().unwrap_or(r)
    }

    /// Takes a submission of this rank (not a join: see [`join`](Self::join)).
    pub(crate) fn submit(&mut self, name: String, meta: Meta, ticket: T) {
        let via = match self.cache.get(&name) {
            Some((slot, m)) if *m == meta && meta.kind.cacheable() => Via::Cached(slot),
            Some((slot, _)) => {
                // Its type, shape or arguments changed: every rank drops the slot this cycle.
                self.invalidate.insert(slot);
                Via::Unsent
            }
            None => Via::Unsent,
        };
        if via == Via::Unsent {
            self.unsent.push(name.clone());
        }
        self.entries.insert(name, Entry { meta, ticket, via });
    }

    /// This rank joins: until every rank has, allreduces run without it.
    pub(crate) fn join(&mut self) {
        self.joined = true;
    }

    /// This rank shuts the engine down (every rank learns it in the next cycle).
    pub(crate) fn shut_down(&mut self) {
        self.shutdown = true;
    }

    /// Whether [`shut_down`](Self::shut_down) was called.
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutdown
    }

    /// Whether this rank has something to tell the others (names to send in full, slots to
    /// invalidate) beyond new submissions.
    pub(crate) fn has_news(&self) -> bool {
        !self.unsent.is_empty() || !self.invalidate.is_empty()
    }

    /// How long the idle wait may last before [`inspect_stalls`](Self::inspect_stalls) has
    /// something to look at (rank 0 with pending names); `None`: until a message comes.
    pub(crate) fn stall_wait(&self) -> Option<Duration> {
        if self.rank != COORDINATOR {
            return None;
        }
        let slots = (!self.stalled_slots.is_empty())
            .then(|| self.stalls.period())
            .flatten()
            .map(|p| (p / 8).clamp(Duration::from_millis(10), Duration::from_secs(1)));
        [self.stalls.next_look(), slots].into_iter().flatten().min()
    }

    /// Every ticket still pending (the engine failed), in no particular order.
    pub(crate) fn drain_tickets(&mut self) -> Vec<(String, T)> {
        self.entries.drain().map(|(name, e)| (name, e.ticket)).collect()
    }

    /// This rank's submissions pending in the cache (their slot's bit is set in this cycle's
    /// state message), by slot: what may travel with the state message.
    pub(crate) fn cached_pending(&self) -> Vec<(u32, &Meta, &T)> {
        let mut v: Vec<(u32, &Meta, &T)> = self
            .entries
            .values()
            .filter_map(|e| match e.via {
                Via::Cached(s) => Some((s, &e.meta, &e.ticket)),
                _ => None,
            })
            .collect();
        v.sort_unstable_by_key(|e| e.0);
        v
    }

    /// Whether a rank had joined as of the last cycle (or this rank has).
    pub(crate) fn any_joined(&self) -> bool {
        self.joined || self.last_joined.iter().any(|&j| j)
    }

    /// Starts the next cycle: this rank's state message.
    pub(crate) fn begin(&mut self) -> Outbox {
        self.cycle += 1;
        let mine = self.state();
        let full = mine.encode(true);
        let short = (!mine.requests.is_empty()).then(|| mine.encode(false));
        let mut states = vec![None; self.size()];
        states[self.rank] = Some(mine);
        self.current = Some(Cycle {
            states,
            joined: Vec::new(),
            hits: Vec::new(),
            coordinated: false,
            shut_by: None,
            decided: None,
            exchanged: false,
            summary: None,
        });
        Outbox { full, short }
    }

    /// This rank's state message for the cycle (its requests leave the unsent list).
    fn state(&mut self) -> State {
        let words = self.cache.words();
        let mut pending = vec![0u64; words];
        for e in self.entries.values() {
            if let Via::Cached(s) = e.via {
                set_bit(&mut pending, s);
            }
        }
        let mut invalidate = vec![0u64; words];
        for &s in &self.invalidate {
            set_bit(&mut invalidate, s);
        }
        self.invalidate.clear();
        let mut requests = Vec::with_capacity(self.unsent.len());
        for name in self.unsent.drain(..) {
            if let Some(e) = self.entries.get_mut(&name)
                && e.via == Via::Unsent
            {
                e.via = Via::Requested;
                requests.push(Request { name, meta: e.meta.clone() });
            }
        }
        let mut flags = 0;
        if self.joined {
            flags |= JOINED;
        }
        if self.shutdown {
            flags |= SHUTDOWN;
        }
        if !requests.is_empty() {
            flags |= REQUESTS;
        }
        State { cycle: self.cycle, flags, pending, invalidate, requests }
    }

    fn bug(&self, what: &str) -> Error {
        Error::Protocol { peer: None, detail: format!("engine on rank {}: {what} (a bug)", self.w(self.rank)) }
    }

    /// The ranks whose state message of this cycle has not come yet: every other rank's, or,
    /// where the ranks agreed by reduction ([`agreed`](Self::agreed)), on rank 0 those that
    /// send names in full.
    pub(crate) fn awaiting(&self) -> Vec<usize> {
        match &self.current {
            Some(c) if !c.exchanged => (0..self.size())
                .filter(|&p| c.states[p].is_none())
                .filter(|&p| match &c.summary {
                    Some(s) => self.rank == COORDINATOR && is_set(&s.requests, p),
                    None => true,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// This rank's state of this cycle as a summary of one, to combine with the others'
    /// ([`agree`](super::agree)).
    pub(crate) fn own_summary(&self) -> Result<Summary> {
        match self.current.as_ref().filter(|c| !c.exchanged).and_then(|c| c.states[self.rank].as_ref()) {
            Some(s) => Ok(Summary::of(s, self.rank, self.size())),
            None => Err(self.bug("a summary outside a cycle's exchange")),
        }
    }

    /// What every rank's state of this cycle says together (combined by reduction): only
    /// the states of the ranks that send names in full are still to come (to rank 0, see
    /// [`awaiting`](Self::awaiting)).
    pub(crate) fn agreed(&mut self, summary: Summary) -> Result<()> {
        let (me, cycle) = (self.w(self.rank), self.cycle);
        let Some(c) = self.current.as_mut().filter(|c| !c.exchanged && c.summary.is_none()) else {
            return Err(self.bug("an agreement outside a cycle's exchange"));
        };
        if summary.cycle != cycle {
            return Err(Error::Protocol {
                peer: None,
                detail: format!("engine: the ranks agreed on cycle {}, rank {me} is in cycle {cycle}", summary.cycle),
            });
        }
        c.summary = Some(Box::new(summary));
        Ok(())
    }

    /// Rank `peer`'s state message of this cycle.
    pub(crate) fn receive_state(&mut self, peer: usize, msg: &[u8]) -> Result<()> {
        let wp = self.w(peer);
        let s = State::decode(msg, wp)?;
        let Some(c) = self.current.as_mut().filter(|c| !c.exchanged) else {
            return Err(self.bug("a state message outside a cycle's exchange"));
        };
        match c.states.get_mut(peer) {
            Some(slot @ None) => {
                *slot = Some(s);
                Ok(())
            }
            _ => Err(Error::Protocol {
                peer: Some(wp),
                detail: format!("engine: a second state message from rank {wp} in cycle {}", self.cycle),
            }),
        }
    }

    /// Every state message is in: applies the invalidations, finds the names ready in the
    /// cache, and (rank 0) decides the names sent in full. `record_seen`: note when each rank
    /// was first seen with each name (for a timeline; rank 0 always does, for the stall
    /// inspector).
    pub(crate) fn exchanged(&mut self, now: Instant, record_seen: bool) -> Result<Responses> {
        let Some(mut cur) = self.current.take().filter(|c| !c.exchanged) else {
            return Err(self.bug("an exchange outside a cycle"));
        };
        let (me, n) = (self.rank, self.size());
        let words = self.cache.words();
        let reduced = cur.summary.is_some();
        // The states at hand: every rank's, or (agreed by reduction) this rank's and those
        // with names in full.
        let mut states: SmallVec<[(usize, State); 8]> = SmallVec::with_capacity(n);
        for (p, s) in cur.states.drain(..).enumerate() {
            let wp = self.w(p);
            let Some(s) = s else {
                if reduced {
                    continue;
                }
                return Err(Error::Protocol { peer: Some(wp), detail: "engine: no state message".into() });
            };
            if s.cycle != self.cycle {
                return Err(Error::Protocol {
                    peer: Some(wp),
                    detail: format!(
                        "engine: rank {wp} is in cycle {}, rank {} in cycle {}",
                        s.cycle,
                        self.w(me),
                        self.cycle
                    ),
                });
            }
            if s.pending.len() != words || s.invalidate.len() != words {
                return Err(Error::Protocol {
                    peer: Some(wp),
                    detail: format!(
                        "engine: rank {wp} has {} cache words, rank {} has {words} (the response caches diverged)",
                        s.pending.len(),
                        self.w(me)
                    ),
                });
            }
            states.push((p, s));
        }
        let all = match cur.summary.take() {
            Some(sum) => *sum,
            None => Summary::of_all(states.iter().map(|(r, s)| (*r, s)), self.cycle, words, n),
        };
        if all.pending_all.len() != words {
            return Err(Error::Protocol {
                peer: None,
                detail: format!(
                    "engine: the ranks agreed on {} cache words, rank {} has {words} (the response caches diverged)",
                    all.pending_all.len(),
                    self.w(me)
                ),
            });
        }
        let joined: Vec<bool> = (0..n).map(|r| is_set(&all.joined, r)).collect();
        for (r, &j) in joined.iter().enumerate() {
            if j && self.joined_at[r].is_none() {
                self.joined_at[r] = Some(self.cycle);
            }
        }
        cur.shut_by = (0..n).find(|&r| is_set(&all.shutdown, r));
        cur.coordinated = (0..n).any(|r| is_set(&all.requests, r)) || joined.iter().any(|&j| j);

        // Slots some rank found out of date: dropped everywhere; names pending on them go to
        // the coordinator in full next cycle.
        let stale = &all.invalidate;
        for slot in bits(stale) {
            self.cache.drop_slot(slot);
            self.requeue_slot_except(slot, None);
        }

        // Names every (needed) rank has pending in the cache (of the slots some rank has
        // pending, in slot order): an allreduce needs the ranks that have not joined, any
        // other collective every rank.
        let some_unjoined = joined.iter().any(|&j| !j);
        for slot in bits(&all.pending_any) {
            if has_bit(stale, slot) {
                continue;
            }
            let Some((_, meta)) = self.cache.at(slot) else { continue };
            let ready = match meta.kind {
                Kind::Allreduce => some_unjoined && has_bit(&all.pending_unjoined, slot),
                _ => has_bit(&all.pending_all, slot),
            };
            if ready {
                cur.hits.push(slot);
            }
        }
        if me == COORDINATOR || record_seen {
            // The stall inspector looks only at names still pending after this cycle: those
            // found ready need no sighting, unless a timeline records when each rank had them.
            // (A hit of a group runs only with the whole group: it may stay pending.)
            let ready: SmallVec<[u32; 16]> = if record_seen {
                SmallVec::new()
            } else {
                let alone = |s: &&u32| self.cache.at(**s).is_some_and(|(_, m)| m.group == 0);
                cur.hits.iter().filter(alone).copied().collect()
            };
            self.note_seen(&states, now, &ready);
        }
        if me == COORDINATOR && reduced {
            self.note_stalled_slots(&all.pending_any, &cur.hits, stale, now);
        }

        // Names not in the cache: the coordinator decides.
        let out = match (&mut self.coordinator, cur.coordinated) {
            (_, false) => Responses::None,
            (Some(co), true) => {
                for (r, s) in &states {
                    for req in &s.requests {
                        co.hold(*r, req, &self.world)?;
                    }
                }
                let decided = co.decide(&self.cache, &cur.hits, &joined, &self.world);
                let msg = wire::encode_responses(self.cycle, &decided);
                cur.decided = Some(decided);
                Responses::Send(msg)
            }
            (None, true) => Responses::Receive,
        };
        cur.joined = joined;
        cur.exchanged = true;
        self.current = Some(cur);
        Ok(out)
    }

    /// Rank 0, where the ranks agree by reduction: notes since when each slot pending on some
    /// rank has not been ready (under the name it holds now: its version). One pending past
    /// half the stall threshold is dropped after the cycle (by
    /// [`inspect_stalls`](Self::inspect_stalls)), on every rank in the next cycle, so that its
    /// names come to the coordinator in full and the stall inspector learns which ranks have
    /// them.
    fn note_stalled_slots(&mut self, pending: &[u64], hits: &[u32], stale: &[u64], now: Instant) {
        if self.stalls.period().is_none() {
            self.stalled_slots.clear();
            return;
        }
        let cache = &self.cache;
        let waiting: SmallVec<[(u32, u64); 16]> = bits(pending)
            .filter(|s| !has_bit(stale, *s) && !hits.contains(s))
            .filter_map(|s| Some((s, cache.version(s)?)))
            .collect();
        self.stalled_slots.retain(|s, (v, _)| waiting.contains(&(*s, *v)));
        for (s, v) in waiting {
            self.stalled_slots.entry(s).or_insert((v, now));
        }
    }

    /// Drops the slots noted by [`note_stalled_slots`](Self::note_stalled_slots) that still
    /// hold the same name and have waited half of `period` (100 ms at least, so that a
    /// threshold of 0 does not drop every slot that a rank reaches a little late).
    fn drop_stalled_slots(&mut self, now: Instant, period: Duration) {
        let after = (period / 2).max(Duration::from_millis(100));
        let cache = &self.cache;
        let due: SmallVec<[u32; 8]> = self
            .stalled_slots
            .iter()
            .filter(|(s, (v, since))| cache.version(**s) == Some(*v) && now.saturating_duration_since(*since) >= after)
            .map(|(s, _)| *s)
            .collect();
        for s in due {
            self.stalled_slots.remove(&s);
            self.invalidate.insert(s);
        }
    }

    /// Records when each rank was first seen with each pending name, but for the cache slots
    /// in `skip` (ascending).
    fn note_seen(&mut self, states: &[(usize, State)], now: Instant, skip: &[u32]) {
        for &(r, ref s) in states {
            for slot in bits(&s.pending).filter(|s| skip.binary_search(s).is_err()) {
                if let Some((name, _)) = self.cache.at(slot) {
                    self.stalls.saw(name, r, now);
                }
            }
            if self.rank == COORDINATOR {
                for req in &s.requests {
                    self.stalls.saw(&req.name, r, now);
                }
            }
        }
        for (name, e) in &self.entries {
            if matches!(e.via, Via::Cached(s) if skip.binary_search(&s).is_ok()) {
                continue;
            }
            self.stalls.saw(name, self.rank, now);
        }
    }

    /// Ends the cycle: `responses` is the coordinator's message when
    /// [`exchanged`](Self::exchanged) said [`Responses::Receive`], with the rank it came from
    /// (the coordinator, or this rank's parent in the tree that forwards it), else `None`.
    pub(crate) fn conclude(&mut self, responses: Option<(&[u8], usize)>) -> Result<Decision<T>> {
        let Some(cur) = self.current.take().filter(|c| c.exchanged) else {
            return Err(self.bug("a decision before the exchange"));
        };
        let Cycle { joined, hits, coordinated, shut_by, decided, .. } = cur;
        let n = self.size();
        let responses = match (decided, responses, coordinated) {
            (Some(d), None, _) => d,
            (None, Some((msg, from)), true) => wire::decode_responses(msg, self.w(from), self.cycle)?,
            (None, None, false) => Vec::new(),
            _ => return Err(self.bug("the coordinator's responses where none were due, or none where they were")),
        };
        for r in &responses {
            if let Some(slot) = r.slot {
                if let Some(old) = self.cache.put(slot, &r.name, &r.meta, self.cycle) {
                    self.requeue_name(&old);
                }
                // A name of this rank cached at this slot under its old name goes to the
                // coordinator in full.
                self.requeue_slot_except(slot, Some(&r.name));
            }
        }

        // Groups run whole or not at all.
        let mut count: HashMap<u64, u32> = HashMap::default();
        let group_of = |m: &Meta| (m.group != 0).then_some(m.group);
        for slot in &hits {
            if let Some(g) = self.cache.at(*slot).and_then(|(_, m)| group_of(m)) {
                *count.entry(g).or_default() += 1;
            }
        }
        for r in &responses {
            if let Some(g) = group_of(&r.meta) {
                *count.entry(g).or_default() += 1;
            }
        }
        // Name, what the ranks agreed on, first dimensions, a failure, the slot of a cache hit,
        // this rank's ticket.
        type Found<T> = (String, Meta, Vec<u64>, Option<Error>, Option<u32>, Option<T>);
        let mut ready: Vec<Found<T>> = Vec::with_capacity(responses.len() + hits.len());
        for r in responses {
            let error = r.error.map(|(rank, detail)| Error::Mismatch { rank: rank as usize, detail });
            let own = self.entries.remove(&r.name).map(|e| e.ticket);
            ready.push((r.name, r.meta, r.dims, error, None, own));
        }
        let from_coordinator = ready.len();
        for slot in &hits {
            let Some((name, meta)) = self.cache.at(*slot) else { continue };
            if group_of(meta).is_some_and(|g| count.get(&g).copied().unwrap_or(0) < meta.group_size) {
                continue;
            }
            // This rank's submission gives the name and what was agreed (the cache's own, where
            // its bit was set), without copies.
            let (name, meta, own) = match self.entries.remove_entry(name.as_str()) {
                Some((name, e)) if e.via == Via::Cached(*slot) => (name, e.meta, Some(e.ticket)),
                Some((name, e)) => (name, meta.clone(), Some(e.ticket)),
                None => (name.clone(), meta.clone(), None),
            };
            ready.push((name, meta, Vec::new(), None, Some(*slot), own));
            self.cache.touch(*slot, self.cycle);
        }

        let contributors = joined.iter().filter(|&&j| !j).count().max(1);
        if joined.iter().any(|&j| j) {
            // Zeros stand in for a joined rank: right for sums and averages only.
            let who: Vec<usize> = (0..n).filter(|&r| joined[r]).map(|r| self.w(r)).collect();
            for (name, meta, _, error, _, _) in &mut ready {
                if error.is_none()
                    && meta.kind == Kind::Allreduce
                    && !matches!(meta.op, Reduction::Sum | Reduction::Average)
                {
                    *error = Some(Error::invalid(format!(
                        "allreduce '{name}': {} cannot run while ranks {who:?} have joined (only sum and average can)",
                        meta.op.name()
                    )));
                }
            }
        }
        let ready = ready
            .into_iter()
            .map(|(name, meta, dims, error, slot, own)| Ready {
                seen: self.stalls.take(&name),
                own,
                name,
                meta,
                dims,
                error,
                slot,
            })
            .collect();

        let mut join_done = None;
        if joined.iter().all(|&j| j) {
            let last = (0..n).max_by_key(|&r| (self.joined_at[r], r)).unwrap_or(0);
            self.joined_at = vec![None; n];
            if std::mem::take(&mut self.joined) {
                join_done = Some(self.w(last));
            }
        }
        self.last_joined = joined;
        Ok(Decision {
            ready,
            from_coordinator,
            coordinated,
            contributors,
            join_done,
            shut_by: shut_by.map(|r| self.w(r)),
        })
    }

    /// Names of this rank pending on `slot`, which no longer holds them (`keep`: one that it
    /// now holds): to the coordinator in full.
    fn requeue_slot_except(&mut self, slot: u32, keep: Option<&str>) {
        for (name, e) in self.entries.iter_mut() {
            if e.via == Via::Cached(slot) && keep != Some(name.as_str()) {
                e.via = Via::Unsent;
                self.unsent.push(name.clone());
            }
        }
    }

    fn requeue_name(&mut self, name: &str) {
        if let Some(e) = self.entries.get_mut(name)
            && matches!(e.via, Via::Cached(_))
        {
            e.via = Via::Unsent;
            self.unsent.push(name.to_string());
        }
    }

    /// Rank 0: what the stall inspector finds at `now` (nothing on other ranks).
    pub(crate) fn inspect_stalls(&mut self, now: Instant) -> Stalls {
        if self.rank != COORDINATOR {
            return Stalls::default();
        }
        if let Some(period) = self.stalls.period() {
            self.drop_stalled_slots(now, period);
        }
        let (entries, coordinator, cache) = (&self.entries, &self.coordinator, &self.cache);
        let kind_of = |name: &str| {
            entries
                .get(name)
                .map(|e| e.meta.kind)
                .or_else(|| coordinator.as_ref().and_then(|c| c.kind_of(name)))
                .or_else(|| cache.get(name).map(|(_, m)| m.kind))
                .unwrap_or(Kind::Allreduce)
        };
        self.stalls.inspect(now, kind_of, &self.last_joined, &self.world)
    }

    /// The response cache (the same on every rank between cycles).
    pub(crate) fn cache(&self) -> &Cache {
        &self.cache
    }
}

#[cfg(test)]
mod tests;
