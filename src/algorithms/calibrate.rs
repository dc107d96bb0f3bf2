//! Which copy path a host's shared-area collectives take ([`CopyPlan`]), decided as a context
//! forms.
//!
//! Two copies through the area's slots, or one straight from the owner's buffer
//! (`process_vm_readv`): which is faster depends on the machine (the kernel pins every page it
//! copies across processes; on one machine type that made single copy 3 to 4 times slower, on
//! another it halved a message's time). So the members measure both, unless the device was
//! told which ([`ShmCopy`](crate::device::ShmCopy)):
//!
//! 1. Every member publishes what it was told and the address of a known word; a member told
//!    otherwise than the others fails formation on every member ([`Error::Mismatch`]).
//! 2. Each tries to read every other member's word, and publishes whether it could: unless all
//!    could, every collective takes two copies (one log line says so).
//! 3. The first member decides for all: from its cache (a file per user, boot, member count,
//!    slot size and build, under `/dev/shm`), or by timing broadcast, allgather and allreduce
//!    both ways at a few sizes (within [`BUDGET`]), and publishes its plan, which every member
//!    takes. So no two members can take different paths in one call, whatever each would
//!    have measured; the path is also in every call's descriptor, as a second guard.

use super::local;
use super::steps::Local;
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::transport::{CopyChoice, LocalArea};
use crate::types::{Algorithm, Call, CopyPlan, DType, Fold, OpDesc, Reduction};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The word whose address members publish, for the others to read.
static PROBE: u64 = u64::from_le_bytes(*b"FGCOPY01");
/// Marks the calibration's calls (their descriptors' `extra`).
const CALIBRATION: u64 = 0x6361_6c69_6272_6174;
/// Buffer sizes timed (bytes of the user's buffer; ascending).
const SIZES: [usize; 3] = [64 << 10, 512 << 10, 4 << 20];
/// Timed calls per size and path (after one untimed).
const CALLS: u32 = 3;
/// The time the first member lets the timing take; past it, what is not measured takes two
/// copies and the plan is not cached (a later context measures again).
pub(crate) const BUDGET: Duration = Duration::from_millis(300);
/// Single copy is taken where it is at least this much faster (noise does not flip a path).
const MARGIN: f64 = 0.95;
/// Said once per process: the kernel refused single copies.
static REFUSAL_SAID: AtomicBool = AtomicBool::new(false);

/// The collectives timed, in [`CopyPlan`]'s order.
#[derive(Clone, Copy)]
enum Op {
    Broadcast,
    Allgather,
    Allreduce,
}

const OPS: [Op; 3] = [Op::Broadcast, Op::Allgather, Op::Allreduce];

