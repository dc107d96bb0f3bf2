//! The launcher's lifeline: a pipe whose write end only the launcher holds. Every rank it
//! starts ([`spawn_tied`](super::spawn_tied)) inherits the read end, and its number in
//! `FERROGLOO_LIFELINE`; a ferrogloo program watches it from
//! [`RankEnv::from_env`](super::RankEnv::from_env). When the launcher ends, however it ends,
//! the kernel closes the write end, the read end reports hang-up, and the watcher kills the
//! rank's process group.
//!
//! This backs up the parent-death signal, which reaches only the launcher's direct children: a
//! rank started through a wrapper (`sh -c '… my-program'`, a container entry point, a profiler)
//! is a grandchild, and the lifeline reaches it all the same, and with it everything in its
//! process group.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

/// The variable holding the inherited read end's descriptor number.
pub const LIFELINE_ENV: &str = "FERROGLOO_LIFELINE";

/// This process's lifeline as a launcher: (read end, write end), both close-on-exec here; a
/// child gets the read end without the flag ([`spawn_tied`](super::spawn_tied)).
pub(super) fn ends() -> Option<&'static (OwnedFd, OwnedFd)> {
    static ENDS: OnceLock<Option<(OwnedFd, OwnedFd)>> = OnceLock::new();
    ENDS.get_or_init(|| {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "no lifeline pipe for the ranks (the parent-death signal still ties them)"
            );
            return None;
        }
        // SAFETY: pipe2 succeeded: both descriptors are new and owned by nobody else.
        Some(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
    })
    .as_ref()
}

/// The read end's number, for a child's environment.
pub(super) fn read_end() -> Option<RawFd> {
    ends().map(|(r, _)| r.as_raw_fd())
}

/// Starts, once per process, the thread that watches the lifeline `FERROGLOO_LIFELINE` names
/// (when it names an inherited pipe). Returns whether one is watched.
pub(super) fn watch() -> bool {
    static WATCHING: OnceLock<bool> = OnceLock::new();
    *WATCHING.get_or_init(|| {
        let Some(fd) = std::env::var(LIFELINE_ENV).ok().and_then(|v| v.trim().parse::<RawFd>().ok()) else {
            return false;
        };
        if fd < 0 || !is_pipe(fd) {
            tracing::debug!(fd, "{LIFELINE_ENV} names no inherited pipe; no lifeline watched");
            return false;
        }
        // This process's own lifeline pipe (when it is a launcher too) is a different one.
        std::thread::Builder::new()
            .name("ferrogloo-lifeline".into())
            .spawn(move || {
                wait_for_hangup(fd);
                // (Not eprintln!: stderr may be a pipe to the launcher that is gone.)
                let _ = writeln!(
                    std::io::stderr(),
                    "ferrogloo: the launcher that started this rank is gone; ending the rank"
                );
                // SAFETY: kill takes plain integers. Group 0 is this process's own group: the
                // rank the launcher started (a group leader) and what runs under it.
                unsafe { libc::kill(0, libc::SIGKILL) };
                // Not in a group of its own after all (a blocked signal is impossible for SIGKILL).
                std::process::exit(137);
            })
            .is_ok()
    })
}

/// Whether `fd` is an open pipe (FIFO).
fn is_pipe(fd: RawFd) -> bool {
    // SAFETY: fstat writes into the stat struct it is given; a bad descriptor is an error.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` is a live, writable struct.
    unsafe { libc::fstat(fd, &mut st) == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFIFO }
}

/// Blocks until the pipe `fd` hangs up (its last writer closed) or fails.
fn wait_for_hangup(fd: RawFd) {
    loop {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd; no timeout.
        let n = unsafe { libc::poll(&mut p, 1, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            return;
        }
        if p.revents & libc::POLLIN != 0 {
            // Nobody writes to a lifeline; data (or end of file) means it is not one any more.
            let mut b = [0u8; 64];
            // SAFETY: reads into a live buffer of its length.
            if unsafe { libc::read(fd, b.as_mut_ptr().cast(), b.len()) } <= 0 {
                return;
            }
        }
    }
}
