//! Strangers at the listener are refused while the mesh forms and while it runs point-to-point
//! traffic and collectives.

mod common;

use common::{TIMEOUT, WIRE_VERSION, all_ok, hello};
use ferrogloo::device::{Device, TcpAttr};
use ferrogloo::rendezvous::HashStore;
use ferrogloo::{Context, Reduction};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Reads until EOF or error; returns the bytes received and whether the peer closed in time.
fn drain(mut s: TcpStream, within: Duration) -> (Vec<u8>, bool) {
    s.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, true),
            Err(_) => return (got, false),
        }
    }
}

fn strangers(addr: SocketAddr) -> Vec<(&'static str, TcpStream)> {
    let mut out = Vec::new();
    let mut send = |name, bytes: &[u8]| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(bytes).unwrap();
        out.push((name, s));
    };
    let noise: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    send("random bytes", &noise);
    send("http request", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    send("wrong magic", &hello(b"GLOO", WIRE_VERSION, [1; 16], 1, 0, 2));
    send("wrong version", &hello(b"FGLO", 99, [1; 16], 1, 0, 2));
    send("wrong context id", &hello(b"FGLO", WIRE_VERSION, [0xEE; 16], 1, 0, 2));
    send("short handshake then silence", &hello(b"FGLO", WIRE_VERSION, [1; 16], 1, 0, 2)[..10]);
    out.push(("silent", TcpStream::connect(addr).unwrap()));
    out
}

