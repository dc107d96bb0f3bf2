//! The receiving side of a worker: who drives the receive (a waiting caller, else the
//! receiving thread, which a caller that comes to wait interrupts), taking in the servers'
//! messages (answers, their values straight into a waiting caller's buffer, heartbeats), servers
//! counted gone, deadlines, and the callbacks, which run on the receiving thread only.

use super::WorkerShared;
use crate::comm::PersistentRecv;
use crate::error::{Error, Result};
use crate::ps::fold::Folder;
use crate::ps::pending::{Answers, Callback, Pending, Route, Takeover, is_push, route};
use crate::ps::wire::{self, Kind, Message};
use crate::ps::{PS_TAG, PS_VALUES_TAG, Reply, SLICE, Timestamp};
use crate::sync::lock;
use crate::types::Element;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// How long the receiving thread leaves answers that nobody waits for yet unread while a
/// caller drives the receive or may be about to: it then looks whether to take over. Bounds
/// the delay of a callback, and how long a server's large answer waits to be read, while
/// the worker's callers are between waits.
const LINGER: Duration = Duration::from_millis(1);

/// A caller in a wait (see [`WorkerShared::waiting`]); leaving hands the receive on.
pub(super) struct Waiter<'a, T> {
    sh: &'a WorkerShared<T>,
    pub(super) drove: bool,
}

impl<'a, T> Waiter<'a, T> {
    pub(super) fn enter(sh: &'a WorkerShared<T>) -> Self {
        sh.waiting.fetch_add(1, Ordering::SeqCst);
        // The receiving thread lets go of the receive (it sees `waiting` or is interrupted).
        sh.interrupter.interrupt();
        Waiter { sh, drove: false }
    }
}

impl<T> Drop for Waiter<'_, T> {
    fn drop(&mut self) {
        let others = self.sh.waiting.fetch_sub(1, Ordering::SeqCst) > 1;
        if self.drove && others {
            // Another caller sleeps until someone drives: its turn.
            let _p = lock(&self.sh.pending);
            self.sh.done.notify_all();
        }
    }
}

/// Sleeps on `done` for at most `timeout`, counted among its sleepers.
pub(super) fn sleep_on_done<'a, T>(
    sh: &'a WorkerShared<T>,
    p: MutexGuard<'a, HashMap<Timestamp, Pending<T>>>,
    timeout: Duration,
) -> MutexGuard<'a, HashMap<Timestamp, Pending<T>>> {
    sh.sleepers.fetch_add(1, Ordering::SeqCst);
    let p = crate::sync::wait_timeout(&sh.done, p, timeout);
    sh.sleepers.fetch_sub(1, Ordering::SeqCst);
    p
}

/// `m` locked if nobody holds it (poison ignored).
pub(super) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Completes request `ts` (the first outcome wins): runs its callback, or keeps the outcome
/// for `wait` (a push's success is not kept: waiting for it returns at once).
pub(super) fn finish<T: Element>(sh: &WorkerShared<T>, ts: Timestamp, out: Result<Answers<T>>) {
    let mut p = lock(&sh.pending);
    let Some(req) = p.get_mut(&ts) else { return };
    if req.outcome.is_some() {
        return;
    }
    match req.callback.take() {
        Some(cb) => {
            let what = req.what;
            p.remove(&ts);
            drop(p);
            spend(sh, ts, &out);
            lock(&sh.callbacks).push((ts, what, cb, out));
            // The receiving thread runs it; if it is the one here, after letting go of the
            // receive.
            sh.idle.notify_one();
        }
        None => {
            if out.is_ok() && !req.wants_values {
                p.remove(&ts);
            } else {
                req.outcome = Some(out);
            }
            let sleepers = sh.sleepers.load(Ordering::SeqCst) > 0;
            drop(p);
            if sleepers {
                sh.done.notify_all();
            }
        }
    }
}

/// Runs the callbacks of finished requests (on the receiving thread, holding no lock).
fn run_callbacks<T: Element>(sh: &WorkerShared<T>) {
    let ready = std::mem::take(&mut *lock(&sh.callbacks));
    for (ts, what, cb, out) in ready {
        // Values received into a waiting caller's buffer are not this callback's to read.
        let out = out.and_then(|a| a.check_placed(None, &format!("worker {}: request {ts}", sh.id)).map(|()| a));
        if let Err(e) = run_callback(sh.id, ts, what, cb, out.map(Answers::into_reply)) {
            tracing::error!(worker = sh.id, request = ts, error = %e, "parameter-server callback panicked");
        }
    }
}

/// Remembers a push's failure once handed out (see [`WorkerShared::spent_failures`]).
pub(super) fn spend<T, A>(sh: &WorkerShared<T>, ts: Timestamp, out: &Result<A>) {
    if is_push(ts) && out.is_err() {
        lock(&sh.spent_failures).insert(ts);
    }
}

