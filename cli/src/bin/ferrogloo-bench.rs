//! `ferrogloo-bench`: bandwidth and latency of ferrogloo's collectives, in the style of
//! nccl-tests.
//!
//! `ferrogloo-bench --np 4 --op allreduce,allgather -b 8 -e 64M -f 4` runs 4 local ranks (a
//! temporary FileStore) and prints one line per size and algorithm: time (p50 of the slowest
//! rank per iteration), algorithm (for `auto`, the one it picked) and bus bandwidth, min/p99,
//! and how many results were wrong.
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

use clap::Parser;
use ferrogloo::device::{TcpAttr, Transport};
use ferrogloo::launch::{RankEnv, spawn_local};
use ferrogloo::{Algorithm, CollectiveOptions, Context, DType, Error, Reduction, Result, bf16, f16};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Round trips per timed `pingpong` iteration (the time reported is one way: the iteration's
/// time over twice this).
const PINGPONG_ROUNDS: usize = 100;

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
    /// sendrecv, pingpong (ranks 0 and 1 bounce a message; the time is one way)
    /// (comma-separated).
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
    /// Reduction: sum, prod, min, max, average (floating-point types).
    #[arg(long, default_value = "sum")]
    reduce: String,
    /// Algorithms (comma-separated; `all` = every one the collective has): auto, ring, hd, rd,
    /// tree, pipeline, shm. With `auto` the table and JSON say which one it picked.
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
    /// Deadline of rendezvous and of every collective, in seconds (default: FERROGLOO_TIMEOUT
    /// when set, else 120).
    #[arg(long)]
    timeout: Option<f64>,
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
    /// `SO_SNDBUF` and `SO_RCVBUF` of every connection, in bytes (K/M suffixes allowed).
    /// Default: a 512 KiB send buffer for connections between ranks on one host and the
    /// kernel's autotuning otherwise, and the kernel's autotuning for receive buffers.
    #[arg(long)]
    socket_buffer: Option<String>,
    /// Busy-poll this many microseconds before sleeping in a wait (default: automatic).
    #[arg(long)]
    busy_poll_us: Option<u64>,
    /// Where the buffers live: host, or cuda (GPU 0's memory, staged through pinned host
    /// buffers; built with the feature `cuda`; allreduce, allgather, reduce_scatter, broadcast
    /// and reduce).
    #[arg(long, default_value = "host")]
    device: String,
    /// Transport between ranks: tcp, shm (shared memory), auto (shared memory on one host,
    /// TCP across hosts) or ibverbs (RDMA; built with the feature `ibverbs`, device from
    /// FERROGLOO_IB_DEVICE). Default: FERROGLOO_TRANSPORT when set, else auto.
    #[arg(long)]
    transport: Option<String>,
    /// Append one JSON object per measured cell and line to this file (created if missing;
    /// earlier lines are kept).
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
}

