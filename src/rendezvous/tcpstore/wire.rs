//! The TCPStore wire protocol without I/O: the one [`Request`] and [`Response`] pair that the
//! client and the server both speak, their encoders, and decoders that take bytes as they
//! arrive and answer "need more", a whole message, or a [`WireError`] naming what is wrong.
//!
//! A message is a run of fields, integers little-endian: a request is a one-byte opcode and the
//! fields its opcode calls for; a reply has no header, so its decoder is told which request it
//! answers ([`Shape`]). A key or a value is a `u64` length and its bytes; a list is a `u64`
//! count and its entries (a MULTI_GET reply's count is that of its request's keys). A decoder
//! checks a length or a count against its limits as soon as it arrives, before the bytes it
//! announces: nothing is allocated for what a peer only announces.
//!
//! Fields are read with the crate's codec ([`crate::codec`]). A message is read in parts — what
//! comes before its list, then each entry of the list — and a part whose bytes straddle reads
//! is held until the codec no longer finds it short; it asks for exactly the bytes it misses,
//! so a part never takes bytes of the next.

use crate::codec::{Codec, DecodeError, Reader};
use std::convert::Infallible;
use std::io::Write;

/// VALIDATE's magic number.
pub(super) const MAGIC: u32 = 0x3C85_F7CE;
pub(super) const VALIDATE: u8 = 0;
pub(super) const SET: u8 = 1;
pub(super) const COMPARE_SET: u8 = 2;
pub(super) const GET: u8 = 3;
pub(super) const ADD: u8 = 4;
pub(super) const CHECK: u8 = 5;
pub(super) const WAIT: u8 = 6;
pub(super) const GETNUMKEYS: u8 = 7;
pub(super) const DELETE_KEY: u8 = 8;
pub(super) const APPEND: u8 = 9;
pub(super) const MULTI_GET: u8 = 10;
pub(super) const MULTI_SET: u8 = 11;
pub(super) const CANCEL_WAIT: u8 = 12;
pub(super) const PING: u8 = 13;
pub(super) const LIST_KEYS: u8 = 17;
const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;

/// The largest key and value the server takes (PyTorch's libuv server's limits; a value made by
/// APPEND too), and the most keys in one request.
const MAX_KEY: usize = 8192;
pub(super) const MAX_VALUE: usize = 8 << 20;
const MAX_KEYS: usize = 131_072;
/// Most bytes of keys and values one request to the server may carry (a MULTI_SET, the keys of a
/// WAIT or a MULTI_GET): 64 MiB. The server holds a request whole before it applies it.
const MAX_REQUEST: usize = 64 << 20;
/// Most bytes of keys and values in one reply the client takes: 64 MiB.
const MAX_REPLY: usize = 64 << 20;

/// What a decoder takes at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limits {
    /// Bytes of one key.
    key: usize,
    /// Bytes of one value.
    value: usize,
    /// Entries of one list.
    keys: usize,
    /// Bytes of keys and values in one message.
    total: usize,
    /// The message, in words: "request" or "reply".
    message: &'static str,
}

impl Limits {
    /// A request to the server.
    const REQUEST: Limits =
        Limits { key: MAX_KEY, value: MAX_VALUE, keys: MAX_KEYS, total: MAX_REQUEST, message: "request" };
    /// A reply to the client. A list entry costs at least its 8-byte length, so no more fit.
    const REPLY: Limits =
        Limits { key: MAX_REPLY, value: MAX_REPLY, keys: MAX_REPLY / 8, total: MAX_REPLY, message: "reply" };
}

