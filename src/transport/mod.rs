//! The transport contract: what a backend is, and what every backend promises.
//!
//! A *backend* ([`Backend`]) is what a [`Device`](crate::device::Device) is made of: TCP
//! ([`tcp`]), ranks as threads of one process ([`memory`]), shared memory ([`shm`]) and
//! ibverbs ([`ibverbs`], RDMA). The [`Context`](crate::Context) and the algorithms know only this module; a new
//! backend is a folder here plus a line in `tests/transport_contract.rs`.
//!
//! # Forming a mesh
//!
//! For each context a backend makes an [`Endpoint`] (given the context id rank 0 chose, the
//! rank, the size and an optional shared secret). The endpoint's [`address`](Endpoint::address)
//! is an opaque blob that the context publishes in the store; a peer hands that blob to its own
//! endpoint's [`connect`](Endpoint::connect). The higher rank of each pair connects to the
//! lower one, which [waits](Endpoint::wait_connected) for it. A connect either succeeds, fails
//! for a reason worth retrying (a listener not up yet: [`ConnectError::Retry`]), or is refused
//! by an endpoint that does not know the context id (a stale entry of an earlier job:
//! [`ConnectError::Refused`]). Backends whose pairs cross a socket run the one
//! [`handshake`] on it (context, ranks, version, and the shared secret proved both ways before
//! either side hands over what its pair needs). Once every peer is connected,
//! [`finish`](Endpoint::finish) gives the [`Mesh`]: one [`Pair`] per peer and the [`Progress`]
//! engine that waits use.
//!
//! # Pairs
//!
//! A *pair* is the connection between this rank and one peer. Algorithms and point-to-point
//! calls talk to pairs only through [`Pair`]. A backend promises:
//!
//! 1. **Posting never blocks.** `post_send` and `post_recv` queue the operation and return at
//!    once; the backend completes it later (or right away) with [`Completion::complete`].
//! 2. **Ordering.** Two sends to one peer with the same [`Key`] are received in the order they
//!    were posted; a receive matches the oldest unmatched message with its key. Messages with
//!    different keys are independent.
//! 3. **Matching, checked.** A message matches a receive only if the key is equal; it then
//!    must carry the same [`OpDesc`] and fit the receive's [`RecvTarget`] (exactly the
//!    buffer's length, at most its capacity, or at most the limit of an owned receive). A
//!    difference completes the receive with [`Error::Mismatch`] saying in words what differs;
//!    the payload is discarded and the pair stays usable.
//! 4. **Zero copy when posted.** A message whose receive is already posted lands directly in
//!    the receive's buffer (an owned receive gets a buffer of the message's length, filled in
//!    place). A message that arrives first is held in a per-pair buffer of bounded size (the
//!    *early-arrival budget*); once that is full the backend stops taking the peer's messages
//!    until a matching receive is posted, so memory stays bounded.
//! 5. **Buffers.** The backend reads a send buffer and writes a receive buffer only between
//!    the post and the moment the completion is completed or [`Pair::cancel`] returns; never
//!    after. A buffer whose [`MemKind`] the backend cannot reach is refused with
//!    [`Error::Unsupported`] at post time.
//! 6. **Failure.** When the connection fails, every pending and future operation on the pair
//!    completes with an error naming the peer: [`Error::PeerClosed`] when the peer is gone (EOF,
//!    reset), [`Error::Io`] naming the peer when the path failed otherwise (unreachable, timed
//!    out); messages that arrived completely before the failure can still be received.
//! 7. **Sequenced tags.** A tag whose top two bits are `0b10` ([`SEQUENCED`]) belongs to the
//!    *family* of its top 32 bits and has the sequence number of its low 32 bits (collectives
//!    number their calls this way). Every rank sends a family's messages in sequence order, so
//!    a message of sequence `s'` while a receive of sequence `s != s'` of the same family and
//!    group waits on the same pair, or the reverse, proves the two ranks disagree (on the
//!    collective, root, count or order): the receive completes with [`Error::Mismatch`] at
//!    once, and a message of an earlier sequence than the receive is dropped.
//! 8. **Abort.** [`Pair::abort`] tells the peer why (an [`AbortCause`], best effort) and fails
//!    this side's operations of the group. For the mesh's own group (0) the pair then closes;
//!    the peer fails every pending and future operation on it with the cause turned back into
//!    an error ([`AbortCause::into_error`]). For a sub-group only that group's operations fail,
//!    on both sides, and the pair goes on serving the others. A message of the group already on
//!    its way (a send partly written, a payload partly read into its receive) finishes first,
//!    as a stream must.
//! 9. **Cancellation.** `cancel` removes a pending operation. If a send had already been partly
//!    written, the stream cannot continue, so the pair fails with [`Error::Protocol`].
//! 10. **Deadlines** are the waiter's: [`Progress::wait`] returns `None` at the deadline and the
//!     waiter cancels. A backend never blocks a poster or a waiter past the deadline it is given.
//!
//! A rank's messages to itself go through a loopback pair ([`memory::loopback`]) whatever the
//! backend, under the same rules.

