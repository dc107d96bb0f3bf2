//! A worker's requests in flight, as plain state: the timestamps it hands out, what each
//! request waits for ([`Pending`]), how answers come together into a [`Reply`], where an
//! answer goes (a server's own, a backup's, or a protocol error), what becomes of the requests
//! when a server is gone (a backup takes its parts over, or they fail naming it), and the error
//! of a request past its deadline. The worker (`worker.rs`) holds these under its locks and
//! does the sending and receiving.

use super::Timestamp;
use super::config::backup_of;
use super::wire::{Kind, Message};
use crate::error::{Error, Result};
use crate::types::Element;
use rustc_hash::FxHashMap as HashMap;
use std::borrow::Cow;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

/// A timestamp from a worker's request counter: the lowest bit says whether the request is a
/// push (which gives nothing back, so that its entry can go once acknowledged).
pub(super) fn timestamp_of(counter: u64, push: bool) -> Timestamp {
    counter << 1 | u64::from(push)
}

/// Whether `ts` is a push's timestamp.
pub(super) fn is_push(ts: Timestamp) -> bool {
    ts & 1 == 1
}

/// Whether `ts` is the timestamp of a push sent before the counter reached `next`.
pub(super) fn issued_push(ts: Timestamp, next: u64) -> bool {
    let counter = ts >> 1;
    is_push(ts) && counter >= 1 && counter < next
}

/// What a finished request gives back: for a pull or push-pull, the values of the keys asked
/// for (concatenated in key order) and each key's length; empty for a push (no keys either).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply<T> {
    /// The keys.
    pub keys: Vec<u64>,
    /// Their values, concatenated.
    pub values: Vec<T>,
    /// Each key's number of values.
    pub lens: Vec<usize>,
}

impl<T> Default for Reply<T> {
    fn default() -> Self {
        Reply { keys: Vec::new(), values: Vec::new(), lens: Vec::new() }
    }
}

/// A finished request's answers, not read out yet: whoever takes the outcome reads them once,
/// into a fresh [`Reply`] ([`KvWorker::wait`](super::KvWorker::wait)) or into the caller's
/// buffer ([`KvWorker::wait_into`](super::KvWorker::wait_into)), on its own thread rather
/// than the worker's receiving thread.
#[derive(Debug)]
pub(super) struct Answers<T> {
    keys: Vec<u64>,
    /// Each key's number of values.
    lens: Vec<usize>,
    /// Where each key's values are: which message, at which value.
    from: Vec<(usize, usize)>,
    messages: Vec<Message>,
    /// Where values were received straight into the waiting caller's buffer (its address),
    /// not into the messages: those of the messages marked in `in_place`.
    placed: Option<usize>,
    /// Per message: its values went into the caller's buffer (its payload is empty).
    in_place: Vec<bool>,
    _values: PhantomData<fn() -> T>,
}

impl<T: Element> Answers<T> {
    /// A push's (or a request with no keys): no keys, no values.
    pub(super) fn none() -> Self {
        Answers {
            keys: Vec::new(),
            lens: Vec::new(),
            from: Vec::new(),
            messages: Vec::new(),
            placed: None,
            in_place: Vec::new(),
            _values: PhantomData,
        }
    }

