//! Elastic jobs with real processes: `ferrogloo-run --min-np 3 -np 4` runs this test binary's
//! worker (the ignored test `elastic_worker`), one worker is SIGKILLed in the middle, and the
//! other three shrink their context in place to size 3 and finish the work; a worker whose work fails
//! for a reason of its own (not a lost peer) ends the whole job instead.

use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::{RankEnv, elastic};
use ferrogloo::{Error, Reduction};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_ferrogloo-run");

/// Allreduces every worker runs, in all.
const STEPS: u64 = 200;
/// The step at which the victim stops and waits to be killed.
const KILL_AT: u64 = 50;

#[test]
#[ignore = "run as a child process by the test below, under ferrogloo-run"]
fn elastic_worker() {
    if !RankEnv::is_set() {
        return;
    }
    ferrogloo_cli::init_logging();
    let env = RankEnv::from_env().expect("rank environment");
    let worker: u64 =
        std::env::var(ferrogloo::config::FERROGLOO_WORKER).ok().and_then(|w| w.parse().ok()).expect("a worker id");
    println!("PID {}", std::process::id());
    let dev = Device::with_transport(Transport::from_env().expect("transport"), &TcpAttr::loopback()).expect("device");
    // What the worker has done survives generations; each generation starts from the furthest.
    let mut done = 0u64;
    // With ELASTIC_TEST_GROW_TO=n, workers go on past STEPS until the job has n ranks.
    let grow_to: usize = std::env::var("ELASTIC_TEST_GROW_TO").ok().and_then(|g| g.parse().ok()).unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(40);
    // Each context's deadline (ELASTIC_TEST_TIMEOUT seconds, default 10).
    let timeout: u64 = std::env::var("ELASTIC_TEST_TIMEOUT").ok().and_then(|t| t.parse().ok()).unwrap_or(10);
    // With ELASTIC_TEST_STALL=s, a victim stalls s seconds instead of waiting to be killed.
    let stall: Option<u64> = std::env::var("ELASTIC_TEST_STALL").ok().and_then(|t| t.parse().ok());
    let size = elastic::run(&env, &dev, Duration::from_secs(timeout), |ctx, membership| {
        let mut start = [done];
        ctx.allreduce(&mut start, Reduction::Max)?;
        done = start[0];
        while done < STEPS || ctx.size() < grow_to {
            // Ranks joined: rebuild at the new size.
            membership.check()?;
            if Instant::now() > deadline {
                return Err(Error::invalid(format!("the job did not grow to {grow_to} ranks")));
            }
            let victims = std::env::var("ELASTIC_TEST_VICTIMS").unwrap_or_else(|_| "3".into());
            let victim = victims.split(',').any(|v| v.parse() == Ok(worker));
            if done == KILL_AT && membership.generation() == 0 && victim {
                if std::env::var("ELASTIC_TEST_MODE").as_deref() == Ok("fatal") {
                    return Err(Error::invalid("bad input on worker 3"));
                }
                if let Some(secs) = stall {
                    // Stalls past the others' deadline, then goes on (its next call finds them
                    // gone: it joins the generation they regrouped in).
                    println!("STALLING");
                    std::thread::sleep(Duration::from_secs(secs));
                    done += 1;
                    continue;
                }
                println!("READY");
                std::thread::sleep(Duration::from_secs(30));
                return Err(Error::invalid("the victim was not killed"));
            }
            // With ELASTIC_TEST_BUSY=s, the others compute for s seconds there (no call in
            // which to notice a loss).
            if let Some(secs) = std::env::var("ELASTIC_TEST_BUSY").ok().and_then(|t| t.parse().ok())
                && done == KILL_AT
                && membership.generation() == 0
            {
                std::thread::sleep(Duration::from_secs(secs));
            }
            let mut v = vec![1.0f32; 1024];
            ctx.allreduce(&mut v, Reduction::Sum)?;
            assert!(v.iter().all(|&x| x == ctx.size() as f32), "allreduce at size {}", ctx.size());
            done += 1;
        }
        Ok(ctx.size())
    })
    .expect("the elastic job");
    println!("DONE worker {worker} size {size}");
}

/// How an elastic job of the worker went.
struct Outcome {
    status: std::process::ExitStatus,
    /// The workers' `DONE` lines, sorted.
    done: Vec<String>,
    /// All stdout.
    seen: String,
    /// The launcher's stderr.
    stderr: String,
    /// When each of the launcher's stderr lines came, after the start.
    stamped: Vec<(Duration, String)>,
}

/// Runs `ferrogloo-run -np 4 --min-np min` of the worker, SIGKILLs `victims` (100 ms apart)
/// once all of them reached the step they wait at.
fn kill_workers(min: usize, victims: &[usize]) -> Outcome {
    elastic_job(&["-np", "4", "--min-np", &min.to_string()], &[], victims)
}

