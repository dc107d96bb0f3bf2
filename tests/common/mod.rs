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

/// A handshake opening (see src/transport/tcp/handshake.rs for the layout), for tests that
/// play a stranger or a fake rank.
/// This opens a pair's main connection (flag 2, bulk, clear), which carries every frame of the
/// connector; a pair needs its bulk connection too.
pub fn hello(magic: &[u8; 4], version: u16, ctx: [u8; 16], from: u32, to: u32, size: u32) -> Vec<u8> {
    hello_lane(magic, version, ctx, from, to, size, false)
}

/// [`hello`] for either lane of a pair.
pub fn hello_lane(magic: &[u8; 4], version: u16, ctx: [u8; 16], from: u32, to: u32, size: u32, bulk: bool) -> Vec<u8> {
    let mut b = vec![0u8; 64];
    b[6] = if bulk { 2 } else { 0 };
    b[0..4].copy_from_slice(magic);
    b[4..6].copy_from_slice(&version.to_le_bytes());
    b[8..24].copy_from_slice(&ctx);
    b[24..28].copy_from_slice(&from.to_le_bytes());
    b[28..32].copy_from_slice(&to.to_le_bytes());
    b[32..36].copy_from_slice(&size.to_le_bytes());
    b
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
