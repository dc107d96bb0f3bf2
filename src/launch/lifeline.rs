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
//!
//! `FERROGLOO_LIFELINE` names the inherited read end: `FD:DEV:INO`, its descriptor number and
//! the pipe's device and inode numbers (so that a descriptor a wrapper closed, and whose number
//! the program reused for something else, is never taken for the lifeline).

use crate::config::{FERROGLOO_LIFELINE, Vars};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

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

/// The read end's number, and the value of [`FERROGLOO_LIFELINE`] for a child.
pub(super) fn read_end() -> Option<(RawFd, String)> {
    let fd = ends()?.0.as_raw_fd();
    let (dev, ino) = pipe_id(fd)?;
    Some((fd, format!("{fd}:{dev}:{ino}")))
}

/// Starts, once per process, the thread that watches the lifeline `FERROGLOO_LIFELINE` names
/// (when it names an inherited pipe). Returns whether one is watched.
pub(super) fn watch() -> bool {
    static WATCHING: OnceLock<bool> = OnceLock::new();
    *WATCHING.get_or_init(|| {
        let Some(spec) = Vars::process().raw(FERROGLOO_LIFELINE) else {
            return false;
        };
        let parsed: Option<(RawFd, u64, u64)> = (|| {
            let mut it = spec.trim().split(':');
            let t = (it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?);
            it.next().is_none().then_some(t)
        })();
        let Some((fd, dev, ino)) = parsed else {
            tracing::debug!(spec, "{FERROGLOO_LIFELINE} is not FD:DEV:INO; no lifeline watched");
            return false;
        };
        if fd < 0 || pipe_id(fd) != Some((dev, ino)) {
            tracing::debug!(fd, "{FERROGLOO_LIFELINE} names a pipe this process does not hold; no lifeline watched");
            return false;
        }
        // This process's own lifeline pipe (when it is a launcher too) is a different one.
        std::thread::Builder::new()
            .name("ferrogloo-lifeline".into())
            .spawn(move || {
                if !wait_for_hangup(fd) {
                    tracing::debug!(fd, "the lifeline pipe carried data; no longer watched");
                    return;
                }
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

/// The device and inode numbers of `fd` when it is an open pipe (FIFO).
fn pipe_id(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: fstat writes into the stat struct it is given; a bad descriptor is an error.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` is a live, writable struct.
    let ok = unsafe { libc::fstat(fd, &mut st) } == 0;
    (ok && (st.st_mode & libc::S_IFMT) == libc::S_IFIFO).then_some((st.st_dev, st.st_ino))
}

/// Blocks until the pipe `fd` hangs up (its last writer closed: true), or carries data, which
/// a lifeline never does, or is closed by this program (false). It never reads from `fd`.
fn wait_for_hangup(fd: RawFd) -> bool {
    loop {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd; no timeout.
        let n = unsafe { libc::poll(&mut p, 1, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        if p.revents & libc::POLLHUP != 0 {
            return true;
        }
        // Data, or the descriptor closed by the program itself: not a lifeline any more.
        if p.revents & (libc::POLLIN | libc::POLLNVAL | libc::POLLERR) != 0 {
            return false;
        }
    }
}
