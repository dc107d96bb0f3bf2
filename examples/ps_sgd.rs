//! Sparse logistic regression through the parameter server: 2 servers and 4 workers as local
//! processes (the servers own the weights, one key per feature, hash-sharded); each worker
//! pulls the weights of the features its mini-batch touches, computes the gradient on its own
//! shard of the data and pushes it.
//!
//! `cargo run --release --example ps_sgd` (synchronous SGD: every step waits for all workers)
//! `cargo run --release --example ps_sgd -- --mode async` (each push applied as it comes)
//!
//! Worker 0 prints the loss of its mini-batches per epoch.

use clap::Parser;
use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::launch::{RankEnv, spawn_local};
use ferrogloo::ps::{AsyncSgd, KvWorker, Node, PsConfig, Role, SyncSgd};
use ferrogloo::{Error, Result};
use std::time::Duration;

#[derive(Parser, Debug)]
struct Args {
    /// sync or async.
    #[arg(long, default_value = "sync")]
    mode: String,
    /// Servers.
    #[arg(long, default_value_t = 2)]
    servers: usize,
    /// Workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Passes over each worker's data.
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Samples per worker.
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    /// Samples per step.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 4.0)]
    lr: f32,
}

/// Features in the model (keys 0..FEATURES; key FEATURES is the bias).
const FEATURES: u64 = 5000;
/// Non-zero features per sample.
const ACTIVE: usize = 12;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 17
    }
}

/// A teacher's weight for feature `f` (fixed): samples are labelled by the sign of the sum.
fn teacher(f: u64) -> f32 {
    let mut g = Lcg(f.wrapping_mul(0x9e37_79b9) ^ 77);
    (g.next() % 2001) as f32 / 1000.0 - 1.0
}

/// Worker `w`'s shard: each sample's (sorted, distinct) active features and its label.
fn shard(w: usize, n: usize) -> Vec<(Vec<u64>, f32)> {
    let mut g = Lcg(1000 + w as u64);
    (0..n)
        .map(|_| {
            let mut fs: Vec<u64> = (0..ACTIVE).map(|_| g.next() % FEATURES).collect();
            fs.sort_unstable();
            fs.dedup();
            let y = if fs.iter().map(|&f| teacher(f)).sum::<f32>() > 0.0 { 1.0 } else { 0.0 };
            (fs, y)
        })
        .collect()
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

fn work(w: &KvWorker<f32>, args: &Args) -> Result<()> {
    let data = shard(w.id(), args.samples);
    let batch = args.batch.max(1);
    for epoch in 0..args.epochs {
        let (mut loss, mut seen) = (0.0f64, 0usize);
        for chunk in data.chunks(batch) {
            // The features this batch touches, and the bias.
            let mut keys: Vec<u64> = chunk.iter().flat_map(|(fs, _)| fs.iter().copied()).collect();
            keys.push(FEATURES);
            keys.sort_unstable();
            keys.dedup();
            let pulled = w.wait(w.pull(&keys)?)?;
            // Weights never pushed come back empty: zero.
            let mut weight = std::collections::HashMap::new();
            let mut at = 0;
            for (k, &l) in keys.iter().zip(&pulled.lens) {
                weight.insert(*k, if l == 1 { pulled.values[at] } else { 0.0 });
                at += l;
            }
            let mut grad: std::collections::HashMap<u64, f32> = keys.iter().map(|&k| (k, 0.0)).collect();
            for (fs, y) in chunk {
                let z = weight[&FEATURES] + fs.iter().map(|f| weight[f]).sum::<f32>();
                let p = sigmoid(z);
                loss -= f64::from(y * p.max(1e-7).ln() + (1.0 - y) * (1.0 - p).max(1e-7).ln());
                let d = (p - y) / chunk.len() as f32;
                for f in fs.iter().chain(std::iter::once(&FEATURES)) {
                    if let Some(g) = grad.get_mut(f) {
                        *g += d;
                    }
                }
            }
            seen += chunk.len();
            let g: Vec<f32> = keys.iter().map(|k| grad[k]).collect();
            w.wait(w.push(&keys, &g, &[])?)?;
        }
        if w.id() == 0 {
            println!(
                "epoch {epoch:>2}: loss {:.5} ({} mode, worker 0's {seen} samples)",
                loss / seen as f64,
                args.mode
            );
        }
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    let n = args.servers + args.workers;
    let run = || -> Result<()> {
        if !RankEnv::is_set() {
            // Start the job: n local processes of this program.
            let argv: Vec<String> = std::env::args().skip(1).collect();
            return spawn_local(n, &argv, Duration::from_secs(240));
        }
        let env = RankEnv::from_env()?;
        if env.size != n {
            return Err(Error::invalid(format!(
                "{} ranks for {} servers and {} workers",
                env.size, args.servers, args.workers
            )));
        }
        let store = env.open_store()?;
        let dev = Device::with_transport(Transport::from_env()?, &TcpAttr::from_env()?)?;
        let (role, id) =
            if env.rank < args.servers { (Role::Server, env.rank) } else { (Role::Worker, env.rank - args.servers) };
        let node = Node::connect(&store, &dev, role, id, PsConfig::new(args.workers, args.servers))?;
        match (role, args.mode.as_str()) {
            (Role::Server, "sync") => node.server(SyncSgd::new(args.workers, args.lr))?.run(),
            (Role::Server, "async") => node.server(AsyncSgd::new(args.lr))?.run(),
            (Role::Worker, "sync" | "async") => work(&node.worker::<f32>()?, &args),
            (_, m) => Err(Error::invalid(format!("--mode {m}: sync or async"))),
        }
    };
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