pub(crate) mod auth;
pub(crate) mod auto;
pub(crate) mod handshake;
pub(crate) mod ibverbs;
pub(crate) mod matching;
pub(crate) mod memory;
pub(crate) mod shm;
pub(crate) mod tcp;
pub(crate) mod wake;

use crate::error::{Error, Result};
use crate::types::OpDesc;
use handshake::codec::{BufMutExt, DecodeError, Decoded, Reader};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A context id: random bytes chosen by rank 0 for one rendezvous, so that endpoints of an
/// earlier job are told apart from this one's.
pub(crate) type ContextId = [u8; 16];

/// Fresh random bytes for context ids and nonces.
pub(crate) fn random16() -> [u8; 16] {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        // No OS entropy (never seen on Linux): fall back to time, process id and a counter.
        // Context ids need uniqueness, which this keeps; nonces lose unpredictability.
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        b = (t ^ (u128::from(std::process::id()) << 64) ^ (u128::from(n) << 96)).to_le_bytes();
    }
    b
}

/// Which messages a receive takes: those of its group (the mesh's own context is group 0, a
/// sub-group has its own id) with its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub(crate) group: u64,
    pub(crate) tag: u64,
}

/// The top bits of a sequenced tag (contract rule 7).
pub(crate) const SEQUENCED: u64 = 2 << 62;

/// `(group, family, sequence)` of a key with a sequenced tag.
pub(crate) fn sequenced(key: Key) -> Option<(u64, u64, u32)> {
    (key.tag >> 62 == SEQUENCED >> 62).then_some((key.group, key.tag >> 32, key.tag as u32))
}

/// Whether sequence `a` comes after `b` (wrapping).
pub(crate) fn seq_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// The mismatch a sequenced message `got` from `peer` reports to a receive of rank `me`
/// waiting for `want`.
pub(crate) fn sequence_mismatch(me: usize, peer: usize, family: u64, want: u32, got: u32) -> Error {
    let (what, hint) = if seq_after(got, want) {
        ("has moved on to", format!("it finished that collective without sending what rank {me} expects"))
    } else {
        ("sent a message of the earlier", format!("rank {me} finished that collective without receiving it"))
    };
    Error::Mismatch {
        rank: peer,
        detail: format!(
            "while rank {me} waits in collective #{want} of tag {}, rank {peer} {what} collective #{got} ({hint}): \
             the ranks called different collectives, or disagree on roots, counts or order",
            family & 0x3fff_ffff
        ),
    }
}

/// Where a buffer's memory lives. Host memory is all there is today; device memory (a GPU's)
/// is described so that a backend can refuse it clearly now and take it later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// Ordinary memory of this process.
    Host,
    /// Memory of accelerator `ordinal` (no API produces it yet).
    #[allow(dead_code)]
    Device { ordinal: u32 },
}

impl MemKind {
    /// Refuses memory other than host memory, for a backend that reaches only that.
    pub(crate) fn require_host(self, backend: &str) -> Result<()> {
        match self {
            MemKind::Host => Ok(()),
            MemKind::Device { ordinal } => Err(Error::unsupported(
                format!("device memory (accelerator {ordinal}) on the {backend} transport"),
                None,
            )),
        }
    }
}

/// A send buffer lent to a backend: raw because the backend's I/O thread reads it while the
/// poster waits, with the lifetime guaranteed by the wait/cancel protocol (contract rule 5).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendBuf {
    pub(crate) ptr: *const u8,
    pub(crate) len: usize,
    pub(crate) mem: MemKind,
}

