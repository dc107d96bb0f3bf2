//! Surviving a dead rank inside the library: revoke, agree and shrink, with ranks as threads
//! (a rank "dies" by dropping its context, which closes its connections) on every backend, and
//! as processes killed with SIGKILL in the middle of collectives and of agreements.

mod common;

use common::{TIMEOUT, all_ok, run_ranks_on};
use ferrogloo::config::{FERROGLOO_RANK as RANK_ENV, FERROGLOO_SIZE as SIZE_ENV, FERROGLOO_STORE as STORE_ENV};
use ferrogloo::device::{Device, ShmAttr, TcpAttr, Transport};
use ferrogloo::rendezvous::HashStore;
use ferrogloo::{Agreement, Context, Error, Reduction, Result};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

type MakeDevice = fn() -> Result<Device>;

fn tcp() -> Result<Device> {
    Device::tcp(&TcpAttr::loopback())
}
fn shm() -> Result<Device> {
    Ok(Device::shared_memory(&ShmAttr::default()))
}
fn memory() -> Result<Device> {
    Ok(Device::in_process())
}

const BACKENDS: [(&str, MakeDevice); 3] = [("tcp", tcp), ("shm", shm), ("memory", memory)];

/// How long a survivor may take, after the failure, to return from each step: far below the
/// contexts' deadline (20 s), so a step that waited for a deadline fails the test.
const PROMPT: Duration = Duration::from_secs(5);

fn run<T: Send>(dev: MakeDevice, n: usize, f: impl Fn(Context) -> Result<T> + Sync) -> Vec<Result<T>> {
    run_ranks_on(n, &HashStore::new(), &dev, |b| b, f)
}

/// An allreduce on `ctx` where rank r (of the job the mesh was formed for) contributes r + 1 at
/// every element, checked against the sum over the context's members.
fn checked_allreduce(ctx: &Context) -> Result<()> {
    let me = ctx.world_rank(ctx.rank()).unwrap_or(usize::MAX);
    let mut v = vec![(me + 1) as u64; 5000];
    ctx.allreduce(&mut v, Reduction::Sum)?;
    let want: u64 = (0..ctx.size()).filter_map(|r| ctx.world_rank(r)).map(|w| w as u64 + 1).sum();
    assert!(v.iter().all(|&x| x == want), "rank {me}: allreduce gave {} where {want} was due", v[0]);
    Ok(())
}

