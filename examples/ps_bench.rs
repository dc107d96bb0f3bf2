//! The parameter server's benchmark: push+pull goodput and latency against ferrogloo's own
//! point-to-point bandwidth and round trip, and the same gradient exchanged by allreduce.
//!
//! `cargo run --release --example ps_bench -- --servers 2 --workers 4`
//! (`FERROGLOO_TRANSPORT=tcp` for TCP; the default puts local nodes on shared memory)
//!
//! Each worker push-pulls a gradient of `--sizes` bytes (f32, spread over 16 keys, so over
//! every server) `--iters` times: a push-pull is one push of the gradient and the summed
//! values back. Reported per worker: median time, goodput (bytes pushed + pulled per second)
//! and, summed over workers, the job's goodput. Anchors, in the same run, on another context
//! of the same job: a ping-pong of the same size between worker 0 and server 0 (its round
//! trip, and its bandwidth: 2 × size per round trip), and an allreduce of the gradient among
//! the workers. Worker 0 prints a table and one JSON line per measurement.
//!
//! `--sparse N` adds the workload a parameter server is for: a model of N keys (one f32 each),
//! of which every worker touches `--touched` percent per step (a different random set each
//! step), push-pulled against an allreduce of the whole dense vector among the workers
//! (`--servers 2 --workers 4 --sparse 10000000`: 1% of 10 M keys).

use clap::Parser;
use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::{RankEnv, spawn_local};
use ferrogloo::ps::{KvWorker, Node, PsConfig, Role, SumStore};
use ferrogloo::rendezvous::PrefixStore;
use ferrogloo::{Context, Error, Reduction, Result};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
struct Args {
    /// Servers.
    #[arg(long, default_value_t = 1)]
    servers: usize,
    /// Workers.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Gradient sizes in bytes (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4096,4194304")]
    sizes: Vec<usize>,
    /// Timed push-pulls per size (large sizes run a tenth as many, at least 20).
    #[arg(long, default_value_t = 1000)]
    iters: usize,
    /// Also run the sparse workload over a model of this many keys (one f32 each): every
    /// worker push-pulls the keys it touched (`--touched` percent of them, a different random
    /// set each step) against an allreduce of the whole dense vector among the workers.
    #[arg(long)]
    sparse: Option<u64>,
    /// Percent of the model's keys a worker touches per step in the sparse workload.
    #[arg(long, default_value_t = 1.0)]
    touched: f64,
    /// Timed steps of the sparse workload.
    #[arg(long, default_value_t = 10)]
    steps: usize,
}

const KEYS: u64 = 16;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn iters_for(args: &Args, bytes: usize) -> usize {
    if bytes >= 1 << 20 { (args.iters / 10).max(20) } else { args.iters.max(20) }
}

/// A plain context of the job for the anchors, meeting under `prefix`.
fn plain(env: &RankEnv, prefix: &str) -> Result<Context> {
    let store = PrefixStore::new(prefix, env.open_store()?);
    let dev = Device::with_transport(Transport::from_env()?, &TcpAttr::from_env()?)?;
    Context::builder(env.rank, env.size).timeout(Duration::from_secs(60)).connect(&store, &dev)
}

/// Round trips of `bytes` between worker 0 (rank `servers`) and server 0 (rank 0); seconds.
fn pingpong(ctx: &Context, servers: usize, bytes: usize, iters: usize) -> Result<Vec<f64>> {
    let mut buf = vec![0u8; bytes];
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters + 5 {
        if ctx.rank() == servers {
            let t = Instant::now();
            ctx.send(0, 1, &buf)?;
            ctx.recv(0, 1, &mut buf)?;
            times.push(t.elapsed().as_secs_f64());
        } else if ctx.rank() == 0 {
            ctx.recv(servers, 1, &mut buf)?;
            ctx.send(servers, 1, &buf)?;
        }
    }
    Ok(times.split_off(times.len().min(5)))
}

