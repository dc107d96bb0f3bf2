//! `ferrogloo-bench`: bandwidth and latency of ferrogloo's collectives, in the style of
//! nccl-tests.
//!
//! `ferrogloo-bench --np 4 --op allreduce,allgather -b 8 -e 64M -f 4` runs 4 local ranks (a
//! temporary FileStore) and prints one line per size and algorithm: time (p50 of the slowest
//! rank per iteration), algorithm (for `auto`, the one it picked) and bus bandwidth, its ratio
//! to one thread's `memcpy` of that size measured in the same run (`eff`, see `memcpy`),
//! min/p99, and how many results were wrong.
//!
//! Timing rule (the same as the Gloo and MPI anchors in `../shared/bench`): warm-up with the
//! same count on every rank, then timed iterations, each after a barrier, each counted at the
//! slowest rank; p50/min/p99 over iterations. Sizes follow nccl-tests: allreduce, broadcast,
//! reduce and sendrecv move S bytes per rank; allgather's S is the total output; reduce_scatter's
//! S is the input; alltoall's S is each rank's send buffer.
//!
//! Every run warms the whole job up first (each collective once at the largest size), then
//! measures the cells of one collective size by size, with the algorithms in a rotated order
//! at each size, so no algorithm is always the first measured after a change of size.
//! Collectives run on bytes with a runtime element type (`Context::allreduce_bytes` and its
//! siblings), as an engine or a binding would call them.
//!
//! The binary `ferrogloo-bench` is [`main`]; its parts are `args` (the command line),
//! `measure` (one cell on host buffers), `gpu` (on GPU buffers) and `report` (the table, JSON
//! rows and plot).

mod args;
mod cache;
mod gpu;
mod measure;
mod memcpy;
mod report;

use args::{Args, algorithms, human, parse_size, sizes};
use clap::Parser;
use ferrogloo::device::{TcpAttr, Transport};
use ferrogloo::launch::{RankEnv, spawn_local};
use ferrogloo::{Algorithm, Context, Error, Result};
use gpu::{Gpu, gpu_for};
use measure::{Setup, effective, measure};
use report::{header, plot, print_cell, timing_mode, write_json};
use std::time::Duration;

/// One measured cell.
#[derive(Debug, Clone)]
pub(crate) struct Cell {
    op: String,
    /// The algorithm asked for.
    algorithm: Algorithm,
    /// The algorithm that ran (what `auto` picked).
    picked: Option<Algorithm>,
    bytes: usize,
    count: usize,
    iters: usize,
    p50: f64,
    min: f64,
    p99: f64,
    algbw: f64,
    busbw: f64,
    wrong: u32,
    /// One thread's copy bandwidth at this size in the same run (rank 0 only), GB/s.
    memcpy: Option<f64>,
    /// Each rank's mean time per call, over the ranks: mean, least, greatest (µs).
    ranks: [f64; 3],
    /// The time the context's cost model predicts (allreduce, µs; on rank 0).
    model: Option<f64>,
}

impl Cell {
    /// A cell from its timing: `moved` bytes per call, `factor` from algorithm to bus
    /// bandwidth (nccl-tests' rule).
    fn new(
        op: &str,
        algorithm: Algorithm,
        picked: Option<Algorithm>,
        (count, moved, factor): (usize, usize, f64),
        t: measure::Timing,
        wrong: u32,
    ) -> Cell {
        let mut sorted = t.worst;
        sorted.sort_by(f64::total_cmp);
        let p50 = sorted[sorted.len() / 2];
        let algbw = if p50 > 0.0 { moved as f64 / p50 / 1e3 } else { 0.0 };
        Cell {
            op: op.to_string(),
            algorithm,
            picked,
            bytes: moved,
            count,
            iters: sorted.len(),
            p50,
            min: sorted[0],
            p99: sorted[((sorted.len() - 1) as f64 * 0.99) as usize],
            algbw,
            busbw: algbw * factor,
            wrong,
            memcpy: None,
            ranks: t.ranks,
            model: None,
        }
    }

    /// "ring", or "auto:rd" when `auto` picked recursive doubling.
    fn algorithm_label(&self) -> String {
        match (self.algorithm, self.picked) {
            (Algorithm::Auto, Some(p)) => format!("auto:{}", p.name()),
            (a, _) => a.name().to_string(),
        }
    }

    /// Bus bandwidth ÷ one thread's copy bandwidth at the same size.
    fn efficiency(&self) -> Option<f64> {
        self.memcpy.filter(|m| *m > 0.0 && self.bytes > 0).map(|m| self.busbw / m)
    }
}

