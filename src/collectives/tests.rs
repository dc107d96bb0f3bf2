//! The ring over parts cut alike (the engine's fused batches): against the sequential
//! reference, and a rank that cuts differently.

use crate::algorithms::{Algorithm, CollectiveOptions};
use crate::context::testing::ranks_with;
use crate::cost::CostModel;
use crate::device::{Device, ShmAttr};
use crate::error::Error;
use crate::types::{Element, Reduction};
use proptest::prelude::*;

/// Rank `r`'s element `i`: small whole numbers, so that sums are exact in every type.
fn value<T: Element + From<u8>>(r: usize, i: usize) -> T {
    T::from(((i * 7 + r * 13) % 5) as u8)
}

/// Cost models under which the ring cuts at every part's end (a link of no latency), packs
/// the parts below 20 KB (5 µs at 4 GB/s: some of the proptest's, not others) or packs every
/// part the proptest makes.
const MODELS: [&str; 3] = [
    "latency_us=0,link_gbs=1,reduce_gbs=4",
    "latency_us=5,link_gbs=1,reduce_gbs=4",
    "latency_us=1000,link_gbs=1,reduce_gbs=4",
];

/// A context builder given `MODELS[m]`.
fn with_model(m: usize) -> impl Fn(crate::ContextBuilder) -> crate::ContextBuilder + Sync {
    move |b| b.cost_model(MODELS[m].parse::<CostModel>().expect("a model"))
}

/// Every rank cuts `lens.iter().sum()` elements into parts of `lens`, runs the allreduce of
/// parts cut alike with the ring forced (segments of `seg` bytes) under `MODELS[model]`, and
/// checks every element of every part against the sum over ranks.
fn check<T: Element + From<u8> + std::ops::Add<Output = T> + PartialEq + std::fmt::Debug>(
    n: usize,
    device: &Device,
    lens: &[usize],
    seg: usize,
    model: usize,
) {
    let total: usize = lens.iter().sum();
    let want: Vec<T> = (0..total).map(|i| (1..n).fold(value::<T>(0, i), |acc, r| acc + value::<T>(r, i))).collect();
    ranks_with(n, device, with_model(model), |ctx| {
        let r = ctx.rank();
        let mut whole: Vec<T> = (0..total).map(|i| value(r, i)).collect();
        let mut parts: Vec<&mut [T]> = Vec::new();
        let mut rest: &mut [T] = &mut whole;
        for &k in lens {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(k);
            parts.push(part);
            rest = tail;
        }
        let opts = CollectiveOptions::new().algorithm(Algorithm::Ring).segment_bytes(seg);
        ctx.allreduce_many_alike(&mut parts, Reduction::Sum, &opts)?;
        let bad = (0..total).find(|&i| whole[i] != want[i]);
        assert_eq!(bad, None, "rank {r} of {n}, parts {lens:?}, segments of {seg} bytes, model {model}: first wrong");
        Ok(())
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    /// 0 to 40 parts of 0 to 5,000 elements (empty ones among them), world sizes 1 to 9,
    /// segments from 4 bytes (a message per few elements) to the default, f32, i64 and u8, on
    /// every transport of the process (in-process, TCP, shared memory: the ring over its pairs),
    /// with none, some or all of the parts packed together.
    #[test]
    fn the_ring_over_parts_cut_alike_matches_the_sequential_reference(
        n in 1usize..=9,
        lens in proptest::collection::vec(prop_oneof![Just(0usize), 0usize..5000], 0..=40),
        seg in prop_oneof![Just(4usize), 64usize..4096, Just(1 << 20)],
        dtype in 0u8..3,
        backend in 0u8..3,
        model in 0usize..3,
    ) {
        let device = match backend {
            0 => Device::in_process(),
            1 => Device::loopback().expect("a TCP device on loopback"),
            _ => Device::shared_memory(&ShmAttr::default()),
        };
        match dtype {
            0 => check::<f32>(n, &device, &lens, seg, model),
            1 => check::<i64>(n, &device, &lens, seg, model),
            _ => check::<u8>(n, &device, &lens, seg, model),
        }
    }
}

/// A rank that cuts the whole differently from the others, though the total agrees, gets a
/// `Mismatch` that says so, on every rank: it would misplace elements, not just be slow.
#[test]
fn a_rank_that_cuts_parts_differently_is_a_mismatch_on_every_rank() {
    let device = Device::in_process();
    let results = ranks_with(3, &device, with_model(0), |ctx| {
        let r = ctx.rank();
        let mut whole = vec![1.0f32; 3000];
        let cut = if r == 1 { 1001 } else { 1000 };
        let (a, b) = whole.split_at_mut(cut);
        let opts = CollectiveOptions::new().algorithm(Algorithm::Ring);
        Ok(ctx.allreduce_many_alike(&mut [a, b], Reduction::Sum, &opts))
    });
    for (r, got) in results.iter().enumerate() {
        assert!(matches!(got, Err(Error::Mismatch { .. })), "rank {r}: {got:?}");
    }
}
