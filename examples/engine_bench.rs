//! The engine's benchmark: N local ranks measure what the [engine](ferrogloo::engine) costs
//! against plain collectives on equal contexts (all f32, times taken on every rank, rank 0's
//! printed).
//!
//! `cargo run --release --example engine_bench -- --np 4`
//!
//! - **resnet**: one training step's gradients of ResNet-50: its 161 parameter tensors,
//!   25,557,032 f32 (the list of torchvision's `resnet50().parameters()`, built from the
//!   architecture and checked at start), submitted in reverse layer order as backprop produces
//!   them; one step submits all 161 and waits for all. Modes: `fused` (an engine configured as
//!   by default, 64 MiB fusion buffer), `unfused` (an engine with `fusion_threshold: 0`),
//!   `ordered` (no engine: one plain `Context::allreduce` per tensor, in the same order),
//!   `single` (no engine: one `Context::allreduce` of all the parameters in one buffer),
//!   `many` (no engine: one `Context::allreduce_many_alike` of the 161 tensors, what a fused
//!   batch runs) and `carved` (`many`'s call on 161 tensors cut from `single`'s one buffer:
//!   the same call as `many` on the same memory as `single`, so that `many` ÷ `carved` is what
//!   the tensors' separate allocations cost and `carved` ÷ `single` what cutting the
//!   collective at the tensors' ends costs).
//!   Median, minimum and maximum per step over `--steps`, after `--warmup` steps. The modes
//!   take turns: every step runs each once, in an order of its own, so that what the machine
//!   does meanwhile (other tenants, the clock's frequency) falls on every mode alike rather
//!   than on whichever ran in that stretch; each begins on its own buffers, just filled
//!   (untimed), and every element of its results is checked after (untimed).
//! - **latency**: one 4 KiB tensor (1024 f32), submit → done, `--iters` times: `warm` (the
//!   same name every time: response-cache hits), `cold` (an engine with `cache_capacity: 0`:
//!   every round goes through the coordinator) and `bare` (a plain `Context::allreduce` of
//!   4 KiB); median, 10th and 90th percentile, against bare and against Horovod's floor, its
//!   1 ms cycle.
//! - **idle**: last, an engine that has worked and then has nothing submitted for
//!   `--idle-secs`: the CPU time of the whole process over that time (`getrusage`), as a share
//!   of one core, and the engine's negotiation cycles before and after (idle ranks exchange
//!   nothing, so they must be equal).
//!
//! Every mode runs on its own full context of the same job, formed through the job's store
//! under a prefix of its own, on the transport a rank gets by default (`FERROGLOO_TRANSPORT`,
//! auto: shared memory between local ranks). The plain modes use the context the job started
//! with. Engines are configured from the environment (`HOROVOD_FUSION_THRESHOLD`,
//! `FERROGLOO_FUSION_MAX_TENSOR`, ... see [`EngineConfig::from_env`]) with the stall check off;
//! each mode then sets what it is about. `HOROVOD_TIMELINE` applies to the `fused` engine only.
//!
//! Rank 0 prints one JSON line per measurement (`{"bench":"resnet50","mode":"fused","np":4,
//! "median_ms":..,"min_ms":..,"max_ms":..,"reps":..}`), then a table and the targets: fused
//! within 1.05× of the better of single and ordered and no slower than unfused, warm latency
//! within 2× of bare, an idle engine below 1% of a core and running no cycles. Lines that are not JSON start with `#`. Under a
//! launcher (ferrogloo-run, mpirun, torchrun, ...) leave out `--np`.

mod common;

use clap::Parser;
use ferrogloo::config::FERROGLOO_STORE;
use ferrogloo::device::{Device, TcpAttr, Transport};
use ferrogloo::engine::{Engine, EngineConfig, EngineStats, Reduction};
use ferrogloo::launch::RankEnv;
use ferrogloo::rendezvous::PrefixStore;
use ferrogloo::{CollectiveOptions, Context, Error, Result};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The measurements `--only` may name, in the order they run.
const MEASUREMENTS: [&str; 3] = ["resnet", "latency", "idle"];

