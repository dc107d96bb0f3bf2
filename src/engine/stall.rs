//! The stall inspector (Horovod's StallInspector) as a plain state machine: given "rank r has
//! had name n pending since t" and the time now, which names to report (some ranks submitted
//! them, others have not, for longer than the check threshold; again every threshold) and when
//! to fail the engine (past the shutdown threshold). It also keeps when each rank was first
//! seen with each pending name, which the timeline shows.

use super::meta::Kind;
use crate::error::Error;
use rustc_hash::FxHashMap as HashMap;
use std::time::{Duration, Instant};

/// A name that some ranks submitted and others had not, as rank 0's stall inspector saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct StallReport {
    /// The tensor's name.
    pub name: String,
    /// The collective ("allreduce", ...).
    pub op: &'static str,
    /// The ranks that had submitted it.
    pub submitted: Vec<usize>,
    /// The ranks that had not.
    pub missing: Vec<usize>,
    /// How long it had waited when reported.
    pub waited: Duration,
}

impl std::fmt::Display for StallReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} '{}' waited {:.1} s: submitted by ranks {:?}, missing on ranks {:?}",
            self.op,
            self.name,
            self.waited.as_secs_f64(),
            self.submitted,
            self.missing
        )
    }
}

/// What one look found.
#[derive(Debug, Default)]
pub(crate) struct Stalls {
    /// Names to report now (each at most once per check threshold).
    pub(crate) reports: Vec<StallReport>,
    /// The engine must fail: a name waited past the shutdown threshold ([`Error::Timeout`]
    /// naming the missing ranks).
    pub(crate) fatal: Option<Error>,
}

/// The inspector's state.
#[derive(Debug)]
pub(crate) struct StallInspector {
    size: usize,
    check: Option<Duration>,
    shutdown: Option<Duration>,
    /// When each rank was first seen with each pending name.
    seen: HashMap<String, Vec<Option<Instant>>>,
    /// When each name was last reported.
    reported: HashMap<String, Instant>,
}

impl StallInspector {
    /// An inspector for `size` ranks that reports after `check` and fails after `shutdown`
    /// (`None`: never).
    pub(crate) fn new(size: usize, check: Option<Duration>, shutdown: Option<Duration>) -> Self {
        StallInspector { size, check, shutdown, seen: HashMap::default(), reported: HashMap::default() }
    }

    /// Notes that rank `r` has `name` pending at `now` (the first sighting counts).
    pub(crate) fn saw(&mut self, name: &str, r: usize, now: Instant) {
        let n = self.size;
        if !self.seen.contains_key(name) {
            self.seen.insert(name.to_string(), vec![None; n]);
        }
        if let Some(t) = self.seen.get_mut(name).and_then(|v| v.get_mut(r)) {
            t.get_or_insert(now);
        }
    }

    /// `name` was decided: forget it; returns when each rank was first seen with it.
    pub(crate) fn take(&mut self, name: &str) -> Option<Vec<Option<Instant>>> {
        self.reported.remove(name);
        self.seen.remove(name)
    }

    /// How long to wait before the next look: a quarter of the shorter threshold (10 ms to
    /// 1 s) while some name is pending; `None` when there is nothing to look at.
    pub(crate) fn next_look(&self) -> Option<Duration> {
        let check = self.period()?;
        (!self.seen.is_empty()).then(|| (check / 4).clamp(Duration::from_millis(10), Duration::from_secs(1)))
    }

    /// The shorter threshold (`None`: the inspector never reports nor fails).
    pub(crate) fn period(&self) -> Option<Duration> {
        [self.check, self.shutdown].into_iter().flatten().min()
    }

