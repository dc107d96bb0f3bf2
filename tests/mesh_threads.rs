//! Full mesh, point-to-point and barrier with ranks as threads.

mod common;

use common::{TIMEOUT, all_ok, pattern, run_ranks, run_ranks_with};
use ferrogloo::device::{Device, TcpAttr};
use ferrogloo::rendezvous::{HashStore, PrefixStore};
use ferrogloo::{Context, Error};
use std::time::{Duration, Instant};

/// Message length from `from` to `to`: covers 0, 1, odd and multi-segment sizes.
fn len_for(from: usize, to: usize) -> usize {
    match (from + 2 * to) % 5 {
        0 => 0,
        1 => 1,
        2 => 7 + from,
        3 => 1000 + 13 * to,
        _ => 40_000 + from * 17, // above the direct-read threshold
    }
}

#[test]
fn every_pair_exchanges_distinct_payloads_sizes_1_to_9() {
    for n in 1..=9 {
        let store = HashStore::new();
        let results = run_ranks(n, &store, |ctx| {
            let me = ctx.rank();
            let peers: Vec<usize> = (0..ctx.size()).filter(|&p| p != me).collect();
            let outs: Vec<Vec<u32>> = peers.iter().map(|&p| pattern(me, p, len_for(me, p))).collect();
            let mut ins: Vec<Vec<u32>> = peers.iter().map(|&p| vec![0u32; len_for(p, me)]).collect();
            // Every send and receive in flight at once.
            ctx.scope(|s| {
                let sends = peers.iter().zip(&outs).map(|(&p, o)| s.isend(p, 9, o)).collect::<Result<Vec<_>, _>>()?;
                let recvs =
                    peers.iter().zip(ins.iter_mut()).map(|(&p, i)| s.irecv(p, 9, i)).collect::<Result<Vec<_>, _>>()?;
                for r in recvs {
                    r.wait()?;
                }
                for snd in sends {
                    snd.wait()?;
                }
                Ok(())
            })?;
            ctx.barrier()?;
            for (&p, got) in peers.iter().zip(&ins) {
                assert_eq!(got, &pattern(p, me, len_for(p, me)), "rank {me} from {p} (n={n})");
            }
            Ok(ctx.size())
        });
        assert_eq!(all_ok(results), vec![n; n]);
    }
}

#[test]
fn ring_token_and_repeated_barriers() {
    let store = HashStore::new();
    let n = 5;
    let results = run_ranks(n, &store, |ctx| {
        let (r, n) = (ctx.rank(), ctx.size());
        let mut token = [0u64; 3];
        for lap in 0..20u64 {
            if r == 0 {
                token = [lap, 0, 0];
                ctx.send(1, 1, &token)?;
                ctx.recv(n - 1, 1, &mut token)?;
                assert_eq!(token, [lap, (1..n as u64).sum(), n as u64 - 1]);
            } else {
                ctx.recv(r - 1, 1, &mut token)?;
                token[1] += r as u64;
                token[2] += 1;
                ctx.send((r + 1) % n, 1, &token)?;
            }
            ctx.barrier()?;
        }
        Ok(token[0])
    });
    assert!(all_ok(results).iter().all(|&lap| lap == 19));
}

