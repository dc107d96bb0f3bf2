//! A server ([`KvServer`]): the loop that serves its handler (and, with replication, the copy
//! of the shard it backs up) the requests of every link at once (the job's context, and each
//! rejoined worker's own), sends heartbeats, counts workers that leave, die or cannot be
//! reached as gone, and meets workers that rejoin.

use super::config::backup_of;
use super::fold::Folder;
use super::request::{Request, SplitPush, request_of, split_push_of};
use super::wire::{self, Kind, Message};
use super::{Handler, Node, PS_RECEIVE, PS_TAG, PS_VALUES_TAG, REJOIN, Responder, SLICE};
use crate::Context;
use crate::comm::{PersistentRecv, QUIET, wait_any};
use crate::error::{Error, Result};
use crate::types::Element;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A server: runs its handler on the requests until every worker has left.
pub struct KvServer<T: Element, H: Handler<T> + Clone> {
    node: Node,
    handler: H,
    _t: PhantomData<fn(T)>,
}

impl<T: Element, H: Handler<T> + Clone> KvServer<T, H> {
    /// Node `node` (a server) serving with `handler`.
    pub(super) fn new(node: Node, handler: H) -> Self {
        KvServer { node, handler, _t: PhantomData }
    }

    /// Serves until every worker has said goodbye or gone; returns the handler's first error,
    /// or the error that made the server's own context unusable.
    ///
    /// What one worker does wrong or suffers ends nothing but that worker's part: a malformed
    /// request is refused (the worker's wait fails with why), a message that is not a request
    /// or does not fit a message is logged (`tracing`) and skipped, and a worker whose
    /// connection fails, or that an answer cannot reach, counts as gone. A worker that fails
    /// to rejoin is logged and waited for until its [`PsConfig::rejoin_wait`] ends.
    ///
    /// [`PsConfig::rejoin_wait`]: super::PsConfig::rejoin_wait
    pub fn run(self) -> Result<()> {
        let (servers, workers) = (self.node.cfg.servers, self.node.cfg.workers);
        let ctx = self.node.ctx.clone();
        let responder = Responder::new(ctx.clone(), servers, workers);
        // The copy of the shard this server backs up exists from the start, so that it sees
        // every worker leave and join, as the shard's own handler does (made at its first
        // request, it waited in synchronous rounds for workers gone before).
        let mut replicas = HashMap::new();
        if self.node.cfg.replicates() {
            let backed = (0..servers).filter(|&s| s != self.node.id && backup_of(s, servers) == self.node.id);
            replicas.extend(backed.map(|s| (s, self.handler.clone())));
        }
        // A push's values wait in the transport for the receive the server posts once it has
        // read their head (no copy aside).
        ctx.hold_until_posted(PS_VALUES_TAG);
        let mut serving = Serving {
            links: vec![Link {
                inbox: ctx.comm().persistent_recv(PS_TAG, wire::MAX_MESSAGE, QUIET, PS_RECEIVE),
                ctx,
                workers: (0..workers).map(|w| (servers + w, w)).collect(),
                ranks: Vec::new(),
            }],
            node: self.node,
            handler: self.handler,
            responder,
            dead: HashMap::new(),
            generations: HashMap::new(),
            rejoining: HashMap::new(),
            store_failing: false,
            replicas,
        };
        serving.run()
    }
}

/// A context the server reaches workers through: the job's, or a rejoined worker's own.
struct Link {
    ctx: Arc<Context>,
    /// Its live workers: rank in `ctx` → worker number.
    workers: HashMap<usize, usize>,
    /// The receive from them, posted from one slice to the next.
    inbox: PersistentRecv,
    /// Their ranks, sorted (as the receive is posted for them), rebuilt when they change.
    ranks: Vec<usize>,
}

/// A server's state while it runs.
struct Serving<T: Element, H: Handler<T> + Clone> {
    node: Node,
    handler: H,
    responder: Responder<T>,
    links: Vec<Link>,
    /// Workers whose process died, waited for until the deadline (rejoin).
    dead: HashMap<usize, Instant>,
    /// The next generation each dead worker may come back as.
    generations: HashMap<usize, i64>,
    /// Rejoins being met (a context forming in the background).
    rejoining: HashMap<usize, JoinHandle<Result<Context>>>,
    /// Whether the last look at the store for rejoins failed (said once, not at every look).
    store_failing: bool,
    /// The copy of the shard this server backs up (with replication), made from the handler
    /// as it started.
    replicas: HashMap<usize, H>,
}

