//! Posted receives against arrived messages: the matching rules of the transport contract
//! (rules 2, 3, 4, 6, 7 and the group part of 8), with no I/O, shared by every backend.
//!
//! A backend keeps one [`Matcher`] per pair, for the messages coming from the peer. It tells
//! the matcher about receives as they are posted ([`Matcher::post`]) and about messages as
//! their headers arrive ([`Matcher::incoming`]); the matcher answers where each message's
//! payload goes: straight into a claimed receive ([`Dispatch::Deliver`]), into an early-arrival
//! buffer within the pair's budget ([`Dispatch::Early`]), nowhere ([`Dispatch::Discard`]), or
//! not yet ([`Dispatch::Stall`]: the backend stops taking the peer's messages until a receive
//! is posted). Moving the bytes is the backend's job, which is what keeps this module free of
//! sockets and testable on its own.

use super::{Completion, Done, Key, RecvBuf, RecvTarget, seq_after, sequence_mismatch, sequenced};
use crate::error::{Error, Result};
use crate::types::OpDesc;
use std::collections::VecDeque;
use std::sync::Arc;

/// Early-arrival buffers kept for reuse (their capacity also stays within the early budget):
/// a fresh multi-megabyte allocation per early message costs page faults on every touch.
const SPARE_BUFFERS: usize = 8;

/// A spare may be this much larger than the message it takes whatever the message's length
/// (see [`Matcher::spare_buffer`]).
const SPARE_SLACK: usize = 64 << 10;

/// What an early message costs the budget beyond its payload (its place on the list), so that
/// a flood of empty messages is bounded too.
const EARLY_OVERHEAD: usize = 64;

/// The budget an early message of `len` payload bytes takes.
fn cost(len: usize) -> usize {
    len + EARLY_OVERHEAD
}

/// What precedes a message: its key, its call's descriptor and its payload length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) key: Key,
    pub(crate) desc: OpDesc,
    pub(crate) len: u64,
}

/// A posted receive.
#[derive(Debug)]
pub(crate) struct RecvOp {
    pub(crate) key: Key,
    pub(crate) desc: OpDesc,
    pub(crate) target: RecvTarget,
    pub(crate) done: Arc<Completion>,
}

/// A message on its way into the receive that claimed it.
#[derive(Debug)]
pub(crate) struct Delivery {
    op: RecvOp,
    len: usize,
    filled: usize,
    /// The buffer of an owned receive, of the message's length.
    owned: Option<Vec<u8>>,
    /// Where a backend that reads into [`Delivery::dst`] (not [`Delivery::put`]) writes the
    /// bytes of a receive into a consumer (`RecvTarget::Sink`) before they are handed over.
    bounce: Vec<u8>,
}

impl Delivery {
    /// A delivery of `len` bytes into `op`'s target; an owned receive's buffer is `spare`,
    /// which has room for them.
    fn new(op: RecvOp, len: usize, spare: impl FnOnce(usize) -> Option<Vec<u8>>) -> Self {
        let owned = matches!(op.target, RecvTarget::Owned { .. }).then(|| match spare(len) {
            // All `len` bytes are written before the receive completes: only a spare shorter
            // than that is extended (with zeros), a longer one is cut.
            Some(mut v) => {
                v.resize(len, 0);
                v
            }
            None => vec![0u8; len],
        });
        Delivery { op, len, filled: 0, owned, bounce: Vec::new() }
    }

    /// The completion of the receive.
    pub(crate) fn done(&self) -> &Arc<Completion> {
        &self.op.done
    }

    /// Payload bytes still to come.
    #[inline]
    pub(crate) fn remaining(&self) -> usize {
        self.len - self.filled
    }

    /// Where the rest of the payload goes (`remaining()` bytes).
    #[inline]
    pub(crate) fn dst(&mut self) -> &mut [u8] {
        match (&mut self.owned, self.op.target.buf()) {
            (Some(v), _) => &mut v[self.filled..],
            (None, Some(RecvBuf { ptr, .. })) => {
                // SAFETY: the poster lent this buffer to the pair until the receive is completed
                // or cancelled (contract rule 5); a delivery exists only for a receive this pair
                // claimed and has not finished, and `filled <= len <= buf.len` (checked when the
                // delivery was made).
                unsafe { std::slice::from_raw_parts_mut(ptr.add(self.filled), self.len - self.filled) }
            }
            (None, None) => {
                // A consumer's: the bytes go through a buffer of their own (see `put`).
                self.bounce.resize(self.len - self.filled, 0);
                &mut self.bounce
            }
        }
    }

