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
//! For runs that must repeat bit for bit, give the model:
//! `FERROGLOO_COST_MODEL` (`latency_us=50,link_gbs=1.25,reduce_gbs=8`) gives them instead;
//! it must then be the same on every rank. Ranks given different models get
//! [`Error::Mismatch`](crate::Error::Mismatch) where their `Auto` allreduces choose differently;
//! where some ranks were given one and others not, the others measure alone and their
//! [`Error::Timeout`](crate::Error::Timeout) (or the first collective's `Mismatch`) says why.

use crate::algorithms::{self, Algorithm, CollectiveOptions, allreduce};
use crate::comm::Comm;
use crate::config::{FERROGLOO_COST_MODEL, Vars};
use crate::error::{Error, Result};
use crate::types::{Call, DType, Fold, OpDesc, Reduction};
use smallvec::{SmallVec, smallvec};
use std::time::{Duration, Instant};

/// The link and reduction parameters of a context, and the time they predict for each
/// allreduce algorithm. See the [module](self).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// α: the time of one step, one small message each way between neighbours.
    pub latency: Duration,
    /// 1/β: bytes per second a link moves, each way.
    pub link_bytes_per_s: f64,
    /// 1/γ: bytes per second a rank reduces (f32 sums).
    pub reduce_bytes_per_s: f64,
}

impl std::fmt::Display for CostModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "latency {:.1} us, link {:.3} GB/s, reduction {:.2} GB/s",
            self.latency.as_secs_f64() * 1e6,
            self.link_bytes_per_s / 1e9,
            self.reduce_bytes_per_s / 1e9
        )
    }
}

/// How a model is written (`FERROGLOO_COST_MODEL`, [`CostModel::from_str`]).
const EXAMPLE: &str = "latency_us=50,link_gbs=1.25,reduce_gbs=8";

impl std::str::FromStr for CostModel {
    type Err = Error;

    /// `latency_us=50,link_gbs=1.25,reduce_gbs=8`: α in µs, the link's and the reduction's
    /// rates in GB/s (10^9 bytes per second), as `FERROGLOO_COST_MODEL` takes them.
    fn from_str(text: &str) -> Result<Self> {
        Self::parse(text).map_err(|why| Error::invalid(format!("cost model {text:?}: {why}")))
    }
}

/// The allreduce algorithms over pairs that the model ranks, fewest steps first (the first of
/// equal predictions wins).
const FLAT: [Algorithm; 3] = [Algorithm::RecursiveDoubling, Algorithm::HalvingDoubling, Algorithm::Ring];

impl CostModel {
    /// A model of `latency`, a link of `link_bytes_per_s` and reductions of
    /// `reduce_bytes_per_s`; an error unless both rates are positive and finite.
    pub fn new(latency: Duration, link_bytes_per_s: f64, reduce_bytes_per_s: f64) -> Result<Self> {
        for (what, v) in [("link", link_bytes_per_s), ("reduction", reduce_bytes_per_s)] {
            if !(v.is_finite() && v > 0.0 && (1.0 / v).is_finite()) {
                return Err(Error::invalid(format!("a cost model's {what} rate must be a positive number, not {v}")));
            }
        }
        Ok(CostModel { latency, link_bytes_per_s, reduce_bytes_per_s })
    }

