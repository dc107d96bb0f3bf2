//! Attacks on the handshake by a stranger who has read the store but does not know the job's
//! secret, run against each backend's real endpoints (TCP, shared memory here; ibverbs on the
//! simulated provider in its own module, through [`attack`]).
//!
//! The stranger puts its own listener's address in place of rank 0's (the store answers anyone,
//! and writes too), so rank 1 connects to it. It then does the most it can without the secret:
//!
//! - **replay**: it records what rank 1 sends and replays it to rank 0's real listener (with
//!   any descriptors rank 1 passed), and never answers rank 1;
//! - **relay**: it also carries rank 0's answers back to rank 1 and rank 1's next messages on
//!   to rank 0, round after round (a fake acceptor that answers with what the real one says).
//!
//! Neither may leave a link on either rank, nor let a payload or a descriptor reach the
//! stranger; afterwards the real rank 1 still connects to the real rank 0. The tests use only
//! the endpoints' API and raw sockets, so they ran unchanged against the three handshakes the
//! one handshake replaced (wire version 3), where these failed:
//!
//! - TCP, relay: both ranks made a link through the stranger (the acceptor's proof did not
//!   cover the address the connector dialed). The replay was refused.
//! - shared memory, replay and relay: each rank handed its segment and doorbell descriptors
//!   to the stranger (the connector with its hello, the acceptor with its answer, both before
//!   the other side had proved the secret); the relay also left both ranks linked.
//! - ibverbs, replay: rank 0 made a link for the stranger (the hello's MAC took the context id
//!   as its nonce), and rank 1's hello carried its ring's address and key; relay: both ranks
//!   linked, and rank 1 handed over its ring. Rank 0's ring address was in its store entry.

use crate::transport::{Endpoint, EndpointSpec, random16};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The job's secret (the stranger does not have it).
pub(crate) const SECRET: &[u8] = b"the job's secret";
/// How long the stranger waits for more bytes before it takes a message as complete.
const QUIET: Duration = Duration::from_millis(150);
/// How long the attack lasts.
const WINDOW: Duration = Duration::from_millis(2500);

/// A connection the stranger holds.
pub(crate) enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// What the stranger read from a connection.
#[derive(Default)]
struct Got {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Got {
    fn is_empty(&self) -> bool {
        self.bytes.is_empty() && self.fds.is_empty()
    }
}

impl Conn {
    fn send(&mut self, got: &Got) {
        match self {
            Conn::Tcp(s) => {
                let _ = s.write_all(&got.bytes);
            }
            Conn::Unix(s) => {
                if got.bytes.is_empty() {
                    return;
                }
                let raw: Vec<i32> = got.fds.iter().map(|f| f.as_raw_fd()).collect();
                let cmsg = [ControlMessage::ScmRights(&raw)];
                let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
                let _ = sendmsg::<()>(s.as_raw_fd(), &[IoSlice::new(&got.bytes)], cmsgs, MsgFlags::MSG_NOSIGNAL, None);
            }
        }
    }

    /// Reads until nothing arrives for [`QUIET`] or the peer closes.
    fn drain(&mut self) -> Got {
        let mut got = Got::default();
        let mut buf = [0u8; 4096];
        loop {
            let n = match self {
                Conn::Tcp(s) => {
                    let _ = s.set_read_timeout(Some(QUIET));
                    s.read(&mut buf).unwrap_or(0)
                }
                Conn::Unix(s) => {
                    let _ = s.set_read_timeout(Some(QUIET));
                    let mut space = nix::cmsg_space!([i32; 8]);
                    let mut iov = [IoSliceMut::new(&mut buf)];
                    match recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
                        Ok(msg) => {
                            for c in msg.cmsgs().into_iter().flatten() {
                                if let ControlMessageOwned::ScmRights(list) = c {
                                    // SAFETY: the kernel installed these descriptors for us alone.
                                    got.fds.extend(list.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                                }
                            }
                            msg.bytes
                        }
                        Err(_) => 0,
                    }
                }
            };
            if n == 0 {
                return got;
            }
            got.bytes.extend_from_slice(&buf[..n]);
        }
    }
}

/// The stranger's listener.
pub(crate) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// A TCP listener on loopback and its address as a TCP endpoint publishes it.
    pub(crate) fn tcp() -> (Listener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").expect("the stranger's listener");
        let a = l.local_addr().expect("its address");
        l.set_nonblocking(true).expect("nonblocking");
        (Listener::Tcp(l), a)
    }

