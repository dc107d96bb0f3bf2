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
//!    the group's operations on both sides; the pair goes on serving the other groups (the
//!    mesh's own group, 0, is a group like the others, so that survivors of a failure can agree
//!    and shrink over the pairs they hold). A message of the group already on its way finishes
//!    as a stream must: a send partly written goes on from a copy of its rest (its poster's
//!    operation fails at once), a payload partly read into its receive is read to its end. An
//!    abort of [`ALL_GROUPS`] closes the pair: the peer fails every pending and future operation
//!    on it with the cause turned back into an error ([`AbortCause::into_error`]).
//! 9. **Cancellation.** `cancel` removes a pending operation. A send partly written goes on
//!    from a copy of its rest, so the stream stays whole (the copy is the message's rest, made
//!    under the pair's lock: a failure path only). Where the peer may be reading the sender's
//!    memory itself (single-copy shared memory, RDMA), a cancel of such a send fails the pair
//!    instead: its memory goes back to the caller while the peer may still read it.
//! 10. **Deadlines** are the waiter's: [`Progress::wait`] returns `None` at the deadline and the
//!     waiter cancels. A backend never blocks a poster or a waiter past the deadline it is given.
//!
//! A rank's messages to itself go through a loopback pair ([`memory::loopback`]) whatever the
//! backend, under the same rules.

mod abort;
pub(crate) mod accepting;
pub(crate) mod auth;
pub(crate) mod auto;
mod completion;
pub(crate) mod handshake;
pub(crate) mod ibverbs;
pub(crate) mod matching;
pub(crate) mod memory;
pub(crate) mod shm;
pub(crate) mod tcp;
pub(crate) mod wake;

pub(crate) use abort::{AbortCause, MAX_CAUSE};
pub(crate) use completion::{Completion, Done};

use crate::error::{Error, Result};
use crate::types::OpDesc;
use std::sync::Arc;
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

/// The group of an abort that closes the pair: every group's operations fail with its cause,
/// and the connection closes ([`Pair::abort`]). No group's messages carry it (see
/// [`group_id`]).
pub(crate) const ALL_GROUPS: u64 = u64::MAX;

/// The longest a context that goes away takes to write what its pairs still have queued, all
/// pairs together (`TcpPair::close`, [`Pair::abort_closing`]): a peer that reads takes it in
/// well under a millisecond; one that does not (dead, or stuck) costs this bound once.
pub(crate) const CLOSE_FLUSH: Duration = Duration::from_millis(250);

/// A group id made from the hash `h`: never 0 (the mesh's own context) nor [`ALL_GROUPS`].
pub(crate) fn group_id(h: u64) -> u64 {
    if h == 0 || h == ALL_GROUPS { 1 } else { h }
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
}

impl RecvBuf {
    pub(crate) fn from_slice(s: &mut [u8]) -> Self {
        RecvBuf { ptr: s.as_mut_ptr(), len: s.len(), mem: MemKind::Host }
    }
}

/// The slices of `parts` (one message, their concatenation) that hold its bytes
/// `from..from + n`.
pub(crate) fn span<'a>(parts: &[&'a [u8]], from: usize, n: usize) -> impl Iterator<Item = &'a [u8]> {
    let mut at = 0usize;
    parts.iter().filter_map(move |&p| {
        let (start, end) = (at, at + p.len());
        at = end;
        let (lo, hi) = (from.max(start), (from + n).min(end));
        (lo < hi).then(|| &p[lo - start..hi - start])
    })
}

/// A copy of bytes `from..from + n` of the message made of `parts` one after the other, for a
/// send that goes on after its poster got its buffers back (a cancel or an abort part-way,
/// contract rules 8 and 9).
///
/// # Safety
/// `parts` must still be lent to the pair (the send queued, its completion open).
pub(crate) unsafe fn copy_span(parts: &[SendBuf], from: usize, n: usize) -> Box<[u8]> {
    // SAFETY: forwarded from this function's contract: the buffers are valid and unwritten.
    let slices: smallvec::SmallVec<[&[u8]; 4]> =
        parts.iter().map(|b| unsafe { std::slice::from_raw_parts(b.ptr, b.len) }).collect();
    let mut rest = Vec::with_capacity(n);
    span(&slices, from, n).for_each(|p| rest.extend_from_slice(p));
    rest.into_boxed_slice()
}

