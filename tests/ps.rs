//! The parameter server with nodes as real processes (this binary re-executes itself as each
//! node, the ignored test `ps_node`) and as threads: results against a sequential reference,
//! rejected keys, a SIGKILLed server, a worker that never arrives.

mod common;

use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::{RANK_ENV, RankEnv, SIZE_ENV};
use ferrogloo::ps::{Handler, Node, PsConfig, Request, Responder, Role, Sharding, SumStore};
use ferrogloo::rendezvous::{HashStore, STORE_ENV, Store};
use ferrogloo::{Error, Result};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SCENARIO_ENV: &str = "FERROGLOO_TEST_PS";
const SERVERS_ENV: &str = "FERROGLOO_TEST_PS_SERVERS";
/// Request deadline of the fault scenario.
const DEADLINE: Duration = Duration::from_secs(6);

/// One node. Does nothing unless started by a test below.
#[test]
#[ignore = "run as a child process by the other tests in this file"]
fn ps_node() {
    if std::env::var_os("DMLC_ROLE").is_some() {
        match dmlc_node() {
            Ok(()) => println!("DONE {}", std::env::var("DMLC_ROLE").unwrap_or_default()),
            Err(e) => {
                println!("ERROR {e}");
                std::process::exit(3);
            }
        }
        return;
    }
    if !RankEnv::is_set() {
        return;
    }
    let env = RankEnv::from_env().expect("rank environment");
    let scenario = std::env::var(SCENARIO_ENV).unwrap_or_default();
    match node(&env, &scenario) {
        Ok(()) => println!("DONE rank {}", env.rank),
        Err(e) => {
            println!("ERROR rank {}: {e}", env.rank);
            std::process::exit(3);
        }
    }
}

/// Values of worker `w`'s push of `key` at `step` (the key's length is `1 + key % 4`).
fn pushed(w: usize, step: usize, key: u64, j: usize) -> i64 {
    (w as i64 + 1) * 1000 + step as i64 * 10 + key as i64 * 3 + j as i64
}

/// Worker `w`'s keys at `step`: a seeded subset of 0..200.
fn keys_of(w: usize, step: usize) -> Vec<u64> {
    let mut x = (w as u64 + 7) * 7919 + step as u64 * 104_729;
    (0..200u64)
        .filter(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33).is_multiple_of(3)
        })
        .collect()
}

/// A store that holds requests with command 99 unanswered (to have requests pending).
#[derive(Clone)]
struct Holding(SumStore<i64>, Vec<Request<i64>>);

impl Handler<i64> for Holding {
    fn handle(&mut self, r: Request<i64>, responder: &Responder<i64>) -> Result<()> {
        if r.meta.cmd == 99 {
            self.1.push(r);
            return Ok(());
        }
        self.0.handle(r, responder)
    }
}