    /// The values of every key, in key order.
    fn runs(&self) -> impl Iterator<Item = Cow<'_, [T]>> {
        (0..self.lens.len()).map(|i| self.run(i))
    }

    /// Key `i`'s values as its answer holds them (none for an answer received into the
    /// caller's buffer: read there).
    fn run(&self, i: usize) -> Cow<'_, [T]> {
        let (Some(&l), Some(&(a, at))) = (self.lens.get(i), self.from.get(i)) else { return Cow::Borrowed(&[]) };
        let payload = self.messages.get(a).map_or(&[][..], |m| m.payload());
        let bytes = size_of::<T>();
        crate::types::view_or_copy(payload.get(at * bytes..(at + l) * bytes).unwrap_or(&[]))
    }

    /// Whether key `i`'s values were received into the caller's buffer.
    fn is_in_place(&self, i: usize) -> bool {
        self.from.get(i).and_then(|&(a, _)| self.in_place.get(a)).copied().unwrap_or(false)
    }

    /// An error when the values went straight into a caller's buffer (at `placed`) other than
    /// `out` (`None`: a call that has none): another thread waits for this request.
    pub(super) fn check_placed(&self, out: Option<*const T>, what: &str) -> Result<()> {
        match self.placed {
            Some(at) if out.map(|p| p as usize) != Some(at) => {
                Err(Error::invalid(format!("{what}: its values went into the buffer of another thread waiting for it")))
            }
            _ => Ok(()),
        }
    }

    /// The reply, its values read once from the answers into one allocation.
    pub(super) fn into_reply(self) -> Reply<T> {
        let values = self.values();
        Reply { values, keys: self.keys, lens: self.lens }
    }

    /// [`into_reply`](Self::into_reply), the answers kept (to give their buffers back).
    pub(super) fn reply(&self) -> Reply<T> {
        Reply { values: self.values(), keys: self.keys.clone(), lens: self.lens.clone() }
    }

    /// Every key's values, in key order, in one allocation.
    fn values(&self) -> Vec<T> {
        let mut values = Vec::with_capacity(self.lens.iter().sum());
        for run in self.runs() {
            values.extend_from_slice(&run);
        }
        values
    }

    /// The answers' buffers, each with the server whose shard it answered.
    pub(super) fn into_buffers(self) -> impl Iterator<Item = (usize, Vec<u8>)> {
        self.messages.into_iter().map(|m| (m.shard as usize, m.values))
    }

    /// Reads the values into `out`, which must hold exactly all of them; returns each key's
    /// number of values. `what` names the call in the error.
    pub(super) fn read_into(&self, out: &mut [T], what: &str) -> Result<Vec<usize>> {
        let total: usize = self.lens.iter().sum();
        if out.len() != total {
            return Err(Error::invalid(format!(
                "{what}: the {} keys have {total} values, the buffer has room for {}",
                self.keys.len(),
                out.len()
            )));
        }
        self.check_placed(Some(out.as_ptr()), what)?;
        // Keys whose values are in place already are stepped over.
        let mut at = 0;
        for (i, &len) in self.lens.iter().enumerate() {
            if !self.is_in_place(i) {
                out[at..at + len].copy_from_slice(&self.run(i));
            }
            at += len;
        }
        Ok(self.lens.clone())
    }
}

/// A request's callback ([`KvWorker::then`](super::KvWorker::then)).
pub(super) type Callback<T> = Box<dyn FnOnce(Result<Reply<T>>) + Send>;

/// A request in flight.
pub(super) struct Pending<T> {
    pub(super) keys: Vec<u64>,
    /// Per server: the positions (in `keys`) of the keys sent to it; `None` once answered.
    pub(super) parts: HashMap<usize, Vec<usize>>,
    /// The answers so far: the key positions each covers, the message, and whether its values
    /// were received into the waiting caller's buffer.
    answers: Vec<(Vec<usize>, Message, bool)>,
    /// Where answers' values were received into the waiting caller's buffer.
    placed: Option<usize>,
    /// Each key's number of values where the request says them (a push-pull's), so that an
    /// answer's place in the caller's buffer is known before the other answers come.
    pub(super) lens: Option<Vec<usize>>,
    pub(super) wants_values: bool,
    pub(super) deadline: Instant,
    pub(super) what: &'static str,
    pub(super) outcome: Option<Result<Answers<T>>>,
    pub(super) callback: Option<Callback<T>>,
    /// A backup's answers for a shard whose primary is still alive (used if it dies).
    pub(super) stash: HashMap<usize, Message>,
    /// Pull parts, to ask the backup if the primary dies (replication only).
    pub(super) pulls: HashMap<usize, Vec<u8>>,
}

/// What becomes of one part of a request when a server is gone.
#[derive(Debug)]
pub(super) enum Takeover {
    /// The backup's answer for this shard came already: take it.
    Stashed(usize, Message),
    /// Ask the backup (first) for this pull part (the bytes sent to the primary).
    Ask(usize, Vec<u8>),
    /// Nobody is left to answer: the request fails.
    Fail(Error),
}

