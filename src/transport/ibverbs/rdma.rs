//! The real verbs provider, over `rdma-sys` (libibverbs from rdma-core).
//!
//! It is compiled in CI (against Debian's rdma-core headers) and its "no RDMA device" path is
//! tested; no machine it was developed on has an RDMA device, so **none of the verbs below has
//! run against hardware**. It follows libibverbs' documented sequence: open the device, a
//! protection domain, a completion queue on a completion channel, RC queue pairs moved
//! RESET → INIT → RTR → RTS, memory regions for local write and remote read and write, RDMA
//! write with immediate data and RDMA read, every request signalled.

use super::verbs::{
    CompletionQueue, MemoryRegion, PortInfo, QpAddr, QueuePair, SendOp, Sge, VerbsDevice, Wc, WcKind, WcStatus,
};
use crate::error::{Error, Result};
use rdma_sys::*;
use std::ffi::CStr;
use std::os::fd::RawFd;
use std::sync::Arc;

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that the bindings leave out).
const LINK_LAYER_ETHERNET: u8 = 2;

/// The verb `what` failed with errno `code` (or the thread's last one for 0).
fn verb_error(what: String, code: i32) -> Error {
    let e = if code > 0 { std::io::Error::from_raw_os_error(code) } else { std::io::Error::last_os_error() };
    Error::io(what, e)
}

/// An opened device: its context and protection domain. Queue pairs, completion queues and
/// memory regions hold an `Arc` of it, so it is closed after them.
struct Ctx {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    port: PortInfo,
    max_rd_atom: u8,
}

// SAFETY: libibverbs contexts and protection domains may be used from any thread; this
// provider calls only thread-safe verbs on them (rdma-core documents its verbs as thread safe).
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: both were allocated by this provider, everything made from them (which held
        // an `Arc` of this) is gone, and they are freed once.
        unsafe {
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.ctx);
        }
    }
}

/// A device list from `ibv_get_device_list`, freed on drop.
struct DeviceList(*mut *mut ibv_device, usize);

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the list came from `ibv_get_device_list` and is freed once; opened
            // contexts stay valid after it is freed.
            unsafe { ibv_free_device_list(self.0) };
        }
    }
}

impl DeviceList {
    fn get() -> Self {
        let mut n: i32 = 0;
        // SAFETY: `n` is a valid out-pointer; a NULL result (no provider, no devices) is
        // handled by the callers.
        let list = unsafe { ibv_get_device_list(&mut n) };
        DeviceList(list, if list.is_null() { 0 } else { n.max(0) as usize })
    }

    fn devices(&self) -> Vec<(*mut ibv_device, String)> {
        (0..self.1)
            .filter_map(|i| {
                // SAFETY: the list holds `self.1` device pointers.
                let d = unsafe { *self.0.add(i) };
                if d.is_null() {
                    return None;
                }
                // SAFETY: a listed device has a NUL-terminated name owned by the library.
                let name = unsafe { CStr::from_ptr(ibv_get_device_name(d)) }.to_string_lossy().into_owned();
                Some((d, name))
            })
            .collect()
    }
}

/// Opens RDMA device `name` (the first with an active port `port` for `None`), port `port`,
/// GID index `gid_index` (`None`: for RoCE the first RoCE v2 entry with an IPv4-mapped GID,
/// else the first RoCE v2 entry, else 0; for InfiniBand 0).
pub(crate) fn open(name: Option<&str>, port: u8, gid_index: Option<u8>) -> Result<Arc<dyn VerbsDevice>> {
    let list = DeviceList::get();
    let devices = list.devices();
    if devices.is_empty() {
        return Err(Error::unsupported(
            "the ibverbs transport: no RDMA device was found (ibv_get_device_list lists none; is rdma-core's \
             provider for the adapter installed and its kernel module loaded?)",
            None,
        ));
    }
    let names: Vec<&str> = devices.iter().map(|(_, n)| n.as_str()).collect();
    let candidates: Vec<_> = match name {
        Some(want) => {
            let found: Vec<_> = devices.iter().filter(|(_, n)| n == want).collect();
            if found.is_empty() {
                return Err(Error::invalid(format!(
                    "RDMA device {want:?} was not found; this host has {}",
                    names.join(", ")
                )));
            }
            found
        }
        None => devices.iter().collect(),
    };
    let mut why = Vec::new();
    for (dev, dname) in candidates {
        match open_one(*dev, dname, port, gid_index) {
            Ok(c) => return Ok(Arc::new(RdmaDevice { ctx: Arc::new(c) })),
            Err(e) => why.push(format!("{dname}: {e}")),
        }
    }
    Err(Error::invalid(format!("no usable RDMA device port {port}: {}", why.join("; "))))
}

