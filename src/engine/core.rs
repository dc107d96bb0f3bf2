//! The background thread: idle waiting, cycles (the state exchange, the coordinator's
//! responses), the response cache, the stall inspector.

use super::exec::{self, Item, Ready};
use super::timeline::Timeline;
use super::wire::{self, JOINED, REQUESTS, Request, Response, SHUTDOWN, State};
use super::{CONTROL_TAG, Completion, EngineConfig, Kind, Meta, Output, Payload, Shared, StallReport};
use super::{Submission, TimelineCommand};
use crate::Context;
use crate::comm::{PersistentRecv, SLEEPING};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::types::Reduction;
use std::collections::{BTreeSet, HashMap};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The coordinator's rank.
const COORDINATOR: usize = 0;

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

/// A submission of this rank the others have not all made yet.
struct Entry {
    meta: Meta,
    payload: Option<Box<dyn Payload>>,
    done: Arc<Completion>,
    submitted: Instant,
    via: Via,
}

/// The response cache: the same slots on every rank, changed only by what every rank sees
/// (the coordinator's responses, invalidations announced in a cycle).
struct Cache {
    slots: Vec<Option<(String, Meta)>>,
    index: HashMap<String, u32>,
    /// The cycle each slot was last run in (for choosing a slot to reuse).
    used: Vec<u64>,
    capacity: usize,
}

impl Cache {
    fn new(capacity: usize) -> Self {
        Cache { slots: Vec::new(), index: HashMap::new(), used: Vec::new(), capacity }
    }

    fn get(&self, name: &str) -> Option<(u32, &Meta)> {
        let slot = *self.index.get(name)?;
        self.slots.get(slot as usize)?.as_ref().map(|(_, m)| (slot, m))
    }

    fn at(&self, slot: u32) -> Option<&(String, Meta)> {
        self.slots.get(slot as usize)?.as_ref()
    }

    /// Words of a bit vector over the slots.
    fn words(&self) -> usize {
        self.slots.len().div_ceil(64)
    }

    /// Puts `name` in `slot`; returns the name it replaced, if any.
    fn put(&mut self, slot: u32, name: &str, meta: &Meta, cycle: u64) -> Option<String> {
        let s = slot as usize;
        if s >= self.slots.len() {
            self.slots.resize(s + 1, None);
            self.used.resize(s + 1, 0);
        }
        if let Some(old) = self.index.remove(name)
            && old != slot
        {
            self.slots[old as usize] = None;
        }
        let replaced = self.slots[s].take().map(|(n, _)| n).filter(|n| n != name);
        if let Some(r) = &replaced {
            self.index.remove(r);
        }
        self.slots[s] = Some((name.to_string(), meta.clone()));
        self.index.insert(name.to_string(), slot);
        self.used[s] = cycle;
        replaced
    }

    fn drop_slot(&mut self, slot: u32) {
        if let Some((name, _)) = self.slots.get_mut(slot as usize).and_then(Option::take) {
            self.index.remove(&name);
        }
    }

    /// A slot for a new name (the coordinator's choice): a free one, a new one below the
    /// capacity, else the least recently run one not in `busy`.
    fn choose(&self, busy: &BTreeSet<u32>) -> Option<u32> {
        if self.capacity == 0 {
            return None;
        }
        let free = (0..self.slots.len()).find(|&s| self.slots[s].is_none() && !busy.contains(&(s as u32)));
        if let Some(s) = free {
            return Some(s as u32);
        }
        if let Some(s) = (self.slots.len()..self.capacity).find(|&s| !busy.contains(&(s as u32))) {
            return Some(s as u32);
        }
        (0..self.slots.len()).filter(|&s| !busy.contains(&(s as u32))).min_by_key(|&s| self.used[s]).map(|s| s as u32)
    }
}

/// A name the coordinator holds requests for.
struct Held {
    metas: Vec<Option<Meta>>,
    order: u64,
}

