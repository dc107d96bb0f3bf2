//! Elastic jobs with real processes: `ferrogloo-run --min-np 3 -np 4` runs this test binary's
//! worker (the ignored test `elastic_worker`), one worker is SIGKILLed in the middle, and the
//! other three rebuild their context at size 3 and finish the work.

use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::{RankEnv, elastic};
use ferrogloo::{Error, ReduceOp};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
            if done == KILL_AT && ctx.size() == 4 && worker == 3 {
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

#[test]
fn a_worker_killed_mid_job_leaves_three_that_rebuild_and_finish() {
    let run = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent()?.parent().map(|d| d.join("ferrogloo-run")))
        .filter(|p| p.exists());
    let Some(run) = run else {
        eprintln!("SKIPPED: ferrogloo-run is not built next to this test");
        return;
    };
    let me = std::env::current_exe().expect("this test binary");
    let t = Instant::now();
    let mut child = Command::new("timeout")
        .arg("120")
        .arg(&run)
        .args(["-np", "4", "--min-np", "3", "--elastic-timeout", "20", "--grace", "2"])
        .arg(&me)
        .args(["--ignored", "--exact", "elastic_worker", "--nocapture", "--test-threads=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let errors = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let mut victim: Option<u32> = None;
    let mut done: Vec<String> = Vec::new();
    let mut seen = String::new();
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        seen.push_str(&line);
        seen.push('\n');
        // (The test harness's "test elastic_worker ... " may start the pid's line.)
        if line.starts_with("[3]<stdout>:") && line.contains("PID ") {
            victim = line.split("PID ").nth(1).and_then(|p| p.trim().parse().ok());
        }
        if line.starts_with("[3]<stdout>:") && line.contains("READY") {
            let pid = victim.expect("the victim's pid came first");
            // SAFETY: kill takes plain integers.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        if let Some(d) = line.split("DONE ").nth(1) {
            done.push(d.to_string());
        }
    }
    let status = child.wait().expect("the launcher ends");
    let stderr = errors.join().unwrap_or_default();
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    done.sort();
    assert_eq!(done, ["worker 0 size 3", "worker 1 size 3", "worker 2 size 3"], "{seen}\n{stderr}");
    assert!(stderr.contains("generation 1 goes on with 3 ranks"), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}