/// A receive buffer lent to a backend (see [`SendBuf`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvBuf {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) mem: MemKind,
}

// SAFETY: the buffers are plain memory; whoever posts one guarantees (contract rule 5) that it
// outlives the operation and that nothing else writes (SendBuf) or touches (RecvBuf) it
// meanwhile, so handing the pointer to the I/O thread is sound.
unsafe impl Send for SendBuf {}
// SAFETY: as for `Send` above.
unsafe impl Send for RecvBuf {}

impl SendBuf {
    pub(crate) fn from_slice(s: &[u8]) -> Self {
        SendBuf { ptr: s.as_ptr(), len: s.len(), mem: MemKind::Host }
    }

    /// A zero-length buffer (switch frames and the like).
    pub(crate) fn empty() -> Self {
        SendBuf { ptr: std::ptr::NonNull::<u8>::dangling().as_ptr().cast_const(), len: 0, mem: MemKind::Host }
    }
}

impl RecvBuf {
    pub(crate) fn from_slice(s: &mut [u8]) -> Self {
        RecvBuf { ptr: s.as_mut_ptr(), len: s.len(), mem: MemKind::Host }
    }
}

/// Where a receive puts its message.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RecvTarget {
    /// Into this buffer; the message must have exactly its length.
    Exact(RecvBuf),
    /// Into this buffer; the message may be shorter (its length is reported).
    Upto(RecvBuf),
    /// Into a buffer of the message's length that the backend allocates (at most `max` bytes)
    /// and hands over with the completion ([`Completion::take_payload`]).
    Owned { max: usize },
}

impl RecvTarget {
    /// The caller's buffer, when there is one.
    pub(crate) fn buf(&self) -> Option<RecvBuf> {
        match *self {
            RecvTarget::Exact(b) | RecvTarget::Upto(b) => Some(b),
            RecvTarget::Owned { .. } => None,
        }
    }

    /// Why a message of `len` bytes does not fit, if it does not.
    pub(crate) fn misfit(&self, len: u64) -> Option<String> {
        match *self {
            RecvTarget::Exact(b) if len != b.len as u64 => {
                Some(format!("a message of {len} bytes where the receive buffer holds exactly {}", b.len))
            }
            RecvTarget::Upto(b) if len > b.len as u64 => {
                Some(format!("a message of {len} bytes where the receive buffer holds at most {}", b.len))
            }
            RecvTarget::Owned { max } if len > max as u64 => {
                Some(format!("a message of {len} bytes where the receive takes at most {max}"))
            }
            _ => None,
        }
    }

    /// The memory the message lands in.
    pub(crate) fn mem(&self) -> MemKind {
        self.buf().map_or(MemKind::Host, |b| b.mem)
    }
}

/// Why a context was aborted, as it travels to the peers: kept structured so that every rank
/// reports the first cause (the rank that died, the rank that timed out), not "aborted".
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AbortCause {
    pub(crate) kind: CauseKind,
    /// The rank the cause started at (the one that called abort, timed out or saw a peer die).
    pub(crate) origin: usize,
    /// The rank the cause is about (the dead or disagreeing peer), when another than `origin`.
    pub(crate) subject: Option<usize>,
    /// The operation that failed ("allreduce", ...), or empty.
    pub(crate) op: String,
    /// The rest, in words.
    pub(crate) detail: String,
}

/// The kinds of [`AbortCause`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum CauseKind {
    /// [`Context::abort`](crate::Context::abort).
    User = 1,
    /// A peer's connection closed ([`Error::PeerClosed`]).
    PeerClosed = 2,
    /// An operation timed out.
    TimedOut = 3,
    /// Ranks disagreed ([`Error::Mismatch`]).
    Mismatch = 4,
    /// A protocol violation ([`Error::Protocol`]).
    Protocol = 5,
    /// Anything else.
    Other = 6,
}

/// Longest encoded abort cause.
pub(crate) const MAX_CAUSE: usize = 4096;