    /// An abstract Unix socket and its name.
    pub(crate) fn unix() -> (Listener, Vec<u8>) {
        let name: Vec<u8> =
            format!("ferrogloo-stranger-{}", random16().iter().map(|b| format!("{b:02x}")).collect::<String>()).into();
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(&name).expect("a name");
        let l = UnixListener::bind_addr(&addr).expect("the stranger's listener");
        l.set_nonblocking(true).expect("nonblocking");
        (Listener::Unix(l), name)
    }

    fn accept(&self) -> Option<Conn> {
        let conn = match self {
            Listener::Tcp(l) => l.accept().ok().map(|(s, _)| Conn::Tcp(s)),
            Listener::Unix(l) => l.accept().ok().map(|(s, _)| Conn::Unix(s)),
        };
        match &conn {
            Some(Conn::Tcp(s)) => s.set_nonblocking(false).expect("blocking"),
            Some(Conn::Unix(s)) => s.set_nonblocking(false).expect("blocking"),
            None => {}
        }
        conn
    }
}

/// A connection to a real TCP listener.
pub(crate) fn dial_tcp(to: SocketAddr) -> Conn {
    Conn::Tcp(TcpStream::connect(to).expect("connecting to the real listener"))
}

/// A connection to a real abstract Unix socket.
pub(crate) fn dial_unix(name: &[u8]) -> Conn {
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name).expect("a name");
    Conn::Unix(UnixStream::connect_addr(&addr).expect("connecting to the real listener"))
}

/// The attack, on two real endpoints of one context: rank 0 (`a`) and rank 1 (`b`).
pub(crate) struct Attack<'a> {
    /// The stranger's listener.
    pub(crate) listener: Listener,
    /// Rank 0's address with the stranger's listener in place of its own.
    pub(crate) fake: Vec<u8>,
    /// Opens a connection to rank 0's real listener.
    pub(crate) dial: &'a (dyn Fn() -> Conn + Sync),
    /// Byte strings that must not reach the stranger: what rank 1 hands only to rank 0 (its
    /// ring's address) and the other way round.
    pub(crate) b_private: Vec<Vec<u8>>,
    pub(crate) a_private: Vec<Vec<u8>>,
    /// Carry rank 0's answers back to rank 1 (else only replay rank 1's opening).
    pub(crate) relay: bool,
}

/// A context id, spec for `rank` of 2 with the job's secret.
pub(crate) fn spec(ctx: [u8; 16], rank: usize) -> EndpointSpec {
    EndpointSpec { ctx, rank, size: 2, secret: Some(SECRET.to_vec()), host: "attacked-host".into() }
}

