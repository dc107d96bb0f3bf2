//! The allreduce cost model's predictions for worlds too large to run here (see
//! `ferrogloo::cost`): for each world size and buffer size, the time each algorithm would take
//! on links of the given model, the one `Auto` picks, and its bus bandwidth.
//!
//! ```text
//! cargo run --release --example cost_model -- --model latency_us=50,link_gbs=1.25,reduce_gbs=8 \
//!     --ranks 64,256,1024 --sizes 4096,1048576,67108864
//! ```
//!
//! With `--per-host R` it also predicts the two-level allreduce of ranks R to a host (the
//! steps within a host at `--memory-gbs`).

use clap::Parser;
use ferrogloo::{Algorithm, CostModel};
use std::time::Duration;

#[derive(Parser)]
#[command(about = "Predicted allreduce times from an alpha-beta-gamma cost model")]
struct Args {
    /// The model: latency_us=…,link_gbs=…,reduce_gbs=… (as FERROGLOO_COST_MODEL takes it).
    #[arg(long, default_value = "latency_us=50,link_gbs=1.25,reduce_gbs=8")]
    model: CostModel,
    /// World sizes (ranks), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    ranks: Vec<usize>,
    /// Buffer sizes in bytes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4096,65536,1048576,16777216,67108864")]
    sizes: Vec<usize>,
    /// Ranks per host, for the two-level allreduce's column (1: none).
    #[arg(long, default_value_t = 1)]
    per_host: usize,
    /// Copy bandwidth within a host (GB/s), for the two-level allreduce.
    #[arg(long, default_value_t = 10.0)]
    memory_gbs: f64,
}

fn us(t: Option<Duration>) -> String {
    t.map_or("-".into(), |t| format!("{:.1}", t.as_secs_f64() * 1e6))
}

fn main() -> ferrogloo::Result<()> {
    let a = Args::parse();
    let m = a.model;
    let memory = CostModel::new(Duration::ZERO, a.memory_gbs * 1e9, m.reduce_bytes_per_s)?;
    println!("# model: {m}");
    println!("# busbw = 2(n-1)/n * size / time of the pick; times in us");
    let two = a.per_host > 1;
    println!(
        "# {:>6} {:>12} {:>12} {:>12} {:>12} {:>6} {:>10}{}",
        "ranks",
        "size (B)",
        "rd",
        "hd",
        "ring",
        "auto",
        "busbw GB/s",
        if two { format!(" {:>14}", format!("two-level x{}", a.per_host)) } else { String::new() }
    );
    for &n in &a.ranks {
        for &s in &a.sizes {
            let t = |alg| m.allreduce_time(alg, n, s);
            let pick = m.allreduce_choice(n, s);
            let best = t(pick).unwrap_or_default().as_secs_f64();
            let busbw = if best > 0.0 { 2.0 * (n as f64 - 1.0) / n as f64 * s as f64 / best / 1e9 } else { 0.0 };
            let hier = (two && n % a.per_host == 0)
                .then(|| m.hierarchical_allreduce_time(&memory, n / a.per_host, a.per_host, s));
            println!(
                "  {:>6} {:>12} {:>12} {:>12} {:>12} {:>6} {:>10.3}{}",
                n,
                s,
                us(t(Algorithm::RecursiveDoubling)),
                us(t(Algorithm::HalvingDoubling)),
                us(t(Algorithm::Ring)),
                pick.name(),
                busbw,
                if two { format!(" {:>14}", us(hier)) } else { String::new() }
            );
        }
    }
    Ok(())
}
