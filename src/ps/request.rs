//! A request as a server's handler sees it ([`Request`], [`RequestMeta`]), and the checks
//! every request passes: the worker's before it sends (sorted unique keys, lengths that split
//! the values) and the server's on arrival (the same, plus the value type and a whole number
//! of values), as plain functions of the request.

use super::Timestamp;
use super::wire::{Kind, Message};
use crate::error::{Error, Result};
use crate::types::Element;
use std::borrow::Cow;

/// A request as a server's handler sees it. Its values are borrowed from the received message
/// (a server hands them over without copying them); a handler that keeps a request past its
/// `handle` call takes it with [`into_owned`](Request::into_owned).
#[derive(Debug, Clone, PartialEq)]
pub struct Request<'a, T: Clone> {
    /// Who sent it, and how to answer.
    pub meta: RequestMeta,
    /// The keys (sorted, unique), this server's share of them.
    pub keys: Vec<u64>,
    /// The pushed values, concatenated (empty for a pull): a view of the received bytes, or
    /// owned where they could not be viewed in place (bytes not aligned for `T`) or were
    /// taken.
    pub values: Cow<'a, [T]>,
    /// Each key's number of values (empty for a pull).
    pub lens: Vec<usize>,
}

impl<T: Clone> Request<'_, T> {
    /// The request with its values owned (copied if they were borrowed), to keep past the
    /// handler's call (answered later, or held for a synchronous round).
    pub fn into_owned(self) -> Request<'static, T> {
        let Request { meta, keys, values, lens } = self;
        Request { meta, keys, values: Cow::Owned(values.into_owned()), lens }
    }
}

/// Who sent a request and what it asks; [`Responder::respond`] answers it.
///
/// [`Responder::respond`]: super::Responder::respond
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestMeta {
    /// The worker's number.
    pub worker: usize,
    /// The caller's command id.
    pub cmd: i32,
    /// The request's timestamp (the worker's).
    pub timestamp: Timestamp,
    /// Whether it carries values.
    pub push: bool,
    /// Whether it wants values back.
    pub pull: bool,
    /// The server whose keys these are: this one, or (with replication) the dead or living
    /// primary this server keeps a copy for.
    pub shard: usize,
}

/// A request the server refuses: whom to answer, and why.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Refusal {
    pub(super) meta: RequestMeta,
    pub(super) reason: String,
}

/// The request message `m` from worker `worker` carries, checked ([`check_request`]), or why
/// it is refused.
pub(super) fn request_of<T: Element>(m: &mut Message, worker: usize) -> std::result::Result<Request<'_, T>, Refusal> {
    let meta = meta_of(m, worker);
    let refuse = |reason: String| Refusal { meta, reason };
    if m.dtype != T::DTYPE as u8 {
        return Err(refuse(format!("this server holds {} values, the request has type code {}", T::DTYPE, m.dtype)));
    }
    let size = size_of::<T>().max(1);
    if !m.payload().len().is_multiple_of(size) {
        return Err(refuse(format!(
            "the request's values are {} bytes, not a whole number of {size}-byte values",
            m.payload().len()
        )));
    }
    let (keys, lens) = (std::mem::take(&mut m.keys), std::mem::take(&mut m.lens));
    let m: &Message = m;
    // The values start 8-byte aligned within the message: viewed in place.
    let values = crate::types::view_or_copy(m.payload());
    let req = Request { meta, keys, values, lens };
    match check_request(&req) {
        Ok(()) => Ok(req),
        Err(e) => Err(refuse(e.to_string())),
    }
}

/// The head of a push whose values follow on their own ([`Kind::PushHead`]), checked: its
/// identity, keys and lengths and the values' size in bytes, or why it is refused (the size is
/// then unknown).
pub(super) type SplitPush = (RequestMeta, Vec<u64>, Vec<usize>, usize);

/// What head `m` from worker `worker` announces ([`SplitPush`]), or why it is refused.
pub(super) fn split_push_of<T: Element>(m: &mut Message, worker: usize) -> std::result::Result<SplitPush, Refusal> {
    let meta = meta_of(m, worker);
    let refuse = |reason: String| Refusal { meta, reason };
    if m.dtype != T::DTYPE as u8 {
        return Err(refuse(format!("this server holds {} values, the request has type code {}", T::DTYPE, m.dtype)));
    }
    if !m.payload().is_empty() || m.lens.len() != m.keys.len() {
        return Err(refuse(format!(
            "a push's head has no values and a length per key, this one has {} bytes of values, {} lengths \
             and {} keys",
            m.payload().len(),
            m.lens.len(),
            m.keys.len()
        )));
    }
    let (keys, lens) = (std::mem::take(&mut m.keys), std::mem::take(&mut m.lens));
    let n = lens.iter().try_fold(0usize, |a, &l| a.checked_add(l));
    let bytes = n.and_then(|n| n.checked_mul(size_of::<T>())).filter(|&b| b <= super::wire::MAX_MESSAGE);
    let Some(bytes) = bytes else {
        return Err(refuse(format!("the lengths add up to more than a message of {} bytes", super::wire::MAX_MESSAGE)));
    };
    check_keys(if meta.pull { "push_pull" } else { "push" }, &keys, None).map_err(|e| refuse(e.to_string()))?;
    Ok((meta, keys, lens, bytes))
}