fn node(env: &RankEnv, scenario: &str) -> Result<()> {
    let servers: usize = std::env::var(SERVERS_ENV).ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let workers = env.size - servers;
    let store = ferrogloo::rendezvous::open(&env.store)?;
    let dev = Device::with_transport(Transport::from_env()?, &TcpAttr::loopback())?;
    let (role, id) = if env.rank < servers { (Role::Server, env.rank) } else { (Role::Worker, env.rank - servers) };
    let mut cfg = PsConfig::new(workers, servers);
    cfg.timeout = DEADLINE;
    if scenario == "range" {
        cfg.sharding = Sharding::Range;
    }
    cfg.replication = scenario == "replicated";
    if scenario == "rejoin" {
        return rejoin_scenario(store.into(), &dev, role, id, cfg, env);
    }
    let node = Node::connect(&store, &dev, role, id, cfg)?;
    if role == Role::Server {
        return node.server(Holding(SumStore::default(), Vec::new()))?.run();
    }
    let w = node.worker::<i64>()?;
    match scenario {
        "reference" | "range" | "replicated" => {
            let steps = if scenario == "replicated" { 60 } else { 4 };
            for step in 0..steps {
                if step == 2 && scenario == "replicated" {
                    // The parent kills server 1 now; pushes go on while it dies.
                    println!("HALF rank {}", env.rank);
                }
                let keys = keys_of(id, step);
                let lens: Vec<usize> = keys.iter().map(|k| 1 + (k % 4) as usize).collect();
                let values: Vec<i64> =
                    keys.iter().zip(&lens).flat_map(|(&k, &l)| (0..l).map(move |j| pushed(id, step, k, j))).collect();
                w.wait(w.push(&keys, &values, &lens)?)?;
            }
            if scenario == "replicated" {
                // The final pull must be the backup's: wait (bounded) until server 1 is known dead.
                let until = Instant::now() + DEADLINE;
                while !w.dead_servers().contains(&1) {
                    if Instant::now() > until {
                        return Err(Error::invalid("server 1 was never seen dead"));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            // Every worker's pushes are in before anyone pulls.
            w.barrier()?;
            let all: Vec<u64> = (0..200).collect();
            let got = w.wait(w.pull(&all)?)?;
            let mut at = 0;
            for (&k, &l) in all.iter().zip(&got.lens) {
                let want: Vec<i64> = (0..1 + (k % 4) as usize)
                    .map(|j| {
                        (0..workers)
                            .flat_map(|q| (0..steps).map(move |s| (q, s)))
                            .filter(|&(q, s)| keys_of(q, s).contains(&k))
                            .map(|(q, s)| pushed(q, s, k, j))
                            .sum()
                    })
                    .collect();
                let pushed_at_all = want.iter().any(|&x| x != 0)
                    || (0..workers).any(|q| (0..steps).any(|s| keys_of(q, s).contains(&k)));
                let want = if pushed_at_all { want } else { Vec::new() };
                if got.values[at..at + l] != want[..] {
                    return Err(Error::invalid(format!(
                        "worker {id}: key {k} is {:?}, expected {want:?}",
                        &got.values[at..at + l]
                    )));
                }
                at += l;
            }
            Ok(())
        }
        "kill" => {
            // Keys on both servers (hash sharding), held unanswered.
            let keys: Vec<u64> = (0..40).collect();
            let ts = w.push_with(&keys, &vec![1i64; 40], &[], 99)?;
            println!("PENDING rank {}", env.rank);
            let start = Instant::now();
            let pending = w.wait(ts).err().map(|e| e.to_string()).unwrap_or_default();
            let took = start.elapsed();
            let again = w
                .push(&keys, &vec![1i64; 40], &[])
                .and_then(|ts| w.wait(ts))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            // Keys of the live server alone still work.
            let sharding = Sharding::Hash;
            let live: Vec<u64> = (0..40).filter(|&k| sharding.server_of(k, 2) == 0).collect();
            w.wait(w.push(&live, &vec![2i64; live.len()], &[])?)?;
            let back = w.wait(w.pull(&live)?)?;
            println!("PENDING-ERROR {:.3} {pending}", took.as_secs_f64());
            println!("NEW-ERROR {again}");
            println!("LIVE {:?} DEAD {:?}", back.values.iter().all(|&v| v == 2), w.dead_servers());
            Ok(())
        }
        other => Err(Error::invalid(format!("unknown scenario {other:?}"))),
    }
}

/// Worker 1 dies after 5 of its 10 pushes and comes back (FERROGLOO_TEST_REJOIN set) for the
/// other 5; every key ends at 10 pushes of 1 (worker 0) + 10 of 2 (worker 1).
fn rejoin_scenario(
    store: std::sync::Arc<dyn Store>,
    dev: &Device,
    role: Role,
    id: usize,
    mut cfg: PsConfig,
    env: &RankEnv,
) -> Result<()> {
    cfg.rejoin_wait = Some(Duration::from_secs(30));
    let keys: Vec<u64> = (0..20).collect();
    if role == Role::Server {
        return Node::connect_shared(store, dev, role, id, cfg)?.server(SumStore::<i64>::default())?.run();
    }
    let again = std::env::var_os("FERROGLOO_TEST_REJOIN").is_some();
    let node = if again { Node::rejoin(&*store, dev, id, cfg)? } else { Node::connect(&*store, dev, role, id, cfg)? };
    let w = node.worker::<i64>()?;
    let steps = match (id, again) {
        (0, _) => 0..10,
        (_, false) => 0..5,
        (_, true) => 5..10,
    };
    for _ in steps {
        w.wait(w.push(&keys, &vec![id as i64 + 1; keys.len()], &[])?)?;
    }
    if id == 0 {
        store.set("ps-test/w0-done", b"1")?;
        return Ok(());
    }
    if !again {
        println!("READY rank {}", env.rank);
        // Killed by the parent here (bounded, should it not be).
        std::thread::sleep(DEADLINE * 5);
        return Err(Error::invalid("worker 1 was not killed"));
    }
    store.get("ps-test/w0-done", DEADLINE)?;
    let got = w.wait(w.pull(&keys)?)?;
    if got.values != vec![30i64; keys.len()] {
        return Err(Error::invalid(format!("after the rejoin the keys hold {:?}, expected 30 each", got.values)));
    }
    Ok(())
}

/// A node started the ps-lite way: everything from `DMLC_*`.
fn dmlc_node() -> Result<()> {
    use ferrogloo::ps::{EnvRole, config_from_env, role_from_env, run_scheduler};
    if role_from_env()? == EnvRole::Scheduler {
        return run_scheduler(Duration::from_secs(30));
    }
    let node = Node::from_env(config_from_env()?)?;
    if node.role() == Role::Server {
        return node.server(SumStore::<f32>::default())?.run();
    }
    let w = node.worker::<f32>()?;
    w.wait(w.push(&[1, 2, 3], &[1.0, 2.0, 3.0], &[])?)?;
    let n = w.id();
    println!("WORKER {n}");
    Ok(())
}

struct Job {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, String)>,
    tx: mpsc::Sender<(usize, String)>,
    url: String,
    servers: usize,
    n: usize,
    scenario: String,
    _dir: tempfile::TempDir,
}

fn start(servers: usize, workers: usize, scenario: &str) -> Job {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file:{}", dir.path().display());
    let n = servers + workers;
    let (tx, lines) = mpsc::channel();
    let mut job = Job { children: Vec::new(), lines, tx, url, servers, n, scenario: scenario.to_string(), _dir: dir };
    for rank in 0..n {
        let c = job.spawn(rank, &[]);
        job.children.push(c);
    }
    job
}

impl Job {
    /// Starts node `rank` (again), with `extra` variables.
    fn spawn(&self, rank: usize, extra: &[(&str, &str)]) -> Child {
        let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
        cmd.args(["--ignored", "--exact", "ps_node", "--nocapture", "--test-threads=1"])
            .env(RANK_ENV, rank.to_string())
            .env(SIZE_ENV, self.n.to_string())
            .env(STORE_ENV, &self.url)
            .env(SCENARIO_ENV, &self.scenario)
            .env(SERVERS_ENV, self.servers.to_string())
            .stdout(Stdio::piped());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn a node");
        let out = child.stdout.take().expect("piped stdout");
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                let _ = tx.send((rank, line));
            }
        });
        child
    }

    /// Lines until every rank of `ranks` printed one containing `what`.
    fn wait_for(&self, what: &str, ranks: &[usize], deadline: Instant) -> Vec<(usize, String)> {
        let (mut seen, mut all) = (Vec::new(), Vec::new());
        while !ranks.iter().all(|r| seen.contains(r)) {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok((r, line)) => {
                    if line.contains(what) {
                        seen.push(r);
                    }
                    all.push((r, line));
                }
                Err(_) => panic!("ranks {ranks:?} did not all print {what:?} in time; lines: {all:?}"),
            }
        }
        all
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn processes_get_the_sequential_sums_for_random_keys_and_lengths_on_several_servers() {
    for (servers, workers, scenario) in [(3, 3, "reference"), (1, 2, "reference"), (2, 4, "range")] {
        let job = start(servers, workers, scenario);
        let all: Vec<usize> = (0..servers + workers).collect();
        let lines = job.wait_for("DONE rank", &all, Instant::now() + Duration::from_secs(60));
        assert!(!lines.iter().any(|(_, l)| l.contains("ERROR")), "{servers} servers, {workers} workers: {lines:?}");
    }
}