fn open_one(dev: *mut ibv_device, name: &str, port: u8, gid_index: Option<u8>) -> Result<Ctx> {
    // SAFETY: `dev` comes from a live device list.
    let ctx = unsafe { ibv_open_device(dev) };
    if ctx.is_null() {
        return Err(verb_error(format!("ibv_open_device on {name}"), 0));
    }
    // From here the context is closed on every error path by `Ctx`'s drop (once the PD exists)
    // or explicitly.
    let close = |e: Error| {
        // SAFETY: opened above, not used after this.
        unsafe { ibv_close_device(ctx) };
        e
    };
    // SAFETY: an all-zero port attribute struct is valid plain data for the verb to fill.
    let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open and `pa` a valid out-pointer of the size the wrapper passes.
    let rc = unsafe { ___ibv_query_port(ctx, port, &mut pa) };
    if rc != 0 {
        return Err(close(verb_error(format!("ibv_query_port on {name} port {port}"), rc)));
    }
    if pa.state != ibv_port_state::IBV_PORT_ACTIVE {
        return Err(close(Error::invalid(format!(
            "port {port} of {name} is not active (state {}); check the cable and the subnet manager",
            pa.state
        ))));
    }
    let roce = pa.link_layer == LINK_LAYER_ETHERNET;
    let gid_of = |i: u8| -> Option<[u8; 16]> {
        // SAFETY: an all-zero GID is valid plain data for the verb to fill.
        let mut g: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `g` a valid out-pointer.
        let rc = unsafe { ibv_query_gid(ctx, port, i32::from(i), &mut g) };
        // SAFETY: every bit pattern of the union is a valid byte array.
        let raw = unsafe { g.raw };
        (rc == 0).then_some(raw)
    };
    let index = match gid_index {
        Some(i) => i,
        None if roce => choose_roce_gid(name, port, pa.gid_tbl_len, &gid_of),
        None => 0,
    };
    let gid = gid_of(index)
        .ok_or_else(|| close(Error::invalid(format!("GID index {index} of {name} port {port} cannot be read"))))?;
    if roce && gid == [0u8; 16] {
        return Err(close(Error::invalid(format!(
            "GID index {index} of {name} port {port} is empty; set FERROGLOO_IB_GID_INDEX (see show_gids)"
        ))));
    }
    // SAFETY: an all-zero device attribute struct is valid plain data for the verb to fill.
    let mut da: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open and `da` a valid out-pointer.
    let rc = unsafe { ibv_query_device(ctx, &mut da) };
    if rc != 0 {
        return Err(close(verb_error(format!("ibv_query_device on {name}"), rc)));
    }
    // SAFETY: `ctx` is open.
    let pd = unsafe { ibv_alloc_pd(ctx) };
    if pd.is_null() {
        return Err(close(verb_error(format!("ibv_alloc_pd on {name}"), 0)));
    }
    Ok(Ctx {
        ctx,
        pd,
        port: PortInfo {
            device: name.to_string(),
            port,
            lid: pa.lid,
            gid,
            gid_index: index,
            mtu: pa.active_mtu as u8,
            roce,
        },
        max_rd_atom: da.max_qp_rd_atom.clamp(1, 16) as u8,
    })
}