/// The background thread's state.
pub(crate) struct Core {
    ctx: Arc<Context>,
    sh: Arc<Shared>,
    cfg: EngineConfig,
    rank: usize,
    size: usize,
    cycle: u64,
    entries: HashMap<String, Entry>,
    cache: Cache,
    unsent: Vec<String>,
    invalidate: BTreeSet<u32>,
    join: Option<Arc<Completion>>,
    joined_at: Vec<Option<u64>>,
    shutdown: bool,
    /// The coordinator's requests (rank 0 only).
    held: HashMap<String, Held>,
    order: u64,
    /// When each rank was first seen with each pending name (rank 0, or with a timeline).
    seen: HashMap<String, Vec<Option<Instant>>>,
    /// Each rank's pending slots in the last cycle.
    last_pending: Vec<Vec<u64>>,
    last_joined: Vec<bool>,
    reported: HashMap<String, Instant>,
    fusion: Vec<u64>,
    timeline: Option<Timeline>,
    /// The idle wait's receive of control messages from any rank: it stays posted from one
    /// idle slice to the next (withdrawn at a slice's end, a half-read message would be lost).
    inbox: PersistentRecv,
}

impl Core {
    pub(crate) fn new(
        ctx: Arc<Context>,
        sh: Arc<Shared>,
        cfg: EngineConfig,
        timeline: Option<PathBuf>,
    ) -> Result<Core> {
        let (rank, size) = (ctx.rank(), ctx.size());
        let timeline =
            timeline.map(|p| Timeline::create(&p, ctx.world_rank(rank).unwrap_or(rank), sh.epoch)).transpose()?;
        Ok(Core {
            cache: Cache::new(cfg.cache_capacity.min(u32::MAX as usize - 1)),
            inbox: ctx.comm().persistent_recv(CONTROL_TAG, wire::MAX_MESSAGE, SLEEPING, "engine control receive"),
            ctx,
            sh,
            cfg,
            rank,
            size,
            cycle: 0,
            entries: HashMap::new(),
            unsent: Vec::new(),
            invalidate: BTreeSet::new(),
            join: None,
            joined_at: vec![None; size],
            shutdown: false,
            held: HashMap::new(),
            order: 0,
            seen: HashMap::new(),
            last_pending: vec![Vec::new(); size],
            last_joined: vec![false; size],
            reported: HashMap::new(),
            fusion: Vec::new(),
            timeline,
        })
    }

    /// The job's rank of rank `r` of the engine's context (errors name ranks this way).
    fn w(&self, r: usize) -> usize {
        self.ctx.world_rank(r).unwrap_or(r)
    }