/// Runs `attack` against `a` and `b`; returns what went wrong (nothing, when the handshake
/// holds), then checks that the real ranks still connect.
pub(crate) fn attack(a: &mut dyn Endpoint, b: &mut dyn Endpoint, attack: &Attack<'_>) -> Vec<String> {
    let real = a.address();
    let mut wrong = Vec::new();
    let b_done = AtomicBool::new(false);
    let (from_b, from_a, b_result, a_missing) = std::thread::scope(|s| {
        let end = Instant::now() + WINDOW;
        let (a, b, b_done) = (&mut *a, &mut *b, &b_done);
        let waiter = s.spawn(move || a.wait_connected(&[1], end));
        let connector = s.spawn(move || {
            let r = b.connect(0, &attack.fake, end);
            b_done.store(true, Ordering::SeqCst);
            r
        });
        let (mut from_b, mut from_a) = (Got::default(), Got::default());
        // Held until the ranks are done with them, so that nothing ends for want of a peer.
        let mut held = Vec::new();
        while Instant::now() < end && !b_done.load(Ordering::SeqCst) {
            let Some(to_b) = attack.listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            let mut to_b = Some(to_b);
            let mut got = to_b.as_mut().map(Conn::drain).unwrap_or_default();
            if !attack.relay {
                to_b = None; // rank 1 gets no answer
            }
            let mut to_a = (attack.dial)();
            for _ in 0..4 {
                if got.is_empty() {
                    break;
                }
                to_a.send(&got);
                from_b.bytes.extend_from_slice(&got.bytes);
                from_b.fds.append(&mut got.fds);
                let mut answer = to_a.drain();
                let Some(to_b) = to_b.as_mut() else {
                    from_a.bytes.extend_from_slice(&answer.bytes);
                    from_a.fds.append(&mut answer.fds);
                    break;
                };
                to_b.send(&answer);
                from_a.bytes.extend_from_slice(&answer.bytes);
                from_a.fds.append(&mut answer.fds);
                got = to_b.drain();
            }
            held.push((to_a, to_b));
        }
        let b_result = connector.join().expect("rank 1 panicked");
        let a_missing = waiter.join().expect("rank 0 panicked");
        drop(held);
        (from_b, from_a, b_result, a_missing)
    });
    let kind = if attack.relay { "relay" } else { "replay" };
    if from_b.bytes.is_empty() {
        wrong.push(format!("{kind}: rank 1 never reached the stranger (the test tests nothing)"));
    }
    if b_result.is_ok() {
        wrong.push(format!("{kind}: rank 1 made a link through the stranger's listener"));
    }
    if a_missing != [1] {
        wrong.push(format!("{kind}: rank 0 made a link for rank 1 with the stranger"));
    }
    if !from_b.fds.is_empty() {
        wrong.push(format!("{kind}: rank 1 handed {} descriptors to the stranger", from_b.fds.len()));
    }
    if !from_a.fds.is_empty() {
        wrong.push(format!("{kind}: rank 0 handed {} descriptors to the stranger", from_a.fds.len()));
    }
    let leaked = |bytes: &[u8], private: &[Vec<u8>]| private.iter().any(|p| bytes.windows(p.len()).any(|w| w == p));
    if leaked(&from_b.bytes, &attack.b_private) {
        wrong.push(format!("{kind}: rank 1 sent the stranger what only rank 0 may see"));
    }
    if leaked(&from_a.bytes, &attack.a_private) {
        wrong.push(format!("{kind}: rank 0 sent the stranger what only rank 1 may see"));
    }
    if wrong.is_empty() {
        // The attack left nothing behind: the real ranks connect.
        let (connected, missing) = std::thread::scope(|s| {
            let end = Instant::now() + Duration::from_secs(10);
            let waiter = {
                let a = &mut *a;
                s.spawn(move || a.wait_connected(&[1], end))
            };
            let c = b.connect(0, &real, end);
            (c, waiter.join().expect("rank 0 panicked"))
        });
        if let Err(e) = connected {
            wrong.push(format!("{kind}: afterwards the real rank 1 cannot connect: {}", e.into_error()));
        }
        if !missing.is_empty() {
            wrong.push(format!("{kind}: afterwards the real rank 0 does not see rank 1"));
        }
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Backend;
    use crate::transport::shm::{ShmDevice, ShmOptions};
    use crate::transport::tcp::device::{TcpDevice, TcpOptions};

    fn tcp_device() -> TcpDevice {
        let opts = TcpOptions {
            send_buffer: None,
            recv_buffer: None,
            early_budget: 1 << 20,
            handshake_timeout: Duration::from_secs(3),
            max_pending: 64,
        };
        TcpDevice::start(&[SocketAddr::from(([127, 0, 0, 1], 0))], opts).expect("a TCP device")
    }

    fn on_tcp(relay: bool) -> Vec<String> {
        let (dev_a, dev_b) = (tcp_device(), tcp_device());
        let ctx = random16();
        let mut a = dev_a.endpoint(spec(ctx, 0)).expect("rank 0");
        let mut b = dev_b.endpoint(spec(ctx, 1)).expect("rank 1");
        let (listener, at) = Listener::tcp();
        let real = dev_a.local_addr().expect("a TCP device listens");
        let dial = move || dial_tcp(real);
        let attack = Attack {
            listener,
            fake: at.to_string().into_bytes(),
            dial: &dial,
            b_private: vec![],
            a_private: vec![],
            relay,
        };
        super::attack(&mut *a, &mut *b, &attack)
    }

    fn on_shm(relay: bool) -> Vec<String> {
        let dev = ShmDevice::new(ShmOptions {
            ring_bytes: 64 << 10,
            coll_bytes: 64 << 10,
            handshake_timeout: Duration::from_secs(3),
            ..ShmOptions::default()
        });
        let ctx = random16();
        let mut a = dev.endpoint(spec(ctx, 0)).expect("rank 0");
        let mut b = dev.endpoint(spec(ctx, 1)).expect("rank 1");
        let (listener, name) = Listener::unix();
        let real = a.address();
        let dial = move || dial_unix(&real);
        let attack = Attack { listener, fake: name, dial: &dial, b_private: vec![], a_private: vec![], relay };
        super::attack(&mut *a, &mut *b, &attack)
    }

    #[test]
    fn a_replayed_tcp_opening_gets_no_link() {
        let wrong = on_tcp(false);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn a_fake_tcp_acceptor_gets_no_link() {
        let wrong = on_tcp(true);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn a_replayed_shared_memory_opening_gets_no_link_and_no_memory() {
        let wrong = on_shm(false);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn a_fake_shared_memory_acceptor_gets_no_link_and_no_memory() {
        let wrong = on_shm(true);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }
}
