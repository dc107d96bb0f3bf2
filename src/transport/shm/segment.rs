//! The memory a rank shares with the other ranks of its host: one segment per rank, created
//! with `memfd_create` (so it has no name anywhere: nothing is left behind when a job dies),
//! handed to peers as a descriptor over a Unix socket and mapped by each of them.
//!
//! ```text
//! [ header: 4 KiB ]
//! [ ring from rank 0: control (5 words, each on a cache line of its own) | data ]
//! [ ring from rank 1 ... ]  (one per rank of the context; a rank's own is unused)
//! [ collective area: a page of control words | two slots of data (coll_bytes) ]
//! ```
//! The owner of a segment consumes its rings; rank p produces into ring p of every peer's
//! segment.

use super::ring::RingMem;
use crate::error::{Error, Result};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

const HEADER: usize = 4096;
const PAGE: usize = 4096;
/// A cache line: words written by different ranks never share one.
pub(crate) const LINE: usize = 64;
/// Control words of a ring: tail, head, producer waiting, consumer sleeping, sender broken.
const CTL_WORDS: usize = 5;
const CTL: usize = CTL_WORDS * LINE;
/// "FGSHM001": what a segment's header starts with.
const MAGIC: u64 = u64::from_le_bytes(*b"FGSHM001");

/// Where things are in a segment of a context of `size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) size: usize,
    pub(crate) ring_bytes: usize,
    pub(crate) coll_bytes: usize,
}

impl Layout {
    fn ring_at(&self, from: usize) -> usize {
        HEADER + from * (CTL + self.ring_bytes)
    }

    /// Where the collective area starts: a page of control words (see `area`), then the
    /// data, page-aligned.
    pub(crate) fn coll_flags_at(&self) -> usize {
        (HEADER + self.size * (CTL + self.ring_bytes)).next_multiple_of(PAGE)
    }

    pub(crate) fn coll_data_at(&self) -> usize {
        self.coll_flags_at() + PAGE
    }

    pub(crate) fn len(&self) -> usize {
        self.coll_data_at() + self.coll_bytes
    }
}

/// A mapped segment (this rank's own, or a peer's). Unmapped when the last reference goes.
pub(crate) struct Segment {
    base: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: the mapping is plain shared memory; every access to it goes through atomics (the
// control words) or through copies into and out of ranges the ring protocol hands over.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    /// A fresh segment for `layout`, with this process's id in its header. Returns it with the
    /// descriptor to hand to peers.
    pub(crate) fn create(layout: Layout, rank: usize) -> Result<(Arc<Segment>, OwnedFd)> {
        use nix::sys::memfd::MFdFlags;
        let fd = nix::sys::memfd::memfd_create(c"ferrogloo-shm", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .map_err(|e| Error::io("creating a shared-memory segment (memfd_create)", e.into()))?;
        nix::unistd::ftruncate(&fd, layout.len() as i64)
            .map_err(|e| Error::io(format!("sizing a shared-memory segment to {} bytes", layout.len()), e.into()))?;
        // Its size is fixed for good: a peer cannot shrink it under this rank's mapping (a
        // fault on the next access).
        let seals = nix::fcntl::SealFlag::F_SEAL_SHRINK | nix::fcntl::SealFlag::F_SEAL_GROW;
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_ADD_SEALS(seals))
            .map_err(|e| Error::io("sealing a shared-memory segment's size", e.into()))?;
        let seg = Self::map(&fd, layout)?;
        seg.word(0).store(MAGIC, Ordering::Relaxed);
        seg.word(8).store(rank as u64, Ordering::Relaxed);
        seg.word(16).store(u64::from(std::process::id()), Ordering::Relaxed);
        seg.word(24).store(layout.size as u64, Ordering::Release);
        Ok((seg, fd))
    }

    /// Maps a segment a peer created (checked against `layout` and `rank`).
    pub(crate) fn open(fd: &OwnedFd, layout: Layout, rank: usize) -> Result<Arc<Segment>> {
        let sealed = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GET_SEALS)
            .ok()
            .and_then(nix::fcntl::SealFlag::from_bits)
            .is_some_and(|s| s.contains(nix::fcntl::SealFlag::F_SEAL_SHRINK));
        if !sealed {
            return Err(Error::Protocol {
                peer: Some(rank),
                detail: "its shared-memory segment could shrink under this rank's mapping (not sealed)".into(),
            });
        }
        let seg = Self::map(fd, layout)?;
        let ok = seg.word(0).load(Ordering::Acquire) == MAGIC
            && seg.word(8).load(Ordering::Relaxed) == rank as u64
            && seg.word(24).load(Ordering::Relaxed) == layout.size as u64;
        if !ok {
            return Err(Error::Protocol {
                peer: Some(rank),
                detail: "its shared-memory segment is not one of this job".into(),
            });
        }
        Ok(seg)
    }

