//! The parameter server with nodes as real processes (this binary re-executes itself as each
//! node, the ignored test `ps_node`) and as threads: results against a sequential reference,
//! rejected keys, a SIGKILLed server, a worker that never arrives.

mod common;

use ferrogloo::config::{FERROGLOO_RANK as RANK_ENV, FERROGLOO_SIZE as SIZE_ENV, FERROGLOO_STORE as STORE_ENV};
use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::RankEnv;
use ferrogloo::ps::{AsyncSgd, Handler, Node, PsConfig, Request, Responder, Role, Sharding, SumStore, SyncSgd};
use ferrogloo::rendezvous::{HashStore, Store};
use ferrogloo::{Context, Element, Error, Result};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
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
struct Holding(SumStore<i64>, Vec<Request<'static, i64>>);

impl Handler<i64> for Holding {
    fn handle(&mut self, r: Request<'_, i64>, responder: &Responder<i64>) -> Result<()> {
        if r.meta.cmd == 99 {
            self.1.push(r.into_owned());
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
    let (node, role, id, workers) = if scenario == "shrunk" {
        shrunk_node(env, &*store, &dev, servers)?
    } else {
        (Node::connect(&store, &dev, role, id, cfg)?, role, id, workers)
    };
    if role == Role::Server {
        return node.server(Holding(SumStore::default(), Vec::new()))?.run();
    }
    let w = node.worker::<i64>()?;
    match scenario {
        "reference" | "range" | "replicated" | "shrunk" => {
            let replicated = matches!(scenario, "replicated" | "shrunk");
            let steps = if replicated { 60 } else { 4 };
            for step in 0..steps {
                if step == 2 && replicated {
                    // The parent kills server 1 now; pushes go on while it dies.
                    println!("HALF rank {}", env.rank);
                }
                let keys = keys_of(id, step);
                let lens: Vec<usize> = keys.iter().map(|k| 1 + (k % 4) as usize).collect();
                let values: Vec<i64> =
                    keys.iter().zip(&lens).flat_map(|(&k, &l)| (0..l).map(move |j| pushed(id, step, k, j))).collect();
                w.wait(w.push(&keys, &values, &lens)?)?;
            }
            if replicated {
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

/// The "shrunk" scenario's node: the world is the parameter server's ranks plus rank 1, which
/// the parent SIGKILLs once it printed `DOOMED`; the others see it gone in a barrier, shrink
/// the world and make the survivors' context a replicated parameter server of `servers`
/// servers (its ranks `0..servers`: world ranks 0, 2, 3, ...) and the rest workers.
fn shrunk_node(env: &RankEnv, store: &dyn Store, dev: &Device, servers: usize) -> Result<(Node, Role, usize, usize)> {
    let world = Context::builder(env.rank, env.size).timeout(DEADLINE).connect(store, dev)?;
    if env.rank == 1 {
        println!("DOOMED rank 1");
        std::thread::sleep(Duration::from_secs(60));
        return Err(Error::invalid("rank 1 was not killed"));
    }
    match world.barrier() {
        Err(Error::PeerClosed { rank: 1, .. }) => {}
        other => return Err(Error::invalid(format!("the barrier did not lose rank 1: {other:?}"))),
    }
    let shrunk = world.shrink()?;
    let workers = shrunk.size() - servers;
    let (role, id) =
        if shrunk.rank() < servers { (Role::Server, shrunk.rank()) } else { (Role::Worker, shrunk.rank() - servers) };
    let mut cfg = PsConfig::new(workers, servers);
    cfg.timeout = DEADLINE;
    cfg.replication = true;
    Ok((Node::over(shrunk, role, id, cfg)?, role, id, workers))
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
    /// Every line read so far (a node may print what a later wait looks for early).
    history: std::cell::RefCell<Vec<(usize, String)>>,
    tx: mpsc::Sender<(usize, String)>,
    url: String,
    servers: usize,
    n: usize,
    scenario: String,
    _dir: tempfile::TempDir,
}

fn start(servers: usize, workers: usize, scenario: &str) -> Job {
    start_with(servers, workers, 0, scenario)
}

/// [`start`], with `extra` ranks more in the world than the parameter server has.
fn start_with(servers: usize, workers: usize, extra: usize, scenario: &str) -> Job {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file:{}", dir.path().display());
    let n = servers + workers + extra;
    let (tx, lines) = mpsc::channel();
    let mut job = Job {
        children: Vec::new(),
        lines,
        history: Default::default(),
        tx,
        url,
        servers,
        n,
        scenario: scenario.to_string(),
        _dir: dir,
    };
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

    /// Lines until every rank of `ranks` printed one containing `what` (lines read by earlier
    /// waits count too: a node may have printed it while the test waited for something else).
    fn wait_for(&self, what: &str, ranks: &[usize], deadline: Instant) -> Vec<(usize, String)> {
        let mut all = self.history.borrow_mut();
        let mut seen: Vec<usize> = all.iter().filter(|(_, l)| l.contains(what)).map(|(r, _)| *r).collect();
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
        all.clone()
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
fn on_a_shrunk_context_the_backup_takes_over_a_sigkilled_server_and_the_sums_are_right() {
    // World ranks 0..6: rank 1 dies first, and the survivors shrink; the parameter server of
    // 3 servers and 2 workers runs on their context, and its server 1 (world rank 2) dies
    // mid-way: its backup takes over, and every worker's final pull has every sum.
    let mut job = start_with(3, 2, 1, "shrunk");
    job.wait_for("DOOMED rank 1", &[1], Instant::now() + Duration::from_secs(60));
    job.children[1].kill().expect("SIGKILL rank 1");
    let _ = job.children[1].wait();
    job.wait_for("HALF rank", &[4, 5], Instant::now() + Duration::from_secs(60));
    job.children[2].kill().expect("SIGKILL server 1");
    let _ = job.children[2].wait();
    let lines = job.wait_for("DONE rank", &[0, 3, 4, 5], Instant::now() + Duration::from_secs(60));
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
    let mut cfg = PsConfig::new(workers, servers);
    cfg.timeout = timeout;
    threads(cfg, &|| Ok(Device::in_process()), arrive, f)
}

/// Nodes as threads of this process, each with a device of its own from `device`, meeting
/// through one store; returns each node's result in the order of `arrive`.
fn threads<T: Send>(
    cfg: PsConfig,
    device: &(dyn Fn() -> Result<Device> + Sync),
    arrive: &[(Role, usize)],
    f: impl Fn(Node) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    members(arrive.len(), |i, store| {
        let (role, id) = arrive[i];
        f(Node::connect(&**store, &device()?, role, id, cfg.clone())?)
    })
}

/// `n` threads running `f(i, store)`, all with the same store; returns their results in order.
fn members<T: Send>(n: usize, f: impl Fn(usize, &Arc<dyn Store>) -> Result<T> + Sync) -> Vec<Result<T>> {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let (store, f) = (&store, &f);
                s.spawn(move || f(i, store))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("node thread")).collect()
    })
}

/// The tag of parameter-server messages (src/ps/mod.rs), for tests that play a worker that
/// breaks the rules with a context of its own.
const PS_TAG: u32 = 0x5053_0001;

/// A parameter-server message as src/ps/wire.rs lays it out: `kind u8 | dtype u8 | cmd i32 |
/// timestamp u64 | shard u32 | key count u32 | keys u64… | length count u32 | lengths u64… |
/// padding to 8 | values`, little-endian. Kinds: push 1, pull 2, reply 4, error 5, bye 6.
fn ps_message(kind: u8, ts: u64, keys: &[u64], lens: &[u64], values: &[u8]) -> Vec<u8> {
    let mut b = vec![kind, <f32 as Element>::DTYPE as u8];
    b.extend_from_slice(&0i32.to_le_bytes());
    b.extend_from_slice(&ts.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    for words in [keys, lens] {
        b.extend_from_slice(&(words.len() as u32).to_le_bytes());
        words.iter().for_each(|w| b.extend_from_slice(&w.to_le_bytes()));
    }
    b.resize(b.len().next_multiple_of(8), 0);
    b.extend_from_slice(values);
    b
}

/// Worker `id` of a job of `servers` servers and `workers` workers as a bare context (no
/// parameter-server worker: it sends what the test says).
fn bare_worker(store: &Arc<dyn Store>, servers: usize, workers: usize, id: usize) -> Result<Context> {
    Context::builder(servers + id, servers + workers).timeout(common::TIMEOUT).connect(&**store, &Device::in_process())
}

/// Sends `msg` to server 0 and returns the answer's kind and its text (an error's reason).
fn ask(ctx: &Context, msg: &[u8]) -> Result<(u8, String)> {
    ctx.send(0, PS_TAG, msg)?;
    answer_of(ctx)
}

/// Server 0's next answer: its kind and its text (an error's reason).
fn answer_of(ctx: &Context) -> Result<(u8, String)> {
    let answer = ctx.recv_bytes(0, PS_TAG, 1 << 20)?;
    let kind = answer.first().copied().unwrap_or(0);
    let text =
        if kind == 5 { String::from_utf8_lossy(answer.get(32..).unwrap_or(&[])).into_owned() } else { String::new() };
    Ok((kind, text))
}

#[test]
fn malformed_requests_are_refused_and_the_server_goes_on() {
    let r = members(2, |i, store| {
        if i == 0 {
            let node = Node::connect(&**store, &Device::in_process(), Role::Server, 0, PsConfig::new(1, 1))?;
            node.server(SyncSgd::new(1, 1.0))?.run()?;
            return Ok(Vec::new());
        }
        let ctx = bare_worker(store, 1, 1, 0)?;
        let two = [1f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let answers = vec![
            // A pull with lengths and values (the handler indexed the values by the lengths).
            ask(&ctx, &ps_message(2, 1, &[3], &[5], &[]))?,
            ask(&ctx, &ps_message(2, 2, &[3], &[], &two))?,
            // A push whose values are not a whole number of f32s.
            ask(&ctx, &ps_message(1, 3, &[3], &[2], &two[..7]))?,
            // Lengths that do not add up; keys out of order.
            ask(&ctx, &ps_message(1, 4, &[3], &[3], &two))?,
            ask(&ctx, &ps_message(1, 5, &[4, 3], &[1, 1], &two))?,
            // A good push and pull: the server still serves.
            ask(&ctx, &ps_message(1, 6, &[3], &[2], &two))?,
            ask(&ctx, &ps_message(2, 7, &[3], &[], &[]))?,
        ];
        ctx.send(0, PS_TAG, &ps_message(6, 0, &[], &[], &[]))?;
        Ok(answers)
    });
    let r = common::all_ok(r);
    let a = &r[1];
    assert!(a[0].0 == 5 && a[0].1.contains("a pull carries no values, this one has 0 values and 1 lengths"), "{a:?}");
    assert!(a[1].0 == 5 && a[1].1.contains("a pull carries no values, this one has 2 values and 0 lengths"), "{a:?}");
    assert!(a[2].0 == 5 && a[2].1.contains("7 bytes, not a whole number of 4-byte values"), "{a:?}");
    assert!(a[3].0 == 5 && a[3].1.contains("the lengths add up to Some(3) values, not the 2 given"), "{a:?}");
    assert!(a[4].0 == 5 && a[4].1.contains("keys must be sorted and unique"), "{a:?}");
    assert_eq!((a[5].0, a[6].0), (4, 4), "{a:?}");
}

/// The tag of a push's values that follow its head (src/ps/mod.rs).
const PS_VALUES_TAG: u32 = 0x5053_0002;

#[test]
fn a_push_head_that_is_malformed_or_whose_values_do_not_fit_is_refused_and_the_server_goes_on() {
    // A push whose values follow its head (kind 9): the server takes the next message on the
    // values' tag whatever the head is, and refuses what does not hold together.
    let r = members(2, |i, store| {
        if i == 0 {
            let node = Node::connect(&**store, &Device::in_process(), Role::Server, 0, PsConfig::new(1, 1))?;
            node.server(SumStore::<f32>::default())?.run()?;
            return Ok(Vec::new());
        }
        let ctx = bare_worker(store, 1, 1, 0)?;
        let split = |head: Vec<u8>, values: &[u8]| -> Result<(u8, String)> {
            ctx.send(0, PS_TAG, &head)?;
            ctx.send(0, PS_VALUES_TAG, values)?;
            answer_of(&ctx)
        };
        let four: Vec<u8> = [1f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let answers = vec![
            // No length for its key; values in the head itself.
            split(ps_message(9, 1, &[3], &[], &[]), &four)?,
            split(ps_message(9, 2, &[3], &[4], &four), &four)?,
            // Fewer and more values than the head says.
            split(ps_message(9, 3, &[3], &[4], &[]), &four[..8])?,
            split(ps_message(9, 4, &[3], &[2], &[]), &four)?,
            // A good one (a new key), then one summed as it arrives, then a pull.
            split(ps_message(9, 5, &[3], &[4], &[]), &four)?,
            split(ps_message(9, 6, &[3], &[4], &[]), &four)?,
            ask(&ctx, &ps_message(2, 7, &[3], &[], &[]))?,
        ];
        ctx.send(0, PS_TAG, &ps_message(6, 0, &[], &[], &[]))?;
        Ok(answers)
    });
    let r = common::all_ok(r);
    let a = &r[1];
    assert!(a[0].0 == 5 && a[0].1.contains("0 lengths and 1 keys"), "{a:?}");
    assert!(a[1].0 == 5 && a[1].1.contains("16 bytes of values"), "{a:?}");
    assert!(a[2].0 == 5 && a[2].1.contains("announced 16 bytes of values, 8 came"), "{a:?}");
    assert!(a[3].0 == 5 && a[3].1.contains("the push's values"), "{a:?}");
    assert_eq!((a[4].0, a[5].0, a[6].0), (4, 4, 4), "{a:?}");
}

#[test]
fn messages_that_are_no_request_are_skipped_and_the_server_goes_on() {
    let r = members(3, |i, store| {
        let cfg = PsConfig::new(2, 1);
        match i {
            0 => {
                let node = Node::connect(&**store, &Device::in_process(), Role::Server, 0, cfg)?;
                node.server(SumStore::<f32>::default())?.run()?;
                Ok(String::new())
            }
            1 => {
                let ctx = bare_worker(store, 1, 2, 0)?;
                ctx.send(0, PS_TAG, &[0xff, 0xff, 0xff])?; // undecodable
                ctx.send(0, PS_TAG, &ps_message(4, 1, &[], &[], &[]))?; // a reply, to a server
                // Over the largest message (1 GiB): the server reads past it.
                ctx.send(0, PS_TAG, &vec![0u8; (1 << 30) + 1])?;
                let (kind, text) = ask(&ctx, &ps_message(1, 2, &[3], &[1], &1f32.to_le_bytes()))?;
                ctx.send(0, PS_TAG, &ps_message(6, 0, &[], &[], &[]))?;
                Ok(format!("{kind} {text}"))
            }
            _ => {
                // A worker does not send what no server would take.
                let node = Node::connect(&**store, &Device::in_process(), Role::Worker, 1, cfg)?;
                let w = node.worker::<f32>()?;
                let big = vec![0f32; 1 << 28];
                Ok(w.push(&[1], &big, &[]).err().map(|e| e.to_string()).unwrap_or_default())
            }
        }
    });
    let r = common::all_ok(r);
    assert_eq!(r[1], "4 ", "the good push after the bad messages was answered");
    assert!(
        r[2].contains("the message to server 0 (1 of the keys) would be 1073741872 bytes, more than the 1073741824"),
        "{}",
        r[2]
    );
}

/// [`SyncSgd`] that holds worker 0's first request until told to go, and says whose request
/// it got.
#[derive(Clone)]
struct Gated {
    inner: SyncSgd,
    arrived: mpsc::Sender<usize>,
    go: Arc<Mutex<mpsc::Receiver<()>>>,
    held: bool,
}

impl Handler<f32> for Gated {
    fn handle(&mut self, r: Request<'_, f32>, responder: &Responder<f32>) -> Result<()> {
        let _ = self.arrived.send(r.meta.worker);
        if r.meta.worker == 0 && !self.held {
            self.held = true;
            let go = self.go.lock().map_err(|_| Error::invalid("poisoned"))?.recv_timeout(common::TIMEOUT);
            go.map_err(|_| Error::invalid("never told to go"))?;
        }
        self.inner.handle(r, responder)
    }

    fn worker_left(&mut self, worker: usize, responder: &Responder<f32>) -> Result<()> {
        self.inner.worker_left(worker, responder)
    }
}

#[test]
fn a_worker_dying_while_its_round_is_answered_leaves_the_others_served() {
    let (arrived_tx, arrived) = mpsc::channel();
    let (go_tx, go) = mpsc::channel();
    let arrived = Mutex::new(arrived);
    let gated = Gated { inner: SyncSgd::new(2, 1.0), arrived: arrived_tx, go: Arc::new(Mutex::new(go)), held: false };
    let gated = Mutex::new(Some(gated));
    let go_tx = Mutex::new(go_tx);
    let (w1_pushed, w1_pushed_rx) = mpsc::channel::<()>();
    let w1_pushed = Mutex::new(w1_pushed);
    let w1_pushed_rx = Mutex::new(w1_pushed_rx);
    let r = members(3, |i, store| {
        let cfg = PsConfig::new(2, 1);
        match i {
            0 => {
                let handler =
                    gated.lock().ok().and_then(|mut g| g.take()).ok_or_else(|| Error::invalid("no handler"))?;
                Node::connect(&**store, &Device::in_process(), Role::Server, 0, cfg)?.server(handler)?.run()?;
                Ok(Vec::new())
            }
            1 => {
                // Worker 1 pushes, and dies once the server holds worker 0's push of the same
                // round: answering the round then fails to reach it.
                let ctx = bare_worker(store, 1, 2, 1)?;
                let arrived = arrived.lock().map_err(|_| Error::invalid("poisoned"))?;
                let next = || arrived.recv_timeout(common::TIMEOUT).map_err(|_| Error::invalid("no request arrived"));
                ctx.send(0, PS_TAG, &ps_message(1, 1, &[1], &[1], &1f32.to_le_bytes()))?;
                if next()? != 1 {
                    return Err(Error::invalid("worker 0's request came first"));
                }
                let _ = w1_pushed.lock().map(|t| t.send(()));
                if next()? != 0 {
                    return Err(Error::invalid("not worker 0's request"));
                }
                drop(ctx);
                let _ = go_tx.lock().map(|t| t.send(()));
                Ok(Vec::new())
            }
            _ => {
                let w = Node::connect(&**store, &Device::in_process(), Role::Worker, 0, cfg)?.worker::<f32>()?;
                let pushed = w1_pushed_rx.lock().map_err(|_| Error::invalid("poisoned"))?.recv_timeout(common::TIMEOUT);
                pushed.map_err(|_| Error::invalid("worker 1 never pushed"))?;
                // Round 1 with worker 1: w = -(1 + 3) / 2; round 2 alone: w -= 3.
                w.wait(w.push(&[1], &[3.0], &[])?)?;
                w.wait(w.push(&[1], &[3.0], &[])?)?;
                Ok(w.wait(w.pull(&[1])?)?.values)
            }
        }
    });
    let r = common::all_ok(r);
    assert_eq!(r[2], [-5.0]);
}

#[test]
fn on_a_shrunk_context_a_worker_dying_leaves_the_other_served() {
    // World ranks 0..4; rank 1 dies at once and the others shrink: server 0 (world 0), worker 0
    // (world 2) and worker 1 (world 3, which dies after round 1 without a goodbye). The server
    // must see which worker its closed connection was (errors name world ranks) for round 2
    // to go on with worker 0 alone.
    let (died_tx, died) = mpsc::channel::<()>();
    let (died_tx, died) = (Mutex::new(died_tx), Mutex::new(died));
    let r = members(4, |i, store| {
        let world = Context::builder(i, 4).timeout(common::TIMEOUT).connect(&**store, &Device::in_process())?;
        if i == 1 {
            return Ok(Vec::new());
        }
        match world.barrier() {
            Err(Error::PeerClosed { rank: 1, .. }) => {}
            other => return Err(Error::invalid(format!("the barrier did not lose rank 1: {other:?}"))),
        }
        let shrunk = world.shrink()?;
        drop(world);
        let cfg = PsConfig::new(2, 1);
        match i {
            0 => {
                Node::over(shrunk, Role::Server, 0, cfg)?.server(SyncSgd::new(2, 1.0))?.run()?;
                Ok(Vec::new())
            }
            3 => {
                // Round 1's push, answered once worker 0 pushed too; then gone, no goodbye.
                let (kind, why) = ask(&shrunk, &ps_message(1, 1, &[1], &[1], &1f32.to_le_bytes()))?;
                if kind != 4 {
                    return Err(Error::invalid(format!("round 1 answered with kind {kind}: {why}")));
                }
                drop(shrunk);
                let _ = died_tx.lock().map(|t| t.send(()));
                Ok(Vec::new())
            }
            _ => {
                let w = Node::over(shrunk, Role::Worker, 0, cfg)?.worker::<f32>()?;
                // Round 1 with worker 1: w = -(1 + 3) / 2; round 2 alone: w -= 3.
                w.wait(w.push(&[1], &[3.0], &[])?)?;
                let gone = died.lock().map_err(|_| Error::invalid("poisoned"))?.recv_timeout(common::TIMEOUT);
                gone.map_err(|_| Error::invalid("worker 1 never died"))?;
                w.wait(w.push(&[1], &[3.0], &[])?)?;
                Ok(w.wait(w.pull(&[1])?)?.values)
            }
        }
    });
    let r = common::all_ok(r);
    assert_eq!(r[2], [-5.0]);
}

#[test]
fn node_over_a_context_checks_its_size_and_rank() {
    let r = members(2, |i, store| {
        let ctx = Context::builder(i, 2).connect(&**store, &Device::in_process())?;
        let cfg = PsConfig::new(2, 1);
        let e = Node::over(ctx, Role::Worker, 0, cfg).err().map(|e| e.to_string()).unwrap_or_default();
        Ok(e)
    });
    let r = common::all_ok(r);
    assert!(
        r[1].contains("worker 0 of a parameter server of 1 servers and 2 workers is rank 1 of 3, but this is rank 1 of a context of 2"),
        "{}",
        r[1]
    );
}

/// A TCP device on the loopback interface.
fn tcp() -> Result<Device> {
    Device::tcp(&TcpAttr::loopback())
}

#[test]
fn a_value_of_160_mib_round_trips_over_tcp_and_shared_memory() {
    // Far longer to move than the receiving loops' wait slices (100 ms and less): a receive
    // withdrawn while its message was half read lost the message (the push then failed).
    let n = 40 << 20;
    let values: Vec<f32> = (0..n).map(|i| (i % 1_000_003) as f32).collect();
    let shm = || Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default()));
    let devices: [(&str, &(dyn Fn() -> Result<Device> + Sync)); 2] = [("tcp", &tcp), ("shm", &shm)];
    for (name, device) in devices {
        let mut cfg = PsConfig::new(1, 1);
        cfg.timeout = Duration::from_secs(30);
        let r = threads(cfg, device, &[(Role::Server, 0), (Role::Worker, 0)], |node| {
            if node.role() == Role::Server {
                node.server(SumStore::<f32>::default())?.run()?;
                return Ok(true);
            }
            let w = node.worker::<f32>()?;
            w.wait(w.push(&[7], &values, &[])?)?;
            let got = w.wait(w.pull(&[7])?)?;
            Ok(got.lens == [n] && got.values == values)
        });
        assert_eq!(common::all_ok(r), [true, true], "{name}: the pulled value differs from the pushed one");
    }
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
            w.push(&[], &[1.0], &[]).err(),
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
    assert!(e[5].contains("push: 1 values given for no keys"), "{e:?}");
    assert!(e[6].contains("server 0 refused the push: key 4 holds 2 values, the push has 1"), "{e:?}");
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

/// A [`SumStore`] that answers requests with command 99 only when the next other request
/// comes (before it), and those with command 98 never.
#[derive(Clone, Default)]
struct Deferred(SumStore<f32>, Vec<Request<'static, f32>>);

impl Handler<f32> for Deferred {
    fn handle(&mut self, r: Request<'_, f32>, responder: &Responder<f32>) -> Result<()> {
        match r.meta.cmd {
            98 => Ok(()),
            99 => {
                self.1.push(r.into_owned());
                Ok(())
            }
            _ => {
                for held in std::mem::take(&mut self.1) {
                    self.0.handle(held, responder)?;
                }
                self.0.handle(r, responder)
            }
        }
    }
}

#[test]
fn a_panicking_callback_fails_only_its_request_and_the_worker_goes_on() {
    let r = in_process(1, 1, &[(Role::Server, 0), (Role::Worker, 0)], common::TIMEOUT, |node| {
        if node.role() == Role::Server {
            node.server(Deferred::default())?.run()?;
            return Ok(String::new());
        }
        let w = node.worker::<f32>()?;
        w.wait(w.push(&[1], &[2.0], &[])?)?;
        // On the receiving thread: the answer comes after `then` (the server holds it).
        let ts = w.pull_with(&[1], 99)?;
        w.then(ts, |_| panic!("a callback on the receiving thread"))?;
        // The receiving thread goes on (the next answer comes right after the panicking one).
        let after = w.wait(w.pull(&[1])?)?;
        if after.values != [2.0] {
            return Err(Error::invalid(format!("pulled {:?}", after.values)));
        }
        // Here and now: the panic is `then`'s error.
        let ts = w.pull(&[1])?;
        w.wait(w.pull(&[1])?)?; // answered after `ts`
        Ok(w.then(ts, |_| panic!("a callback here")).err().map(|e| e.to_string()).unwrap_or_default())
    });
    let r = common::all_ok(r);
    assert!(r[1].contains("the callback of parameter-server pull request"), "{}", r[1]);
    assert!(r[1].contains("on worker 0 panicked: a callback here"), "{}", r[1]);
}

#[test]
fn wait_ends_at_the_deadline_even_while_the_receiving_thread_is_busy() {
    let deadline = Duration::from_secs(2);
    let (release, released) = mpsc::channel::<()>();
    let released = Mutex::new(Some(released));
    let r = in_process(1, 1, &[(Role::Server, 0), (Role::Worker, 0)], deadline, |node| {
        if node.role() == Role::Server {
            node.server(Deferred::default())?.run()?;
            return Ok((Duration::ZERO, String::new()));
        }
        let w = node.worker::<f32>()?;
        // A callback that keeps the receiving thread until this test lets it go.
        let held = w.pull_with(&[1], 99)?;
        let rx = released.lock().ok().and_then(|mut r| r.take()).ok_or_else(|| Error::invalid("no channel"))?;
        w.then(held, move |_| {
            let _ = rx.recv_timeout(common::TIMEOUT);
        })?;
        let unanswered = w.push_with(&[5], &[1.0], &[], 98)?;
        let start = Instant::now();
        w.then(w.pull(&[1])?, drop)?; // releases `held` on the server
        let e = w.wait(unanswered).err().map(|e| e.to_string()).unwrap_or_default();
        let took = start.elapsed();
        let _ = release.send(());
        // The receiving thread is back.
        w.wait(w.push(&[1], &[1.0], &[])?)?;
        Ok((took, e))
    });
    let r = common::all_ok(r);
    let (took, e) = &r[1];
    assert!(*took < deadline + Duration::from_secs(3), "the wait took {took:?}");
    assert!(e.contains("parameter-server push request") && e.contains("did not answer for keys [5]"), "{e}");
    assert!(e.contains("timed out after 2.0 s; still waiting for rank 0"), "{e}");
}

#[test]
fn a_wait_receives_its_own_answer_while_a_callback_holds_the_receiving_thread() {
    // The thread that waits receives its answer itself: a callback that keeps the receiving
    // thread does not hold up a wait for another request (before, the wait ran to its
    // deadline), on a transport the receiving thread would drive (TCP) and on one it would not.
    let deadline = Duration::from_secs(10);
    let loopback = || Device::loopback();
    let in_process = || Ok(Device::in_process());
    let devices: [&(dyn Fn() -> Result<Device> + Sync); 2] = [&loopback, &in_process];
    for device in devices {
        let (release, released) = mpsc::channel::<()>();
        let (started, starts) = mpsc::channel::<()>();
        let released = Mutex::new(Some((released, started)));
        let starts = Mutex::new(starts);
        let mut cfg = PsConfig::new(1, 1);
        cfg.timeout = deadline;
        let r = threads(cfg, device, &[(Role::Server, 0), (Role::Worker, 0)], |node| {
            if node.role() == Role::Server {
                node.server(SumStore::<f32>::default())?.run()?;
                return Ok((Duration::ZERO, Vec::new()));
            }
            let w = node.worker::<f32>()?;
            w.wait(w.push(&[1, 2], &[1.0, 2.0], &[])?)?;
            let (rx, started) =
                released.lock().ok().and_then(|mut r| r.take()).ok_or_else(|| Error::invalid("no channel"))?;
            w.then(w.pull(&[1])?, move |_| {
                let _ = started.send(());
                let _ = rx.recv_timeout(common::TIMEOUT);
            })?;
            let ran = starts.lock().map_err(|_| Error::invalid("poisoned"))?.recv_timeout(common::TIMEOUT);
            ran.map_err(|_| Error::invalid("the callback never ran"))?;
            let start = Instant::now();
            let got = w.wait(w.push_pull(&[1, 2], &[10.0, 20.0], &[])?)?.values;
            let took = start.elapsed();
            let _ = release.send(());
            Ok((took, got))
        });
        let r = common::all_ok(r);
        let (took, got) = &r[1];
        assert_eq!(got, &[11.0, 22.0], "the push-pull's sums");
        assert!(*took < deadline / 2, "the wait took {took:?}: it waited for the receiving thread");
    }
}

#[test]
fn large_answers_arrive_whole_into_the_callers_buffer_a_reply_and_a_callback() {
    // Answers of 64 KiB and more come as a head and a message of values, which a caller
    // waiting with its buffer receives there when it is the request's only answer (one
    // server) or, on shared memory, when the request is a push-pull (each answer scattered to
    // its keys' places), and into a buffer of their own otherwise (`wait`, a callback).
    let shm = || Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default()));
    let loopback = || Device::loopback();
    let devices: [&(dyn Fn() -> Result<Device> + Sync); 2] = [&loopback, &shm];
    for (servers, device) in [1, 2].into_iter().flat_map(|s| devices.iter().map(move |d| (s, *d))) {
        let mut cfg = PsConfig::new(1, servers);
        cfg.timeout = common::TIMEOUT;
        let mut arrive: Vec<(Role, usize)> = (0..servers).map(|s| (Role::Server, s)).collect();
        arrive.push((Role::Worker, 0));
        let r = threads(cfg, device, &arrive, |node| {
            if node.role() == Role::Server {
                node.server(SumStore::<f32>::default())?.run()?;
                return Ok(());
            }
            let w = node.worker::<f32>()?;
            let keys = [3u64, 8, 13, 21];
            let lens = [40_000usize, 1, 70_000, 5];
            let n: usize = lens.iter().sum();
            let grad: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
            for round in 1..=3u32 {
                let mut back = vec![-1f32; n];
                let got = w.wait_into(w.push_pull(&keys, &grad, &lens)?, &mut back)?;
                assert_eq!(got, lens, "{servers} servers, round {round}: lengths");
                let want: Vec<f32> = grad.iter().map(|g| g * round as f32).collect();
                assert!(back == want, "{servers} servers, round {round}: values into the buffer");
                assert_eq!(w.wait(w.pull(&keys)?)?.values, want, "{servers} servers, round {round}: a reply");
                let (tx, rx) = mpsc::channel();
                w.then(w.pull(&keys)?, move |r| {
                    let _ = tx.send(r.map(|r| r.values));
                })?;
                let by_callback = rx.recv_timeout(common::TIMEOUT).map_err(|_| Error::invalid("no callback"))??;
                assert!(by_callback == want, "{servers} servers, round {round}: a callback's values");
            }
            Ok(())
        });
        common::all_ok(r);
    }
}

#[test]
fn large_pushes_from_several_threads_are_summed_whole_as_they_arrive() {
    // Pushes of 256 KiB and more to one server go as a head, the server's go, and the values,
    // which a summing store adds in straight from the transport (shared memory, in-process);
    // a handler that does not sum in place (asynchronous SGD) gets them whole. Two workers of
    // two threads each, pushing at once to keys new and old, on one and two servers: every
    // value is added exactly once.
    let shm = || Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default()));
    let in_process = || Ok(Device::in_process());
    let devices: [(&str, &(dyn Fn() -> Result<Device> + Sync)); 2] = [("shm", &shm), ("in-process", &in_process)];
    let keys = [1u64, 5, 9, 40];
    let lens = [200_000usize, 3, 150_000, 70_000];
    let n: usize = lens.iter().sum();
    const ROUNDS: usize = 3;
    let grad = |w: usize, t: usize| -> Vec<f32> { (0..n).map(|i| (i % 89) as f32 + (w * 2 + t) as f32).collect() };
    let total: Vec<f32> = (0..n).map(|i| (ROUNDS * (4 * (i % 89) + 6)) as f32).collect();
    // A third thread per worker pushes small values to a key of its own meanwhile: its
    // messages go between the large pushes', never between a head and its values.
    const SMALL: usize = 300;
    for (name, device) in devices {
        for servers in [1, 2] {
            for sgd in [false, true] {
                let mut cfg = PsConfig::new(2, servers);
                cfg.timeout = common::TIMEOUT;
                let mut arrive: Vec<(Role, usize)> = (0..servers).map(|s| (Role::Server, s)).collect();
                arrive.extend([(Role::Worker, 0), (Role::Worker, 1)]);
                let r = threads(cfg, device, &arrive, |node| {
                    if node.role() == Role::Server {
                        if sgd {
                            node.server(AsyncSgd::new(1.0))?.run()?;
                        } else {
                            node.server(SumStore::<f32>::default())?.run()?;
                        }
                        return Ok(true);
                    }
                    let w = node.worker::<f32>()?;
                    std::thread::scope(|s| {
                        let mut pushing: Vec<_> = (0..2)
                            .map(|t| {
                                let (w, g) = (&w, grad(w.id(), t));
                                s.spawn(move || -> Result<()> {
                                    (0..ROUNDS).try_for_each(|_| w.wait(w.push(&keys, &g, &lens)?).map(drop))
                                })
                            })
                            .collect();
                        let w = &w;
                        pushing.push(s.spawn(move || -> Result<()> {
                            (0..SMALL).try_for_each(|_| w.wait(w.push(&[77], &[1.0; 10], &[10])?).map(drop))
                        }));
                        pushing
                            .into_iter()
                            .try_for_each(|h| h.join().map_err(|_| Error::invalid("a pusher panicked"))?)
                    })?;
                    w.barrier()?;
                    let mut back = vec![0f32; n];
                    w.pull_into(&keys, &mut back)?;
                    let want: Vec<f32> = total.iter().map(|&v| if sgd { -v } else { v }).collect();
                    let mut small = [0f32; 10];
                    w.pull_into(&[77], &mut small)?;
                    let small_want = if sgd { -2.0 * SMALL as f32 } else { 2.0 * SMALL as f32 };
                    Ok(back == want && small.iter().all(|&v| v == small_want))
                });
                let r = common::all_ok(r);
                assert!(r.iter().all(|&ok| ok), "{name}, {servers} server(s), sgd {sgd}: sums differ");
            }
        }
    }
}

/// Answers every two requests at once, from two threads (a handler may answer from any
/// thread): each pull gets its key's number, `TWO_AT_ONCE` times.
#[derive(Clone, Default)]
struct TwoAtOnce(Vec<Request<'static, f32>>);

const TWO_AT_ONCE: usize = 64 << 10;

impl Handler<f32> for TwoAtOnce {
    fn handle(&mut self, r: Request<'_, f32>, responder: &Responder<f32>) -> Result<()> {
        self.0.push(r.into_owned());
        if self.0.len() < 2 {
            return Ok(());
        }
        let requests = std::mem::take(&mut self.0);
        let go = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            let answering: Vec<_> = requests
                .iter()
                .map(|r| {
                    let go = &go;
                    s.spawn(move || {
                        let values = vec![r.keys[0] as f32; TWO_AT_ONCE];
                        go.wait();
                        responder.respond(&r.meta, &r.keys, &values, &[TWO_AT_ONCE])
                    })
                })
                .collect();
            answering
                .into_iter()
                .try_for_each(|h| h.join().map_err(|_| Error::invalid("an answering thread panicked"))?)
        })
    }
}

#[test]
fn large_answers_sent_from_two_threads_at_once_reach_their_own_requests() {
    // An answer of 64 KiB or more goes as a head and its values: two of them racing to one
    // worker must not cross (each pull gets its own key's values, never the other's).
    let loopback = || Device::loopback();
    let in_process = || Ok(Device::in_process());
    let devices: [&(dyn Fn() -> Result<Device> + Sync); 2] = [&loopback, &in_process];
    for device in devices {
        let mut cfg = PsConfig::new(1, 1);
        cfg.timeout = common::TIMEOUT;
        let r = threads(cfg, device, &[(Role::Server, 0), (Role::Worker, 0)], |node| {
            if node.role() == Role::Server {
                node.server(TwoAtOnce::default())?.run()?;
                return Ok(0);
            }
            let w = node.worker::<f32>()?;
            let (mut one, mut two) = (vec![0f32; TWO_AT_ONCE], vec![0f32; TWO_AT_ONCE]);
            let mut crossed = 0;
            for _ in 0..100 {
                let (a, b) = (w.pull(&[1])?, w.pull(&[2])?);
                w.wait_into(a, &mut one)?;
                w.wait_into(b, &mut two)?;
                crossed += usize::from(one.iter().any(|&v| v != 1.0) || two.iter().any(|&v| v != 2.0));
            }
            Ok(crossed)
        });
        let r = common::all_ok(r);
        assert_eq!(r[1], 0, "rounds whose answers crossed");
    }
}

/// A handler whose first request ends its server's run (as a crash would: its connections close).
#[derive(Clone)]
struct Stops;

impl Handler<f32> for Stops {
    fn handle(&mut self, r: Request<'_, f32>, _: &Responder<f32>) -> Result<()> {
        Err(Error::invalid(format!("stopping at request {}", r.meta.timestamp)))
    }
}

#[test]
fn with_replication_a_late_request_names_the_backup_it_waits_for_not_the_dead_primary() {
    let deadline = Duration::from_secs(2);
    let mut cfg = PsConfig::new(1, 2);
    cfg.timeout = deadline;
    cfg.replication = true;
    cfg.sharding = Sharding::Range; // key 1 is server 0's; server 1 backs it up
    let arrive = [(Role::Server, 0), (Role::Server, 1), (Role::Worker, 0)];
    let r = threads(cfg, &|| Ok(Device::in_process()), &arrive, |node| match (node.role(), node.id()) {
        (Role::Server, 0) => Ok(node.server(Stops)?.run().err().map(|e| e.to_string()).unwrap_or_default()),
        (Role::Server, _) => {
            // The backup's copy holds command 98 unanswered.
            node.server(Deferred::default())?.run()?;
            Ok(String::new())
        }
        _ => {
            let w = node.worker::<f32>()?;
            let e = w.wait(w.pull_with(&[1], 98)?).err().map(|e| e.to_string()).unwrap_or_default();
            Ok(format!("{e} DEAD {:?}", w.dead_servers()))
        }
    });
    let r = common::all_ok(r);
    assert!(r[0].contains("stopping at request"), "server 0 stopped for another reason: {}", r[0]);
    let e = &r[2];
    assert!(e.ends_with("DEAD [0]"), "server 0 not seen gone: {e}");
    assert!(
        e.contains(
            "parameter-server pull request 2 (server(s) [1] did not answer for keys [1]; answering as backups: \
             server 1 for gone server 0)"
        ),
        "{e}"
    );
    assert!(e.contains("timed out after 2.0 s; still waiting for rank 1"), "{e}");
}

#[test]
fn a_rejoin_that_fails_is_logged_and_a_later_one_is_met() {
    let mut cfg = PsConfig::new(2, 1);
    cfg.timeout = Duration::from_secs(3);
    cfg.rejoin_wait = Some(common::TIMEOUT);
    let r = members(3, |i, store| {
        let dev = Device::in_process();
        match i {
            0 => {
                let node = Node::connect_shared(store.clone(), &dev, Role::Server, 0, cfg.clone())?;
                node.server(SumStore::<f32>::default())?.run()?;
                Ok(Vec::new())
            }
            1 => {
                let w = Node::connect(&**store, &dev, Role::Worker, 0, cfg.clone())?.worker::<f32>()?;
                w.wait(w.push(&[1], &[1.0], &[])?)?;
                store.get("ps-test/w1-done", common::TIMEOUT)?;
                Ok(w.wait(w.pull(&[1, 5])?)?.values)
            }
            _ => {
                // Worker 1 dies, announces a rejoin and gives up before the server meets it
                // (the server's meeting fails), then rejoins for good.
                drop(bare_worker(store, 1, 2, 1)?);
                let mut hasty = cfg.clone();
                hasty.timeout = Duration::from_millis(1);
                if Node::rejoin(&**store, &dev, 1, hasty).is_ok() {
                    return Err(Error::invalid("the hasty rejoin was met"));
                }
                let mut patient = cfg.clone();
                patient.timeout = common::TIMEOUT;
                let w = Node::rejoin(&**store, &dev, 1, patient)?.worker::<f32>()?;
                w.wait(w.push(&[5], &[7.0], &[])?)?;
                let got = w.wait(w.pull(&[5])?)?.values;
                store.set("ps-test/w1-done", b"1")?;
                Ok(got)
            }
        }
    });
    let r = common::all_ok(r);
    assert_eq!((&r[1][..], &r[2][..]), (&[1.0, 7.0][..], &[7.0][..]));
}

/// A [`SyncSgd`] that says whose request it took and which workers it saw leave (to
/// senders whose receivers a test may have dropped).
#[derive(Clone)]
struct Observed {
    inner: SyncSgd,
    took: mpsc::Sender<usize>,
    left: mpsc::Sender<usize>,
}

impl Observed {
    fn new(workers: usize, took: mpsc::Sender<usize>, left: mpsc::Sender<usize>) -> Self {
        Observed { inner: SyncSgd::new(workers, 1.0), took, left }
    }
}

impl Handler<f32> for Observed {
    fn handle(&mut self, r: Request<'_, f32>, responder: &Responder<f32>) -> Result<()> {
        let worker = r.meta.worker;
        self.inner.handle(r, responder)?;
        let _ = self.took.send(worker);
        Ok(())
    }

    fn worker_left(&mut self, worker: usize, responder: &Responder<f32>) -> Result<()> {
        let _ = self.left.send(worker);
        self.inner.worker_left(worker, responder)
    }
}

#[test]
fn a_backup_copy_knows_of_workers_that_left_before_its_first_request() {
    // Server 1 keeps server 0's copy. Worker 1 dies before anything was sent; then worker 0
    // pushes to server 1's copy of shard 0 (as a worker does when server 0 is gone). The
    // copy's synchronous round has worker 0 only and is answered (made at its first request,
    // the copy waited for worker 1 to the end).
    let (left_tx, left) = mpsc::channel();
    let left = Mutex::new(left);
    let r = members(4, |i, store| {
        let mut cfg = PsConfig::new(2, 2);
        cfg.replication = true;
        cfg.heartbeat = None;
        match i {
            0 | 1 => {
                let (tx, _) = mpsc::channel();
                let left = if i == 1 { left_tx.clone() } else { tx.clone() };
                let handler = Observed::new(2, tx, left);
                Node::connect(&**store, &Device::in_process(), Role::Server, i, cfg)?.server(handler)?.run()?;
                Ok((0, String::new()))
            }
            2 => {
                drop(bare_worker(store, 2, 2, 1)?);
                Ok((0, String::new()))
            }
            _ => {
                let ctx = bare_worker(store, 2, 2, 0)?;
                let gone = left.lock().map_err(|_| Error::invalid("poisoned"))?.recv_timeout(common::TIMEOUT);
                if gone != Ok(1) {
                    return Err(Error::invalid(format!("server 1 did not see worker 1 leave: {gone:?}")));
                }
                // A push of key 1 for shard 0 (the message's shard field), to server 1.
                ctx.send(1, PS_TAG, &ps_message(1, 3, &[1], &[1], &2f32.to_le_bytes()))?;
                let answer = ctx.recv_bytes(1, PS_TAG, 1 << 20)?;
                for s in 0..2 {
                    ctx.send(s, PS_TAG, &ps_message(6, 0, &[], &[], &[]))?;
                }
                let kind = answer.first().copied().unwrap_or(0);
                Ok((kind, String::from_utf8_lossy(answer.get(32..).unwrap_or(&[])).into_owned()))
            }
        }
    });
    let r = common::all_ok(r);
    assert_eq!(r[3].0, 4, "server 1's copy of shard 0 answered {:?}", r[3]);
}

/// The values of a parameter-server reply (the layout of [`ps_message`]).
fn reply_values(m: &[u8]) -> Vec<f32> {
    let word = |at: usize| m.get(at..at + 4).map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let nkeys = word(18);
    let at = 22 + 8 * nkeys;
    let nlens = word(at);
    let start = (at + 4 + 8 * nlens).next_multiple_of(8);
    m.get(start..).unwrap_or(&[]).chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

#[test]
fn sgd_pushes_that_do_not_fit_a_key_are_refused_whole() {
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    // Synchronous rounds: worker 1's push of another length to a key new in the round is
    // refused (it was left out of the sum, silently); its push of the right length completes
    // the round.
    let (took_tx, took) = mpsc::channel();
    let took = Mutex::new(took);
    let r = members(3, |i, store| {
        let mut cfg = PsConfig::new(2, 1);
        cfg.heartbeat = None;
        if i == 0 {
            let handler = Observed::new(2, took_tx.clone(), mpsc::channel().0);
            Node::connect(&**store, &Device::in_process(), Role::Server, 0, cfg)?.server(handler)?.run()?;
            return Ok(Vec::new());
        }
        let ctx = bare_worker(store, 1, 2, i - 1)?;
        let took = || {
            let t = took.lock().map_err(|_| Error::invalid("poisoned"))?.recv_timeout(common::TIMEOUT);
            t.map_err(|_| Error::invalid("the server took no request"))
        };
        let mut out = Vec::new();
        if i == 1 {
            ctx.send(0, PS_TAG, &ps_message(1, 1, &[5], &[3], &f32s(&[1.0, 2.0, 3.0])))?;
            let answer = ctx.recv_bytes(0, PS_TAG, 1 << 20)?;
            out.push((answer.first().copied().unwrap_or(0), String::new()));
            out.push((ask(&ctx, &ps_message(2, 3, &[5], &[], &[]))?.0, String::new()));
            ctx.send(0, PS_TAG, &ps_message(2, 5, &[5], &[], &[]))?;
            out.push((9, format!("{:?}", reply_values(&ctx.recv_bytes(0, PS_TAG, 1 << 20)?))));
        } else {
            if took()? != 0 {
                return Err(Error::invalid("worker 1's request came first"));
            }
            out.push(ask(&ctx, &ps_message(1, 2, &[5], &[4], &f32s(&[1.0; 4])))?);
            out.push(ask(&ctx, &ps_message(1, 4, &[5], &[3], &f32s(&[3.0, 2.0, 1.0])))?);
            // Worker 0's pull (its second request) waits for this round.
            out.push(ask(&ctx, &ps_message(2, 6, &[5], &[], &[]))?);
        }
        ctx.send(0, PS_TAG, &ps_message(6, 0, &[], &[], &[]))?;
        Ok(out)
    });
    let r = common::all_ok(r);
    let (w0, w1) = (&r[1], &r[2]);
    assert!(
        w1[0].0 == 5
            && w1[0].1.contains("key 5 has 3 values in worker 0's push waiting in this round, this push has 4"),
        "{w1:?}"
    );
    assert_eq!((w1[1].0, w1[2].0, w0[0].0, w0[1].0), (4, 4, 4, 4), "{w0:?} {w1:?}");
    // w = -(1 + 3, 2 + 2, 3 + 1) / 2.
    assert_eq!(w0[2].1, "[-2.0, -2.0, -2.0]");

    // Asynchronous: a push with one misfit key changes no key.
    let r = members(2, |i, store| {
        let mut cfg = PsConfig::new(1, 1);
        cfg.heartbeat = None;
        if i == 0 {
            Node::connect(&**store, &Device::in_process(), Role::Server, 0, cfg)?.server(AsyncSgd::new(1.0))?.run()?;
            return Ok((Vec::new(), Vec::new()));
        }
        let ctx = bare_worker(store, 1, 1, 0)?;
        let answers = vec![
            ask(&ctx, &ps_message(1, 1, &[1, 2], &[2, 2], &f32s(&[1.0; 4])))?,
            ask(&ctx, &ps_message(1, 2, &[1, 2], &[2, 3], &f32s(&[1.0; 5])))?,
        ];
        ctx.send(0, PS_TAG, &ps_message(2, 3, &[1], &[], &[]))?;
        let values = reply_values(&ctx.recv_bytes(0, PS_TAG, 1 << 20)?);
        ctx.send(0, PS_TAG, &ps_message(6, 0, &[], &[], &[]))?;
        Ok((answers, values))
    });
    let r = common::all_ok(r);
    let (answers, values) = &r[1];
    assert_eq!(answers[0].0, 4, "{answers:?}");
    assert!(answers[1].0 == 5 && answers[1].1.contains("key 2 holds 2 weights, the push has 3"), "{answers:?}");
    assert_eq!(values, &[-1.0, -1.0]);
}

#[test]
fn a_first_sync_round_of_many_new_keys_is_answered_in_time() {
    // The check that a new key's pushes in one round agree in length is a lookup per key (a
    // search per key took minutes for 100,000 keys).
    let keys: Vec<u64> = (0..30_000).collect();
    let ones = vec![1f32; keys.len()];
    let arrive = [(Role::Server, 0), (Role::Worker, 0), (Role::Worker, 1)];
    let r = in_process(2, 1, &arrive, Duration::from_secs(5), |node| {
        if node.role() == Role::Server {
            node.server(SyncSgd::new(2, 1.0))?.run()?;
            return Ok(None);
        }
        let w = node.worker::<f32>()?;
        w.wait(w.push(&keys, &ones, &[])?)?;
        Ok(Some(w.wait(w.pull(&[0, 29_999])?)?.values))
    });
    let r = common::all_ok(r);
    assert_eq!(r[1], Some(vec![-1.0, -1.0]));
    assert_eq!(r[2], Some(vec![-1.0, -1.0]));
}

/// A [`SumStore`] that, on the push with command 1, keeps its borrowed values while the
/// worker sends more pushes, then reports whether they were viewed in place and are intact.
#[derive(Clone)]
struct Lingering {
    inner: SumStore<f32>,
    holding: mpsc::Sender<()>,
    sent: Arc<Mutex<mpsc::Receiver<()>>>,
    report: mpsc::Sender<(bool, bool)>,
}

impl Handler<f32> for Lingering {
    fn handle(&mut self, r: Request<'_, f32>, responder: &Responder<f32>) -> Result<()> {
        if r.meta.cmd == 1 {
            let _ = self.holding.send(());
            let sent = self.sent.lock().map_err(|_| Error::invalid("poisoned"))?.recv_timeout(common::TIMEOUT);
            sent.map_err(|_| Error::invalid("the worker never said it sent the others"))?;
            let in_place = matches!(r.values, std::borrow::Cow::Borrowed(_));
            let intact = r.values.iter().all(|&v| v == 1.0);
            let _ = self.report.send((in_place, intact));
        }
        self.inner.handle(r, responder)
    }
}

#[test]
fn values_arriving_while_the_handler_holds_a_borrow_leave_it_intact() {
    const LEN: usize = 1024;
    const MORE: usize = 8;
    let (holding_tx, holding) = mpsc::channel();
    let (sent_tx, sent) = mpsc::channel();
    let (report_tx, report) = mpsc::channel();
    let handler = Lingering {
        inner: SumStore::default(),
        holding: holding_tx,
        sent: Arc::new(Mutex::new(sent)),
        report: report_tx,
    };
    let handler = Mutex::new(Some(handler));
    let (holding, sent_tx) = (Mutex::new(holding), Mutex::new(sent_tx));
    let r = members(2, |i, store| {
        let cfg = PsConfig::new(1, 1);
        if i == 0 {
            let h = handler.lock().ok().and_then(|mut h| h.take()).ok_or_else(|| Error::invalid("no handler"))?;
            Node::connect(&**store, &Device::in_process(), Role::Server, 0, cfg)?.server(h)?.run()?;
            return Ok(Vec::new());
        }
        let w = Node::connect(&**store, &Device::in_process(), Role::Worker, 0, cfg)?.worker::<f32>()?;
        let first = w.push_with(&[7], &[1.0; LEN], &[LEN], 1)?;
        let held = holding.lock().map_err(|_| Error::invalid("poisoned"))?.recv_timeout(common::TIMEOUT);
        held.map_err(|_| Error::invalid("the server never held the first push"))?;
        // Sent (taken by the transport) while the handler still holds the first push's values.
        let more: Vec<_> = (0..MORE).map(|k| w.push(&[7], &[k as f32 + 2.0; LEN], &[LEN])).collect::<Result<_>>()?;
        let _ = sent_tx.lock().map(|t| t.send(()));
        w.wait(first)?;
        for ts in more {
            w.wait(ts)?;
        }
        Ok(w.wait(w.pull(&[7])?)?.values)
    });
    let r = common::all_ok(r);
    let (in_place, intact) = report.recv_timeout(common::TIMEOUT).expect("the handler reported");
    assert!(in_place, "the push's values were copied out of the message");
    assert!(intact, "the held values changed while more pushes arrived");
    let want = 1.0 + (0..MORE).map(|k| k as f32 + 2.0).sum::<f32>();
    assert_eq!(r[1], vec![want; LEN]);
}

#[test]
fn pull_into_reads_the_values_of_keys_on_several_servers_into_the_callers_buffer() {
    let r = members(3, |i, store| {
        let cfg = PsConfig::new(1, 2);
        if i < 2 {
            Node::connect(&**store, &Device::in_process(), Role::Server, i, cfg)?
                .server(SumStore::<f32>::default())?
                .run()?;
            return Ok(None);
        }
        let w = Node::connect(&**store, &Device::in_process(), Role::Worker, 0, cfg)?.worker::<f32>()?;
        // Keys spread over both servers by the default hash sharding, of lengths 1 to 6.
        let keys: Vec<u64> = (1..=6).collect();
        let lens: Vec<usize> = (1..=6).collect();
        let values: Vec<f32> = (0..lens.iter().sum::<usize>()).map(|v| v as f32 * 0.5).collect();
        w.wait(w.push(&keys, &values, &lens)?)?;
        let mut into = vec![f32::NAN; values.len()];
        let got_lens = w.pull_into(&keys, &mut into)?;
        let reply = w.wait(w.pull(&keys)?)?;
        let mut short = vec![0f32; values.len() - 1];
        let refused = w.pull_into(&keys, &mut short).map_err(|e| e.to_string());
        Ok(Some((values, lens, into, got_lens, reply.values, reply.lens, refused)))
    });
    let (values, lens, into, got_lens, reply_values, reply_lens, refused) =
        common::all_ok(r).pop().flatten().expect("the worker's results");
    assert_eq!((&into, &got_lens), (&values, &lens), "pull_into");
    assert_eq!((&reply_values, &reply_lens), (&values, &lens), "pull");
    let refused = refused.expect_err("a buffer one value short");
    assert!(refused.contains("the 6 keys have 21 values, the buffer has room for 20"), "{refused}");
}

/// This process's resident memory, in KiB (`VmRSS` in /proc/self/status).
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("a VmRSS line");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmRSS in kB")
}

/// Set in the child process that [`ten_thousand_requests_over_shared_memory_do_not_grow_the_process`]
/// starts to measure in.
const ALONE_ENV: &str = "FERROGLOO_TEST_MEASURE_ALONE";

#[test]
fn ten_thousand_requests_over_shared_memory_do_not_grow_the_process() {
    // The resident memory is the whole process's: measured here, the other tests of this file,
    // running on other threads, would count too (CI once saw 7 MiB of theirs). So the test
    // runs again in a process of its own, alone, and this one checks that it passed.
    if std::env::var_os(ALONE_ENV).is_none() {
        let name = "ten_thousand_requests_over_shared_memory_do_not_grow_the_process";
        let args = ["--exact", name, "--nocapture", "--test-threads=1"];
        let (passed, said) = common::run_again(&args, (ALONE_ENV, "1"), Duration::from_secs(120));
        assert!(passed && said.contains("1 passed"), "the measuring process failed: {said}");
        return;
    }
    // Every request's and answer's buffer is given back and received into again: after a
    // warm-up the resident memory stays put, whatever the allocator does with freed memory.
    const LEN: usize = 16 << 10; // 64 KiB of f32 per push and per answer
    const WARM: usize = 500;
    const MORE: usize = 10_000;
    let store = HashStore::new();
    let dev = || Device::shared_memory(&ferrogloo::device::ShmAttr::default());
    let r = std::thread::scope(|s| {
        let server = s.spawn(|| -> Result<u64> {
            Node::connect(&store, &dev(), Role::Server, 0, PsConfig::new(1, 1))?
                .server(SumStore::<f32>::default())?
                .run()?;
            Ok(0)
        });
        let worker = (|| -> Result<u64> {
            let w = Node::connect(&store, &dev(), Role::Worker, 0, PsConfig::new(1, 1))?.worker::<f32>()?;
            let (g, mut back) = (vec![1f32; LEN], vec![0f32; LEN]);
            let mut before = 0;
            for i in 0..WARM + MORE {
                if i == WARM {
                    before = resident_kib();
                }
                w.wait_into(w.push_pull(&[3], &g, &[LEN])?, &mut back)?;
            }
            if back[0] != (WARM + MORE) as f32 {
                return Err(Error::invalid(format!("key 3 holds {} after {} pushes", back[0], WARM + MORE)));
            }
            Ok(resident_kib().saturating_sub(before))
        })();
        let server = server.join().map_err(|_| Error::invalid("the server panicked")).and_then(|r| r);
        vec![worker, server]
    });
    let grew = common::all_ok(r)[0];
    assert!(grew < 4 << 10, "resident memory grew {grew} KiB over {MORE} requests of {} KiB", (LEN * 4) >> 10);
}