/// Runs `ferrogloo-run ARGS` of the worker with `env`, SIGKILLs `victims` (100 ms apart) once
/// all of them reached the step they wait at.
fn elastic_job(args: &[&str], env: &[(&str, &str)], victims: &[usize]) -> Outcome {
    // One job at a time: their deadlines and timings assume the cores are theirs.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let me = std::env::current_exe().expect("this test binary");
    let list = victims.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let t = Instant::now();
    let mut child = Command::new("timeout")
        .arg("120")
        .arg(RUN)
        .args(args)
        .args(["--elastic-timeout", "20", "--grace", "2"])
        .arg(&me)
        .args(["--ignored", "--exact", "elastic_worker", "--nocapture", "--test-threads=1"])
        .env("ELASTIC_TEST_VICTIMS", &list)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let errors = std::thread::spawn(move || {
        BufReader::new(err).lines().map_while(Result::ok).map(|l| (t.elapsed(), l)).collect::<Vec<_>>()
    });
    let mut pids = [None::<i32>; 8];
    let mut ready = Vec::new();
    let mut done: Vec<String> = Vec::new();
    let mut seen = String::new();
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        seen.push_str(&line);
        seen.push('\n');
        let rank: Option<usize> = line.strip_prefix('[').and_then(|l| l.split(']').next()?.parse().ok());
        // (The test harness's "test elastic_worker ... " may start the pid's line.)
        if let (Some(r), Some(p)) = (rank, line.split("PID ").nth(1).and_then(|p| p.trim().parse().ok()))
            && let Some(slot) = pids.get_mut(r)
        {
            *slot = Some(p);
        }
        if let Some(r) = rank.filter(|r| victims.contains(r) && line.contains("READY")) {
            ready.push(r);
            if ready.len() == victims.len() {
                for (i, &v) in victims.iter().enumerate() {
                    // Victims die 100 ms apart, as the ranks of a failing host might: the
                    // launcher must gather them into one new generation.
                    if i > 0 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    let pid = pids[v].expect("a victim's pid came before its READY");
                    // SAFETY: kill takes plain integers.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        if let Some(d) = line.split("DONE ").nth(1) {
            done.push(d.to_string());
        }
    }
    let status = child.wait().expect("the launcher ends");
    done.sort();
    let stamped = errors.join().unwrap_or_default();
    let stderr = stamped.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n");
    Outcome { status, done, seen, stderr, stamped }
}

/// A host discovery script in `dir` that names `hosts`.
fn discovery_script(dir: &std::path::Path, hosts: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("discover.sh");
    std::fs::write(&path, format!("#!/bin/sh\necho {hosts}\n")).expect("write the script");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("make it executable");
    path.display().to_string()
}

#[test]
fn a_worker_killed_mid_job_leaves_three_that_shrink_in_place_and_finish() {
    let t = Instant::now();
    let Outcome { status, done, seen, stderr, .. } = kill_workers(3, &[3]);
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    assert_eq!(done, ["worker 0 size 3", "worker 1 size 3", "worker 2 size 3"], "{seen}\n{stderr}");
    // The survivors were inside an allreduce with it: they shrink their context in place, and
    // the launcher follows them instead of publishing a generation for them to rebuild in.
    assert!(
        stderr.contains("rank 3 failed; the survivors shrank generation 0 in place to 3 ranks (workers [0, 1, 2])"),
        "{stderr}"
    );
    assert!(!stderr.contains("generation 1"), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}

#[test]
fn two_workers_killed_together_make_one_shrink() {
    let t = Instant::now();
    let Outcome { status, done, seen, stderr, .. } = kill_workers(2, &[1, 3]);
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    assert_eq!(done, ["worker 0 size 2", "worker 2 size 2"], "{seen}\n{stderr}");
    assert!(
        stderr.contains("ranks [1, 3] failed; the survivors shrank generation 0 in place to 2 ranks (workers [0, 2])"),
        "{stderr}"
    );
    assert!(!stderr.contains("generation 1"), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}

#[test]
fn survivors_busy_elsewhere_when_a_worker_dies_rebuild_in_the_launcher_s_generation() {
    let t = Instant::now();
    // The others compute for 4 s when worker 3 is killed: no shrink in place is recorded
    // within the launcher's wait, so it publishes a generation of them, and they rebuild.
    let Outcome { status, done, seen, stderr, .. } =
        elastic_job(&["-np", "4", "--min-np", "3"], &[("ELASTIC_TEST_BUSY", "4")], &[3]);
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    assert_eq!(done, ["worker 0 size 3", "worker 1 size 3", "worker 2 size 3"], "{seen}\n{stderr}");
    assert!(stderr.contains("rank 3 failed; generation 1 goes on with 3 ranks (workers [0, 1, 2])"), "{stderr}");
    assert!(!stderr.contains("in place"), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}

#[test]
fn a_worker_failing_on_its_own_ends_the_elastic_job() {
    let me = std::env::current_exe().expect("this test binary");
    let t = Instant::now();
    let out = Command::new("timeout")
        .arg("120")
        .arg(RUN)
        .args(["-np", "4", "--min-np", "3", "--elastic-timeout", "20", "--grace", "2"])
        .arg(&me)
        .args(["--ignored", "--exact", "elastic_worker", "--nocapture", "--test-threads=1"])
        .env("ELASTIC_TEST_MODE", "fatal")
        .output()
        .expect("run ferrogloo-run");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Worker 3's process panics on its error (code 101): that is the job's end and its code.
    assert_eq!(out.status.code(), Some(101), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(
            "the elastic job ends: worker 3 (rank 3 of generation 0): invalid argument: bad input on worker 3"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("goes on with"), "no new generation after a worker's own failure:\n{stderr}");
    assert!(!stderr.contains("in place"), "the others do not go on without it:\n{stderr}");
    assert!(!stdout.contains("DONE"), "{stdout}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}

#[test]
fn the_job_grows_onto_discovered_slots() {
    let dir = tempfile::tempdir().expect("a directory");
    let script = discovery_script(dir.path(), "localhost:3");
    let t = Instant::now();
    let Outcome { status, done, seen, stderr, .. } = elastic_job(
        &[
            "-np",
            "2",
            "--min-np",
            "2",
            "--max-np",
            "3",
            "--host-discovery-script",
            &script,
            "--discovery-interval",
            "0.2",
        ],
        &[("ELASTIC_TEST_GROW_TO", "3")],
        &[],
    );
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    assert_eq!(done, ["worker 0 size 3", "worker 1 size 3", "worker 2 size 3"], "{seen}\n{stderr}");
    assert!(stderr.contains("generation 1 grows to 3 ranks (workers [0, 1, 2]; started 2 on localhost)"), "{stderr}");
    assert!(!stderr.contains("generation 2"), "it stops at --max-np:\n{stderr}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}

#[test]
fn a_failed_host_gets_a_new_rank_only_after_its_cooldown() {
    let dir = tempfile::tempdir().expect("a directory");
    let script = discovery_script(dir.path(), "localhost:3");
    let t = Instant::now();
    let Outcome { status, done, seen, stderr, stamped } = elastic_job(
        &[
            "-np",
            "3",
            "--min-np",
            "2",
            "--host-discovery-script",
            &script,
            "--discovery-interval",
            "0.2",
            "--blacklist-cooldown",
            "3",
        ],
        &[("ELASTIC_TEST_GROW_TO", "3")],
        &[2],
    );
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    // Worker 2 was killed; worker 3 took its place once localhost's cooldown was over.
    assert_eq!(done, ["worker 0 size 3", "worker 1 size 3", "worker 3 size 3"], "{seen}\n{stderr}");
    let at = |what: &str| stamped.iter().find(|(_, l)| l.contains(what)).map(|(t, _)| *t);
    let shrunk = at("rank 2 failed; the survivors shrank generation 0 in place to 2 ranks").expect(&stderr);
    let grown = at("generation 1 grows to 3 ranks (workers [0, 1, 3]; started 3 on localhost)").expect(&stderr);
    assert!(stderr.contains("host localhost gets no new ranks for 3 s"), "{stderr}");
    assert!(grown >= shrunk + Duration::from_secs(2), "regrown {:?} after the failure", grown - shrunk);
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}

#[test]
fn a_stalled_worker_makes_the_others_regroup_and_all_finish() {
    let t = Instant::now();
    // Worker 3 stalls 9 s in generation 0; the others' 6 s deadline passes, they ask to
    // regroup, and the launcher (no process ended) publishes the same four again.
    let Outcome { status, done, seen, stderr, .. } = elastic_job(
        &["-np", "4", "--min-np", "3"],
        &[("ELASTIC_TEST_VICTIMS", "3"), ("ELASTIC_TEST_STALL", "9"), ("ELASTIC_TEST_TIMEOUT", "6")],
        &[],
    );
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    assert!(seen.contains("STALLING"), "{seen}");
    assert_eq!(done, ["worker 0 size 4", "worker 1 size 4", "worker 2 size 4", "worker 3 size 4"], "{seen}\n{stderr}");
    assert!(
        stderr.contains("ranks asked to regroup (a peer stalled); generation ")
            && stderr.contains(" goes on with 4 ranks (workers [0, 1, 2, 3])"),
        "{stderr}"
    );
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}