/// A consumer of a message's bytes (see [`RecvTarget::Sink`]): the pair that claimed the
/// receive hands it the message in order, in pieces as they arrive (a shared-memory fragment
/// straight from the ring), so that the receiver can fold them into its own state instead of
/// landing them in a buffer first.
#[derive(Clone, Copy)]
pub(crate) struct SinkRef {
    f: *mut (dyn FnMut(&[u8]) + Send + 'static),
    /// The message's exact length.
    pub(crate) len: usize,
}

impl std::fmt::Debug for SinkRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SinkRef").field("len", &self.len).finish_non_exhaustive()
    }
}

// SAFETY: the consumer is `Send`; whoever posts the receive guarantees (as for `RecvBuf`) that
// it outlives the operation and that nothing else calls it meanwhile, and the pair calls it
// only under its lock, so it is called from one thread at a time.
unsafe impl Send for SinkRef {}

impl SinkRef {
    /// A sink for a message of exactly `len` bytes.
    ///
    /// # Safety
    /// `f` must stay valid, and must not be called by anyone else, until the receive it is
    /// posted with is completed or [`Pair::cancel`] for it has returned on every pair.
    pub(crate) unsafe fn new(f: &mut (dyn FnMut(&[u8]) + Send + '_), len: usize) -> Self {
        let f: *mut (dyn FnMut(&[u8]) + Send + '_) = f;
        // SAFETY: only the trait object's lifetime bound changes (the same fat pointer); the
        // caller keeps it valid for as long as the pointer is used (this function's contract).
        let f: *mut (dyn FnMut(&[u8]) + Send + 'static) = unsafe { std::mem::transmute(f) };
        SinkRef { f, len }
    }

    /// Hands the next `bytes` of the message to the consumer.
    ///
    /// # Safety
    /// Only by the pair that claimed the receive, under its lock, before completing it.
    pub(crate) unsafe fn feed(&self, bytes: &[u8]) {
        // SAFETY: valid and called by nobody else until the receive completes (`new`'s
        // contract), and the pair calls it from one thread at a time (this call's).
        unsafe { (*self.f)(bytes) }
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
    /// Handed, in order and in pieces as it arrives, to this consumer; the message must have
    /// exactly its length. Only on a pair that [`sinks`](Pair::sinks).
    Sink(SinkRef),
}

impl RecvTarget {
    /// The caller's buffer, when there is one.
    pub(crate) fn buf(&self) -> Option<RecvBuf> {
        match *self {
            RecvTarget::Exact(b) | RecvTarget::Upto(b) => Some(b),
            RecvTarget::Owned { .. } | RecvTarget::Sink(_) => None,
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
            RecvTarget::Sink(s) if len != s.len as u64 => {
                Some(format!("a message of {len} bytes where the receive takes exactly {}", s.len))
            }
            _ => None,
        }
    }

    /// The memory the message lands in.
    pub(crate) fn mem(&self) -> MemKind {
        self.buf().map_or(MemKind::Host, |b| b.mem)
    }
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

    /// Whether [`post_send_parts`](Self::post_send_parts) sends a message made of several
    /// buffers without gathering them into one first (this default: it cannot).
    fn gathers(&self) -> bool {
        false
    }

    /// Queues a send of one message made of `parts`, one after the other (a header and the
    /// values it describes, say), read from where they are: the peer receives one message of
    /// their total length. Several parts only where [`gathers`](Self::gathers) says so; this
    /// default sends one part with [`post_send`](Self::post_send) and refuses more.
    ///
    /// # Safety
    /// As for [`post_send`](Self::post_send), for every part.
    unsafe fn post_send_parts(&self, key: Key, desc: OpDesc, parts: &[SendBuf], done: &Arc<Completion>) -> Result<()> {
        match parts {
            // SAFETY: as this call's.
            [one] => unsafe { self.post_send(key, desc, *one, done) },
            _ => Err(Error::invalid("this transport does not send a message from several buffers")),
        }
    }

    /// Whether a receive may hand its message to a consumer piece by piece
    /// ([`RecvTarget::Sink`]; this default: it may not, and such a receive is refused).
    fn sinks(&self) -> bool {
        false
    }

    /// Messages with `key` that come before their receive wait in the transport (nothing after
    /// them is read) until it is posted, instead of being copied aside (see
    /// `Matcher::hold`); where [`sinks`](Self::sinks) says so (this default does nothing).
    fn hold_until_posted(&self, key: Key) {
        let _ = key;
    }

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
    /// and future operations of the group with `local`, on both sides; the pair goes on
    /// carrying the other groups (the mesh's own context, group 0, is a group like the others,
    /// so that survivors of a failure can agree and shrink over the pairs they hold).
    /// [`ALL_GROUPS`] closes the pair: every group fails, on both sides.
    fn abort(&self, group: u64, local: &Error, cause: &AbortCause);

    /// [`abort`](Pair::abort) of [`ALL_GROUPS`] by a context going away after it failed: the
    /// pair may take until `deadline` to hand the peer what it still has queued, the cause
    /// last (a transport that queues nothing of its own aborts at once).
    fn abort_closing(&self, local: &Error, cause: &AbortCause, deadline: Instant) {
        let _ = deadline;
        self.abort(ALL_GROUPS, local, cause);
    }

    /// The error `group` was aborted with on this pair (by either side), if it was; `None`
    /// also when the pair closed. A wait of the group on other pairs asks it, so that an abort
    /// that reached this rank through another peer ends it too.
    fn aborted(&self, group: u64) -> Option<Error>;

    /// Withdraws every operation of `done` from this pair. After it returns the pair no longer
    /// touches that operation's buffer.
    fn cancel(&self, done: &Arc<Completion>);

    /// Takes back a buffer that an owned receive of this pair handed over, once its reader is
    /// done with it, to receive a later message into: a stream of large messages then finds
    /// its pages mapped instead of faulting fresh ones in for each. A pair keeps a few, within
    /// its early budget, and drops the rest (this default keeps none).
    fn recycle(&self, buf: Vec<u8>) {
        drop(buf);
    }
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

    /// Wakes the waits sleeping in this engine so that they look at their completions again:
    /// called by a thread that completed another thread's completion from outside the
    /// transport (an interrupted wait, see `comm::Interrupter`). Waits that sleep on the
    /// completion itself need nothing (this default).
    fn interrupt(&self) {}

    /// Makes the pairs of `peers` progress without a waiting thread of this engine, until a
    /// wait of this engine takes them again: called before a wait sleeps in another engine
    /// (a mixed backend's) while operations on these pairs are outstanding. Engines whose
    /// pairs always progress on their own (this default) need nothing.
    fn lend(&self, _peers: &[usize]) {}
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

    /// Copies the bytes at `from` (runs of member `m`'s memory: address and length, in order)
    /// into `into` (in order, as many bytes in all), straight from the member's process
    /// (`process_vm_readv`: one copy, no slot), for collectives that read a peer's buffers
    /// straight. The member must keep those bytes unchanged until this rank arrives at a
    /// later step. An error where the kernel refuses (the area's calibration tries it first)
    /// or the member's process is gone.
    fn read_member(
        &self,
        m: usize,
        from: &[nix::sys::uio::RemoteIoVec],
        into: &mut [std::io::IoSliceMut<'_>],
    ) -> Result<()> {
        let _ = (from, into);
        Err(Error::invalid(format!("this area cannot read member {m}'s memory")))
    }

    /// Copies `src` to address `addr` of member `m`'s process (`process_vm_writev`), for
    /// collectives that write straight into a peer's buffer. The member must not touch those
    /// bytes until this rank arrives at a later step. Errors as for
    /// [`read_member`](LocalArea::read_member), and when the member has
    /// [withdrawn](LocalArea::withdraw) (nothing is written then).
    fn write_member(&self, m: usize, addr: u64, src: &[u8]) -> Result<()> {
        let _ = (addr, src);
        Err(Error::invalid(format!("this area cannot write member {m}'s memory")))
    }

    /// This rank leaves its call early (a wait or a copy failed): from now on no member
    /// writes into its memory ([`write_member`](LocalArea::write_member) refuses, and a
    /// [`read_member`](LocalArea::read_member) that ends after it fails), and it waits, until
    /// `until`, for writes already under way by members whose process lives. False when one
    /// may still be under way then. Called before the failed call returns its buffers.
    fn withdraw(&self, until: Instant) -> bool {
        let _ = until;
        true
    }

    /// The copy path the device was told to take (the shared-memory area's default is
    /// [`CopyChoice::Measure`]; an area that cannot read members' memory says
    /// [`CopyChoice::Two`]).
    fn copy_choice(&self) -> CopyChoice {
        CopyChoice::Two
    }

    /// Whether the area says when steps begin ([`started`](LocalArea::started)) and which
    /// members wait idle ([`set_idle`](LocalArea::set_idle)), for a loop that takes steps
    /// whenever any member begins one (the engine's cycles).
    fn signals(&self) -> bool {
        false
    }

    /// Whether another member has arrived at a step this rank has not taken yet (it began one
    /// this rank is to join).
    fn started(&self) -> bool {
        false
    }

    /// Says this rank waits idle, away from the area (the flag is stored and fenced: a member
    /// that arrives and then claims the flag, or this rank that sets it and then looks at
    /// [`started`](LocalArea::started), sees the other's store: Dekker's).
    fn set_idle(&self) {}

    /// Takes back this rank's idle flag; true when a member had claimed it
    /// ([`claim_idle`](LocalArea::claim_idle)): one wake-up from that member is on its way.
    fn clear_idle(&self) -> bool {
        false
    }

    /// Claims member `m`'s idle flag: true for the one member that finds it set and clears it
    /// (that member, and only it, then wakes `m`).
    fn claim_idle(&self, m: usize) -> bool {
        let _ = m;
        false
    }

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

/// How a host's ranks move a collective's bytes between their buffers: through the area's
/// slots (two copies: into the owner's slot, out of it), or straight from the owner's buffer
/// (`process_vm_readv`, one copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyChoice {
    /// Measured when the context forms (the default).
    Measure,
    /// Single copy wherever the kernel allows it (`FERROGLOO_SHM_SINGLE_COPY=1`).
    Single,
    /// Always through the slots (`FERROGLOO_SHM_SINGLE_COPY=0`).
    Two,
    /// This plan, wherever the kernel allows single copies.
    Given(crate::types::CopyPlan),
}

impl CopyChoice {
    /// Words in [`words`](Self::words): the kind, then a plan's.
    pub(crate) const WORDS: usize = 1 + crate::types::CopyPlan::WORDS;

    /// The choice as words (published in the area by calibration, compared between members).
    pub(crate) fn words(self) -> [u64; Self::WORDS] {
        let mut w = [0u64; Self::WORDS];
        match self {
            CopyChoice::Measure => {}
            CopyChoice::Single => w[0] = 1,
            CopyChoice::Two => w[0] = 2,
            CopyChoice::Given(p) => {
                w[0] = 3;
                w[1..].copy_from_slice(&p.words());
            }
        }
        w
    }

    /// The choice of [`words`](Self::words), in words for messages.
    pub(crate) fn describe(w: &[u64]) -> String {
        match w.first() {
            Some(0) => "to measure which copy path is faster".into(),
            Some(1) => "single copies (FERROGLOO_SHM_SINGLE_COPY=1)".into(),
            Some(2) => "two copies (FERROGLOO_SHM_SINGLE_COPY=0)".into(),
            Some(3) if w.len() == Self::WORDS => {
                let mut p = [0u64; crate::types::CopyPlan::WORDS];
                p.copy_from_slice(&w[1..]);
                format!("the copy plan \"{}\"", crate::types::CopyPlan::from_words(p))
            }
            _ => "another copy path".into(),
        }
    }
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