/// A request, from a client to the server. `B` holds keys and values: owned when decoded,
/// borrowed when the client builds one to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Request<B = Vec<u8>> {
    /// VALIDATE (0): a connection's first request, [`MAGIC`]; no reply.
    Validate { magic: u32 },
    /// SET (1); no reply.
    Set { key: B, value: B },
    /// COMPARE_SET (2): sets `key` to `desired` if it holds `expected` (or is missing and
    /// `expected` is empty); answered with the value it holds afterwards (`expected` when it
    /// is missing and stays so).
    CompareSet { key: B, expected: B, desired: B },
    /// GET (3): answered with the value (empty when missing).
    Get { key: B },
    /// ADD (4): answered with the new value.
    Add { key: B, delta: i64 },
    /// CHECK (5): answered with whether every key exists.
    Check { keys: Vec<B> },
    /// WAIT (6): answered once every key exists, or when the client cancels the wait.
    Wait { keys: Vec<B> },
    /// GETNUMKEYS (7): answered with the number of keys.
    GetNumKeys,
    /// DELETE_KEY (8): answered with 1 when the key existed, else 0.
    DeleteKey { key: B },
    /// APPEND (9): adds `value` to the end of the key's value; no reply.
    Append { key: B, value: B },
    /// MULTI_GET (10): answered with each key's value in turn.
    MultiGet { keys: Vec<B> },
    /// MULTI_SET (11); no reply.
    MultiSet { pairs: Vec<(B, B)> },
    /// CANCEL_WAIT (12): takes back a pending WAIT; answered WAIT_CANCELED (after the WAIT's
    /// own STOP_WAITING when the keys came first).
    CancelWait,
    /// PING (13): answered with `nonce`.
    Ping { nonce: u32 },
    /// LIST_KEYS (17): answered with every key.
    ListKeys,
}

/// The kind of reply a request gets, which a reply's decoder is told: replies have no header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    /// PING's: a `u32`.
    Pong,
    /// GET's and COMPARE_SET's: a value.
    Value,
    /// ADD's, DELETE_KEY's and GETNUMKEYS's: an `i64`.
    Int,
    /// CHECK's: READY or NOT_READY.
    Check,
    /// WAIT's and CANCEL_WAIT's: STOP_WAITING or WAIT_CANCELED.
    Wait,
    /// MULTI_GET's: this many values, no count.
    Values(usize),
    /// LIST_KEYS's: an `i64` count and the keys.
    Keys,
}

/// A reply, from the server to a client. `B` holds values: owned when decoded, shared with the
/// server's entries when it writes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Response<B = Vec<u8>> {
    /// To PING: its nonce.
    Pong(u32),
    /// To GET or COMPARE_SET.
    Value(B),
    /// To ADD, DELETE_KEY or GETNUMKEYS.
    Int(i64),
    /// To CHECK: whether every key exists.
    Check(bool),
    /// To WAIT: STOP_WAITING, every key exists.
    WaitDone,
    /// To WAIT or CANCEL_WAIT: WAIT_CANCELED.
    WaitCanceled,
    /// To MULTI_GET: each key's value (a missing key's empty).
    Values(Vec<B>),
    /// To LIST_KEYS.
    Keys(Vec<B>),
}

/// What a decoder found in the bytes it was given.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decoded<T> {
    /// Every byte given was taken and the message is not whole: at least this many more are
    /// needed (never more than the rest of the message, so a reader may read exactly that many).
    NeedMore(usize),
    /// A whole message, and how many of the bytes given it took (the rest begin the next one).
    Done(T, usize),
}

/// Bytes that are not the protocol, or that break a limit. The connection they came on cannot
/// go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct WireError {
    /// The message: a request's name ("SET"), "request" before its opcode is known, or "reply".
    pub(super) op: &'static str,
    /// The key a value belongs to, when it was read.
    pub(super) key: Option<Vec<u8>>,
    /// What is wrong, with the sizes.
    pub(super) detail: String,
    /// Whether a limit was broken (else the bytes are no message of the protocol).
    pub(super) limit: bool,
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.key {
            Some(k) => write!(f, "{} of key {}: {}", self.op, show(k), self.detail),
            None => write!(f, "{}: {}", self.op, self.detail),
        }
    }
}

/// A key for messages: quoted, cut at 100 characters.
pub(super) fn show(key: &[u8]) -> String {
    let s = String::from_utf8_lossy(key);
    if s.chars().count() > 100 { format!("{:?}...", s.chars().take(100).collect::<String>()) } else { format!("{s:?}") }
}