/// ResNet-50's parameter tensors (`len(list(torchvision.models.resnet50().parameters()))`).
const RESNET50_TENSORS: usize = 161;
/// ResNet-50's parameters (the sum of those tensors' sizes).
const RESNET50_PARAMETERS: usize = 25_557_032;

/// Elements of the latency tensor: 4 KiB of f32.
const LATENCY_ELEMENTS: usize = 1024;

/// Horovod's negotiation cycle (`HOROVOD_CYCLE_TIME`'s default), in µs: its latency floor.
const HOROVOD_CYCLE_US: f64 = 1000.0;

/// Command-line options: the job's (`--np N`, ...) and the benchmark's.
#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    job: common::JobArgs,
    /// Timed ResNet-50 steps per mode.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Untimed ResNet-50 steps before them.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed 4 KiB round trips per latency mode (a tenth more run untimed first).
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Seconds an engine idles for the idle measurement.
    #[arg(long, default_value_t = 2.0)]
    idle_secs: f64,
    /// Measurements to run, comma-separated: resnet, latency, idle.
    #[arg(long, value_delimiter = ',', default_value = "resnet,latency,idle")]
    only: Vec<String>,
}

/// The sizes of ResNet-50's parameter tensors, in torchvision's order: the stem (conv 7×7 and
/// its batchnorm's weight and bias), 4 stages of [3, 4, 6, 3] bottleneck blocks of widths
/// 64/128/256/512 and expansion 4 (conv 1×1, 3×3, 1×1, each with a batchnorm; the first block
/// of a stage also has a downsampling conv 1×1 and batchnorm), and the fully connected layer
/// (2048×1000 weight and 1000 bias).
fn resnet50() -> Vec<usize> {
    let mut t = vec![64 * 3 * 7 * 7, 64, 64];
    let mut inputs = 64;
    for (blocks, width) in [(3, 64), (4, 128), (6, 256), (3, 512)] {
        let out = width * 4;
        for b in 0..blocks {
            t.extend([width * inputs, width, width]); // conv1 (1×1), bn1
            t.extend([width * width * 3 * 3, width, width]); // conv2 (3×3), bn2
            t.extend([out * width, out, out]); // conv3 (1×1), bn3
            if b == 0 {
                t.extend([out * inputs, out, out]); // downsample conv (1×1), bn
            }
            inputs = out;
        }
    }
    t.extend([2048 * 1000, 1000]);
    t
}

/// How to form more full contexts of this job, the way `common::join` formed the first one.
struct Job {
    /// This rank.
    rank: usize,
    /// The number of ranks.
    size: usize,
    /// The job's store URL.
    store: String,
    /// The TCP listener's settings (for peers on other hosts).
    attr: TcpAttr,
    /// The deadline of rendezvous and of every call, as the first context's.
    timeout: Duration,
}

impl Job {
    /// The job `ctx` (made by `common::join` from `args`) belongs to.
    fn of(args: &common::JobArgs, ctx: &Context) -> Result<Job> {
        let mut attr = TcpAttr::from_env()?;
        if let Some(i) = &args.iface {
            attr.iface = Some(i.clone());
        }
        let store = if RankEnv::is_set() {
            let env = RankEnv::from_env()?;
            if attr.iface.is_none() && attr.ip.is_none() && attr.hostname.is_none() {
                attr.iface = env.iface;
            }
            env.store
        } else {
            match &args.store {
                Some(s) => s.clone(),
                None => std::env::var(FERROGLOO_STORE)
                    .map_err(|_| Error::invalid(format!("--store or {FERROGLOO_STORE} is required with --rank")))?,
            }
        };
        Ok(Job { rank: ctx.rank(), size: ctx.size(), store, attr, timeout: ctx.timeout() })
    }

    /// Another full context of the job, formed through its store under the prefix
    /// `engine-bench/<label>` (every rank must use the same labels, each once), on a device of
    /// the default transport.
    fn context(&self, label: &str) -> Result<Context> {
        let store = PrefixStore::new(format!("engine-bench/{label}"), ferrogloo::rendezvous::open(&self.store)?);
        let device = Device::with_transport(Transport::from_env()?, &self.attr)?;
        Context::builder(self.rank, self.size).timeout(self.timeout).connect(&store, &device)
    }

