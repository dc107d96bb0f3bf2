//! The handshake's messages, their statuses, and their encodings through the one
//! [`codec`](super::codec) (the layout is in the [module documentation](super)).

use super::codec::{BufMutExt, Codec, DecodeError, Decoded, Reader};
use crate::transport::ContextId;
use bytes::BufMut;

/// "FGLO" in little-endian.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"FGLO");
/// Wire protocol version; both sides must agree. (2: two TCP connections per pair; 3: frame
/// headers with a group and a call descriptor; 4: one handshake for every backend, nonces and
/// proofs both ways, payloads after the proofs; 5: shared-memory collectives write into
/// peers' memory, a single-copy allgather publishes its output, the copy plan has 8 words.)
pub(crate) const VERSION: u16 = 5;
/// Longest payload a side may carry: nothing a stranger sends sizes a larger allocation.
pub(crate) const MAX_PAYLOAD: usize = 1024;
/// Bytes of a [`Hello`] and of a [`Challenge`].
pub(crate) const HELLO_LEN: usize = 56;
pub(crate) const CHALLENGE_LEN: usize = 56;
/// Bytes of a [`Sealed`] message before its payload, and of its MAC.
pub(crate) const SEALED_HEAD: usize = 10;
pub(crate) const MAC_LEN: usize = 32;
/// The longest message.
pub(crate) const MAX_MESSAGE: usize = SEALED_HEAD + MAX_PAYLOAD + MAC_LEN;

/// The hello's flag: the connector uses a shared secret.
const FLAG_SECRET: u8 = 1;

/// Which message (byte 6 of every message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Type {
    Hello = 1,
    Challenge = 2,
    Proof = 3,
    Welcome = 4,
    Ready = 5,
}

impl Type {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Type::Hello,
            2 => Type::Challenge,
            3 => Type::Proof,
            4 => Type::Welcome,
            5 => Type::Ready,
            _ => return None,
        })
    }
}

/// Which backend a handshake opens a connection of: a TCP listener answers only TCP hellos,
/// not an ibverbs endpoint's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum BackendKind {
    Tcp = 1,
    Shm = 2,
    Ibverbs = 3,
}

impl BackendKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => BackendKind::Tcp,
            2 => BackendKind::Shm,
            3 => BackendKind::Ibverbs,
            _ => return None,
        })
    }

    /// Whether the acceptor hands the connector a payload: the handshake then goes on after
    /// the connector's proof with the acceptor's welcome and the connector's ready (see the
    /// [module documentation](super)). A TCP handshake ends with the proof.
    pub(crate) fn welcomes(self) -> bool {
        !matches!(self, BackendKind::Tcp)
    }

    /// How many connections a pair of this backend has (a hello names one by its lane).
    pub(crate) fn lanes(self) -> u8 {
        match self {
            BackendKind::Tcp => 2,
            BackendKind::Shm | BackendKind::Ibverbs => 1,
        }
    }
}

/// A side's verdict, which the other side can put in words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Status {
    Ok = 0,
    UnknownContext = 1,
    BadRank = 2,
    Duplicate = 3,
    SecretMismatch = 4,
    /// A proof of the secret did not check.
    WrongSecret = 5,
    /// The hello is for another backend.
    WrongBackend = 6,
    /// The backends' settings differ (a payload the other side cannot work with).
    Settings = 7,
    /// The side could not set up its part of the connection.
    Unavailable = 8,
}

impl Status {
    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::UnknownContext,
            2 => Status::BadRank,
            3 => Status::Duplicate,
            4 => Status::SecretMismatch,
            5 => Status::WrongSecret,
            6 => Status::WrongBackend,
            7 => Status::Settings,
            8 => Status::Unavailable,
            _ => return None,
        })
    }

    /// The reason, as the side that was refused reads it.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Status::Ok => "accepted",
            Status::UnknownContext => "the peer has no context with this id (a stale or foreign rendezvous)",
            Status::BadRank => "the ranks or world size do not fit the peer's context",
            Status::Duplicate => "the peer already has a connection for this pair",
            Status::SecretMismatch => {
                "one side uses a shared secret and the other does not (every rank of a job needs the job's \
                 secret: ferrogloo-run and --np hand it to the ranks they start in FERROGLOO_SECRET_FILE)"
            }
            Status::WrongSecret => {
                "the proof of the shared secret did not check: the secrets differ (ferrogloo-run and --np \
                 make one per job, so parts of one job started by separate launchers need one file named by \
                 FERROGLOO_SECRET_FILE for all of them)"
            }
            Status::WrongBackend => "the peer's endpoint belongs to another transport",
            Status::Settings => "the two sides' transport settings differ (e.g. shared-memory segment sizes)",
            Status::Unavailable => "the peer could not set up its side of the connection",
        }
    }
}

/// Writes the 8 bytes every message starts with.
fn write_head<B: BufMut>(out: &mut B, ty: Type, code: u8) {
    out.write(MAGIC);
    out.write(VERSION);
    out.write(ty as u8);
    out.write(code);
}

/// Reads the 8 bytes every message starts with; returns the type and its code.
fn read_head(r: &mut Reader<'_>) -> Decoded<(Type, u8)> {
    let magic: u32 = r.get()?;
    if magic != MAGIC {
        return Err(DecodeError::malformed(format!("bad magic {magic:#010x} (not a ferrogloo peer)")));
    }
    let version: u16 = r.get()?;
    if version != VERSION {
        return Err(DecodeError::malformed(format!("protocol version {version}, this side speaks {VERSION}")));
    }
    let ty: u8 = r.get()?;
    let ty = Type::from_u8(ty).ok_or_else(|| DecodeError::malformed(format!("unknown handshake message {ty}")))?;
    Ok((ty, r.get()?))
}

