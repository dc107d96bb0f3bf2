//! The real verbs provider, over `rdma-sys` (libibverbs from rdma-core).
//!
//! It is compiled (against Debian's rdma-core headers) and its "no RDMA device" path is
//! tested; no machine it was developed on has an RDMA device, so **none of the verbs below has
//! run against hardware**. It follows libibverbs' documented sequence: open the device, a
//! protection domain, a completion queue on a completion channel, RC queue pairs moved
//! RESET → INIT → RTR → RTS, memory regions for local write and remote read and write, RDMA
//! write with immediate data and RDMA read, every request signalled.
//!
//! Every verb that fails becomes an [`Error`] naming the verb, the device and port, and the
//! errno in words; nothing here panics or blocks (the completion channel is non-blocking).

use super::verbs::{
    Access, CompletionQueue, MemoryRegion, PortInfo, QpAddr, QueuePair, SendOp, Sge, VerbsDevice, Wc, WcKind, WcStatus,
};
use crate::error::{Error, Result};
use crate::sync::lock;
use rdma_sys::*;
use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that the bindings leave out).
const LINK_LAYER_ETHERNET: u8 = 2;

/// The access a memory region and a queue pair grant: local writes, remote reads and writes.
const ACCESS: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;

/// Outstanding RDMA reads a queue pair asks for (as initiator and as responder), lowered to
/// what the device allows.
const RD_ATOMIC: i32 = 16;

/// The error of a verb that returned NULL or -1 and set errno. Call it right after the verb,
/// before anything else can change errno.
fn errno_error() -> io::Error {
    let e = io::Error::last_os_error();
    if e.raw_os_error().unwrap_or(0) == 0 { io::Error::other("failed without setting errno") } else { e }
}

/// The error of a verb that returned `rc` (not 0): most verbs return the errno value itself,
/// a few return -1 and set errno.
fn rc_error(rc: i32) -> io::Error {
    if rc > 0 { io::Error::from_raw_os_error(rc) } else { errno_error() }
}

/// An opened device: its context and protection domain. Queue pairs, completion queues and
/// memory regions hold an `Arc` of it, so it is closed after them.
struct Ctx {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    port: PortInfo,
    /// `max_rd_atomic` of this side's queue pairs (initiator depth).
    init_rd_atom: u8,
    /// `max_dest_rd_atomic` of this side's queue pairs (responder resources).
    resp_rd_atom: u8,
    /// The device's limits, for error messages.
    max_cqe: i32,
    max_qp_wr: i32,
}

// SAFETY: libibverbs contexts and protection domains may be used from any thread (rdma-core
// documents its verbs as thread safe); this provider only reads the pointers after creation
// and frees them once, in drop.
unsafe impl Send for Ctx {}
// SAFETY: as above: every verb called through a shared `&Ctx` is thread safe.
unsafe impl Sync for Ctx {}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: both were allocated by this provider, everything made from them (which held
        // an `Arc` of this) is gone, and they are freed once, the protection domain first.
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
            // SAFETY: the list came from `ibv_get_device_list` and is freed once; contexts
            // opened from it stay valid after it is freed.
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
        DeviceList(list, if list.is_null() { 0 } else { usize::try_from(n).unwrap_or(0) })
    }

    fn devices(&self) -> Vec<(*mut ibv_device, String)> {
        (0..self.1)
            .filter_map(|i| {
                // SAFETY: the list is non-NULL (else `self.1` is 0) and holds `self.1` device
                // pointers.
                let d = unsafe { *self.0.add(i) };
                if d.is_null() {
                    return None;
                }
                // SAFETY: `d` is a listed device.
                let name = unsafe { ibv_get_device_name(d) };
                let name = if name.is_null() {
                    format!("device #{i}")
                } else {
                    // SAFETY: a non-NULL device name is a NUL-terminated string owned by the
                    // library while the list lives.
                    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
                };
                Some((d, name))
            })
            .collect()
    }
}

