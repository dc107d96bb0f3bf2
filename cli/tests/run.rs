//! `ferrogloo-run` with real processes: a job of the benchmark, tagged and saved output, the
//! first failure as the headline, and no rank left running after SIGKILL or SIGINT to the
//! launcher.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_ferrogloo-run");
const BENCH: &str = env!("CARGO_BIN_EXE_ferrogloo-bench");

/// Kills the launcher when dropped (a failed test must not leave one behind).
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether process `pid` still exists (a zombie counts as gone).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit(')').next().and_then(|r| r.split_whitespace().next()) != Some("Z"))
        .unwrap_or(false)
}

/// Waits until none of `pids` runs, at most `limit`; returns those still running.
fn gone_within(pids: &[u32], limit: Duration) -> Vec<u32> {
    let t = Instant::now();
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|&p| running(p)).collect();
        if alive.is_empty() || t.elapsed() >= limit {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `ferrogloo-run -np n` of a shell script that runs `setup`, prints `PID <pid>` and
/// then runs `then`; returns the launcher and every rank's pid, once all have printed theirs
/// (so every rank's `setup` is done).
fn job_of_sleepers(n: usize, setup: &str, then: &str, extra: &[&str]) -> (Guard, Vec<u32>, std::process::ChildStderr) {
    // The pid, then whatever the rank does (its pid stays the same through `exec`).
    let script = format!("{setup}\necho PID $$; {then}");
    let mut child = Command::new(RUN)
        .args(["-np", &n.to_string()])
        .args(extra)
        .args(["sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let guard = Guard(child);
    let mut pids = Vec::new();
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        if let Some(p) = line.split("PID ").nth(1).and_then(|p| p.trim().parse().ok()) {
            pids.push(p);
            if pids.len() == n {
                break;
            }
        }
    }
    assert_eq!(pids.len(), n, "every rank printed its pid");
    (guard, pids, err)
}

#[test]
fn a_job_of_four_runs_the_benchmark_with_tagged_and_saved_output() {
    let dir = tempfile::tempdir().expect("an output directory");
    let out = Command::new("timeout")
        .args(["120", RUN, "-np", "4", "--output-filename"])
        .arg(dir.path())
        .args([BENCH, "--op", "allreduce", "--sizes", "4K,64K", "-n", "3"])
        .output()
        .expect("run ferrogloo-run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("[0]<stdout>:# allreduce: 4 ranks"), "{stdout}");
    assert!(stdout.contains("[0]<stdout>:# Out of bounds values : 0 OK"), "{stdout}");
    for rank in 0..4 {
        let d = dir.path().join("1").join(format!("rank.{rank}"));
        let (so, se) = (std::fs::read_to_string(d.join("stdout")), std::fs::read_to_string(d.join("stderr")));
        assert!(so.is_ok() && se.is_ok(), "rank {rank}'s output files in {}", d.display());
        if rank == 0 {
            assert!(so.unwrap_or_default().contains("# allreduce: 4 ranks"), "rank 0's stdout file");
        }
    }
}

#[test]
fn the_first_rank_to_fail_is_the_headline_and_its_code_the_launchers() {
    // Rank 2 fails with code 3 after writing to stderr, once every rank has started (each
    // leaves a file; rank 2 waits for all four, at most 20 s); the others would sleep a minute.
    let dir = tempfile::tempdir().expect("a directory");
    let d = dir.path().display();
    let t = Instant::now();
    let script = format!(
        r#"touch {d}/up.$FERROGLOO_RANK; if [ "$FERROGLOO_RANK" = 2 ]; then
             i=0; while [ $(ls {d} | wc -l) -lt 4 ] && [ $i -lt 2000 ]; do i=$((i+1)); sleep 0.01; done
             echo "bad input on rank 2" >&2; exit 3; fi; exec sleep 60"#
    );
    let (mut guard, pids, err) = job_of_sleepers(4, "", &script, &["--grace", "2"]);
    let status = guard.0.wait().expect("the launcher ends");
    let stderr = std::io::read_to_string(err).unwrap_or_default();
    assert_eq!(status.code(), Some(3), "the launcher exits with rank 2's code:\n{stderr}");
    let headline = stderr.lines().find(|l| l.starts_with("ferrogloo-run: rank")).unwrap_or_default();
    assert!(headline.contains("rank 2 (host localhost) exited with code 3"), "{stderr}");
    assert!(stderr.contains("    bad input on rank 2"), "its last stderr lines follow:\n{stderr}");
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
    assert_eq!(gone_within(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "ranks left running");
}

#[test]
fn sigkill_to_the_launcher_leaves_no_rank_running() {
    let (mut guard, pids, _err) = job_of_sleepers(3, "", "exec sleep 60", &[]);
    assert!(pids.iter().all(|&p| running(p)));
    guard.0.kill().expect("SIGKILL the launcher");
    let _ = guard.0.wait();
    assert_eq!(gone_within(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "ranks outlived the launcher");
}

#[test]
fn sigint_to_the_launcher_stops_the_job_within_the_grace_period() {
    // One rank ignores SIGINT and SIGTERM: it is killed when the 2 s grace ends; the others
    // stop at once.
    let (mut guard, pids, err) = job_of_sleepers(
        3,
        // The trap is set before the pid is printed: the SIGINT cannot come first.
        r#"if [ "$FERROGLOO_RANK" = 1 ]; then trap '' INT TERM; fi"#,
        "exec sleep 60",
        &["--grace", "2"],
    );
    let t = Instant::now();
    // SAFETY: kill takes plain integers; the launcher is our child, still running.
    unsafe { libc::kill(guard.0.id() as i32, libc::SIGINT) };
    let status = guard.0.wait().expect("the launcher ends");
    let took = t.elapsed();
    let stderr = std::io::read_to_string(err).unwrap_or_default();
    assert!(took < Duration::from_secs(6), "the launcher took {took:?} to stop:\n{stderr}");
    assert!(took >= Duration::from_millis(1500), "rank 1 ignores SIGINT until the grace ends ({took:?})");
    assert_eq!(status.code(), Some(130), "128 + SIGINT:\n{stderr}");
    assert!(stderr.contains("interrupted by signal 2 (SIGINT), forwarded to every rank"), "{stderr}");
    assert_eq!(gone_within(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "ranks left running");
}

#[test]
fn sigkill_to_the_launcher_ends_ranks_started_through_a_wrapper() {
    // Each rank is a shell that starts the benchmark in the background and waits: the
    // benchmark is the launcher's grandchild, out of reach of the parent-death signal. The
    // lifeline (FERROGLOO_LIFELINE, watched from RankEnv::from_env) must end it.
    let inner = format!("echo PID $$; exec {BENCH} --op allreduce --sizes 64K -n 100000000 --timeout 120");
    let script = format!("sh -c '{inner}' & wait");
    let mut child = Command::new(RUN)
        .args(["-np", "2", "sh", "-c", &script])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let mut guard = Guard(child);
    let mut pids = Vec::new();
    let mut lines = BufReader::new(out).lines().map_while(Result::ok);
    for line in lines.by_ref() {
        if let Some(p) = line.split("PID ").nth(1).and_then(|p| p.trim().parse::<u32>().ok()) {
            pids.push(p);
            if pids.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(pids.len(), 2, "both benchmarks printed their pids");
    // Rank 0 names the transport once the job's context is up (its one cell would take hours).
    assert!(lines.any(|l| l.contains("# transport:")), "the benchmark started");
    assert!(pids.iter().all(|&p| running(p)));
    guard.0.kill().expect("SIGKILL the launcher");
    let _ = guard.0.wait();
    assert_eq!(gone_within(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "grandchildren outlived the launcher");
}
