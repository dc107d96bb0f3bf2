//! The collectives of a [`Context`].
//!
//! Every collective must be called by every rank of the context, with the same arguments where
//! they must agree (counts, root, reduction, element type), and in the same order for one tag.
//! Ranks that disagree get [`Error::Mismatch`] (or [`Error::Timeout`] at the deadline) instead
//! of corrupted data. All take [`CollectiveOptions`] in their `_with` form.
//!
//! Costs are per rank, for n ranks, S bytes of buffer, α the per-message latency and β the
//! time per byte.

use crate::algorithms::{
    self, Algorithm, CollectiveOptions, OpCode, Seg, allgather, allreduce, barrier, blocks_of, broadcast, check_counts,
    counts_hash, meta, partition, personalized, reduce,
};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::types::{Element, ReduceOp};

/// `Auto` allreduce uses recursive doubling (fewest steps, but S·log₂p bytes per rank against
/// halving-doubling's 2S(p-1)/p) while S·log₂p stays below this many bytes. Measured with
/// `ferrogloo-bench --algorithm rd,hd` (2-core machine, f32): with 2 ranks recursive doubling
/// is much faster at 4 KiB (12 vs 33 µs) and they tie from 128 KiB; with 4 ranks recursive
/// doubling wins at 32 KiB (64-90 vs 85-142 µs) and loses from 64 KiB (median of eight
/// alternating runs: 64 KiB 149 vs 118 µs, 128 KiB 203 vs 164 µs).
pub(crate) const ALLREDUCE_DOUBLING_BELOW: usize = 128 << 10;
/// Up to this many bytes, `Auto` allreduce uses halving-doubling (fewer steps); above it, the
/// ring (pipelined). Measured with `examples/algorithms` on a 2-core machine over loopback
/// (f32, median of 10-30 calls): with 4 ranks halving-doubling is 15-35% faster at 1-4 MiB and
/// the ring 10-20% faster from 8 MiB; with 2 ranks they tie at 16 MiB.
pub(crate) const ALLREDUCE_RING_ABOVE: usize = 4 << 20;
/// Up to this many bytes of output, `Auto` allgather uses recursive doubling when the world size
/// is a power of two; the ring otherwise.
pub(crate) const ALLGATHER_DOUBLING_UPTO: usize = 4 << 20;
/// Up to this many bytes, `Auto` broadcast uses the binomial tree; above it, the pipeline.
/// Same measurement: the tree wins up to 4 MiB with 3 and 4 ranks, the pipeline from 8 MiB.
pub(crate) const BROADCAST_PIPELINE_ABOVE: usize = 4 << 20;

fn bytes_of<T>(n: usize) -> usize {
    n.saturating_mul(std::mem::size_of::<T>())
}

