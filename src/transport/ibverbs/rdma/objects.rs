//! The real provider's verbs objects over `rdma-sys`: memory regions, completion queues (on a
//! non-blocking completion channel) and RC queue pairs (RESET → INIT → RTR → RTS, RDMA write
//! with immediate and RDMA read, every request signalled). Like the rest of [`super`], compiled
//! and never run against hardware.

use super::super::verbs::{CompletionQueue, MemoryRegion, QpAddr, QueuePair, SendOp, Sge, Wc, WcKind, WcStatus};
use super::{ACCESS, Ctx, rc_error};
use crate::error::{Error, Result};
use crate::sync::lock;
use rdma_sys::*;
use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};
/// A registered memory region (or, for zero bytes, none: `mr` NULL and keys 0).
pub(super) struct RdmaMr {
    pub(super) mr: *mut ibv_mr,
    pub(super) addr: u64,
    pub(super) len: usize,
    pub(super) lkey: u32,
    pub(super) rkey: u32,
    /// Keeps the protection domain alive while registered.
    pub(super) _ctx: Option<Arc<Ctx>>,
}

// SAFETY: the region's pointer is only used to deregister it, once, in drop (deregistration
// may happen on any thread); everything else is copied plain data.
unsafe impl Send for RdmaMr {}
// SAFETY: as above: a shared `&RdmaMr` reads only the copied fields.
unsafe impl Sync for RdmaMr {}

impl MemoryRegion for RdmaMr {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for RdmaMr {
    fn drop(&mut self) {
        if !self.mr.is_null() {
            // SAFETY: registered by this provider, deregistered once, before the protection
            // domain (held in `_ctx`, dropped after this body).
            unsafe { ibv_dereg_mr(self.mr) };
        }
    }
}

/// A completion queue and its completion channel (non-blocking).
pub(super) struct RdmaCq {
    pub(super) cq: *mut ibv_cq,
    pub(super) channel: *mut ibv_comp_channel,
    pub(super) fd: RawFd,
    /// Serialises taking events off the channel and acknowledging them.
    pub(super) events: Mutex<()>,
    pub(super) ctx: Arc<Ctx>,
}

// SAFETY: polling, arming, and taking and acknowledging events of one completion queue are
// thread safe in libibverbs (the providers lock the queue); event handling is serialised by
// `events` anyway, and the queue and channel are destroyed once, in drop.
unsafe impl Send for RdmaCq {}
// SAFETY: as above.
unsafe impl Sync for RdmaCq {}

/// A completion status in [`WcStatus`]'s terms.
pub(super) fn status(s: ibv_wc_status::Type, vendor: u32) -> WcStatus {
    match s {
        ibv_wc_status::IBV_WC_SUCCESS => WcStatus::Success,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR | ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        other => {
            // SAFETY: the library returns a static string for any status value ("unknown"
            // out of range).
            let p = unsafe { ibv_wc_status_str(other) };
            let words = if p.is_null() {
                "unknown status".to_string()
            } else {
                // SAFETY: non-NULL: a static NUL-terminated string.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            };
            WcStatus::Other(format!("{words} (status {other}, vendor error {vendor:#x})"))
        }
    }
}

impl CompletionQueue for RdmaCq {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// Completions in [`Wc`]'s terms. The opcode of a completion in error is undefined in
    /// libibverbs, so such a completion is reported as [`WcKind::Send`] unless its opcode
    /// happens to read as a receive: the caller must tell send from receive requests by their
    /// `wr_id`. `imm` and `byte_len` mean something only for successful receives.
    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<usize> {
        const BATCH: usize = 32;
        let mut total = 0;
        while total < max {
            // SAFETY: an all-zero work completion array is valid plain data for the verb.
            let mut wcs: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
            let want = (max - total).min(BATCH);
            // SAFETY: the completion queue is live and `wcs` holds at least `want` entries
            // (at most 32, so the cast is exact).
            let n = unsafe { ibv_poll_cq(self.cq, want as i32, wcs.as_mut_ptr()) };
            let Ok(got) = usize::try_from(n) else {
                return Err(Error::io(
                    format!("ibv_poll_cq on {}", self.ctx.port.device),
                    io::Error::other(format!("the provider returned {n}")),
                ));
            };
            for wc in wcs.iter().take(got.min(want)) {
                let kind = match wc.opcode {
                    ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM | ibv_wc_opcode::IBV_WC_RECV => WcKind::RecvImm,
                    _ => WcKind::Send,
                };
                // SAFETY: the union is two 32-bit integers; any bits are valid (they are the
                // immediate data, big-endian, for a write with immediate).
                let imm = u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data });
                out.push(Wc {
                    wr_id: wc.wr_id,
                    status: status(wc.status, wc.vendor_err),
                    kind,
                    imm,
                    byte_len: wc.byte_len,
                    qpn: wc.qp_num,
                });
            }
            total += got.min(want);
            if got < want {
                break;
            }
        }
        Ok(total)
    }

    fn arm(&self) -> Result<()> {
        // SAFETY: the completion queue is live.
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 {
            return Err(Error::io(format!("ibv_req_notify_cq on {}", self.ctx.port.device), rc_error(rc)));
        }
        Ok(())
    }

    fn fd(&self) -> RawFd {
        self.fd
    }

