//! Allreduce on GPU memory: N rank processes, each with a CUDA buffer on one GPU, allreduce it
//! through ferrogloo's staged CUDA path and check every element against the sum.
//!
//! `cargo run --release --features cuda --example cuda_allreduce -- --np 2`
//!
//! Where there is no CUDA driver or no GPU it says so and exits without running anything.

mod common;

use clap::Parser;
use ferrogloo::Reduction;
use ferrogloo::gpu::{Cuda, cuda_available, default_stream};
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Buffer sizes in bytes, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [4096usize, 1 << 20, 16 << 20, 64 << 20])]
    sizes: Vec<usize>,
    /// Timed allreduces per size.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// The GPU every rank uses.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Element type: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

fn main() {
    let args = Args::parse();
    if !cuda_available() {
        println!(
            "cuda_allreduce: no CUDA driver library (libcuda.so) was found, so this machine has no usable GPU; \
             nothing to run (the CUDA path is tested on host-simulated device memory by `cargo test`)"
        );
        return;
    }
    if let Err(e) = default_stream(args.gpu) {
        println!("cuda_allreduce: cannot use GPU {}: {e}", args.gpu);
        return;
    }
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else {
        println!("all ranks finished");
        return;
    };
    let result = match args.dtype.as_str() {
        "f32" => run::<f32>(&ctx, &args, |x| x as f32, |x| x as f64),
        "bf16" => run::<ferrogloo::bf16>(&ctx, &args, |x| ferrogloo::bf16::from_f32(x as f32), |x| x.to_f64()),
        other => Err(ferrogloo::Error::invalid(format!("--dtype {other}: expected f32 or bf16"))),
    };
    common::exit_on_error(result);
}

fn run<T: ferrogloo::gpu::CudaElement + Copy>(
    ctx: &ferrogloo::Context,
    args: &Args,
    from: fn(usize) -> T,
    to: fn(T) -> f64,
) -> ferrogloo::Result<()> {
    let (rank, n) = (ctx.rank(), ctx.size());
    let cuda_err = |e: ferrogloo::gpu::cudarc::driver::DriverError| ferrogloo::Error::invalid(format!("CUDA: {e:?}"));
    let stream = default_stream(args.gpu)?;
    let mut cuda = Cuda::new(ctx, stream.clone())?;
    if rank == 0 {
        println!(
            "# {n} ranks on GPU {}, {} elements, staged in {} KiB chunks",
            args.gpu,
            args.dtype,
            cuda.chunk_bytes() >> 10
        );
        println!("# {:>12} {:>12} {:>12}", "bytes", "time_us", "busbw_GB/s");
    }
    for &bytes in &args.sizes {
        let count = bytes / std::mem::size_of::<T>();
        // Small integers, exact in every type: rank r holds r + 1 + i % 8 at i.
        let host: Vec<T> = (0..count).map(|i| from(rank + 1 + i % 8)).collect();
        let mut dev = stream.clone_htod(&host).map_err(cuda_err)?;
        let mut best = f64::INFINITY;
        for it in 0..args.iters.max(1) + 1 {
            stream.memcpy_htod(&host, &mut dev).map_err(cuda_err)?;
            stream.synchronize().map_err(cuda_err)?;
            ctx.barrier()?;
            let t = Instant::now();
            cuda.allreduce(&mut dev, Reduction::Sum)?;
            stream.synchronize().map_err(cuda_err)?;
            if it > 0 {
                best = best.min(t.elapsed().as_secs_f64());
            }
        }
        let back = stream.clone_dtoh(&dev).map_err(cuda_err)?;
        if let Some(i) = (0..count).find(|&i| to(back[i]) != (n * (n + 1) / 2 + n * (i % 8)) as f64) {
            return Err(ferrogloo::Error::invalid(format!(
                "rank {rank}: element {i} is {}, expected {}",
                to(back[i]),
                n * (n + 1) / 2 + n * (i % 8)
            )));
        }
        if rank == 0 {
            let busbw = 2.0 * (n as f64 - 1.0) / n as f64 * (count * std::mem::size_of::<T>()) as f64 / best / 1e9;
            println!("  {:>12} {:>12.1} {:>12.2}", count * std::mem::size_of::<T>(), best * 1e6, busbw);
        }
    }
    Ok(())
}
