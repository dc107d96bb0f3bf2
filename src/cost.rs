//! The α–β–γ cost model of the allreduce algorithms, with which
//! [`Algorithm::Auto`] chooses one (Thakur, Rabenseifner and Gropp, "Optimization of
//! collective communication operations in MPICH", 2005).
//!
//! A collective's time on `p` ranks and `S` bytes is counted in three parameters of the links
//! between the ranks: α, the time of one step (one message each way, however small: latency
//! and software), β, the time per byte a link moves, and γ, the time per byte a rank reduces.
//! With `p'` the largest power of two ≤ p and `k = log₂p'`:
//!
//! | algorithm | time |
//! |---|---|
//! | recursive doubling | k(α + Sβ + Sγ) |
//! | halving-doubling | 2kα + 2(p'-1)/p'·Sβ + (p'-1)/p'·Sγ |
//! | ring | 2(p-1)α + (p-1)/p·S·max(β, γ) + (p-1)/p·Sβ |
//!
//! plus, where p is not a power of two, the two extra steps of the doubling algorithms (a rank
//! outside the power-of-two group hands its buffer in and gets the result back): 2α + 2Sβ + Sγ.
//! The ring's reduce-scatter reduces one segment while the next moves (it forwards each as soon
//! as it is reduced), so its reductions hide behind the link where the link is the slower.
//!
//! The two-level allreduce of a context over several hosts ([`Algorithm::SharedMemory`] there)
//! is a same-host allreduce, the hosts' leaders' allreduce, and a same-host broadcast:
//! [`CostModel::hierarchical_allreduce_time`].
//!
//! **Where the parameters come from.** A context measures them as it forms, in its first
//! collective (a few milliseconds): α from small recursive-doubling allreduces (their time per
//! step), β from exchanges of 1 MiB (less exchanges of 8 bytes) with a partner half the
//! power-of-two group away (another host when ranks are numbered host by host and the hosts
//! hold equally many; with uneven hosts it may be one of the same host), γ from timing an f32
//! sum. Each step counts at its slowest
//! rank's time and the fastest of a few steps is kept, so every rank holds the same model and
//! picks the same algorithm. Sub-groups and the two-level allreduce's leaders use the model of
//! the context they were made from.
//!
//! The choice follows a measurement, so two runs of one program may choose differently, and a
//! float sum's last bits may differ between them (the algorithms add in different orders).
//! For runs that must repeat bit for bit, give the model: `FERROGLOO_COST_MODEL`
//! (`latency_us=50,link_gbs=1.25,reduce_gbs=8`) or
//! [`ContextBuilder::cost_model`](crate::ContextBuilder::cost_model), for instance the one a
//! run measured ([`Context::cost_model`](crate::Context::cost_model)) written by
//! [`CostModel::to_exact_text`]. Every rank must then be given the same one: each publishes
//! the model it was given with its store entry, and where two differ (or one rank has a model
//! and another none) every rank fails formation with [`Error::Mismatch`](crate::Error::Mismatch)
//! naming both, rather than choosing different algorithms or waiting for a measurement that
//! the given ranks would never join.

pub use crate::types::CostModel;

use crate::algorithms::{self, Algorithm, CollectiveOptions, allreduce};
use crate::comm::{Comm, fnv};
use crate::error::Result;
use crate::transport::group_id;
use crate::types::cost_model::secs;
use crate::types::{Call, DType, Fold, OpDesc, Reduction};
use smallvec::{SmallVec, smallvec};
use std::time::{Duration, Instant};

/// The group id of the probe's messages, a sibling of the context's (hashed with it).
const PROBE_GROUP: u64 = 0x636f_7374_7072_6f62;
/// Small allreduces before the latency is timed: a context's first steps are slow (on 4
/// simulated hosts on 2 cores, 4 warm-up steps left 300 µs per step, 40 left 11-60 µs, as warm
/// allreduces take).
const WARM_STEPS: usize = 40;
/// Timed small allreduces (α).
const LATENCY_STEPS: usize = 8;
/// Timed exchanges of 8 bytes and of [`PROBE_BYTES`] each (β).
const BANDWIDTH_STEPS: usize = 4;
/// The bandwidth probe's message: larger than a shaped link's burst, small enough to cost a
/// millisecond on a 10 Gbit/s link.
const PROBE_BYTES: usize = 1 << 20;
/// The reduction probe's buffer (f32 sums, in cache as a received segment is).
const REDUCE_ELEMS: usize = 64 << 10;

