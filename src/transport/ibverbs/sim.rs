//! A simulated verbs provider: RDMA devices, queue pairs and memory regions modelled in this
//! process, for testing the ibverbs backend where no RDMA hardware exists.
//!
//! One fabric per process connects every simulated device. What it models, and checks:
//!
//! - **Memory regions** with keys, bounds and access rights: a work request's local bytes must
//!   lie inside the region its `lkey` names (one that allows local writes, for a read's
//!   destination), and a remote access inside the peer's region `rkey` names, in the peer's
//!   protection domain, which must allow that access (remote write, or remote read). A bad remote key or range completes the request with
//!   [`WcStatus::RemoteAccess`] and puts both queue pairs in the error state, as an RC
//!   responder does. A deregistered region's keys grant nothing.
//! - **RC queue pairs** with states: posting needs RTS; a queue pair in error completes every
//!   request as [`WcStatus::Flushed`]; a request to a peer that is gone (destroyed) or in error
//!   completes as [`WcStatus::RetryExceeded`] and puts the sender in error.
//! - **RDMA write with immediate** consumes a receive request at the peer (held until one is
//!   posted, as hardware retries on receiver-not-ready) and **RDMA read**.
//! - **Completion queues** with a completion channel (an eventfd) raised once per arming.
//! - **Faults** a test injects ([`inject`]): a queue pair that goes to error after a number
//!   of requests, or whose next requests carry a wrong remote key.
//!
//! The "NIC" is the posting thread: a request's bytes move while it is posted (under the
//! fabric's lock, so a region cannot be deregistered during a copy), and its completions are
//! queued at once. Timing, packet loss and MTU segmentation are not modelled.

use super::verbs::{
    Access, CompletionQueue, MemoryRegion, PortInfo, QpAddr, QueuePair, SendOp, Sge, VerbsDevice, Wc, WcKind, WcStatus,
};
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::transport::wake::EventFd;
use std::collections::{HashMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// A fault a test injects into the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Fault {
    /// The queue pairs of simulated device `dev` ([`device_id`]) go to the error state once
    /// `after` more requests were posted on them: that request fails as a broken link fails
    /// it (retries exhausted), later ones are flushed.
    QpError { dev: u32, after: u32 },
    /// The next `count` requests posted on device `dev`'s queue pairs that carry bytes name a
    /// remote key the peer never gave.
    BadRkey { dev: u32, count: u32 },
}

#[derive(Debug, Clone, Copy)]
struct MrEntry {
    addr: u64,
    len: usize,
    pd: u32,
    access: Access,
}

#[derive(Default)]
struct Fabric {
    next_key: u32,
    next_qpn: u32,
    next_dev: u32,
    qps: HashMap<u32, Weak<SimQp>>,
    mrs: HashMap<u32, MrEntry>,
    faults: Vec<Fault>,
}

fn fabric() -> &'static Mutex<Fabric> {
    static FABRIC: OnceLock<Mutex<Fabric>> = OnceLock::new();
    FABRIC.get_or_init(|| Mutex::new(Fabric { next_key: 0x100, next_qpn: 0x40, ..Fabric::default() }))
}

/// Injects `fault` into the fabric.
#[cfg(test)]
pub(crate) fn inject(fault: Fault) {
    lock(fabric()).faults.push(fault);
}

/// The number of simulated device `dev`, for [`Fault`]s (`None` for another provider's).
#[cfg(test)]
pub(crate) fn device_id(dev: &dyn VerbsDevice) -> Option<u32> {
    dev.port().device.strip_prefix("sim")?.parse().ok()
}

/// Opens a simulated device (a protection domain of its own; every device is on one fabric).
pub(crate) fn open() -> Arc<dyn VerbsDevice> {
    let id = {
        let mut f = lock(fabric());
        f.next_dev += 1;
        f.next_dev
    };
    let mut gid = [0u8; 16];
    gid[..2].copy_from_slice(&[0xfe, 0x80]);
    gid[12..].copy_from_slice(&id.to_be_bytes());
    Arc::new(SimDevice {
        pd: id,
        port: PortInfo {
            device: format!("sim{id}"),
            port: 1,
            lid: (id & 0xffff) as u16,
            gid,
            gid_index: 0,
            mtu: 5,
            roce: false,
        },
    })
}

struct SimDevice {
    pd: u32,
    port: PortInfo,
}

struct SimMr {
    addr: u64,
    len: usize,
    key: u32,
}

impl MemoryRegion for SimMr {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for SimMr {
    fn drop(&mut self) {
        lock(fabric()).mrs.remove(&self.key);
    }
}

impl VerbsDevice for SimDevice {
    fn port(&self) -> &PortInfo {
        &self.port
    }

    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<Arc<dyn MemoryRegion>> {
        let mut f = lock(fabric());
        f.next_key = f.next_key.wrapping_add(1).max(0x100);
        let key = f.next_key;
        f.mrs.insert(key, MrEntry { addr: addr as u64, len, pd: self.pd, access });
        Ok(Arc::new(SimMr { addr: addr as u64, len, key }))
    }

