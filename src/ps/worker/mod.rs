//! A worker ([`KvWorker`]): its calls (push, pull, push-pull, wait, callbacks), its state, and
//! the sending of a request's parts to their servers (and backups). The receiving side (who
//! drives the receive, the servers' messages, servers counted gone, deadlines, callbacks) is
//! in `receive.rs`; the requests' own state in `../pending.rs`.

mod receive;

use super::config::{Group, Role, backup_of};
use super::node::barrier;
use super::pending::{Answers, Callback, Pending, issued_push, server_gone, timestamp_of};
use super::request::check_keys;
use super::wire::{self, Kind, Message};
use super::{Node, PS_RECEIVE, PS_TAG, PS_VALUES_TAG, PsConfig, Reply, SLICE, Timestamp};
use crate::Context;
use crate::comm::{Interrupter, PersistentRecv, QUIET};
use crate::error::{Error, Result};
use crate::sync::{keep_larger, lock};
use crate::types::Element;
use receive::{
    Received, Waiter, fail_server, receive_one, receive_replies, run_callback, sleep_on_done, spend, try_lock,
};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

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
    /// Message heads to reuse, a few (large fresh buffers cost their page faults every time);
    /// a thread takes them all for a request, and others meanwhile allocate their own.
    scratch: Mutex<Vec<Vec<u8>>>,
    /// Where a message's parts are gathered for a transport that sends from one buffer only.
    gathered: Mutex<Vec<u8>>,
    /// Held, per server, while a request's messages to it are posted (a one-server request:
    /// while it is sent): a split push's head and its values (see [`wire::PUSH_SPLIT_MIN`]) go
    /// one right after the other, with no other thread's message between them (the server
    /// receives the values next, and the transport holds them until it does). Requests with
    /// replication never split, and do not take it.
    sending: Vec<Mutex<()>>,
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

/// A request's part for one server: the server, whether its values follow its head as a
/// message of their own, and the runs of values it carries.
type Part<'a> = (usize, bool, Vec<&'a [u8]>);

