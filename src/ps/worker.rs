//! A worker ([`KvWorker`]): its calls (push, pull, push-pull, wait, callbacks), the sending of
//! a request's parts to their servers (and backups), and the receiving of the servers'
//! messages: answers, heartbeats, a closed or misbehaving server counted gone (its backup takes
//! over, or the requests that need it fail), requests failed at their deadline. The requests'
//! own state is in `pending.rs`.
//!
//! Whoever holds the receive drives it. A caller waiting for its request does (so its answer
//! reaches it with no hand-off between threads, and a large one lands in its buffer); the
//! receiving thread does only while nobody waits (callbacks, answers nobody waits for yet,
//! heartbeats), and a caller that comes to wait interrupts it. Callbacks always run on the
//! receiving thread.

use super::config::{Group, Role, backup_of};
use super::node::barrier;
use super::pending::{
    Answers, Callback, Pending, Route, Takeover, is_push, issued_push, route, server_gone, timestamp_of,
};
use super::request::check_keys;
use super::wire::{self, Kind, Message};
use super::{Node, PS_RECEIVE, PS_TAG, PS_VALUES_TAG, PsConfig, Reply, SLICE, Timestamp};
use crate::Context;
use crate::comm::{Interrupter, PersistentRecv, QUIET};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::types::Element;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the receiving thread leaves answers that nobody waits for yet unread while a
/// caller drives the receive or may be about to: it then looks whether to take over. Bounds
/// the delay of a callback, and how long a server's large answer waits to be read, while
/// the worker's callers are between waits.
const LINGER: Duration = Duration::from_millis(1);

struct WorkerShared<T> {
    ctx: Arc<Context>,
    cfg: PsConfig,
    id: usize,
    next: AtomicU64,
    pending: Mutex<HashMap<Timestamp, Pending<T>>>,
    done: Condvar,
    /// Servers whose connection closed.
    closed: Mutex<HashMap<usize, Error>>,
    /// When each server was last heard from.
    heard: Mutex<Vec<Instant>>,
    /// A message buffer to reuse (large fresh buffers cost their page faults every time).
    scratch: Mutex<Vec<u8>>,
    /// Where a message's parts are gathered for a transport that sends from one buffer only.
    gathered: Mutex<Vec<u8>>,
    /// Pushes whose failure was handed out (to `wait` or a callback): waiting for one again is
    /// an error, not the empty success of an acknowledged push.
    spent_failures: Mutex<HashSet<Timestamp>>,
    stop: AtomicBool,
    /// The receive of the servers' messages. Whoever holds it drives it: a caller waiting for
    /// its request (no thread hop: the thread that waits reads its answer), else the receiving
    /// thread (for callbacks, answers nobody waits for yet, heartbeats and closed servers).
    inbox: Mutex<PersistentRecv>,
    /// Ends the receiving thread's wait on `inbox` when a caller comes to wait.
    interrupter: Interrupter,
    /// Callers in [`KvWorker::wait`] and the like: while there are any, the receiving thread
    /// leaves the receive to them.
    waiting: AtomicUsize,
    /// Wakes the receiving thread (with `pending`): a request to read answers for, a callback,
    /// the end.
    idle: Condvar,
    /// The receiving thread sleeps with nothing to read for: a new request wakes it.
    dozing: AtomicBool,
    /// Callbacks of finished requests, for the receiving thread to run (whoever received the
    /// answer: a caller that waits never runs another request's callback).
    callbacks: Mutex<Vec<ReadyCallback<T>>>,
    /// Threads asleep on `done` (counted under `pending`): finishing a request wakes them.
    sleepers: AtomicUsize,
}

/// A callback with its request's outcome: the request, what it was, the callback, the outcome.
type ReadyCallback<T> = (Timestamp, &'static str, Callback<T>, Result<Answers<T>>);

/// A caller in a wait (see [`WorkerShared::waiting`]); leaving hands the receive on.
struct Waiter<'a, T> {
    sh: &'a WorkerShared<T>,
    drove: bool,
}

