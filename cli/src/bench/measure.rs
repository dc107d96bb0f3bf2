//! Measuring one cell (a collective, an algorithm, a size) on host buffers: the buffers, the
//! timing rule, and the check of every result.

use super::Cell;
use super::args::Args;
use super::gpu::Gpu;
#[cfg(feature = "cuda")]
use super::gpu::measure_gpu;
use ferrogloo::{Algorithm, CollectiveOptions, Context, DType, Error, Reduction, Result, bf16, f16};
use std::time::{Duration, Instant};

/// Round trips per timed `pingpong` iteration (the time reported is one way: the iteration's
/// time over twice this).
const PINGPONG_ROUNDS: usize = 100;

/// One element of `dtype` holding the small integer `v` (exact in every reduction order).
pub(super) fn element(dtype: DType, v: u32) -> Vec<u8> {
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

/// Alignment of a [`Buf`]'s first byte: a page, as Open MPI's harness allocates its buffers
/// (`aligned_alloc(4096, …)`), so that both harnesses hand their libraries buffers alike
/// (a copy's speed depends on its buffers' alignment: the kernel's cross-process copy of
/// page-aligned buffers measured faster than of buffers 16 bytes past a page).
const BUF_ALIGN: usize = 4096;

/// A buffer of `bytes` bytes, page-aligned ([`BUF_ALIGN`]), backed by `u64`s.
pub(super) struct Buf {
    words: Vec<u64>,
    /// The first word of the buffer in `words`: the first on a page boundary.
    start: usize,
    len: usize,
}

impl Buf {
    pub(super) fn new(len: usize) -> Self {
        let words = vec![0u64; len.div_ceil(8) + BUF_ALIGN / 8];
        let start = (words.as_ptr() as usize).next_multiple_of(BUF_ALIGN) - words.as_ptr() as usize;
        Buf { words, start: start / 8, len }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words[self.start..])[..self.len]
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words[self.start..])[..self.len]
    }

    /// Fills with the element `e` repeated.
    pub(super) fn fill(&mut self, e: &[u8]) {
        repeat(self.bytes_mut(), e);
    }

    /// Fills block `i` of `per` bytes with `e(i)` repeated, for every block.
    pub(super) fn fill_blocks(&mut self, per: usize, e: impl Fn(usize) -> Vec<u8>) {
        if per == 0 {
            return;
        }
        for (i, block) in self.bytes_mut().chunks_exact_mut(per).enumerate() {
            repeat(block, &e(i));
        }
    }

    /// Whether every element equals `e`.
    pub(super) fn all(&self, e: &[u8]) -> bool {
        self.bytes().chunks_exact(e.len()).all(|c| c == e)
    }
}

