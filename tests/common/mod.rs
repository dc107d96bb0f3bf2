//! Helpers shared by the integration tests.
#![allow(dead_code)]

use ferrogloo::device::{Device, TcpAttr};
use ferrogloo::rendezvous::Store;
use ferrogloo::{Context, Result};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Deadline of every context in the tests: generous for a loaded 2-core CI machine, yet
/// bounded.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `f` on `n` ranks that are threads, each with its own device, meeting through `store`.
/// Returns each rank's result in rank order.
pub fn run_ranks<T: Send>(n: usize, store: &dyn Store, f: impl Fn(Context) -> Result<T> + Sync) -> Vec<Result<T>> {
    run_ranks_with(n, store, &TcpAttr::loopback(), |b| b, f)
}

/// Like [`run_ranks`], with device attributes and a context-builder hook.
pub fn run_ranks_with<T: Send>(
    n: usize,
    store: &dyn Store,
    attr: &TcpAttr,
    build: impl Fn(ferrogloo::ContextBuilder) -> ferrogloo::ContextBuilder + Sync,
    f: impl Fn(Context) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    run_ranks_on(n, store, &|| Device::tcp(attr), build, f)
}

/// Runs `f` on `n` ranks that are threads, each with its own device from `device`, meeting
/// through `store`. Returns each rank's result in rank order.
pub fn run_ranks_on<T: Send>(
    n: usize,
    store: &dyn Store,
    device: &(dyn Fn() -> Result<Device> + Sync),
    build: impl Fn(ferrogloo::ContextBuilder) -> ferrogloo::ContextBuilder + Sync,
    f: impl Fn(Context) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, build) = (&f, &build);
                s.spawn(move || {
                    let dev = device()?;
                    let ctx = build(Context::builder(rank, n).timeout(TIMEOUT)).connect(store, &dev)?;
                    f(ctx)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank thread panicked")).collect()
    })
}

/// Unwraps every rank's result, naming the rank that failed.
pub fn all_ok<T>(results: Vec<Result<T>>) -> Vec<T> {
    let failed: Vec<String> = results
        .iter()
        .enumerate()
        .filter_map(|(r, x)| x.as_ref().err().map(|e| format!("rank {r} failed: {e}")))
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    results.into_iter().filter_map(|x| x.ok()).collect()
}

/// A payload that differs for every (from, to, index): catches misrouted or shifted data.
pub fn pattern(from: usize, to: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((from as u32) << 24) ^ ((to as u32) << 16) ^ (i as u32).wrapping_mul(2654435761)).collect()
}

/// The handshake's wire protocol version (src/transport/handshake/messages.rs), which the
/// tests that speak the handshake by hand must send.
pub const WIRE_VERSION: u16 = 5;

/// A handshake opening, a hello of a TCP pair (see src/transport/handshake/mod.rs for the
/// layout), for tests that play a stranger or a fake rank.
/// This opens a pair's main connection (lane 0), which carries every frame of the connector; a
/// pair needs its bulk connection (lane 1) too.
pub fn hello(magic: &[u8; 4], version: u16, ctx: [u8; 16], from: u32, to: u32, size: u32) -> Vec<u8> {
    hello_lane(magic, version, ctx, from, to, size, false)
}

/// [`hello`] for either lane of a pair.
pub fn hello_lane(magic: &[u8; 4], version: u16, ctx: [u8; 16], from: u32, to: u32, size: u32, bulk: bool) -> Vec<u8> {
    let mut b = magic.to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    // Type 1 (hello), no flags (no secret), backend 1 (TCP), the lane, 2 reserved bytes.
    b.extend_from_slice(&[1, 0, 1, u8::from(bulk), 0, 0]);
    b.extend_from_slice(&ctx);
    for x in [from, to, size] {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b.extend_from_slice(&[0x5a; 16]); // the nonce
    b
}

/// Runs the connector's side of a TCP handshake without a secret on `sock` (see
/// src/transport/handshake/mod.rs): the hello, the acceptor's challenge, then an empty proof,
/// which ends a TCP handshake. Returns the challenge's status.
pub fn handshake_without_secret(sock: &mut std::net::TcpStream, hello: &[u8]) -> u8 {
    use std::io::{Read, Write};
    sock.write_all(hello).expect("hello");
    let mut challenge = [0u8; 56];
    sock.read_exact(&mut challenge).expect("challenge");
    if challenge[7] == 0 {
        // A proof: head (type 3), no payload, a zero MAC.
        let mut proof = b"FGLO".to_vec();
        proof.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        proof.extend_from_slice(&[3, 0, 0, 0]);
        proof.extend_from_slice(&[0; 32]);
        sock.write_all(&proof).expect("proof");
    }
    challenge[7]
}

/// Runs this test binary again in a process of its own, with `args` (a test filter and the
/// harness's options) and `env` set, killed after `limit`; returns whether it passed, and
/// its standard output and error (for the caller's message). Whether it passed: it exited
/// with success and its harness said `test result: ok`.
pub fn run_again(args: &[&str], env: (&str, &str), limit: Duration) -> (bool, String) {
    let dir = tempfile::tempdir().expect("a directory for the child's output");
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(args)
        .env(env.0, env.1)
        .stdout(std::fs::File::create(&out).expect("the child's stdout"))
        .stderr(std::fs::File::create(&err).expect("the child's stderr"))
        .spawn()
        .expect("spawn the test binary again");
    let status = wait_or_kill(&mut child, Instant::now() + limit);
    let said = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
    let (out, err) = (said(&out), said(&err));
    let passed = status.is_some_and(|s| s.success()) && out.contains("test result: ok");
    (passed, format!("it ended with {status:?} (None: killed after {limit:?})\n{out}\n{err}"))
}

/// Waits for a child process until `deadline`, killing it if it overruns (`None`).
pub fn wait_or_kill(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().expect("polling a child process") {
            return Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The place of a rank process that a test started (`None` when this process is not one), with
/// the library's logs on stderr where the parent asks for them (`RUST_LOG`).
pub fn rank_process() -> Option<ferrogloo::launch::RankEnv> {
    if !ferrogloo::launch::RankEnv::is_set() {
        return None;
    }
    let env = ferrogloo::launch::RankEnv::from_env().expect("rank environment");
    if std::env::var_os("RUST_LOG").is_some() {
        let filter = tracing_subscriber::EnvFilter::from_default_env();
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    }
    Some(env)
}
