//! Ready-made server handlers: a summing store, synchronous SGD and asynchronous SGD.

use super::request::check_request;
use super::{Handler, Request, RequestMeta, Responder};
use crate::error::Result;
use crate::types::{Element, Reduction};
use rustc_hash::FxBuildHasher;
use std::collections::{BTreeSet, HashMap};

/// Splits a request's values by key (a request [`check_request`] passed: its lengths add up
/// to its values; a key past the values would get none).
fn per_key<'a, T: Clone>(r: &'a Request<'_, T>) -> impl Iterator<Item = (u64, &'a [T])> + 'a {
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
fn refused<T: Element>(r: &Request<'_, T>, responder: &Responder<T>) -> Result<bool> {
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
///
/// The values of every key live in one arena, found through one hash lookup per key and
/// request (a fast hash: keys are the workers' own, not an attacker's), so a request over many
/// small keys costs a lookup each, not three lookups and an allocation.
#[derive(Debug, Clone)]
pub struct SumStore<T> {
    /// Where each key's values are in `values`: offset and length.
    index: HashMap<u64, (usize, usize), FxBuildHasher>,
    values: Vec<T>,
}

impl<T> Default for SumStore<T> {
    fn default() -> Self {
        SumStore { index: HashMap::default(), values: Vec::new() }
    }
}

impl<T> SumStore<T> {
    /// The values stored for `key`, if it was ever pushed.
    pub fn get(&self, key: u64) -> Option<&[T]> {
        self.index.get(&key).and_then(|&(at, len)| self.values.get(at..at + len))
    }

    /// The keys stored, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.index.keys().copied()
    }

    /// The number of keys stored.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
}

impl<T: Element> Handler<T> for SumStore<T> {
    fn handle(&mut self, r: Request<'_, T>, responder: &Responder<T>) -> Result<()> {
        if refused(&r, responder)? {
            return Ok(());
        }
        // One lookup per key: where its values are, if anywhere.
        let mut slots: Vec<Option<(usize, usize)>> = r.keys.iter().map(|k| self.index.get(k).copied()).collect();
        if r.meta.push {
            let misfit = per_key(&r)
                .zip(&slots)
                .find_map(|((k, v), slot)| slot.filter(|&(_, len)| len != v.len()).map(|(_, len)| (k, len, v.len())));
            if let Some((k, have, want)) = misfit {
                return responder.refuse(&r.meta, &format!("key {k} holds {have} values, the push has {want}"));
            }
            for ((k, v), slot) in per_key(&r).zip(&mut slots) {
                let (at, len) = *slot.get_or_insert_with(|| {
                    let at = self.values.len();
                    self.values.resize(at + v.len(), T::zeroed());
                    self.index.insert(k, (at, v.len()));
                    (at, v.len())
                });
                T::fold(Reduction::Sum, &mut self.values[at..at + len], v);
            }
        }
        if r.meta.pull {
            let parts: Vec<&[T]> =
                slots.iter().map(|s| s.and_then(|(at, len)| self.values.get(at..at + len)).unwrap_or(&[])).collect();
            responder.respond_parts(&r.meta, &r.keys, &parts)
        } else {
            responder.respond(&r.meta, &[], &[], &[])
        }
    }

    /// Keys it holds, each pushed with its length, are summed into where they are; a new key
    /// or a push of another length goes through `handle` (which makes or refuses it).
    fn fold_push(&mut self, _meta: &RequestMeta, keys: &[u64], lens: &[usize]) -> Option<Vec<&mut [T]>> {
        // Where each key's values are, by place in the arena: split off one after the other.
        let mut spans: Vec<(usize, usize, usize)> = Vec::with_capacity(keys.len());
        for (i, (k, &l)) in keys.iter().zip(lens).enumerate() {
            let &(at, len) = self.index.get(k)?;
            if len != l {
                return None;
            }
            spans.push((at, len, i));
        }
        // By place, an empty key (which may share its place with the next) first.
        spans.sort_unstable_by_key(|s| (s.0, s.1));
        let mut out: Vec<Option<&mut [T]>> = (0..keys.len()).map(|_| None).collect();
        let (mut rest, mut base) = (&mut self.values[..], 0usize);
        for (at, len, i) in spans {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut_checked(at.checked_sub(base)?)?;
            let (mine, tail) = tail.split_at_mut_checked(len)?;
            out[i] = Some(mine);
            (rest, base) = (tail, at + len);
        }
        out.into_iter().collect()
    }