impl AbortCause {
    /// The cause `err` makes when rank `me` aborts because of it.
    pub(crate) fn of(err: &Error, me: usize) -> Self {
        let cause = |kind, origin, subject, op: &str, detail: &str| AbortCause {
            kind,
            origin,
            subject,
            op: op.to_string(),
            detail: detail.to_string(),
        };
        match err {
            Error::Aborted { rank, reason } => cause(CauseKind::User, *rank, None, "", reason),
            Error::PeerClosed { rank, op, detail } => cause(CauseKind::PeerClosed, me, Some(*rank), op, detail),
            Error::PeerTimedOut { rank, op, detail } => cause(CauseKind::TimedOut, *rank, None, op, detail),
            Error::Timeout { op, .. } => cause(CauseKind::TimedOut, me, None, op, &err.to_string()),
            Error::Mismatch { rank, detail } => cause(CauseKind::Mismatch, me, Some(*rank), "", detail),
            Error::Protocol { peer, detail } => cause(CauseKind::Protocol, me, *peer, "", detail),
            other => cause(CauseKind::Other, me, None, "", &other.to_string()),
        }
    }

    /// The error a rank reports when a peer aborts with this cause.
    pub(crate) fn into_error(self) -> Error {
        let AbortCause { kind, origin, subject, op, detail } = self;
        let reported = |detail: String| {
            if detail.contains("reported by rank") || subject.is_none_or(|s| s == origin) {
                detail
            } else {
                format!("{detail} (reported by rank {origin})")
            }
        };
        match kind {
            CauseKind::User => Error::Aborted { rank: origin, reason: detail },
            CauseKind::PeerClosed => {
                Error::PeerClosed { rank: subject.unwrap_or(origin), op, detail: reported(detail) }
            }
            CauseKind::TimedOut => Error::PeerTimedOut { rank: origin, op, detail },
            CauseKind::Mismatch => Error::Mismatch { rank: subject.unwrap_or(origin), detail: reported(detail) },
            CauseKind::Protocol => Error::Protocol { peer: Some(subject.unwrap_or(origin)), detail: reported(detail) },
            CauseKind::Other => Error::Aborted { rank: origin, reason: detail },
        }
    }

    /// `kind u8 | origin u32 | subject u32 (u32::MAX: none) | op length u16 | op | detail`,
    /// at most [`MAX_CAUSE`] bytes (the detail is cut at a character boundary).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MAX_CAUSE.min(11 + self.op.len() + self.detail.len()));
        b.write(self.kind as u8);
        b.write(self.origin as u32);
        b.write(self.subject.map_or(u32::MAX, |s| s as u32));
        b.write_u16_prefixed(truncate(&self.op, 256).as_bytes());
        b.extend_from_slice(truncate(&self.detail, MAX_CAUSE - b.len()).as_bytes());
        b
    }

    /// Decodes [`AbortCause::encode`]'s bytes; a malformed cause is an error message.
    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Self, String> {
        if b.len() < 11 || b.len() > MAX_CAUSE {
            return Err(format!("abort cause of {} bytes", b.len()));
        }
        let mut r = Reader::new(b);
        let read = |r: &mut Reader<'_>| -> Decoded<Self> {
            let kind = match r.get::<u8>()? {
                1 => CauseKind::User,
                2 => CauseKind::PeerClosed,
                3 => CauseKind::TimedOut,
                4 => CauseKind::Mismatch,
                5 => CauseKind::Protocol,
                6 => CauseKind::Other,
                k => return Err(DecodeError::malformed(format!("unknown abort cause kind {k}"))),
            };
            let origin = r.get::<u32>()? as usize;
            let subject = r.get::<u32>()?;
            let op = r.u16_prefixed(MAX_CAUSE, "an abort cause's operation name")?;
            Ok(AbortCause {
                kind,
                origin,
                subject: (subject != u32::MAX).then_some(subject as usize),
                op: String::from_utf8_lossy(op).into_owned(),
                detail: String::from_utf8_lossy(r.rest()).into_owned(),
            })
        };
        read(&mut r).map_err(|e| match e {
            DecodeError::Short(_) => "abort cause shorter than its operation name".to_string(),
            DecodeError::Malformed(why) => why,
        })
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends at a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A connection to one peer (see the module documentation for the contract).
pub(crate) trait Pair: Send + Sync {
    /// The peer's rank in the mesh.
    fn peer(&self) -> usize;

