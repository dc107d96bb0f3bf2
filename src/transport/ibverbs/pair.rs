//! One pair of the ibverbs backend: the protocol over a reliable-connected queue pair.
//!
//! Each side owns a *ring* of [`SLOTS`] slots of [`SLOT_BYTES`] in registered memory, which
//! only its peer writes, and a *staging* area of the same shape that it writes from. A message
//! takes one slot of the peer's ring:
//!
//! - **Eager** (at most [`EAGER_MAX`] bytes): header and payload are copied into the staging
//!   slot and written into the peer's ring slot with one RDMA write with immediate data (the
//!   slot's number). The send is complete once copied.
//! - **Rendezvous** (larger): the slot carries a header with the send buffer's address and
//!   remote key (the buffer is registered, through the registration cache); the receiver
//!   RDMA-reads the payload straight into the matched receive's buffer (zero copy), or into an
//!   early-arrival buffer within its budget, and answers `DONE`, which completes the send.
//!
//! Control messages travel in the 32-bit immediate of a zero-length write and take no slot:
//! `CREDIT` (a mask of ring slots the receiver has freed: the sender may write them again)
//! and `DONE` (a rendezvous send's id). So credits bound what a sender has in flight, a
//! receiver that cannot take a message (no receive posted, budget full) simply keeps its slot
//! (the sender runs out of credits, as a TCP sender is held back), and control messages are
//! never stuck behind data. Slots are processed in arrival order (an RC queue pair delivers in
//! order), which keeps each key's messages in send order.
//!
//! Aborts travel on the pair's *lifeline*, the TCP connection of the handshake, whose end also
//! tells that the peer is gone (its process died or it closed the context).

use super::reg::RegCache;
use super::verbs::{Access, MemoryRegion, QueuePair, SendOp, Sge, VerbsDevice, Wc, WcStatus};
use crate::error::{Error, Result};
use crate::sync::{lock, wait_timeout};
use crate::transport::matching::{Delivery, Dispatch, EarlyRx, Header, Matcher, RecvOp};
use crate::transport::{AbortCause, Completion, Done, Key, MAX_CAUSE, Pair, RecvTarget, SendBuf};
use crate::types::{DESC_LEN, OpDesc};
use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a failed request waits for the peer's word on the lifeline before it reports its
/// own error.
const CAUSE_GRACE: Duration = Duration::from_millis(200);

/// Slots in each ring (at most 28: a credit's mask travels in the immediate).
pub(crate) const SLOTS: usize = 16;
/// Bytes per slot.
pub(crate) const SLOT_BYTES: usize = 32 << 10;
/// Bytes of a message header in its slot.
const HDR: usize = 80;
/// The largest payload sent eagerly.
pub(crate) const EAGER_MAX: usize = SLOT_BYTES - HDR;
/// The most bytes one RDMA read request moves (a work request's length is 32 bits, and ports
/// take up to 2 GiB per message). The crate's own tests use 64 KiB, so that their payloads
/// take several.
const MAX_READ: usize = if cfg!(test) { 64 << 10 } else { 1 << 30 };
/// Send-queue requests a pair keeps posted at once (more wait in order).
pub(crate) const SQ_DEPTH: usize = 64;
/// Receive requests a pair keeps posted (data, credits and dones each take one).
pub(crate) const RQ_DEPTH: usize = 4 * SLOTS + 16;

const KIND_EAGER: u8 = 1;
const KIND_RTS: u8 = 2;

const IMM_DATA: u32 = 1 << 28;
const IMM_CREDIT: u32 = 2 << 28;
const IMM_DONE: u32 = 3 << 28;
const IMM_LOW: u32 = (1 << 28) - 1;

/// What a work request's id says: the peer, the kind of request and an id within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrKind {
    Recv = 1,
    Write = 2,
    Read = 3,
}

pub(crate) fn wr_id(peer: usize, kind: WrKind, id: u32) -> u64 {
    ((peer as u64) << 40) | ((kind as u64) << 32) | u64::from(id)
}

pub(crate) fn wr_peer(wr_id: u64) -> usize {
    (wr_id >> 40) as usize
}

fn wr_kind(wr_id: u64) -> Option<WrKind> {
    match (wr_id >> 32) as u8 {
        1 => Some(WrKind::Recv),
        2 => Some(WrKind::Write),
        3 => Some(WrKind::Read),
        _ => None,
    }
}

/// Registered memory this pair owns: a ring or a staging area. The NIC writes it behind
/// Rust's back, so it is held as a raw allocation (never as a reference), and freed after the
/// registration is dropped.
pub(crate) struct Region {
    pub(crate) mr: Arc<dyn MemoryRegion>,
    mem: *mut u8,
    len: usize,
}