    fn coherent_registrations(&self) -> bool {
        // The simulated NIC reads and writes the process's memory through its current
        // mapping, as on-demand paging does.
        true
    }

    fn create_cq(&self, _depth: usize) -> Result<Arc<dyn CompletionQueue>> {
        let event = EventFd::new().map_err(|e| Error::io("creating a simulated completion channel (eventfd)", e))?;
        Ok(Arc::new(SimCq::new(event)))
    }

    fn create_qp(&self, cq: &Arc<dyn CompletionQueue>, _max_send: u32, _max_recv: u32) -> Result<Arc<dyn QueuePair>> {
        let Some(sim_cq) = cq.as_any().downcast_ref::<SimCq>().map(|c| c.inner.clone()) else {
            return Err(Error::invalid("a simulated queue pair needs a simulated completion queue"));
        };
        let mut f = lock(fabric());
        f.next_qpn = (f.next_qpn + 1) & 0x00ff_ffff;
        let qpn = f.next_qpn;
        let qp = Arc::new(SimQp { qpn, pd: self.pd, cq: sim_cq, state: Mutex::new(QpState::default()) });
        // Destroyed queue pairs leave dead entries (a drop must not take the fabric's lock: the
        // last reference can go while a post holds it); sweep them now and then.
        if qpn.is_multiple_of(256) {
            f.qps.retain(|_, q| q.strong_count() > 0);
        }
        f.qps.insert(qpn, Arc::downgrade(&qp));
        Ok(qp)
    }
}

#[derive(Default)]
struct CqState {
    wcs: VecDeque<Wc>,
    armed: bool,
}

/// What a simulated completion queue is (queue pairs hold it).
struct SimCqInner {
    state: Mutex<CqState>,
    event: EventFd,
}

impl SimCqInner {
    fn push(&self, wc: Wc) {
        let mut s = lock(&self.state);
        s.wcs.push_back(wc);
        if std::mem::take(&mut s.armed) {
            self.event.signal();
        }
    }
}

struct SimCq {
    inner: Arc<SimCqInner>,
}

impl SimCq {
    fn new(event: EventFd) -> Self {
        SimCq { inner: Arc::new(SimCqInner { state: Mutex::new(CqState::default()), event }) }
    }
}

impl CompletionQueue for SimCq {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<usize> {
        let mut s = lock(&self.inner.state);
        let n = s.wcs.len().min(max);
        out.extend(s.wcs.drain(..n));
        Ok(n)
    }

    fn arm(&self) -> Result<()> {
        lock(&self.inner.state).armed = true;
        Ok(())
    }

    fn fd(&self) -> RawFd {
        self.inner.event.raw()
    }