#[test]
fn agreements_without_failures_and_the_flags_of_every_member_on_every_backend() {
    for (name, dev) in BACKENDS {
        let sizes: &[usize] = if name == "memory" { &[1, 2, 3, 4, 5, 6, 7, 8, 9] } else { &[1, 2, 3, 5] };
        for &n in sizes {
            let got = all_ok(run(dev, n, |ctx| {
                let r = ctx.rank();
                // Each rank clears its own bit: the AND has the bits of no member.
                let mut seen = Vec::new();
                for round in 0..20u64 {
                    let flag = !(1u64 << r) ^ (round << 40);
                    seen.push(ctx.agree(flag)?);
                }
                Ok(seen)
            }));
            for (r, seen) in got.iter().enumerate() {
                for (round, a) in seen.iter().enumerate() {
                    let want = (0..n).fold(!0u64, |acc, m| acc & (!(1u64 << m) ^ ((round as u64) << 40)));
                    assert_eq!(
                        a,
                        &Agreement { value: want, failed: vec![] },
                        "{name}, {n} ranks, rank {r}, round {round}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_revoke_fails_every_member_at_once_and_they_shrink_to_the_same_members() {
    for (name, dev) in BACKENDS {
        for n in [2, 4] {
            let got = all_ok(run(dev, n, |ctx| {
                let t = Instant::now();
                let err = if ctx.rank() == n - 1 {
                    // The others are blocked in an allreduce that waits for this rank.
                    ctx.revoke("stop, everyone");
                    ctx.barrier().expect_err("a revoked context fails its revoker's calls too")
                } else {
                    let mut v = vec![1u32; 1000];
                    ctx.allreduce(&mut v, Reduction::Sum).expect_err("the revoke ends the allreduce")
                };
                let took = t.elapsed();
                assert!(
                    matches!(&err, Error::Revoked { rank, reason } if *rank == n - 1 && reason == "stop, everyone"),
                    "{name}: rank {}: {err:?}",
                    ctx.rank()
                );
                assert!(took < PROMPT, "{name}: rank {} took {took:?} to see the revoke", ctx.rank());
                // Later calls fail too, with the same cause.
                let again = ctx.broadcast(&mut [0u8; 4], 0, &Default::default()).expect_err("still revoked");
                assert!(matches!(again, Error::Revoked { .. }), "{again:?}");
                let a = ctx.agree(1)?;
                assert_eq!(a, Agreement { value: 1, failed: vec![] });
                let small = ctx.shrink()?;
                assert_eq!((small.size(), small.rank()), (n, ctx.rank()), "nobody failed: the same members");
                checked_allreduce(&small)?;
                Ok(())
            }));
            assert_eq!(got.len(), n);
        }
    }
}

/// `dead` ranks leave (drop their context) in the middle of an allreduce; the others see the
/// failure, agree on it and shrink; returns what each survivor saw.
fn leave_mid_allreduce(dev: MakeDevice, n: usize, dead: &[usize]) -> Vec<Result<(Agreement, Vec<usize>)>> {
    leave_mid_allreduce_and_shrink(dev, n, dead, &[])
}

/// [`leave_mid_allreduce`], and `in_shrink` ranks leave after the agreement on the first
/// failure, during the survivors' shrink (whose own agreement must then count them failed).
fn leave_mid_allreduce_and_shrink(
    dev: MakeDevice,
    n: usize,
    dead: &[usize],
    in_shrink: &[usize],
) -> Vec<Result<(Agreement, Vec<usize>)>> {
    let finished = std::sync::Barrier::new(n);
    run(dev, n, |ctx| {
        let me = ctx.rank();
        // One allreduce everybody finishes; then the dead leave during the next one.
        checked_allreduce(&ctx)?;
        finished.wait();
        if dead.contains(&me) {
            let mut v = vec![1u64; 1 << 16];
            // Leaves with its part sent to some peers and not to others.
            ctx.scope(|s| {
                for p in (0..n).filter(|&p| p != me) {
                    let _ = s.isend(p, 77, &v[..p * 100])?;
                }
                Ok(())
            })
            .ok();
            v.clear();
            drop(ctx);
            return Err(Error::invalid("left"));
        }
        let mut v = vec![1u64; 1 << 16];
        let seen = Instant::now();
        let err = ctx.allreduce(&mut v, Reduction::Sum).expect_err("a member left");
        assert!(err.rank().is_some(), "the error names a rank: {err:?}");
        let agreed = ctx.agree(!0)?;
        if in_shrink.contains(&me) {
            drop(ctx);
            return Err(Error::invalid("left during the shrink"));
        }
        let small = ctx.shrink()?;
        assert!(seen.elapsed() < PROMPT, "rank {me}: failure to shrink took {:?}", seen.elapsed());
        let members: Vec<usize> = (0..small.size()).filter_map(|r| small.world_rank(r)).collect();
        checked_allreduce(&small)?;
        // The shrunk context works on: agreements, sub-groups, another shrink.
        assert_eq!(small.agree(3)?, Agreement { value: 3, failed: vec![] });
        let half = small.split(Some(small.rank() as u32 % 2), 0)?.expect("a color");
        checked_allreduce(&half)?;
        let again = small.shrink()?;
        checked_allreduce(&again)?;
        Ok((agreed, members))
    })
}

#[test]
fn the_survivors_of_ranks_that_leave_mid_allreduce_agree_on_them_and_shrink() {
    for (name, dev) in BACKENDS {
        // A member, the coordinator (rank 0), two at once, the last and the first.
        for (n, dead) in [(4, vec![2]), (4, vec![0]), (5, vec![1, 3]), (6, vec![0, 5])] {
            let got = leave_mid_allreduce(dev, n, &dead);
            let live: Vec<usize> = (0..n).filter(|r| !dead.contains(r)).collect();
            for (r, outcome) in got.into_iter().enumerate() {
                if dead.contains(&r) {
                    continue;
                }
                let (agreed, members) =
                    outcome.unwrap_or_else(|e| panic!("{name}, {n} ranks, dead {dead:?}: rank {r}: {e}"));
                assert_eq!(agreed.failed, dead, "{name}, {n} ranks: rank {r} agreed on another failed set");
                assert_eq!(members, live, "{name}, {n} ranks: rank {r}'s shrunk context");
            }
        }
    }
}

#[test]
fn a_member_that_leaves_during_the_shrink_is_left_out_of_the_shrunk_context() {
    for (name, dev) in BACKENDS {
        // Rank 1 leaves mid-allreduce; after the agreement on it, rank 3 (then the
        // coordinator, rank 0) leaves while the others shrink.
        for (n, dead, in_shrink) in [(5, vec![1], vec![3]), (5, vec![1], vec![0])] {
            let got = leave_mid_allreduce_and_shrink(dev, n, &dead, &in_shrink);
            let live: Vec<usize> = (0..n).filter(|r| !dead.contains(r) && !in_shrink.contains(r)).collect();
            for r in live.iter().copied() {
                let (agreed, members) = got[r].as_ref().unwrap_or_else(|e| panic!("{name}: rank {r}: {e}")).clone();
                assert_eq!(agreed.failed, dead, "{name}: rank {r}'s first agreement");
                assert_eq!(members, live, "{name}: rank {r}'s shrunk context");
            }
        }
    }
}

#[test]
fn a_minority_does_not_go_on_and_half_goes_on_only_with_rank_0() {
    for (n, dead, goes_on) in [(4, vec![0, 1], false), (4, vec![2, 3], true), (5, vec![0, 1, 2], false)] {
        let got = leave_mid_allreduce(memory, n, &dead);
        for (r, outcome) in got.into_iter().enumerate() {
            if dead.contains(&r) {
                continue;
            }
            match outcome {
                Ok(_) => assert!(goes_on, "{n} ranks, dead {dead:?}: rank {r} went on"),
                Err(Error::RanksFailed { ranks, detail }) => {
                    assert!(!goes_on, "{n} ranks, dead {dead:?}: rank {r} stopped: {detail}");
                    assert_eq!(ranks, dead);
                    assert!(detail.contains("not a majority"), "{detail}");
                }
                Err(e) => panic!("{n} ranks, dead {dead:?}: rank {r}: {e}"),
            }
        }
    }
}

#[test]
fn an_agreement_that_a_live_member_skips_times_out_naming_it() {
    // Every rank keeps its context (and so its connections) until all are done.
    let done = std::sync::Barrier::new(3);
    let got = run_ranks_on(
        3,
        &HashStore::new(),
        &memory,
        |b| b.timeout(Duration::from_millis(500)),
        |ctx| {
            if ctx.rank() == 1 {
                // Alive, and out of the agreement.
                done.wait();
                return Ok(None);
            }
            let t = Instant::now();
            let err = ctx.agree(1).expect_err("rank 1 never agrees");
            assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
            done.wait();
            Ok(Some(err))
        },
    );
    for (r, outcome) in got.into_iter().enumerate() {
        match outcome {
            Ok(Some(Error::Timeout { ranks, op, .. })) => {
                assert!(op.contains("agreement"), "{op}");
                // The coordinator waits for rank 1; rank 2 for the coordinator's decision.
                let awaited = if r == 0 { vec![1] } else { vec![0] };
                assert_eq!(ranks, awaited, "rank {r}: {op}");
            }
            Ok(None) => assert_eq!(r, 1),
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

// Ranks as processes: this binary re-executes itself as each rank (the ignored test
// `survive_rank`), and the parent kills one with SIGKILL.

const SCENARIO_ENV: &str = "FERROGLOO_TEST_SURVIVE";
/// Agreements each rank runs in the agreement scenario.
const AGREEMENTS: u64 = 400;

/// One rank. Does nothing unless started by a test below with the rank variables set.
#[test]
#[ignore = "run as a child process by the other tests in this file"]
fn survive_rank() {
    let Some(env) = common::rank_process() else { return };
    let store = ferrogloo::rendezvous::open(&env.store).expect("open store");
    let dev = Device::with_transport(Transport::from_env().expect("transport"), &TcpAttr::loopback()).expect("device");
    if std::env::var(SCENARIO_ENV).as_deref() == Ok("close") {
        closing(&env, &*store);
        println!("DONE rank {}", env.rank);
        return;
    }
    if std::env::var(SCENARIO_ENV).as_deref() == Ok("connect") {
        connecting(&env, &store, &dev);
        println!("DONE rank {}", env.rank);
        return;
    }
    let ctx = Context::builder(env.rank, env.size).timeout(TIMEOUT).connect(&store, &dev).expect("rendezvous");
    match std::env::var(SCENARIO_ENV).as_deref() {
        // Agreements in a loop, each printed; the victim dies in the middle of one.
        Ok("agree") => {
            for i in 0..AGREEMENTS {
                let a = ctx.agree(!(i % 7)).expect("agreement");
                println!("AGREE {i} {} {:?}", a.value, a.failed);
            }
            let small = ctx.shrink().expect("shrink");
            let members: Vec<usize> = (0..small.size()).filter_map(|r| small.world_rank(r)).collect();
            checked_allreduce(&small).expect("allreduce on the shrunk context");
            println!("SHRUNK {members:?}");
        }
        // Collectives in a loop (`FERROGLOO_TEST_OP`: op:algorithm); the victim is killed
        // during one; the survivors agree, shrink and check an allreduce on the survivors.
        Ok("collective") => mid_collective(&ctx),
        other => panic!("unknown scenario {other:?}"),
    }
    println!("DONE rank {}", env.rank);
}

/// Bytes rank 1 sends in the close scenario: more than rank 0's kernel takes while it is
/// stopped, less than rank 1's send buffer.
const CLOSING_SEND: usize = 768 << 10;

/// The close scenario's rank (see `survive_rank`): rank 0 sends rank 1 a message it never
/// takes (rank 1 has no early budget: it stays unread in rank 1's socket; under 256 KiB, it
/// goes on the connection that carries all of rank 1's frames) and is stopped by the parent;
/// rank 1 then sends [`CLOSING_SEND`] bytes, most of which wait in its own socket, and drops
/// its context at once; the parent resumes rank 0, which must receive them whole.
fn closing(env: &ferrogloo::launch::RankEnv, store: &dyn ferrogloo::rendezvous::Store) {
    let attr = if env.rank == 1 {
        TcpAttr { early_budget: 0, send_buffer: Some(1 << 20), ..TcpAttr::loopback() }
    } else {
        TcpAttr { recv_buffer: Some(64 << 10), send_buffer: Some(1 << 20), ..TcpAttr::loopback() }
    };
    let dev = Device::tcp(&attr).expect("device");
    let ctx = Context::builder(env.rank, 2).timeout(TIMEOUT).connect(store, &dev).expect("rendezvous");
    let pattern = |i: usize| (i as u32).wrapping_mul(2_654_435_761);
    if env.rank == 1 {
        store.get("go", TIMEOUT).expect("the parent's go");
        let out: Vec<u32> = (0..CLOSING_SEND / 4).map(pattern).collect();
        ctx.send(0, 9, &out).expect("send");
        drop(ctx);
        println!("CLOSED");
        return;
    }
    // Larger than what rank 1 reads ahead, smaller than this rank's send buffer: sent whole,
    // mostly unread by rank 1.
    ctx.send(1, 7, &vec![7u8; 200 << 10]).expect("the unwanted message");
    println!("UNWANTED");
    let mut got = vec![0u32; CLOSING_SEND / 4];
    match ctx.recv(1, 9, &mut got) {
        Ok(()) => {
            let wrong = got.iter().enumerate().position(|(i, &x)| x != pattern(i));
            println!("RECEIVED wrong at {wrong:?}");
        }
        Err(e) => println!("RECEIVED error: {e}"),
    }
}

/// The deadline of the mesh's forming in the connect scenario.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The ranks an error blames: those a deadline waited for, or the one it names.
fn blamed(e: &Error) -> Vec<usize> {
    match e {
        Error::Timeout { ranks, .. } => ranks.clone(),
        other => other.rank().into_iter().collect(),
    }
}

/// The connect scenario's rank (see `survive_rank`): the parent kills the victim while the
/// mesh forms. A survivor whose forming fails says so and whom it blames; one whose mesh
/// formed (the victim died just after) finds the victim gone in barriers, agrees and shrinks.
fn connecting(env: &ferrogloo::launch::RankEnv, store: &dyn ferrogloo::rendezvous::Store, dev: &Device) {
    println!("CONNECTING");
    let ctx = match Context::builder(env.rank, env.size).timeout(CONNECT_TIMEOUT).connect(store, dev) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("CONNECT_FAILED blamed {:?}: {e}", blamed(&e));
            return;
        }
    };
    let err = loop {
        if let Err(e) = ctx.barrier() {
            break e;
        }
    };
    println!("FAILED blamed {:?}: {err}", blamed(&err));
    match ctx.shrink() {
        Ok(small) => {
            let members: Vec<usize> = (0..small.size()).filter_map(|r| small.world_rank(r)).collect();
            println!("SHRUNK {members:?}");
        }
        // A survivor whose forming failed takes no part: the others' agreement times out.
        Err(e) => println!("SHRINK_FAILED blamed {:?}: {e}", blamed(&e)),
    }
}

/// The collective scenario's rank (see `survive_rank`).
fn mid_collective(ctx: &Context) {
    let spec = std::env::var("FERROGLOO_TEST_OP").expect("FERROGLOO_TEST_OP");
    let (op, algo) = spec.split_once(':').expect("op:algorithm");
    let opts = ferrogloo::CollectiveOptions { algorithm: algo.parse().expect("algorithm"), ..Default::default() };
    let (me, n) = (ctx.rank(), ctx.size());
    let len = 1 << 20; // 4 MiB of f32: pipelined, a few milliseconds per call
    let mut buf = vec![0f32; len];
    let mut out = vec![0f32; len * n];
    let mut i = 0u64;
    let victim: Option<usize> = std::env::var("FERROGLOO_TEST_VICTIM").ok().and_then(|v| v.parse().ok());
    let err = loop {
        buf.iter_mut().enumerate().for_each(|(k, x)| *x = (me + k % 5) as f32);
        if op == "revoke" && i == 4 && victim == Some(me) {
            // Revokes while the others allreduce, and dies at once (fault injection).
            ctx.revoke("rank about to die");
            // SAFETY: raise(3) with a valid signal number; SIGKILL ends the process here.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        let done = match op {
            "allreduce" | "revoke" => ctx.allreduce_with(&mut buf, Reduction::Sum, &opts),
            "broadcast" => ctx.broadcast(&mut buf, 0, &opts),
            "allgather" => ctx.allgather(&buf, &mut out, &opts),
            "barrier" => ctx.barrier(),
            other => panic!("unknown op {other}"),
        };
        if let Err(e) = done {
            break e;
        }
        i += 1;
        // The parent kills the victim after it says so, during one of its next calls.
        println!("READY {i}");
    };
    let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    println!("FAILED_AT {} {err}", at.as_nanos());
    // A rank the others took for dead (stopped, then woken) cannot go on: it says so and ends.
    let refused = |e: Error| -> ! {
        println!("REFUSED {e}");
        std::process::exit(3)
    };
    let agreed = ctx.agree(!0).unwrap_or_else(|e| refused(e));
    let small = ctx.shrink().unwrap_or_else(|e| refused(e));
    checked_allreduce(&small).expect("allreduce on the shrunk context");
    let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    println!("SHRUNK_AT {} {:?}", at.as_nanos(), agreed.failed);
}

fn spawn(n: usize, transport: &str, store: &str, scenario: &str, victim: usize) -> Vec<Child> {
    spawn_with(n, transport, store, scenario, victim, &[])
}

fn spawn_with(
    n: usize,
    transport: &str,
    store: &str,
    scenario: &str,
    victim: usize,
    env: &[(&str, &str)],
) -> Vec<Child> {
    let (scenario, op) = scenario.split_once('/').unwrap_or((scenario, ""));
    (0..n)
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
            cmd.args(["--ignored", "--exact", "survive_rank", "--nocapture", "--test-threads=1"])
                .env(RANK_ENV, rank.to_string())
                .env(SIZE_ENV, n.to_string())
                .env(STORE_ENV, store)
                .env(SCENARIO_ENV, scenario)
                .env("FERROGLOO_TEST_OP", op)
                .env("FERROGLOO_TEST_VICTIM", victim.to_string())
                .envs(env.iter().copied())
                .stdout(Stdio::piped());
            match transport {
                "mixed" => {
                    cmd.env("FERROGLOO_TRANSPORT", "auto").env("FERROGLOO_HOST_ID", format!("pretend-{}", rank % 2))
                }
                t => cmd.env("FERROGLOO_TRANSPORT", t),
            };
            cmd.spawn().expect("starting a rank")
        })
        .collect()
}

fn output(mut child: Child, deadline: Instant) -> (bool, String) {
    let out = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || std::io::read_to_string(out).unwrap_or_default());
    match common::wait_or_kill(&mut child, deadline) {
        Some(st) => (st.success(), reader.join().unwrap_or_default()),
        None => (false, format!("KILLED AT DEADLINE\n{}", reader.join().unwrap_or_default())),
    }
}

/// The victim is killed with SIGKILL right after it printed agreement `at`, so it dies in one of
/// the next ones (whether it coordinates or not); every survivor must print the same
/// agreements (values and failed sets) and shrink to the same members.
fn killed_during_agreements(n: usize, victim: usize, at: u64, transport: &str) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut children = spawn(n, transport, &format!("file:{}", dir.path().display()), "agree", victim);
    let mut doomed = children.remove(victim);
    let mut lines = BufReader::new(doomed.stdout.take().expect("piped")).lines();
    let reached = lines.by_ref().map_while(|l| l.ok()).any(|l| l.starts_with(&format!("AGREE {at} ")));
    assert!(reached, "{transport}: the victim did not reach agreement {at}");
    doomed.kill().expect("SIGKILL");
    doomed.wait().expect("reaped");
    let deadline = Instant::now() + TIMEOUT;
    let mut seen: Vec<(usize, Vec<String>)> = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let rank = if i < victim { i } else { i + 1 };
        let (ok, out) = output(c, deadline);
        assert!(ok && out.contains(&format!("DONE rank {rank}")), "{transport}: survivor {rank} of {n}:\n{out}");
        let agreed: Vec<String> = out.lines().filter_map(|l| l.split("AGREE ").nth(1).map(str::to_string)).collect();
        assert_eq!(agreed.len() as u64, AGREEMENTS, "{transport}: survivor {rank}");
        let last = agreed.last().cloned().unwrap_or_default();
        assert!(last.ends_with(&format!("[{victim}]")), "{transport}: survivor {rank}'s last agreement: {last}");
        let live: Vec<usize> = (0..n).filter(|&r| r != victim).collect();
        assert!(out.contains(&format!("SHRUNK {live:?}")), "{transport}: survivor {rank}:\n{out}");
        seen.push((rank, agreed));
    }
    for (rank, agreed) in &seen[1..] {
        let (first, theirs) = &seen[0];
        let differ = agreed.iter().zip(theirs).position(|(a, b)| a != b);
        assert!(
            differ.is_none(),
            "{transport}: ranks {first} and {rank} returned different agreements: {:?} and {:?}",
            differ.map(|i| &theirs[i]),
            differ.map(|i| &agreed[i])
        );
    }
}

#[test]
fn survivors_of_a_rank_killed_during_agreements_return_the_same_ones() {
    // The coordinator, and a member; over TCP, shared memory and both.
    killed_during_agreements(4, 0, 40, "tcp");
    killed_during_agreements(4, 2, 40, "shm");
    killed_during_agreements(4, 0, 40, "shm");
    killed_during_agreements(3, 1, 40, "mixed");
}

/// Kills `victim` with SIGKILL during a collective (`op`: op:algorithm) of `n` processes on
/// `transport`; checks that every survivor fails, agrees that the victim failed, shrinks and
/// gets a right allreduce, each in bounded time; returns the slowest survivor's time from the
/// kill to its error and to its shrunk context's checked allreduce.
fn killed_mid_collective(n: usize, victim: usize, op: &str, transport: &str) -> (Duration, Duration) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut children =
        spawn(n, transport, &format!("file:{}", dir.path().display()), &format!("collective/{op}"), victim);
    let mut doomed = children.remove(victim);
    let mut lines = BufReader::new(doomed.stdout.take().expect("piped")).lines();
    let ready = lines.by_ref().map_while(|l| l.ok()).any(|l| l.ends_with("READY 3"));
    assert!(ready, "{op} on {transport}: the victim did not reach its fourth call");
    doomed.kill().expect("SIGKILL");
    let killed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock");
    doomed.wait().expect("reaped");
    let deadline = Instant::now() + TIMEOUT + Duration::from_secs(10);
    let (mut failed, mut shrunk) = (Duration::ZERO, Duration::ZERO);
    let since = |out: &str, tag: &str| -> Duration {
        let at: u128 = out
            .lines()
            .find_map(|l| l.split(tag).nth(1))
            .and_then(|l| l.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{op} on {transport}: no {tag}:\n{out}"));
        Duration::from_nanos(at.saturating_sub(killed.as_nanos()) as u64)
    };
    for (i, c) in children.into_iter().enumerate() {
        let rank = if i < victim { i } else { i + 1 };
        let (ok, out) = output(c, deadline);
        assert!(ok && out.contains(&format!("DONE rank {rank}")), "{op} on {transport}: survivor {rank}:\n{out}");
        assert!(out.contains(&format!("[{victim}]")), "{op} on {transport}: survivor {rank} agreed otherwise:\n{out}");
        failed = failed.max(since(&out, "FAILED_AT "));
        shrunk = shrunk.max(since(&out, "SHRUNK_AT "));
    }
    // Far below the contexts' deadline (20 s): nobody waited for one.
    assert!(shrunk < PROMPT, "{op} on {transport}: a survivor took {shrunk:?} from the kill to its shrunk allreduce");
    (failed, shrunk)
}

#[test]
fn survivors_of_a_rank_killed_in_each_algorithm_fail_agree_shrink_and_go_on() {
    let mut table = Vec::new();
    for (op, transport, n, victim) in [
        ("allreduce:ring", "tcp", 4, 2),
        ("allreduce:hd", "tcp", 5, 0),
        ("allreduce:rd", "shm", 4, 3),
        ("allreduce:shm", "shm", 4, 1),
        ("allreduce:auto", "mixed", 4, 1),
        ("broadcast:pipeline", "tcp", 4, 2),
        ("broadcast:shm", "shm", 3, 0),
        ("allgather:ring", "shm", 4, 2),
        ("barrier:auto", "tcp", 3, 1),
        // The victim revokes during the others' allreduce and dies at once.
        ("revoke:auto", "tcp", 4, 1),
        ("revoke:auto", "shm", 4, 0),
    ] {
        let (failed, shrunk) = killed_mid_collective(n, victim, op, transport);
        let fault = if op.starts_with("revoke") { "revoke, then SIGKILL" } else { "SIGKILL" };
        table.push(format!("| {fault} rank {victim} of {n} | {op} | {transport} | {failed:.1?} | {shrunk:.1?} |"));
    }
    println!("| fault | during | transport | slowest survivor's error | slowest shrunk and checked |");
    println!("|---|---|---|---|---|");
    for row in table {
        println!("{row}");
    }
}

/// Kills `victim` with SIGKILL `after` it printed that it starts forming the mesh of `n`
/// processes on `transport`: every survivor must return within the forming's deadline plus
/// an agreement's, with an error, or a shrink to the others; someone must blame the victim.
/// Returns the slowest survivor's time from the kill and what the survivors did.
fn killed_while_connecting(n: usize, victim: usize, after: Duration, transport: &str) -> (Duration, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut children = spawn(n, transport, &format!("file:{}", dir.path().display()), "connect", victim);
    let mut doomed = children.remove(victim);
    let mut lines = BufReader::new(doomed.stdout.take().expect("piped")).lines();
    let started = lines.by_ref().map_while(|l| l.ok()).any(|l| l.ends_with("CONNECTING"));
    assert!(started, "{transport}: the victim did not start connecting");
    std::thread::sleep(after);
    doomed.kill().expect("SIGKILL");
    let killed = Instant::now();
    doomed.wait().expect("reaped");
    let bound = CONNECT_TIMEOUT + TIMEOUT + Duration::from_secs(5);
    let deadline = killed + bound;
    let (mut slowest, mut outcomes, mut blamed_victim) = (Duration::ZERO, Vec::new(), false);
    let mut shrunk_to: Vec<String> = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let rank = if i < victim { i } else { i + 1 };
        let (ok, out) = output(c, deadline);
        slowest = slowest.max(killed.elapsed());
        let what = |l: &str| out.lines().find(|x| x.contains(l)).map(str::to_string);
        assert!(
            ok && out.contains(&format!("DONE rank {rank}")),
            "{transport}: survivor {rank} of {n}:
{out}"
        );
        blamed_victim |= out.contains(&format!("blamed [{victim}]"));
        // A survivor whose forming failed leaves: the others, if their mesh formed, shrink
        // without it too, or find themselves a minority, or wait for it in their agreement.
        let outcome = if let Some(l) = what("CONNECT_FAILED") {
            assert!(l.contains("blamed [") && !l.contains("blamed []"), "{transport}: survivor {rank}: {l}");
            "forming failed"
        } else if let Some(l) = what("SHRUNK ") {
            assert!(!l.contains(&victim.to_string()), "{transport}: survivor {rank}: {l}");
            shrunk_to.push(l);
            "shrank"
        } else if let Some(l) = what("SHRINK_FAILED") {
            if l.contains("timed out") {
                "agreement timed out"
            } else {
                assert!(l.contains("not a majority"), "{transport}: survivor {rank}: {l}");
                "a minority, stopped"
            }
        } else {
            panic!("{transport}: survivor {rank} of {n} neither failed nor shrank:\n{out}");
        };
        outcomes.push(outcome);
    }
    assert!(blamed_victim, "{transport}: no survivor blamed rank {victim}: {outcomes:?}");
    shrunk_to.dedup();
    assert!(shrunk_to.len() <= 1, "{transport}: survivors shrank to different members: {shrunk_to:?}");
    outcomes.sort_unstable();
    outcomes.dedup();
    (slowest, outcomes.join(", "))
}