    /// The thread's body: serve until shutdown or failure, then fail whatever is left.
    pub(crate) fn run(mut self) {
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve())).unwrap_or_else(|p| {
            Err(Error::Aborted {
                rank: self.w(self.rank),
                reason: format!(
                    "the engine's thread panicked on rank {}: {}",
                    self.w(self.rank),
                    super::panic_message(&*p)
                ),
            })
        });
        let err = match served {
            Ok(by) => Error::Aborted {
                rank: by,
                reason: format!("the engine was shut down on rank {by} (an Engine dropped or shut down)"),
            },
            Err(e) => {
                // Tell every peer the cause (a no-op when the cause came from a peer).
                self.ctx.comm().fail(&e);
                e
            }
        };
        {
            let mut f = lock(&self.sh.failed);
            if f.is_none() {
                *f = Some(err.clone());
            }
        }
        tracing::debug!(rank = self.rank, error = %err, "engine stopped");
        let mut queued = {
            let mut q = lock(&self.sh.queue);
            q.closed = true;
            std::mem::take(&mut q.items)
        };
        lock(&self.sh.inflight).clear();
        for s in queued.drain(..) {
            s.done.finish(Err(err.clone()));
        }
        for (_, e) in self.entries.drain() {
            e.done.finish(Err(err.clone()));
        }
        if let Some(j) = self.join.take() {
            j.done_with(Err(err.clone()));
        }
        if let Some(t) = &mut self.timeline {
            t.flush();
        }
    }

    /// Cycles until a rank shuts down (returns that rank) or something fails.
    fn serve(&mut self) -> Result<usize> {
        loop {
            let first = self.idle()?;
            if let Some(by) = self.cycle(first)? {
                return Ok(by);
            }
        }
    }

    /// Whether this rank has something to negotiate.
    fn has_news(&mut self) -> bool {
        self.timeline_commands();
        let q = lock(&self.sh.queue);
        !q.items.is_empty() || (q.shutdown && !self.shutdown) || !self.unsent.is_empty() || !self.invalidate.is_empty()
    }

    /// Starts and stops the timeline as asked (before the submissions that came after).
    fn timeline_commands(&mut self) {
        let cmds = std::mem::take(&mut lock(&self.sh.queue).timeline);
        for c in cmds {
            self.timeline_command(c);
        }
    }

    fn timeline_command(&mut self, c: TimelineCommand) {
        if let Some(mut t) = self.timeline.take() {
            t.flush();
        }
        self.timeline = match c {
            TimelineCommand::Stop => None,
            TimelineCommand::Start(p) => {
                let p = match (self.cfg.timeline_all_ranks, self.rank) {
                    (true, r) => super::timeline::rank_path(&p, self.w(r)),
                    (false, COORDINATOR) => p,
                    (false, _) => return,
                };
                match Timeline::create(&p, self.w(self.rank), self.sh.epoch) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::warn!(rank = self.rank, error = %e, "cannot start the engine's timeline");
                        None
                    }
                }
            }
        };
    }

    /// Waits for news: a submission on this rank (it wakes itself with a message), or a
    /// peer's state message (a cycle began). Returns the peer's message, or `None` for news
    /// of this rank.
    fn idle(&mut self) -> Result<Option<(usize, State)>> {
        let all: Vec<usize> = (0..self.size).collect();
        loop {
            if self.has_news() {
                // The cycle's own receives must not race the idle one: withdraw it, unless a
                // message is arriving into it already, which then comes first.
                self.inbox.withdraw();
                if !self.inbox.is_posted() {
                    return Ok(None);
                }
            }
            let timeout = self.idle_timeout();
            match self.inbox.wait(&all, Instant::now() + timeout) {
                Some(Ok((peer, msg))) if peer == self.rank => {
                    self.sh.wake_pending.store(false, Ordering::SeqCst);
                    if msg != [wire::WAKE] {
                        return Err(Error::Protocol {
                            peer: Some(self.w(peer)),
                            detail: format!("engine: a message of {} bytes from this rank to itself", msg.len()),
                        });
                    }
                }
                Some(Ok((peer, msg))) => return Ok(Some((peer, State::decode(&msg, self.w(peer))?))),
                // A message that began arriving and stopped was dropped; so is a quiet slice.
                None | Some(Err(Error::Timeout { .. })) => self.inspect_stalls()?,
                Some(Err(e)) => return Err(e),
            }
        }
    }

    /// How long an idle wait lasts: until the stall inspector's next look, when rank 0 holds
    /// pending names; otherwise long (nothing to do until a message comes).
    fn idle_timeout(&self) -> Duration {
        let check = [self.cfg.stall_check, self.cfg.stall_shutdown].into_iter().flatten().min();
        match check {
            Some(c) if self.rank == COORDINATOR && !self.seen.is_empty() => {
                (c / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
            }
            _ => Duration::from_secs(3600),
        }
    }

    /// While submissions keep arriving close together, waits (at most the batch window) for
    /// the burst to end, so that one cycle negotiates it.
    fn batch(&self) {
        let (gap, window) = (self.cfg.batch_gap, self.cfg.batch_window);
        if window.is_zero() || gap.is_zero() {
            return;
        }
        let start = Instant::now();
        let mut q = lock(&self.sh.queue);
        loop {
            // A burst: more than one submission is waiting, the last two close together, and
            // the last one just now. (One submission alone, as from a thread that submits and
            // waits, is negotiated at once.)
            let burst =
                q.items.len() > 1 && q.gap.is_some_and(|g| g < gap) && q.last.is_some_and(|l| l.elapsed() < gap);
            let left = window.saturating_sub(start.elapsed());
            if !burst || q.shutdown || left.is_zero() {
                return;
            }
            let n = q.items.len();
            q = crate::sync::wait_timeout(&self.sh.arrived, q, gap.min(left));
            if q.items.len() == n {
                return;
            }
        }
    }

    /// Moves new submissions into the pending table.
    fn drain(&mut self) {
        self.timeline_commands();
        let (items, shutdown) = {
            let mut q = lock(&self.sh.queue);
            (std::mem::take(&mut q.items), q.shutdown)
        };
        self.shutdown |= shutdown;
        for s in items {
            self.accept(s);
        }
    }

    fn accept(&mut self, s: Submission) {
        let Submission { name, meta, payload, done, submitted } = s;
        if meta.kind == Kind::Join {
            self.join = Some(done);
            return;
        }
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
        self.entries.insert(name, Entry { meta, payload, done, submitted, via });
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
        if self.join.is_some() {
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

    /// Sends this rank's state to every rank and receives theirs (the direct bitwise
    /// allreduce). `first` is a state already received (the one that began the cycle).
    fn exchange(&mut self, mine: State, first: Option<(usize, State)>) -> Result<Vec<State>> {
        let (me, n) = (self.rank, self.size);
        let full = mine.encode(true);
        let short = if mine.requests.is_empty() { Vec::new() } else { mine.encode(false) };
        let mut states: Vec<Option<State>> = vec![None; n];
        if let Some((p, s)) = first {
            states[p] = Some(s);
        }
        let need: Vec<usize> = (0..n).filter(|&p| p != me && states[p].is_none()).collect();
        let world: Vec<usize> = (0..n).map(|r| self.w(r)).collect();
        let got = self.ctx.scope(|s| {
            let mut sends = Vec::with_capacity(n);
            for p in (0..n).filter(|&p| p != me) {
                let buf = if p == COORDINATOR || short.is_empty() { &full } else { &short };
                sends.push(s.isend(p, CONTROL_TAG, buf.as_slice())?);
            }
            let recvs = need
                .iter()
                .map(|&p| s.irecv_bytes(&[p], CONTROL_TAG, wire::MAX_MESSAGE).map(|r| (p, r)))
                .collect::<Result<Vec<_>>>()?;
            let mut got = Vec::with_capacity(recvs.len());
            for (p, r) in recvs {
                let (_, msg) = r.wait()?;
                got.push((p, State::decode(&msg, world[p])?));
            }
            for s in sends {
                s.wait()?;
            }
            Ok(got)
        })?;
        for (p, s) in got {
            states[p] = Some(s);
        }
        states[me] = Some(mine);
        let words = self.cache.words();
        let mut out = Vec::with_capacity(n);
        for (p, s) in states.into_iter().enumerate() {
            let s =
                s.ok_or_else(|| Error::Protocol { peer: Some(world[p]), detail: "engine: no state message".into() })?;
            if s.cycle != self.cycle {
                return Err(Error::Protocol {
                    peer: Some(world[p]),
                    detail: format!(
                        "engine: rank {} is in cycle {}, rank {} in cycle {}",
                        world[p], s.cycle, world[me], self.cycle
                    ),
                });
            }
            if s.pending.len() != words || s.invalidate.len() != words {
                return Err(Error::Protocol {
                    peer: Some(world[p]),
                    detail: format!(
                        "engine: rank {} has {} cache words, rank {} has {words} (the response caches diverged)",
                        world[p],
                        s.pending.len(),
                        world[me]
                    ),
                });
            }
            out.push(s);
        }
        Ok(out)
    }

    /// One cycle. Returns the rank that shut the engine down, if one did.
    fn cycle(&mut self, first: Option<(usize, State)>) -> Result<Option<usize>> {
        if first.is_none() {
            self.batch();
        }
        self.drain();
        self.cycle += 1;
        let mine = self.state();
        let states = self.exchange(mine, first)?;
        let now = Instant::now();
        let n = self.size;
        let joined: Vec<bool> = states.iter().map(|s| s.flags & JOINED != 0).collect();
        for (r, &j) in joined.iter().enumerate() {
            if j && self.joined_at[r].is_none() {
                self.joined_at[r] = Some(self.cycle);
            }
        }
        let shut_by = states.iter().position(|s| s.flags & SHUTDOWN != 0);
        let coordinated = states.iter().any(|s| s.flags & REQUESTS != 0) || joined.iter().any(|&j| j);

        // Slots some rank found out of date: dropped everywhere; names pending on them go to
        // the coordinator in full next cycle.
        let words = self.cache.words();
        let mut stale = vec![0u64; words];
        for s in &states {
            for (a, b) in stale.iter_mut().zip(&s.invalidate) {
                *a |= b;
            }
        }
        for slot in bits(&stale) {
            self.cache.drop_slot(slot);
            self.requeue_slot(slot);
        }

        // Names every (needed) rank has pending in the cache: the ANDed bits.
        let mut hits: Vec<u32> = Vec::new();
        for slot in 0..(words * 64) as u32 {
            if has_bit(&stale, slot) {
                continue;
            }
            let Some((_, meta)) = self.cache.at(slot) else { continue };
            let needed: Vec<usize> = (0..n).filter(|&r| meta.kind != Kind::Allreduce || !joined[r]).collect();
            let any = states.iter().any(|s| has_bit(&s.pending, slot));
            if any && !needed.is_empty() && needed.iter().all(|&r| has_bit(&states[r].pending, slot)) {
                hits.push(slot);
            }
        }
        if self.rank == COORDINATOR || self.timeline.is_some() {
            self.note_seen(&states, now);
        }

        // Names not in the cache: the coordinator decides.
        let mut responses = Vec::new();
        if coordinated {
            if self.rank == COORDINATOR {
                for (r, s) in states.iter().enumerate() {
                    for req in &s.requests {
                        self.hold(r, req)?;
                    }
                }
                responses = self.decide(&hits, &joined);
                let msg = wire::encode_responses(self.cycle, &responses);
                self.ctx.scope(|s| {
                    let sends = (1..n).map(|p| s.isend(p, CONTROL_TAG, msg.as_slice())).collect::<Result<Vec<_>>>()?;
                    sends.into_iter().try_for_each(|s| s.wait())
                })?;
            } else {
                let msg = self.ctx.scope(|s| s.irecv_bytes(&[COORDINATOR], CONTROL_TAG, wire::MAX_MESSAGE)?.wait())?.1;
                responses = wire::decode_responses(&msg, self.w(COORDINATOR), self.cycle)?;
            }
            for r in &responses {
                if let Some(slot) = r.slot {
                    if let Some(old) = self.cache.put(slot, &r.name, &r.meta, self.cycle) {
                        self.requeue_name(&old);
                    }
                    // A name of this rank cached at this slot under its old name goes to the
                    // coordinator in full.
                    self.requeue_slot_except(slot, &r.name);
                }
            }
        }

        // Groups run whole or not at all.
        let mut count: HashMap<u64, u32> = HashMap::new();
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
        let mut ready: Vec<Ready> = responses
            .into_iter()
            .map(|r| Ready {
                error: r.error.map(|(rank, detail)| Error::Mismatch { rank: rank as usize, detail }),
                name: r.name,
                meta: r.meta,
                dims: r.dims,
            })
            .collect();
        let coordinated_ready = ready.len();
        for slot in &hits {
            let Some((name, meta)) = self.cache.at(*slot) else { continue };
            if group_of(meta).is_some_and(|g| count.get(&g).copied().unwrap_or(0) < meta.group_size) {
                continue;
            }
            ready.push(Ready { name: name.clone(), meta: meta.clone(), dims: Vec::new(), error: None });
            self.cache.used[*slot as usize] = self.cycle;
        }
        {
            let mut st = lock(&self.sh.stats);
            st.cycles += 1;
            st.coordinated_cycles += u64::from(coordinated);
            st.coordinated += coordinated_ready as u64;
            st.cache_hits += (ready.len() - coordinated_ready) as u64;
        }

        let contributors = joined.iter().filter(|&&j| !j).count().max(1);
        if joined.iter().any(|&j| j) {
            // Zeros stand in for a joined rank: right for sums and averages only.
            let who: Vec<usize> = (0..n).filter(|&r| joined[r]).map(|r| self.w(r)).collect();
            for r in &mut ready {
                if r.error.is_none()
                    && r.meta.kind == Kind::Allreduce
                    && !matches!(r.meta.op, Reduction::Sum | Reduction::Average)
                {
                    r.error = Some(Error::invalid(format!(
                        "allreduce '{}': {} cannot run while ranks {who:?} have joined (only sum and average can)",
                        r.name,
                        r.meta.op.name()
                    )));
                }
            }
        }
        self.execute(ready, contributors, now)?;

        if joined.iter().all(|&j| j) {
            let last = (0..n).max_by_key(|&r| (self.joined_at[r], r)).unwrap_or(0);
            let last = self.w(last);
            self.joined_at = vec![None; n];
            if let Some(j) = self.join.take() {
                lock(&self.sh.inflight).remove("ferrogloo.join");
                self.sh.joined.store(false, Ordering::SeqCst);
                j.done_with(Ok(Output::Rank(last)));
            }
        }
        self.last_pending = states.into_iter().map(|s| s.pending).collect();
        self.last_joined = joined;
        if self.rank == COORDINATOR {
            self.inspect_stalls()?;
        }
        if let Some(t) = &mut self.timeline {
            t.flush();
        }
        Ok(shut_by.map(|r| self.w(r)))
    }

    /// Names of this rank pending on `slot`, which no longer holds them: to the coordinator.
    fn requeue_slot(&mut self, slot: u32) {
        for (name, e) in self.entries.iter_mut() {
            if e.via == Via::Cached(slot) {
                e.via = Via::Unsent;
                self.unsent.push(name.clone());
            }
        }
    }

    fn requeue_slot_except(&mut self, slot: u32, keep: &str) {
        for (name, e) in self.entries.iter_mut() {
            if e.via == Via::Cached(slot) && name != keep {
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

    /// The coordinator takes rank `r`'s request.
    fn hold(&mut self, r: usize, req: &Request) -> Result<()> {
        let n = self.size;
        let order = &mut self.order;
        let h = self.held.entry(req.name.clone()).or_insert_with(|| {
            *order += 1;
            Held { metas: vec![None; n], order: *order }
        });
        if h.metas[r].is_some() {
            return Err(Error::Protocol {
                peer: Some(self.ctx.world_rank(r).unwrap_or(r)),
                detail: format!("engine: rank {r} requested '{}' twice", req.name),
            });
        }
        h.metas[r] = Some(req.meta.clone());
        Ok(())
    }

    /// The coordinator's decisions: held names every needed rank has requested, checked for
    /// agreement, in the order they were first requested, whole groups only, with cache slots.
    fn decide(&mut self, hits: &[u32], joined: &[bool]) -> Vec<Response> {
        let n = self.size;
        let mut ready: Vec<(u64, String)> = Vec::new();
        for (name, h) in &self.held {
            let Some(m0) = h.metas.iter().flatten().next() else { continue };
            let needed = |r: usize| m0.kind != Kind::Allreduce || !joined[r];
            if (0..n).any(needed) && (0..n).all(|r| !needed(r) || h.metas[r].is_some()) {
                ready.push((h.order, name.clone()));
            }
        }
        ready.sort();
        let mut out: Vec<Response> = Vec::new();
        for (_, name) in ready {
            let Some(h) = self.held.get(&name) else { continue };
            let present: Vec<(usize, &Meta)> =
                h.metas.iter().enumerate().filter_map(|(r, m)| m.as_ref().map(|m| (r, m))).collect();
            let (r0, m0) = present[0];
            let error = present.iter().find(|(_, m)| !m0.agrees(m)).map(|&(r, m)| {
                let (wr, w0) = (self.w(r), self.w(r0));
                let kind = if m.kind == m0.kind { m0.kind.name() } else { "collective" };
                (
                    wr as u32,
                    format!("{kind} '{name}': rank {wr} submitted {}, rank {w0} {}", m.describe(m0), m0.describe(m)),
                )
            });
            let dims = if m0.kind == Kind::Allgather && error.is_none() {
                h.metas.iter().map(|m| m.as_ref().and_then(|m| m.shape.first().copied()).unwrap_or(0)).collect()
            } else {
                Vec::new()
            };
            out.push(Response { name, meta: m0.clone(), slot: None, dims, error });
        }
        // Whole groups only (counting their members found ready in the cache).
        let mut count: HashMap<u64, u32> = HashMap::new();
        for slot in hits {
            if let Some((_, m)) = self.cache.at(*slot).filter(|(_, m)| m.group != 0) {
                *count.entry(m.group).or_default() += 1;
            }
        }
        for r in &out {
            if r.meta.group != 0 {
                *count.entry(r.meta.group).or_default() += 1;
            }
        }
        out.retain(|r| r.meta.group == 0 || count.get(&r.meta.group).copied().unwrap_or(0) >= r.meta.group_size);
        let mut busy: BTreeSet<u32> = hits.iter().copied().collect();
        for r in &mut out {
            self.held.remove(&r.name);
            if r.error.is_none()
                && r.meta.kind.cacheable()
                && let Some(slot) = self.cache.choose(&busy)
            {
                busy.insert(slot);
                r.slot = Some(slot);
            }
        }
        out
    }

    /// Records when each rank was first seen with each pending name.
    fn note_seen(&mut self, states: &[State], now: Instant) {
        let n = self.size;
        for (r, s) in states.iter().enumerate() {
            for slot in bits(&s.pending) {
                if let Some((name, _)) = self.cache.at(slot) {
                    let v = self.seen.entry(name.clone()).or_insert_with(|| vec![None; n]);
                    v[r].get_or_insert(now);
                }
            }
            if self.rank == COORDINATOR {
                for req in &s.requests {
                    let v = self.seen.entry(req.name.clone()).or_insert_with(|| vec![None; n]);
                    v[r].get_or_insert(now);
                }
            }
        }
        for name in self.entries.keys() {
            let v = self.seen.entry(name.clone()).or_insert_with(|| vec![None; n]);
            v[self.rank].get_or_insert(now);
        }
    }

    /// Rank 0: reports names some ranks submitted and others have not, past the thresholds;
    /// past the shutdown threshold, fails the engine (on every rank) naming them.
    fn inspect_stalls(&mut self) -> Result<()> {
        if self.rank != COORDINATOR {
            return Ok(());
        }
        let Some(check) = [self.cfg.stall_check, self.cfg.stall_shutdown].into_iter().flatten().min() else {
            return Ok(());
        };
        let now = Instant::now();
        let mut fatal: Option<StallReport> = None;
        let mut names: Vec<&String> = self.seen.keys().collect();
        names.sort();
        for name in names {
            let Some(v) = self.seen.get(name) else { continue };
            let Some(since) = v.iter().flatten().min().copied() else { continue };
            let waited = now.saturating_duration_since(since);
            if waited < check {
                continue;
            }
            let kind = self
                .entries
                .get(name)
                .map(|e| e.meta.kind)
                .or_else(|| self.held.get(name).and_then(|h| h.metas.iter().flatten().next()).map(|m| m.kind))
                .or_else(|| self.cache.get(name).map(|(_, m)| m.kind))
                .unwrap_or(Kind::Allreduce);
            let submitted: Vec<usize> = (0..self.size).filter(|&r| v[r].is_some()).collect();
            let missing: Vec<usize> = (0..self.size)
                .filter(|&r| {
                    v[r].is_none() && !(kind == Kind::Allreduce && self.last_joined.get(r).copied().unwrap_or(false))
                })
                .collect();
            if missing.is_empty() {
                continue;
            }
            let report = StallReport {
                name: name.clone(),
                op: kind.name(),
                submitted: submitted.iter().map(|&r| self.w(r)).collect(),
                missing: missing.iter().map(|&r| self.w(r)).collect(),
                waited,
            };
            if self.cfg.stall_shutdown.is_some_and(|s| waited >= s) {
                fatal.get_or_insert(report);
                continue;
            }
            let due = self.cfg.stall_check.is_some_and(|c| {
                waited >= c && self.reported.get(name).is_none_or(|t| now.saturating_duration_since(*t) >= c)
            });
            if due {
                self.reported.insert(name.clone(), now);
                let _ = writeln!(std::io::stderr(), "[ferrogloo engine, rank {}] stalled: {report}", self.w(self.rank));
                tracing::warn!(rank = self.rank, %report, "engine stall");
                lock(&self.sh.stalls).push(report);
            }
        }
        match fatal {
            None => Ok(()),
            Some(r) => Err(Error::Timeout {
                op: format!(
                    "engine: {} '{}' (submitted by ranks {:?}; stall shutdown after {:.1} s)",
                    r.op,
                    r.name,
                    r.submitted,
                    self.cfg.stall_shutdown.unwrap_or_default().as_secs_f64()
                ),
                ranks: r.missing,
                keys: Vec::new(),
                waited: r.waited,
            }),
        }
    }

    /// Runs the ready names in order (fusing allreduces) and completes this rank's handles.
    fn execute(&mut self, ready: Vec<Ready>, contributors: usize, decided: Instant) -> Result<()> {
        if ready.is_empty() {
            return Ok(());
        }
        let mut items = Vec::with_capacity(ready.len());
        for r in ready {
            let seen = self.seen.remove(&r.name);
            self.reported.remove(&r.name);
            let own = self.entries.remove(&r.name).map(|e| (e.payload, e.done, e.submitted));
            items.push(Item::new(r, own, seen, decided));
        }
        let (spans, ran) = exec::run(
            &self.ctx,
            &mut self.fusion,
            &mut items,
            contributors,
            (self.cfg.fusion_threshold, self.cfg.fusion_max_tensor),
            &self.sh.stats,
        );
        if let Some(t) = &mut self.timeline {
            t.record(&items, &spans);
        }
        if let Err(e) = &ran {
            // Whatever did not run reports the failure (the rest keep their results).
            for item in &mut items {
                item.fail_unrun(e);
            }
        }
        let mut panicked: Option<Error> = None;
        for item in items {
            let name = item.name.clone();
            lock(&self.sh.inflight).remove(&name);
            if let Some(msg) = item.finish() {
                panicked.get_or_insert(Error::Aborted {
                    rank: self.w(self.rank),
                    reason: format!("a completion callback of '{name}' panicked on rank {}: {msg}", self.w(self.rank)),
                });
            }
        }
        ran?;
        panicked.map_or(Ok(()), Err)
    }
}

impl Completion {
    /// Finishes a completion whose callback cannot panic the engine (join, shutdown).
    pub(crate) fn done_with(&self, out: Result<Output>) {
        let _ = self.finish(out);
    }
}

fn set_bit(words: &mut [u64], slot: u32) {
    if let Some(w) = words.get_mut(slot as usize / 64) {
        *w |= 1 << (slot % 64);
    }
}

fn has_bit(words: &[u64], slot: u32) -> bool {
    words.get(slot as usize / 64).is_some_and(|w| w & (1 << (slot % 64)) != 0)
}

fn bits(words: &[u64]) -> impl Iterator<Item = u32> + '_ {
    words
        .iter()
        .enumerate()
        .flat_map(|(i, &w)| (0..64u32).filter(move |b| w & (1 << b) != 0).map(move |b| i as u32 * 64 + b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DType;

    fn meta(d: u64) -> Meta {
        Meta {
            kind: Kind::Allreduce,
            dtype: DType::F32,
            shape: vec![d],
            op: Reduction::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            compression: super::super::Compression::None,
            group: 0,
            group_size: 0,
        }
    }

    #[test]
    fn cache_slots_are_stable_and_reused_least_recently_run_first() {
        let mut c = Cache::new(2);
        let none = BTreeSet::new();
        assert_eq!(c.choose(&none), Some(0));
        assert_eq!(c.put(0, "a", &meta(1), 1), None);
        assert_eq!(c.choose(&none), Some(1));
        // A slot chosen in this round is busy: the next new one is after it.
        // The last new slot was chosen earlier in the same round: reuse the least recently run.
        assert_eq!(c.choose(&BTreeSet::from([1])), Some(0));
        c.put(1, "b", &meta(2), 2);
        assert_eq!(c.get("a").map(|(s, _)| s), Some(0));
        // Full: the least recently run slot (a, cycle 1) is reused, unless busy.
        assert_eq!(c.choose(&none), Some(0));
        assert_eq!(c.choose(&BTreeSet::from([0])), Some(1));
        assert_eq!(c.put(0, "c", &meta(3), 3), Some("a".to_string()));
        assert!(c.get("a").is_none());
        c.drop_slot(1);
        assert!(c.get("b").is_none());
        assert_eq!(c.choose(&none), Some(1));
        assert_eq!(Cache::new(0).choose(&none), None);
    }

    #[test]
    fn bit_helpers() {
        let mut w = vec![0u64; 2];
        set_bit(&mut w, 3);
        set_bit(&mut w, 64);
        set_bit(&mut w, 500); // out of range: ignored
        assert!(has_bit(&w, 3) && has_bit(&w, 64) && !has_bit(&w, 4) && !has_bit(&w, 500));
        assert_eq!(bits(&w).collect::<Vec<_>>(), vec![3, 64]);
    }
}