impl Context {
    /// Barrier with options (a tag, so barriers of different tags run independently, and a
    /// deadline). Dissemination: ⌈log₂ n⌉ rounds of one empty message each way.
    pub fn barrier_with(&self, opts: &CollectiveOptions) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        let m = meta(OpCode::Barrier, 0, &[]);
        algorithms::run(self, "barrier", m, opts, barrier::dissemination)
    }

    /// Reduces `buf` element-wise across all ranks, in place: afterwards every rank's `buf`
    /// holds the same, bitwise identical, result.
    ///
    /// Algorithms ([`CollectiveOptions::algorithm`]):
    /// - `Ring`: reduce-scatter then allgather around the ring, pipelined in segments
    ///   (`segment_bytes`, default 1 MiB) so reducing one segment overlaps moving the next.
    ///   2(n-1) steps; sends and receives 2(n-1)/n·S bytes: time ≈ 2(n-1)α + 2(n-1)/n·Sβ.
    /// - `HalvingDoubling`: recursive halving then doubling; any n (the 2(n-p) extra ranks
    ///   beyond the largest power of two p fold into a neighbour first). 2·log₂p (+2) steps;
    ///   2(p-1)/p·S bytes (+S for folded ranks).
    /// - `RecursiveDoubling`: whole-buffer exchanges with partners 2^k away, both folding in
    ///   rank order. log₂p (+2) steps; S·log₂p bytes.
    /// - `Auto` (default): recursive doubling while S·log₂p < 128 KiB (S < 128 KiB for 2 and 3
    ///   ranks, < 64 KiB for 4 to 7), halving-doubling up to 4 MiB, the ring above.
    ///
    /// Constraints: every rank passes the same length, element type and reduction. Zero-length
    /// buffers are allowed.
    ///
    /// ```
    /// # use ferrogloo::{Context, ReduceOp, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::loopback()?)?;
    /// let mut grads = vec![1.0f32; 1024];
    /// ctx.allreduce(&mut grads, ReduceOp::Sum)?;
    /// assert!(grads.iter().all(|&g| g == ctx.size() as f32));
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp<T>) -> Result<()> {
        self.allreduce_with(buf, &op, &CollectiveOptions::default())
    }

    /// [`allreduce`](Self::allreduce) with options.
    pub fn allreduce_with<T: Element>(&self, buf: &mut [T], op: &ReduceOp<T>, opts: &CollectiveOptions) -> Result<()> {
        let n = self.size();
        let bytes = bytes_of::<T>(buf.len());
        let log2p = n.ilog2() as usize;
        let algo = match opts.algorithm {
            Algorithm::Auto if bytes.saturating_mul(log2p) < ALLREDUCE_DOUBLING_BELOW => Algorithm::RecursiveDoubling,
            Algorithm::Auto if bytes <= ALLREDUCE_RING_ABOVE => Algorithm::HalvingDoubling,
            Algorithm::Auto => Algorithm::Ring,
            a @ (Algorithm::Ring | Algorithm::HalvingDoubling | Algorithm::RecursiveDoubling) => a,
            a => return Err(Error::invalid(format!("allreduce does not support the {a:?} algorithm"))),
        };
        if n == 1 {
            return Ok(());
        }
        let seg = opts.segment_elems::<T>();
        let m = meta(OpCode::Allreduce, T::DTYPE as u8, &[buf.len() as u64, op.code(), algo as u64]);
        let buf = Seg::new(buf);
        algorithms::run(self, "allreduce", m, opts, |c| match algo {
            Algorithm::Ring => allreduce::ring(c, buf, op, seg),
            Algorithm::RecursiveDoubling => allreduce::recursive_doubling(c, buf, op),
            _ => allreduce::halving_doubling(c, buf, op),
        })
    }

    /// Allreduce of several input buffers per rank into several outputs (Gloo's `inputs` and
    /// `outputs`): the inputs are reduced locally first, then across ranks, and every output
    /// receives the result. With one input and one output this is an out-of-place allreduce.
    ///
    /// Cost: (k-1)·S local reduction for k inputs, one allreduce, and a copy per extra output.
    /// Constraints: at least one input and one output, all of the same length.
    pub fn allreduce_multi<T: Element>(
        &self,
        inputs: &[&[T]],
        outputs: &mut [&mut [T]],
        op: &ReduceOp<T>,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let (Some(first_in), Some(len)) = (inputs.first(), outputs.first().map(|o| o.len())) else {
            return Err(Error::invalid("allreduce_multi needs at least one input and one output"));
        };
        if inputs.iter().any(|i| i.len() != len) || outputs.iter().any(|o| o.len() != len) {
            return Err(Error::invalid("allreduce_multi: every input and output must have the same length"));
        }
        let (head, rest) = outputs.split_at_mut(1);
        let acc = &mut *head[0];
        acc.copy_from_slice(first_in);
        for i in &inputs[1..] {
            op.apply(acc, i);
        }
        self.allreduce_with(acc, op, opts)?;
        for o in rest {
            o.copy_from_slice(acc);
        }
        Ok(())
    }

    /// Reduces `input` across ranks and leaves block `rank` of the result in `output`: with
    /// equal blocks, `input.len() == n * output.len()`.
    ///
    /// Algorithm: pipelined ring reduce-scatter. n-1 steps; sends and receives (n-1)/n of the
    /// input: time ≈ (n-1)α + (n-1)/n·Sβ.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: &ReduceOp<T>,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let counts = vec![output.len(); self.size()];
        self.reduce_scatterv(input, output, &counts, op, opts)
    }

    /// Reduce-scatter with per-rank block sizes: rank i gets `counts[i]` elements, the blocks
    /// laid out in rank order. `input.len()` must be the sum of `counts`, and
    /// `output.len() == counts[rank]`. Same algorithm and cost as
    /// [`reduce_scatter`](Self::reduce_scatter).
    pub fn reduce_scatterv<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: &ReduceOp<T>,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let n = self.size();
        let total = check_counts(counts, n, "reduce_scatter")?;
        if input.len() != total || output.len() != counts[self.rank()] {
            return Err(Error::invalid(format!(
                "reduce_scatter: input has {} elements and output {}, counts need {total} and {}",
                input.len(),
                output.len(),
                counts[self.rank()]
            )));
        }
        if n == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let seg = opts.segment_elems::<T>();
        let m = meta(OpCode::ReduceScatter, T::DTYPE as u8, &[counts_hash(counts), op.code()]);
        let blocks = blocks_of(counts);
        algorithms::run(self, "reduce_scatter", m, opts, |c| {
            // `input` is only read: each received segment is reduced into a copy of this
            // rank's part made just before (in the context's scratch pool, reused from call
            // to call), and this rank's own block straight into `output`.
            let bufs = allreduce::RingBufs {
                input: Seg::of(input),
                // (With two ranks the only block received is this rank's own.)
                work: c.scratch::<T>(if n > 2 { total } else { 0 }),
                last: Some(Seg::new(output)),
            };
            allreduce::ring_reduce_scatter(c, bufs, &blocks, op, n - 1, seg)
        })
    }

    /// Every rank's `input` is concatenated in rank order into every rank's `output`
    /// (`output.len() == n * input.len()`).
    ///
    /// Algorithms (both send and receive (n-1)/n of the S output bytes):
    /// - `Ring`: pipelined in segments; n-1 steps: time ≈ (n-1)α + (n-1)/n·Sβ.
    /// - `RecursiveDoubling`: swaps of 1, 2, 4… blocks with the rank 1, 2, 4… away; log₂n steps.
    ///   Power-of-two world sizes only (others run the ring).
    /// - `Auto` (default): recursive doubling up to 4 MiB of output when n is a power of two,
    ///   the ring otherwise.
    ///
    /// ```
    /// # use ferrogloo::{Context, device::Device, rendezvous::HashStore, algorithms::CollectiveOptions};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::loopback()?)?;
    /// let mine = [ctx.rank() as u32; 2];
    /// let mut all = vec![0u32; 2 * ctx.size()];
    /// ctx.allgather(&mine, &mut all, &CollectiveOptions::default())?;
    /// assert_eq!(all[2 * ctx.rank()], ctx.rank() as u32);
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn allgather<T: Element>(&self, input: &[T], output: &mut [T], opts: &CollectiveOptions) -> Result<()> {
        let counts = vec![input.len(); self.size()];
        self.allgatherv(input, output, &counts, opts)
    }

    /// Allgather with per-rank sizes: rank i contributes `counts[i]` elements (its `input`),
    /// concatenated in rank order into `output` (the sum of `counts`). Same algorithm and cost
    /// as [`allgather`](Self::allgather).
    pub fn allgatherv<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let n = self.size();
        let total = check_counts(counts, n, "allgather")?;
        if output.len() != total || input.len() != counts[self.rank()] {
            return Err(Error::invalid(format!(
                "allgather: input has {} elements and output {}, counts need {} and {total}",
                input.len(),
                output.len(),
                counts[self.rank()]
            )));
        }
        let seg = opts.segment_elems::<T>();
        let blocks = blocks_of(counts);
        if n == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let doubling = match opts.algorithm {
            Algorithm::Auto => n.is_power_of_two() && bytes_of::<T>(total) <= ALLGATHER_DOUBLING_UPTO,
            Algorithm::Ring => false,
            Algorithm::RecursiveDoubling => n.is_power_of_two(),
            a => return Err(Error::invalid(format!("allgather does not support the {a:?} algorithm"))),
        };
        let m = meta(OpCode::Allgather, T::DTYPE as u8, &[counts_hash(counts), u64::from(doubling)]);
        let out = Seg::new(output);
        algorithms::run(self, "allgather", m, opts, |c| {
            if doubling {
                allgather::recursive_doubling(c, input, out, &blocks)
            } else {
                allgather::ring(c, input, out, &blocks, seg)
            }
        })
    }

    /// Copies `buf` from rank `root` into every other rank's `buf`.
    ///
    /// Algorithms:
    /// - `BinomialTree`: ⌈log₂ n⌉ steps; time ≈ ⌈log₂ n⌉(α + Sβ).
    /// - `Pipeline`: a chain from the root, in segments of `segment_bytes`: time ≈
    ///   (n-2+S/segment)(α + segment·β); every rank sends S bytes once.
    /// - `Auto` (default): the tree up to 4 MiB, the pipeline above.
    ///
    /// Constraints: the same `root` and length on every rank; `root < n`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize, opts: &CollectiveOptions) -> Result<()> {
        let n = self.size();
        check_root(root, n, "broadcast")?;
        let algo = match opts.algorithm {
            Algorithm::Auto if bytes_of::<T>(buf.len()) <= BROADCAST_PIPELINE_ABOVE => Algorithm::BinomialTree,
            Algorithm::Auto => Algorithm::Pipeline,
            a @ (Algorithm::BinomialTree | Algorithm::Pipeline) => a,
            a => return Err(Error::invalid(format!("broadcast does not support the {a:?} algorithm"))),
        };
        if n == 1 {
            return Ok(());
        }
        let seg = opts.segment_elems::<T>();
        let m = meta(OpCode::Broadcast, T::DTYPE as u8, &[buf.len() as u64, root as u64, algo as u64]);
        let b = Seg::new(buf);
        algorithms::run(self, "broadcast", m, opts, |c| match algo {
            Algorithm::Pipeline => broadcast::pipeline(c, b, root, seg),
            _ => broadcast::tree(c, b, root),
        })
    }

    /// Reduces `buf` element-wise across ranks into rank `root`'s `buf`; other ranks' buffers
    /// are left unchanged.
    ///
    /// Algorithm: binomial tree. ⌈log₂ n⌉ steps; an inner node receives one buffer per child:
    /// time ≈ ⌈log₂ n⌉(α + Sβ) plus the reductions.
    pub fn reduce<T: Element>(
        &self,
        buf: &mut [T],
        root: usize,
        op: &ReduceOp<T>,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let n = self.size();
        check_root(root, n, "reduce")?;
        if n == 1 {
            return Ok(());
        }
        let m = meta(OpCode::Reduce, T::DTYPE as u8, &[buf.len() as u64, root as u64, op.code()]);
        let b = Seg::new(buf);
        algorithms::run(self, "reduce", m, opts, |c| reduce::tree(c, b, root, op))
    }

    /// Rank `root` receives every rank's `input`, concatenated in rank order, in `output`
    /// (`n * input.len()` elements); other ranks ignore `output` (pass `&mut []`).
    ///
    /// Algorithm: direct. One step; the root receives (n-1)/n of the output, others send S.
    pub fn gather<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let counts = vec![input.len(); self.size()];
        self.gatherv(input, output, &counts, root, opts)
    }

    /// Gather with per-rank sizes: rank i sends `counts[i]` elements; the root's `output`
    /// holds their sum. Same algorithm and cost as [`gather`](Self::gather).
    pub fn gatherv<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        root: usize,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let n = self.size();
        check_root(root, n, "gather")?;
        let total = check_counts(counts, n, "gather")?;
        if input.len() != counts[self.rank()] || (self.rank() == root && output.len() != total) {
            return Err(Error::invalid(format!(
                "gather: input has {} elements (counts say {}); the root's output must hold {total}",
                input.len(),
                counts[self.rank()]
            )));
        }
        let blocks = blocks_of(counts);
        if n == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let m = meta(OpCode::Gather, T::DTYPE as u8, &[counts_hash(counts), root as u64]);
        let out = Seg::new(output);
        algorithms::run(self, "gather", m, opts, |c| personalized::gather(c, input, out, &blocks, root))
    }

    /// Rank `root` sends block i of its `input` (`n * output.len()` elements) to rank i, which
    /// receives it in `output`; other ranks ignore `input` (pass `&[]`).
    ///
    /// Algorithm: direct. One step; the root sends (n-1)/n of its input, others receive once.
    pub fn scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let n = self.size();
        check_root(root, n, "scatter")?;
        if self.rank() == root && input.len() != n * output.len() {
            return Err(Error::invalid(format!(
                "scatter: the root's input has {} elements, expected {n} x {}",
                input.len(),
                output.len()
            )));
        }
        let blocks = partition(output.len() * n, n);
        if n == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let m = meta(OpCode::Scatter, T::DTYPE as u8, &[output.len() as u64, root as u64]);
        let inp = Seg::of(input);
        algorithms::run(self, "scatter", m, opts, |c| personalized::scatter(c, inp, output, &blocks, root))
    }

    /// Rank i's block p of `input` goes to block i of rank p's `output`; equal blocks:
    /// `input.len() == output.len()`, a multiple of n.
    ///
    /// Algorithm: direct, all pairs at once. n-1 messages each way per rank, (n-1)/n·S bytes.
    pub fn alltoall<T: Element>(&self, input: &[T], output: &mut [T], opts: &CollectiveOptions) -> Result<()> {
        let n = self.size();
        if input.len() != output.len() || !input.len().is_multiple_of(n) {
            return Err(Error::invalid(format!(
                "alltoall: input ({}) and output ({}) must be equal and a multiple of {n}",
                input.len(),
                output.len()
            )));
        }
        let counts = vec![input.len() / n; n];
        self.alltoallv(input, &counts, output, &counts, opts)
    }

    /// All-to-all with per-peer sizes: this rank sends `send_counts[p]` elements (the p-th run
    /// of `input`) to rank p and receives `recv_counts[p]` elements from rank p into the p-th
    /// run of `output`. Each pair must agree: `send_counts[p]` here equals rank p's
    /// `recv_counts[rank]` (a disagreement is [`Error::Mismatch`]). Same algorithm and cost as
    /// [`alltoall`](Self::alltoall).
    pub fn alltoallv<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let n = self.size();
        let sent = check_counts(send_counts, n, "alltoall send")?;
        let recvd = check_counts(recv_counts, n, "alltoall receive")?;
        if input.len() != sent || output.len() != recvd {
            return Err(Error::invalid(format!(
                "alltoall: input {} / output {} elements, counts need {sent} / {recvd}",
                input.len(),
                output.len()
            )));
        }
        let r = self.rank();
        if send_counts[r] != recv_counts[r] {
            return Err(Error::invalid("alltoall: this rank's send and receive counts for itself differ"));
        }
        let (sb, rb) = (blocks_of(send_counts), blocks_of(recv_counts));
        let m = meta(OpCode::Alltoall, T::DTYPE as u8, &[]);
        let (inp, out) = (Seg::of(input), Seg::new(output));
        if n == 1 {
            output_copy(inp, out);
            return Ok(());
        }
        algorithms::run(self, "alltoall", m, opts, |c| personalized::alltoall(c, inp, &sb, out, &rb))
    }
}

fn output_copy<T: Copy>(inp: Seg<T>, out: Seg<T>) {
    // SAFETY: no operation is pending; `out` is exclusively borrowed by the caller.
    unsafe { out.get_mut().copy_from_slice(inp.get()) }
}

fn check_root(root: usize, n: usize, what: &str) -> Result<()> {
    if root >= n {
        return Err(Error::invalid(format!("{what}: root {root} is out of range for size {n}")));
    }
    Ok(())
}
