//! Faults with ranks as threads: a rank that never arrives, a peer that sends malformed frames
//! on an established connection, and load (many small collectives, many concurrent tags).
//! Process-level faults (a killed rank, recovery) are in `processes.rs`.

mod common;

use common::{TIMEOUT, WIRE_VERSION, all_ok, handshake_without_secret, hello_lane, run_ranks};
use ferrogloo::device::{Device, TcpAttr};
use ferrogloo::rendezvous::{HashStore, Store};
use ferrogloo::{CollectiveOptions, Context, Error, Reduction};
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Held by the tests that allocate a lot, so that the memory test's RSS samples (which are
/// process-wide) see only its own work.
static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Rendezvous deadline of the missing-rank tests.
const SHORT: Duration = Duration::from_secs(2);

/// Runs `ranks` (a subset of `0..size`) as threads; the others never arrive.
fn partial_job(size: usize, ranks: &[usize]) -> Vec<(usize, ferrogloo::Result<Context>, Duration)> {
    partial_job_on(size, ranks, &Device::loopback)
}

/// [`partial_job`] on devices from `device`.
fn partial_job_on(
    size: usize,
    ranks: &[usize],
    device: &(dyn Fn() -> ferrogloo::Result<Device> + Sync),
) -> Vec<(usize, ferrogloo::Result<Context>, Duration)> {
    let store = HashStore::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&rank| {
                let store = &store;
                s.spawn(move || {
                    let dev = device()?;
                    let t = Instant::now();
                    let r = Context::builder(rank, size).timeout(SHORT).connect(store, &dev);
                    Ok::<_, Error>((rank, r, t.elapsed()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked").expect("device")).collect()
    })
}

#[test]
fn a_rank_that_never_arrives_is_named_with_its_key() {
    // Rank 2 of 4 never comes: rank 3 cannot connect to it, ranks 0 and 1 wait for its connection.
    for (rank, result, took) in partial_job(4, &[0, 1, 3]) {
        match result {
            Err(Error::Timeout { ranks, keys, .. }) => {
                assert!(ranks.contains(&2), "rank {rank}: timeout names {ranks:?}, not rank 2");
                assert!(
                    keys.iter().any(|k| k == "ferrogloo.rank.2"),
                    "rank {rank}: timeout names keys {keys:?}, not ferrogloo.rank.2"
                );
            }
            other => panic!("rank {rank}: expected a timeout naming rank 2, got {other:?}"),
        }
        assert!(took < SHORT + Duration::from_secs(1), "rank {rank} took {took:?}");
    }
}

#[test]
fn a_shared_memory_rank_that_never_arrives_is_named_with_its_key() {
    // Shared-memory segments count in this process's resident memory, which the memory test
    // samples.
    let _serial = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    for (rank, result, took) in
        partial_job_on(4, &[0, 1, 3], &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())))
    {
        match result {
            Err(Error::Timeout { ranks, keys, .. }) => {
                assert!(ranks.contains(&2), "rank {rank}: timeout names {ranks:?}, not rank 2");
                assert!(keys.iter().any(|k| k == "ferrogloo.rank.2"), "rank {rank}: keys {keys:?}");
            }
            other => panic!("rank {rank}: expected a timeout naming rank 2, got {other:?}"),
        }
        assert!(took < SHORT + Duration::from_secs(1), "rank {rank} took {took:?}");
    }
}

#[test]
fn a_shared_memory_rank_that_stops_coming_to_collectives_is_named_at_the_deadline() {
    // Shared-memory segments count in this process's resident memory, which the memory test
    // samples.
    let _serial = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    // Rank 2 of 3 forms the context, then never calls the allreduce the others wait in (it
    // stays, quietly, until they are done).
    let store = HashStore::new();
    let (done, wait_done) = std::sync::mpsc::channel::<()>();
    let wait_done = std::sync::Mutex::new(wait_done);
    let results = common::run_ranks_on(
        3,
        &store,
        &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        |b| b.timeout(SHORT),
        |ctx| {
            if ctx.rank() == 2 {
                // Bounded: it leaves once the others have given up (their abort reaches it).
                let wait = wait_done.lock().expect("one rank 2");
                for _ in 0..2 {
                    let _ = wait.recv_timeout(SHORT * 5);
                }
                return Ok(None);
            }
            let t = Instant::now();
            let mut v = vec![1.0f32; 1000];
            let r = ctx.allreduce(&mut v, Reduction::Sum).err().map(|e| (t.elapsed(), e));
            let _ = done.send(());
            Ok(r)
        },
    );
    for (rank, r) in results.into_iter().enumerate().take(2) {
        match r {
            Ok(Some((took, Error::Timeout { ranks, op, .. }))) => {
                assert_eq!(ranks, vec![2], "rank {rank}: {op}");
                assert!(took >= SHORT && took < SHORT + Duration::from_secs(2), "rank {rank} took {took:?}");
            }
            Ok(Some((_, Error::PeerTimedOut { rank: 0 | 1, detail, .. }))) => {
                assert!(detail.contains("rank 2"), "rank {rank}: {detail}")
            }
            other => panic!("rank {rank}: expected a timeout naming rank 2, got {other:?}"),
        }
    }
}

#[test]
fn a_missing_rank_0_is_named_with_its_key() {
    for (rank, result, took) in partial_job(3, &[1, 2]) {
        let err = result.expect_err("a job without rank 0 cannot form");
        assert!(err.is_timeout(), "rank {rank}: expected a timeout, got {err}");
        assert!(err.to_string().contains("ferrogloo.rank.0"), "rank {rank}: {err} does not name rank 0's key");
        assert!(took < SHORT + Duration::from_secs(1), "rank {rank} took {took:?}");
    }
}

/// A fake rank 1 of a 2-rank job: it joins through the store and the handshake like a real
/// one (see src/transport/handshake/mod.rs and context.rs), then writes `frame`.
fn fake_peer_sends(frame: Vec<u8>) -> (Error, Duration) {
    let store = HashStore::new();
    std::thread::scope(|s| {
        let real = s.spawn(|| {
            let dev = Device::loopback().expect("device");
            let ctx = Context::builder(0, 2)
                .timeout(TIMEOUT)
                .cost_model(fixed_model())
                .connect(&store, &dev)
                .expect("rendezvous");
            let mut buf = [0u8; 16];
            let t = Instant::now();
            let err = ctx.recv(1, 5, &mut buf).expect_err("a malformed frame cannot be received");
            (err, t.elapsed())
        });
        let mut lanes = join_as_fake_rank_1(&store);
        lanes[0].write_all(&frame).expect("frame");
        let out = real.join().expect("rank 0 panicked");
        drop(lanes);
        out
    })
}

/// Joins a 2-rank job as rank 1 without a context: waits for rank 0's entry, opens both
/// connections of the pair with their handshakes, and publishes an entry. Returns the main
/// connection (which carries every frame of the higher rank) and the bulk one.
fn join_as_fake_rank_1(store: &HashStore) -> [TcpStream; 2] {
    // Rank 0's entry: "ferrogloo-v2 <context id hex> <size> <backend> <host> <address>
    // [cost=<model>]" (see src/mesh.rs; a loopback address needs no escaping).
    let raw = store.get("ferrogloo.rank.0", TIMEOUT).expect("rank 0's entry");
    let entry = String::from_utf8(raw).expect("utf-8 entry");
    let fields: Vec<&str> = entry.split(' ').collect();
    let mut ctx = [0u8; 16];
    for (i, b) in ctx.iter_mut().enumerate() {
        *b = u8::from_str_radix(&fields[1][2 * i..2 * i + 2], 16).expect("hex");
    }
    let lanes = [false, true].map(|bulk| {
        assert_eq!(fields[3], "tcp");
        let mut sock = TcpStream::connect(fields[5]).expect("connect to rank 0");
        let status = handshake_without_secret(&mut sock, &hello_lane(b"FGLO", WIRE_VERSION, ctx, 1, 0, 2, bulk));
        assert_eq!(status, 0, "rank 0 refused the fake rank's handshake");
        sock
    });
    // The same cost model as rank 0's (ranks given different ones fail formation).
    let cost = fields.get(6).map(|f| format!(" {f}")).unwrap_or_default();
    store
        .set("ferrogloo.rank.1", format!("ferrogloo-v2 {} 2 tcp fake 127.0.0.1:1{cost}", fields[1]).as_bytes())
        .expect("set");
    lanes
}

/// A peer that gives up sends an abort frame naming the cause, then closes. A send that then
/// finds the connection reset must report the abort's cause (here: rank 7 died, as rank 1
/// saw it), not the broken pipe. Here rank 0
/// drives its pair in a receive that times out, which leaves the pair parked (nobody reads it
/// for a few milliseconds); meanwhile the fake rank 1 writes an abort frame and resets the bulk
/// connection, so rank 0's next send, a large one for the bulk connection, is the first to
/// touch the pair. (Should rank 0 be descheduled past the park, the event loop reads the abort
/// frame first and the test passes without exercising the send path.)
#[test]
fn a_send_that_finds_the_peer_gone_reports_the_peers_abort() {
    let store = HashStore::new();
    // An abort cause (src/transport/mod.rs): peer closed (2), seen by rank 1 during an
    // allreduce, about rank 7.
    let mut cause = vec![2u8];
    cause.extend_from_slice(&1u32.to_le_bytes());
    cause.extend_from_slice(&7u32.to_le_bytes());
    cause.extend_from_slice(&9u16.to_le_bytes());
    cause.extend_from_slice(b"allreduce");
    cause.extend_from_slice(b"connection closed (EOF)");
    let (parked, fake_gone) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    let err = std::thread::scope(|s| {
        let real = s.spawn(|| {
            let dev = Device::loopback().expect("device");
            let ctx = Context::builder(0, 2)
                .timeout(TIMEOUT)
                .cost_model(fixed_model())
                .connect(&store, &dev)
                .expect("rendezvous");
            let mut inbox = [0u8; 16];
            let waited = ctx.scope(|s| s.irecv(1, 5, &mut inbox)?.wait_timeout(Duration::from_millis(20)).map(drop));
            assert!(matches!(waited, Err(Error::Timeout { .. })), "nothing was sent: {waited:?}");
            parked.wait();
            fake_gone.wait();
            // Over 256 KiB: the lower rank sends it on the bulk connection.
            ctx.send(1, 6, &vec![1u8; 1 << 20]).expect_err("the peer is gone")
        });
        let [mut main, bulk] = join_as_fake_rank_1(&store);
        parked.wait();
        let mut abort = header(ABORT, 0, 0, cause.len() as u64);
        abort.extend_from_slice(&cause);
        main.write_all(&abort).expect("abort frame");
        // Reset the bulk connection (RST, not FIN: a send to it fails at once).
        socket2::SockRef::from(&bulk).set_linger(Some(Duration::ZERO)).expect("SO_LINGER");
        drop(bulk);
        fake_gone.wait();
        let err = real.join().expect("rank 0 panicked");
        drop(main);
        err
    });
    match &err {
        Error::PeerClosed { rank: 7, op, detail } => {
            assert_eq!(op, "allreduce");
            assert!(detail.contains("reported by rank 1") && detail.contains("EOF"), "{detail}")
        }
        other => panic!("expected the abort's cause (rank 7 closed), got {other:?}"),
    }
}

/// Frame kinds (src/transport/tcp/frame.rs).
const DATA: u8 = 1;
const ABORT: u8 = 2;

/// A 56-byte frame header: kind, 7 reserved, group u64 (0), tag u64, len u64, and a 24-byte
/// call descriptor (little-endian): a point-to-point one for data frames (no root: u32::MAX
/// at offset 4), zeros for others.
fn header(kind: u8, reserved: u8, tag: u64, len: u64) -> Vec<u8> {
    let mut h = vec![kind, reserved, 0, 0, 0, 0, 0, 0];
    h.extend_from_slice(&0u64.to_le_bytes());
    h.extend_from_slice(&tag.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    let mut desc = [0u8; 24];
    if kind == DATA {
        desc[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    }
    h.extend_from_slice(&desc);
    h
}

#[test]
fn malformed_frames_on_an_established_pair_are_protocol_errors_naming_the_peer() {
    let p2p_tag = (1u64 << 62) | 5; // the wire tag of user tag 5
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("unknown frame kind", header(7, 0, p2p_tag, 16)),
        ("nonzero reserved byte", header(DATA, 1, p2p_tag, 16)),
        ("oversized abort frame", header(ABORT, 0, 0, u64::MAX)),
    ];
    for (what, frame) in cases {
        let (err, took) = fake_peer_sends(frame);
        match err {
            Error::Protocol { peer: Some(1), .. } => {}
            other => panic!("{what}: expected a protocol error naming rank 1, got {other:?}"),
        }
        assert!(took < Duration::from_secs(2), "{what}: took {took:?}");
    }
}

#[test]
fn a_frame_claiming_an_enormous_length_is_a_mismatch_without_allocating_it() {
    // A data frame claiming 2^63 bytes for a 16-byte receive: nothing may be allocated for it
    // (the process would abort), and the receive fails naming the peer.
    let (err, took) = fake_peer_sends(header(DATA, 0, (1u64 << 62) | 5, 1 << 63));
    match err {
        Error::Mismatch { rank: 1, detail } => assert!(detail.contains("bytes"), "{detail}"),
        other => panic!("expected a mismatch naming rank 1, got {other:?}"),
    }
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

/// A cost model given to a context whose peer is made by hand here and runs no collective (a
/// context measures its links in its first collective otherwise); the hand-made peer publishes
/// the same one.
fn fixed_model() -> ferrogloo::CostModel {
    ferrogloo::CostModel::new(Duration::from_micros(20), 1e9, 1e10).expect("a valid model")
}

/// Resident set size of this process, from /proc (bytes).
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[test]
fn ten_thousand_small_collectives_keep_memory_flat() {
    let _serial = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let n = 4;
    let store = HashStore::new();
    let rss_samples = std::sync::Mutex::new(Vec::new());
    let results = run_ranks(n, &store, |ctx| {
        let me = ctx.rank() as u64;
        let want: u64 = (0..n as u64).sum();
        for i in 0..10_000u64 {
            if i == 1_000 && me == 0 {
                rss_samples.lock().unwrap().push(rss());
            }
            let mut v = [me + i, 1];
            ctx.allreduce(&mut v, Reduction::Sum)?;
            assert_eq!(v, [want + n as u64 * i, n as u64], "rank {me}, call {i}");
        }
        if me == 0 {
            rss_samples.lock().unwrap().push(rss());
        }
        Ok(())
    });
    all_ok(results);
    let s = rss_samples.into_inner().unwrap();
    println!("RSS after 1,000 collectives: {} KiB, after 10,000: {} KiB", s[0] / 1024, s[1] / 1024);
    assert!(s[1] <= s[0] + (8 << 20), "memory grew from {} to {} bytes", s[0], s[1]);
}

#[test]
fn a_hundred_concurrent_tagged_collectives_on_one_context() {
    let _serial = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    let n = 3;
    let store = HashStore::new();
    let before = rss();
    let results = run_ranks(n, &store, |ctx| {
        let me = ctx.rank();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..100u32)
                .map(|tag| {
                    let ctx = &ctx;
                    s.spawn(move || {
                        let opts = CollectiveOptions { tag, ..Default::default() };
                        // Sizes differ per tag so that small and pipelined algorithms mix.
                        let len = 1 + (tag as usize * 997) % 5000;
                        let mut v: Vec<u32> = (0..len).map(|i| (i as u32) ^ tag ^ me as u32).collect();
                        ctx.allreduce_with(&mut v, Reduction::Max, &opts)?;
                        let want: Vec<u32> =
                            (0..len).map(|i| (0..n as u32).map(|r| (i as u32) ^ tag ^ r).max().unwrap_or(0)).collect();
                        assert!(v == want, "tag {tag}: wrong result on rank {me}");
                        let mut all = vec![0u32; n];
                        ctx.allgather(&[tag * 10 + me as u32], &mut all, &opts)?;
                        assert_eq!(all, (0..n as u32).map(|r| tag * 10 + r).collect::<Vec<_>>());
                        Ok::<_, Error>(())
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().expect("collective thread panicked"))
        })
    });
    all_ok(results);
    println!("RSS before: {} KiB, after 100 concurrent tags on 3 ranks: {} KiB", before / 1024, rss() / 1024);
}

#[test]
fn a_stranger_at_an_established_context_does_not_disturb_it() {
    // A device's listener stays open after the mesh forms; junk there must not reach pairs.
    let store = HashStore::new();
    let attr = TcpAttr::loopback();
    let results = common::run_ranks_with(
        3,
        &store,
        &attr,
        |b| b,
        |ctx| {
            if ctx.rank() == 0 {
                let raw = store.get("ferrogloo.rank.1", TIMEOUT)?;
                let entry = String::from_utf8_lossy(&raw).into_owned();
                if let Some(addr) = entry.split(' ').nth(3)
                    && let Ok(mut s) = TcpStream::connect(addr)
                {
                    let _ = s.write_all(&header(DATA, 0, (1u64 << 62) | 5, 16));
                    let _ = s.write_all(&[0xAB; 64]);
                }
            }
            let mut v = [ctx.rank() as u32 + 1; 1000];
            for _ in 0..20 {
                ctx.allreduce(&mut v, Reduction::Max)?;
            }
            assert!(v.iter().all(|&x| x == 3));
            Ok(())
        },
    );
    all_ok(results);
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    // SAFETY: getrusage writes a plain struct we own; an error leaves it zeroed.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let t = |v: libc::timeval| Duration::from_secs(v.tv_sec as u64) + Duration::from_micros(v.tv_usec as u64);
    t(ru.ru_utime) + t(ru.ru_stime)
}

#[test]
fn a_shared_memory_wait_after_one_peer_left_sleeps_and_sees_the_next_one_go() {
    // Shared-memory segments count in this process's resident memory, which the memory test
    // samples.
    let _serial = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    // Rank 2 leaves; then rank 0 waits for a message rank 1 never sends, and rank 1 leaves:
    // rank 0 learns it from rank 1's lifeline long before its deadline, without spinning
    // meanwhile (a closed pair once kept every wait from sleeping, and from polling lifelines).
    let store = HashStore::new();
    let (left, wait_left) = std::sync::mpsc::channel::<()>();
    let wait_left = std::sync::Mutex::new(wait_left);
    let results = common::run_ranks_on(
        3,
        &store,
        &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        |b| b.timeout(Duration::from_secs(6)),
        |ctx| {
            ctx.barrier()?;
            match ctx.rank() {
                2 => {
                    drop(ctx);
                    let _ = left.send(());
                    Ok(None)
                }
                1 => {
                    let _ = wait_left.lock().expect("one rank 1").recv_timeout(Duration::from_secs(10));
                    ctx.send(0, 1, &[1u32])?;
                    // Long enough for rank 0's wait to settle into sleeping.
                    std::thread::sleep(Duration::from_millis(300));
                    Ok(None)
                }
                _ => {
                    let mut b = [0u32];
                    ctx.recv(1, 1, &mut b)?;
                    let (t, cpu) = (Instant::now(), thread_cpu());
                    let r = ctx.recv(1, 2, &mut b);
                    Ok(Some((r, t.elapsed(), thread_cpu() - cpu)))
                }
            }
        },
    );
    let Some((r, took, cpu)) = all_ok(results).remove(0) else { panic!("rank 0 measured nothing") };
    assert!(matches!(r, Err(Error::PeerClosed { rank: 1, .. })), "expected rank 1 gone, got {r:?}");
    assert!(took < Duration::from_secs(3), "rank 1's exit took {took:?} to be noticed");
    assert!(cpu < took / 2 + Duration::from_millis(20), "the wait used {cpu:?} of CPU in {took:?}");
}

#[test]
fn a_stalled_message_does_not_hide_a_dead_member_from_a_shared_memory_barrier() {
    // Shared-memory segments count in this process's resident memory, which the memory test
    // samples.
    let _serial = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    // Rank 1's 16 MiB message waits in rank 0's ring (over its early budget, no receive
    // posted); rank 2 leaves; rank 0's barrier names rank 2 in time (not a timeout).
    let store = HashStore::new();
    let results = common::run_ranks_on(
        3,
        &store,
        &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        |b| b.timeout(Duration::from_secs(6)),
        |ctx| {
            ctx.barrier()?;
            match ctx.rank() {
                1 => {
                    // Fails once rank 0 gives up and aborts.
                    let _ = ctx.send(0, 5, &vec![7u8; 16 << 20]);
                    Ok(None)
                }
                2 => Ok(None),
                _ => {
                    let t = Instant::now();
                    Ok(Some((ctx.barrier(), t.elapsed())))
                }
            }
        },
    );
    let Some((r, took)) = all_ok(results).remove(0) else { panic!("rank 0 measured nothing") };
    match r {
        Err(e) => assert_eq!(e.rank(), Some(2), "the error names rank 2: {e}"),
        Ok(()) => panic!("a barrier without rank 2 succeeded"),
    }
    assert!(took < Duration::from_secs(3), "rank 2's exit took {took:?} to be noticed");
}

#[test]
fn a_single_copy_send_aborted_before_its_peer_reads_it_is_never_received_as_good() {
    // Shared-memory segments count in this process's resident memory, which the memory test
    // samples.
    let _serial = HEAVY.lock().unwrap_or_else(|p| p.into_inner());
    // Rank 0 posts 1 MiB (read by rank 1 straight from rank 0's memory), aborts, and reuses
    // the buffer; rank 1 must not receive the reused bytes as the message.
    let store = HashStore::new();
    let (aborted, wait_abort) = std::sync::mpsc::channel::<()>();
    let wait_abort = std::sync::Mutex::new(wait_abort);
    let single = || Ok(Device::shared_memory(&ferrogloo::device::ShmAttr { single_copy: true, ..Default::default() }));
    let results = common::run_ranks_on(
        2,
        &store,
        &single,
        |b| b.timeout(Duration::from_secs(5)),
        |ctx| {
            ctx.barrier()?;
            if ctx.rank() == 0 {
                let mut big = vec![7u8; 1 << 20];
                let r = ctx.scope(|s| {
                    let op = s.isend(1, 5, &big)?;
                    ctx.abort("test abort");
                    op.wait()
                });
                assert!(r.is_err(), "the send of an aborted context succeeded");
                big.fill(0xEE);
                let _ = aborted.send(());
                Ok(None)
            } else {
                let _ = wait_abort.lock().expect("one rank 1").recv_timeout(Duration::from_secs(10));
                let mut b = vec![0u8; 1 << 20];
                let r = ctx.recv(0, 5, &mut b).map(|()| b[0]);
                Ok(Some(r))
            }
        },
    );
    let got = all_ok(results).remove(1).expect("rank 1's result");
    assert!(!matches!(got, Ok(0xEE)), "rank 1 received the reused buffer as the message");
    assert!(matches!(got, Ok(7) | Err(_)), "{got:?}");
}