fn malformed(op: &'static str, detail: String) -> WireError {
    WireError { op, key: None, detail, limit: false }
}

/// Where an encoder puts its bytes: a buffer, which never fails, or a writer.
trait Put {
    type Error;
    fn put(&mut self, b: &[u8]) -> Result<(), Self::Error>;

    /// An integer field.
    fn int(&mut self, v: impl Int) -> Result<(), Self::Error> {
        let mut b = [0u8; 8];
        let left = {
            let mut w = &mut b[..];
            v.encode(&mut w);
            w.len()
        };
        self.put(&b[..8 - left])
    }

    /// A key or value: its `u64` length, then its bytes.
    fn bytes(&mut self, b: &[u8]) -> Result<(), Self::Error> {
        self.int(b.len() as u64)?;
        self.put(b)
    }

    /// A count, then each key or value.
    fn list<B: AsRef<[u8]>>(&mut self, items: &[B]) -> Result<(), Self::Error> {
        self.int(items.len() as u64)?;
        items.iter().try_for_each(|b| self.bytes(b.as_ref()))
    }
}

/// The integers of the protocol's fields: at most 8 bytes each.
trait Int: Codec {}
impl Int for u8 {}
impl Int for u32 {}
impl Int for u64 {}
impl Int for i64 {}

impl Put for Vec<u8> {
    type Error = Infallible;
    fn put(&mut self, b: &[u8]) -> Result<(), Infallible> {
        self.extend_from_slice(b);
        Ok(())
    }
}

/// A writer, as somewhere to put bytes.
struct Writer<W>(W);

impl<W: Write> Put for Writer<W> {
    type Error = std::io::Error;
    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.0.write_all(b)
    }
}

/// Why a part of a message does not decode.
enum Fail {
    /// It is cut short: at least this many more bytes are needed, and it takes that many more.
    Short(usize),
    /// It is not the protocol, or breaks a limit.
    Wire(WireError),
}

impl From<DecodeError> for Fail {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Short(n) => Fail::Short(n),
            // The fields read here are integers and bytes, which are never malformed.
            DecodeError::Malformed(what) => Fail::Wire(malformed("message", what)),
        }
    }
}

impl From<WireError> for Fail {
    fn from(e: WireError) -> Self {
        Fail::Wire(e)
    }
}

/// The limits of the message being read, and what of them it used so far.
#[derive(Debug, Clone, Copy)]
struct Budget {
    limits: Limits,
    /// The message's name, for errors: the request's name once its opcode is read.
    name: &'static str,
    /// Bytes of keys and values so far, announced ones included.
    total: usize,
}

impl Budget {
    /// A message named `name`, before any of its bytes.
    fn new(limits: Limits, name: &'static str) -> Self {
        Budget { limits, name, total: 0 }
    }

    /// A `u64` count of keys, checked against the limit.
    fn count(&self, r: &mut Reader<'_>) -> Result<u64, Fail> {
        let n = r.get::<u64>()?;
        let (max, message) = (self.limits.keys, self.limits.message);
        if n > max as u64 {
            return Err(self.limit(None, format!("{n} keys in one {message}, over the limit of {max}")));
        }
        Ok(n)
    }

    /// A key: its `u64` length, checked against the limits before its bytes, then its bytes.
    fn key(&mut self, r: &mut Reader<'_>) -> Result<Vec<u8>, Fail> {
        self.bytes(r, "key", self.limits.key, None)
    }

    /// A value, likewise; a limit it breaks names `key`.
    fn value(&mut self, r: &mut Reader<'_>, key: Option<&[u8]>) -> Result<Vec<u8>, Fail> {
        self.bytes(r, "value", self.limits.value, key)
    }

