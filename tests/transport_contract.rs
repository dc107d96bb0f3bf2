//! The transport contract (`src/transport/mod.rs`): one suite, run over every backend. Adding a
//! backend is adding a line to the `backends!` list at the bottom.
//!
//! Ranks are threads here (each with a device of its own unless a test shares one), so faults
//! are a rank dropping its context or aborting; killed processes are in `processes.rs`.

mod common;

use common::{TIMEOUT, all_ok, pattern, run_ranks_on};
use ferrogloo::device::Device;
use ferrogloo::rendezvous::{HashStore, PrefixStore};
use ferrogloo::{CollectiveOptions, Context, Error, Reduction};
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// How a rank of the suite makes its device.
type MakeDevice = fn() -> ferrogloo::Result<Device>;

/// Runs `f` on `n` ranks that are threads, each with its own device; every rank must succeed.
fn run<T: Send>(dev: MakeDevice, n: usize, f: impl Fn(Context) -> ferrogloo::Result<T> + Sync) -> Vec<T> {
    let store = HashStore::new();
    all_ok(run_ranks_on(n, &store, &dev, |b| b, f))
}

/// Bytes that differ per (seed, index).
fn bytes(seed: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(7919) ^ (i >> 9)) as u8).collect()
}

/// Rule 2: one key's messages arrive in send order; keys are independent.
fn ordering(dev: MakeDevice) {
    run(dev, 2, |ctx| {
        if ctx.rank() == 0 {
            for i in 0..40u32 {
                ctx.send(1, 1 + i % 2, &[i; 3])?;
            }
        } else {
            // Every message of tag 2 first, then those of tag 1: each in its send order.
            for (tag, first) in [(2, 1), (1, 0)] {
                for want in (first..40).step_by(2) {
                    let mut got = [0u32; 3];
                    ctx.recv(0, tag, &mut got)?;
                    assert_eq!(got, [want; 3], "tag {tag}");
                }
            }
        }
        ctx.barrier()
    });
}

/// Receive from any: each message goes to one receive, which names its sender; small and
/// large messages alike.
fn recv_any(dev: MakeDevice) {
    let n = 4;
    run(dev, n, |ctx| {
        for len in [2, 40_000] {
            if ctx.rank() == 0 {
                let mut seen = Vec::new();
                for _ in 1..n {
                    let mut buf = vec![0u32; len];
                    let from = ctx.recv_any(&[1, 2, 3], 5, &mut buf)?;
                    assert_eq!(buf, pattern(from, 0, len), "the message of rank {from}");
                    seen.push(from);
                }
                seen.sort_unstable();
                assert_eq!(seen, [1, 2, 3]);
            } else {
                ctx.send(0, 5, &pattern(ctx.rank(), 0, len))?;
            }
            ctx.barrier()?;
        }
        Ok(())
    });
}

/// Receives whose length the sender decides: owned buffers (posted before and after the
/// message arrives), receives up to a capacity, and a message over the limit, which is a
/// mismatch in words after which the pair still works.
fn unknown_length(dev: MakeDevice) {
    let sizes = [0usize, 1, 1000, 20_000, 3 << 20];
    run(dev, 2, |ctx| {
        if ctx.rank() == 1 {
            ctx.barrier()?; // rank 0's receives are posted
            for (i, &len) in sizes.iter().enumerate() {
                ctx.send(0, 9, &bytes(i, len))?;
            }
            for (i, &len) in sizes.iter().enumerate() {
                ctx.send(0, 9, &bytes(i + 10, len))?;
            }
            ctx.barrier()?; // those arrived before rank 0's receives
            ctx.send(0, 10, &[7u32; 5])?;
            ctx.send(0, 11, &vec![1u8; 2000])?;
            ctx.send(0, 12, &[3u8; 3])?;
            return Ok(());
        }
        ctx.scope(|s| {
            let posted = (0..sizes.len()).map(|_| s.irecv_bytes(&[1], 9, 4 << 20)).collect::<Result<Vec<_>, _>>()?;
            ctx.barrier()?;
            for (i, req) in posted.into_iter().enumerate() {
                let (from, got) = req.wait()?;
                assert_eq!((from, got.len()), (1, sizes[i]));
                assert!(got == bytes(i, sizes[i]), "posted receive {i}");
            }
            Ok(())
        })?;
        ctx.barrier()?;
        for (i, &len) in sizes.iter().enumerate() {
            assert!(ctx.recv_bytes(1, 9, 4 << 20)? == bytes(i + 10, len), "early message {i}");
        }
        let mut room = [0u32; 8];
        assert_eq!(ctx.recv_upto(1, 10, &mut room)?, 5);
        assert_eq!(room, [7, 7, 7, 7, 7, 0, 0, 0]);
        match ctx.recv_bytes(1, 11, 1000) {
            Err(Error::Mismatch { rank: 1, detail }) => {
                assert!(detail.contains("2000 bytes") && detail.contains("at most 1000"), "{detail}")
            }
            other => panic!("a message over the limit: expected a mismatch, got {other:?}"),
        }
        let mut last = [0u8; 3];
        ctx.recv(1, 12, &mut last)?;
        assert_eq!(last, [3; 3], "the pair works on after a mismatch");
        Ok(())
    });
}