/// The next message of a split push's values from `rank` of `ctx` (at most `max` bytes), into
/// a buffer of the pair's pool, by `deadline`.
fn values_from(ctx: &Context, rank: usize, max: usize, deadline: Instant) -> Result<Vec<u8>> {
    let got = ctx.comm().scope(|s| {
        s.irecv_bytes(&[rank], PS_VALUES_TAG, max)?.wait_timeout(deadline.saturating_duration_since(Instant::now()))
    });
    got.map(|(_, v)| v)
}

impl<T: Element, H: Handler<T> + Clone> Serving<T, H> {
    fn run(&mut self) -> Result<()> {
        let beat = self.node.cfg.heartbeat;
        let mut last_beat = Instant::now();
        let mut last_look = Instant::now();
        let heartbeat = Message::control(Kind::Heartbeat).encode();
        let mut turn = 0usize;
        let ctx_spin = self.node.ctx.comm().spin();
        let mut hot = false;
        while self.links.iter().any(|l| !l.workers.is_empty()) || !self.dead.is_empty() || !self.rejoining.is_empty() {
            if let Some(b) = beat
                && last_beat.elapsed() >= b
            {
                last_beat = Instant::now();
                for link in &self.links {
                    for (&r, &w) in &link.workers {
                        if let Err(e) = link.ctx.send(r, PS_TAG, &heartbeat) {
                            self.responder.unreachable(w, e);
                        }
                    }
                }
                self.settle()?;
            }
            if (!self.dead.is_empty() || !self.rejoining.is_empty()) && last_look.elapsed() >= SLICE {
                last_look = Instant::now();
                self.look_for_rejoins()?;
            }
            if let [link] = &mut self.links[..]
                && !link.workers.is_empty()
            {
                // The job's context alone (no rejoined worker): one receive, no bookkeeping.
                let slice = if !self.dead.is_empty() || !self.rejoining.is_empty() {
                    beat.map_or(SLICE, |b| b.min(SLICE)).min(Duration::from_millis(2))
                } else {
                    beat.map_or(SLICE, |b| b.min(SLICE))
                };
                if link.ranks.len() != link.workers.len() {
                    link.ranks = link.workers.keys().copied().collect();
                    link.ranks.sort_unstable();
                }
                // Right after a request, the next is waited for as a caller waits for its
                // answer (long enough to outlast a worker's wake-up; with both sides on a
                // background thread's short spin, each slept just before the other's message
                // came, 111 µs per 4 KiB request instead of 2.6); idle, briefly.
                let spin = if hot { ctx_spin } else { QUIET };
                hot = false;
                if let Some(got) = link.inbox.wait_as(&link.ranks, Instant::now() + slice, spin) {
                    hot = true;
                    self.take(0, got)?;
                }
                self.settle()?;
                continue;
            }
            let active: Vec<usize> = (0..self.links.len()).filter(|&i| !self.links[i].workers.is_empty()).collect();
            if active.is_empty() {
                // Only workers that may rejoin are left: look for them again shortly.
                std::thread::sleep(SLICE.min(Duration::from_millis(20)));
                continue;
            }
            // Every link with workers at once; the first to answer is served, and the turn
            // rotates which one comes first when several have a message waiting.
            turn = (turn + 1) % active.len();
            let order: Vec<usize> = active[turn..].iter().chain(&active[..turn]).copied().collect();
            let mut slice = beat.map_or(SLICE, |b| b.min(SLICE));
            if !self.dead.is_empty() || !self.rejoining.is_empty() {
                slice = slice.min(Duration::from_millis(2));
            }
            let ranks: Vec<Vec<usize>> = order
                .iter()
                .map(|&li| {
                    let mut r: Vec<usize> = self.links[li].workers.keys().copied().collect();
                    r.sort_unstable();
                    r
                })
                .collect();
            let from: Vec<&[usize]> = ranks.iter().map(Vec::as_slice).collect();
            let mut inboxes: Vec<Option<&mut PersistentRecv>> =
                self.links.iter_mut().map(|l| Some(&mut l.inbox)).collect();
            let mut recvs: Vec<&mut PersistentRecv> = order.iter().filter_map(|&li| inboxes[li].take()).collect();
            let got = wait_any(&mut recvs, &from, Instant::now() + slice);
            drop(recvs);
            if let Some((k, got)) = got {
                self.take(order[k], got)?;
            }
            self.settle()?;
        }
        Ok(())
    }