    fn folded(&mut self, r: Request<'_, T>, responder: &Responder<T>) -> Result<()> {
        if r.meta.pull {
            let parts: Vec<&[T]> = r.keys.iter().map(|&k| self.get(k).unwrap_or(&[])).collect();
            responder.respond_parts(&r.meta, &r.keys, &parts)
        } else {
            responder.respond(&r.meta, &[], &[], &[])
        }
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
    round: Vec<Request<'static, f32>>,
    later: Vec<Request<'static, f32>>,
}

impl SyncSgd {
    /// Rounds over `workers` workers, learning rate `lr`.
    pub fn new(workers: usize, lr: f32) -> Self {
        SyncSgd { lr, weights: HashMap::new(), live: (0..workers).collect(), round: Vec::new(), later: Vec::new() }
    }

    /// Why push `r` does not fit: a key whose weights, or whose push waiting in a round (a key
    /// new in this round), have another length. Pushes of different lengths to a new key
    /// would be summed in part.
    fn misfit(&self, r: &Request<'_, f32>) -> Option<String> {
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
    fn handle(&mut self, r: Request<'_, f32>, responder: &Responder<f32>) -> Result<()> {
        if refused(&r, responder)? {
            return Ok(());
        }
        if r.meta.push
            && let Some(why) = self.misfit(&r)
        {
            return responder.refuse(&r.meta, &why);
        }
        // Kept until the round completes: its values are copied out of the message.
        let r = r.into_owned();
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
    fn handle(&mut self, r: Request<'_, f32>, responder: &Responder<f32>) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ps::wire::Kind;
    use proptest::prelude::*;

    proptest! {
        /// The sum store against a plain map of sums: pushes over random key sets (a key's
        /// length fixed by its first push), each followed by a misfit push (a new key and a
        /// known key of another length) that must change nothing.
        #[test]
        fn the_sum_store_matches_a_map_of_sums(pushes in proptest::collection::vec(
            proptest::collection::btree_set(0u64..40, 1..12), 1..20)
        ) {
            let len = |k: u64| (k % 4 + 1) as usize;
            let (mut h, r) = (SumStore::<i64>::default(), Responder::kept(1));
            let mut want: HashMap<u64, Vec<i64>> = HashMap::new();
            for (ts, keys) in pushes.iter().enumerate() {
                let keys: Vec<u64> = keys.iter().copied().collect();
                let lens: Vec<usize> = keys.iter().map(|&k| len(k)).collect();
                let values: Vec<i64> = (0..lens.iter().sum::<usize>()).map(|i| (i as i64 + 1) * (ts as i64 + 3)).collect();
                let mut at = 0;
                for (&k, &l) in keys.iter().zip(&lens) {
                    let w = want.entry(k).or_insert_with(|| vec![0; l]);
                    w.iter_mut().zip(&values[at..at + l]).for_each(|(a, b)| *a += b);
                    at += l;
                }
                let mut req = request(0, ts as u64, true, true, &keys, values);
                req.lens = lens;
                h.handle(req, &r)?;
                let known = keys[0];
                let misfit = Request { lens: vec![len(known) + 1, 1], ..request(0, 999, true, false, &[known, 1000], vec![1; len(known) + 2]) };
                let misfit = Request { keys: vec![known, 1000], ..misfit };
                h.handle(misfit, &r)?;
            }
            prop_assert_eq!(h.len(), want.len());
            prop_assert!(h.get(1000).is_none(), "a refused push added a key");
            for (k, w) in &want {
                prop_assert_eq!(h.get(*k), Some(&w[..]), "key {}", k);
            }
            let mut keys: Vec<u64> = h.keys().collect();
            keys.sort_unstable();
            let mut known: Vec<u64> = want.keys().copied().collect();
            known.sort_unstable();
            prop_assert_eq!(keys, known);
        }
    }

    fn request<T: Clone>(
        worker: usize,
        ts: u64,
        push: bool,
        pull: bool,
        keys: &[u64],
        values: Vec<T>,
    ) -> Request<'static, T> {
        let lens = if push && !keys.is_empty() { vec![values.len() / keys.len(); keys.len()] } else { Vec::new() };
        Request {
            meta: RequestMeta { worker, cmd: 0, timestamp: ts, push, pull, shard: 0 },
            keys: keys.to_vec(),
            values: values.into(),
            lens,
        }
    }

    /// The answers sent: worker, timestamp, and the values (or the refusal's text).
    fn answers(r: &Responder<f32>) -> Vec<(usize, u64, std::result::Result<Vec<f32>, String>)> {
        r.sent()
            .into_iter()
            .map(|(w, m)| {
                let out = match m.kind {
                    Kind::Error => Err(String::from_utf8_lossy(m.payload()).into_owned()),
                    _ => Ok(bytemuck::pod_collect_to_vec(m.payload())),
                };
                (w, m.ts, out)
            })
            .collect()
    }

    #[test]
    fn the_sum_store_adds_pushes_and_refuses_another_length_whole() -> Result<()> {
        let (mut h, r) = (SumStore::<f32>::default(), Responder::kept(2));
        h.handle(request(0, 1, true, false, &[1, 2], vec![1.0, 2.0, 3.0, 4.0]), &r)?;
        h.handle(request(1, 1, true, true, &[1], vec![10.0, 20.0]), &r)?;
        let misfit = Request { lens: vec![1, 2], ..request(0, 2, true, false, &[1, 2], vec![5.0, 5.0, 5.0]) };
        h.handle(misfit, &r)?;
        h.handle(request(1, 2, false, true, &[2, 3], vec![]), &r)?;
        let refusal = "key 1 holds 2 values, the push has 1".to_string();
        assert_eq!(
            answers(&r),
            [
                (0, 1, Ok(vec![])),
                (1, 1, Ok(vec![11.0, 22.0])),
                (0, 2, Err(refusal)),
                (1, 2, Ok(vec![3.0, 4.0])), // key 2 unchanged by the refused push; key 3 has none
            ]
        );
        Ok(())
    }

    #[test]
    fn a_malformed_request_handed_to_a_handler_is_refused() -> Result<()> {
        let r = Responder::kept(1);
        let bad = request(0, 3, true, false, &[2, 1], vec![1.0, 2.0]);
        SyncSgd::new(1, 0.1).handle(bad.clone(), &r)?;
        AsyncSgd::new(0.1).handle(bad, &r)?;
        let got = answers(&r);
        assert_eq!(got.len(), 2);
        for (_, ts, out) in got {
            assert!(ts == 3 && out.as_ref().is_err_and(|e| e.contains("keys must be sorted and unique")), "{out:?}");
        }
        Ok(())
    }

    #[test]
    fn a_sync_round_waits_for_every_live_worker_and_a_worker_leaving_completes_it() -> Result<()> {
        let (mut h, r) = (SyncSgd::new(3, 0.5), Responder::kept(3));
        h.handle(request(0, 1, true, true, &[7], vec![2.0]), &r)?;
        h.handle(request(0, 2, true, true, &[7], vec![8.0]), &r)?; // early: the next round
        h.handle(request(1, 1, true, true, &[7], vec![4.0]), &r)?;
        assert!(answers(&r).is_empty(), "a round answered before worker 2 pushed");
        h.worker_left(2, &r)?;
        // Round 1 over workers 0 and 1: 0 - 0.5 * (2 + 4) / 2.
        assert_eq!(answers(&r), [(0, 1, Ok(vec![-1.5])), (1, 1, Ok(vec![-1.5]))]);
        h.handle(request(1, 2, true, true, &[7], vec![0.0]), &r)?;
        // Round 2 took worker 0's early push: -1.5 - 0.5 * (8 + 0) / 2.
        assert_eq!(answers(&r), [(0, 2, Ok(vec![-3.5])), (1, 2, Ok(vec![-3.5]))]);
        h.worker_joined(2, &r)?;
        h.handle(request(0, 3, false, true, &[7], vec![]), &r)?;
        h.handle(request(1, 3, false, true, &[7], vec![]), &r)?;
        assert!(answers(&r).is_empty(), "a rejoined worker is waited for again");
        Ok(())
    }

    #[test]
    fn pushes_of_other_lengths_to_a_new_key_in_one_round_are_refused() -> Result<()> {
        let (mut h, r) = (SyncSgd::new(2, 1.0), Responder::kept(2));
        h.handle(request(0, 1, true, true, &[4], vec![1.0, 1.0]), &r)?;
        h.handle(request(1, 1, true, true, &[4], vec![1.0, 1.0, 1.0]), &r)?;
        assert_eq!(
            answers(&r),
            [(1, 1, Err("key 4 has 2 values in worker 0's push waiting in this round, this push has 3".to_string()))]
        );
        h.handle(request(1, 2, true, true, &[4], vec![3.0, 5.0]), &r)?;
        assert_eq!(answers(&r), [(0, 1, Ok(vec![-2.0, -3.0])), (1, 2, Ok(vec![-2.0, -3.0]))]);
        Ok(())
    }

    #[test]
    fn async_sgd_applies_each_push_at_once_and_refuses_a_misfit_whole() -> Result<()> {
        let (mut h, r) = (AsyncSgd::new(0.5), Responder::kept(2));
        h.handle(request(0, 1, true, false, &[1], vec![2.0, 4.0]), &r)?;
        h.handle(request(1, 1, true, true, &[1], vec![2.0, 0.0]), &r)?;
        h.handle(request(0, 2, true, true, &[1, 2], vec![1.0, 1.0]), &r)?; // key 1 holds 2
        h.handle(request(1, 2, false, true, &[1, 2], vec![]), &r)?;
        assert_eq!(
            answers(&r),
            [
                (0, 1, Ok(vec![])),
                (1, 1, Ok(vec![-2.0, -2.0])),
                (0, 2, Err("key 1 holds 2 weights, the push has 1".to_string())),
                (1, 2, Ok(vec![-2.0, -2.0])), // key 2 was not made by the refused push
            ]
        );
        Ok(())
    }

    proptest! {
        /// Synchronous SGD over workers whose requests arrive in any order (a worker's next
        /// push may come before the others finished the round) gives every worker, each round,
        /// the weights a plain round-by-round computation gives.
        #[test]
        fn sync_rounds_match_a_sequential_reference(
            // Powers of two: the reference's division is exact, as the handler's scaling is.
            workers in proptest::sample::select(vec![1usize, 2, 4]),
            rounds in 1usize..4,
            grads in proptest::collection::vec(-8i8..8, 32),
            order in proptest::collection::vec(any::<u16>(), 16),
        ) {
            let g = |w: usize, round: usize, k: usize| f32::from(grads[(w * 4 + round) * 2 + k]);
            // Arrival order: each worker's requests in its own order, the workers interleaved.
            let mut arrivals: Vec<usize> = (0..workers).flat_map(|w| std::iter::repeat_n(w, rounds)).collect();
            for (i, o) in order.iter().enumerate().take(arrivals.len()) {
                let j = usize::from(*o) % arrivals.len();
                arrivals.swap(i, j);
            }
            let (mut h, r) = (SyncSgd::new(workers, 0.5), Responder::kept(workers));
            let mut sent = vec![0usize; workers];
            for w in arrivals {
                let round = sent[w];
                sent[w] += 1;
                let values = vec![g(w, round, 0), g(w, round, 1)];
                h.handle(request(w, round as u64, true, true, &[3, 9], values), &r).expect("handled");
            }
            // The reference: round by round, weights -= lr * sum / workers.
            let mut weights = [0f32; 2];
            let mut want = Vec::new();
            for round in 0..rounds {
                for (k, wk) in weights.iter_mut().enumerate() {
                    let sum: f32 = (0..workers).map(|w| g(w, round, k)).sum();
                    *wk -= 0.5 * sum / workers as f32;
                }
                want.push(weights.to_vec());
            }
            let mut got = answers(&r);
            prop_assert_eq!(got.len(), workers * rounds, "every request answered once");
            got.sort_by_key(|(w, ts, _)| (*w, *ts));
            for (w, ts, out) in got {
                prop_assert_eq!(out, Ok(want[ts as usize].clone()), "worker {} round {}", w, ts);
            }
        }
    }
}
