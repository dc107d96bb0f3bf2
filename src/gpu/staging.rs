//! The staging pipeline: collectives on memory the host cannot touch directly (a GPU's),
//! moved in chunks through a small pool of host buffers.
//!
//! A collective is cut into *chunks*. Each chunk names the device bytes to copy into a pool
//! buffer (*downloads*), the host collective to run on that buffer, and the bytes to copy back
//! (*uploads*). With [`POOL`] buffers in rotation the copies overlap the network: chunk `i + 1`
//! is downloading while chunk `i` is on the wire, and chunk `i` uploads while chunk `i + 1` is.
//! A buffer is reused only after its uploads finished; every copy started is waited for before
//! the pipeline returns, also when it fails, so device and pool memory are never touched after.
//!
//! The pipeline knows device memory only through [`Staging`], which the CUDA path implements
//! with asynchronous copies on a stream and events, and which the tests implement with host
//! memory and copies on another thread that finish late and in random order, so that a
//! missing wait shows up as a wrong result.

#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::algorithms::CollectiveOptions;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::types::{Algorithm, DType, Reduction};

/// Buffers in the pool.
pub(crate) const POOL: usize = 3;

/// Device memory as the pipeline sees it: copies in and out of the pool's buffers that finish
/// later, each with a ticket to wait on.
pub(crate) trait Staging {
    /// What a started copy gives to wait on.
    type Ticket;

    /// Bytes in each pool buffer.
    fn chunk_bytes(&self) -> usize;

    /// Pool buffer `i` (`i < POOL`), [`chunk_bytes`](Staging::chunk_bytes) long.
    fn buffer(&mut self, i: usize) -> *mut u8;

    /// Starts copying `len` bytes at byte `dev` of the input into pool buffer `buf` at byte
    /// `host`.
    fn download(&mut self, dev: usize, buf: usize, host: usize, len: usize) -> Result<Self::Ticket>;

    /// Starts copying `len` bytes of pool buffer `buf` at byte `host` to byte `dev` of the
    /// output.
    fn upload(&mut self, buf: usize, host: usize, dev: usize, len: usize) -> Result<Self::Ticket>;

    /// Waits until the copy of `t` finished.
    fn wait(&mut self, t: Self::Ticket) -> Result<()>;
}

/// One copy of a chunk: `len` bytes between device byte `dev` and pool byte `host`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copy {
    pub(crate) dev: usize,
    pub(crate) host: usize,
    pub(crate) len: usize,
}

/// One chunk: copies in, then the host collective, then copies out.
#[derive(Debug, Clone, Default)]
pub(crate) struct Chunk {
    pub(crate) downloads: Vec<Copy>,
    pub(crate) uploads: Vec<Copy>,
    /// Pool bytes the chunk uses.
    pub(crate) bytes: usize,
}