// SAFETY: the region is plain memory owned by this value; accesses to it are coordinated by
// the protocol (a slot is written by one side at a time, under the link's lock).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    pub(crate) fn new(dev: &dyn VerbsDevice, len: usize, access: Access) -> Result<Self> {
        let mem = Box::into_raw(vec![0u8; len].into_boxed_slice()).cast::<u8>();
        // SAFETY: the memory is owned by the region and freed only in its drop, after the
        // registration is dropped.
        match unsafe { dev.register(mem, len, access) } {
            Ok(mr) => Ok(Region { mr, mem, len }),
            Err(e) => {
                // SAFETY: allocated above as a boxed slice of `len` bytes, not registered.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(mem, len)) });
                Err(e)
            }
        }
    }

    fn ptr(&self, offset: usize) -> *mut u8 {
        self.mem.wrapping_add(offset)
    }

    fn addr(&self, offset: usize) -> u64 {
        self.mr.addr() + offset as u64
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // Deregister first: from then on the NIC no longer touches the memory. (Another holder
        // of the registration would be a bug; the region is the only one.)
        let mr = std::mem::replace(&mut self.mr, Arc::new(Unregistered));
        drop(mr);
        // SAFETY: allocated in `new` as a boxed slice of `len` bytes, freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.mem, self.len)) });
    }
}

/// A placeholder registration (what a dropped region holds while it frees its memory).
struct Unregistered;

impl MemoryRegion for Unregistered {
    fn addr(&self) -> u64 {
        0
    }
    fn len(&self) -> usize {
        0
    }
    fn lkey(&self) -> u32 {
        0
    }
    fn rkey(&self) -> u32 {
        0
    }
}

/// A send waiting for a slot of the peer's ring.
struct PendingSend {
    header: Header,
    buf: SendBuf,
    done: Arc<Completion>,
}

/// A rendezvous send whose header went out: its buffer stays lent until `DONE`.
struct RtsSend {
    done: Arc<Completion>,
    len: usize,
    _mr: Arc<dyn MemoryRegion>,
}

/// Where a read lands.
enum ReadInto {
    Deliver(Delivery),
    /// An early message, read straight into its early buffer (registered per read).
    Early(EarlyRx),
}

/// A rendezvous payload being read.
struct Reading {
    into: ReadInto,
    send_id: u32,
    len: usize,
    /// Read requests of this payload not yet completed (one per [`MAX_READ`] bytes).
    parts: usize,
    /// The first failure of a part.
    error: Option<Error>,
    _mr: Arc<dyn MemoryRegion>,
}

impl Reading {
    fn is_for(&self, done: &Arc<Completion>) -> bool {
        matches!(&self.into, ReadInto::Deliver(d) if Arc::ptr_eq(d.done(), done))
    }
}

/// A send-queue request waiting for room.
struct Wr {
    wr_id: u64,
    sge: Sge,
    op: SendOp,
}

struct State {
    matcher: Matcher,
    /// Slots of the peer's ring this side may write.
    free: u32,
    /// Slots of this side's ring freed since the peer was last told.
    unreported: u32,
    /// Data slots arrived and not yet taken, in arrival order.
    arrived: VecDeque<usize>,
    sends: VecDeque<PendingSend>,
    rts: HashMap<u32, RtsSend>,
    reads: HashMap<u32, Reading>,
    next_id: u32,
    /// Send-queue requests posted and not completed.
    outstanding: usize,
    /// Reads into early buffers under way (later messages wait for them).
    early_reads: usize,
    /// Requests that failed to post (their reads' parts are settled when the pair fails).
    unposted: Vec<u64>,
    backlog: VecDeque<Wr>,
    /// Set once the pair failed.
    failed: Option<Error>,
    /// Bytes of a lifeline frame being read.
    lifeline_in: Vec<u8>,
}

/// The connection to one peer (both sides of the protocol).
pub(crate) struct Link {
    pub(crate) me: usize,
    pub(crate) peer: usize,
    pub(crate) qp: Arc<dyn QueuePair>,
    ring: Region,
    staging: Region,
    /// The peer's ring: address and remote key.
    remote_ring: (u64, u32),
    regs: Arc<RegCache>,
    lifeline: TcpStream,
    state: Mutex<State>,
    /// Signalled when a read finishes (a cancel may wait for one).
    read_done: Condvar,
}

