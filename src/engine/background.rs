//! The engine's driving loop: the thin I/O loop around the negotiation's state machine
//! (`controller.rs`), run by one thread at a time (the background thread, or a caller waiting
//! for its result: `drive.rs`). It waits idle for a submission or a peer's state message (or,
//! where the cycles go through the host's area, a peer's arrival there), moves
//! the controller's messages through `comm` (one persistent receive while idle, the cycle's
//! sends and receives), runs what a cycle decided through `exec.rs`, writes the timeline, and
//! when anything fails, fails every pending submission with the first cause.

use super::CONTROL_TAG;
use super::agree;
use super::config::EngineConfig;
use super::controller::{COORDINATOR, Controller, Decision, Responses};
use super::exec::{self, Item, Own, Span};
use super::handle::{Deferred, Output, Promise, panic_message};
use super::meta::Kind;
use super::shared::{EngineState, Submission, TimelineCommand};
use super::timeline::Timeline;
use super::wire;
use crate::Context;
use crate::comm::{Interrupter, PersistentRecv, SLEEPING};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::transport::{BusyWait, LocalArea};
use rustc_hash::FxHashMap as HashMap;
use smallvec::SmallVec;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

mod exchange;

pub(crate) use exchange::exchange_area_of;
use exchange::recv_past_nudges;

/// Who drives the engine, and until when.
pub(crate) enum Mode<'a> {
    /// The background thread: until a caller comes to wait ([`EngineState::waiting`]), which
    /// interrupts its idle wait.
    Background,
    /// A caller waiting for `done` (with no deadline: a cycle it runs may take longer than
    /// one): until it is finished. Callbacks of others' submissions are handed to the
    /// background thread ([`Core::take_deferred`]), not run on the caller's thread.
    Caller { done: &'a Promise },
}

impl Mode<'_> {
    /// Whether the driver has what it drove for (a caller's result).
    fn satisfied(&self) -> bool {
        match self {
            Mode::Background => false,
            Mode::Caller { done } => done.is_done(),
        }
    }

    /// After an idle wait that ended with no message: whether to let go of the drive.
    fn lets_go(&self, sh: &EngineState) -> bool {
        match self {
            Mode::Background => sh.waiting.load(Ordering::SeqCst) > 0,
            Mode::Caller { .. } => self.satisfied(),
        }
    }
}

/// What an idle wait ended with.
enum Idle {
    /// A cycle begins: with a peer's state message, or (`None`) with this rank's news or a
    /// peer's arrival in the host's area.
    Cycle(Option<(usize, Vec<u8>)>),
    /// The driver lets go ([`Mode`]).
    LetGo,
}