impl<'a, T> Waiter<'a, T> {
    fn enter(sh: &'a WorkerShared<T>) -> Self {
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
fn sleep_on_done<'a, T>(
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
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

impl<T> WorkerShared<T> {
    /// The server a shard's parts wait for now: its backup once it is gone (with replication).
    fn answering(&self) -> impl Fn(usize) -> usize + use<T> {
        let (replicate, servers) = (self.cfg.replicates(), self.cfg.servers);
        let closed: HashSet<usize> = lock(&self.closed).keys().copied().collect();
        move |shard| if replicate && closed.contains(&shard) { backup_of(shard, servers) } else { shard }
    }
}

/// A worker: pushes and pulls values of type `T`. Calls are thread-safe.
pub struct KvWorker<T: Element> {
    sh: Arc<WorkerShared<T>>,
    thread: Option<JoinHandle<()>>,
}

impl<T: Element> std::fmt::Debug for KvWorker<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvWorker").field("id", &self.sh.id).finish()
    }
}

impl<T: Element> KvWorker<T> {
    pub(super) fn start(node: Node) -> Result<Self> {
        // One receive stays posted from wait to wait: a reply half read is not lost.
        let inbox = node.ctx.comm().persistent_recv(PS_TAG, wire::MAX_MESSAGE, QUIET, PS_RECEIVE);
        let sh = Arc::new(WorkerShared {
            ctx: node.ctx,
            next: AtomicU64::new(1),
            pending: Mutex::new(HashMap::default()),
            done: Condvar::new(),
            closed: Mutex::new(HashMap::default()),
            heard: Mutex::new(vec![Instant::now(); node.cfg.servers]),
            scratch: Mutex::new(Vec::new()),
            gathered: Mutex::new(Vec::new()),
            spent_failures: Mutex::new(HashSet::default()),
            stop: AtomicBool::new(false),
            interrupter: inbox.interrupter(),
            inbox: Mutex::new(inbox),
            waiting: AtomicUsize::new(0),
            idle: Condvar::new(),
            dozing: AtomicBool::new(false),
            callbacks: Mutex::new(Vec::new()),
            sleepers: AtomicUsize::new(0),
            id: node.id,
            cfg: node.cfg,
        });
        let s = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ferrogloo-ps-worker-{}", node.id))
            .spawn(move || receive_replies(&s))
            .map_err(|e| Error::io("starting the worker's receiving thread", e))?;
        Ok(KvWorker { sh, thread: Some(thread) })
    }

    /// This worker's number.
    pub fn id(&self) -> usize {
        self.sh.id
    }

    /// Blocks until every worker has called `barrier` as often as this one (the servers go on
    /// serving).
    pub fn barrier(&self) -> Result<()> {
        barrier(&self.sh.ctx, &self.sh.cfg, Role::Worker, Group::Workers)
    }

    /// Pushes `values` for `keys` (sorted, unique); `lens[i]` values belong to `keys[i]`
    /// (empty `lens`: equal lengths). Returns at once with the request's timestamp.
    pub fn push(&self, keys: &[u64], values: &[T], lens: &[usize]) -> Result<Timestamp> {
        self.push_with(keys, values, lens, 0)
    }

    /// [`push`](Self::push) with a command id the server's handler sees.
    pub fn push_with(&self, keys: &[u64], values: &[T], lens: &[usize], cmd: i32) -> Result<Timestamp> {
        let lens = check_keys("push", keys, Some((values.len(), lens)))?;
        self.send(Kind::Push, keys, values, &lens, cmd, false, "push")
    }

    /// Asks for the values of `keys` (sorted, unique); [`wait`](Self::wait) returns them.
    pub fn pull(&self, keys: &[u64]) -> Result<Timestamp> {
        self.pull_with(keys, 0)
    }

    /// [`pull`](Self::pull) with a command id.
    pub fn pull_with(&self, keys: &[u64], cmd: i32) -> Result<Timestamp> {
        check_keys("pull", keys, None)?;
        self.send(Kind::Pull, keys, &[], &[], cmd, true, "pull")
    }

    /// Pushes, and gets back the values after the push (as the server's handler answers).
    pub fn push_pull(&self, keys: &[u64], values: &[T], lens: &[usize]) -> Result<Timestamp> {
        self.push_pull_with(keys, values, lens, 0)
    }

    /// [`push_pull`](Self::push_pull) with a command id.
    pub fn push_pull_with(&self, keys: &[u64], values: &[T], lens: &[usize], cmd: i32) -> Result<Timestamp> {
        let lens = check_keys("push_pull", keys, Some((values.len(), lens)))?;
        self.send(Kind::PushPull, keys, values, &lens, cmd, true, "push_pull")
    }

