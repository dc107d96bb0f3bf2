//! Locking that survives a panicking thread.
//!
//! Every state behind a lock in this crate is changed by single assignments, inserts or
//! removes, so it is consistent whenever a panic can strike, and a lock poisoned by a panic
//! (a user's reduction function, say, on another rank's thread) is still good to use. A panic
//! on one thread must not become a panic on every thread that shares the context or device.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Locks `m`, ignoring poison.
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Puts `buf` back in `slot` for reuse if it is larger than what `slot` holds (a buffer taken
/// out for one message and grown by it), else drops it.
pub(crate) fn keep_larger(slot: &Mutex<Vec<u8>>, buf: Vec<u8>) {
    let mut slot = lock(slot);
    if slot.capacity() < buf.capacity() {
        *slot = buf;
    }
}

/// Waits on `cv` for at most `timeout`, ignoring poison.
pub(crate) fn wait_timeout<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, timeout).unwrap_or_else(|p| p.into_inner()).0
}

/// Waits on `cv` until notified, ignoring poison.
pub(crate) fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|p| p.into_inner())
}
