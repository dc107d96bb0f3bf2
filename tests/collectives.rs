//! Every collective and algorithm against a plain sequential reference: random world sizes
//! 1..=9, element counts from 0 to a few thousand (including fewer than ranks, and odd), every
//! element type and reduction, with ranks as threads.

mod common;

use common::{TIMEOUT, all_ok, run_ranks, run_ranks_on, run_ranks_with};
use ferrogloo::device::{CopyPlan, Device, ShmAttr, ShmCopy, SizeRange, TcpAttr};
use ferrogloo::rendezvous::HashStore;
use ferrogloo::{Algorithm, CollectiveOptions, Context, Element, Error, Reduction, bf16, f16};
use proptest::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Values for the tests: small integers, so float sums and products are exact in every order
/// (the algorithms reduce in different orders; exact values make the reference unambiguous).
trait Val: Element + PartialEq {
    fn small(i: i64) -> Self;
}
macro_rules! val {
    ($($t:ty: $e:expr),*) => {$( impl Val for $t { fn small(i: i64) -> Self { let f: fn(i64) -> $t = $e; f(i) } } )*};
}
val!(i8: |i| i as i8, i16: |i| i as i16, i32: |i| i as i32, i64: |i| i, u8: |i| i as u8, u16: |i| i as u16,
     u32: |i| i as u32, u64: |i| i as u64, f32: |i| i as f32, f64: |i| i as f64,
     f16: |i| f16::from_f32(i as f32), bf16: |i| bf16::from_f32(i as f32));

/// A deterministic value for (seed, rank, index) in -2..=2 (products stay powers of two).
fn value<T: Val>(seed: u64, rank: usize, i: usize) -> T {
    let mut h =
        seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 31;
    h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
    T::small((h >> 40) as i64 % 5 - 2)
}

fn input<T: Val>(seed: u64, rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| value(seed, rank, i)).collect()
}

/// A per-rank count derived from the seed (the same on every rank).
fn count_for(seed: u64, who: usize, max: usize) -> usize {
    (seed.wrapping_mul(31).wrapping_add(who as u64 * 7919) % (max as u64 + 1)) as usize
}

#[derive(Debug, Clone, Copy)]
enum Red {
    Sum,
    Product,
    Min,
    Max,
    Custom,
}

/// The built-in reduction of `r`; `None` for the custom fold ([`custom_max`]).
fn op_of(r: Red) -> Option<Reduction> {
    match r {
        Red::Sum => Some(Reduction::Sum),
        Red::Product => Some(Reduction::Product),
        Red::Min => Some(Reduction::Min),
        Red::Max => Some(Reduction::Max),
        Red::Custom => None,
    }
}

/// Max, written by hand: the custom fold of the `*_custom` calls.
fn custom_max<T: Val>(acc: &mut [T], x: &[T]) {
    for (a, b) in acc.iter_mut().zip(x) {
        if *b > *a {
            *a = *b;
        }
    }
}

/// The plain sequential reference: fold ranks 0..n in order.
fn reference<T: Val>(r: Red, inputs: &[Vec<T>]) -> Vec<T> {
    let mut acc = inputs[0].clone();
    for x in &inputs[1..] {
        for (a, &b) in acc.iter_mut().zip(x) {
            *a = match r {
                Red::Sum => T::add(*a, b),
                Red::Product => T::mul(*a, b),
                Red::Min => {
                    if b < *a {
                        b
                    } else {
                        *a
                    }
                }
                Red::Max | Red::Custom => {
                    if b > *a {
                        b
                    } else {
                        *a
                    }
                }
            };
        }
    }
    acc
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Allreduce(Algorithm),
    AllreduceMulti,
    /// `allreduce_many` of the rank's input cut into 0 to 40 parts (some empty), cut
    /// differently on every rank.
    AllreduceMany(Algorithm),
    Reduce,
    ReduceScatter,
    ReduceScatterV,
    Allgather(Algorithm),
    AllgatherV(Algorithm),
    Broadcast(Algorithm),
    Gather,
    GatherV,
    Scatter,
    Alltoall,
    AlltoallV,
    Barrier,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    kind: Kind,
    dtype: u8,
    count: usize,
    root: usize,
    red: Red,
    seed: u64,
    segment: usize,
}

fn case() -> impl Strategy<Value = Case> {
    let kind = prop_oneof![
        Just(Kind::Allreduce(Algorithm::Auto)),
        Just(Kind::Allreduce(Algorithm::Ring)),
        Just(Kind::Allreduce(Algorithm::HalvingDoubling)),
        Just(Kind::Allreduce(Algorithm::RecursiveDoubling)),
        Just(Kind::AllreduceMulti),
        Just(Kind::AllreduceMany(Algorithm::Auto)),
        Just(Kind::AllreduceMany(Algorithm::Ring)),
        Just(Kind::AllreduceMany(Algorithm::RecursiveDoubling)),
        Just(Kind::Reduce),
        Just(Kind::ReduceScatter),
        Just(Kind::ReduceScatterV),
        Just(Kind::Allgather(Algorithm::Auto)),
        Just(Kind::Allgather(Algorithm::Ring)),
        Just(Kind::Allgather(Algorithm::RecursiveDoubling)),
        Just(Kind::AllgatherV(Algorithm::Auto)),
        Just(Kind::AllgatherV(Algorithm::RecursiveDoubling)),
        Just(Kind::Broadcast(Algorithm::BinomialTree)),
        Just(Kind::Broadcast(Algorithm::Pipeline)),
        Just(Kind::Broadcast(Algorithm::Auto)),
        Just(Kind::Gather),
        Just(Kind::GatherV),
        Just(Kind::Scatter),
        Just(Kind::Alltoall),
        Just(Kind::AlltoallV),
        Just(Kind::Barrier),
    ];
    let red = prop_oneof![Just(Red::Sum), Just(Red::Product), Just(Red::Min), Just(Red::Max), Just(Red::Custom)];
    let count = prop_oneof![0usize..=1, 0usize..=12, 0usize..=3000];
    (kind, 0u8..12, count, any::<usize>(), red, any::<u64>(), prop_oneof![Just(8usize), 16usize..=512, Just(256 << 10)])
        .prop_map(|(kind, dtype, count, root, red, seed, segment)| Case {
            kind,
            dtype,
            count,
            root,
            red,
            seed,
            segment,
        })
}

