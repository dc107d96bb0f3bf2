//! The simulated provider's checks, the registration cache, and faults in the middle of
//! transfers (which need the simulated fabric's fault injection, so they live inside the
//! crate; the transport contract suite and the collectives run on the simulated provider in
//! `tests/`).

use super::IbOptions;
use super::reg::RegCache;
use super::sim::{self, Fault};
use super::verbs::{Access, QpAddr, SendOp, Sge, VerbsDevice, Wc, WcKind, WcStatus};
use crate::rendezvous::HashStore;
use crate::{Context, Device, Error, Reduction};

use std::time::{Duration, Instant};

/// Polls `cq` until `n` completions or a second passed.
fn completions(cq: &dyn super::verbs::CompletionQueue, n: usize) -> Vec<Wc> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n && start.elapsed() < Duration::from_secs(1) {
        cq.poll(&mut out, 16).unwrap();
    }
    out
}

fn addr(dev: &dyn VerbsDevice, qpn: u32) -> QpAddr {
    let p = dev.port();
    QpAddr { lid: p.lid, gid: p.gid, qpn, psn: 0, mtu: p.mtu }
}

#[test]
fn the_simulated_fabric_checks_keys_bounds_and_states() {
    let (a, b) = (sim::open(), sim::open());
    let (cqa, cqb) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let (qa, qb) = (a.create_qp(&cqa, 8, 8).unwrap(), b.create_qp(&cqb, 8, 8).unwrap());
    qa.connect(0, &addr(&*b, qb.qpn())).unwrap();
    qb.connect(0, &addr(&*a, qa.qpn())).unwrap();
    let mut src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    // SAFETY: both buffers outlive their regions (dropped at the end of the test, after them).
    // `ma`: a read's destination; `mb`: a ring the peer writes; `mr`: the same memory, which
    // the peer may read.
    let (ma, mb, mr) = unsafe {
        (
            a.register(src.as_mut_ptr(), 4096, Access::LocalWrite).unwrap(),
            b.register(dst.as_mut_ptr(), 4096, Access::RemoteWrite).unwrap(),
            b.register(dst.as_mut_ptr(), 4096, Access::RemoteRead).unwrap(),
        )
    };
    let sge = |len: u32| Sge { addr: ma.addr(), len, lkey: ma.lkey() };

    // A write with immediate waits for a receive request, then lands and completes on both.
    qa.post_send(1, sge(100), SendOp::WriteImm { remote_addr: mb.addr() + 10, rkey: mb.rkey(), imm: 42 }).unwrap();
    assert_eq!(completions(&*cqa, 1)[0].status, WcStatus::Success);
    assert!(completions(&*cqb, 1).is_empty(), "no receive request posted yet");
    qb.post_recv(9).unwrap();
    let wc = &completions(&*cqb, 1)[0];
    assert_eq!((wc.wr_id, wc.kind, wc.imm, wc.byte_len), (9, WcKind::RecvImm, 42, 100));
    assert!(dst[10..110].iter().all(|&x| x == 7) && dst[9] == 0 && dst[110] == 0);

    // A read of the peer's memory.
    dst[0] = 99;
    qa.post_send(2, sge(1), SendOp::Read { remote_addr: mr.addr(), rkey: mr.rkey() }).unwrap();
    assert_eq!(completions(&*cqa, 1)[0].status, WcStatus::Success);
    assert_eq!(src[0], 99);

    // Beyond the peer's region: a remote access error, and both queue pairs in error.
    qa.post_send(3, sge(100), SendOp::Read { remote_addr: mr.addr() + 4000, rkey: mr.rkey() }).unwrap();
    assert_eq!(completions(&*cqa, 1)[0].status, WcStatus::RemoteAccess);
    qa.post_send(4, sge(1), SendOp::Read { remote_addr: mb.addr(), rkey: mb.rkey() }).unwrap();
    assert_eq!(completions(&*cqa, 1)[0].status, WcStatus::Flushed);
    qb.post_recv(10).unwrap();
    let wc = &completions(&*cqb, 1)[0];
    assert_eq!((wc.wr_id, &wc.status), (10, &WcStatus::Flushed), "the responder is in error too");

    // Fresh pairs: a region grants only its access (a ring the peer writes cannot be read);
    // a deregistered region grants nothing; a destroyed peer does not answer.
    let (qa, qb) = (a.create_qp(&cqa, 8, 8).unwrap(), b.create_qp(&cqb, 8, 8).unwrap());
    qa.connect(0, &addr(&*b, qb.qpn())).unwrap();
    qb.connect(0, &addr(&*a, qa.qpn())).unwrap();
    qa.post_send(5, sge(1), SendOp::Read { remote_addr: mb.addr(), rkey: mb.rkey() }).unwrap();
    assert_eq!(completions(&*cqa, 1)[0].status, WcStatus::RemoteAccess);
    let (qa, qb) = (a.create_qp(&cqa, 8, 8).unwrap(), b.create_qp(&cqb, 8, 8).unwrap());
    qa.connect(0, &addr(&*b, qb.qpn())).unwrap();
    qb.connect(0, &addr(&*a, qa.qpn())).unwrap();
    let rkey = mr.rkey();
    drop(mr);
    qa.post_send(5, sge(1), SendOp::Read { remote_addr: dst.as_ptr() as u64, rkey }).unwrap();
    assert_eq!(completions(&*cqa, 1)[0].status, WcStatus::RemoteAccess);
    drop(mb);
    let (qa, qb) = (a.create_qp(&cqa, 8, 8).unwrap(), b.create_qp(&cqb, 8, 8).unwrap());
    qa.connect(0, &addr(&*b, qb.qpn())).unwrap();
    qb.connect(0, &addr(&*a, qa.qpn())).unwrap();
    drop(qb);
    qa.post_send(6, sge(0), SendOp::WriteImm { remote_addr: 0, rkey: 0, imm: 1 }).unwrap();
    assert_eq!(completions(&*cqa, 1)[0].status, WcStatus::RetryExceeded);
    // Posting before connecting is refused outright.
    let q = a.create_qp(&cqa, 8, 8).unwrap();
    assert!(q.post_send(7, sge(1), SendOp::Read { remote_addr: 0, rkey: 0 }).is_err());
    drop(ma);
}

