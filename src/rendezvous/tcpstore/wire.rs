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

    /// The low `width` bytes of `v`, little-endian.
    fn int(&mut self, v: u64, width: usize) -> Result<(), Self::Error> {
        self.put(&v.to_le_bytes()[..width])
    }

    /// A key or value: its `u64` length, then its bytes.
    fn bytes(&mut self, b: &[u8]) -> Result<(), Self::Error> {
        self.int(b.len() as u64, 8)?;
        self.put(b)
    }

    /// A count, then each key or value.
    fn list<B: AsRef<[u8]>>(&mut self, items: &[B]) -> Result<(), Self::Error> {
        self.int(items.len() as u64, 8)?;
        items.iter().try_for_each(|b| self.bytes(b.as_ref()))
    }
}

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

/// The low `bytes.len()` bytes of an integer, little-endian.
fn le(bytes: &[u8]) -> u64 {
    bytes.iter().rev().fold(0, |v, &b| (v << 8) | u64::from(b))
}

/// A field of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// An opcode, or a one-byte answer.
    U8,
    U32,
    /// A `u64` or an `i64`.
    U64,
    /// The number of entries that follow, checked against the limit.
    Count,
    /// A `u64` length and that many bytes, checked against the key limit.
    Key,
    /// A `u64` length and that many bytes, checked against the value limit.
    Value,
}

impl Field {
    /// Bytes of the field's fixed part (a key's or value's length).
    fn width(self) -> usize {
        match self {
            Field::U8 => 1,
            Field::U32 => 4,
            Field::U64 | Field::Count | Field::Key | Field::Value => 8,
        }
    }
}

/// How a message is laid out: fixed fields, then, when `group` is not empty, that many groups
/// of fields as `count` says, or else the last fixed field (a [`Field::Count`]).
struct Layout {
    /// The message's name, for errors.
    name: &'static str,
    head: &'static [Field],
    group: &'static [Field],
    count: Option<u64>,
}

impl Layout {
    /// The field after `items`, or none when the message is whole.
    fn next(&self, items: &[Item]) -> Option<Field> {
        if let Some(f) = self.head.get(items.len()) {
            return Some(*f);
        }
        let count = match (self.count, self.head.len().checked_sub(1).and_then(|i| items.get(i))) {
            (Some(n), _) => n,
            (None, Some(Item::Int(n))) => *n,
            _ => 0,
        };
        let i = (items.len() - self.head.len()) as u64;
        let len = self.group.len() as u64;
        (i < count.saturating_mul(len)).then(|| self.group[(i % len) as usize])
    }
}

/// A field read whole.
#[derive(Debug)]
enum Item {
    Int(u64),
    Bytes(Vec<u8>),
}

/// The fields of one message as its bytes arrive: those read whole, and what there is of the
/// one being read.
#[derive(Default)]
struct Fields {
    items: Vec<Item>,
    /// The fixed part of the field being read (an integer, or a key's or value's length).
    head: [u8; 8],
    have: usize,
    /// The bytes of the key or value being read, and the length it will have.
    body: Option<(Vec<u8>, usize)>,
    /// Bytes of keys and values so far, announced ones included.
    total: usize,
    /// Where in `items` the last key is, for errors about its value.
    key: Option<usize>,
}

/// How far a message got.
enum Progress {
    /// Whole, taking this many bytes of the input.
    Whole(usize),
    /// Not whole; the input is used up and at least this many more bytes are needed.
    More(usize),
}