/// Runs one case on this rank, checks its result, returns a digest of reduced results (for the
/// bit-equality check across ranks).
fn run_case<T: Val>(ctx: &Context, c: &Case) -> ferrogloo::Result<Vec<u8>> {
    let (r, n) = (ctx.rank(), ctx.size());
    let root = c.root % n;
    let opts = CollectiveOptions::new().segment_bytes(c.segment);
    let all: Vec<Vec<T>> = (0..n).map(|p| input(c.seed, p, c.count)).collect();
    let mine = all[r].clone();
    let op = op_of(c.red);
    // The calls without a custom form run the custom cases as the built-in max they equal.
    let builtin = op.unwrap_or(Reduction::Max);
    let mut digest = Vec::new();
    let ctxt = format!("{c:?} on rank {r} of {n}");
    match c.kind {
        Kind::Allreduce(a) => {
            let mut buf = mine;
            let opts = opts.clone().algorithm(a);
            match op {
                Some(op) => ctx.allreduce_with(&mut buf, op, &opts)?,
                None => ctx.allreduce_custom(&mut buf, &custom_max::<T>, &opts)?,
            }
            assert!(buf == reference(c.red, &all), "{ctxt}");
            digest = bytemuck::cast_slice(&buf).to_vec();
        }
        Kind::AllreduceMany(a) => {
            // Cut points from the seed and the rank: the parts differ between ranks, the whole
            // does not.
            let k = (c.seed % 41) as usize;
            let k = if c.count > 0 { k.max(1) } else { k };
            let mut cuts: Vec<usize> = (1..k).map(|j| count_for(c.seed ^ j as u64, r, c.count)).collect();
            cuts.sort_unstable();
            let mut buf = mine.clone();
            let mut parts: Vec<&mut [T]> = Vec::with_capacity(k);
            let mut rest: &mut [T] = &mut buf;
            let mut at = 0;
            for &cut in cuts.iter().chain(std::iter::once(&c.count)).take(k) {
                let (part, tail) = std::mem::take(&mut rest).split_at_mut(cut - at);
                parts.push(part);
                rest = tail;
                at = cut;
            }
            assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), c.count, "{ctxt}");
            ctx.allreduce_many(&mut parts, builtin, &opts.clone().algorithm(a))?;
            assert!(buf == reference(c.red, &all), "{ctxt}");
            digest = bytemuck::cast_slice(&buf).to_vec();
        }
        Kind::AllreduceMulti => {
            let second = input::<T>(c.seed ^ 1, r, c.count);
            let mut out1 = vec![T::small(0); c.count];
            let mut out2 = vec![T::small(0); c.count];
            ctx.allreduce_multi(&[&mine, &second], &mut [&mut out1, &mut out2], builtin, &opts)?;
            let both: Vec<Vec<T>> = (0..n).flat_map(|p| [all[p].clone(), input(c.seed ^ 1, p, c.count)]).collect();
            let want = reference(c.red, &both);
            assert!(out1 == want && out2 == want, "{ctxt}");
            digest = bytemuck::cast_slice(&out1).to_vec();
        }
        Kind::Reduce => {
            let mut buf = mine.clone();
            match op {
                Some(op) => ctx.reduce(&mut buf, root, op, &opts)?,
                None => ctx.reduce_custom(&mut buf, root, &custom_max::<T>, &opts)?,
            }
            let want = if r == root { reference(c.red, &all) } else { mine };
            assert!(buf == want, "{ctxt}");
        }
        Kind::ReduceScatter | Kind::ReduceScatterV => {
            let counts: Vec<usize> = match c.kind {
                Kind::ReduceScatter => vec![c.count / n.max(1); n],
                _ => (0..n).map(|p| count_for(c.seed, p, c.count / n.max(1) + 3)).collect(),
            };
            let total: usize = counts.iter().sum();
            let inputs: Vec<Vec<T>> = (0..n).map(|p| input(c.seed, p, total)).collect();
            let mut out = vec![T::small(0); counts[r]];
            match (c.kind, op) {
                (Kind::ReduceScatter, Some(op)) => ctx.reduce_scatter(&inputs[r], &mut out, op, &opts)?,
                (Kind::ReduceScatter, None) => {
                    ctx.reduce_scatter_custom(&inputs[r], &mut out, &custom_max::<T>, &opts)?
                }
                _ => ctx.reduce_scatterv(&inputs[r], &mut out, &counts, builtin, &opts)?,
            }
            let start: usize = counts[..r].iter().sum();
            assert!(out[..] == reference(c.red, &inputs)[start..start + counts[r]], "{ctxt}");
            let fresh = input::<T>(c.seed, r, total);
            let untouched: &[u8] = bytemuck::cast_slice(&fresh);
            assert!(bytemuck::cast_slice::<T, u8>(&inputs[r]) == untouched, "{ctxt}: the input was written");
        }
        Kind::Allgather(a) | Kind::AllgatherV(a) => {
            let counts: Vec<usize> = match c.kind {
                Kind::Allgather(_) => vec![c.count; n],
                _ => (0..n).map(|p| count_for(c.seed, p, c.count)).collect(),
            };
            let inputs: Vec<Vec<T>> = (0..n).map(|p| input(c.seed, p, counts[p])).collect();
            let mut out = vec![T::small(0); counts.iter().sum()];
            let opts = opts.clone().algorithm(a);
            if matches!(c.kind, Kind::Allgather(_)) {
                ctx.allgather(&inputs[r], &mut out, &opts)?;
            } else {
                ctx.allgatherv(&inputs[r], &mut out, &counts, &opts)?;
            }
            assert!(out == inputs.concat(), "{ctxt}");
        }
        Kind::Broadcast(a) => {
            let mut buf = mine;
            ctx.broadcast(&mut buf, root, &opts.clone().algorithm(a))?;
            assert!(buf == all[root], "{ctxt}");
        }
        Kind::Gather | Kind::GatherV => {
            let counts: Vec<usize> = match c.kind {
                Kind::Gather => vec![c.count; n],
                _ => (0..n).map(|p| count_for(c.seed, p, c.count)).collect(),
            };
            let inputs: Vec<Vec<T>> = (0..n).map(|p| input(c.seed, p, counts[p])).collect();
            let mut out = if r == root { vec![T::small(0); counts.iter().sum()] } else { Vec::new() };
            if matches!(c.kind, Kind::Gather) {
                ctx.gather(&inputs[r], &mut out, root, &opts)?;
            } else {
                ctx.gatherv(&inputs[r], &mut out, &counts, root, &opts)?;
            }
            if r == root {
                assert!(out == inputs.concat(), "{ctxt}");
            }
        }
        Kind::Scatter => {
            let src: Vec<T> = input(c.seed, root, c.count * n);
            let mut out = vec![T::small(0); c.count];
            ctx.scatter(if r == root { &src } else { &[] }, &mut out, root, &opts)?;
            assert!(out[..] == src[r * c.count..(r + 1) * c.count], "{ctxt}");
        }
        Kind::Alltoall | Kind::AlltoallV => {
            // counts[p][q]: elements rank p sends to rank q.
            let counts: Vec<Vec<usize>> = (0..n)
                .map(|p| {
                    (0..n)
                        .map(|q| match c.kind {
                            Kind::Alltoall => c.count / n.max(1),
                            _ => count_for(c.seed ^ (p as u64 * 131), q, c.count / n.max(1) + 2),
                        })
                        .collect()
                })
                .collect();
            let inputs: Vec<Vec<T>> = (0..n).map(|p| input(c.seed, p, counts[p].iter().sum())).collect();
            let recv_counts: Vec<usize> = (0..n).map(|p| counts[p][r]).collect();
            let mut out = vec![T::small(0); recv_counts.iter().sum()];
            if matches!(c.kind, Kind::Alltoall) {
                ctx.alltoall(&inputs[r], &mut out, &opts)?;
            } else {
                ctx.alltoallv(&inputs[r], &counts[r], &mut out, &recv_counts, &opts)?;
            }
            let want: Vec<T> = (0..n)
                .flat_map(|p| {
                    let start: usize = counts[p][..r].iter().sum();
                    inputs[p][start..start + counts[p][r]].to_vec()
                })
                .collect();
            assert!(out == want, "{ctxt}");
        }
        Kind::Barrier => ctx.barrier_with(&opts)?,
    }
    Ok(digest)
}

fn dispatch(ctx: &Context, c: &Case) -> ferrogloo::Result<Vec<u8>> {
    match c.dtype {
        0 => run_case::<f32>(ctx, c),
        1 => run_case::<f64>(ctx, c),
        2 => run_case::<f16>(ctx, c),
        3 => run_case::<bf16>(ctx, c),
        4 => run_case::<i8>(ctx, c),
        5 => run_case::<i16>(ctx, c),
        6 => run_case::<i32>(ctx, c),
        7 => run_case::<i64>(ctx, c),
        8 => run_case::<u8>(ctx, c),
        9 => run_case::<u16>(ctx, c),
        10 => run_case::<u32>(ctx, c),
        _ => run_case::<u64>(ctx, c),
    }
}

/// The transports the plans run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dev {
    /// TCP over loopback.
    Tcp,
    /// Shared memory: `Auto` runs the shared-memory collectives (their copy path measured).
    Shm,
    /// Shared memory, its collectives forced to read peers' buffers straight (single copy).
    ShmSingle,
    /// Shared memory, its collectives forced through the area's slots (two copies).
    ShmTwo,
    /// Shared memory with a given copy plan whose thresholds lie among the plans' sizes
    /// ([`THRESHOLDS`]): calls on both sides of each.
    ShmGiven,
    /// Auto devices on two pretend hosts: shared memory within each, TCP across.
    Mixed,
    /// The ibverbs transport on the simulated verbs provider.
    #[cfg(feature = "ibverbs")]
    IbverbsSim,
    /// Shared memory within two pretend hosts, simulated ibverbs across (hierarchical
    /// allreduce over RDMA).
    #[cfg(feature = "ibverbs")]
    IbverbsMixed,
}

/// [`Dev::ShmGiven`]'s plan: the sizes (bytes) at which each collective reads straight, their
/// ends among the plans' sizes (which reach 24,000 bytes).
const THRESHOLDS: CopyPlan = CopyPlan {
    broadcast: SizeRange { from: 1000, below: usize::MAX },
    allgather: SizeRange { from: 0, below: 2048 },
    allreduce: SizeRange { from: 4000, below: 12_000 },
    broadcast_split: SizeRange { from: 8192, below: 20_000 },
};

