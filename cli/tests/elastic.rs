//! Elastic jobs with real processes: `ferrogloo-run --min-np 3 -np 4` runs this test binary's
//! worker (the ignored test `elastic_worker`), one worker is SIGKILLed in the middle, and the
//! other three rebuild their context at size 3 and finish the work; a worker whose work fails
//! for a reason of its own (not a lost peer) ends the whole job instead.

use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::{RankEnv, elastic};
use ferrogloo::{Error, ReduceOp};
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
    let env = RankEnv::from_env().expect("rank environment");
    let worker: u64 = std::env::var(elastic::WORKER_ENV).ok().and_then(|w| w.parse().ok()).expect("a worker id");
    println!("PID {}", std::process::id());
    let dev = Device::with_transport(Transport::from_env().expect("transport"), &TcpAttr::loopback()).expect("device");
    // What the worker has done survives generations; each generation starts from the furthest.
    let mut done = 0u64;
    let size = elastic::run(&env, &dev, Duration::from_secs(10), |ctx| {
        let mut start = [done];
        ctx.allreduce(&mut start, ReduceOp::Max)?;
        done = start[0];
        while done < STEPS {
            let victims = std::env::var("ELASTIC_TEST_VICTIMS").unwrap_or_else(|_| "3".into());
            let victim = victims.split(',').any(|v| v.parse() == Ok(worker));
            if done == KILL_AT && ctx.size() == 4 && victim {
                if std::env::var("ELASTIC_TEST_MODE").as_deref() == Ok("fatal") {
                    return Err(Error::invalid("bad input on worker 3"));
                }
                println!("READY");
                std::thread::sleep(Duration::from_secs(30));
                return Err(Error::invalid("the victim was not killed"));
            }
            let mut v = vec![1.0f32; 1024];
            ctx.allreduce(&mut v, ReduceOp::Sum)?;
            assert!(v.iter().all(|&x| x == ctx.size() as f32), "allreduce at size {}", ctx.size());
            done += 1;
        }
        Ok(ctx.size())
    })
    .expect("the elastic job");
    println!("DONE worker {worker} size {size}");
}

/// Runs `ferrogloo-run -np 4 --min-np min` of the worker, SIGKILLs `victims` (100 ms apart)
/// once all of them reached the step they wait at; returns the launcher's status, the workers' `DONE` lines
/// (sorted), all stdout and the launcher's stderr.
fn kill_workers(min: usize, victims: &[usize]) -> (std::process::ExitStatus, Vec<String>, String, String) {
    let me = std::env::current_exe().expect("this test binary");
    let list = victims.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let mut child = Command::new("timeout")
        .arg("120")
        .arg(RUN)
        .args(["-np", "4", "--min-np", &min.to_string(), "--elastic-timeout", "20", "--grace", "2"])
        .arg(&me)
        .args(["--ignored", "--exact", "elastic_worker", "--nocapture", "--test-threads=1"])
        .env("ELASTIC_TEST_VICTIMS", &list)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let errors = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let mut pids = [None::<i32>; 4];
    let mut ready = Vec::new();
    let mut done: Vec<String> = Vec::new();
    let mut seen = String::new();
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        seen.push_str(&line);
        seen.push('\n');
        let rank: Option<usize> = line.strip_prefix('[').and_then(|l| l.split(']').next()?.parse().ok());
        // (The test harness's "test elastic_worker ... " may start the pid's line.)
        if let (Some(r), Some(p)) = (rank, line.split("PID ").nth(1).and_then(|p| p.trim().parse().ok())) {
            pids[r] = Some(p);
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
    (status, done, seen, errors.join().unwrap_or_default())
}

#[test]
fn a_worker_killed_mid_job_leaves_three_that_rebuild_and_finish() {
    let t = Instant::now();
    let (status, done, seen, stderr) = kill_workers(3, &[3]);
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    assert_eq!(done, ["worker 0 size 3", "worker 1 size 3", "worker 2 size 3"], "{seen}\n{stderr}");
    assert!(stderr.contains("rank 3 failed; generation 1 goes on with 3 ranks"), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}

#[test]
fn two_workers_killed_together_make_one_new_generation() {
    let t = Instant::now();
    let (status, done, seen, stderr) = kill_workers(2, &[1, 3]);
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    assert_eq!(done, ["worker 0 size 2", "worker 2 size 2"], "{seen}\n{stderr}");
    assert!(stderr.contains("ranks [1, 3] failed; generation 1 goes on with 2 ranks (workers [0, 2])"), "{stderr}");
    assert!(!stderr.contains("generation 2"), "{stderr}");
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
    assert!(!stdout.contains("DONE"), "{stdout}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}