    fn bytes(&mut self, r: &mut Reader<'_>, what: &str, max: usize, key: Option<&[u8]>) -> Result<Vec<u8>, Fail> {
        let v = r.get::<u64>()?;
        if v > max as u64 {
            return Err(self.limit(key, format!("a {what} of {v} bytes, over the limit of {max}")));
        }
        let (n, total) = (v as usize, self.total.saturating_add(v as usize));
        if total > self.limits.total {
            let (max, message) = (self.limits.total, self.limits.message);
            return Err(self.limit(
                key,
                format!("a {what} of {n} bytes makes {total} bytes in one {message}, over the limit of {max}"),
            ));
        }
        self.total = total;
        Ok(r.bytes(n)?.to_vec())
    }

    /// A limit broken, naming `key` when it is about its value.
    fn limit(&self, key: Option<&[u8]>, detail: String) -> Fail {
        Fail::Wire(WireError { op: self.name, key: key.map(<[u8]>::to_vec), detail, limit: true })
    }
}

/// What reading one part of a message found.
enum Step<T> {
    /// The part, and how many bytes of the input it took.
    Got(T, usize),
    /// The input is used up, and the part needs at least this many more bytes.
    More(usize),
}

/// One message as its bytes arrive: the message read so far, with how many entries of its
/// list are still to come, and the bytes of a part that straddles inputs.
struct Reading<M> {
    read: Option<(M, u64)>,
    /// The bytes of the part being read, when it began in an earlier input (else empty).
    held: Vec<u8>,
    /// The bytes the held part needs at least.
    need: usize,
    /// The budget of the message: what its parts read whole used of it.
    budget: Budget,
    /// A new message's budget.
    fresh: Budget,
}

impl<M> Reading<M> {
    fn new(budget: Budget) -> Self {
        Reading { read: None, held: Vec::new(), need: 0, budget, fresh: budget }
    }