/// Where a message that came to a worker from `server` goes.
#[derive(Debug)]
pub(super) enum Route {
    /// A heartbeat: nothing to do (hearing from the server is all).
    Skip,
    /// The server's answer for its own keys.
    Own,
    /// A backup's answer for its primary's keys: it counts once the primary is gone.
    Backup,
    /// Not something a server sends a worker: the server is counted gone for it.
    Bad(Error),
}

/// Where message `m` from `server` goes, with `servers` servers and replication on or off.
pub(super) fn route(server: usize, m: &Message, replication: bool, servers: usize) -> Route {
    match m.kind {
        Kind::Heartbeat => return Route::Skip,
        Kind::Reply | Kind::Error => {}
        other => {
            let detail = format!("a {other:?} message to a worker");
            return Route::Bad(Error::Protocol { peer: Some(server), detail });
        }
    }
    let shard = m.shard as usize;
    if shard == server {
        Route::Own
    } else if !replication || shard >= servers || backup_of(shard, servers) != server {
        Route::Bad(Error::Protocol { peer: Some(server), detail: format!("an answer for server {shard}'s keys") })
    } else {
        Route::Backup
    }
}

/// The failure of a request that needs `server`, gone (`cause`) with `keys` outstanding.
pub(super) fn server_gone(what: &str, server: usize, keys: &[u64], cause: &Error) -> Error {
    let shown: Vec<u64> = keys.iter().copied().take(8).collect();
    let more = if keys.len() > 8 { format!(" and {} more", keys.len() - 8) } else { String::new() };
    Error::PeerClosed {
        rank: server,
        op: format!("parameter-server {what}"),
        detail: format!("server {server} is gone with keys {shown:?}{more} of this request outstanding ({cause})"),
    }
}

impl<T: Element> Pending<T> {
    /// A `what` request for `keys`, sent in `parts` (per server, the key positions), due by
    /// `deadline`; `wants_values` when its answers carry values. A request with no keys is
    /// done at once.
    pub(super) fn new(
        keys: Vec<u64>,
        parts: HashMap<usize, Vec<usize>>,
        wants_values: bool,
        deadline: Instant,
        what: &'static str,
    ) -> Self {
        let outcome = if keys.is_empty() { Some(Ok(Answers::none())) } else { None };
        Pending {
            keys,
            parts,
            answers: Vec::new(),
            placed: None,
            lens: None,
            wants_values,
            deadline,
            what,
            outcome,
            callback: None,
            stash: HashMap::default(),
            pulls: HashMap::default(),
        }
    }

    /// Whether `shard`'s answer is the only one this request waits for, with values, and
    /// nobody but a waiting caller takes it (no callback): its values may then be received
    /// straight into that caller's buffer.
    pub(super) fn only_part(&self, shard: usize) -> bool {
        self.outcome.is_none()
            && self.callback.is_none()
            && self.wants_values
            && self.answers.is_empty()
            && self.parts.len() == 1
            && self.parts.contains_key(&shard)
    }

    /// Where `shard`'s answer goes in the waiting caller's buffer, as (offset, length) in values
    /// per key of its part, when the request knows every key's length (a push-pull's), is still
    /// open with values to come, and nobody but a waiting caller takes it: its values may then
    /// be received there as they arrive, whatever the other answers.
    /// `room`: the caller's buffer's length, which must be the request's number of values.
    pub(super) fn place_of(&self, shard: usize, room: usize) -> Option<Vec<(usize, usize)>> {
        if self.outcome.is_some() || self.callback.is_some() || !self.wants_values {
            return None;
        }
        let (lens, idx) = (self.lens.as_ref()?, self.parts.get(&shard)?);
        if lens.iter().try_fold(0usize, |a, &l| a.checked_add(l)) != Some(room) {
            return None;
        }
        let mut offsets = Vec::with_capacity(lens.len());
        let mut at = 0usize;
        for &l in lens {
            offsets.push(at);
            at = at.checked_add(l)?;
        }
        idx.iter().map(|&i| Some((*offsets.get(i)?, *lens.get(i)?))).collect()
    }