    /// Queues a send of `buf` with `key` and descriptor `desc`.
    ///
    /// # Safety
    /// `buf` must stay valid, and must not be written, until `done` is completed or
    /// [`Pair::cancel`] for `done` has returned.
    unsafe fn post_send(&self, key: Key, desc: OpDesc, buf: SendBuf, done: &Arc<Completion>) -> Result<()>;

    /// Queues a receive of the next message with `key` into `target`. Several pairs may be given
    /// the same `done` (receive from any of several peers, [`Completion::is_shared`]): the
    /// first message to claim it wins, and a pair writes into the buffer only once it has
    /// claimed it. A receive posted to one pair only is that pair's until it completes: the pair
    /// may write into its buffer before it knows which message is next (the TCP pair reads
    /// ahead).
    ///
    /// # Safety
    /// The target's buffer must stay valid, and must not be read or written by anyone else,
    /// until `done` is completed or [`Pair::cancel`] for `done` has returned on every pair it
    /// was posted to.
    unsafe fn post_recv(&self, key: Key, desc: OpDesc, target: RecvTarget, done: &Arc<Completion>) -> Result<()>;

    /// Gives up on `group`: tells the peer `cause` (best effort) and fails this side's pending
    /// and future operations of the group with `local`. Group 0 (the mesh's own context) closes
    /// the pair.
    fn abort(&self, group: u64, local: &Error, cause: &AbortCause);

    /// Withdraws every operation of `done` from this pair. After it returns the pair no longer
    /// touches that operation's buffer.
    fn cancel(&self, done: &Arc<Completion>);
}

/// How a waiting thread busy-waits before it sleeps in the kernel: for `budget`, spinning
/// when this rank has a core to itself (saves the wake-up of an idle core, tens of
/// microseconds on a VM), or yielding the CPU between tries when ranks share cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BusyWait {
    pub(crate) budget: Duration,
    pub(crate) yield_cpu: bool,
    /// The waiter is the only thread that waits on its mesh (the engine's idle wait): it may
    /// sleep long between looks, nobody else can take its wake-ups.
    pub(crate) alone: bool,
}

/// How a mesh's waits make progress: a backend may do the I/O of the pairs involved on the
/// waiting thread (see `tcp::progress`).
pub(crate) trait Progress: Send + Sync {
    /// Blocks until `done` finishes or `deadline` passes (`None`). `done` was posted to the
    /// pairs of the peers in `own`; `others` are peers whose pairs have other operations
    /// outstanding, which the wait may progress too. Busy-waits as `busy` says before it
    /// sleeps.
    fn wait(
        &self,
        done: &Completion,
        own: &[usize],
        others: &[usize],
        deadline: Instant,
        busy: BusyWait,
    ) -> Option<Result<Done>>;
}

/// Progress made by backend threads (or posters) alone: a wait just sleeps on its completion.
pub(crate) struct Passive;

impl Progress for Passive {
    fn wait(
        &self,
        done: &Completion,
        _: &[usize],
        _: &[usize],
        deadline: Instant,
        _: BusyWait,
    ) -> Option<Result<Done>> {
        done.wait_until(deadline)
    }
}

/// What a backend is: a maker of endpoints, one per context, and what the layers above need to
/// know of it. Callers never match on a backend's name: what they need is a method here.
pub(crate) trait Backend: Send + Sync {
    /// The backend's name (`tcp`, `shm`, `memory`, `ibverbs`, and `tcp+shm` or
    /// `ibverbs+shm` for a device that reaches its own host through shared memory and other
    /// hosts through TCP or RDMA): for logs, errors and the store entry, where every rank checks
    /// that the others use the same.
    fn name(&self) -> &str;

    /// Whether only this host can reach its endpoints (a loopback address, this process).
    fn host_only(&self) -> bool;

    /// A fresh endpoint for one context.
    fn endpoint(&self, spec: EndpointSpec) -> Result<Box<dyn Endpoint>>;

    /// The TCP address peers connect to, for a backend that listens on one (a launcher
    /// publishes it).
    fn local_addr(&self) -> Option<std::net::SocketAddr> {
        None
    }

