//! How a shared-memory pair ends and says why: the lifeline (abort messages in, its end when
//! the peer is gone; abort messages out), a quiet close, failing the pair or one group's
//! operations.

use super::super::wire::{AbortMsg, next_abort};
use super::{Inner, Rx, ShmPair};

use crate::error::Error;
use crate::transport::handshake::codec::to_vec;
use crate::transport::{ALL_GROUPS, AbortCause};
use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl ShmPair {
    /// Reads what the lifeline has: abort causes, or the end of the peer.
    pub(crate) fn check_lifeline(&self) {
        let mut g = self.lock();
        if g.closed.is_some() {
            return;
        }
        let mut buf = [0u8; 4096];
        // What ended the lifeline, if it ended: acted on after the messages before it.
        let mut ended = None;
        loop {
            match (&self.lifeline).read(&mut buf) {
                Ok(0) => {
                    ended = Some("it exited or closed its context".to_string());
                    break;
                }
                Ok(n) => g.lifeline_buf.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    ended = Some(format!("its lifeline failed: {e}"));
                    break;
                }
            }
        }
        loop {
            let (AbortMsg { group, cause }, used) = match next_abort(&g.lifeline_buf) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(why) => return self.fail(&mut g, self.protocol(format!("an abort message: {why}"))),
            };
            g.lifeline_buf.drain(..used);
            let err = match AbortCause::decode(&cause) {
                Ok(c) => c.into_error(),
                Err(detail) => Error::Protocol { peer: Some(self.peer), detail },
            };
            if group == ALL_GROUPS {
                return self.fail(&mut g, err);
            }
            Self::fail_group(&mut g, group, &err);
        }
        if let Some(detail) = ended {
            // What the peer wrote before it went is still for this rank (contract rule 6).
            let _ = self.read(&mut g);
            self.fail(&mut g, Error::PeerClosed { rank: self.peer, op: String::new(), detail });
        }
    }

    /// Closes the pair quietly (the context is going away): the peer sees its lifeline end.
    pub(crate) fn close(&self) {
        let mut g = self.lock();
        self.fail(&mut g, Error::Aborted { rank: self.me, reason: "this rank closed the context".into() });
    }

    /// Fails everything pending with `err`; the pair is done.
    pub(super) fn fail(&self, g: &mut Inner, err: Error) {
        if g.closed.is_some() {
            return;
        }
        tracing::debug!(peer = self.peer, error = %err, "shared-memory pair failed");
        g.closed = Some(err.clone());
        if !g.unacked.is_empty() {
            // The peer may still read these sends' buffers, which go back to their owners now:
            // tell it not to trust what it reads (as a cancel does).
            g.outbound.broken().store(1, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        for o in g.sendq.drain(..) {
            o.done.complete(Err(err.clone()));
        }
        for (_, done, _) in g.unacked.drain(..) {
            done.complete(Err(err.clone()));
        }
        g.matcher.close(&err);
        match std::mem::replace(&mut g.rx_state, Rx::Idle) {
            Rx::Payload(d) => d.done().complete(Err(err)),
            Rx::Early(e) => g.matcher.early_dropped(e),
            _ => {}
        }
        let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
    }

    /// Fails the operations of `group` with `err`: sends not started are withdrawn, and one
    /// partly in the ring is detached (it must finish: the peer reads it as one message).
    pub(super) fn fail_group(g: &mut Inner, group: u64, err: &Error) {
        g.sendq.retain_mut(|o| {
            if o.key.group != group || o._owned.is_some() {
                return true;
            }
            match o.sent {
                None => {
                    o.done.complete(Err(err.clone()));
                    false
                }
                Some(sent) => {
                    o.detach(sent).complete(Err(err.clone()));
                    true
                }
            }
        });
        g.matcher.abort_group(group, err);
    }

    /// Sends an abort message for `group` over the lifeline (best effort).
    pub(super) fn send_abort(&self, group: u64, cause: &AbortCause) {
        let m = to_vec(&AbortMsg { group, cause: cause.encode() });
        // Small and rare: the socket buffer takes it, or the peer is gone. A lifeline that
        // cannot take a whole message within a moment is shut: a truncated message would
        // garble every later one, an ended lifeline only tells the peer this rank is gone.
        let mut sent = 0;
        let until = Instant::now() + Duration::from_millis(100);
        while sent < m.len() {
            match (&self.lifeline).write(&m[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < until => {
                    let mut fds = [libc::pollfd { fd: self.lifeline_fd(), events: libc::POLLOUT, revents: 0 }];
                    let _ = crate::transport::wake::poll_fds(&mut fds, Duration::from_millis(10));
                }
                Err(_) => {
                    let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
        }
    }
}
