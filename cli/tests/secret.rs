//! Launched jobs are authenticated. `ferrogloo-run` and a program's own `--np` hand every rank
//! the job's secret (and the store's token) in private files that no command line or
//! environment shows and that are gone when the job ends; and a process that has read the
//! whole store, token and all, but not the secret cannot take a rank's place in a running job,
//! over TCP or over shared memory, while the job finishes with correct results.
//!
//! The ranks are this test binary's ignored tests `guarded_rank` (under `ferrogloo-run`) and
//! `np_launcher` / `np_rank` (a `--np` job through `spawn_local`).

use ferrogloo::config::{
    FERROGLOO_SECRET as SECRET_ENV, FERROGLOO_SECRET_FILE as SECRET_FILE_ENV, FERROGLOO_STORE_TOKEN as STORE_TOKEN_ENV,
    FERROGLOO_STORE_TOKEN_FILE as STORE_TOKEN_FILE_ENV,
};
use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::{RankEnv, spawn_local};
use ferrogloo::rendezvous::{HashStore, HttpStore, Store, StoreUrl};
use ferrogloo::{Context, Reduction};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RUN: &str = env!("CARGO_BIN_EXE_ferrogloo-run");
/// Ranks of the launched jobs.
const RANKS: usize = 3;
/// Elements each rank allreduces.
const LEN: u64 = 4096;
/// The key the test sets in a job's store once its strangers have tried: the last rank joins
/// only then (the others wait for it in their rendezvous, where the strangers find them).
const GO: &str = "test.go";
/// Set for `np_launcher` by the test that runs it (which it ignores otherwise).
const NP_TEST: &str = "FERROGLOO_TEST_NP_LAUNCHER";

/// Kills the child when dropped (a failing test must not leave a job behind).
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What rank `r` of `n` allreduces, and the sum every rank must get.
fn contribution(r: usize) -> Vec<u64> {
    (0..LEN).map(|i| i * (r as u64 + 1) + 7).collect()
}

fn expected(n: usize) -> Vec<u64> {
    let mut sum = vec![0u64; LEN as usize];
    for r in 0..n {
        for (s, v) in sum.iter_mut().zip(contribution(r)) {
            *s += v;
        }
    }
    sum
}

/// The allreduce of a job's ranks, checked on every rank; prints the result's checksum.
fn allreduce_and_report(ctx: &Context) {
    let mut v = contribution(ctx.rank());
    ctx.allreduce(&mut v, Reduction::Sum).expect("the job's allreduce");
    assert_eq!(v, expected(ctx.size()), "rank {}: the allreduce is wrong", ctx.rank());
    println!("RESULT rank {} of {} sum {}", ctx.rank(), ctx.size(), v.iter().sum::<u64>());
}

#[test]
#[ignore = "run as a child process by the tests below, under ferrogloo-run"]
fn guarded_rank() {
    if !RankEnv::is_set() {
        return;
    }
    let env = RankEnv::from_env().expect("rank environment");
    println!("PID {} RANK {}", std::process::id(), env.rank);
    if env.rank == env.size - 1 {
        let store = ferrogloo::rendezvous::open(&env.store).expect("the job's store, with its token");
        store.get(GO, Duration::from_secs(60)).expect("the test's go");
    }
    let ctx = env.connect(&TcpAttr::from_env().expect("attr"), Duration::from_secs(60)).expect("the job's context");
    allreduce_and_report(&ctx);
}

/// A process's command line and environment, as `ps e` shows them.
fn shown(pid: u32) -> Vec<(&'static str, Vec<u8>)> {
    ["cmdline", "environ"]
        .into_iter()
        .filter_map(|what| std::fs::read(format!("/proc/{pid}/{what}")).ok().map(|b| (what, b)))
        .collect()
}

/// The variables of process `pid`.
fn environ(pid: u32) -> HashMap<String, String> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    raw.split(|&b| b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok()?.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
        .collect()
}

/// Every process of this machine whose command line or environment holds `needle`.
fn processes_showing(needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
        for (what, bytes) in shown(pid) {
            if bytes.windows(needle.len()).any(|w| w == needle) {
                found.push(format!("{pid} ({what})"));
            }
        }
    }
    found
}