    /// Whether its endpoints connect exactly the ranks that share this rank's host identity
    /// (shared memory between the processes of one host): such a backend can be the same-host
    /// half of a device that reaches other hosts through a second backend ([`auto`]).
    fn reaches_same_host(&self) -> bool {
        false
    }

    /// Whether its meshes may span hosts while the ranks of each host share a collective area
    /// ([`Mesh::local`]): the hierarchical allreduce (within hosts, across their leaders, within
    /// hosts again) is then the one to run. The same on every rank of a job.
    fn hierarchical(&self) -> bool {
        false
    }
}

/// What an endpoint is made for.
#[derive(Debug, Clone)]
pub(crate) struct EndpointSpec {
    pub(crate) ctx: ContextId,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    /// A secret both ends must prove (HMAC over the handshake), for backends that can.
    pub(crate) secret: Option<Vec<u8>>,
    /// This rank's host identity ([`host_id`](crate::device::host_id), or what its device was
    /// told): ranks with equal identities are on one host.
    pub(crate) host: String,
}

/// Why a connect failed.
#[derive(Debug)]
pub(crate) enum ConnectError {
    /// Nothing answered yet, or the path failed: worth trying again until the deadline.
    Retry(Error),
    /// Something answered and refused: the address belongs to another context (a stale store
    /// entry) or the peer does not fit. Trying the same address again cannot help.
    Refused(Error),
}

impl ConnectError {
    pub(crate) fn into_error(self) -> Error {
        match self {
            ConnectError::Retry(e) | ConnectError::Refused(e) => e,
        }
    }
}

/// One context's end of a mesh while it forms (see the module documentation). Dropping an
/// unfinished endpoint withdraws it: peers can no longer connect to it.
pub(crate) trait Endpoint: Send {
    /// The blob a peer's [`connect`](Endpoint::connect) needs.
    fn address(&self) -> Vec<u8>;

    /// Connects to `peer`, whose endpoint published `addr`. Called by the higher rank of a pair.
    fn connect(&mut self, peer: usize, addr: &[u8], deadline: Instant) -> std::result::Result<(), ConnectError>;

    /// Waits until every rank of `peers` has connected to this endpoint, or `until`; returns
    /// those still missing.
    fn wait_connected(&mut self, peers: &[usize], until: Instant) -> Vec<usize>;

    /// The formed mesh.
    fn finish(self: Box<Self>) -> Mesh;
}

/// A formed mesh: one pair per peer, and how waits make progress. Dropping it closes the pairs.
pub(crate) struct Mesh {
    /// Indexed by rank; `None` at this endpoint's own rank.
    pub(crate) pairs: Vec<Option<Arc<dyn Pair>>>,
    pub(crate) progress: Arc<dyn Progress>,
    /// Memory this rank shares with the other ranks of its host, for collectives, where the
    /// backend has it (shared memory) and this host has two ranks or more.
    pub(crate) local: Option<Arc<dyn LocalArea>>,
    /// Closes the pairs and withdraws the endpoint when dropped.
    pub(crate) _guard: Box<dyn Send + Sync>,
}

/// Memory the ranks of one host share for collectives (the shared-memory backend's collective
/// area), and the steps that hand it over.
///
/// Each member has two slots of [`slot_bytes`](LocalArea::slot_bytes) that every member can
/// read. The members go through numbered *steps* together; the content of step `t` lives in
/// the slots `t % 2`. The rule that keeps them apart: a member writes its slot of step `t`
/// only after [`wait_all`](LocalArea::wait_all) of step `t - 1` returned, and before it
/// [`arrive`](LocalArea::arrive)s at `t`; it reads the others' slots of step `t` only after
/// `wait_all(t)` returned and before it arrives at `t + 1`. So a slot is never written while
/// another member may read it.
pub(crate) trait LocalArea: Send + Sync {
    /// The mesh ranks that share the area, ascending (this rank is one of them).
    fn members(&self) -> &[usize];

    /// This rank's index in [`members`](LocalArea::members).
    fn me(&self) -> usize;

    /// Bytes in each slot (a multiple of 64).
    fn slot_bytes(&self) -> usize;

    /// The next step number: every member takes the same numbers in the same order.
    fn next_step(&self) -> u64;

    /// The start of member `m`'s slot for step `step` (64-byte aligned).
    fn slot(&self, m: usize, step: u64) -> *mut u8;