    /// `n` more bytes were written into [`Delivery::dst`].
    #[inline]
    pub(crate) fn advance(&mut self, n: usize) {
        let n = n.min(self.len - self.filled);
        if let RecvTarget::Sink(sink) = self.op.target
            && n > 0
        {
            // SAFETY: this pair claimed the receive and has not completed it (a delivery
            // exists only then), and it holds its lock while it writes.
            unsafe { sink.feed(&self.bounce[..n.min(self.bounce.len())]) };
            self.bounce.clear();
        }
        self.filled += n;
    }

    /// Writes the next bytes of the payload (at most [`remaining`](Self::remaining) of
    /// `bytes`): copied into the receive's buffer, or handed to its consumer where they are.
    #[inline]
    pub(crate) fn put(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.remaining());
        if let RecvTarget::Sink(sink) = self.op.target {
            if n > 0 {
                // SAFETY: as in `advance`.
                unsafe { sink.feed(&bytes[..n]) };
            }
            self.filled += n;
        } else {
            self.dst()[..n].copy_from_slice(&bytes[..n]);
            self.advance(n);
        }
    }

    /// Whether the receive's buffer is one this delivery allocated (an owned receive), not the
    /// caller's.
    #[cfg_attr(not(feature = "ibverbs"), allow(dead_code))]
    pub(crate) fn is_owned(&self) -> bool {
        self.owned.is_some()
    }

    /// Whether the whole payload is in.
    #[inline]
    pub(crate) fn is_full(&self) -> bool {
        self.filled == self.len
    }

    /// Completes the receive: the message came from `peer`.
    pub(crate) fn finish(self, peer: usize) {
        match self.owned {
            Some(data) => self.op.done.complete_owned(peer, data),
            None => self.op.done.complete(Ok(Done { peer, len: self.len })),
        }
    }
}

/// An early message whose payload is being read into a buffer of the pair's budget.
#[derive(Debug)]
pub(crate) struct EarlyRx {
    header: Header,
    data: Vec<u8>,
}

impl EarlyRx {
    /// Payload bytes still to come.
    pub(crate) fn remaining(&self) -> usize {
        self.header.len as usize - self.data.len()
    }

    /// Appends payload bytes (at most [`EarlyRx::remaining`] of them are taken).
    pub(crate) fn extend(&mut self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(self.remaining());
        self.data.extend_from_slice(&bytes[..n]);
        n
    }

    /// Appends `n` payload bytes (at most [`EarlyRx::remaining`]) that `fill` writes into the
    /// buffer in place (a copy from another process's memory, say).
    pub(crate) fn fill<E>(&mut self, n: usize, fill: impl FnOnce(&mut [u8]) -> Result<(), E>) -> Result<(), E> {
        let start = self.data.len();
        self.data.resize(start + n.min(self.remaining()), 0);
        fill(&mut self.data[start..])
    }
}

impl EarlyRx {
    /// Makes room for the whole payload and returns where it starts: for a backend whose
    /// hardware writes it in place later (an RDMA read). The buffer stays where it is while the
    /// `EarlyRx` is moved, and is complete once the writer has finished.
    #[cfg_attr(not(feature = "ibverbs"), allow(dead_code))]
    pub(crate) fn room_for_all(&mut self) -> *mut u8 {
        let start = self.data.len();
        self.data.resize(self.header.len as usize, 0);
        self.data[start..].as_mut_ptr()
    }
}

/// Where an arriving message's payload goes.
#[derive(Debug)]
pub(crate) enum Dispatch {
    /// Into this claimed receive.
    Deliver(Delivery),
    /// Into this early buffer; hand it back with [`Matcher::early_arrived`] once full.
    Early(EarlyRx),
    /// Nowhere: the message was for a receive that failed on it, or is of a finished call.
    Discard,
    /// Not yet: no receive takes it and the early budget cannot hold it. Take no more of the
    /// peer's messages until a receive is posted (or budget freed), then ask again.
    Stall,
}

/// A message that arrived before its receive.
#[derive(Debug)]
struct Early {
    header: Header,
    data: Vec<u8>,
}

/// One pair's matching state for the messages coming from its peer.
#[derive(Debug)]
pub(crate) struct Matcher {
    me: usize,
    peer: usize,
    budget: usize,
    posted: VecDeque<RecvOp>,
    /// Keys whose messages are never taken early: they wait in the transport until their
    /// receive is posted ([`Matcher::hold`]).
    held: Vec<Key>,
    early: VecDeque<Early>,
    /// Bytes of the budget taken: complete early messages and one being read, each with
    /// [`EARLY_OVERHEAD`].
    early_bytes: usize,
    spare: Vec<Vec<u8>>,
    /// Set once the connection failed: posts fail with it (early messages stay receivable).
    closed: Option<Error>,
    /// Groups aborted on this pair, with the error their operations get.
    aborted: Vec<(u64, Error)>,
}