    /// Reads a message from `input`: with `head` what comes before its list (the message,
    /// with its list empty, and how many entries it has), then with `entry` each entry (which
    /// adds it to the message as its last step, once nothing it reads can be short).
    fn decode(
        &mut self,
        input: &[u8],
        mut head: impl FnMut(&mut Reader<'_>, &mut Budget) -> Result<(M, u64), Fail>,
        mut entry: impl FnMut(&mut M, &mut Reader<'_>, &mut Budget) -> Result<(), Fail>,
    ) -> Result<Decoded<M>, WireError> {
        let mut used = 0;
        loop {
            let (mut m, left) = match self.read.take() {
                Some(read) => read,
                None => match self.part(&input[used..], &mut head)? {
                    Step::Got(read, n) => {
                        used += n;
                        read
                    }
                    Step::More(n) => return Ok(Decoded::NeedMore(n)),
                },
            };
            if left == 0 {
                self.budget = self.fresh;
                return Ok(Decoded::Done(m, used));
            }
            let step = self.part(&input[used..], |r, b| entry(&mut m, r, b))?;
            let left = match step {
                Step::Got((), n) => {
                    used += n;
                    left - 1
                }
                Step::More(_) => left,
            };
            self.read = Some((m, left));
            if let Step::More(n) = step {
                return Ok(Decoded::NeedMore(n));
            }
        }
    }

    /// Reads one part with `parse`, from the held bytes and `input`: when the part is short,
    /// all of the input is its, and is held.
    fn part<T>(
        &mut self,
        input: &[u8],
        mut parse: impl FnMut(&mut Reader<'_>, &mut Budget) -> Result<T, Fail>,
    ) -> Result<Step<T>, WireError> {
        let budget = self.budget;
        let mut attempt = |bytes: &[u8]| {
            let (mut b, mut r) = (budget, Reader::new(bytes));
            match parse(&mut r, &mut b) {
                Ok(t) => Ok(Ok((t, bytes.len() - r.remaining(), b))),
                Err(Fail::Short(n)) => Ok(Err(n)),
                Err(Fail::Wire(e)) => Err(e),
            }
        };
        if self.held.is_empty() {
            return Ok(match attempt(input)? {
                Ok((t, used, b)) => {
                    self.budget = b;
                    Step::Got(t, used)
                }
                Err(n) => {
                    self.held.extend_from_slice(input);
                    self.need = n;
                    Step::More(n)
                }
            });
        }
        let mut used = 0;
        loop {
            // Only the bytes the part needs, so that it never takes bytes of the next.
            let take = self.need.min(input.len() - used);
            self.held.extend_from_slice(&input[used..used + take]);
            used += take;
            if take < self.need {
                self.need -= take;
                return Ok(Step::More(self.need));
            }
            match attempt(&self.held)? {
                Ok((t, _, b)) => {
                    self.budget = b;
                    self.held = Vec::new();
                    return Ok(Step::Got(t, used));
                }
                Err(n) => self.need = n,
            }
        }
    }
}

/// A request's name, or none for an opcode we do not serve.
fn request_name(op: u8) -> Option<&'static str> {
    Some(match op {
        VALIDATE => "VALIDATE",
        SET => "SET",
        COMPARE_SET => "COMPARE_SET",
        GET => "GET",
        ADD => "ADD",
        CHECK => "CHECK",
        WAIT => "WAIT",
        GETNUMKEYS => "GETNUMKEYS",
        DELETE_KEY => "DELETE_KEY",
        APPEND => "APPEND",
        MULTI_GET => "MULTI_GET",
        MULTI_SET => "MULTI_SET",
        CANCEL_WAIT => "CANCEL_WAIT",
        PING => "PING",
        LIST_KEYS => "LIST_KEYS",
        _ => return None,
    })
}

fn unknown(op: u8) -> WireError {
    malformed("request", format!("unknown opcode {op} (not a TCPStore request this server serves)"))
}

impl<B> Request<B> {
    /// The opcode.
    pub(super) fn op(&self) -> u8 {
        match self {
            Request::Validate { .. } => VALIDATE,
            Request::Set { .. } => SET,
            Request::CompareSet { .. } => COMPARE_SET,
            Request::Get { .. } => GET,
            Request::Add { .. } => ADD,
            Request::Check { .. } => CHECK,
            Request::Wait { .. } => WAIT,
            Request::GetNumKeys => GETNUMKEYS,
            Request::DeleteKey { .. } => DELETE_KEY,
            Request::Append { .. } => APPEND,
            Request::MultiGet { .. } => MULTI_GET,
            Request::MultiSet { .. } => MULTI_SET,
            Request::CancelWait => CANCEL_WAIT,
            Request::Ping { .. } => PING,
            Request::ListKeys => LIST_KEYS,
        }
    }

    /// The name, as PyTorch calls it ("SET").
    pub(super) fn name(&self) -> &'static str {
        request_name(self.op()).unwrap_or("request")
    }

    /// The kind of reply it gets; none for VALIDATE, SET, APPEND and MULTI_SET.
    pub(super) fn shape(&self) -> Option<Shape> {
        Some(match self {
            Request::Validate { .. } | Request::Set { .. } | Request::Append { .. } | Request::MultiSet { .. } => {
                return None;
            }
            Request::Ping { .. } => Shape::Pong,
            Request::CompareSet { .. } | Request::Get { .. } => Shape::Value,
            Request::Add { .. } | Request::GetNumKeys | Request::DeleteKey { .. } => Shape::Int,
            Request::Check { .. } => Shape::Check,
            Request::Wait { .. } | Request::CancelWait => Shape::Wait,
            Request::MultiGet { keys } => Shape::Values(keys.len()),
            Request::ListKeys => Shape::Keys,
        })
    }
}

impl<B: AsRef<[u8]>> Request<B> {
    /// Appends the request's bytes to `out`.
    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        let Ok(()) = self.put(out);
    }