/// The pieces a link is made of, from the endpoint.
pub(crate) struct LinkParts {
    pub(crate) me: usize,
    pub(crate) peer: usize,
    pub(crate) qp: Arc<dyn QueuePair>,
    pub(crate) ring: Region,
    pub(crate) staging: Region,
    pub(crate) remote_ring: (u64, u32),
    pub(crate) regs: Arc<RegCache>,
    pub(crate) lifeline: TcpStream,
    pub(crate) budget: usize,
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

/// A parsed slot header.
struct SlotHeader {
    kind: u8,
    header: Header,
    addr: u64,
    rkey: u32,
    id: u32,
}

fn encode_header(b: &mut [u8], kind: u8, h: &Header, addr: u64, rkey: u32, id: u32) {
    b[..8].fill(0);
    b[0] = kind;
    put_u64(b, 8, h.key.group);
    put_u64(b, 16, h.key.tag);
    b[24..24 + DESC_LEN].copy_from_slice(&h.desc.encode());
    put_u64(b, 48, h.len);
    put_u64(b, 56, addr);
    b[64..68].copy_from_slice(&rkey.to_le_bytes());
    b[68..72].copy_from_slice(&id.to_le_bytes());
}

fn decode_header(b: &[u8]) -> SlotHeader {
    let mut desc = [0u8; DESC_LEN];
    desc.copy_from_slice(&b[24..24 + DESC_LEN]);
    SlotHeader {
        kind: b[0],
        header: Header {
            key: Key { group: get_u64(b, 8), tag: get_u64(b, 16) },
            desc: OpDesc::decode(&desc),
            len: get_u64(b, 48),
        },
        addr: get_u64(b, 56),
        rkey: get_u32(b, 64),
        id: get_u32(b, 68),
    }
}

/// Words for a failed work request.
fn status_words(status: &WcStatus) -> String {
    match status {
        WcStatus::Success => "success".into(),
        WcStatus::RemoteAccess => {
            "remote access error (the peer refused the access: a wrong remote key or an address outside its \
             registered memory)"
                .into()
        }
        WcStatus::Flushed => "flushed (the queue pair went to the error state: a request of the peer was refused, \
                               or the link failed)"
            .into(),
        WcStatus::RetryExceeded => "transport retry count exceeded (the peer does not answer: it is gone, or its \
                                     queue pair is in the error state)"
            .into(),
        WcStatus::Other(s) => s.clone(),
    }
}

impl Link {
    pub(crate) fn new(p: LinkParts) -> Self {
        Link {
            me: p.me,
            peer: p.peer,
            qp: p.qp,
            ring: p.ring,
            staging: p.staging,
            remote_ring: p.remote_ring,
            regs: p.regs,
            lifeline: p.lifeline,
            state: Mutex::new(State {
                matcher: Matcher::new(p.me, p.peer, p.budget),
                free: (1u32 << SLOTS) - 1,
                unreported: 0,
                arrived: VecDeque::new(),
                sends: VecDeque::new(),
                rts: HashMap::new(),
                reads: HashMap::new(),
                next_id: 0,
                outstanding: 0,
                early_reads: 0,
                unposted: Vec::new(),
                backlog: VecDeque::new(),
                failed: None,
                lifeline_in: Vec::new(),
            }),
            read_done: Condvar::new(),
        }
    }

    pub(crate) fn lifeline(&self) -> &TcpStream {
        &self.lifeline
    }

    /// Posts a send-queue request, or queues it behind those waiting for room.
    fn post(&self, st: &mut State, wr: Wr) {
        if st.outstanding < SQ_DEPTH && st.backlog.is_empty() {
            self.post_now(st, wr);
        } else {
            st.backlog.push_back(wr);
        }
    }

    fn post_now(&self, st: &mut State, wr: Wr) {
        match self.qp.post_send(wr.wr_id, wr.sge, wr.op) {
            Ok(()) => st.outstanding += 1,
            Err(e) => {
                // A read part that never went out will never complete either.
                st.unposted.push(wr.wr_id);
                let err = self.io_error(&format!("posting an RDMA request to rank {}", self.peer), &e.to_string());
                self.fail_and_tell(st, err);
            }
        }
    }

    /// A control message in a zero-length write's immediate.
    fn control(&self, st: &mut State, imm: u32) {
        let (addr, rkey) = self.remote_ring;
        let wr = Wr {
            wr_id: wr_id(self.peer, WrKind::Write, 0),
            sge: Sge { addr: self.staging.addr(0), len: 0, lkey: self.staging.mr.lkey() },
            op: SendOp::WriteImm { remote_addr: addr, rkey, imm },
        };
        self.post(st, wr);
    }