impl Matcher {
    /// Matching for messages from `peer` to `me`, holding at most `budget` bytes early.
    pub(crate) fn new(me: usize, peer: usize, budget: usize) -> Self {
        Matcher {
            me,
            peer,
            budget,
            posted: VecDeque::new(),
            early: VecDeque::new(),
            early_bytes: 0,
            held: Vec::new(),
            spare: Vec::new(),
            closed: None,
            aborted: Vec::new(),
        }
    }

    /// Bytes of the early budget in use.
    #[cfg(test)]
    pub(crate) fn early_bytes(&self) -> usize {
        self.early_bytes
    }

    /// Whether any receive is posted.
    pub(crate) fn has_posted(&self) -> bool {
        !self.posted.is_empty()
    }

    /// The oldest posted receive.
    pub(crate) fn front(&self) -> Option<&RecvOp> {
        self.posted.front()
    }

    /// The error `group` was aborted with, if it was (not counting the pair closing).
    pub(crate) fn aborted(&self, group: u64) -> Option<Error> {
        self.aborted.iter().find(|(g, _)| *g == group).map(|(_, e)| e.clone())
    }

    /// The error operations of `group` get, if the group was aborted or the pair closed.
    pub(crate) fn refusal(&self, group: u64) -> Option<Error> {
        self.aborted.iter().find(|(g, _)| *g == group).map(|(_, e)| e.clone()).or_else(|| self.closed.clone())
    }

    /// A receive is posted: it takes an early message of its key, fails on one that proves the
    /// ranks disagree, or is queued. Errors (without touching `op.done`) when the pair is closed
    /// or the group aborted and no early message satisfies it. Early budget may be freed, so the
    /// caller should ask again about a stalled message.
    pub(crate) fn post(&mut self, op: RecvOp) -> Result<()> {
        if let Some((_, e)) = self.aborted.iter().find(|(g, _)| *g == op.key.group) {
            return Err(e.clone());
        }
        if let Some(i) = self.early.iter().position(|m| m.header.key == op.key) {
            if op.done.try_claim()
                && let Some(msg) = self.early.remove(i)
            {
                self.deliver_early(op, msg);
            }
            return Ok(());
        }
        if let Some((group, family, want)) = sequenced(op.key) {
            // Early messages of the same family but another sequence: the ranks disagree. Those
            // of earlier sequences belong to finished collectives: nobody will take them.
            let other = |m: &Early| {
                sequenced(m.header.key).filter(|&(g, f, s)| g == group && f == family && s != want).map(|t| t.2)
            };
            if let Some(got) = self.early.iter().find_map(other) {
                let (stale, kept): (VecDeque<Early>, VecDeque<Early>) = std::mem::take(&mut self.early)
                    .into_iter()
                    .partition(|m| other(m).is_some_and(|s| !seq_after(s, want)));
                self.early = kept;
                for m in stale {
                    self.drop_early(m);
                }
                fail(&op, sequence_mismatch(self.me, self.peer, family, want, got));
                return Ok(());
            }
        }
        if let Some(e) = &self.closed {
            return Err(e.clone());
        }
        if op.done.is_open() {
            self.posted.push_back(op); // (else claimed elsewhere meanwhile: receive from any)
        }
        Ok(())
    }

    /// A message's header arrived: where its payload goes.
    pub(crate) fn incoming(&mut self, h: Header) -> Dispatch {
        if self.aborted.iter().any(|(g, _)| *g == h.key.group) {
            return Dispatch::Discard;
        }
        // The oldest posted receive for this key that nobody else has claimed.
        while let Some(i) = self.posted.iter().position(|op| op.key == h.key) {
            let Some(op) = self.posted.remove(i) else { break };
            if !op.done.try_claim() {
                continue; // taken by another pair (receive from any) or already finished
            }
            return match self.check(op, &h) {
                Some(op) => Dispatch::Deliver(Delivery::new(op, h.len as usize, |n| self.spare_buffer(n))),
                None => Dispatch::Discard,
            };
        }
        if let Some((group, family, got)) = sequenced(h.key) {
            // Receives of the same family waiting for another sequence: the ranks disagree.
            let mut stale = false;
            let mut i = 0;
            while i < self.posted.len() {
                match sequenced(self.posted[i].key) {
                    Some((g, f, want)) if g == group && f == family && want != got => {
                        stale |= seq_after(want, got);
                        if let Some(op) = self.posted.remove(i) {
                            fail(&op, sequence_mismatch(self.me, self.peer, family, want, got));
                        }
                    }
                    _ => i += 1,
                }
            }
            if stale {
                // Nobody will ever receive a message of a finished collective.
                return Dispatch::Discard;
            }
        }
        if self.held.contains(&h.key) {
            return Dispatch::Stall;
        }
        match usize::try_from(h.len) {
            Ok(len) if cost(len) <= self.budget.saturating_sub(self.early_bytes) => {
                self.early_bytes += cost(len);
                Dispatch::Early(EarlyRx { header: h, data: self.early_buffer(len) })
            }
            _ => Dispatch::Stall,
        }
    }

