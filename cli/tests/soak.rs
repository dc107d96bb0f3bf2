//! Soak of the store server: 8 jobs of 2 rank processes each (`ferrogloo-bench`) rendezvous
//! at once through one `ferrogloo-store-server`, each under a scope of its own, and run
//! collectives. Every job succeeds; afterwards the server holds no more descriptors or threads
//! than before, and its memory grew by less than a bound. Not in the default `cargo test`:
//! `.ci/run` runs it (`cargo test --release -p ferrogloo-cli --test soak -- --ignored`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BENCH: &str = env!("CARGO_BIN_EXE_ferrogloo-bench");
const SERVER: &str = env!("CARGO_BIN_EXE_ferrogloo-store-server");

/// (open file descriptors, threads, resident KiB) of process `pid`.
fn usage(pid: u32) -> (usize, usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    (fds, field("Threads:") as usize, field("VmRSS:"))
}

#[test]
#[ignore = "16 rank processes against one server: .ci/run runs it (cargo test --release -p ferrogloo-cli --test soak -- --ignored)"]
fn eight_jobs_share_one_store_server_and_leave_nothing_behind() {
    const JOBS: usize = 8;
    let mut server = Command::new(SERVER)
        .args(["--bind", "127.0.0.1:0", "--seconds", "300"])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the store server");
    let mut line = String::new();
    BufReader::new(server.stdout.take().expect("stdout")).read_line(&mut line).expect("the server's URL");
    let base_url = line.trim().rsplit_once('/').map(|(b, _)| b.to_string()).expect("http://HOST:PORT/SCOPE");
    let before = usage(server.id());
    let t = Instant::now();
    let ranks: Vec<_> = (0..JOBS)
        .flat_map(|job| (0..2).map(move |rank| (job, rank)))
        .map(|(job, rank)| {
            let store = format!("{base_url}/job{job}");
            let child = Command::new(BENCH)
                .args(["--rank", &rank.to_string(), "--size", "2", "--store", &store])
                .args(["--op", "allreduce,broadcast", "--sizes", "4K,256K", "-n", "20", "--timeout", "60"])
                .env("FERROGLOO_ADDR", "127.0.0.1")
                .env("RUST_LOG", "error")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a rank");
            (job, rank, child)
        })
        .collect();
    for (job, rank, child) in ranks {
        let out = child.wait_with_output().expect("a rank");
        assert!(
            out.status.success(),
            "job {job}, rank {rank} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if rank == 0 {
            assert!(String::from_utf8_lossy(&out.stdout).contains("Out of bounds values : 0 OK"), "job {job}");
        }
    }
    let took = t.elapsed();
    // Kept-alive client connections close as the ranks exit; the server notices within moments.
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = loop {
        let now = usage(server.id());
        if now.0 <= before.0 || Instant::now() >= deadline {
            break now;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = server.kill();
    let _ = server.wait();
    eprintln!(
        "soak: {JOBS} jobs of 2 ranks in {:.1} s; server fds {} -> {}, threads {} -> {}, RSS {:.1} -> {:.1} MiB",
        took.as_secs_f64(),
        before.0,
        after.0,
        before.1,
        after.1,
        before.2 as f64 / 1024.0,
        after.2 as f64 / 1024.0
    );
    assert!(after.0 <= before.0, "the server's descriptors grew from {} to {}", before.0, after.0);
    assert!(after.1 <= before.1, "the server's threads grew from {} to {}", before.1, after.1);
    assert!(after.2 < before.2 + 16 * 1024, "the server's memory grew from {} to {} KiB", before.2, after.2);
}