#[test]
fn survivors_of_a_rank_killed_while_the_mesh_forms_return_in_bounded_time() {
    let mut table = Vec::new();
    // The mesh of a few processes forms in about a millisecond here: kills from before the
    // victim published its endpoint to after the mesh formed.
    for (transport, n, victim, after_us) in [
        ("tcp", 4, 2, 0),
        ("tcp", 4, 0, 400),
        ("tcp", 4, 3, 900),
        ("tcp", 3, 1, 5000),
        ("shm", 4, 1, 0),
        ("shm", 4, 0, 400),
        ("shm", 4, 3, 900),
        ("shm", 3, 0, 5000),
    ] {
        let (slowest, what) = killed_while_connecting(n, victim, Duration::from_micros(after_us), transport);
        table.push(format!(
            "| SIGKILL rank {victim} of {n}, {after_us} µs into connect | {transport} | {what} | {slowest:.1?} |"
        ));
    }
    println!("| fault | transport | survivors | slowest survivor's return |");
    println!("|---|---|---|---|");
    for row in table {
        println!("{row}");
    }
}

#[test]
fn engines_recover_on_the_live_members_after_one_leaves() {
    use ferrogloo::engine::{Engine, EngineConfig};
    // Each rank to every other, and by reduction (before and after the recovery).
    let direct = EngineConfig { stall_check: None, tree_negotiation_from: Some(0), ..EngineConfig::default() };
    let tree = EngineConfig { tree_negotiation_from: Some(2), ..direct.clone() };
    let runs = [("memory", memory as MakeDevice, &direct), ("tcp", tcp, &direct), ("tcp, by reduction", tcp, &tree)];
    for (name, dev, cfg) in runs {
        let settled = std::sync::Barrier::new(3);
        let got = run(dev, 4, |ctx| {
            let me = ctx.rank();
            let mut engine = Engine::new(ctx, cfg.clone())?;
            assert_eq!(engine.agrees_by_reduction(), cfg.tree_negotiation_from == Some(2), "{name}");
            let sum = |e: &Engine, tag: &str| -> Result<Vec<i64>> {
                e.allreduce(tag, vec![me as i64 + 1; 100], Reduction::Sum)?.wait().map(|t| t.data)
            };
            assert_eq!(sum(&engine, "before")?, vec![10; 100]);
            if me == 2 {
                drop(engine); // leaves: its engine stops, its connections close
                return Ok(None);
            }
            // The next submission fails (rank 2 is gone); the live members recover.
            let err = sum(&engine, "during").expect_err("rank 2 left");
            assert_eq!(err.rank(), Some(2), "{name}: rank {me}: {err}");
            engine.recover()?;
            assert_eq!(engine.size(), 3, "{name}: rank {me}");
            assert_eq!(engine.agrees_by_reduction(), cfg.tree_negotiation_from == Some(2), "{name}: after");
            assert_eq!(sum(&engine, "after")?, vec![1 + 2 + 4; 100], "{name}: rank {me}");
            // And once more, with nobody gone: the same members. (Recovering revokes the engine's
            // context: a member still finishing a submission would see it fail, as it should.)
            settled.wait();
            engine.recover()?;
            assert_eq!(sum(&engine, "again")?, vec![7; 100], "{name}: rank {me}");
            Ok(Some(engine.rank()))
        });
        let ranks: Vec<Option<usize>> = all_ok(got);
        assert_eq!(ranks, [Some(0), Some(1), None, Some(2)], "{name}: ranks renumbered in order");
    }
}

