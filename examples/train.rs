//! Data-parallel training through the engine: N local ranks fit a small two-layer network
//! (tanh hidden layer, logistic output) to data a fixed "teacher" network labels, each rank on
//! its own shard.
//!
//! `cargo run --release --example train -- --np 4`
//!
//! Per mini-batch every rank computes its gradients and submits them per layer from two
//! threads, in an order that differs between ranks (the output layer first on even ranks, the
//! hidden layer first on odd ones); the [engine](ferrogloo::engine) negotiates the names,
//! fuses them and averages them; every rank applies the same update. Rank 0 prints the loss
//! over all shards per epoch; at the end every rank checks that its weights are bitwise
//! identical to rank 0's. `HOROVOD_TIMELINE=tl.json` writes a Chrome-trace timeline.

mod common;

use clap::Parser;
use ferrogloo::engine::{Engine, EngineConfig, Handle, Reduction, Tensor};
use ferrogloo::{Error, Result};

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Passes over the data.
    #[arg(long, default_value_t = 12)]
    epochs: usize,
    /// Samples per rank.
    #[arg(long, default_value_t = 1024)]
    samples: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.5)]
    lr: f32,
}

const INPUTS: usize = 16;
const HIDDEN: usize = 32;

/// A small deterministic generator.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// The network's parameters, one tensor per layer part.
#[derive(Clone)]
struct Model {
    w1: Vec<f32>, // HIDDEN x INPUTS
    b1: Vec<f32>, // HIDDEN
    w2: Vec<f32>, // HIDDEN
    b2: Vec<f32>, // 1
}

impl Model {
    fn new(seed: u64) -> Self {
        let mut g = Lcg(seed);
        let scale = 1.0 / (INPUTS as f32).sqrt();
        Model {
            w1: (0..HIDDEN * INPUTS).map(|_| g.next() * scale).collect(),
            b1: vec![0.0; HIDDEN],
            w2: (0..HIDDEN).map(|_| g.next() * 0.1).collect(),
            b2: vec![0.0],
        }
    }

    fn hidden(&self, x: &[f32]) -> Vec<f32> {
        (0..HIDDEN)
            .map(|h| (self.b1[h] + (0..INPUTS).map(|i| self.w1[h * INPUTS + i] * x[i]).sum::<f32>()).tanh())
            .collect()
    }

    /// The probability of class 1.
    fn predict(&self, x: &[f32]) -> f32 {
        let h = self.hidden(x);
        sigmoid(self.b2[0] + (0..HIDDEN).map(|k| self.w2[k] * h[k]).sum::<f32>())
    }

    /// Summed cross-entropy loss and gradients over a batch.
    fn gradients(&self, xs: &[Vec<f32>], ys: &[f32]) -> (f32, Model) {
        let mut g =
            Model { w1: vec![0.0; HIDDEN * INPUTS], b1: vec![0.0; HIDDEN], w2: vec![0.0; HIDDEN], b2: vec![0.0] };
        let mut loss = 0.0;
        for (x, &y) in xs.iter().zip(ys) {
            let h = self.hidden(x);
            let p = sigmoid(self.b2[0] + (0..HIDDEN).map(|k| self.w2[k] * h[k]).sum::<f32>());
            loss -= y * p.max(1e-7).ln() + (1.0 - y) * (1.0 - p).max(1e-7).ln();
            let d = (p - y) / xs.len() as f32;
            g.b2[0] += d;
            for (k, &hk) in h.iter().enumerate() {
                g.w2[k] += d * hk;
                let dh = d * self.w2[k] * (1.0 - hk * hk);
                g.b1[k] += dh;
                for (w, xi) in g.w1[k * INPUTS..(k + 1) * INPUTS].iter_mut().zip(x) {
                    *w += dh * xi;
                }
            }
        }
        (loss, g)
    }

