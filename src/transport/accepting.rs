//! The accepting side of the backends whose endpoints listen on a socket of their own (shared
//! memory, ibverbs): the connections taken from the listener handshake several at once, each
//! on its own ([`Accepting`]). Each runs the one handshake ([`Handshake`], sans-IO) without
//! blocking, as far as the bytes that came let it, with its own deadline; at most `max` are
//! pending, and a new one evicts the oldest (as the TCP device's `max_pending` does). So a
//! stranger that connects and says nothing, or stops halfway, holds up nobody but itself: a
//! real peer, which sends its hello at once, finishes its handshake meanwhile.
//!
//! The backend says what is particular to it through [`Acceptor`]: how to take a connection,
//! send and read on it, and what to answer a hello and a proven peer.

use crate::transport::handshake::messages::MAX_MESSAGE;
use crate::transport::handshake::{BackendKind, Done, Event, Handshake};
use crate::transport::random16;
use crate::transport::wake::poll_fds;
use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// What a backend's endpoint does for its acceptor.
pub(crate) trait Acceptor {
    /// A connection in its handshake, and whatever the backend keeps with it (descriptors
    /// received, what it set up for the peer once it proved the secret).
    type Conn;

    /// The backend, for the log.
    const NAME: &'static str;

    /// Takes a connection waiting on the listener, set non-blocking; `Ok(None)` when none is.
    fn accept(&mut self) -> io::Result<Option<Self::Conn>>;

    /// The listener's descriptor.
    fn listener_fd(&self) -> RawFd;

    /// A connection's descriptor.
    fn fd(conn: &Self::Conn) -> RawFd;

    /// Sends a whole handshake message (with what goes only with this side's payload when
    /// `payload`); a message the socket cannot take at once is an error (a few dozen bytes
    /// into a fresh connection's buffer, or it is broken).
    fn send(&self, conn: &mut Self::Conn, bytes: &[u8], payload: bool) -> io::Result<()>;

    /// Reads what has come, at most `buf.len()` bytes: `Ok(0)` at the end, `WouldBlock` when
    /// nothing has.
    fn recv(&self, conn: &mut Self::Conn, buf: &mut [u8]) -> io::Result<usize>;

    /// Answers the handshake's question `ev` ([`Event::Hello`]: admit it; [`Event::Proved`]:
    /// respond or refuse).
    fn decide(&mut self, hs: &mut Handshake, ev: &Event, conn: &mut Self::Conn);

    /// The handshake on `conn` finished: the connection is the peer's.
    fn finished(&mut self, conn: Self::Conn, done: Done);
}

/// One connection in its handshake.
struct Pending<C> {
    conn: C,
    hs: Handshake,
    deadline: Instant,
}

/// Where a handshake stands after a step.
enum Step {
    /// Waiting for bytes.
    More,
    Done(Done),
    /// Refused or broken, for this reason: the connection is closed.
    Drop(String),
}

/// The connections an endpoint handshakes with, oldest first.
pub(crate) struct Accepting<C> {
    kind: BackendKind,
    /// Each handshake's time.
    timeout: Duration,
    /// The most handshakes pending at once.
    max: usize,
    pending: Vec<Pending<C>>,
}

impl<C> Accepting<C> {
    pub(crate) fn new(kind: BackendKind, timeout: Duration, max: usize) -> Self {
        Accepting { kind, timeout, max: max.max(1), pending: Vec::new() }
    }

    /// The table, leaving this one empty (for the time its endpoint is borrowed to wait).
    pub(crate) fn take(&mut self) -> Self {
        Accepting { kind: self.kind, timeout: self.timeout, max: self.max, pending: std::mem::take(&mut self.pending) }
    }