/// Opens RDMA device `name` (the first device whose port `port` is active, for `None`), port
/// `port`, GID index `gid_index` (`None`: for RoCE the first RoCE v2 entry with an IPv4-mapped
/// GID, else the first RoCE v2 entry, else 0; for InfiniBand 0).
///
/// With no RDMA device on the host the error is [`Error::Unsupported`] and says "no RDMA
/// device was found"; a named device that is not there, or a port that is not active, is an
/// error naming it.
pub(crate) fn open(name: Option<&str>, port: u8, gid_index: Option<u8>) -> Result<Arc<dyn VerbsDevice>> {
    let list = DeviceList::get();
    let devices = list.devices();
    if devices.is_empty() {
        return Err(Error::unsupported(
            "the ibverbs (RDMA) transport on this host (no RDMA device was found: ibv_get_device_list lists \
             none; is rdma-core's provider for the adapter installed and its kernel module loaded?)",
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
    let mut errors = Vec::new();
    for (dev, dname) in candidates {
        match open_one(*dev, dname, port, gid_index) {
            Ok(c) => return Ok(Arc::new(RdmaDevice { ctx: Arc::new(c) })),
            Err(e) => errors.push((dname, e)),
        }
    }
    if errors.len() == 1
        && let Some((_, e)) = errors.pop()
    {
        return Err(e);
    }
    let why: Vec<String> = errors.iter().map(|(d, e)| format!("{d}: {e}")).collect();
    Err(Error::invalid(format!("no RDMA device has a usable port {port}: {}", why.join("; "))))
}

/// Port state `s` in libibverbs' words.
fn port_state_words(s: ibv_port_state::Type) -> String {
    // SAFETY: the library returns a static string for any value ("unknown" out of range).
    let p = unsafe { ibv_port_state_str(s) };
    if p.is_null() {
        return format!("state {s}");
    }
    // SAFETY: non-NULL: a static NUL-terminated string.
    let w = unsafe { CStr::from_ptr(p) }.to_string_lossy();
    format!("{w} (state {s})")
}

fn open_one(dev: *mut ibv_device, name: &str, port: u8, gid_index: Option<u8>) -> Result<Ctx> {
    // SAFETY: `dev` comes from a live device list.
    let ctx = unsafe { ibv_open_device(dev) };
    if ctx.is_null() {
        return Err(Error::io(format!("ibv_open_device on {name}"), errno_error()));
    }
    // Until the protection domain exists and `Ctx` owns both, every error path closes the
    // context through this.
    let close = |e: Error| {
        // SAFETY: opened above and not used after this.
        unsafe { ibv_close_device(ctx) };
        e
    };
    // SAFETY: an all-zero port attribute struct is valid plain data for the verb to fill.
    let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open and `pa` a valid out-pointer of the full (not the compat) size,
    // which the wrapper passes to the provider.
    let rc = unsafe { ___ibv_query_port(ctx, port, &mut pa) };
    if rc != 0 {
        return Err(close(Error::io(format!("ibv_query_port on {name} port {port}"), rc_error(rc))));
    }
    if pa.state != ibv_port_state::IBV_PORT_ACTIVE {
        return Err(close(Error::invalid(format!(
            "port {port} of RDMA device {name} is not active: {}; check the link (and, on InfiniBand, the \
             subnet manager)",
            port_state_words(pa.state)
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
    let Some(gid) = gid_of(index) else {
        return Err(close(Error::invalid(format!(
            "GID index {index} of {name} port {port} cannot be read (the table has {} entries)",
            pa.gid_tbl_len
        ))));
    };
    if roce && gid == [0u8; 16] {
        return Err(close(Error::invalid(format!(
            "GID index {index} of {name} port {port} is empty; set FERROGLOO_IB_GID_INDEX to a populated RoCE v2 \
             entry (see show_gids)"
        ))));
    }
    // SAFETY: an all-zero device attribute struct is valid plain data for the verb to fill.
    let mut da: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open and `da` a valid out-pointer.
    let rc = unsafe { ibv_query_device(ctx, &mut da) };
    if rc != 0 {
        return Err(close(Error::io(format!("ibv_query_device on {name}"), rc_error(rc))));
    }
    // SAFETY: `ctx` is open.
    let pd = unsafe { ibv_alloc_pd(ctx) };
    if pd.is_null() {
        let e = errno_error();
        return Err(close(Error::io(format!("ibv_alloc_pd on {name}"), e)));
    }
    let rd_atom = |max: i32| u8::try_from(max.clamp(1, RD_ATOMIC)).unwrap_or(1);
    Ok(Ctx {
        ctx,
        pd,
        port: PortInfo {
            device: name.to_string(),
            port,
            lid: pa.lid,
            gid,
            gid_index: index,
            mtu: u8::try_from(pa.active_mtu).unwrap_or(1),
            roce,
        },
        init_rd_atom: rd_atom(da.max_qp_init_rd_atom),
        resp_rd_atom: rd_atom(da.max_qp_rd_atom),
        max_cqe: da.max_cqe,
        max_qp_wr: da.max_qp_wr,
    })
}

/// The GID index RoCE v2 traffic should use: the first RoCE v2 entry with an IPv4-mapped
/// address, else the first RoCE v2 entry, else 0 (entry types read from sysfs, as `show_gids`
/// does; a kernel without `gid_attrs` gives 0).
fn choose_roce_gid(name: &str, port: u8, len: i32, gid_of: &dyn Fn(u8) -> Option<[u8; 16]>) -> u8 {
    let mut first_v2 = None;
    for i in 0..=u8::try_from(len.clamp(1, 256) - 1).unwrap_or(u8::MAX) {
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

    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<Arc<dyn MemoryRegion>> {
        let flags = match access {
            Access::LocalRead => 0,
            Access::RemoteRead => ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            Access::LocalWrite => ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0,
            Access::RemoteWrite => {
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            }
        };
        if len == 0 {
            // The verb refuses empty regions; a zero-length request checks no key, so an
            // unregistered region with keys 0 serves.
            return Ok(Arc::new(RdmaMr {
                mr: std::ptr::null_mut(),
                addr: addr as u64,
                len,
                lkey: 0,
                rkey: 0,
                _ctx: None,
            }));
        }
        // SAFETY: the protection domain is live; the caller promises the memory stays
        // allocated while it is registered.
        let mr = unsafe { ibv_reg_mr(self.ctx.pd, addr.cast(), len, flags as i32) };
        if mr.is_null() {
            let e = errno_error();
            return Err(Error::io(
                format!(
                    "ibv_reg_mr of {len} bytes at {addr:p} on {} (is the locked-memory limit, ulimit -l, high enough?)",
                    self.ctx.port.device
                ),
                e,
            ));
        }
        // SAFETY: a registered region's keys are plain data, fixed until deregistration.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(Arc::new(RdmaMr { mr, addr: addr as u64, len, lkey, rkey, _ctx: Some(self.ctx.clone()) }))
    }

    fn coherent_registrations(&self) -> bool {
        false
    }

    fn create_cq(&self, depth: usize) -> Result<Arc<dyn CompletionQueue>> {
        let dev = &self.ctx.port.device;
        // SAFETY: the context is live.
        let channel = unsafe { ibv_create_comp_channel(self.ctx.ctx) };
        if channel.is_null() {
            return Err(Error::io(format!("ibv_create_comp_channel on {dev}"), errno_error()));
        }
        // SAFETY: the channel was just created; its descriptor lives as long as it does.
        let fd = unsafe { (*channel).fd };
        // SAFETY: `fd` is open; F_GETFL takes no argument and returns plain flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: `fd` is open; F_SETFL takes plain flags.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            let e = errno_error();
            // SAFETY: created above, used nowhere else.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(Error::io(format!("making the completion channel of {dev} non-blocking (fcntl)"), e));
        }
        let cqe = i32::try_from(depth).unwrap_or(i32::MAX).max(1);
        // SAFETY: the context and the channel are live.
        let cq = unsafe { ibv_create_cq(self.ctx.ctx, cqe, std::ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = errno_error();
            // SAFETY: created above, used nowhere else.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(Error::io(
                format!("ibv_create_cq of {depth} entries on {dev} (the device allows {})", self.ctx.max_cqe),
                e,
            ));
        }
        Ok(Arc::new(RdmaCq { cq, channel, fd, events: Mutex::new(()), ctx: self.ctx.clone() }))
    }

    fn create_qp(&self, cq: &Arc<dyn CompletionQueue>, max_send: u32, max_recv: u32) -> Result<Arc<dyn QueuePair>> {
        let dev = &self.ctx.port.device;
        let Some(rcq) = cq.as_any().downcast_ref::<RdmaCq>() else {
            return Err(Error::invalid("an RDMA queue pair needs a completion queue of the RDMA provider"));
        };
        if !Arc::ptr_eq(&rcq.ctx, &self.ctx) {
            return Err(Error::invalid(format!(
                "an RDMA queue pair on {dev} needs a completion queue of the same opened device (this one is of {})",
                rcq.ctx.port.device
            )));
        }
        // SAFETY: all-zero init attributes are valid plain data (NULL context and SRQ, no
        // inline data); the fields that matter are set below.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = rcq.cq;
        init.recv_cq = rcq.cq;
        init.cap = ibv_qp_cap {
            max_send_wr: max_send,
            max_recv_wr: max_recv,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 1;
        // SAFETY: the protection domain and the completion queue are live; `init` is fully
        // initialised and outlives the call.
        let qp = unsafe { ibv_create_qp(self.ctx.pd, &mut init) };
        if qp.is_null() {
            let e = errno_error();
            return Err(Error::io(
                format!(
                    "ibv_create_qp (RC, {max_send} send and {max_recv} receive requests; the device allows {}) on {dev}",
                    self.ctx.max_qp_wr
                ),
                e,
            ));
        }
        // SAFETY: the queue pair was just created; its number is fixed plain data.
        let qpn = unsafe { (*qp).qp_num };
        Ok(Arc::new(RdmaQp { qp, qpn, _cq: cq.clone(), ctx: self.ctx.clone() }))
    }
}

/// A registered memory region (or, for zero bytes, none: `mr` NULL and keys 0).
struct RdmaMr {
    mr: *mut ibv_mr,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    /// Keeps the protection domain alive while registered.
    _ctx: Option<Arc<Ctx>>,
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
struct RdmaCq {
    cq: *mut ibv_cq,
    channel: *mut ibv_comp_channel,
    fd: RawFd,
    /// Serialises taking events off the channel and acknowledging them.
    events: Mutex<()>,
    ctx: Arc<Ctx>,
}

// SAFETY: polling, arming, and taking and acknowledging events of one completion queue are
// thread safe in libibverbs (the providers lock the queue); event handling is serialised by
// `events` anyway, and the queue and channel are destroyed once, in drop.
unsafe impl Send for RdmaCq {}
// SAFETY: as above.
unsafe impl Sync for RdmaCq {}

/// A completion status in [`WcStatus`]'s terms.
fn status(s: ibv_wc_status::Type, vendor: u32) -> WcStatus {
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
struct RdmaQp {
    qp: *mut ibv_qp,
    qpn: u32,
    /// Its completion queue, destroyed after it.
    _cq: Arc<dyn CompletionQueue>,
    ctx: Arc<Ctx>,
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

#[cfg(test)]
mod tests {
    #[test]
    fn without_a_device_opening_says_no_rdma_device_was_found() {
        let devices = std::fs::read_dir("/sys/class/infiniband").map(|d| d.count()).unwrap_or(0);
        if devices > 0 {
            eprintln!("skipped: this host has {devices} RDMA device(s) in /sys/class/infiniband");
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