/// Members and newcomers as threads: `members` ranks form a context on `dev` (through `store`);
/// `leave` of them leave after one allreduce and the others shrink; then the live members grow
/// by `newcomers`, who join with `join_existing`. Returns each thread's (rank, size) in the
/// grown context (members first, in their old order, then newcomers), after a checked allreduce.
fn shrink_then_grow(dev: MakeDevice, members: usize, leave: &[usize], newcomers: usize) -> Vec<(usize, usize)> {
    let store = HashStore::new();
    let grow_store = HashStore::new();
    // Nobody leaves before every member has finished the first allreduce: a member still in it
    // would rightly fail when the others abort on the leavers' departure.
    let finished = std::sync::Barrier::new(members);
    std::thread::scope(|s| {
        let olds: Vec<_> = (0..members)
            .map(|r| {
                let (store, grow_store, finished) = (&store, &grow_store, &finished);
                s.spawn(move || -> Result<Option<(usize, usize)>> {
                    let ctx = Context::builder(r, members).timeout(TIMEOUT).connect(store, &dev()?)?;
                    let first = checked_allreduce(&ctx);
                    finished.wait();
                    first?;
                    if leave.contains(&r) {
                        return Ok(None);
                    }
                    let live = if leave.is_empty() {
                        ctx
                    } else {
                        let _ = ctx.barrier(); // fails: ranks left
                        ctx.shrink()?
                    };
                    let grown = live.grow(grow_store, newcomers)?;
                    checked_sum(&grown)?;
                    Ok(Some((grown.rank(), grown.size())))
                })
            })
            .collect();
        let news: Vec<_> = (0..newcomers)
            .map(|_| {
                let grow_store = &grow_store;
                s.spawn(move || -> Result<Option<(usize, usize)>> {
                    let grown = Context::join_existing(grow_store, &dev()?, TIMEOUT)?;
                    checked_sum(&grown)?;
                    Ok(Some((grown.rank(), grown.size())))
                })
            })
            .collect();
        olds.into_iter()
            .chain(news)
            .filter_map(|h| h.join().expect("a thread panicked").unwrap_or_else(|e| panic!("{e}")))
            .collect()
    })
}

