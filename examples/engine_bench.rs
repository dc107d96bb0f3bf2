//! The engine's benchmark: N local ranks measure what the [engine](ferrogloo::engine) costs
//! against plain collectives on equal contexts.
//!
//! `cargo run --release --example engine_bench -- --np 4`
//!
//! - **latency**: one 4 KiB f32 tensor, submit → done, with the response cache warm (the same
//!   name every time), cold (`cache_capacity: 0`: every round goes through the coordinator),
//!   and a bare `Context::allreduce` of 4 KiB; Horovod's floor is its 1 ms cycle.
//! - **idle**: an engine with nothing submitted: CPU time of the whole process over
//!   `--idle-secs`, and negotiation cycles (which must not move).
//! - **resnet**: one step of ResNet-50's 161 gradients (25,557,032 f32, the sizes of
//!   torchvision's `resnet50().parameters()`), submitted in reverse layer order as backprop
//!   produces them: through the engine with fusion (64 MiB), without fusion, as plain ordered
//!   allreduces one per tensor, and as one allreduce of all parameters in a single buffer.
//!
//! Every mode runs on its own full context of the same job (formed through the job's store
//! under a prefix), on the default transport (shared memory between local ranks). Rank 0
//! prints a table and one JSON line per measurement.

mod common;

use clap::Parser;
use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::engine::{Engine, EngineConfig, Op};
use ferrogloo::launch::RankEnv;
use ferrogloo::rendezvous::PrefixStore;
use ferrogloo::{Context, Error, ReduceOp, Result};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Timed ResNet-50 steps per mode.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Latency iterations per mode.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Seconds of idling for the idle measurement.
    #[arg(long, default_value_t = 2.0)]
    idle_secs: f64,
    /// Measurements to run: latency, idle, resnet (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "latency,idle,resnet")]
    only: Vec<String>,
}

/// The sizes of ResNet-50's parameter tensors, in torchvision's order.
fn resnet50() -> Vec<usize> {
    let mut t = vec![64 * 3 * 7 * 7, 64, 64];
    let mut inputs = 64;
    for (blocks, width) in [(3, 64), (4, 128), (6, 256), (3, 512)] {
        for b in 0..blocks {
            let out = width * 4;
            t.extend([width * inputs, width, width, width * width * 9, width, width, out * width, out, out]);
            if b == 0 {
                t.extend([out * inputs, out, out]);
            }
            inputs = out;
        }
    }
    t.extend([2048 * 1000, 1000]);
    t
}

/// Another full context of this job, formed through the job's store under `label`.
fn context(label: &str, rank: usize, size: usize) -> Result<Context> {
    let env = RankEnv::from_env()?;
    let store = PrefixStore::new(format!("engine-bench/{label}"), ferrogloo::rendezvous::open(&env.store)?);
    let dev = Device::with_transport(Transport::from_env()?, &TcpAttr::from_env()?)?;
    Context::builder(rank, size).timeout(Duration::from_secs(60)).connect(&store, &dev)
}

fn engine(label: &str, rank: usize, size: usize, cfg: EngineConfig) -> Result<Engine> {
    Engine::new(context(label, rank, size)?, EngineConfig { stall_check: None, timeline: None, ..cfg })
}

/// The configuration from the environment (HOROVOD_* variables), for runs that vary it.
fn base() -> Result<EngineConfig> {
    EngineConfig::from_env()
}

/// Median, minimum and maximum (or 10th and 90th percentile) of `xs`, in the same unit.
fn stats(mut xs: Vec<f64>, percentiles: bool) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize];
    if xs.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    if percentiles { (at(0.5), at(0.1), at(0.9)) } else { (at(0.5), at(0.0), at(1.0)) }
}

/// CPU time (user + system) of this process so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes one rusage struct into the zeroed one we lend it.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer to a live rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

struct Report {
    rank: usize,
    size: usize,
}

impl Report {
    fn line(&self, bench: &str, mode: &str, unit: &str, (mid, lo, hi): (f64, f64, f64), extra: &str) {
        if self.rank == 0 {
            println!(
                "{{\"bench\":\"{bench}\",\"mode\":\"{mode}\",\"np\":{},\"median_{unit}\":{mid:.3},\"low_{unit}\":{lo:.3},\"high_{unit}\":{hi:.3}{extra}}}",
                self.size
            );
        }
    }
}