/// The GID index RoCE v2 traffic should use: the first RoCE v2 entry with an IPv4-mapped
/// address, else the first RoCE v2 entry, else 0 (types from sysfs, as `show_gids` reads them).
fn choose_roce_gid(name: &str, port: u8, len: i32, gid_of: &dyn Fn(u8) -> Option<[u8; 16]>) -> u8 {
    let mut first_v2 = None;
    for i in 0..len.clamp(0, 256) {
        let i = i as u8;
        let Some(g) = gid_of(i).filter(|g| *g != [0u8; 16]) else { continue };
        let kind = std::fs::read_to_string(format!("/sys/class/infiniband/{name}/ports/{port}/gid_attrs/types/{i}"))
            .unwrap_or_default();
        if !kind.trim().eq_ignore_ascii_case("RoCE v2") {
            continue;
        }
        if g[..10] == [0u8; 10] && g[10..12] == [0xff, 0xff] {
            return i;
        }
        first_v2.get_or_insert(i);
    }
    first_v2.unwrap_or(0)
}

struct RdmaDevice {
    ctx: Arc<Ctx>,
}

impl VerbsDevice for RdmaDevice {
    fn port(&self) -> &PortInfo {
        &self.ctx.port
    }

    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<Arc<dyn MemoryRegion>> {
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        // SAFETY: the PD is live; the caller promises the memory stays allocated while
        // registered (a zero-length registration is refused by the verb, not undefined).
        let mr = unsafe { ibv_reg_mr(self.ctx.pd, addr.cast(), len.max(1), access as i32) };
        if mr.is_null() {
            return Err(verb_error(
                format!(
                    "ibv_reg_mr of {len} bytes at {addr:p} on {} (is the locked-memory limit, ulimit -l, high enough?)",
                    self.ctx.port.device
                ),
                0,
            ));
        }
        Ok(Arc::new(RdmaMr { mr, _ctx: self.ctx.clone() }))
    }

    fn coherent_registrations(&self) -> bool {
        false
    }

    fn create_cq(&self, depth: usize) -> Result<Arc<dyn CompletionQueue>> {
        let dev = &self.ctx.port.device;
        // SAFETY: the context is live.
        let channel = unsafe { ibv_create_comp_channel(self.ctx.ctx) };
        if channel.is_null() {
            return Err(verb_error(format!("ibv_create_comp_channel on {dev}"), 0));
        }
        // SAFETY: the channel was just created; its fd is a valid descriptor it owns.
        let fd = unsafe { (*channel).fd };
        // SAFETY: `fd` is open; F_GETFL/F_SETFL take and return plain flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            let e = verb_error(format!("making the completion channel of {dev} non-blocking"), 0);
            // SAFETY: created above, unused elsewhere.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(e);
        }
        let cqe = i32::try_from(depth).unwrap_or(i32::MAX);
        // SAFETY: the context and channel are live.
        let cq = unsafe { ibv_create_cq(self.ctx.ctx, cqe, std::ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = verb_error(format!("ibv_create_cq of {depth} entries on {dev}"), 0);
            // SAFETY: created above, unused elsewhere.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(e);
        }
        Ok(Arc::new(RdmaCq { cq, channel, unacked: std::sync::Mutex::new(0), _ctx: self.ctx.clone() }))
    }

