//! Ranks as real OS processes: this test binary re-executes itself as each rank (the ignored
//! test `rank_worker`, selected with `--exact`), meeting through a FileStore or an HttpStore.

mod common;

use common::pattern;
use ferrogloo::config::{FERROGLOO_RANK as RANK_ENV, FERROGLOO_SIZE as SIZE_ENV, FERROGLOO_STORE as STORE_ENV};
use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::RankEnv;
use ferrogloo::rendezvous::{FileStore, HttpStoreServer, PrefixStore, Store};
use ferrogloo::{CollectiveOptions, Context, Error, Reduction};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SCENARIO_ENV: &str = "FERROGLOO_TEST_SCENARIO";
/// Set by `@shm-split`: the worker's device takes [`split_plan`].
const SPLIT_ENV: &str = "FERROGLOO_TEST_SPLIT";

/// Single copies everywhere, and the broadcast's root writes its share at every size.
fn split_plan() -> ferrogloo::device::CopyPlan {
    use ferrogloo::device::{CopyPlan, SizeRange};
    CopyPlan { broadcast_split: SizeRange::ALL, ..CopyPlan::SINGLE }
}
const WORKER_TIMEOUT: Duration = Duration::from_secs(20);
/// Deadline of each call on 64 MiB buffers (a debug build on a loaded 2-core machine).
const BIG_TIMEOUT: Duration = Duration::from_secs(60);
/// Deadline of the contexts in the kill test: survivors must report within it (+1 s).
const KILL_TIMEOUT: Duration = Duration::from_secs(8);

/// One rank. Does nothing unless started by a parent below with the rank variables set.
#[test]
#[ignore = "run as a child process by the other tests in this file"]
fn rank_worker() {
    let Some(env) = common::rank_process() else { return };
    let scenario = std::env::var(SCENARIO_ENV).unwrap_or_default();
    let store = ferrogloo::rendezvous::open(&env.store).expect("open store");
    // FERROGLOO_TRANSPORT (set by `rank_command`) picks TCP, shared memory or both.
    let transport = Transport::from_env().expect("transport");
    let dev = match std::env::var(SPLIT_ENV) {
        // Single copies, the broadcast's root writing a share, at every size.
        Ok(_) => Device::shared_memory(&ferrogloo::device::ShmAttr {
            collective_copy: ferrogloo::device::ShmCopy::Given(split_plan()),
            ..Default::default()
        }),
        Err(_) => Device::with_transport(transport, &TcpAttr::loopback()).expect("device"),
    };
    let timeout = match scenario.as_str() {
        "kill" => KILL_TIMEOUT,
        "big" => BIG_TIMEOUT,
        _ => WORKER_TIMEOUT,
    };
    if scenario == "elastic" {
        elastic(&env, &store, &dev);
        println!("DONE rank {}", env.rank);
        return;
    }
    if scenario == "linger" {
        // Says who it is, then stays alive (bounded) until its launcher's fate ends it.
        println!("PID {}", std::process::id());
        std::thread::sleep(WORKER_TIMEOUT);
        println!("OUTLIVED rank {}", env.rank);
        return;
    }
    if scenario == "copies-refused" {
        // The kernel must refuse the others' reads of this process: not dumpable, and (run by
        // `unshare --user`) none of them has power over its user namespace. Its one log line
        // goes to stdout, where the parent counts it.
        nix::sys::prctl::set_dumpable(false).expect("prctl(PR_SET_DUMPABLE)");
        tracing_subscriber::fmt()
            .with_writer(std::io::stdout)
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .init();
    }
    let ctx = Context::builder(env.rank, env.size).timeout(timeout).connect(&store, &dev).expect("rendezvous");
    match scenario.as_str() {
        "copies" | "copies-refused" => copies(&ctx),
        "mesh" => mesh(&ctx),
        "kill" => kill(&ctx),
        "light" => light(&ctx),
        "big" => big(&ctx),
        other => panic!("unknown scenario {other:?}"),
    }
    println!("DONE rank {}", env.rank);
}

