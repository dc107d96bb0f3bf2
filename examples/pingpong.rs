//! Point-to-point latency and bandwidth between rank 0 and rank 1.
//!
//! `cargo run --release --example pingpong -- --np 2`
//!
//! Latency: round trips of an 8-byte message (p50 and min over `--iters`). Bandwidth: rank 0
//! sends `--mib` MiB, rank 1 answers with 8 bytes once it has all of it; repeated `--reps`
//! times, the median reported.

mod common;

use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Round trips for the latency figure.
    #[arg(long, default_value_t = 20000)]
    iters: usize,
    /// Megabytes per bandwidth transfer.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Bandwidth transfers.
    #[arg(long, default_value_t = 20)]
    reps: usize,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = Args::parse();
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else { return };
    if ctx.size() != 2 {
        common::exit_on_error::<()>(Err(ferrogloo::Error::invalid("pingpong needs exactly 2 ranks")));
    }
    let (me, peer) = (ctx.rank(), 1 - ctx.rank());
    let result = (|| -> ferrogloo::Result<()> {
        // Latency.
        let mut small = [0u64; 1];
        let mut rtts = Vec::with_capacity(args.iters);
        for i in 0..args.iters + 100 {
            let t = Instant::now();
            if me == 0 {
                ctx.send(peer, 1, &[i as u64])?;
                ctx.recv(peer, 1, &mut small)?;
                assert_eq!(small[0], i as u64 + 1);
            } else {
                ctx.recv(peer, 1, &mut small)?;
                small[0] += 1;
                ctx.send(peer, 1, &small)?;
            }
            if i >= 100 {
                rtts.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        // Bandwidth.
        let bytes = args.mib << 20;
        let mut buf = vec![me as u8; bytes];
        let mut secs = Vec::with_capacity(args.reps);
        for rep in 0..args.reps + 2 {
            ctx.barrier()?;
            let t = Instant::now();
            if me == 0 {
                ctx.send(peer, 2, &buf)?;
                ctx.recv(peer, 3, &mut small)?;
            } else {
                ctx.recv(peer, 2, &mut buf)?;
                ctx.send(peer, 3, &small)?;
            }
            if rep >= 2 {
                secs.push(t.elapsed().as_secs_f64());
            }
        }
        if me == 1 {
            assert!(buf.iter().all(|&b| b == 0), "payload corrupted");
        }
        if me == 0 {
            let min = rtts.iter().copied().fold(f64::INFINITY, f64::min);
            let p50 = median(&mut rtts);
            let s = median(&mut secs);
            println!("latency: 8-byte round trip p50 {p50:.1} us, min {min:.1} us ({} iterations)", args.iters);
            println!(
                "bandwidth: {} MiB one way in {:.2} ms = {:.2} GB/s (median of {})",
                args.mib,
                s * 1e3,
                bytes as f64 / s / 1e9,
                args.reps
            );
        }
        Ok(())
    })();
    common::exit_on_error(result);
}