    fn map(fd: &OwnedFd, layout: Layout) -> Result<Arc<Segment>> {
        let len = layout.len();
        let size = std::num::NonZeroUsize::new(len).ok_or_else(|| Error::invalid("empty shared-memory segment"))?;
        let stat =
            nix::sys::stat::fstat(fd.as_fd()).map_err(|e| Error::io("inspecting a shared-memory segment", e.into()))?;
        if (stat.st_size as usize) < len {
            return Err(Error::Protocol {
                peer: None,
                detail: format!("a shared-memory segment of {} bytes where {len} are needed", stat.st_size),
            });
        }
        // SAFETY: a fresh shared mapping of a descriptor we hold, at an address the kernel
        // picks; nothing else in this process refers to that range.
        let ptr = unsafe {
            nix::sys::mman::mmap(
                None,
                size,
                nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                nix::sys::mman::MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(|e| Error::io(format!("mapping a shared-memory segment (fd {})", fd.as_raw_fd()), e.into()))?;
        Ok(Arc::new(Segment { base: ptr.cast(), len, layout }))
    }

    /// Where things are in this segment.
    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    /// The atomic word at byte `off` (8-aligned, inside the segment).
    pub(crate) fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= self.len, "word {off} outside the segment");
        // SAFETY: in bounds and 8-aligned (checked; the mapping is page-aligned), and only ever
        // accessed atomically by every process that maps it.
        unsafe { &*self.base.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// Raw pointer to byte `off`, for copies of ranges the protocols hand over.
    pub(crate) fn at(&self, off: usize, len: usize) -> *mut u8 {
        assert!(off + len <= self.len, "range {off}+{len} outside the segment");
        // SAFETY: in bounds (checked).
        unsafe { self.base.as_ptr().add(off) }
    }

    /// The ring from rank `from` in this segment.
    pub(crate) fn ring(self: &Arc<Self>, from: usize) -> ShmRing {
        let at = self.layout.ring_at(from);
        ShmRing { seg: self.clone(), ctl: at, data: at + CTL, cap: self.layout.ring_bytes }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the range is the mapping made in `map`, and no reference into it outlives the
        // segment (every user holds an Arc to it).
        let _ = unsafe { nix::sys::mman::munmap(self.base.cast(), self.len) };
    }
}

/// A ring of a segment.
#[derive(Clone)]
pub(crate) struct ShmRing {
    seg: Arc<Segment>,
    ctl: usize,
    data: usize,
    cap: usize,
}

impl ShmRing {
    /// The word a producer sets when it breaks its side (a cancelled send the consumer may be
    /// reading through CMA): the consumer must not trust what it read.
    pub(crate) fn broken(&self) -> &AtomicU64 {
        self.seg.word(self.ctl + 4 * LINE)
    }

    /// Raw pointer to data byte `off` of the ring.
    pub(crate) fn data_at(&self, off: usize, len: usize) -> *const u8 {
        assert!(off + len <= self.cap, "ring range {off}+{len} outside {}", self.cap);
        self.seg.at(self.data + off, len)
    }
}

impl RingMem for ShmRing {
    const ALIGN: usize = LINE;
    type W = AtomicU64;
    fn tail(&self) -> &AtomicU64 {
        self.seg.word(self.ctl)
    }
    fn head(&self) -> &AtomicU64 {
        self.seg.word(self.ctl + LINE)
    }
    fn producer_waiting(&self) -> &AtomicU64 {
        self.seg.word(self.ctl + 2 * LINE)
    }
    fn consumer_sleeping(&self) -> &AtomicU64 {
        self.seg.word(self.ctl + 3 * LINE)
    }
    fn capacity(&self) -> usize {
        self.cap
    }
    fn write(&self, off: usize, bytes: &[u8]) {
        let dst = self.seg.at(self.data + off, bytes.len());
        // SAFETY: the ring protocol gives the producer this range alone until it publishes it.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
    }
    fn read(&self, off: usize, out: &mut [u8]) {
        let src = self.data_at(off, out.len());
        // SAFETY: the ring protocol gives the consumer this published range until it consumes it.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
    }
    fn fence(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}