    /// [`take_answer`](Self::take_answer) for an answer whose `bytes` of values were received
    /// into the waiting caller's buffer at `at` (see [`only_part`](Self::only_part) and
    /// [`place_of`](Self::place_of)).
    pub(super) fn take_placed(
        &mut self,
        shard: usize,
        m: Message,
        at: usize,
        bytes: usize,
    ) -> Option<Result<Answers<T>>> {
        let elsewhere = self.placed.is_some_and(|p| p != at);
        let placeable = self.lens.is_some() && self.parts.contains_key(&shard) && self.callback.is_none();
        if elsewhere || !(self.only_part(shard) || placeable) {
            // A callback given meanwhile (or a second wait): nobody else may take these.
            return Some(Err(Error::invalid(format!(
                "a {}'s values went into the buffer of a thread waiting for it, and another took it",
                self.what
            ))));
        }
        self.placed = Some(at);
        let outcome = self.take(shard, m, Some(bytes));
        if outcome.as_ref().is_some_and(Result::is_err) {
            self.placed = None;
        }
        outcome
    }

    /// Takes the answer `m` for `shard`'s part; returns the request's outcome when this answer
    /// decides it: a refusal, an answer that does not fit the part, or the last part.
    pub(super) fn take_answer(&mut self, shard: usize, m: Message) -> Option<Result<Answers<T>>> {
        self.take(shard, m, None)
    }

    /// [`take_answer`](Self::take_answer); `placed`: the bytes of values received elsewhere.
    fn take(&mut self, shard: usize, m: Message, placed: Option<usize>) -> Option<Result<Answers<T>>> {
        let server = shard;
        if self.outcome.is_some() {
            return None;
        }
        let idx = self.parts.remove(&shard)?;
        self.pulls.remove(&shard);
        self.stash.remove(&shard);
        if m.kind == Kind::Error {
            let text = String::from_utf8_lossy(m.payload()).into_owned();
            Some(Err(Error::Aborted {
                rank: server,
                reason: format!("server {server} refused the {}: {text}", self.what),
            }))
        } else if self.wants_values {
            let size = std::mem::size_of::<T>().max(1);
            let fits = m.keys.len() == idx.len()
                && m.lens.len() == idx.len()
                && m.keys.iter().zip(&idx).all(|(k, &i)| *k == self.keys[i])
                && m.lens.iter().try_fold(0usize, |a, &l| a.checked_add(l)).and_then(|n| n.checked_mul(size))
                    == Some(placed.unwrap_or(m.payload().len()));
            if !fits {
                Some(Err(Error::Protocol {
                    peer: Some(server),
                    detail: format!("server {server} answered the {} with other keys or lengths", self.what),
                }))
            } else {
                self.answers.push((idx, m, placed.is_some()));
                None
            }
        } else {
            None
        }
        .or_else(|| self.parts.is_empty().then(|| self.assemble()))
    }

    /// The answers of a request whose every part has been answered, in key order (read out
    /// later, by whoever takes them). Where answers went into the caller's buffer at the places
    /// the push's lengths give, every answer must have those lengths (else the others' values
    /// would be read in over them): a protocol error otherwise.
    fn assemble(&mut self) -> Result<Answers<T>> {
        if !self.wants_values {
            return Ok(Answers::none());
        }
        let n = self.keys.len();
        let answers = std::mem::take(&mut self.answers);
        let mut lens = vec![0usize; n];
        let mut from = vec![(0usize, 0usize); n];
        let mut messages = Vec::with_capacity(answers.len());
        let mut in_place = Vec::with_capacity(answers.len());
        for (a, (idx, m, placed)) in answers.into_iter().enumerate() {
            in_place.push(placed);
            let mut at = 0;
            for (&i, &l) in idx.iter().zip(&m.lens) {
                if let (Some(len), Some(f)) = (lens.get_mut(i), from.get_mut(i)) {
                    *len = l;
                    *f = (a, at);
                }
                at += l;
            }
            messages.push(m);
        }
        let placed = self.placed.filter(|_| in_place.contains(&true));
        if placed.is_some()
            && let Some(pushed) = &self.lens
            && *pushed != lens
        {
            return Err(Error::Protocol {
                peer: None,
                detail: format!(
                    "the {}'s answers have other lengths than it pushed, and some of them were received \
                     into the caller's buffer at the pushed lengths' places",
                    self.what
                ),
            });
        }
        Ok(Answers { keys: self.keys.clone(), lens, from, messages, placed, in_place, _values: PhantomData })
    }

