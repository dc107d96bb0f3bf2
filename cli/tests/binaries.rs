//! The command-line tools as a new user runs them: the store server's printed URL, its token,
//! a rank that waits for one that never comes, a bad interface name, the benchmark's JSON rows, and the
//! warning for a loopback address published where other hosts read.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BENCH: &str = env!("CARGO_BIN_EXE_ferrogloo-bench");
const SERVER: &str = env!("CARGO_BIN_EXE_ferrogloo-store-server");

/// Kills the child when dropped (a test that fails must not leave a server behind).
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the store server with `args`; returns it and the URL it printed first.
fn server(args: &[&str]) -> (Guard, String) {
    let mut child = Command::new(SERVER)
        .args(args)
        .args(["--seconds", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ferrogloo-store-server");
    let stdout = child.stdout.take().expect("piped stdout");
    let guard = Guard(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("the server prints its URL");
    (guard, line.trim().to_string())
}

/// Runs the benchmark with `args` and environment `env`, bounded by `limit`.
fn bench(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
    let mut cmd = Command::new("timeout");
    cmd.arg(limit.as_secs().to_string()).arg(BENCH).args(args).env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run ferrogloo-bench")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Two benchmark ranks meet through the store at `url` and run an allreduce.
fn two_ranks_meet_at(url: &str) {
    let ranks: Vec<Child> = (0..2)
        .map(|r| {
            Command::new(BENCH)
                .args(["--rank", &r.to_string(), "--size", "2", "--store", url])
                .args(["--op", "allreduce", "--sizes", "4096", "-n", "3"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().expect("a rank");
        assert!(out.status.success(), "rank {r} with the printed URL {url}: {}", text(&out));
    }
}

#[test]
fn the_store_server_url_works_exactly_as_printed() {
    let (_server, url) = server(&["--scope", "job1"]);
    assert!(url.starts_with("http://127.0.0.1:") && url.ends_with("/job1"), "{url}");
    two_ranks_meet_at(&url);
}

#[test]
fn the_store_server_serves_the_tcpstore_protocol_at_the_url_it_prints() {
    let (_server, url) = server(&["--protocol", "tcpstore", "--scope", "job2"]);
    assert!(url.starts_with("tcpstore://127.0.0.1:") && url.ends_with("/job2"), "{url}");
    two_ranks_meet_at(&url);
    // A token cannot be enforced over TCPStore's protocol: refused, not ignored.
    let dir = tempfile::tempdir().expect("a directory");
    let token = private_file(dir.path(), "token", "s3cret-token-value", 0o600);
    let out = Command::new(SERVER)
        .args(["--protocol", "tcpstore", "--token-file"])
        .arg(&token)
        .args(["--seconds", "5"])
        .output()
        .expect("run ferrogloo-store-server");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("TCPStore protocol has no authentication"), "{}", text(&out));
}

/// A file holding `content` with permissions `mode`.
fn private_file(dir: &std::path::Path, name: &str, content: &str, mode: u32) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, content).expect("write a file");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
    p
}

#[test]
fn a_store_server_with_a_token_serves_only_ranks_that_have_it() {
    let dir = tempfile::tempdir().expect("a directory");
    let token = private_file(dir.path(), "token", "t0k3n-of-the-job\n", 0o600);
    let (_server, url) = server(&["--scope", "job2", "--token-file", &token.display().to_string()]);
    let rank = |r: usize, token_file: Option<&std::path::Path>| {
        let mut c = Command::new(BENCH);
        c.args(["--rank", &r.to_string(), "--size", "2", "--store", &url])
            .args(["--op", "allreduce", "--sizes", "4096", "-n", "3"])
            .env("FERROGLOO_TIMEOUT", "20")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(t) = token_file {
            c.env("FERROGLOO_STORE_TOKEN_FILE", t);
        }
        c.spawn().expect("start a rank")
    };
    let ranks = [rank(0, Some(&token)), rank(1, Some(&token))];
    for (r, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().expect("a rank");
        assert!(out.status.success(), "rank {r} with the token: {}", text(&out));
    }
    // Without the token, or with another, a rank is refused at its first request, saying why.
    let other = private_file(dir.path(), "other", "another-token", 0o600);
    for (token_file, words) in [(None, "HTTP 401"), (Some(other.as_path()), "does not accept this client's token")] {
        let t = Instant::now();
        let out = rank(0, token_file).wait_with_output().expect("a rank");
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(text(&out).contains(words), "{}", text(&out));
        assert!(t.elapsed() < Duration::from_secs(10), "refused only after {:?}", t.elapsed());
    }
    // A token file others can read is refused, naming it and its mode.
    let open = private_file(dir.path(), "open", "t", 0o644);
    let out = Command::new(SERVER).args(["--token-file", &open.display().to_string()]).output().expect("run");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains(&open.display().to_string()) && text(&out).contains("0644"), "{}", text(&out));
}

#[test]
fn a_rank_alone_times_out_at_ferrogloo_timeout_naming_the_missing_rank() {
    let dir = tempfile::tempdir().expect("temporary store directory");
    let store = format!("file:{}", dir.path().display());
    let t = Instant::now();
    let out = bench(
        &["--rank", "0", "--size", "2", "--store", &store, "--op", "allreduce", "--sizes", "4096"],
        &[("FERROGLOO_TIMEOUT", "2")],
        Duration::from_secs(30),
    );
    let took = t.elapsed();
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(took < Duration::from_secs(8), "gave up only after {took:?}");
    assert!(said.contains("still waiting for rank 1"), "{said}");
    assert!(said.contains("ferrogloo.rank.1"), "{said}");
    assert!(!said.contains("Timeout {"), "errors print in Display form: {said}");
}

#[test]
fn an_interface_that_does_not_exist_is_named_with_those_that_do() {
    let out = bench(
        &["--rank", "0", "--size", "2", "--store", "file:/tmp"],
        &[("FERROGLOO_IFACE", "nope0")],
        Duration::from_secs(30),
    );
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("\"nope0\" does not exist") && said.contains("lo (127.0.0.1)"), "{said}");
}

#[test]
fn json_rows_are_appended_one_per_cell() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let json = dir.path().join("rows.jsonl");
    let json = json.to_str().expect("utf-8 path");
    for run in 1..=2 {
        let out = bench(
            &[
                "--np",
                "2",
                "--op",
                "allreduce",
                "--sizes",
                "4K,64K",
                "-n",
                "3",
                "--algorithm",
                "auto,ring",
                "--json",
                json,
            ],
            &[],
            Duration::from_secs(120),
        );
        assert!(out.status.success(), "{}", text(&out));
        let rows: Vec<serde_json::Value> = std::fs::read_to_string(json)
            .expect("the JSON file")
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON object per line"))
            .collect();
        assert_eq!(rows.len(), 4 * run, "run {run} appends its 4 cells");
        for row in &rows {
            assert_eq!(row["wrong"], 0);
            assert_eq!(row["transport"], "tcp+shm");
            match row["algorithm"].as_str() {
                // Local ranks talk through shared memory by default, where auto picks the
                // shared-memory algorithm.
                Some("auto") => assert_eq!(row["picked"], "shm", "auto at 4K and 64K on 2 local ranks: {row}"),
                Some("ring") => assert_eq!(row["picked"], "ring"),
                other => panic!("algorithm {other:?}"),
            }
        }
    }
}

#[test]
fn json_rows_carry_the_memcpy_limit_and_the_efficiency() {
    let dir = tempfile::tempdir().expect("a directory");
    let json = dir.path().join("rows.jsonl");
    let json = json.to_str().expect("a UTF-8 path");
    let out = bench(
        &["--np", "2", "--op", "broadcast,barrier", "--sizes", "64K", "-n", "3", "--json", json],
        &[],
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("# memcpy, one thread, this run (bytes GB/s): 64K "), "{t}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(json)
        .expect("the JSON file")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON object per line"))
        .collect();
    let cell = |op: &str| rows.iter().find(|r| r["op"] == op).unwrap_or_else(|| panic!("no {op} row: {rows:?}"));
    let (b, memcpy) = (cell("broadcast"), cell("broadcast")["memcpy_gbps"].as_f64().expect("a number"));
    assert!(memcpy > 0.0, "{b}");
    let eff = b["efficiency"].as_f64().expect("a number");
    let busbw = b["busbw_gbps"].as_f64().expect("a number");
    assert!((eff - busbw / memcpy).abs() < 1e-9, "{b}");
    // A barrier moves no bytes: no limit, no efficiency.
    assert!(cell("barrier")["efficiency"].is_null(), "{rows:?}");
}

#[test]
fn seconds_per_cell_are_filled_or_the_cap_is_said() {
    // 0.6 s asked of a 64 KiB allreduce: the cell takes about that long, and nothing is capped.
    let t = std::time::Instant::now();
    let out =
        bench(&["--np", "2", "--op", "allreduce", "--sizes", "64K", "--seconds", "0.6"], &[], Duration::from_secs(120));
    assert!(out.status.success(), "{}", text(&out));
    assert!(!text(&out).contains("capped"), "{}", text(&out));
    assert!(t.elapsed() >= Duration::from_millis(400), "a 0.6 s cell took {:?} in all", t.elapsed());
    // A barrier takes a few microseconds: 100 s of them is more than the iterations kept.
    let out = bench(&["--np", "2", "--op", "barrier", "--seconds", "100"], &[], Duration::from_secs(120));
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("# --seconds 100: capped at 1000000 iterations"), "{}", text(&out));
}

#[test]
fn a_loopback_address_published_where_other_hosts_read_is_warned_about() {
    // A server on every address, reached at this host's network address (skip without one).
    let (_server, url) = server(&["--bind", "0.0.0.0:0"]);
    if url.starts_with("http://127.") {
        eprintln!("SKIPPED: this host has no address other hosts could reach");
        return;
    }
    let out = bench(
        &["--rank", "0", "--size", "2", "--store", &url, "--op", "allreduce", "--sizes", "4096"],
        &[("FERROGLOO_ADDR", "127.0.0.1"), ("FERROGLOO_TIMEOUT", "1")],
        Duration::from_secs(30),
    );
    let said = text(&out);
    assert!(said.contains("only this host can reach"), "{said}");
    // Not for a store only this host reads.
    let dir = tempfile::tempdir().expect("temporary store directory");
    let store = format!("file:{}", dir.path().display());
    let out = bench(
        &["--rank", "0", "--size", "2", "--store", &store, "--op", "allreduce", "--sizes", "4096"],
        &[("FERROGLOO_ADDR", "127.0.0.1"), ("FERROGLOO_TIMEOUT", "1")],
        Duration::from_secs(30),
    );
    assert!(!text(&out).contains("only this host can reach"), "{}", text(&out));
}

#[test]
fn osu_columns_and_cache_cold_rotation_say_their_mode_and_check_every_result() {
    let dir = tempfile::tempdir().expect("a directory");
    let json = dir.path().join("rows.jsonl");
    let json = json.to_str().expect("a UTF-8 path");
    let ops = "allreduce,allgather,reduce_scatter,broadcast,alltoall,sendrecv";
    let args = ["--np", "3", "--op", ops, "--sizes", "6K,3M", "-n", "7", "--osu", "--cold", "--json", json];
    let out = bench(&args, &[], Duration::from_secs(180));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("# timing: per call, every call after a barrier") && t.contains("over the ranks (OSU)"), "{t}");
    assert!(t.contains("# cache: cold: each cell rotates through buffers"), "{t}");
    assert!(t.contains("avg        min        max        p50        p99    iters"), "{t}");
    assert!(t.contains("# Out of bounds values : 0 OK"), "{t}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(json)
        .expect("the JSON file")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON object per line"))
        .collect();
    assert_eq!(rows.len(), 12, "{rows:?}");
    for r in &rows {
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("no {k}: {r}"));
        assert!(f("rank_min_us") <= f("avg_us") && f("avg_us") <= f("rank_max_us"), "{r}");
        assert!(f("rank_min_us") > 0.0, "{r}");
        assert_eq!(
            (r["cache"].as_str(), r["timing"].as_str(), r["wrong"].as_u64()),
            (Some("cold"), Some("per-call-barrier"), Some(0)),
            "{r}"
        );
    }
    // Warm by default, and said so.
    let out = bench(&["--np", "2", "--op", "allreduce", "--sizes", "4K", "-n", "3"], &[], Duration::from_secs(120));
    assert!(text(&out).contains("# cache: warm (the same buffers every call)"), "{}", text(&out));
}