/// The engine's state on this rank, driven by one thread at a time (`drive.rs`).
pub(crate) struct Core {
    ctx: Arc<Context>,
    sh: Arc<EngineState>,
    cfg: EngineConfig,
    rank: usize,
    size: usize,
    /// The negotiation; its tickets are this rank's tensors and completions.
    ctl: Controller<Own>,
    /// This rank's join, until every rank has joined.
    join: Option<Arc<Promise>>,
    /// The fusion buffer, reused from cycle to cycle.
    fusion: Vec<u64>,
    timeline: Option<Timeline>,
    /// The idle wait's receive of control messages from any rank: it stays posted from one
    /// idle slice to the next (withdrawn at a slice's end, a half-read message would be lost).
    inbox: PersistentRecv,
    /// The largest tensor that travels with the state messages (0: none do); see [`eager_limit`].
    eager_max: usize,
    /// The tensors this rank sent with its state messages, by cache slot: the slot's version
    /// and the tensor's byte length. Each is sent once, in the first cycle its slot's bit is
    /// set, and forgotten when the slot is found ready, or changes.
    sent: HashMap<u32, (u64, usize)>,
    /// The cache's changes when [`forget_travelled`](Self::forget_travelled) last looked.
    seen_changes: u64,
    /// The tensors each rank sent, by cache slot, kept from cycle to cycle on the same terms
    /// (every rank keeps the same ones: see [`Core::forget_travelled`]).
    kept: Vec<HashMap<u32, Kept>>,
    /// Every rank of the context (the idle wait's peers), made once.
    all: Arc<[usize]>,
    /// The host's area, where every rank of the context shares it: the cycles' state
    /// messages go through it ([`exchange_area`](Self::exchange_area)), not over the pairs.
    area: Option<Arc<dyn LocalArea>>,
    /// Over the pairs, the ranks agree by reduction ([`exchange_tree`](Self::exchange_tree);
    /// [`EngineConfig::tree_negotiation_from`]), as every rank checked.
    tree: bool,
    /// Nudges from peers that claimed this rank's idle flag and have not been taken from its
    /// receives yet (each claim sends one: [`LocalArea::claim_idle`]).
    owed_nudges: usize,
    /// The buffers of this rank's envelopes (to the coordinator, to the others), reused.
    envelopes: [Vec<u8>; 2],
    /// Storage for the folds of [`reduce_eager`](Self::reduce_eager), reused.
    scratch: Vec<u64>,
    /// Buffers of peers' envelopes read from the area, given back once used: a warm cycle
    /// allocates none.
    spare: Spare,
    /// A caller drives: callbacks are kept here for the background thread, not run.
    deferring: bool,
    /// Callbacks of finished submissions (with their names) for the background thread.
    deferred: Vec<(String, Deferred)>,
}

/// The most bytes of tensors that travel with one state message (a bound on the memory a
/// cycle's messages take, not a speed setting: which tensors travel is the cost model's).
const EAGER_MESSAGE_BYTES: usize = 1 << 20;

/// The largest envelope buffer kept for the next cycle (a larger one is freed after use).
const ENVELOPE_KEPT_BYTES: usize = 2 * EAGER_MESSAGE_BYTES;

/// The most bytes of tensors a rank has sent and not yet seen used (what every other rank
/// keeps of it, at most).
const EAGER_KEPT_BYTES: usize = 4 << 20;

/// Buffers of received envelopes kept for the next cycles' (at most [`EAGER_KEPT_BYTES`] of
/// them in all, each at most [`ENVELOPE_KEPT_BYTES`]).
#[derive(Default)]
struct Spare {
    bufs: Vec<Vec<u8>>,
    bytes: usize,
}

impl Spare {
    /// `bytes` in a buffer of this pool, or a new one.
    fn copy_of(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut v = self.bufs.pop().unwrap_or_default();
        self.bytes -= v.capacity();
        v.clear();
        v.extend_from_slice(bytes);
        v
    }

    /// Keeps `v` for later, if it fits.
    fn give(&mut self, v: Vec<u8>) {
        let c = v.capacity();
        if c > 0 && c <= ENVELOPE_KEPT_BYTES && self.bytes + c <= EAGER_KEPT_BYTES {
            self.bytes += c;
            self.bufs.push(v);
        }
    }

    /// Keeps `msg`'s buffer for later, where nothing else holds it.
    fn give_shared(&mut self, msg: Arc<Vec<u8>>) {
        if let Ok(v) = Arc::try_unwrap(msg) {
            self.give(v);
        }
    }
}

/// A tensor a rank sent with its state message: the version of its slot when it came (see
/// `Cache::version`), and where its bytes lie in the message it came in. The message is
/// shared by the tensors it carried, not copied: what is kept is what was sent (a message is
/// received into memory of its own), and the fold copies a tensor first only where it is not
/// aligned for its type (`Item::reduce_from`).
struct Kept {
    version: u64,
    msg: Arc<Vec<u8>>,
    at: usize,
    len: usize,
}

impl Kept {
    fn bytes(&self) -> &[u8] {
        &self.msg[self.at..self.at + self.len]
    }
}