    /// What the receive on link `li` gave.
    fn take(&mut self, li: usize, got: Result<(usize, Vec<u8>)>) -> Result<()> {
        let id = self.node.id;
        let worker_at = |rank: usize| self.links[li].workers.get(&rank).copied();
        // Errors name ranks of the mesh's context; the link's context may be a sub-group or a
        // shrunk one, with ranks of its own.
        let ctx_rank = |world: usize| self.links[li].ctx.rank_of_world(world);
        match got {
            Ok((rank, bytes)) => {
                let Some(w) = worker_at(rank) else {
                    tracing::debug!(server = id, rank, "a message from a worker that has left; skipped");
                    return Ok(());
                };
                match Message::decode(bytes, rank) {
                    Err(e) => {
                        tracing::warn!(server = id, worker = w, error = %e, "an undecodable message; skipped");
                        Ok(())
                    }
                    Ok(mut m) => match m.kind {
                        Kind::Bye => self.depart(w, false),
                        Kind::Push | Kind::Pull | Kind::PushPull => {
                            let served = self.serve_one(&mut m, w);
                            // The request's bytes, read: the next request is received into them.
                            if let Some(link) = self.links.get(li) {
                                link.ctx.comm().recycle(rank, std::mem::take(&mut m.values));
                            }
                            served
                        }
                        Kind::PushHead | Kind::PushPullHead => {
                            let served = self.serve_split(&mut m, w, li, rank);
                            if let Some(link) = self.links.get(li) {
                                link.ctx.comm().recycle(rank, std::mem::take(&mut m.values));
                            }
                            served
                        }
                        other => {
                            tracing::warn!(server = id, worker = w, "a {other:?} message to a server; skipped");
                            Ok(())
                        }
                    },
                }
            }
            Err(Error::Timeout { .. }) => Ok(()),
            Err(Error::Mismatch { rank, detail }) if ctx_rank(rank).and_then(worker_at).is_some() => {
                // The pair reads past the message and goes on: only that message is lost.
                tracing::warn!(server = id, worker = ctx_rank(rank).and_then(worker_at), "{detail}; skipped");
                Ok(())
            }
            Err(e) => match e.rank().and_then(ctx_rank).and_then(worker_at) {
                Some(w) => {
                    tracing::debug!(server = id, worker = w, error = %e, "a worker's connection failed");
                    self.depart(w, true)
                }
                None if li > 0 => {
                    // A rejoined worker's own context failed: that worker is gone again.
                    tracing::debug!(server = id, error = %e, "a rejoined worker's context failed");
                    let gone: Vec<usize> = self.links[li].workers.values().copied().collect();
                    gone.into_iter().try_for_each(|w| self.depart(w, true))
                }
                None if e.rank().is_some_and(|r| ctx_rank(r) != Some(self.links[li].ctx.rank())) => {
                    tracing::debug!(server = id, error = %e, "an error from a rank that is no live worker; ignored");
                    Ok(())
                }
                None => Err(e),
            },
        }
    }

    /// Worker `w` is gone (`died`: without a goodbye, so it may rejoin).
    fn depart(&mut self, w: usize, died: bool) -> Result<()> {
        let Some(li) = self.links.iter().position(|l| l.workers.values().any(|&x| x == w)) else {
            return Ok(()); // gone already
        };
        let link = &mut self.links[li];
        link.workers.retain(|_, x| *x != w);
        link.ranks.clear();
        if link.workers.is_empty() {
            if li > 0 {
                // A rejoined worker's own context: nothing more comes through it.
                self.links.remove(li);
            } else {
                link.inbox.withdraw();
            }
        }
        self.responder.forget(w);
        if died
            && self.node.store.is_some()
            && let Some(wait) = self.node.cfg.rejoin_wait
        {
            self.dead.insert(w, Instant::now() + wait);
        }
        self.handler.worker_left(w, &self.responder)?;
        for r in self.replicas.values_mut() {
            r.worker_left(w, &self.responder)?;
        }
        Ok(())
    }

    /// Counts the workers that answers could not reach as gone (which may make more answers
    /// go out, and fail).
    fn settle(&mut self) -> Result<()> {
        loop {
            let gone = self.responder.take_unreachable();
            if gone.is_empty() {
                return Ok(());
            }
            for (w, e) in gone {
                tracing::debug!(server = self.node.id, worker = w, error = %e, "a worker cannot be reached");
                self.depart(w, true)?;
            }
        }
    }