impl Cell {
    /// "ring", or "auto:rd" when `auto` picked recursive doubling.
    fn algorithm_label(&self) -> String {
        match (self.algorithm, self.picked) {
            (Algorithm::Auto, Some(p)) => format!("auto:{}", p.name()),
            (a, _) => a.name().to_string(),
        }
    }
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

/// A size as the plot's ticks and notes write it: 512, 4K, 64K, 1M, 16M, 1G.
fn human(bytes: usize) -> String {
    let units = [(1usize << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    for (u, suffix) in units {
        if bytes >= u && bytes.is_multiple_of(u) {
            return format!("{}{suffix}", bytes / u);
        }
    }
    bytes.to_string()
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

/// The algorithms of `op` asked for in `wanted`; `shm` says whether the context can run the
/// shared-memory ones.
fn algorithms(op: &str, wanted: &[String], shm: bool) -> Result<Vec<Algorithm>> {
    let mut has: Vec<Algorithm> = match op {
        "allreduce" => vec![Algorithm::Auto, Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::RecursiveDoubling],
        "broadcast" => vec![Algorithm::Auto, Algorithm::BinomialTree, Algorithm::Pipeline],
        "allgather" => vec![Algorithm::Auto, Algorithm::Ring, Algorithm::RecursiveDoubling],
        _ => vec![Algorithm::Auto],
    };
    if shm && matches!(op, "allreduce" | "broadcast" | "allgather") {
        has.push(Algorithm::SharedMemory);
    }
    let mut out = Vec::new();
    for w in wanted {
        let wanted: Vec<Algorithm> = if w == "all" { has.to_vec() } else { vec![w.parse()?] };
        for a in wanted {
            if has.contains(&a) && !out.contains(&a) {
                out.push(a);
            }
        }
    }
    Ok(out)
}

/// One element of `dtype` holding the small integer `v` (exact in every reduction order).
fn element(dtype: DType, v: u32) -> Vec<u8> {
    match dtype {
        DType::F32 => (v as f32).to_ne_bytes().to_vec(),
        DType::F64 => f64::from(v).to_ne_bytes().to_vec(),
        DType::F16 => f16::from_f32(v as f32).to_ne_bytes().to_vec(),
        DType::BF16 => bf16::from_f32(v as f32).to_ne_bytes().to_vec(),
        DType::I8 | DType::U8 => vec![v as u8],
        DType::I16 | DType::U16 => (v as u16).to_ne_bytes().to_vec(),
        DType::I32 | DType::U32 => v.to_ne_bytes().to_vec(),
        _ => u64::from(v).to_ne_bytes().to_vec(),
    }
}

/// A buffer of `bytes` bytes aligned for every element type (backed by `u64`s).
struct Buf {
    words: Vec<u64>,
    len: usize,
}

impl Buf {
    fn new(len: usize) -> Self {
        Buf { words: vec![0; len.div_ceil(8)], len }
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// Fills with the element `e` repeated.
    fn fill(&mut self, e: &[u8]) {
        repeat(self.bytes_mut(), e);
    }

    /// Fills block `i` of `per` bytes with `e(i)` repeated, for every block.
    fn fill_blocks(&mut self, per: usize, e: impl Fn(usize) -> Vec<u8>) {
        if per == 0 {
            return;
        }
        for (i, block) in self.bytes_mut().chunks_exact_mut(per).enumerate() {
            repeat(block, &e(i));
        }
    }

    /// Whether every element equals `e`.
    fn all(&self, e: &[u8]) -> bool {
        self.bytes().chunks_exact(e.len()).all(|c| c == e)
    }
}

/// Fills `buf` with `e` repeated (whole copies; a remainder shorter than `e` is left), in
/// doubling memcpys: as fast as `Vec::fill`, for an element of any size.
fn repeat(buf: &mut [u8], e: &[u8]) {
    let whole = buf.len() / e.len().max(1) * e.len();
    let buf = &mut buf[..whole];
    if buf.is_empty() {
        return;
    }
    buf[..e.len()].copy_from_slice(e);
    let mut done = e.len();
    while done < buf.len() {
        let n = done.min(buf.len() - done);
        buf.copy_within(..n, done);
        done += n;
    }
}

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
            ctx.allreduce(&mut per, ferrogloo::ReduceOp::Max)?;
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
    ctx.allreduce(&mut times, ferrogloo::ReduceOp::Max)?;
    Ok(times)
}

/// What a run measures: element type, reduction, options.
struct Setup<'a> {
    args: &'a Args,
    dtype: DType,
    red: Reduction,
    seg: Option<usize>,
}

impl Setup<'_> {
    fn opts(&self, algo: Algorithm) -> CollectiveOptions {
        let mut o = CollectiveOptions::new().algorithm(algo);
        if let Some(seg) = self.seg {
            o = o.segment_bytes(seg);
        }
        o
    }

    /// The reduction of `v(p)` over every rank p, as one element.
    fn reduced(&self, n: usize, v: impl Fn(usize) -> u32) -> Result<Vec<u8>> {
        let mut acc = element(self.dtype, v(0));
        for p in 1..n {
            self.red.apply_bytes(self.dtype, &mut acc, &element(self.dtype, v(p)))?;
        }
        self.red.finish_bytes(self.dtype, &mut acc, n)?;
        Ok(acc)
    }
}

/// Measures one (op, algorithm, size) cell.
/// The GPU collectives of a `--device cuda` run.
#[cfg(feature = "cuda")]
type Gpu<'c> = ferrogloo::gpu::Cuda<'c>;
/// Without the feature `cuda` there is none (`--device cuda` is refused first).
#[cfg(not(feature = "cuda"))]
type Gpu<'c> = std::marker::PhantomData<&'c ()>;

fn measure(
    ctx: &Context,
    s: &Setup<'_>,
    gpu: &mut Option<Gpu<'_>>,
    op: &str,
    algo: Algorithm,
    bytes: usize,
) -> Result<Cell> {
    #[cfg(feature = "cuda")]
    if let Some(g) = gpu {
        return measure_gpu(ctx, s, g, op, algo, bytes);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = gpu;
    let (args, dtype) = (s.args, s.dtype);
    let (r, n) = (ctx.rank(), ctx.size());
    let ts = dtype.size();
    let opts = s.opts(algo);
    let root = args.root % n;
    let own = element(dtype, r as u32 + 1);
    let mut picked = None;
    let mut wrong = false;
    let (count, moved, factor, times) = match op {
        "allreduce" => {
            let count = bytes / ts;
            let mut buf = Buf::new(count * ts);
            picked = Some(ctx.allreduce_algorithm(count * ts, algo)?);
            let times = timed(
                ctx,
                args,
                &mut buf,
                |b| b.fill(&own),
                |b| ctx.allreduce_bytes(b.bytes_mut(), dtype, s.red, &opts),
            )?;
            wrong = !buf.all(&s.reduced(n, |p| p as u32 + 1)?);
            (count, count * ts, 2.0 * (n - 1) as f64 / n as f64, times)
        }
        "allgather" => {
            let per = bytes / ts / n;
            let mut mine = Buf::new(per * ts);
            mine.fill(&own);
            let mut out = Buf::new(per * n * ts);
            picked = Some(ctx.allgather_algorithm(per * n * ts, algo)?);
            let times =
                timed(ctx, args, &mut out, |_| {}, |o| ctx.allgather_bytes(mine.bytes(), o.bytes_mut(), dtype, &opts))?;
            wrong = per > 0
                && out.bytes().chunks_exact(per * ts).enumerate().any(|(p, b)| {
                    let e = element(dtype, p as u32 + 1);
                    b.chunks_exact(ts).any(|c| c != e)
                });
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, times)
        }
        "reduce_scatter" => {
            let per = bytes / ts / n;
            let mut input = Buf::new(per * n * ts);
            input.fill(&own);
            let mut out = Buf::new(per * ts);
            let times = timed(
                ctx,
                args,
                &mut out,
                |_| {},
                |o| ctx.reduce_scatter_bytes(input.bytes(), o.bytes_mut(), dtype, s.red, &opts),
            )?;
            wrong = !out.all(&s.reduced(n, |p| p as u32 + 1)?);
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, times)
        }
        "broadcast" => {
            let count = bytes / ts;
            let fresh = if r == root { own.clone() } else { element(dtype, 0) };
            let mut buf = Buf::new(count * ts);
            picked = Some(ctx.broadcast_algorithm(count * ts, algo)?);
            let times = timed(
                ctx,
                args,
                &mut buf,
                |b| b.fill(&fresh),
                |b| ctx.broadcast_bytes(b.bytes_mut(), dtype, root, &opts),
            )?;
            wrong = !buf.all(&element(dtype, root as u32 + 1));
            (count, count * ts, 1.0, times)
        }
        "reduce" => {
            let count = bytes / ts;
            let mut buf = Buf::new(count * ts);
            let times = timed(
                ctx,
                args,
                &mut buf,
                |b| b.fill(&own),
                |b| ctx.reduce_bytes(b.bytes_mut(), dtype, root, s.red, &opts),
            )?;
            let want = if r == root { s.reduced(n, |p| p as u32 + 1)? } else { own.clone() };
            wrong = !buf.all(&want);
            (count, count * ts, 1.0, times)
        }
        "alltoall" => {
            let per = bytes / ts / n;
            let mut input = Buf::new(per * n * ts);
            input.fill_blocks(per * ts, |p| element(dtype, ((r * n + p) % 100) as u32));
            let mut out = Buf::new(per * n * ts);
            let times =
                timed(ctx, args, &mut out, |_| {}, |o| ctx.alltoall_bytes(input.bytes(), o.bytes_mut(), dtype, &opts))?;
            let mut want = Buf::new(per * n * ts);
            want.fill_blocks(per * ts, |p| element(dtype, ((p * n + r) % 100) as u32));
            wrong = out.bytes() != want.bytes();
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, times)
        }
        "sendrecv" => {
            let count = bytes / ts;
            let (right, left) = ((r + 1) % n, (r + n - 1) % n);
            let mut out = Buf::new(count * ts);
            out.fill(&own);
            let mut inbox = Buf::new(count * ts);
            let times = timed(
                ctx,
                args,
                &mut inbox,
                |_| {},
                |inbox| {
                    if n == 1 {
                        return Ok(());
                    }
                    ctx.scope(|sc| {
                        let sent = sc.isend(right, 1, out.bytes())?;
                        let got = sc.irecv(left, 1, inbox.bytes_mut())?;
                        sent.wait()?;
                        got.wait().map(drop)
                    })
                },
            )?;
            wrong = n > 1 && !inbox.all(&element(dtype, left as u32 + 1));
            (count, count * ts, 1.0, times)
        }
        "pingpong" => {
            // Ranks 0 and 1 bounce one message PINGPONG_ROUNDS times; the time is half a round
            // trip (the one-way latency), the bandwidth that of one direction.
            let count = bytes / ts;
            let mut out = Buf::new(count * ts);
            out.fill(&own);
            let mut inbox = Buf::new(count * ts);
            let times = timed(
                ctx,
                args,
                &mut inbox,
                |_| {},
                |inbox| {
                    for _ in 0..PINGPONG_ROUNDS {
                        match r {
                            0 if n > 1 => {
                                ctx.send(1, 3, out.bytes())?;
                                ctx.recv(1, 3, inbox.bytes_mut())?;
                            }
                            1 => {
                                ctx.recv(0, 3, inbox.bytes_mut())?;
                                ctx.send(0, 3, out.bytes())?;
                            }
                            _ => {}
                        }
                    }
                    Ok(())
                },
            )?;
            let from = if r == 0 { 2 } else { 1 };
            wrong = r < 2 && n > 1 && !inbox.all(&element(dtype, from));
            let one_way: Vec<f64> = times.iter().map(|t| t / (2 * PINGPONG_ROUNDS) as f64).collect();
            (count, count * ts, 1.0, one_way)
        }
        "barrier" => {
            let times = timed(ctx, args, &mut (), |_| {}, |_| ctx.barrier())?;
            (0, 0, 0.0, times)
        }
        other => return Err(Error::invalid(format!("unknown collective {other:?}"))),
    };
    let mut bad = [u32::from(wrong && !args.no_check)];
    ctx.allreduce(&mut bad, ferrogloo::ReduceOp::Max)?;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let p50 = sorted[sorted.len() / 2];
    let algbw = if p50 > 0.0 { moved as f64 / p50 / 1e3 } else { 0.0 };
    Ok(Cell {
        op: op.to_string(),
        algorithm: algo,
        picked,
        bytes: moved,
        count,
        iters: sorted.len(),
        p50,
        min: sorted[0],
        p99: sorted[((sorted.len() - 1) as f64 * 0.99) as usize],
        algbw,
        busbw: algbw * factor,
        wrong: bad[0],
    })
}

