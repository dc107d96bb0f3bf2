//! Surviving a dead rank: N rank processes allreduce in a loop; rank K is killed with SIGKILL in
//! the middle of one allreduce; the others see the failure, agree on who failed, shrink the
//! context to the survivors and allreduce on it, checking the result.
//!
//! `cargo run --release --example survive -- --np 4 --kill 2`
//!
//! The last line (from the first survivor) reads like
//! `survive: survivors [0, 1, 3] agreed failed [2] in 0.4 ms, shrank in 0.3 ms, allreduce correct`
//! (ranks of the original job). The launcher expects rank K to die by SIGKILL and exits 0 when
//! it is the only rank that failed.

mod common;

use clap::Parser;
use ferrogloo::launch::{LocalJob, RankEnv, spawn_local_with};
use ferrogloo::{Error, Reduction, Result};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// The rank to kill with SIGKILL during an allreduce.
    #[arg(long, default_value_t = 2)]
    kill: usize,
    /// The allreduce during which it is killed (counted from 0).
    #[arg(long, default_value_t = 3)]
    kill_at: usize,
    /// Elements (f32) of each allreduce: enough that one takes a few milliseconds.
    #[arg(long, default_value_t = 1 << 22)]
    count: usize,
}

/// What rank `r` (of the original job) contributes at index `i`.
fn value(r: usize, i: usize) -> f32 {
    (r + 1 + i % 7) as f32
}

fn rank_main(args: &Args) -> Result<Option<String>> {
    let Some(ctx) = common::join(&args.job)? else { return Ok(None) };
    let (me, n) = (ctx.rank(), ctx.size());
    if args.kill >= n || n < 2 {
        return Err(Error::invalid(format!("--kill {} needs a job of at least 2 ranks with that rank", args.kill)));
    }
    let mut buf = vec![0f32; args.count];
    let fill = |buf: &mut [f32], r: usize| buf.iter_mut().enumerate().for_each(|(i, x)| *x = value(r, i));
    // Allreduce until one fails; the rank to kill dies in the middle of allreduce `kill_at`.
    let mut failure = None;
    for it in 0..args.kill_at + 10 {
        fill(&mut buf, me);
        if me == args.kill && it == args.kill_at {
            std::thread::spawn(|| {
                // Fault injection, not synchronisation: a moment into the allreduce.
                std::thread::sleep(Duration::from_millis(1));
                // SAFETY: raise(3) with a valid signal number; SIGKILL ends the process here.
                unsafe { libc::raise(libc::SIGKILL) };
            });
        }
        match ctx.allreduce(&mut buf, Reduction::Sum) {
            Ok(()) => {
                let want = |i: usize| (0..n).map(|r| value(r, i)).sum::<f32>();
                if let Some(i) = (0..buf.len()).find(|&i| buf[i] != want(i)) {
                    return Err(Error::invalid(format!("allreduce {it}: element {i} is {}, not {}", buf[i], want(i))));
                }
            }
            Err(e) => {
                failure = Some((Instant::now(), e));
                break;
            }
        }
    }
    let Some((seen, cause)) = failure else {
        return Err(Error::invalid(format!("no allreduce failed although rank {} was killed", args.kill)));
    };
    tracing::info!(rank = me, cause = %cause, "allreduce failed; agreeing");
    let agreed = ctx.agree(1)?;
    let agree_ms = seen.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let small = ctx.shrink()?;
    let shrink_ms = t.elapsed().as_secs_f64() * 1e3;
    let survivors: Vec<usize> = (0..small.size()).filter_map(|r| small.world_rank(r)).collect();
    fill(&mut buf, me);
    small.allreduce(&mut buf, Reduction::Sum)?;
    let want = |i: usize| survivors.iter().map(|&r| value(r, i)).sum::<f32>();
    if let Some(i) = (0..buf.len()).find(|&i| buf[i] != want(i)) {
        return Err(Error::invalid(format!(
            "the shrunk context's allreduce: element {i} is {}, not {}",
            buf[i],
            want(i)
        )));
    }
    let failed: Vec<usize> = agreed.failed.iter().filter_map(|&r| ctx.world_rank(r)).collect();
    Ok((small.rank() == 0).then(|| {
        format!(
            "survive: survivors {survivors:?} agreed failed {failed:?} in {agree_ms:.2} ms, shrank in {shrink_ms:.2} ms, \
             allreduce correct"
        )
    }))
}

fn main() {
    let args = Args::parse();
    if !RankEnv::is_set()
        && let Some(n) = args.job.np
    {
        // The launcher: rank `kill` is meant to die by SIGKILL; any other failure is the job's.
        let argv: Vec<String> = std::env::args().skip(1).collect();
        let job = LocalJob { ranks: n, timeout: Duration::from_secs(50), grace: Duration::from_secs(30) };
        match spawn_local_with(&job, &argv) {
            Err(Error::RanksFailed { ranks, detail }) if ranks == [args.kill] && detail.contains("signal: 9") => {}
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
            Ok(()) => {
                eprintln!("error: rank {} was not killed", args.kill);
                std::process::exit(1);
            }
        }
        return;
    }
    if let Some(line) = common::exit_on_error(rank_main(&args)) {
        println!("{line}");
    }
}
