//! How a server's handler answers: the [`Handler`] trait a server runs, and the [`Responder`]
//! it answers through (now or later), which sends to each worker where it is reached now and
//! counts a worker it cannot reach as gone.

use super::wire::{self, Kind, Message};
use super::{PS_TAG, PS_VALUES_TAG, Request, RequestMeta};
use crate::Context;
use crate::error::{Error, Result};
use crate::sync::{keep_larger, lock};
use crate::types::Element;
use smallvec::SmallVec;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// How a handler answers, now or later.
///
/// A worker that cannot be reached any more (its connection failed, or a send to it timed
/// out) counts as gone: the answer is dropped, the call returns `Ok`, and the server tells the
/// handler ([`Handler::worker_left`]) once the handler's call returns.
pub struct Responder<T> {
    out: Outlet,
    servers: usize,
    workers: usize,
    scratch: Mutex<Vec<u8>>,
    /// Where an answer's parts are gathered for a transport that sends from one buffer only.
    gathered: Mutex<Vec<u8>>,
    /// Held while an answer's head and values go out (handlers may answer from several
    /// threads).
    split: Mutex<()>,
    /// Workers that rejoined: the context and rank they are reached at now.
    routes: Mutex<HashMap<usize, (Arc<Context>, usize)>>,
    /// Workers a send to failed, and why: the server counts them gone.
    unreachable: Mutex<Vec<(usize, Error)>>,
    _t: PhantomData<fn(T)>,
}

/// Where answers go when a worker has no route of its own.
enum Outlet {
    /// The job's context: worker `w` is its rank `servers + w`.
    Job(Arc<Context>),
    /// Kept in memory, per worker (handlers tested without a context).
    #[cfg(test)]
    Kept(Mutex<Vec<(usize, Vec<u8>)>>),
}

impl<T: Element> Responder<T> {
    /// Answers to the workers of the job's context `ctx` (`servers` servers, `workers` workers).
    pub(super) fn new(ctx: Arc<Context>, servers: usize, workers: usize) -> Self {
        Self::with(Outlet::Job(ctx), servers, workers)
    }

    fn with(out: Outlet, servers: usize, workers: usize) -> Self {
        Responder {
            out,
            servers,
            workers,
            scratch: Mutex::new(Vec::new()),
            gathered: Mutex::new(Vec::new()),
            split: Mutex::new(()),
            routes: Mutex::new(HashMap::new()),
            unreachable: Mutex::new(Vec::new()),
            _t: PhantomData,
        }
    }

    /// Answers a request: for a push, with nothing (`keys` empty); for a pull, with the values
    /// of the keys asked for, in their order. An answer larger than a parameter-server message
    /// may be is not sent: the worker's request fails with an error naming both sizes.
    pub fn respond(&self, meta: &RequestMeta, keys: &[u64], values: &[T], lens: &[usize]) -> Result<()> {
        self.send_reply(meta, keys, lens.to_vec(), &[values])
    }

    /// [`respond`](Self::respond) with each key's values as a slice of its own (no gathering
    /// copy before the message is written).
    pub fn respond_parts(&self, meta: &RequestMeta, keys: &[u64], parts: &[&[T]]) -> Result<()> {
        self.send_reply(meta, keys, parts.iter().map(|p| p.len()).collect(), parts)
    }

    /// Sends the message made of `parts` to worker `worker` (gathered into `gathered` where
    /// the transport needs one buffer); a failed send makes the worker unreachable, not an
    /// error. Whether it was sent.
    fn send_to(&self, worker: usize, tag: u32, parts: &[&[u8]], gathered: &mut Vec<u8>) -> Result<bool> {
        if worker >= self.workers {
            return Err(Error::invalid(format!("an answer to worker {worker} of {}: no such worker", self.workers)));
        }
        let route = lock(&self.routes).get(&worker).cloned();
        let sent = match (route, &self.out) {
            (Some((ctx, rank)), _) => ctx.send_parts(rank, tag, parts, gathered),
            (None, Outlet::Job(ctx)) => ctx.send_parts(self.servers + worker, tag, parts, gathered),
            #[cfg(test)]
            (None, Outlet::Kept(kept)) => {
                let _ = tag;
                lock(kept).push((worker, parts.concat()));
                Ok(())
            }
        };
        if let Err(e) = sent {
            tracing::debug!(worker, error = %e, "a parameter-server answer could not be sent; the worker counts as gone");
            self.unreachable(worker, e);
            return Ok(false);
        }
        Ok(true)
    }