    fn io_error(&self, what: &str, detail: &str) -> Error {
        Error::io(format!("rank {}: {what}", self.me), std::io::Error::other(detail.to_string()))
    }

    /// Sends waiting for a slot go out while the peer has slots free, in order.
    fn pump(&self, st: &mut State) {
        while st.failed.is_none() && st.free != 0 {
            let Some(send) = st.sends.pop_front() else { break };
            let slot = st.free.trailing_zeros() as usize;
            st.free &= !(1 << slot);
            let len = send.buf.len;
            let base = slot * SLOT_BYTES;
            // SAFETY: the staging slot is this side's and not in use (its ring slot was free:
            // the previous write from it has arrived); `HDR` bytes fit in a slot.
            let hdr = unsafe { std::slice::from_raw_parts_mut(self.staging.ptr(base), HDR) };
            let (addr, rkey) = self.remote_ring;
            let write = |bytes: usize| Wr {
                wr_id: wr_id(self.peer, WrKind::Write, 0),
                sge: Sge { addr: self.staging.addr(base), len: bytes as u32, lkey: self.staging.mr.lkey() },
                op: SendOp::WriteImm { remote_addr: addr + base as u64, rkey, imm: IMM_DATA | slot as u32 },
            };
            if len <= EAGER_MAX {
                encode_header(hdr, KIND_EAGER, &send.header, 0, 0, 0);
                if len > 0 {
                    // SAFETY: the poster lent the send buffer until its completion (contract
                    // rule 5), completed below after this copy; the staging slot holds
                    // `HDR + EAGER_MAX` bytes.
                    unsafe { std::ptr::copy_nonoverlapping(send.buf.ptr, self.staging.ptr(base + HDR), len) };
                }
                self.post(st, write(HDR + len));
                send.done.complete(Ok(Done { peer: self.peer, len }));
            } else {
                // SAFETY: the buffer stays lent until the send completes, which happens only
                // after `DONE` (the peer finished reading) or once the queue pair is in error.
                let mr = match unsafe { self.regs.get(send.buf.ptr.cast_mut(), len, Access::RemoteRead) } {
                    Ok(mr) => mr,
                    Err(e) => {
                        send.done.complete(Err(e));
                        st.free |= 1 << slot;
                        continue;
                    }
                };
                st.next_id = (st.next_id + 1) & IMM_LOW;
                let id = st.next_id;
                encode_header(hdr, KIND_RTS, &send.header, send.buf.ptr as u64, mr.rkey(), id);
                self.post(st, write(HDR));
                st.rts.insert(id, RtsSend { done: send.done, len, _mr: mr });
            }
        }
    }

    /// Takes arrived messages in order until one cannot be taken yet.
    fn take_arrived(&self, st: &mut State) {
        while st.failed.is_none() && st.early_reads == 0 {
            let Some(&slot) = st.arrived.front() else { break };
            let base = slot * SLOT_BYTES;
            // SAFETY: the peer wrote this slot completely before its completion arrived, and
            // writes it again only after this side frees it (credits); `HDR <= SLOT_BYTES`.
            let hdr = decode_header(unsafe { std::slice::from_raw_parts(self.ring.ptr(base), HDR) });
            let len = hdr.header.len;
            let valid = match hdr.kind {
                KIND_EAGER => len <= EAGER_MAX as u64,
                KIND_RTS => len > EAGER_MAX as u64 && usize::try_from(len).is_ok(),
                _ => false,
            };
            if !valid {
                let err = Error::Protocol {
                    peer: Some(self.peer),
                    detail: format!("a message header of kind {} and {len} bytes in ring slot {slot}", hdr.kind),
                };
                self.fail_and_tell(st, err);
                return;
            }
            let len = len as usize;
            let dispatch = st.matcher.incoming(hdr.header);
            if matches!(dispatch, Dispatch::Stall) {
                return;
            }
            st.arrived.pop_front();
            if hdr.kind == KIND_EAGER {
                // SAFETY: as for the header; the payload follows it within the slot.
                let payload = unsafe { std::slice::from_raw_parts(self.ring.ptr(base + HDR), len) };
                match dispatch {
                    Dispatch::Deliver(mut d) => {
                        d.dst().copy_from_slice(payload);
                        d.advance(len);
                        d.finish(self.peer);
                    }
                    Dispatch::Early(mut e) => {
                        e.extend(payload);
                        st.matcher.early_arrived(e);
                    }
                    Dispatch::Discard | Dispatch::Stall => {}
                }
            } else {
                match dispatch {
                    Dispatch::Deliver(d) => self.read(st, ReadInto::Deliver(d), &hdr, len),
                    Dispatch::Early(e) => self.read(st, ReadInto::Early(e), &hdr, len),
                    Dispatch::Discard | Dispatch::Stall => self.control(st, IMM_DONE | hdr.id),
                }
            }
            st.unreported |= 1 << slot;
        }
    }