fn latency(args: &Args, ctx: &Context, rep: &Report) -> Result<Engine> {
    let (rank, size) = (ctx.rank(), ctx.size());
    let iters = args.iters.max(10);
    let mut buf = vec![1f32; 1024];
    let mut bare = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        ctx.allreduce(&mut buf, ReduceOp::Sum)?;
        if i >= iters / 10 {
            bare.push(t.elapsed().as_secs_f64() * 1e6);
        }
        buf.fill(1.0);
    }
    let time = |e: &Engine, fresh: bool| -> Result<Vec<f64>> {
        let mut v = vec![1f32; 1024];
        let mut out = Vec::with_capacity(iters);
        for i in 0..iters + iters / 10 {
            let name = if fresh { format!("t{i}") } else { "t".to_string() };
            let t = Instant::now();
            v = e.allreduce(&name, v, Op::Sum)?.wait()?.data;
            if i >= iters / 10 {
                out.push(t.elapsed().as_secs_f64() * 1e6);
            }
            v.fill(1.0);
        }
        Ok(out)
    };
    let warm_engine = engine("warm", rank, size, base()?)?;
    let warm = time(&warm_engine, false)?;
    let cold_engine = engine("cold", rank, size, EngineConfig { cache_capacity: 0, ..base()? })?;
    let cold = time(&cold_engine, false)?;
    let cold_hits = cold_engine.stats().cache_hits;
    drop(cold_engine);
    let (b, w, c) = (stats(bare, true), stats(warm, true), stats(cold, true));
    rep.line("latency", "bare", "us", b, "");
    rep.line("latency", "warm", "us", w, &format!(",\"ratio_to_bare\":{:.2}", w.0 / b.0));
    rep.line("latency", "cold", "us", c, &format!(",\"ratio_to_bare\":{:.2},\"cache_hits\":{cold_hits}", c.0 / b.0));
    if rank == 0 {
        println!("# 4 KiB f32 submit -> done, {size} ranks, median (p10-p90) µs over {iters} iterations:");
        println!("#   bare allreduce {:.1} ({:.1}-{:.1})", b.0, b.1, b.2);
        println!(
            "#   engine, cache warm {:.1} ({:.1}-{:.1}) = {:.2}x bare; Horovod's cycle alone is 1000 µs ({:.0}x this)",
            w.0,
            w.1,
            w.2,
            w.0 / b.0,
            1000.0 / w.0
        );
        println!("#   engine, cache off {:.1} ({:.1}-{:.1}) = {:.2}x bare", c.0, c.1, c.2, c.0 / b.0);
    }
    Ok(warm_engine)
}

fn idle(args: &Args, e: &Engine, rep: &Report) -> Result<()> {
    e.barrier()?.wait()?;
    let (cycles, cpu, t) = (e.stats().cycles, cpu_time(), Instant::now());
    std::thread::sleep(Duration::try_from_secs_f64(args.idle_secs).map_err(|_| Error::invalid("--idle-secs"))?);
    let busy = (cpu_time() - cpu).as_secs_f64() / t.elapsed().as_secs_f64() * 100.0;
    let moved = e.stats().cycles - cycles;
    rep.line("idle", "engine", "cpu_percent", (busy, busy, busy), &format!(",\"cycles\":{moved}"));
    if e.rank() == 0 {
        println!("# idle engine: {busy:.3}% of a core over {:.1} s, {moved} negotiation cycles", args.idle_secs);
    }
    Ok(())
}