    /// Looks at every pending name at `now`: those waiting longer than the shorter threshold
    /// with some rank missing (a rank that `joined` is not missing from an allreduce) are
    /// reported, at most once per check threshold, or are fatal past the shutdown threshold
    /// (the first such name by name). `kind_of` says a name's collective; `world` each rank's
    /// rank in the job, which the reports and the error name.
    pub(crate) fn inspect(
        &mut self,
        now: Instant,
        kind_of: impl Fn(&str) -> Kind,
        joined: &[bool],
        world: &[usize],
    ) -> Stalls {
        let mut out = Stalls::default();
        let Some(check) = self.period() else { return out };
        let w = |r: usize| world.get(r).copied().unwrap_or(r);
        let mut fatal: Option<StallReport> = None;
        let mut names: Vec<&String> = self.seen.keys().collect();
        names.sort();
        for name in names {
            let Some(v) = self.seen.get(name) else { continue };
            let Some(since) = v.iter().flatten().min().copied() else { continue };
            let waited = now.saturating_duration_since(since);
            if waited < check {
                continue;
            }
            let kind = kind_of(name);
            let submitted: Vec<usize> = (0..self.size).filter(|&r| v[r].is_some()).collect();
            let missing: Vec<usize> = (0..self.size)
                .filter(|&r| v[r].is_none() && !(kind == Kind::Allreduce && joined.get(r).copied().unwrap_or(false)))
                .collect();
            if missing.is_empty() {
                continue;
            }
            let report = StallReport {
                name: name.clone(),
                op: kind.name(),
                submitted: submitted.iter().map(|&r| w(r)).collect(),
                missing: missing.iter().map(|&r| w(r)).collect(),
                waited,
            };
            if self.shutdown.is_some_and(|s| waited >= s) {
                fatal.get_or_insert(report);
                continue;
            }
            let due = self.check.is_some_and(|c| {
                waited >= c && self.reported.get(name).is_none_or(|t| now.saturating_duration_since(*t) >= c)
            });
            if due {
                self.reported.insert(name.clone(), now);
                out.reports.push(report);
            }
        }
        out.fatal = fatal.map(|r| Error::Timeout {
            op: format!(
                "engine: {} '{}' (submitted by ranks {:?}; stall shutdown after {:.1} s)",
                r.op,
                r.name,
                r.submitted,
                self.shutdown.unwrap_or_default().as_secs_f64()
            ),
            ranks: r.missing,
            keys: Vec::new(),
            waited: r.waited,
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORLD: [usize; 3] = [4, 5, 6];
    const S: Duration = Duration::from_secs(1);

    fn allreduce(_: &str) -> Kind {
        Kind::Allreduce
    }

    #[test]
    fn a_name_missing_on_some_ranks_is_reported_past_the_threshold_naming_them_once_per_threshold() {
        let t0 = Instant::now();
        let mut s = StallInspector::new(3, Some(10 * S), None);
        assert_eq!(s.next_look(), None, "nothing pending");
        s.saw("b", 0, t0);
        s.saw("b", 2, t0 + 2 * S);
        s.saw("b", 0, t0 + 3 * S); // a later sighting does not move the first
        s.saw("a", 1, t0 + 5 * S);
        s.saw("done", 0, t0);
        for r in 0..3 {
            s.saw("all", r, t0); // every rank has it: never a stall
        }
        assert_eq!(s.next_look(), Some(S), "a quarter of 10 s, at most 1 s");
        assert!(s.inspect(t0 + 9 * S, allreduce, &[false; 3], &WORLD).reports.is_empty());
        assert!(s.take("done").is_some_and(|v| v == [Some(t0), None, None]));
        let look = s.inspect(t0 + 10 * S, allreduce, &[false; 3], &WORLD);
        assert!(look.fatal.is_none());
        assert_eq!(
            look.reports,
            [StallReport {
                name: "b".into(),
                op: "allreduce",
                submitted: vec![4, 6],
                missing: vec![5],
                waited: 10 * S
            }]
        );
        // Not again within the threshold; a when it has waited as long; b again after it.
        let names = |s: &mut StallInspector, at: Duration| -> Vec<(String, Vec<usize>, Vec<usize>)> {
            let look = s.inspect(t0 + at, allreduce, &[false; 3], &WORLD);
            look.reports.into_iter().map(|r| (r.name, r.submitted, r.missing)).collect()
        };
        assert_eq!(names(&mut s, 14 * S), []);
        assert_eq!(names(&mut s, 15 * S), [("a".to_string(), vec![5], vec![4, 6])]);
        assert_eq!(names(&mut s, 20 * S), [("b".to_string(), vec![4, 6], vec![5])]);
        assert_eq!(names(&mut s, 25 * S), [("a".to_string(), vec![5], vec![4, 6])]);
    }

    #[test]
    fn a_joined_rank_is_missing_only_from_collectives_other_than_allreduce() {
        let t0 = Instant::now();
        let mut s = StallInspector::new(3, Some(S), None);
        s.saw("g", 0, t0);
        s.saw("g", 2, t0);
        s.saw("bc", 0, t0);
        let kind = |n: &str| if n == "bc" { Kind::Broadcast } else { Kind::Allreduce };
        let look = s.inspect(t0 + S, kind, &[false, true, false], &WORLD);
        let got: Vec<(&str, &str, Vec<usize>)> =
            look.reports.iter().map(|r| (r.name.as_str(), r.op, r.missing.clone())).collect();
        assert_eq!(got, [("bc", "broadcast", vec![5, 6])]);
    }

    #[test]
    fn past_the_shutdown_threshold_the_engine_fails_naming_the_missing_ranks() {
        let t0 = Instant::now();
        let mut s = StallInspector::new(3, None, Some(3 * S));
        s.saw("late", 1, t0);
        s.saw("later", 1, t0 + S);
        assert_eq!(s.next_look(), Some(Duration::from_millis(750)));
        let look = s.inspect(t0 + 2 * S, allreduce, &[false; 3], &WORLD);
        assert!(look.reports.is_empty() && look.fatal.is_none(), "no check threshold: no report");
        let look = s.inspect(t0 + 4 * S, allreduce, &[false; 3], &WORLD);
        match look.fatal {
            Some(Error::Timeout { op, ranks, waited, .. }) => {
                assert!(op.contains("allreduce 'late' (submitted by ranks [5]; stall shutdown after 3.0 s)"), "{op}");
                assert_eq!((ranks, waited), (vec![4, 6], 4 * S));
            }
            other => panic!("{other:?}"),
        }
        // Neither threshold: never.
        let mut off = StallInspector::new(2, None, None);
        off.saw("x", 0, t0);
        assert_eq!(off.next_look(), None);
        assert!(off.inspect(t0 + 1000 * S, allreduce, &[false; 2], &WORLD).reports.is_empty());
    }
}