    #[allow(clippy::too_many_arguments)]
    fn send(
        &self,
        kind: Kind,
        keys: &[u64],
        values: &[T],
        lens: &[usize],
        cmd: i32,
        wants_values: bool,
        what: &'static str,
    ) -> Result<Timestamp> {
        let sh = &self.sh;
        let servers = sh.cfg.servers;
        let mut parts: HashMap<usize, Vec<usize>> = HashMap::default();
        for (i, &k) in keys.iter().enumerate() {
            let s = sh.cfg.sharding.server_of(k, servers);
            if s >= servers {
                return Err(Error::invalid(format!("{what}: the sharding put key {k} on server {s} of {servers}")));
            }
            parts.entry(s).or_default().push(i);
        }
        // Every part must fit a message before any is sent.
        let carries = kind != Kind::Pull;
        for (s, idx) in &parts {
            let payload = if carries {
                idx.iter().try_fold(0usize, |a, &i| a.checked_add(lens[i])).and_then(|n| n.checked_mul(size_of::<T>()))
            } else {
                Some(0)
            };
            if let Some(size) = wire::oversize(idx.len(), if carries { idx.len() } else { 0 }, payload) {
                return Err(Error::invalid(format!(
                    "{what} of {} keys: the message to server {s} ({} of the keys) would be {size}, more \
                     than the {} bytes a parameter-server message may have (split the request)",
                    keys.len(),
                    idx.len(),
                    wire::MAX_MESSAGE
                )));
            }
        }
        let ts = timestamp_of(sh.next.fetch_add(1, Ordering::Relaxed), kind == Kind::Push);
        let replicate = sh.cfg.replicates();
        let closed: HashMap<usize, Error> = lock(&sh.closed).clone();
        for s in parts.keys() {
            if let Some(e) = closed.get(s)
                && (!replicate || closed.contains_key(&backup_of(*s, servers)))
            {
                let ks: Vec<u64> = parts[s].iter().map(|&i| keys[i]).collect();
                return Err(server_gone(what, *s, &ks, e));
            }
        }
        let offsets: Vec<usize> = lens
            .iter()
            .scan(0usize, |at, &l| {
                let o = *at;
                *at += l;
                Some(o)
            })
            .collect();
        let pending = Pending::new(keys.to_vec(), parts.clone(), wants_values, Instant::now() + sh.cfg.timeout, what);
        if keys.is_empty() && kind == Kind::Push {
            // Done already, and a push's success is not kept (see `wait`).
            return Ok(ts);
        }
        lock(&sh.pending).insert(ts, pending);
        if sh.dozing.load(Ordering::SeqCst) {
            // Its answers are to be read even if nobody waits for them.
            sh.idle.notify_one();
        }
        let mut failed: Vec<(usize, Error)> = Vec::new();
        for (s, idx) in parts {
            let ks: Vec<u64> = idx.iter().map(|&i| keys[i]).collect();
            let ls: Vec<usize> = if kind == Kind::Pull { Vec::new() } else { idx.iter().map(|&i| lens[i]).collect() };
            let msg = Message {
                kind,
                cmd,
                ts,
                shard: s as u32,
                keys: ks,
                lens: ls,
                values: Vec::new(),
                at: 0,
                dtype: T::DTYPE as u8,
            };
            // The values go straight from the caller's slice into the message.
            let extra =
                if kind == Kind::Pull { 0 } else { idx.iter().map(|&i| lens[i]).sum::<usize>() * size_of::<T>() };
            let mut bytes = std::mem::take(&mut *lock(&sh.scratch));
            msg.encode_head_into(&mut bytes, extra);
            // The values go from the caller's slice, in runs of keys whose values follow
            // one another there.
            let mut runs: Vec<(usize, usize)> = Vec::new();
            if kind != Kind::Pull {
                for &i in &idx {
                    let (from, to) = (offsets[i] * size_of::<T>(), (offsets[i] + lens[i]) * size_of::<T>());
                    match runs.last_mut() {
                        Some(last) if last.1 == from => last.1 = to,
                        _ => runs.push((from, to)),
                    }
                }
            }
            let mut gathered = std::mem::take(&mut *lock(&sh.gathered));
            let all: &[u8] = bytemuck::cast_slice(values);
            let runs: Vec<&[u8]> = runs.iter().map(|&(a, b)| &all[a..b]).collect();
            let message = Message::parts(&mut bytes, &runs);
            let primary_gone = closed.contains_key(&s);
            let b = backup_of(s, servers);
            if replicate
                && kind == Kind::Pull
                && !primary_gone
                && let Some(p) = lock(&sh.pending).get_mut(&ts)
            {
                p.pulls.insert(s, message.concat());
            }
            if !primary_gone && let Err(e) = sh.ctx.send_parts(s, PS_TAG, &message, &mut gathered) {
                failed.push((s, e));
            }
            // The backup gets every push (to keep its copy) and what its dead primary would.
            if replicate && (primary_gone || kind != Kind::Pull) && !closed.contains_key(&b) {
                let _ = sh.ctx.send_parts(b, PS_TAG, &message, &mut gathered);
            }
            drop(message);
            for (slot, buf) in [(&sh.scratch, bytes), (&sh.gathered, gathered)] {
                let mut slot = lock(slot);
                if slot.capacity() < buf.capacity() {
                    *slot = buf;
                }
            }
        }
        for (s, e) in failed {
            fail_server(sh, s, e);
        }
        Ok(ts)
    }