/// Reads the head of a message of type `want`; returns its code.
fn expect_head(r: &mut Reader<'_>, want: Type) -> Decoded<u8> {
    let (ty, code) = read_head(r)?;
    if ty != want {
        return Err(DecodeError::malformed(format!("a {ty:?} message where a {want:?} was due")));
    }
    Ok(code)
}

fn status(code: u8) -> Decoded<Status> {
    Status::from_u8(code).ok_or_else(|| DecodeError::malformed(format!("unknown handshake status {code}")))
}

/// The connector's opening: who it is, whom it wants, and its fresh nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The connector uses a shared secret.
    pub(crate) secret: bool,
    pub(crate) kind: BackendKind,
    /// Which of the pair's connections this is (below the backend's [`BackendKind::lanes`]).
    pub(crate) lane: u8,
    pub(crate) ctx: ContextId,
    pub(crate) from: u32,
    pub(crate) to: u32,
    pub(crate) size: u32,
    pub(crate) nonce: [u8; 16],
}

impl Codec for Hello {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        r.require(HELLO_LEN)?;
        let flags = expect_head(r, Type::Hello)?;
        if flags & !FLAG_SECRET != 0 {
            return Err(DecodeError::malformed(format!("unknown handshake flags {flags:#x}")));
        }
        let kind: u8 = r.get()?;
        let kind = BackendKind::from_u8(kind)
            .ok_or_else(|| DecodeError::malformed(format!("unknown backend kind {kind} in a hello")))?;
        let lane = r.get()?;
        if lane >= kind.lanes() {
            return Err(DecodeError::malformed(format!("lane {lane} of a {kind:?} pair (it has {})", kind.lanes())));
        }
        r.reserved(2, "a hello")?;
        Ok(Hello {
            secret: flags & FLAG_SECRET != 0,
            kind,
            lane,
            ctx: r.get()?,
            from: r.get()?,
            to: r.get()?,
            size: r.get()?,
            nonce: r.get()?,
        })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        write_head(out, Type::Hello, if self.secret { FLAG_SECRET } else { 0 });
        out.write(self.kind as u8);
        out.write(self.lane);
        out.write([0u8; 2]);
        out.write(self.ctx);
        out.write(self.from);
        out.write(self.to);
        out.write(self.size);
        out.write(self.nonce);
    }
}

/// The acceptor's answer to a hello: its verdict, its fresh nonce and its proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub(crate) status: Status,
    pub(crate) nonce: [u8; 16],
    pub(crate) mac: [u8; 32],
}

impl Codec for Challenge {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        r.require(CHALLENGE_LEN)?;
        let status = status(expect_head(r, Type::Challenge)?)?;
        Ok(Challenge { status, nonce: r.get()?, mac: r.get()? })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        write_head(out, Type::Challenge, self.status as u8);
        out.write(self.nonce);
        out.write(self.mac);
    }
}

/// A payload sealed by a MAC over the whole transcript: the connector's proof ([`Type::Proof`],
/// status always [`Status::Ok`]), the acceptor's welcome and the connector's ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sealed {
    pub(crate) ty: Type,
    pub(crate) status: Status,
    pub(crate) payload: Vec<u8>,
    pub(crate) mac: [u8; 32],
}

impl Sealed {
    /// Reads a sealed message of type `ty`.
    pub(crate) fn read(r: &mut Reader<'_>, ty: Type) -> Decoded<Self> {
        r.require(SEALED_HEAD)?;
        let status = status(expect_head(r, ty)?)?;
        if ty == Type::Proof && status != Status::Ok {
            return Err(DecodeError::malformed("a proof with a status"));
        }
        let n = usize::from(r.get::<u16>()?);
        if n > MAX_PAYLOAD {
            return Err(DecodeError::malformed(format!("a handshake payload of {n} bytes (at most {MAX_PAYLOAD})")));
        }
        r.require(n + MAC_LEN)?;
        Ok(Sealed { ty, status, payload: r.bytes(n)?.to_vec(), mac: r.get()? })
    }
}

/// Any handshake message (what the fuzz target decodes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    Hello(Hello),
    Challenge(Challenge),
    Sealed(Sealed),
}

impl Codec for Message {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        r.require(8)?;
        let (ty, _) = read_head(&mut r.clone())?;
        Ok(match ty {
            Type::Hello => Message::Hello(r.get()?),
            Type::Challenge => Message::Challenge(r.get()?),
            ty => Message::Sealed(Sealed::read(r, ty)?),
        })
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        match self {
            Message::Hello(h) => h.encode(out),
            Message::Challenge(c) => c.encode(out),
            Message::Sealed(s) => s.encode(out),
        }
    }
}

impl Codec for Sealed {
    fn decode(r: &mut Reader<'_>) -> Decoded<Self> {
        match r.get::<Message>()? {
            Message::Sealed(s) => Ok(s),
            other => Err(DecodeError::malformed(format!("a {other:?} where a sealed message was due"))),
        }
    }

    fn encode<B: BufMut>(&self, out: &mut B) {
        write_head(out, self.ty, self.status as u8);
        out.write_u16_prefixed(&self.payload);
        out.write(self.mac);
    }
}