    /// Messages with `key` that come before their receive wait where they are (the pair reads
    /// nothing after them) until it is posted, instead of being copied into an early buffer:
    /// for a message whose receiver posts its receive as soon as it has read the one before
    /// (a parameter-server push's values after its head), so that it lands where the receive
    /// says (or is handed to its consumer) with no copy in between.
    pub(crate) fn hold(&mut self, key: Key) {
        if !self.held.contains(&key) {
            self.held.push(key);
        }
    }

    /// The oldest posted receive, taken for a message with header `h` that is known to be its
    /// (the TCP pair's read-ahead): what [`Matcher::incoming`] would decide, when the receive is
    /// the first one posted, posted to this pair only, and takes `h`. Returns `None` and leaves
    /// the receive posted otherwise.
    pub(crate) fn take_front_for(&mut self, h: &Header) -> Option<Delivery> {
        let front = self.posted.front()?;
        let takes = front.key == h.key
            && !front.done.is_shared()
            && self.refusal(h.key.group).is_none()
            && self.misfit(front, h).is_none();
        if !takes || !front.done.try_claim() {
            return None;
        }
        let op = self.posted.pop_front()?;
        Some(Delivery::new(op, h.len as usize, |n| self.spare_buffer(n)))
    }

    /// An early payload is complete: hand it to a receive posted meanwhile, or keep it (or drop
    /// it, when its group was aborted while it came in).
    pub(crate) fn early_arrived(&mut self, rx: EarlyRx) {
        let msg = Early { header: rx.header, data: rx.data };
        if self.aborted.iter().any(|(g, _)| *g == msg.header.key.group) {
            return self.drop_early(msg);
        }
        while let Some(i) = self.posted.iter().position(|op| op.key == msg.header.key) {
            let Some(op) = self.posted.remove(i) else { break };
            if op.done.try_claim() {
                self.deliver_early(op, msg);
                return;
            }
        }
        self.early.push_back(msg);
    }

    /// An early payload that will never be complete (the pair failed while reading it).
    pub(crate) fn early_dropped(&mut self, rx: EarlyRx) {
        self.early_bytes -= cost(rx.header.len as usize);
    }

    /// Forgets a complete early message nobody will take.
    fn drop_early(&mut self, m: Early) {
        self.early_bytes -= cost(m.data.len());
        self.recycle(m.data);
    }

    /// Withdraws the receive of `done`, if posted here.
    pub(crate) fn cancel(&mut self, done: &Arc<Completion>) {
        self.posted.retain(|op| !Arc::ptr_eq(&op.done, done));
    }

    /// The connection failed: every posted receive fails with `err`, and so will later posts
    /// that no early message satisfies.
    pub(crate) fn close(&mut self, err: &Error) {
        if self.closed.is_none() {
            self.closed = Some(err.clone());
        }
        for op in self.posted.drain(..) {
            fail(&op, err.clone());
        }
    }

    /// `group` was aborted: its posted receives fail with `err` and so will its later posts;
    /// its messages are discarded, early ones included.
    pub(crate) fn abort_group(&mut self, group: u64, err: &Error) {
        if self.aborted.iter().any(|(g, _)| *g == group) {
            return;
        }
        self.aborted.push((group, err.clone()));
        let mut i = 0;
        while i < self.posted.len() {
            if self.posted[i].key.group == group {
                if let Some(op) = self.posted.remove(i) {
                    fail(&op, err.clone());
                }
            } else {
                i += 1;
            }
        }
        let (dropped, kept): (VecDeque<Early>, VecDeque<Early>) =
            std::mem::take(&mut self.early).into_iter().partition(|m| m.header.key.group == group);
        self.early = kept;
        for m in dropped {
            self.drop_early(m);
        }
    }

    /// How a message differs from a receive of its key, in words, if it does.
    fn misfit(&self, op: &RecvOp, h: &Header) -> Option<String> {
        if op.desc != h.desc {
            return Some(OpDesc::explain(self.me, &op.desc, self.peer, &h.desc));
        }
        op.target.misfit(h.len).map(|m| {
            let what = if op.desc == OpDesc::P2P {
                format!("point-to-point tag {}", op.key.tag as u32)
            } else {
                op.desc.describe()
            };
            format!("rank {} sent {m} on rank {} ({what})", self.peer, self.me)
        })
    }

    /// Checks a claimed receive against a message; completes it with the mismatch and returns
    /// `None` when they disagree.
    fn check(&self, op: RecvOp, h: &Header) -> Option<RecvOp> {
        match self.misfit(&op, h) {
            Some(detail) => {
                op.done.complete(Err(Error::Mismatch { rank: self.peer, detail }));
                None
            }
            None => Some(op),
        }
    }