/// Runs request `ts`'s callback, catching a panic as [`Error::Panicked`].
pub(super) fn run_callback<T>(
    worker: usize,
    ts: Timestamp,
    what: &str,
    cb: Callback<T>,
    out: Result<Reply<T>>,
) -> Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(out))).map_err(|p| Error::Panicked {
        what: format!("the callback of parameter-server {what} request {ts} on worker {worker}"),
        message: crate::engine::panic_message(&*p),
    })
}

/// The worker's receiving thread: the callbacks, the answers nobody waits for yet, heartbeats,
/// closed servers, deadlines. It drives the receive only while no caller waits (callers
/// receive their answers themselves, see `KvWorker::take`), and lets go of it as soon as one
/// comes.
pub(super) fn receive_replies<T: Element>(sh: &WorkerShared<T>) {
    let mut last_look = Instant::now();
    while !sh.stop.load(Ordering::SeqCst) {
        expire(sh);
        run_callbacks(sh);
        let unanswered = lock(&sh.pending).values().any(|r| r.outcome.is_none());
        if sh.waiting.load(Ordering::SeqCst) == 0
            && (unanswered || last_look.elapsed() >= SLICE)
            && let Some(mut inbox) = try_lock(&sh.inbox)
        {
            if unanswered {
                // Answers to read: until the next slice, or until a caller comes.
                if receive_one(sh, &mut inbox, Instant::now() + SLICE, true, None) == Received::NoServer {
                    // Nothing to receive from: the requests fail at their deadlines.
                    drop(inbox);
                    drop(crate::sync::wait_timeout(&sh.idle, lock(&sh.pending), SLICE));
                    continue;
                }
            } else {
                // A look at what came (heartbeats, closures): what is there, no wait.
                let mut n = 0;
                while n < LOOK_AT_MOST && receive_one(sh, &mut inbox, Instant::now(), true, None) == Received::Message {
                    n += 1;
                }
            }
            last_look = Instant::now();
            drop(inbox);
            if sh.waiting.load(Ordering::SeqCst) > 0 {
                // A caller interrupted the wait and sleeps until the receive is free.
                let _p = lock(&sh.pending);
                sh.done.notify_all();
            }
            continue;
        }
        let p = lock(&sh.pending);
        if sh.stop.load(Ordering::SeqCst) || !lock(&sh.callbacks).is_empty() {
            continue;
        }
        let busy = sh.waiting.load(Ordering::SeqCst) > 0 || p.values().any(|r| r.outcome.is_none());
        // With requests in flight or callers waiting, look again shortly (a caller may leave
        // answers behind); else until the next look, or until a request or callback comes.
        let nap = if busy { LINGER } else { SLICE.saturating_sub(last_look.elapsed()).max(LINGER) };
        sh.dozing.store(!busy, Ordering::SeqCst);
        drop(crate::sync::wait_timeout(&sh.idle, p, nap));
        sh.dozing.store(false, Ordering::SeqCst);
    }
    lock(&sh.inbox).withdraw();
    run_callbacks(sh);
}

/// The most messages the receiving thread's look at the receive takes in at once.
const LOOK_AT_MOST: usize = 64;

/// What [`receive_one`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Received {
    /// A message, or an error that was taken in.
    Message,
    /// Nothing by the deadline (or interrupted).
    Nothing,
    /// No live server to receive from.
    NoServer,
}