    /// Waits for request `ts` until its deadline ([`PsConfig::timeout`] after it was sent),
    /// then fails it with [`Error::Timeout`] naming the request, the servers that did not
    /// answer and their keys; a pull's values come back. The calling thread receives the
    /// answers itself while it waits (unless another caller does already).
    ///
    /// A push that succeeded is not kept once acknowledged (so that pushes nobody waits for
    /// cost nothing): waiting for one returns an empty reply at once, also when it was already
    /// waited for or given to [`then`](Self::then). A push that failed is kept until waited for
    /// (or given to `then`), as is every pull; waiting for it again is an error.
    pub fn wait(&self, ts: Timestamp) -> Result<Reply<T>> {
        let answers = self.take(ts, None)?;
        answers.check_placed(None, &format!("worker {}: request {ts}", self.sh.id))?;
        let reply = answers.reply();
        self.give_back(answers);
        Ok(reply)
    }

    /// [`wait`](Self::wait), with the values read straight into `values`, which must hold
    /// exactly all of them (the sum of the keys' lengths; a buffer of another length is
    /// [`Error::InvalidArgument`] naming both, and the request is spent). Returns each key's
    /// number of values. Nothing is allocated for the values, and an answer of 64 KiB or more
    /// that is the request's only one (one server holds every key) is received straight into
    /// `values`, with no copy.
    pub fn wait_into(&self, ts: Timestamp, values: &mut [T]) -> Result<Vec<usize>> {
        let answers = self.take(ts, Some(&mut *values))?;
        let lens = answers.read_into(values, &format!("worker {}: request {ts}", self.sh.id));
        self.give_back(answers);
        lens
    }

    /// Gives the buffers of answers read back to the pairs they came in on (a shard's server,
    /// or its backup once it is gone), to receive later answers into.
    fn give_back(&self, answers: Answers<T>) {
        let comm = self.sh.ctx.comm();
        let answering = self.sh.answering();
        for (shard, buf) in answers.into_buffers() {
            comm.recycle(answering(shard), buf);
        }
    }

    /// Pulls `keys` into `values` and waits: [`pull`](Self::pull) and
    /// [`wait_into`](Self::wait_into). The values of key `keys[i]` come in order, each key's
    /// number of them returned.
    pub fn pull_into(&self, keys: &[u64], values: &mut [T]) -> Result<Vec<usize>> {
        let ts = self.pull(keys)?;
        self.wait_into(ts, values)
    }

