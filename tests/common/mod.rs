//! Helpers shared by the integration tests.
#![allow(dead_code)]

use ferrogloo::device::{Device, TcpAttr};
use ferrogloo::rendezvous::Store;
use ferrogloo::{Context, Result};
use std::time::Duration;

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
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (f, build) = (&f, &build);
                s.spawn(move || {
                    let dev = Device::new(attr)?;
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
    results.into_iter().enumerate().map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r} failed: {e}"))).collect()
}

/// A payload that differs for every (from, to, index): catches misrouted or shifted data.
pub fn pattern(from: usize, to: usize, len: usize) -> Vec<u32> {
    (0..len).map(|i| ((from as u32) << 24) ^ ((to as u32) << 16) ^ (i as u32).wrapping_mul(2654435761)).collect()
}