/// Every pair exchanges a distinct payload, then a ring pass and barriers.
fn mesh(ctx: &Context) {
    let (me, n) = (ctx.rank(), ctx.size());
    let len = |from: usize, to: usize| (from * 7919 + to * 104_729) % 70_000;
    for p in (0..n).filter(|&p| p != me) {
        ctx.send(p, 1, &pattern(me, p, len(me, p))).expect("send");
    }
    for p in (0..n).filter(|&p| p != me) {
        let mut got = vec![0u32; len(p, me)];
        ctx.recv(p, 1, &mut got).expect("recv");
        assert_eq!(got, pattern(p, me, len(p, me)), "rank {me} from {p}");
    }
    let mut token = [0u64];
    if me == 0 {
        ctx.send(1, 2, &token).expect("send");
        ctx.recv(n - 1, 2, &mut token).expect("recv");
        assert_eq!(token[0], (1..n as u64).sum::<u64>());
    } else {
        ctx.recv(me - 1, 2, &mut token).expect("recv");
        token[0] += me as u64;
        ctx.send((me + 1) % n, 2, &token).expect("send");
    }
    for _ in 0..3 {
        ctx.barrier().expect("barrier");
    }
}

/// Collectives on 64 MiB buffers, results checked on every rank.
fn big(ctx: &Context) {
    use ferrogloo::{CollectiveOptions, Reduction};
    let (r, n) = (ctx.rank(), ctx.size());
    let o = CollectiveOptions::default();
    let count = (64 << 20) / 4;
    // Allreduce (ring at this size): rank r contributes r + 1 + i % 7.
    let mut v: Vec<f32> = (0..count).map(|i| (r + 1 + i % 7) as f32).collect();
    ctx.allreduce(&mut v, Reduction::Sum).expect("allreduce");
    let base = (n * (n + 1) / 2) as f32;
    assert!(v.iter().enumerate().all(|(i, &x)| x == base + (n * (i % 7)) as f32), "allreduce result on rank {r}");
    // Broadcast from the last rank (pipeline at this size).
    let mut b: Vec<u32> = if r == n - 1 { (0..count as u32).collect() } else { vec![0; count] };
    ctx.broadcast(&mut b, n - 1, &o).expect("broadcast");
    assert!(b.iter().enumerate().all(|(i, &x)| x == i as u32), "broadcast result on rank {r}");
    // Allgather of 64 MiB in total.
    let per = count / n;
    let mine: Vec<u32> = (0..per).map(|i| (r * per + i) as u32).collect();
    let mut all = vec![0u32; per * n];
    ctx.allgather(&mine, &mut all, &o).expect("allgather");
    assert!(all.iter().enumerate().all(|(i, &x)| x == i as u32), "allgather result on rank {r}");
    // Reduce-scatter back: every block sums n copies.
    let mut part = vec![0u32; per];
    ctx.reduce_scatter(&all, &mut part, Reduction::Sum, &o).expect("reduce_scatter");
    assert!(part.iter().enumerate().all(|(i, &x)| x == (n * (r * per + i)) as u32), "reduce_scatter on rank {r}");
}

/// Broadcast, allgather and allreduce through the host's area at sizes below and above a
/// slot, checked on every rank; prints the host's copy plan (`PLAN ...`) for the parent.
fn copies(ctx: &Context) {
    use ferrogloo::{CollectiveOptions, Reduction};
    let (r, n) = (ctx.rank(), ctx.size());
    let plan = ctx.copy_plan().expect("ranks of one host share an area");
    println!("PLAN {plan}");
    let o = CollectiveOptions::default();
    for len in [0usize, 1, 1000, 70_000, (3 << 20) / 4 + 5] {
        let data = |p: usize| -> Vec<u32> { (0..len).map(|i| (i as u32 % 977) * (p as u32 + 1)).collect() };
        let mut b = if r == n - 1 { data(n - 1) } else { vec![0; len] };
        ctx.broadcast(&mut b, n - 1, &o).expect("broadcast");
        assert!(b == data(n - 1), "broadcast of {len} on rank {r}");
        let mut all = vec![0u32; n * len];
        ctx.allgather(&data(r), &mut all, &o).expect("allgather");
        assert!(all == (0..n).flat_map(data).collect::<Vec<_>>(), "allgather of {len} on rank {r}");
        let mut v = data(r);
        ctx.allreduce(&mut v, Reduction::Sum).expect("allreduce");
        let k = (n * (n + 1) / 2) as u32;
        assert!(v.iter().enumerate().all(|(i, &x)| x == (i as u32 % 977) * k), "allreduce of {len} on rank {r}");
    }
}

