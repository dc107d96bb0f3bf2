//! The main job: N rank processes on this machine allreduce a buffer, and every rank checks the
//! result against the sum computed on its own.
//!
//! `cargo run --release --bin allreduce -- --np 4` (from the repository's root)
//!
//! Rank r contributes `r + 1 + i` at index i (f32), so the sum at index i is
//! `N(N+1)/2 + N·i`. Under a launcher (ferrogloo-run, mpirun, torchrun, ...) leave out `--np`.

// The examples' shared part (`--np`, `--rank/--size/--store`, logs), used here as it is.
#[path = "../../examples/common/mod.rs"]
mod common;

use clap::Parser;
use ferrogloo::Reduction;
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Elements in the buffer (f32).
    #[arg(long, default_value_t = 1 << 20)]
    count: usize,
    /// How many allreduces to time.
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

fn main() {
    let args = Args::parse();
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else {
        println!("all ranks finished");
        return;
    };
    let (rank, n) = (ctx.rank(), ctx.size());
    let fill = |buf: &mut [f32]| {
        for (i, x) in buf.iter_mut().enumerate() {
            *x = (rank + 1 + i % 1024) as f32;
        }
    };
    let expected = |i: usize| (n * (n + 1) / 2 + n * (i % 1024)) as f32;
    let mut buf = vec![0f32; args.count];
    let result = (|| -> ferrogloo::Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..args.iters.max(1) {
            fill(&mut buf);
            ctx.barrier()?;
            let t = Instant::now();
            ctx.allreduce(&mut buf, Reduction::Sum)?;
            best = best.min(t.elapsed().as_secs_f64());
            if let Some(i) = (0..buf.len()).find(|&i| buf[i] != expected(i)) {
                return Err(ferrogloo::Error::invalid(format!(
                    "rank {rank}: element {i} is {}, expected {}",
                    buf[i],
                    expected(i)
                )));
            }
        }
        Ok(best)
    })();
    let best = common::exit_on_error(result);
    let bytes = (args.count * 4) as f64;
    let busbw = if n > 1 { bytes * 2.0 * (n - 1) as f64 / n as f64 / best / 1e9 } else { 0.0 };
    println!(
        "[rank {rank}] allreduce of {} f32 across {n} ranks: all {} elements right; best {:.1} us ({busbw:.2} GB/s bus bandwidth)",
        args.count,
        args.count,
        best * 1e6
    );
}