    /// Starts reading a rendezvous payload.
    fn read(&self, st: &mut State, mut into: ReadInto, hdr: &SlotHeader, len: usize) {
        let (dst, once) = match &mut into {
            // An owned receive's buffer is allocated (and freed) per message: never cached.
            ReadInto::Deliver(d) => (d.dst().as_mut_ptr(), d.is_owned()),
            ReadInto::Early(e) => (e.room_for_all(), true),
        };
        // SAFETY: `dst` is a claimed receive's buffer (lent until it completes, which happens
        // when this read finishes or fails) or the early buffer the reading entry owns; either
        // stays allocated while the region is used. Buffers of this library's own (early and
        // owned) are registered per read, as they are freed right after.
        let mr = if once {
            unsafe { self.regs.register_once(dst, len, Access::LocalWrite) }
        } else {
            unsafe { self.regs.get(dst, len, Access::LocalWrite) }
        };
        let mr = match mr {
            Ok(mr) => mr,
            Err(e) => {
                match into {
                    ReadInto::Deliver(d) => d.done().complete(Err(e)),
                    ReadInto::Early(e) => st.matcher.early_dropped(e),
                }
                self.control(st, IMM_DONE | hdr.id);
                return;
            }
        };
        if matches!(into, ReadInto::Early(_)) {
            // Later messages wait until this one is in the early list: one of the same key
            // must not overtake it (contract rule 2).
            st.early_reads += 1;
        }
        st.next_id = st.next_id.wrapping_add(1);
        let id = st.next_id;
        let parts = len.div_ceil(MAX_READ);
        let lkey = mr.lkey();
        st.reads.insert(id, Reading { into, send_id: hdr.id, len, parts, error: None, _mr: mr });
        for part in 0..parts {
            let at = part * MAX_READ;
            let n = (len - at).min(MAX_READ);
            let wr = Wr {
                wr_id: wr_id(self.peer, WrKind::Read, id),
                sge: Sge { addr: dst as u64 + at as u64, len: n as u32, lkey },
                op: SendOp::Read { remote_addr: hdr.addr + at as u64, rkey: hdr.rkey },
            };
            self.post(st, wr);
        }
    }

    /// Tells the peer which slots were freed, if any.
    fn report(&self, st: &mut State) {
        if st.unreported != 0 && st.failed.is_none() {
            let mask = std::mem::take(&mut st.unreported);
            self.control(st, IMM_CREDIT | mask);
        }
    }

    /// A completion of this pair's queue pair.
    pub(crate) fn completed(&self, wc: &Wc) {
        let mut st = lock(&self.state);
        let kind = wr_kind(wc.wr_id);
        if kind == Some(WrKind::Recv) {
            if wc.status != WcStatus::Success {
                let err = self.wc_error(&st, "receive", &wc.status);
                self.fail_request(&mut st, &wc.status, err);
                return;
            }
            if st.failed.is_none()
                && let Err(e) = self.qp.post_recv(wc.wr_id)
            {
                let err = self.io_error(&format!("posting a receive request for rank {}", self.peer), &e.to_string());
                self.fail(&mut st, err);
                return;
            }
            self.arrived(&mut st, wc.imm);
        } else {
            st.outstanding = st.outstanding.saturating_sub(1);
            let is_read = kind == Some(WrKind::Read);
            let ok = wc.status == WcStatus::Success;
            let err = (!ok).then(|| self.wc_error(&st, if is_read { "RDMA read" } else { "RDMA write" }, &wc.status));
            // A read whose last part this was.
            let mut read = None;
            if is_read {
                let id = wc.wr_id as u32;
                if let Some(r) = st.reads.get_mut(&id) {
                    r.parts = r.parts.saturating_sub(1);
                    if let Some(e) = &err {
                        r.error.get_or_insert_with(|| e.clone());
                    }
                    if r.parts == 0 {
                        read = st.reads.remove(&id);
                    }
                }
            }
            if let Some(err) = err {
                self.fail_request(&mut st, &wc.status, err);
                if let Some(mut r) = read {
                    let err = st.failed.clone().or(r.error.take()).unwrap_or_else(err_or_flushed);
                    self.finish_read(&mut st, r, Some(err));
                }
                return;
            }
            if let Some(mut r) = read {
                let err = r.error.take();
                self.finish_read(&mut st, r, err);
            }
            while st.outstanding < SQ_DEPTH && st.failed.is_none() {
                let Some(wr) = st.backlog.pop_front() else { break };
                self.post_now(&mut st, wr);
            }
            if st.outstanding == 0 {
                self.read_done.notify_all(); // a closing side may wait for this
            }
        }
        self.report(&mut st);
    }