/// Barriers, and every rank reports to rank 0: cheap enough for 64 processes on 2 cores.
fn light(ctx: &Context) {
    ctx.barrier().expect("barrier");
    if ctx.rank() == 0 {
        let peers: Vec<usize> = (1..ctx.size()).collect();
        let mut seen = vec![false; ctx.size()];
        for _ in &peers {
            let mut v = [0u64];
            let from = ctx.recv_any(&peers, 3, &mut v).expect("recv_any");
            assert_eq!(v[0], from as u64 * 1000);
            assert!(!seen[from], "rank {from} reported twice");
            seen[from] = true;
        }
    } else {
        ctx.send(0, 3, &[ctx.rank() as u64 * 1000]).expect("send");
    }
    ctx.barrier().expect("barrier");
}

/// The last rank is killed by the parent once it says READY; the others wait on it.
fn kill(ctx: &Context) {
    let victim = ctx.size() - 1;
    ctx.barrier().expect("barrier before the kill");
    if ctx.rank() == victim {
        println!("READY");
        // The parent kills this process; the bounded wait only matters if it never does.
        std::thread::sleep(WORKER_TIMEOUT);
        std::process::exit(3);
    }
    let mut buf = vec![0u8; 1 << 20];
    match ctx.recv(victim, 9, &mut buf) {
        Err(Error::PeerClosed { rank, .. }) => {
            assert_eq!(rank, victim);
            // Once a peer is known dead, sends to it fail at once too.
            match ctx.send(victim, 9, &buf) {
                Err(Error::PeerClosed { rank, .. }) => assert_eq!(rank, victim),
                other => panic!("expected PeerClosed from a send to the dead rank, got {other:?}"),
            }
        }
        Err(Error::Timeout { ranks, .. }) => assert_eq!(ranks, vec![victim]),
        other => panic!("expected PeerClosed or Timeout naming rank {victim}, got {other:?}"),
    }
}

/// Elastic recovery (the recipe in the README): generation 0 runs allreduces until the last
/// rank is killed in the middle of one; each survivor checks that its error names the dead
/// rank (or is a timeout), prints when it got it, and the survivors form generation 1 under a
/// fresh store prefix with one rank fewer and check collectives there.
fn elastic(env: &RankEnv, store: &impl Store, dev: &Device) {
    let (rank, n) = (env.rank, env.size);
    let victim = n - 1;
    let gen0 = PrefixStore::new("gen0", store);
    let ctx = Context::builder(rank, n).timeout(KILL_TIMEOUT).connect(&gen0, dev).expect("generation 0");
    let mut buf = vec![1.0f32; 1 << 20]; // 4 MiB: a pipelined ring
    let err = loop {
        buf.fill(1.0);
        match ctx.allreduce(&mut buf, Reduction::Sum) {
            Ok(()) => assert!(buf.iter().all(|&x| x == n as f32), "wrong allreduce before the kill"),
            Err(e) => break e,
        }
        if rank == victim {
            // Killed by the parent in the middle of the next allreduce (or the one after).
            println!("READY");
        }
    };
    let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    println!("ERROR_AT {} {err}", at.as_nanos());
    let names_victim = match &err {
        Error::PeerClosed { rank, .. } => *rank == victim,
        Error::Timeout { ranks, .. } => ranks.contains(&victim),
        _ => false,
    };
    assert!(names_victim, "rank {rank}: the error does not name the dead rank {victim}: {err:?}");
    assert!(ctx.is_aborted(), "a failed collective leaves the context aborted");
    drop(ctx);

    // Generation 1: the survivors keep their ranks (the victim was the last one).
    let gen1 = PrefixStore::new("gen1", store);
    let ctx = Context::builder(rank, n - 1).timeout(WORKER_TIMEOUT).connect(&gen1, dev).expect("generation 1");
    let mut v: Vec<u64> = (0..100_000).map(|i| i * (rank as u64 + 1)).collect();
    ctx.allreduce(&mut v, Reduction::Sum).expect("allreduce in generation 1");
    let factor: u64 = (1..n as u64).sum();
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64 * factor), "wrong allreduce in generation 1");
    let mut b = vec![rank as u32; 1000];
    ctx.broadcast(&mut b, 0, &CollectiveOptions::default()).expect("broadcast in generation 1");
    assert!(b.iter().all(|&x| x == 0));
}