#[test]
fn the_registration_cache_reuses_covering_registrations_and_stays_bounded() {
    let dev = sim::open();
    let cache = RegCache::new(dev);
    assert!(cache.enabled(), "the simulated provider's registrations follow the page tables");
    let mut bufs: Vec<Vec<u8>> = (0..70).map(|_| vec![0u8; 3 << 12]).collect();
    // SAFETY: the buffers outlive the cache's use of them in this test (no requests).
    unsafe {
        let a = cache.get(bufs[0].as_mut_ptr(), 1000, Access::RemoteRead).unwrap();
        let b = cache.get(bufs[0].as_mut_ptr().add(100), 500, Access::RemoteRead).unwrap();
        assert_eq!(a.rkey(), b.rkey(), "a range inside a cached registration reuses it");
        let c = cache.get(bufs[0].as_mut_ptr().add(100), 500, Access::LocalWrite).unwrap();
        assert_ne!(a.rkey(), c.rkey(), "another access is another registration");
        for b in &mut bufs {
            cache.get(b.as_mut_ptr(), b.len(), Access::RemoteRead).unwrap();
        }
    }
    assert_eq!(cache.cached(), 64, "at most 64 registrations are kept");
    cache.clear();
    assert_eq!(cache.cached(), 0);
}

/// Simulated devices, handshakes on loopback.
fn simulated() -> IbOptions {
    IbOptions {
        device: Some("sim".into()),
        port: 1,
        gid_index: None,
        ip: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        early_budget: 8 << 20,
    }
}