/// A single-copy broadcast whose root writes its share cuts each member's buffer at a page
/// (bytes / n, in whole pages) and a single-copy allgather pushes its input in pieces of 256
/// KiB: sizes on both sides of both, every root, element types of 1, 4 and 8 bytes, against
/// the sequential reference on every rank.
#[test]
fn split_broadcasts_and_pushed_allgathers_are_right_on_both_sides_of_their_cuts() {
    let plan = CopyPlan { broadcast_split: SizeRange::ALL, ..CopyPlan::SINGLE };
    let dev = || Ok(Device::shared_memory(&ShmAttr { collective_copy: ShmCopy::Given(plan), ..ShmAttr::default() }));
    fn check<T: Element + PartialEq + std::fmt::Debug>(ctx: &Context, from: impl Fn(usize, usize) -> T) {
        let (n, me) = (ctx.size(), ctx.rank());
        let page = 4096 / std::mem::size_of::<T>();
        let piece = (256 << 10) / std::mem::size_of::<T>();
        let lens = [0, 1, page - 1, page, page + 1, n * page - 1, n * page, n * page + 1, 3 * n * page + 7, piece + 1];
        for len in lens {
            for root in 0..n {
                let mut buf: Vec<T> =
                    (0..len).map(|i| if me == root { from(root, i) } else { from(n + 1, i) }).collect();
                ctx.broadcast(&mut buf, root, &CollectiveOptions::default()).expect("broadcast");
                assert!(
                    buf.iter().enumerate().all(|(i, v)| *v == from(root, i)),
                    "broadcast of {len} from {root}, rank {me}"
                );
            }
            let input: Vec<T> = (0..len).map(|i| from(me, i)).collect();
            let mut out = vec![from(n + 1, 0); len * n];
            ctx.allgather(&input, &mut out, &CollectiveOptions::default()).expect("allgather");
            for m in 0..n {
                assert!(
                    out[m * len..(m + 1) * len].iter().enumerate().all(|(i, v)| *v == from(m, i)),
                    "allgather of {len} per rank, block {m}, rank {me}"
                );
            }
        }
        // 2.5 pieces per rank: whole pieces and a part.
        let len = piece * 5 / 2;
        let input: Vec<T> = (0..len).map(|i| from(me, i)).collect();
        let mut out = vec![from(n + 1, 0); len * n];
        ctx.allgather(&input, &mut out, &CollectiveOptions::default()).expect("allgather");
        assert!((0..n * len).all(|j| out[j] == from(j / len, j % len)), "allgather of {len} per rank, rank {me}");
    }
    for n in [2usize, 3, 4] {
        let store = HashStore::new();
        all_ok(run_ranks_on(
            n,
            &store,
            &dev,
            |b| b.timeout(TIMEOUT),
            |ctx| {
                assert_eq!(ctx.copy_plan(), Some(plan));
                check::<u8>(&ctx, |r, i| (r * 31 + i * 7) as u8);
                check::<f32>(&ctx, |r, i| (r * 1_000_003 + i) as f32);
                check::<u64>(&ctx, |r, i| ((r as u64) << 40) + i as u64);
                Ok(())
            },
        ));
    }
}

/// The single-copy allreduce of parts reads straight from the others' parts however each rank
/// cuts the whole: rank 0 into more parts than its slot can list (140,000: it gathers them
/// into a buffer of its own and the others read that), rank 1 into 23,000 parts with empty
/// ones among them (more runs than one system call takes, on both sides of a read: 20,000
/// of one element in a row), rank 2
/// passes one buffer to `allreduce_with` (the same path: no `Mismatch`). Every rank gets the
/// sequential sum.
#[test]
fn single_copy_allreduce_of_parts_reads_straight_from_parts_cut_any_way() {
    let dev = || {
        Ok(Device::shared_memory(&ShmAttr { collective_copy: ShmCopy::Given(CopyPlan::SINGLE), ..ShmAttr::default() }))
    };
    let len = 150_000usize;
    let data = |p: usize, i: usize| (i as i64) * 3 + (p as i64) * 1_000_003;
    for n in [2usize, 3] {
        let store = HashStore::new();
        all_ok(run_ranks_on(
            n,
            &store,
            &dev,
            |b| b.timeout(TIMEOUT),
            |ctx| {
                let r = ctx.rank();
                let mut v: Vec<i64> = (0..len).map(|i| data(r, i)).collect();
                let opts = CollectiveOptions::default();
                match r {
                    0 => {
                        let (ones, rest) = v.split_at_mut(140_000);
                        let mut parts: Vec<&mut [i64]> = ones.chunks_mut(1).collect();
                        parts.push(rest);
                        ctx.allreduce_many(&mut parts, Reduction::Sum, &opts)?;
                    }
                    1 => {
                        let mut parts: Vec<&mut [i64]> = Vec::new();
                        let mut rest: &mut [i64] = &mut v;
                        for j in 0..22_999 {
                            let k = if j < 20_000 { 1 } else { j % 7 * 5 };
                            let (part, tail) = std::mem::take(&mut rest).split_at_mut(k);
                            parts.push(part);
                            rest = tail;
                        }
                        parts.push(rest);
                        ctx.allreduce_many(&mut parts, Reduction::Sum, &opts)?;
                    }
                    _ => ctx.allreduce_with(&mut v, Reduction::Sum, &opts)?,
                }
                let bad = (0..len).find(|&i| v[i] != (0..n).map(|p| data(p, i)).sum::<i64>());
                assert_eq!(bad, None, "rank {r} of {n}: the first element that differs from the sum");
                Ok(())
            },
        ));
    }
}

/// A member whose call failed (it timed out waiting for a late rank) gets its buffers back
/// untouched: the late rank of a single-copy broadcast (the root, which writes a share) or
/// allgather (which pushes its input) writes nothing into them once the member has left
/// (it withdrew), and its own call fails instead.
#[test]
fn a_member_that_left_a_call_is_not_written_into_by_a_late_rank() {
    use std::sync::{Mutex, mpsc};
    use std::time::Duration;
    let plan = CopyPlan { broadcast_split: SizeRange::ALL, ..CopyPlan::SINGLE };
    let dev = || Ok(Device::shared_memory(&ShmAttr { collective_copy: ShmCopy::Given(plan), ..ShmAttr::default() }));
    let len = 1 << 18;
    for op in ["broadcast", "allgather"] {
        // Rank 1 says it has left (and refilled its buffers); rank 0 says it is done.
        let (left_tx, left_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let (left_tx, left_rx, done_tx, done_rx) =
            (Mutex::new(left_tx), Mutex::new(left_rx), Mutex::new(done_tx), Mutex::new(done_rx));
        let store = HashStore::new();
        let results = run_ranks_on(
            2,
            &store,
            &dev,
            |b| b.timeout(TIMEOUT),
            |ctx| {
                let call = |buf: &mut Vec<f32>, out: &mut Vec<f32>, opts: &CollectiveOptions| match op {
                    "broadcast" => ctx.broadcast(buf, 0, opts),
                    _ => ctx.allgather(&buf.clone(), out, opts),
                };
                let (mut buf, mut out) = (vec![ctx.rank() as f32 + 1.0; len], vec![0f32; 2 * len]);
                if ctx.rank() == 1 {
                    let quick = CollectiveOptions { timeout: Some(Duration::from_millis(300)), ..Default::default() };
                    let early = call(&mut buf, &mut out, &quick);
                    assert!(matches!(early, Err(Error::Timeout { .. })), "{op}: {early:?}");
                    buf.fill(-7.0);
                    out.fill(-7.0);
                    left_tx.lock().unwrap().send(()).unwrap();
                    done_rx.lock().unwrap().recv_timeout(TIMEOUT).expect("rank 0 is done");
                    assert!(buf.iter().all(|&v| v == -7.0), "{op}: rank 0 wrote into rank 1's buffer after it left");
                    assert!(out.iter().all(|&v| v == -7.0), "{op}: rank 0 wrote into rank 1's output after it left");
                } else {
                    left_rx.lock().unwrap().recv_timeout(TIMEOUT).expect("rank 1 has left");
                    let late = call(&mut buf, &mut out, &CollectiveOptions::default());
                    done_tx.lock().unwrap().send(()).unwrap();
                    assert!(late.is_err(), "{op}: the late rank's call succeeded");
                }
                Ok(())
            },
        );
        all_ok(results);
    }
}

fn device(dev: Dev) -> ferrogloo::Result<Device> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    match dev {
        Dev::Tcp => Device::tcp(&TcpAttr::loopback()),
        Dev::Shm => Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        Dev::ShmSingle | Dev::ShmTwo | Dev::ShmGiven => {
            let copy = match dev {
                Dev::ShmSingle => ShmCopy::Single,
                Dev::ShmTwo => ShmCopy::Two,
                _ => ShmCopy::Given(THRESHOLDS),
            };
            Ok(Device::shared_memory(&ShmAttr { collective_copy: copy, ..ShmAttr::default() }))
        }
        Dev::Mixed => {
            let host = NEXT.fetch_add(1, Ordering::Relaxed) % 2;
            Device::auto(&TcpAttr::loopback()).map(|d| d.on_host(format!("pretend-host-{host}")))
        }
        #[cfg(feature = "ibverbs")]
        Dev::IbverbsSim => Device::ibverbs(&ferrogloo::device::IbAttr::simulated()),
        #[cfg(feature = "ibverbs")]
        Dev::IbverbsMixed => {
            let host = NEXT.fetch_add(1, Ordering::Relaxed) % 2;
            let shm = Device::shared_memory(&ferrogloo::device::ShmAttr::default());
            let rdma = Device::ibverbs(&ferrogloo::device::IbAttr::simulated())?;
            Ok(Device::combine(&shm, &rdma)?.on_host(format!("pretend-ib-host-{host}")))
        }
    }
}

