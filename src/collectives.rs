//! The collectives of a [`Context`].
//!
//! Every collective must be called by every rank of the context, with the same arguments where
//! they must agree (counts, root, reduction, element type), and in the same order for one tag.
//! Ranks that disagree get [`Error::Mismatch`] (or [`Error::Timeout`] at the deadline) instead
//! of corrupted data. Every call takes [`CollectiveOptions`] (tag, deadline, algorithm, segment
//! size), except `allreduce` and `barrier`, whose `_with` forms take them.
//!
//! Each typed call has a runtime-typed twin over bytes and a [`DType`](crate::DType) (`allreduce_bytes`, ...)
//! for engines and bindings that learn the element type at run time.
//!
//! Costs are per rank, for n ranks, S bytes of buffer, α the per-message latency and β the
//! time per byte.

use crate::algorithms::{
    self, Algorithm, CollectiveOptions, allgather, allreduce, barrier, blocks_of, broadcast, check_counts, counts_hash,
    local, partition, personalized, reduce, steps,
};
use crate::comm::Comm;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::transport::LocalArea;
use crate::types::{BroadcastPath, Call, CopyPlan, Element, Fold, OpDesc, Reduction};
use std::sync::Arc;

mod bytes;
#[cfg(test)]
mod tests;

/// Up to this many bytes of output, `Auto` allgather uses recursive doubling when the world size
/// is a power of two; the ring otherwise.
pub(crate) const ALLGATHER_DOUBLING_UPTO: usize = 4 << 20;
/// Up to this many bytes, `Auto` broadcast uses the binomial tree; above it, the pipeline.
/// Same measurement: the tree wins up to 4 MiB with 3 and 4 ranks, the pipeline from 8 MiB.
pub(crate) const BROADCAST_PIPELINE_ABOVE: usize = 4 << 20;

fn bytes_of<T>(n: usize) -> usize {
    n.saturating_mul(std::mem::size_of::<T>())
}

/// The algorithm an allreduce of `bytes` over the pairs of `comm` runs when asked for `asked`:
/// for `Auto`, the one the mesh's cost model predicts fastest.
fn allreduce_algorithm(comm: &Comm, bytes: usize, asked: Algorithm) -> Result<Algorithm> {
    Ok(match asked {
        Algorithm::Auto => match comm.cost_model() {
            Some(m) => m.allreduce_choice(comm.size(), bytes),
            None => Algorithm::RecursiveDoubling, // one rank: nothing to choose
        },
        a @ (Algorithm::Ring | Algorithm::HalvingDoubling | Algorithm::RecursiveDoubling) => a,
        a => return Err(Error::invalid(format!("allreduce does not support the {a} algorithm"))),
    })
}

/// The algorithm allgather runs for `bytes` of output on `n` ranks when asked for `asked`.
fn allgather_algorithm(n: usize, bytes: usize, asked: Algorithm) -> Result<Algorithm> {
    Ok(match asked {
        Algorithm::Auto if n.is_power_of_two() && bytes <= ALLGATHER_DOUBLING_UPTO => Algorithm::RecursiveDoubling,
        Algorithm::Auto | Algorithm::Ring => Algorithm::Ring,
        // Power-of-two world sizes only; others run the ring.
        Algorithm::RecursiveDoubling if n.is_power_of_two() => Algorithm::RecursiveDoubling,
        Algorithm::RecursiveDoubling => Algorithm::Ring,
        a => return Err(Error::invalid(format!("allgather does not support the {a} algorithm"))),
    })
}

/// The algorithm broadcast runs for `bytes` when asked for `asked`.
fn broadcast_algorithm(bytes: usize, asked: Algorithm) -> Result<Algorithm> {
    Ok(match asked {
        Algorithm::Auto if bytes <= BROADCAST_PIPELINE_ABOVE => Algorithm::BinomialTree,
        Algorithm::Auto => Algorithm::Pipeline,
        a @ (Algorithm::BinomialTree | Algorithm::Pipeline) => a,
        a => return Err(Error::invalid(format!("broadcast does not support the {a} algorithm"))),
    })
}

/// The error for [`Algorithm::SharedMemory`] asked where it cannot run.
fn no_area(what: &str) -> Error {
    Error::invalid(format!(
        "{what}: the shared-memory algorithm needs every rank of the context on this host, \
         connected through shared memory (a shared-memory or auto device), tag 0, and not a sub-group"
    ))
}

