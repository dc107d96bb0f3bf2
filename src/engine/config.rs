//! The engine's configuration, in code or from Horovod's (and ferrogloo's) environment
//! variables.

use crate::config::{
    FERROGLOO_ENGINE_AREA, FERROGLOO_ENGINE_BATCH_GAP_US, FERROGLOO_ENGINE_TREE_FROM, FERROGLOO_FUSION_MAX_TENSOR,
    FERROGLOO_TIMELINE_ALL_RANKS, HOROVOD_CACHE_CAPACITY, HOROVOD_CYCLE_TIME, HOROVOD_FUSION_THRESHOLD,
    HOROVOD_STALL_CHECK_DISABLE, HOROVOD_STALL_CHECK_TIME_SECONDS, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS,
    HOROVOD_TIMELINE, Vars,
};
use crate::error::Result;
use std::path::PathBuf;
use std::time::Duration;

/// The engine's configuration: `default()` is the defaults (it never reads the environment),
/// [`EngineConfig::from_env`] the defaults changed by the variables each field names.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Bytes of the fusion buffer: ready allreduces that fit together are run as one. 0 turns
    /// fusion off. Default 64 MiB; `HOROVOD_FUSION_THRESHOLD`.
    pub fusion_threshold: usize,
    /// Allreduces larger than this many bytes are not fused: they run alone, in place
    /// (copying them through the fusion buffer costs more than the collective it saves).
    /// Not where an uncompressed batch runs on its tensors themselves, with no fusion buffer
    /// (every rank on one host's area, or the ring over the pairs: see the engine's
    /// "Fusion"): any size joins a batch there.
    /// Default 1 MiB; `FERROGLOO_FUSION_MAX_TENSOR`.
    pub fusion_max_tensor: usize,
    /// The longest a rank waits for a burst of submissions to end before it negotiates them.
    /// Default 1 ms; `HOROVOD_CYCLE_TIME` (milliseconds; there is no fixed cycle).
    pub batch_window: Duration,
    /// A burst has ended when no submission came for this long (a single submission after a
    /// quiet spell is negotiated at once). Default 100 µs; `FERROGLOO_ENGINE_BATCH_GAP_US`.
    pub batch_gap: Duration,
    /// Response cache slots (0: every round goes through the coordinator). Default 1024;
    /// `HOROVOD_CACHE_CAPACITY`.
    pub cache_capacity: usize,
    /// Report names that some ranks submitted and others have not after this long (`None`:
    /// never). Default 60 s; `HOROVOD_STALL_CHECK_TIME_SECONDS`, and `HOROVOD_STALL_CHECK_DISABLE`
    /// (`1`) for `None`.
    pub stall_check: Option<Duration>,
    /// Fail the engine on every rank when a name waited this long (`None`: never, the default).
    /// `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` (0: never).
    pub stall_shutdown: Option<Duration>,
    /// Write a Chrome-trace timeline to this file from the start (rank 0 only, unless
    /// `timeline_all_ranks`). Default none; `HOROVOD_TIMELINE`.
    pub timeline: Option<PathBuf>,
    /// Every rank writes a timeline, to the file name with `.<rank>` appended. Default off;
    /// `FERROGLOO_TIMELINE_ALL_RANKS` (`1`).
    pub timeline_all_ranks: bool,
    /// Where every rank of the context shares one host's shared-memory area, each cycle's
    /// state goes through it (one step of the area, no message but to wake a rank that waits
    /// idle) instead of over the pairs. Default on; `FERROGLOO_ENGINE_AREA` (`0` for off).
    pub negotiate_through_area: bool,
    /// Where the cycles go over the pairs (not through a host's area), whether the ranks agree
    /// each cycle by reduction: in `log2 n` rounds of one message per rank, two more for the
    /// ranks paired up first where `n` is not a power of two (a bitwise AND/OR reduction of
    /// the cache's bits and the ranks' flags, recursive doubling; names not in the cache go to
    /// the coordinator in full, whose responses go down a binomial tree),
    /// instead of every rank sending its state to every other (`n - 1` messages per rank and
    /// cycle, all at once). The second is one round trip but `n - 1` messages; the first
    /// `log2 n` round trips of one: which is faster depends on what a message costs against a
    /// round trip on the machines and network at hand.
    ///
    /// `None` (the default): measured as the engine starts, for 8 ranks or more (a few
    /// exchanges each way; the reduction is taken where it is at least a fifth faster, [`Engine::agrees_by_reduction`](super::Engine::agrees_by_reduction)
    /// says what was chosen; below 8 ranks the direct exchange); `Some(0)`: never; `Some(k)`:
    /// for `k` ranks or more.
    /// `FERROGLOO_ENGINE_TREE_FROM` (a number, or `auto` for `None`).
    ///
    /// Agreeing by reduction, small allreduces do not travel with the states, and a timeline
    /// shows when each rank was first seen with a cached name only for its own rank.
    pub tree_negotiation_from: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            fusion_threshold: 64 << 20,
            fusion_max_tensor: 1 << 20,
            batch_window: Duration::from_millis(1),
            batch_gap: Duration::from_micros(100),
            cache_capacity: 1024,
            stall_check: Some(Duration::from_secs(60)),
            stall_shutdown: None,
            timeline: None,
            timeline_all_ranks: false,
            negotiate_through_area: true,
            tree_negotiation_from: None,
        }
    }
}