fn run_plan(n: usize, plan: &[Case]) {
    run_plan_on(Dev::Tcp, n, plan);
}

fn run_plan_on(dev: Dev, n: usize, plan: &[Case]) {
    let store = HashStore::new();
    let digests = all_ok(run_ranks_on(
        n,
        &store,
        &|| device(dev),
        |b| b.timeout(TIMEOUT),
        |ctx| plan.iter().map(|c| dispatch(&ctx, c)).collect::<ferrogloo::Result<Vec<_>>>(),
    ));
    for d in &digests[1..] {
        assert_eq!(d, &digests[0], "results differ between ranks");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn collectives_match_the_sequential_reference(n in 1usize..=9, plan in proptest::collection::vec(case(), 1..10)) {
        run_plan(n, &plan);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn collectives_on_shared_memory_match_the_sequential_reference(
        n in 1usize..=9, plan in proptest::collection::vec(case(), 1..10),
    ) {
        run_plan_on(Dev::Shm, n, &plan);
    }

    #[test]
    fn collectives_on_shared_memory_with_single_copies_match_the_sequential_reference(
        n in 1usize..=9, plan in proptest::collection::vec(case(), 1..10),
    ) {
        run_plan_on(Dev::ShmSingle, n, &plan);
    }

    #[test]
    fn collectives_on_shared_memory_on_both_sides_of_given_copy_thresholds_match_the_sequential_reference(
        n in 1usize..=9, plan in proptest::collection::vec(case(), 1..10),
    ) {
        run_plan_on(Dev::ShmGiven, n, &plan);
    }

    #[test]
    fn collectives_across_pretend_hosts_match_the_sequential_reference(
        n in 1usize..=9, plan in proptest::collection::vec(case(), 1..10),
    ) {
        run_plan_on(Dev::Mixed, n, &plan);
    }
}

#[cfg(feature = "ibverbs")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn collectives_on_simulated_ibverbs_match_the_sequential_reference(
        n in 1usize..=9, plan in proptest::collection::vec(case(), 1..10),
    ) {
        run_plan_on(Dev::IbverbsSim, n, &plan);
    }

    #[test]
    fn collectives_across_pretend_hosts_over_simulated_ibverbs_match_the_sequential_reference(
        n in 1usize..=9, plan in proptest::collection::vec(case(), 1..10),
    ) {
        run_plan_on(Dev::IbverbsMixed, n, &plan);
    }
}

/// Large buffers on simulated ibverbs: payloads beyond a ring slot go by RDMA read, through
/// the registration cache, in every collective.
#[cfg(feature = "ibverbs")]
#[test]
fn simulated_ibverbs_collectives_of_large_buffers() {
    for n in [2usize, 3, 5] {
        let plan: Vec<Case> = [
            Kind::Allreduce(Algorithm::Ring),
            Kind::Allreduce(Algorithm::HalvingDoubling),
            Kind::Allgather(Algorithm::Ring),
            Kind::Broadcast(Algorithm::Auto),
            Kind::ReduceScatter,
        ]
        .iter()
        .enumerate()
        .map(|(i, &kind)| Case {
            kind,
            dtype: (i % 12) as u8,
            count: 300_000 + i,
            root: i,
            red: Red::Sum,
            seed: i as u64,
            segment: 64,
        })
        .collect();
        run_plan_on(Dev::IbverbsSim, n, &plan);
    }
}

#[test]
fn shared_memory_collectives_of_every_kind_type_and_size_class() {
    // The shared-memory algorithm by name, for every collective that has it, beside the
    // random plans (where `Auto` picks it), on both copy paths.
    for (dev, n) in [Dev::ShmTwo, Dev::ShmSingle].into_iter().flat_map(|d| [1usize, 2, 3, 4, 7].map(|n| (d, n))) {
        let mut plan = Vec::new();
        let kinds = [
            Kind::Allreduce(Algorithm::SharedMemory),
            Kind::Allgather(Algorithm::SharedMemory),
            Kind::Broadcast(Algorithm::SharedMemory),
            Kind::ReduceScatter,
            Kind::Barrier,
        ];
        for (i, &kind) in kinds.iter().enumerate() {
            for (j, count) in [0, 1, n.saturating_sub(1), 2 * n + 1, 777, 40_000].into_iter().enumerate() {
                let red = [Red::Sum, Red::Product, Red::Min, Red::Max, Red::Custom][(i + j) % 5];
                plan.push(Case {
                    kind,
                    dtype: ((i * 5 + j) % 12) as u8,
                    count,
                    root: i + j,
                    red,
                    seed: (i * 100 + j) as u64,
                    segment: 64,
                });
            }
        }
        run_plan_on(dev, n, &plan);
    }
}

#[test]
fn shared_memory_collectives_larger_than_a_slot_go_through_in_chunks() {
    // 3 MiB of f32 (a slot holds 2 MiB): several chunks and a partial one, every collective,
    // on both copy paths (single copy reads the whole buffer, and a block of it, at once).
    // Two ranks have a core each here: their broadcast and allgather go in pieces of a slot's
    // fraction (pipelined); three outnumber the cores and go slot by slot.
    for dev in [Dev::ShmTwo, Dev::ShmSingle, Dev::Shm] {
        for n in [2, 3] {
            larger_than_a_slot(dev, n);
        }
    }
}

fn larger_than_a_slot(dev: Dev, n: usize) {
    let len = (3 << 20) / 4 + 7;
    let store = HashStore::new();
    all_ok(run_ranks_on(
        n,
        &store,
        &|| device(dev),
        |b| b.timeout(TIMEOUT),
        |ctx| {
            let r = ctx.rank();
            let data = |p: usize| -> Vec<i32> { (0..len).map(|i| (i as i32 % 1000) * (p as i32 + 1)).collect() };
            // Rank p contributes p + 1 times the pattern: the sum is n(n+1)/2 times it.
            let k = (n * (n + 1) / 2) as i32;
            let mut v = data(r);
            ctx.allreduce(&mut v, Reduction::Sum)?;
            assert!(v.iter().enumerate().all(|(i, &x)| x == (i as i32 % 1000) * k), "allreduce");
            // The same as parts whose ends fall inside chunks and across their boundaries.
            let mut w = data(r);
            let (a, rest) = w.split_at_mut(1000 + r);
            let (b, c) = rest.split_at_mut(len / 3);
            ctx.allreduce_many(&mut [a, &mut [], b, c], Reduction::Sum, &CollectiveOptions::new())?;
            assert!(w == v, "allreduce_many");
            let mut all = vec![0i32; n * len];
            ctx.allgather(&data(r), &mut all, &CollectiveOptions::new())?;
            assert!(all == (0..n).flat_map(data).collect::<Vec<_>>(), "allgather");
            let mut b = if r == 1 { data(1) } else { vec![0; len] };
            ctx.broadcast(&mut b, 1, &CollectiveOptions::new())?;
            assert!(b == data(1), "broadcast");
            let input: Vec<i32> = (0..n).flat_map(|_| data(r)).collect();
            let mut out = vec![0i32; len];
            ctx.reduce_scatter(&input, &mut out, Reduction::Sum, &CollectiveOptions::new())?;
            assert!(out.iter().enumerate().all(|(i, &x)| x == (i as i32 % 1000) * k), "reduce_scatter");
            for a in ["allreduce", "allgather", "broadcast"] {
                let got = match a {
                    "allreduce" => ctx.allreduce_algorithm(len * 4, Algorithm::Auto)?,
                    "allgather" => ctx.allgather_algorithm(len * 4, Algorithm::Auto)?,
                    _ => ctx.broadcast_algorithm(len * 4, Algorithm::Auto)?,
                };
                assert_eq!(got, Algorithm::SharedMemory, "{a} on shared memory picks the shared-memory algorithm");
            }
            Ok(())
        },
    ));
}