#[test]
fn with_replication_the_backup_takes_over_a_sigkilled_server_and_the_sums_are_right() {
    let mut job = start(3, 2, "replicated");
    job.wait_for("HALF rank", &[3, 4], Instant::now() + Duration::from_secs(60));
    job.children[1].kill().expect("SIGKILL server 1");
    let _ = job.children[1].wait();
    let lines = job.wait_for("DONE rank", &[0, 2, 3, 4], Instant::now() + Duration::from_secs(60));
    assert!(!lines.iter().any(|(_, l)| l.contains("ERROR")), "{lines:?}");
}

#[test]
fn a_worker_killed_with_sigkill_and_restarted_rejoins_and_the_sums_are_right() {
    let mut job = start(1, 2, "rejoin");
    job.wait_for("READY rank", &[2], Instant::now() + Duration::from_secs(60));
    job.children[2].kill().expect("SIGKILL worker 1");
    let _ = job.children[2].wait();
    let again = job.spawn(2, &[("FERROGLOO_TEST_REJOIN", "1")]);
    job.children[2] = again;
    let lines = job.wait_for("DONE rank", &[0, 1, 2], Instant::now() + Duration::from_secs(60));
    assert!(!lines.iter().any(|(_, l)| l.contains("ERROR")), "{lines:?}");
}