    /// The error a failed request of kind `what` means (the first failure, when this one is
    /// only its flush).
    fn wc_error(&self, st: &State, what: &str, status: &WcStatus) -> Error {
        if let (WcStatus::Flushed, Some(e)) = (status, &st.failed) {
            return e.clone();
        }
        self.io_error(&format!("{what} on the RDMA connection to rank {} failed", self.peer), &status_words(status))
    }

    fn arrived(&self, st: &mut State, imm: u32) {
        let low = imm & IMM_LOW;
        match imm & !IMM_LOW {
            IMM_DATA if (low as usize) < SLOTS => {
                st.arrived.push_back(low as usize);
                self.take_arrived(st);
            }
            IMM_CREDIT if low >> SLOTS == 0 => {
                st.free |= low;
                self.pump(st);
            }
            IMM_DONE => {
                if let Some(s) = st.rts.remove(&low) {
                    s.done.complete(Ok(Done { peer: self.peer, len: s.len }));
                }
            }
            _ => {
                let err = Error::Protocol { peer: Some(self.peer), detail: format!("an RDMA immediate {imm:#010x}") };
                self.fail(st, err);
            }
        }
    }

    /// A read finished (with `err`, or not): its receive or early buffer gets the payload, and
    /// the sender is told.
    fn finish_read(&self, st: &mut State, r: Reading, err: Option<Error>) {
        let Reading { into, send_id, len, _mr, .. } = r;
        drop(_mr);
        match (into, err) {
            (ReadInto::Deliver(d), Some(e)) => d.done().complete(Err(e)),
            (ReadInto::Early(e), Some(_)) => {
                st.early_reads -= 1;
                st.matcher.early_dropped(e);
            }
            (ReadInto::Deliver(mut d), None) => {
                d.advance(len);
                d.finish(self.peer);
            }
            (ReadInto::Early(e), None) => {
                st.early_reads -= 1;
                st.matcher.early_arrived(e);
            }
        }
        self.read_done.notify_all();
        if st.failed.is_none() {
            self.control(st, IMM_DONE | send_id);
            // Messages held behind an early read go on.
            self.take_arrived(st);
        }
    }

    /// The pair failed: the queue pair goes to error (so the NIC stops touching buffers), and
    /// every operation fails with `err` (reads end when their flush arrives).
    fn fail(&self, st: &mut State, err: Error) {
        if st.failed.is_some() {
            return;
        }
        // Messages that arrived before the failure stay receivable where the budget holds them.
        self.take_arrived(st);
        if st.failed.is_some() {
            return; // taking them failed the pair already
        }
        st.failed = Some(err.clone());
        self.qp.set_error();
        st.matcher.close(&err);
        for s in st.sends.drain(..) {
            s.done.complete(Err(err.clone()));
        }
        for (_, s) in st.rts.drain() {
            s.done.complete(Err(err.clone()));
        }
        // Read parts that will never complete (queued, or refused by the provider) settle
        // their reads now; parts posted end with their flush.
        let dropped: Vec<u64> = st.backlog.drain(..).map(|w| w.wr_id).chain(std::mem::take(&mut st.unposted)).collect();
        for id in dropped {
            if wr_kind(id) != Some(WrKind::Read) {
                continue;
            }
            let rid = id as u32;
            let done = st.reads.get_mut(&rid).is_some_and(|r| {
                r.parts = r.parts.saturating_sub(1);
                r.parts == 0
            });
            if done && let Some(r) = st.reads.remove(&rid) {
                self.finish_read(st, r, Some(err.clone()));
            }
        }
        st.arrived.clear();
        let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
    }

    /// Fails the pair with `err` (from outside the protocol: the lifeline, a local close).
    pub(crate) fn fail_with(&self, err: Error) {
        let mut st = lock(&self.state);
        self.fail(&mut st, err);
    }

    /// Reads ready bytes of the lifeline: abort frames, or its end.
    pub(crate) fn lifeline_readable(&self) {
        let mut st = lock(&self.state);
        self.read_lifeline(&mut st);
    }

