//! Ranks arrive at a barrier at different times; none leaves before the last arrives.
//!
//! `cargo run --release --example barrier -- --np 4`

mod common;

use clap::Parser;
use ferrogloo::CollectiveOptions;
use std::time::{Duration, Instant, SystemTime};

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
    let arrived = wall_ns();
    common::exit_on_error(ctx.barrier());
    let left = wall_ns();
    let waited = t.elapsed();
    // When the last rank arrived, by the wall clock (the ranks' timers above started at
    // different moments; the wall clock is one for the ranks of one host).
    let mut last_arrived = [arrived];
    common::exit_on_error(ctx.broadcast(&mut last_arrived, ctx.size() - 1, &CollectiveOptions::default()));
    let early = last_arrived[0].saturating_sub(left);
    assert!(early == 0, "rank {rank} left the barrier {early} ns before the last rank arrived");
    let last = Duration::from_millis(50 * (ctx.size() as u64 - 1));
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

/// Nanoseconds since the Unix epoch, by this host's wall clock.
fn wall_ns() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}
