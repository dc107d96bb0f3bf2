//! `ferrogloo-bench`: bandwidth and latency of ferrogloo's collectives, in the style of
//! nccl-tests.
//!
//! `ferrogloo-bench --np 4 --op allreduce,allgather -b 8 -e 64M -f 4` runs 4 local ranks (a
//! temporary FileStore) and prints one line per size: time (p50 of the slowest rank per
//! iteration), algorithm and bus bandwidth, min/p99, and how many results were wrong.
//!
//! Timing rule (the same as the Gloo and MPI anchors in `../shared/bench`): warm-up with the
//! same count on every rank, then timed iterations, each after a barrier, each counted at the
//! slowest rank; p50/min/p99 over iterations. Sizes follow nccl-tests: allreduce, broadcast,
//! reduce and sendrecv move S bytes per rank; allgather's S is the total output; reduce_scatter's
//! S is the input; alltoall's S is each rank's send buffer.

use clap::Parser;
use ferrogloo::device::TcpAttr;
use ferrogloo::launch::{RankEnv, spawn_local};
use ferrogloo::{Algorithm, CollectiveOptions, Context, Element, Error, ReduceOp, Result, bf16, f16};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Bandwidth and latency of ferrogloo's collectives (nccl-tests style).
#[derive(Parser, Debug, Clone)]
#[command(version)]
struct Args {
    /// Run N local ranks (processes of this program) meeting through a temporary FileStore.
    #[arg(long)]
    np: Option<usize>,
    /// This process's rank, to join a job started elsewhere (with --size and --store).
    #[arg(long)]
    rank: Option<usize>,
    /// Number of ranks of the job joined with --rank.
    #[arg(long)]
    size: Option<usize>,
    /// Store URL of the job joined with --rank (file:DIR or http://HOST:PORT/SCOPE).
    #[arg(long)]
    store: Option<String>,
    /// Collectives: allreduce, allgather, broadcast, reduce_scatter, reduce, alltoall, barrier,
    /// sendrecv (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "allreduce")]
    op: Vec<String>,
    /// Explicit sizes in bytes (K/M/G suffixes allowed); overrides -b/-e/-f.
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<String>,
    /// Smallest size of the sweep.
    #[arg(short = 'b', long = "minbytes", default_value = "8")]
    minbytes: String,
    /// Largest size of the sweep.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M")]
    maxbytes: String,
    /// Factor between sizes of the sweep.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    stepfactor: usize,
    /// Element type: f32 f64 f16 bf16 i8 i16 i32 i64 u8 u16 u32 u64.
    #[arg(long = "type", default_value = "f32")]
    dtype: String,
    /// Reduction: sum, prod, min, max.
    #[arg(long, default_value = "sum")]
    reduce: String,
    /// Algorithms (comma-separated; `all` = every one the collective has): auto, ring, hd, rd,
    /// tree, pipeline.
    #[arg(long, value_delimiter = ',', default_value = "auto")]
    algorithm: Vec<String>,
    /// Root of broadcast and reduce.
    #[arg(long, default_value_t = 0)]
    root: usize,
    /// Timed seconds per cell (the iteration count follows from it); overrides -n.
    #[arg(long)]
    seconds: Option<f64>,
    /// Timed iterations per cell.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per cell.
    #[arg(short = 'w', long = "warmup", default_value_t = 3)]
    warmup: usize,
    /// Deadline of every collective, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Skip checking results.
    #[arg(long)]
    no_check: bool,
    /// Network interface to listen on.
    #[arg(long)]
    iface: Option<String>,
    /// Host name whose address to listen on.
    #[arg(long)]
    hostname: Option<String>,
    /// Pipeline segment size of the pipelined algorithms, in bytes (K/M suffixes allowed).
    #[arg(long)]
    segment_bytes: Option<String>,
    /// `SO_SNDBUF` and `SO_RCVBUF` of every connection, in bytes (K/M suffixes allowed; default:
    /// the kernel's autotuning).
    #[arg(long)]
    socket_buffer: Option<String>,
    /// Busy-poll this many microseconds before sleeping in a wait (default: automatic).
    #[arg(long)]
    busy_poll_us: Option<u64>,
    /// Write one JSON object per measured cell and line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw bus bandwidth against size, one line per collective and algorithm, as SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
}