    fn read_lifeline(&self, st: &mut State) {
        let mut buf = [0u8; 4096];
        while st.failed.is_none() {
            match std::io::Read::read(&mut &self.lifeline, &mut buf) {
                Ok(0) => {
                    let err = Error::PeerClosed {
                        rank: self.peer,
                        op: String::new(),
                        detail: "its RDMA connection's lifeline closed (the process exited or closed its context)"
                            .into(),
                    };
                    self.fail(st, err);
                }
                Ok(n) => {
                    st.lifeline_in.extend_from_slice(&buf[..n]);
                    self.take_frames(st);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let detail = format!("its lifeline failed: {e}");
                    self.fail(st, Error::PeerClosed { rank: self.peer, op: String::new(), detail });
                }
            }
        }
    }

    /// A request failed with `status` (`err` in words): the pair fails with it, unless the peer
    /// has said why on the lifeline (an abort, or its end), which is the better cause; a flushed
    /// request waits [`CAUSE_GRACE`] for the peer's word.
    fn fail_request(&self, st: &mut State, status: &WcStatus, err: Error) {
        // A request that failed for a reason of its own is the cause; one flushed without a
        // recorded cause failed for a reason elsewhere (the peer's side refused something),
        // which the peer tells.
        let grace = if *status == WcStatus::Flushed { CAUSE_GRACE } else { Duration::ZERO };
        self.read_lifeline(st);
        let start = Instant::now();
        while st.failed.is_none() && start.elapsed() < grace {
            self.read_lifeline(st);
            if st.failed.is_some() {
                return;
            }
            let mut fds = [libc::pollfd { fd: self.lifeline_fd(), events: libc::POLLIN, revents: 0 }];
            let _ = crate::transport::wake::poll_fds(&mut fds, Duration::from_millis(10));
        }
        self.fail_and_tell(st, err);
    }

    /// Fails the pair with a cause found on this side, and tells the peer (best effort), so
    /// that it reports this cause rather than only seeing the connection end.
    fn fail_and_tell(&self, st: &mut State, err: Error) {
        if st.failed.is_none() {
            self.tell(0, &AbortCause::of(&err, self.me));
        }
        self.fail(st, err);
    }

    /// Sends an abort frame on the lifeline (best effort, bounded).
    fn tell(&self, group: u64, cause: &AbortCause) {
        let c = cause.encode();
        let mut frame = Vec::with_capacity(12 + c.len());
        frame.extend_from_slice(&((8 + c.len()) as u32).to_le_bytes());
        frame.extend_from_slice(&group.to_le_bytes());
        frame.extend_from_slice(&c);
        // The lifeline carries nothing else, so a frame this small fits its socket buffer;
        // the timeout bounds the rest.
        let _ = self.lifeline.set_nonblocking(false);
        let _ = self.lifeline.set_write_timeout(Some(Duration::from_millis(500)));
        let _ = (&self.lifeline).write_all(&frame);
        let _ = self.lifeline.set_nonblocking(true);
    }

    fn lifeline_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.lifeline)
    }

    /// Abort frames off the lifeline: `len: u32, group: u64, cause`.
    fn take_frames(&self, st: &mut State) {
        loop {
            if st.lifeline_in.len() < 12 {
                return;
            }
            let len = get_u32(&st.lifeline_in, 0) as usize;
            if !(8..=8 + MAX_CAUSE).contains(&len) {
                let err = Error::Protocol { peer: Some(self.peer), detail: format!("a lifeline frame of {len} bytes") };
                self.fail(st, err);
                return;
            }
            if st.lifeline_in.len() < 4 + len {
                return;
            }
            let frame: Vec<u8> = st.lifeline_in.drain(..4 + len).collect();
            let group = get_u64(&frame, 4);
            let err = match AbortCause::decode(&frame[12..]) {
                Ok(c) => c.into_error(),
                Err(e) => {
                    Error::Protocol { peer: Some(self.peer), detail: format!("an abort that does not decode: {e}") }
                }
            };
            if group == 0 {
                self.fail(st, err);
                return;
            }
            self.abort_group(st, group, &err);
        }
    }

    fn abort_group(&self, st: &mut State, group: u64, err: &Error) {
        st.matcher.abort_group(group, err);
        st.sends.retain(|s| {
            let fail = s.header.key.group == group;
            if fail {
                s.done.complete(Err(err.clone()));
            }
            !fail
        });
        // Messages of the group that were held are now discarded: take what follows.
        self.take_arrived(st);
        self.report(st);
    }
}