/// The largest tensor whose travelling with the state messages costs less, by `ctx`'s cost
/// model, than the allreduce it replaces: each rank sends it to every other rank and folds
/// theirs, `(n - 1) · bytes · (β + γ)`, against the allreduce `Auto` would run. Up to
/// [`EAGER_MESSAGE_BYTES`]; 0 where there is no model (one rank). Every rank holds the same
/// model, so every rank finds the same limit (and a tensor that travels from some ranks only
/// is allreduced as usual: see [`Core::cycle`]).
fn eager_limit(ctx: &Context) -> usize {
    let n = ctx.size();
    let Some(model) = ctx.cost_model().filter(|_| n > 1) else { return 0 };
    let per_byte = (n - 1) as f64 * (1.0 / model.link_bytes_per_s + 1.0 / model.reduce_bytes_per_s);
    let mut limit = 0;
    let mut bytes = 64;
    while bytes <= EAGER_MESSAGE_BYTES {
        let allreduce = model.allreduce_choice(n, bytes);
        let Some(t) = model.allreduce_time(allreduce, n, bytes) else { break };
        if bytes as f64 * per_byte >= t.as_secs_f64() {
            break;
        }
        limit = bytes;
        bytes *= 2;
    }
    limit
}

impl Core {
    /// `area`: the area the cycles go through ([`exchange_area_of`]), as every rank checked.
    pub(crate) fn new(
        ctx: Arc<Context>,
        sh: Arc<EngineState>,
        cfg: EngineConfig,
        timeline: Option<PathBuf>,
        area: Option<Arc<dyn LocalArea>>,
        tree: bool,
    ) -> Result<Core> {
        let (rank, size) = (ctx.rank(), ctx.size());
        let world: Vec<usize> = (0..size).map(|r| ctx.world_rank(r).unwrap_or(r)).collect();
        let timeline = timeline.map(|p| Timeline::create(&p, world[rank], sh.epoch)).transpose()?;
        Ok(Core {
            ctl: Controller::new(rank, world, cfg.cache_capacity, cfg.stall_check, cfg.stall_shutdown),
            inbox: ctx.comm().persistent_recv(CONTROL_TAG, wire::MAX_MESSAGE, SLEEPING, "engine control receive"),
            // Nothing travels with a reduction (its messages carry bits, not states).
            eager_max: if tree { 0 } else { eager_limit(&ctx) },
            sent: HashMap::default(),
            seen_changes: 0,
            kept: (0..size).map(|_| HashMap::default()).collect(),
            all: (0..size).collect(),
            area,
            tree,
            owed_nudges: 0,
            envelopes: Default::default(),
            scratch: Vec::new(),
            spare: Spare::default(),
            deferring: false,
            deferred: Vec::new(),
            ctx,
            sh,
            cfg,
            rank,
            size,
            join: None,
            fusion: Vec::new(),
            timeline,
        })
    }

    /// The job's rank of rank `r` of the engine's context (errors name ranks this way).
    fn w(&self, r: usize) -> usize {
        self.ctx.world_rank(r).unwrap_or(r)
    }

    /// Drives the engine on this thread: waits for news and runs cycles until `mode` says to
    /// let go (`Ok(None)`), a rank shut the engine down (`Ok(Some(rank))`) or something failed.
    pub(crate) fn drive(&mut self, mode: &Mode<'_>) -> Result<Option<usize>> {
        self.deferring = matches!(mode, Mode::Caller { .. });
        loop {
            if mode.satisfied() {
                return Ok(None);
            }
            match self.idle(mode)? {
                Idle::Cycle(first) => {
                    let shut = self.cycle(first, matches!(mode, Mode::Background))?;
                    // Callers waiting for their turn look whether this cycle finished theirs.
                    self.sh.changed();
                    if let Some(by) = shut {
                        return Ok(Some(by));
                    }
                }
                Idle::LetGo => return Ok(None),
            }
        }
    }