fn sim_device(opts: &IbOptions) -> Device {
    Device::from_backend(super::open(opts).unwrap())
}

/// Runs two ranks on simulated devices; `fault` is injected into rank 1's device (given its
/// number) once both are connected. Returns each rank's result of `f`, and how long it took.
fn two_ranks_with_fault(
    fault: impl Fn(u32) -> Fault + Sync,
    f: impl Fn(&Context) -> crate::Result<()> + Sync,
) -> Vec<(crate::Result<()>, Duration)> {
    let store = HashStore::new();
    let attr = simulated();
    let connected = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (store, attr, f, fault, connected) = (&store, &attr, &f, &fault, &connected);
                s.spawn(move || {
                    let verbs = sim::open();
                    let id = sim::device_id(&*verbs).unwrap();
                    let dev = Device::from_backend(super::open_on(verbs, attr).unwrap());
                    let ctx = Context::builder(rank, 2).timeout(Duration::from_secs(10)).connect(store, &dev).unwrap();
                    ctx.barrier().unwrap();
                    connected.wait();
                    if rank == 1 {
                        sim::inject(fault(id));
                    }
                    connected.wait();
                    let t = Instant::now();
                    let r = f(&ctx);
                    (r, t.elapsed())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank 1 streams messages, eager and rendezvous, to rank 0.
fn stream(ctx: &Context) -> crate::Result<()> {
    let big = vec![3u32; 100_000];
    let small = [5u32; 16];
    for i in 0..40 {
        if ctx.rank() == 1 {
            ctx.send(0, 1, if i % 2 == 0 { &small[..] } else { &big[..] })?;
        } else {
            let mut got = vec![0u32; if i % 2 == 0 { small.len() } else { big.len() }];
            ctx.recv(1, 1, &mut got)?;
        }
    }
    ctx.allreduce(&mut [1u32; 8], Reduction::Sum)
}

#[test]
fn a_queue_pair_that_goes_to_error_mid_transfer_fails_both_ranks_in_words() {
    let results = two_ranks_with_fault(|dev| Fault::QpError { dev, after: 7 }, stream);
    for (rank, (r, took)) in results.iter().enumerate() {
        let e = r.as_ref().expect_err("the transfer cannot succeed");
        let text = e.to_string();
        assert!(*took < Duration::from_secs(3), "rank {rank} noticed only after {took:?}: {text}");
        // Whichever rank's request failed first says so, and tells the other.
        assert!(text.contains("retry count exceeded"), "rank {rank}: {text}");
        assert!(text.contains("RDMA write on the RDMA connection to rank"), "rank {rank}: {e:?}");
        assert!(matches!(e, Error::Io { .. } | Error::Aborted { .. }), "rank {rank}: {e:?}");
    }
}

#[test]
fn a_remote_access_error_is_reported_in_words_on_both_ranks() {
    let results = two_ranks_with_fault(|dev| Fault::BadRkey { dev, count: 1 }, stream);
    for (rank, (r, took)) in results.iter().enumerate() {
        let text = r.as_ref().expect_err("the transfer cannot succeed").to_string();
        assert!(*took < Duration::from_secs(3), "rank {rank} noticed only after {took:?}: {text}");
        assert!(text.contains("remote access error"), "rank {rank}: {text}");
    }
}

#[test]
fn large_payloads_are_read_in_parts_into_posted_and_early_receives() {
    let store = HashStore::new();
    let attr = simulated();
    let data: Vec<u8> = (0..(5 << 20) + 3).map(|i: usize| (i * 7 + i / 65536) as u8).collect();
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (store, attr, data) = (&store, &attr, &data);
            s.spawn(move || {
                let dev = sim_device(attr);
                let ctx = Context::builder(rank, 2).timeout(Duration::from_secs(10)).connect(store, &dev).unwrap();
                if rank == 1 {
                    ctx.send(0, 3, data).unwrap(); // into an early buffer (budget 8 MiB)
                    ctx.barrier().unwrap();
                    ctx.send(0, 4, data).unwrap(); // into the posted receive
                } else {
                    ctx.barrier().unwrap();
                    assert!(ctx.recv_bytes(1, 3, 8 << 20).unwrap() == *data, "the early payload");
                    let mut got = vec![0u8; data.len()];
                    ctx.recv(1, 4, &mut got).unwrap();
                    assert!(got == *data, "the posted payload");
                }
            });
        }
    });
}