/// Measures the model of `comm`'s links (see the [module](self)): a collective of its ranks,
/// on a group of its own, ending by `deadline`. Every rank returns the same model.
pub(crate) fn probe(comm: &Comm, deadline: Instant) -> Result<CostModel> {
    let opts = CollectiveOptions {
        timeout: Some(deadline.saturating_duration_since(Instant::now())),
        ..CollectiveOptions::default()
    };
    let desc = OpDesc::new(Call::Allreduce)
        .dtype(DType::F64)
        .count(LATENCY_STEPS + 2 * BANDWIDTH_STEPS + 1)
        .algo(Algorithm::RecursiveDoubling);
    let (n, r) = (comm.size(), comm.rank());
    // Partners half the power-of-two group apart (0 with p/2, …), so that ranks numbered host
    // by host measure the links between hosts; ranks beyond the power of two p pair with
    // r - p, which then answers two.
    let p = 1usize << n.ilog2();
    let partners: SmallVec<[usize; 2]> = if r >= p {
        smallvec![r - p]
    } else if r + p < n {
        smallvec![r ^ (p / 2), r + p]
    } else {
        smallvec![r ^ (p / 2)]
    };
    let what = "measuring the links for the cost model";
    // A group of its own: a rank that has formed its context may revoke it (group 0) while
    // others still measure; that must not fail their formation.
    let comm = &comm.sibling(group_id(fnv(&[comm.group(), PROBE_GROUP])));
    let measured = algorithms::run(comm, what, desc, &opts, |c| {
        // One step: the exchange with the first partner, timed (not on a rank beyond the power
        // of two, which waits for its partner's first exchange), then the second untimed.
        let shift = |out: &[u8], into: &mut [u8]| -> Result<Duration> {
            let mut took = Duration::ZERO;
            for (i, &partner) in partners.iter().enumerate() {
                let t = Instant::now();
                c.phase(|ph| {
                    let s = ph.send(partner, out)?;
                    let got = ph.recv(partner, into)?;
                    ph.filled(got)?;
                    ph.wait(s)
                })?;
                if i == 0 && r < p {
                    took = t.elapsed();
                }
            }
            Ok(took)
        };
        // The first steps warm what a context's first collective finds cold: connections'
        // windows, the buffers' pages, caches.
        let (big, mut big_in) = (vec![0u8; PROBE_BYTES], vec![0u8; PROBE_BYTES]);
        shift(&big, &mut big_in)?;
        // α as a doubling algorithm sees it: a small recursive-doubling allreduce, per step.
        let doubling_steps = f64::from(n.ilog2()) + if n.is_power_of_two() { 0.0 } else { 2.0 };
        let small_allreduce = || -> Result<f64> {
            let mut x = [0.0f64];
            let t = Instant::now();
            allreduce::recursive_doubling(c, &mut x, &Fold::Builtin(Reduction::Max))?;
            Ok(t.elapsed().as_secs_f64() / doubling_steps)
        };
        for _ in 0..WARM_STEPS {
            small_allreduce()?;
        }
        // Each step's time as the slowest rank saw it (a step ends when its slowest rank's
        // does), then the fastest step: what the links allow when no rank was descheduled. (On
        // a host with fewer cores than ranks, collectives run slower than this; the median
        // step varied by 5x from run to run there, the fastest by less.)
        // α from the allreduces; β from the 1 MiB exchanges less 8-byte ones of the same
        // pattern (a different pattern's step could cost more than the whole exchange).
        let (small, mut small_in) = ([0u8; 8], [0u8; 8]);
        let mut times = [0.0f64; LATENCY_STEPS + 2 * BANDWIDTH_STEPS + 1];
        let (lat, rest) = times.split_at_mut(LATENCY_STEPS);
        let (exch, rest) = rest.split_at_mut(BANDWIDTH_STEPS);
        let (bulk, gamma) = rest.split_at_mut(BANDWIDTH_STEPS);
        for t in lat {
            *t = small_allreduce()?;
        }
        for (e, b) in exch.iter_mut().zip(bulk.iter_mut()) {
            *e = shift(&small, &mut small_in)?.as_secs_f64();
            *b = shift(&big, &mut big_in)?.as_secs_f64();
        }
        gamma[0] = reduce_time();
        allreduce::recursive_doubling(c, &mut times, &Fold::Builtin(Reduction::Max))?;
        tracing::debug!(?times, "cost probe: each step's slowest rank (s), and the reduction");
        let alpha = least(&times[..LATENCY_STEPS]);
        let exchange = least(&times[LATENCY_STEPS..LATENCY_STEPS + BANDWIDTH_STEPS]);
        let bulk = least(&times[LATENCY_STEPS + BANDWIDTH_STEPS..LATENCY_STEPS + 2 * BANDWIDTH_STEPS]);
        // Noise can make the small exchange as slow as the large one: the bytes then count
        // for at least half of the large one's time.
        let beta = (bulk - exchange).max(bulk / 2.0).max(1e-12) / PROBE_BYTES as f64;
        Ok([alpha, beta, times[LATENCY_STEPS + 2 * BANDWIDTH_STEPS]])
    })?;
    let [alpha, beta, gamma] = measured;
    CostModel::new(secs(alpha), 1.0 / beta, 1.0 / gamma)
}

/// The model of memory a host's ranks share, for the two-level allreduce's steps within a
/// host: no latency, this thread's copy bandwidth (the best of a few 1 MiB copies) as the link,
/// reductions at `reduce_bytes_per_s`.
pub(crate) fn memory_model(reduce_bytes_per_s: f64) -> Result<CostModel> {
    let src = vec![1u8; PROBE_BYTES];
    let mut dst = vec![0u8; PROBE_BYTES];
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    CostModel::new(Duration::ZERO, PROBE_BYTES as f64 / best.max(1e-9), reduce_bytes_per_s)
}

/// γ: seconds per byte of an f32 sum, the best of a few.
fn reduce_time() -> f64 {
    let mut acc = vec![1.0f32; REDUCE_ELEMS];
    let src = vec![0.5f32; REDUCE_ELEMS];
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        Reduction::Sum.apply(&mut acc, &src);
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&acc);
    best.max(1e-12) / (REDUCE_ELEMS * 4) as f64
}

fn least(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}