impl Fields {
    /// Reads the fields `layout` calls for from `input`, until the message is whole or the
    /// input used up.
    fn read(
        &mut self,
        input: &[u8],
        limits: &Limits,
        layout: impl Fn(&[Item]) -> Result<Layout, WireError>,
    ) -> Result<Progress, WireError> {
        let mut used = 0;
        loop {
            let layout = layout(&self.items)?;
            let Some(field) = layout.next(&self.items) else { return Ok(Progress::Whole(used)) };
            let need = match &self.body {
                Some((body, len)) => len - body.len(),
                None => field.width() - self.have,
            };
            if used == input.len() {
                return Ok(Progress::More(need));
            }
            let chunk = &input[used..used + need.min(input.len() - used)];
            used += chunk.len();
            if let Some((body, len)) = &mut self.body {
                body.extend_from_slice(chunk);
                if body.len() == *len
                    && let Some((body, _)) = self.body.take()
                {
                    self.push(field, Item::Bytes(body));
                }
                continue;
            }
            self.head[self.have..self.have + chunk.len()].copy_from_slice(chunk);
            self.have += chunk.len();
            if self.have < field.width() {
                continue;
            }
            let v = le(&self.head[..self.have]);
            self.have = 0;
            match field {
                Field::Key | Field::Value => match self.announced(field, v, limits, layout.name)? {
                    0 => self.push(field, Item::Bytes(Vec::new())),
                    len => self.body = Some((Vec::new(), len)),
                },
                Field::Count if v > limits.keys as u64 => {
                    let (max, message) = (limits.keys, limits.message);
                    return Err(self.limit(
                        layout.name,
                        false,
                        format!("{v} keys in one {message}, over the limit of {max}"),
                    ));
                }
                _ => self.items.push(Item::Int(v)),
            }
        }
    }

    /// Checks the length `v` of a key or value against the limits, and counts it.
    fn announced(&mut self, field: Field, v: u64, limits: &Limits, name: &'static str) -> Result<usize, WireError> {
        let (what, max) = if field == Field::Key { ("key", limits.key) } else { ("value", limits.value) };
        let value = field == Field::Value;
        if v > max as u64 {
            return Err(self.limit(name, value, format!("a {what} of {v} bytes, over the limit of {max}")));
        }
        let (n, total) = (v as usize, self.total.saturating_add(v as usize));
        if total > limits.total {
            let (max, message) = (limits.total, limits.message);
            return Err(self.limit(
                name,
                value,
                format!("a {what} of {n} bytes makes {total} bytes in one {message}, over the limit of {max}"),
            ));
        }
        self.total = total;
        Ok(n)
    }

    /// A limit broken by message `name`, naming the last key when it is about its value.
    fn limit(&self, name: &'static str, value: bool, detail: String) -> WireError {
        let key = match self.key.and_then(|i| self.items.get(i)) {
            Some(Item::Bytes(k)) if value => Some(k.clone()),
            _ => None,
        };
        WireError { op: name, key, detail, limit: true }
    }

    fn push(&mut self, field: Field, item: Item) {
        if field == Field::Key {
            self.key = Some(self.items.len());
        }
        self.items.push(item);
    }

    /// The fields of the message just read whole, leaving none for the next.
    fn take(&mut self) -> Taken {
        self.total = 0;
        self.key = None;
        Taken(std::mem::take(&mut self.items).into_iter())
    }
}

/// The fields of a whole message, taken in order. Its layout made them, so each is of the
/// kind asked for.
struct Taken(std::vec::IntoIter<Item>);

impl Taken {
    fn int(&mut self) -> u64 {
        match self.0.next() {
            Some(Item::Int(v)) => v,
            _ => 0,
        }
    }

    fn bytes(&mut self) -> Vec<u8> {
        match self.0.next() {
            Some(Item::Bytes(b)) => b,
            _ => Vec::new(),
        }
    }

    /// A count, then that many keys or values.
    fn list(&mut self) -> Vec<Vec<u8>> {
        let n = self.int();
        (0..n).map(|_| self.bytes()).collect()
    }

    /// The keys or values that are left.
    fn rest(self) -> Vec<Vec<u8>> {
        self.0.filter_map(|i| if let Item::Bytes(b) = i { Some(b) } else { None }).collect()
    }
}