/// `allreduce_many` takes the options `allreduce_with` takes: `SharedMemory` over several
/// hosts is the two-level allreduce (packed), and an algorithm allreduce has not is refused
/// even on one rank.
#[test]
fn allreduce_many_takes_the_algorithms_allreduce_takes() {
    let store = HashStore::new();
    let got = all_ok(run_ranks_on(
        4,
        &store,
        &|| device(Dev::Mixed),
        |b| b.timeout(TIMEOUT),
        |ctx| {
            let r = ctx.rank() as u32;
            let (mut a, mut b) = (vec![r; 700], vec![r + 1; 70_000]);
            let opts = CollectiveOptions::new().algorithm(Algorithm::SharedMemory);
            ctx.allreduce_many(&mut [&mut a[..], &mut b[..]], Reduction::Sum, &opts)?;
            Ok((a, b))
        },
    ));
    for (a, b) in got {
        assert!(a.iter().all(|&x| x == 6) && b.iter().all(|&x| x == 10));
    }
    let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process()).expect("a context of one");
    let tree = CollectiveOptions::new().algorithm(Algorithm::BinomialTree);
    let err =
        ctx.allreduce_many(&mut [&mut [1.0f32][..]], Reduction::Sum, &tree).expect_err("not an allreduce algorithm");
    let plain = ctx.allreduce_with(&mut [1.0f32], Reduction::Sum, &tree).expect_err("not an allreduce algorithm");
    assert_eq!(err.to_string(), plain.to_string());
}

/// The copy path is the host's, not each rank's: every rank holds the plan one rank decided
/// (measured, or forced alike), and ranks forced differently fail formation, each naming the
/// other's setting, before any call could take two paths at once.
#[test]
fn every_rank_of_a_host_takes_the_same_copy_path_and_ranks_told_otherwise_fail_formation() {
    for n in [2usize, 3, 4] {
        for (dev, want) in [
            (Dev::ShmSingle, Some(CopyPlan::SINGLE)),
            (Dev::ShmTwo, Some(CopyPlan::TWO)),
            (Dev::ShmGiven, Some(THRESHOLDS)),
            (Dev::Shm, None),
        ] {
            let store = HashStore::new();
            let plans =
                all_ok(run_ranks_on(n, &store, &|| device(dev), |b| b.timeout(TIMEOUT), |ctx| Ok(ctx.copy_plan())));
            assert!(plans.iter().all(|p| p.is_some() && *p == plans[0]), "{dev:?}, {n} ranks: {plans:?}");
            if let Some(w) = want {
                assert_eq!(plans[0], Some(w), "{dev:?}");
            }
        }
    }
    let store = HashStore::new();
    let got = run_ranks_on(
        3,
        &store,
        &{
            let next = AtomicUsize::new(0);
            move || device(if next.fetch_add(1, Ordering::Relaxed) == 0 { Dev::ShmSingle } else { Dev::ShmTwo })
        },
        |b| b.timeout(TIMEOUT),
        |ctx| Ok(ctx.copy_plan()),
    );
    for r in &got {
        match r {
            Err(e @ Error::Mismatch { .. }) => {
                let text = e.to_string();
                assert!(text.contains("single copies") && text.contains("two copies"), "{text}");
            }
            other => panic!("ranks forced to different copy paths formed a context: {other:?}"),
        }
    }
}

#[test]
fn the_shared_memory_algorithm_asked_where_it_cannot_run_is_an_error_in_words() {
    let store = HashStore::new();
    all_ok(run_ranks_on(
        3,
        &store,
        &|| device(Dev::Tcp),
        |b| b.timeout(TIMEOUT),
        |ctx| {
            let mut v = vec![1u32; 10];
            let shm = CollectiveOptions::new().algorithm(Algorithm::SharedMemory);
            match ctx.allreduce_with(&mut v, Reduction::Sum, &shm) {
                Err(ferrogloo::Error::InvalidArgument(m)) => assert!(m.contains("needs every rank"), "{m}"),
                other => panic!("expected an invalid argument, got {other:?}"),
            }
            // Nothing was sent: the context goes on.
            ctx.allreduce(&mut v, Reduction::Sum)?;
            assert_eq!(v, vec![3; 10]);
            Ok(())
        },
    ));
}

#[test]
fn every_kind_type_and_size_class_once_per_world_size() {
    // A deterministic sweep beside the random one: every collective, every type, counts
    // 0, 1, fewer than ranks, odd, and several segments, for world sizes 1..=9.
    for n in 1usize..=9 {
        let mut plan = Vec::new();
        let kinds = [
            Kind::Allreduce(Algorithm::Ring),
            Kind::Allreduce(Algorithm::HalvingDoubling),
            Kind::Allreduce(Algorithm::RecursiveDoubling),
            Kind::AllreduceMulti,
            Kind::Reduce,
            Kind::ReduceScatterV,
            Kind::AllgatherV(Algorithm::Ring),
            Kind::AllgatherV(Algorithm::RecursiveDoubling),
            Kind::Broadcast(Algorithm::Pipeline),
            Kind::Broadcast(Algorithm::BinomialTree),
            Kind::GatherV,
            Kind::Scatter,
            Kind::AlltoallV,
        ];
        for (i, &kind) in kinds.iter().enumerate() {
            for (j, count) in [0, 1, n.saturating_sub(1), 2 * n + 1, 777].into_iter().enumerate() {
                let red = [Red::Sum, Red::Product, Red::Min, Red::Max, Red::Custom][(i + j) % 5];
                plan.push(Case {
                    kind,
                    dtype: ((i * 5 + j) % 12) as u8,
                    count,
                    root: i + j,
                    red,
                    seed: (i * 100 + j) as u64,
                    segment: 64,
                });
            }
        }
        run_plan(n, &plan);
    }
}

#[test]
fn floats_reduce_within_tolerance_and_bit_identically_on_every_rank() {
    // Arbitrary floats: the order of additions differs by algorithm, so compare to the
    // reference within a tolerance, and across ranks bit for bit.
    for n in [2, 3, 5, 8] {
        for algo in [Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::RecursiveDoubling] {
            let store = HashStore::new();
            let len = 10_001;
            let data = |r: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7 + r * 13) as f32).sin() * 1e3).collect() };
            let results = all_ok(run_ranks_with(
                n,
                &store,
                &TcpAttr::loopback(),
                |b| b,
                |ctx| {
                    let mut v = data(ctx.rank());
                    let opts = CollectiveOptions::new().algorithm(algo).segment_bytes(4096);
                    ctx.allreduce_with(&mut v, Reduction::Sum, &opts)?;
                    Ok(v)
                },
            ));
            let inputs: Vec<Vec<f32>> = (0..n).map(data).collect();
            let want: Vec<f64> = (0..len).map(|i| inputs.iter().map(|d| f64::from(d[i])).sum()).collect();
            for (i, (&got, &w)) in results[0].iter().zip(&want).enumerate() {
                assert!((f64::from(got) - w).abs() <= 1e-3 * w.abs().max(1.0), "element {i}: {got} vs {w}");
            }
            for r in &results[1..] {
                assert!(
                    r.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "ranks differ ({algo:?}, n={n})"
                );
            }
        }
    }
}

