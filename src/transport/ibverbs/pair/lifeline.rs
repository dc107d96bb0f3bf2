//! How a pair fails and says why: failing it (the queue pair to error, every operation ended),
//! the lifeline (abort frames both ways, its end when the peer is gone), a failed request's
//! grace for the peer's word, and aborts of one group.

use super::super::verbs::WcStatus;
use super::super::wire::{LifelineFrame, next_frame};
use super::{CAUSE_GRACE, Link, State, WrKind, wr_kind};
use crate::error::Error;
use crate::sync::lock;
use crate::transport::handshake::codec::to_vec;
use crate::transport::{ALL_GROUPS, AbortCause};
use std::io::Write;
use std::time::{Duration, Instant};

impl Link {
    /// every operation fails with `err` (reads end when their flush arrives).
    pub(super) fn fail(&self, st: &mut State, err: Error) {
        if st.failed.is_some() {
            return;
        }
        // Messages that arrived before the failure stay receivable where the budget holds them.
        self.take_arrived(st);
        if st.failed.is_some() {
            return; // taking them failed the pair already
        }
        st.failed = Some(err.clone());
        self.qp.set_error();
        st.matcher.close(&err);
        for s in st.sends.drain(..) {
            s.done.complete(Err(err.clone()));
        }
        for (_, s) in st.rts.drain() {
            s.done.complete(Err(err.clone()));
        }
        // Read parts that will never complete (queued, or refused by the provider) settle
        // their reads now; parts posted end with their flush.
        let dropped: Vec<u64> = st.backlog.drain(..).map(|w| w.wr_id).chain(std::mem::take(&mut st.unposted)).collect();
        for id in dropped {
            if wr_kind(id) != Some(WrKind::Read) {
                continue;
            }
            let rid = id as u32;
            let done = st.reads.get_mut(&rid).is_some_and(|r| {
                r.parts = r.parts.saturating_sub(1);
                r.parts == 0
            });
            if done && let Some(r) = st.reads.remove(&rid) {
                self.finish_read(st, r, Some(err.clone()));
            }
        }
        st.arrived.clear();
        let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
    }

    /// Fails the pair with `err` (from outside the protocol: the lifeline, a local close).
    pub(crate) fn fail_with(&self, err: Error) {
        let mut st = lock(&self.state);
        self.fail(&mut st, err);
    }

    /// Reads ready bytes of the lifeline: abort frames, or its end.
    pub(crate) fn lifeline_readable(&self) {
        let mut st = lock(&self.state);
        self.read_lifeline(&mut st);
    }

    pub(super) fn read_lifeline(&self, st: &mut State) {
        let mut buf = [0u8; 4096];
        while st.failed.is_none() {
            match std::io::Read::read(&mut &self.lifeline, &mut buf) {
                Ok(0) => {
                    let err = Error::PeerClosed {
                        rank: self.peer,
                        op: String::new(),
                        detail: "its RDMA connection's lifeline closed (the process exited or closed its context)"
                            .into(),
                    };
                    self.fail(st, err);
                }
                Ok(n) => {
                    st.lifeline_in.extend_from_slice(&buf[..n]);
                    self.take_frames(st);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let detail = format!("its lifeline failed: {e}");
                    self.fail(st, Error::PeerClosed { rank: self.peer, op: String::new(), detail });
                }
            }
        }
    }

    /// A request failed with `status` (`err` in words): the pair fails with it, unless the peer
    /// has said why on the lifeline (an abort, or its end), which is the better cause; a flushed
    /// request waits [`CAUSE_GRACE`] for the peer's word.
    pub(super) fn fail_request(&self, st: &mut State, status: &WcStatus, err: Error) {
        // A request that failed for a reason of its own is the cause; one flushed without a
        // recorded cause failed for a reason elsewhere (the peer's side refused something),
        // which the peer tells.
        let grace = if *status == WcStatus::Flushed { CAUSE_GRACE } else { Duration::ZERO };
        self.read_lifeline(st);
        let start = Instant::now();
        while st.failed.is_none() && start.elapsed() < grace {
            self.read_lifeline(st);
            if st.failed.is_some() {
                return;
            }
            let mut fds = [libc::pollfd { fd: self.lifeline_fd(), events: libc::POLLIN, revents: 0 }];
            let _ = crate::transport::wake::poll_fds(&mut fds, Duration::from_millis(10));
        }
        self.fail_and_tell(st, err);
    }

    /// Fails the pair with a cause found on this side, and tells the peer (best effort), so
    /// that it reports this cause rather than only seeing the connection end.
    pub(super) fn fail_and_tell(&self, st: &mut State, err: Error) {
        if st.failed.is_none() {
            self.tell(ALL_GROUPS, &AbortCause::of(&err, self.me));
        }
        self.fail(st, err);
    }

    /// Sends an abort frame on the lifeline (best effort, bounded).
    pub(super) fn tell(&self, group: u64, cause: &AbortCause) {
        let frame = to_vec(&LifelineFrame { group, cause: cause.encode() });
        // The lifeline carries nothing else, so a frame this small fits its socket buffer;
        // the timeout bounds the rest.
        let _ = self.lifeline.set_nonblocking(false);
        let _ = self.lifeline.set_write_timeout(Some(Duration::from_millis(500)));
        let _ = (&self.lifeline).write_all(&frame);
        let _ = self.lifeline.set_nonblocking(true);
    }

    pub(super) fn lifeline_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.lifeline)
    }

    /// Abort frames off the lifeline ([`LifelineFrame`]).
    pub(super) fn take_frames(&self, st: &mut State) {
        loop {
            let (LifelineFrame { group, cause }, used) = match next_frame(&st.lifeline_in) {
                Ok(Some(f)) => f,
                Ok(None) => return,
                Err(detail) => return self.fail(st, Error::Protocol { peer: Some(self.peer), detail }),
            };
            st.lifeline_in.drain(..used);
            let err = match AbortCause::decode(&cause) {
                Ok(c) => c.into_error(),
                Err(e) => {
                    Error::Protocol { peer: Some(self.peer), detail: format!("an abort that does not decode: {e}") }
                }
            };
            if group == ALL_GROUPS {
                self.fail(st, err);
                return;
            }
            self.abort_group(st, group, &err);
        }
    }

    pub(super) fn abort_group(&self, st: &mut State, group: u64, err: &Error) {
        st.matcher.abort_group(group, err);
        st.sends.retain(|s| {
            let fail = s.header.key.group == group;
            if fail {
                s.done.complete(Err(err.clone()));
            }
            !fail
        });
        // Messages of the group that were held are now discarded: take what follows.
        self.take_arrived(st);
        self.report(st);
    }
}