    fn create_qp(&self, cq: &Arc<dyn CompletionQueue>, max_send: u32, max_recv: u32) -> Result<Arc<dyn QueuePair>> {
        let dev = &self.ctx.port.device;
        let Some(raw_cq) = rdma_cq_of(cq) else {
            return Err(Error::invalid("an RDMA queue pair needs a completion queue of the same provider"));
        };
        // SAFETY: all-zero init attributes are valid plain data; the fields that matter are set.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = raw_cq;
        init.recv_cq = raw_cq;
        init.cap = ibv_qp_cap {
            max_send_wr: max_send,
            max_recv_wr: max_recv,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 1;
        // SAFETY: the PD and the completion queue are live; `init` is fully initialised.
        let qp = unsafe { ibv_create_qp(self.ctx.pd, &mut init) };
        if qp.is_null() {
            return Err(verb_error(format!("ibv_create_qp (RC, {max_send} send, {max_recv} receive) on {dev}"), 0));
        }
        Ok(Arc::new(RdmaQp { qp, _cq: cq.clone(), ctx: self.ctx.clone() }))
    }
}

struct RdmaMr {
    mr: *mut ibv_mr,
    _ctx: Arc<Ctx>,
}

// SAFETY: a registered memory region is immutable plain data to its users; deregistration
// happens once, in drop.
unsafe impl Send for RdmaMr {}
// SAFETY: as above.
unsafe impl Sync for RdmaMr {}

impl MemoryRegion for RdmaMr {
    fn addr(&self) -> u64 {
        // SAFETY: the region is registered until drop.
        unsafe { (*self.mr).addr as u64 }
    }
    fn len(&self) -> usize {
        // SAFETY: as above.
        unsafe { (*self.mr).length }
    }
    fn lkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for RdmaMr {
    fn drop(&mut self) {
        // SAFETY: registered by this provider, deregistered once.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

struct RdmaCq {
    cq: *mut ibv_cq,
    channel: *mut ibv_comp_channel,
    /// Events taken off the channel and not yet acknowledged.
    unacked: std::sync::Mutex<u32>,
    _ctx: Arc<Ctx>,
}

// SAFETY: polling, arming and event handling of one completion queue are thread safe in
// libibverbs; the backend polls from one thread at a time anyway.
unsafe impl Send for RdmaCq {}
// SAFETY: as above.
unsafe impl Sync for RdmaCq {}

/// The raw completion queue behind a trait object of this provider.
fn rdma_cq_of(cq: &Arc<dyn CompletionQueue>) -> Option<*mut ibv_cq> {
    let any: &dyn std::any::Any = cq.as_any();
    any.downcast_ref::<RdmaCq>().map(|c| c.cq)
}

fn status(s: ibv_wc_status::Type, vendor: u32) -> WcStatus {
    match s {
        ibv_wc_status::IBV_WC_SUCCESS => WcStatus::Success,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR | ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        other => {
            // SAFETY: the library returns a static string for any status value.
            let words = unsafe { CStr::from_ptr(ibv_wc_status_str(other)) }.to_string_lossy().into_owned();
            WcStatus::Other(format!("{words} (status {other}, vendor error {vendor:#x})"))
        }
    }
}

impl CompletionQueue for RdmaCq {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn poll(&self, out: &mut Vec<Wc>, max: usize) -> Result<usize> {
        const BATCH: usize = 32;
        let mut total = 0;
        while total < max {
            // SAFETY: an all-zero work completion array is valid plain data for the verb.
            let mut wcs: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
            let want = (max - total).min(BATCH) as i32;
            // SAFETY: the completion queue is live and `wcs` holds `want` entries.
            let n = unsafe { ibv_poll_cq(self.cq, want, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(verb_error("ibv_poll_cq".into(), -n));
            }
            for wc in &wcs[..n as usize] {
                let kind =
                    if wc.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM { WcKind::RecvImm } else { WcKind::Send };
                // SAFETY: the union holds the immediate for completions with one, and plain
                // bits otherwise (ignored then).
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
            total += n as usize;
            if (n as usize) < want as usize {
                break;
            }
        }
        Ok(total)
    }

    fn arm(&self) -> Result<()> {
        // SAFETY: the completion queue is live.
        let rc = unsafe { ibv_req_notify_cq(self.cq, 0) };
        if rc != 0 { Err(verb_error("ibv_req_notify_cq".into(), rc)) } else { Ok(()) }
    }

    fn fd(&self) -> RawFd {
        // SAFETY: the channel lives as long as this queue.
        unsafe { (*self.channel).fd }
    }

    fn ack(&self) {
        let mut unacked = crate::sync::lock(&self.unacked);
        for _ in 0..64 {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking: with no event pending the call
            // returns -1 at once.
            if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut ctx) } != 0 {
                break;
            }
            *unacked += 1;
        }
        if *unacked > 0 {
            // SAFETY: acknowledges exactly the events taken above.
            unsafe { ibv_ack_cq_events(self.cq, *unacked) };
            *unacked = 0;
        }
    }
}

impl Drop for RdmaCq {
    fn drop(&mut self) {
        self.ack();
        // SAFETY: the queue pairs using this queue (holding an `Arc` of it) are gone; the
        // queue is destroyed before its channel, each once.
        unsafe {
            ibv_destroy_cq(self.cq);
            ibv_destroy_comp_channel(self.channel);
        }
    }
}

struct RdmaQp {
    qp: *mut ibv_qp,
    _cq: Arc<dyn CompletionQueue>,
    ctx: Arc<Ctx>,
}

// SAFETY: posting to and modifying one queue pair from several threads is thread safe in
// libibverbs; the backend serialises posts per pair anyway.
unsafe impl Send for RdmaQp {}
// SAFETY: as above.
unsafe impl Sync for RdmaQp {}

impl RdmaQp {
    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, what: &str, remote: u32) -> Result<()> {
        // SAFETY: the queue pair is live and `attr` fully initialised for the mask's fields.
        let rc = unsafe { ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            let p = &self.ctx.port;
            return Err(verb_error(
                format!("ibv_modify_qp to {what} on {} port {} (remote QPN {remote:#x})", p.device, p.port),
                rc,
            ));
        }
        Ok(())
    }
}

impl QueuePair for RdmaQp {
    fn qpn(&self) -> u32 {
        // SAFETY: the queue pair is live.
        unsafe { (*self.qp).qp_num }
    }

    fn connect(&self, psn: u32, remote: &QpAddr) -> Result<()> {
        let port = &self.ctx.port;
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        // SAFETY: all-zero attributes are valid plain data; each step sets what its mask names.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port.port;
        a.qp_access_flags = access;
        use ibv_qp_attr_mask as M;
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "INIT",
            remote.qpn,
        )?;

        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = u32::from(remote.mtu.min(port.mtu).max(1));
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn & 0x00ff_ffff;
        a.max_dest_rd_atomic = self.ctx.max_rd_atom;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = remote.lid;
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
        a.max_rd_atomic = self.ctx.max_rd_atom;
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
        // SAFETY: an all-zero work request is valid plain data; the fields used are set below.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sg;
        wr.num_sge = i32::from(sge.len > 0);
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        match op {
            SendOp::WriteImm { remote_addr, rkey, imm } => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                wr.wr.rdma = rdma_t { remote_addr, rkey };
            }
            SendOp::Read { remote_addr, rkey } => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                wr.wr.rdma = rdma_t { remote_addr, rkey };
            }
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the queue pair is live; `wr` and `sg` outlive the call (the library copies
        // them into the send queue); the memory `sg` names is registered by the caller.
        let rc = unsafe { ibv_post_send(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(verb_error(format!("ibv_post_send on {}", self.ctx.port.device), rc));
        }
        Ok(())
    }

    fn post_recv(&self, wr_id: u64) -> Result<()> {
        let mut wr = ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 0 };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the queue pair is live and `wr` outlives the call.
        let rc = unsafe { ibv_post_recv(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(verb_error(format!("ibv_post_recv on {}", self.ctx.port.device), rc));
        }
        Ok(())
    }

    fn set_error(&self) {
        // SAFETY: all-zero attributes are valid plain data; only the state is used.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // Best effort: a queue pair that cannot be moved to error is already broken.
        let _ = self.modify(&mut a, ibv_qp_attr_mask::IBV_QP_STATE, "ERR", 0);
    }
}

impl Drop for RdmaQp {
    fn drop(&mut self) {
        // SAFETY: created by this provider, destroyed once; its completion queue outlives it
        // (held in `_cq`).
        unsafe { ibv_destroy_qp(self.qp) };
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn without_a_device_opening_says_no_rdma_device_was_found() {
        let devices = std::fs::read_dir("/sys/class/infiniband").map(|d| d.count()).unwrap_or(0);
        if devices > 0 {
            eprintln!("skipped: this host has {devices} RDMA device(s)");
            return;
        }
        for name in [None, Some("mlx5_0")] {
            match super::open(name, 1, None) {
                Err(e) => assert!(e.to_string().contains("no RDMA device was found"), "{e}"),
                Ok(d) => panic!("opened {} on a host without RDMA devices", d.port().device),
            }
        }
    }
}
