//! A candle model trained data-parallel on ferrogloo: a two-layer perceptron learns to classify
//! points that a fixed "teacher" network labels (generated with a fixed seed; nothing is
//! downloaded).
//!
//! ```text
//! cargo build --release -p ferrogloo-candle --example ddp
//! ferrogloo-run -np 2 target/release/examples/ddp
//! torchrun --nproc-per-node 2 --no-python target/release/examples/ddp
//! target/release/examples/ddp --np 2          # starts its own local ranks
//! target/release/examples/ddp                 # one process, the whole batch
//! ```
//!
//! Each step, the global batch is split evenly across the ranks; each rank computes the loss
//! and gradients on its share, [`DataParallel::average_gradients`] averages the gradients, and
//! every rank's SGD applies the same update. Every rank starts from weights of its own (seeded
//! by its rank) and [`DataParallel::broadcast_parameters`] replaces them with rank 0's, so the
//! run is the same as one process training on the whole batch: the losses it prints match the
//! single-process run's within floating-point rounding. Rank 0 prints the loss per epoch and,
//! after checking that every rank holds bitwise the same weights, the summary line.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, Optimizer, SGD, VarBuilder, VarMap};
use clap::Parser;
use ferrogloo::engine::{Engine, EngineConfig, Reduction};
use ferrogloo::launch::{RankEnv, spawn_local};
use ferrogloo_candle::{DataParallel, Result};

#[derive(Parser, Debug)]
struct Args {
    /// Start N local ranks of this program (without a launcher).
    #[arg(long)]
    np: Option<usize>,
    /// Passes over the data.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Samples in the data set.
    #[arg(long, default_value_t = 1536)]
    samples: usize,
    /// Samples per step, over all ranks (a multiple of the number of ranks).
    #[arg(long, default_value_t = 96)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.5)]
    lr: f64,
    /// Seed of the data and of rank 0's initial weights.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

const INPUTS: usize = 16;
const HIDDEN: usize = 32;

/// A small deterministic generator of values in [-1, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

struct Mlp {
    hidden: Linear,
    out: Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            hidden: candle_nn::linear(INPUTS, HIDDEN, vb.pp("hidden"))?,
            out: candle_nn::linear(HIDDEN, 1, vb.pp("out"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.out.forward(&self.hidden.forward(x)?.tanh()?)
    }
}

/// The data set: inputs, and labels 0/1 from a random teacher network.
fn data(args: &Args) -> Result<(Tensor, Tensor)> {
    let mut g = Lcg(args.seed);
    let x = g.vec(args.samples * INPUTS, 1.0);
    let (tw1, tw2) = (g.vec(HIDDEN * INPUTS, 1.0), g.vec(HIDDEN, 1.0));
    let y: Vec<f32> = x
        .chunks(INPUTS)
        .map(|row| {
            let h = tw1.chunks(INPUTS).map(|w| w.iter().zip(row).map(|(a, b)| a * b).sum::<f32>().tanh());
            let logit: f32 = h.zip(&tw2).map(|(h, w)| h * w).sum();
            f32::from(logit > 0.0)
        })
        .collect();
    Ok((
        Tensor::from_vec(x, (args.samples, INPUTS), &Device::Cpu)?,
        Tensor::from_vec(y, (args.samples, 1), &Device::Cpu)?,
    ))
}

/// Sets the model's weights from `seed` (candle's own initialisation draws from an unseeded
/// generator, which a comparison with a single-process run cannot use).
fn init(varmap: &mut VarMap, seed: u64) -> Result<()> {
    let mut g = Lcg(seed);
    let a = 1.0 / (INPUTS as f32).sqrt();
    let b = 1.0 / (HIDDEN as f32).sqrt();
    let dev = &Device::Cpu;
    varmap.set_one("hidden.weight", Tensor::from_vec(g.vec(HIDDEN * INPUTS, a), (HIDDEN, INPUTS), dev)?)?;
    varmap.set_one("hidden.bias", Tensor::from_vec(g.vec(HIDDEN, a), HIDDEN, dev)?)?;
    varmap.set_one("out.weight", Tensor::from_vec(g.vec(HIDDEN, b), (1, HIDDEN), dev)?)?;
    varmap.set_one("out.bias", Tensor::from_vec(g.vec(1, b), 1, dev)?)?;
    Ok(())
}

fn train(args: &Args, engine: Engine) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let (rank, n) = (engine.rank(), engine.size());
    if args.batch == 0 || !args.batch.is_multiple_of(n) || args.samples < args.batch {
        return Err(format!(
            "--batch {} must be a positive multiple of the {n} ranks and at most --samples {}",
            args.batch, args.samples
        )
        .into());
    }
    let (x, y) = data(args)?;
    let mut varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    // Each rank starts from weights of its own; the broadcast makes them rank 0's.
    init(&mut varmap, args.seed.wrapping_add(1 + rank as u64))?;
    let dp = DataParallel::from_varmap(engine, &varmap)?;
    dp.broadcast_parameters(0)?;
    let mut sgd = SGD::new(varmap.all_vars(), args.lr)?;

    let share = args.batch / n;
    let steps = args.samples / args.batch;
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for epoch in 1..=args.epochs {
        let mut total = 0.0;
        for step in 0..steps {
            let start = step * args.batch + rank * share;
            let (xs, ys) = (x.narrow(0, start, share)?, y.narrow(0, start, share)?);
            let loss = candle_nn::loss::binary_cross_entropy_with_logit(&model.forward(&xs)?, &ys)?;
            let mut grads = loss.backward()?;
            dp.average_gradients(&mut grads)?;
            sgd.step(&grads)?;
            total += dp.allreduce_scalar("loss", f64::from(loss.to_scalar::<f32>()?))?;
        }
        let mean = total / steps as f64;
        if epoch == 1 {
            first = mean;
        }
        last = mean;
        if rank == 0 {
            println!("epoch {epoch}: loss {mean:.6}");
        }
    }

    // Every rank compares its weights with rank 0's, bit for bit.
    let mut same = true;
    for (name, var) in dp.parameters() {
        let mine = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        let root = dp.engine().broadcast(&format!("check.{name}"), mine.clone(), 0)?.wait()?;
        same &= root.data.iter().zip(&mine).all(|(a, b)| a.to_bits() == b.to_bits());
    }
    let all_same = dp.allreduce_scalar_with("weights-identical", f64::from(u8::from(same)), Reduction::Min)? == 1.0;
    dp.shutdown()?;
    if !all_same {
        return Err(match same {
            true => "after training, another rank's weights differ from rank 0's".into(),
            false => format!("after training, rank {rank}'s weights differ from rank 0's").into(),
        });
    }
    if rank == 0 {
        println!(
            "ddp: {n} ranks, {} epochs, loss {first:.6} -> {last:.6}, weights identical on every rank",
            args.epochs
        );
    }
    Ok(())
}

fn run(args: &Args) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let engine = if RankEnv::is_set() {
        Engine::from_env()?
    } else if let Some(np) = args.np {
        let argv: Vec<String> = std::env::args().skip(1).collect();
        spawn_local(np, &argv, ferrogloo::context::default_timeout()? * 4)?;
        return Ok(());
    } else {
        // No launcher: one process, a world of one.
        let ctx = ferrogloo::Context::builder(0, 1)
            .connect(&ferrogloo::rendezvous::HashStore::new(), &ferrogloo::device::Device::in_process())?;
        Engine::new(ctx, EngineConfig::from_env()?)?
    };
    train(args, engine)
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("ddp: {e}");
        std::process::exit(1);
    }
}