    /// Delivers an early message (no longer on the early list) to the receive that claimed it,
    /// returns its bytes to the early budget and keeps its buffer for reuse.
    fn deliver_early(&mut self, op: RecvOp, msg: Early) {
        self.early_bytes -= cost(msg.data.len());
        let Some(op) = self.check(op, &msg.header) else {
            self.recycle(msg.data);
            return;
        };
        match (op.target, op.target.buf()) {
            (RecvTarget::Sink(sink), _) => {
                // SAFETY: the receive is this pair's (claimed) until its completion, which
                // follows; the message has the sink's length (checked above).
                unsafe { sink.feed(&msg.data) };
                op.done.complete(Ok(Done { peer: self.peer, len: msg.data.len() }));
                self.recycle(msg.data);
            }
            (_, None) => op.done.complete_owned(self.peer, msg.data),
            (_, Some(buf)) => {
                // SAFETY: the receive buffer is lent to this pair until its completion, which
                // follows; the message fits it (checked above).
                unsafe { std::ptr::copy_nonoverlapping(msg.data.as_ptr(), buf.ptr, msg.data.len()) };
                op.done.complete(Ok(Done { peer: self.peer, len: msg.data.len() }));
                self.recycle(msg.data);
            }
        }
    }

    /// A buffer for an early payload of `len` bytes: the smallest spare that fits, else new.
    fn early_buffer(&mut self, len: usize) -> Vec<u8> {
        let mut v = self.spare_buffer(len).unwrap_or_else(|| Vec::with_capacity(len));
        v.clear();
        v
    }

    /// A spare buffer with room for `len` bytes, as it was left (its old length and bytes, so
    /// that an owned receive writing all of them need not zero them first), or a new one.
    /// A spare fits a message of `len` bytes when it has room for them and is not much larger
    /// (at most twice, or [`SPARE_SLACK`]): a small message does not take, and keep, a large
    /// buffer that a large message could use.
    fn spare_buffer(&mut self, len: usize) -> Option<Vec<u8>> {
        let most = len.saturating_mul(2).max(SPARE_SLACK);
        let fits = |b: &Vec<u8>| (len..=most).contains(&b.capacity());
        let best = self.spare.iter().enumerate().filter(|(_, b)| fits(b)).min_by_key(|(_, b)| b.capacity());
        best.map(|(i, _)| i).map(|i| self.spare.swap_remove(i))
    }

    /// Keeps an emptied buffer (an early message's, or one an owned receive handed over and
    /// its reader gave back, [`Pair::recycle`](super::Pair::recycle)) for reuse while the
    /// spares stay within their bounds.
    pub(crate) fn recycle(&mut self, data: Vec<u8>) {
        let held: usize = self.spare.iter().map(Vec::capacity).sum();
        if data.capacity() > 0 && self.spare.len() < SPARE_BUFFERS && held + data.capacity() <= self.budget {
            self.spare.push(data);
        }
    }
}