/// The GPU collectives `--device` asks for.
fn gpu_for<'c>(ctx: &'c Context, device: &str) -> Result<Option<Gpu<'c>>> {
    match device {
        "host" => Ok(None),
        #[cfg(feature = "cuda")]
        "cuda" => {
            let stream = ferrogloo::gpu::default_stream(0)?;
            Ok(Some(ferrogloo::gpu::Cuda::new(ctx, stream)?))
        }
        #[cfg(not(feature = "cuda"))]
        "cuda" => {
            let _ = ctx;
            Err(Error::unsupported("--device cuda (this ferrogloo-bench was built without it)", Some("cuda")))
        }
        other => Err(Error::invalid(format!("--device {other}: expected host or cuda"))),
    }
}

/// Measures one cell on GPU buffers: the buffers are filled on the host and copied to the
/// GPU before each call (not timed); the time is the call until the stream has the result.
#[cfg(feature = "cuda")]
fn measure_gpu(ctx: &Context, s: &Setup<'_>, g: &mut Gpu<'_>, op: &str, algo: Algorithm, bytes: usize) -> Result<Cell> {
    use ferrogloo::gpu::cudarc::driver::{CudaSlice, DriverError};
    let cuda = |e: DriverError| Error::invalid(format!("CUDA: {e:?}"));
    let (args, dtype) = (s.args, s.dtype);
    let (r, n) = (ctx.rank(), ctx.size());
    let ts = dtype.size();
    let root = args.root % n;
    let own = element(dtype, r as u32 + 1);
    let stream = g.stream().clone();
    let (count, moved, factor, times, wrong) = match op {
        "allreduce" | "broadcast" | "reduce" => {
            let count = bytes / ts;
            let mut host = Buf::new(count * ts);
            let fresh = if op == "broadcast" && r != root { element(dtype, 0) } else { own.clone() };
            host.fill(&fresh);
            let dev: CudaSlice<u8> = stream.clone_htod(host.bytes()).map_err(cuda)?;
            let mut st = (dev, &mut *g);
            let times = timed(
                ctx,
                args,
                &mut st,
                |st| {
                    let _ = stream.memcpy_htod(host.bytes(), &mut st.0);
                    let _ = stream.synchronize();
                },
                |st| {
                    match op {
                        "allreduce" => st.1.allreduce_bytes(&mut st.0, dtype, s.red)?,
                        "broadcast" => st.1.broadcast_bytes(&mut st.0, dtype, root)?,
                        _ => st.1.reduce_bytes(&mut st.0, dtype, root, s.red)?,
                    }
                    stream.synchronize().map_err(cuda)
                },
            )?;
            let back = stream.clone_dtoh(&st.0).map_err(cuda)?;
            let want = match op {
                "allreduce" => s.reduced(n, |p| p as u32 + 1)?,
                "broadcast" => element(dtype, root as u32 + 1),
                _ if r == root => s.reduced(n, |p| p as u32 + 1)?,
                _ => own.clone(),
            };
            let wrong = back.chunks_exact(ts).any(|c| c != want.as_slice());
            let factor = if op == "allreduce" { 2.0 * (n - 1) as f64 / n as f64 } else { 1.0 };
            (count, count * ts, factor, times, wrong)
        }
        "allgather" | "reduce_scatter" => {
            let per = bytes / ts / n;
            let (ilen, olen) = if op == "allgather" { (per, per * n) } else { (per * n, per) };
            let mut input = Buf::new(ilen * ts);
            input.fill(&own);
            let din: CudaSlice<u8> = stream.clone_htod(input.bytes()).map_err(cuda)?;
            let dout: CudaSlice<u8> = stream.alloc_zeros(olen * ts).map_err(cuda)?;
            let mut st = (dout, &mut *g);
            let times = timed(
                ctx,
                args,
                &mut st,
                |_| {},
                |st| {
                    if op == "allgather" {
                        st.1.allgather_bytes(&din, &mut st.0, dtype)?;
                    } else {
                        st.1.reduce_scatter_bytes(&din, &mut st.0, dtype, s.red)?;
                    }
                    stream.synchronize().map_err(cuda)
                },
            )?;
            let back = stream.clone_dtoh(&st.0).map_err(cuda)?;
            let wrong = if op == "allgather" {
                per > 0
                    && back.chunks_exact(per * ts).enumerate().any(|(p, b)| {
                        let e = element(dtype, p as u32 + 1);
                        b.chunks_exact(ts).any(|c| c != e.as_slice())
                    })
            } else {
                let want = s.reduced(n, |p| p as u32 + 1)?;
                back.chunks_exact(ts).any(|c| c != want.as_slice())
            };
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, times, wrong)
        }
        other => return Err(Error::invalid(format!("{other} is not measured on GPU buffers"))),
    };
    let _ = algo;
    let mut bad = [u32::from(wrong && !args.no_check)];
    ctx.allreduce(&mut bad, ferrogloo::ReduceOp::Max)?;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let p50 = sorted[sorted.len() / 2];
    let algbw = if p50 > 0.0 { moved as f64 / p50 / 1e3 } else { 0.0 };
    Ok(Cell {
        op: op.to_string(),
        algorithm: algo,
        picked: None,
        bytes: moved,
        count,
        iters: sorted.len(),
        p50,
        min: sorted[0],
        p99: sorted[((sorted.len() - 1) as f64 * 0.99) as usize],
        algbw,
        busbw: algbw * factor,
        wrong: bad[0],
    })
}