/// This rank's node of a parameter server meeting under `prefix`: a server runs (a
/// [`SumStore`]) until every worker has said goodbye and gives `None`; a worker is returned.
fn ps_node(args: &Args, env: &RankEnv, prefix: &str) -> Result<Option<KvWorker<f32>>> {
    let (s, w) = (args.servers, args.workers);
    let store = PrefixStore::new(prefix, env.open_store()?);
    let dev = Device::with_transport(Transport::from_env()?, &TcpAttr::from_env()?)?;
    let cfg = PsConfig::new(w, s);
    if env.rank < s {
        Node::connect(&store, &dev, Role::Server, env.rank, cfg)?.server(SumStore::<f32>::default())?.run()?;
        return Ok(None);
    }
    Ok(Some(Node::connect(&store, &dev, Role::Worker, env.rank - s, cfg)?.worker::<f32>()?))
}

/// Worker `me`'s touched keys for each of `sets` steps: `share` of `0..model`, sorted and
/// unique, from a fixed-seed generator (the same on every run).
fn touched_sets(model: u64, share: f64, me: usize, sets: usize) -> Vec<Vec<u64>> {
    let want = ((model as f64 * share / 100.0) as usize).max(1);
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (me as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..sets)
        .map(|_| {
            let mut keys: Vec<u64> = (0..want)
                .map(|_| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    (x >> 11) % model
                })
                .collect();
            keys.sort_unstable();
            keys.dedup();
            keys
        })
        .collect()
}

/// The sparse workload (see `--sparse`); worker 0 prints the result and whether the target
/// (push+pull of the touched keys ≥ 5× faster per step than the dense allreduce) is met.
fn sparse(args: &Args, env: &RankEnv, model: u64) -> Result<()> {
    let (s, w) = (args.servers, args.workers);
    let ctx = plain(env, "ps-bench/sparse-plain")?;
    let steps = args.steps.max(3);
    // The dense anchor: an allreduce of the whole model among the workers.
    let workers: Vec<usize> = (s..s + w).collect();
    let mut allreduce = f64::NAN;
    if env.rank >= s {
        let wctx = ctx.subgroup(&workers)?;
        let len = usize::try_from(model).map_err(|_| Error::invalid("--sparse: too many keys for this machine"))?;
        let mut dense = vec![1f32; len];
        let mut t = Vec::new();
        for _ in 0..steps + 1 {
            let start = Instant::now();
            wctx.allreduce(&mut dense, Reduction::Sum)?;
            t.push(start.elapsed().as_secs_f64());
        }
        allreduce = median(t.split_off(1));
    }
    ctx.barrier()?;
    let Some(worker) = ps_node(args, env, "ps-bench/sparse")? else { return Ok(()) };
    let me = env.rank - s;
    let sets = touched_sets(model, args.touched, me, 4);
    let most = sets.iter().map(Vec::len).max().unwrap_or(0);
    let (grad, mut back) = (vec![1f32; most], vec![0f32; most]);
    let mut t = Vec::new();
    for step in 0..steps + 1 {
        let keys = &sets[step % sets.len()];
        let n = keys.len();
        let start = Instant::now();
        worker.wait_into(worker.push_pull(keys, &grad[..n], &vec![1; n])?, &mut back[..n])?;
        t.push(start.elapsed().as_secs_f64());
    }
    let step = median(t.split_off(1));
    if me == 0 {
        let touched = sets.first().map_or(0, Vec::len);
        let speedup = allreduce / step;
        println!(
            "{{\"bench\":\"ps_sparse\",\"servers\":{s},\"workers\":{w},\"keys\":{model},\"touched\":{touched},\"step_us\":{:.1},\"allreduce_us\":{:.1},\"speedup\":{speedup:.2},\"transport\":\"{}\"}}",
            step * 1e6,
            allreduce * 1e6,
            Transport::from_env().map(|t| format!("{t:?}")).unwrap_or_default()
        );
        println!(
            "# sparse: {model} keys, {touched} touched per worker and step ({}%), {s} servers, {w} workers: push+pull \
             {:.1} ms per step, dense allreduce {:.1} ms: {speedup:.1}x ({} the target of 5x)",
            args.touched,
            step * 1e3,
            allreduce * 1e3,
            if speedup >= 5.0 { "met" } else { "MISSED" }
        );
    }
    Ok(())
}