#[test]
fn a_dropped_context_s_pending_sends_still_arrive() {
    // Rank 1 sends and drops its context at once; the bytes were only at the peer once the
    // write completed, which closing waits for.
    let store = HashStore::new();
    let attr = simulated();
    std::thread::scope(|s| {
        for rank in 0..2 {
            let (store, attr) = (&store, &attr);
            s.spawn(move || {
                let dev = sim_device(attr);
                let ctx = Context::builder(rank, 2).timeout(Duration::from_secs(10)).connect(store, &dev).unwrap();
                if rank == 1 {
                    for i in 0..30u32 {
                        ctx.send(0, 2, &[i; 1000]).unwrap();
                    }
                } else {
                    for i in 0..30u32 {
                        let mut got = [0u32; 1000];
                        ctx.recv(1, 2, &mut got).unwrap();
                        assert_eq!(got, [i; 1000]);
                    }
                }
            });
        }
    });
}

#[test]
fn a_large_message_read_early_is_not_overtaken_by_a_later_one_of_its_key() {
    // Rank 1 sends a large message (read into rank 0's early buffer) and at once a small one
    // with the same tag; rank 0 receives both only afterwards, and must get them in order.
    for _ in 0..20 {
        let store = HashStore::new();
        let attr = simulated();
        std::thread::scope(|s| {
            for rank in 0..2 {
                let (store, attr) = (&store, &attr);
                s.spawn(move || {
                    let dev = sim_device(attr);
                    let ctx = Context::builder(rank, 2).timeout(Duration::from_secs(10)).connect(store, &dev).unwrap();
                    let (big, small) = (vec![1u8; 100_000], [2u8; 16]);
                    if rank == 1 {
                        ctx.scope(|sc| {
                            let a = sc.isend(0, 7, &big)?;
                            let b = sc.isend(0, 7, &small)?;
                            a.wait()?;
                            b.wait()
                        })
                        .unwrap();
                        ctx.barrier().unwrap();
                    } else {
                        ctx.barrier().unwrap(); // both are in (the large one read early)
                        let mut g = vec![0u8; big.len()];
                        ctx.recv(1, 7, &mut g).unwrap();
                        assert!(g == big, "the first message of the tag");
                        let mut t = [0u8; 16];
                        ctx.recv(1, 7, &mut t).unwrap();
                        assert_eq!(t, small);
                    }
                });
            }
        });
    }
}

#[test]
fn a_pair_that_fails_with_read_parts_still_queued_ends_the_receive_at_once() {
    // 5 MiB in 64 KiB parts (this build's read size) is 80 read requests, more than the send
    // queue takes: when the reader's queue pair fails, the queued parts must settle the read.
    for after in 0..3u32 {
        let results = two_ranks_with_fault(
            |dev| Fault::QpError { dev, after },
            |ctx| {
                let data = vec![7u8; 5 << 20];
                if ctx.rank() == 0 {
                    ctx.send(1, 9, &data)
                } else {
                    let mut got = vec![0u8; data.len()];
                    ctx.recv(0, 9, &mut got)
                }
            },
        );
        for (rank, (r, took)) in results.iter().enumerate() {
            let e = r.as_ref().expect_err("the transfer cannot succeed");
            assert!(*took < Duration::from_secs(3), "fault after {after}: rank {rank} ended after {took:?}: {e}");
        }
    }
}