/// An allreduce of every rank's rank + 1, checked (ranks of a grown context are its own).
fn checked_sum(ctx: &Context) -> Result<()> {
    let mut v = vec![ctx.rank() as u64 + 1; 3000];
    ctx.allreduce(&mut v, Reduction::Sum)?;
    let n = ctx.size() as u64;
    assert!(v.iter().all(|&x| x == n * (n + 1) / 2), "rank {}: {}", ctx.rank(), v[0]);
    Ok(())
}

#[test]
fn live_members_grow_with_newcomers_that_join_through_the_store() {
    for (name, dev) in BACKENDS {
        // Two more, with nobody gone.
        let mut got = shrink_then_grow(dev, 3, &[], 2);
        got.sort_unstable();
        assert_eq!(got, [(0, 5), (1, 5), (2, 5), (3, 5), (4, 5)], "{name}");
        // A rank left: the survivors shrink, and a newcomer takes the free place.
        let got = shrink_then_grow(dev, 4, &[1], 1);
        assert_eq!(&got[..3], [(0, 4), (1, 4), (2, 4)], "{name}: the survivors keep their order");
        assert_eq!(got[3], (3, 4), "{name}: the newcomer is last");
    }
}

#[test]
fn a_newcomer_with_no_grow_open_times_out_saying_so() {
    let t = Instant::now();
    let err = Context::join_existing(&HashStore::new(), &Device::in_process(), Duration::from_millis(300))
        .expect_err("no grow");
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(matches!(&err, Error::Timeout { op, .. } if op.contains("no grow with room")), "{err}");
}