#[test]
fn concurrent_collectives_with_different_tags_do_not_mix() {
    let store = HashStore::new();
    let results = run_ranks_with(
        4,
        &store,
        &TcpAttr::loopback(),
        |b| b,
        |ctx| {
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..4u32)
                    .map(|tag| {
                        let ctx = &ctx;
                        s.spawn(move || -> ferrogloo::Result<()> {
                            let opts = CollectiveOptions::new().tag(tag).segment_bytes(1024);
                            for round in 0..20u32 {
                                let mut v = vec![tag * 1000 + round + ctx.rank() as u32; 5000];
                                ctx.allreduce_with(&mut v, Reduction::Sum, &opts)?;
                                let want = 4 * (tag * 1000 + round) + 6;
                                assert!(v.iter().all(|&x| x == want), "tag {tag} round {round}");
                                let mut b = vec![ctx.rank() as u32 + tag; 300];
                                ctx.broadcast(&mut b, (tag as usize) % 4, &opts)?;
                                assert!(b.iter().all(|&x| x == (tag % 4) + tag));
                            }
                            Ok(())
                        })
                    })
                    .collect();
                hs.into_iter().try_for_each(|h| h.join().expect("thread panicked"))
            })
        },
    );
    all_ok(results);
}

#[test]
fn hierarchical_allreduce_across_pretend_hosts_agrees_bit_for_bit() {
    // Five ranks on two pretend hosts (three and two): shared memory within each, TCP across;
    // `Auto` runs the hierarchical allreduce. Floats of every magnitude, and a buffer larger
    // than a slot.
    for len in [0usize, 1, 1000, (3 << 20) / 4 + 5] {
        let next = AtomicUsize::new(0);
        let store = HashStore::new();
        let data = |r: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7 + r * 13) as f32).sin() * 1e3).collect() };
        let results = all_ok(run_ranks_on(
            5,
            &store,
            &|| {
                let host = next.fetch_add(1, Ordering::Relaxed) % 2;
                Device::auto(&TcpAttr::loopback()).map(|d| d.on_host(format!("pretend-host-{host}")))
            },
            |b| b.timeout(TIMEOUT),
            |ctx| {
                assert_eq!(ctx.allreduce_algorithm(len * 4, Algorithm::Auto)?, Algorithm::SharedMemory);
                let mut v = data(ctx.rank());
                ctx.allreduce(&mut v, Reduction::Sum)?;
                let mut exact: Vec<i64> = (0..len as i64).map(|i| i * (ctx.rank() as i64 + 1)).collect();
                ctx.allreduce(&mut exact, Reduction::Sum)?;
                assert!(exact.iter().enumerate().all(|(i, &x)| x == i as i64 * 15), "exact sums");
                Ok((v, ctx.local_ranks().len()))
            },
        ));
        let mut sizes: Vec<usize> = results.iter().map(|(_, l)| *l).collect();
        sizes.sort();
        assert_eq!(sizes, vec![2, 2, 3, 3, 3], "the ranks split three and two over the hosts");
        let inputs: Vec<Vec<f32>> = (0..5).map(data).collect();
        for i in 0..len {
            let want: f64 = inputs.iter().map(|d| f64::from(d[i])).sum();
            let got = f64::from(results[0].0[i]);
            assert!((got - want).abs() <= 1e-3 * want.abs().max(1.0), "element {i}: {got} vs {want}");
        }
        for (r, (v, _)) in results.iter().enumerate().skip(1) {
            assert!(v.iter().zip(&results[0].0).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r} differs");
        }
    }
}

#[test]
fn every_rank_sees_the_same_hosts_and_picks_the_same_allreduce() {
    // Rank 0 learns the higher ranks' hosts after they connect to it (they connect to rank 0
    // before they publish): it must wait for their entries, or it would choose another
    // allreduce than they do.
    for _ in 0..20 {
        let store = HashStore::new();
        let v = all_ok(run_ranks_on(
            3,
            &store,
            &|| device(Dev::Mixed),
            |b| b.timeout(TIMEOUT),
            |ctx| {
                let hosts: Vec<String> = (0..3).map(|r| ctx.host_of(r).unwrap_or("?").to_string()).collect();
                Ok((hosts, ctx.allreduce_algorithm(16, Algorithm::Auto)?))
            },
        ));
        for x in &v[1..] {
            assert_eq!(x, &v[0], "{v:?}");
        }
    }
}

/// The floating-point types, through `f64` (the runtime-typed average's reference).
trait Float: Val {
    fn to_f64(self) -> f64;
    fn of_f64(x: f64) -> Self;
}
macro_rules! float {
    ($($t:ty: $to:expr, $from:expr),*) => {$( impl Float for $t {
        fn to_f64(self) -> f64 { let f: fn($t) -> f64 = $to; f(self) }
        fn of_f64(x: f64) -> Self { let f: fn(f64) -> $t = $from; f(x) }
    } )*};
}
float!(f32: f64::from, |x| x as f32, f64: |x| x, |x| x, f16: f16::to_f64, f16::from_f64, bf16: bf16::to_f64, bf16::from_f64);

/// `v` as native-order bytes starting `skew` bytes into the buffer (0: aligned).
fn bytes_at<T: Element>(v: &[T], skew: usize) -> Vec<u8> {
    let mut b = vec![0u8; skew];
    b.extend_from_slice(bytemuck::cast_slice(v));
    b
}

/// Runs the three runtime-typed reductions with `Reduction::Average` on `n` ranks and checks
/// each rank's result against the sum of the inputs scaled once by 1/n (inputs are small
/// integers, so the sums are exact and the reference is bit for bit).
fn average_case<T: Float>(n: usize, count: usize, root: usize, skew: usize, seed: u64) {
    use ferrogloo::Reduction;
    let dt = T::DTYPE;
    let root = root % n;
    let store = HashStore::new();
    let all = all_ok(run_ranks_with(
        n,
        &store,
        &TcpAttr::loopback(),
        |b| b,
        |ctx| {
            let me = ctx.rank();
            let opts = CollectiveOptions::default();
            let mut ar = bytes_at(&input::<T>(seed, me, count), skew);
            ctx.allreduce_bytes(&mut ar[skew..], dt, Reduction::Average, &opts)?;
            let mut red = bytes_at(&input::<T>(seed ^ 1, me, count), skew);
            ctx.reduce_bytes(&mut red[skew..], dt, root, Reduction::Average, &opts)?;
            let rs_in = bytes_at(&input::<T>(seed ^ 2, me, count * n), skew);
            let mut rs_out = vec![0u8; count * dt.size()];
            ctx.reduce_scatter_bytes(&rs_in[skew..], &mut rs_out, dt, Reduction::Average, &opts)?;
            Ok((ar.split_off(skew), red.split_off(skew), rs_out))
        },
    ));
    let avg = |seed: u64, len: usize| -> Vec<T> {
        (0..len)
            .map(|i| {
                let sum = (0..n).fold(T::of_f64(0.0), |a, r| T::add(a, value::<T>(seed, r, i)));
                T::of_f64(sum.to_f64() * (1.0 / n as f64))
            })
            .collect()
    };
    let (ar, red, rs) = (avg(seed, count), avg(seed ^ 1, count), avg(seed ^ 2, count * n));
    for (r, (a, b, c)) in all.iter().enumerate() {
        assert_eq!(a.as_slice(), bytemuck::cast_slice::<T, u8>(&ar), "allreduce on rank {r} ({dt}, n={n})");
        // Only the root holds the reduction's result; the others keep their input.
        let want_red = if r == root { red.clone() } else { input::<T>(seed ^ 1, r, count) };
        assert_eq!(b.as_slice(), bytemuck::cast_slice::<T, u8>(&want_red), "reduce on rank {r} ({dt}, root {root})");
        let block = &rs[r * count..(r + 1) * count];
        assert_eq!(c.as_slice(), bytemuck::cast_slice::<T, u8>(block), "reduce_scatter on rank {r} ({dt})");
    }
}