/// The bytes a cell of `op` really moves when asked for `bytes`: whole elements, and for the
/// collectives whose size is split over the ranks, whole blocks per rank.
fn effective(op: &str, bytes: usize, ts: usize, n: usize) -> usize {
    match op {
        "allgather" | "reduce_scatter" | "alltoall" => bytes / ts / n * n * ts,
        "barrier" => 0,
        _ => bytes / ts * ts,
    }
}

fn run(ctx: &Context, s: &Setup<'_>, gpu: &mut Option<Gpu<'_>>) -> Result<Vec<Cell>> {
    let args = s.args;
    let sizes = sizes(args)?;
    let (n, ts) = (ctx.size(), s.dtype.size());
    // The plan: per collective, size by size, the algorithms rotated by one at each size.
    let mut plan = Vec::new();
    for op in &args.op {
        let sz: Vec<usize> = if op == "barrier" { vec![0] } else { sizes.clone() };
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
                if e != b && op != "barrier" {
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
        let cell = measure(ctx, s, gpu, &op, algo, bytes)?;
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
        "# {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>10} {:>8} {:>8} {:>10} {:>10} {:>7}",
        "size", "count", "type", "redop", "root", "algorithm", "time", "algbw", "busbw", "min", "p99", "#wrong"
    );
    println!(
        "# {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>10} {:>8} {:>8} {:>10} {:>10} {:>7}",
        "(B)", "(elements)", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", "(us)", "(us)", ""
    );
}

fn print_cell(args: &Args, c: &Cell) {
    let rooted = matches!(c.op.as_str(), "broadcast" | "reduce");
    let reducing = matches!(c.op.as_str(), "allreduce" | "reduce_scatter" | "reduce");
    println!(
        "  {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>10.1} {:>8.3} {:>8.3} {:>10.1} {:>10.1} {:>7}",
        c.bytes,
        c.count,
        args.dtype,
        if reducing { args.reduce.as_str() } else { "-" },
        if rooted { args.root.to_string() } else { "-1".to_string() },
        c.algorithm_label(),
        c.p50,
        c.algbw,
        c.busbw,
        c.min,
        c.p99,
        c.wrong
    );
}

/// Appends the cells to `path`, one JSON object per line (the shared schema, plus `picked`:
/// the algorithm `auto` ran).
fn write_json(path: &PathBuf, args: &Args, n: usize, transport: Transport, cells: &[Cell]) -> Result<()> {
    use std::io::Write;
    let mut out = String::new();
    for c in cells {
        let row = serde_json::json!({
            "impl": "ferrogloo", "op": c.op, "algorithm": c.algorithm.name(),
            "picked": c.picked.map(|a| a.name()), "ranks": n, "bytes": c.bytes,
            "dtype": args.dtype, "iters": c.iters, "p50_us": c.p50, "min_us": c.min, "p99_us": c.p99,
            "algbw_gbps": c.algbw, "busbw_gbps": c.busbw, "wrong": c.wrong,
            "transport": transport.name(),
        });
        out.push_str(&row.to_string());
        out.push('\n');
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(out.as_bytes()))
        .map_err(|e| Error::io(format!("appending to {}", path.display()), e))
}

/// Colours told apart easily (Okabe and Ito's palette, safe for colour blindness, then grey
/// and brown); each collective also has a marker shape of its own.
const COLOURS: [(u8, u8, u8); 10] = [
    (0, 114, 178),
    (213, 94, 0),
    (0, 158, 115),
    (204, 121, 167),
    (230, 159, 0),
    (86, 180, 233),
    (0, 0, 0),
    (240, 228, 66),
    (128, 128, 128),
    (153, 79, 0),
];

fn plot(path: &PathBuf, args: &Args, n: usize, cells: &[Cell]) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    let drawn: Vec<&Cell> = cells.iter().filter(|c| c.bytes > 0).collect();
    if drawn.is_empty() {
        return Ok(());
    }
    // Sizes on a log2 axis, ticked at powers of two (4K, 64K, 1M).
    let log2 = |b: usize| (b as f64).log2();
    let xmin = drawn.iter().map(|c| log2(c.bytes)).fold(f64::INFINITY, f64::min).floor();
    let xmax = drawn.iter().map(|c| log2(c.bytes)).fold(0.0, f64::max).ceil().max(xmin + 1.0);
    let ymax = drawn.iter().map(|c| c.busbw).fold(0.0, f64::max) * 1.1 + 1e-3;
    let ops: Vec<&str> = {
        let mut o: Vec<&str> = drawn.iter().map(|c| c.op.as_str()).collect();
        o.dedup();
        o
    };
    let host = ferrogloo::device::host_id();
    let host = host.split('/').next().unwrap_or("");
    let iters = drawn.iter().map(|c| c.iters).min().unwrap_or(0);
    let title = format!(
        "{}: {} {}, {n} ranks, ≥{iters} iterations per point, host {host}",
        ops.join(", "),
        args.dtype,
        args.reduce
    );
    let root = SVGBackend::new(path, (1100, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    // The chart on the left, the legend in a column of its own on the right.
    let (chart_area, legend_area) = root.split_horizontally(860);
    let mut chart = ChartBuilder::on(&chart_area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(xmin..xmax, 0.0..ymax)?;
    let ticks = (xmax - xmin) as usize;
    let step = ticks.div_ceil(12).max(1);
    chart
        .configure_mesh()
        .x_desc("message size (bytes)")
        .y_desc("bus bandwidth (GB/s)")
        .x_labels(ticks / step + 1)
        .x_label_formatter(&|x| if x.fract() == 0.0 { human(2f64.powf(*x) as usize) } else { String::new() })
        .draw()?;
    // One series per collective and algorithm asked for.
    struct Series {
        name: String,
        /// The collective's marker.
        shape: usize,
        pts: Vec<(f64, f64)>,
    }
    let mut series: Vec<Series> = Vec::new();
    for c in &drawn {
        let name =
            if ops.len() > 1 { format!("{} {}", c.op, c.algorithm.name()) } else { c.algorithm.name().to_string() };
        let shape = ops.iter().position(|o| *o == c.op).unwrap_or(0);
        let pt = (log2(c.bytes), c.busbw);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.pts.push(pt),
            None => series.push(Series { name, shape, pts: vec![pt] }),
        }
    }
    for (i, Series { name, shape, mut pts }) in series.into_iter().enumerate() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (r, g, b) = COLOURS[i % COLOURS.len()];
        let colour = RGBColor(r, g, b);
        chart.draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))?;
        let marker = |p: (f64, f64)| -> DynElement<'static, SVGBackend<'_>, (f64, f64)> {
            match shape % 3 {
                0 => Circle::new(p, 4, colour.filled()).into_dyn(),
                1 => TriangleMarker::new(p, 5, colour.filled()).into_dyn(),
                _ => Cross::new(p, 4, colour.stroke_width(2)).into_dyn(),
            }
        };
        chart.draw_series(pts.into_iter().map(marker))?;
        let y = 60 + 26 * i as i32;
        legend_area.draw(&PathElement::new(vec![(10, y), (40, y)], colour.stroke_width(3)))?;
        let mark: DynElement<'static, SVGBackend<'_>, (i32, i32)> = match shape % 3 {
            0 => Circle::new((25, y), 4, colour.filled()).into_dyn(),
            1 => TriangleMarker::new((25, y), 5, colour.filled()).into_dyn(),
            _ => Cross::new((25, y), 4, colour.stroke_width(2)).into_dyn(),
        };
        legend_area.draw(&mark)?;
        legend_area.draw(&Text::new(name, (48, y - 8), ("sans-serif", 15)))?;
    }
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
    let timeout = match args.timeout {
        Some(t) => {
            Duration::try_from_secs_f64(t).map_err(|_| Error::invalid(format!("--timeout {t} is not a duration")))?
        }
        None if std::env::var_os(ferrogloo::context::TIMEOUT_ENV).is_some() => ferrogloo::context::default_timeout()?,
        None => Duration::from_secs(120),
    };
    let setup = Setup {
        args,
        dtype: args.dtype.parse()?,
        red: args.reduce.parse()?,
        seg: args.segment_bytes.as_deref().map(parse_size).transpose()?,
    };
    let store = ferrogloo::rendezvous::open(&env.store)?;
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
    let mut gpu = gpu_for(&ctx, &args.device)?;
    if ctx.rank() == 0 && gpu.is_some() {
        println!("# buffers: GPU 0 (CUDA), staged through pinned host memory");
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

fn main() {
    ferrogloo_cli::init_logging();
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
