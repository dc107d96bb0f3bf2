//! The sending half of a TCP pair: the queue of frames and its flush onto the pair's two
//! connections.

use super::super::frame::{FrameHeader, HEADER_LEN};
use super::{Lane, Sock};
use crate::error::Error;
use crate::transport::{ALL_GROUPS, Completion, Done, SendBuf};
use crate::transport::{copy_span, span};
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::Arc;

/// Most iovecs handed to one `sendmsg`.
const MAX_IOV: usize = 64;
/// Most bytes handed to one `sendmsg`. Measured with `ferrogloo-bench` on the 2-core machine,
/// eight alternating runs of each build, median p50: 1 MiB broadcast 166 µs with this cap
/// against 364 µs without (2 ranks), 1191 vs 1287 µs (4 ranks); 1 MiB allgather 298 vs 344 µs
/// (2 ranks), 863 vs 948 µs (4 ranks). Much smaller caps cost more calls than they save
/// (128 KiB: 1 MiB broadcast 360–420 µs).
const MAX_SEND: usize = 1 << 20;

/// One frame waiting to be written.
struct SendOp {
    /// The connection it goes on.
    lane: Lane,
    /// The group it belongs to (so that an aborted group's frames can be withdrawn).
    group: u64,
    hdr: [u8; HEADER_LEN],
    /// The payload: these buffers one after the other (most frames have one).
    body: SmallVec<[SendBuf; 1]>,
    /// Its length.
    len: usize,
    /// Memory `body` points into when the pair owns the payload (abort frames, and the rest
    /// of a frame cancelled part-way, see [`Sender::cancel`]).
    _owned: Option<Box<[u8]>>,
    /// Payload bytes before what `body` holds (written before a cancel copied the rest).
    base: usize,
    /// Bytes of header + payload written so far.
    off: usize,
    done: Arc<Completion>,
}

impl SendOp {
    fn total(&self) -> usize {
        HEADER_LEN + self.len
    }

    /// Copies the rest of the payload of a frame partly written, to write it from the copy:
    /// the poster's buffers are no longer read. Returns the poster's completion (the frame
    /// now has one nobody waits for).
    fn detach(&mut self) -> Arc<Completion> {
        let sent = self.off.saturating_sub(HEADER_LEN);
        // SAFETY: the buffers are still lent (the frame is queued, its completion open).
        let rest = unsafe { copy_span(&self.body, sent - self.base, self.len - sent) };
        self.body = smallvec::smallvec![SendBuf::from_slice(&rest)];
        self._owned = Some(rest);
        self.base = sent;
        std::mem::replace(&mut self.done, Completion::new())
    }
}

/// The frames queued on a pair, in the order they go out.
pub(super) struct Sender {
    queue: VecDeque<SendOp>,
    /// The connection of the last frame queued (a switch frame goes first when it changes).
    lane: Lane,
}