/// Fills `buf` with `e` repeated (whole copies; a remainder shorter than `e` is left), in
/// doubling memcpys: as fast as `Vec::fill`, for an element of any size.
pub(super) fn repeat(buf: &mut [u8], e: &[u8]) {
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

/// The most timed iterations of one cell with `--seconds` (their times are kept, 8 bytes each,
/// and reduced across the ranks).
const MAX_ITERS: usize = 1_000_000;

/// The fewest timed iterations of one cell with `--seconds`, however long they take.
const MIN_ITERS: usize = 5;

/// What [`timed`] measured.
pub(super) struct Timing {
    /// Every timed iteration's time at the slowest rank, in microseconds.
    pub(super) worst: Vec<f64>,
    /// Each rank's mean time per call, then over the ranks: their mean, least and greatest
    /// (OSU's avg/min/max), in microseconds.
    pub(super) ranks: [f64; 3],
    /// The state the last timed call used (the one whose result to check).
    pub(super) last: usize,
}

/// Times calls of `call`, every one after a barrier, the reset and a barrier, on `states` in
/// turn (one state: the same buffers every call; several: cache-cold rotation, each state
/// reset right after its use, so that the others go through the caches before it is used
/// again). Iterations: `-n`, or as many as `--seconds` allow.
pub(super) fn timed<S>(
    ctx: &Context,
    args: &Args,
    states: &mut [S],
    mut reset: impl FnMut(&mut S),
    mut call: impl FnMut(&mut S) -> Result<()>,
) -> Result<Timing> {
    let k = states.len();
    if k == 0 {
        return Err(Error::invalid("timing a collective on no buffers"));
    }
    for w in 0..args.warmup {
        reset(&mut states[w % k]);
        call(&mut states[w % k])?;
    }
    if k > 1 {
        // Every state once, untimed, so that no timed call is the first to touch its pages
        // (the page faults would be timed instead of the cold caches); then their inputs.
        for st in states.iter_mut() {
            reset(st);
            call(st)?;
        }
        states.iter_mut().for_each(&mut reset);
    }
    // With --seconds, rank 0 decides before each iteration whether another one fits, and
    // tells the others (so every rank makes the same number).
    let (limit, deadline) = match args.seconds {
        // Beyond what a clock can hold: until the iterations run out.
        Some(secs) => (
            MAX_ITERS,
            Some((secs, Duration::try_from_secs_f64(secs.max(0.0)).ok().and_then(|d| Instant::now().checked_add(d)))),
        ),
        None => (args.iters.max(1), None),
    };
    let mut times = Vec::new();
    loop {
        match deadline {
            Some((_, until)) => {
                let more = times.len() < limit && (times.len() < MIN_ITERS || until.is_none_or(|u| Instant::now() < u));
                let mut go = [u8::from(more)];
                ctx.broadcast(&mut go, 0, &Default::default())?;
                if go[0] == 0 {
                    break;
                }
            }
            None if times.len() >= limit => break,
            None => {}
        }
        // Every rank resets only once all have finished the previous call: a rank refilling
        // a large buffer while a slower one is still inside its timed call would take CPU
        // from it, and the harness would be timed along with the collective (Open MPI's
        // harness has no reset at all; its calls are out of place).
        let i = times.len();
        ctx.barrier()?;
        match k {
            1 => reset(&mut states[0]),
            _ if i > 0 => reset(&mut states[(i - 1) % k]),
            _ => {}
        }
        ctx.barrier()?;
        let t = Instant::now();
        call(&mut states[i % k])?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    if let Some((secs, until)) = deadline
        && times.len() >= limit
        && until.is_none_or(|u| Instant::now() < u)
        && ctx.rank() == 0
    {
        println!("# --seconds {secs}: capped at {MAX_ITERS} iterations");
    }
    let last = (times.len() - 1) % k;
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let (mut sum, mut least, mut most) = ([mean], [mean], [mean]);
    ctx.allreduce(&mut sum, ferrogloo::Reduction::Sum)?;
    ctx.allreduce(&mut least, ferrogloo::Reduction::Min)?;
    ctx.allreduce(&mut most, ferrogloo::Reduction::Max)?;
    ctx.allreduce(&mut times, ferrogloo::Reduction::Max)?;
    Ok(Timing { worst: times, ranks: [sum[0] / ctx.size() as f64, least[0], most[0]], last })
}

/// How many states of `bytes` each a cell rotates through: one when the cache is left warm;
/// with `--cold`, enough that the others touch twice the last-level cache between two uses of
/// one, at least 2 and at most [`MAX_ROTATION`] (a cache of unknown size is taken for
/// [`ASSUMED_LLC`]).
pub(super) fn rotation(args: &Args, bytes: usize) -> usize {
    if !args.cold || bytes == 0 {
        return 1;
    }
    let llc = super::cache::last_level().unwrap_or(ASSUMED_LLC);
    ((2 * llc).div_ceil(bytes) + 1).clamp(2, MAX_ROTATION)
}

/// The last-level cache `--cold` assumes where sysfs does not give its size (the header says
/// so).
pub(super) const ASSUMED_LLC: usize = 32 << 20;

/// The most buffers one cell rotates through with `--cold` (so that a cell of 8 bytes does not
/// allocate millions): cells smaller than twice the last-level cache over this stay partly
/// warm there, which the header says.
pub(super) const MAX_ROTATION: usize = 64;

/// `k` states made by `make`.
fn states<S>(k: usize, mut make: impl FnMut() -> S) -> Vec<S> {
    (0..k).map(|_| make()).collect()
}

/// What a run measures: element type, reduction, options.
pub(super) struct Setup<'a> {
    pub(super) args: &'a Args,
    pub(super) dtype: DType,
    pub(super) red: Reduction,
    pub(super) seg: Option<usize>,
}

impl Setup<'_> {
    pub(super) fn opts(&self, algo: Algorithm) -> CollectiveOptions {
        let mut o = CollectiveOptions::new().algorithm(algo);
        if let Some(seg) = self.seg {
            o = o.segment_bytes(seg);
        }
        o
    }

    /// The reduction of `v(p)` over every rank p, as one element.
    pub(super) fn reduced(&self, n: usize, v: impl Fn(usize) -> u32) -> Result<Vec<u8>> {
        let mut acc = element(self.dtype, v(0));
        for p in 1..n {
            self.red.apply_bytes(self.dtype, &mut acc, &element(self.dtype, v(p)))?;
        }
        self.red.finish_bytes(self.dtype, &mut acc, n)?;
        Ok(acc)
    }
}