/// The typed calls with `Reduction::Average` on `n` ranks: allreduce, reduce, reduce_scatter
/// (the sum scaled once by 1/n where the result is) and allreduce_multi with two inputs per rank
/// (the mean of all 2n inputs), against the same reference.
fn typed_average_case<T: Float>(n: usize, count: usize, root: usize, seed: u64) {
    let root = root % n;
    let store = HashStore::new();
    let all = all_ok(run_ranks_with(
        n,
        &store,
        &TcpAttr::loopback(),
        |b| b,
        |ctx| {
            let me = ctx.rank();
            let opts = CollectiveOptions::default();
            let mut ar = input::<T>(seed, me, count);
            ctx.allreduce(&mut ar, Reduction::Average)?;
            let mut red = input::<T>(seed ^ 1, me, count);
            ctx.reduce(&mut red, root, Reduction::Average, &opts)?;
            let mut rs = vec![T::small(0); count];
            ctx.reduce_scatter(&input::<T>(seed ^ 2, me, count * n), &mut rs, Reduction::Average, &opts)?;
            let (a, b) = (input::<T>(seed ^ 3, me, count), input::<T>(seed ^ 4, me, count));
            let mut multi = vec![T::small(0); count];
            ctx.allreduce_multi(&[&a, &b], &mut [&mut multi], Reduction::Average, &opts)?;
            Ok((ar, red, rs, multi))
        },
    ));
    let mean = |inputs: &[Vec<T>]| -> Vec<T> {
        let sum = inputs[1..].iter().fold(inputs[0].clone(), |mut acc, x| {
            acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::add(*a, b));
            acc
        });
        sum.into_iter().map(|x| T::of_f64(x.to_f64() * (1.0 / inputs.len() as f64))).collect()
    };
    let of = |seed: u64, len: usize| -> Vec<Vec<T>> { (0..n).map(|r| input::<T>(seed, r, len)).collect() };
    let (ar, red, rs) = (mean(&of(seed, count)), mean(&of(seed ^ 1, count)), mean(&of(seed ^ 2, count * n)));
    // allreduce_multi folds each rank's two inputs first, then the ranks in order.
    let pairs: Vec<Vec<T>> = (0..n)
        .map(|r| {
            let (mut a, b) = (input::<T>(seed ^ 3, r, count), input::<T>(seed ^ 4, r, count));
            a.iter_mut().zip(&b).for_each(|(x, &y)| *x = T::add(*x, y));
            a
        })
        .collect();
    let sum_pairs = pairs[1..].iter().fold(pairs[0].clone(), |mut acc, x| {
        acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::add(*a, b));
        acc
    });
    let multi: Vec<T> = sum_pairs.into_iter().map(|x| T::of_f64(x.to_f64() * (1.0 / (2 * n) as f64))).collect();
    let bits = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
    for (r, (a, b, c, d)) in all.iter().enumerate() {
        let dt = T::DTYPE;
        assert_eq!(bits(a), bits(&ar), "allreduce on rank {r} ({dt}, n={n})");
        let want_red = if r == root { red.clone() } else { input::<T>(seed ^ 1, r, count) };
        assert_eq!(bits(b), bits(&want_red), "reduce on rank {r} ({dt}, root {root})");
        assert_eq!(bits(c), bits(&rs[r * count..(r + 1) * count]), "reduce_scatter on rank {r} ({dt})");
        assert_eq!(bits(d), bits(&multi), "allreduce_multi on rank {r} ({dt})");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// `Reduction::Average` on the runtime-typed calls: the sum, scaled once by 1/n on the
    /// ranks that hold the result, for every floating-point type, aligned or not.
    #[test]
    fn runtime_typed_average_is_the_sum_scaled_once_where_the_result_is(
        n in 1usize..=5, count in 0usize..300, root in 0usize..5, skew in 0usize..2, ty in 0u8..4, seed in any::<u64>(),
    ) {
        match ty {
            0 => average_case::<f32>(n, count, root, skew, seed),
            1 => average_case::<f64>(n, count, root, skew, seed),
            2 => average_case::<f16>(n, count, root, skew, seed),
            _ => average_case::<bf16>(n, count, root, skew, seed),
        }
    }

    /// `Reduction::Average` on the typed calls, against the same reference.
    #[test]
    fn typed_average_is_the_sum_scaled_once_where_the_result_is(
        n in 1usize..=4, count in 0usize..200, root in 0usize..4, ty in 0u8..4, seed in any::<u64>(),
    ) {
        match ty {
            0 => typed_average_case::<f32>(n, count, root, seed),
            1 => typed_average_case::<f64>(n, count, root, seed),
            2 => typed_average_case::<f16>(n, count, root, seed),
            _ => typed_average_case::<bf16>(n, count, root, seed),
        }
    }
}

#[test]
fn runtime_typed_average_of_integers_is_refused_on_every_rank_before_any_traffic() {
    use ferrogloo::{DType, Error, Reduction};
    let store = HashStore::new();
    let all = all_ok(run_ranks_with(
        3,
        &store,
        &TcpAttr::loopback(),
        |b| b,
        |ctx| {
            let opts = CollectiveOptions::default();
            let mut b = vec![0u8; 8];
            let errs = [
                ctx.allreduce_bytes(&mut b, DType::I32, Reduction::Average, &opts).err(),
                ctx.reduce_bytes(&mut b, DType::U64, 0, Reduction::Average, &opts).err(),
                ctx.reduce_scatter_bytes(&[0u8; 6], &mut b[..2], DType::I16, Reduction::Average, &opts).err(),
                // The typed calls alike.
                ctx.allreduce(&mut [1i32; 4], Reduction::Average).err(),
                ctx.reduce(&mut [1u64], 0, Reduction::Average, &opts).err(),
                ctx.reduce_scatter(&[1i16; 3], &mut [0i16], Reduction::Average, &opts).err(),
                ctx.allreduce_multi(&[&[1u8][..]], &mut [&mut [0u8][..]], Reduction::Average, &opts).err(),
            ];
            // Nothing was sent: the next collective pairs up as usual.
            let mut x = vec![ctx.rank() as u32 + 1];
            ctx.allreduce(&mut x, Reduction::Sum)?;
            Ok((errs, x[0]))
        },
    ));
    for (r, (errs, sum)) in all.into_iter().enumerate() {
        for (e, ty) in errs.into_iter().zip(["i32", "u64", "i16", "i32", "u64", "i16", "u8"]) {
            assert!(
                matches!(&e, Some(Error::InvalidArgument(m)) if m.contains(&format!("average of {ty}"))),
                "rank {r}: {e:?}"
            );
        }
        assert_eq!(sum, 6, "rank {r}");
    }
}

#[test]
fn two_threads_of_one_rank_in_the_shared_memory_area_at_once_are_refused_not_raced() {
    // Rank 0 runs two tag-0 allreduces on two threads at once. Neither can finish before rank 1
    // joins, and rank 1 joins only once one of them was refused: a second call through the
    // area would have written slots the first reads.
    let refused = std::sync::Mutex::new(false);
    let go = std::sync::Condvar::new();
    let store = HashStore::new();
    let results = all_ok(run_ranks_on(
        2,
        &store,
        &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        |b| b.timeout(TIMEOUT),
        |ctx| {
            assert!(ctx.allreduce_algorithm(64, Algorithm::Auto)? == Algorithm::SharedMemory);
            if ctx.rank() == 1 {
                let mut r = refused.lock().unwrap();
                while !*r {
                    r = go.wait_timeout(r, TIMEOUT).unwrap().0;
                }
                drop(r);
                let mut v = vec![2.0f32; 16];
                ctx.allreduce(&mut v, Reduction::Sum)?;
                let mut w = vec![1u32; 4];
                ctx.allreduce(&mut w, Reduction::Sum)?;
                return Ok((vec![v[0]], w[0]));
            }
            let outcomes: Vec<ferrogloo::Result<f32>> = std::thread::scope(|s| {
                let calls: Vec<_> = (0..2)
                    .map(|_| {
                        s.spawn(|| {
                            let mut v = vec![1.0f32; 16];
                            let r = ctx.allreduce(&mut v, Reduction::Sum).map(|()| v[0]);
                            if r.is_err() {
                                *refused.lock().unwrap() = true;
                                go.notify_all();
                            }
                            r
                        })
                    })
                    .collect();
                calls.into_iter().map(|c| c.join().expect("thread panicked")).collect()
            });
            let mut sums = Vec::new();
            for o in outcomes {
                match o {
                    Ok(x) => sums.push(x),
                    Err(ferrogloo::Error::InvalidArgument(m)) => {
                        assert!(m.contains("another collective of tag 0"), "{m}")
                    }
                    Err(e) => panic!("unexpected error: {e}"),
                }
            }
            // The context goes on: the next collective pairs up as usual.
            let mut w = vec![1u32; 4];
            ctx.allreduce(&mut w, Reduction::Sum)?;
            Ok((sums, w[0]))
        },
    ));
    assert_eq!(results[0], (vec![3.0], 2), "one call ran (1 + 2), one was refused; then 1 + 1");
    assert_eq!(results[1], (vec![3.0], 2));
}

#[test]
fn a_fold_that_panics_in_the_shared_memory_area_aborts_the_context_rather_than_misleading_a_peer() {
    a_fold_that_panics(
        &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        "inside the shared-memory area",
    );
}