    /// Says this rank has reached step `step` of the call `desc` (its slot of the step is
    /// written, and it is done reading the previous step's), waking members that sleep on it.
    fn arrive(&self, step: u64, desc: &OpDesc);

    /// Waits until every member has arrived at `step`, and checks that their calls agree
    /// with `desc`. Busy-waits as `busy` says, then sleeps. Fails at `deadline`
    /// ([`AreaWait::Late`]), when members disagree ([`AreaWait::Disagree`]) or when the pair
    /// to a member fails (a member died or aborted: [`AreaWait::Failed`]).
    fn wait_all(
        &self,
        step: u64,
        desc: &OpDesc,
        deadline: Instant,
        busy: BusyWait,
    ) -> std::result::Result<(), AreaWait>;
}

/// Why [`LocalArea::wait_all`] failed.
#[derive(Debug)]
pub(crate) enum AreaWait {
    /// These mesh ranks had not arrived by the deadline.
    Late(Vec<usize>),
    /// Mesh rank `.0` arrived with the call `.1`.
    Disagree(usize, OpDesc),
    /// The pair to a member failed.
    Failed(Error),
}

/// What a finished operation reports: the rank that completed it and the bytes moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Done {
    pub(crate) peer: usize,
    pub(crate) len: usize,
}

/// The state of one posted operation, shared between the poster and the backend.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    state: Mutex<CompletionState>,
    cond: Condvar,
    /// Posted to several pairs (a receive from any of several ranks).
    shared: bool,
}

#[derive(Debug, Default)]
struct CompletionState {
    /// Threads blocked on the condition variable: only then does completing it notify (a
    /// notify is a futex system call even with nobody waiting, and most waits drive the pair
    /// themselves instead).
    sleepers: u32,
    /// A receive posted to several pairs is claimed by the first message that matches it.
    claimed: bool,
    /// `Some` once finished.
    outcome: Option<Result<Done>>,
    /// The message of an owned receive ([`RecvTarget::Owned`]).
    payload: Option<Vec<u8>>,
    /// Rung when the operation finishes: a wait that sleeps in `poll(2)` on it rather than on
    /// the condition variable (see [`Completion::ring_on_finish`]).
    bell: Option<Arc<wake::EventFd>>,
    /// Completed when the operation finishes: a wait for any of several operations waits on it
    /// (see [`Completion::finish_with`]).
    listener: Option<Arc<Completion>>,
}

impl Completion {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A completion for an operation posted to `pairs` pairs.
    pub(crate) fn for_pairs(pairs: usize) -> Arc<Self> {
        Arc::new(Self { shared: pairs > 1, ..Self::default() })
    }

    /// Whether the operation is posted to several pairs, any of which may claim it.
    pub(crate) fn is_shared(&self) -> bool {
        self.shared
    }