    /// Starts meeting dead workers that announced a rejoin in the store, and takes in those met.
    fn look_for_rejoins(&mut self) -> Result<()> {
        let now = Instant::now();
        self.dead.retain(|_, until| now < *until);
        let id = self.node.id;
        let met: Vec<usize> = self.rejoining.iter().filter(|(_, h)| h.is_finished()).map(|(&w, _)| w).collect();
        for w in met {
            let Some(h) = self.rejoining.remove(&w) else { continue };
            match h.join() {
                Ok(Ok(ctx)) => self.admit(w, Arc::new(ctx))?,
                Ok(Err(e)) => tracing::warn!(server = id, worker = w, error = %e, "a rejoining worker did not connect"),
                Err(p) => tracing::warn!(
                    server = id,
                    worker = w,
                    "the thread meeting a rejoining worker panicked: {}",
                    crate::engine::panic_message(&*p)
                ),
            }
        }
        let Some(store) = self.node.store.clone() else { return Ok(()) };
        let waiting: Vec<usize> = self.dead.keys().copied().filter(|w| !self.rejoining.contains_key(w)).collect();
        for w in waiting {
            let g = self.generations.entry(w).or_insert(0);
            match store.try_get(&format!("{REJOIN}/{w}/{g}")) {
                Ok(found) => {
                    self.store_failing = false;
                    if found.is_none() {
                        continue;
                    }
                }
                Err(e) => {
                    if !std::mem::replace(&mut self.store_failing, true) {
                        tracing::warn!(server = id, worker = w, error = %e, "reading the store for rejoins failed");
                    }
                    continue;
                }
            }
            let prefixed = crate::rendezvous::PrefixStore::new(format!("{REJOIN}/{w}/{g}/"), store.clone());
            *g += 1;
            let (cfg, device) = (self.node.cfg.clone(), self.node.ctx.device().clone());
            let meet = std::thread::Builder::new().name(format!("ferrogloo-ps-rejoin-{w}")).spawn(move || {
                Context::builder(id, cfg.servers + 1).timeout(cfg.timeout).connect(&prefixed, &device).map_err(|e| {
                    match e {
                        // Rank `servers` of this context is the worker (not worker 0).
                        Error::Timeout { op, ranks, keys, waited } => Error::Timeout {
                            op: format!("parameter-server server {id} meeting rejoining worker {w}: {op}"),
                            ranks,
                            keys,
                            waited,
                        },
                        other => other,
                    }
                })
            });
            match meet {
                Ok(h) => {
                    self.rejoining.insert(w, h);
                }
                Err(e) => {
                    tracing::warn!(server = id, worker = w, error = %e, "cannot start meeting a rejoining worker")
                }
            }
        }
        Ok(())
    }

    /// Worker `w` rejoined in its own context `ctx`.
    fn admit(&mut self, w: usize, ctx: Arc<Context>) -> Result<()> {
        let rank = self.node.cfg.servers;
        self.dead.remove(&w);
        self.responder.route(w, ctx.clone(), rank);
        ctx.hold_until_posted(PS_VALUES_TAG);
        self.links.push(Link {
            inbox: ctx.comm().persistent_recv(PS_TAG, wire::MAX_MESSAGE, QUIET, PS_RECEIVE),
            ctx,
            workers: HashMap::from([(rank, w)]),
            ranks: Vec::new(),
        });
        self.handler.worker_joined(w, &self.responder)?;
        for r in self.replicas.values_mut() {
            r.worker_joined(w, &self.responder)?;
        }
        Ok(())
    }