    /// An engine over a new context `label`: the environment's configuration without the
    /// stall check or a timeline, changed by `f`.
    fn engine(&self, label: &str, f: impl FnOnce(&mut EngineConfig)) -> Result<Engine> {
        let mut cfg = EngineConfig { stall_check: None, timeline: None, ..EngineConfig::from_env()? };
        f(&mut cfg);
        Engine::new(self.context(label)?, cfg)
    }
}

/// A summary of samples: median, a low and a high value (minimum and maximum, or the 10th and
/// 90th percentile), and how many samples.
#[derive(Debug, Clone, Copy)]
struct Summary {
    /// The median.
    median: f64,
    /// The minimum, or the 10th percentile.
    low: f64,
    /// The maximum, or the 90th percentile.
    high: f64,
    /// How many samples.
    reps: usize,
}

impl Summary {
    /// Median, minimum and maximum.
    fn range(xs: &[f64]) -> Summary {
        Summary::of(xs, 0.0, 1.0)
    }

    /// Median, 10th and 90th percentile.
    fn percentiles(xs: &[f64]) -> Summary {
        Summary::of(xs, 0.1, 0.9)
    }

    /// Median and the `lo` and `hi` quantiles (nearest rank); NaN for no samples.
    fn of(xs: &[f64], lo: f64, hi: f64) -> Summary {
        let mut s = xs.to_vec();
        s.sort_by(f64::total_cmp);
        let at = |q: f64| if s.is_empty() { f64::NAN } else { s[((s.len() - 1) as f64 * q).round() as usize] };
        Summary { median: at(0.5), low: at(lo), high: at(hi), reps: s.len() }
    }
}

/// What rank 0 prints: the JSON lines as they come, the table at the end.
struct Report {
    /// This rank (only rank 0 prints).
    rank: usize,
    /// The number of ranks.
    size: usize,
    /// Table rows: measurement, mode, median, range, note.
    rows: Vec<[String; 5]>,
    /// Targets: what, the value, whether it was met.
    targets: Vec<(String, bool)>,
}

impl Report {
    /// One measurement: a JSON line now (bench, mode, np, then `fields` in their order), a
    /// table row later.
    fn measured(&mut self, bench: &str, mode: &str, fields: Fields, row: [String; 3]) {
        if self.rank != 0 {
            return;
        }
        let head: Fields = vec![("bench", json!(bench)), ("mode", json!(mode)), ("np", json!(self.size))];
        let members: Vec<String> = head.iter().chain(&fields).map(|(k, v)| format!("{}:{v}", json!(k))).collect();
        println!("{{{}}}", members.join(","));
        let [median, range, note] = row;
        self.rows.push([bench.to_string(), mode.to_string(), median, range, note]);
    }

    /// A target, met or not.
    fn target(&mut self, what: String, met: bool) {
        self.targets.push((what, met));
    }

    /// The table and the targets (rank 0).
    fn print(&self) {
        if self.rank != 0 || self.rows.is_empty() {
            return;
        }
        println!(
            "# engine_bench, {} ranks, transport {}",
            self.size,
            Transport::from_env().map_or("?".to_string(), |t| t.name())
        );
        let heads = ["measurement", "mode", "median", "range", "note"];
        let mut widths = heads.map(str::len);
        for row in &self.rows {
            for (w, c) in widths.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: [&str; 5]| {
            let padded: Vec<String> =
                cells.iter().zip(widths).map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count()))).collect();
            println!("# {}", padded.join("  ").trim_end());
        };
        line(heads);
        for row in &self.rows {
            line([&row[0], &row[1], &row[2], &row[3], &row[4]]);
        }
        for (what, met) in &self.targets {
            println!("# target {}: {what}", if *met { "met   " } else { "MISSED" });
        }
    }
}

/// CPU time (user + system) of this process so far, all its threads.
fn cpu_time() -> Result<Duration> {
    // SAFETY: rusage is plain old data; all zeroes is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a pointer to a live, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return Err(Error::io("getrusage", std::io::Error::last_os_error()));
    }
    let tv =
        |t: libc::timeval| Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64);
    Ok(tv(u.ru_utime) + tv(u.ru_stime))
}

