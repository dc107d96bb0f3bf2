//! Memory registration for user buffers, with a cache: registering costs a system call and
//! page pinning per buffer, so a buffer used again (the same gradients every step) is
//! registered once.
//!
//! A cached registration is only sound if it follows the memory under it. With a provider
//! whose registrations follow the page tables (on-demand paging, and the simulated provider)
//! the cache is on; otherwise a buffer freed and allocated again at the same address would
//! keep the old pages' registration, so the cache is off (every operation registers its
//! buffer) unless `FERROGLOO_IB_REG_CACHE=1` says the program never frees buffers it
//! communicates from.

use super::verbs::{Access, MemoryRegion, VerbsDevice};
use crate::config::{FERROGLOO_IB_REG_CACHE, Vars};
use crate::error::Result;
use crate::sync::lock;
use std::sync::{Arc, Mutex};

/// Registrations kept at most (the least recently used goes first).
const MAX_ENTRIES: usize = 64;

struct Entry {
    access: Access,
    start: usize,
    end: usize,
    mr: Arc<dyn MemoryRegion>,
    used: u64,
}

/// Registrations of user buffers for one device.
pub(crate) struct RegCache {
    dev: Arc<dyn VerbsDevice>,
    enabled: bool,
    entries: Mutex<(Vec<Entry>, u64)>,
}

impl RegCache {
    pub(crate) fn new(dev: Arc<dyn VerbsDevice>) -> Self {
        // `1` turns the cache on, `0` off, whatever the provider.
        let enabled = Vars::process().on_off(FERROGLOO_IB_REG_CACHE).unwrap_or_else(|| dev.coherent_registrations());
        RegCache { dev, enabled, entries: Mutex::new((Vec::new(), 0)) }
    }

    /// Whether registrations are cached.
    #[cfg(test)]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Cached registrations.
    #[cfg(test)]
    pub(crate) fn cached(&self) -> usize {
        lock(&self.entries).0.len()
    }

    /// A registration covering `len` bytes at `ptr`: a cached one, or a new one (cached when
    /// the cache is on).
    ///
    /// # Safety
    /// As [`VerbsDevice::register`]: the memory stays allocated while work requests use it.
    pub(crate) unsafe fn get(&self, ptr: *mut u8, len: usize, access: Access) -> Result<Arc<dyn MemoryRegion>> {
        if !self.enabled {
            // SAFETY: the caller's promise.
            return unsafe { self.register_once(ptr, len, access) };
        }
        let (start, end) = (ptr as usize, ptr as usize + len);
        let mut g = lock(&self.entries);
        let (entries, tick) = &mut *g;
        *tick += 1;
        if let Some(e) = entries.iter_mut().find(|e| e.access == access && e.start <= start && end <= e.end) {
            e.used = *tick;
            return Ok(e.mr.clone());
        }
        // Whole pages, so that neighbouring buffers of one allocation share a registration.
        const PAGE: usize = 4096;
        let (pstart, pend) = (start & !(PAGE - 1), end.div_ceil(PAGE) * PAGE);
        // SAFETY: the caller's promise covers the buffer; the rest of its pages are mapped (a
        // page is mapped whole), and a coherent registration follows later remappings.
        let mr = unsafe { self.dev.register(pstart as *mut u8, pend - pstart, access)? };
        if entries.len() >= MAX_ENTRIES
            && let Some(i) = entries.iter().enumerate().min_by_key(|(_, e)| e.used).map(|(i, _)| i)
        {
            // Dropped here; operations still using it hold their own reference.
            entries.swap_remove(i);
        }
        entries.push(Entry {
            access,
            start: pstart,
            end: pstart + mr.len().min(pend - pstart),
            mr: mr.clone(),
            used: *tick,
        });
        Ok(mr)
    }

    /// A registration of exactly `len` bytes at `ptr`, not cached.
    ///
    /// # Safety
    /// As [`VerbsDevice::register`].
    pub(crate) unsafe fn register_once(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Arc<dyn MemoryRegion>> {
        // SAFETY: the caller's promise.
        unsafe { self.dev.register(ptr, len, access) }
    }

    /// Drops every cached registration.
    pub(crate) fn clear(&self) {
        lock(&self.entries).0.clear();
    }
}