    /// How many handshakes are pending.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.pending.len()
    }

    /// Takes a new connection, first dropping the oldest pending one when the table is full.
    fn add<A: Acceptor<Conn = C>>(&mut self, conn: C) {
        if self.pending.len() >= self.max {
            let evicted = self.pending.remove(0);
            tracing::warn!(backend = A::NAME, "refused a connection: evicted, too many handshakes in progress");
            drop(evicted);
        }
        let deadline = Instant::now() + self.timeout;
        self.pending.push(Pending { conn, hs: Handshake::accept(self.kind, random16()), deadline });
    }

    /// Takes every connection waiting on the listener; false when taking one failed (it stays
    /// in the listener's backlog, which then stays readable).
    fn accept_all<A: Acceptor<Conn = C>>(&mut self, a: &mut A) -> bool {
        loop {
            match a.accept() {
                Ok(Some(conn)) => self.add::<A>(conn),
                Ok(None) => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors and the like.
                    tracing::warn!(backend = A::NAME, error = %e, "accepting a connection failed");
                    return false;
                }
            }
        }
    }

    /// Advances every pending handshake as far as what has come lets it; hands the finished
    /// ones to `a`, drops the refused, broken and late ones.
    fn step<A: Acceptor<Conn = C>>(&mut self, a: &mut A) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let step =
                if p.deadline <= now { Step::Drop("handshake not completed in time".into()) } else { advance(a, p) };
            match step {
                Step::More => i += 1,
                Step::Drop(why) => {
                    tracing::warn!(backend = A::NAME, reason = %why, "refused a connection");
                    self.pending.remove(i);
                }
                Step::Done(done) => {
                    let p = self.pending.remove(i);
                    a.finished(p.conn, done);
                }
            }
        }
    }

    /// Accepts and handshakes until `missing(a)` is empty or `until`; returns what is missing
    /// then. Sleeps in `poll` on the listener and the pending connections, up to the earliest of
    /// `until` and the handshakes' deadlines.
    pub(crate) fn wait<A: Acceptor<Conn = C>>(
        &mut self,
        a: &mut A,
        until: Instant,
        missing: impl Fn(&A) -> Vec<usize>,
    ) -> Vec<usize> {
        let mut fds = Vec::new();
        loop {
            let accepted = self.accept_all(a);
            self.step(a);
            let left = missing(a);
            let now = Instant::now();
            if left.is_empty() || now >= until {
                return left;
            }
            let wake = self.pending.iter().map(|p| p.deadline).fold(until, Instant::min);
            if !accepted {
                // The listener stays readable: look at it again in a moment, not at once.
                std::thread::sleep(Duration::from_millis(10).min(wake.saturating_duration_since(now)));
                continue;
            }
            fds.clear();
            fds.extend(
                std::iter::once(a.listener_fd())
                    .chain(self.pending.iter().map(|p| A::fd(&p.conn)))
                    .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }),
            );
            if let Err(e) = poll_fds(&mut fds, wake.saturating_duration_since(now)) {
                tracing::warn!(backend = A::NAME, error = %e, "waiting for connections failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Runs `p`'s handshake until it needs bytes that have not come, or ends.
fn advance<A: Acceptor>(a: &mut A, p: &mut Pending<A::Conn>) -> Step {
    let mut buf = [0u8; MAX_MESSAGE];
    loop {
        match p.hs.poll() {
            Event::Send(o) => {
                if let Err(e) = a.send(&mut p.conn, &o.bytes, o.payload) {
                    return Step::Drop(format!("could not answer the handshake: {e}"));
                }
            }
            Event::Need(n) => match a.recv(&mut p.conn, &mut buf[..n.min(MAX_MESSAGE)]) {
                Ok(0) => return Step::Drop("closed during the handshake".into()),
                Ok(k) => {
                    p.hs.feed(&buf[..k]);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::More,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Step::Drop(format!("reading the handshake failed: {e}")),
            },
            Event::Done(d) => return Step::Done(d),
            Event::Refused(why) => return Step::Drop(why.to_string()),
            ev => a.decide(&mut p.hs, &ev, &mut p.conn),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::handshake::{Dial, Local};
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::{UnixListener, UnixStream};

    const CTX: [u8; 16] = [7; 16];

    /// An acceptor of rank 0 of 2 on a Unix socket, with no payload of its own; it records the
    /// peers whose handshakes finished.
    struct Fake {
        listener: UnixListener,
        done: Vec<usize>,
    }

    impl Acceptor for Fake {
        type Conn = UnixStream;
        const NAME: &'static str = "test";

        fn accept(&mut self) -> io::Result<Option<UnixStream>> {
            match self.listener.accept() {
                Ok((s, _)) => s.set_nonblocking(true).map(|()| Some(s)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                Err(e) => Err(e),
            }
        }
        fn listener_fd(&self) -> RawFd {
            self.listener.as_raw_fd()
        }
        fn fd(conn: &UnixStream) -> RawFd {
            conn.as_raw_fd()
        }
        fn send(&self, conn: &mut UnixStream, bytes: &[u8], _: bool) -> io::Result<()> {
            conn.write_all(bytes)
        }
        fn recv(&self, conn: &mut UnixStream, buf: &mut [u8]) -> io::Result<usize> {
            conn.read(buf)
        }
        fn decide(&mut self, hs: &mut Handshake, ev: &Event, _: &mut UnixStream) {
            match ev {
                Event::Hello(h) => {
                    let local = Local { ctx: CTX, rank: 0, size: 2, secret: None };
                    hs.admit(Some(&local), b"rank 0", self.done.contains(&(h.from as usize)));
                }
                Event::Proved(_) => hs.respond(b"welcome"),
                _ => {}
            }
        }
        fn finished(&mut self, _: UnixStream, done: Done) {
            self.done.push(done.peer.rank);
        }
    }

    fn fake() -> (Fake, std::path::PathBuf, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("listener");
        let listener = UnixListener::bind(&path).expect("a listener");
        listener.set_nonblocking(true).expect("non-blocking");
        (Fake { listener, done: Vec::new() }, path, dir)
    }

    /// Rank 1's side of the handshake, blocking, on `s`.
    fn connect(mut s: UnixStream) -> Result<(), String> {
        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
        let mut hs = Handshake::connect(Dial {
            kind: BackendKind::Shm,
            local: Local { ctx: CTX, rank: 1, size: 2, secret: None },
            to: 0,
            lane: 0,
            address: b"rank 0",
            payload: b"hello".to_vec(),
            nonce: random16(),
        });
        let mut buf = [0u8; MAX_MESSAGE];
        loop {
            match hs.poll() {
                Event::Send(o) => s.write_all(&o.bytes).map_err(|e| e.to_string())?,
                Event::Need(n) => {
                    let k = s.read(&mut buf[..n]).map_err(|e| e.to_string())?;
                    if k == 0 {
                        return Err("closed".into());
                    }
                    hs.feed(&buf[..k]);
                }
                Event::Proved(_) => hs.respond(&[]),
                Event::Done(_) => return Ok(()),
                Event::Refused(why) => return Err(why.to_string()),
                Event::Hello(_) => return Err("a hello on the connector".into()),
            }
        }
    }

    #[test]
    fn a_peer_finishes_while_silent_and_half_finished_connections_wait() {
        let (mut a, path, _dir) = fake();
        let mut table = Accepting::new(BackendKind::Shm, Duration::from_secs(30), 8);
        let _silent = UnixStream::connect(&path).expect("connect");
        let mut half = UnixStream::connect(&path).expect("connect");
        half.write_all(b"FGLO\x04\x00\x01").expect("part of a hello");
        let peer = UnixStream::connect(&path).expect("connect");
        let t = Instant::now();
        let connector = std::thread::spawn(move || connect(peer));
        let missing = table.wait(&mut a, Instant::now() + Duration::from_secs(10), |a| {
            if a.done.is_empty() { vec![1] } else { vec![] }
        });
        assert_eq!(missing, Vec::<usize>::new());
        assert_eq!(connector.join().expect("the connector"), Ok(()));
        assert!(t.elapsed() < Duration::from_secs(2), "the peer waited {:?} for the strangers", t.elapsed());
        assert_eq!((a.done.as_slice(), table.len()), (&[1][..], 2), "the strangers still pending");
    }

    #[test]
    fn the_oldest_handshake_is_evicted_and_late_ones_are_dropped() {
        let (mut a, path, _dir) = fake();
        let mut table = Accepting::new(BackendKind::Shm, Duration::from_millis(300), 2);
        let mut first = UnixStream::connect(&path).expect("connect");
        let mut second = UnixStream::connect(&path).expect("connect");
        let mut third = UnixStream::connect(&path).expect("connect");
        let none = |_: &Fake| vec![1];
        table.wait(&mut a, Instant::now(), none);
        assert_eq!(table.len(), 2, "at most two pending");
        let closed = |s: &mut UnixStream| {
            s.set_read_timeout(Some(Duration::from_secs(5))).expect("a timeout");
            matches!(s.read(&mut [0u8; 8]), Ok(0))
        };
        let open = |s: &mut UnixStream| {
            s.set_read_timeout(Some(Duration::from_millis(20))).expect("a timeout");
            s.read(&mut [0u8; 8])
                .is_err_and(|e| matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut))
        };
        assert!(closed(&mut first), "the oldest was evicted");
        assert!(open(&mut second) && open(&mut third), "only the oldest was evicted");
        // The others are dropped at their deadline: a wait that outlasts it closes them.
        table.wait(&mut a, Instant::now() + Duration::from_millis(600), none);
        assert_eq!(table.len(), 0);
        assert!(closed(&mut second) && closed(&mut third));
    }
}
