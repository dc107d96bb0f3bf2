//! The engine with ranks as real processes (this test binary re-executes itself as each rank,
//! the ignored test `engine_worker`): random submission orders, a rank killed with SIGKILL,
//! and the timeline of a rank killed mid-run.

mod common;

use ferrogloo::config::{FERROGLOO_RANK as RANK_ENV, FERROGLOO_SIZE as SIZE_ENV, FERROGLOO_STORE as STORE_ENV};
use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::engine::{Engine, EngineConfig, Reduction};
use ferrogloo::launch::RankEnv;
use ferrogloo::rendezvous::FileStore;
use ferrogloo::{Context, Error, Result};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const SCENARIO_ENV: &str = "FERROGLOO_TEST_ENGINE";
const TIMELINE_ENV: &str = "FERROGLOO_TEST_TIMELINE";
/// Set where the ranks are told to agree by reduction (the engine's variable, which the
/// workers read, is set beside it).
const TREE_ENV: &str = "FERROGLOO_TEST_ENGINE_TREE";
/// Deadline of the workers' contexts: a survivor of a killed rank must fail within it.
const KILL_TIMEOUT: Duration = Duration::from_secs(8);

/// One rank. Does nothing unless started by a test below.
#[test]
#[ignore = "run as a child process by the other tests in this file"]
fn engine_worker() {
    if !RankEnv::is_set() {
        return;
    }
    let env = RankEnv::from_env().expect("rank environment");
    let scenario = std::env::var(SCENARIO_ENV).unwrap_or_default();
    match work(&env, &scenario) {
        Ok(()) => println!("DONE rank {}", env.rank),
        Err(e) => {
            println!("ERROR rank {}: {e}", env.rank);
            std::process::exit(3);
        }
    }
}

fn work(env: &RankEnv, scenario: &str) -> Result<()> {
    let store = ferrogloo::rendezvous::open(&env.store)?;
    let dev = Device::with_transport(Transport::from_env()?, &TcpAttr::loopback())?;
    let ctx = Context::builder(env.rank, env.size).timeout(KILL_TIMEOUT).connect(&store, &dev)?;
    let timeline = std::env::var_os(TIMELINE_ENV).map(Into::into);
    // From the environment (the tests below set FERROGLOO_ENGINE_TREE_FROM for some runs).
    let engine = Engine::new(ctx, EngineConfig { timeline, stall_check: None, ..EngineConfig::from_env()? })?;
    if std::env::var_os(TREE_ENV).is_some() && !engine.agrees_by_reduction() {
        return Err(Error::invalid("told to agree by reduction, the engine does not"));
    }
    let (r, n) = (engine.rank(), engine.size());
    match scenario {
        "orders" => {
            // 40 names, each rank its own order, three steps; checked against the sum.
            for step in 0..3u64 {
                let mut names: Vec<usize> = (0..40).collect();
                names.rotate_left((r * 11 + step as usize * 3) % 40);
                if r % 2 == 1 {
                    names.reverse();
                }
                let hs = names
                    .iter()
                    .map(|&t| {
                        engine.allreduce(
                            &format!("p{t}"),
                            vec![(r * 100 + t) as u64 + step; 1 + t * 50],
                            Reduction::Sum,
                        )
                    })
                    .collect::<Result<Vec<_>>>()?;
                for (t, h) in names.iter().zip(hs) {
                    let want = (0..n).map(|q| (q * 100 + t) as u64 + step).sum::<u64>();
                    let got = h.wait()?.data;
                    if got.len() != 1 + t * 50 || got.iter().any(|&x| x != want) {
                        return Err(Error::invalid(format!("rank {r}: p{t} step {step} is wrong")));
                    }
                }
            }
            Ok(())
        }
        "forever" => {
            // Steps until something fails (bounded: the parent kills a rank long before).
            for step in 0..1_000_000u64 {
                let a = engine.allreduce("grad.a", vec![1f32; 1000], Reduction::Average)?;
                let b = engine.allreduce("grad.b", vec![step as f32; 10], Reduction::Sum)?;
                a.wait()?;
                b.wait()?;
                if step == 20 {
                    println!("READY rank {r}");
                }
            }
            Ok(())
        }
        other => Err(Error::invalid(format!("unknown scenario {other:?}"))),
    }
}

struct Job {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, String)>,
    _dir: tempfile::TempDir,
}

fn start(n: usize, scenario: &str, timeline: Option<&std::path::Path>) -> Job {
    start_with(n, scenario, timeline, &[])
}

/// Ranks that agree by reduction, over TCP.
const TREE: &[(&str, &str)] = &[("FERROGLOO_ENGINE_TREE_FROM", "2"), (TREE_ENV, "1"), ("FERROGLOO_TRANSPORT", "tcp")];

fn start_with(n: usize, scenario: &str, timeline: Option<&std::path::Path>, env: &[(&str, &str)]) -> Job {
    let dir = tempfile::tempdir().expect("tempdir");
    let _ = FileStore::new(dir.path());
    let url = format!("file:{}", dir.path().display());
    let (tx, lines) = mpsc::channel();
    let children = (0..n)
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
            cmd.args(["--ignored", "--exact", "engine_worker", "--nocapture", "--test-threads=1"])
                .env(RANK_ENV, rank.to_string())
                .env(SIZE_ENV, n.to_string())
                .env(STORE_ENV, &url)
                .env(SCENARIO_ENV, scenario)
                .env("FERROGLOO_TRANSPORT", "auto")
                .envs(env.iter().copied())
                .stdout(Stdio::piped());
            if let Some(t) = timeline {
                cmd.env(TIMELINE_ENV, t);
            }
            let mut child = cmd.spawn().expect("spawn a rank");
            let out = child.stdout.take().expect("piped stdout");
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                    let _ = tx.send((rank, line));
                }
            });
            child
        })
        .collect();
    Job { children, lines, _dir: dir }
}

