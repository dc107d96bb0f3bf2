//! The engine's configuration, in code or from Horovod's (and ferrogloo's) environment
//! variables.

use crate::error::{Error, Result};
use std::path::PathBuf;
use std::time::Duration;

/// The engine's configuration; see the [module documentation](crate::engine) for the environment
/// variables that set each field.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Bytes of the fusion buffer: ready allreduces that fit together are run as one. 0 turns
    /// fusion off.
    pub fusion_threshold: usize,
    /// Allreduces larger than this many bytes are not fused: they run alone, in place
    /// (copying them through the fusion buffer costs more than the collective it saves).
    pub fusion_max_tensor: usize,
    /// The longest a rank waits for a burst of submissions to end before it negotiates them.
    pub batch_window: Duration,
    /// A burst has ended when no submission came for this long (a single submission after a
    /// quiet spell is negotiated at once).
    pub batch_gap: Duration,
    /// Response cache slots (0: every round goes through the coordinator).
    pub cache_capacity: usize,
    /// Report names that some ranks submitted and others have not after this long (`None`:
    /// never).
    pub stall_check: Option<Duration>,
    /// Fail the engine on every rank when a name waited this long (`None`: never).
    pub stall_shutdown: Option<Duration>,
    /// Write a Chrome-trace timeline to this file from the start (rank 0 only, unless
    /// `timeline_all_ranks`).
    pub timeline: Option<PathBuf>,
    /// Every rank writes a timeline, to the file name with `.<rank>` appended.
    pub timeline_all_ranks: bool,
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
        }
    }
}

impl EngineConfig {
    /// The defaults, changed by the environment variables of the [module documentation](crate::engine).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        fn num(var: &dyn Fn(&str) -> Option<String>, k: &str) -> Result<Option<f64>> {
            match var(k) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => match v.trim().parse::<f64>() {
                    Ok(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
                    _ => Err(Error::invalid(format!("{k}={v:?} is not a non-negative number"))),
                },
            }
        }
        let secs = |x: f64| Duration::from_secs_f64(x.min(1e9));
        let mut c = EngineConfig::default();
        if let Some(x) = num(var, "HOROVOD_FUSION_THRESHOLD")? {
            c.fusion_threshold = x.min(usize::MAX as f64) as usize;
        }
        if let Some(x) = num(var, "FERROGLOO_FUSION_MAX_TENSOR")? {
            c.fusion_max_tensor = x.min(usize::MAX as f64) as usize;
        }
        if let Some(x) = num(var, "HOROVOD_CYCLE_TIME")? {
            c.batch_window = secs(x / 1000.0);
        }
        if let Some(x) = num(var, "FERROGLOO_ENGINE_BATCH_GAP_US")? {
            c.batch_gap = secs(x / 1e6);
        }
        if let Some(x) = num(var, "HOROVOD_CACHE_CAPACITY")? {
            c.cache_capacity = x.min(1e7) as usize;
        }
        if let Some(x) = num(var, "HOROVOD_STALL_CHECK_TIME_SECONDS")? {
            c.stall_check = Some(secs(x));
        }
        if var("HOROVOD_STALL_CHECK_DISABLE").is_some_and(|v| truthy(&v)) {
            c.stall_check = None;
        }
        if let Some(x) = num(var, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")? {
            c.stall_shutdown = (x > 0.0).then(|| secs(x));
        }
        if let Some(p) = var("HOROVOD_TIMELINE").filter(|p| !p.is_empty()) {
            c.timeline = Some(PathBuf::from(p));
        }
        c.timeline_all_ranks = var("FERROGLOO_TIMELINE_ALL_RANKS").is_some_and(|v| truthy(&v));
        Ok(c)
    }
}

fn truthy(v: &str) -> bool {
    matches!(v.trim(), "1" | "true" | "yes" | "on")
}