    /// Ends the engine on this rank once driving it ended (`driven`: the rank that shut it
    /// down, a failure, or a panic): tells the peers a failure's cause, records the first
    /// cause, and fails whatever is left with it. Returns the callbacks of what it failed
    /// when a caller drove (for the background thread).
    pub(crate) fn end(mut self, driven: std::thread::Result<Result<usize>>) -> Vec<(String, Deferred)> {
        let served = driven.unwrap_or_else(|p| {
            Err(Error::Aborted {
                rank: self.w(self.rank),
                reason: format!("the engine's loop panicked on rank {}: {}", self.w(self.rank), panic_message(&*p)),
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
        let fail = |name: String, done: &Promise, deferred: &mut Vec<(String, Deferred)>, deferring: bool| {
            if deferring {
                deferred.extend(done.finish_deferring(Err(err.clone())).map(|d| (name, d)));
            } else {
                done.done_with(Err(err.clone()));
            }
        };
        let mut deferred = std::mem::take(&mut self.deferred);
        for s in queued.drain(..) {
            fail(s.name, &s.done, &mut deferred, self.deferring);
        }
        for (name, (_, done, _)) in self.ctl.drain_tickets() {
            fail(name, &done, &mut deferred, self.deferring);
        }
        if let Some(j) = self.join.take() {
            j.done_with(Err(err.clone()));
        }
        if let Some(t) = &mut self.timeline {
            t.flush();
        }
        self.sh.changed();
        deferred
    }

    /// The callbacks a caller's driving kept for the background thread.
    pub(crate) fn take_deferred(&mut self) -> Vec<(String, Deferred)> {
        std::mem::take(&mut self.deferred)
    }

    /// The context the engine runs on.
    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// What ends the idle wait of this rank's driver early: its interrupter.
    pub(crate) fn interrupter(&self) -> Interrupter {
        self.inbox.interrupter()
    }

    /// Whether this rank has something to negotiate; starts and stops the timeline as asked
    /// first (before the submissions that came after).
    fn has_news(&mut self) -> bool {
        let (news, cmds) = {
            let mut q = lock(&self.sh.queue);
            let news = !q.items.is_empty() || (q.shutdown && !self.ctl.is_shutting_down());
            (news, std::mem::take(&mut q.timeline))
        };
        for c in cmds {
            self.timeline_command(c);
        }
        news || self.ctl.has_news()
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

    /// Waits for news: a submission on this rank (a message to itself wakes a driver waiting
    /// here), or a peer's state message (a cycle began), or, where the cycles go through the
    /// host's area, a peer's arrival there (seen here, or, while this rank sleeps, told by a
    /// nudge: [`exchange_area`](Self::exchange_area)). Returns the peer's message, or `None`
    /// for news of this rank or of the area; or says to let go ([`Mode`]).
    fn idle(&mut self, mode: &Mode<'_>) -> Result<Idle> {
        let all = self.all.clone();
        loop {
            // Set before looking for news, so that a submission either is seen here or sees
            // the flag and sends the wake-up message (shared.rs).
            self.sh.on_inbox.store(true, Ordering::SeqCst);
            // A peer that begins a cycle through the area nudges this rank only while it says
            // it waits idle: said before the look that precedes a wait (area.rs: either the
            // peer's arrival is seen here or the peer sees the flag). News found at a first
            // look needs no flag (a warm loop then writes no word that its peers read).
            let mut news = self.has_news() || self.area.as_ref().is_some_and(|a| a.started());
            // Whether this rank's idle flag is set (taken back once, not twice: a second take
            // would count a nudge that nobody sends).
            let mut flagged = !news && self.area.is_some();
            if flagged && let Some(area) = self.area.clone() {
                area.set_idle();
                news = self.has_news() || area.started();
            }
            if news {
                self.sh.on_inbox.store(false, Ordering::SeqCst);
                if std::mem::take(&mut flagged) {
                    self.leave_idle();
                }
                // Nudges owed to this rank are taken now, while nothing else can come (a
                // peer's state comes by message only after every rank arrived at the step).
                self.take_nudges()?;
                // The cycle's own receives must not race the idle one: withdraw it, unless a
                // message is arriving into it already, which then comes first.
                self.inbox.withdraw();
                if !self.inbox.is_posted() {
                    return Ok(Idle::Cycle(None));
                }
            }
            // Until the stall inspector's next look, when rank 0 holds pending names;
            // otherwise long (nothing to do until a message comes).
            let until = Instant::now() + self.ctl.stall_wait().unwrap_or(Duration::from_secs(3600));
            let got = match mode {
                Mode::Background => {
                    let sh = &self.sh;
                    self.inbox.wait_interruptibly(&all, until, || sh.waiting.load(Ordering::SeqCst) == 0)
                }
                Mode::Caller { .. } => {
                    // A caller waiting for its own result busy-waits as callers do, then
                    // sleeps as the only thread waiting on the mesh.
                    let spin = BusyWait { alone: true, ..self.ctx.comm().spin() };
                    self.inbox.wait_as(&all, until, spin)
                }
            };
            self.sh.on_inbox.store(false, Ordering::SeqCst);
            if flagged {
                self.leave_idle();
            }
            match got {
                // A peer's nudge: a cycle began in the area (the next look finds it).
                Some(Ok((peer, msg))) if peer != self.rank && self.area.is_some() && msg == [wire::WAKE] => {
                    self.owed_nudges = self.owed_nudges.saturating_sub(1);
                    self.inspect_stalls()?;
                }
                Some(Ok((peer, msg))) if peer == self.rank => {
                    self.sh.wake_pending.store(false, Ordering::SeqCst);
                    if msg != [wire::WAKE] {
                        return Err(Error::Protocol {
                            peer: Some(self.w(peer)),
                            detail: format!("engine: a message of {} bytes from this rank to itself", msg.len()),
                        });
                    }
                }
                Some(Ok((peer, msg))) => return Ok(Idle::Cycle(Some((peer, msg)))),
                // A message that began arriving and stopped was dropped; so is a quiet slice
                // (or an interrupted one).
                None | Some(Err(Error::Timeout { .. })) => {
                    self.inspect_stalls()?;
                    if mode.lets_go(&self.sh) {
                        return Ok(Idle::LetGo);
                    }
                }
                Some(Err(e)) => return Err(e),
            }
        }
    }

    /// Takes back this rank's idle flag; a peer that claimed it sends a nudge, now owed.
    fn leave_idle(&mut self) {
        if self.area.as_ref().is_some_and(|a| a.clear_idle()) {
            self.owed_nudges += 1;
        }
    }

    /// Takes the owed nudges that have come (without waiting for those still on their way), so
    /// that none piles up in the transport.
    fn take_nudges(&mut self) -> Result<()> {
        while self.owed_nudges > 0 {
            let quick = BusyWait { budget: Duration::ZERO, ..self.ctx.comm().spin() };
            let all = self.all.clone();
            match self.inbox.wait_as(&all, Instant::now(), quick) {
                None => return Ok(()),
                Some(Ok((peer, msg))) if msg == [wire::WAKE] => {
                    if peer == self.rank {
                        self.sh.wake_pending.store(false, Ordering::SeqCst);
                    } else {
                        self.owed_nudges -= 1;
                    }
                }
                Some(Ok((peer, msg))) => {
                    return Err(Error::Protocol {
                        peer: Some(self.w(peer)),
                        detail: format!("engine: a message of {} bytes while no cycle runs", msg.len()),
                    });
                }
                Some(Err(e)) => return Err(e),
            }
        }
        Ok(())
    }

    /// While submissions keep arriving close together, waits (at most the batch window) for
    /// the burst to end, so that one cycle negotiates it. On the background thread
    /// (`background`) one submission just made, that nobody waits for yet, counts as the start
    /// of a burst: a thread that submits a step's tensors one after the other and then waits
    /// would otherwise see its first tensor negotiated alone, and the next few as they came,
    /// each cycle running a piece of the step (ResNet-50's step ran in five to six cycles
    /// instead of two or three). A thread that submits one tensor and waits drives the loop
    /// itself: no wait.
    fn batch(&self, background: bool) {
        let (gap, window) = (self.cfg.batch_gap, self.cfg.batch_window);
        if window.is_zero() || gap.is_zero() {
            return;
        }
        let mut start = None;
        let mut q = lock(&self.sh.queue);
        loop {
            // A burst: more than one submission is waiting, the last two close together, and
            // the last one just now; or the first of one (above). (One submission alone, as
            // from a thread that submits and waits, is negotiated at once, without a look at
            // the clock.)
            let recent = |q: &crate::engine::shared::Queue| q.last.is_some_and(|l| l.elapsed() < gap);
            let burst = q.items.len() > 1 && q.gap.is_some_and(|g| g < gap) && recent(&q);
            let first_of_burst =
                background && q.items.len() == 1 && self.sh.waiting.load(Ordering::SeqCst) == 0 && recent(&q);
            if !burst && !first_of_burst {
                return;
            }
            let left = window.saturating_sub(start.get_or_insert_with(Instant::now).elapsed());
            if q.shutdown || left.is_zero() {
                return;
            }
            let n = q.items.len();
            q.batching = true;
            q = crate::sync::wait_timeout(&self.sh.arrived, q, gap.min(left));
            q.batching = false;
            if q.items.len() == n {
                return;
            }
        }
    }

    /// Hands new submissions to the controller.
    fn drain(&mut self) {
        // Timeline commands and submissions are taken together: a submission made just after
        // `start_timeline` must not be taken (and run) before the command is.
        let (commands, items, shutdown) = {
            let mut q = lock(&self.sh.queue);
            (std::mem::take(&mut q.timeline), std::mem::take(&mut q.items), q.shutdown)
        };
        for c in commands {
            self.timeline_command(c);
        }
        if shutdown {
            self.ctl.shut_down();
        }
        for Submission { name, meta, payload, done, submitted } in items {
            if meta.kind == Kind::Join {
                self.join = Some(done);
                self.ctl.join();
            } else {
                self.ctl.submit(name, meta, (payload, done, submitted));
            }
        }
    }

    /// Reduces the ready allreduces whose tensors every rank has sent for this submission
    /// (`slots[i]`: `items[i]`'s slot, for those the cache's bits found ready), with no
    /// collective. Every rank has the same messages, so every rank reduces the same ones; the
    /// others run as usual. Returns how many it reduced, and (with a timeline) the time spent
    /// on each.
    fn reduce_eager(
        &mut self,
        items: &mut [Item],
        slots: &[Option<u32>],
        contributors: usize,
    ) -> Result<(u64, Vec<Span>)> {
        // With joined ranks, allreduces run as collectives (an average divides by the ranks
        // that contributed: exec.rs).
        if self.sent.is_empty() || contributors != self.size {
            return Ok((0, Vec::new()));
        }
        let (me, n) = (self.rank, self.size);
        let (mut reduced, mut spans) = (0, Vec::new());
        for (i, item) in items.iter_mut().enumerate() {
            let (Some(slot), Some(len)) = (slots.get(i).copied().flatten(), item.eager_bytes()) else { continue };
            let version = self.ctl.cache().version(slot);
            if self.sent.get(&slot).is_none_or(|(v, l)| Some(*v) != version || *l != len) {
                continue;
            }
            let peers: Option<SmallVec<[Option<&[u8]>; 8]>> = (0..n)
                .map(|p| {
                    if p == me {
                        return Some(None);
                    }
                    self.kept[p]
                        .get(&slot)
                        .filter(|k| Some(k.version) == version && k.len == len)
                        .map(|k| Some(k.bytes()))
                })
                .collect();
            if let Some(peers) = peers {
                let timed = self.timeline.is_some().then_some(&mut spans);
                item.reduce_from(&peers, &mut self.scratch, timed, i)?;
                reduced += 1;
            }
        }
        Ok((reduced, spans))
    }

    /// After a cycle: forgets the tensors sent for the slots found ready (used, or allreduced
    /// by a collective), and those kept under a slot that no longer holds the same name and
    /// kind (invalidated, evicted, given to another name). Every rank found the same slots
    /// ready and holds the same cache, so every rank forgets the same ones; a rank forgets
    /// what it sent itself when its submission no longer pends in that slot
    /// ([`exchange`](Self::exchange)).
    fn forget_travelled(&mut self, ready: &[Option<u32>]) {
        for slot in ready.iter().flatten() {
            self.sent.remove(slot);
            for k in &mut self.kept {
                if let Some(gone) = k.remove(slot) {
                    self.spare.give_shared(gone.msg);
                }
            }
        }
        let cache = self.ctl.cache();
        if cache.changes() != self.seen_changes {
            self.seen_changes = cache.changes();
            for k in &mut self.kept {
                k.retain(|slot, kept| cache.version(*slot) == Some(kept.version));
            }
        }
    }

    /// One cycle. Returns the rank that shut the engine down, if one did.
    fn cycle(&mut self, first: Option<(usize, Vec<u8>)>, background: bool) -> Result<Option<usize>> {
        if first.is_none() {
            self.batch(background);
        }
        self.drain();
        self.exchange(first)?;
        let now = Instant::now();
        let responses = match self.ctl.exchanged(now, self.timeline.is_some())? {
            Responses::None => None,
            Responses::Send(msg) => {
                self.send_responses(&msg)?;
                None
            }
            Responses::Receive if self.tree => {
                // Down the binomial tree: from this rank's parent, on to its children.
                let parent = agree::tree_parent(self.rank).unwrap_or(COORDINATOR);
                let msg =
                    self.ctx.scope(|s| Ok(s.irecv_bytes(&[parent], CONTROL_TAG, wire::MAX_MESSAGE)?.wait()?.1))?;
                self.send_responses(&msg)?;
                // A broken message is blamed on the parent that sent it (it may have come
                // from the coordinator broken, which the parent then reports too).
                Some((msg, parent))
            }
            Responses::Receive => {
                let mut nudged = 0;
                let nudges = self.area.is_some();
                let msg = self.ctx.scope(|s| recv_past_nudges(s, COORDINATOR, nudges, &mut nudged))?;
                self.owed_nudges = self.owed_nudges.saturating_sub(nudged);
                Some((msg, COORDINATOR))
            }
        };
        let Decision { ready, from_coordinator, coordinated, contributors, join_done, shut_by } =
            self.ctl.conclude(responses.as_ref().map(|(msg, from)| (msg.as_slice(), *from)))?;
        let slots: SmallVec<[Option<u32>; 16]> = ready.iter().map(|r| r.slot).collect();
        let hits = ready.len() - from_coordinator;
        let mut items: Vec<Item> = ready.into_iter().map(|r| Item::new(r, now)).collect();
        let eager = self.reduce_eager(&mut items, &slots, contributors);
        self.forget_travelled(&slots);
        {
            let mut st = lock(&self.sh.stats);
            st.cycles += 1;
            st.coordinated_cycles += u64::from(coordinated);
            st.coordinated += from_coordinator as u64;
            st.cache_hits += hits as u64;
            st.eager += eager.as_ref().map_or(0, |(reduced, _)| *reduced);
        }
        let spans = match eager {
            Ok((_, spans)) => spans,
            Err(e) => {
                // The failure ends the engine: every item of the cycle reports it.
                for mut item in items {
                    lock(&self.sh.inflight).remove(&item.name);
                    item.fail_unrun(&e);
                    let _ = item.finish();
                }
                return Err(e);
            }
        };
        self.execute(items, contributors, spans)?;
        if let Some(last) = join_done
            && let Some(j) = self.join.take()
        {
            lock(&self.sh.inflight).remove("ferrogloo.join");
            self.sh.joined.store(false, Ordering::SeqCst);
            j.done_with(Ok(Output::Rank(last)));
        }
        if self.rank == COORDINATOR {
            self.inspect_stalls()?;
        }
        if let Some(t) = &mut self.timeline {
            t.flush();
        }
        Ok(shut_by)
    }

    /// Sends the coordinator's responses on: from rank 0 to every other rank, or (agreeing by
    /// reduction) to this rank's children in the binomial tree rooted at rank 0.
    fn send_responses(&self, msg: &[u8]) -> Result<()> {
        let (me, n) = (self.rank, self.size);
        let to: SmallVec<[usize; 16]> = match self.tree {
            true => agree::tree_children(me, n).collect(),
            false => (0..n).filter(|&p| p != me).collect(),
        };
        if to.is_empty() {
            return Ok(());
        }
        self.ctx.scope(|s| {
            let sends = to.iter().map(|&p| s.isend(p, CONTROL_TAG, msg)).collect::<Result<SmallVec<[_; 16]>>>()?;
            sends.into_iter().try_for_each(|s| s.wait())
        })
    }

    /// Rank 0: reports names some ranks submitted and others have not, past the thresholds;
    /// past the shutdown threshold, fails the engine (on every rank) naming them.
    fn inspect_stalls(&mut self) -> Result<()> {
        let found = self.ctl.inspect_stalls(Instant::now());
        for report in found.reports {
            let _ = writeln!(std::io::stderr(), "[ferrogloo engine, rank {}] stalled: {report}", self.w(self.rank));
            tracing::warn!(rank = self.rank, %report, "engine stall");
            lock(&self.sh.stalls).push(report);
        }
        found.fatal.map_or(Ok(()), Err)
    }

    /// Runs the ready names in order (fusing allreduces) and completes this rank's handles.
    /// `eager`: the spans of those reduced from the state messages.
    fn execute(&mut self, mut items: Vec<Item>, contributors: usize, eager: Vec<Span>) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let (mut spans, ran) = exec::run(
            &self.ctx,
            &mut self.fusion,
            &mut items,
            contributors,
            (self.cfg.fusion_threshold, self.cfg.fusion_max_tensor),
            &self.sh.stats,
        );
        spans.extend(eager);
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
            if self.deferring {
                self.deferred.extend(item.finish_deferring());
                continue;
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool of envelope buffers: a buffer given back is the next one used (a warm cycle
    /// allocates none), and what it keeps stays within its bounds, each and in all.
    #[test]
    fn spare_buffers_are_reused_within_their_bounds() {
        let mut spare = Spare::default();
        let first = spare.copy_of(&[7u8; 4096]);
        assert_eq!(first, vec![7u8; 4096]);
        let (at, capacity) = (first.as_ptr(), first.capacity());
        spare.give(first);
        assert_eq!(spare.bytes, capacity);
        let again = spare.copy_of(&[9u8; 100]);
        assert_eq!((again.as_ptr(), again.as_slice()), (at, &[9u8; 100][..]), "the same buffer, refilled");
        assert_eq!(spare.bytes, 0);
        spare.give(again);
        // Too large to keep, and empty: dropped.
        spare.give(Vec::with_capacity(ENVELOPE_KEPT_BYTES + 1));
        spare.give(Vec::new());
        assert_eq!(spare.bufs.len(), 1);
        // At most EAGER_KEPT_BYTES in all.
        for _ in 0..2 * EAGER_KEPT_BYTES / ENVELOPE_KEPT_BYTES {
            spare.give(Vec::with_capacity(ENVELOPE_KEPT_BYTES));
        }
        assert!(spare.bytes <= EAGER_KEPT_BYTES, "{} bytes kept", spare.bytes);
        assert_eq!(spare.bytes, spare.bufs.iter().map(Vec::capacity).sum::<usize>());
        // A message still shared is not taken back.
        let shared = Arc::new(vec![1u8; 8]);
        let held = shared.clone();
        let before = spare.bufs.len();
        spare.give_shared(shared);
        assert_eq!(spare.bufs.len(), before);
        drop(held);
    }
}
