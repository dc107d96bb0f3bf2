//! The α–β–γ cost model's type and formulas; see [`crate::cost`] for where its parameters
//! come from and how `Auto` uses it.

use crate::config::{FERROGLOO_COST_MODEL, Vars};
use crate::error::{Error, Result};
use crate::types::Algorithm;
use std::time::Duration;

/// The link and reduction parameters of a context, and the time they predict for each
/// allreduce algorithm. See the [module](crate::cost).
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

    /// The model as [`FromStr`](std::str::FromStr) and `FERROGLOO_COST_MODEL` read it, every
    /// value written so that it parses back to the same bits: to give a later run the model
    /// this one measured ([`Context::cost_model`](crate::Context::cost_model)), so that it
    /// chooses the same algorithms.
    ///
    /// ```
    /// let m: ferrogloo::CostModel = "latency_us=12.5,link_gbs=1.25,reduce_gbs=8".parse()?;
    /// assert_eq!(m.to_exact_text().parse::<ferrogloo::CostModel>()?, m);
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn to_exact_text(self) -> String {
        format!(
            "latency_us={:?},link_gbs={:?},reduce_gbs={:?}",
            self.latency.as_secs_f64() * 1e6,
            self.link_bytes_per_s / 1e9,
            self.reduce_bytes_per_s / 1e9
        )
    }

    fn alpha(&self) -> f64 {
        self.latency.as_secs_f64()
    }

    /// Whether a buffer of `bytes`, one of several the ring reduces as one, is predicted
    /// cheaper copied into a buffer with the other small ones and out again (twice its bytes
    /// at the reduction rate, which this model takes as memory's) than cut out of the ring's
    /// segments where it ends (a message more in each of the ring's two phases: 2α).
    pub(crate) fn packs_for_the_ring(&self, bytes: usize) -> bool {
        (bytes as f64) * self.gamma() < self.alpha()
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

/// `t` seconds as a duration: `Duration::MAX` past its range or not a number (a model of
/// absurd rates), zero for what is not positive.
pub(crate) fn secs(t: f64) -> Duration {
    if t.is_nan() {
        Duration::MAX
    } else if t <= 0.0 {
        Duration::ZERO
    } else {
        Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(latency_us: f64, link_gbs: f64, reduce_gbs: f64) -> CostModel {
        CostModel::new(Duration::from_secs_f64(latency_us / 1e6), link_gbs * 1e9, reduce_gbs * 1e9).unwrap()
    }

    /// A buffer is packed for the ring while copying it in and out costs less than the two
    /// messages its ends add: on a 30 µs link with reductions at 4 GB/s, below 120 KB
    /// (ResNet-50's biases and norms: 115 of its 161 gradients, 0.66 MB of its 102), not a
    /// 4 MiB weight; on a link of no latency, nothing.
    #[test]
    fn buffers_are_packed_for_the_ring_while_copying_costs_less_than_their_messages() {
        let m = model(30.0, 1.0, 4.0);
        assert!(m.packs_for_the_ring(4 * 1000) && m.packs_for_the_ring(119_000));
        assert!(!m.packs_for_the_ring(121_000) && !m.packs_for_the_ring(4 << 20));
        assert!(!model(0.0, 1.0, 4.0).packs_for_the_ring(1));
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
    fn the_exact_text_parses_to_a_fixed_point() {
        let m = CostModel::new(Duration::from_nanos(31_234), 1.234_567_891e9, 6.7e10).unwrap();
        let once: CostModel = m.to_exact_text().parse().unwrap();
        let twice: CostModel = once.to_exact_text().parse().unwrap();
        assert_eq!(once, twice);
        assert_eq!(once.to_exact_text(), twice.to_exact_text());
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