/// `asked` when it is not about shared memory; [`Algorithm::SharedMemory`] when `Auto` may
/// use `area`, or it was asked for and there is one; an error when it was asked for and there
/// is none.
/// (A context of one rank has nothing to share and needs no algorithm: any is fine.)
fn area_choice(
    area: Option<&Arc<dyn LocalArea>>,
    asked: Algorithm,
    what: &str,
    size: usize,
) -> Result<Option<Algorithm>> {
    match (asked, area) {
        (Algorithm::Auto | Algorithm::SharedMemory, Some(_)) => Ok(Some(Algorithm::SharedMemory)),
        (Algorithm::SharedMemory, None) if size == 1 => Ok(Some(Algorithm::SharedMemory)),
        (Algorithm::SharedMemory, None) => Err(no_area(what)),
        _ => Ok(None),
    }
}

impl Context {
    /// The shared area when every rank of the context is in it and a collective with `tag`
    /// may use it.
    pub(crate) fn whole_area(&self, tag: u32) -> Option<&Arc<dyn LocalArea>> {
        if tag != 0 {
            return None;
        }
        self.comm().local_area().filter(|a| a.members().len() == self.size())
    }

    /// Blocks until every rank has called `barrier` (dissemination barrier: ⌈log₂ N⌉ rounds of
    /// one empty message sent and one received per rank).
    pub fn barrier(&self) -> Result<()> {
        self.barrier_with(&CollectiveOptions::default())
    }