/// Receives one message from the live servers (waiting until `until`; `interruptible`: ended
/// early when a caller comes to wait) and takes it in, then fails the requests past their
/// deadline. `dest`: a waiting caller's request and its buffer for the values (see
/// [`values_of`]).
pub(super) fn receive_one<T: Element>(
    sh: &WorkerShared<T>,
    inbox: &mut PersistentRecv,
    until: Instant,
    interruptible: bool,
    dest: Option<(Timestamp, &mut [T])>,
) -> Received {
    let live: Vec<usize> = {
        let closed = lock(&sh.closed);
        (0..sh.cfg.servers).filter(|s| !closed.contains_key(s)).collect()
    };
    let got = if live.is_empty() {
        inbox.withdraw();
        expire(sh);
        return Received::NoServer;
    } else if interruptible {
        inbox.wait_interruptibly(&live, until, || {
            sh.waiting.load(Ordering::SeqCst) == 0 && !sh.stop.load(Ordering::SeqCst)
        })
    } else {
        // A caller waiting for its answer busy-waits as any caller does (long enough to
        // outlast the server's wake-up, where a background thread's short spin would sleep
        // before every answer).
        inbox.wait_as(&live, until, sh.ctx.comm().spin())
    };
    match got {
        Some(Ok((server, bytes))) => {
            if let Some(h) = lock(&sh.heard).get_mut(server) {
                *h = Instant::now();
            }
            match Message::decode(bytes, server) {
                Ok(m) if m.kind == Kind::ReplyHead => match values_of(sh, server, m, dest) {
                    Ok((m, placed)) => on_reply(sh, server, m, placed),
                    Err(e) => fail_server(sh, server, e),
                },
                Ok(m) => on_reply(sh, server, m, None),
                Err(e) => fail_server(sh, server, e),
            }
        }
        // A quiet slice.
        None => {
            expire(sh);
            return Received::Nothing;
        }
        // A message that began arriving and stopped (dropped). From one server that server's
        // stream is out of step (an answer's values could be taken as the next head's): it
        // counts as gone. From one of several, it cannot be told which.
        Some(Err(e @ Error::Timeout { .. })) => {
            // The ranks of the mesh's context, which a shrunk context renumbers.
            let ranks: Vec<usize> = match &e {
                Error::Timeout { ranks, .. } => {
                    ranks.iter().filter_map(|&w| sh.ctx.rank_of_world(w)).filter(|&r| r < sh.cfg.servers).collect()
                }
                _ => Vec::new(),
            };
            if let [server] = ranks[..] {
                fail_server(sh, server, e);
            } else {
                tracing::warn!(worker = sh.id, ?ranks, error = %e, "a server's message began arriving and stopped");
            }
            expire(sh);
            return Received::Nothing;
        }
        Some(Err(e)) => {
            // Which server: the error names it (a closed connection; by its rank in the mesh's
            // context, which a shrunk context renumbers), else every live one is suspect; the
            // context itself is unusable then.
            let server = match &e {
                Error::PeerClosed { rank, .. } | Error::PeerTimedOut { rank, .. } => {
                    sh.ctx.rank_of_world(*rank).filter(|&r| r < sh.cfg.servers)
                }
                _ => None,
            };
            match server {
                Some(s) => fail_server(sh, s, e),
                None => {
                    for s in live {
                        fail_server(sh, s, e.clone());
                    }
                }
            }
        }
    }
    expire(sh);
    Received::Message
}

/// Marks `server` gone: requests waiting for it go to its backup (with replication, when the
/// backup lives) or fail naming it and their keys.
pub(super) fn fail_server<T: Element>(sh: &WorkerShared<T>, server: usize, cause: Error) {
    let closed: HashSet<usize> = {
        let mut c = lock(&sh.closed);
        c.entry(server).or_insert(cause.clone());
        c.keys().copied().collect()
    };
    let mut resend: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut stashed: Vec<(Timestamp, usize, Message)> = Vec::new();
    let mut doomed: Vec<(Timestamp, Error)> = Vec::new();
    {
        let mut p = lock(&sh.pending);
        for (&ts, req) in p.iter_mut() {
            let (replicate, servers) = (sh.cfg.replicates(), sh.cfg.servers);
            for t in req.on_server_gone(server, &cause, replicate, servers, |s| closed.contains(&s)) {
                match t {
                    Takeover::Stashed(shard, m) => stashed.push((ts, shard, m)),
                    Takeover::Ask(b, bytes) => resend.push((b, bytes)),
                    Takeover::Fail(e) => doomed.push((ts, e)),
                }
            }
        }
    }
    for (b, bytes) in resend {
        if let Err(e) = sh.ctx.send(b, PS_TAG, &bytes) {
            tracing::debug!(server = b, error = %e, "asking a backup failed");
        }
    }
    for (ts, shard, m) in stashed {
        apply_part(sh, ts, shard, m);
    }
    for (ts, e) in doomed {
        finish(sh, ts, Err(e));
    }
}

/// Fails requests past their deadline, naming the servers and keys still outstanding.
pub(super) fn expire<T: Element>(sh: &WorkerShared<T>) {
    let now = Instant::now();
    let answering = sh.answering();
    let late: Vec<(Timestamp, Error)> = lock(&sh.pending)
        .iter()
        .filter(|(_, p)| p.outcome.is_none() && p.deadline <= now)
        .map(|(ts, p)| (*ts, p.overdue(*ts, sh.cfg.timeout, &answering)))
        .collect();
    for (ts, e) in late {
        finish(sh, ts, Err(e));
    }
}

