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
//! 2. Each tries to read every other member's word and to write into another, and publishes
//!    whether it could: unless all could, every collective takes two copies (one log line
//!    says so).
//!    The first member also says whether pipelined collectives go in pieces
//!    ([`Local::piece_elems`]), for all.
//! 3. The first member decides for all: from its cache (a file per user, boot, member count,
//!    slot size, whether the members have cores of their own, and build, under `/dev/shm`),
//!    or by timing broadcast, allgather and allreduce both ways at a few sizes (and
//!    broadcast a third way, the root writing a share, where the members have cores; within
//!    [`BUDGET`]; what the budget leaves untimed takes two copies, and the plan is cached all
//!    the same), and publishes its plan, which every member takes. So no two members can
//!    take different paths in one call, whatever each would have measured; a call's own path
//!    is also in its descriptor, as a second guard (not for the two-level allreduce's last
//!    host step, a broadcast: that call's descriptor says its first step's path).

use super::local;
use super::steps::Local;
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::transport::{CopyChoice, LocalArea};
use crate::types::{Algorithm, Call, CopyPlan, DType, Fold, OpDesc, Reduction, SizeRange};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The word whose address members publish, for the others to read.
static PROBE: u64 = u64::from_le_bytes(*b"FGCOPY01");
/// The word whose address members publish for the others to write into (the single-copy
/// broadcast and allgather write straight into members' buffers). Static: a member that
/// fails formation early may still be written into by a slower one.
static WRITE_PROBE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Marks the calibration's calls (their descriptors' `extra`).
const CALIBRATION: u64 = 0x6361_6c69_6272_6174;
/// Buffer sizes timed (bytes of the user's buffer; ascending, each 4 times the last).
const SIZES: [usize; 5] = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];
/// Bytes of calls timed per size, path and round (between 2 and 32 calls).
const CALL_BYTES: usize = 4 << 20;
/// Rounds, the two paths alternating (the fastest counts: one slow round of two copies at
/// 16 MiB, 2.0 ms against its usual 0.4-0.8, once made single copy look faster).
const ROUNDS: usize = 3;
/// The time the first member lets the timing take; past it, what is not measured takes two
/// copies.
pub(crate) const BUDGET: Duration = Duration::from_secs(1);
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
    // Whether this rank would cut pipelined collectives in pieces (it has a core to wait on):
    // the first member's say holds for all.
    let pieces = !comm.shared().spin.yield_cpu;
    const TOLD: std::ops::Range<usize> = 1..1 + CopyChoice::WORDS;
    const PIECES: usize = TOLD.end;
    const TARGET: usize = PIECES + 1;
    let t = l.step(|own: &mut [u64]| {
        own[0] = &raw const PROBE as u64;
        own[TOLD].copy_from_slice(&told);
        own[PIECES] = u64::from(pieces);
        own[TARGET] = WRITE_PROBE.as_ptr() as u64;
    })?;
    let pieces = t.read::<u64>(0, PIECES..PIECES + 1)[0] == 1;
    comm.shared().area_pieces.store(pieces, Ordering::Relaxed);
    if let Some(m) = (0..n).find(|&m| t.read::<u64>(m, TOLD) != told) {
        return Err(Error::Mismatch {
            rank: members[m],
            detail: format!(
                "rank {} of this host was told {} and rank {} {}: set FERROGLOO_SHM_SINGLE_COPY \
                 (ShmAttr::collective_copy) alike on every rank",
                members[m],
                CopyChoice::describe(t.read::<u64>(m, TOLD)),
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
        let wrote = t.write_member(m, t.read::<u64>(m, TARGET..TARGET + 1)[0], &PROBE.to_le_bytes());
        readable &= wrote.is_ok();
    }
    let t = t.next(|own: &mut [u64], _| own[0] = u64::from(readable))?;
    if let Some(m) = (0..n).find(|&m| t.read::<u64>(m, 0..1)[0] != 1) {
        if !REFUSAL_SAID.swap(true, Ordering::Relaxed) {
            tracing::info!(
                rank = members[m],
                "the kernel does not let ranks of this host read and write each other's memory \
                 (process_vm_readv and process_vm_writev; Yama's ptrace_scope or a container's rules): \
                 shared-memory collectives take two copies"
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
    let path = cache_path(n, area.slot_bytes(), pieces);
    let cached = if me == 0 { path.as_ref().and_then(load) } else { None };
    let t = t.next(|own: &mut [u64], _| {
        own[0] = u64::from(cached.is_some());
        own[1..1 + CopyPlan::WORDS].copy_from_slice(&cached.unwrap_or(CopyPlan::TWO).words());
    })?;
    if t.read::<u64>(0, 0..1)[0] == 1 {
        let plan = CopyPlan::from_words(plan_words(t.read::<u64>(0, 1..1 + CopyPlan::WORDS)));
        tracing::debug!(%plan, "shared-memory copy path (cached)");
        return Ok(plan);
    }
    drop(l);
    let began = Instant::now();
    let (times, whole) = time_paths(comm, area, deadline)?;
    let decided = decide(&times);
    let mut l = Local::new(comm, area, what, desc, deadline, timeout)?;
    let t = l.step(|own: &mut [u64]| own[..CopyPlan::WORDS].copy_from_slice(&decided.words()))?;
    let plan = CopyPlan::from_words(plan_words(t.read::<u64>(0, 0..CopyPlan::WORDS)));
    if me == 0 {
        tracing::debug!(
            %plan, ?times, whole, took = ?began.elapsed(),
            "shared-memory copy path (measured: seconds per call, two copies and one)"
        );
        // Cached even when the budget ran out (what was not timed takes two copies): a busy
        // host would otherwise pay the budget again for every context.
        if let Some(path) = &path {
            save(path, &plan);
        }
    }
    Ok(plan)
}

fn plan_words(w: &[u64]) -> [u64; CopyPlan::WORDS] {
    let mut out = [0; CopyPlan::WORDS];
    out.copy_from_slice(&w[..CopyPlan::WORDS]);
    out
}

/// The paths timed: two copies, single copy (every member reading), and for broadcast single
/// copy with the root writing a share (where the members have cores of their own).
const PATHS: usize = 3;

/// Seconds per call, by collective, size and path ([`PATHS`]; infinite where a path was not
/// timed), as the first member timed them (a call's time there includes the others': each
/// call's last step waits for every member), `None` where the budget ran out.
type Times = [[Option<[f64; PATHS]>; SIZES.len()]; OPS.len()];

/// Times every collective at every size both ways, the two paths alternating over
/// [`ROUNDS`] (the fastest round of each counts: a machine's state can change between runs
/// of seconds, not within the few milliseconds of a round). Returns whether all were timed.
fn time_paths(comm: &Comm, area: &dyn LocalArea, deadline: Instant) -> Result<(Times, bool)> {
    let (n, me) = (area.members().len(), area.me());
    let elems = SIZES[SIZES.len() - 1] / 4;
    // Written, every page (a zeroed allocation reads the kernel's one zero page, which no
    // user buffer does); zeros added stay zeros, so the sums cannot overflow.
    let (mut buf, mut out) = (vec![0f32; elems], vec![0f32; elems]);
    let mut input = vec![0f32; elems / n];
    for v in [&mut buf, &mut out, &mut input] {
        v.fill(-0.0);
    }
    let sum = Fold::Builtin(Reduction::Sum);
    // Only a root with a core of its own can copy while the others do.
    let split = comm.shared().area_pieces.load(Ordering::Relaxed);
    let start = Instant::now();
    let mut times: Times = [[None; SIZES.len()]; OPS.len()];
    for (o, op) in OPS.into_iter().enumerate() {
        let call = match op {
            Op::Broadcast => Call::Broadcast,
            Op::Allgather => Call::Allgather,
            Op::Allreduce => Call::Allreduce,
        };
        for (s, size) in SIZES.into_iter().enumerate() {
            let k = size / 4;
            // Enough calls that a small size's time is not one call's noise.
            let calls = (CALL_BYTES / size).clamp(2, 32) as u32;
            let mut best = [f64::INFINITY; PATHS];
            let paths = match op {
                Op::Broadcast if split => PATHS,
                _ => 2,
            };
            for round in 0..ROUNDS {
                for (p, best) in best.iter_mut().enumerate().take(paths) {
                    let (single, writes) = (p == 1, p == 2);
                    let desc = OpDesc::new(call)
                        .dtype(DType::F32)
                        .count(k)
                        .algo(Algorithm::SharedMemory)
                        .single_copy(single)
                        .root_writes(writes)
                        .extra(CALIBRATION);
                    let timeout = deadline.saturating_duration_since(Instant::now());
                    let mut l = Local::new(comm, area, "timing the shared-memory copy paths", desc, deadline, timeout)?;
                    // One call, timed. A broadcast's members first write their buffers and
                    // meet (untimed): a buffer a broadcast overwrites is usually the member's
                    // own data, in its cache, not the last call's copy; a root writing a share
                    // pays for that (measured: 5.2 us at 64 KiB where a fresh call took 3.4).
                    let mut once = |l: &mut Local<'_>| -> Result<Duration> {
                        let b = k / n;
                        if let Op::Broadcast = op {
                            if me != 0 {
                                buf[..k].fill(-0.0);
                            }
                            local::barrier(l)?;
                        }
                        let t = Instant::now();
                        match (op, p) {
                            (Op::Broadcast, 0) => local::broadcast(l, &mut buf[..k], 0),
                            (Op::Broadcast, _) => local::broadcast_single(l, &mut buf[..k], 0, writes),
                            (Op::Allgather, 0) => {
                                // As the collective does: the own block is the caller's (the
                                // single-copy path copies it itself).
                                out[me * b..(me + 1) * b].copy_from_slice(&input[..b]);
                                local::allgather(l, &input[..b], &mut out[..b * n])
                            }
                            (Op::Allgather, _) => local::allgather_single(l, &input[..b], &mut out[..b * n]),
                            (Op::Allreduce, 0) => local::allreduce(l, &mut buf[..k], &sum),
                            (Op::Allreduce, _) => local::allreduce_single(l, &mut buf[..k], &sum),
                        }?;
                        Ok(t.elapsed())
                    };
                    if round == 0 {
                        once(&mut l)?;
                    }
                    let mut spent = Duration::ZERO;
                    for _ in 0..calls {
                        spent += once(&mut l)?;
                    }
                    *best = best.min(spent.as_secs_f64() / f64::from(calls));
                    // The first member says whether to go on (all stop at the same point).
                    let go = start.elapsed() < BUDGET;
                    let t = l.step(|own: &mut [u64]| own[0] = u64::from(me != 0 || go))?;
                    if t.read::<u64>(0, 0..1)[0] == 0 {
                        return Ok((times, false));
                    }
                }
            }
            times[o][s] = Some(best);
        }
    }
    Ok((times, true))
}

/// Per collective, the sizes where single copy won (by [`MARGIN`]): the longest run of
/// consecutive sizes timed where it won (the first of equal runs), reaching halfway (in
/// ratio) to the neighbouring sizes where it lost, and on past the largest size when it won
/// there; from the smallest size timed at the least. Two copies where it never won, or where
/// nothing was timed. Broadcast's split sizes likewise, where the root writing a share beat
/// both other paths (a broadcast takes it first, so it may lie outside the single-copy run).
fn decide(times: &Times) -> CopyPlan {
    let range = |row: &[Option<[f64; PATHS]>; SIZES.len()], won: &dyn Fn(&[f64; PATHS]) -> bool| -> SizeRange {
        let wins: Vec<bool> = row.iter().map(|t| t.as_ref().is_some_and(won)).collect();
        let (mut best, mut at) = (0..0, 0);
        while at < wins.len() {
            let end = (at..wins.len()).find(|&j| !wins[j]).unwrap_or(wins.len());
            if end - at > best.len() {
                best = at..end;
            }
            at = end + 1;
        }
        if best.is_empty() {
            return SizeRange::NONE;
        }
        let mid = |a: usize, b: usize| ((a as f64) * (b as f64)).sqrt() as usize;
        let from = if best.start == 0 { SIZES[0] } else { mid(SIZES[best.start - 1], SIZES[best.start]) };
        let below = if best.end == SIZES.len() { usize::MAX } else { mid(SIZES[best.end - 1], SIZES[best.end]) };
        SizeRange { from, below }
    };
    // Reading where it beat two copies; the root's share where it beat both (taken first).
    let single = |[two, one, _]: &[f64; PATHS]| one < &(two * MARGIN);
    let split = |[two, one, split]: &[f64; PATHS]| *split < two.min(*one) * MARGIN;
    CopyPlan {
        broadcast: range(&times[0], &single),
        allgather: range(&times[1], &single),
        allreduce: range(&times[2], &single),
        broadcast_split: range(&times[0], &split),
    }
}

/// Where the first member keeps its host's plan: per user, boot, member count, slot size,
/// whether the members have cores of their own (only then is the root's share timed), and
/// build profile (a debug build's reductions are many times slower), in `/dev/shm` (gone at
/// reboot) or else the temporary directory.
fn cache_path(n: usize, slot_bytes: usize, cores: bool) -> Option<PathBuf> {
    let boot = crate::device::boot_id()?;
    let uid = nix::unistd::getuid();
    let build = if cfg!(debug_assertions) { "debug" } else { "release" };
    let dir = match std::path::Path::new("/dev/shm") {
        d if d.is_dir() => d.to_path_buf(),
        _ => std::env::temp_dir(),
    };
    let cores = if cores { "own" } else { "shared" };
    let name = format!(
        "ferrogloo-copy-plan-{}-u{uid}-{boot}-n{n}-s{slot_bytes}-cores-{cores}-{build}",
        env!("CARGO_PKG_VERSION")
    );
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
    <[u64; CopyPlan::WORDS]>::try_from(words).ok().map(CopyPlan::from_words)
}

/// Caches `plan` at `path` (written aside, then renamed over it: a reader never sees half).
/// The aside file is created new (`O_EXCL`, which follows no link another user left there).
fn save(path: &PathBuf, plan: &CopyPlan) {
    use std::io::Write;
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let text: Vec<String> = plan.words().iter().map(u64::to_string).collect();
    let mut name = path.as_os_str().to_os_string();
    name.push(format!(".{}.{}.tmp", std::process::id(), SAVES.fetch_add(1, Ordering::Relaxed)));
    let aside = PathBuf::from(name);
    let written = match std::fs::OpenOptions::new().write(true).create_new(true).open(&aside) {
        // Not ours to remove when it was there already.
        Err(e) => Err(e),
        Ok(mut f) => {
            let done = f.write_all((text.join(" ") + "\n").as_bytes()).and_then(|()| std::fs::rename(&aside, path));
            if done.is_err() {
                let _ = std::fs::remove_file(&aside);
            }
            done
        }
    };
    if let Err(e) = written {
        tracing::debug!(path = %path.display(), error = %e, "the shared-memory copy plan was not cached");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_copy_over_the_longest_run_of_sizes_where_it_won() {
        let (w, l) = (Some([2.0, 1.0, f64::INFINITY]), Some([1.0, 2.0, f64::INFINITY]));
        let bcast = |r: [Option<[f64; PATHS]>; 5]| decide(&[r, [l; 5], [None; 5]]).broadcast;
        let range = |from, below| SizeRange { from, below };
        assert_eq!(bcast([w; 5]), range(SIZES[0], usize::MAX));
        assert_eq!(bcast([l; 5]), SizeRange::NONE);
        // Won in the middle: from halfway (in ratio) below to halfway above.
        assert_eq!(bcast([l, w, w, l, l]), range(128 << 10, 2 << 20));
        assert_eq!(bcast([l, l, l, l, w]), range(8 << 20, usize::MAX));
        // The longer run counts; of equal runs, the first.
        assert_eq!(bcast([w, l, w, w, l]), range(512 << 10, 8 << 20));
        assert_eq!(bcast([w, l, w, l, l]), range(SIZES[0], 128 << 10));
        // Within the margin is no win; what was not timed is none either.
        assert_eq!(bcast([w, w, w, w, Some([1.0, 0.99, f64::INFINITY])]), range(SIZES[0], 8 << 20));
        assert_eq!(bcast([None; 5]), SizeRange::NONE);
        let all = decide(&[[w; 5], [l; 5], [None; 5]]);
        assert_eq!((all.allgather, all.allreduce), (SizeRange::NONE, SizeRange::NONE));
        assert_eq!(all.broadcast_split, SizeRange::NONE);
        for size in [0, 1000, (64 << 10) - 1] {
            assert!(!all.broadcast.contains(size), "{size}");
        }
    }

    /// The root's share where it beat both other paths (taken first); reading only where
    /// reading beat two copies.
    #[test]
    fn the_roots_share_where_it_beat_both_paths() {
        let inf = f64::INFINITY;
        // Two copies, reading, the root writing a share (microseconds): reading wins to 1
        // MiB, the share from 1 MiB (also at 4 MiB, where reading lost), then nothing by the
        // margin.
        let row = [
            Some([10.0, 3.0, 5.0]),
            Some([27.0, 9.0, 16.0]),
            Some([94.0, 50.0, 39.0]),
            Some([338.0, 425.0, 209.0]),
            Some([1340.0, 1800.0, 1320.0]),
        ];
        let plan = decide(&[row, [Some([1.0, 2.0, inf]); 5], [None; 5]]);
        assert_eq!(plan.broadcast, SizeRange { from: SIZES[0], below: 2 << 20 });
        assert_eq!(plan.broadcast_split, SizeRange { from: 512 << 10, below: 8 << 20 });
        assert_eq!(plan.broadcast_path(64 << 10), crate::types::BroadcastPath::Read);
        assert_eq!(plan.broadcast_path(4 << 20), crate::types::BroadcastPath::Split);
        // At 16 MiB the share's 1320 is within the margin of two copies' 1340: two copies.
        assert_eq!(plan.broadcast_path(16 << 20), crate::types::BroadcastPath::Two);
        // The share winning in two runs apart, reading in between only: reading is never taken
        // where it lost to two copies.
        let row = [
            Some([10.0, 12.0, 5.0]),
            Some([27.0, 9.0, 30.0]),
            Some([94.0, 100.0, 39.0]),
            Some([338.0, 425.0, 209.0]),
            Some([1340.0, 1800.0, 900.0]),
        ];
        let plan = decide(&[row, [Some([1.0, 2.0, inf]); 5], [None; 5]]);
        for (s, size) in SIZES.into_iter().enumerate() {
            let path = plan.broadcast_path(size);
            let [two, one, _] = row[s].unwrap_or([0.0; 3]);
            assert!(path != crate::types::BroadcastPath::Read || one < two, "{size}: {path:?}");
        }
        assert_eq!(plan.broadcast_split, SizeRange { from: 512 << 10, below: usize::MAX });
    }

    #[test]
    fn a_cached_plan_is_read_back_and_a_foreign_file_is_not() {
        let dir = std::env::temp_dir().join(format!("ferrogloo-calibrate-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let path = dir.join("plan");
        let plan = CopyPlan {
            broadcast: SizeRange { from: 65536, below: 1 << 24 },
            allgather: SizeRange::NONE,
            allreduce: SizeRange { from: 1 << 22, below: usize::MAX },
            broadcast_split: SizeRange { from: 1 << 19, below: usize::MAX },
        };
        save(&path, &plan);
        assert_eq!(load(&path), Some(plan));
        std::fs::write(&path, "1 2 3\n").expect("write");
        assert_eq!(load(&path), None);
        std::fs::write(&path, "x y z\n").expect("write");
        assert_eq!(load(&path), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