    /// Barrier with options (a tag, so barriers of different tags run independently, and a
    /// deadline). Dissemination: ⌈log₂ n⌉ rounds of one empty message each way.
    pub fn barrier_with(&self, opts: &CollectiveOptions) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        let area = self.whole_area(opts.tag);
        if let (Some(algo), Some(area)) = (area_choice(area, opts.algorithm, "barrier", self.size())?, area) {
            let desc = OpDesc::new(Call::Barrier).algo(algo);
            return local::run(self.comm(), &**area, "barrier", desc, opts, local::barrier);
        }
        let desc = OpDesc::new(Call::Barrier);
        algorithms::run(self.comm(), "barrier", desc, opts, barrier::dissemination)
    }

    /// The algorithm [`allreduce_with`](Self::allreduce_with) runs on this context for a
    /// buffer of `bytes` when `asked` for an algorithm: what `Auto` picks, or the one asked for
    /// (an error for one allreduce does not have).
    pub fn allreduce_algorithm(&self, bytes: usize, asked: Algorithm) -> Result<Algorithm> {
        let area = self.whole_area(0);
        if area.is_none() && self.hierarchy().is_some() && matches!(asked, Algorithm::Auto | Algorithm::SharedMemory) {
            return Ok(Algorithm::SharedMemory);
        }
        match area_choice(area, asked, "allreduce", self.size())? {
            Some(a) => Ok(a),
            None => allreduce_algorithm(self.comm(), bytes, asked),
        }
    }

    /// The cost model of this context's links, with which `Auto` chooses an allreduce
    /// algorithm (see [`crate::cost`]): `FERROGLOO_COST_MODEL`'s, or measured by every rank as
    /// the context formed (all hold the same). `None` when the context's mesh has one rank (a
    /// one-rank sub-group of a larger job has its job's model).
    pub fn cost_model(&self) -> Option<crate::cost::CostModel> {
        self.comm().cost_model()
    }

    /// How this rank's host copies in the collectives through its shared area (broadcast,
    /// allgather and allreduce; the host steps of the two-level allreduce): decided by the
    /// host's ranks together as the context formed, measured unless forced (see
    /// [`ShmCopy`](crate::device::ShmCopy)); every rank of the host holds the same. `None` when
    /// this rank shares no memory with another rank of the context, and for a sub-group
    /// ([`split`](Self::split), [`subgroup`](Self::subgroup)) or a context made by
    /// [`shrink`](Self::shrink): they run over the pairs, not the area.
    pub fn copy_plan(&self) -> Option<CopyPlan> {
        self.comm().local_area().map(|_| self.comm().copy_plan())
    }

    /// The time this context's [cost model](Self::cost_model) predicts for an allreduce of
    /// `bytes` with `algorithm` (for `Auto`, the one it picks). `None` where the model does not
    /// reach: the shared-memory algorithm of one host. The two-level allreduce is modelled as
    /// the leaders' allreduce over the context's links plus the steps within a host at this
    /// host's copy bandwidth (measured by this call).
    pub fn predicted_allreduce_time(&self, algorithm: Algorithm, bytes: usize) -> Result<Option<std::time::Duration>> {
        let n = self.size();
        let Some(model) = self.cost_model() else { return Ok(Some(std::time::Duration::ZERO)) };
        match self.allreduce_algorithm(bytes, algorithm)? {
            Algorithm::SharedMemory if self.hierarchy().is_some() => {
                let hosts = &self.comm().shared().hosts;
                let mut distinct = hosts.clone();
                distinct.sort();
                distinct.dedup();
                let per_host = hosts.iter().map(|h| hosts.iter().filter(|x| *x == h).count()).max().unwrap_or(1);
                let local = crate::cost::memory_model(model.reduce_bytes_per_s)?;
                Ok(Some(model.hierarchical_allreduce_time(&local, distinct.len(), per_host, bytes)))
            }
            Algorithm::SharedMemory => Ok(None),
            a => Ok(model.allreduce_time(a, n, bytes)),
        }
    }

    /// The algorithm [`allgather`](Self::allgather) runs on this context for `bytes` of output
    /// when `asked` for an algorithm.
    pub fn allgather_algorithm(&self, bytes: usize, asked: Algorithm) -> Result<Algorithm> {
        match area_choice(self.whole_area(0), asked, "allgather", self.size())? {
            Some(a) => Ok(a),
            None => allgather_algorithm(self.size(), bytes, asked),
        }
    }

    /// The algorithm [`broadcast`](Self::broadcast) runs for a buffer of `bytes` when `asked`
    /// for an algorithm.
    pub fn broadcast_algorithm(&self, bytes: usize, asked: Algorithm) -> Result<Algorithm> {
        match area_choice(self.whole_area(0), asked, "broadcast", self.size())? {
            Some(a) => Ok(a),
            None => broadcast_algorithm(bytes, asked),
        }
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
    /// - `Auto` (default): the one the context's [cost model](Self::cost_model) predicts
    ///   fastest for S and n (measured as the context formed; see [`crate::cost`]). On one host with
    ///   every rank in shared memory, the shared-memory algorithm; over several hosts whose
    ///   ranks share memory within each, the two-level allreduce.
    ///
    /// Constraints: every rank passes the same length, element type and reduction. Zero-length
    /// buffers are allowed.
    ///
    /// ```
    /// # use ferrogloo::{Context, Reduction, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::loopback()?)?;
    /// let mut grads = vec![1.0f32; 1024];
    /// ctx.allreduce(&mut grads, Reduction::Sum)?;
    /// assert!(grads.iter().all(|&g| g == ctx.size() as f32));
    /// ctx.allreduce(&mut grads, Reduction::Average)?;
    /// assert!(grads.iter().all(|&g| g == ctx.size() as f32));
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    ///
    /// [`Reduction::Average`] sums, then scales every rank's result by 1 / [`size`](Self::size)
    /// (floating-point types only: an integer type is [`Error::InvalidArgument`] on every rank
    /// before anything is sent).
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: Reduction) -> Result<()> {
        self.allreduce_with(buf, op, &CollectiveOptions::default())
    }

    /// [`allreduce`](Self::allreduce) with options.
    pub fn allreduce_with<T: Element>(&self, buf: &mut [T], op: Reduction, opts: &CollectiveOptions) -> Result<()> {
        op.check(T::DTYPE)?;
        self.allreduce_fold(buf, &Fold::Builtin(op), opts, 0)?;
        finish(op, buf, self.size())
    }

    /// [`allreduce_with`](Self::allreduce_with) with a fold of your own: `fold(acc, other)`
    /// folds `other` into `acc` element-wise. It must give the same result on every rank for the
    /// same inputs, and every rank must pass the same fold (ranks check only that each passed a
    /// fold of its own, not which).
    ///
    /// ```
    /// # use ferrogloo::{Context, CollectiveOptions, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
    /// // The largest magnitude, keeping its sign.
    /// let mut x = vec![-3.0f32, 2.0];
    /// let by_magnitude = |acc: &mut [f32], other: &[f32]| {
    ///     acc.iter_mut().zip(other).for_each(|(a, b)| if b.abs() > a.abs() { *a = *b });
    /// };
    /// ctx.allreduce_custom(&mut x, &by_magnitude, &CollectiveOptions::default())?;
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn allreduce_custom<T: Element>(
        &self,
        buf: &mut [T],
        fold: &(dyn Fn(&mut [T], &[T]) + Send + Sync),
        opts: &CollectiveOptions,
    ) -> Result<()> {
        self.allreduce_fold(buf, &Fold::Custom(fold), opts, 0)
    }

    /// Allreduce of several buffers as one: the same result as an allreduce of their
    /// concatenation, in place in each buffer, without a buffer for the concatenation. Every
    /// rank must pass buffers of the same total length (how it is split may differ). What a
    /// fused batch of tensors needs (the engine's fusion uses it).
    ///
    /// ```
    /// # use ferrogloo::{Context, CollectiveOptions, Reduction, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
    /// let (mut weights, mut bias) = (vec![1.0f32; 1000], vec![2.0f32; 10]);
    /// ctx.allreduce_many(&mut [&mut weights[..], &mut bias[..]], Reduction::Sum, &CollectiveOptions::default())?;
    /// assert_eq!(bias[0], 2.0 * ctx.size() as f32);
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    ///
    /// Through the host's shared area (every rank of the context on one host, tag 0, `Auto` or
    /// `SharedMemory`) the buffers take the path one buffer of the same total would take (the
    /// [copy plan](Self::copy_plan)): copied straight into the area and the results straight
    /// out of it, or read straight from the other ranks' buffers (single copies), so a rank
    /// calling this and another calling [`allreduce_with`](Self::allreduce_with) on a buffer
    /// of the same total agree. Over the pairs (the ring, halving-doubling, recursive
    /// doubling, the two-level allreduce) they are packed into one buffer first and unpacked
    /// after: a copy in and one out (where every rank cuts the whole alike,
    /// [`allreduce_many_alike`](Self::allreduce_many_alike) runs the ring on the buffers
    /// themselves).
    pub fn allreduce_many<T: Element>(
        &self,
        bufs: &mut [&mut [T]],
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        self.allreduce_parts(bufs, op, opts, false)
    }

    /// [`allreduce_many`](Self::allreduce_many) of buffers that every rank cuts alike: the
    /// same number of buffers, of the same lengths, in the same order (a model's gradients).
    /// Over the pairs, where the ring is the algorithm, the ring runs on the buffers
    /// themselves: its segments are also cut where a buffer ends, and each is sent from a
    /// buffer and received or reduced straight into one, with no copy in or out. Buffers so
    /// small that, by the [cost model](Self::cost_model), the messages their ends add cost
    /// more than copying them (a bias of a few KiB on a link of tens of µs) are copied into
    /// one buffer together and out again. Otherwise as `allreduce_many`. A rank that cuts
    /// differently is an [`Error::Mismatch`] on every rank (a hash of the lengths is compared
    /// with the call), not a wrong result; a rank that calls `allreduce_many` instead may be
    /// one too.
    ///
    /// ```
    /// # use ferrogloo::{Context, CollectiveOptions, Reduction, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
    /// let (mut conv, mut bias) = (vec![0.5f32; 4096], vec![1.0f32; 64]);
    /// ctx.allreduce_many_alike(&mut [&mut conv[..], &mut bias[..]], Reduction::Sum, &CollectiveOptions::default())?;
    /// assert_eq!(conv[0], 0.5 * ctx.size() as f32);
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn allreduce_many_alike<T: Element>(
        &self,
        bufs: &mut [&mut [T]],
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        self.allreduce_parts(bufs, op, opts, true)
    }

    /// [`allreduce_many`](Self::allreduce_many), or with `alike`
    /// [`allreduce_many_alike`](Self::allreduce_many_alike).
    pub(crate) fn allreduce_parts<T: Element>(
        &self,
        bufs: &mut [&mut [T]],
        op: Reduction,
        opts: &CollectiveOptions,
        alike: bool,
    ) -> Result<()> {
        op.check(T::DTYPE)?;
        let fold = Fold::Builtin(op);
        if self.size() == 1 {
            // Nothing to reduce; the options are checked as an allreduce's are.
            return self.allreduce_fold(&mut [], &fold, opts, 0);
        }
        let area = self.whole_area(opts.tag);
        // Over several hosts `Auto` and `SharedMemory` mean the two-level allreduce, which
        // takes the packed path as the pair algorithms do.
        let hier = self.hierarchy().filter(|_| opts.tag == 0 && area.is_none());
        let shm = match hier {
            Some(_) => None,
            None => area_choice(area, opts.algorithm, "allreduce", self.size())?,
        };
        let total = bufs.iter().map(|b| b.len()).sum::<usize>();
        let ring = match (alike, shm, hier) {
            (true, None, None) => {
                allreduce_algorithm(self.comm(), bytes_of::<T>(total), opts.algorithm)? == Algorithm::Ring
            }
            _ => false,
        };
        if ring {
            let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
            let desc = OpDesc::new(Call::Allreduce)
                .dtype(T::DTYPE)
                .count(total)
                .reduce(fold.code())
                .algo(Algorithm::Ring)
                .extra(counts_hash(&lens));
            let seg = opts.segment_elems::<T>();
            // Buffers so small that the messages their ends would add cost more than copying
            // them go together in one buffer of their own, after the others (every rank
            // sorts them alike: the same lengths, the same model).
            let model = self.comm().cost_model();
            let small = |b: &[T]| !b.is_empty() && model.is_some_and(|m| m.packs_for_the_ring(bytes_of::<T>(b.len())));
            let mut packed: Vec<T> = bufs.iter().filter(|b| small(b)).flat_map(|b| b.iter().copied()).collect();
            let mut runs: Vec<&mut [T]> = bufs.iter_mut().filter(|b| !small(b)).map(|b| &mut **b).collect();
            runs.push(&mut packed);
            algorithms::run(self.comm(), "allreduce", desc, opts, |c| allreduce::ring_parts(c, &mut runs, &fold, seg))?;
            drop(runs);
            let mut at = 0;
            for b in bufs.iter_mut().filter(|b| small(b)) {
                b.copy_from_slice(&packed[at..at + b.len()]);
                at += b.len();
            }
            for b in bufs.iter_mut() {
                finish(op, b, self.size())?;
            }
            return Ok(());
        }
        let mut parts = local::Parts::new(bufs);
        match (shm, area) {
            (Some(_), Some(area)) => {
                // The copy path of one buffer of the same size: a rank calling this and one
                // calling `allreduce_with` agree.
                let single = self.comm().copy_plan().allreduce.contains(bytes_of::<T>(total));
                let desc = OpDesc::new(Call::Allreduce)
                    .dtype(T::DTYPE)
                    .count(total)
                    .reduce(fold.code())
                    .algo(Algorithm::SharedMemory)
                    .single_copy(single);
                local::run(self.comm(), &**area, "allreduce", desc, opts, |l| match single {
                    true => local::allreduce_single_parts(l, &mut parts, &fold),
                    false => local::allreduce_parts(l, &mut parts, &fold),
                })?;
            }
            _ => {
                let mut whole = parts.to_vec();
                self.allreduce_fold(&mut whole, &fold, opts, 0)?;
                parts.scatter(0..total, &whole);
            }
        }
        for b in bufs.iter_mut() {
            finish(op, b, self.size())?;
        }
        Ok(())
    }

    /// The allreduce of every typed call; `extra` goes in the call's descriptor for the ranks to
    /// compare (what else must agree, e.g. allreduce_multi's number of inputs for an average).
    fn allreduce_fold<T: Element>(
        &self,
        buf: &mut [T],
        op: &Fold<'_, T>,
        opts: &CollectiveOptions,
        extra: u64,
    ) -> Result<()> {
        let n = self.size();
        let area = self.whole_area(opts.tag);
        let hier = self.hierarchy().filter(|_| opts.tag == 0 && area.is_none());
        let shm = match hier {
            Some(_) if matches!(opts.algorithm, Algorithm::Auto | Algorithm::SharedMemory) => {
                Some(Algorithm::SharedMemory)
            }
            _ => area_choice(area, opts.algorithm, "allreduce", self.size())?,
        };
        let algo = match shm {
            Some(a) => a,
            None => allreduce_algorithm(self.comm(), bytes_of::<T>(buf.len()), opts.algorithm)?,
        };
        if n == 1 {
            return Ok(());
        }
        let single =
            shm.is_some() && area.is_some() && self.comm().copy_plan().allreduce.contains(bytes_of::<T>(buf.len()));
        let desc = OpDesc::new(Call::Allreduce)
            .dtype(T::DTYPE)
            .count(buf.len())
            .reduce(op.code())
            .algo(algo)
            .single_copy(single)
            .extra(extra);
        if let (Some(_), Some(area)) = (shm, area) {
            return local::run(self.comm(), &**area, "allreduce", desc, opts, |l| match single {
                true => local::allreduce_single(l, buf, op),
                false => local::allreduce(l, buf, op),
            });
        }
        if let (Some(_), Some(h)) = (shm, hier) {
            return self.hierarchical_allreduce(h.leaders.as_ref(), buf, op, desc, opts);
        }
        let seg = opts.segment_elems::<T>();
        algorithms::run(self.comm(), "allreduce", desc, opts, |c| match algo {
            Algorithm::Ring => allreduce::ring(c, buf, op, seg),
            Algorithm::RecursiveDoubling => allreduce::recursive_doubling(c, buf, op),
            _ => allreduce::halving_doubling(c, buf, op),
        })
    }

    /// Allreduce over several hosts: within each host through shared memory (every rank gets
    /// the host's sum), across hosts among the host leaders (the lowest rank of each) over
    /// their pairs, then from each leader to its host through shared memory again. Every rank
    /// ends with its leader's result, so all agree bit for bit.
    fn hierarchical_allreduce<T: Element>(
        &self,
        leaders: Option<&crate::comm::Comm>,
        buf: &mut [T],
        op: &Fold<'_, T>,
        desc: OpDesc,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let comm = self.comm();
        comm.check_usable()?;
        let timeout = opts.timeout.unwrap_or(comm.timeout());
        let deadline = std::time::Instant::now() + timeout;
        let area = comm.local_area();
        // The host steps' copy path is this host's (the leaders' call has its own descriptor).
        let (plan, bytes) = (comm.copy_plan(), bytes_of::<T>(buf.len()));
        let single = area.is_some() && plan.allreduce.contains(bytes);
        let broadcast_path = match area {
            Some(_) => plan.broadcast_path(bytes),
            None => BroadcastPath::Two,
        };
        let desc = desc.single_copy(single);
        let mut local =
            area.map(|a| steps::Local::new(comm, &**a, "allreduce", desc, deadline, timeout)).transpose()?;
        comm.next_collective_key(opts.tag)?;
        let result = (|| {
            if let Some(l) = &mut local {
                match single {
                    true => local::allreduce_single(l, buf, op)?,
                    false => local::allreduce(l, buf, op)?,
                }
            }
            if let Some(lc) = leaders {
                let algo = allreduce_algorithm(lc, bytes_of::<T>(buf.len()), Algorithm::Auto)?;
                let cross = OpDesc::new(Call::Allreduce)
                    .dtype(T::DTYPE)
                    .count(buf.len())
                    .reduce(op.code())
                    .algo(algo)
                    .extra(desc.extra);
                let o = CollectiveOptions {
                    timeout: Some(deadline.saturating_duration_since(std::time::Instant::now())),
                    algorithm: algo,
                    ..opts.clone()
                };
                let seg = o.segment_elems::<T>();
                let b = &mut *buf;
                algorithms::run(lc, "allreduce across hosts", cross, &o, |c| match algo {
                    Algorithm::Ring => allreduce::ring(c, b, op, seg),
                    Algorithm::RecursiveDoubling => allreduce::recursive_doubling(c, b, op),
                    _ => allreduce::halving_doubling(c, b, op),
                })?;
            }
            if let Some(l) = &mut local {
                match broadcast_path {
                    BroadcastPath::Two => local::broadcast(l, buf, 0)?,
                    p => local::broadcast_single(l, buf, 0, p == BroadcastPath::Split)?,
                }
            }
            Ok(())
        })();
        if let Err(e) = &result {
            comm.fail(e);
        }
        result
    }

    /// Allreduce of several input buffers per rank into several outputs (Gloo's `inputs` and
    /// `outputs`): the inputs are reduced locally first, then across ranks, and every output
    /// receives the result. With one input and one output this is an out-of-place allreduce.
    ///
    /// Cost: (k-1)·S local reduction for k inputs, one allreduce, and a copy per extra output.
    /// Constraints: at least one input and one output, all of the same length.
    /// [`Reduction::Average`] is the mean of every input of every rank (the sum scaled by
    /// 1 / (k · [`size`](Self::size))).
    pub fn allreduce_multi<T: Element>(
        &self,
        inputs: &[&[T]],
        outputs: &mut [&mut [T]],
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        op.check(T::DTYPE)?;
        let (Some(first_in), Some(len)) = (inputs.first(), outputs.first().map(|o| o.len())) else {
            return Err(Error::invalid("allreduce_multi needs at least one input and one output"));
        };
        if inputs.iter().any(|i| i.len() != len) || outputs.iter().any(|o| o.len() != len) {
            return Err(Error::invalid("allreduce_multi: every input and output must have the same length"));
        }
        let (head, rest) = outputs.split_at_mut(1);
        let acc = &mut *head[0];
        acc.copy_from_slice(first_in);
        let fold = Fold::Builtin(op);
        for i in &inputs[1..] {
            fold.apply(acc, i);
        }
        // An average divides by every rank's number of inputs: the ranks check they agree on it.
        let k = if op == Reduction::Average { inputs.len() as u64 } else { 0 };
        self.allreduce_fold(acc, &fold, opts, k)?;
        finish(op, acc, inputs.len() * self.size())?;
        for o in rest {
            o.copy_from_slice(acc);
        }
        Ok(())
    }

    /// Reduces `input` across ranks and leaves block `rank` of the result in `output`: with
    /// equal blocks, `input.len() == n * output.len()`.
    ///
    /// Algorithm: pipelined ring reduce-scatter. n-1 steps; sends and receives (n-1)/n of the
    /// input: time ≈ (n-1)α + (n-1)/n·Sβ. [`Reduction::Average`] scales every rank's block by
    /// 1 / [`size`](Self::size).
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let counts = vec![output.len(); self.size()];
        self.reduce_scatterv(input, output, &counts, op, opts)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with a fold of your own (see
    /// [`allreduce_custom`](Self::allreduce_custom)).
    pub fn reduce_scatter_custom<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        fold: &(dyn Fn(&mut [T], &[T]) + Send + Sync),
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let counts = vec![output.len(); self.size()];
        self.reduce_scatterv_fold(input, output, &counts, &Fold::Custom(fold), opts)
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
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        op.check(T::DTYPE)?;
        self.reduce_scatterv_fold(input, output, counts, &Fold::Builtin(op), opts)?;
        finish(op, output, self.size())
    }

    fn reduce_scatterv_fold<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: &Fold<'_, T>,
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
        let equal = counts.iter().all(|&c| c == counts[0]);
        let area = self.whole_area(opts.tag).filter(|_| equal);
        let shm = area_choice(area, opts.algorithm, "reduce_scatter (with equal blocks)", self.size())?;
        let desc =
            OpDesc::new(Call::ReduceScatter).dtype(T::DTYPE).count(total).reduce(op.code()).extra(counts_hash(counts));
        if let (Some(algo), Some(area)) = (shm, area) {
            let desc = desc.algo(algo);
            return local::run(self.comm(), &**area, "reduce_scatter", desc, opts, |l| {
                local::reduce_scatter(l, input, output, op)
            });
        }
        let seg = opts.segment_elems::<T>();
        let blocks = blocks_of(counts);
        algorithms::run(self.comm(), "reduce_scatter", desc, opts, |c| {
            // `input` is only read: each received segment is reduced into a copy of this
            // rank's part made just before (in the context's scratch pool, reused from call
            // to call), and this rank's own block straight into `output`.
            // (With two ranks the only block received is this rank's own.)
            let mut work = c.scratch::<T>(if n > 2 { total } else { 0 });
            let bufs = allreduce::RingBufs::Apart { input, work: &mut work, last: output };
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
        let equal = counts.iter().all(|&c| c == counts[0]);
        let area = self.whole_area(opts.tag).filter(|_| equal);
        let shm = area_choice(area, opts.algorithm, "allgather (with equal blocks)", self.size())?;
        let algo = match shm {
            Some(a) => a,
            None => allgather_algorithm(n, bytes_of::<T>(total), opts.algorithm)?,
        };
        if n == 1 {
            output[blocks[self.rank()].clone()].copy_from_slice(input);
            return Ok(());
        }
        let single =
            shm.is_some() && area.is_some() && self.comm().copy_plan().allgather.contains(bytes_of::<T>(total));
        // This rank's own block (the algorithms only send it; the single-copy one copies it
        // piece by piece as it sends).
        if !single {
            output[blocks[self.rank()].clone()].copy_from_slice(input);
        }
        let desc = OpDesc::new(Call::Allgather)
            .dtype(T::DTYPE)
            .count(total)
            .algo(algo)
            .single_copy(single)
            .extra(counts_hash(counts));
        if let (Some(_), Some(area)) = (shm, area) {
            return local::run(self.comm(), &**area, "allgather", desc, opts, |l| match single {
                true => local::allgather_single(l, input, output),
                false => local::allgather(l, input, output),
            });
        }
        algorithms::run(self.comm(), "allgather", desc, opts, |c| {
            if algo == Algorithm::RecursiveDoubling {
                allgather::recursive_doubling(c, output, &blocks)
            } else {
                allgather::ring(c, output, &blocks, seg)
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
        let area = self.whole_area(opts.tag);
        let shm = area_choice(area, opts.algorithm, "broadcast", self.size())?;
        let algo = match shm {
            Some(a) => a,
            None => broadcast_algorithm(bytes_of::<T>(buf.len()), opts.algorithm)?,
        };
        if n == 1 {
            return Ok(());
        }
        let path = match (shm, area) {
            (Some(_), Some(_)) => self.comm().copy_plan().broadcast_path(bytes_of::<T>(buf.len())),
            _ => BroadcastPath::Two,
        };
        let desc = OpDesc::new(Call::Broadcast)
            .dtype(T::DTYPE)
            .count(buf.len())
            .root(root)
            .algo(algo)
            .single_copy(path == BroadcastPath::Read)
            .root_writes(path == BroadcastPath::Split);
        if let (Some(_), Some(area)) = (shm, area) {
            return local::run(self.comm(), &**area, "broadcast", desc, opts, |l| match path {
                BroadcastPath::Two => local::broadcast(l, buf, root),
                p => local::broadcast_single(l, buf, root, p == BroadcastPath::Split),
            });
        }
        let seg = opts.segment_elems::<T>();
        algorithms::run(self.comm(), "broadcast", desc, opts, |c| match algo {
            Algorithm::Pipeline => broadcast::pipeline(c, buf, root, seg),
            _ => broadcast::tree(c, buf, root),
        })
    }

    /// Reduces `buf` element-wise across ranks into rank `root`'s `buf`; other ranks' buffers
    /// are left unchanged.
    ///
    /// Algorithm: binomial tree. ⌈log₂ n⌉ steps; an inner node receives one buffer per child:
    /// time ≈ ⌈log₂ n⌉(α + Sβ) plus the reductions. [`Reduction::Average`] scales the root's
    /// result by 1 / [`size`](Self::size).
    pub fn reduce<T: Element>(
        &self,
        buf: &mut [T],
        root: usize,
        op: Reduction,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        op.check(T::DTYPE)?;
        self.reduce_fold(buf, root, &Fold::Builtin(op), opts)?;
        if self.rank() == root {
            finish(op, buf, self.size())?;
        }
        Ok(())
    }

    /// [`reduce`](Self::reduce) with a fold of your own (see
    /// [`allreduce_custom`](Self::allreduce_custom)).
    pub fn reduce_custom<T: Element>(
        &self,
        buf: &mut [T],
        root: usize,
        fold: &(dyn Fn(&mut [T], &[T]) + Send + Sync),
        opts: &CollectiveOptions,
    ) -> Result<()> {
        self.reduce_fold(buf, root, &Fold::Custom(fold), opts)
    }

    fn reduce_fold<T: Element>(
        &self,
        buf: &mut [T],
        root: usize,
        op: &Fold<'_, T>,
        opts: &CollectiveOptions,
    ) -> Result<()> {
        let n = self.size();
        check_root(root, n, "reduce")?;
        if n == 1 {
            return Ok(());
        }
        let desc = OpDesc::new(Call::Reduce).dtype(T::DTYPE).count(buf.len()).root(root).reduce(op.code());
        algorithms::run(self.comm(), "reduce", desc, opts, |c| reduce::tree(c, buf, root, op))
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
        if self.rank() == root {
            // The root's own block (the algorithm only receives the others).
            output[blocks[root].clone()].copy_from_slice(input);
        }
        if n == 1 {
            return Ok(());
        }
        let desc = OpDesc::new(Call::Gather).dtype(T::DTYPE).count(total).root(root).extra(counts_hash(counts));
        algorithms::run(self.comm(), "gather", desc, opts, |c| personalized::gather(c, input, output, &blocks, root))
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
        let desc = OpDesc::new(Call::Scatter).dtype(T::DTYPE).count(output.len()).root(root);
        algorithms::run(self.comm(), "scatter", desc, opts, |c| personalized::scatter(c, input, output, &blocks, root))
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
        // This rank's own block (the algorithm moves only the others).
        output[rb[r].clone()].copy_from_slice(&input[sb[r].clone()]);
        if n == 1 {
            return Ok(());
        }
        let desc = OpDesc::new(Call::Alltoall).dtype(T::DTYPE);
        algorithms::run(self.comm(), "alltoall", desc, opts, |c| personalized::alltoall(c, input, &sb, output, &rb))
    }
}

/// What `op` does to a result of `contributors` ranks' values once the fold is done: an
/// average divides (see [`Reduction::finish_bytes`]).
fn finish<T: Element>(op: Reduction, buf: &mut [T], contributors: usize) -> Result<()> {
    op.finish_bytes(T::DTYPE, bytemuck::cast_slice_mut(buf), contributors)
}

fn check_root(root: usize, n: usize, what: &str) -> Result<()> {
    if root >= n {
        return Err(Error::invalid(format!("{what}: root {root} is out of range for size {n}")));
    }
    Ok(())
}