/// One measured cell.
#[derive(Debug, Clone)]
struct Cell {
    op: String,
    algorithm: String,
    bytes: usize,
    count: usize,
    iters: usize,
    p50: f64,
    min: f64,
    p99: f64,
    algbw: f64,
    busbw: f64,
    wrong: u32,
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().map(|v| v * mul).map_err(|_| Error::invalid(format!("bad size {s:?}")))
}

fn sizes(args: &Args) -> Result<Vec<usize>> {
    if !args.sizes.is_empty() {
        return args.sizes.iter().map(|s| parse_size(s)).collect();
    }
    let (mut b, e) = (parse_size(&args.minbytes)?, parse_size(&args.maxbytes)?);
    if args.stepfactor < 2 {
        return Err(Error::invalid("-f must be at least 2"));
    }
    let mut out = Vec::new();
    while b <= e {
        out.push(b);
        b = b.saturating_mul(args.stepfactor).max(b + 1);
    }
    Ok(out)
}

fn algorithms(op: &str, wanted: &[String]) -> Result<Vec<Algorithm>> {
    let has: &[Algorithm] = match op {
        "allreduce" => &[Algorithm::Auto, Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::RecursiveDoubling],
        "broadcast" => &[Algorithm::Auto, Algorithm::BinomialTree, Algorithm::Pipeline],
        "allgather" => &[Algorithm::Auto, Algorithm::Ring, Algorithm::RecursiveDoubling],
        _ => &[Algorithm::Auto],
    };
    let mut out = Vec::new();
    for w in wanted {
        let a = match w.as_str() {
            "all" => {
                out.extend_from_slice(has);
                continue;
            }
            "auto" => Algorithm::Auto,
            "ring" => Algorithm::Ring,
            "hd" | "halving-doubling" => Algorithm::HalvingDoubling,
            "rd" | "recursive-doubling" => Algorithm::RecursiveDoubling,
            "tree" => Algorithm::BinomialTree,
            "pipeline" => Algorithm::Pipeline,
            other => return Err(Error::invalid(format!("unknown algorithm {other:?}"))),
        };
        if has.contains(&a) && !out.contains(&a) {
            out.push(a);
        }
    }
    Ok(out)
}

fn algo_name(a: Algorithm) -> &'static str {
    match a {
        Algorithm::Ring => "ring",
        Algorithm::HalvingDoubling => "hd",
        Algorithm::RecursiveDoubling => "rd",
        Algorithm::BinomialTree => "tree",
        Algorithm::Pipeline => "pipeline",
        _ => "auto",
    }
}

/// Small integer values in every element type (exact in every reduction order).
trait Val: Element {
    fn of(v: u32) -> Self;
}
macro_rules! val {
    ($($t:ty: $e:expr),*) => {$( impl Val for $t { fn of(v: u32) -> Self { let f: fn(u32) -> $t = $e; f(v) } } )*};
}
val!(i8: |v| v as i8, i16: |v| v as i16, i32: |v| v as i32, i64: i64::from, u8: |v| v as u8, u16: |v| v as u16,
     u32: |v| v, u64: u64::from, f32: |v| v as f32, f64: f64::from, f16: |v| f16::from_f32(v as f32),
     bf16: |v| bf16::from_f32(v as f32));

/// Times `iters` calls of `call` (each after a barrier, `reset` and a barrier); returns every
/// iteration's time at the slowest rank, in microseconds.
fn timed<S>(
    ctx: &Context,
    args: &Args,
    state: &mut S,
    mut reset: impl FnMut(&mut S),
    mut call: impl FnMut(&mut S) -> Result<()>,
) -> Result<Vec<f64>> {
    for _ in 0..args.warmup {
        reset(state);
        call(state)?;
    }
    let iters = match args.seconds {
        Some(secs) => {
            let t = Instant::now();
            for _ in 0..3 {
                reset(state);
                call(state)?;
            }
            let mut per = [t.elapsed().as_secs_f64() / 3.0];
            ctx.allreduce(&mut per, ReduceOp::Max)?;
            ((secs / per[0].max(1e-9)) as usize).clamp(5, 2000)
        }
        None => args.iters.max(1),
    };
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        // Every rank resets only once all have finished the previous call: a rank refilling
        // a large buffer while a slower one is still inside its timed call would take CPU
        // from it, and the harness would be timed along with the collective (Open MPI's
        // harness has no reset at all; its calls are out of place).
        ctx.barrier()?;
        reset(state);
        ctx.barrier()?;
        let t = Instant::now();
        call(state)?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    ctx.allreduce(&mut times, ReduceOp::Max)?;
    Ok(times)
}