impl Job {
    /// Waits until every rank in `ranks` printed a line starting with `what`.
    fn wait_for(&self, what: &str, ranks: &[usize], deadline: Instant) -> Vec<(usize, String)> {
        let mut seen = Vec::new();
        let mut all = Vec::new();
        while !ranks.iter().all(|r| seen.contains(r)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
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
fn processes_submitting_in_different_orders_get_the_sums() {
    for n in [2, 3, 4] {
        let job = start(n, "orders", None);
        let lines = job.wait_for("DONE rank", &(0..n).collect::<Vec<_>>(), Instant::now() + Duration::from_secs(60));
        assert!(!lines.iter().any(|(_, l)| l.contains("ERROR rank")), "{lines:?}");
    }
}

#[test]
fn processes_agreeing_by_reduction_over_tcp_get_the_sums() {
    for n in [3, 5] {
        let job = start_with(n, "orders", None, TREE);
        let lines = job.wait_for("DONE rank", &(0..n).collect::<Vec<_>>(), Instant::now() + Duration::from_secs(60));
        assert!(!lines.iter().any(|(_, l)| l.contains("ERROR rank")), "{lines:?}");
    }
}

#[test]
fn a_rank_killed_with_sigkill_gives_every_survivor_an_error_naming_it() {
    killed_rank_is_named(&[]);
}

#[test]
fn a_rank_killed_while_the_ranks_agree_by_reduction_is_named_by_every_survivor() {
    killed_rank_is_named(TREE);
}

fn killed_rank_is_named(env: &[(&str, &str)]) {
    let n = 4;
    let mut job = start_with(n, "forever", None, env);
    job.wait_for("READY rank", &[0, 1, 2, 3], Instant::now() + Duration::from_secs(60));
    let killed = Instant::now();
    job.children[2].kill().expect("SIGKILL rank 2");
    let _ = job.children[2].wait();
    let lines = job.wait_for("ERROR rank", &[0, 1, 3], killed + KILL_TIMEOUT + Duration::from_secs(5));
    for (r, line) in lines.iter().filter(|(_, l)| l.contains("ERROR rank")) {
        assert!(line.contains("rank 2"), "rank {r} does not name the killed rank: {line}");
    }
    for (r, c) in job.children.iter_mut().enumerate().filter(|(r, _)| *r != 2) {
        let st = common::wait_or_kill(c, Instant::now() + Duration::from_secs(10));
        assert_eq!(st.and_then(|s| s.code()), Some(3), "rank {r} exits with the engine's error");
    }
}

#[test]
fn the_timeline_is_valid_json_after_its_rank_is_killed_with_sigkill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("timeline.json");
    for _ in 0..3 {
        let mut job = start(2, "forever", Some(&path));
        job.wait_for("READY rank", &[0, 1], Instant::now() + Duration::from_secs(60));
        job.children[0].kill().expect("SIGKILL rank 0");
        let _ = job.children[0].wait();
        let text = std::fs::read_to_string(&path).expect("timeline file");
        let tl: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("not JSON after SIGKILL ({e}): ...{}", &text[text.len().saturating_sub(300)..]));
        let events = tl["traceEvents"].as_array().expect("traceEvents");
        assert!(events.iter().any(|e| e["name"] == "NEGOTIATE_ALLREDUCE"), "no negotiation span");
        // Small tensors are reduced from what travelled with the negotiation
        // (ALLREDUCE_WITH_NEGOTIATION), the others by an allreduce.
        let allreduces =
            events.iter().filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with("ALLREDUCE"))).count();
        assert!(allreduces >= 20, "fewer allreduce spans than steps");
    }
}

/// `examples/train` as `cargo test` built it (next to this test's `deps` directory).
fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary");
    let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    profile.join("examples").join(name)
}

#[test]
fn the_training_example_runs_on_three_ranks_its_loss_falls_and_the_weights_agree() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tl = dir.path().join("train.json");
    let mut child = Command::new(example("train"))
        .args(["--np", "3", "--epochs", "4", "--samples", "256"])
        .env("HOROVOD_TIMELINE", &tl)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("run examples/train (built by cargo test)");
    let out = child.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || std::io::read_to_string(out).unwrap_or_default());
    let status = common::wait_or_kill(&mut child, Instant::now() + Duration::from_secs(120));
    let out = reader.join().unwrap_or_default();
    assert!(status.is_some_and(|s| s.success()), "train failed:\n{out}");
    let losses: Vec<f64> =
        out.lines().filter_map(|l| l.split("loss ").nth(1)?.split_whitespace().next()?.parse().ok()).collect();
    assert_eq!(losses.len(), 4, "{out}");
    assert!(losses[3] < losses[0] * 0.8, "the loss does not fall: {losses:?}");
    assert!(out.contains("weights bitwise identical on all 3 ranks"), "{out}");
    let tl: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tl).expect("timeline")).expect("timeline JSON");
    assert!(tl["traceEvents"].as_array().is_some_and(|e| e.iter().any(|e| e["name"] == "NEGOTIATE_ALLREDUCE")));
}