/// The command for rank `rank` of `n` running `scenario` against `store_url`, stdout piped.
/// `scenario@shm` runs it over shared memory (`@shm-single-copy`: large messages read
/// straight from the sender's process), `scenario@mixed` on auto devices of two pretend hosts
/// (even and odd ranks: shared memory within each, TCP across); plain `scenario` over TCP.
fn rank_command(rank: usize, n: usize, scenario: &str, store_url: &str) -> Command {
    let (scenario, transport) = scenario.split_once('@').unwrap_or((scenario, "tcp"));
    // `@shm-refused`: each rank in a user namespace of its own, where it has no power over
    // the others' processes (see `copies`).
    let mut cmd = if transport == "shm-refused" {
        let mut c = Command::new("unshare");
        c.args(["--user", "--map-root-user"]).arg(std::env::current_exe().unwrap());
        c
    } else {
        Command::new(std::env::current_exe().unwrap())
    };
    cmd.args(["--ignored", "--exact", "rank_worker", "--nocapture", "--test-threads=1"])
        .env(RANK_ENV, rank.to_string())
        .env(SIZE_ENV, n.to_string())
        .env(STORE_ENV, store_url)
        .env(SCENARIO_ENV, scenario)
        .stdout(Stdio::piped());
    match transport {
        "mixed" => cmd.env("FERROGLOO_TRANSPORT", "auto").env("FERROGLOO_HOST_ID", format!("pretend-{}", rank % 2)),
        "shm-single-copy" | "shm-refused" => {
            cmd.env("FERROGLOO_TRANSPORT", "shm").env("FERROGLOO_SHM_SINGLE_COPY", "1")
        }
        "shm-two-copies" => cmd.env("FERROGLOO_TRANSPORT", "shm").env("FERROGLOO_SHM_SINGLE_COPY", "0"),
        "shm-split" => cmd.env("FERROGLOO_TRANSPORT", "shm").env(SPLIT_ENV, "1"),
        t => cmd.env("FERROGLOO_TRANSPORT", t),
    };
    cmd
}

/// Shared-memory objects of ferrogloo's in `/dev/shm` (there should never be any: its
/// segments are anonymous memfds). The copy-path cache files (one per user, boot, member
/// count, slot size and build: a few dozen bytes each, written once) are not objects.
fn shm_objects() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .filter(|n| n.contains("ferrogloo") && !n.starts_with("ferrogloo-copy-plan-"))
                .collect()
        })
        .unwrap_or_default()
}

/// Starts `n` rank processes of `scenario` against `store_url`, with stdout piped.
fn spawn(n: usize, scenario: &str, store_url: &str) -> Vec<Child> {
    (0..n).map(|rank| rank_command(rank, n, scenario, store_url).spawn().unwrap()).collect()
}

/// Waits for a child with a deadline, killing it if it overruns; returns (success, output).
fn finish(mut child: Child, deadline: Instant) -> (bool, String) {
    let out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || std::io::read_to_string(out).unwrap_or_default());
    match common::wait_or_kill(&mut child, deadline) {
        Some(st) => (st.success(), reader.join().unwrap()),
        None => (false, format!("KILLED AT DEADLINE\n{}", reader.join().unwrap())),
    }
}

fn run_job(n: usize, scenario: &str, store_url: &str) {
    run_job_output(n, scenario, store_url);
}

/// [`run_job`], returning each rank's output.
fn run_job_output(n: usize, scenario: &str, store_url: &str) -> Vec<String> {
    let per_call = if scenario == "big" { BIG_TIMEOUT } else { WORKER_TIMEOUT };
    let deadline = Instant::now() + per_call * 2;
    let children = spawn(n, scenario, store_url);
    let mut outs = Vec::new();
    for (rank, c) in children.into_iter().enumerate() {
        let (ok, out) = finish(c, deadline);
        assert!(ok && out.contains(&format!("DONE rank {rank}")), "rank {rank} of {n} failed:\n{out}");
        outs.push(out);
    }
    outs
}