#[test]
fn an_abort_after_a_revoke_still_closes_the_connections() {
    for (name, dev) in BACKENDS {
        let got = all_ok(run(dev, 3, |ctx| {
            let all = ctx.subgroup(&[0, 1, 2])?;
            if ctx.rank() == 0 {
                // Only once every member holds the sub-group: a member still forming it when
                // the abort comes fails there, not in the wait this test is about.
                for peer in 1..3 {
                    all.recv(peer, 2, &mut [0u8; 1])?;
                }
                ctx.revoke("first");
                ctx.abort("then close everything");
                return Ok(None);
            }
            all.send(0, 2, &[1u8])?;
            // Waits in the sub-group, which the revoke leaves alone and the abort closes.
            let t = Instant::now();
            let err = all.recv(0, 3, &mut [0u8; 1]).expect_err("rank 0 closed its connections");
            assert!(t.elapsed() < PROMPT, "{name}: {:?}", t.elapsed());
            Ok(Some(err))
        }));
        for err in got.into_iter().flatten() {
            assert_eq!(err.rank(), Some(0), "{name}: {err}");
        }
    }
}

/// With heartbeats every 50 ms, `victim` is stopped with SIGSTOP during an allreduce: its
/// connections stay open, and only the heartbeats tell. The survivors take it for dead within
/// a few intervals (not at their 20 s deadline), agree, shrink and go on; woken with SIGCONT,
/// the victim finds its connections closed and cannot go on. Returns the slowest survivor's
/// time from the stop to its error.
fn stopped_mid_collective(n: usize, victim: usize, transport: &str) -> Duration {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = format!("file:{}", dir.path().display());
    let beat = [("FERROGLOO_HEARTBEAT", "0.05")];
    let mut children = spawn_with(n, transport, &store, "collective/allreduce:auto", victim, &beat);
    let mut doomed = children.remove(victim);
    let mut lines = BufReader::new(doomed.stdout.take().expect("piped")).lines();
    let ready = lines.by_ref().map_while(|l| l.ok()).any(|l| l.ends_with("READY 3"));
    assert!(ready, "{transport}: the victim did not reach its fourth call");
    let pid = nix::unistd::Pid::from_raw(doomed.id() as i32);
    // Whatever happens below, a stopped child must not outlive the test (it would hold its pipes).
    struct Reap(nix::unistd::Pid);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGKILL);
        }
    }
    let reap = Reap(pid);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    let stopped = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock");
    let deadline = Instant::now() + TIMEOUT + Duration::from_secs(10);
    let mut failed = Duration::ZERO;
    for (i, c) in children.into_iter().enumerate() {
        let rank = if i < victim { i } else { i + 1 };
        let (ok, out) = output(c, deadline);
        assert!(ok && out.contains(&format!("DONE rank {rank}")), "{transport}: survivor {rank}:\n{out}");
        assert!(out.contains(&format!("[{victim}]")), "{transport}: survivor {rank} agreed otherwise:\n{out}");
        let at: u128 = out
            .lines()
            .find_map(|l| l.split("FAILED_AT ").nth(1))
            .and_then(|l| l.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{transport}: survivor {rank} printed no failure time:\n{out}"));
        failed = failed.max(Duration::from_nanos(at.saturating_sub(stopped.as_nanos()) as u64));
    }
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    let rest: String = lines.map_while(|l| l.ok()).collect::<Vec<_>>().join("\n");
    let status = common::wait_or_kill(&mut doomed, Instant::now() + TIMEOUT);
    std::mem::forget(reap); // reaped: its pid is no longer its own
    assert!(
        status.is_some_and(|s| s.code() == Some(3)) && rest.contains("REFUSED") && !rest.contains("DONE rank"),
        "{transport}: the stopped rank went on after it was taken for dead:\n{rest}"
    );
    failed
}

