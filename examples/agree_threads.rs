//! Latency of `Context::agree` and `Context::shrink` against a barrier, with the ranks as
//! threads of this one process: as many as you like (the process benchmark,
//! `ferrogloo-bench --op agree,shrink`, is bounded by the processes a machine runs well).
//!
//! `cargo run --release --example agree_threads -- --threads 32 --transport memory`
//!
//! Prints one line: the median over the iterations (each timed on rank 0, all ranks entering
//! together) of a barrier, an agreement and a shrink, and the agreement's ratio to the
//! barrier.

#[path = "common/threads.rs"]
mod threads;

use clap::Parser;
use ferrogloo::rendezvous::HashStore;
use ferrogloo::{Context, Error, Result};
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Ranks, each a thread.
    #[arg(long, default_value_t = 32)]
    threads: usize,
    /// Transport between them: memory (in-process), shm or tcp (loopback).
    #[arg(long, default_value = "memory")]
    transport: String,
    /// Timed iterations of each operation.
    #[arg(long, default_value_t = 200)]
    iters: usize,
}

/// The median of `samples`, in microseconds.
fn median_us(mut samples: Vec<Duration>) -> f64 {
    samples.sort_unstable();
    samples.get(samples.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// Times `iters` calls of `op` on `ctx` (after a tenth as many untimed), each begun together
/// after a barrier; returns the samples.
fn timed(ctx: &Context, iters: usize, mut op: impl FnMut(&Context) -> Result<()>) -> Result<Vec<Duration>> {
    for _ in 0..iters / 10 + 1 {
        op(ctx)?;
    }
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        ctx.barrier()?;
        let t = Instant::now();
        op(ctx)?;
        samples.push(t.elapsed());
    }
    Ok(samples)
}

/// One rank: its samples of a barrier, an agreement and a shrink.
fn rank(r: usize, args: &Args, store: &HashStore) -> Result<[Vec<Duration>; 3]> {
    let ctx = Context::builder(r, args.threads)
        .timeout(Duration::from_secs(60))
        .connect(store, &threads::device(&args.transport)?)?;
    let barrier = timed(&ctx, args.iters, |c| c.barrier())?;
    let agree = timed(&ctx, args.iters, |c| c.agree(!0).map(drop))?;
    let shrink = timed(&ctx, args.iters, |c| c.shrink().map(drop))?;
    Ok([barrier, agree, shrink])
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.threads == 0 || args.iters == 0 {
        eprintln!("agree_threads: --threads and --iters must be at least 1");
        return ExitCode::FAILURE;
    }
    let store = HashStore::new();
    let results: Vec<Result<[Vec<Duration>; 3]>> = std::thread::scope(|s| {
        let (args, store) = (&args, &store);
        let handles: Vec<_> = (0..args.threads).map(|r| s.spawn(move || rank(r, args, store))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::invalid("a rank panicked")))).collect()
    });
    let mut first = None;
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(samples) if r == 0 => first = Some(samples),
            Ok(_) => {}
            Err(e) => {
                eprintln!("agree_threads: rank {r}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let Some([barrier, agree, shrink]) = first else { return ExitCode::FAILURE };
    let (b, a, s) = (median_us(barrier), median_us(agree), median_us(shrink));
    println!(
        "agree_threads: {} threads over {}: barrier {b:.1} µs, agree {a:.1} µs ({:.1}x the barrier), shrink {s:.1} µs",
        args.threads,
        args.transport,
        a / b.max(1e-3)
    );
    ExitCode::SUCCESS
}
