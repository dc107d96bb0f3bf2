//! The two system calls caller-driven waits need that mio does not offer: an eventfd to wake a
//! thread blocked on its pairs (TCP) or a rank sleeping on its rings (shared memory), and
//! `poll(2)` on those sockets and eventfds.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// A non-blocking Linux eventfd.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a negative return is an error, anything else a
        // fresh descriptor that we alone own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a valid descriptor just returned to us and owned by nothing else.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes the eventfd readable (wakes a `poll` on it).
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own descriptor. The only failure,
        // EAGAIN at counter overflow, leaves it readable, which is all a signal needs.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Clears pending signals.
    pub(crate) fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64 from our own non-blocking descriptor;
        // EAGAIN (nothing pending) is fine.
        let _ = unsafe { libc::read(self.0.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    pub(crate) fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// An eventfd received from another process.
    pub(crate) fn from_fd(fd: OwnedFd) -> Self {
        EventFd(fd)
    }

    /// The descriptor, to hand to another process.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.as_fd()
    }
}

/// `poll(2)` on `fds`: returns how many have events. A zero `timeout` only looks; otherwise it
/// blocks until an event or `timeout`. EINTR counts as a wake-up with nothing ready.
pub(crate) fn poll_fds(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<usize> {
    // Round up so a sub-millisecond remainder still sleeps instead of spinning.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a live, exclusively borrowed array of pollfd structs and we pass its
    // exact length.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
        return Ok(0);
    }
    Ok(r as usize)
}
