//! Ready-made server handlers: a summing store, synchronous SGD and asynchronous SGD.

use super::request::check_request;
use super::{Handler, Request, RequestMeta, Responder};
use crate::error::Result;
use crate::types::{Element, Reduction};
use std::collections::{BTreeSet, HashMap};

/// Splits a request's values by key (a request [`check_request`] passed: its lengths add up
/// to its values; a key past the values would get none).
fn per_key<'a, T>(r: &'a Request<T>) -> impl Iterator<Item = (u64, &'a [T])> + 'a {
    let mut at = 0usize;
    r.keys.iter().zip(&r.lens).map(move |(&k, &l)| {
        let end = at.saturating_add(l);
        let v = r.values.get(at..end).unwrap_or(&[]);
        at = end;
        (k, v)
    })
}

/// Refuses `r` if it is malformed (for requests handed to a handler by other code than the
/// server, which checks them itself); `true` when it did.
fn refused<T: Element>(r: &Request<T>, responder: &Responder<T>) -> Result<bool> {
    match check_request(r) {
        Ok(()) => Ok(false),
        Err(e) => responder.refuse(&r.meta, &e.to_string()).map(|()| true),
    }
}

/// Answers a request: nothing for a push, the keys' values for a pull or push-pull.
fn answer<T: Element>(
    store: &HashMap<u64, Vec<T>>,
    meta: &RequestMeta,
    keys: &[u64],
    responder: &Responder<T>,
) -> Result<()> {
    if meta.pull {
        let parts: Vec<&[T]> = keys.iter().map(|k| store.get(k).map(Vec::as_slice).unwrap_or(&[])).collect();
        responder.respond_parts(meta, keys, &parts)
    } else {
        responder.respond(meta, &[], &[], &[])
    }
}

/// The default handler: a push adds its values into the key's stored values (a key's first
/// push sets its length; a push of another length is refused), a pull reads them (a key
/// never pushed has no values).
#[derive(Debug, Clone)]
pub struct SumStore<T> {
    /// The stored values.
    pub store: HashMap<u64, Vec<T>>,
}

impl<T> Default for SumStore<T> {
    fn default() -> Self {
        SumStore { store: HashMap::new() }
    }
}

impl<T: Element> Handler<T> for SumStore<T> {
    fn handle(&mut self, r: Request<T>, responder: &Responder<T>) -> Result<()> {
        if refused(&r, responder)? {
            return Ok(());
        }
        if r.meta.push {
            if let Some((k, have, want)) = per_key(&r)
                .find_map(|(k, v)| self.store.get(&k).filter(|s| s.len() != v.len()).map(|s| (k, s.len(), v.len())))
            {
                return responder.refuse(&r.meta, &format!("key {k} holds {have} values, the push has {want}"));
            }
            for (k, v) in per_key(&r) {
                let s = self.store.entry(k).or_insert_with(|| vec![T::zeroed(); v.len()]);
                T::fold(Reduction::Sum, s, v);
            }
        }
        answer(&self.store, &r.meta, &r.keys, responder)
    }
}

/// Synchronous SGD: the server collects one request from every live worker (a round), then
/// applies `weights -= lr · (sum of the round's gradients) / workers` for every key pushed,
/// and answers every request of the round (a push-pull gets the new weights). A worker's
/// second request before its round completes waits for the next round. Weights start at
/// zero, with the length of a key's first push; a push of another length (also one in the
/// same round as that first push) is refused whole.
#[derive(Debug, Clone)]
pub struct SyncSgd {
    /// Learning rate.
    pub lr: f32,
    /// The weights.
    pub weights: HashMap<u64, Vec<f32>>,
    live: BTreeSet<usize>,
    round: Vec<Request<f32>>,
    later: Vec<Request<f32>>,
}

impl SyncSgd {
    /// Rounds over `workers` workers, learning rate `lr`.
    pub fn new(workers: usize, lr: f32) -> Self {
        SyncSgd { lr, weights: HashMap::new(), live: (0..workers).collect(), round: Vec::new(), later: Vec::new() }
    }

    /// Why push `r` does not fit: a key whose weights, or whose push waiting in a round (a key
    /// new in this round), have another length. Pushes of different lengths to a new key
    /// would be summed in part.
    fn misfit(&self, r: &Request<f32>) -> Option<String> {
        // The keys of `r` that hold no weights yet, and their lengths in `r`.
        let mut new: HashMap<u64, usize> = HashMap::new();
        for (k, v) in per_key(r) {
            match self.weights.get(&k) {
                Some(w) if w.len() != v.len() => {
                    return Some(format!("key {k} holds {} weights, the push has {}", w.len(), v.len()));
                }
                Some(_) => {}
                None => {
                    new.insert(k, v.len());
                }
            }
        }
        if new.is_empty() {
            return None;
        }
        // One pass over the waiting pushes (a lookup per key, not a search).
        for q in self.round.iter().chain(&self.later).filter(|q| q.meta.push) {
            for (k, v) in per_key(q) {
                if let Some(&n) = new.get(&k)
                    && n != v.len()
                {
                    return Some(format!(
                        "key {k} has {} values in worker {}'s push waiting in this round, this push has {n}",
                        v.len(),
                        q.meta.worker
                    ));
                }
            }
        }
        None
    }

    fn complete_rounds(&mut self, responder: &Responder<f32>) -> Result<()> {
        loop {
            let arrived: BTreeSet<usize> = self.round.iter().map(|r| r.meta.worker).collect();
            if self.round.is_empty() || !self.live.iter().all(|w| arrived.contains(w)) {
                return Ok(());
            }
            let mut sums: HashMap<u64, Vec<f32>> = HashMap::new();
            for r in self.round.iter().filter(|r| r.meta.push) {
                for (k, g) in per_key(r) {
                    let s = sums.entry(k).or_insert_with(|| vec![0.0; g.len()]);
                    if s.len() == g.len() {
                        f32::fold(Reduction::Sum, s, g);
                    }
                }
            }
            let scale = self.lr / self.live.len().max(1) as f32;
            for (k, g) in sums {
                let w = self.weights.entry(k).or_insert_with(|| vec![0.0; g.len()]);
                if w.len() == g.len() {
                    w.iter_mut().zip(&g).for_each(|(w, g)| *w -= scale * g);
                }
            }
            // Every request of the round is answered, whatever happens to one answer.
            let mut first = Ok(());
            for r in std::mem::take(&mut self.round) {
                let sent = answer(&self.weights, &r.meta, &r.keys, responder);
                if first.is_ok() {
                    first = sent;
                }
            }
            first?;
            // Requests that came early go into the next round, one per worker.
            let mut next = Vec::new();
            for r in std::mem::take(&mut self.later) {
                if self.round.iter().any(|q| q.meta.worker == r.meta.worker) {
                    next.push(r);
                } else {
                    self.round.push(r);
                }
            }
            self.later = next;
        }
    }
}

impl Handler<f32> for SyncSgd {
    fn handle(&mut self, r: Request<f32>, responder: &Responder<f32>) -> Result<()> {
        if refused(&r, responder)? {
            return Ok(());
        }
        if r.meta.push
            && let Some(why) = self.misfit(&r)
        {
            return responder.refuse(&r.meta, &why);
        }
        if self.round.iter().any(|q| q.meta.worker == r.meta.worker) {
            self.later.push(r);
        } else {
            self.round.push(r);
        }
        self.complete_rounds(responder)
    }

    fn worker_left(&mut self, worker: usize, responder: &Responder<f32>) -> Result<()> {
        self.live.remove(&worker);
        // Its requests waiting in a round go with it.
        self.round.retain(|r| r.meta.worker != worker);
        self.later.retain(|r| r.meta.worker != worker);
        self.complete_rounds(responder)
    }

    fn worker_joined(&mut self, worker: usize, _responder: &Responder<f32>) -> Result<()> {
        self.live.insert(worker);
        Ok(())
    }
}

/// Asynchronous SGD: every push is applied at once (`weights -= lr · gradient`), and a
/// push-pull gets the weights right after its own update.
#[derive(Debug, Clone)]
pub struct AsyncSgd {
    /// Learning rate.
    pub lr: f32,
    /// The weights.
    pub weights: HashMap<u64, Vec<f32>>,
}

impl AsyncSgd {
    /// Learning rate `lr`.
    pub fn new(lr: f32) -> Self {
        AsyncSgd { lr, weights: HashMap::new() }
    }
}

impl Handler<f32> for AsyncSgd {
    fn handle(&mut self, r: Request<f32>, responder: &Responder<f32>) -> Result<()> {
        if refused(&r, responder)? {
            return Ok(());
        }
        if r.meta.push {
            // All or nothing: a push with one misfit key changes no key.
            if let Some((k, have, want)) = per_key(&r)
                .find_map(|(k, g)| self.weights.get(&k).filter(|w| w.len() != g.len()).map(|w| (k, w.len(), g.len())))
            {
                return responder.refuse(&r.meta, &format!("key {k} holds {have} weights, the push has {want}"));
            }
            for (k, g) in per_key(&r) {
                let w = self.weights.entry(k).or_insert_with(|| vec![0.0; g.len()]);
                w.iter_mut().zip(g).for_each(|(w, g)| *w -= self.lr * g);
            }
        }
        answer(&self.weights, &r.meta, &r.keys, responder)
    }
}