#[test]
fn a_stopped_rank_is_taken_for_dead_by_the_heartbeats_and_the_survivors_go_on() {
    for (n, victim, transport) in [(3, 1, "tcp"), (4, 0, "shm")] {
        let took = stopped_mid_collective(n, victim, transport);
        println!("| SIGSTOP rank {victim} of {n} | allreduce | {transport} | {took:.1?} |");
        // Four 50 ms intervals, with room for a loaded machine; the deadline is 20 s.
        assert!(took < Duration::from_secs(3), "{transport}: the survivors took {took:?} to see the stopped rank");
    }
}

#[test]
fn heartbeats_take_no_busy_rank_for_dead() {
    for (name, dev) in BACKENDS {
        let got = run_ranks_on(
            3,
            &HashStore::new(),
            &dev,
            |b| b.heartbeat(Duration::from_millis(100)),
            |ctx| {
                // Large allreduces for a while, and idle moments: nobody is suspected.
                for _ in 0..40 {
                    let mut v = vec![1f32; 1 << 18];
                    ctx.allreduce(&mut v, Reduction::Sum)?;
                    assert!(v.iter().all(|&x| x == 3.0));
                }
                ctx.barrier()?;
                std::thread::sleep(Duration::from_millis(100));
                ctx.barrier()?;
                ctx.agree(1)
            },
        );
        for a in all_ok(got) {
            assert_eq!(a, Agreement { value: 1, failed: vec![] }, "{name}");
        }
    }
}