    fn ack(&self) {
        self.inner.event.drain();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum State {
    #[default]
    Init,
    Rts,
    Error,
}

#[derive(Default)]
struct QpState {
    state: State,
    remote: u32,
    /// Posted receive requests.
    recvs: VecDeque<u64>,
    /// Writes with immediate that found no receive request yet: (immediate, bytes).
    backlog: VecDeque<(u32, u32)>,
}

struct SimQp {
    qpn: u32,
    pd: u32,
    cq: Arc<SimCqInner>,
    state: Mutex<QpState>,
}

impl SimQp {
    fn wc(&self, wr_id: u64, status: WcStatus, kind: WcKind, imm: u32, byte_len: u32) -> Wc {
        Wc { wr_id, status, kind, imm, byte_len, qpn: self.qpn }
    }

    /// Puts the queue pair in error: its posted receives complete as flushed.
    fn fail(&self, st: &mut QpState) {
        st.state = State::Error;
        st.backlog.clear();
        for wr_id in st.recvs.drain(..) {
            self.cq.push(self.wc(wr_id, WcStatus::Flushed, WcKind::RecvImm, 0, 0));
        }
    }

    /// A write with immediate arrived: it takes a posted receive or waits for one.
    fn deliver(&self, st: &mut QpState, imm: u32, len: u32) {
        match st.recvs.pop_front() {
            Some(wr_id) => self.cq.push(self.wc(wr_id, WcStatus::Success, WcKind::RecvImm, imm, len)),
            None => st.backlog.push_back((imm, len)),
        }
    }
}

/// Whether `[addr, addr + len)` lies inside the region.
fn inside(mr: &MrEntry, addr: u64, len: usize) -> bool {
    addr >= mr.addr && addr.checked_add(len as u64).is_some_and(|end| end <= mr.addr + mr.len as u64)
}

impl QueuePair for SimQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn connect(&self, _psn: u32, remote: &QpAddr) -> Result<()> {
        let mut st = lock(&self.state);
        if st.state != State::Init {
            return Err(Error::invalid(format!("simulated queue pair {:#x} connected twice", self.qpn)));
        }
        st.state = State::Rts;
        st.remote = remote.qpn;
        Ok(())
    }

    fn post_send(&self, wr_id: u64, sge: Sge, op: SendOp) -> Result<()> {
        let mut f = lock(fabric());
        let mut st = lock(&self.state);
        match st.state {
            State::Error => {
                self.cq.push(self.wc(wr_id, WcStatus::Flushed, WcKind::Send, 0, 0));
                return Ok(());
            }
            State::Init => {
                return Err(Error::invalid(format!(
                    "simulated queue pair {:#x} posted to before it is connected",
                    self.qpn
                )));
            }
            State::Rts => {}
        }
        // Injected faults.
        let mut bad_rkey = false;
        let mut now_error = false;
        f.faults.retain_mut(|fault| match fault {
            Fault::QpError { dev, after } if *dev == self.pd => {
                if *after == 0 {
                    now_error = true;
                    false
                } else {
                    *after -= 1;
                    true
                }
            }
            // Only a request that reaches remote memory checks its key (as on hardware, where a
            // zero-length write is not checked): one of none, a credit or an immediate alone,
            // would spend the fault and go through.
            Fault::BadRkey { dev, count } if *dev == self.pd && *count > 0 && sge.len > 0 => {
                bad_rkey = true;
                *count -= 1;
                *count > 0
            }
            _ => true,
        });
        if now_error {
            self.cq.push(self.wc(wr_id, WcStatus::RetryExceeded, WcKind::Send, 0, 0));
            self.fail(&mut st);
            return Ok(());
        }
        let len = sge.len as usize;
        // A read writes the local bytes: their region must allow local writes.
        let writes_local = matches!(op, SendOp::Read { .. });
        let local_ok = len == 0
            || f.mrs.get(&sge.lkey).is_some_and(|mr| {
                mr.pd == self.pd && inside(mr, sge.addr, len) && (!writes_local || mr.access.local_write())
            });
        if !local_ok {
            let what =
                format!("local protection error: lkey {:#x} does not cover {len} bytes at {:#x}", sge.lkey, sge.addr);
            self.cq.push(self.wc(wr_id, WcStatus::Other(what), WcKind::Send, 0, 0));
            self.fail(&mut st);
            return Ok(());
        }
        let peer = f.qps.get(&st.remote).and_then(Weak::upgrade);
        let Some(peer) = peer else {
            self.cq.push(self.wc(wr_id, WcStatus::RetryExceeded, WcKind::Send, 0, 0));
            self.fail(&mut st);
            return Ok(());
        };
        let mut pst = lock(&peer.state);
        if pst.state != State::Rts || pst.remote != self.qpn {
            drop(pst);
            self.cq.push(self.wc(wr_id, WcStatus::RetryExceeded, WcKind::Send, 0, 0));
            self.fail(&mut st);
            return Ok(());
        }
        let (remote_addr, rkey) = match op {
            SendOp::WriteImm { remote_addr, rkey, .. } | SendOp::Read { remote_addr, rkey } => (remote_addr, rkey),
        };
        let rkey = if bad_rkey { rkey ^ 0x5a5a_0000 } else { rkey };
        let permitted = |a: Access| match op {
            SendOp::WriteImm { .. } => a == Access::RemoteWrite,
            SendOp::Read { .. } => a == Access::RemoteRead,
        };
        let remote_ok = len == 0
            || f.mrs
                .get(&rkey)
                .is_some_and(|mr| mr.pd == peer.pd && inside(mr, remote_addr, len) && permitted(mr.access));
        if !remote_ok {
            // The responder refuses, and both ends of an RC connection go to error.
            peer.fail(&mut pst);
            drop(pst);
            self.cq.push(self.wc(wr_id, WcStatus::RemoteAccess, WcKind::Send, 0, 0));
            self.fail(&mut st);
            return Ok(());
        }
        if len > 0 {
            let (src, dst) = match op {
                SendOp::WriteImm { .. } => (sge.addr, remote_addr),
                SendOp::Read { .. } => (remote_addr, sge.addr),
            };
            // SAFETY: both ranges lie inside regions registered in the fabric (checked above
            // under the fabric's lock, which deregistration takes too), whose registrants
            // promised the memory stays allocated while registered (`VerbsDevice::register`);
            // `copy` allows overlap.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        }
        if let SendOp::WriteImm { imm, .. } = op {
            peer.deliver(&mut pst, imm, sge.len);
        }
        drop(pst);
        self.cq.push(self.wc(wr_id, WcStatus::Success, WcKind::Send, 0, sge.len));
        Ok(())
    }

    fn post_recv(&self, wr_id: u64) -> Result<()> {
        let mut st = lock(&self.state);
        if st.state == State::Error {
            self.cq.push(self.wc(wr_id, WcStatus::Flushed, WcKind::RecvImm, 0, 0));
            return Ok(());
        }
        st.recvs.push_back(wr_id);
        if let Some((imm, len)) = st.backlog.pop_front() {
            self.deliver(&mut st, imm, len);
        }
        Ok(())
    }

    fn set_error(&self) {
        let _f = lock(fabric());
        let mut st = lock(&self.state);
        self.fail(&mut st);
    }
}