/// Measures one (op, algorithm, size) cell.
pub(super) fn measure(
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
    let (count, moved, factor, timing) = match op {
        "allreduce" => {
            let count = bytes / ts;
            let mut bufs = states(rotation(args, count * ts), || Buf::new(count * ts));
            picked = Some(ctx.allreduce_algorithm(count * ts, algo)?);
            let t = timed(
                ctx,
                args,
                &mut bufs,
                |b| b.fill(&own),
                |b| ctx.allreduce_bytes(b.bytes_mut(), dtype, s.red, &opts),
            )?;
            wrong = !bufs[t.last].all(&s.reduced(n, |p| p as u32 + 1)?);
            (count, count * ts, 2.0 * (n - 1) as f64 / n as f64, t)
        }
        "allgather" => {
            let per = bytes / ts / n;
            let make = || {
                let mut mine = Buf::new(per * ts);
                mine.fill(&own);
                (mine, Buf::new(per * n * ts))
            };
            let mut st = states(rotation(args, (n + 1) * per * ts), make);
            picked = Some(ctx.allgather_algorithm(per * n * ts, algo)?);
            let t = timed(
                ctx,
                args,
                &mut st,
                |_| {},
                |(mine, out)| ctx.allgather_bytes(mine.bytes(), out.bytes_mut(), dtype, &opts),
            )?;
            wrong = per > 0
                && st[t.last].1.bytes().chunks_exact(per * ts).enumerate().any(|(p, b)| {
                    let e = element(dtype, p as u32 + 1);
                    b.chunks_exact(ts).any(|c| c != e)
                });
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, t)
        }
        "reduce_scatter" => {
            let per = bytes / ts / n;
            let make = || {
                let mut input = Buf::new(per * n * ts);
                input.fill(&own);
                (input, Buf::new(per * ts))
            };
            let mut st = states(rotation(args, (n + 1) * per * ts), make);
            let t = timed(
                ctx,
                args,
                &mut st,
                |_| {},
                |(input, out)| ctx.reduce_scatter_bytes(input.bytes(), out.bytes_mut(), dtype, s.red, &opts),
            )?;
            wrong = !st[t.last].1.all(&s.reduced(n, |p| p as u32 + 1)?);
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, t)
        }
        "broadcast" => {
            let count = bytes / ts;
            // The root's buffer is filled once: a broadcast only reads it, and refilling it
            // before every call would leave it dirty in the root's cache, so that every
            // timed call read it from there (Open MPI's harness writes no input either).
            // The others' are cleared before every call, so the check sees the last one.
            let mut bufs = states(rotation(args, count * ts), || {
                let mut b = Buf::new(count * ts);
                if r == root {
                    b.fill(&own);
                }
                b
            });
            let cleared = element(dtype, 0);
            picked = Some(ctx.broadcast_algorithm(count * ts, algo)?);
            let t = timed(
                ctx,
                args,
                &mut bufs,
                |b| {
                    if r != root {
                        b.fill(&cleared)
                    }
                },
                |b| ctx.broadcast_bytes(b.bytes_mut(), dtype, root, &opts),
            )?;
            wrong = !bufs[t.last].all(&element(dtype, root as u32 + 1));
            (count, count * ts, 1.0, t)
        }
        "reduce" => {
            let count = bytes / ts;
            let mut bufs = states(rotation(args, count * ts), || Buf::new(count * ts));
            let t = timed(
                ctx,
                args,
                &mut bufs,
                |b| b.fill(&own),
                |b| ctx.reduce_bytes(b.bytes_mut(), dtype, root, s.red, &opts),
            )?;
            let want = if r == root { s.reduced(n, |p| p as u32 + 1)? } else { own.clone() };
            wrong = !bufs[t.last].all(&want);
            (count, count * ts, 1.0, t)
        }
        "alltoall" => {
            let per = bytes / ts / n;
            let make = || {
                let mut input = Buf::new(per * n * ts);
                input.fill_blocks(per * ts, |p| element(dtype, ((r * n + p) % 100) as u32));
                (input, Buf::new(per * n * ts))
            };
            let mut st = states(rotation(args, 2 * per * n * ts), make);
            let t = timed(
                ctx,
                args,
                &mut st,
                |_| {},
                |(input, out)| ctx.alltoall_bytes(input.bytes(), out.bytes_mut(), dtype, &opts),
            )?;
            let mut want = Buf::new(per * n * ts);
            want.fill_blocks(per * ts, |p| element(dtype, ((p * n + r) % 100) as u32));
            wrong = st[t.last].1.bytes() != want.bytes();
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, t)
        }
        "sendrecv" => {
            let count = bytes / ts;
            let (right, left) = ((r + 1) % n, (r + n - 1) % n);
            let make = || {
                let mut out = Buf::new(count * ts);
                out.fill(&own);
                (out, Buf::new(count * ts))
            };
            let mut st = states(rotation(args, 2 * count * ts), make);
            let t = timed(
                ctx,
                args,
                &mut st,
                |_| {},
                |(out, inbox)| {
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
            wrong = n > 1 && !st[t.last].1.all(&element(dtype, left as u32 + 1));
            (count, count * ts, 1.0, t)
        }
        "pingpong" => {
            // Ranks 0 and 1 bounce one message PINGPONG_ROUNDS times; the time is half a round
            // trip (the one-way latency), the bandwidth that of one direction.
            let count = bytes / ts;
            let make = || {
                let mut out = Buf::new(count * ts);
                out.fill(&own);
                (out, Buf::new(count * ts))
            };
            let mut st = states(rotation(args, 2 * count * ts), make);
            let mut t = timed(
                ctx,
                args,
                &mut st,
                |_| {},
                |(out, inbox)| {
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
            wrong = r < 2 && n > 1 && !st[t.last].1.all(&element(dtype, from));
            let one_way = (2 * PINGPONG_ROUNDS) as f64;
            t.worst.iter_mut().for_each(|x| *x /= one_way);
            t.ranks.iter_mut().for_each(|x| *x /= one_way);
            (count, count * ts, 1.0, t)
        }
        "barrier" => {
            let t = timed(ctx, args, &mut [()], |_| {}, |_| ctx.barrier())?;
            (0, 0, 0.0, t)
        }
        "agree" => {
            let mut agreed = Vec::new();
            let t = timed(ctx, args, &mut [()], |_| {}, |_| ctx.agree(!0).map(|a| agreed.push(a)))?;
            wrong = agreed.iter().any(|a| a.value != !0 || !a.failed.is_empty());
            (0, 0, 0.0, t)
        }
        "shrink" => {
            let mut sizes = Vec::new();
            let t = timed(ctx, args, &mut [()], |_| {}, |_| ctx.shrink().map(|c| sizes.push(c.size())))?;
            wrong = sizes.iter().any(|&s| s != n);
            (0, 0, 0.0, t)
        }
        other => return Err(Error::invalid(format!("unknown collective {other:?}"))),
    };
    let mut bad = [u32::from(wrong && !args.no_check)];
    ctx.allreduce(&mut bad, ferrogloo::Reduction::Max)?;
    Ok(Cell::new(op, algo, picked, (count, moved, factor), timing, bad[0]))
}

/// The bytes a cell of `op` really moves when asked for `bytes`: whole elements, and for the
/// collectives whose size is split over the ranks, whole blocks per rank.
pub(super) fn effective(op: &str, bytes: usize, ts: usize, n: usize) -> usize {
    match op {
        "allgather" | "reduce_scatter" | "alltoall" => bytes / ts / n * n * ts,
        "barrier" | "agree" | "shrink" => 0,
        _ => bytes / ts * ts,
    }
}