/// Runs `chunks` through the pool; `host(i, buf)` runs chunk `i`'s collective on its pool
/// buffer's first `bytes` bytes.
pub(crate) fn run<S: Staging>(
    s: &mut S,
    chunks: &[Chunk],
    mut host: impl FnMut(usize, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut downs: Vec<Vec<S::Ticket>> = (0..POOL).map(|_| Vec::new()).collect();
    let mut ups: Vec<Vec<S::Ticket>> = (0..POOL).map(|_| Vec::new()).collect();
    let outcome = run_inner(s, chunks, &mut host, &mut downs, &mut ups);
    // Whatever happened, no copy may still be running when the caller gets its memory back.
    let mut first_err = outcome.err();
    for t in downs.into_iter().chain(ups).flatten() {
        if let Err(e) = s.wait(t) {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

fn run_inner<S: Staging>(
    s: &mut S,
    chunks: &[Chunk],
    host: &mut impl FnMut(usize, &mut [u8]) -> Result<()>,
    downs: &mut [Vec<S::Ticket>],
    ups: &mut [Vec<S::Ticket>],
) -> Result<()> {
    let cap = s.chunk_bytes();
    if let Some(c) = chunks.iter().find(|c| c.bytes > cap) {
        return Err(Error::invalid(format!("a staging chunk of {} bytes in a pool of {cap}-byte buffers", c.bytes)));
    }
    let start = |s: &mut S, i: usize, downs: &mut [Vec<S::Ticket>], ups: &mut [Vec<S::Ticket>]| -> Result<()> {
        let b = i % POOL;
        // The buffer's previous chunk must have finished uploading before it is written again.
        for t in ups[b].drain(..) {
            s.wait(t)?;
        }
        for c in &chunks[i].downloads {
            downs[b].push(s.download(c.dev, b, c.host, c.len)?);
        }
        Ok(())
    };
    if !chunks.is_empty() {
        start(s, 0, downs, ups)?;
    }
    for (i, chunk) in chunks.iter().enumerate() {
        let b = i % POOL;
        if i + 1 < chunks.len() {
            start(s, i + 1, downs, ups)?;
        }
        for t in downs[b].drain(..) {
            s.wait(t)?;
        }
        let ptr = s.buffer(b);
        // SAFETY: pool buffer `b` holds `chunk_bytes() >= chunk.bytes` bytes (checked above);
        // its downloads have finished and its previous uploads too (waited in `start`), and no
        // copy touches it until this chunk's uploads start below.
        let buf = unsafe { std::slice::from_raw_parts_mut(ptr, chunk.bytes) };
        host(i, buf)?;
        for c in &chunk.uploads {
            ups[b].push(s.upload(b, c.host, c.dev, c.len)?);
        }
    }
    Ok(())
}

/// The largest multiple of `esize` that is at most `n` (at least `esize` when `n >= esize`).
fn whole(n: usize, esize: usize) -> usize {
    n / esize * esize
}

/// Chunks of an in-place collective over `len` bytes, each at most `piece` bytes (and a pool
/// buffer): each chunk downloads where `down`, uploads where `up`.
pub(crate) fn in_place(len: usize, esize: usize, cap: usize, piece: usize, down: bool, up: bool) -> Vec<Chunk> {
    let step = whole(cap.min(piece), esize).max(esize);
    (0..len)
        .step_by(step)
        .map(|off| {
            let n = step.min(len - off);
            let c = Copy { dev: off, host: 0, len: n };
            Chunk {
                downloads: if down { vec![c] } else { vec![] },
                uploads: if up { vec![c] } else { vec![] },
                bytes: n,
            }
        })
        .collect()
}

/// The piece of each rank's block a chunk of a gathering or scattering collective moves (at
/// most `want` bytes, at least one element): the pool holds the piece once and `n` times.
fn piece(esize: usize, cap: usize, want: usize, n: usize) -> Result<usize> {
    let fits = whole(cap / (n + 1), esize);
    if fits == 0 {
        return Err(Error::invalid(format!(
            "a staging buffer of {cap} bytes cannot hold one element per rank for {n} ranks"
        )));
    }
    Ok(fits.min(whole(want, esize).max(esize)))
}

/// Chunks of an allgather of `block` bytes per rank among `n` ranks, this one `me`: the
/// chunk's own piece (at most `want` bytes) lands at pool byte 0, the gathered pieces at
/// `p + r * len`.
pub(crate) fn allgather(block: usize, esize: usize, cap: usize, want: usize, n: usize) -> Result<(Vec<Chunk>, usize)> {
    let p = piece(esize, cap, want, n)?;
    let chunks = (0..block)
        .step_by(p)
        .map(|off| {
            let len = p.min(block - off);
            Chunk {
                downloads: vec![Copy { dev: off, host: 0, len }],
                uploads: (0..n).map(|r| Copy { dev: r * block + off, host: p + r * len, len }).collect(),
                bytes: p + n * len,
            }
        })
        .collect();
    Ok((chunks, p))
}

/// Chunks of a reduce-scatter to `block` bytes per rank among `n` ranks: the pieces of every
/// rank's block (at most `want` bytes each) land at `r * len`, the reduced piece at `n * p`.
pub(crate) fn reduce_scatter(
    block: usize,
    esize: usize,
    cap: usize,
    want: usize,
    n: usize,
) -> Result<(Vec<Chunk>, usize)> {
    let p = piece(esize, cap, want, n)?;
    let chunks = (0..block)
        .step_by(p)
        .map(|off| {
            let len = p.min(block - off);
            Chunk {
                downloads: (0..n).map(|r| Copy { dev: r * block + off, host: r * len, len }).collect(),
                uploads: vec![Copy { dev: off, host: n * p, len }],
                bytes: n * p + len,
            }
        })
        .collect();
    Ok((chunks, p))
}

/// What a staged collective's pieces cost on this machine, as measured (see `Cuda`'s first
/// call) and agreed by every rank, so that every rank cuts a call into the same pieces: the
/// fixed time and the time per byte of a copy from the device (`down`) and to it (`up`), in
/// seconds, and the fixed time of a host collective (`host`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Rates {
    pub(crate) down: (f64, f64),
    pub(crate) up: (f64, f64),
    pub(crate) host: f64,
}

impl Rates {
    /// Every rank's figures, agreed: this rank's copy figures (`down`, `up`: fixed time and
    /// time per byte, measured by the caller) and a host collective's fixed time, timed here
    /// (the best of three tiny allreduces); the largest of each over the ranks (one more tiny
    /// allreduce), so that every rank holds the same rates and cuts every call alike, whatever
    /// its own measurement said. A collective: every rank calls it at the same point.
    pub(crate) fn agree(ctx: &Context, down: (f64, f64), up: (f64, f64), opts: &CollectiveOptions) -> Result<Rates> {
        // The caller's tag and deadline, and an algorithm every allreduce takes (the caller's
        // may be a broadcast's, such as a binomial tree).
        let opts = &opts.clone().algorithm(Algorithm::Auto);
        let mut host = f64::INFINITY;
        for _ in 0..3 {
            let mut probe = [0u8; 8];
            let t = std::time::Instant::now();
            ctx.allreduce_with(&mut probe, Reduction::Max, opts)?;
            host = host.min(t.elapsed().as_secs_f64());
        }
        let mut v = [down.0, down.1, up.0, up.1, host];
        ctx.allreduce_with(&mut v, Reduction::Max, opts)?;
        Ok(Rates { down: (v[0], v[1]), up: (v[2], v[3]), host: v[4] })
    }

    /// How many pieces a call that copies `down` bytes from the device and `up` bytes to it is
    /// cut into. Only the first piece's download and the last one's upload are not hidden
    /// behind other pieces' work, and each piece costs fixed times (a host collective, the
    /// copies' starts and waits): with `k` pieces the call takes about
    /// `(down·β_down + up·β_up) / k + k·α + (the host collective's own time)`, least at
    /// `k = √((down·β_down + up·β_up) / α)`.
    pub(crate) fn pieces(&self, down: usize, up: usize) -> usize {
        let exposed = down as f64 * self.down.1 + up as f64 * self.up.1;
        let fixed = self.host + (self.down.0 + self.up.0) / 2.0;
        let k = (exposed / fixed).sqrt();
        if k.is_finite() && k >= 1.0 { (k.round() as usize).min(1 << 20) } else { 1 }
    }
}

/// Bytes per piece when `len` bytes are cut into `k` pieces: whole elements, and whole pages
/// from 64 KiB (copies of whole pages run at the link's full speed).
fn piece_bytes(len: usize, k: usize, esize: usize) -> usize {
    let raw = len.div_ceil(k.max(1)).max(1);
    let align = if raw >= 64 << 10 { 4096 } else { esize };
    raw.div_ceil(align) * align
}

/// What a staged collective does on the host.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    Allreduce(Reduction),
    Broadcast { root: usize },
    Reduce { root: usize, op: Reduction },
    Allgather,
    ReduceScatter(Reduction),
}

/// Runs collective `op` on `ctx` over staged memory: `len` bytes of `dtype` in the input (per
/// rank for allgather, in all for reduce-scatter, whose output is `len / size`). With `rates`
/// the call is cut into the pieces they give ([`Rates::pieces`]); without, into pieces as large
/// as the pool's buffers.
pub(crate) fn collective<S: Staging>(
    ctx: &Context,
    s: &mut S,
    op: Op,
    dtype: DType,
    len: usize,
    opts: &CollectiveOptions,
    rates: Option<&Rates>,
) -> Result<()> {
    let esize = dtype.size();
    let (n, me) = (ctx.size(), ctx.rank());
    if !len.is_multiple_of(esize) {
        return Err(Error::invalid(format!("{len} bytes are not whole {dtype:?} elements of {esize} bytes")));
    }
    if let Op::Allreduce(red) | Op::Reduce { op: red, .. } | Op::ReduceScatter(red) = op {
        red.check(dtype)?;
    }
    let cap = s.chunk_bytes();
    // Every rank computes the same cut: the same rates, lengths and rank count. `block`: the
    // bytes the pieces cut (a rank's block for reduce-scatter), `down`/`up`: the bytes copied.
    let (block, down, up) = match op {
        Op::Allgather => (len, len, len.saturating_mul(n)),
        Op::ReduceScatter(_) => (len / n, len, len / n),
        _ => (len, len, len),
    };
    let want = rates.map_or(usize::MAX, |r| piece_bytes(block, r.pieces(down, up), esize));
    match op {
        Op::Allreduce(red) => {
            let chunks = in_place(len, esize, cap, want, true, true);
            run(s, &chunks, |_, b| ctx.allreduce_bytes(b, dtype, red, opts))
        }
        Op::Broadcast { root } => {
            let chunks = in_place(len, esize, cap, want, me == root, me != root);
            run(s, &chunks, |_, b| ctx.broadcast_bytes(b, dtype, root, opts))
        }
        Op::Reduce { root, op: red } => {
            let chunks = in_place(len, esize, cap, want, true, me == root);
            run(s, &chunks, |_, b| ctx.reduce_bytes(b, dtype, root, red, opts))
        }
        Op::Allgather => {
            let (chunks, p) = allgather(len, esize, cap, want, n)?;
            run(s, &chunks, |i, b| {
                let piece = chunks[i].downloads[0].len;
                let (input, rest) = b.split_at_mut(p);
                ctx.allgather_bytes(&input[..piece], &mut rest[..n * piece], dtype, opts)
            })
        }
        Op::ReduceScatter(red) => {
            if !len.is_multiple_of(n * esize) {
                return Err(Error::invalid(format!(
                    "reduce-scatter of {len} bytes of {dtype:?} over {n} ranks: not a whole number of elements per rank"
                )));
            }
            let (chunks, p) = reduce_scatter(len / n, esize, cap, want, n)?;
            run(s, &chunks, |i, b| {
                let piece = chunks[i].uploads[0].len;
                let (input, out) = b.split_at_mut(n * p);
                ctx.reduce_scatter_bytes(&input[..n * piece], &mut out[..piece], dtype, red, opts)
            })
        }
    }
}

#[cfg(test)]
pub(crate) mod host {
    //! Staged memory in host memory, with copies that finish late and out of order on a
    //! thread of their own, and copies that fail on request.

    use super::{POOL, Staging};
    use crate::error::{Error, Result};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::Duration;

    type Job = Box<dyn FnOnce() + Send>;

    /// A ticket: set once its copy ran.
    pub(crate) struct Ticket(Arc<(Mutex<Option<bool>>, Condvar)>);

    /// Host buffers pretending to be device memory.
    pub(crate) struct HostStaging {
        pub(crate) input: Vec<u8>,
        /// `None`: the output is the input (in-place collectives).
        pub(crate) output: Option<Vec<u8>>,
        pool: Vec<Vec<u8>>,
        jobs: Option<mpsc::Sender<Job>>,
        worker: Option<std::thread::JoinHandle<()>>,
        /// Copies started and not yet finished.
        pub(crate) in_flight: Arc<AtomicUsize>,
        /// The copy with this number (counted from 0) fails.
        pub(crate) fail_at: Option<usize>,
        started: usize,
        seed: u64,
    }

    impl HostStaging {
        pub(crate) fn new(input: Vec<u8>, output: Option<Vec<u8>>, chunk: usize, seed: u64) -> Self {
            let (tx, rx) = mpsc::channel::<Job>();
            let worker = std::thread::spawn(move || {
                // Copies run in batches in reverse order of arrival: late, and out of order.
                while let Ok(first) = rx.recv() {
                    let mut batch = vec![first];
                    while let Ok(j) = rx.recv_timeout(Duration::from_micros(200)) {
                        batch.push(j);
                        if batch.len() >= 4 {
                            break;
                        }
                    }
                    for j in batch.into_iter().rev() {
                        j();
                    }
                }
            });
            HostStaging {
                input,
                output,
                pool: (0..POOL).map(|_| vec![0xEE; chunk]).collect(),
                jobs: Some(tx),
                worker: Some(worker),
                in_flight: Arc::new(AtomicUsize::new(0)),
                fail_at: None,
                started: 0,
                seed,
            }
        }

        /// The output (the input for in-place collectives).
        pub(crate) fn result(&self) -> &[u8] {
            self.output.as_deref().unwrap_or(&self.input)
        }

        fn copy(&mut self, src: *const u8, dst: *mut u8, len: usize) -> Result<Ticket> {
            let n = self.started;
            self.started += 1;
            if self.fail_at == Some(n) {
                return Err(Error::io("a simulated device copy", std::io::Error::other(format!("copy {n} fails"))));
            }
            let t = Arc::new((Mutex::new(None), Condvar::new()));
            let (t2, flight) = (t.clone(), self.in_flight.clone());
            flight.fetch_add(1, Ordering::SeqCst);
            let (src, dst) = (src as usize, dst as usize);
            self.seed = self.seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let delay = self.seed >> 60;
            let job: Job = Box::new(move || {
                std::thread::sleep(Duration::from_micros(delay * 20));
                // SAFETY: the pipeline keeps both ranges alive and untouched until it waited for
                // this ticket (what the test checks by the results).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
                flight.fetch_sub(1, Ordering::SeqCst);
                *t2.0.lock().unwrap() = Some(true);
                t2.1.notify_all();
            });
            self.jobs.as_ref().unwrap().send(job).unwrap();
            Ok(Ticket(t))
        }
    }

    impl Drop for HostStaging {
        fn drop(&mut self) {
            self.jobs = None;
            if let Some(w) = self.worker.take() {
                let _ = w.join();
            }
        }
    }

    impl Staging for HostStaging {
        type Ticket = Ticket;

        fn chunk_bytes(&self) -> usize {
            self.pool[0].len()
        }

        fn buffer(&mut self, i: usize) -> *mut u8 {
            self.pool[i].as_mut_ptr()
        }

        fn download(&mut self, dev: usize, buf: usize, host: usize, len: usize) -> Result<Ticket> {
            assert!(dev + len <= self.input.len() && host + len <= self.pool[buf].len(), "download out of bounds");
            let src = self.input[dev..].as_ptr();
            let dst = self.pool[buf][host..].as_mut_ptr();
            self.copy(src, dst, len)
        }

        fn upload(&mut self, buf: usize, host: usize, dev: usize, len: usize) -> Result<Ticket> {
            let out = self.output.as_mut().unwrap_or(&mut self.input);
            assert!(dev + len <= out.len() && host + len <= self.pool[buf].len(), "upload out of bounds");
            let dst = out[dev..].as_mut_ptr();
            let src = self.pool[buf][host..].as_ptr();
            self.copy(src, dst, len)
        }

        fn wait(&mut self, t: Ticket) -> Result<()> {
            let mut g = t.0.0.lock().unwrap();
            while g.is_none() {
                g = t.0.1.wait(g).unwrap();
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::host::HostStaging;
    use super::{Op, Rates, collective, piece_bytes};
    use crate::algorithms::CollectiveOptions;
    use crate::context::testing::ranks;
    use crate::rendezvous::HashStore;
    use crate::types::{DType, Reduction};
    use crate::{Context, Device};
    use proptest::prelude::*;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    /// A value of rank `r` at element `i`, small so sums of every type stay exact.
    fn val(seed: u64, r: usize, i: usize) -> i64 {
        ((seed as usize ^ (r * 7919) ^ (i * 31)) % 5) as i64 - 2
    }

    fn encode(dtype: DType, vals: &[i64]) -> Vec<u8> {
        vals.iter()
            .flat_map(|&v| match dtype {
                DType::F32 => (v as f32).to_ne_bytes().to_vec(),
                DType::F64 => (v as f64).to_ne_bytes().to_vec(),
                DType::F16 => half::f16::from_f32(v as f32).to_ne_bytes().to_vec(),
                DType::BF16 => half::bf16::from_f32(v as f32).to_ne_bytes().to_vec(),
                DType::I32 => (v as i32).to_ne_bytes().to_vec(),
                DType::I64 => v.to_ne_bytes().to_vec(),
                _ => vec![v as u8],
            })
            .collect()
    }

    const TYPES: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8];

    /// Runs `op` on `n` ranks with staged memory of `count` elements (per rank for allgather,
    /// per rank's output for reduce-scatter), pool buffers of `chunk` bytes; returns every
    /// rank's result, and checks that no copy was left running.
    fn staged(n: usize, op: Op, dtype: DType, count: usize, chunk: usize, seed: u64) -> Vec<Vec<u8>> {
        staged_in_pieces(n, op, dtype, count, chunk, None, seed)
    }

    /// [`staged`], cut by `rates` (seconds per byte of either copy, one second per piece).
    fn staged_in_pieces(
        n: usize,
        op: Op,
        dtype: DType,
        count: usize,
        chunk: usize,
        rate: Option<f64>,
        seed: u64,
    ) -> Vec<Vec<u8>> {
        let rates = rate.map(|b| Rates { down: (0.0, b), up: (0.0, b), host: 1.0 });
        ranks(n, &Device::in_process(), |ctx| {
            let r = ctx.rank();
            let elems = if matches!(op, Op::ReduceScatter(_)) { count * n } else { count };
            let input = encode(dtype, &(0..elems).map(|i| val(seed, r, i)).collect::<Vec<_>>());
            let len = input.len();
            let output = match op {
                Op::Allgather => Some(vec![0xAB; len * n]),
                Op::ReduceScatter(_) => Some(vec![0xAB; len / n]),
                _ => None,
            };
            let mut st = HostStaging::new(input, output, chunk, seed ^ r as u64);
            collective(&ctx, &mut st, op, dtype, len, &CollectiveOptions::default(), rates.as_ref())?;
            assert_eq!(st.in_flight.load(Ordering::SeqCst), 0, "a copy outlived the collective");
            Ok(st.result().to_vec())
        })
    }

    /// The same collective on plain host buffers.
    fn reference(n: usize, op: Op, dtype: DType, count: usize, seed: u64) -> Vec<Vec<u8>> {
        let sum = |i: usize| (0..n).map(|r| val(seed, r, i)).sum::<i64>();
        (0..n)
            .map(|r| {
                let vals: Vec<i64> = match op {
                    Op::Allreduce(_) => (0..count).map(sum).collect(),
                    Op::Broadcast { root } => (0..count).map(|i| val(seed, root, i)).collect(),
                    Op::Reduce { root, .. } if r == root => (0..count).map(sum).collect(),
                    Op::Reduce { .. } => (0..count).map(|i| val(seed, r, i)).collect(),
                    Op::Allgather => (0..n).flat_map(|q| (0..count).map(move |i| val(seed, q, i))).collect(),
                    Op::ReduceScatter(_) => (0..count).map(|i| sum(r * count + i)).collect(),
                };
                if dtype == DType::U8 {
                    encode(dtype, &vals.iter().map(|v| v.rem_euclid(256)).collect::<Vec<_>>())
                } else {
                    encode(dtype, &vals)
                }
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

        /// Every staged collective, every element type, sizes around the chunk size, 1 to 5
        /// ranks: the same bytes as the host collective, on every rank.
        #[test]
        fn staged_collectives_match_the_host_reference(
            n in 1usize..=5, which in 0usize..5, t in 0usize..7, count in 0usize..600,
            chunk in prop_oneof![Just(64usize), Just(96), Just(1000), Just(4096)], seed in any::<u64>(),
            rate in prop_oneof![Just(None), Just(Some(1e-3)), Just(Some(0.1)), Just(Some(10.0))],
        ) {
            let dtype = TYPES[t];
            let root = (seed as usize) % n;
            let op = [
                Op::Allreduce(Reduction::Sum),
                Op::Broadcast { root },
                Op::Reduce { root, op: Reduction::Sum },
                Op::Allgather,
                Op::ReduceScatter(Reduction::Sum),
            ][which];
            // A pool buffer must hold one element per rank and one more.
            let chunk = chunk.max((n + 1) * dtype.size());
            let got = staged_in_pieces(n, op, dtype, count, chunk, rate, seed);
            let want = reference(n, op, dtype, count, seed);
            for r in 0..n {
                prop_assert!(
                    got[r] == want[r], "rank {} of {}: {:?} {:?} count {} chunk {} rate {:?}", r, n, op, dtype, count, chunk, rate
                );
            }
        }
    }

    #[test]
    fn ranks_that_measured_differently_agree_on_the_largest_figures() {
        let got: Vec<Rates> = ranks(3, &Device::in_process(), |ctx| {
            // Rank 1 measured the slowest copies from the device, rank 2 to it.
            let r = ctx.rank();
            let f = r as f64 + 1.0;
            let down = if r == 1 { (9e-6, 9e-11) } else { (f * 1e-6, f * 1e-11) };
            let up = if r == 2 { (8e-6, 8e-11) } else { (f * 1e-7, f * 1e-12) };
            // Options a broadcast may carry: the agreement's allreduces ignore the algorithm.
            let opts = CollectiveOptions::default().algorithm(crate::Algorithm::BinomialTree);
            Rates::agree(&ctx, down, up, &opts)
        });
        for r in &got {
            assert_eq!(r, &got[0], "every rank holds the same rates");
        }
        assert_eq!(got[0].down, (9e-6, 9e-11));
        assert_eq!(got[0].up, (8e-6, 8e-11));
        assert!(got[0].host > 0.0 && got[0].host < 20.0, "a host collective's time: {}", got[0].host);
        // A rank whose copies could not be timed offers infinite fixed costs: one piece.
        let failed = Rates { down: (f64::INFINITY, 0.0), up: (f64::INFINITY, 0.0), ..got[0] };
        assert_eq!(failed.pieces(64 << 20, 64 << 20), 1);
    }

    #[test]
    fn pieces_grow_with_the_root_of_the_exposed_copy_time_and_never_below_one() {
        // 25 GB/s each way, 10 µs fixed per piece.
        let r = Rates { down: (8e-6, 4e-11), up: (8e-6, 4e-11), host: 2e-6 };
        assert_eq!(r.pieces(0, 0), 1);
        assert_eq!(r.pieces(4096, 4096), 1, "a small call is one piece");
        let (m, m4) = (r.pieces(1 << 20, 1 << 20), r.pieces(4 << 20, 4 << 20));
        assert!((3..=4).contains(&m), "1 MiB: {m} pieces");
        assert!(m4 == 2 * m || m4 == 2 * m - 1, "4× the bytes, about 2× the pieces: {m} then {m4}");
        let slow_host = Rates { host: 1e-3, ..r };
        assert_eq!(slow_host.pieces(1 << 20, 1 << 20), 1, "fixed costs above the copy time: one piece");
        let free = Rates { down: (0.0, 0.0), up: (0.0, 0.0), host: 0.0 };
        assert_eq!(free.pieces(1 << 30, 1 << 30), 1, "nothing measured: one piece, not a division by zero");
        let odd = Rates { down: (f64::NAN, 1.0), up: (0.0, f64::INFINITY), host: 0.0 };
        assert_eq!(odd.pieces(1 << 20, 1 << 20), 1);
        // Pieces are whole elements, whole pages from 64 KiB, and cover the bytes.
        for (len, k, esize) in [(1000, 3, 8), (1 << 20, 3, 4), (10, 20, 2), (5 << 20, 7, 2)] {
            let p = piece_bytes(len, k, esize);
            assert!(p.is_multiple_of(esize), "{len} {k}");
            assert!(p * k >= len, "{len} bytes in {k} pieces of {p}");
            assert!(p < (64 << 10) || p.is_multiple_of(4096), "{p}");
        }
    }

    #[test]
    fn staged_averages_are_the_sums_scaled_once_where_the_result_is_and_integers_are_refused() {
        for (n, count, chunk) in [(1, 5, 64), (3, 100, 96), (4, 333, 1000)] {
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                let root = count % n;
                let ops = [
                    Op::Allreduce(Reduction::Average),
                    Op::Reduce { root, op: Reduction::Average },
                    Op::ReduceScatter(Reduction::Average),
                ];
                for (op, sum) in ops.into_iter().zip([
                    Op::Allreduce(Reduction::Sum),
                    Op::Reduce { root, op: Reduction::Sum },
                    Op::ReduceScatter(Reduction::Sum),
                ]) {
                    let chunk = chunk.max((n + 1) * dtype.size());
                    let got = staged(n, op, dtype, count, chunk, 7);
                    let mut want = reference(n, sum, dtype, count, 7);
                    for (r, w) in want.iter_mut().enumerate() {
                        if !matches!(op, Op::Reduce { .. }) || r == root {
                            Reduction::Average.finish_bytes(dtype, w, n).unwrap();
                        }
                    }
                    assert_eq!(got, want, "{op:?} of {dtype} on {n} ranks");
                }
            }
        }
        let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process()).unwrap();
        let mut st = HostStaging::new(vec![0u8; 16], None, 256, 0);
        let e = collective(&ctx, &mut st, Op::Allreduce(Reduction::Average), DType::I32, 16, &Default::default(), None)
            .expect_err("an average of integers");
        assert!(matches!(&e, crate::Error::InvalidArgument(m) if m.contains("average of i32")), "{e}");
        assert_eq!(st.in_flight.load(Ordering::SeqCst), 0, "no copy started");
    }

    #[test]
    fn a_failed_copy_fails_the_collective_after_every_started_copy_finished() {
        let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process()).unwrap();
        for fail_at in [0, 1, 5, 9] {
            let mut st = HostStaging::new(vec![1u8; 4000], None, 256, fail_at as u64);
            st.fail_at = Some(fail_at);
            let r = collective(
                &ctx,
                &mut st,
                Op::Allreduce(Reduction::Sum),
                DType::U8,
                4000,
                &CollectiveOptions::default(),
                None,
            );
            let e = r.expect_err("the copy fails");
            assert!(e.to_string().contains(&format!("copy {fail_at} fails")), "{e}");
            assert_eq!(st.in_flight.load(Ordering::SeqCst), 0, "a copy outlived the failed collective");
        }
    }

    #[test]
    fn a_failed_host_collective_waits_for_the_copies_too() {
        // Rank 1 stages fewer bytes: the chunk where they differ is a mismatch in words.
        let store = HashStore::new();
        std::thread::scope(|s| {
            for r in 0..2 {
                let store = &store;
                s.spawn(move || {
                    let ctx = Context::builder(r, 2)
                        .timeout(Duration::from_secs(5))
                        .connect(store, &Device::in_process())
                        .unwrap();
                    let len = if r == 0 { 1000 } else { 900 };
                    let mut st = HostStaging::new(vec![1u8; len], None, 256, r as u64);
                    let e = collective(
                        &ctx,
                        &mut st,
                        Op::Allreduce(Reduction::Sum),
                        DType::U8,
                        len,
                        &CollectiveOptions::default(),
                        None,
                    )
                    .expect_err("lengths differ");
                    assert!(
                        matches!(
                            e,
                            crate::Error::Mismatch { .. }
                                | crate::Error::Timeout { .. }
                                | crate::Error::Aborted { .. }
                                | crate::Error::PeerClosed { .. }
                        ),
                        "rank {r}: {e}"
                    );
                    assert_eq!(st.in_flight.load(Ordering::SeqCst), 0);
                });
            }
        });
    }

    #[test]
    fn lengths_that_are_not_whole_elements_are_refused() {
        let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process()).unwrap();
        let mut st = HostStaging::new(vec![0u8; 10], None, 256, 0);
        let e = collective(
            &ctx,
            &mut st,
            Op::Allreduce(Reduction::Sum),
            DType::F32,
            10,
            &CollectiveOptions::default(),
            None,
        )
        .expect_err("10 bytes of f32");
        assert!(e.to_string().contains("not whole"), "{e}");
    }
}