/// Fails unless every element of `buf` that is looked at (the first and the last) is `want`.
fn check(what: &str, buf: &[f32], want: f32) -> Result<()> {
    match [buf.first(), buf.last()].into_iter().flatten().find(|&&x| x != want) {
        Some(x) => Err(Error::invalid(format!("{what}: an element is {x}, expected {want}"))),
        None => Ok(()),
    }
}

/// Checks a ResNet-50 step's results: every tensor of `bufs` as long as `lens` says (an engine
/// hands the tensors back) and every element `want`.
fn check_step(mode: &str, bufs: &[Vec<f32>], lens: &[usize], want: f32) -> Result<()> {
    if bufs.len() != lens.len() {
        return Err(Error::invalid(format!("{mode}: {} tensors came back, expected {}", bufs.len(), lens.len())));
    }
    for (i, (b, &n)) in bufs.iter().zip(lens).enumerate() {
        if b.len() != n {
            return Err(Error::invalid(format!("{mode}, tensor {i}: {} elements came back, expected {n}", b.len())));
        }
        if let Some(x) = b.iter().find(|&&x| x != want) {
            return Err(Error::invalid(format!("{mode}, tensor {i}: an element is {x}, expected {want}")));
        }
    }
    Ok(())
}

/// Fills every tensor of `bufs` with ones: a step's fresh gradients.
fn refill(bufs: &mut [Vec<f32>]) {
    for b in bufs {
        b.fill(1.0);
    }
}

/// `0..n` in an order drawn from `seed` (Fisher-Yates over splitmix64): the same on every
/// rank for the same seed.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut x = seed;
    let mut next = move || {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    order
}

/// `buf` cut into consecutive runs of `sizes` (which add up to at most its length), in order.
fn carve<'b>(buf: &'b mut [f32], sizes: &[usize]) -> Vec<&'b mut [f32]> {
    let mut rest = buf;
    sizes
        .iter()
        .map(|&n| {
            let (run, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            run
        })
        .collect()
}

