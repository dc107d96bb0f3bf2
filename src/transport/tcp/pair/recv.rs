//! The receiving half of a TCP pair: reading frames off the two connections, through staging
//! or straight into receive buffers, and handing each message to the contract's matching.

use super::super::frame::{FrameHeader, HEADER_LEN, Kind};
use super::{Conn, Inner, Lane, Step, TcpPair};
use crate::error::Error;
use crate::transport::matching::{Delivery, Dispatch, EarlyRx, Header};
use crate::transport::{ALL_GROUPS, AbortCause, Completion, RecvTarget};
use std::io::{self, IoSliceMut, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Staging buffer for small reads (headers and small payloads arrive many per syscall).
const STAGING: usize = 64 << 10;
/// A payload remainder at least this large is read straight into the user's buffer.
const DIRECT_MIN: usize = 16 << 10;
/// A message at least this large that arrives while no receive at all is posted on its pair is
/// left in the socket (held) instead of being read into the early budget: when its receive is
/// posted, it is read straight into the receive buffer. An early-buffered message costs two
/// more copies (staging to early buffer, early buffer to receive buffer); in a ring allreduce
/// the next phase's segments routinely arrive before their receives are posted.
const HOLD_MIN: usize = 64 << 10;
/// How long a message is held at most; then it is read into the early budget after all, so a
/// sender that waits for its send to finish before it receives still gets on. (A pair nobody
/// watches, parked, is looked at again after the parking grace, so its hold can last that long.)
pub(super) const HOLD: Duration = Duration::from_millis(2);

/// Where the bytes coming in belong.
pub(super) enum Rx {
    /// Expecting a frame header.
    Header,
    /// Payload for a posted receive.
    Payload(Delivery),
    /// Payload that arrived before its receive; held within the budget.
    Early(EarlyRx),
    /// Payload nobody can take (mismatch, cancelled receive, finished call): read and dropped.
    Discard { remaining: u64 },
    /// The cause of an abort frame for `group` (bounded by the frame decoder).
    Abort { group: u64, len: usize, data: Vec<u8> },
    /// A header whose payload fits neither a posted receive nor the budget, or is held (see
    /// [`HOLD_MIN`]): reading stops (TCP back-pressure) until a receive for it is posted, or the
    /// hold ends.
    Stalled(Header),
}

/// The pair's reading state.
pub(super) struct Reader {
    pub(super) state: Rx,
    /// The connection the next incoming bytes are read from.
    pub(super) reading: Lane,
    /// Bytes read from `reading` and not consumed yet: `staging[start..end]`.
    staging: Box<[u8]>,
    start: usize,
    end: usize,
    /// The other connection's staging buffer and unconsumed range, kept across a switch.
    other_staging: Box<[u8]>,
    other_start: usize,
    other_end: usize,
    /// Since when the stalled header is held (see [`HOLD_MIN`]); `None` when not held.
    pub(super) held_since: Option<Instant>,
}

impl Reader {
    pub(super) fn new() -> Self {
        Reader {
            state: Rx::Header,
            reading: Lane::Main,
            staging: vec![0u8; STAGING].into_boxed_slice(),
            start: 0,
            end: 0,
            other_staging: vec![0u8; STAGING].into_boxed_slice(),
            other_start: 0,
            other_end: 0,
            held_since: None,
        }
    }

    /// Forgets staged bytes (the pair failed).
    pub(super) fn reset(&mut self) {
        (self.start, self.end, self.other_start, self.other_end) = (0, 0, 0, 0);
    }

    /// Whether reading waits for a receive to be posted.
    pub(super) fn is_stalled(&self) -> bool {
        matches!(self.state, Rx::Stalled(_))
    }

    /// A receive being filled was cancelled: the rest of its payload is read and dropped.
    pub(super) fn cancel(&mut self, done: &Arc<Completion>) {
        if let Rx::Payload(d) = &self.state
            && Arc::ptr_eq(d.done(), done)
        {
            self.state = Rx::Discard { remaining: d.remaining() as u64 };
        }
    }

    /// Reads on at the other connection (the peer sent a switch frame). What was read past the
    /// switch frame belongs to the frames after the switch back: it waits with its connection.
    fn switch_reading(&mut self) {
        std::mem::swap(&mut self.staging, &mut self.other_staging);
        std::mem::swap(&mut self.start, &mut self.other_start);
        std::mem::swap(&mut self.end, &mut self.other_end);
        self.reading = self.reading.other();
    }
}

impl TcpPair {
    /// Reads until the socket is drained or reading must stall.
    ///
    /// A read that returns less than it asked for has drained the socket, so reading stops
    /// there without the one more `recv` that would only say `EAGAIN`: whatever arrives later
    /// raises readiness again, for `poll(2)` (level-triggered) and the loop's edge-triggered
    /// epoll alike (every arrival is an edge).
    pub(super) fn read(&self, g: &mut Inner) -> Step {
        let mut drained = None;
        loop {
            self.consume_staged(g)?;
            if g.rx.is_stalled() || drained == Some(g.rx.reading) {
                return Ok(());
            }
            let Some(res) = Self::read_ahead(g).or_else(|| Self::read_some(g)) else { return Ok(()) };
            match res {
                Ok((0, _)) => {
                    return Err(Error::PeerClosed {
                        rank: self.peer,
                        op: String::new(),
                        detail: "connection closed (EOF)".into(),
                    });
                }
                Ok((n, asked)) => {
                    if n < asked {
                        drained = Some(g.rx.reading);
                    }
                    self.finish_payload(g);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(e, "receiving from")),
            }
        }
    }

    /// One read where the state says: straight into a posted receive's buffer when its payload
    /// is being read and at least [`DIRECT_MIN`] of it is left, else into staging. Returns the
    /// bytes read and asked for; `None` when the pair is not connected.
    fn read_some(g: &mut Inner) -> Option<io::Result<(usize, usize)>> {
        let Inner { conn, rx, .. } = g;
        let Conn::Open(socks) = conn else { return None };
        let stream = &mut socks[rx.reading.index()].stream;
        let (start, end) = (&mut rx.start, &mut rx.end);
        Some(match &mut rx.state {
            Rx::Payload(d) if *start == *end && d.remaining() >= DIRECT_MIN => {
                let dst = d.dst();
                let asked = dst.len();
                stream.read(dst).map(|n| {
                    d.advance(n);
                    (n, asked)
                })
            }
            _ => {
                if *start == *end {
                    *start = 0;
                    *end = 0;
                }
                let asked = rx.staging.len() - *end;
                stream.read(&mut rx.staging[*end..]).map(|n| {
                    *end += n;
                    (n, asked)
                })
            }
        })
    }

    /// Between frames, with nothing staged and an exact-length receive of at least
    /// [`DIRECT_MIN`] posted first: reads the next header into staging and what follows it
    /// straight into that receive's buffer, in one `readv`. When the header is that receive's
    /// message (the usual case: a collective posts its receive before the data lands) the
    /// payload skips the staging copy; otherwise the bytes move to staging, as if read there.
    /// A 2-rank 64 KiB allreduce then copies 64 KiB less per message. `None` when there is no
    /// such receive.
    fn read_ahead(g: &mut Inner) -> Option<io::Result<(usize, usize)>> {
        let Inner { conn, rx, matcher, .. } = g;
        let Conn::Open(socks) = conn else { return None };
        if !matches!(rx.state, Rx::Header) || rx.start != rx.end {
            return None;
        }
        // Not a receive from any of several ranks: another pair may claim and fill its buffer.
        let op = matcher.front().filter(|op| !op.done.is_shared() && op.done.is_open())?;
        let RecvTarget::Exact(buf) = op.target else { return None };
        if buf.len < DIRECT_MIN {
            return None;
        }
        let (hdr, rest) = rx.staging.split_at_mut(HEADER_LEN);
        let ahead = buf.len.min(rest.len());
        // SAFETY: the poster lent this buffer exclusively to this pair (it is posted to no other)
        // until completion or cancel, and both need the lock we hold; it is open, so neither
        // has happened. A receive that fails later may be left partly written, as ever.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.ptr, ahead) };
        let asked = HEADER_LEN + ahead;
        let read = socks[rx.reading.index()].stream.read_vectored(&mut [IoSliceMut::new(hdr), IoSliceMut::new(dst)]);
        let n = match read {
            Ok(n) => n,
            Err(e) => return Some(Err(e)),
        };
        (rx.start, rx.end) = (0, n.min(HEADER_LEN));
        if n <= HEADER_LEN {
            return Some(Ok((n, asked)));
        }
        let got = n - HEADER_LEN;
        let mut raw = [0u8; HEADER_LEN];
        raw.copy_from_slice(&rx.staging[..HEADER_LEN]);
        // What the matching would decide: a data frame for the oldest posted receive (this
        // one), of its key, descriptor and length.
        let ours = FrameHeader::decode(&raw)
            .ok()
            .filter(|h| h.kind == Kind::Data)
            .and_then(|h| matcher.take_front_for(&h.header()));
        match ours {
            Some(mut d) => {
                d.advance(got);
                rx.end = 0;
                rx.state = Rx::Payload(d);
            }
            None => {
                // SAFETY: as above; the receive is untouched otherwise, and `got <= rest.len()`.
                let read = unsafe { std::slice::from_raw_parts(buf.ptr, got) };
                rx.staging[HEADER_LEN..n].copy_from_slice(read);
                rx.end = n;
            }
        }
        Some(Ok((n, asked)))
    }

    /// Completes a directly-read payload once full.
    fn finish_payload(&self, g: &mut Inner) {
        if let Rx::Payload(d) = &g.rx.state
            && d.is_full()
            && let Rx::Payload(d) = std::mem::replace(&mut g.rx.state, Rx::Header)
        {
            d.finish(self.peer);
        }
    }

    /// Moves staged bytes to where they belong.
    fn consume_staged(&self, g: &mut Inner) -> Step {
        loop {
            let rx = &mut g.rx;
            let avail = rx.end - rx.start;
            let staged = &rx.staging[rx.start..rx.end];
            match &mut rx.state {
                Rx::Stalled(h) => {
                    let h = *h;
                    self.dispatch(g, h);
                    if g.rx.is_stalled() {
                        return Ok(());
                    }
                }
                Rx::Header => {
                    if avail < HEADER_LEN {
                        if rx.start > 0 && avail > 0 {
                            rx.staging.copy_within(rx.start..rx.end, 0);
                        }
                        if rx.start > 0 {
                            rx.end = avail;
                            rx.start = 0;
                        }
                        return Ok(());
                    }
                    let mut raw = [0u8; HEADER_LEN];
                    raw.copy_from_slice(&staged[..HEADER_LEN]);
                    rx.start += HEADER_LEN;
                    let h = FrameHeader::decode(&raw)
                        .map_err(|detail| Error::Protocol { peer: Some(self.peer), detail })?;
                    match h.kind {
                        Kind::Switch => g.rx.switch_reading(),
                        Kind::Abort => {
                            // The length is bounded by the decoder.
                            let len = h.len as usize;
                            g.rx.state = Rx::Abort { group: h.key.group, len, data: Vec::with_capacity(len) };
                            self.abort_received(g)?;
                        }
                        Kind::Data => self.dispatch(g, h.header()),
                    }
                }
                _ if avail == 0 => return Ok(()),
                Rx::Payload(d) => {
                    let n = avail.min(d.remaining());
                    d.dst()[..n].copy_from_slice(&staged[..n]);
                    d.advance(n);
                    rx.start += n;
                    self.finish_payload(g);
                }
                Rx::Early(early) => {
                    rx.start += early.extend(staged);
                    if early.remaining() == 0
                        && let Rx::Early(early) = std::mem::replace(&mut rx.state, Rx::Header)
                    {
                        g.matcher.early_arrived(early);
                    }
                }
                Rx::Abort { len, data, .. } => {
                    let n = avail.min(*len - data.len());
                    data.extend_from_slice(&staged[..n]);
                    rx.start += n;
                    self.abort_received(g)?;
                }
                Rx::Discard { remaining } => {
                    let n = (avail as u64).min(*remaining);
                    *remaining -= n;
                    rx.start += n as usize;
                    if *remaining == 0 {
                        rx.state = Rx::Header;
                    }
                }
            }
        }
    }

    /// Acts on a complete abort frame: the peer gave up on a group. For [`ALL_GROUPS`] the pair
    /// fails with the peer's cause (returned as the error); for a group, its operations fail
    /// and reading goes on.
    fn abort_received(&self, g: &mut Inner) -> Step {
        let Rx::Abort { group, len, data } = &g.rx.state else { return Ok(()) };
        if data.len() < *len {
            return Ok(());
        }
        let group = *group;
        let err =
            AbortCause::decode(data).map_err(|detail| Error::Protocol { peer: Some(self.peer), detail })?.into_error();
        g.rx.state = Rx::Header;
        if group == ALL_GROUPS {
            return Err(err);
        }
        tracing::debug!(peer = self.peer, group, error = %err, "peer aborted a group");
        g.tx.fail_group(group, &err);
        g.matcher.abort_group(group, &err);
        // Reading goes on here, so a stalled message is looked at again by the caller's loop;
        // a driver that is not this thread must see the failed operations.
        if g.watching.is_driven() {
            self.wake.signal();
        }
        Ok(())
    }

    /// Decides where the payload of a data frame goes (see [`HOLD_MIN`] for holds).
    fn dispatch(&self, g: &mut Inner, h: Header) {
        if self.keep_holding(g, h.len) {
            g.rx.state = Rx::Stalled(h);
            return;
        }
        self.end_hold(g);
        g.rx.state = match g.matcher.incoming(h) {
            Dispatch::Deliver(d) if d.is_full() => {
                d.finish(self.peer);
                Rx::Header
            }
            Dispatch::Deliver(d) => Rx::Payload(d),
            Dispatch::Early(early) if early.remaining() == 0 => {
                g.matcher.early_arrived(early);
                Rx::Header
            }
            Dispatch::Early(early) => Rx::Early(early),
            Dispatch::Discard if h.len == 0 => Rx::Header,
            Dispatch::Discard => Rx::Discard { remaining: h.len },
            Dispatch::Stall => Rx::Stalled(h),
        };
    }

    /// After a receive was posted or early budget freed: reads on if the stalled header can go
    /// somewhere now, and tells a driver, which polls a stalled pair without `POLLIN`.
    pub(super) fn unstall(&self, g: &mut Inner) {
        if g.rx.is_stalled() {
            self.drive(g);
            if g.watching.is_driven() {
                self.wake.signal();
            }
        }
    }

    /// Whether a stalled header of `len` bytes stays held: only while no receive is posted on
    /// the pair (one that is posted for another message needs the stream read past this one)
    /// and for at most [`HOLD`]. Starts the hold of a fresh header.
    fn keep_holding(&self, g: &mut Inner, len: u64) -> bool {
        if len < HOLD_MIN as u64 || g.matcher.has_posted() {
            return false;
        }
        let now = Instant::now();
        match g.rx.held_since {
            Some(t) => now.saturating_duration_since(t) < HOLD,
            None => {
                g.rx.held_since = Some(now);
                self.count_hold(g);
                true
            }
        }
    }

    /// The stalled header is no longer held.
    pub(super) fn end_hold(&self, g: &mut Inner) {
        if g.rx.held_since.take().is_some() {
            self.count_hold(g);
        }
    }
}