/// The secret and token files a rank's environment names, with their contents: checks they
/// are files readable by their owner only and that the values themselves are in no process's
/// command line or environment.
fn check_handed_privately(pid: u32) -> (PathBuf, PathBuf, Vec<u8>, String) {
    use std::os::unix::fs::PermissionsExt;
    // A rank that is exec'ing (`sh -c '...; exec sleep'`) shows an empty environment for a
    // moment: read it again until it is there (the variables are set before the rank starts).
    let t = Instant::now();
    let mut env = environ(pid);
    while env.is_empty() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
        env = environ(pid);
    }
    assert!(!env.contains_key(SECRET_ENV) && !env.contains_key(STORE_TOKEN_ENV), "values in rank {pid}'s environment");
    let secret_file = PathBuf::from(env.get(SECRET_FILE_ENV).expect("the rank has FERROGLOO_SECRET_FILE"));
    let token_file = PathBuf::from(env.get(STORE_TOKEN_FILE_ENV).expect("the rank has FERROGLOO_STORE_TOKEN_FILE"));
    for f in [&secret_file, &token_file] {
        let mode = std::fs::metadata(f).expect("the file exists while the job runs").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", f.display());
        let dir_mode = std::fs::metadata(f.parent().expect("a directory")).expect("its directory").permissions().mode();
        assert_eq!(dir_mode & 0o777, 0o700, "{}'s directory", f.display());
    }
    let secret = std::fs::read(&secret_file).expect("read the secret");
    let secret = secret.strip_suffix(b"\n").unwrap_or(&secret).to_vec();
    let token = std::fs::read_to_string(&token_file).expect("read the token").trim_end().to_string();
    assert!(secret.len() >= 32 && token.len() >= 32, "fresh values are long");
    assert_ne!(secret, token.as_bytes(), "the token, sent in clear to the store, is not the secret");
    assert_eq!(processes_showing(&secret), Vec::<String>::new(), "processes showing the job's secret");
    assert_eq!(processes_showing(token.as_bytes()), Vec::<String>::new(), "processes showing the store token");
    (secret_file, token_file, secret, token)
}

/// How a stranger fared.
struct Refusal {
    who: &'static str,
    error: String,
    took: Duration,
}

/// Strangers that have read every entry of the job's store (through `store`, with the token)
/// try to join the job as its last rank, on `transport`: one without a secret, one with a
/// guessed one. Each error is returned.
fn strangers(store: &HttpStore, transport: Transport) -> Vec<Refusal> {
    // Everything the store holds about the job (the ranks' entries), copied: the strangers
    // rendezvous on the copy, so the job's own store stays as the job left it.
    let copy = HashStore::new();
    for r in 0..RANKS {
        if let Some(v) = store.try_get(&format!("ferrogloo.rank.{r}")).expect("the stranger reads the store") {
            copy.set(&format!("ferrogloo.rank.{r}"), &v).expect("copy");
        }
    }
    let device = Device::with_transport(transport, &TcpAttr::loopback()).expect("the stranger's device");
    let mut out = Vec::new();
    for (who, guess) in [("no secret", None), ("a guessed secret", Some(b"0123456789abcdef".to_vec()))] {
        let t = Instant::now();
        let mut b = Context::builder(RANKS - 1, RANKS).timeout(Duration::from_secs(3));
        if let Some(g) = guess {
            b = b.secret(g);
        }
        let error = match b.connect(&copy, &device) {
            Ok(_) => panic!("a stranger with {who} joined the job as rank {}", RANKS - 1),
            Err(e) => e.to_string(),
        };
        out.push(Refusal { who, error, took: t.elapsed() });
    }
    out
}

