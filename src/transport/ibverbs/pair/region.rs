//! Registered memory a pair owns (its ring and its staging area), held as a raw allocation that
//! the NIC may write behind Rust's back, freed only after its registration is dropped.

use super::super::verbs::{Access, MemoryRegion, VerbsDevice};
use crate::error::Result;
use std::sync::Arc;

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

    pub(super) fn ptr(&self, offset: usize) -> *mut u8 {
        self.mem.wrapping_add(offset)
    }

    pub(super) fn addr(&self, offset: usize) -> u64 {
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
pub(super) struct Unregistered;

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