    /// Takes request `ts`'s outcome once it is there (see [`wait`](Self::wait)). The calling
    /// thread receives the answers itself while no other thread does.
    ///
    /// With `dest` (the caller's buffer for all the values), an answer that is the request's
    /// only one is received straight into it when this thread receives it.
    fn take(&self, ts: Timestamp, mut dest: Option<&mut [T]>) -> Result<Answers<T>> {
        let sh = &self.sh;
        let mut waiter = Waiter::enter(sh);
        let mut p = lock(&sh.pending);
        loop {
            let Some(req) = p.get_mut(&ts) else {
                if self.is_issued_push(ts) {
                    return Ok(Answers::none());
                }
                return Err(Error::invalid(format!(
                    "worker {}: no request {ts} in flight (already waited for, or given a callback)",
                    sh.id
                )));
            };
            if req.outcome.is_some() {
                let out = p.remove(&ts).and_then(|r| r.outcome).unwrap_or_else(|| Err(Error::invalid("no outcome")));
                drop(p);
                spend(sh, ts, &out);
                return out;
            }
            let now = Instant::now();
            if now >= req.deadline {
                // The receiving thread fails late requests too; this wait does not depend on it.
                let late = p.remove(&ts);
                drop(p);
                let answering = sh.answering();
                return Err(match late {
                    Some(req) => req.overdue(ts, sh.cfg.timeout, answering),
                    None => Error::invalid("no outcome"),
                });
            }
            let until = req.deadline.min(now + SLICE);
            match try_lock(&sh.inbox) {
                Some(mut inbox) => {
                    drop(p);
                    waiter.drove = true;
                    let got = receive_one(sh, &mut inbox, until, false, dest.as_deref_mut().map(|d| (ts, d)));
                    drop(inbox);
                    p = lock(&sh.pending);
                    if got == Received::NoServer {
                        // Nothing can answer: the request is failed by now, or at its deadline.
                        p = sleep_on_done(sh, p, until.saturating_duration_since(Instant::now()));
                    }
                }
                // Another thread drives: it wakes this one when it finishes a request or
                // leaves the receive.
                None => p = sleep_on_done(sh, p, until - now),
            }
        }
    }

    /// The callback form: `f` gets the outcome of request `ts` on the worker's receiving thread
    /// (here and now if it is already there). Keep it short.
    ///
    /// A panic in `f` is caught: here, `then` returns it as [`Error::Panicked`] naming the
    /// request; on the receiving thread it is logged (`tracing`, error level) and the thread
    /// goes on with the other requests.
    pub fn then(&self, ts: Timestamp, f: impl FnOnce(Result<Reply<T>>) + Send + 'static) -> Result<()> {
        let id = self.sh.id;
        let mut p = lock(&self.sh.pending);
        let Some(req) = p.get_mut(&ts) else {
            drop(p);
            if self.is_issued_push(ts) {
                return run_callback(id, ts, "push", Box::new(f), Ok(Reply::default()));
            }
            return Err(Error::invalid(format!("worker {id}: no request {ts} in flight")));
        };
        if req.outcome.is_some() {
            let what = req.what;
            if let Some(Ok(a)) = &req.outcome {
                a.check_placed(None, &format!("worker {id}: request {ts}"))?;
            }
            let out = p.remove(&ts).and_then(|r| r.outcome).unwrap_or_else(|| Err(Error::invalid("no outcome")));
            drop(p);
            spend(&self.sh, ts, &out);
            run_callback(id, ts, what, Box::new(f), out.map(Answers::into_reply))
        } else {
            req.callback = Some(Box::new(f));
            drop(p);
            // The receiving thread runs it when no caller drives.
            self.sh.idle.notify_one();
            Ok(())
        }
    }

    /// Whether `ts` is a push this worker sent that, once not in flight, succeeded (a failed
    /// one stays in flight until its failure is handed out, and is then remembered).
    fn is_issued_push(&self, ts: Timestamp) -> bool {
        issued_push(ts, self.sh.next.load(Ordering::Relaxed)) && !lock(&self.sh.spent_failures).contains(&ts)
    }

    /// Servers this worker knows to be gone: their connection closed, or (with heartbeats)
    /// nothing heard from them for three heartbeats.
    pub fn dead_servers(&self) -> Vec<usize> {
        let closed = lock(&self.sh.closed);
        let heard = lock(&self.sh.heard);
        let silent = |s: usize| self.sh.cfg.heartbeat.is_some_and(|h| heard[s].elapsed() > h * 3);
        (0..self.sh.cfg.servers).filter(|&s| closed.contains_key(&s) || silent(s)).collect()
    }
}