/// The plan of this rank's host: every member of `area` calls this at the same point of
/// forming `comm`'s context, and every member gets the same plan (see the [module](self)).
pub(crate) fn copy_plan(comm: &Comm, area: &dyn LocalArea, deadline: Instant) -> Result<CopyPlan> {
    let timeout = deadline.saturating_duration_since(Instant::now());
    let what = "deciding the shared-memory copy path";
    let desc = OpDesc::new(Call::Barrier).extra(CALIBRATION);
    let mut l = Local::new(comm, area, what, desc, deadline, timeout)?;
    let (n, me, members) = (l.n(), l.me(), area.members());
    let choice = area.copy_choice();
    let told = choice.words();
    let t = l.step(|own: &mut [u64]| {
        own[0] = &raw const PROBE as u64;
        own[1..5].copy_from_slice(&told);
    })?;
    if let Some(m) = (0..n).find(|&m| t.read::<u64>(m, 1..5) != told) {
        return Err(Error::Mismatch {
            rank: members[m],
            detail: format!(
                "rank {} of this host was told {} and rank {} {}: set FERROGLOO_SHM_SINGLE_COPY \
                 (ShmAttr::collective_copy) alike on every rank",
                members[m],
                CopyChoice::describe(t.read::<u64>(m, 1..5)),
                members[me],
                CopyChoice::describe(&told)
            ),
        });
    }
    if choice == CopyChoice::Two {
        return Ok(CopyPlan::TWO);
    }
    let mut readable = true;
    for m in (0..n).filter(|&m| m != me) {
        let mut word = [0u8; 8];
        let read = t.read_member(m, t.read::<u64>(m, 0..1)[0], &mut word);
        readable &= read.is_ok() && u64::from_le_bytes(word) == PROBE;
    }
    let t = t.next(|own: &mut [u64], _| own[0] = u64::from(readable))?;
    if let Some(m) = (0..n).find(|&m| t.read::<u64>(m, 0..1)[0] != 1) {
        if !REFUSAL_SAID.swap(true, Ordering::Relaxed) {
            tracing::info!(
                rank = members[m],
                "the kernel does not let ranks of this host read each other's memory (process_vm_readv; \
                 Yama's ptrace_scope or a container's rules): shared-memory collectives take two copies"
            );
        }
        return Ok(CopyPlan::TWO);
    }
    match choice {
        CopyChoice::Single => return Ok(CopyPlan::SINGLE),
        CopyChoice::Given(plan) => return Ok(plan),
        CopyChoice::Measure | CopyChoice::Two => {}
    }
    // The first member decides: from its cache, or by timing both paths.
    let path = cache_path(n, area.slot_bytes());
    let cached = if me == 0 { path.as_ref().and_then(load) } else { None };
    let t = t.next(|own: &mut [u64], _| {
        own[0] = u64::from(cached.is_some());
        own[1..4].copy_from_slice(&cached.unwrap_or(CopyPlan::TWO).words());
    })?;
    if t.read::<u64>(0, 0..1)[0] == 1 {
        let plan = CopyPlan::from_words(first_three(t.read::<u64>(0, 1..4)));
        tracing::debug!(%plan, "shared-memory copy path (cached)");
        return Ok(plan);
    }
    drop(l);
    let (times, whole) = time_paths(comm, area, deadline)?;
    let decided = decide(&times);
    let mut l = Local::new(comm, area, what, desc, deadline, timeout)?;
    let t = l.step(|own: &mut [u64]| own[..3].copy_from_slice(&decided.words()))?;
    let plan = CopyPlan::from_words(first_three(t.read::<u64>(0, 0..3)));
    if me == 0 {
        tracing::debug!(%plan, ?times, "shared-memory copy path (measured: seconds per call, two copies and one)");
        if let (true, Some(path)) = (whole, &path) {
            save(path, &plan);
        }
    }
    Ok(plan)
}

fn first_three(w: &[u64]) -> [u64; 3] {
    [w[0], w[1], w[2]]
}

/// Seconds per call, by collective, size and path (two copies, then one), as the first member
/// timed them (a call's time there includes the others': each call's last step waits for
/// every member), `None` where the budget ran out; and whether all were timed.
type Times = [[Option<[f64; 2]>; SIZES.len()]; OPS.len()];

fn time_paths(comm: &Comm, area: &dyn LocalArea, deadline: Instant) -> Result<(Times, bool)> {
    let (n, me) = (area.members().len(), area.me());
    let elems = SIZES[SIZES.len() - 1] / 4;
    let (mut buf, mut out) = (vec![0f32; elems], vec![0f32; elems]);
    let input = vec![0f32; elems / n];
    let sum = Fold::Builtin(Reduction::Sum);
    let start = Instant::now();
    let mut times: Times = [[None; SIZES.len()]; OPS.len()];
    for (o, op) in OPS.into_iter().enumerate() {
        for (s, size) in SIZES.into_iter().enumerate() {
            let k = size / 4;
            let mut pair = [0.0; 2];
            for (p, single) in [false, true].into_iter().enumerate() {
                let call = match op {
                    Op::Broadcast => Call::Broadcast,
                    Op::Allgather => Call::Allgather,
                    Op::Allreduce => Call::Allreduce,
                };
                let desc = OpDesc::new(call)
                    .dtype(DType::F32)
                    .count(k)
                    .algo(Algorithm::SharedMemory)
                    .single_copy(single)
                    .extra(CALIBRATION);
                let timeout = deadline.saturating_duration_since(Instant::now());
                let mut l = Local::new(comm, area, "timing the shared-memory copy paths", desc, deadline, timeout)?;
                let mut once = |l: &mut Local<'_>| -> Result<()> {
                    let b = k / n;
                    match (op, single) {
                        (Op::Broadcast, false) => local::broadcast(l, &mut buf[..k], 0),
                        (Op::Broadcast, true) => local::broadcast_single(l, &mut buf[..k], 0),
                        (Op::Allgather, false) => local::allgather(l, &input[..b], &mut out[..b * n]),
                        (Op::Allgather, true) => local::allgather_single(l, &input[..b], &mut out[..b * n]),
                        (Op::Allreduce, false) => local::allreduce(l, &mut buf[..k], &sum),
                        (Op::Allreduce, true) => local::allreduce_single(l, &mut buf[..k], &sum),
                    }
                };
                once(&mut l)?;
                let t = Instant::now();
                for _ in 0..CALLS {
                    once(&mut l)?;
                }
                pair[p] = t.elapsed().as_secs_f64() / f64::from(CALLS);
                // The first member says whether to go on (all stop at the same point).
                let go = start.elapsed() < BUDGET;
                let t = l.step(|own: &mut [u64]| own[0] = u64::from(me != 0 || go))?;
                if t.read::<u64>(0, 0..1)[0] == 0 {
                    return Ok((times, false));
                }
            }
            times[o][s] = Some(pair);
        }
    }
    Ok((times, true))
}