impl Sender {
    pub(super) fn new() -> Self {
        Sender { queue: VecDeque::new(), lane: Lane::Main }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The connection of the last frame queued.
    pub(super) fn lane(&self) -> Lane {
        self.lane
    }

    /// The connection the next frame to write goes on.
    pub(super) fn front_lane(&self) -> Option<Lane> {
        self.queue.front().map(|op| op.lane)
    }

    /// Queues a frame (header `hdr`, payload `body`'s buffers one after the other) on `lane`,
    /// behind a switch frame on the connection it leaves when the lane changes.
    pub(super) fn push(
        &mut self,
        lane: Lane,
        group: u64,
        hdr: [u8; HEADER_LEN],
        body: SmallVec<[SendBuf; 1]>,
        owned: Option<Box<[u8]>>,
        done: Arc<Completion>,
    ) {
        if lane != self.lane {
            // Tell the peer to read on at the other connection.
            self.queue.push_back(SendOp {
                lane: self.lane,
                // No group's: a group's abort must not withdraw it.
                group: ALL_GROUPS,
                hdr: FrameHeader::switch().encode(),
                body: SmallVec::new(),
                len: 0,
                _owned: None,
                base: 0,
                off: 0,
                done: Completion::new(),
            });
            self.lane = lane;
        }
        let len = body.iter().map(|b| b.len).sum();
        self.queue.push_back(SendOp { lane, group, hdr, body, len, _owned: owned, base: 0, off: 0, done });
    }

    /// Writes as much of the queue as the sockets take, in order: a frame for the other
    /// connection waits until the ones before it are written. Completes each frame's send,
    /// from `peer`'s point of view, once its last byte is written.
    pub(super) fn flush(&mut self, socks: &mut [Sock; 2], peer: usize) -> io::Result<()> {
        while let Some(lane) = self.front_lane() {
            // The queue's next slices for this connection, at most MAX_IOV of them and
            // MAX_SEND bytes in all.
            let mut iov: [IoSlice<'_>; MAX_IOV] = [IoSlice::new(&[]); MAX_IOV];
            let (mut n_iov, mut budget) = (0, MAX_SEND);
            'ops: for op in self.queue.iter() {
                if n_iov + 2 > MAX_IOV || budget == 0 || op.lane != lane {
                    break;
                }
                // SAFETY: the poster guarantees (Pair::post_send) that the buffers stay valid
                // and unwritten until the completion is completed, which happens below only
                // after the last byte is written.
                let payload: SmallVec<[&[u8]; 4]> =
                    op.body.iter().map(|b| unsafe { std::slice::from_raw_parts(b.ptr, b.len) }).collect();
                let (hdr, sent): (&[u8], usize) = match op.off.checked_sub(HEADER_LEN) {
                    None => (&op.hdr[op.off..], 0),
                    Some(sent) => (&[], sent),
                };
                for part in std::iter::once(hdr).chain(span(&payload, sent - op.base, op.len - sent)) {
                    if n_iov == MAX_IOV || budget == 0 {
                        break 'ops;
                    }
                    let take = part.len().min(budget);
                    if take > 0 {
                        iov[n_iov] = IoSlice::new(&part[..take]);
                        n_iov += 1;
                        budget -= take;
                    }
                }
            }
            let sock = socket2::SockRef::from(&socks[lane.index()].stream);
            match sock.send_vectored_with_flags(&iov[..n_iov], libc::MSG_NOSIGNAL) {
                Ok(mut n) => {
                    for op in self.queue.iter_mut() {
                        let take = (op.total() - op.off).min(n);
                        op.off += take;
                        n -= take;
                        if n == 0 {
                            break;
                        }
                    }
                    while let Some(op) = self.queue.pop_front_if(|op| op.off == op.total()) {
                        op.done.complete(Ok(Done { peer, len: op.len }));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Withdraws the frame of `done`: after it returns the sender no longer reads its buffers.
    /// A frame partly written already cannot be taken back (the peer reads the stream as
    /// frames): it is [detached](SendOp::detach), so the connection goes on carrying the
    /// other groups (the peer receives the message whole, or drops it with its group).
    pub(super) fn cancel(&mut self, done: &Arc<Completion>) {
        let Some(i) = self.queue.iter().position(|op| Arc::ptr_eq(&op.done, done)) else { return };
        if self.queue[i].off == 0 {
            self.queue.remove(i);
        } else {
            self.queue[i].detach();
        }
    }

    /// Fails every queued frame (the pair failed).
    pub(super) fn fail_all(&mut self, err: &Error) {
        for op in self.queue.drain(..) {
            op.done.complete(Err(err.clone()));
        }
    }

    /// Fails the frames of `group` with `err`: those not started are withdrawn, and a partly
    /// written one is [detached](SendOp::detach) (it must finish, or the stream breaks).
    pub(super) fn fail_group(&mut self, group: u64, err: &Error) {
        self.queue.retain_mut(|op| {
            if op.group != group || op._owned.is_some() {
                return true;
            }
            if op.off == 0 {
                op.done.complete(Err(err.clone()));
                return false;
            }
            op.detach().complete(Err(err.clone()));
            true
        });
    }
}