/// A request's name and layout (after its opcode), or none for an opcode we do not serve.
fn request_layout(op: u8) -> Option<(&'static str, &'static [Field], &'static [Field])> {
    use Field::{Count, Key, U8, U32, U64, Value};
    Some(match op {
        VALIDATE => ("VALIDATE", &[U8, U32], &[]),
        SET => ("SET", &[U8, Key, Value], &[]),
        COMPARE_SET => ("COMPARE_SET", &[U8, Key, Value, Value], &[]),
        GET => ("GET", &[U8, Key], &[]),
        ADD => ("ADD", &[U8, Key, U64], &[]),
        CHECK => ("CHECK", &[U8, Count], &[Key]),
        WAIT => ("WAIT", &[U8, Count], &[Key]),
        GETNUMKEYS => ("GETNUMKEYS", &[U8], &[]),
        DELETE_KEY => ("DELETE_KEY", &[U8, Key], &[]),
        APPEND => ("APPEND", &[U8, Key, Value], &[]),
        MULTI_GET => ("MULTI_GET", &[U8, Count], &[Key]),
        MULTI_SET => ("MULTI_SET", &[U8, Count], &[Key, Value]),
        CANCEL_WAIT => ("CANCEL_WAIT", &[U8], &[]),
        PING => ("PING", &[U8, U32], &[]),
        LIST_KEYS => ("LIST_KEYS", &[U8], &[]),
        _ => return None,
    })
}

fn unknown(op: u64) -> WireError {
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
        request_layout(self.op()).map_or("request", |(name, ..)| name)
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
        p.put(&[self.op()])?;
        match self {
            Request::Validate { magic: n } | Request::Ping { nonce: n } => p.int(u64::from(*n), 4),
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
                p.int(*delta as u64, 8)
            }
            Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => p.list(keys),
            Request::MultiSet { pairs } => {
                p.int(pairs.len() as u64, 8)?;
                pairs.iter().try_for_each(|(k, v)| {
                    p.bytes(k.as_ref())?;
                    p.bytes(v.as_ref())
                })
            }
            Request::GetNumKeys | Request::CancelWait | Request::ListKeys => Ok(()),
        }
    }
}

impl Request {
    /// The request from its fields (`t`, opcode first), read whole.
    fn build(mut t: Taken) -> Result<Self, WireError> {
        let op = t.int();
        Ok(match u8::try_from(op).map_err(|_| unknown(op))? {
            VALIDATE => Request::Validate { magic: t.int() as u32 },
            SET => Request::Set { key: t.bytes(), value: t.bytes() },
            COMPARE_SET => Request::CompareSet { key: t.bytes(), expected: t.bytes(), desired: t.bytes() },
            GET => Request::Get { key: t.bytes() },
            ADD => Request::Add { key: t.bytes(), delta: t.int() as i64 },
            CHECK => Request::Check { keys: t.list() },
            WAIT => Request::Wait { keys: t.list() },
            GETNUMKEYS => Request::GetNumKeys,
            DELETE_KEY => Request::DeleteKey { key: t.bytes() },
            APPEND => Request::Append { key: t.bytes(), value: t.bytes() },
            MULTI_GET => Request::MultiGet { keys: t.list() },
            MULTI_SET => {
                let n = t.int();
                Request::MultiSet { pairs: (0..n).map(|_| (t.bytes(), t.bytes())).collect() }
            }
            CANCEL_WAIT => Request::CancelWait,
            PING => Request::Ping { nonce: t.int() as u32 },
            LIST_KEYS => Request::ListKeys,
            _ => return Err(unknown(op)),
        })
    }
}

/// Decodes the requests a server is sent, one after another, from bytes as they arrive.
pub(super) struct RequestDecoder {
    fields: Fields,
    limits: Limits,
}

impl RequestDecoder {
    /// A decoder with the server's limits: a key of at most 8 KiB, a value of at most 8 MiB,
    /// at most 131,072 keys and 64 MiB of keys and values in one request.
    pub(super) fn new() -> Self {
        RequestDecoder { fields: Fields::default(), limits: Limits::REQUEST }
    }

    /// The opcode of the request being read, once read.
    pub(super) fn op(&self) -> Option<u8> {
        match self.fields.items.first() {
            Some(Item::Int(op)) => Some(*op as u8),
            _ => None,
        }
    }