    /// The model `FERROGLOO_COST_MODEL` gives (`latency_us=50,link_gbs=1.25,reduce_gbs=8`: µs
    /// and GB/s), `None` when it is unset, an error naming the variable when it does not parse.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(&Vars::process())
    }

    pub(crate) fn from_vars(vars: &Vars<'_>) -> Result<Option<Self>> {
        let Some(text) = vars.text(FERROGLOO_COST_MODEL) else { return Ok(None) };
        Self::parse(&text).map(Some).map_err(|why| Error::invalid(format!("{FERROGLOO_COST_MODEL}={text:?}: {why}")))
    }

    /// Parses `latency_us=…,link_gbs=…,reduce_gbs=…`; the error says what is wrong.
    fn parse(text: &str) -> std::result::Result<Self, String> {
        let bad = |why: String| format!("{why} (give latency_us=…,link_gbs=…,reduce_gbs=…, such as {EXAMPLE})");
        let (mut latency, mut link, mut reduce) = (None, None, None);
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("{part:?} is not name=value")))?;
            let v: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && (*v > 0.0 || (*v == 0.0 && k.trim() == "latency_us")))
                .ok_or_else(|| bad(format!("{part:?} is not a positive number")))?;
            match k.trim() {
                "latency_us" => latency = Some(secs(v / 1e6)),
                "link_gbs" => link = Some(v * 1e9),
                "reduce_gbs" => reduce = Some(v * 1e9),
                other => return Err(bad(format!("{other:?} is not one of latency_us, link_gbs, reduce_gbs"))),
            }
        }
        match (latency, link, reduce) {
            (Some(l), Some(b), Some(g)) => Self::new(l, b, g).map_err(|e| bad(e.to_string())),
            _ => Err(bad("all three are needed".into())),
        }
    }

    fn alpha(&self) -> f64 {
        self.latency.as_secs_f64()
    }

    fn beta(&self) -> f64 {
        1.0 / self.link_bytes_per_s
    }

    fn gamma(&self) -> f64 {
        1.0 / self.reduce_bytes_per_s
    }

    /// The predicted time of an allreduce of `bytes` on `n` ranks with `algorithm` (ring,
    /// halving-doubling or recursive doubling; `None` for the others, and for `Auto`, which
    /// is [`allreduce_choice`](Self::allreduce_choice)'s).
    pub fn allreduce_time(&self, algorithm: Algorithm, n: usize, bytes: usize) -> Option<Duration> {
        if n <= 1 {
            return matches!(algorithm, Algorithm::Ring | Algorithm::HalvingDoubling | Algorithm::RecursiveDoubling)
                .then_some(Duration::ZERO);
        }
        let (a, b, g) = (self.alpha(), self.beta(), self.gamma());
        let s = bytes as f64;
        let pp = 1usize << n.ilog2();
        let k = f64::from(n.ilog2());
        let (p, q) = (n as f64, pp as f64);
        // The doubling algorithms' extra ranks: in and out of the power-of-two group.
        let extra = if pp == n { 0.0 } else { 2.0 * a + 2.0 * s * b + s * g };
        let t = match algorithm {
            Algorithm::RecursiveDoubling => k * (a + s * b + s * g) + extra,
            Algorithm::HalvingDoubling => 2.0 * k * a + 2.0 * (q - 1.0) / q * s * b + (q - 1.0) / q * s * g + extra,
            Algorithm::Ring => 2.0 * (p - 1.0) * a + (p - 1.0) / p * s * (b.max(g) + b),
            _ => return None,
        };
        Some(secs(t))
    }

    /// The algorithm the model predicts fastest for an allreduce of `bytes` on `n` ranks: the
    /// one `Auto` runs on a context whose links this model describes.
    pub fn allreduce_choice(&self, n: usize, bytes: usize) -> Algorithm {
        let mut best = (Algorithm::RecursiveDoubling, Duration::MAX);
        for a in FLAT {
            if let Some(t) = self.allreduce_time(a, n, bytes)
                && t < best.1
            {
                best = (a, t);
            }
        }
        best.0
    }

    /// The predicted time of the two-level allreduce of `bytes` over `hosts` hosts of
    /// `per_host` ranks each, this model describing the links between hosts and `local` the
    /// memory a host's ranks share: a same-host allreduce (each rank writes its buffer in,
    /// reduces its share and reads the result out), the leaders' allreduce with the algorithm
    /// this model chooses, and a same-host broadcast (the leader writes, the others read).
    pub fn hierarchical_allreduce_time(
        &self,
        local: &CostModel,
        hosts: usize,
        per_host: usize,
        bytes: usize,
    ) -> Duration {
        let s = bytes as f64;
        let cross = self.allreduce_time(self.allreduce_choice(hosts, bytes), hosts, bytes).unwrap_or_default();
        let within = if per_host > 1 {
            let r = per_host as f64;
            // Written in and read out at memory speed, each rank's share reduced from r copies,
            // the whole buffer written in by the leader and read out by the others.
            4.0 * local.alpha() + 2.0 * s * local.beta() + (r - 1.0) / r * s * local.gamma() + 2.0 * s * local.beta()
        } else {
            0.0
        };
        cross.saturating_add(secs(within))
    }
}

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
/// its first (tag 0), ending by `deadline`. Every rank returns the same model.
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
    let what = "measuring the links for the cost model (a rank given a model, by ContextBuilder::cost_model or \
                FERROGLOO_COST_MODEL, does not: give every rank the same or none)";
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

/// `t` seconds as a duration: `Duration::MAX` past its range or not a number (a model of
/// absurd rates), zero for what is not positive.
fn secs(t: f64) -> Duration {
    if t.is_nan() {
        Duration::MAX
    } else if t <= 0.0 {
        Duration::ZERO
    } else {
        Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX)
    }
}