    /// Serves a push whose values follow its head `m` ([`Kind::PushHead`]) as the worker's next
    /// message (the transport holds them until received, `Context::hold_until_posted`): sums
    /// them into the handler's store as they arrive where it takes them
    /// ([`Handler::fold_push`]), else receives them and hands the request over as any other.
    /// The values are taken whatever becomes of the request. A worker whose values do not come
    /// counts as gone (its messages are out of step).
    fn serve_split(&mut self, m: &mut Message, worker: usize, li: usize, rank: usize) -> Result<()> {
        let ctx = self.links[li].ctx.clone();
        let head = split_push_of::<T>(m, worker);
        let deadline = Instant::now() + self.node.cfg.timeout;
        let (meta, keys, lens, bytes): SplitPush = match head {
            Ok(h) => h,
            Err(refusal) => {
                // Of unknown length: taken whole, and dropped.
                return match values_from(&ctx, rank, wire::MAX_MESSAGE, deadline) {
                    Ok(v) => {
                        ctx.comm().recycle(rank, v);
                        self.responder.refuse(&refusal.meta, &refusal.reason)
                    }
                    Err(e) => self.values_lost(worker, &refusal.meta, e),
                };
            }
        };
        let me = self.node.id;
        if meta.shard == me && ctx.sinks(rank) {
            let want = lens.iter().sum::<usize>();
            if let Some(dests) = self.handler.fold_push(&meta, &keys, &lens) {
                let fits = dests.len() == lens.len() && dests.iter().zip(&lens).all(|(d, &l)| d.len() == l);
                if !fits {
                    drop(dests);
                    let reason = "the handler's places for the push do not have its keys' lengths";
                    tracing::warn!(server = me, worker, "{reason}");
                    return self.take_values_then(worker, &meta, &ctx, rank, bytes, deadline, |this, _| {
                        this.responder.refuse(&meta, reason)
                    });
                }
                let mut folder = Folder::new(dests);
                let got = ctx.recv_sink(rank, PS_VALUES_TAG, bytes, &mut |b: &[u8]| folder.feed(b), deadline);
                debug_assert!(got.is_err() || folder.summed() == want, "a whole message sums every value");
                drop(folder);
                return match got {
                    Ok(()) => {
                        let request = Request { meta, keys, values: std::borrow::Cow::Borrowed(&[]), lens };
                        self.handler.folded(request, &self.responder)
                    }
                    Err(e) => self.values_lost(worker, &meta, e),
                };
            }
        }
        self.take_values_then(worker, &meta, &ctx, rank, bytes, deadline, |this, values| {
            this.dispatch(Request { meta, keys, values: crate::types::view_or_copy(values), lens })
        })
    }

    /// Receives a split push's `bytes` of values from `rank` of `ctx` into a buffer (reused
    /// for the next), then runs `then` on them.
    #[allow(clippy::too_many_arguments)]
    fn take_values_then(
        &mut self,
        worker: usize,
        meta: &super::RequestMeta,
        ctx: &Context,
        rank: usize,
        bytes: usize,
        deadline: Instant,
        then: impl FnOnce(&mut Self, &[u8]) -> Result<()>,
    ) -> Result<()> {
        match values_from(ctx, rank, bytes, deadline) {
            Ok(v) if v.len() == bytes => {
                let served = then(self, &v);
                ctx.comm().recycle(rank, v);
                served
            }
            Ok(v) => {
                let reason = format!("the push's head announced {bytes} bytes of values, {} came", v.len());
                ctx.comm().recycle(rank, v);
                self.responder.refuse(meta, &reason)
            }
            Err(e) => self.values_lost(worker, meta, e),
        }
    }

    /// A split push's values did not come in (`e`): not of the head's length (taken and
    /// dropped: the request is refused), or not at all (the worker's connection failed, or
    /// they did not come by the deadline: its later messages would be out of step, so it
    /// counts as gone).
    fn values_lost(&mut self, worker: usize, meta: &super::RequestMeta, e: Error) -> Result<()> {
        match e {
            Error::Mismatch { detail, .. } => self.responder.refuse(meta, &format!("the push's values: {detail}")),
            e => {
                tracing::warn!(server = self.node.id, worker, error = %e, "a push's values did not come; the worker counts as gone");
                self.depart(worker, true)
            }
        }
    }

    /// Hands one request to the handler (or the backup copy it is for), or refuses it.
    fn serve_one(&mut self, m: &mut Message, worker: usize) -> Result<()> {
        match request_of::<T>(m, worker) {
            Ok(req) => self.dispatch(req),
            Err(refusal) => self.responder.refuse(&refusal.meta, &refusal.reason),
        }
    }

    /// Hands a checked request to the handler of its shard: this server's own, or the backup
    /// copy it keeps; refuses it when this server holds neither.
    fn dispatch(&mut self, req: Request<'_, T>) -> Result<()> {
        let (me, meta, responder) = (self.node.id, req.meta, &self.responder);
        if meta.shard == me {
            self.handler.handle(req, responder)
        } else if let Some(replica) = self.replicas.get_mut(&meta.shard) {
            replica.handle(req, responder)
        } else {
            responder.refuse(&meta, &format!("server {me} does not hold server {}'s keys", meta.shard))
        }
    }
}