/// A pair of the ibverbs backend.
pub(crate) struct IbPair {
    pub(crate) link: Arc<Link>,
}

impl Pair for IbPair {
    fn peer(&self) -> usize {
        self.link.peer
    }

    unsafe fn post_send(&self, key: Key, desc: OpDesc, buf: SendBuf, done: &Arc<Completion>) -> Result<()> {
        buf.mem.require_host("ibverbs")?;
        let l = &self.link;
        let mut st = lock(&l.state);
        if let Some(e) = st.matcher.refusal(key.group) {
            return Err(e);
        }
        st.sends.push_back(PendingSend { header: Header { key, desc, len: buf.len as u64 }, buf, done: done.clone() });
        l.pump(&mut st);
        Ok(())
    }

    unsafe fn post_recv(&self, key: Key, desc: OpDesc, target: RecvTarget, done: &Arc<Completion>) -> Result<()> {
        target.mem().require_host("ibverbs")?;
        let l = &self.link;
        let mut st = lock(&l.state);
        st.matcher.post(RecvOp { key, desc, target, done: done.clone() })?;
        l.take_arrived(&mut st);
        l.report(&mut st);
        Ok(())
    }

    fn abort(&self, group: u64, local: &Error, cause: &AbortCause) {
        let l = &self.link;
        let mut st = lock(&l.state);
        if st.failed.is_none() {
            l.tell(group, cause);
        }
        if group == 0 {
            l.fail(&mut st, local.clone());
        } else {
            l.abort_group(&mut st, group, local);
        }
    }

    fn cancel(&self, done: &Arc<Completion>) {
        let l = &self.link;
        let mut st = lock(&l.state);
        st.matcher.cancel(done);
        st.sends.retain(|s| !Arc::ptr_eq(&s.done, done));
        if st.rts.values().any(|s| Arc::ptr_eq(&s.done, done)) {
            // The peer may be reading the buffer: only stopping the queue pair stops it.
            let err = Error::Protocol {
                peer: Some(l.peer),
                detail: format!(
                    "a send to rank {} was withdrawn while rank {} could be reading it; the RDMA connection cannot go on",
                    l.peer, l.peer
                ),
            };
            l.fail(&mut st, err);
        }
        // A read into the receive's buffer must end before the buffer goes back: it may be
        // finishing now; otherwise only stopping the queue pair stops it (its flush ends it).
        let start = Instant::now();
        let mut stopped = false;
        while st.reads.values().any(|r| r.is_for(done)) {
            if !stopped && start.elapsed() > CANCEL_GRACE {
                let detail = format!(
                    "a receive was withdrawn while rank {} wrote into it by RDMA; the connection cannot go on",
                    l.peer
                );
                l.fail(&mut st, Error::Protocol { peer: Some(l.peer), detail });
                stopped = true;
            }
            if start.elapsed() > CANCEL_GRACE + Duration::from_secs(10) {
                // The flush never came: the provider is broken.
                tracing::error!(peer = l.peer, "an RDMA read was neither completed nor flushed within 10 s");
                break;
            }
            st = wait_timeout(&l.read_done, st, Duration::from_millis(10));
        }
    }
}

/// How long withdrawing a receive that is being read into waits for the read to finish before
/// it stops the queue pair.
const CANCEL_GRACE: Duration = Duration::from_millis(100);

/// How long closing waits for this side's writes to reach the peer.
const CLOSE_DRAIN: Duration = Duration::from_secs(2);

/// Closes the link from this side (the context was dropped): waits (boundedly) until the
/// writes already posted have completed (a send completes once copied, but its bytes are
/// only at the peer when the write's completion comes; destroying the queue pair sooner
/// could drop them), then fails what is left.
pub(crate) fn close(link: &Link) {
    let me = link.me;
    let start = Instant::now();
    let mut st = lock(&link.state);
    while st.failed.is_none()
        && (st.outstanding > 0 || !st.backlog.is_empty() || !st.sends.is_empty())
        && start.elapsed() < CLOSE_DRAIN
    {
        st = wait_timeout(&link.read_done, st, Duration::from_millis(20));
    }
    link.fail(&mut st, Error::Aborted { rank: me, reason: "this rank closed the context".into() });
}

impl Link {
    /// Whether the pair has failed.
    pub(crate) fn is_failed(&self) -> bool {
        lock(&self.state).failed.is_some()
    }
}

/// The error of a request flushed without a recorded cause (not reached: failing records one).
fn err_or_flushed() -> Error {
    Error::io("an RDMA request", std::io::Error::other(status_words(&WcStatus::Flushed)))
}