/// Zero-length messages, into every kind of receive.
fn zero_length(dev: MakeDevice) {
    run(dev, 2, |ctx| {
        if ctx.rank() == 0 {
            for tag in 0..3 {
                ctx.send::<u64>(1, tag, &[])?;
            }
        } else {
            ctx.recv::<u64>(0, 0, &mut [])?;
            assert_eq!(ctx.recv_upto(0, 1, &mut [0u64; 4])?, 0);
            assert!(ctx.recv_bytes(0, 2, 0)?.is_empty());
        }
        ctx.barrier()
    });
}

/// A message far beyond the early budget sent before its receive is posted waits for it and
/// lands whole; so does one whose receive is waiting.
fn large(dev: MakeDevice) {
    const LEN: usize = 48 << 20;
    let sending = Barrier::new(2);
    run(dev, 2, |ctx| {
        if ctx.rank() == 1 {
            let data = bytes(1, LEN);
            ctx.scope(|s| {
                let sent = s.isend(0, 1, &data)?;
                sending.wait();
                sent.wait()
            })?;
            ctx.send(0, 2, &data)?;
        } else {
            sending.wait(); // the send is under way, stalled by the budget
            let mut got = vec![0u8; LEN];
            ctx.recv(1, 1, &mut got)?;
            assert!(got == bytes(1, LEN), "the late-posted receive got other bytes");
            got.fill(0);
            ctx.recv(1, 2, &mut got)?;
            assert!(got == bytes(1, LEN), "the posted receive got other bytes");
        }
        ctx.barrier()
    });
}

/// A rank's messages to itself follow the same rules: order, any length, receive from any.
fn to_itself(dev: MakeDevice) {
    run(dev, 2, |ctx| {
        let me = ctx.rank();
        ctx.send(me, 1, &[1u16, 2])?;
        ctx.send(me, 1, &[3u16])?;
        let mut a = [0u16; 2];
        ctx.recv(me, 1, &mut a)?;
        assert_eq!(a, [1, 2]);
        assert_eq!(ctx.recv_bytes(me, 1, 64)?, 3u16.to_ne_bytes());
        let (mut got, out) = ([0u64; 1], [me as u64]);
        ctx.scope(|s| {
            let r = s.irecv_any(&[0, 1], 2, &mut got)?;
            s.isend(me, 2, &out)?.wait()?;
            let (from, v) = r.wait_from()?;
            assert_eq!((from, v[0]), (me, me as u64));
            Ok(())
        })?;
        // A receive of the wrong length from itself is a mismatch too.
        ctx.send(me, 3, &[0u8; 5])?;
        assert!(matches!(ctx.recv(me, 3, &mut [0u8; 4]), Err(Error::Mismatch { .. })));
        ctx.barrier()
    });
}