fn meta_of(m: &Message, worker: usize) -> RequestMeta {
    RequestMeta {
        worker,
        cmd: m.cmd,
        timestamp: m.ts,
        push: matches!(m.kind, Kind::Push | Kind::PushPull | Kind::PushHead | Kind::PushPullHead),
        pull: matches!(m.kind, Kind::Pull | Kind::PushPull | Kind::PushPullHead),
        shard: m.shard as usize,
    }
}

/// Checks that keys are sorted and unique and that `lens` splits `values`; returns the lengths.
pub(super) fn check_keys(what: &str, keys: &[u64], values: Option<(usize, &[usize])>) -> Result<Vec<usize>> {
    if let Some(i) = (1..keys.len()).find(|&i| keys[i] <= keys[i - 1]) {
        let how = if keys[i] == keys[i - 1] { "repeats" } else { "comes after" };
        return Err(Error::invalid(format!(
            "{what}: keys must be sorted and unique: key {} at index {i} {how} key {} at index {}",
            keys[i],
            keys[i - 1],
            i - 1
        )));
    }
    let Some((n, lens)) = values else { return Ok(Vec::new()) };
    if lens.is_empty() {
        if keys.is_empty() {
            if n != 0 {
                return Err(Error::invalid(format!("{what}: {n} values given for no keys")));
            }
            return Ok(Vec::new());
        }
        if n % keys.len() != 0 {
            return Err(Error::invalid(format!(
                "{what}: {n} values do not split evenly over {} keys (give their lengths)",
                keys.len()
            )));
        }
        return Ok(vec![n / keys.len(); keys.len()]);
    }
    if lens.len() != keys.len() {
        return Err(Error::invalid(format!("{what}: {} lengths for {} keys", lens.len(), keys.len())));
    }
    let total = lens.iter().try_fold(0usize, |a, &l| a.checked_add(l));
    if total != Some(n) {
        return Err(Error::invalid(format!("{what}: the lengths add up to {total:?} values, not the {n} given")));
    }
    Ok(lens.to_vec())
}

