//! PyTorch's TCPStore, from both ends: [`TcpStore`] speaks its wire protocol to a server that
//! `torchrun`, `init_process_group` or [`TcpStoreServer`] runs, and [`TcpStoreServer`] serves
//! it to PyTorch's own clients.
//!
//! The protocol (torch 2.5 to 2.15, checked against 2.15's server and client): every request is
//! a one-byte opcode and its fields, integers little-endian, strings and values a `u64` length
//! and their bytes; replies come in request order, with no header. A client opens with
//! VALIDATE (opcode 0, `u32` magic `0x3C85F7CE`, no reply) and PING (13, a `u32` nonce the
//! server echoes). The C++ client puts `/` before every key. A key nobody has set is waited for
//! with WAIT (6), which the server answers once every key exists, or never; the client then
//! takes its wait back with CANCEL_WAIT (12, answered `1`).
//!
//! Unlike PyTorch's client, every read here has a deadline: a server that stops answering is an
//! error naming it, not a hang.
//!
//! [`wire`] holds the protocol's one [`Request`](wire::Request) and
//! [`Response`](wire::Response) type, with their encoders and decoders, which both ends use;
//! `client` holds [`TcpStore`] and `server` [`TcpStoreServer`]; this file, the tests that run
//! both ends together.

mod client;
mod server;
mod wire;

pub use client::TcpStore;
pub use server::TcpStoreServer;