/// Receives the values that follow the answer head `m` from `server` ([`Kind::ReplyHead`]):
/// straight into `dest`'s buffer when `dest` is the caller waiting for this very request and
/// this is the request's only answer, or one of a push-pull's answers on a pair that hands
/// bytes over (scattered to its keys' places; returns where, and how many bytes), else into a
/// buffer of their own, which becomes the message's values.
fn values_of<T: Element>(
    sh: &WorkerShared<T>,
    server: usize,
    mut m: Message,
    dest: Option<(Timestamp, &mut [T])>,
) -> Result<(Message, Option<(usize, usize)>)> {
    let bytes = m
        .lens
        .iter()
        .try_fold(0usize, |a, &l| a.checked_add(l))
        .and_then(|n| n.checked_mul(size_of::<T>()))
        .filter(|&n| n <= wire::MAX_MESSAGE)
        .ok_or_else(|| Error::Protocol {
            peer: Some(server),
            detail: format!("an answer's head for {} keys whose values do not fit a message", m.keys.len()),
        })?;
    m.kind = Kind::Reply;
    if let Some((ts, out)) = dest
        && ts == m.ts
        && m.shard as usize == server
    {
        let at = out.as_ptr() as usize;
        if size_of_val(out) == bytes && lock(&sh.pending).get(&ts).is_some_and(|p| p.only_part(server)) {
            sh.ctx.recv(server, PS_VALUES_TAG, out)?;
            m.values = Vec::new();
            m.at = 0;
            return Ok((m, Some((at, bytes))));
        }
        // One answer of several, its keys' places in the caller's buffer known (a push-pull):
        // scattered there as they arrive, where the transport hands bytes over.
        let places = if sh.ctx.sinks(server) {
            lock(&sh.pending).get(&ts).and_then(|p| p.place_of(server, out.len()))
        } else {
            None
        };
        if let Some(places) = places
            && places.len() == m.lens.len()
            && places.iter().zip(&m.lens).all(|(&(_, l), &ml)| l == ml)
            && let Some(dests) = disjoint(out, &places)
        {
            let mut scatter = Folder::copying(dests);
            let deadline = Instant::now() + sh.cfg.timeout;
            sh.ctx.recv_sink(server, PS_VALUES_TAG, bytes, &mut |b: &[u8]| scatter.feed(b), deadline)?;
            m.values = Vec::new();
            m.at = 0;
            return Ok((m, Some((at, bytes))));
        }
    }
    let values = sh.ctx.recv_bytes(server, PS_VALUES_TAG, bytes)?;
    if values.len() != bytes {
        return Err(Error::Protocol {
            peer: Some(server),
            detail: format!("an answer's values of {} bytes where its head says {bytes}", values.len()),
        });
    }
    m.values = values;
    m.at = 0;
    Ok((m, None))
}

/// The slices of `out` at `places` ((offset, length) in values, in increasing offsets and not
/// overlapping, as a request's keys' places are), or `None` where they are not so or do not
/// fit.
fn disjoint<'a, T>(out: &'a mut [T], places: &[(usize, usize)]) -> Option<Vec<&'a mut [T]>> {
    let mut dests = Vec::with_capacity(places.len());
    let (mut rest, mut base) = (out, 0usize);
    for &(at, len) in places {
        let (_, tail) = rest.split_at_mut_checked(at.checked_sub(base)?)?;
        let (mine, tail) = tail.split_at_mut_checked(len)?;
        dests.push(mine);
        (rest, base) = (tail, at + len);
    }
    Some(dests)
}

/// Takes in message `m` from `server`; `placed`: where its values were received instead (see
/// [`values_of`]).
fn on_reply<T: Element>(sh: &WorkerShared<T>, server: usize, m: Message, placed: Option<(usize, usize)>) {
    let shard = m.shard as usize;
    match route(server, &m, sh.cfg.replication, sh.cfg.servers) {
        Route::Skip => {}
        Route::Bad(e) => fail_server(sh, server, e),
        Route::Own if let Some((at, bytes)) = placed => {
            let ts = m.ts;
            let outcome = lock(&sh.pending).get_mut(&ts).and_then(|req| req.take_placed(shard, m, at, bytes));
            if let Some(out) = outcome {
                finish(sh, ts, out);
            }
        }
        Route::Own => apply_part(sh, m.ts, shard, m),
        // A backup's answer: it counts once the primary is gone, until then it waits.
        Route::Backup if lock(&sh.closed).contains_key(&shard) => apply_part(sh, m.ts, shard, m),
        Route::Backup => {
            let mut p = lock(&sh.pending);
            if let Some(req) = p.get_mut(&m.ts).filter(|r| r.outcome.is_none() && r.parts.contains_key(&shard)) {
                req.stash.insert(shard, m);
            }
        }
    }
}

/// Takes the answer `m` for `shard`'s part of request `ts`; completes the request when it was
/// the last part.
fn apply_part<T: Element>(sh: &WorkerShared<T>, ts: Timestamp, shard: usize, m: Message) {
    let outcome = lock(&sh.pending).get_mut(&ts).and_then(|req| req.take_answer(shard, m));
    if let Some(out) = outcome {
        finish(sh, ts, out);
    }
}