/// Rule 10: a receive nobody answers ends at its deadline naming the peer, is withdrawn, and
/// the pair works on.
fn deadline(dev: MakeDevice) {
    run(dev, 2, |ctx| {
        let mut got = [0u8; 4];
        if ctx.rank() == 0 {
            let t = Instant::now();
            let waited = ctx.scope(|s| s.irecv(1, 3, &mut got)?.wait_timeout(Duration::from_millis(100)).map(drop));
            let took = t.elapsed();
            match waited {
                Err(Error::Timeout { ranks, .. }) => assert_eq!(ranks, [1]),
                other => panic!("expected a timeout naming rank 1, got {other:?}"),
            }
            assert!(took >= Duration::from_millis(100) && took < Duration::from_millis(1600), "took {took:?}");
        }
        ctx.barrier()?;
        if ctx.rank() == 1 {
            ctx.send(0, 3, &[5u8; 4])?;
        } else {
            ctx.recv(1, 3, &mut got)?;
            assert_eq!(got, [5; 4], "the message went to the withdrawn receive");
        }
        ctx.barrier()
    });
}

/// Rule 6: a peer that goes away fails pending and later operations with it, naming it.
fn peer_gone(dev: MakeDevice) {
    run(dev, 2, |ctx| {
        if ctx.rank() == 1 {
            return Ok(()); // drops the context and the device
        }
        let t = Instant::now();
        match ctx.recv(1, 4, &mut [0u8; 8]) {
            Err(Error::PeerClosed { rank: 1, op, .. }) => assert_eq!(op, "recv"),
            other => panic!("expected rank 1 closed, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(3), "noticed only after {:?}", t.elapsed());
        match ctx.send(1, 4, &[1u8; 8]) {
            Err(Error::PeerClosed { rank: 1, .. }) => {}
            other => panic!("a send after the peer left: expected rank 1 closed, got {other:?}"),
        }
        Ok(())
    });
}

/// Rule 8: an abort reaches every peer, with the rank and the reason, even those waiting on
/// other ranks (the first cause travels on).
fn abort(dev: MakeDevice) {
    run(dev, 3, |ctx| {
        if ctx.rank() == 2 {
            ctx.abort("out of memory");
            assert!(ctx.is_aborted());
            return Ok(());
        }
        let t = Instant::now();
        match ctx.allreduce(&mut [1u32; 16], Reduction::Sum) {
            Err(Error::Aborted { rank: 2, reason }) => assert_eq!(reason, "out of memory"),
            other => panic!("rank {}: expected rank 2's abort, got {other:?}", ctx.rank()),
        }
        assert!(t.elapsed() < Duration::from_secs(3), "noticed only after {:?}", t.elapsed());
        assert!(matches!(ctx.barrier(), Err(Error::Aborted { rank: 2, .. })), "later calls fail with the cause too");
        Ok(())
    });
}

/// Several contexts on one device run at once, with the same tags, and never mix.
fn concurrent_contexts(dev: MakeDevice) {
    let n = 3;
    let store = HashStore::new();
    let device = dev().expect("device");
    let per_rank: Vec<ferrogloo::Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (store, device) = (&store, &device);
                s.spawn(move || -> ferrogloo::Result<()> {
                    let (a, b) = std::thread::scope(|t| {
                        let a = t.spawn(|| {
                            Context::builder(rank, n).timeout(TIMEOUT).connect(&PrefixStore::new("a", store), device)
                        });
                        let b = t.spawn(|| {
                            Context::builder(rank, n).timeout(TIMEOUT).connect(&PrefixStore::new("b", store), device)
                        });
                        (a.join().expect("context a"), b.join().expect("context b"))
                    });
                    let (a, b) = (a?, b?);
                    std::thread::scope(|t| {
                        let runs = [(&a, 1u64), (&b, 1000u64)].map(|(ctx, base)| {
                            t.spawn(move || -> ferrogloo::Result<()> {
                                for i in 0..30u64 {
                                    let mut v = [base + i + rank as u64; 5];
                                    ctx.allreduce(&mut v, Reduction::Sum)?;
                                    let want = n as u64 * (base + i) + (0..n as u64).sum::<u64>();
                                    assert_eq!(v, [want; 5], "base {base}, call {i}");
                                    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
                                    let (out, mut got) = ([base + rank as u64; 2], [0u64; 2]);
                                    ctx.scope(|s| {
                                        let sent = s.isend(right, 8, &out)?;
                                        let r = s.irecv(left, 8, &mut got)?;
                                        sent.wait()?;
                                        r.wait().map(drop)
                                    })?;
                                    assert_eq!(got, [base + left as u64; 2]);
                                }
                                Ok(())
                            })
                        });
                        runs.into_iter().try_for_each(|h| h.join().expect("a context's thread panicked"))
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank thread panicked")).collect()
    });
    all_ok(per_rank);
}

/// Collectives on every world size from 1 to 5 against a plain reference.
fn collectives(dev: MakeDevice) {
    let o = CollectiveOptions::default();
    for n in 1..=5 {
        run(dev, n, |ctx| {
            let r = ctx.rank();
            // allreduce of small integers in f32 (exact in any order), past the ring threshold
            for len in [0, 7, 300_000] {
                let mut v: Vec<f32> = (0..len).map(|i| ((i * 7 + r * 3) % 100) as f32).collect();
                ctx.allreduce(&mut v, Reduction::Sum)?;
                let ok = v
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == (0..n).map(|p| ((i * 7 + p * 3) % 100) as f32).sum::<f32>());
                assert!(ok, "allreduce of {len} on {n} ranks");
            }
            // allgatherv with a different count per rank
            let counts: Vec<usize> = (0..n).map(|p| p * 3 + 1).collect();
            let mine = pattern(r, 0, counts[r]);
            let mut all = vec![0u32; counts.iter().sum()];
            ctx.allgatherv(&mine, &mut all, &counts, &o)?;
            let want: Vec<u32> = (0..n).flat_map(|p| pattern(p, 0, counts[p])).collect();
            assert_eq!(all, want, "allgatherv on {n} ranks");
            // broadcast from the last rank
            let mut b = if r == n - 1 { pattern(9, 9, 1000) } else { vec![0; 1000] };
            ctx.broadcast(&mut b, n - 1, &o)?;
            assert_eq!(b, pattern(9, 9, 1000));
            // alltoall: block p of rank r's input is pattern(r, p)
            let input: Vec<u32> = (0..n).flat_map(|p| pattern(r, p, 4)).collect();
            let mut out = vec![0u32; 4 * n];
            ctx.alltoall(&input, &mut out, &o)?;
            assert_eq!(out, (0..n).flat_map(|p| pattern(p, r, 4)).collect::<Vec<_>>());
            Ok(())
        });
    }
}

/// Sub-groups (MPI_Comm_split semantics and explicit member lists) over the parent's pairs:
/// 6 ranks, groups that overlap, a group of one, a rank in no group, nesting, and a parent and
/// a child busy at once with the same tags.
fn subgroups(dev: MakeDevice) {
    run(dev, 6, |ctx| {
        let r = ctx.rank();
        let o = CollectiveOptions::default();
        // Odd and even ranks, each group ordered by descending rank.
        let half = ctx.split(Some(r as u32 % 2), 100 - r as u32)?.expect("every rank has a color");
        assert_eq!(half.size(), 3);
        assert_eq!(half.world_rank(0), Some(if r % 2 == 0 { 4 } else { 5 }));
        assert_eq!(half.world_rank(half.rank()), Some(r));
        // A group of one, and a rank in none.
        let alone = ctx.split(Some(10 + r as u32), 0)?.expect("a color");
        assert_eq!((alone.rank(), alone.size()), (0, 1));
        let mut x = [r as u64];
        alone.allreduce(&mut x, Reduction::Sum)?;
        assert_eq!(x, [r as u64]);
        let some = ctx.split(if r == 5 { None } else { Some(0) }, 0)?;
        assert_eq!(some.as_ref().map(Context::size), if r == 5 { None } else { Some(5) });
        // Parent and child at once, same tag, many calls each.
        std::thread::scope(|t| {
            let parent = t.spawn(|| -> ferrogloo::Result<()> {
                for i in 0..20u64 {
                    let mut v = [i + r as u64];
                    ctx.allreduce(&mut v, Reduction::Sum)?;
                    assert_eq!(v, [6 * i + 15]);
                }
                Ok(())
            });
            let child = t.spawn(|| -> ferrogloo::Result<()> {
                for i in 0..20u64 {
                    let mut v = [i + r as u64];
                    half.allreduce(&mut v, Reduction::Sum)?;
                    let members = (0..6u64).filter(|p| p % 2 == r as u64 % 2).sum::<u64>();
                    assert_eq!(v, [3 * i + members]);
                }
                Ok(())
            });
            parent.join().expect("parent thread")?;
            child.join().expect("child thread")
        })?;
        // Overlapping explicit groups: ranks 2 and 3 are in both, and run A then B while 4
        // and 5 start B at once (their messages to 2 and 3 arrive early, in B's group).
        let lists: [&[usize]; 2] = [&[0, 1, 2, 3], &[5, 4, 3, 2]];
        for (k, list) in lists.iter().enumerate() {
            if list.contains(&r) {
                let g = ctx.subgroup(list)?;
                assert_eq!(g.world_rank(g.rank()), Some(r));
                let mut all = vec![0u32; 2 * list.len()];
                g.allgather(&[r as u32, k as u32], &mut all, &o)?;
                let want: Vec<u32> = list.iter().flat_map(|&p| [p as u32, k as u32]).collect();
                assert_eq!(all, want, "group {list:?}");
            }
        }
        // Nesting: split the half again.
        let quarter = half.split(Some(u32::from(half.rank() == 0)), 0)?.expect("a color");
        let mut s = [1u32];
        quarter.allreduce(&mut s, Reduction::Sum)?;
        assert_eq!(s, [quarter.size() as u32]);
        assert_eq!(quarter.size(), if half.rank() == 0 { 1 } else { 2 });
        // Bad lists are clear errors.
        assert!(matches!(ctx.subgroup(&[0, 0]), Err(Error::InvalidArgument(_))));
        assert!(matches!(ctx.subgroup(&[9]), Err(Error::InvalidArgument(_))));
        if r != 1 {
            assert!(matches!(ctx.subgroup(&[1]), Err(Error::InvalidArgument(_))));
        }
        ctx.barrier()
    });
}

/// Aborting a sub-group fails that group's calls on its members and leaves the parent (and
/// the other group) working.
fn subgroup_abort(dev: MakeDevice) {
    run(dev, 4, |ctx| {
        let r = ctx.rank();
        let half = ctx.split(Some(u32::from(r >= 2)), 0)?.expect("a color");
        if r == 0 {
            half.abort("this half is done");
        } else if r == 1 {
            match half.allreduce(&mut [1u8], Reduction::Sum) {
                Err(Error::Aborted { rank: 0, reason }) => assert_eq!(reason, "this half is done"),
                other => panic!("expected rank 0's abort of the half, got {other:?}"),
            }
        } else {
            let mut v = [r as u32];
            half.allreduce(&mut v, Reduction::Sum)?;
            assert_eq!(v, [5]);
        }
        let mut v = [1u32];
        ctx.allreduce(&mut v, Reduction::Sum)?;
        assert_eq!(v, [4], "the parent works on");
        Ok(())
    });
}

/// An abort from another thread stops this rank's own calls blocked in the group at once,
/// and the peer's: in a sub-group (the parent goes on) and in the whole context.
fn local_abort(dev: MakeDevice) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let store = HashStore::new();
    // No busy-polling: a blocked call sleeps in the kernel at once, where only a wake-up reaches
    // it.
    let no_spin = |b: ferrogloo::ContextBuilder| b.busy_poll(Duration::ZERO);
    // Rank 1 sends nothing more until rank 0's blocked call has returned, so no message from
    // it can be what wakes that call. (A channel, not a barrier: if rank 0 fails, its end is
    // dropped and rank 1 goes on.)
    let (returned, quiet) = std::sync::mpsc::sync_channel::<()>(2);
    let quiet = std::sync::Mutex::new(quiet);
    all_ok(run_ranks_on(2, &store, &dev, no_spin, |ctx| {
        let half = ctx.split(Some(0), 0)?.expect("a color");
        for (what, target) in [("sub-group", &half), ("context", &ctx)] {
            let t = Instant::now();
            let got = if ctx.rank() == 0 {
                let started = AtomicBool::new(false);
                std::thread::scope(|s| {
                    let waiter = s.spawn(|| {
                        started.store(true, Ordering::SeqCst);
                        target.recv(1, 6, &mut [0u8; 64])
                    });
                    while !started.load(Ordering::SeqCst) {
                        std::thread::yield_now();
                    }
                    target.abort("stop");
                    waiter.join().expect("the waiting thread")
                })
            } else {
                // Waits for rank 0 (which never sends) until its abort arrives.
                target.recv(0, 6, &mut [0u8; 64])
            };
            match got {
                Err(Error::Aborted { rank: 0, reason }) => assert_eq!(reason, "stop", "{what}"),
                other => panic!("{what}, rank {}: expected rank 0's abort, got {other:?}", ctx.rank()),
            }
            assert!(t.elapsed() < Duration::from_secs(3), "{what}: stopped only after {:?}", t.elapsed());
            if ctx.rank() == 0 {
                let _ = returned.send(());
            } else {
                let quiet = quiet.lock().expect("one rank 1");
                let _ = quiet.recv_timeout(Duration::from_secs(30));
            }
            if what == "sub-group" {
                let mut v = [1u8];
                ctx.allreduce(&mut v, Reduction::Sum)?;
                assert_eq!(v, [2], "the parent works on after its sub-group's abort");
            }
        }
        Ok(())
    }));
}

/// Contract rule 3: a call that disagrees is a mismatch in words, on both sides.
fn mismatch_in_words(dev: MakeDevice) {
    let store = HashStore::new();
    let seen = run_ranks_on(
        2,
        &store,
        &dev,
        |b| b.timeout(Duration::from_secs(5)),
        |ctx| {
            let mut v = vec![1.0f32; 1000 + ctx.rank()];
            Ok(ctx.allreduce(&mut v, Reduction::Sum).expect_err("the lengths disagree").to_string())
        },
    );
    let seen: Vec<String> = all_ok(seen);
    // Whichever rank saw the other's message first says what each called (the other may
    // learn it from its abort).
    for s in &seen {
        assert!(
            s.contains("rank 1 called allreduce with 1001 f32 elements, rank 0 with 1000")
                || s.contains("rank 0 called allreduce with 1000 f32 elements, rank 1 with 1001"),
            "{s}"
        );
    }
}

/// Rule 9: a send cancelled after part of it went out never arrives cut or changed: the peer
/// receives it whole, with the bytes it had when it was posted (the sender reuses its buffer
/// at once), or not at all, and the pair goes on; or, where the peer reads the sender's memory
/// itself, the pair fails saying so.
fn cancel_midway(dev: MakeDevice) {
    let len = 24 << 20;
    let cancelled = std::sync::Barrier::new(2);
    run(dev, 2, |ctx| {
        let original = bytes(5, len);
        if ctx.rank() == 0 {
            let mut big = original.clone();
            let waited = ctx.scope(|s| Ok(s.isend(1, 5, &big)?.wait_timeout(Duration::from_millis(30))))?;
            assert!(waited.is_err(), "24 MiB went out with nobody receiving: the test needs a partial send");
            big.fill(0); // the sender's buffer is its own again
            cancelled.wait();
            if let Err(e) = ctx.send(1, 6, &[7u8]) {
                // The peer was reading this rank's memory: the pair failed, saying so.
                assert!(matches!(e, Error::Protocol { .. }), "{e}");
                return Ok(());
            }
            let mut back = [0u8; 1];
            if ctx.recv(1, 7, &mut back).is_ok() {
                assert_eq!(back, [9]);
            }
            return Ok(());
        }
        cancelled.wait();
        let mut got = vec![0u8; len];
        let mut token = [0u8; 1];
        let outcome = ctx.scope(|s| {
            let whole = s.irecv(0, 5, &mut got)?;
            let after = s.irecv(0, 6, &mut token)?;
            assert_eq!(after.wait()?, [7]);
            // The rest of the cancelled send came before the token, or nothing of it did.
            Ok(whole.wait_timeout(Duration::from_millis(200)).map(|b| b == original.as_slice()))
        });
        match outcome {
            Ok(Ok(intact)) => assert!(intact, "the cancelled message arrived changed"),
            Ok(Err(e)) => assert!(e.is_timeout(), "the cancelled message neither arrived nor was withdrawn: {e}"),
            Err(e) => {
                // The pair failed (the sender's side closed it): never a message cut or changed.
                assert!(matches!(e, Error::Protocol { .. } | Error::PeerClosed { rank: 0, .. }), "{e}");
                return Ok(());
            }
        }
        ctx.send(0, 7, &[9u8])
    });
}

macro_rules! backends {
    ($($(#[$attr:meta])* $backend:ident => $device:expr),* $(,)?) => {$(
        #[allow(unused_attributes)]
        mod $backend {
            const DEVICE: super::MakeDevice = $device;
            $(#[$attr])* #[test] fn ordering() { super::ordering(DEVICE) }
            $(#[$attr])* #[test] fn recv_any() { super::recv_any(DEVICE) }
            $(#[$attr])* #[test] fn unknown_length() { super::unknown_length(DEVICE) }
            $(#[$attr])* #[test] fn zero_length() { super::zero_length(DEVICE) }
            $(#[$attr])* #[test] fn to_itself() { super::to_itself(DEVICE) }
            $(#[$attr])* #[test] fn large() { super::large(DEVICE) }
            $(#[$attr])* #[test] fn deadline() { super::deadline(DEVICE) }
            $(#[$attr])* #[test] fn peer_gone() { super::peer_gone(DEVICE) }
            $(#[$attr])* #[test] fn abort() { super::abort(DEVICE) }
            $(#[$attr])* #[test] fn concurrent_contexts() { super::concurrent_contexts(DEVICE) }
            $(#[$attr])* #[test] fn collectives() { super::collectives(DEVICE) }
            $(#[$attr])* #[test] fn subgroups() { super::subgroups(DEVICE) }
            $(#[$attr])* #[test] fn subgroup_abort() { super::subgroup_abort(DEVICE) }
            $(#[$attr])* #[test] fn local_abort() { super::local_abort(DEVICE) }
            $(#[$attr])* #[test] fn mismatch_in_words() { super::mismatch_in_words(DEVICE) }
            $(#[$attr])* #[test] fn cancel_midway() { super::cancel_midway(DEVICE) }
        }
    )*};
}

backends! {
    memory => || Ok(ferrogloo::device::Device::in_process()),
    tcp => ferrogloo::device::Device::loopback,
    shm => || Ok(ferrogloo::device::Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
    shm_single_copy => || Ok(ferrogloo::device::Device::shared_memory(
        &ferrogloo::device::ShmAttr { single_copy: true, ..Default::default() },
    )),
    auto => || ferrogloo::device::Device::auto(&ferrogloo::device::TcpAttr::loopback()),
    mixed => super::mixed_hosts,
}

#[cfg(feature = "ibverbs")]
backends! {
    ibverbs_sim => || ferrogloo::device::Device::ibverbs(&ferrogloo::device::IbAttr::simulated()),
    ibverbs_mixed => super::ibverbs_mixed_hosts,
    #[ignore = "needs an RDMA device: FERROGLOO_TEST_IB_DEVICE=<device> ... -- --ignored"]
    ibverbs_real => super::real_ib_device,
}

/// Shared memory within each of two pretend hosts, simulated ibverbs across.
#[cfg(feature = "ibverbs")]
fn ibverbs_mixed_hosts() -> ferrogloo::Result<ferrogloo::device::Device> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let attr = ferrogloo::device::IbAttr::simulated();
    let shm = ferrogloo::device::Device::shared_memory(&ferrogloo::device::ShmAttr::default());
    let dev = ferrogloo::device::Device::combine(&shm, &ferrogloo::device::Device::ibverbs(&attr)?)?;
    Ok(dev.on_host(format!("pretend-ib-host-{}", n % 2)))
}

/// The RDMA device `FERROGLOO_TEST_IB_DEVICE` names (the real provider), handshakes on
/// loopback: for running the suite on a machine with RDMA hardware.
#[cfg(feature = "ibverbs")]
fn real_ib_device() -> ferrogloo::Result<ferrogloo::device::Device> {
    let name = std::env::var("FERROGLOO_TEST_IB_DEVICE").map_err(|_| {
        ferrogloo::Error::invalid("set FERROGLOO_TEST_IB_DEVICE to the RDMA device to run the suite on")
    })?;
    ferrogloo::device::Device::ibverbs(&ferrogloo::device::IbAttr {
        device: Some(name),
        tcp: ferrogloo::device::TcpAttr::loopback(),
        ..ferrogloo::device::IbAttr::default()
    })
}

/// Auto devices on two pretend hosts, in turn: a context of three or more ranks mixes shared
/// memory (between ranks of one pretend host) and TCP (across).
fn mixed_hosts() -> ferrogloo::Result<ferrogloo::device::Device> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    ferrogloo::device::Device::auto(&ferrogloo::device::TcpAttr::loopback())
        .map(|d| d.on_host(format!("pretend-host-{}", n % 2)))
}