    /// `server` is gone (`cause`; `closed` says which servers are, `server` among them): what
    /// becomes of the parts it answered for, its own shard's and (as a backup) its dead
    /// primary's. With `replicate` and a live backup, the backup takes the server's own parts
    /// over (its answer stashed already, or a pull asked of it again; a push it has, and
    /// answers); every other part it answered for fails.
    pub(super) fn on_server_gone(
        &mut self,
        server: usize,
        cause: &Error,
        replicate: bool,
        servers: usize,
        closed: impl Fn(usize) -> bool,
    ) -> Vec<Takeover> {
        if self.outcome.is_some() {
            return Vec::new();
        }
        let answered_by = |shard: usize| if closed(shard) && replicate { backup_of(shard, servers) } else { shard };
        let mut out = Vec::new();
        for (&shard, idx) in &self.parts {
            if answered_by(shard) != server && shard != server {
                continue;
            }
            let b = backup_of(shard, servers);
            if replicate && shard == server && !closed(b) {
                if let Some(m) = self.stash.remove(&shard) {
                    out.push(Takeover::Stashed(shard, m));
                } else if let Some(bytes) = self.pulls.remove(&shard) {
                    out.push(Takeover::Ask(b, bytes));
                }
                // A push: the backup has it and answers.
            } else {
                let keys: Vec<u64> = idx.iter().map(|&i| self.keys[i]).collect();
                out.push(Takeover::Fail(server_gone(self.what, shard, &keys, cause)));
            }
        }
        out
    }
}