#[cfg(test)]
mod tests {
    use super::wire::{MAGIC, PING, Request};
    use super::*;
    use crate::error::Error;
    use crate::rendezvous::Store;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Polls `done` until it holds, failing after 10 s.
    pub(super) fn eventually(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn our_client_and_server_speak_the_protocol() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let addr = server.local_addr().to_string();
        let a = TcpStore::connect(&addr, "", Duration::from_secs(5)).unwrap();
        let b = TcpStore::connect(&addr, "job", Duration::from_secs(5)).unwrap();
        a.set("k", b"v1").unwrap();
        assert_eq!(a.try_get("k").unwrap(), Some(b"v1".to_vec()));
        assert_eq!(b.try_get("k").unwrap(), None, "another prefix");
        assert_eq!(a.add("n", 5).unwrap(), 5);
        assert_eq!(a.add("n", -7).unwrap(), -2);
        assert_eq!(a.compare_set("c", b"", b"x").unwrap(), b"x");
        assert_eq!(a.compare_set("c", b"y", b"z").unwrap(), b"x");
        assert!(a.delete("k").unwrap() && !a.delete("k").unwrap());
        // A wait that times out is taken back, and the connection goes on.
        let t = Instant::now();
        let e = b.get("late", Duration::from_millis(300)).unwrap_err();
        assert!(e.is_timeout() && t.elapsed() < Duration::from_secs(3), "{e}");
        assert_eq!(server.pending_waiters(), 0, "the timed-out wait was taken back");
        let waiter = std::thread::spawn(move || b.get("late", Duration::from_secs(10)));
        // The set lands while the server holds the wait, so it is the set that wakes it.
        eventually("the server holds the wait", || server.pending_waiters() == 1);
        let c = TcpStore::connect(&addr, "job", Duration::from_secs(5)).unwrap();
        c.set("late", b"here").unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), b"here");
        assert_eq!(server.pending_waiters(), 0);
    }

    #[test]
    fn a_stranger_is_refused_and_a_silent_server_is_an_error_in_time() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.write_all(&[wire::SET, 1, 0, 0, 0, 0, 0, 0, 0, b'k']).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 1];
        assert!(matches!(s.read(&mut b), Ok(0) | Err(_)), "a request before validation closes the connection");
        // Something that accepts but never answers.
        let mute = TcpListener::bind("127.0.0.1:0").unwrap();
        let t = Instant::now();
        let e = TcpStore::connect(&mute.local_addr().unwrap().to_string(), "", Duration::from_millis(500)).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn a_wait_longer_than_the_store_timeout_fails_as_a_missing_key() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let store = TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(1)).unwrap();
        let t = Instant::now();
        let e = store.get("missing", Duration::from_millis(2500)).unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(2500) && t.elapsed() < Duration::from_secs(5), "{e}");
        match &e {
            Error::Timeout { keys, op, .. } => assert!(keys == &["missing"] && op.contains("store wait"), "{e}"),
            other => panic!("expected the get's timeout, got {other}"),
        }
        assert_eq!(server.pending_waiters(), 0, "the wait was taken back");
        store.set("missing", b"now").unwrap();
        assert_eq!(store.get("missing", Duration::from_secs(5)).unwrap(), b"now");
    }

    #[test]
    fn a_wait_does_not_hold_up_other_requests_of_the_same_client() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        let store = Arc::new(TcpStore::connect(&server.local_addr().to_string(), "", Duration::from_secs(5)).unwrap());
        let t = Instant::now();
        let waiter = {
            let store = store.clone();
            std::thread::spawn(move || store.get("k", Duration::from_secs(60)))
        };
        eventually("the server holds the wait", || server.pending_waiters() == 1);
        store.set("k", b"v").unwrap();
        assert_eq!(store.add("n", 2).unwrap(), 2);
        assert_eq!(waiter.join().unwrap().unwrap(), b"v");
        assert!(t.elapsed() < Duration::from_secs(10), "the set waited for the wait: {:?}", t.elapsed());
    }

    pub(super) fn encoded(req: &Request<&[u8]>) -> Vec<u8> {
        let mut b = Vec::new();
        req.encode(&mut b);
        b
    }

    /// A raw connection to `server` that has sent VALIDATE.
    pub(super) fn validated(server: &TcpStoreServer) -> TcpStream {
        let s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        (&s).write_all(&encoded(&Request::Validate { magic: MAGIC })).unwrap();
        s
    }

    /// Whether the server closes `s` (EOF or reset) within its read timeout, skipping replies.
    pub(super) fn closed_by_server(s: &TcpStream) -> bool {
        let mut b = [0u8; 4096];
        loop {
            match (&*s).read(&mut b) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => {
                    return matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
                    );
                }
            }
        }
    }

    /// Whether the server echoes a PING on `s` (its bytes written out, not encoded).
    pub(super) fn pings(s: &TcpStream) -> bool {
        let mut echo = [0u8; 4];
        (&*s).write_all(&[PING, 1, 2, 3, 4]).is_ok() && (&*s).read_exact(&mut echo).is_ok() && echo == [1, 2, 3, 4]
    }

    #[test]
    fn the_store_budget_refuses_growth_and_serves_the_others() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        server.set_max_total_bytes(1 << 20);
        let addr = server.local_addr().to_string();
        let (a, b) = (
            TcpStore::connect(&addr, "", Duration::from_secs(5)).unwrap(),
            TcpStore::connect(&addr, "", Duration::from_secs(5)).unwrap(),
        );
        let v = vec![0u8; 600 << 10];
        a.set("x", &v).unwrap();
        a.set("x", &v).unwrap();
        assert_eq!(a.try_get("x").unwrap().map(|v| v.len()), Some(v.len()), "replacing a value costs nothing more");
        // A second such value is over the budget: that connection is closed, nothing is stored.
        let s = validated(&server);
        (&s).write_all(&encoded(&Request::Set { key: b"/y", value: &v })).unwrap();
        assert!(closed_by_server(&s));
        assert_eq!(b.try_get("y").unwrap(), None);
        // Our client's set is an error, and the client goes on.
        let e = a.set("z", &v).unwrap_err();
        assert!(matches!(e, Error::Io { .. }) && e.to_string().contains("SET of key \"z\""), "{e}");
        assert_eq!(a.try_get("z").unwrap(), None);
        let s = validated(&server);
        (&s).write_all(&encoded(&Request::Append { key: b"/x", value: &v })).unwrap();
        assert!(closed_by_server(&s), "an APPEND over the budget");
        // The others are served, and a deleted value frees its bytes.
        b.set("small", b"1").unwrap();
        assert_eq!(b.try_get("small").unwrap(), Some(b"1".to_vec()));
        assert!(b.delete("x").unwrap());
        b.set("y", &v).unwrap();
        assert_eq!(a.try_get("y").unwrap().map(|v| v.len()), Some(v.len()));
    }

    #[test]
    fn silent_connections_are_closed_and_connections_are_bounded() {
        let server = TcpStoreServer::start("127.0.0.1:0").unwrap();
        server.set_handshake_timeout(Duration::from_millis(300));
        server.set_max_connections(2);
        let addr = server.local_addr().to_string();
        let silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(server.local_addr()).unwrap()).collect();
        eventually("both are served", || server.connections() == 2);
        let third = TcpStream::connect(server.local_addr()).unwrap();
        third.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(closed_by_server(&third), "a connection over the limit is closed at once");
        // A client gets in once the silent ones are closed, after the handshake time.
        let t = Instant::now();
        let store = TcpStore::connect(&addr, "", Duration::from_secs(5)).unwrap();
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        for s in &silent {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            assert!(closed_by_server(s));
        }
        // A validated connection may idle past the handshake time.
        let idle = validated(&server);
        std::thread::sleep(Duration::from_millis(600));
        assert!(pings(&idle));
        store.set("k", b"v").unwrap();
        assert_eq!(store.try_get("k").unwrap(), Some(b"v".to_vec()));
    }
}