#[test]
fn a_fold_that_panics_in_a_pair_based_allreduce_aborts_the_context() {
    a_fold_that_panics(&|| Device::tcp(&TcpAttr::loopback()), "panicked");
}

/// Rank 0's custom fold panics halfway through an allreduce; rank 0 catches the panic and
/// calls the allreduce again. Rank 1, still in the first call, must fail with the cause, not
/// read rank 0's part of the second call as if it were the first's (through the area, whose
/// steps are numbered per area, that read would be silent).
fn a_fold_that_panics(device: &(dyn Fn() -> ferrogloo::Result<Device> + Sync), why: &str) {
    let store = HashStore::new();
    let results = all_ok(run_ranks_on(
        2,
        &store,
        device,
        |b| b.timeout(TIMEOUT),
        |ctx| {
            let o = CollectiveOptions::default();
            let sum = |acc: &mut [f32], x: &[f32]| acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
            let mut warm = vec![1.0f32; 16384];
            ctx.allreduce_custom(&mut warm, &sum, &o)?;
            assert_eq!(warm[0], 2.0);
            let mut v = vec![10.0f32 * (ctx.rank() as f32 + 1.0); 16384];
            if ctx.rank() == 1 {
                // Every element must agree (NaN stands for "not all the same").
                let whole = |v: &[f32]| if v.iter().all(|&x| x == v[0]) { v[0] } else { f32::NAN };
                return Ok(ctx.allreduce_custom(&mut v, &sum, &o).map(|()| whole(&v)).map_err(|e| e.to_string()));
            }
            let panicking = |_: &mut [f32], _: &[f32]| panic!("a fold that panics");
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = ctx.allreduce_custom(&mut v, &panicking, &o);
            }));
            assert!(caught.is_err(), "the fold panicked");
            assert!(ctx.is_aborted(), "a panic inside a collective aborts the context");
            let mut again = vec![10.0f32; 16384];
            Ok(ctx.allreduce_custom(&mut again, &sum, &o).map(|()| again[0]).map_err(|e| e.to_string()))
        },
    ));
    // Rank 0 is aborted; rank 1 fails with the cause, or (when its own part of the work was
    // done before rank 0's fold ran) has the right sum: never another value.
    match &results[0] {
        Err(e) => assert!(e.contains(why), "rank 0: {e}"),
        Ok(x) => panic!("rank 0 ran an allreduce ({x}) on a context a panic aborted"),
    }
    match &results[1] {
        Err(e) => assert!(e.contains(why), "rank 1: {e}"),
        Ok(x) => assert_eq!(*x, 30.0, "rank 1 completed with a wrong value after its peer's fold panicked"),
    }
}

/// The links' cost model: measured as a context forms, the same bits on every rank (whatever
/// each rank saw alone), so `Auto` picks the same allreduce everywhere; and the prediction of
/// `Auto` is the pick's.
#[test]
fn every_rank_measures_the_same_cost_model_and_picks_by_it() {
    for n in 1..=9 {
        let store = HashStore::new();
        let got = all_ok(run_ranks(n, &store, |ctx| {
            let m = ctx.cost_model();
            let mut picks = Vec::new();
            for shift in [0, 8, 12, 16, 20, 24, 26] {
                let bytes = 1usize << shift;
                let pick = ctx.allreduce_algorithm(bytes, Algorithm::Auto)?;
                if let Some(m) = m {
                    assert_eq!(pick, m.allreduce_choice(n, bytes), "{n} ranks, {bytes} B");
                    let want = m.allreduce_time(pick, n, bytes);
                    assert_eq!(ctx.predicted_allreduce_time(Algorithm::Auto, bytes)?, want);
                }
                picks.push(pick);
            }
            // The model is usable: an allreduce of each size it chose for is right.
            let mut v = vec![ctx.rank() as u32 + 1; 70_000];
            ctx.allreduce(&mut v, Reduction::Sum)?;
            assert!(v.iter().all(|&x| x as usize == n * (n + 1) / 2));
            Ok((m.map(|m| (m.latency, m.link_bytes_per_s.to_bits(), m.reduce_bytes_per_s.to_bits())), picks))
        }));
        assert_eq!(got[0].0.is_some(), n > 1, "{n} ranks: a model exactly when there are links");
        assert!(got.iter().all(|g| *g == got[0]), "{n} ranks disagree: {got:?}");
        if let Some((latency, link, reduce)) = got[0].0 {
            let (link, reduce) = (f64::from_bits(link), f64::from_bits(reduce));
            assert!(latency > std::time::Duration::ZERO && latency < TIMEOUT, "{n} ranks: latency {latency:?}");
            assert!(link.is_finite() && link > 0.0 && reduce.is_finite() && reduce > 0.0, "{link} {reduce}");
        }
    }
}

/// A model given to the builder is the one the context uses, and `Auto` follows it: with a
/// slow step every size goes by recursive doubling, with slow reductions large ones by the ring.
#[test]
fn a_given_cost_model_decides_auto() {
    use ferrogloo::CostModel;
    let cases: [(&str, usize, Algorithm); 3] = [
        ("latency_us=100000,link_gbs=100,reduce_gbs=100", 16 << 20, Algorithm::RecursiveDoubling),
        ("latency_us=1,link_gbs=3,reduce_gbs=1", 64 << 20, Algorithm::Ring),
        ("latency_us=50,link_gbs=1.25,reduce_gbs=8", 1 << 20, Algorithm::HalvingDoubling),
    ];
    for (model, bytes, want) in cases {
        let m: CostModel = model.parse().expect("a model");
        let store = HashStore::new();
        let got = all_ok(run_ranks_with(
            4,
            &store,
            &TcpAttr::loopback(),
            |b| b.cost_model(m),
            |ctx| {
                assert_eq!(ctx.cost_model(), Some(m));
                let mut v = vec![1.0f32; 1000];
                ctx.allreduce(&mut v, Reduction::Sum)?;
                assert!(v.iter().all(|&x| x == 4.0));
                ctx.allreduce_algorithm(bytes, Algorithm::Auto)
            },
        ));
        assert!(got.iter().all(|&a| a == want), "{model}: {got:?}, want {want}");
    }
}

/// Ranks given different cost models, or some one and others none, would choose different
/// algorithms (or some would measure, waiting for ranks that never join): formation fails on
/// every rank, at once, with `Mismatch` naming the rank that differs and both models.
#[test]
fn cost_models_that_differ_between_ranks_fail_formation_on_every_rank() {
    let m: ferrogloo::CostModel = "latency_us=50,link_gbs=1.25,reduce_gbs=8".parse().expect("a model");
    let other: ferrogloo::CostModel = "latency_us=50,link_gbs=1.25,reduce_gbs=9".parse().expect("a model");
    let deadline = std::time::Duration::from_secs(20);
    // (rank 0's model, the others'): given to one rank only, and two different ones.
    for (first, rest) in [(Some(m), None), (None, Some(m)), (Some(m), Some(other))] {
        let start = std::time::Instant::now();
        let store = HashStore::new();
        let got = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    let store = &store;
                    s.spawn(move || -> ferrogloo::Result<()> {
                        let dev = Device::tcp(&TcpAttr::loopback())?;
                        let mut b = Context::builder(rank, 3).timeout(deadline);
                        if let Some(model) = if rank == 0 { first } else { rest } {
                            b = b.cost_model(model);
                        }
                        b.connect(store, &dev).map(drop)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("a rank thread panicked")).collect::<Vec<_>>()
        });
        // Well inside the deadline: no rank waits for another to time out.
        assert!(start.elapsed() < deadline / 2, "took {:?}", start.elapsed());
        let text = |m: Option<ferrogloo::CostModel>| m.map_or("none".to_string(), |m| m.to_exact_text());
        for (rank, r) in got.iter().enumerate() {
            let Err(e @ Error::Mismatch { rank: peer, detail }) = r else {
                panic!("{first:?}/{rest:?}: rank {rank}: {r:?}, want Mismatch")
            };
            // Rank 0 differs from the others, so it names rank 1 and they name rank 0.
            assert_eq!(*peer, usize::from(rank == 0), "rank {rank}: {e}");
            assert!(detail.contains(&text(first)) && detail.contains(&text(rest)), "rank {rank}: {e}");
            assert!(e.to_string().contains("cost model"), "rank {rank}: {e}");
        }
    }
}