/// A message to send: the server, the tag, and its parts.
type Outgoing<'a> = (usize, u32, SmallVec<[&'a [u8]; 8]>);

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
            sending: (0..node.cfg.servers).map(|_| Mutex::new(())).collect(),
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
            // One server holds them all, or about its share (no regrowing as keys come).
            parts.entry(s).or_insert_with(|| Vec::with_capacity(keys.len() / servers + 1)).push(i);
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
        let mut offsets = Vec::with_capacity(lens.len());
        let mut at = 0usize;
        for &l in lens {
            offsets.push(at);
            at += l;
        }
        let mut pending =
            Pending::new(keys.to_vec(), parts.clone(), wants_values, Instant::now() + sh.cfg.timeout, what);
        if kind == Kind::PushPull && servers > 1 {
            // Its answers' places in a waiting caller's buffer are known before they come.
            pending.lens = Some(lens.to_vec());
        }
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
        let all: &[u8] = bytemuck::cast_slice(values);
        // Each server's message: its head, and the runs of the caller's values it carries (keys
        // whose values follow one another there), by server.
        let mut order: SmallVec<[(usize, Vec<usize>); 4]> = parts.into_iter().collect();
        order.sort_unstable_by_key(|(s, _)| *s);
        let mut pool = std::mem::take(&mut *lock(&sh.scratch));
        let mut heads: SmallVec<[Vec<u8>; 4]> = SmallVec::with_capacity(order.len());
        let mut outs: SmallVec<[Part<'_>; 4]> = SmallVec::with_capacity(order.len());
        for (s, idx) in &order {
            let s = *s;
            let ks: Vec<u64> = idx.iter().map(|&i| keys[i]).collect();
            let ls: Vec<usize> = if kind == Kind::Pull { Vec::new() } else { idx.iter().map(|&i| lens[i]).collect() };
            let extra =
                if kind == Kind::Pull { 0 } else { idx.iter().map(|&i| lens[i]).sum::<usize>() * size_of::<T>() };
            // Large values for a server that sums them as they arrive follow their head as a
            // message of their own.
            let split = kind != Kind::Pull && !replicate && extra >= wire::PUSH_SPLIT_MIN && sh.ctx.sinks(s);
            let msg = Message {
                kind: if split { kind.head() } else { kind },
                cmd,
                ts,
                shard: s as u32,
                keys: ks,
                lens: ls,
                values: Vec::new(),
                at: 0,
                dtype: T::DTYPE as u8,
            };
            let mut bytes = pool.pop().unwrap_or_default();
            msg.encode_head_into(&mut bytes, if split { 0 } else { extra });
            let mut runs: Vec<&[u8]> = Vec::with_capacity(idx.len().min(wire::GATHER_MOST + 1));
            if kind != Kind::Pull {
                for &i in idx {
                    let (from, to) = (offsets[i] * size_of::<T>(), (offsets[i] + lens[i]) * size_of::<T>());
                    match runs.last_mut() {
                        Some(last) if last.as_ptr_range().end == all[from..].as_ptr() => {
                            *last = &all[from - last.len()..to];
                        }
                        _ => runs.push(&all[from..to]),
                    }
                }
            }
            heads.push(bytes);
            outs.push((s, split, runs));
        }
        if replicate {
            let mut gathered = std::mem::take(&mut *lock(&sh.gathered));
            for ((s, _, runs), head) in outs.iter().zip(heads.iter_mut()) {
                let s = *s;
                let message = Message::parts(head, runs);
                let primary_gone = closed.contains_key(&s);
                let b = backup_of(s, servers);
                if kind == Kind::Pull
                    && !primary_gone
                    && let Some(p) = lock(&sh.pending).get_mut(&ts)
                {
                    p.pulls.insert(s, message.concat());
                }
                if !primary_gone && let Err(e) = sh.ctx.send_parts(s, PS_TAG, &message, &mut gathered) {
                    failed.push((s, e));
                }
                // The backup gets every push (to keep its copy) and what its dead primary would.
                if (primary_gone || kind != Kind::Pull) && !closed.contains_key(&b) {
                    let _ = sh.ctx.send_parts(b, PS_TAG, &message, &mut gathered);
                }
            }
            keep_larger(&sh.gathered, gathered);
        } else if let ([(s, false, runs)], [head]) = (&outs[..], &mut heads[..]) {
            // One message: sent as it is (no lists to build for it).
            let _sending = lock(&sh.sending[*s]);
            let mut gathered = std::mem::take(&mut *lock(&sh.gathered));
            if let Err(e) = sh.ctx.send_parts(*s, PS_TAG, &Message::parts(head, runs), &mut gathered) {
                failed.push((*s, e));
            }
            keep_larger(&sh.gathered, gathered);
        } else {
            // Every server's message at once (a server does not wait for another's to be
            // taken), with nothing of another thread's posted between a head and its values.
            let joined: Vec<Option<Vec<u8>>> = outs
                .iter()
                .map(|(_, split, runs)| (*split && runs.len() > wire::GATHER_MOST).then(|| runs.concat()))
                .collect();
            let mut messages: Vec<Outgoing<'_>> = Vec::with_capacity(2 * outs.len());
            for (((s, split, runs), head), joined) in outs.iter().zip(heads.iter_mut()).zip(&joined) {
                if *split {
                    messages.push((*s, PS_TAG, smallvec::smallvec![&head[..]]));
                    let values = match joined {
                        Some(j) => smallvec::smallvec![&j[..]],
                        None => runs.iter().copied().collect(),
                    };
                    messages.push((*s, PS_VALUES_TAG, values));
                } else {
                    messages.push((*s, PS_TAG, Message::parts(head, runs)));
                }
            }
            let list: Vec<(usize, u32, &[&[u8]])> = messages.iter().map(|(s, t, p)| (*s, *t, &p[..])).collect();
            let posting = || -> SmallVec<[_; 4]> { outs.iter().map(|(s, _, _)| lock(&sh.sending[*s])).collect() };
            for ((s, _, _), sent) in list.iter().zip(sh.ctx.send_all(&list, posting)) {
                if let Err(e) = sent
                    && !failed.iter().any(|(f, _)| f == s)
                {
                    failed.push((*s, e));
                }
            }
        }
        drop(outs);
        // A few heads kept for the next requests (a fresh large buffer faults its pages in).
        pool.extend(heads);
        pool.truncate(4);
        *lock(&sh.scratch) = pool;
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
    /// that is the request's only one (one server holds every key), or on shared memory any
    /// such answer to a push-pull (its keys' places known from the push), is received straight
    /// into `values`, with no copy. After an error `values` may hold some of the answers.
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
    /// With `dest` (the caller's buffer for all the values), a large answer that is the
    /// request's only one, or one of a push-pull's, is received straight into it when this
    /// thread receives it.
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