fn run(args: &Args, env: &RankEnv) -> Result<()> {
    let (s, w) = (args.servers, args.workers);
    let ctx = plain(env, "ps-bench/plain")?;
    let mut anchors = Vec::new();
    for &bytes in &args.sizes {
        let rt = median(pingpong(&ctx, s, bytes, iters_for(args, bytes))?);
        anchors.push((bytes, rt));
    }
    // Allreduce among the workers.
    let workers: Vec<usize> = (s..s + w).collect();
    let mut allreduce = Vec::new();
    if env.rank >= s {
        let wctx = ctx.subgroup(&workers)?;
        for &bytes in &args.sizes {
            let mut g = vec![1f32; bytes / 4];
            let mut t = Vec::new();
            for _ in 0..iters_for(args, bytes) {
                let start = Instant::now();
                wctx.allreduce(&mut g, Reduction::Sum)?;
                t.push(start.elapsed().as_secs_f64());
            }
            allreduce.push(median(t));
        }
    }
    ctx.barrier()?;
    let Some(worker) = ps_node(args, env, "ps-bench/ps")? else { return Ok(()) };
    let me = env.rank - s;
    for (i, &bytes) in args.sizes.iter().enumerate() {
        // Keys of their own per size (a key keeps the length of its first push).
        let keys: Vec<u64> = (0..KEYS).map(|k| i as u64 * 1000 + k).collect();
        let g = vec![1f32; (bytes / 4).max(KEYS as usize) / KEYS as usize * KEYS as usize];
        let mut t = Vec::new();
        // The pulled values land in one buffer, reused (wait_into checks its length).
        let mut back = vec![0f32; g.len()];
        for _ in 0..iters_for(args, bytes) + 5 {
            let start = Instant::now();
            worker.wait_into(worker.push_pull(&keys, &g, &[])?, &mut back)?;
            t.push(start.elapsed().as_secs_f64());
        }
        let t = median(t.split_off(5));
        let sent = (g.len() * 4) as f64;
        let goodput = 2.0 * sent / t / 1e9;
        let (_, rt) = anchors[i];
        let p2p_bw = 2.0 * bytes as f64 / rt / 1e9;
        if me == 0 {
            println!(
                "{{\"bench\":\"ps\",\"servers\":{s},\"workers\":{w},\"bytes\":{bytes},\"push_pull_us\":{:.2},\"goodput_gbs\":{goodput:.3},\
                 \"job_goodput_gbs\":{:.3},\"p2p_rtt_us\":{:.2},\"p2p_bw_gbs\":{p2p_bw:.3},\"allreduce_us\":{:.2},\"transport\":\"{}\"}}",
                t * 1e6,
                goodput * w as f64,
                rt * 1e6,
                allreduce[i] * 1e6,
                Transport::from_env().map(|t| format!("{t:?}")).unwrap_or_default()
            );
            println!(
                "# {bytes} B, {s} servers, {w} workers: push+pull {:.1} µs ({goodput:.2} GB/s per worker, {:.2} job); \
                 point-to-point round trip {:.1} µs ({p2p_bw:.2} GB/s): ratio time {:.2}x, goodput {:.2}x; allreduce {:.1} µs",
                t * 1e6,
                goodput * w as f64,
                rt * 1e6,
                t / rt,
                goodput / p2p_bw,
                allreduce[i] * 1e6
            );
        }
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    let result = (|| -> Result<()> {
        if !RankEnv::is_set() {
            let argv: Vec<String> = std::env::args().skip(1).collect();
            return spawn_local(args.servers + args.workers, &argv, Duration::from_secs(600));
        }
        let env = RankEnv::from_env()?;
        if env.size != args.servers + args.workers || args.servers == 0 || args.workers == 0 {
            return Err(Error::invalid("--servers and --workers must be at least 1 and add up to the job's size"));
        }
        run(&args, &env)?;
        match args.sparse {
            Some(model) => sparse(&args, &env, model),
            None => Ok(()),
        }
    })();
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