fn least(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(latency_us: f64, link_gbs: f64, reduce_gbs: f64) -> CostModel {
        CostModel::new(Duration::from_secs_f64(latency_us / 1e6), link_gbs * 1e9, reduce_gbs * 1e9).unwrap()
    }

    #[test]
    fn the_formulas_are_thakurs() {
        let m = model(10.0, 1.0, 4.0);
        let (a, b, g) = (10e-6, 1e-9, 0.25e-9);
        let s = 1e6;
        let secs = |alg, n| m.allreduce_time(alg, n, 1_000_000).unwrap().as_secs_f64();
        let close = |x: f64, y: f64| (x - y).abs() < 2e-9; // a Duration's nanoseconds
        assert!(close(secs(Algorithm::RecursiveDoubling, 4), 2.0 * (a + s * b + s * g)));
        assert!(close(secs(Algorithm::HalvingDoubling, 4), 4.0 * a + 1.5 * s * b + 0.75 * s * g));
        assert!(close(secs(Algorithm::Ring, 4), 6.0 * a + 0.75 * s * (b + b)));
        // 6 ranks: the power-of-two group of 4 and the extra ranks' two steps.
        let extra = 2.0 * a + 2.0 * s * b + s * g;
        assert!(close(secs(Algorithm::HalvingDoubling, 6), 4.0 * a + 1.5 * s * b + 0.75 * s * g + extra));
        assert!(close(secs(Algorithm::Ring, 6), 10.0 * a + 5.0 / 6.0 * s * 2.0 * b));
        assert_eq!(m.allreduce_time(Algorithm::Pipeline, 4, 1), None);
        assert_eq!(m.allreduce_time(Algorithm::Ring, 1, 1 << 20), Some(Duration::ZERO));
    }

    #[test]
    fn latency_picks_few_steps_and_bandwidth_picks_few_bytes() {
        // A 50 µs, 10 Gbit/s link: 4 KiB and 64 KiB by recursive doubling; 16 MiB by an
        // algorithm that sends each byte about twice, not log₂p times.
        let m = model(50.0, 1.25, 8.0);
        assert_eq!(m.allreduce_choice(4, 4096), Algorithm::RecursiveDoubling);
        assert_eq!(m.allreduce_choice(4, 65536), Algorithm::RecursiveDoubling);
        assert_ne!(m.allreduce_choice(8, 16 << 20), Algorithm::RecursiveDoubling);
        // A link 100 times faster with the same latency moves the crossover up.
        let fast = model(50.0, 125.0, 80.0);
        assert_eq!(fast.allreduce_choice(8, 1 << 20), Algorithm::RecursiveDoubling);
        // Many ranks, a large buffer: the ring's 2(p-1) steps cost more than halving-doubling's
        // 2 log₂p unless reductions are slower than the link.
        assert_eq!(m.allreduce_choice(1024, 64 << 20), Algorithm::HalvingDoubling);
        let slow_reduce = model(5.0, 3.0, 1.0);
        assert_eq!(slow_reduce.allreduce_choice(4, 64 << 20), Algorithm::Ring);
    }

    #[test]
    fn absurd_rates_predict_the_longest_time_rather_than_panic() {
        let m = "latency_us=1e300,link_gbs=1e-300,reduce_gbs=1e-300".parse::<CostModel>().unwrap();
        assert_eq!(m.latency, Duration::MAX);
        assert_eq!(m.allreduce_time(Algorithm::Ring, 9, usize::MAX), Some(Duration::MAX));
        let _ = m.allreduce_choice(1024, usize::MAX);
        assert_eq!(m.hierarchical_allreduce_time(&m, 4, 2, 1 << 30), Duration::MAX);
    }

    #[test]
    fn the_hierarchy_adds_the_hosts_allreduce_to_the_local_steps() {
        let net = model(50.0, 1.25, 8.0);
        let mem = model(1.0, 10.0, 8.0);
        let s = 16 << 20;
        let cross = net.allreduce_time(net.allreduce_choice(4, s), 4, s).unwrap();
        let one_per_host = net.hierarchical_allreduce_time(&mem, 4, 1, s);
        assert_eq!(one_per_host, cross);
        let two = net.hierarchical_allreduce_time(&mem, 4, 2, s);
        assert!(two > cross && two < cross + Duration::from_millis(10), "{two:?} vs {cross:?}");
    }

    #[test]
    fn the_variable_parses_or_says_what_is_wrong() {
        let with = |v: &'static str| move |name: &str| (name == FERROGLOO_COST_MODEL).then(|| v.to_string());
        let read = |v: &'static str| {
            let f = with(v);
            CostModel::from_vars(&Vars::lookup(&f))
        };
        let m = read("latency_us=50, link_gbs=1.25,reduce_gbs=8").unwrap().unwrap();
        assert_eq!(m, model(50.0, 1.25, 8.0));
        assert_eq!("latency_us=50,link_gbs=1.25,reduce_gbs=8".parse::<CostModel>().unwrap(), m);
        let e = "latency_us=50".parse::<CostModel>().unwrap_err().to_string();
        assert!(e.contains("all three are needed") && e.contains("latency_us=50"), "{e}");
        let none = |_: &str| None;
        assert_eq!(CostModel::from_vars(&Vars::lookup(&none)).unwrap(), None);
        for bad in [
            "latency_us=50",
            "latency_us=x,link_gbs=1,reduce_gbs=1",
            "speed=1",
            "latency_us=-1,link_gbs=1,reduce_gbs=1",
        ] {
            let e = read(bad).unwrap_err().to_string();
            assert!(e.contains("FERROGLOO_COST_MODEL") && e.contains(bad), "{bad}: {e}");
        }
    }
}