fn run(ctx: &Context, s: &Setup<'_>, gpu: &mut Option<Gpu<'_>>) -> Result<Vec<Cell>> {
    let args = s.args;
    let sizes = sizes(args)?;
    let (n, ts) = (ctx.size(), s.dtype.size());
    // The plan: per collective, size by size, the algorithms rotated by one at each size.
    let mut plan = Vec::new();
    for op in &args.op {
        let sizeless = matches!(op.as_str(), "barrier" | "agree" | "shrink");
        let sz: Vec<usize> = if sizeless { vec![0] } else { sizes.clone() };
        let shm = ctx.allreduce_algorithm(0, Algorithm::SharedMemory).is_ok() && n > 1;
        let algos = algorithms(op, &args.algorithm, shm)?;
        for (i, &b) in sz.iter().enumerate() {
            for k in 0..algos.len() {
                plan.push((op.clone(), algos[(i + k) % algos.len()], b));
            }
        }
    }
    if ctx.rank() == 0 {
        for op in &args.op {
            for &b in &sizes {
                let e = effective(op, b, ts, n);
                if e != b && !matches!(op.as_str(), "barrier" | "agree" | "shrink") {
                    let split = matches!(op.as_str(), "allgather" | "reduce_scatter" | "alltoall");
                    let why = if split {
                        format!("do not split into {n} equal blocks of whole {ts}-byte {} elements", s.dtype)
                    } else {
                        format!("are not a whole number of {ts}-byte {} elements", s.dtype)
                    };
                    println!("# {op}: {b} bytes {why}; measured {e} bytes");
                }
            }
        }
    }
    // Warm the whole job up once (connections, socket buffers, page faults, scratch) so the
    // first cell measured is not the one that pays for it.
    let largest = sizes.iter().copied().max().unwrap_or(0);
    for op in &args.op {
        let warm = Args { warmup: 1, iters: 1, seconds: None, ..args.clone() };
        let w = Setup { args: &warm, dtype: s.dtype, red: s.red, seg: s.seg };
        measure(ctx, &w, gpu, op, Algorithm::Auto, largest)?;
    }
    // The physical limit of each size, measured once by rank 0 while the others wait.
    let limits = if ctx.rank() == 0 && gpu.is_none() {
        let cell_sizes: std::collections::BTreeSet<usize> = args
            .op
            .iter()
            .filter(|op| !matches!(op.as_str(), "barrier" | "agree" | "shrink"))
            .flat_map(|op| sizes.iter().map(|&b| effective(op, b, ts, n)))
            .collect();
        let limits = memcpy::bandwidths(cell_sizes);
        if !limits.is_empty() {
            let list: Vec<String> = limits.iter().map(|(b, g)| format!("{} {g:.1}", human(*b))).collect();
            println!("# memcpy, one thread, this run (bytes GB/s): {}; eff = busbw / memcpy", list.join(", "));
        }
        limits
    } else {
        Default::default()
    };
    if let Some(m) = ctx.cost_model().filter(|_| ctx.rank() == 0 && gpu.is_none()) {
        println!("# cost model (measured as the context formed, the same on every rank): {m}; model = its prediction");
    }
    if let Some(p) = ctx.copy_plan().filter(|_| ctx.rank() == 0) {
        println!(
            "# shared-memory copies (this host's, FERROGLOO_SHM_SINGLE_COPY or measured as the context formed): {p}"
        );
    }
    ctx.barrier()?;
    let bar = if ctx.rank() == 0 {
        let b =
            indicatif::ProgressBar::with_draw_target(Some(plan.len() as u64), indicatif::ProgressDrawTarget::stderr());
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} cells {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut cells = Vec::new();
    let mut last_op = String::new();
    for (op, algo, bytes) in plan {
        bar.set_message(format!("{op} {algo} {}", human(bytes)));
        let mut cell = measure(ctx, s, gpu, &op, algo, bytes)?;
        cell.memcpy = limits.get(&cell.bytes).copied();
        if op == "allreduce" && gpu.is_none() {
            cell.model = ctx.predicted_allreduce_time(algo, cell.bytes)?.map(|t| t.as_secs_f64() * 1e6);
        }
        if ctx.rank() == 0 {
            if op != last_op {
                bar.suspend(|| header(ctx, args, &op));
                last_op = op.clone();
            }
            bar.suspend(|| print_cell(args, &cell));
        }
        bar.inc(1);
        cells.push(cell);
    }
    bar.finish_and_clear();
    Ok(cells)
}

fn rank_main(args: &Args, env: RankEnv) -> Result<()> {
    let mut attr = TcpAttr::from_env()?;
    if args.iface.is_some() {
        attr.iface = args.iface.clone();
    }
    if args.hostname.is_some() {
        attr.hostname = args.hostname.clone();
    }
    if let Some(b) = &args.socket_buffer {
        let b = parse_size(b)?;
        (attr.send_buffer, attr.recv_buffer) = (Some(b), Some(b));
    }
    let timeout = match args.timeout {
        Some(t) => {
            Duration::try_from_secs_f64(t).map_err(|_| Error::invalid(format!("--timeout {t} is not a duration")))?
        }
        // Set (not blank, which counts as unset): its value, or the error that it is not one.
        None if std::env::var(ferrogloo::config::FERROGLOO_TIMEOUT).is_ok_and(|v| !v.trim().is_empty()) => {
            ferrogloo::context::default_timeout()?
        }
        None => Duration::from_secs(120),
    };
    let setup = Setup {
        args,
        dtype: args.dtype.parse()?,
        red: args.reduce.parse()?,
        seg: args.segment_bytes.as_deref().map(parse_size).transpose()?,
    };
    let store = env.open_store()?;
    let transport = match &args.transport {
        Some(t) => t.parse()?,
        None => Transport::from_env()?,
    };
    let device = ferrogloo::device::Device::with_transport(transport, &attr)?;
    let mut builder = Context::builder(env.rank, env.size).timeout(timeout);
    if let Some(us) = args.busy_poll_us {
        builder = builder.busy_poll(Duration::from_micros(us));
    }
    let ctx = builder.connect(&store, &device)?;
    if ctx.rank() == 0 {
        println!("# transport: {transport} ({} backend)", device.backend_name());
    }
    if args.cold && args.device != "host" {
        return Err(Error::invalid("--cold rotates host buffers only; GPU buffers are measured warm"));
    }
    let mut gpu = gpu_for(&ctx, &args.device)?;
    if ctx.rank() == 0 && gpu.is_some() {
        println!("# buffers: GPU 0 (CUDA), staged through pinned host memory");
    }
    if ctx.rank() == 0 {
        timing_mode(args);
    }
    let cells = run(&ctx, &setup, &mut gpu)?;
    if ctx.rank() == 0 {
        let bus: Vec<f64> = cells.iter().filter(|c| c.bytes > 0).map(|c| c.busbw).collect();
        let avg = if bus.is_empty() { 0.0 } else { bus.iter().sum::<f64>() / bus.len() as f64 };
        let wrong: u32 = cells.iter().map(|c| c.wrong).sum();
        println!("# Out of bounds values : {wrong} {}", if wrong == 0 { "OK" } else { "WRONG" });
        println!("# Avg bus bandwidth    : {avg:.3}");
        if let Some(p) = &args.json {
            write_json(p, args, ctx.size(), transport, &cells)?;
        }
        if let Some(p) = &args.plot {
            plot(p, args, ctx.size(), &cells).map_err(|e| Error::invalid(format!("drawing {}: {e}", p.display())))?;
        }
        if wrong > 0 {
            return Err(Error::invalid(format!("{wrong} cells gave wrong results")));
        }
    }
    Ok(())
}

/// `ferrogloo-bench`: parses its command line, then runs the job's ranks (`--np`) or this rank,
/// and exits 1 with the error when it fails.
pub fn main() {
    crate::init_logging();
    let args = Args::parse();
    let result = if RankEnv::is_set() {
        RankEnv::from_env().and_then(|env| rank_main(&args, env))
    } else {
        match (args.np, args.rank, args.size, &args.store) {
            (Some(n), None, None, _) => {
                let argv: Vec<String> = std::env::args().skip(1).collect();
                // Bounded: a sweep's worth of deadlines.
                let per = args.timeout.map_or(Duration::from_secs(120), Duration::from_secs_f64);
                spawn_local(n, &argv, per * 30)
            }
            (None, Some(rank), Some(size), Some(store)) => rank_main(&args, RankEnv::new(rank, size, store.clone())),
            _ => Err(Error::invalid("give --np N, or --rank R --size N --store URL")),
        }
    };
    if let Err(e) = result {
        eprintln!("ferrogloo-bench: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::measure::repeat;
    use super::*;

    #[test]
    fn sizes_read_and_print_in_human_units() {
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(human(4096), "4K");
        assert_eq!(human(1 << 20), "1M");
        assert_eq!(human(3 << 20), "3M");
        assert_eq!(human(1000), "1000");
        assert_eq!(effective("allgather", 1000, 4, 3), 996);
        assert_eq!(effective("allreduce", 1001, 4, 3), 1000);
    }

    #[test]
    fn repeat_fills_whole_elements() {
        let mut b = [0u8; 11];
        repeat(&mut b, &[1, 2, 3]);
        assert_eq!(b, [1, 2, 3, 1, 2, 3, 1, 2, 3, 0, 0]);
        let mut big = vec![0u8; 1000];
        repeat(&mut big, &[9, 8]);
        assert!(big.chunks(2).all(|c| c == [9, 8]));
    }

    #[test]
    fn all_expands_to_every_algorithm_once() {
        let all = algorithms("allreduce", &["auto".into(), "all".into()], false).unwrap();
        assert_eq!(all.len(), 4);
        let with_shm = algorithms("allreduce", &["all".into()], true).unwrap();
        assert_eq!(with_shm.len(), 5);
        assert!(with_shm.contains(&Algorithm::SharedMemory));
        assert!(algorithms("broadcast", &["nope".into()], false).is_err());
    }
}