/// Collectives through the host's area between processes, on each copy path: single copies
/// read and write another process's buffer (forced: the plan says so on every rank; with
/// and without the broadcast root's share), two copies go through the slots, and a measured
/// plan is one plan for all ranks.
#[test]
fn shared_area_collectives_between_processes_on_each_copy_path() {
    let (single, two) = (ferrogloo::device::CopyPlan::SINGLE, ferrogloo::device::CopyPlan::TWO);
    for (transport, want) in [
        ("shm-single-copy", Some(single)),
        ("shm-split", Some(split_plan())),
        ("shm-two-copies", Some(two)),
        ("shm", None),
    ] {
        for n in [2usize, 3] {
            let dir = tempfile::tempdir().unwrap();
            let outs = run_job_output(n, &format!("copies@{transport}"), &format!("file:{}", dir.path().display()));
            // The line follows the test harness's "test rank_worker ... ".
            let plans: Vec<&str> =
                outs.iter().filter_map(|o| o.lines().find_map(|l| l.find("PLAN ").map(|i| &l[i..]))).collect();
            assert_eq!(plans.len(), n, "{outs:?}");
            assert!(plans.iter().all(|p| *p == plans[0]), "{transport}: {plans:?}");
            if let Some(plan) = want {
                assert_eq!(plans[0], format!("PLAN {plan}"), "{transport}");
            }
        }
    }
}