#[test]
fn a_sigkilled_server_fails_pending_and_new_requests_in_time_naming_it() {
    let mut job = start(2, 1, "kill");
    job.wait_for("PENDING rank", &[2], Instant::now() + Duration::from_secs(60));
    job.children[1].kill().expect("SIGKILL server 1");
    let _ = job.children[1].wait();
    let lines = job.wait_for("DONE rank", &[2], Instant::now() + DEADLINE + Duration::from_secs(10));
    let line = |p: &str| lines.iter().find(|(_, l)| l.contains(p)).map(|(_, l)| l.clone()).unwrap_or_default();
    let pending = line("PENDING-ERROR");
    assert!(pending.contains("server 1") && pending.contains("keys ["), "{pending}");
    let took: f64 = pending.split_whitespace().nth(1).and_then(|d| d.parse().ok()).unwrap_or(f64::MAX);
    assert!(took < DEADLINE.as_secs_f64(), "the pending request failed after {took} s");
    assert!(line("NEW-ERROR").contains("server 1"), "{lines:?}");
    assert!(line("LIVE").contains("LIVE true DEAD [1]"), "{lines:?}");
}

fn in_process<T: Send>(
    workers: usize,
    servers: usize,
    arrive: &[(Role, usize)],
    timeout: Duration,
    f: impl Fn(Node) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let store = HashStore::new();
    let mut cfg = PsConfig::new(workers, servers);
    cfg.timeout = timeout;
    std::thread::scope(|s| {
        let hs: Vec<_> = arrive
            .iter()
            .map(|&(role, id)| {
                let (store, cfg, f) = (&store, cfg.clone(), &f);
                s.spawn(move || f(Node::connect(store as &dyn Store, &Device::in_process(), role, id, cfg)?))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("node thread")).collect()
    })
}

#[test]
fn unsorted_duplicate_and_misfit_keys_are_rejected_with_a_clear_error() {
    let r = in_process(1, 1, &[(Role::Server, 0), (Role::Worker, 0)], Duration::from_secs(20), |node| {
        if node.role() == Role::Server {
            node.server(SumStore::<f32>::default())?.run()?;
            return Ok(Vec::new());
        }
        let w = node.worker::<f32>()?;
        let errs = vec![
            w.push(&[3, 1], &[1.0, 2.0], &[]).err(),
            w.push(&[1, 1], &[1.0, 2.0], &[]).err(),
            w.pull(&[5, 9, 7]).err(),
            w.push(&[1, 2], &[1.0, 2.0, 3.0], &[]).err(),
            w.push(&[1, 2], &[1.0, 2.0, 3.0], &[1, 1]).err(),
        ];
        // A key's length is fixed by its first push: a push of another length is refused.
        w.wait(w.push(&[4], &[1.0, 1.0], &[])?)?;
        let refused = w.wait(w.push(&[4], &[1.0], &[])?).err();
        Ok(errs.into_iter().chain([refused]).map(|e| e.map(|e| e.to_string()).unwrap_or_default()).collect())
    });
    let r = common::all_ok(r);
    let e = &r[1];
    assert!(e[0].contains("keys must be sorted and unique: key 1 at index 1 comes after key 3 at index 0"), "{e:?}");
    assert!(e[1].contains("key 1 at index 1 repeats key 1 at index 0"), "{e:?}");
    assert!(e[2].contains("pull: keys must be sorted and unique: key 7 at index 2 comes after key 9"), "{e:?}");
    assert!(e[3].contains("3 values do not split evenly over 2 keys"), "{e:?}");
    assert!(e[4].contains("the lengths add up to Some(2) values, not the 3 given"), "{e:?}");
    assert!(e[5].contains("server 0 refused the push: key 4 holds 2 values, the push has 1"), "{e:?}");
}

#[test]
fn a_worker_that_never_arrives_times_out_naming_the_role() {
    let start = Instant::now();
    let r = in_process(2, 1, &[(Role::Server, 0), (Role::Worker, 0)], Duration::from_secs(2), |_| Ok(()));
    for e in r {
        let e = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("1 of 2 workers missing (workers [1])"), "{e}");
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn sharding_spreads_dense_keys_by_hash_and_keeps_ranges_by_range() {
    let per = |s: &Sharding| {
        (0..1000u64).fold(vec![0; 4], |mut c, k| {
            c[s.server_of(k, 4)] += 1;
            c
        })
    };
    assert!(per(&Sharding::Hash).iter().all(|&c| c > 200), "{:?}", per(&Sharding::Hash));
    assert_eq!(per(&Sharding::Range), vec![1000, 0, 0, 0]);
    assert_eq!(Sharding::Range.server_of(u64::MAX, 4), 3);
    let custom = Sharding::Custom(std::sync::Arc::new(|k, n| (k as usize) % n));
    assert_eq!(per(&custom), vec![250; 4]);
}

#[test]
fn a_job_started_with_ps_lite_variables_runs() {
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port");
    let roles = ["scheduler", "server", "worker", "worker"];
    let mut children: Vec<Child> = roles
        .iter()
        .map(|role| {
            Command::new(std::env::current_exe().expect("test binary"))
                .args(["--ignored", "--exact", "ps_node", "--nocapture", "--test-threads=1"])
                .env("DMLC_ROLE", role)
                .env("DMLC_NUM_WORKER", "2")
                .env("DMLC_NUM_SERVER", "1")
                .env("DMLC_PS_ROOT_URI", "127.0.0.1")
                .env("DMLC_PS_ROOT_PORT", port.to_string())
                .env_remove(STORE_ENV)
                .env_remove(RANK_ENV)
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn a node")
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut outs = Vec::new();
    for c in &mut children {
        let out = c.stdout.take().expect("stdout");
        let reader = std::thread::spawn(move || std::io::read_to_string(out).unwrap_or_default());
        let st = common::wait_or_kill(c, deadline);
        outs.push((st.is_some_and(|s| s.success()), reader.join().unwrap_or_default()));
    }
    for (role, (ok, out)) in roles.iter().zip(&outs) {
        assert!(*ok && out.contains(&format!("DONE {role}")), "{role}: {out}");
    }
    let ids: Vec<&str> = outs.iter().flat_map(|(_, o)| o.lines().filter_map(|l| l.split("WORKER ").nth(1))).collect();
    assert_eq!(ids.len(), 2, "{outs:?}");
    assert_ne!(ids[0], ids[1], "the workers got numbers of their own");
}