    fn put<P: Put>(&self, p: &mut P) -> Result<(), P::Error> {
        p.int(self.op())?;
        match self {
            Request::Validate { magic: n } | Request::Ping { nonce: n } => p.int(*n),
            Request::Set { key, value: v } | Request::Append { key, value: v } => {
                p.bytes(key.as_ref())?;
                p.bytes(v.as_ref())
            }
            Request::CompareSet { key, expected, desired } => {
                p.bytes(key.as_ref())?;
                p.bytes(expected.as_ref())?;
                p.bytes(desired.as_ref())
            }
            Request::Get { key } | Request::DeleteKey { key } => p.bytes(key.as_ref()),
            Request::Add { key, delta } => {
                p.bytes(key.as_ref())?;
                p.int(*delta)
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => p.list(keys),
            Request::MultiSet { pairs } => {
                p.int(pairs.len() as u64)?;
                pairs.iter().try_for_each(|(k, v)| {
                    p.bytes(k.as_ref())?;
                    p.bytes(v.as_ref())
                })
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => Ok(()),
        }
    }
}

/// What comes before a request's list: the request, with its list empty, and how many
/// entries the list has.
fn request_head(r: &mut Reader<'_>, b: &mut Budget) -> Result<(Request, u64), Fail> {
    let op = r.get::<u8>()?;
    b.name = request_name(op).ok_or_else(|| unknown(op))?;
    let list = |b: &mut Budget, r: &mut Reader<'_>| b.count(r);
    Ok(match op {
        VALIDATE => (Request::Validate { magic: r.get()? }, 0),
        SET | APPEND => {
            let key = b.key(r)?;
            let value = b.value(r, Some(&key))?;
            (if op == SET { Request::Set { key, value } } else { Request::Append { key, value } }, 0)
        }
        COMPARE_SET => {
            let key = b.key(r)?;
            let expected = b.value(r, Some(&key))?;
            let desired = b.value(r, Some(&key))?;
            (Request::CompareSet { key, expected, desired }, 0)
        }
        GET => (Request::Get { key: b.key(r)? }, 0),
        ADD => (Request::Add { key: b.key(r)?, delta: r.get()? }, 0),
        CHECK => (Request::Check { keys: Vec::new() }, list(b, r)?),
        WAIT => (Request::Wait { keys: Vec::new() }, list(b, r)?),
        GETNUMKEYS => (Request::GetNumKeys, 0),
        DELETE_KEY => (Request::DeleteKey { key: b.key(r)? }, 0),
        MULTI_GET => (Request::MultiGet { keys: Vec::new() }, list(b, r)?),
        MULTI_SET => (Request::MultiSet { pairs: Vec::new() }, list(b, r)?),
        CANCEL_WAIT => (Request::CancelWait, 0),
        PING => (Request::Ping { nonce: r.get()? }, 0),
        LIST_KEYS => (Request::ListKeys, 0),
        _ => return Err(unknown(op).into()),
    })
}

/// An entry of a request's list, added to it.
fn request_entry(req: &mut Request, r: &mut Reader<'_>, b: &mut Budget) -> Result<(), Fail> {
    match req {
        Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => keys.push(b.key(r)?),
        Request::MultiSet { pairs } => {
            let key = b.key(r)?;
            let value = b.value(r, Some(&key))?;
            pairs.push((key, value));
        }
        // No other request has a list, so none has entries to read.
        _ => {}
    }
    Ok(())
}

/// Decodes the requests a server is sent, one after another, from bytes as they arrive.
pub(super) struct RequestDecoder {
    reading: Reading<Request>,
}

impl RequestDecoder {
    /// A decoder with the server's limits: a key of at most 8 KiB, a value of at most 8 MiB,
    /// at most 131,072 keys and 64 MiB of keys and values in one request.
    pub(super) fn new() -> Self {
        Self::with_limits(Limits::REQUEST)
    }

    fn with_limits(limits: Limits) -> Self {
        RequestDecoder { reading: Reading::new(Budget::new(limits, "request")) }
    }

    /// The opcode of the request being read, once read.
    pub(super) fn op(&self) -> Option<u8> {
        match &self.reading.read {
            Some((req, _)) => Some(req.op()),
            None => self.reading.held.first().copied(),
        }
    }

    /// Takes `input`, the bytes that follow those given before.
    pub(super) fn decode(&mut self, input: &[u8]) -> Result<Decoded<Request>, WireError> {
        self.reading.decode(input, request_head, request_entry)
    }
}

impl<B> Response<B> {
    /// The kind of reply it is.
    #[cfg(test)]
    fn shape(&self) -> Shape {
        match self {
            Response::Pong(_) => Shape::Pong,
            Response::Value(_) => Shape::Value,
            Response::Int(_) => Shape::Int,
            Response::Check(_) => Shape::Check,
            Response::WaitDone | Response::WaitCanceled => Shape::Wait,
            Response::Values(v) => Shape::Values(v.len()),
            Response::Keys(_) => Shape::Keys,
        }
    }
}

impl<B: AsRef<[u8]>> Response<B> {
    /// Writes the reply to `w`, values from where `B` holds them (nothing is copied first).
    pub(super) fn write_to(&self, w: impl Write) -> std::io::Result<()> {
        self.put(&mut Writer(w))
    }

    fn put<P: Put>(&self, p: &mut P) -> Result<(), P::Error> {
        match self {
            Response::Pong(n) => p.int(*n),
            Response::Value(v) => p.bytes(v.as_ref()),
            Response::Int(n) => p.int(*n),
            Response::Check(ready) => p.int(if *ready { READY } else { NOT_READY }),
            Response::WaitDone => p.int(STOP_WAITING),
            Response::WaitCanceled => p.int(WAIT_CANCELED),
            Response::Values(values) => values.iter().try_for_each(|v| p.bytes(v.as_ref())),
            Response::Keys(keys) => p.list(keys),
        }
    }
}

/// A one-byte answer: the reply of the two it may be, else a protocol error about `what`.
fn answer(r: &mut Reader<'_>, [(b0, r0), (b1, r1)]: [(u8, Response); 2], what: &str) -> Result<Response, Fail> {
    match r.get::<u8>()? {
        x if x == b0 => Ok(r0),
        x if x == b1 => Ok(r1),
        x => Err(malformed("reply", format!("{x} answers {what} (expected {b0} or {b1})")).into()),
    }
}

/// Decodes one reply of a known shape from bytes as they arrive.
pub(super) struct ResponseDecoder {
    reading: Reading<Response>,
    shape: Shape,
}

impl ResponseDecoder {
    /// A decoder of the reply to a request of `shape`, taking at most 64 MiB of values.
    pub(super) fn new(shape: Shape) -> Self {
        ResponseDecoder { reading: Reading::new(Budget::new(Limits::REPLY, "reply")), shape }
    }

    /// Takes `input`, the bytes that follow those given before.
    pub(super) fn decode(&mut self, input: &[u8]) -> Result<Decoded<Response>, WireError> {
        let shape = self.shape;
        let head = |r: &mut Reader<'_>, b: &mut Budget| {
            Ok(match shape {
                Shape::Pong => (Response::Pong(r.get()?), 0),
                Shape::Value => (Response::Value(b.value(r, None)?), 0),
                Shape::Int => (Response::Int(r.get()?), 0),
                Shape::Check => {
                    (answer(r, [(READY, Response::Check(true)), (NOT_READY, Response::Check(false))], "a CHECK")?, 0)
                }
                Shape::Wait => (
                    answer(r, [(STOP_WAITING, Response::WaitDone), (WAIT_CANCELED, Response::WaitCanceled)], "a WAIT")?,
                    0,
                ),
                Shape::Values(n) => (Response::Values(Vec::new()), n as u64),
                Shape::Keys => (Response::Keys(Vec::new()), b.count(r)?),
            })
        };
        let entry = |resp: &mut Response, r: &mut Reader<'_>, b: &mut Budget| {
            match resp {
                Response::Values(values) => values.push(b.value(r, None)?),
                Response::Keys(keys) => keys.push(b.key(r)?),
                // No other reply has a list.
                _ => {}
            }
            Ok(())
        };
        self.reading.decode(input, head, entry)
    }
}

#[cfg(test)]
mod tests;