impl<T: Element> Drop for KvWorker<T> {
    fn drop(&mut self) {
        // Goodbye to every live server (their run ends when every worker has said it).
        let closed: HashSet<usize> = lock(&self.sh.closed).keys().copied().collect();
        let bye = Message::control(Kind::Bye).encode();
        for s in (0..self.sh.cfg.servers).filter(|s| !closed.contains(s)) {
            let _ = self.sh.ctx.send(s, PS_TAG, &bye);
        }
        self.sh.stop.store(true, Ordering::SeqCst);
        {
            let _p = lock(&self.sh.pending);
            self.sh.idle.notify_all();
        }
        self.sh.interrupter.interrupt();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Completes request `ts` (the first outcome wins): runs its callback, or keeps the outcome
/// for `wait` (a push's success is not kept: waiting for it returns at once).
fn finish<T: Element>(sh: &WorkerShared<T>, ts: Timestamp, out: Result<Answers<T>>) {
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
fn spend<T, A>(sh: &WorkerShared<T>, ts: Timestamp, out: &Result<A>) {
    if is_push(ts) && out.is_err() {
        lock(&sh.spent_failures).insert(ts);
    }
}

/// Runs request `ts`'s callback, catching a panic as [`Error::Panicked`].
fn run_callback<T>(worker: usize, ts: Timestamp, what: &str, cb: Callback<T>, out: Result<Reply<T>>) -> Result<()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(out))).map_err(|p| Error::Panicked {
        what: format!("the callback of parameter-server {what} request {ts} on worker {worker}"),
        message: crate::engine::panic_message(&*p),
    })
}

/// The worker's receiving thread: the callbacks, the answers nobody waits for yet, heartbeats,
/// closed servers, deadlines. It drives the receive only while no caller waits (callers
/// receive their answers themselves, see [`KvWorker::take`]), and lets go of it as soon as one
/// comes.
fn receive_replies<T: Element>(sh: &WorkerShared<T>) {
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
enum Received {
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
fn receive_one<T: Element>(
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
        inbox.wait(&live, until)
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
            let ranks = match &e {
                Error::Timeout { ranks, .. } => ranks.clone(),
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
            // Which server: the error names it (a closed connection), else every live one
            // is suspect; the context itself is unusable then.
            let server = match &e {
                Error::PeerClosed { rank, .. } | Error::PeerTimedOut { rank, .. } if *rank < sh.cfg.servers => {
                    Some(*rank)
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
fn fail_server<T: Element>(sh: &WorkerShared<T>, server: usize, cause: Error) {
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
fn expire<T: Element>(sh: &WorkerShared<T>) {
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
/// this is the request's only answer (returns where, and how many bytes), else into a buffer
/// of their own, which becomes the message's values.
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
        && size_of_val(out) == bytes
        && lock(&sh.pending).get(&ts).is_some_and(|p| p.only_part(server))
    {
        sh.ctx.recv(server, PS_VALUES_TAG, out)?;
        m.values = Vec::new();
        m.at = 0;
        return Ok((m, Some((out.as_ptr() as usize, bytes))));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::ps::SumStore;
    use crate::rendezvous::HashStore;

    #[test]
    fn pushes_nobody_waits_for_are_forgotten_once_acknowledged() -> Result<()> {
        let store = HashStore::new();
        let cfg = PsConfig::new(1, 1);
        std::thread::scope(|s| {
            let server = s.spawn(|| {
                let node = Node::connect(&store, &Device::in_process(), Role::Server, 0, cfg.clone())?;
                node.server(SumStore::<f32>::default())?.run()
            });
            let w = Node::connect(&store, &Device::in_process(), Role::Worker, 0, cfg.clone())?.worker::<f32>()?;
            let first = w.push(&[1], &[1.0], &[])?;
            for _ in 0..99 {
                w.push(&[1], &[1.0], &[])?;
            }
            // One server answers in order: the pull's answer comes after every acknowledgement.
            assert_eq!(w.wait(w.pull(&[1])?)?.values, [100.0]);
            assert_eq!(lock(&w.sh.pending).len(), 0, "requests kept after their answers");
            // Waiting for an acknowledged push still works.
            assert_eq!(w.wait(first)?, Reply::default());
            assert!(w.wait(first + 1).is_err(), "a pull that was never sent");
            // A push that failed (refused: key 1 holds one value) fails each time it is waited
            // for, not only the first.
            let bad = w.push(&[1], &[1.0, 2.0], &[])?;
            let first_wait = w.wait(bad).map_err(|e| e.to_string());
            assert!(first_wait.as_ref().is_err_and(|e| e.contains("key 1 holds 1 values")), "{first_wait:?}");
            assert!(w.wait(bad).is_err(), "a failed push waited for again");
            drop(w);
            server.join().expect("server thread")
        })
    }
}