    fn lock(&self) -> MutexGuard<'_, CompletionState> {
        crate::sync::lock(&self.state)
    }

    /// Claims an unclaimed, unfinished operation for the caller. Exactly one caller wins.
    pub(crate) fn try_claim(&self) -> bool {
        let mut s = self.lock();
        if s.claimed || s.outcome.is_some() {
            return false;
        }
        s.claimed = true;
        true
    }

    /// True while nobody has claimed or finished the operation.
    pub(crate) fn is_open(&self) -> bool {
        let s = self.lock();
        !s.claimed && s.outcome.is_none()
    }

    /// Finishes the operation (the first outcome wins) and wakes its waiter.
    pub(crate) fn complete(&self, outcome: Result<Done>) {
        self.finish(outcome, None);
    }

    /// Finishes an owned receive with its message.
    pub(crate) fn complete_owned(&self, peer: usize, data: Vec<u8>) {
        let len = data.len();
        self.finish(Ok(Done { peer, len }), Some(data));
    }

    fn finish(&self, outcome: Result<Done>, payload: Option<Vec<u8>>) {
        let mut s = self.lock();
        if s.outcome.is_none() {
            s.claimed = true;
            s.outcome = Some(outcome);
            s.payload = payload;
            let sleepers = s.sleepers;
            let bell = s.bell.take();
            let listener = s.listener.take();
            drop(s);
            if sleepers > 0 {
                self.cond.notify_all();
            }
            if let Some(b) = bell {
                b.signal();
            }
            if let Some(l) = listener {
                l.complete(Ok(Done { peer: 0, len: 0 }));
            }
        }
    }

    /// Completes `listener` too when the operation finishes (at once if it has): a wait for
    /// any of several operations sleeps on one completion that each of them finishes. A later
    /// call replaces the listener.
    pub(crate) fn finish_with(&self, listener: &Arc<Completion>) {
        let mut s = self.lock();
        if s.outcome.is_some() {
            drop(s);
            listener.complete(Ok(Done { peer: 0, len: 0 }));
        } else {
            s.listener = Some(listener.clone());
        }
    }

    /// Rings `bell` when the operation finishes (at once if it has): for a wait that sleeps on
    /// the eventfd while another thread may finish the operation.
    pub(crate) fn ring_on_finish(&self, bell: &Arc<wake::EventFd>) {
        let mut s = self.lock();
        if s.outcome.is_some() {
            drop(s);
            bell.signal();
        } else {
            s.bell = Some(bell.clone());
        }
    }

    /// The outcome, if finished.
    pub(crate) fn outcome(&self) -> Option<Result<Done>> {
        self.lock().outcome.clone()
    }

    /// The message of a finished owned receive (once).
    pub(crate) fn take_payload(&self) -> Option<Vec<u8>> {
        self.lock().payload.take()
    }

    /// Waits until finished or `deadline`; `None` on timeout.
    pub(crate) fn wait_until(&self, deadline: Instant) -> Option<Result<Done>> {
        let mut s = self.lock();
        loop {
            if let Some(o) = &s.outcome {
                return Some(o.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s.sleepers += 1;
            s = crate::sync::wait_timeout(&self.cond, s, deadline - now);
            s.sleepers -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn abort_causes_keep_the_first_cause_across_relays() {
        // Rank 1 sees rank 2 die and aborts; rank 0 hears it and relays it to rank 3.
        let seen = Error::PeerClosed { rank: 2, op: "allreduce".into(), detail: "connection closed (EOF)".into() };
        let at_0 = AbortCause::of(&seen, 1).into_error();
        assert!(matches!(&at_0, Error::PeerClosed { rank: 2, op, .. } if op == "allreduce"), "{at_0}");
        assert!(at_0.to_string().contains("reported by rank 1"), "{at_0}");
        let at_3 = AbortCause::decode(&AbortCause::of(&at_0, 0).encode()).unwrap().into_error();
        assert_eq!(at_3.to_string(), at_0.to_string());
        // A timeout at rank 4 reaches the others as rank 4 timing out.
        let t = Error::Timeout { op: "broadcast".into(), ranks: vec![5], keys: vec![], waited: Duration::from_secs(2) };
        let e = AbortCause::of(&t, 4).into_error();
        assert!(matches!(&e, Error::PeerTimedOut { rank: 4, op, .. } if op == "broadcast"), "{e}");
        assert!(e.to_string().contains("still waiting for rank 5"), "{e}");
        let user = Error::Aborted { rank: 3, reason: "bad data".into() };
        assert!(matches!(AbortCause::of(&user, 0).into_error(), Error::Aborted { rank: 3, .. }));
    }

    proptest! {
        #[test]
        fn abort_causes_round_trip_within_their_bound(
            kind in 1u8..=6, origin in 0u32..1000, subject in proptest::option::of(0u32..1000),
            op in "[a-z_]{0,20}", detail in "\\PC{0,3000}",
        ) {
            let c = AbortCause {
                kind: AbortCause::decode(&[kind, 0, 0, 0, 0, 255, 255, 255, 255, 0, 0]).unwrap().kind,
                origin: origin as usize,
                subject: subject.map(|s| s as usize),
                op,
                detail,
            };
            let b = c.encode();
            prop_assert!(b.len() <= MAX_CAUSE);
            let d = AbortCause::decode(&b).unwrap();
            prop_assert_eq!(&d.op, &c.op);
            prop_assert!(c.detail.starts_with(&d.detail));
            prop_assert_eq!((d.kind, d.origin, d.subject), (c.kind, c.origin, c.subject));
        }

        #[test]
        fn random_abort_causes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = AbortCause::decode(&b);
        }
    }
}