/// Where the kernel refuses `process_vm_readv` (and `_writev`) between the ranks (each is not dumpable and
/// runs in a user namespace of its own, so none may read another), single copies forced by
/// `FERROGLOO_SHM_SINGLE_COPY=1` fall back to two: the results are right, the plan says two
/// copies on every rank, and each rank says so in one log line.
#[test]
fn a_kernel_that_refuses_cross_process_reads_gets_two_copies_and_one_log_line() {
    let userns = Command::new("unshare").args(["--user", "--map-root-user", "true"]).status();
    if !userns.is_ok_and(|s| s.success()) {
        eprintln!("skipped: this machine cannot make user namespaces (unshare --user), which the test needs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let outs = run_job_output(2, "copies-refused@shm-refused", &format!("file:{}", dir.path().display()));
    for (rank, out) in outs.iter().enumerate() {
        let said = out.matches("does not let ranks of this host read and write each other's memory").count();
        assert_eq!(said, 1, "rank {rank}:\n{out}");
        assert!(out.contains(&format!("PLAN {}", ferrogloo::device::CopyPlan::TWO)), "rank {rank}:\n{out}");
    }
}

#[test]
fn mesh_over_file_store_2_3_4_8_processes() {
    for n in [2, 3, 4, 8] {
        let dir = tempfile::tempdir().unwrap();
        run_job(n, "mesh", &format!("file:{}", dir.path().display()));
    }
}

#[test]
fn collectives_on_64_mib_buffers_over_file_store_2_to_5_processes() {
    for n in 2..=5 {
        let dir = tempfile::tempdir().unwrap();
        run_job(n, "big", &format!("file:{}", dir.path().display()));
    }
}

#[test]
fn sixty_four_processes_form_a_full_mesh() {
    let dir = tempfile::tempdir().unwrap();
    run_job(64, "light", &format!("file:{}", dir.path().display()));
}

#[test]
fn mesh_over_http_store_with_embedded_server() {
    let server = HttpStoreServer::start("127.0.0.1:0").unwrap();
    run_job(4, "mesh", &server.store_url("job-a"));
    // A second job on the same server under another scope.
    run_job(3, "mesh", &server.store_url("job-b"));
}

#[test]
fn a_store_directory_left_by_earlier_jobs_is_harmless() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file:{}", dir.path().display());
    // An earlier job of another size left its entries, then one of the same size did.
    run_job(3, "mesh", &url);
    run_job(4, "mesh", &url);
    // Plant entries that point at a dead port with a foreign context id, for every rank.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let store = FileStore::new(dir.path()).unwrap();
    for r in 0..4 {
        let v = format!("ferrogloo-v1 {} 4 {dead}", "ab".repeat(16));
        store.set(&format!("ferrogloo.rank.{r}"), v.as_bytes()).unwrap();
    }
    let t = Instant::now();
    run_job(4, "mesh", &url);
    assert!(t.elapsed() < WORKER_TIMEOUT, "stale entries slowed the job to {:?}", t.elapsed());
}

/// Takes the last child (the victim) out of `children`, waits until it prints READY, kills it
/// with SIGKILL and reaps it. Returns when it was killed, monotonic and since the Unix epoch.
fn kill_last_when_ready(children: &mut Vec<Child>) -> (Instant, Duration) {
    let mut victim = children.pop().unwrap();
    // The test harness prints its own lines first; READY comes at the kill point.
    let mut lines = BufReader::new(victim.stdout.take().unwrap()).lines();
    let ready = lines.by_ref().map_while(Result::ok).any(|l| l.ends_with("READY"));
    assert!(ready, "victim did not reach the kill point");
    victim.kill().unwrap();
    let killed_at = (Instant::now(), std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap());
    victim.wait().unwrap();
    killed_at
}

#[test]
fn survivors_of_a_killed_peer_fail_within_the_deadline() {
    for n in [2, 4] {
        let dir = tempfile::tempdir().unwrap();
        let mut children = spawn(n, "kill", &format!("file:{}", dir.path().display()));
        let (killed_at, _) = kill_last_when_ready(&mut children);
        for (rank, c) in children.into_iter().enumerate() {
            let (ok, out) = finish(c, killed_at + KILL_TIMEOUT + Duration::from_secs(10));
            let took = killed_at.elapsed();
            assert!(ok && out.contains(&format!("DONE rank {rank}")), "survivor {rank} of {n}:\n{out}");
            assert!(took < KILL_TIMEOUT + Duration::from_secs(1), "survivor {rank} took {took:?} to report");
        }
    }
}

#[test]
fn a_rank_killed_mid_allreduce_fails_every_survivor_in_time_and_survivors_recover() {
    for n in [2, 4, 8] {
        killed_mid_allreduce(n, "elastic");
    }
}

#[test]
fn shared_memory_jobs_of_2_3_4_8_processes_and_64_mib_buffers() {
    for n in [2, 3, 4, 8] {
        let dir = tempfile::tempdir().unwrap();
        run_job(n, "mesh@shm", &format!("file:{}", dir.path().display()));
    }
    for n in [2, 3] {
        let dir = tempfile::tempdir().unwrap();
        run_job(n, "big@shm", &format!("file:{}", dir.path().display()));
    }
    // Large messages read straight from the sender's process.
    for (n, scenario) in [(4, "mesh@shm-single-copy"), (2, "big@shm-single-copy")] {
        let dir = tempfile::tempdir().unwrap();
        run_job(n, scenario, &format!("file:{}", dir.path().display()));
    }
    assert_eq!(shm_objects(), Vec::<String>::new(), "left in /dev/shm");
}

#[test]
fn processes_on_two_pretend_hosts_mix_shared_memory_and_tcp() {
    for n in [2, 3, 5] {
        let dir = tempfile::tempdir().unwrap();
        run_job(n, "mesh@mixed", &format!("file:{}", dir.path().display()));
    }
}

#[test]
fn one_of_4_shared_memory_ranks_killed_mid_allreduce_fails_every_survivor_in_time() {
    // And nothing is left behind: not by the killed rank, not by the survivors.
    killed_mid_allreduce(4, "elastic@shm");
    killed_mid_allreduce(3, "elastic@mixed");
    assert_eq!(shm_objects(), Vec::<String>::new(), "left in /dev/shm");
}

#[test]
fn survivors_of_a_killed_shared_memory_peer_fail_within_the_deadline() {
    for n in [2, 4] {
        let dir = tempfile::tempdir().unwrap();
        let mut children = spawn(n, "kill@shm", &format!("file:{}", dir.path().display()));
        let (killed_at, _) = kill_last_when_ready(&mut children);
        for (rank, c) in children.into_iter().enumerate() {
            let (ok, out) = finish(c, killed_at + KILL_TIMEOUT + Duration::from_secs(10));
            let took = killed_at.elapsed();
            assert!(ok && out.contains(&format!("DONE rank {rank}")), "survivor {rank} of {n}:\n{out}");
            assert!(took < KILL_TIMEOUT + Duration::from_secs(1), "survivor {rank} took {took:?} to report");
        }
    }
}

/// Runs `scenario` (elastic) on `n` processes, SIGKILLs the last one in the middle of an
/// allreduce, and checks every survivor fails in time naming it and recovers.
fn killed_mid_allreduce(n: usize, scenario: &str) {
    {
        let dir = tempfile::tempdir().unwrap();
        let mut children = spawn(n, scenario, &format!("file:{}", dir.path().display()));
        // SIGKILL while it runs its next allreduce; survivors report the wall-clock time of
        // their error, so compare in wall-clock time.
        let (_, killed_at) = kill_last_when_ready(&mut children);
        let deadline = Instant::now() + KILL_TIMEOUT + WORKER_TIMEOUT * 2;
        for (rank, c) in children.into_iter().enumerate() {
            let (ok, out) = finish(c, deadline);
            assert!(ok && out.contains(&format!("DONE rank {rank}")), "survivor {rank} of {n}:\n{out}");
            let at: u128 = out
                .lines()
                .find_map(|l| l.split("ERROR_AT ").nth(1)) // the harness's "test ... " may precede it
                .and_then(|l| l.split(' ').next())
                .and_then(|t| t.parse().ok())
                .unwrap_or_else(|| panic!("survivor {rank} of {n} printed no error time:\n{out}"));
            let took = Duration::from_nanos(at.saturating_sub(killed_at.as_nanos()) as u64);
            println!("{n} ranks: survivor {rank} failed {took:?} after the kill");
            assert!(took < KILL_TIMEOUT + Duration::from_secs(1), "survivor {rank} of {n} took {took:?} to fail");
        }
    }
}

#[test]
fn launch_spawn_local_runs_a_job_and_reports_failures() {
    // The library's own launcher, run in a child process (it re-executes its binary).
    let run = |scenario: &str| {
        Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "launcher_parent", "--nocapture", "--test-threads=1"])
            .env("FERROGLOO_TEST_LAUNCH", scenario)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
    };
    assert!(run("mesh").success(), "spawn_local failed on a good job");
    assert!(!run("bogus").success(), "spawn_local must report a failing rank");
}