/// One step of a plain mode after a barrier: its milliseconds.
fn plain_step(ctx: &Context, step: impl FnOnce() -> Result<()>) -> Result<f64> {
    ctx.barrier()?;
    let start = Instant::now();
    step()?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// One step of an engine after an engine barrier: every tensor of `grads` submitted in reverse
/// (backprop) order, then all waited for and put back. Its milliseconds.
fn engine_step(e: &Engine, names: &[String], grads: &mut [Vec<f32>]) -> Result<f64> {
    e.barrier()?.wait()?;
    let start = Instant::now();
    let mut handles = Vec::with_capacity(grads.len());
    for i in (0..grads.len()).rev() {
        handles.push((i, e.allreduce(&names[i], std::mem::take(&mut grads[i]), Reduction::Sum)?));
    }
    for (i, h) in handles {
        grads[i] = h.wait()?.data;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// The members of a JSON line after bench, mode and np, in order.
type Fields = Vec<(&'static str, Value)>;

/// `x` rounded to 3 decimals, as JSON (null when not finite).
fn r3(x: f64) -> Value {
    json!((x * 1e3).round() / 1e3)
}

/// Engine counters per step.
fn per_step(after: &EngineStats, before: &EngineStats, steps: usize) -> Fields {
    let per = |a: u64, b: u64| r3(a.saturating_sub(b) as f64 / steps as f64);
    vec![
        ("cycles_per_step", per(after.cycles, before.cycles)),
        ("collectives_per_step", per(after.collectives, before.collectives)),
        ("fused_batches_per_step", per(after.fused_batches, before.fused_batches)),
        ("fused_tensors_per_step", per(after.fused_tensors, before.fused_tensors)),
        ("fusion_buffer_batches_per_step", per(after.fusion_buffer_batches, before.fusion_buffer_batches)),
    ]
}

/// The ResNet-50 step's modes, in the order the first step runs them.
const RESNET_MODES: [&str; 6] = ["ordered", "single", "many", "carved", "fused", "unfused"];

/// The ResNet-50 step in its modes, interleaved: every step runs each mode once, in an order of
/// its own (shuffled, the same on every rank), so that whatever the machine does meanwhile (another
/// tenant, the clock, the page cache) falls on every mode alike instead of on whichever ran in
/// that stretch. Each mode's step begins after a barrier of its own kind and ends when this
/// rank has all its results; checking and refilling them is not timed.
fn resnet(args: &Args, job: &Job, ctx: &Context, rep: &mut Report) -> Result<()> {
    let sizes = resnet50();
    let total: usize = sizes.iter().sum();
    let want = job.size as f32; // every rank contributes ones
    let (warmup, steps) = (args.warmup, args.steps.max(1));
    let mut grads: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![1f32; n]).collect();
    let mut flat = vec![vec![1f32; total]];
    let names: Vec<String> = (0..sizes.len()).map(|i| format!("resnet50.param{i}.grad")).collect();
    // fused and unfused: the engine, each on a context of its own.
    let env_timeline = EngineConfig::from_env()?.timeline;
    let fused = job.engine("fused", |c| c.timeline = env_timeline)?;
    let unfused = job.engine("unfused", |c| c.fusion_threshold = 0)?;
    let mut times: Vec<(&str, Vec<f64>, Fields)> =
        RESNET_MODES.iter().map(|&m| (m, Vec::with_capacity(steps), Vec::new())).collect();
    let mut before = [fused.stats(), unfused.stats()];
    for s in 0..warmup + steps {
        if s == warmup {
            before = [fused.stats(), unfused.stats()];
        }
        for m in shuffled(RESNET_MODES.len(), s as u64) {
            let mode = RESNET_MODES[m];
            // Each mode starts on its own buffers, just written (untimed), as a step's gradients
            // are: whichever mode ran before leaves none a warmer cache than another.
            let on_flat = mode == "single" || mode == "carved";
            if on_flat {
                refill(&mut flat);
            } else {
                refill(&mut grads);
            }
            let took = match mode {
                // ordered: plain allreduces, one per tensor, in backprop order.
                "ordered" => {
                    plain_step(ctx, || grads.iter_mut().rev().try_for_each(|g| ctx.allreduce(g, Reduction::Sum)))?
                }
                // single: all parameters in one buffer, one allreduce.
                "single" => plain_step(ctx, || ctx.allreduce(&mut flat[0], Reduction::Sum))?,
                // many: every tensor in one plain call, `allreduce_many_alike` (what a fused
                // batch runs, without the engine around it).
                "many" => plain_step(ctx, || {
                    let mut parts: Vec<&mut [f32]> = grads.iter_mut().rev().map(|g| g.as_mut_slice()).collect();
                    ctx.allreduce_many_alike(&mut parts, Reduction::Sum, &CollectiveOptions::default())
                })?,
                // carved: `many` on tensors cut from the one buffer of `single`.
                "carved" => plain_step(ctx, || {
                    let mut parts = carve(&mut flat[0], &sizes);
                    parts.reverse();
                    ctx.allreduce_many_alike(&mut parts, Reduction::Sum, &CollectiveOptions::default())
                })?,
                _ => engine_step(if mode == "fused" { &fused } else { &unfused }, &names, &mut grads)?,
            };
            if on_flat {
                check_step(mode, &flat, &[total], want)?;
            } else {
                check_step(mode, &grads, &sizes, want)?;
            }
            if s >= warmup {
                times[m].1.push(took);
            }
        }
    }
    drop(flat);
    let cfg = EngineConfig::from_env()?;
    for (e, b, mode) in [(fused, &before[0], "fused"), (unfused, &before[1], "unfused")] {
        // Each timed step also ran one engine barrier (one cycle, one collective).
        let mut counts = per_step(&e.stats(), b, steps);
        let threshold = if mode == "fused" { cfg.fusion_threshold } else { 0 };
        counts.push(("fusion_threshold", json!(threshold)));
        counts.push(("fusion_max_tensor", json!(cfg.fusion_max_tensor)));
        e.shutdown()?;
        if let Some(t) = times.iter_mut().find(|t| t.0 == mode) {
            t.2 = counts;
        }
    }

    let median = |mode: &str| times.iter().find(|m| m.0 == mode).map_or(f64::NAN, |m| Summary::range(&m.1).median);
    let (single, unfused) = (median("single"), median("unfused"));
    for (mode, t, extra) in &times {
        let s = Summary::range(t);
        let mut fields: Fields = vec![
            ("median_ms", r3(s.median)),
            ("min_ms", r3(s.low)),
            ("max_ms", r3(s.high)),
            ("reps", json!(s.reps)),
            ("tensors", json!(sizes.len())),
            ("parameters", json!(total)),
            ("ratio_to_single", r3(s.median / single)),
            ("speedup_over_unfused", r3(unfused / s.median)),
        ];
        fields.extend(extra.iter().cloned());
        let note = format!("{:.2}x single, {:.2}x faster than unfused", s.median / single, unfused / s.median);
        let row = [format!("{:.1} ms", s.median), format!("{:.1}-{:.1}", s.low, s.high), note];
        rep.measured("resnet50", mode, fields, row);
    }
    let (fused, best) = (median("fused"), single.min(median("ordered")));
    rep.target(
        format!("resnet50 fused <= 1.05x the better of single and ordered: {:.3}x", fused / best),
        fused <= 1.05 * best,
    );
    rep.target(format!("resnet50 fused no slower than unfused: {:.3}x", fused / unfused), fused <= unfused);
    Ok(())
}

/// `iters` timed rounds (after a tenth as many untimed) of `round`, in µs.
fn rounds(iters: usize, mut round: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let mut us = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        round()?;
        if i >= iters / 10 {
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(us)
}

/// Submit → done of one 4 KiB tensor under the same name, again and again, on `e`.
fn engine_rounds(e: &Engine, name: &str, iters: usize, want: f32) -> Result<Vec<f64>> {
    let mut v = Some(vec![1f32; LATENCY_ELEMENTS]);
    rounds(iters, || {
        let mut out = e.allreduce(name, v.take().unwrap_or_default(), Reduction::Sum)?.wait()?.data;
        check(name, &out, want)?;
        out.fill(1.0);
        v = Some(out);
        Ok(())
    })
}

/// The 4 KiB latency: bare, warm, cold. Returns the warm engine (for the idle measurement).
fn latency(args: &Args, job: &Job, ctx: &Context, rep: &mut Report) -> Result<Engine> {
    let iters = args.iters.max(10);
    let want = job.size as f32;
    let mut buf = vec![1f32; LATENCY_ELEMENTS];
    let bare = rounds(iters, || {
        ctx.allreduce(&mut buf, Reduction::Sum)?;
        check("bare", &buf, want)?;
        buf.fill(1.0);
        Ok(())
    })?;
    let warm_engine = job.engine("warm", |_| ())?;
    let warm = engine_rounds(&warm_engine, "latency.warm", iters, want)?;
    let (hits, eager) = (warm_engine.stats().cache_hits, warm_engine.stats().eager);
    let reduction = warm_engine.agrees_by_reduction();
    let cold_engine = job.engine("cold", |c| c.cache_capacity = 0)?;
    let cold = engine_rounds(&cold_engine, "latency.cold", iters, want)?;
    let cold_stats = cold_engine.stats();
    cold_engine.shutdown()?;

    let b = Summary::percentiles(&bare);
    for (mode, samples, extra) in [
        ("bare", &bare, vec![]),
        (
            "warm",
            &warm,
            vec![("cache_hits", json!(hits)), ("eager", json!(eager)), ("agrees_by_reduction", json!(reduction))],
        ),
        (
            "cold",
            &cold,
            vec![
                ("cache_hits", json!(cold_stats.cache_hits)),
                ("coordinated", json!(cold_stats.coordinated)),
                ("agrees_by_reduction", json!(reduction)),
            ],
        ),
    ] {
        let s = Summary::percentiles(samples);
        let mut fields: Fields = vec![
            ("median_us", r3(s.median)),
            ("p10_us", r3(s.low)),
            ("p90_us", r3(s.high)),
            ("reps", json!(s.reps)),
            ("bytes", json!(LATENCY_ELEMENTS * 4)),
            ("ratio_to_bare", r3(s.median / b.median)),
            ("ratio_to_horovod_cycle", r3(s.median / HOROVOD_CYCLE_US)),
        ];
        fields.extend(extra);
        let note =
            format!("{:.1}x bare, {:.3}x Horovod's 1 ms cycle", s.median / b.median, s.median / HOROVOD_CYCLE_US);
        let row = [format!("{:.1} µs", s.median), format!("p10-p90 {:.1}-{:.1}", s.low, s.high), note];
        rep.measured("latency_4k", mode, fields, row);
    }
    let w = Summary::percentiles(&warm).median;
    rep.target(format!("latency warm <= 2x bare: {:.1}x", w / b.median), w <= 2.0 * b.median);
    Ok(warm_engine)
}

/// CPU and cycles of an idle engine (`warm`, or a new one that first does some rounds).
fn idle(args: &Args, job: &Job, warm: Option<Engine>, rep: &mut Report) -> Result<()> {
    let secs = Duration::try_from_secs_f64(args.idle_secs)
        .map_err(|_| Error::invalid(format!("--idle-secs {} is not a duration", args.idle_secs)))?;
    let e = match warm {
        Some(e) => e,
        None => {
            let e = job.engine("idle", |_| ())?;
            engine_rounds(&e, "idle.warmup", 100, job.size as f32)?;
            e
        }
    };
    e.barrier()?.wait()?;
    let (before, cpu0, t) = (e.stats().cycles, cpu_time()?, Instant::now());
    std::thread::sleep(secs);
    let (cpu1, elapsed, after) = (cpu_time()?, t.elapsed(), e.stats().cycles);
    let busy = cpu1.saturating_sub(cpu0).as_secs_f64() / elapsed.as_secs_f64() * 100.0;
    let fields: Fields = vec![
        ("secs", r3(elapsed.as_secs_f64())),
        ("cpu_percent", r3(busy)),
        ("cycles_before", json!(before)),
        ("cycles_after", json!(after)),
    ];
    let row = [
        format!("{busy:.3}% of a core"),
        format!("{:.1} s", elapsed.as_secs_f64()),
        format!("cycles {before} -> {after}"),
    ];
    rep.measured("idle", "engine", fields, row);
    rep.target(format!("idle engine < 1% of a core: {busy:.3}%"), busy < 1.0);
    rep.target(format!("idle engine runs no cycles: {before} -> {after}"), before == after);
    e.shutdown()
}

/// Checks the options and the ResNet-50 list, joins the job (or launches `--np` ranks) and
/// runs the measurements asked for.
fn main() {
    let args = Args::parse();
    if let Some(bad) = args.only.iter().find(|m| !MEASUREMENTS.contains(&m.as_str())) {
        common::exit_on_error::<()>(Err(Error::invalid(format!(
            "--only {bad}: the measurements are {}",
            MEASUREMENTS.join(", ")
        ))));
    }
    let sizes = resnet50();
    let total: usize = sizes.iter().sum();
    if sizes.len() != RESNET50_TENSORS || total != RESNET50_PARAMETERS {
        common::exit_on_error::<()>(Err(Error::invalid(format!(
            "the ResNet-50 list has {} tensors of {total} parameters, not {RESNET50_TENSORS} of {RESNET50_PARAMETERS}",
            sizes.len()
        ))));
    }
    let Some(ctx) = common::exit_on_error(common::join(&args.job)) else {
        return;
    };
    let mut rep = Report { rank: ctx.rank(), size: ctx.size(), rows: Vec::new(), targets: Vec::new() };
    let run = |rep: &mut Report| -> Result<()> {
        let job = Job::of(&args.job, &ctx)?;
        let want = |m: &str| args.only.iter().any(|o| o == m);
        if want("resnet") {
            resnet(&args, &job, &ctx, rep)?;
        }
        let mut warm = None;
        if want("latency") {
            warm = Some(latency(&args, &job, &ctx, rep)?);
        }
        if want("idle") {
            idle(&args, &job, warm.take(), rep)?;
        }
        if let Some(e) = warm {
            e.shutdown()?;
        }
        Ok(())
    };
    let outcome = run(&mut rep);
    rep.print();
    common::exit_on_error(outcome);
}