    fn flat(&self) -> Vec<f32> {
        [&self.w1[..], &self.b1, &self.w2, &self.b2].concat()
    }
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// This rank's shard: inputs and the teacher's labels.
fn shard(rank: usize, samples: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
    let teacher = Model::new(7);
    let mut g = Lcg(1000 + rank as u64);
    let xs: Vec<Vec<f32>> = (0..samples).map(|_| (0..INPUTS).map(|_| g.next() * 2.0).collect()).collect();
    let ys = xs.iter().map(|x| if teacher.predict(x) > 0.5 { 1.0 } else { 0.0 }).collect();
    (xs, ys)
}

type Grad = Handle<Tensor<f32>>;

fn train(engine: &Engine, args: &Args) -> Result<()> {
    let (rank, n) = (engine.rank(), engine.size());
    let (xs, ys) = shard(rank, args.samples);
    // Every rank starts from the same weights (the same seed).
    let mut model = Model::new(42);
    let steps = args.samples.div_ceil(args.batch.max(1));
    for epoch in 0..args.epochs {
        let mut loss_sum = 0.0f32;
        for step in 0..steps {
            let lo = step * args.batch.max(1);
            let hi = (lo + args.batch.max(1)).min(xs.len());
            let (loss, g) = model.gradients(&xs[lo..hi], &ys[lo..hi]);
            loss_sum += loss;
            // Two threads submit the layers' gradients, in an order that depends on the rank.
            let (out_layer, hidden_layer) = std::thread::scope(|s| {
                let submit = |parts: Vec<(&str, Vec<f32>)>| -> Result<Vec<Grad>> {
                    parts.into_iter().map(|(name, v)| engine.allreduce(name, v, Reduction::Average)).collect()
                };
                let out = vec![("layer2.bias", g.b2.clone()), ("layer2.weight", g.w2.clone())];
                let hid = vec![("layer1.weight", g.w1.clone()), ("layer1.bias", g.b1.clone())];
                let (first, second) = if rank % 2 == 0 { (out, hid) } else { (hid, out) };
                let t = s.spawn(move || submit(first));
                let b = submit(second);
                let a = t.join().map_err(|_| Error::invalid("a submitting thread panicked"))?;
                let (a, b) = (a?, b?);
                Ok::<_, Error>(if rank % 2 == 0 { (a, b) } else { (b, a) })
            })?;
            let wait =
                |hs: Vec<Grad>| -> Result<Vec<Vec<f32>>> { hs.into_iter().map(|h| Ok(h.wait()?.data)).collect() };
            let out = wait(out_layer)?;
            let hid = wait(hidden_layer)?;
            let lr = args.lr;
            let step_in = |w: &mut [f32], g: &[f32]| w.iter_mut().zip(g).for_each(|(w, g)| *w -= lr * g);
            step_in(&mut model.b2, &out[0]);
            step_in(&mut model.w2, &out[1]);
            step_in(&mut model.w1, &hid[0]);
            step_in(&mut model.b1, &hid[1]);
        }
        let total = engine.allreduce("loss", vec![loss_sum, xs.len() as f32], Reduction::Sum)?.wait()?.data;
        if rank == 0 {
            println!("epoch {epoch:>2}: loss {:.5} over {} samples on {n} ranks", total[0] / total[1], total[1]);
        }
    }
    // Every rank must hold the same weights, bit for bit.
    let mine = model.flat();
    let theirs = engine.broadcast("final.weights", mine.clone(), 0)?.wait()?.data;
    let same = mine.iter().zip(&theirs).all(|(a, b)| a.to_bits() == b.to_bits());
    let agree = engine.allreduce("final.agree", vec![u32::from(same)], Reduction::Min)?.wait()?.data[0];
    if agree != 1 {
        return Err(Error::invalid(format!("rank {rank}: the ranks' weights differ")));
    }
    let correct = xs.iter().zip(&ys).filter(|(x, y)| (model.predict(x) > 0.5) == (**y > 0.5)).count();
    let acc = engine.allreduce("final.accuracy", vec![correct as u64, xs.len() as u64], Reduction::Sum)?.wait()?.data;
    if rank == 0 {
        let st = engine.stats();
        println!(
            "weights bitwise identical on all {n} ranks; training accuracy {:.1}%; engine: {} cycles, {} cache hits, {} fused batches",
            100.0 * acc[0] as f64 / acc[1] as f64,
            st.cycles,
            st.cache_hits,
            st.fused_batches
        );
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else {
        println!("all ranks finished");
        return;
    };
    let engine = common::exit_on_error(EngineConfig::from_env().and_then(|cfg| Engine::new(ctx, cfg)));
    common::exit_on_error(train(&engine, &args));
}