#[test]
fn ranks_sharing_one_device_form_a_mesh() {
    let store = HashStore::new();
    let dev = Device::loopback().unwrap();
    let n = 4;
    let sums: Vec<u64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (store, dev) = (&store, &dev);
                s.spawn(move || -> ferrogloo::Result<u64> {
                    let ctx = Context::builder(rank, n).timeout(TIMEOUT).connect(store, dev)?;
                    let mut total = rank as u64;
                    for p in (0..n).filter(|&p| p != rank) {
                        ctx.send(p, 0, &[rank as u64])?;
                    }
                    for p in (0..n).filter(|&p| p != rank) {
                        let mut v = [0u64];
                        ctx.recv(p, 0, &mut v)?;
                        total += v[0];
                    }
                    Ok(total)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    assert_eq!(sums, vec![6; n]);
}

#[test]
fn tags_keep_messages_apart_and_same_tag_keeps_order() {
    let store = HashStore::new();
    let results = run_ranks(2, &store, |ctx| {
        if ctx.rank() == 0 {
            ctx.send(1, 1, &[1u8; 100])?;
            ctx.send(1, 2, &[2u8; 50])?;
            for i in 0..10u16 {
                ctx.send(1, 3, &[i; 8])?;
            }
        } else {
            let mut b = [0u8; 50];
            ctx.recv(0, 2, &mut b)?; // the later message first
            assert_eq!(b, [2u8; 50]);
            let mut a = [0u8; 100];
            ctx.recv(0, 1, &mut a)?;
            assert_eq!(a, [1u8; 100]);
            for i in 0..10u16 {
                let mut c = [0u16; 8];
                ctx.recv(0, 3, &mut c)?;
                assert_eq!(c, [i; 8], "same-tag messages arrive in order");
            }
        }
        Ok(())
    });
    all_ok(results);
}

/// The lower rank of a pair sends large messages (256 KiB and up) on the pair's second
/// connection and switches back for small ones: messages of one tag still arrive in the order
/// sent, whether their receives are posted first or long after (early and held messages), and
/// in both directions at once.
#[test]
fn small_and_large_messages_keep_their_order_across_both_connections() {
    // (tag, length in u32) in send order; lengths from 0 up to 400 KB, alternating.
    let plan: Vec<(u32, usize)> = [(1, 3), (1, 100_000), (1, 1), (2, 65_536), (1, 0), (2, 16_384), (1, 16_385), (2, 5)]
        .into_iter()
        .cycle()
        .take(40)
        .collect();
    let message = |from: usize, i: usize, len: usize| -> Vec<u32> {
        (0..len as u32).map(|j| ((from * 1000 + i) as u32) ^ j.wrapping_mul(2654435761)).collect()
    };
    for late in [false, true] {
        let store = HashStore::new();
        let results = run_ranks(2, &store, |ctx| {
            let (me, peer) = (ctx.rank(), 1 - ctx.rank());
            let outs: Vec<Vec<u32>> = plan.iter().enumerate().map(|(i, &(_, len))| message(me, i, len)).collect();
            let mut ins: Vec<Vec<u32>> = plan.iter().map(|&(_, len)| vec![0; len]).collect();
            // Receives posted before the sends (`first`), or only once every send has finished
            // (`after`: into the socket, the early budget or a hold).
            let (first, after) = ins.split_at_mut(if late { 0 } else { plan.len() });
            ctx.scope(|s| {
                let recvs = plan
                    .iter()
                    .zip(first.iter_mut())
                    .map(|(&(tag, _), b)| s.irecv(peer, tag, b))
                    .collect::<Result<Vec<_>, _>>()?;
                let sends = plan
                    .iter()
                    .zip(&outs)
                    .map(|(&(tag, _), o)| s.isend(peer, tag, o))
                    .collect::<Result<Vec<_>, _>>()?;
                for r in sends {
                    r.wait()?;
                }
                for r in recvs {
                    r.wait()?;
                }
                for (&(tag, _), b) in plan.iter().zip(after.iter_mut()) {
                    s.irecv(peer, tag, b)?.wait()?;
                }
                Ok(())
            })?;
            for (i, (got, &(tag, len))) in ins.iter().zip(&plan).enumerate() {
                assert!(
                    *got == message(peer, i, len),
                    "rank {me}: message {i} (tag {tag}, {len} u32) wrong or out of order (late: {late})"
                );
            }
            Ok(())
        });
        all_ok(results);
    }
}

/// A pair reads the bytes after a frame header straight into the oldest posted receive when
/// that is large, before it knows whose they are. Here the oldest receive (tag 1) is not the
/// one the first message is for (tag 2): its bytes must still reach tag 2 whole, and tag 1's
/// buffer must end up with tag 1's message. Lengths straddle the direct-read threshold (16 KiB)
/// and the 64 KiB staging buffer, and include bulk-connection sizes.
#[test]
fn bytes_read_ahead_into_the_wrong_receive_reach_the_right_one() {
    let store = HashStore::new();
    let lens = [16_384usize, 16_385, 65_512, 65_536, 65_537, 100_003, 300_000];
    let bytes = |from: usize, tag: usize, len: usize| -> Vec<u8> {
        pattern(from, tag, len.div_ceil(4)).iter().flat_map(|w| w.to_le_bytes()).take(len).collect()
    };
    let results = run_ranks(2, &store, |ctx| {
        for &len in &lens {
            if ctx.rank() == 0 {
                ctx.barrier()?; // both receives are posted
                ctx.send(1, 2, &bytes(0, 2, len))?;
                ctx.send(1, 1, &bytes(0, 1, len + 8))?;
            } else {
                let mut one = vec![0u8; len + 8];
                let mut two = vec![0u8; len];
                ctx.scope(|s| {
                    let first = s.irecv(0, 1, &mut one)?;
                    let second = s.irecv(0, 2, &mut two)?;
                    ctx.barrier()?;
                    second.wait()?;
                    first.wait().map(drop)
                })?;
                assert!(two == bytes(0, 2, len), "tag 2 message of {len} bytes damaged");
                assert!(one == bytes(0, 1, len + 8), "tag 1 message of {} bytes damaged", len + 8);
            }
        }
        Ok(())
    });
    all_ok(results);
}

/// Two senders race for one large receive from either at a time, and every message arrives
/// whole. (Such a receive is never read into ahead of its claim, since two threads may drive its
/// two pairs at once; with one thread driving both, as here, the claim alone already keeps the
/// second pair out.)
#[test]
fn large_receives_from_any_rank_get_whole_messages() {
    let store = HashStore::new();
    let len = 70_000;
    let results = run_ranks(3, &store, |ctx| {
        let me = ctx.rank();
        for round in 0..20 {
            if me == 0 {
                let mut seen = Vec::new();
                for _ in 0..2 {
                    let mut buf = vec![0u32; len];
                    let from = ctx.recv_any(&[1, 2], 9, &mut buf)?;
                    assert!(buf == pattern(from, round, len), "round {round}: message from {from} damaged");
                    seen.push(from);
                }
                seen.sort();
                assert_eq!(seen, [1, 2]);
            } else {
                ctx.send(0, 9, &pattern(me, round, len))?;
            }
            ctx.barrier()?; // a sender's next round waits for this one
        }
        Ok(())
    });
    all_ok(results);
}

#[test]
fn large_payload_beyond_the_early_budget_lands_when_posted() {
    // A 1 KiB early budget: every large message must wait for its receive (back-pressure),
    // and messages behind it still arrive once it is taken.
    let store = HashStore::new();
    let attr = TcpAttr { early_budget: 1024, ..TcpAttr::loopback() };
    let big = 48 << 20; // 48 MiB
    let results = run_ranks_with(
        2,
        &store,
        &attr,
        |b| b,
        |ctx| {
            if ctx.rank() == 0 {
                let data: Vec<u64> = (0..big as u64 / 8).collect();
                ctx.send(1, 1, &data)?;
                ctx.send(1, 2, &[42u32; 3])?;
                ctx.send(1, 3, &data[..1000])?;
            } else {
                let mut small = [0u32; 3];
                let mut data = vec![0u64; big / 8];
                ctx.scope(|s| {
                    let second = s.irecv(0, 2, &mut small)?;
                    let first = s.irecv(0, 1, &mut data)?;
                    assert_eq!(second.wait()?, &[42; 3]);
                    first.wait()?;
                    Ok(())
                })?;
                assert!(data.iter().enumerate().all(|(i, &v)| v == i as u64));
                let mut tail = vec![0u64; 1000];
                ctx.recv(0, 3, &mut tail)?;
                assert!(tail.iter().enumerate().all(|(i, &v)| v == i as u64));
            }
            Ok(())
        },
    );
    all_ok(results);
}

#[test]
fn both_ranks_sending_before_receiving_get_on_past_the_hold() {
    // A large message whose receive is not posted is left in the socket for a while (so that a
    // receive posted soon after takes it without an extra copy). Here each rank's blocking send
    // of 2 MiB cannot finish through 64 KiB socket buffers unless the other side reads it
    // before its own receive is posted: the hold must end by itself, and the messages land in
    // the early budget. Then the same with the receive of a later message posted first: that
    // receive must not wait for the hold.
    let store = HashStore::new();
    let attr = TcpAttr { send_buffer: Some(64 << 10), recv_buffer: Some(64 << 10), ..TcpAttr::loopback() };
    let len = 2 << 20;
    let started = Instant::now();
    let results = run_ranks_with(
        2,
        &store,
        &attr,
        |b| b,
        |ctx| {
            let (me, peer) = (ctx.rank(), 1 - ctx.rank());
            for round in 0..3 {
                ctx.send(peer, 1, &pattern(me, round, len / 4))?;
                let mut got = vec![0u32; len / 4];
                ctx.recv(peer, 1, &mut got)?;
                assert!(got == pattern(peer, round, len / 4), "round {round}: corrupted");
            }
            let (big, small, mut tail) = (pattern(me, 9, len / 4), [me as u32; 4], [0u32; 4]);
            ctx.scope(|s| {
                let sent = s.isend(peer, 5, &big)?;
                let sent_small = s.isend(peer, 6, &small)?;
                let got_small = s.irecv(peer, 6, &mut tail)?;
                assert_eq!(got_small.wait()?, &[peer as u32; 4]);
                sent.wait()?;
                sent_small.wait()?;
                Ok(())
            })?;
            let mut got = vec![0u32; len / 4];
            ctx.recv(peer, 5, &mut got)?;
            assert!(got == pattern(peer, 9, len / 4), "the message behind a held one: corrupted");
            Ok(())
        },
    );
    all_ok(results);
    // Each hold lasts a few milliseconds; a hold that never ended would run into TIMEOUT.
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

#[test]
fn a_message_nobody_waits_for_is_still_read_within_the_early_budget() {
    // Rank 0 sends rank 1 a 4 MiB message that small socket buffers cannot hold, so its send
    // finishes only if rank 1's side reads it into the early budget. Rank 1 meanwhile waits on
    // rank 2, who answers only after that send finished: rank 1's wait never drives the pair to
    // rank 0 (no receive is posted there), and that pair is parked by the waits that used it
    // before. The event loop must take it back and read.
    let store = HashStore::new();
    let attr = TcpAttr { send_buffer: Some(64 << 10), recv_buffer: Some(64 << 10), ..TcpAttr::loopback() };
    let len = 4 << 20;
    let results = run_ranks_with(
        3,
        &store,
        &attr,
        |b| b,
        |ctx| {
            // Round trips make rank 1 wait on the pair to rank 0, which parks it. (A reply that
            // is already in when the wait starts skips driving; twenty in a row do not.)
            let mut token = [0u32];
            for _ in 0..20 {
                match ctx.rank() {
                    0 => {
                        ctx.recv(1, 9, &mut token)?;
                        ctx.send(1, 9, &token)?;
                    }
                    1 => {
                        ctx.send(0, 9, &token)?;
                        ctx.recv(0, 9, &mut token)?;
                    }
                    _ => {}
                }
            }
            match ctx.rank() {
                0 => {
                    ctx.send(1, 1, &pattern(0, 1, len / 4))?;
                    ctx.send(2, 2, &[1u8])?;
                }
                1 => {
                    let mut go = [0u8];
                    ctx.recv(2, 3, &mut go)?;
                    let mut got = vec![0u32; len / 4];
                    ctx.recv(0, 1, &mut got)?;
                    assert!(got == pattern(0, 1, len / 4), "the early message arrived corrupted");
                }
                _ => {
                    let mut go = [0u8];
                    ctx.recv(0, 2, &mut go)?;
                    ctx.send(1, 3, &go)?;
                }
            }
            ctx.barrier()
        },
    );
    all_ok(results);
}

#[test]
fn recv_any_reports_the_sender() {
    let store = HashStore::new();
    let n = 6;
    let results = run_ranks(n, &store, |ctx| {
        let me = ctx.rank();
        if me == 0 {
            let peers: Vec<usize> = (1..ctx.size()).collect();
            let mut seen = Vec::new();
            for _ in &peers {
                let mut buf = [0u32; 5];
                let from = ctx.recv_any(&peers, 4, &mut buf)?;
                assert_eq!(buf.to_vec(), pattern(from, 0, 5));
                seen.push(from);
            }
            seen.sort();
            assert_eq!(seen, peers);
        } else {
            ctx.send(0, 4, &pattern(me, 0, 5))?;
        }
        ctx.barrier()
    });
    all_ok(results);
}

#[test]
fn a_length_mismatch_is_an_error_and_the_pair_stays_usable() {
    let store = HashStore::new();
    let results = run_ranks(2, &store, |ctx| {
        if ctx.rank() == 0 {
            ctx.send(1, 1, &[7u8; 10])?;
            ctx.send(1, 1, &[8u8; 12])?;
        } else {
            let mut b = [0u8; 12];
            match ctx.recv(0, 1, &mut b) {
                Err(Error::Mismatch { rank: 0, detail }) => assert!(detail.contains("10 bytes"), "{detail}"),
                other => panic!("expected a mismatch naming rank 0, got {other:?}"),
            }
            ctx.recv(0, 1, &mut b)?;
            assert_eq!(b, [8u8; 12]);
        }
        Ok(())
    });
    all_ok(results);
}

#[test]
fn a_receive_nobody_answers_times_out_naming_the_peer() {
    let store = HashStore::new();
    let results = run_ranks(3, &store, |ctx| {
        if ctx.rank() == 0 {
            let mut b = [0u8; 4];
            let t = Instant::now();
            let err =
                ctx.scope(|s| s.irecv(2, 77, &mut b)?.wait_timeout(Duration::from_millis(300)).map(drop)).unwrap_err();
            let el = t.elapsed();
            assert!(el >= Duration::from_millis(300) && el < Duration::from_secs(5), "{el:?}");
            match err {
                Error::Timeout { ranks, .. } => assert_eq!(ranks, vec![2]),
                e => panic!("expected Timeout, got {e}"),
            }
        }
        ctx.barrier()
    });
    all_ok(results);
}

#[test]
fn requests_left_unwaited_are_finished_by_the_scope() {
    let store = HashStore::new();
    let results = run_ranks(2, &store, |ctx| {
        let peer = 1 - ctx.rank();
        let out = pattern(ctx.rank(), peer, 3000);
        let mut inbox = vec![0u32; 3000];
        ctx.scope(|s| {
            let _ = s.isend(peer, 5, &out)?; // never waited here
            let _ = s.irecv(peer, 5, &mut inbox)?;
            Ok(())
        })?;
        assert_eq!(inbox, pattern(peer, ctx.rank(), 3000));
        Ok(())
    });
    all_ok(results);
}

#[test]
fn several_contexts_on_shared_devices_never_mix() {
    let store = HashStore::new();
    let n = 3;
    let devs: Vec<Device> = (0..n).map(|_| Device::loopback().unwrap()).collect();
    std::thread::scope(|s| {
        let mut hs = Vec::new();
        for job in 0..3u32 {
            for (rank, dev) in devs.iter().enumerate() {
                let store = &store;
                hs.push(s.spawn(move || -> ferrogloo::Result<()> {
                    let scoped = PrefixStore::new(format!("job{job}"), store);
                    let ctx = Context::builder(rank, n).timeout(TIMEOUT).connect(&scoped, dev)?;
                    for round in 0..10u32 {
                        let msg = [job, rank as u32, round];
                        for p in (0..n).filter(|&p| p != rank) {
                            ctx.send(p, 0, &msg)?;
                        }
                        for p in (0..n).filter(|&p| p != rank) {
                            let mut got = [0u32; 3];
                            ctx.recv(p, 0, &mut got)?;
                            assert_eq!(got, [job, p as u32, round]);
                        }
                    }
                    ctx.barrier()
                }));
            }
        }
        for h in hs {
            h.join().unwrap().unwrap();
        }
    });
}

#[test]
fn shared_secret_authenticates_and_a_mismatch_is_refused() {
    let store = HashStore::new();
    let ok = run_ranks_with(3, &store, &TcpAttr::loopback(), |b| b.secret("s3cret"), |ctx| ctx.barrier());
    all_ok(ok);

    // Rank 1 has the wrong secret: it cannot join, and nobody hangs past the deadline.
    let t = Instant::now();
    let store2 = HashStore::new();
    let results: Vec<ferrogloo::Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let store = &store2;
                s.spawn(move || {
                    let dev = Device::loopback()?;
                    let b = Context::builder(rank, 2).timeout(Duration::from_secs(2));
                    let b = if rank == 0 { b.secret("s3cret") } else { b.secret("wrong") };
                    b.connect(store, &dev).map(drop)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().all(|r| r.as_ref().is_err_and(|e| e.is_timeout())), "{results:?}");
    let msg = results[1].as_ref().unwrap_err().to_string();
    assert!(msg.contains("shared secret"), "rank 1 should say why rank 0 refused it: {msg}");
    assert!(t.elapsed() < Duration::from_secs(15));
}

#[test]
fn bad_arguments_are_clear_errors() {
    let store = HashStore::new();
    let dev = Device::loopback().unwrap();
    for (rank, size) in [(3, 3), (0, 0), (7, 2)] {
        let e = Context::builder(rank, size).connect(&store, &dev).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    let ctx = Context::builder(0, 1).connect(&store, &dev).unwrap();
    ctx.barrier().unwrap();
    // To itself is fine (a loopback pair); out of range is not.
    ctx.send(0, 0, &[1u8]).unwrap();
    let mut back = [0u8];
    ctx.recv(0, 0, &mut back).unwrap();
    assert_eq!(back, [1]);
    assert!(matches!(ctx.send(5, 0, &[1u8]), Err(Error::InvalidArgument(_))));
    assert!(matches!(ctx.recv_any::<u8>(&[], 0, &mut []), Err(Error::InvalidArgument(_))));
}

#[test]
fn ipv6_loopback_works_when_available() {
    let attr = TcpAttr::ip(std::net::Ipv6Addr::LOCALHOST.into());
    if Device::tcp(&attr).is_err() {
        eprintln!("SKIPPED: no IPv6 loopback on this machine");
        return;
    }
    let store = HashStore::new();
    let results = run_ranks_with(
        3,
        &store,
        &attr,
        |b| b,
        |ctx| {
            assert!(ctx.device().local_addr().expect("a TCP device").is_ipv6());
            ctx.barrier()
        },
    );
    all_ok(results);
}

#[test]
fn threads_sharing_a_context_and_a_pair_with_distinct_tags() {
    // Several threads of each rank use the same connection at once: one of them drives the
    // pair, the others are completed through it. Messages must neither mix nor stall.
    let store = HashStore::new();
    let threads = 4u32;
    let results = run_ranks(2, &store, |ctx| {
        let peer = 1 - ctx.rank();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let ctx = &ctx;
                    s.spawn(move || -> ferrogloo::Result<()> {
                        for round in 0..200u32 {
                            // Alternate sizes so some sends queue behind a full socket buffer.
                            let len = if round % 10 == 0 { 300_000 } else { 3 };
                            let out = vec![t * 1_000_000 + round; len];
                            let mut got = vec![0u32; len];
                            if ctx.rank() == 0 {
                                ctx.send(peer, t, &out)?;
                                ctx.recv(peer, t, &mut got)?;
                            } else {
                                ctx.recv(peer, t, &mut got)?;
                                ctx.send(peer, t, &out)?;
                            }
                            assert!(got.iter().all(|&v| v == t * 1_000_000 + round), "thread {t} round {round}");
                        }
                        Ok(())
                    })
                })
                .collect();
            hs.into_iter().try_for_each(|h| h.join().expect("thread panicked"))
        })?;
        ctx.barrier()
    });
    all_ok(results);
}

#[test]
fn busy_polling_can_be_forced_on_and_off() {
    for spin in [Duration::ZERO, Duration::from_micros(50)] {
        let store = HashStore::new();
        let results = run_ranks_with(
            3,
            &store,
            &TcpAttr::loopback(),
            |b| b.busy_poll(spin),
            |ctx| {
                for _ in 0..50 {
                    ctx.barrier()?;
                }
                Ok(())
            },
        );
        all_ok(results);
    }
}

#[test]
fn a_receive_from_any_in_a_sub_group_reports_the_sender_by_its_rank_in_the_sub_group() {
    // The sub-group of ranks 3, 2 and 1 (in that order): its ranks 0, 1 and 2 are the job's
    // ranks 3, 2 and 1, so a sender's rank in the sub-group differs from its rank in the job.
    let store = HashStore::new();
    let results = run_ranks(4, &store, |ctx| {
        if ctx.rank() == 0 {
            return Ok(());
        }
        let sub = ctx.subgroup(&[3, 2, 1])?;
        let me = sub.rank();
        if me == 0 {
            let mut seen = Vec::new();
            for _ in 0..2 {
                let mut buf = [0u32; 5];
                let from = sub.recv_any(&[1, 2], 6, &mut buf)?;
                assert_eq!(buf.to_vec(), pattern(from, 0, 5), "the message of sub-group rank {from}");
                seen.push(from);
            }
            seen.sort();
            assert_eq!(seen, vec![1, 2]);
            let (from, bytes) = sub.scope(|s| s.irecv_bytes(&[2], 7, 64)?.wait())?;
            assert_eq!((from, bytes), (2, b"two".to_vec()));
        } else {
            sub.send(0, 6, &pattern(me, 0, 5))?;
            if me == 2 {
                sub.send(0, 7, b"two")?;
            }
        }
        sub.barrier()
    });
    all_ok(results);
}