    /// Takes `input`, the bytes that follow those given before.
    pub(super) fn decode(&mut self, input: &[u8]) -> Result<Decoded<Request>, WireError> {
        let layout = |items: &[Item]| match items.first() {
            None => Ok(Layout { name: "request", head: &[Field::U8], group: &[], count: None }),
            Some(Item::Int(op)) => match u8::try_from(*op).ok().and_then(request_layout) {
                Some((name, head, group)) => Ok(Layout { name, head, group, count: None }),
                None => Err(unknown(*op)),
            },
            Some(Item::Bytes(_)) => Err(unknown(u64::MAX)),
        };
        Ok(match self.fields.read(input, &self.limits, layout)? {
            Progress::More(n) => Decoded::NeedMore(n),
            Progress::Whole(used) => Decoded::Done(Request::build(self.fields.take())?, used),
        })
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
            Response::Pong(n) => p.int(u64::from(*n), 4),
            Response::Value(v) => p.bytes(v.as_ref()),
            Response::Int(n) => p.int(*n as u64, 8),
            Response::Check(ready) => p.put(&[if *ready { READY } else { NOT_READY }]),
            Response::WaitDone => p.put(&[STOP_WAITING]),
            Response::WaitCanceled => p.put(&[WAIT_CANCELED]),
            Response::Values(values) => values.iter().try_for_each(|v| p.bytes(v.as_ref())),
            Response::Keys(keys) => p.list(keys),
        }
    }
}

/// Decodes one reply of a known shape from bytes as they arrive.
pub(super) struct ResponseDecoder {
    fields: Fields,
    shape: Shape,
}

impl ResponseDecoder {
    /// A decoder of the reply to a request of `shape`, taking at most 64 MiB of values.
    pub(super) fn new(shape: Shape) -> Self {
        ResponseDecoder { fields: Fields::default(), shape }
    }

    /// Takes `input`, the bytes that follow those given before.
    pub(super) fn decode(&mut self, input: &[u8]) -> Result<Decoded<Response>, WireError> {
        use Field::{Count, Key, U8, U32, U64, Value};
        let (head, group, count): (&'static [Field], &'static [Field], _) = match self.shape {
            Shape::Pong => (&[U32], &[], None),
            Shape::Value => (&[Value], &[], None),
            Shape::Int => (&[U64], &[], None),
            Shape::Check | Shape::Wait => (&[U8], &[], None),
            Shape::Values(n) => (&[], &[Value], Some(n as u64)),
            Shape::Keys => (&[Count], &[Key], None),
        };
        let layout = |_: &[Item]| Ok(Layout { name: "reply", head, group, count });
        let used = match self.fields.read(input, &Limits::REPLY, layout)? {
            Progress::More(n) => return Ok(Decoded::NeedMore(n)),
            Progress::Whole(used) => used,
        };
        let mut t = self.fields.take();
        let byte = |t: &mut Taken, ok: [(u8, Response); 2], what: &str| {
            let b = t.int();
            let [(b0, r0), (b1, r1)] = ok;
            match u8::try_from(b) {
                Ok(x) if x == b0 => Ok(r0),
                Ok(x) if x == b1 => Ok(r1),
                _ => Err(malformed("reply", format!("{b} answers {what} (expected {b0} or {b1})"))),
            }
        };
        let r = match self.shape {
            Shape::Pong => Response::Pong(t.int() as u32),
            Shape::Value => Response::Value(t.bytes()),
            Shape::Int => Response::Int(t.int() as i64),
            Shape::Check => {
                byte(&mut t, [(READY, Response::Check(true)), (NOT_READY, Response::Check(false))], "a CHECK")?
            }
            Shape::Wait => {
                byte(&mut t, [(STOP_WAITING, Response::WaitDone), (WAIT_CANCELED, Response::WaitCanceled)], "a WAIT")?
            }
            Shape::Values(_) => Response::Values(t.rest()),
            Shape::Keys => Response::Keys(t.list()),
        };
        Ok(Decoded::Done(r, used))
    }
}

#[cfg(test)]
mod tests;
