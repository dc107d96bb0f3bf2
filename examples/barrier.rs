//! Ranks arrive at a barrier at different times; none leaves before the last arrives.
//!
//! `cargo run --release --example barrier -- --np 4`

mod common;

use clap::Parser;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Rounds of barriers to time after the staggered one.
    #[arg(long, default_value_t = 1000)]
    rounds: u32,
}

fn main() {
    let args = Args::parse();
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else {
        println!("all ranks finished");
        return;
    };
    let rank = ctx.rank();
    // Stagger the arrivals: rank r does r * 50 ms of "work" first.
    let work = Duration::from_millis(50 * rank as u64);
    let t = Instant::now();
    std::thread::sleep(work);
    common::exit_on_error(ctx.barrier());
    let waited = t.elapsed();
    let last = Duration::from_millis(50 * (ctx.size() as u64 - 1));
    assert!(waited >= last, "rank {rank} left the barrier after {waited:?}, before the last rank arrived ({last:?})");
    let t = Instant::now();
    for _ in 0..args.rounds {
        common::exit_on_error(ctx.barrier());
    }
    let per = t.elapsed().as_secs_f64() * 1e6 / f64::from(args.rounds.max(1));
    println!(
        "[rank {rank}] worked {work:?}, left the barrier after {waited:?} (the last rank arrived at {last:?}); \
         {} more barriers at {per:.1} us each",
        args.rounds
    );
}