/// Runs a job of [`RANKS`] `guarded_rank`s under `ferrogloo-run` on `transport`; sends the
/// strangers in while the first ranks wait for the last one; then lets it come. Checks the
/// strangers were refused for want of the secret, the job's results, that no process showed
/// the secret or the token, and that their files are gone afterwards.
fn a_stranger_cannot_join(transport: &str) {
    for v in [SECRET_ENV, SECRET_FILE_ENV, STORE_TOKEN_ENV, STORE_TOKEN_FILE_ENV] {
        assert!(std::env::var_os(v).is_none(), "the test itself must not hold the job's secret ({v} is set)");
    }
    let me = std::env::current_exe().expect("this test binary");
    let t = Instant::now();
    // Bounded by the launcher's own deadline; the guard kills the launcher itself (and so its
    // ranks) if the test fails first.
    let mut child = Command::new(RUN)
        .args(["-np", &RANKS.to_string(), "--timeout", "120"])
        .arg(&me)
        .args(["--ignored", "--exact", "guarded_rank", "--nocapture", "--test-threads=1"])
        .env("FERROGLOO_TRANSPORT", transport)
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let errors = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let mut guard = Guard(child);
    let mut lines = BufReader::new(out).lines().map_while(Result::ok);
    let mut pids: Vec<u32> = Vec::new();
    let mut seen = String::new();
    for line in lines.by_ref() {
        seen.push_str(&line);
        seen.push('\n');
        if let Some(p) = line.split("PID ").nth(1).and_then(|p| p.split_whitespace().next()?.parse().ok()) {
            pids.push(p);
            if pids.len() == RANKS {
                break;
            }
        }
    }
    assert_eq!(pids.len(), RANKS, "every rank printed its pid:\n{seen}");

    // The ranks' files, and nothing that shows their values.
    let (secret_file, token_file, _secret, token) = check_handed_privately(pids[0]);
    for &p in &pids[1..] {
        let env = environ(p);
        assert_eq!(env.get(SECRET_FILE_ENV).map(PathBuf::from), Some(secret_file.clone()), "one secret per job");
    }
    let url = environ(pids[0]).get("FERROGLOO_STORE").cloned().expect("the rank's store");
    let Ok(StoreUrl::Http { base, scope }) = StoreUrl::parse(&url) else { panic!("an HTTP store: {url}") };
    // Without the token the store says nothing; with it (as if it leaked) the stranger reads
    // every entry, once the first ranks have published theirs and wait for the last one.
    let anyone = HttpStore::new(&base, &scope, Duration::from_secs(5)).expect("a client");
    let refused = anyone.try_get("ferrogloo.rank.0").expect_err("a client without the token");
    assert!(refused.to_string().contains("401"), "{refused}");
    let store =
        HttpStore::new(&base, &scope, Duration::from_secs(5)).and_then(|s| s.with_token(&token)).expect("a client");
    for r in 0..RANKS - 1 {
        store.get(&format!("ferrogloo.rank.{r}"), Duration::from_secs(30)).expect("the first ranks' entries");
    }
    let transport: Transport = transport.parse().expect("a transport");
    for s in strangers(&store, transport) {
        assert!(
            s.error.contains("shared secret"),
            "the stranger with {} was refused, but not for the secret: {}",
            s.who,
            s.error
        );
        assert!(s.took < Duration::from_secs(10), "the stranger with {} took {:?}", s.who, s.took);
    }

    // The job goes on: its last rank joins, and every rank gets the right sum.
    store.set(GO, b"1").expect("tell the last rank to join");
    for line in lines {
        seen.push_str(&line);
        seen.push('\n');
    }
    let status = guard.0.wait().expect("the launcher ends");
    let stderr = errors.join().unwrap_or_default();
    assert!(status.success(), "the job failed ({status}):\n{seen}\n{stderr}");
    let sum: u64 = expected(RANKS).iter().sum();
    for r in 0..RANKS {
        assert!(
            seen.contains(&format!("RESULT rank {r} of {RANKS} sum {sum}")),
            "rank {r}'s result:\n{seen}\n{stderr}"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
    for f in [&secret_file, &token_file] {
        assert!(!f.exists(), "{} outlived the job", f.display());
    }
    assert!(!secret_file.parent().is_some_and(|d| d.exists()), "the job's private directory outlived it");
}

#[test]
fn a_stranger_with_the_store_cannot_join_a_launched_job_over_tcp() {
    a_stranger_cannot_join("tcp");
}

#[test]
fn a_stranger_with_the_store_cannot_join_a_launched_job_over_shared_memory() {
    a_stranger_cannot_join("shm");
}

#[test]
#[ignore = "run as a child process by the test below: a program's own --np"]
fn np_launcher() {
    if std::env::var_os(NP_TEST).is_none() {
        return;
    }
    // Re-runs this binary twice, as the ranks of a job: they run the other ignored test.
    let argv: Vec<String> =
        ["--ignored", "--exact", "np_rank", "--nocapture", "--test-threads=1"].into_iter().map(String::from).collect();
    spawn_local(2, &argv, Duration::from_secs(60)).expect("the --np job");
}

#[test]
#[ignore = "run as a child process of np_launcher"]
fn np_rank() {
    if !RankEnv::is_set() {
        return;
    }
    let env = RankEnv::from_env().expect("rank environment");
    println!("PID {} RANK {}", std::process::id(), env.rank);
    let store = ferrogloo::rendezvous::open(&env.store).expect("the job's store");
    store.get(GO, Duration::from_secs(60)).expect("the test's go");
    let ctx = env.connect(&TcpAttr::loopback(), Duration::from_secs(30)).expect("the job's context");
    allreduce_and_report(&ctx);
}

#[test]
fn np_ranks_share_a_secret_that_no_process_shows_and_that_goes_with_the_job() {
    let me = std::env::current_exe().expect("this test binary");
    // Bounded by spawn_local's own deadline; the guard kills the launcher itself (and so its
    // ranks) if the test fails first.
    let child = Command::new(&me)
        .args(["--ignored", "--exact", "np_launcher", "--nocapture", "--test-threads=1"])
        .env_remove(SECRET_FILE_ENV)
        .env_remove(SECRET_ENV)
        .env(NP_TEST, "1")
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the --np launcher");
    let mut guard = Guard(child);
    let out = guard.0.stdout.take().expect("stdout");
    let err = guard.0.stderr.take().expect("stderr");
    let errors = std::thread::spawn(move || std::io::read_to_string(err).unwrap_or_default());
    let mut lines = BufReader::new(out).lines().map_while(Result::ok);
    let mut pids: Vec<u32> = Vec::new();
    let mut seen = String::new();
    for line in lines.by_ref() {
        seen.push_str(&line);
        seen.push('\n');
        if let Some(p) = line.split("PID ").nth(1).and_then(|p| p.split_whitespace().next()?.parse().ok()) {
            pids.push(p);
            if pids.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(pids.len(), 2, "both ranks printed their pids:\n{seen}");
    let envs: Vec<HashMap<String, String>> = pids.iter().map(|&p| environ(p)).collect();
    let file = PathBuf::from(envs[0].get(SECRET_FILE_ENV).expect("rank 0 has FERROGLOO_SECRET_FILE"));
    assert_eq!(envs[1].get(SECRET_FILE_ENV).map(PathBuf::from), Some(file.clone()), "one secret per job");
    let secret = std::fs::read(&file).expect("the secret file, while the job runs");
    assert!(secret.len() >= 32, "a fresh secret");
    assert_eq!(processes_showing(&secret), Vec::<String>::new(), "processes showing the job's secret");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).expect("the file").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    // The ranks meet with it (a context proves it in every handshake) and finish.
    let store = envs[0].get("FERROGLOO_STORE").expect("the rank's store").clone();
    ferrogloo::rendezvous::open(&store).and_then(|s| s.set(GO, b"1")).expect("tell the ranks to go on");
    for line in lines {
        seen.push_str(&line);
        seen.push('\n');
    }
    let status = guard.0.wait().expect("the launcher ends");
    let stderr = errors.join().unwrap_or_default();
    assert!(status.success(), "the --np job failed ({status}):\n{seen}\n{stderr}");
    let sum: u64 = expected(2).iter().sum();
    for r in 0..2 {
        assert!(seen.contains(&format!("RESULT rank {r} of 2 sum {sum}")), "rank {r}'s result:\n{seen}\n{stderr}");
    }
    assert!(!file.exists(), "{} outlived the job", file.display());
}

#[test]
fn the_job_s_private_files_go_even_when_its_launcher_is_killed() {
    let mut child = Command::new(RUN)
        .args(["-np", "2", "--timeout", "120", "sh", "-c", "echo PID $$; exec sleep 60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ferrogloo-run");
    let out = child.stdout.take().expect("stdout");
    let mut guard = Guard(child);
    let pids: Vec<u32> = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.split("PID ").nth(1).and_then(|p| p.trim().parse().ok()))
        .take(2)
        .collect();
    assert_eq!(pids.len(), 2, "both ranks printed their pids");
    let (secret_file, token_file, _, _) = check_handed_privately(pids[0]);
    guard.0.kill().expect("SIGKILL the launcher");
    let _ = guard.0.wait();
    let dir = secret_file.parent().expect("a directory").to_path_buf();
    let t = Instant::now();
    while dir.exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!secret_file.exists() && !token_file.exists() && !dir.exists(), "{} outlived its launcher", dir.display());
}