/// Starts `launcher_parent` with scenario `linger` (3 ranks that stay alive) and returns it
/// with the ranks' process ids, read from its output.
fn lingering_job() -> (Child, Vec<u32>) {
    let mut parent = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "launcher_parent", "--nocapture", "--test-threads=1"])
        .env("FERROGLOO_TEST_LAUNCH", "linger")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(parent.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            // (The test harness may print its own words before it on the line.)
            if let Some(pid) = line.split("PID ").nth(1).and_then(|p| p.trim().parse::<u32>().ok()) {
                let _ = tx.send(pid);
            }
        }
    });
    let deadline = Instant::now() + WORKER_TIMEOUT;
    let pids: Vec<u32> =
        (0..3).map_while(|_| rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).ok()).collect();
    assert_eq!(pids.len(), 3, "the ranks did not all start");
    (parent, pids)
}

/// Whether process `pid` still runs (a zombie waiting to be reaped does not).
fn running(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name in parentheses: "pid (comm) S ...".
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
    matches!(state, Some(s) if s != "Z" && s != "X")
}

/// Waits until none of `pids` runs, at most `limit`; returns those still running.
fn still_running(pids: &[u32], limit: Duration) -> Vec<u32> {
    let deadline = Instant::now() + limit;
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|&p| running(p)).collect();
        if alive.is_empty() || Instant::now() >= deadline {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_launcher_killed_with_sigkill_leaves_no_rank_running() {
    let (mut parent, pids) = lingering_job();
    assert!(pids.iter().all(|&p| running(p)), "the ranks run before the kill");
    parent.kill().unwrap(); // SIGKILL: no handler of the launcher runs
    let _ = parent.wait();
    let alive = still_running(&pids, Duration::from_secs(5));
    assert!(alive.is_empty(), "ranks {alive:?} outlived their launcher");
}

#[test]
fn sigint_to_a_launcher_is_forwarded_and_the_job_ends_within_the_grace_period() {
    let (mut parent, pids) = lingering_job();
    let t = Instant::now();
    // SAFETY: kill takes plain integers; the parent is our child and still running.
    assert_eq!(unsafe { libc::kill(parent.id() as libc::pid_t, libc::SIGINT) }, 0);
    let status = common::wait_or_kill(&mut parent, Instant::now() + ferrogloo::launch::DEFAULT_GRACE * 2);
    let took = t.elapsed();
    assert!(status.is_some_and(|s| !s.success()), "the launcher reports the interrupted job: {status:?}");
    // The ranks die of the forwarded SIGINT at once, well within the grace period.
    assert!(took < ferrogloo::launch::DEFAULT_GRACE, "the launcher took {took:?} to stop");
    let alive = still_running(&pids, Duration::from_secs(2));
    assert!(alive.is_empty(), "ranks {alive:?} outlived their interrupted launcher");
}

/// Runs `spawn_local` in a process of its own (it re-executes the current binary).
#[test]
#[ignore = "run as a child process by launch_spawn_local_runs_a_job_and_reports_failures"]
fn launcher_parent() {
    let Ok(scenario) = std::env::var("FERROGLOO_TEST_LAUNCH") else { return };
    let args: Vec<String> =
        ["--ignored", "--exact", "rank_worker", "--nocapture", "--test-threads=1"].map(String::from).to_vec();
    // SAFETY: single-threaded at this point of the child process; the variable is read by the
    // grandchildren only.
    unsafe { std::env::set_var(SCENARIO_ENV, &scenario) };
    if let Err(e) = ferrogloo::launch::spawn_local(3, &args, WORKER_TIMEOUT) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}

/// An HTTP store server with a journal, as a process the parent can kill: serves on
/// `FERROGLOO_TEST_SERVER` (address) with journal `FERROGLOO_TEST_JOURNAL`, prints its URL, and
/// runs until killed or until its stdin closes.
#[test]
#[ignore = "run as a child process by a_store_server_killed_and_restarted_mid_rendezvous_loses_nothing"]
fn store_server_worker() {
    let (Ok(addr), Ok(journal)) = (std::env::var("FERROGLOO_TEST_SERVER"), std::env::var("FERROGLOO_TEST_JOURNAL"))
    else {
        return;
    };
    let server = HttpStoreServer::start_with_journal(addr.as_str(), journal).expect("store server");
    println!("URL {}", server.base_url());
    let _ = std::io::stdin().read_line(&mut String::new());
}

/// Starts [`store_server_worker`] on `addr`; returns it and its base URL.
fn start_store_server(addr: &str, journal: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "store_server_worker", "--nocapture", "--test-threads=1"])
        .env("FERROGLOO_TEST_SERVER", addr)
        .env("FERROGLOO_TEST_JOURNAL", journal)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.split("URL ").nth(1).map(str::to_string))
        .expect("the store server printed no URL");
    (child, url)
}

