//! Times every allreduce and broadcast algorithm over a range of sizes, so you can see which
//! one suits your job (and where `Auto` switches).
//!
//! `cargo run --release --example algorithms -- --np 4`
//!
//! Timing rule: warm-up, then iterations each started after a barrier and counted at the
//! slowest rank; the median is printed.

mod common;

use clap::Parser;
use ferrogloo::{Algorithm, CollectiveOptions, Context, Reduction};
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,65536,262144,1048576,4194304,16777216")]
    sizes: Vec<usize>,
    /// Timed iterations per cell.
    #[arg(long, default_value_t = 30)]
    iters: usize,
}

/// Median time of `f` in microseconds, the slowest rank's per iteration.
fn time(ctx: &Context, iters: usize, mut f: impl FnMut() -> ferrogloo::Result<()>) -> ferrogloo::Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut t = Vec::with_capacity(iters);
    for _ in 0..iters {
        ctx.barrier()?;
        let s = Instant::now();
        f()?;
        let mut us = [s.elapsed().as_secs_f64() * 1e6];
        ctx.allreduce(&mut us, Reduction::Max)?;
        t.push(us[0]);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

fn main() {
    let args = Args::parse();
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else { return };
    let n = ctx.size();
    let result = (|| -> ferrogloo::Result<()> {
        if ctx.rank() == 0 {
            println!("{n} ranks; median us per call (busbw GB/s)");
            println!(
                "{:>10} {:>18} {:>18} {:>18} {:>18}",
                "bytes", "allreduce ring", "allreduce h-d", "bcast tree", "bcast pipeline"
            );
        }
        for &bytes in &args.sizes {
            let mut buf = vec![1.0f32; bytes / 4];
            let mut row = Vec::new();
            for algo in [Algorithm::Ring, Algorithm::HalvingDoubling] {
                let o = CollectiveOptions::new().algorithm(algo);
                let us = time(&ctx, args.iters, || ctx.allreduce_with(&mut buf, Reduction::Sum, &o))?;
                row.push((us, bytes as f64 / us / 1e3 * 2.0 * (n - 1) as f64 / n as f64));
            }
            for algo in [Algorithm::BinomialTree, Algorithm::Pipeline] {
                let o = CollectiveOptions::new().algorithm(algo);
                let us = time(&ctx, args.iters, || ctx.broadcast(&mut buf, 0, &o))?;
                row.push((us, bytes as f64 / us / 1e3));
            }
            if ctx.rank() == 0 {
                let cells: Vec<String> = row.iter().map(|(us, bw)| format!("{us:>9.1} ({bw:>5.2})")).collect();
                println!("{bytes:>10} {}", cells.iter().map(|c| format!("{c:>18}")).collect::<String>());
            }
        }
        Ok(())
    })();
    common::exit_on_error(result);
}