/// Measures one (op, algorithm, size) cell with element type `T`.
fn measure<T: Val + PartialEq>(ctx: &Context, args: &Args, op: &str, algo: Algorithm, bytes: usize) -> Result<Cell> {
    let (r, n) = (ctx.rank(), ctx.size());
    let ts = std::mem::size_of::<T>();
    let red = match args.reduce.as_str() {
        "sum" => ReduceOp::Sum,
        "prod" | "product" => ReduceOp::Product,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        other => return Err(Error::invalid(format!("unknown reduction {other:?}"))),
    };
    let mut opts = CollectiveOptions::new().algorithm(algo);
    if let Some(seg) = &args.segment_bytes {
        opts = opts.segment_bytes(parse_size(seg)?);
    }
    let root = args.root % n;
    // Reduction of `v(p)` over every rank p, in the element type.
    let reduced = |v: &dyn Fn(usize) -> u32| {
        let mut acc = [T::of(v(0))];
        for p in 1..n {
            red.apply(&mut acc, &[T::of(v(p))]);
        }
        acc[0]
    };
    let own = T::of(r as u32 + 1);
    let mut wrong = false;
    let (count, moved, factor, times) = match op {
        "allreduce" => {
            let count = bytes / ts;
            let mut buf = vec![own; count];
            let times = timed(ctx, args, &mut buf, |b| b.fill(own), |b| ctx.allreduce_with(b, &red, &opts))?;
            let want = reduced(&|p| p as u32 + 1);
            wrong = buf.iter().any(|&x| x != want);
            (count, count * ts, 2.0 * (n - 1) as f64 / n as f64, times)
        }
        "allgather" => {
            let per = bytes / ts / n;
            let mine = vec![own; per];
            let mut out = vec![T::of(0); per * n];
            let times = timed(ctx, args, &mut out, |_| {}, |o| ctx.allgather(&mine, o, &opts))?;
            wrong = out.iter().enumerate().any(|(i, &x)| x != T::of((i / per.max(1)) as u32 + 1));
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, times)
        }
        "reduce_scatter" => {
            let per = bytes / ts / n;
            let input = vec![own; per * n];
            let mut out = vec![T::of(0); per];
            let times = timed(ctx, args, &mut out, |_| {}, |o| ctx.reduce_scatter(&input, o, &red, &opts))?;
            let want = reduced(&|p| p as u32 + 1);
            wrong = out.iter().any(|&x| x != want);
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, times)
        }
        "broadcast" => {
            let count = bytes / ts;
            let fresh = if r == root { own } else { T::of(0) };
            let mut buf = vec![fresh; count];
            let times = timed(ctx, args, &mut buf, |b| b.fill(fresh), |b| ctx.broadcast(b, root, &opts))?;
            wrong = buf.iter().any(|&x| x != T::of(root as u32 + 1));
            (count, count * ts, 1.0, times)
        }
        "reduce" => {
            let count = bytes / ts;
            let mut buf = vec![own; count];
            let times = timed(ctx, args, &mut buf, |b| b.fill(own), |b| ctx.reduce(b, root, &red, &opts))?;
            let want = if r == root { reduced(&|p| p as u32 + 1) } else { own };
            wrong = buf.iter().any(|&x| x != want);
            (count, count * ts, 1.0, times)
        }
        "alltoall" => {
            let per = bytes / ts / n;
            let input: Vec<T> = (0..per * n).map(|i| T::of((r * n + i / per.max(1)) as u32 % 100)).collect();
            let mut out = vec![T::of(0); per * n];
            let times = timed(ctx, args, &mut out, |_| {}, |o| ctx.alltoall(&input, o, &opts))?;
            wrong = out.iter().enumerate().any(|(i, &x)| x != T::of(((i / per.max(1)) * n + r) as u32 % 100));
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, times)
        }
        "sendrecv" => {
            let count = bytes / ts;
            let (right, left) = ((r + 1) % n, (r + n - 1) % n);
            let out = vec![own; count];
            let mut inbox = vec![T::of(0); count];
            let times = timed(
                ctx,
                args,
                &mut inbox,
                |_| {},
                |inbox| {
                    if n == 1 {
                        return Ok(());
                    }
                    ctx.scope(|s| {
                        let sent = s.isend(right, 1, &out)?;
                        let got = s.irecv(left, 1, inbox)?;
                        sent.wait()?;
                        got.wait().map(drop)
                    })
                },
            )?;
            wrong = n > 1 && inbox.iter().any(|&x| x != T::of(left as u32 + 1));
            (count, count * ts, 1.0, times)
        }
        "barrier" => {
            let times = timed(ctx, args, &mut (), |_| {}, |_| ctx.barrier())?;
            (0, 0, 0.0, times)
        }
        other => return Err(Error::invalid(format!("unknown collective {other:?}"))),
    };
    let mut bad = [u32::from(wrong && !args.no_check)];
    ctx.allreduce(&mut bad, ReduceOp::Max)?;
    let mut s = times.clone();
    s.sort_by(f64::total_cmp);
    let p50 = s[s.len() / 2];
    let algbw = if p50 > 0.0 { moved as f64 / p50 / 1e3 } else { 0.0 };
    Ok(Cell {
        op: op.to_string(),
        algorithm: algo_name(algo).to_string(),
        bytes: moved,
        count,
        iters: s.len(),
        p50,
        min: s[0],
        p99: s[((s.len() - 1) as f64 * 0.99) as usize],
        algbw,
        busbw: algbw * factor,
        wrong: bad[0],
    })
}