/// Ranks 0 and 1 publish their entries, then wait (on their listeners) for the others; the
/// server is killed; ranks 2 and 3 start and retry against the dead server (each says so on
/// stderr); the server restarts on the same address and journal, and the job forms.
#[test]
fn a_store_server_killed_and_restarted_mid_rendezvous_loses_nothing() {
    use ferrogloo::rendezvous::HttpStore;
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("store.journal");
    let (mut server, base) = start_store_server("127.0.0.1:0", &journal);
    let url = format!("{base}/job");
    let (n, first) = (4, 2);
    let start = Instant::now();

    let mut ranks: Vec<Child> = (0..first).map(|rank| rank_command(rank, n, "mesh", &url).spawn().unwrap()).collect();
    let watcher = HttpStore::new(&base, "job", WORKER_TIMEOUT).unwrap();
    let keys: Vec<String> = (0..first).map(|r| format!("ferrogloo.rank.{r}")).collect();
    watcher.wait(&keys.iter().map(String::as_str).collect::<Vec<_>>(), WORKER_TIMEOUT).expect("entries published");
    server.kill().unwrap();
    server.wait().unwrap();

    // The late ranks find no server: their requests fail and are retried.
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in first..n {
        let mut cmd = rank_command(rank, n, "mesh", &url);
        let mut child = cmd.env("RUST_LOG", "ferrogloo::rendezvous=debug").stderr(Stdio::piped()).spawn().unwrap();
        let (err, tx) = (child.stderr.take().unwrap(), tx.clone());
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                if l.contains("retrying") {
                    let _ = tx.send(rank);
                }
            }
        });
        ranks.push(child);
    }
    let mut retrying = vec![false; n];
    while !retrying[first..].iter().all(|&r| r) {
        let left = WORKER_TIMEOUT.saturating_sub(start.elapsed());
        let rank = rx.recv_timeout(left).expect("every late rank retries while the server is down");
        retrying[rank] = true;
    }

    // Same address, same journal: the early entries are back, and the job forms.
    let (mut server, again) = start_store_server(&base["http://".len()..], &journal);
    assert_eq!(again, base);
    let deadline = start + WORKER_TIMEOUT * 2;
    for (rank, c) in ranks.into_iter().enumerate() {
        let (ok, out) = finish(c, deadline);
        assert!(ok && out.contains(&format!("DONE rank {rank}")), "rank {rank} of {n} failed:\n{out}");
    }
    println!("rendezvous across a server restart: {:?}", start.elapsed());
    server.kill().unwrap();
    server.wait().unwrap();
}