#[test]
fn a_revoke_ends_a_wait_on_another_peer_that_is_alive_but_idle() {
    for (name, dev) in BACKENDS {
        let idle = std::sync::Barrier::new(2);
        let got = all_ok(run(dev, 3, |ctx| {
            match ctx.rank() {
                // Revokes; rank 1 waits for rank 2 only, which sends nothing.
                0 => {
                    ctx.revoke("stop");
                    Ok(None)
                }
                1 => {
                    let t = Instant::now();
                    let err = ctx.recv(2, 5, &mut [0u8; 4]).expect_err("rank 2 sends nothing");
                    let took = t.elapsed();
                    idle.wait();
                    Ok(Some((err, took)))
                }
                _ => {
                    idle.wait(); // alive, in nothing of the context, until rank 1 is done
                    Ok(None)
                }
            }
        }));
        let (err, took) = got.into_iter().flatten().next().expect("rank 1's outcome");
        assert!(matches!(&err, Error::Revoked { rank: 0, .. }), "{name}: {err}");
        assert!(took < PROMPT, "{name}: the revoke took {took:?} to reach a wait on another peer");
    }
}

#[test]
fn a_rank_that_closes_right_after_a_send_with_input_unread_loses_none_of_it_over_tcp() {
    // A close with unread input resets the connection, and a reset throws away what the kernel
    // had not sent yet: the closing rank's last send. The peer is stopped meanwhile, so most of
    // that send still waits in the closing rank's socket when it closes.
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("file:{}", dir.path().display());
    let mut children = spawn(2, "tcp", &url, "close", 1);
    let mut stopped = children.remove(0);
    let mut lines = BufReader::new(stopped.stdout.take().expect("piped")).lines();
    let sent = lines.by_ref().map_while(|l| l.ok()).any(|l| l.ends_with("UNWANTED"));
    assert!(sent, "rank 0 did not send its message");
    let pid = stopped.id() as i32;
    // SAFETY: kill takes plain integers.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let store = ferrogloo::rendezvous::FileStore::new(dir.path()).expect("store");
    ferrogloo::rendezvous::Store::set(&store, "go", b"1").expect("go");
    let (ok, out) = output(children.remove(0), Instant::now() + TIMEOUT);
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(ok && out.contains("CLOSED"), "rank 1:\n{out}");
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let _ = stopped.wait();
    assert!(rest.iter().any(|l| l.ends_with("RECEIVED wrong at None")), "rank 0: {rest:?}");
}