/// Fails a posted receive with `err`, unless another pair has claimed it (a receive from any
/// whose message is arriving elsewhere: that pair finishes it).
fn fail(op: &RecvOp, err: Error) {
    if op.done.try_claim() {
        op.done.complete(Err(err));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Completion, RecvBuf, SEQUENCED, SinkRef};
    use crate::types::Call;
    use proptest::prelude::*;

    fn key(tag: u64) -> Key {
        Key { group: 0, tag }
    }

    fn seq_key(family: u64, seq: u32) -> Key {
        Key { group: 0, tag: SEQUENCED | (family << 32) | u64::from(seq) }
    }

    fn header(k: Key, len: usize) -> Header {
        Header { key: k, desc: OpDesc::P2P, len: len as u64 }
    }

    /// Moves a whole payload where `d` says (what a backend does with the bytes).
    fn feed(m: &mut Matcher, d: Dispatch, payload: &[u8]) {
        match d {
            Dispatch::Deliver(mut del) => {
                del.dst().copy_from_slice(payload);
                del.advance(payload.len());
                assert!(del.is_full());
                del.finish(1);
            }
            Dispatch::Early(mut rx) => {
                assert_eq!(rx.extend(payload), payload.len());
                m.early_arrived(rx);
            }
            Dispatch::Discard => {}
            Dispatch::Stall => panic!("stalled"),
        }
    }

    /// A message arrives whole.
    fn arrive(m: &mut Matcher, h: Header, payload: &[u8]) {
        let d = m.incoming(h);
        feed(m, d, payload);
    }

    fn recv(k: Key, buf: &mut [u8]) -> (RecvOp, Arc<Completion>) {
        let done = Completion::new();
        (
            RecvOp {
                key: k,
                desc: OpDesc::P2P,
                target: RecvTarget::Upto(RecvBuf::from_slice(buf)),
                done: done.clone(),
            },
            done,
        )
    }

    #[test]
    fn a_posted_receive_takes_the_message_directly_and_an_early_one_from_the_buffer() {
        let mut m = Matcher::new(0, 1, 1024);
        let mut a = [0u8; 4];
        let (op, done) = recv(key(1), &mut a);
        m.post(op).unwrap();
        assert!(done.outcome().is_none(), "queued");
        let d = m.incoming(header(key(1), 3));
        assert!(matches!(d, Dispatch::Deliver(_)));
        feed(&mut m, d, b"abc");
        assert_eq!(done.outcome().unwrap().unwrap(), Done { peer: 1, len: 3 });
        assert_eq!(&a[..3], b"abc");
        // Early: held, then handed over when posted; the budget is freed.
        let d = m.incoming(header(key(2), 4));
        feed(&mut m, d, b"wxyz");
        assert_eq!(m.early_bytes(), 4 + EARLY_OVERHEAD);
        let mut b = [0u8; 4];
        let (op, done) = recv(key(2), &mut b);
        m.post(op).unwrap();
        assert_eq!(done.outcome().unwrap().unwrap().len, 4);
        assert_eq!(&b, b"wxyz");
        assert_eq!(m.early_bytes(), 0);
    }

    #[test]
    fn beyond_the_budget_a_message_stalls_until_a_receive_is_posted() {
        let mut m = Matcher::new(0, 1, 100);
        arrive(&mut m, header(key(1), 6), b"123456");
        assert!(matches!(m.incoming(header(key(1), 6)), Dispatch::Stall));
        let mut a = [0u8; 6];
        let (op, _done) = recv(key(1), &mut a);
        m.post(op).unwrap(); // takes the early one, frees the budget
        assert!(matches!(m.incoming(header(key(1), 6)), Dispatch::Early(_)));
    }

    #[test]
    fn a_held_key_waits_for_its_receive_with_budget_to_spare_and_others_go_early() {
        let mut m = Matcher::new(0, 1, 1 << 20);
        m.hold(key(7));
        assert!(matches!(m.incoming(header(key(7), 6)), Dispatch::Stall), "held, not copied aside");
        assert!(matches!(m.incoming(header(key(8), 6)), Dispatch::Early(_)), "another key goes early");
        let mut got = Vec::new();
        let mut sink = |b: &[u8]| got.extend_from_slice(b);
        let done = Completion::new();
        // SAFETY: `sink` outlives the receive, which completes below.
        let target = RecvTarget::Sink(unsafe { SinkRef::new(&mut sink, 6) });
        m.post(RecvOp { key: key(7), desc: OpDesc::P2P, target, done: done.clone() }).unwrap();
        let Dispatch::Deliver(mut d) = m.incoming(header(key(7), 6)) else { panic!("not delivered") };
        d.put(b"abc");
        d.put(b"defXYZ");
        assert!(d.is_full());
        d.finish(1);
        assert_eq!(done.outcome().unwrap().unwrap(), Done { peer: 1, len: 6 });
        assert_eq!(got, b"abcdef", "handed over in order, no more than the message");
    }

    #[test]
    fn empty_messages_cost_budget_too() {
        let mut m = Matcher::new(0, 1, 10 * EARLY_OVERHEAD);
        let mut held = 0;
        while !matches!(m.incoming(header(key(1), 0)), Dispatch::Stall) {
            held += 1;
            assert!(held <= 10, "an unbounded number of empty messages was held");
        }
        assert_eq!(held, 10);
    }

    #[test]
    fn owned_receives_get_a_buffer_of_the_message_length() {
        let mut m = Matcher::new(0, 1, 1024);
        let done = Completion::new();
        let op = RecvOp { key: key(5), desc: OpDesc::P2P, target: RecvTarget::Owned { max: 100 }, done: done.clone() };
        m.post(op).unwrap();
        let d = m.incoming(header(key(5), 10));
        feed(&mut m, d, b"0123456789");
        assert_eq!(done.take_payload().unwrap(), b"0123456789");
        // Early, then owned: the early buffer itself is handed over.
        arrive(&mut m, header(key(5), 3), b"abc");
        let done = Completion::new();
        let op = RecvOp { key: key(5), desc: OpDesc::P2P, target: RecvTarget::Owned { max: 2 }, done: done.clone() };
        m.post(op).unwrap();
        let e = done.outcome().unwrap().unwrap_err();
        assert!(e.to_string().contains("at most 2"), "{e}");
    }

    #[test]
    fn an_owned_receive_reuses_a_buffer_given_back_and_spares_stay_within_the_budget() {
        let mut m = Matcher::new(0, 1, 1024);
        let owned = |m: &mut Matcher, payload: &[u8]| {
            let done = Completion::new();
            let target = RecvTarget::Owned { max: 1 << 20 };
            let op = RecvOp { key: key(5), desc: OpDesc::P2P, target, done: done.clone() };
            m.post(op).unwrap();
            let d = m.incoming(header(key(5), payload.len()));
            feed(m, d, payload);
            done.take_payload().unwrap()
        };
        let first = owned(&mut m, &[7; 300]);
        let at = first.as_ptr();
        m.recycle(first);
        // A shorter message goes into the same memory, cut to its length, all its bytes its own.
        let second = owned(&mut m, &[9; 200]);
        assert_eq!((second.as_ptr(), &second[..]), (at, &[9u8; 200][..]));
        m.recycle(second);
        // A longer one than any spare gets a new buffer; the spare stays for later.
        let third = owned(&mut m, &[1; 500]);
        assert_ne!(third.as_ptr(), at);
        assert_eq!(third, [1u8; 500]);
        // Spares never hold more than the budget: this one would pass it, and is dropped.
        m.recycle(third);
        m.recycle(vec![0; 600]);
        let held: usize = m.spare.iter().map(Vec::capacity).sum();
        assert!(held <= 1024, "{held} bytes of spares for a budget of 1024");
        // A small message does not take a spare many times its size: it stays for a large one.
        let mut m = Matcher::new(0, 1, 1 << 20);
        m.recycle(Vec::with_capacity(200_000));
        let small = owned(&mut m, &[3; 10]);
        assert_eq!((small.len(), small.capacity() < 200_000, m.spare.len()), (10, true, 1));
        let large = owned(&mut m, &[4; 150_000]);
        assert_eq!((large.capacity() >= 200_000, m.spare.len()), (true, 0));
    }

    #[test]
    fn a_different_call_is_a_mismatch_in_words_and_the_payload_is_dropped() {
        let mut m = Matcher::new(0, 1, 1024);
        let mine = OpDesc::new(Call::Allreduce).dtype(crate::DType::F32).count(1000).reduce(1);
        let theirs = mine.count(1001);
        let done = Completion::new();
        let mut buf = [0u8; 4000];
        let op = RecvOp {
            key: key(1),
            desc: mine,
            target: RecvTarget::Exact(RecvBuf::from_slice(&mut buf)),
            done: done.clone(),
        };
        m.post(op).unwrap();
        assert!(matches!(m.incoming(Header { key: key(1), desc: theirs, len: 4004 }), Dispatch::Discard));
        let e = done.outcome().unwrap().unwrap_err();
        assert_eq!(
            e.to_string(),
            "the ranks disagree: rank 1 called allreduce with 1001 f32 elements, rank 0 with 1000"
        );
    }

    #[test]
    fn sequences_that_disagree_fail_the_receive_and_drop_stale_messages() {
        let mut m = Matcher::new(0, 1, 1024);
        let mut a = [0u8; 1];
        let (op, done) = recv(seq_key(7, 4), &mut a);
        m.post(op).unwrap();
        assert!(matches!(m.incoming(header(seq_key(7, 3), 1)), Dispatch::Discard), "an older sequence is stale");
        assert!(matches!(done.outcome(), Some(Err(Error::Mismatch { .. }))));
        // Another group's sequence numbers are independent.
        let mut b = [0u8; 1];
        let (op, done) = recv(seq_key(7, 9), &mut b);
        m.post(op).unwrap();
        let other = Key { group: 5, tag: seq_key(7, 2).tag };
        assert!(matches!(m.incoming(header(other, 1)), Dispatch::Early(_)));
        assert!(done.outcome().is_none());
    }

    #[test]
    fn closing_fails_posted_receives_but_early_messages_stay_receivable() {
        let mut m = Matcher::new(0, 1, 1024);
        arrive(&mut m, header(key(1), 2), b"hi");
        let mut a = [0u8; 2];
        let (op, pending) = recv(key(9), &mut a);
        m.post(op).unwrap();
        let err = Error::PeerClosed { rank: 1, op: String::new(), detail: "EOF".into() };
        m.close(&err);
        assert!(matches!(pending.outcome(), Some(Err(Error::PeerClosed { .. }))));
        let mut b = [0u8; 2];
        let (op, done) = recv(key(1), &mut b);
        m.post(op).unwrap();
        assert!(done.outcome().unwrap().is_ok());
        let mut c = [0u8; 2];
        let (op, _) = recv(key(1), &mut c);
        assert!(m.post(op).is_err());
    }

    #[test]
    fn aborting_a_group_leaves_the_others_alone() {
        let mut m = Matcher::new(0, 1, 1024);
        let (g1, g2) = (Key { group: 1, tag: 3 }, Key { group: 2, tag: 3 });
        arrive(&mut m, header(g1, 2), b"xx");
        let mut a = [0u8; 2];
        let (op, in_g1) = recv(g1, &mut a);
        let mut a2 = [0u8; 2];
        let (op2, in_g2) = recv(g2, &mut a2);
        // The early message of group 1 satisfies the first post; queue a second one.
        m.post(op).unwrap();
        let (op, waiting_g1) = recv(g1, &mut a);
        m.post(op).unwrap();
        m.post(op2).unwrap();
        let err = Error::Aborted { rank: 1, reason: "stop".into() };
        m.abort_group(1, &err);
        assert!(in_g1.outcome().unwrap().is_ok());
        assert!(matches!(waiting_g1.outcome(), Some(Err(Error::Aborted { .. }))));
        assert!(in_g2.outcome().is_none());
        assert!(matches!(m.incoming(header(g1, 1)), Dispatch::Discard));
        assert!(matches!(m.incoming(header(g2, 2)), Dispatch::Deliver(_)));
        assert!(m.refusal(1).is_some() && m.refusal(2).is_none());
    }

    #[test]
    fn a_message_of_an_aborted_group_still_coming_in_gives_its_budget_back() {
        let mut m = Matcher::new(0, 1, 1024);
        let g = Key { group: 4, tag: 1 };
        let Dispatch::Early(mut rx) = m.incoming(header(g, 10)) else { panic!("expected an early message") };
        m.abort_group(4, &Error::Aborted { rank: 0, reason: "done".into() });
        rx.extend(&[0u8; 10]);
        m.early_arrived(rx);
        assert_eq!(m.early_bytes(), 0);
    }

    #[test]
    fn failing_a_pair_leaves_a_receive_from_any_that_another_pair_claimed_to_that_pair() {
        let mut m = Matcher::new(0, 1, 1024);
        let mut a = [0u8; 4];
        let done = Completion::for_pairs(2);
        let op = RecvOp {
            key: key(1),
            desc: OpDesc::P2P,
            target: RecvTarget::Upto(RecvBuf::from_slice(&mut a)),
            done: done.clone(),
        };
        m.post(op).unwrap();
        assert!(done.try_claim(), "another pair claims it");
        m.close(&Error::PeerClosed { rank: 1, op: String::new(), detail: "EOF".into() });
        assert!(done.outcome().is_none(), "the claiming pair finishes it, not this one");
    }

    proptest! {
        /// Any interleaving of arrivals and posts: the j-th receive of a key gets the j-th
        /// message of that key, whole; the early budget is never exceeded; a stalled message
        /// goes on once a receive is posted.
        #[test]
        fn receives_get_their_key_s_messages_in_order_within_the_budget(
            msgs in proptest::collection::vec((0u64..3, 0usize..40), 1..40),
            order in proptest::collection::vec(any::<bool>(), 0..120),
            budget in 0usize..400,
        ) {
            let mut m = Matcher::new(0, 1, budget);
            let payload = |i: usize, len: usize| -> Vec<u8> { (0..len).map(|j| (i * 31 + j) as u8).collect() };
            let mut bufs: Vec<Box<[u8; 64]>> = (0..msgs.len()).map(|_| Box::new([0u8; 64])).collect();
            let mut posts_of: Vec<Vec<(usize, Arc<Completion>)>> = vec![Vec::new(); 3];
            let (mut next_msg, mut next_post) = (0, 0);
            // Receives are posted in message order per key, one per message, to random keys' turns.
            let post_order: Vec<usize> = (0..msgs.len()).collect();
            let mut stalled = false;
            let mut steps = order.into_iter().chain(std::iter::repeat_n(true, 200)).chain(std::iter::repeat_n(false, 200));
            while next_msg < msgs.len() || next_post < msgs.len() {
                let arrive = steps.next().unwrap_or(false);
                if arrive && next_msg < msgs.len() && !stalled {
                    let (k, len) = msgs[next_msg];
                    match m.incoming(header(key(k), len)) {
                        Dispatch::Stall => stalled = true,
                        d => { feed(&mut m, d, &payload(next_msg, len)); next_msg += 1; }
                    }
                } else if next_post < msgs.len() {
                    let i = post_order[next_post];
                    let k = msgs[i].0;
                    let (op, done) = recv(key(k), &mut bufs[i][..]);
                    m.post(op).unwrap();
                    posts_of[k as usize].push((i, done));
                    next_post += 1;
                    stalled = false;
                } else if stalled {
                    prop_assert!(false, "stalled with every receive posted");
                }
                prop_assert!(m.early_bytes() <= budget);
            }
            // Per key, the j-th receive (in post order) got the j-th message of that key.
            for k in 0..3u64 {
                let want: Vec<usize> = (0..msgs.len()).filter(|&i| msgs[i].0 == k).collect();
                for ((slot, done), &msg) in posts_of[k as usize].iter().zip(&want) {
                    let got = done.outcome().expect("finished").expect("no error");
                    let len = msgs[msg].1;
                    prop_assert_eq!(got.len, len);
                    prop_assert_eq!(&bufs[*slot][..len], &payload(msg, len)[..]);
                }
            }
        }
    }
}
