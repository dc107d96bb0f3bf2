//! A token travels around a ring of ranks; each rank adds its rank number. Then every rank
//! checks the total and meets the others at a barrier.
//!
//! `cargo run --release --example ring -- --np 4`

mod common;

use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Laps around the ring.
    #[arg(long, default_value_t = 1000)]
    laps: u64,
}

fn main() {
    let args = Args::parse();
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else {
        println!("all ranks finished");
        return;
    };
    let (rank, n) = (ctx.rank(), ctx.size());
    let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
    let expected: u64 = (0..n as u64).sum();
    let start = Instant::now();
    let mut token = [0u64; 2]; // [lap, sum]
    let result = (|| -> ferrogloo::Result<()> {
        for lap in 0..args.laps {
            if n == 1 {
                token = [lap, 0];
            } else if rank == 0 {
                ctx.send(right, 0, &[lap, 0])?;
                ctx.recv(left, 0, &mut token)?;
            } else {
                ctx.recv(left, 0, &mut token)?;
                token[1] += rank as u64;
                ctx.send(right, 0, &token)?;
            }
            if rank == 0 && token != [lap, expected] {
                return Err(ferrogloo::Error::invalid(format!("lap {lap}: token {token:?}, expected sum {expected}")));
            }
        }
        ctx.barrier()
    })();
    common::exit_on_error(result);
    let per_hop = start.elapsed().as_secs_f64() * 1e6 / (args.laps as f64 * n as f64);
    if rank == 0 {
        println!(
            "[rank 0] ring of {n} ranks: token went {} laps, sum {expected} every lap; {per_hop:.1} us per hop",
            args.laps
        );
    } else {
        println!("[rank {rank}] received from rank {left}, passed to rank {right}, {} laps", args.laps);
    }
}