impl<T> Pending<T> {
    /// Request `ts`'s deadline passed (after `waited`): the error names it, the servers that
    /// did not answer (`answering(shard)` is the server a shard's part waits for: a backup
    /// once its primary is gone) and their keys.
    pub(super) fn overdue(&self, ts: Timestamp, waited: Duration, answering: impl Fn(usize) -> usize) -> Error {
        let mut shards: Vec<usize> = self.parts.keys().copied().collect();
        shards.sort_unstable();
        let mut servers: Vec<usize> = shards.iter().map(|&s| answering(s)).collect();
        servers.sort_unstable();
        servers.dedup();
        let backups: Vec<String> = shards
            .iter()
            .filter(|&&s| answering(s) != s)
            .map(|&s| format!("server {} for gone server {s}", answering(s)))
            .collect();
        let backups =
            if backups.is_empty() { String::new() } else { format!("; answering as backups: {}", backups.join(", ")) };
        let mut keys: Vec<u64> = self.parts.values().flatten().filter_map(|&i| self.keys.get(i).copied()).collect();
        keys.sort_unstable();
        let more = if keys.len() > 8 { format!(" and {} more", keys.len() - 8) } else { String::new() };
        keys.truncate(8);
        Error::Timeout {
            op: format!(
                "parameter-server {} request {ts} (server(s) {servers:?} did not answer for keys {keys:?}{more}{backups})",
                self.what
            ),
            ranks: servers,
            keys: Vec::new(),
            waited,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rustc_hash::FxHashSet as HashSet;

    /// A pull of `keys` split over servers as `parts` says.
    fn pull(keys: &[u64], parts: &[(usize, &[usize])]) -> Pending<f32> {
        let parts = parts.iter().map(|(s, idx)| (*s, idx.to_vec())).collect();
        Pending::new(keys.to_vec(), parts, true, Instant::now(), "pull")
    }

    fn answer(kind: Kind, shard: usize, keys: &[u64], lens: &[usize], values: &[f32]) -> Message {
        let m = Message {
            kind,
            dtype: f32::DTYPE as u8,
            cmd: 0,
            ts: 2,
            shard: shard as u32,
            keys: keys.to_vec(),
            lens: lens.to_vec(),
            values: bytemuck::cast_slice(values).to_vec(),
            at: 0,
        };
        Message::decode(m.encode(), shard).expect("an answer we encoded decodes")
    }

    #[test]
    fn a_push_pulls_answers_have_places_known_ahead_and_one_in_place_is_stepped_over() {
        // Keys 1..4 of lengths 2, 1, 0, 2 (the push's), server 0 holding 1 and 3.
        let mut p = pull(&[1, 2, 3, 4], &[(0, &[0, 2]), (1, &[1, 3])]);
        assert_eq!(p.place_of(1, 5), None, "a pull's lengths are not known ahead");
        p.lens = Some(vec![2, 1, 0, 2]);
        assert_eq!(p.place_of(1, 5), Some(vec![(2, 1), (3, 2)]));
        assert_eq!(p.place_of(0, 5), Some(vec![(0, 2), (3, 0)]));
        assert_eq!(p.place_of(0, 4), None, "a buffer of another length");
        assert_eq!(p.place_of(2, 5), None, "a server not asked");
        // Server 1's values went into the caller's buffer; server 0's came in its message.
        let mut out = [0f32, 0.0, 20.0, 40.0, 41.0];
        let at = out.as_ptr() as usize;
        assert!(p.take_placed(1, answer(Kind::Reply, 1, &[2, 4], &[1, 2], &[]), at, 12).is_none());
        assert_eq!(p.place_of(1, 5), None, "answered");
        let elsewhere = p.take_placed(0, answer(Kind::Reply, 0, &[1, 3], &[2, 0], &[]), at + 4, 8);
        assert!(matches!(elsewhere, Some(Err(Error::InvalidArgument(_)))), "{elsewhere:?}");
        let mut p2 = pull(&[1, 2, 3, 4], &[(0, &[0, 2]), (1, &[1, 3])]);
        p2.lens = Some(vec![2, 1, 0, 2]);
        assert!(p2.take_placed(1, answer(Kind::Reply, 1, &[2, 4], &[1, 2], &[]), at, 12).is_none());
        let done = p2.take_answer(0, answer(Kind::Reply, 0, &[1, 3], &[2, 0], &[10.0, 11.0]));
        let answers = done.expect("the last part decides").expect("a reply");
        assert_eq!(answers.read_into(&mut out, "push_pull").expect("fits"), [2, 1, 0, 2]);
        assert_eq!(out, [10.0, 11.0, 20.0, 40.0, 41.0], "the placed values stay, the others are read in");
        let mut other = [0f32; 5];
        assert!(answers.read_into(&mut other, "push_pull").is_err(), "another buffer than the one placed into");
        assert!(answers.check_placed(None, "push_pull").is_err(), "a reply without the buffer");
        // Another server answering with other lengths than pushed (same total) would have its
        // values read in over the placed ones: the request fails instead.
        let mut p3 = pull(&[1, 2, 3, 4], &[(0, &[0, 2]), (1, &[1, 3])]);
        p3.lens = Some(vec![2, 1, 0, 2]);
        assert!(p3.take_placed(1, answer(Kind::Reply, 1, &[2, 4], &[1, 2], &[]), at, 12).is_none());
        let done = p3.take_answer(0, answer(Kind::Reply, 0, &[1, 3], &[1, 1], &[10.0, 11.0]));
        assert!(matches!(done, Some(Err(Error::Protocol { .. }))), "{done:?}");
    }

    #[test]
    fn answers_from_several_servers_come_together_in_key_order() {
        let mut p = pull(&[1, 2, 3, 4], &[(0, &[0, 2]), (1, &[1, 3])]);
        // Server 1 first: keys 2 and 4.
        assert!(p.take_answer(1, answer(Kind::Reply, 1, &[2, 4], &[1, 2], &[20.0, 40.0, 41.0])).is_none());
        assert!(p.take_answer(1, answer(Kind::Reply, 1, &[2, 4], &[1, 2], &[0.0; 3])).is_none(), "answered twice");
        assert!(p.take_answer(2, answer(Kind::Reply, 2, &[2], &[1], &[0.0])).is_none(), "a server not asked");
        let done = p.take_answer(0, answer(Kind::Reply, 0, &[1, 3], &[2, 0], &[10.0, 11.0]));
        let answers = done.expect("the last part decides").expect("a reply");
        // Read into a buffer of the right length, or into a fresh reply: the same values.
        let mut into = [0f32; 5];
        let lens = answers.read_into(&mut into, "pull").expect("fits");
        assert_eq!((lens, into), (vec![2, 1, 0, 2], [10.0, 11.0, 20.0, 40.0, 41.0]));
        let mut short = [0f32; 4];
        let e = answers.read_into(&mut short, "pull").map_err(|e| e.to_string());
        assert_eq!(e, Err("invalid argument: pull: the 4 keys have 5 values, the buffer has room for 4".into()));
        let reply = answers.into_reply();
        assert_eq!(reply.keys, [1, 2, 3, 4]);
        assert_eq!(reply.lens, [2, 1, 0, 2]);
        assert_eq!(reply.values, [10.0, 11.0, 20.0, 40.0, 41.0]);
    }

    #[test]
    fn a_push_completes_empty_and_a_request_with_no_keys_at_once() {
        let parts = [(0, vec![0]), (1, vec![1])].into_iter().collect::<HashMap<usize, Vec<usize>>>();
        let mut p = Pending::<f32>::new(vec![5, 6], parts, false, Instant::now(), "push");
        assert!(p.take_answer(0, answer(Kind::Reply, 0, &[], &[], &[])).is_none());
        assert_eq!(
            p.take_answer(1, answer(Kind::Reply, 1, &[], &[], &[])).map(|r| r.ok().map(Answers::into_reply)),
            Some(Some(Reply::default()))
        );
        let empty = Pending::<f32>::new(vec![], HashMap::default(), true, Instant::now(), "pull");
        assert_eq!(empty.outcome.map(|o| o.ok().map(Answers::into_reply)), Some(Some(Reply::default())));
    }

    #[test]
    fn a_refusal_or_a_misfit_answer_decides_the_request_naming_the_server() {
        let mut p = pull(&[1, 2], &[(0, &[0]), (1, &[1])]);
        let refusal = Message { values: b"key 1 holds 2 values".to_vec(), at: 0, ..Message::control(Kind::Error) };
        let e = p.take_answer(1, refusal).map(|r| r.map(Answers::into_reply).map_err(|e| e.to_string()));
        assert_eq!(e, Some(Err("rank 1 aborted the context: server 1 refused the pull: key 1 holds 2 values".into())));
        let mut p = pull(&[1, 2], &[(0, &[0]), (1, &[1])]);
        let other_key = p.take_answer(0, answer(Kind::Reply, 0, &[7], &[1], &[1.0]));
        assert!(
            matches!(&other_key, Some(Err(Error::Protocol { peer: Some(0), detail }))
                if detail == "server 0 answered the pull with other keys or lengths"),
            "{other_key:?}"
        );
        let mut p = pull(&[1], &[(0, &[0])]);
        let short = p.take_answer(0, answer(Kind::Reply, 0, &[1], &[3], &[1.0, 2.0]));
        assert!(matches!(short, Some(Err(Error::Protocol { .. }))), "lengths that are not the values: {short:?}");
    }

    #[test]
    fn when_a_primary_dies_its_backup_takes_over_and_what_nobody_can_answer_fails() {
        let cause = Error::PeerClosed { rank: 0, op: "recv".into(), detail: "closed".into() };
        let closed: HashSet<usize> = [0].into_iter().collect::<HashSet<usize>>();
        // A pull over shards 0 and 1 of three servers; the backup of 0 (server 1) answered
        // already, and server 0 dies.
        let mut p = pull(&[1, 2], &[(0, &[0]), (1, &[1])]);
        p.stash.insert(0, answer(Kind::Reply, 0, &[1], &[1], &[1.0]));
        let t = p.on_server_gone(0, &cause, true, 3, |s| closed.contains(&s));
        assert!(matches!(&t[..], [Takeover::Stashed(0, _)]), "{t:?}");
        // No answer of the backup's yet: the pull is asked of it again.
        let mut p = pull(&[1, 2], &[(0, &[0]), (1, &[1])]);
        p.pulls.insert(0, vec![9, 9]);
        let t = p.on_server_gone(0, &cause, true, 3, |s| closed.contains(&s));
        assert!(matches!(&t[..], [Takeover::Ask(1, b)] if b == &[9, 9]), "{t:?}");
        // A push: the backup has it; nothing to do.
        let mut push = Pending::<f32>::new(
            vec![1],
            [(0, vec![0])].into_iter().collect::<HashMap<usize, Vec<usize>>>(),
            false,
            Instant::now(),
            "push",
        );
        assert!(push.on_server_gone(0, &cause, true, 3, |s| closed.contains(&s)).is_empty());
        // Without replication the part fails, naming the server and its keys.
        let mut p = pull(&[1, 2], &[(0, &[0]), (1, &[1])]);
        let t = p.on_server_gone(0, &cause, false, 3, |s| closed.contains(&s));
        let [Takeover::Fail(Error::PeerClosed { rank: 0, detail, .. })] = &t[..] else { panic!("{t:?}") };
        assert!(detail.starts_with("server 0 is gone with keys [1] of this request outstanding"), "{detail}");
        // The backup dies too: the parts it answered for its dead primary fail.
        let both: HashSet<usize> = [0, 1].into_iter().collect::<HashSet<usize>>();
        let mut p = pull(&[1, 2], &[(0, &[0])]);
        let t = p.on_server_gone(1, &cause, true, 3, |s| both.contains(&s));
        assert!(matches!(&t[..], [Takeover::Fail(Error::PeerClosed { rank: 0, .. })]), "{t:?}");
        // A request decided already is left alone.
        let mut done = pull(&[1], &[(0, &[0])]);
        done.outcome = Some(Ok(Answers::none()));
        assert!(done.on_server_gone(0, &cause, false, 3, |s| closed.contains(&s)).is_empty());
    }

    #[test]
    fn a_late_request_names_the_servers_it_waits_for_and_their_keys() {
        let keys: Vec<u64> = (1..=10).collect();
        let p = pull(&keys, &[(0, &[0, 1, 2, 3, 4, 5]), (2, &[6, 7, 8, 9])]);
        let Error::Timeout { op, ranks, waited, .. } = p.overdue(8, Duration::from_secs(3), |s| s) else {
            panic!("not a timeout")
        };
        assert_eq!(
            op,
            "parameter-server pull request 8 (server(s) [0, 2] did not answer for keys [1, 2, 3, 4, 5, 6, 7, 8] and 2 more)"
        );
        assert_eq!((ranks, waited), (vec![0, 2], Duration::from_secs(3)));
    }

    #[test]
    fn a_late_request_whose_primary_died_names_the_backup_it_waits_for() {
        // Server 0 is gone; its backup, server 1, answers for its keys and is silent.
        let p = pull(&[1, 2], &[(0, &[0])]);
        let Error::Timeout { op, ranks, .. } =
            p.overdue(4, Duration::from_secs(1), |s| if s == 0 { backup_of(0, 3) } else { s })
        else {
            panic!("not a timeout")
        };
        assert_eq!(
            op,
            "parameter-server pull request 4 (server(s) [1] did not answer for keys [1]; answering as backups: \
             server 1 for gone server 0)"
        );
        assert_eq!(ranks, [1], "the server waited on, not the dead one");
    }

    #[test]
    fn messages_to_a_worker_go_where_they_belong() {
        let msg = |kind, shard| Message { shard, ..Message::control(kind) };
        assert!(matches!(route(0, &msg(Kind::Heartbeat, 0), false, 2), Route::Skip));
        assert!(matches!(route(1, &msg(Kind::Reply, 1), false, 2), Route::Own));
        assert!(matches!(route(1, &msg(Kind::Error, 0), true, 3), Route::Backup));
        // Not the backup of that shard, replication off, or no such shard.
        for (server, shard, replication) in [(2, 0, true), (1, 0, false), (0, 7, true)] {
            let r = route(server, &msg(Kind::Reply, shard), replication, 3);
            assert!(
                matches!(&r, Route::Bad(Error::Protocol { peer: Some(p), detail })
                    if *p == server && *detail == format!("an answer for server {shard}'s keys")),
                "{r:?}"
            );
        }
        let r = route(0, &msg(Kind::Push, 0), false, 2);
        assert!(matches!(&r, Route::Bad(Error::Protocol { detail, .. }) if detail == "a Push message to a worker"));
    }

    proptest! {
        #[test]
        fn timestamps_increase_and_tell_pushes_apart(counter in 1u64..1 << 40, push: bool, later in 1u64..100) {
            let ts = timestamp_of(counter, push);
            prop_assert_eq!(is_push(ts), push);
            prop_assert!(timestamp_of(counter + later, !push) > ts);
            prop_assert_eq!(issued_push(ts, counter + later), push);
            prop_assert!(!issued_push(ts, counter), "a push not sent yet");
        }
    }
}