/// A request's keys, lengths and values hold together (a worker checks them before sending;
/// this is for requests that did not come from one): keys sorted and unique, a push's
/// lengths one per key and adding up to its values, a pull with neither.
pub(super) fn check_request<T: Clone>(r: &Request<'_, T>) -> Result<()> {
    let what = match (r.meta.push, r.meta.pull) {
        (true, true) => "push_pull",
        (true, false) => "push",
        _ => "pull",
    };
    let refused =
        |why: String| Error::invalid(format!("{what} request {} of worker {}: {why}", r.meta.timestamp, r.meta.worker));
    if !r.meta.push {
        check_keys(what, &r.keys, None)?;
        if !r.lens.is_empty() || !r.values.is_empty() {
            return Err(refused(format!(
                "a pull carries no values, this one has {} values and {} lengths",
                r.values.len(),
                r.lens.len()
            )));
        }
        return Ok(());
    }
    if r.lens.len() != r.keys.len() {
        return Err(refused(format!("{} lengths for {} keys", r.lens.len(), r.keys.len())));
    }
    check_keys(what, &r.keys, Some((r.values.len(), &r.lens))).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A request message as a worker encodes it (or as a stranger might, with any fields).
    fn message(kind: Kind, dtype: u8, keys: &[u64], lens: &[usize], payload: &[u8]) -> Message {
        let m = Message {
            kind,
            dtype,
            cmd: 7,
            ts: 42,
            shard: 1,
            keys: keys.to_vec(),
            lens: lens.to_vec(),
            values: payload.to_vec(),
            at: 0,
        };
        Message::decode(m.encode(), 3).expect("a message we encoded decodes")
    }

    fn refusal<T: Element>(mut m: Message) -> String {
        match request_of::<T>(&mut m, 5) {
            Ok(r) => panic!("accepted: {r:?}"),
            Err(Refusal { meta, reason }) => {
                assert_eq!(
                    (meta.worker, meta.timestamp, meta.cmd, meta.shard),
                    (5, 42, 7, 1),
                    "answered to the sender"
                );
                reason
            }
        }
    }

    #[test]
    fn a_push_pull_comes_out_as_the_worker_sent_it() {
        let values = [1.5f32, -2.0, 3.25];
        let mut m = message(Kind::PushPull, f32::DTYPE as u8, &[4, 9], &[2, 1], bytemuck::cast_slice(&values));
        let r = request_of::<f32>(&mut m, 5).expect("a well-formed request");
        assert_eq!(r.meta, RequestMeta { worker: 5, cmd: 7, timestamp: 42, push: true, pull: true, shard: 1 });
        // Viewed in the received message, not copied out of it.
        assert!(matches!(r.values, Cow::Borrowed(_)), "the values were copied");
        assert_eq!((r.keys, &*r.values, r.lens), (vec![4, 9], &values[..], vec![2, 1]));
        let mut pull = message(Kind::Pull, f32::DTYPE as u8, &[1, 2], &[], &[]);
        let pull = request_of::<f32>(&mut pull, 0).expect("a pull");
        assert!(pull.meta.pull && !pull.meta.push && pull.values.is_empty());
    }

    #[test]
    fn malformed_requests_are_refused_saying_why() {
        let f32_code = f32::DTYPE as u8;
        let wrong_type = refusal::<f32>(message(Kind::Push, i64::DTYPE as u8, &[1], &[1], &[0; 8]));
        assert_eq!(wrong_type, format!("this server holds f32 values, the request has type code {}", i64::DTYPE as u8));
        let torn = refusal::<f32>(message(Kind::Push, f32_code, &[1], &[1], &[0; 6]));
        assert_eq!(torn, "the request's values are 6 bytes, not a whole number of 4-byte values");
        let unsorted = refusal::<f32>(message(Kind::Push, f32_code, &[5, 2], &[1, 1], &[0; 8]));
        assert_eq!(
            unsorted,
            "invalid argument: push: keys must be sorted and unique: key 2 at index 1 comes after key 5 at index 0"
        );
        let pull_with_values = refusal::<f32>(message(Kind::Pull, f32_code, &[1], &[1], &[0; 4]));
        assert_eq!(
            pull_with_values,
            "invalid argument: pull request 42 of worker 5: a pull carries no values, this one has 1 values and 1 \
             lengths"
        );
        let lens = refusal::<f32>(message(Kind::Push, f32_code, &[1, 2], &[2], &[0; 8]));
        assert_eq!(lens, "invalid argument: push request 42 of worker 5: 1 lengths for 2 keys");
        let sums = refusal::<f32>(message(Kind::PushPull, f32_code, &[1, 2], &[2, 2], &[0; 8]));
        assert_eq!(sums, "invalid argument: push_pull: the lengths add up to Some(4) values, not the 2 given");
    }

    #[test]
    fn a_workers_lengths_default_to_an_even_split() {
        assert_eq!(check_keys("push", &[1, 2, 3], Some((6, &[]))).ok(), Some(vec![2, 2, 2]));
        assert_eq!(check_keys("push", &[], Some((0, &[]))).ok(), Some(vec![]));
        // Values with no keys to go to (a server used to take such a push, and drop them).
        let stray = check_keys("push", &[], Some((1, &[]))).map_err(|e| e.to_string());
        assert_eq!(stray, Err("invalid argument: push: 1 values given for no keys".into()));
        let uneven = check_keys("push", &[1, 2], Some((3, &[]))).map_err(|e| e.to_string());
        assert_eq!(
            uneven,
            Err("invalid argument: push: 3 values do not split evenly over 2 keys (give their lengths)".into())
        );
        let overflow = check_keys("push", &[1, 2], Some((0, &[usize::MAX, 1]))).map_err(|e| e.to_string());
        assert_eq!(overflow, Err("invalid argument: push: the lengths add up to None values, not the 0 given".into()));
    }

    proptest! {
        /// The server's check accepts a push exactly when a plain reading of the rules does.
        #[test]
        fn the_check_accepts_exactly_the_well_formed_pushes(
            keys in proptest::collection::vec(0u64..20, 0..6),
            lens in proptest::collection::vec(0usize..4, 0..6),
            values in 0usize..16,
        ) {
            let sorted = keys.windows(2).all(|w| w[0] < w[1]);
            let fits = lens.len() == keys.len() && lens.iter().sum::<usize>() == values;
            let r = Request {
                meta: RequestMeta { worker: 0, cmd: 0, timestamp: 1, push: true, pull: false, shard: 0 },
                keys,
                values: vec![0f32; values].into(),
                lens,
            };
            prop_assert_eq!(check_request(&r).is_ok(), sorted && fits, "{:?}", r);
        }
    }
}