fn resnet(args: &Args, ctx: &Context, rep: &Report) -> Result<()> {
    let (rank, size) = (ctx.rank(), ctx.size());
    let sizes = resnet50();
    let total: usize = sizes.iter().sum();
    if sizes.len() != 161 || total != 25_557_032 {
        return Err(Error::invalid(format!("the ResNet-50 list has {} tensors of {total} parameters", sizes.len())));
    }
    let mut grads: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![1f32; n]).collect();
    let steps = args.steps.max(1);
    let mut times: Vec<(&str, Vec<f64>)> = Vec::new();

    // Plain collectives, one per tensor in backprop order.
    let mut t = Vec::new();
    for s in 0..args.warmup + steps {
        ctx.barrier()?;
        let start = Instant::now();
        for g in grads.iter_mut().rev() {
            ctx.allreduce(g, ReduceOp::Sum)?;
        }
        if s >= args.warmup {
            t.push(start.elapsed().as_secs_f64() * 1e3);
        }
        grads.iter_mut().for_each(|g| g.fill(1.0));
    }
    times.push(("ordered", t));

    // All parameters in one buffer.
    let mut flat = vec![1f32; total];
    let mut t = Vec::new();
    for s in 0..args.warmup + steps {
        ctx.barrier()?;
        let start = Instant::now();
        ctx.allreduce(&mut flat, ReduceOp::Sum)?;
        if s >= args.warmup {
            t.push(start.elapsed().as_secs_f64() * 1e3);
        }
        flat.fill(1.0);
    }
    drop(flat);
    times.push(("single", t));

    for (mode, threshold) in [("fused", 64usize << 20), ("unfused", 0)] {
        let e = engine(mode, rank, size, EngineConfig { fusion_threshold: threshold, ..base()? })?;
        let names: Vec<String> = (0..sizes.len()).map(|i| format!("param{i}.grad")).collect();
        let mut t = Vec::new();
        for s in 0..args.warmup + steps {
            e.barrier()?.wait()?;
            let start = Instant::now();
            let mut handles = Vec::with_capacity(grads.len());
            for (i, g) in grads.drain(..).enumerate().collect::<Vec<_>>().into_iter().rev() {
                handles.push((i, e.allreduce(&names[i], g, Op::Sum)?));
            }
            let mut back: Vec<(usize, Vec<f32>)> = Vec::with_capacity(handles.len());
            for (i, h) in handles {
                back.push((i, h.wait()?.data));
            }
            if s >= args.warmup {
                t.push(start.elapsed().as_secs_f64() * 1e3);
            }
            back.sort_by_key(|(i, _)| *i);
            grads = back
                .into_iter()
                .map(|(_, mut g)| {
                    g.fill(1.0);
                    g
                })
                .collect();
        }
        let st = e.stats();
        if rank == 0 {
            println!(
                "# {mode}: {} cycles, {} collectives, {} fused batches of {} tensors in {} steps",
                st.cycles,
                st.collectives,
                st.fused_batches,
                st.fused_tensors,
                args.warmup + steps
            );
        }
        times.push((mode, t));
    }

    let single = stats(times[1].1.clone(), false).0;
    let unfused =
        times.iter().find(|(m, _)| *m == "unfused").map(|(_, t)| stats(t.clone(), false).0).unwrap_or(f64::NAN);
    if rank == 0 {
        println!(
            "# ResNet-50 step (161 tensors, {total} f32), {size} ranks, ms per step, median (min-max) of {steps}:"
        );
    }
    for (mode, t) in times {
        let s = stats(t, false);
        rep.line(
            "resnet50",
            mode,
            "ms",
            s,
            &format!(",\"ratio_to_single\":{:.3},\"speedup_over_unfused\":{:.2}", s.0 / single, unfused / s.0),
        );
        if rank == 0 {
            println!(
                "#   {mode:<8} {:>9.1} ({:.1}-{:.1})  {:.2}x single, {:.2}x faster than unfused",
                s.0,
                s.1,
                s.2,
                s.0 / single,
                unfused / s.0
            );
        }
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else {
        return;
    };
    let rep = Report { rank: ctx.rank(), size: ctx.size() };
    let run = || -> Result<()> {
        let want = |m: &str| args.only.iter().any(|o| o == m);
        let mut warm = None;
        if want("latency") || want("idle") {
            warm = Some(latency(&args, &ctx, &rep)?);
        }
        if want("idle")
            && let Some(e) = &warm
        {
            idle(&args, e, &rep)?;
        }
        drop(warm);
        if want("resnet") {
            resnet(&args, &ctx, &rep)?;
        }
        Ok(())
    };
    common::exit_on_error(run());
}