/// Per collective, the smallest size from which single copy won at every size timed (by
/// [`MARGIN`]); two copies where it lost at the largest, or where nothing was timed.
fn decide(times: &Times) -> CopyPlan {
    let threshold = |row: &[Option<[f64; 2]>; SIZES.len()]| -> Option<usize> {
        let wins: Vec<bool> = row.iter().map(|t| t.is_some_and(|[two, one]| one < two * MARGIN)).collect();
        let from = wins.iter().rposition(|w| !w).map_or(0, |i| i + 1);
        SIZES.get(from).copied()
    };
    CopyPlan { broadcast: threshold(&times[0]), allgather: threshold(&times[1]), allreduce: threshold(&times[2]) }
}

/// Where the first member keeps its host's plan: per user, boot, member count, slot size and
/// build profile (a debug build's reductions are many times slower), in `/dev/shm` (gone at
/// reboot) or else the temporary directory.
fn cache_path(n: usize, slot_bytes: usize) -> Option<PathBuf> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let uid = nix::unistd::getuid();
    let build = if cfg!(debug_assertions) { "debug" } else { "release" };
    let dir = match std::path::Path::new("/dev/shm") {
        d if d.is_dir() => d.to_path_buf(),
        _ => std::env::temp_dir(),
    };
    let name =
        format!("ferrogloo-copy-plan-{}-u{uid}-{}-n{n}-s{slot_bytes}-{build}", env!("CARGO_PKG_VERSION"), boot.trim());
    Some(dir.join(name))
}

/// The plan cached at `path`, if this user wrote one there.
fn load(path: &PathBuf) -> Option<CopyPlan> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !meta.is_file() || meta.uid() != nix::unistd::getuid().as_raw() {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let words: Vec<u64> = text.split_whitespace().map(|w| w.parse().ok()).collect::<Option<_>>()?;
    <[u64; 3]>::try_from(words).ok().map(CopyPlan::from_words)
}

/// Caches `plan` at `path` (written aside, then renamed over it: a reader never sees half).
fn save(path: &PathBuf, plan: &CopyPlan) {
    let [a, b, c] = plan.words();
    let aside = path.with_extension(format!("{}.tmp", std::process::id()));
    let written = std::fs::write(&aside, format!("{a} {b} {c}\n")).and_then(|()| std::fs::rename(&aside, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&aside);
        tracing::debug!(path = %path.display(), error = %e, "the shared-memory copy plan was not cached");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_copy_from_the_smallest_size_after_its_last_loss() {
        let (win, lose) = (Some([2.0, 1.0]), Some([1.0, 2.0]));
        let row = |r: [Option<[f64; 2]>; 3]| decide(&[r, [lose; 3], [None; 3]]).broadcast;
        assert_eq!(row([win, win, win]), Some(SIZES[0]));
        assert_eq!(row([lose, win, win]), Some(SIZES[1]));
        assert_eq!(row([win, lose, win]), Some(SIZES[2]));
        assert_eq!(row([win, win, lose]), None);
        // Within the margin is no win; what was not timed is none either.
        assert_eq!(row([win, win, Some([1.0, 0.99])]), None);
        assert_eq!(row([win, win, None]), None);
        let all = decide(&[[win; 3], [lose; 3], [None; 3]]);
        assert_eq!((all.allgather, all.allreduce), (None, None));
    }

    #[test]
    fn a_cached_plan_is_read_back_and_a_foreign_file_is_not() {
        let dir = std::env::temp_dir().join(format!("ferrogloo-calibrate-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let path = dir.join("plan");
        let plan = CopyPlan { broadcast: Some(65536), allgather: None, allreduce: Some(1 << 22) };
        save(&path, &plan);
        assert_eq!(load(&path), Some(plan));
        std::fs::write(&path, "1 2\n").expect("write");
        assert_eq!(load(&path), None);
        std::fs::write(&path, "x y z\n").expect("write");
        assert_eq!(load(&path), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