    fn ack(&self) {
        let _serial = lock(&self.events);
        let mut taken: u32 = 0;
        while taken < 64 {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut cq_ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking: with no event pending the call
            // returns -1 (EAGAIN) at once; the out-pointers are valid.
            if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) } != 0 {
                break;
            }
            taken += 1;
        }
        if taken > 0 {
            // SAFETY: the queue is live (the channel serves only it); acknowledges exactly the
            // events taken above.
            unsafe { ibv_ack_cq_events(self.cq, taken) };
        }
    }
}

impl Drop for RdmaCq {
    fn drop(&mut self) {
        // Every event taken is acknowledged (ibv_destroy_cq waits for that); take any pending.
        self.ack();
        // SAFETY: the queue pairs using this queue (each holding an `Arc` of it) are gone; the
        // queue is destroyed before its channel, each once, before the context (`ctx`,
        // dropped after this body).
        unsafe {
            ibv_destroy_cq(self.cq);
            ibv_destroy_comp_channel(self.channel);
        }
    }
}

/// A reliable-connected queue pair.
pub(super) struct RdmaQp {
    pub(super) qp: *mut ibv_qp,
    pub(super) qpn: u32,
    /// Its completion queue, destroyed after it.
    pub(super) _cq: Arc<dyn CompletionQueue>,
    pub(super) ctx: Arc<Ctx>,
}

// SAFETY: posting to and modifying one queue pair from several threads is thread safe in
// libibverbs (the providers lock the queues); the queue pair is destroyed once, in drop.
unsafe impl Send for RdmaQp {}
// SAFETY: as above.
unsafe impl Sync for RdmaQp {}

impl RdmaQp {
    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, what: &str, remote: u32) -> Result<()> {
        // SAFETY: the queue pair is live and `attr` is initialised for every field the mask
        // names (the rest zero) and outlives the call.
        let rc = unsafe { ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            let p = &self.ctx.port;
            return Err(Error::io(
                format!(
                    "ibv_modify_qp to {what} on {} port {} (QPN {:#x}, remote QPN {remote:#x})",
                    p.device, p.port, self.qpn
                ),
                rc_error(rc),
            ));
        }
        Ok(())
    }
}

impl QueuePair for RdmaQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn connect(&self, psn: u32, remote: &QpAddr) -> Result<()> {
        use ibv_qp_attr_mask as M;
        let port = &self.ctx.port;

        // SAFETY: all-zero attributes are valid plain data; each step sets what its mask names.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port.port;
        a.qp_access_flags = ACCESS;
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "INIT",
            remote.qpn,
        )?;

        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ibv_mtu::Type::from(remote.mtu.min(port.mtu).clamp(1, 5));
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn & 0x00ff_ffff;
        a.max_dest_rd_atomic = self.ctx.resp_rd_atom;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = port.port;
        if port.roce || (remote.lid == 0 && remote.gid != [0u8; 16]) {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = port.gid_index;
            a.ah_attr.grh.hop_limit = 64;
        }
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "RTR",
            remote.qpn,
        )?;

        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = psn & 0x00ff_ffff;
        a.max_rd_atomic = self.ctx.init_rd_atom;
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
            remote.qpn,
        )
    }

    fn post_send(&self, wr_id: u64, sge: Sge, op: SendOp) -> Result<()> {
        let mut sg = ibv_sge { addr: sge.addr, length: sge.len, lkey: sge.lkey };
        // SAFETY: an all-zero work request is valid plain data (no next request); the fields
        // used are set below.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sg;
        wr.num_sge = i32::from(sge.len > 0);
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let (what, remote_addr, rkey) = match op {
            SendOp::WriteImm { remote_addr, rkey, imm } => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                ("RDMA write with immediate", remote_addr, rkey)
            }
            SendOp::Read { remote_addr, rkey } => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                ("RDMA read", remote_addr, rkey)
            }
        };
        wr.wr.rdma = rdma_t { remote_addr, rkey };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the queue pair is live; `wr` and `sg` outlive the call (the provider copies
        // them into the send queue); the memory `sg` names is registered by the caller.
        let rc = unsafe { ibv_post_send(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(Error::io(
                format!(
                    "ibv_post_send ({what} of {} bytes) on {} (QPN {:#x})",
                    sge.len, self.ctx.port.device, self.qpn
                ),
                rc_error(rc),
            ));
        }
        Ok(())
    }

    fn post_recv(&self, wr_id: u64) -> Result<()> {
        let mut wr = ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 0 };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the queue pair is live and `wr` (no buffers, no next request) outlives the
        // call.
        let rc = unsafe { ibv_post_recv(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(Error::io(
                format!("ibv_post_recv on {} (QPN {:#x})", self.ctx.port.device, self.qpn),
                rc_error(rc),
            ));
        }
        Ok(())
    }

    fn set_error(&self) {
        // SAFETY: all-zero attributes are valid plain data; only the state is used.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // Best effort: a queue pair that cannot be moved to error is broken already.
        let _ = self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ERR", 0);
    }
}

impl Drop for RdmaQp {
    fn drop(&mut self) {
        // SAFETY: created by this provider and destroyed once, before its completion queue
        // (`_cq`) and the context (`ctx`), both dropped after this body.
        unsafe { ibv_destroy_qp(self.qp) };
    }
}