#[test]
fn strangers_are_refused_and_the_mesh_still_forms() {
    let n = 4;
    let attr = TcpAttr { handshake_timeout: Duration::from_millis(1500), ..TcpAttr::loopback() };
    let devs: Vec<Device> = (0..n).map(|_| Device::tcp(&attr).unwrap()).collect();
    // Strangers arrive at every listener before and while the ranks meet.
    let early: Vec<_> = devs.iter().map(|d| strangers(d.local_addr().expect("a TCP device"))).collect();
    let store = HashStore::new();
    let t = Instant::now();
    let results: Vec<ferrogloo::Result<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (store, dev) = (&store, &devs[rank]);
                s.spawn(move || {
                    let ctx = Context::builder(rank, n).timeout(TIMEOUT).connect(store, dev)?;
                    // More strangers during traffic.
                    let late = strangers(dev.local_addr().expect("a TCP device"));
                    let mut sum = 0u64;
                    for round in 0..50u64 {
                        for p in (0..n).filter(|&p| p != rank) {
                            ctx.send(p, 1, &[round * 100 + rank as u64])?;
                        }
                        for p in (0..n).filter(|&p| p != rank) {
                            let mut v = [0u64];
                            ctx.recv(p, 1, &mut v)?;
                            assert_eq!(v[0], round * 100 + p as u64);
                            sum += v[0];
                        }
                        // And collectives while the strangers knock.
                        let mut r = vec![round + rank as u64; 3000];
                        ctx.allreduce(&mut r, Reduction::Sum)?;
                        let want = n as u64 * round + (n * (n - 1) / 2) as u64;
                        assert!(r.iter().all(|&x| x == want), "rank {rank}: allreduce wrong in round {round}");
                    }
                    ctx.barrier()?;
                    drop(late);
                    Ok(sum)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let sums = all_ok(results);
    assert_eq!(sums.len(), n);
    // The silent connections did not hold the mesh up until their handshake deadline.
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

    // Every stranger was closed by the device, the silent ones by the handshake deadline.
    for conns in early {
        for (name, s) in conns {
            let (reply, closed) = drain(s, Duration::from_secs(5));
            assert!(closed, "{name}: connection left open");
            if name == "wrong context id" {
                // A well-formed hello for an unknown context gets an explicit refusal: a
                // challenge (type 2) with status 1, unknown context.
                assert_eq!(reply.len(), 56, "{name}");
                assert_eq!(&reply[0..4], b"FGLO");
                assert_eq!((reply[6], reply[7]), (2, 1), "status: unknown context");
            } else {
                assert!(reply.is_empty(), "{name}: got {} bytes", reply.len());
            }
        }
    }
}

#[test]
fn many_silent_connections_do_not_block_the_listener() {
    let attr = TcpAttr { handshake_timeout: Duration::from_secs(30), max_pending: 64, ..TcpAttr::loopback() };
    let devs: Vec<Device> = (0..2).map(|_| Device::tcp(&attr).unwrap()).collect();
    // More silent connections than the handshake table holds, on both listeners.
    let _silent: Vec<TcpStream> = devs
        .iter()
        .flat_map(|d| (0..100).map(move |_| TcpStream::connect(d.local_addr().expect("a TCP device")).unwrap()))
        .collect();
    let store = HashStore::new();
    let t = Instant::now();
    let results: Vec<ferrogloo::Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (store, dev) = (&store, &devs[rank]);
                s.spawn(move || Context::builder(rank, 2).timeout(TIMEOUT).connect(store, dev)?.barrier())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    all_ok(results);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// What rank `rank` published as its endpoint's address: the sixth field of its store entry
/// (`ferrogloo-v2 <context> <size> <backend> <host> <address> [cost=<model>]`, percent-encoded).
fn published_address(store: &HashStore, rank: usize) -> Vec<u8> {
    use ferrogloo::rendezvous::Store;
    let entry = store.get(&format!("ferrogloo.rank.{rank}"), TIMEOUT).expect("rank 0 publishes its entry");
    let entry = String::from_utf8(entry).expect("an entry is text");
    let field = entry.split(' ').nth(5).expect("an address field");
    percent_encoding::percent_decode(field.as_bytes()).collect()
}

/// How long the real ranks of [`a_silent_stranger_does_not_hold_up_the_mesh`] may take to
/// form their mesh once the strangers are in the listener's queue.
const FORMS_WITHIN: Duration = Duration::from_secs(1);

/// Rank 0 of 3 publishes its entry; strangers connect to its address (`knock` opens them:
/// one that says nothing, one that stops halfway through a hello) before any real rank does;
/// then ranks 1 and 2 start. The mesh must form within [`FORMS_WITHIN`] of their start (the
/// acceptor handshakes each connection on its own, so the strangers wait for their deadline
/// alone), and an allreduce over it must be right.
fn a_silent_stranger_does_not_hold_up_the_mesh<C: Send>(devs: Vec<Device>, knock: impl Fn(&[u8]) -> Vec<C>) {
    let n = devs.len();
    let store = HashStore::new();
    // Short enough that an acceptor held up by the strangers fails the test quickly.
    let timeout = Duration::from_secs(5);
    let connect = |rank: usize| -> ferrogloo::Result<(Instant, Vec<u64>)> {
        let ctx = Context::builder(rank, n).timeout(timeout).connect(&store, &devs[rank])?;
        let formed = Instant::now();
        let mut v = vec![rank as u64 + 1; 1000];
        ctx.allreduce(&mut v, Reduction::Sum)?;
        Ok((formed, v))
    };
    let (start, results) = std::thread::scope(|s| {
        let rank0 = s.spawn(|| connect(0));
        let held = knock(&published_address(&store, 0));
        assert!(!held.is_empty());
        let start = Instant::now();
        let others: Vec<_> = (1..n).map(|rank| s.spawn(move || connect(rank))).collect();
        let results: Vec<_> = std::iter::once(rank0).chain(others).map(|h| h.join().unwrap()).collect();
        drop(held);
        (start, results)
    });
    let want = (n * (n + 1) / 2) as u64;
    for (rank, (formed, v)) in all_ok(results).into_iter().enumerate() {
        let took = formed.saturating_duration_since(start);
        assert!(took < FORMS_WITHIN, "rank {rank} formed its mesh {took:?} after the real peers started");
        assert!(v.iter().all(|&x| x == want), "rank {rank}: allreduce wrong");
    }
}

/// A hello of backend `kind` (2 shared memory, 3 ibverbs), cut in half.
fn half_hello(kind: u8) -> Vec<u8> {
    let mut h = hello(b"FGLO", WIRE_VERSION, [1; 16], 1, 0, 3);
    h[8] = kind;
    h.truncate(h.len() / 2);
    h
}

#[test]
fn a_silent_stranger_does_not_hold_up_a_shared_memory_mesh() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
    let devs = (0..3).map(|_| Device::shared_memory(&ferrogloo::device::ShmAttr::default())).collect();
    a_silent_stranger_does_not_hold_up_the_mesh(devs, |name| {
        let at = UnixAddr::from_abstract_name(name).expect("an abstract socket name");
        let silent = UnixStream::connect_addr(&at).expect("the stranger connects");
        let mut half = UnixStream::connect_addr(&at).expect("the stranger connects");
        half.write_all(&half_hello(2)).expect("half a hello");
        vec![silent, half]
    });
}

#[cfg(feature = "ibverbs")]
#[test]
fn a_silent_stranger_does_not_hold_up_an_ibverbs_mesh() {
    use ferrogloo::device::IbAttr;
    let devs = (0..3).map(|_| Device::ibverbs(&IbAttr::simulated()).expect("the simulated provider")).collect();
    a_silent_stranger_does_not_hold_up_the_mesh(devs, |blob| {
        // The address blob: magic, version, context id, rank, size (30 bytes), then the
        // lifeline listener's IPv6 (or mapped IPv4) address and port.
        let ip = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&blob[30..46]).expect("an address"));
        let port = u16::from_le_bytes([blob[46], blob[47]]);
        let at = SocketAddr::new(ip.to_ipv4_mapped().map_or(ip.into(), Into::into), port);
        let silent = TcpStream::connect(at).expect("the stranger connects");
        let mut half = TcpStream::connect(at).expect("the stranger connects");
        half.write_all(&half_hello(3)).expect("half a hello");
        vec![silent, half]
    });
}
