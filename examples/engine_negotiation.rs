//! What one engine cycle costs as the ranks grow, agreeing each rank to every other against
//! agreeing by reduction ([`EngineConfig::tree_negotiation_from`]), with the ranks as threads of
//! this one process (as many as you like; `engine_bench` measures processes).
//!
//! `cargo run --release --example engine_negotiation -- --threads 4,8,16,32 --transport memory`
//!
//! For each count of ranks and each way of agreeing, rank 0 times `--iters` rounds of one 4-byte
//! allreduce, submit → done: `warm` (the same name every time: a cache hit, one cycle of bits)
//! and `cold` (an engine without a response cache: every round goes through the coordinator),
//! beside `bare` (a plain `Context::allreduce` of 4 bytes on the same ranks, before the engines
//! start); then what an engine left to choose (the default, `auto`) takes. Prints one JSON line
//! per measurement and a table of medians in microseconds.

#[path = "common/threads.rs"]
mod threads;

use clap::Parser;
use ferrogloo::engine::{Engine, EngineConfig, Reduction};
use ferrogloo::rendezvous::{HashStore, PrefixStore};
use ferrogloo::{Context, Error, Result};
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Counts of ranks (each a thread), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,32")]
    threads: Vec<usize>,
    /// Transport between them: memory (in-process), shm or tcp (loopback).
    #[arg(long, default_value = "memory")]
    transport: String,
    /// Timed rounds of each measurement (after a tenth as many untimed).
    #[arg(long, default_value_t = 300)]
    iters: usize,
}

/// The median and the 10th and 90th percentiles of `samples`, in microseconds.
fn spread_us(mut samples: Vec<Duration>) -> [f64; 3] {
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len().max(1) - 1) as f64 * q).round() as usize;
        samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    [at(0.5), at(0.1), at(0.9)]
}

/// `iters` timed rounds of `round` (after a tenth as many untimed).
fn timed(iters: usize, mut round: impl FnMut() -> Result<()>) -> Result<Vec<Duration>> {
    for _ in 0..iters / 10 + 1 {
        round()?;
    }
    (0..iters)
        .map(|_| {
            let t = Instant::now();
            round()?;
            Ok(t.elapsed())
        })
        .collect()
}

/// Rounds of one 4-byte allreduce through an engine over a fresh context.
fn engine_rounds(
    r: usize,
    n: usize,
    args: &Args,
    store: &PrefixStore<&HashStore>,
    cfg: EngineConfig,
) -> Result<(Vec<Duration>, u64)> {
    let ctx =
        Context::builder(r, n).timeout(Duration::from_secs(120)).connect(store, &threads::device(&args.transport)?)?;
    let e = Engine::new(ctx, cfg)?;
    let want = n as f32;
    let samples = timed(args.iters, || {
        let got = e.allreduce("x", vec![1f32], Reduction::Sum)?.wait()?.data;
        match got[..] == [want] {
            true => Ok(()),
            false => Err(Error::invalid(format!("rank {r}: {got:?}, want [{want}]"))),
        }
    })?;
    // Rounds whose allreduce was folded from the tensors that travelled with the states.
    let eager = e.stats().eager;
    e.shutdown()?;
    Ok((samples, eager))
}

/// A measurement: its mode, its samples, and the rounds reduced from travelling tensors.
type Measured = (String, Vec<Duration>, u64);

/// The measurements of one rank of `n` (bare, then warm and cold for each way of agreeing),
/// and the way an engine left to measure (the default) chooses: `tree` or `direct`.
fn rank(r: usize, n: usize, args: &Args, store: &HashStore) -> Result<(Vec<Measured>, &'static str)> {
    let at = |p: &str| PrefixStore::new(format!("{n}/{p}"), store);
    let ctx = Context::builder(r, n)
        .timeout(Duration::from_secs(120))
        .connect(&at("bare"), &threads::device(&args.transport)?)?;
    let mut one = [1f32];
    let bare = timed(args.iters, || {
        one[0] = 1.0;
        ctx.allreduce(&mut one, Reduction::Sum)
    })?;
    drop(ctx);
    let mut out = vec![("bare".to_string(), bare, 0)];
    for (way, from) in [("direct", Some(0)), ("tree", Some(2))] {
        let base = EngineConfig { stall_check: None, tree_negotiation_from: from, ..EngineConfig::default() };
        let warm = engine_rounds(r, n, args, &at(&format!("{way}/warm")), base.clone())?;
        let cold = engine_rounds(r, n, args, &at(&format!("{way}/cold")), EngineConfig { cache_capacity: 0, ..base })?;
        out.push((format!("{way} warm"), warm.0, warm.1));
        out.push((format!("{way} cold"), cold.0, cold.1));
    }
    // What an engine left to measure (the default) chooses here.
    let ctx = Context::builder(r, n)
        .timeout(Duration::from_secs(120))
        .connect(&at("auto"), &threads::device(&args.transport)?)?;
    let e = Engine::new(ctx, EngineConfig { stall_check: None, ..EngineConfig::default() })?;
    let chose = if e.agrees_by_reduction() { "tree" } else { "direct" };
    e.shutdown()?;
    Ok((out, chose))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.threads.contains(&0) || args.iters == 0 {
        eprintln!("engine_negotiation: --threads and --iters must be at least 1");
        return ExitCode::FAILURE;
    }
    let mut table = Vec::new();
    for &n in &args.threads {
        let store = HashStore::new();
        let results: Vec<Result<(Vec<Measured>, &str)>> = std::thread::scope(|s| {
            let (args, store) = (&args, &store);
            let handles: Vec<_> = (0..n).map(|r| s.spawn(move || rank(r, n, args, store))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::invalid("a rank panicked")))).collect()
        });
        let mut first = None;
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Ok(m) if r == 0 => first = Some(m),
                Ok(_) => {}
                Err(e) => {
                    eprintln!("engine_negotiation: {n} ranks, rank {r}: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        let Some((measured, chose)) = first else { return ExitCode::FAILURE };
        let mut row = vec![n.to_string()];
        for (mode, samples, eager) in measured {
            let [p50, p10, p90] = spread_us(samples);
            println!(
                "{{\"bench\":\"engine_negotiation\",\"transport\":\"{}\",\"ranks\":{n},\"mode\":\"{mode}\",\"median_us\":{p50:.1},\"p10_us\":{p10:.1},\"p90_us\":{p90:.1},\"travelled\":{eager}}}",
                args.transport
            );
            row.push(format!("{p50:.1}"));
        }
        println!(
            "{{\"bench\":\"engine_negotiation\",\"transport\":\"{}\",\"ranks\":{n},\"mode\":\"auto\",\"chose\":\"{chose}\"}}",
            args.transport
        );
        row.push(chose.to_string());
        table.push(row);
    }
    println!("# ranks | bare | direct warm | direct cold | tree warm | tree cold (median µs, rank 0) | auto chose");
    for row in table {
        println!("# {}", row.join(" | "));
    }
    ExitCode::SUCCESS
}
