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

mod completions;
mod lifeline;
mod receive;
mod region;
mod send;

pub(crate) use super::wire::{SLOT_BYTES, SLOTS};
pub(crate) use region::Region;

use super::reg::RegCache;
use super::verbs::{QueuePair, SendOp, Sge};
use super::wire::Imm;
use crate::error::{Error, Result};
use crate::sync::{lock, wait_timeout};
use crate::transport::matching::{Header, Matcher, RecvOp};
use crate::transport::{ALL_GROUPS, AbortCause, Completion, Key, Pair, RecvTarget, SendBuf};
use crate::types::OpDesc;
use receive::Reading;
use send::{PendingSend, RtsSend};
use std::collections::{HashMap, VecDeque};
use std::net::TcpStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a failed request waits for the peer's word on the lifeline before it reports its
/// own error.
const CAUSE_GRACE: Duration = Duration::from_millis(200);

/// The most bytes one RDMA read request moves (a work request's length is 32 bits, and ports
/// take up to 2 GiB per message). The crate's own tests use 64 KiB, so that their payloads
/// take several.
const MAX_READ: usize = if cfg!(test) { 64 << 10 } else { 1 << 30 };
/// Send-queue requests a pair keeps posted at once (more wait in order).
pub(crate) const SQ_DEPTH: usize = 64;
/// Receive requests a pair keeps posted (data, credits and dones each take one).
pub(crate) const RQ_DEPTH: usize = 4 * SLOTS + 16;

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
    fn control(&self, st: &mut State, imm: Imm) {
        let (addr, rkey) = self.remote_ring;
        let wr = Wr {
            wr_id: wr_id(self.peer, WrKind::Write, 0),
            sge: Sge { addr: self.staging.addr(0), len: 0, lkey: self.staging.mr.lkey() },
            op: SendOp::WriteImm { remote_addr: addr, rkey, imm: imm.encode() },
        };
        self.post(st, wr);
    }

    fn io_error(&self, what: &str, detail: &str) -> Error {
        Error::io(format!("rank {}: {what}", self.me), std::io::Error::other(detail.to_string()))
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

    fn aborted(&self, group: u64) -> Option<Error> {
        lock(&self.link.state).matcher.aborted(group)
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
        if group == ALL_GROUPS {
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