fn run<T: Val + PartialEq>(ctx: &Context, args: &Args) -> Result<Vec<Cell>> {
    let sizes = sizes(args)?;
    let mut plan = Vec::new();
    for op in &args.op {
        let sz: Vec<usize> = if op == "barrier" { vec![0] } else { sizes.clone() };
        for a in algorithms(op, &args.algorithm)? {
            plan.extend(sz.iter().map(|&b| (op.clone(), a, b)));
        }
    }
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
        bar.set_message(format!("{op} {} {bytes} B", algo_name(algo)));
        let cell = measure::<T>(ctx, args, &op, algo, bytes)?;
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

fn header(ctx: &Context, args: &Args, op: &str) {
    println!("#\n# {op}: {} ranks, type {}, reduction {}, root {}", ctx.size(), args.dtype, args.reduce, args.root);
    println!(
        "# {:>12} {:>12} {:>6} {:>6} {:>5} {:>9} {:>10} {:>8} {:>8} {:>10} {:>10} {:>7}",
        "size", "count", "type", "redop", "root", "algorithm", "time", "algbw", "busbw", "min", "p99", "#wrong"
    );
    println!(
        "# {:>12} {:>12} {:>6} {:>6} {:>5} {:>9} {:>10} {:>8} {:>8} {:>10} {:>10} {:>7}",
        "(B)", "(elements)", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", "(us)", "(us)", ""
    );
}

fn print_cell(args: &Args, c: &Cell) {
    let rooted = matches!(c.op.as_str(), "broadcast" | "reduce");
    let reducing = matches!(c.op.as_str(), "allreduce" | "reduce_scatter" | "reduce");
    println!(
        "  {:>12} {:>12} {:>6} {:>6} {:>5} {:>9} {:>10.1} {:>8.3} {:>8.3} {:>10.1} {:>10.1} {:>7}",
        c.bytes,
        c.count,
        args.dtype,
        if reducing { args.reduce.as_str() } else { "-" },
        if rooted { args.root.to_string() } else { "-1".to_string() },
        c.algorithm,
        c.p50,
        c.algbw,
        c.busbw,
        c.min,
        c.p99,
        c.wrong
    );
}

fn write_json(path: &PathBuf, args: &Args, n: usize, cells: &[Cell]) -> Result<()> {
    let mut out = String::new();
    for c in cells {
        let row = serde_json::json!({
            "impl": "ferrogloo", "op": c.op, "algorithm": c.algorithm, "ranks": n, "bytes": c.bytes,
            "dtype": args.dtype, "iters": c.iters, "p50_us": c.p50, "min_us": c.min, "p99_us": c.p99,
            "algbw_gbps": c.algbw, "busbw_gbps": c.busbw, "wrong": c.wrong,
        });
        out.push_str(&row.to_string());
        out.push('\n');
    }
    std::fs::write(path, out).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

fn plot(path: &PathBuf, n: usize, cells: &[Cell]) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let drawn: Vec<&Cell> = cells.iter().filter(|c| c.bytes > 0).collect();
    if drawn.is_empty() {
        return Ok(());
    }
    let xmin = drawn.iter().map(|c| c.bytes).min().unwrap_or(1) as f64;
    let xmax = drawn.iter().map(|c| c.bytes).max().unwrap_or(2) as f64;
    let ymax = drawn.iter().map(|c| c.busbw).fold(0.0, f64::max) * 1.1 + 1e-3;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("ferrogloo bus bandwidth, {n} ranks"), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d((xmin..xmax * 1.01).log_scale(), 0.0..ymax)?;
    chart.configure_mesh().x_desc("message size (bytes)").y_desc("busbw (GB/s)").draw()?;
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for c in &drawn {
        let name = format!("{} {}", c.op, c.algorithm);
        match series.iter_mut().find(|(s, _)| *s == name) {
            Some((_, pts)) => pts.push((c.bytes as f64, c.busbw)),
            None => series.push((name, vec![(c.bytes as f64, c.busbw)])),
        }
    }
    for (i, (name, pts)) in series.into_iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
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
    let store = ferrogloo::rendezvous::open(&env.store)?;
    let device = ferrogloo::device::Device::new(&attr)?;
    let mut builder = Context::builder(env.rank, env.size).timeout(Duration::from_secs(args.timeout));
    if let Some(us) = args.busy_poll_us {
        builder = builder.busy_poll(Duration::from_micros(us));
    }
    let ctx = builder.connect(&store, &device)?;
    let cells = match args.dtype.as_str() {
        "f32" => run::<f32>(&ctx, args),
        "f64" => run::<f64>(&ctx, args),
        "f16" => run::<f16>(&ctx, args),
        "bf16" => run::<bf16>(&ctx, args),
        "i8" => run::<i8>(&ctx, args),
        "i16" => run::<i16>(&ctx, args),
        "i32" => run::<i32>(&ctx, args),
        "i64" => run::<i64>(&ctx, args),
        "u8" => run::<u8>(&ctx, args),
        "u16" => run::<u16>(&ctx, args),
        "u32" => run::<u32>(&ctx, args),
        "u64" => run::<u64>(&ctx, args),
        other => Err(Error::invalid(format!("unknown type {other:?}"))),
    }?;
    if ctx.rank() == 0 {
        let bus: Vec<f64> = cells.iter().filter(|c| c.bytes > 0).map(|c| c.busbw).collect();
        let avg = if bus.is_empty() { 0.0 } else { bus.iter().sum::<f64>() / bus.len() as f64 };
        let wrong: u32 = cells.iter().map(|c| c.wrong).sum();
        println!("# Out of bounds values : {wrong} {}", if wrong == 0 { "OK" } else { "WRONG" });
        println!("# Avg bus bandwidth    : {avg:.3}");
        if let Some(p) = &args.json {
            write_json(p, args, ctx.size(), &cells)?;
        }
        if let Some(p) = &args.plot {
            plot(p, ctx.size(), &cells).map_err(|e| Error::invalid(format!("drawing {}: {e}", p.display())))?;
        }
        if wrong > 0 {
            return Err(Error::invalid(format!("{wrong} cells gave wrong results")));
        }
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    let result = match RankEnv::is_set() {
        true => RankEnv::from_env().and_then(|env| rank_main(&args, env)),
        false => match (args.np, args.rank, args.size, &args.store) {
            (Some(n), None, None, _) => {
                let argv: Vec<String> = std::env::args().skip(1).collect();
                // Bounded: a sweep's worth of deadlines.
                spawn_local(n, &argv, Duration::from_secs(args.timeout * 30))
            }
            (None, Some(rank), Some(size), Some(store)) => {
                rank_main(&args, RankEnv { rank, size, store: store.clone() })
            }
            _ => Err(Error::invalid("give --np N, or --rank R --size N --store URL")),
        },
    };
    if let Err(e) = result {
        eprintln!("ferrogloo-bench: {e}");
        std::process::exit(1);
    }
}