    fn send_reply(&self, meta: &RequestMeta, keys: &[u64], lens: Vec<usize>, parts: &[&[T]]) -> Result<()> {
        let total = parts.iter().try_fold(0usize, |a, p| a.checked_add(std::mem::size_of_val(*p)));
        if let Some(size) = wire::oversize(keys.len(), lens.len(), total) {
            let reason = format!(
                "the answer for {} keys would be {size}, more than the {} bytes a parameter-server message \
                 may have",
                keys.len(),
                wire::MAX_MESSAGE
            );
            tracing::warn!(worker = meta.worker, request = meta.timestamp, "{reason}");
            return self.refuse(meta, &reason);
        }
        let split = total.is_some_and(|t| t >= wire::SPLIT_MIN);
        let msg = Message {
            kind: if split { Kind::ReplyHead } else { Kind::Reply },
            cmd: meta.cmd,
            ts: meta.timestamp,
            shard: meta.shard as u32,
            keys: keys.to_vec(),
            lens,
            values: Vec::new(),
            at: 0,
            dtype: T::DTYPE as u8,
        };
        let mut bytes = std::mem::take(&mut *lock(&self.scratch));
        let mut gathered = std::mem::take(&mut *lock(&self.gathered));
        msg.encode_head_into(&mut bytes, total.unwrap_or(0));
        // The values go from where the handler keeps them.
        let mut runs: Vec<&[u8]> = Vec::with_capacity(parts.len());
        runs.extend(parts.iter().map(|p| bytemuck::cast_slice(p)).filter(|p: &&[u8]| !p.is_empty()));
        let sent = if split {
            // The head, then the values as a message of their own, with no other split answer
            // between them (the worker takes the next values message as the head's).
            let _one_at_a_time = lock(&self.split);
            let head = self.send_to(meta.worker, PS_TAG, &[&bytes], &mut gathered);
            let mut joined = Vec::new();
            let values: SmallVec<[&[u8]; 8]> = if runs.len() > wire::GATHER_MOST {
                joined = std::mem::take(&mut gathered);
                joined.clear();
                runs.iter().for_each(|r| joined.extend_from_slice(r));
                smallvec::smallvec![&joined[..]]
            } else {
                runs.iter().copied().collect()
            };
            // A head that did not go (the worker counts as gone) takes its values with it.
            let sent = match head {
                Ok(true) => self.send_to(meta.worker, PS_VALUES_TAG, &values, &mut gathered).map(drop),
                other => other.map(drop),
            };
            drop(values);
            if joined.capacity() > gathered.capacity() {
                gathered = joined;
            }
            sent
        } else {
            let message = Message::parts(&mut bytes, &runs);
            let sent = self.send_to(meta.worker, PS_TAG, &message, &mut gathered).map(drop);
            drop(message);
            sent
        };
        keep_larger(&self.scratch, bytes);
        keep_larger(&self.gathered, gathered);
        sent
    }

    /// Refuses a request: the worker's wait fails with `reason`.
    pub fn refuse(&self, meta: &RequestMeta, reason: &str) -> Result<()> {
        let msg = Message {
            kind: Kind::Error,
            cmd: meta.cmd,
            ts: meta.timestamp,
            shard: meta.shard as u32,
            keys: Vec::new(),
            lens: Vec::new(),
            values: reason.as_bytes().to_vec(),
            at: 0,
            dtype: 0,
        };
        self.send_to(meta.worker, PS_TAG, &[&msg.encode()], &mut Vec::new()).map(drop)
    }

    /// Worker `worker` cannot be reached (`e` says why): the server counts it gone.
    pub(super) fn unreachable(&self, worker: usize, e: Error) {
        lock(&self.unreachable).push((worker, e));
    }

    /// The workers found unreachable since the last call.
    pub(super) fn take_unreachable(&self) -> Vec<(usize, Error)> {
        std::mem::take(&mut *lock(&self.unreachable))
    }

    /// Worker `worker` is reached at rank `rank` of `ctx` from now on (it rejoined).
    pub(super) fn route(&self, worker: usize, ctx: Arc<Context>, rank: usize) {
        lock(&self.routes).insert(worker, (ctx, rank));
    }

    /// Worker `worker` left: a route of its own goes.
    pub(super) fn forget(&self, worker: usize) {
        lock(&self.routes).remove(&worker);
    }
}

#[cfg(test)]
impl<T: Element> Responder<T> {
    /// A responder that keeps its answers, for `workers` workers of a server.
    pub(super) fn kept(workers: usize) -> Self {
        Self::with(Outlet::Kept(Mutex::new(Vec::new())), 1, workers)
    }