impl EngineConfig {
    /// The defaults, changed by the environment variables each field names (Horovod's names where
    /// the meaning is the same; all are in the README's table of environment variables). A value
    /// that is not a non-negative number is an error naming the variable.
    pub fn from_env() -> Result<Self> {
        Self::read(&Vars::process())
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    #[cfg(test)]
    pub(crate) fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        Self::read(&Vars::lookup(var))
    }

    /// [`from_env`](Self::from_env) as `vars` give the variables.
    pub(crate) fn read(vars: &Vars<'_>) -> Result<Self> {
        let num = |name: &str| vars.number(name, |x| x >= 0.0, "a non-negative number");
        let secs = |x: f64| Duration::from_secs_f64(x.min(1e9));
        let mut c = EngineConfig::default();
        if let Some(x) = num(HOROVOD_FUSION_THRESHOLD)? {
            c.fusion_threshold = x.min(usize::MAX as f64) as usize;
        }
        if let Some(x) = num(FERROGLOO_FUSION_MAX_TENSOR)? {
            c.fusion_max_tensor = x.min(usize::MAX as f64) as usize;
        }
        if let Some(x) = num(HOROVOD_CYCLE_TIME)? {
            c.batch_window = secs(x / 1000.0);
        }
        if let Some(x) = num(FERROGLOO_ENGINE_BATCH_GAP_US)? {
            c.batch_gap = secs(x / 1e6);
        }
        if let Some(x) = num(HOROVOD_CACHE_CAPACITY)? {
            c.cache_capacity = x.min(1e7) as usize;
        }
        if let Some(x) = num(HOROVOD_STALL_CHECK_TIME_SECONDS)? {
            c.stall_check = Some(secs(x));
        }
        if vars.truthy(HOROVOD_STALL_CHECK_DISABLE) {
            c.stall_check = None;
        }
        if let Some(x) = num(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)? {
            c.stall_shutdown = (x > 0.0).then(|| secs(x));
        }
        if let Some(p) = vars.path(HOROVOD_TIMELINE) {
            c.timeline = Some(p);
        }
        c.timeline_all_ranks = vars.truthy(FERROGLOO_TIMELINE_ALL_RANKS);
        if vars.text(FERROGLOO_ENGINE_TREE_FROM).is_some_and(|v| v.eq_ignore_ascii_case("auto")) {
            c.tree_negotiation_from = None;
        } else if let Some(x) = vars.number(FERROGLOO_ENGINE_TREE_FROM, |x| x >= 0.0, "a number of ranks or auto")? {
            c.tree_negotiation_from = Some(x.min(1e9) as usize);
        }
        if let Some(on) = vars.switch(FERROGLOO_ENGINE_AREA)? {
            c.negotiate_through_area = on;
        }
        Ok(c)
    }

    /// Whether an engine of `n` ranks whose cycles go over the pairs agrees by reduction as
    /// configured: `None` where it is to be measured.
    pub(crate) fn tree_for(&self, n: usize) -> Option<bool> {
        match self.tree_negotiation_from {
            Some(k) => Some(k != 0 && n >= k.max(2)),
            // Fewer than 8 ranks: at most 3 rounds against at most 6 messages at once, about the
            // same time anywhere (measured on loopback: within the noise at 4 and 8 ranks), and
            // the direct exchange carries small tensors too.
            None if n < 8 => Some(false),
            None => None,
        }
    }
}