    /// The answers sent since the last call: the worker, and the message.
    pub(super) fn sent(&self) -> Vec<(usize, Message)> {
        let Outlet::Kept(kept) = &self.out else { return Vec::new() };
        std::mem::take(&mut *lock(kept))
            .into_iter()
            .map(|(w, b)| (w, Message::decode(b, w).expect("an answer we encoded decodes")))
            .collect()
    }
}

/// What a server does with requests.
pub trait Handler<T: Element>: Send {
    /// Handles one request; answers it through `responder` now or later (every request must
    /// be answered once, or its worker fails it at the deadline). The server checks requests
    /// before they get here (sorted unique keys, lengths that add up to the values, no values
    /// in a pull) and refuses those that fail.
    fn handle(&mut self, request: Request<'_, T>, responder: &Responder<T>) -> Result<()>;

    /// Where a large push's values are summed as they arrive, instead of being handed to
    /// [`handle`](Self::handle) whole: for each key of the push, in its order, the slice its
    /// values are added into (element by element, exactly the key's length), or `None` (this
    /// default) to take the push through `handle`. A handler that gives slices gets the request,
    /// without its values, in [`folded`](Self::folded) once they are all in.
    ///
    /// The server asks for pushes of at least 256 KiB to it, without replication, over a
    /// transport that hands bytes over where they arrive (shared memory, in-process): the
    /// values are summed straight from the transport's memory, in one pass (with shared
    /// memory's single copy switched on, a message read from the sender's memory passes
    /// through a buffer of its size first). A push whose worker dies while its values arrive
    /// stays summed in as far as it came (the worker then counts as gone,
    /// [`worker_left`](Self::worker_left)).
    fn fold_push(&mut self, meta: &RequestMeta, keys: &[u64], lens: &[usize]) -> Option<Vec<&mut [T]>> {
        let _ = (meta, keys, lens);
        None
    }

    /// A push whose values [`fold_push`](Self::fold_push) took is summed in: answer it as
    /// [`handle`](Self::handle) would have (`request.values` is empty, `request.lens` holds the
    /// keys' lengths). This default refuses it (a handler that folds nothing is never asked).
    fn folded(&mut self, request: Request<'_, T>, responder: &Responder<T>) -> Result<()> {
        responder.refuse(&request.meta, "this server's handler folds no pushes")
    }

    /// Worker `worker` is gone (it said goodbye, its connection closed, or an answer to it
    /// could not be sent): a handler that waits for every worker (synchronous SGD) stops
    /// waiting for it.
    fn worker_left(&mut self, worker: usize, responder: &Responder<T>) -> Result<()> {
        let _ = (worker, responder);
        Ok(())
    }

    /// Worker `worker`, which had left, rejoined ([`Node::rejoin`]).
    ///
    /// [`Node::rejoin`]: super::Node::rejoin
    fn worker_joined(&mut self, worker: usize, responder: &Responder<T>) -> Result<()> {
        let _ = (worker, responder);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(worker: usize, pull: bool) -> RequestMeta {
        RequestMeta { worker, cmd: -3, timestamp: 9, push: !pull, pull, shard: 0 }
    }

    #[test]
    fn answers_carry_the_requests_identity_and_the_values_of_each_key() -> Result<()> {
        let r = Responder::<f32>::kept(2);
        r.respond_parts(&meta(1, true), &[4, 6], &[&[1.0, 2.0], &[3.0]])?;
        r.respond(&meta(0, false), &[], &[], &[])?;
        r.refuse(&meta(0, true), "no such luck")?;
        let sent = r.sent();
        let [(w1, a), (w0, b), (w0b, c)] = &sent[..] else { panic!("three answers: {sent:?}") };
        assert_eq!((*w1, *w0, *w0b), (1, 0, 0));
        assert_eq!((a.kind, a.cmd, a.ts, &a.keys, &a.lens), (Kind::Reply, -3, 9, &vec![4, 6], &vec![2, 1]));
        assert_eq!(bytemuck::pod_collect_to_vec::<u8, f32>(a.payload()), [1.0, 2.0, 3.0]);
        assert_eq!((b.kind, b.keys.len(), b.payload().len()), (Kind::Reply, 0, 0));
        assert_eq!((c.kind, c.payload()), (Kind::Error, &b"no such luck"[..]));
        Ok(())
    }

    #[test]
    fn an_answer_to_a_worker_that_does_not_exist_is_an_error() {
        let r = Responder::<f32>::kept(2);
        let e = r.respond(&meta(2, false), &[], &[], &[]).map_err(|e| e.to_string());
        assert_eq!(e, Err("invalid argument: an answer to worker 2 of 2: no such worker".into()));
        assert!(r.sent().is_empty() && r.take_unreachable().is_empty());
    }
}
