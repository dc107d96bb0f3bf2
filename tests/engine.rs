//! The engine with ranks as threads: random submission orders, every mismatch kind, stalls,
//! the response cache, fusion, join, first cause, process sets, the timeline.

mod common;

use common::{TIMEOUT, all_ok};
use ferrogloo::device::Device;
use ferrogloo::engine::{AllreduceOptions, Compression, Engine, EngineConfig, Reduction, Tensor};
use ferrogloo::rendezvous::HashStore;
use ferrogloo::{Context, Error, Result, f16};
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Set (to `shm`) in the process that [`every_test_again_through_the_shared_area`] starts: this
/// file's tests then run on shared memory, where the engine negotiates through the host's area.
const DEVICE_ENV: &str = "FERROGLOO_TEST_ENGINE_DEVICE";

/// The ranks' device: in-process pairs (the engine negotiates over the pairs, as over TCP), or
/// shared memory where [`DEVICE_ENV`] says so.
fn device() -> Result<Device> {
    match std::env::var(DEVICE_ENV).as_deref() {
        Ok("shm") => Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        _ => Ok(Device::in_process()),
    }
}

/// Set (to `1`) in the process that [`every_test_again_agreeing_by_reduction`] starts: every
/// engine of this file's tests then agrees by reduction from 2 ranks on.
const TREE_ENV: &str = "FERROGLOO_TEST_ENGINE_TREE";

/// An engine over `ctx` with `cfg`, agreeing by reduction where [`TREE_ENV`] says so.
fn new_engine(ctx: Context, cfg: EngineConfig) -> Result<Engine> {
    let tree = std::env::var_os(TREE_ENV).is_some();
    let cfg = EngineConfig { tree_negotiation_from: if tree { Some(2) } else { cfg.tree_negotiation_from }, ..cfg };
    Engine::new(ctx, cfg)
}

/// Runs `f` on `n` ranks that are threads over in-process pairs, whatever [`DEVICE_ENV`] says
/// (for tests that make their engines themselves, over the pairs).
fn on_pairs<T: Send>(n: usize, f: impl Fn(Context) -> Result<T> + Sync) -> Vec<Result<T>> {
    let store = HashStore::new();
    common::run_ranks_on(n, &store, &|| Ok(Device::in_process()), |b| b, f)
}

/// Runs `f` on `n` ranks that are threads, each with its own engine (on [`device`]).
fn engines<T: Send>(n: usize, cfg: EngineConfig, f: impl Fn(Engine) -> Result<T> + Sync) -> Vec<Result<T>> {
    let store = HashStore::new();
    common::run_ranks_on(n, &store, &device, |b| b, |ctx| f(new_engine(ctx, cfg.clone())?))
}

/// Every other test of this file once more, in a process of their own, on shared memory: where
/// every rank shares one host's area the engine's cycles go through it (one step each, with
/// nudges to ranks that wait idle), not over the pairs.
#[test]
fn every_test_again_through_the_shared_area() {
    if std::env::var_os(DEVICE_ENV).is_some() || std::env::var_os(TREE_ENV).is_some() {
        return;
    }
    let args = ["--skip", "every_test_again"];
    let (passed, said) = common::run_again(&args, (DEVICE_ENV, "shm"), Duration::from_secs(600));
    assert!(passed, "this file's tests on shared memory failed: {said}");
}

/// Every other test of this file once more, in a process of their own, with every engine
/// agreeing by reduction over the pairs (log2(n) rounds of one message per rank, names in
/// full to the coordinator, its responses down a tree), but those that count what travels
/// with the states (nothing does then).
#[test]
fn every_test_again_agreeing_by_reduction() {
    if std::env::var_os(DEVICE_ENV).is_some() || std::env::var_os(TREE_ENV).is_some() {
        return;
    }
    let args = [
        "--skip",
        "every_test_again",
        "--skip",
        "travel",
        "--skip",
        "the_timeline_holds_negotiation_and_collective_spans",
    ];
    let (passed, said) = common::run_again(&args, (TREE_ENV, "1"), Duration::from_secs(600));
    assert!(passed, "this file's tests agreeing by reduction failed: {said}");
}

/// A cycle whose state does not fit a slot of the host's area (1,500 names of 4,000 bytes
/// submitted at once: about 6 MB to the coordinator, against 2 MiB slots) goes over the pairs
/// for that cycle; the next ones, cached and small, through the area again. On in-process pairs
/// (no area) every cycle goes over the pairs.
#[test]
fn a_state_larger_than_a_slot_of_the_area_goes_over_the_pairs() {
    const NAMES: usize = 1500;
    let r = engines(3, EngineConfig { cache_capacity: 4096, ..cfg() }, |e| {
        let r = e.rank() as i32;
        let name = |t: usize| format!("{t:05}-{}", "x".repeat(4000));
        for round in 0..3 {
            let hs: Vec<_> = (0..NAMES)
                .map(|t| e.allreduce(&name(t), vec![r + t as i32 + round; 2], Reduction::Sum))
                .collect::<Result<_>>()?;
            for (t, h) in hs.into_iter().enumerate() {
                let got = h.wait()?;
                let want = 3 * (t as i32 + round) + 3;
                if got.data != [want; 2] {
                    return Err(Error::invalid(format!("round {round}, tensor {t}: {:?}, want {want}", got.data)));
                }
            }
        }
        Ok(e.stats())
    });
    for st in all_ok(r) {
        assert_eq!(st.cache_hits as usize, 2 * NAMES, "the second and third rounds hit the cache: {st:?}");
    }
}

/// A small deterministic generator (each rank its own stream).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

fn cfg() -> EngineConfig {
    EngineConfig { stall_check: None, ..EngineConfig::default() }
}

/// Rank r's value at element i of tensor t.
fn val(r: usize, t: usize, i: usize) -> i64 {
    ((r * 7 + t * 13 + i * 3) % 17) as i64 - 8
}

#[test]
fn random_submission_orders_from_two_threads_give_the_sequential_result_on_every_rank() {
    for n in [1usize, 2, 3, 4, 5] {
        let tensors = 24;
        let sizes: Vec<usize> = (0..tensors).map(|t| 1 + (t * 37) % 300).collect();
        let results = engines(n, cfg(), |e| {
            let r = e.rank();
            let mut rng = Lcg(r as u64 * 7919 + n as u64);
            let mut out = Vec::new();
            for step in 0..3 {
                let mut order: Vec<usize> = (0..tensors).collect();
                rng.shuffle(&mut order);
                let (a, b) = order.split_at(tensors / 2);
                // Two threads submit half each, in this rank's own order.
                let sub = |part: &[usize]| -> Result<Vec<_>> {
                    part.iter()
                        .map(|&t| {
                            let name = format!("t{t}");
                            match t % 3 {
                                0 => {
                                    let v: Vec<f32> = (0..sizes[t]).map(|i| val(r, t, i) as f32).collect();
                                    e.allreduce(&name, v, Reduction::Sum).map(|h| (t, Kind3::F(h)))
                                }
                                1 => {
                                    let v: Vec<i64> = (0..sizes[t]).map(|i| val(r, t, i)).collect();
                                    e.allreduce(&name, v, Reduction::Sum).map(|h| (t, Kind3::I(h)))
                                }
                                _ => {
                                    let v: Vec<f64> = (0..sizes[t]).map(|i| val(r, t, i) as f64).collect();
                                    e.allreduce(&name, v, Reduction::Max).map(|h| (t, Kind3::D(h)))
                                }
                            }
                        })
                        .collect()
                };
                let handles = std::thread::scope(|s| {
                    let sub = &sub;
                    let ha = s.spawn(move || sub(a));
                    let hb = sub(b);
                    let ha = ha.join().expect("submitting thread panicked");
                    (ha, hb)
                });
                let (ha, hb) = handles;
                for (t, h) in ha?.into_iter().chain(hb?) {
                    let got: Vec<f64> = match h {
                        Kind3::F(h) => h.wait()?.data.into_iter().map(f64::from).collect(),
                        Kind3::I(h) => h.wait()?.data.into_iter().map(|x| x as f64).collect(),
                        Kind3::D(h) => h.wait()?.data,
                        Kind3::U(h) => h.wait()?.data.into_iter().map(f64::from).collect(),
                    };
                    out.push((step, t, got));
                }
            }
            out.sort_by_key(|x| (x.0, x.1));
            Ok((out, e.stats()))
        });
        let results = all_ok(results);
        for (rank, (out, stats)) in results.iter().enumerate() {
            assert_eq!(out.len(), 3 * tensors);
            for (step, t, got) in out {
                let want: Vec<f64> = (0..sizes[*t])
                    .map(|i| {
                        let each = (0..n).map(|r| val(r, *t, i) as f64);
                        if t % 3 == 2 { each.fold(f64::MIN, f64::max) } else { each.sum() }
                    })
                    .collect();
                assert_eq!(got, &want, "n={n} rank {rank} step {step} tensor {t}");
            }
            // After the first step every name is in the response cache.
            assert!(stats.cache_hits >= 2 * tensors as u64, "n={n} rank {rank}: {stats:?}");
        }
    }
}

enum Kind3 {
    U(ferrogloo::engine::Handle<Tensor<u8>>),
    F(ferrogloo::engine::Handle<Tensor<f32>>),
    I(ferrogloo::engine::Handle<Tensor<i64>>),
    D(ferrogloo::engine::Handle<Tensor<f64>>),
}

/// Submits `a` on rank 0 and `b` on rank 1 under one name; returns both ranks' errors.
fn mismatch(a: impl Fn(&Engine) -> Result<()> + Sync, b: impl Fn(&Engine) -> Result<()> + Sync) -> Vec<String> {
    let r = engines(2, cfg(), |e| {
        let err = if e.rank() == 0 { a(&e) } else { b(&e) };
        match err {
            Err(Error::Mismatch { detail, .. }) => Ok(detail),
            other => Err(Error::invalid(format!("rank {} expected a mismatch, got {other:?}", e.rank()))),
        }
    });
    all_ok(r)
}

fn ar<T: ferrogloo::Element>(e: &Engine, v: Vec<T>, shape: Vec<usize>, o: AllreduceOptions) -> Result<()> {
    e.allreduce_with("layer3.grad", Tensor::new(v, shape)?, &o)?.wait().map(drop)
}

#[test]
fn every_mismatch_kind_is_an_error_in_words_on_every_rank() {
    let sum = AllreduceOptions::new(Reduction::Sum);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            mismatch(|e| ar(e, vec![0f32; 192], vec![64, 3], sum), |e| ar(e, vec![f16::ZERO; 192], vec![64, 3], sum)),
            "allreduce 'layer3.grad': rank 1 submitted f16 [64, 3], rank 0 f32 [64, 3]",
        ),
        (
            mismatch(|e| ar(e, vec![0f32; 192], vec![64, 3], sum), |e| ar(e, vec![0f32; 192], vec![3, 64], sum)),
            "allreduce 'layer3.grad': rank 1 submitted f32 [3, 64], rank 0 f32 [64, 3]",
        ),
        (
            mismatch(
                |e| ar(e, vec![0f32; 4], vec![4], sum),
                |e| ar(e, vec![0f32; 4], vec![4], AllreduceOptions::new(Reduction::Average)),
            ),
            "allreduce 'layer3.grad': rank 1 submitted f32 [4] op average, rank 0 f32 [4] op sum",
        ),
        (
            mismatch(|e| ar(e, vec![0f32; 4], vec![4], sum), |e| ar(e, vec![0f32; 4], vec![4], sum.prescale(0.5))),
            "allreduce 'layer3.grad': rank 1 submitted f32 [4] prescale 0.5, rank 0 f32 [4] prescale 1",
        ),
        (
            mismatch(|e| ar(e, vec![0f32; 4], vec![4], sum), |e| ar(e, vec![0f32; 4], vec![4], sum.postscale(2.0))),
            "allreduce 'layer3.grad': rank 1 submitted f32 [4] postscale 2, rank 0 f32 [4] postscale 1",
        ),
        (
            mismatch(
                |e| ar(e, vec![0f32; 4], vec![4], sum),
                |e| ar(e, vec![0f32; 4], vec![4], sum.compression(Compression::BF16)),
            ),
            "allreduce 'layer3.grad': rank 1 submitted f32 [4] compression BF16, rank 0 f32 [4] compression None",
        ),
        (
            mismatch(
                |e| e.broadcast("layer3.grad", vec![0u8; 4], 0)?.wait().map(drop),
                |e| e.broadcast("layer3.grad", vec![0u8; 4], 1)?.wait().map(drop),
            ),
            "broadcast 'layer3.grad': rank 1 submitted u8 [4] root 1, rank 0 u8 [4] root 0",
        ),
        (
            mismatch(
                |e| ar(e, vec![0f32; 4], vec![4], sum),
                |e| e.allgather("layer3.grad", vec![0f32; 4])?.wait().map(drop),
            ),
            "collective 'layer3.grad': rank 1 submitted allgather f32 [4], rank 0 allreduce f32 [4]",
        ),
        (
            mismatch(
                |e| e.allgather("layer3.grad", Tensor::new(vec![0i32; 6], vec![3, 2])?)?.wait().map(drop),
                |e| e.allgather("layer3.grad", Tensor::new(vec![0i32; 6], vec![2, 3])?)?.wait().map(drop),
            ),
            "allgather 'layer3.grad': rank 1 submitted i32 [2, 3], rank 0 i32 [3, 2]",
        ),
    ];
    for (details, want) in cases {
        assert_eq!(details, vec![want.to_string(), want.to_string()]);
    }
}

#[test]
fn a_mismatch_fails_only_that_name_and_the_engine_goes_on() {
    let r = engines(3, cfg(), |e| {
        let bad = e.allreduce("bad", vec![1f32; 2 + usize::from(e.rank() == 2)], Reduction::Sum)?;
        let good = e.allreduce("good", vec![e.rank() as u32; 5], Reduction::Sum)?;
        let err = bad.wait().err().ok_or_else(|| Error::invalid("no mismatch"))?;
        let good = good.wait()?.data;
        let again = e.allreduce("bad", vec![1f32; 2], Reduction::Sum)?.wait()?.data;
        Ok((err.to_string(), good, again))
    });
    for (err, good, again) in all_ok(r) {
        assert_eq!(err, "the ranks disagree: allreduce 'bad': rank 2 submitted f32 [3], rank 0 f32 [2]");
        assert_eq!(good, vec![3; 5]);
        assert_eq!(again, vec![3.0; 2]);
    }
}

#[test]
fn a_stalled_name_is_reported_naming_the_missing_rank_within_the_threshold() {
    let check = Duration::from_millis(300);
    let go = Barrier::new(2);
    let r = engines(2, EngineConfig { stall_check: Some(check), ..EngineConfig::default() }, |e| {
        if e.rank() == 0 {
            let h = e.allreduce("late", vec![1f32; 3], Reduction::Sum)?;
            let start = Instant::now();
            let report = loop {
                if let Some(r) = e.stall_reports().into_iter().next() {
                    break r;
                }
                if start.elapsed() > check * 10 {
                    go.wait();
                    return Err(Error::invalid("no stall report"));
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            let reported_after = start.elapsed();
            go.wait();
            let sum = h.wait()?.data;
            Ok(Some((report, reported_after, sum)))
        } else {
            // Rank 1 submits only once rank 0 has seen the report.
            go.wait();
            e.allreduce("late", vec![2f32; 3], Reduction::Sum)?.wait()?;
            Ok(None)
        }
    });
    let r = all_ok(r);
    let (report, after, sum) = r[0].clone().expect("rank 0 reports");
    assert_eq!((report.name.as_str(), report.op), ("late", "allreduce"));
    assert_eq!((report.submitted, report.missing), (vec![0], vec![1]));
    assert!(report.waited >= check, "{:?}", report.waited);
    assert!(after < check + Duration::from_secs(3), "reported {after:?} after submission, threshold {check:?}");
    assert_eq!(sum, vec![3.0; 3]);
}

#[test]
fn stall_shutdown_fails_every_rank_with_the_cause() {
    let limit = Duration::from_millis(400);
    let r =
        engines(3, EngineConfig { stall_check: None, stall_shutdown: Some(limit), ..EngineConfig::default() }, |e| {
            let start = Instant::now();
            let err = if e.rank() == 2 {
                // Never submits "x" (a broadcast: a rank that joined is still needed); its engine
                // learns the cause from rank 0.
                e.join()?.wait().err()
            } else {
                e.broadcast("x", vec![1u8; 1], 0)?.wait().err()
            };
            let err = err.ok_or_else(|| Error::invalid("no error"))?;
            let later = e.allreduce("after", vec![0u8; 1], Reduction::Sum).err().map(|e| e.to_string());
            Ok((err, start.elapsed(), later))
        });
    for (rank, (err, took, later)) in all_ok(r).into_iter().enumerate() {
        let text = err.to_string();
        assert!(text.contains("'x'") && text.contains("stall shutdown"), "rank {rank}: {text}");
        match (rank, &err) {
            (0, Error::Timeout { ranks, .. }) => assert_eq!(ranks, &vec![2]),
            (_, Error::PeerTimedOut { rank: 0, .. }) => {}
            _ => panic!("rank {rank}: unexpected {err:?}"),
        }
        // Rank 0 submitted "x" first thing: it waited the whole limit.
        assert!((rank != 0 || took >= limit) && took < limit + Duration::from_secs(5), "rank {rank}: {took:?}");
        assert_eq!(later, Some(text), "rank {rank}: later submissions report the first cause");
    }
}

#[test]
fn the_cache_serves_repeats_and_a_changed_shape_invalidates_it_on_every_rank() {
    let r = engines(2, cfg(), |e| {
        let r = e.rank() as f32;
        for _ in 0..3 {
            assert_eq!(e.allreduce("w", vec![r + 1.0; 4], Reduction::Sum)?.wait()?.data, vec![3.0; 4]);
        }
        let after_repeats = e.stats();
        // Both change the shape: the slot is invalidated, renegotiated, cached again.
        for _ in 0..2 {
            assert_eq!(e.allreduce("w", vec![r + 1.0; 6], Reduction::Sum)?.wait()?.data, vec![3.0; 6]);
        }
        let after_change = e.stats();
        // One rank changes the type: a mismatch on both, not stale data.
        let err = if e.rank() == 0 {
            e.allreduce("w", vec![1.0f64; 6], Reduction::Sum)?.wait().err()
        } else {
            e.allreduce("w", vec![1.0f32; 6], Reduction::Sum)?.wait().err()
        };
        Ok((after_repeats, after_change, err.map(|e| e.to_string())))
    });
    for (a, b, err) in all_ok(r) {
        assert_eq!((a.coordinated, a.cache_hits), (1, 2), "{a:?}");
        assert_eq!((b.coordinated, b.cache_hits), (2, 3), "{b:?}");
        assert_eq!(err.as_deref(), Some("the ranks disagree: allreduce 'w': rank 1 submitted f32 [6], rank 0 f64 [6]"));
    }
}

#[test]
fn a_small_cache_evicts_and_stays_correct() {
    let r = engines(3, EngineConfig { cache_capacity: 2, ..cfg() }, |e| {
        let mut sums = Vec::new();
        for step in 0..6 {
            let hs: Vec<_> = (0..4)
                .map(|t| e.allreduce(&format!("n{}", (t + step) % 5), vec![(e.rank() + t) as i32; 3], Reduction::Sum))
                .collect::<Result<_>>()?;
            for h in hs {
                sums.push(h.wait()?.data[0]);
            }
        }
        Ok((sums, e.stats()))
    });
    for (sums, st) in all_ok(r) {
        let want: Vec<i32> = (0..6).flat_map(|_| (0..4).map(|t| 3 + 3 * t)).collect();
        assert_eq!(sums, want);
        assert!(st.cache_hits > 0 && st.coordinated > 4, "{st:?}");
    }
}

#[test]
fn fusion_packs_matching_tensors_up_to_the_threshold() {
    // 10 f32 tensors of 100 elements (400 bytes) and 3 f64 ones, one group so that they are
    // ready in one cycle; threshold 1200 bytes: f32 batches of 3,3,3,1 and f64 800+800 > 1200
    // so 1,1,1.
    let r = engines(3, EngineConfig { fusion_threshold: 1200, ..cfg() }, |e| {
        let r = e.rank() as f32;
        let tensors: Vec<(String, Tensor<f32>)> =
            (0..10).map(|t| (format!("f{t}"), Tensor::from(vec![r + t as f32; 100]))).collect();
        let hs = e.grouped_allreduce("f32s", tensors, &AllreduceOptions::new(Reduction::Sum))?;
        let doubles: Vec<(String, Tensor<f64>)> =
            (0..3).map(|t| (format!("d{t}"), Tensor::from(vec![r as f64; 100]))).collect();
        let hd = e.grouped_allreduce("f64s", doubles, &AllreduceOptions::new(Reduction::Sum))?;
        let mut got = Vec::new();
        for h in hs {
            got.push(h.wait()?.data);
        }
        for h in hd {
            assert_eq!(h.wait()?.data, vec![3.0; 100]);
        }
        Ok((got, e.stats()))
    });
    for (got, st) in all_ok(r) {
        for (t, v) in got.iter().enumerate() {
            assert_eq!(v, &vec![3.0 + 3.0 * t as f32; 100]);
        }
        // Each group is ready in one cycle: the f32 ones fuse 3+3+3 (+1 alone), the f64 ones
        // (800 bytes each) do not.
        assert_eq!((st.fused_batches, st.fused_tensors), (3, 9), "{st:?}");
    }
}

/// Ranks on one host fuse through the shared area, copying each tensor straight in and out
/// (no fusion buffer): so a tensor above `fusion_max_tensor` joins its batch too. Scaling
/// applies to each tensor in place; a compressed group still goes through the fusion buffer.
#[test]
fn fused_batches_through_the_shared_area_copy_no_tensor_and_scale_each() {
    for n in [2usize, 3] {
        let store = HashStore::new();
        let config = EngineConfig { fusion_threshold: 1 << 22, fusion_max_tensor: 1000, ..cfg() };
        let r = common::run_ranks_on(
            n,
            &store,
            &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
            |b| b,
            |ctx| {
                let e = new_engine(ctx, config.clone())?;
                let r = e.rank() as f32;
                // Sizes around the one-step limit and a slot: 0 to 600,000 elements.
                let lens = [0usize, 1, 100, 5000, 70_000, 600_000];
                let tensors: Vec<(String, Tensor<f32>)> = lens
                    .iter()
                    .enumerate()
                    .map(|(t, &l)| (format!("t{t}"), Tensor::from(vec![r + t as f32; l])))
                    .collect();
                let opts = AllreduceOptions::new(Reduction::Average).prescale(2.0).postscale(0.5);
                let hs = e.grouped_allreduce("plain", tensors, &opts)?;
                let squeezed: Vec<(String, Tensor<f32>)> =
                    (0..3).map(|t| (format!("c{t}"), Tensor::from(vec![r + 1.0; 64]))).collect();
                let hc = e.grouped_allreduce(
                    "squeezed",
                    squeezed,
                    &AllreduceOptions::new(Reduction::Sum).compression(Compression::F16),
                )?;
                let mut got = Vec::new();
                for h in hs {
                    got.push(h.wait()?.data);
                }
                let mut packed = Vec::new();
                for h in hc {
                    packed.push(h.wait()?.data);
                }
                Ok((got, packed, e.stats()))
            },
        );
        let mean_rank = (n - 1) as f32 / 2.0;
        let sum_ranks_plus_one = (n * (n + 1) / 2) as f32;
        for (got, packed, st) in all_ok(r) {
            for (t, v) in got.iter().enumerate() {
                // The average of 2(r + t), halved: the mean of r + t.
                assert!(
                    v.iter().all(|&x| x == mean_rank + t as f32),
                    "{n} ranks, tensor {t}: {:?}",
                    &v[..v.len().min(4)]
                );
            }
            assert!(packed.iter().all(|v| v == &vec![sum_ranks_plus_one; 64]), "{packed:?}");
            // Both groups fused whole: the plain one with its tensors above fusion_max_tensor.
            assert_eq!((st.fused_batches, st.fused_tensors), (2, 9), "{st:?}");
        }
    }
}

#[test]
fn fusion_threshold_zero_runs_each_tensor_alone_and_compression_and_scaling_apply() {
    let r = engines(2, EngineConfig { fusion_threshold: 0, ..cfg() }, |e| {
        let r = e.rank() as f32;
        let opts = AllreduceOptions::new(Reduction::Average).prescale(2.0).postscale(0.5).compression(Compression::F16);
        let a = e.allreduce_with("a", vec![r + 1.0; 8], &opts)?;
        let b = e.allreduce_with(
            "b",
            vec![r + 3.0; 8],
            &AllreduceOptions::new(Reduction::Sum).compression(Compression::BF16),
        )?;
        let c = e.allreduce("c", vec![r * 2.0 + 1.0; 8], Reduction::Average)?;
        Ok((a.wait()?.data, b.wait()?.data, c.wait()?.data, e.stats()))
    });
    for (a, b, c, st) in all_ok(r) {
        // (2·1 + 2·2)/2 · 0.5 = 1.5
        assert_eq!(a, vec![1.5; 8]);
        assert_eq!(b, vec![7.0; 8]);
        assert_eq!(c, vec![2.0; 8]);
        assert_eq!(st.fused_batches, 0, "{st:?}");
    }
}

#[test]
fn join_with_uneven_step_counts() {
    let r = engines(3, cfg(), |e| {
        let r = e.rank();
        let mut sums = Vec::new();
        for step in 0..(r + 2) {
            let h = e.allreduce("g", vec![(r + 1) as f64; 4], Reduction::Sum)?;
            let avg = e.allreduce("avg", vec![(r + 1) as f64; 2], Reduction::Average)?;
            sums.push((step, h.wait()?.data[0], avg.wait()?.data[0]));
        }
        let last = e.join()?.wait()?;
        // After the join everyone is back.
        let after = e.allreduce("g", vec![1.0f64; 1], Reduction::Sum)?.wait()?.data[0];
        Ok((sums, last, after))
    });
    for (rank, (sums, last, after)) in all_ok(r).into_iter().enumerate() {
        for (step, sum, avg) in sums {
            // Ranks still stepping at `step`: those with r + 2 > step.
            let active: Vec<f64> = (0..3).filter(|q| q + 2 > step).map(|q| (q + 1) as f64).collect();
            assert_eq!(sum, active.iter().sum::<f64>(), "rank {rank} step {step}");
            assert_eq!(avg, active.iter().sum::<f64>() / active.len() as f64, "rank {rank} step {step}");
        }
        assert_eq!(last, 2, "rank {rank}: the last to join");
        assert_eq!(after, 3.0);
    }
}

#[test]
fn a_panicking_callback_fails_every_rank_with_its_cause() {
    let registered = Barrier::new(3);
    let r = engines(3, cfg(), |e| {
        if e.rank() == 1 {
            // Registered before the others submit: it runs on the engine's background thread.
            e.allreduce("cb", vec![1u16; 3], Reduction::Sum)?.then(|_| panic!("boom in the callback"));
            registered.wait();
        } else {
            registered.wait();
            e.allreduce("cb", vec![1u16; 3], Reduction::Sum)?.wait()?;
        }
        // Once it ran (the background thread runs callbacks, so that may be after many more
        // collectives: on a busy machine, thousands), every collective fails everywhere with
        // the panic as its cause.
        let start = Instant::now();
        for i in 0.. {
            let out = e.allreduce(&format!("next{}", i % 4), vec![1u16; 3], Reduction::Sum).and_then(|h| h.wait());
            if let Err(err) = out {
                return Ok(Some(err.to_string()));
            }
            assert!(start.elapsed() < TIMEOUT, "the engine did not fail in time");
        }
        Ok(None)
    });
    for (rank, err) in all_ok(r).into_iter().enumerate() {
        let err = err.unwrap_or_default();
        assert!(
            err.contains("rank 1") && err.contains("boom in the callback") && err.contains("'cb'"),
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn broadcast_allgather_alltoall_reduce_scatter_and_barrier() {
    let n = 3;
    let r = engines(n, cfg(), |e| {
        let r = e.rank();
        let b = e.broadcast("b", vec![r as u64 * 10 + 1; 5], 2)?;
        // Rank r gathers r + 1 rows of 2.
        let g = e.allgather("g", Tensor::new(vec![r as i16; (r + 1) * 2], vec![r + 1, 2])?)?;
        let a = e.alltoall("a", Tensor::new((0..6).map(|i| (r * 100 + i) as u32).collect(), vec![n * 2])?)?;
        let s =
            e.reduce_scatter("s", Tensor::new((0..8).map(|i| (i + r) as f32).collect(), vec![4, 2])?, Reduction::Sum)?;
        let bar = e.barrier()?;
        bar.wait()?;
        Ok((b.wait()?, g.wait()?, a.wait()?, s.wait()?))
    });
    for (rank, (b, g, a, s)) in all_ok(r).into_iter().enumerate() {
        assert_eq!(b.data, vec![21; 5]);
        assert_eq!(g.shape, vec![6, 2]);
        assert_eq!(g.data, vec![0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]);
        let want: Vec<u32> = (0..n).flat_map(|p| (0..2).map(move |k| (p * 100 + rank * 2 + k) as u32)).collect();
        assert_eq!(a.data, want);
        // 4 rows over 3 ranks: 2,1,1.
        let rows = [0..2, 2..3, 3..4][rank].clone();
        assert_eq!(s.shape, vec![rows.len(), 2]);
        let want: Vec<f32> =
            rows.flat_map(|row| (0..2).map(move |c| (0..n).map(|q| (row * 2 + c + q) as f32).sum())).collect();
        assert_eq!(s.data, want);
    }
}

#[test]
fn process_sets_negotiate_on_their_own() {
    let store = HashStore::new();
    let r = common::run_ranks_on(
        4,
        &store,
        &device,
        |b| b,
        |ctx: Context| {
            let evens = ctx.split(Some((ctx.rank() % 2) as u32), 0)?.ok_or_else(|| Error::invalid("no group"))?;
            let world = new_engine(ctx, cfg())?;
            let half = new_engine(evens, cfg())?;
            let r = world.rank() as i32;
            // Both engines in flight at once, names shared between them.
            let h1 = half.allreduce("x", vec![r; 2], Reduction::Sum)?;
            let h2 = world.allreduce("x", vec![r; 2], Reduction::Sum)?;
            let (a, b) = (h1.wait()?.data[0], h2.wait()?.data[0]);
            drop(half);
            Ok((a, b))
        },
    );
    let got = all_ok(r);
    assert_eq!(got, vec![(2, 6), (4, 6), (2, 6), (4, 6)]);
}

#[test]
fn a_duplicate_name_in_flight_and_bad_arguments_are_refused_at_once() {
    // Two ranks, so "dup" stays in flight on rank 0 until rank 1 submits it: rank 1
    // waits at the barrier until rank 0 has tried the duplicate (with one rank the
    // first "dup" could finish before the second submission).
    let gate = std::sync::Barrier::new(2);
    let r = engines(2, cfg(), |e| {
        let errs = [
            e.allreduce("a", vec![1i32], Reduction::Average).err(),
            e.allreduce_with("a", vec![1f64], &AllreduceOptions::new(Reduction::Sum).compression(Compression::F16))
                .err(),
            e.allreduce("ferrogloo.mine", vec![1f32], Reduction::Sum).err(),
            e.broadcast("a", vec![1f32], 2).err(),
            e.allreduce("", vec![1f32], Reduction::Sum).err(),
        ];
        let (h, dup) = if e.rank() == 0 {
            let h = e.allreduce("dup", vec![1f32], Reduction::Sum)?;
            let dup = e.allreduce("dup", vec![1f32], Reduction::Sum).err();
            gate.wait();
            (h, dup)
        } else {
            gate.wait();
            (e.allreduce("dup", vec![1f32], Reduction::Sum)?, None)
        };
        let sum = h.wait()?.data;
        Ok((errs.map(|e| e.map(|e| e.to_string())), dup.map(|e| e.to_string()), sum))
    });
    for (rank, (errs, dup, sum)) in all_ok(r).into_iter().enumerate() {
        assert!(errs[0].as_deref().is_some_and(|e| e.contains("average of i32")), "{errs:?}");
        assert!(errs[1].as_deref().is_some_and(|e| e.contains("f32 tensors, not f64")), "{errs:?}");
        assert!(errs[2].as_deref().is_some_and(|e| e.contains("are the engine's")), "{errs:?}");
        assert!(errs[3].as_deref().is_some_and(|e| e.contains("root 2 is not a rank of 2")), "{errs:?}");
        assert!(errs[4].as_deref().is_some_and(|e| e.contains("1 to 4096 bytes")), "{errs:?}");
        if rank == 0 {
            assert!(dup.as_deref().is_some_and(|e| e.contains("'dup' is already in flight on rank 0")), "{dup:?}");
        }
        assert_eq!(sum, vec![2f32], "rank {rank}");
    }
}

#[test]
fn the_timeline_holds_negotiation_and_collective_spans_and_can_be_stopped_and_restarted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tl.json");
    let cfg = EngineConfig { timeline: Some(path.clone()), ..cfg() };
    let second = dir.path().join("second.json");
    let r = engines_with_model(2, eager_model(), cfg, |e| {
        for step in 0..3 {
            let a = e.allreduce("grad.a", vec![step as f32; 10], Reduction::Sum)?;
            let b = e.allreduce("grad.b", vec![step as f32; 10], Reduction::Sum)?;
            a.wait()?;
            b.wait()?;
        }
        e.stop_timeline()?;
        e.start_timeline(&second)?;
        e.broadcast("bc", vec![1u8; 4], 0)?.wait()?;
        Ok(())
    });
    all_ok(r);
    let tl: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("timeline")).expect("JSON");
    let names: Vec<String> = tl["traceEvents"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["name"].as_str().map(String::from))
        .collect();
    // The first step's names go to the coordinator and run as allreduces; later, small and
    // cached, they are reduced from the tensors that travelled with the negotiation.
    for want in ["NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE", "ALLREDUCE_WITH_NEGOTIATION"] {
        assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
    }
    assert!(!names.iter().any(|n| n == "BROADCAST"), "written after the stop: {names:?}");
    // Rank 0's negotiation spans name each rank's ready time.
    let ev = tl["traceEvents"].as_array().expect("events");
    assert!(ev.iter().any(|e| e["name"] == "NEGOTIATE_ALLREDUCE" && e["args"]["rank 1 ready"].is_number()));
    let second: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&second).expect("second")).expect("JSON");
    assert!(second["traceEvents"].as_array().expect("events").iter().any(|e| e["name"] == "BROADCAST"));
}

#[test]
fn a_submission_right_after_start_timeline_is_in_that_timeline() {
    // The engine's thread takes timeline commands and submissions from one queue; one taken
    // before the other let a submission made just after `start_timeline` run with the timeline
    // still stopped, in neither file. Many restarts, each followed at once by a submission.
    const ROUNDS: usize = 200;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = |i: usize| dir.path().join(format!("tl-{i}.json"));
    let r = engines(2, cfg(), |e| {
        for i in 0..ROUNDS {
            // Nothing after the last wait: a peer that finished drops its engine, which stops
            // this one's too.
            if i > 0 {
                e.stop_timeline()?;
            }
            e.start_timeline(path(i))?;
            e.allreduce(&format!("x{i}"), vec![1f32; 4], Reduction::Sum)?.wait()?;
        }
        Ok(())
    });
    all_ok(r);
    for i in 0..ROUNDS {
        let tl: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path(i)).expect("timeline")).expect("JSON");
        let names: Vec<&str> =
            tl["traceEvents"].as_array().expect("events").iter().filter_map(|e| e["name"].as_str()).collect();
        assert!(names.contains(&"ALLREDUCE"), "round {i}: the allreduce is missing from its timeline: {names:?}");
    }
}

#[test]
fn dropping_one_engine_stops_the_others_with_its_rank_named() {
    let go = Barrier::new(2);
    let r = engines(2, cfg(), |e| {
        if e.rank() == 1 {
            e.allreduce("warm", vec![1u8], Reduction::Sum)?.wait()?;
            go.wait();
            drop(e);
            return Ok(None);
        }
        e.allreduce("warm", vec![1u8], Reduction::Sum)?.wait()?;
        let h = e.allreduce("never", vec![1u8], Reduction::Sum)?;
        go.wait();
        Ok(Some(h.wait_timeout(TIMEOUT).err().map(|e| e.to_string())))
    });
    let r = all_ok(r);
    let err = r[0].clone().flatten().unwrap_or_default();
    assert!(err.contains("rank 1") && err.contains("shut down"), "{err}");
}

#[test]
fn min_with_a_joined_rank_is_refused_on_every_rank_and_a_joined_rank_cannot_submit() {
    let joined = Barrier::new(2);
    let r = engines(2, cfg(), |e| {
        if e.rank() == 1 {
            let j = e.join()?;
            let refused = e.allreduce("late", vec![1f32], Reduction::Sum).err().map(|e| e.to_string());
            joined.wait();
            let last = j.wait()?;
            return Ok((refused, None, last));
        }
        joined.wait();
        let min = e.allreduce("m", vec![5f32; 2], Reduction::Min)?.wait().err().map(|e| e.to_string());
        let sum = e.allreduce("s", vec![5f32; 2], Reduction::Sum)?.wait()?.data;
        assert_eq!(sum, vec![5.0; 2]);
        let last = e.join()?.wait()?;
        Ok((min, Some(sum), last))
    });
    let r = all_ok(r);
    assert!(r[1].0.as_deref().is_some_and(|e| e.contains("rank 1 has joined")), "{:?}", r[1].0);
    assert!(
        r[0].0.as_deref().is_some_and(|e| e.contains("min cannot run while ranks [1] have joined")),
        "{:?}",
        r[0].0
    );
    assert_eq!((r[0].2, r[1].2), (0, 0), "rank 0 joined last");
}

#[test]
fn a_group_with_a_bad_member_is_refused_whole() {
    let r = engines(2, cfg(), |e| {
        let bad = e
            .grouped_allreduce(
                "g",
                vec![("a".to_string(), Tensor::from(vec![1f32; 2])), ("a".to_string(), Tensor::from(vec![1f32; 2]))],
                &AllreduceOptions::new(Reduction::Sum),
            )
            .err()
            .map(|e| e.to_string());
        // Nothing of it was submitted: "a" is free, and a good group runs.
        let hs = e.grouped_allreduce(
            "g",
            vec![("a".to_string(), Tensor::from(vec![1f32; 2])), ("b".to_string(), Tensor::from(vec![2f32; 2]))],
            &AllreduceOptions::new(Reduction::Sum),
        )?;
        let got = hs.into_iter().map(|h| Ok(h.wait()?.data)).collect::<Result<Vec<_>>>()?;
        Ok((bad, got))
    });
    for (bad, got) in all_ok(r) {
        assert!(bad.is_some_and(|e| e.contains("'a' is already in flight")));
        assert_eq!(got, vec![vec![2.0; 2], vec![4.0; 2]]);
    }
}

#[test]
fn ranks_with_different_fusion_thresholds_are_refused_at_start() {
    let store = HashStore::new();
    let r = common::run_ranks_on(
        2,
        &store,
        &device,
        |b| b,
        |ctx: Context| {
            let t = if ctx.rank() == 0 { 1 << 20 } else { 2 << 20 };
            new_engine(ctx, EngineConfig { fusion_threshold: t, ..cfg() }).map(drop)
        },
    );
    for (rank, r) in r.into_iter().enumerate() {
        let e = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("fusion threshold") && e.contains("HOROVOD_FUSION_THRESHOLD"), "rank {rank}: {e}");
    }
}

/// (On shared memory, where the setting decides: without an area every rank goes over the
/// pairs whatever it says.)
#[test]
fn ranks_that_negotiate_differently_are_refused_at_start() {
    let store = HashStore::new();
    let r = common::run_ranks_on(
        2,
        &store,
        &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        |b| b,
        |ctx: Context| {
            let through_area = ctx.rank() == 0;
            new_engine(ctx, EngineConfig { negotiate_through_area: through_area, ..cfg() }).map(drop)
        },
    );
    for (rank, r) in r.into_iter().enumerate() {
        let e = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("negotiates") && e.contains("FERROGLOO_ENGINE_AREA"), "rank {rank}: {e}");
    }
}

#[test]
fn shapes_whose_size_overflows_are_refused() {
    let huge = Tensor::<f32>::new(Vec::new(), vec![0, 1 << 40, 1 << 40]);
    assert!(huge.is_err_and(|e| e.to_string().contains("more elements than usize holds")));
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    /// One tensor of the case: its length and element type (0 f32, 1 f64, 2 i32, 3 u8).
    fn run_case(n: usize, tensors: &[(usize, u8)], cfg: EngineConfig, seed: u64) -> Vec<Vec<Vec<f64>>> {
        let r = engines(n, cfg, |e| {
            let r = e.rank();
            let mut order: Vec<usize> = (0..tensors.len()).collect();
            Lcg(seed ^ (r as u64 * 0x9e37)).shuffle(&mut order);
            let v = |t: usize, i: usize| (r * 31 + t * 7 + i) % 13;
            let mut hs = Vec::new();
            for &t in &order {
                let (len, ty) = tensors[t];
                let name = format!("t{t}");
                hs.push((
                    t,
                    match ty {
                        0 => Kind3::F(e.allreduce(
                            &name,
                            (0..len).map(|i| v(t, i) as f32).collect::<Vec<_>>(),
                            Reduction::Sum,
                        )?),
                        1 => Kind3::D(e.allreduce(
                            &name,
                            (0..len).map(|i| v(t, i) as f64).collect::<Vec<_>>(),
                            Reduction::Sum,
                        )?),
                        2 => Kind3::I(e.allreduce(
                            &name,
                            (0..len).map(|i| v(t, i) as i64).collect::<Vec<_>>(),
                            Reduction::Sum,
                        )?),
                        _ => Kind3::U(e.allreduce(
                            &name,
                            (0..len).map(|i| v(t, i) as u8).collect::<Vec<_>>(),
                            Reduction::Sum,
                        )?),
                    },
                ));
            }
            let mut out = vec![Vec::new(); tensors.len()];
            for (t, h) in hs {
                out[t] = match h {
                    Kind3::F(h) => h.wait()?.data.into_iter().map(f64::from).collect(),
                    Kind3::D(h) => h.wait()?.data,
                    Kind3::I(h) => h.wait()?.data.into_iter().map(|x| x as f64).collect(),
                    Kind3::U(h) => h.wait()?.data.into_iter().map(f64::from).collect(),
                };
            }
            Ok(out)
        });
        all_ok(r)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        // Any world size 1-9, tensor lengths (empty ones too), element types, fusion
        // thresholds and cache capacities: every rank gets the sequential sum.
        #[test]
        fn any_orders_sizes_types_and_settings_give_the_sequential_sums(
            n in 1usize..=9,
            tensors in proptest::collection::vec((0usize..700, 0u8..4), 1..10),
            threshold in prop_oneof![Just(0usize), Just(256), Just(4096), Just(64 << 20)],
            capacity in prop_oneof![Just(0usize), Just(1), Just(3), Just(1024)],
            seed in any::<u64>(),
        ) {
            let cfg = EngineConfig { fusion_threshold: threshold, cache_capacity: capacity, ..cfg() };
            let got = run_case(n, &tensors, cfg, seed);
            for (rank, out) in got.iter().enumerate() {
                for (t, &(len, ty)) in tensors.iter().enumerate() {
                    let want: Vec<f64> = (0..len)
                        .map(|i| {
                            let s: usize = (0..n).map(|r| (r * 31 + t * 7 + i) % 13).sum();
                            if ty == 3 { (s % 256) as f64 } else { s as f64 }
                        })
                        .collect();
                    prop_assert_eq!(&out[t], &want, "n={} rank {} tensor {}", n, rank, t);
                }
            }
        }
    }
}

/// A large state message that arrives while rank 0's idle wait looks for stalls every 10 ms is
/// read whole: the idle receive stays posted from one look to the next (withdrawn at a look
/// while half read, the message was lost and both ranks waited for each other to the end).
#[test]
fn a_large_state_message_arriving_between_stall_looks_is_not_lost() {
    let check = Duration::from_millis(40);
    let go = Barrier::new(2);
    let store = HashStore::new();
    let cfg = EngineConfig { stall_check: Some(check), ..EngineConfig::default() };
    // Tensors of one element in 2,000,000 dimensions: rank 1's state message carries their
    // shapes (about 80 MB).
    let names: Vec<String> = (0..5).map(|i| format!("big{i}")).collect();
    let reported = |e: &Engine, name: &str| -> Result<()> {
        let start = Instant::now();
        while !e.stall_reports().iter().any(|r| r.name == name) {
            if start.elapsed() > TIMEOUT {
                return Err(Error::invalid(format!("no stall report of '{name}'")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    };
    let r = common::run_ranks_on(
        2,
        &store,
        &Device::loopback,
        |b| b,
        |ctx: Context| {
            let e = new_engine(ctx, cfg.clone())?;
            let submit = || {
                names
                    .iter()
                    .map(|n| {
                        e.allreduce(n, Tensor::new(vec![e.rank() as u32 + 1], vec![1; 2_000_000])?, Reduction::Sum)
                    })
                    .collect::<Result<Vec<_>>>()
            };
            let (first, hs) = if e.rank() == 0 {
                // Pending on rank 0 only: its idle wait looks for stalls every 10 ms. Rank 1
                // sends its large state once the stall is reported, so the looks are surely on,
                // and rank 0, with nothing to say, receives it in its idle wait.
                let first = e.allreduce("first", vec![1f32], Reduction::Sum)?;
                let seen = reported(&e, "first");
                go.wait();
                seen?;
                reported(&e, "big0")?;
                (first, submit()?)
            } else {
                go.wait();
                let hs = submit()?;
                (e.allreduce("first", vec![1f32], Reduction::Sum)?, hs)
            };
            let sums = hs.into_iter().map(|h| Ok(h.wait()?.data[0])).collect::<Result<Vec<_>>>()?;
            Ok((first.wait()?.data, sums))
        },
    );
    for (first, sums) in all_ok(r) {
        assert_eq!(first, vec![2.0]);
        assert_eq!(sums, vec![3; 5]);
    }
}

#[test]
fn an_engine_on_a_sub_group_whose_ranks_differ_from_the_jobs_negotiates_and_reduces() {
    // Sub-group ranks 0, 1, 2 are the job's ranks 3, 2, 1: messages arrive from pairs that
    // know their peers by the job's ranks, and the engine must name them by the sub-group's.
    let store = HashStore::new();
    let r = common::run_ranks_on(
        4,
        &store,
        &device,
        |b| b,
        |ctx: Context| {
            if ctx.rank() == 0 {
                return Ok(Vec::new());
            }
            let sub = ctx.subgroup(&[3, 2, 1])?;
            let e = new_engine(sub, cfg())?;
            let me = e.rank() as i32;
            let mut got = Vec::new();
            for step in 0..20 {
                let handles = (0..3)
                    .map(|t| e.allreduce(&format!("t{t}"), vec![me + step + t; 3], Reduction::Sum))
                    .collect::<Result<Vec<_>, _>>()?;
                for h in handles {
                    got.push(h.wait()?.data[0]);
                }
            }
            got.push(e.broadcast("b", vec![me * 10 + 7], 1)?.wait()?.data[0]);
            Ok(got)
        },
    );
    let got = all_ok(r);
    let mut want: Vec<i32> = (0..20).flat_map(|step| (0..3).map(move |t| 3 * (step + t) + 3)).collect();
    want.push(17);
    assert!(got[0].is_empty());
    for (rank, g) in got.iter().enumerate().skip(1) {
        assert_eq!(g, &want, "rank {rank}");
    }
}

/// Ranks as threads whose contexts hold `model` (which decides the tensors that travel with
/// the negotiation: see `EngineStats::eager`).
fn engines_with_model<T: Send>(
    n: usize,
    model: ferrogloo::cost::CostModel,
    cfg: EngineConfig,
    f: impl Fn(Engine) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let store = HashStore::new();
    // Tensors travel only with the states of the direct exchange.
    let cfg = EngineConfig { tree_negotiation_from: Some(0), ..cfg };
    common::run_ranks_on(n, &store, &device, |b| b.cost_model(model), |ctx| f(new_engine(ctx, cfg.clone())?))
}

/// A model under which tensors of tens of KiB travel with the negotiation (α large against
/// the links' time for them).
fn eager_model() -> ferrogloo::cost::CostModel {
    "latency_us=100,link_gbs=2,reduce_gbs=4".parse().expect("a model")
}

#[test]
fn small_cached_allreduces_travel_with_the_negotiation_and_a_changed_order_stays_correct() {
    // Tens of KiB travel with the state messages; 2 MiB is over what one message carries, so
    // that tensor runs as an allreduce.
    let model = eager_model();
    let (small, big, steps) = (10usize, 2 << 20 >> 2, 6usize);
    let sizes: Vec<usize> = (0..small).map(|t| [0, 1, 7, 300, 5000][t % 5]).chain([big]).collect();
    for n in [2usize, 3, 5] {
        let results = engines_with_model(n, model, cfg(), |e| {
            let r = e.rank();
            let mut rng = Lcg(r as u64 * 31 + n as u64);
            let mut out = Vec::new();
            let mut eager_by_step = Vec::new();
            for step in 0..steps {
                let mut order: Vec<usize> = (0..sizes.len()).collect();
                rng.shuffle(&mut order);
                // From step 3 rank 1 submits in reverse, half from another thread.
                if r == 1 && step >= 3 {
                    order.reverse();
                }
                let sub = |part: &[usize]| -> Result<Vec<_>> {
                    part.iter()
                        .map(|&t| {
                            let name = format!("t{t}");
                            // Values change from step to step: a tensor kept from an earlier
                            // step would give a wrong sum.
                            if t % 2 == 0 {
                                let v: Vec<f32> = (0..sizes[t]).map(|i| val(r, t + 7 * step, i) as f32).collect();
                                e.allreduce(&name, v, Reduction::Sum).map(|h| (t, Kind3::F(h)))
                            } else {
                                let v: Vec<i64> = (0..sizes[t]).map(|i| val(r, t + 7 * step, i)).collect();
                                e.allreduce(&name, v, Reduction::Sum).map(|h| (t, Kind3::I(h)))
                            }
                        })
                        .collect()
                };
                let handles = if r == 1 && step >= 3 {
                    let (a, b) = order.split_at(order.len() / 2);
                    std::thread::scope(|s| {
                        let sub = &sub;
                        let ha = s.spawn(move || sub(a));
                        let hb = sub(b);
                        let ha = ha.join().expect("submitting thread panicked");
                        ha.and_then(|mut ha| {
                            ha.extend(hb?);
                            Ok(ha)
                        })
                    })?
                } else {
                    sub(&order)?
                };
                for (t, h) in handles {
                    let got: Vec<f64> = match h {
                        Kind3::F(h) => h.wait()?.data.into_iter().map(f64::from).collect(),
                        Kind3::I(h) => h.wait()?.data.into_iter().map(|x| x as f64).collect(),
                        _ => unreachable!("only f32 and i64 here"),
                    };
                    out.push((step, t, got));
                }
                eager_by_step.push(e.stats().eager);
            }
            Ok((out, eager_by_step, e.stats()))
        });
        for (rank, (out, eager_by_step, stats)) in all_ok(results).iter().enumerate() {
            assert_eq!(out.len(), steps * sizes.len());
            for (step, t, got) in out {
                let want: Vec<f64> =
                    (0..sizes[*t]).map(|i| (0..n).map(|r| val(r, *t + 7 * step, i) as f64).sum()).collect();
                assert!(got == &want, "n={n} rank {rank} step {step} tensor {t}: a wrong result");
            }
            // From the second step on, every small name is found in the cache in a cycle in
            // which every rank has it pending: it travels, from every rank, in that cycle. The
            // large one never does.
            assert_eq!(stats.eager, stats.cache_hits - (steps as u64 - 1), "n={n} rank {rank}: {stats:?}");
            assert_eq!(stats.eager, (steps as u64 - 1) * small as u64, "n={n} rank {rank}: {stats:?}");
            // Before and after rank 1 changed its order.
            let per_step: Vec<u64> = eager_by_step.windows(2).map(|w| w[1] - w[0]).collect();
            assert!(per_step.iter().all(|&k| k == small as u64), "n={n} rank {rank}: {per_step:?}");
        }
    }
}

#[test]
fn without_a_model_that_favours_it_nothing_travels_with_the_negotiation() {
    // Links so fast against their latency that sending a tensor to every rank never pays.
    let model: ferrogloo::cost::CostModel =
        "latency_us=0.001,link_gbs=0.001,reduce_gbs=0.001".parse().expect("a model");
    let results = engines_with_model(3, model, cfg(), |e| {
        for step in 0..3 {
            let got = e.allreduce("x", vec![e.rank() as f32 + step as f32; 100], Reduction::Sum)?.wait()?.data;
            assert_eq!(got, vec![3.0 + 3.0 * step as f32; 100]);
        }
        Ok(e.stats())
    });
    for s in all_ok(results) {
        assert_eq!((s.eager, s.cache_hits), (0, 2), "{s:?}");
    }
}

#[test]
fn threads_of_one_rank_waiting_at_once_take_turns_running_the_engine() {
    let (n, threads, rounds) = (3usize, 4usize, 40usize);
    let results = engines(n, cfg(), |e| {
        let r = e.rank();
        std::thread::scope(|s| {
            let runs: Vec<_> = (0..threads)
                .map(|j| {
                    let e = &e;
                    s.spawn(move || -> Result<()> {
                        for k in 0..rounds {
                            let name = format!("thread{j}.{}", k % 5);
                            let v: Vec<i64> = (0..1 + 50 * j).map(|i| val(r, j + k, i)).collect();
                            // No deadline: the waiting threads run the engine, in turns.
                            let got = e.allreduce(&name, v, Reduction::Sum)?.wait()?.data;
                            let want: Vec<i64> =
                                (0..1 + 50 * j).map(|i| (0..n).map(|q| val(q, j + k, i)).sum()).collect();
                            assert_eq!(got, want, "rank {r} thread {j} round {k}");
                        }
                        Ok(())
                    })
                })
                .collect();
            runs.into_iter().try_for_each(|h| h.join().expect("a waiting thread panicked"))
        })
    });
    all_ok(results);
}

#[test]
fn a_callback_runs_with_nobody_waiting_and_a_waiter_leaves_at_its_deadline() {
    let (after_timeout, done) = (Barrier::new(2), Barrier::new(2));
    let results = engines(2, cfg(), |e| {
        let r = e.rank();
        // A caller ran the engine last; then a callback that nobody waits for.
        e.allreduce("warm", vec![1f32; 4], Reduction::Sum)?.wait()?;
        let (tx, rx) = std::sync::mpsc::channel();
        e.allreduce("cb", vec![r as f32 + 1.0; 3], Reduction::Sum)?.then(move |out| {
            let _ = tx.send(out.map(|t| t.data));
        });
        let got = rx.recv_timeout(TIMEOUT).map_err(|_| Error::invalid("the callback did not come"))??;
        assert_eq!(got, vec![3.0; 3]);
        // Rank 0 waits with a deadline for a name rank 1 submits only afterwards.
        if r == 0 {
            let h = e.allreduce("late", vec![1i32; 2], Reduction::Sum)?;
            let start = Instant::now();
            let err = h.wait_timeout(Duration::from_millis(200)).err();
            let waited = start.elapsed();
            assert!(matches!(err, Some(Error::Timeout { .. })), "{err:?}");
            assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(2), "{waited:?}");
            after_timeout.wait();
            // The submission stayed in flight: the name completes for rank 1 (whose result
            // this rank's engine must live to negotiate: it is not dropped before).
            done.wait();
            Ok(None)
        } else {
            after_timeout.wait();
            let late = e.allreduce("late", vec![5i32; 2], Reduction::Sum).and_then(|h| h.wait_timeout(TIMEOUT));
            done.wait();
            Ok(Some(late?.data))
        }
    });
    let results = all_ok(results);
    assert_eq!(results[1], Some(vec![6, 6]));
}

#[test]
fn a_waiting_thread_does_not_run_the_callbacks_of_other_submissions() {
    // A callback may take a lock that the waiting thread holds: it runs on the background
    // thread, never on a thread waiting for its own result.
    let results = engines(2, cfg(), |e| {
        let r = e.rank();
        let held = std::sync::Mutex::new(());
        let (tx, rx) = std::sync::mpsc::channel();
        let mut waiters = Vec::new();
        for round in 0..20 {
            let tx = tx.clone();
            let cb_name = format!("cb{round}");
            let own = format!("own{round}");
            std::thread::scope(|s| -> Result<()> {
                let guard = held.lock().map_err(|_| Error::invalid("poisoned"))?;
                let h = e.allreduce(&own, vec![r as i32; 8], Reduction::Sum)?;
                e.allreduce(&cb_name, vec![1i32; 2], Reduction::Sum)?.then(move |out| {
                    let _ = tx.send((std::thread::current().id(), out.map(|t| t.data)));
                });
                let waiter = s.spawn(move || {
                    let got = h.wait();
                    (std::thread::current().id(), got.map(|t| t.data))
                });
                let (id, got) = waiter.join().expect("the waiting thread panicked");
                assert_eq!(got?, vec![1; 8]);
                waiters.push(id);
                drop(guard);
                Ok(())
            })?;
        }
        drop(tx);
        let mut ran_on = Vec::new();
        for _ in 0..20 {
            let (id, out) = rx.recv_timeout(TIMEOUT).map_err(|_| Error::invalid("a callback did not come"))?;
            assert_eq!(out?, vec![2, 2]);
            ran_on.push(id);
        }
        Ok((waiters, ran_on))
    });
    for (rank, (waiters, ran_on)) in all_ok(results).into_iter().enumerate() {
        assert!(ran_on.iter().all(|id| !waiters.contains(id)), "rank {rank}: a callback ran on a waiting thread");
    }
}

#[test]
fn travelling_tensors_stay_right_through_eviction_invalidation_and_join() {
    // Three hot names stay cached (and travel); a new name every step takes the fourth slot
    // and evicts the last one; at step 4 `b` changes its length (its slot is invalidated on
    // every rank), and changes back; rank 2 joins after step 5. Values depend on the step.
    let n = 3;
    let cfg = EngineConfig { cache_capacity: 4, ..cfg() };
    let len = |name: &str, step: usize| if name == "b" && step == 4 { 9 } else { 5 };
    let results = engines_with_model(n, eager_model(), cfg, |e| {
        let r = e.rank();
        let mut out = Vec::new();
        let last = if r == 2 { 6 } else { 8 };
        for step in 0..last {
            let mut names: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
            if step < 6 {
                names.push(format!("cold{step}"));
            }
            let mut hs = Vec::new();
            for (k, name) in names.iter().enumerate() {
                let v: Vec<i64> = (0..len(name, step)).map(|i| val(r, k + 5 * step, i)).collect();
                hs.push((name.clone(), k, e.allreduce(name, v, Reduction::Sum)?));
            }
            for (name, k, h) in hs {
                out.push((step, name, k, h.wait()?.data));
            }
        }
        e.join()?.wait()?;
        Ok((out, e.stats()))
    });
    for (rank, (out, stats)) in all_ok(results).into_iter().enumerate() {
        for (step, name, k, got) in out {
            // Ranks stepping at `step`: all three before 6, ranks 0 and 1 after (rank 2 joined).
            let live = if step < 6 { 3 } else { 2 };
            let want: Vec<i64> =
                (0..len(&name, step)).map(|i| (0..live).map(|q| val(q, k + 5 * step, i)).sum()).collect();
            assert_eq!(got, want, "rank {rank} step {step} {name}");
        }
        assert!(stats.eager > 0, "rank {rank}: nothing travelled: {stats:?}");
    }
}

/// Over TCP pairs where `Auto` runs the ring, a fused batch runs on its tensors themselves:
/// tensors above `fusion_max_tensor` join batches too, and the ring's segments are cut where
/// the tensors end. Every rank gets the sums at every step, with rank 1 submitting in reverse
/// order from step 2 (the batches are formed from the ready list, the same on every rank).
#[test]
fn fused_batches_over_tcp_run_the_ring_on_the_tensors_themselves() {
    // Every tensor above the 1 MiB of `fusion_max_tensor` (262,145 f32 is 4 bytes more).
    let lens = [300_001usize, 700_000, 262_145, 400_003];
    let model: ferrogloo::cost::CostModel = "latency_us=30,link_gbs=1,reduce_gbs=4".parse().expect("a model");
    let store = HashStore::new();
    let steps = 4;
    let r = common::run_ranks_on(
        3,
        &store,
        &Device::loopback,
        |b| b.cost_model(model),
        |ctx: Context| {
            let big = ctx.allreduce_algorithm((1 << 20) + 1, ferrogloo::Algorithm::Auto)?;
            assert_eq!(big, ferrogloo::Algorithm::Ring, "the model must choose the ring above fusion_max_tensor");
            let e = new_engine(ctx, cfg())?;
            let r = e.rank();
            for step in 0..steps {
                let mut order: Vec<usize> = (0..lens.len()).collect();
                if r == 1 && step >= 2 {
                    order.reverse();
                }
                // The tensors are made first and submitted back to back: made one by one (a
                // debug build on a loaded machine takes milliseconds for each), every submission
                // came after the burst window and ran alone.
                let data: Vec<(usize, Vec<f32>)> = order
                    .iter()
                    .map(|&t| (t, (0..lens[t]).map(|i| (val(r, t, i) + step as i64) as f32).collect()))
                    .collect();
                let hs = data
                    .into_iter()
                    .map(|(t, data)| {
                        Ok((t, e.allreduce(&format!("t{t}"), Tensor::new(data, vec![lens[t]])?, Reduction::Sum)?))
                    })
                    .collect::<Result<Vec<_>>>()?;
                for (t, h) in hs {
                    let got = h.wait()?.data;
                    let bad = (0..lens[t])
                        .find(|&i| got[i] != (0..3).map(|p| (val(p, t, i) + step as i64) as f32).sum::<f32>());
                    assert_eq!(bad, None, "rank {r}, step {step}, tensor {t}: first element wrong");
                }
            }
            Ok(e.stats())
        },
    );
    for s in all_ok(r) {
        // Fused, though each is above `fusion_max_tensor` (with a fusion buffer none would be),
        // and with no fusion buffer.
        assert!(s.fused_batches >= 1 && s.fused_tensors > s.fused_batches, "{s:?}");
        assert_eq!(s.fusion_buffer_batches, 0, "{s:?}");
        assert!(s.collectives < (steps * lens.len()) as u64, "{s:?}");
    }
}

/// A thread that submits several tensors one after the other while nobody waits (the
/// background thread runs the loop) gets them negotiated together and run as one fused
/// collective, not the first alone and the rest as they came; the results are right on every
/// rank.
#[test]
fn a_burst_submitted_while_nobody_waits_is_negotiated_together() {
    let tensors = 8;
    // A generous gap: a loaded machine's ranks start their bursts milliseconds apart.
    let cfg = EngineConfig { batch_gap: Duration::from_millis(200), batch_window: Duration::from_secs(5), ..cfg() };
    let results = engines(3, cfg, |e| {
        let r = e.rank();
        // No caller has waited yet: the background thread holds the loop.
        let data: Vec<Vec<i64>> = (0..tensors).map(|t| (0..64).map(|i| val(r, t, i)).collect()).collect();
        let hs = data
            .into_iter()
            .enumerate()
            .map(|(t, v)| {
                // A few milliseconds apart (as a training step's gradients come), well within
                // the gap: the background thread has woken for the first before the second.
                std::thread::sleep(Duration::from_millis(2));
                e.allreduce(&format!("burst{t}"), v, Reduction::Sum).map(|h| (t, h))
            })
            .collect::<Result<Vec<_>>>()?;
        for (t, h) in hs {
            let want: Vec<i64> = (0..64).map(|i| (0..3).map(|p| val(p, t, i)).sum()).collect();
            assert_eq!(h.wait()?.data, want, "rank {r}, tensor {t}");
        }
        Ok(e.stats())
    });
    for (rank, s) in all_ok(results).into_iter().enumerate() {
        // All of them in one fused collective (came as they did, each ran alone: 8 cycles and
        // 8 collectives). A cycle with nothing to decide may come first, from a rank that
        // began before the others' bursts reached them.
        assert_eq!((s.collectives, s.fused_tensors), (1, tensors as u64), "rank {rank}: {s:?}");
        assert!(s.cycles <= 2, "rank {rank}: {s:?}");
    }
}

/// Engines that agree by reduction (log2(n) rounds of one message each) at sizes that are not
/// powers of two, where some ranks pair up before the doubling: every rank gets the sequential
/// result for names submitted in its own order, cached from the second step on; a rank that
/// joins early leaves the others' allreduces to them, and a broadcast needs it still.
#[test]
fn agreeing_by_reduction_gives_every_rank_the_result_at_any_size() {
    for n in [2usize, 3, 6, 9, 12] {
        let tree = EngineConfig { tree_negotiation_from: Some(2), ..cfg() };
        let results = on_pairs(n, |ctx| {
            let e = Engine::new(ctx, tree.clone())?;
            if !e.agrees_by_reduction() {
                return Err(Error::invalid("configured to agree by reduction, it does not"));
            }
            let r = e.rank();
            let mut rng = Lcg(r as u64 * 31 + n as u64);
            let tensors = 10;
            for step in 0..3 {
                let mut order: Vec<usize> = (0..tensors).collect();
                rng.shuffle(&mut order);
                let hs: Vec<_> = order
                    .iter()
                    .map(|&t| {
                        let v: Vec<i64> = (0..5 + t).map(|i| val(r, t, i) + step).collect();
                        e.allreduce(&format!("t{t}"), v, Reduction::Sum).map(|h| (t, h))
                    })
                    .collect::<Result<_>>()?;
                for (t, h) in hs {
                    let want: Vec<i64> = (0..5 + t).map(|i| (0..n).map(|q| val(q, t, i) + step).sum()).collect();
                    let got = h.wait()?.data;
                    if got != want {
                        return Err(Error::invalid(format!("step {step} tensor {t}: {got:?}, want {want:?}")));
                    }
                }
            }
            // The last rank joins; the others allreduce without it, and broadcast with it.
            if r == n - 1 {
                let b = e.broadcast("bc", vec![0u8; 3], 0)?;
                let last = e.join()?.wait()?;
                let got = b.wait()?.data;
                Ok((e.stats(), got, Some(last)))
            } else {
                let b = e.broadcast("bc", vec![r as u8 + 7; 3], 0)?;
                let s = e.allreduce("after", vec![1i32; 2], Reduction::Sum)?.wait()?.data;
                if n > 1 && s != [n as i32 - 1; 2] {
                    return Err(Error::invalid(format!("without the joined rank: {s:?}")));
                }
                let got = b.wait()?.data;
                e.join()?.wait()?;
                Ok((e.stats(), got, None))
            }
        });
        for (rank, (stats, bc, _)) in all_ok(results).into_iter().enumerate() {
            assert_eq!(bc, vec![7u8; 3], "n={n} rank {rank}: the broadcast");
            assert!(stats.cache_hits >= 20, "n={n} rank {rank}: the second and third steps hit the cache: {stats:?}");
            assert_eq!(stats.eager, 0, "n={n} rank {rank}: nothing travels with a reduction");
        }
    }
}

/// Agreeing by reduction, rank 0 learns only that some rank has a cached name pending, not
/// which: past half the stall threshold the name's cache slot is dropped on every rank, its
/// submissions go to the coordinator in full, and the report names the rank that is missing.
#[test]
fn a_stalled_cached_name_is_reported_naming_the_missing_rank_when_agreeing_by_reduction() {
    let check = Duration::from_millis(400);
    let go = Barrier::new(3);
    let cfg = EngineConfig { tree_negotiation_from: Some(2), stall_check: Some(check), ..EngineConfig::default() };
    let r = on_pairs(3, |ctx| {
        let e = Engine::new(ctx, cfg.clone())?;
        // Cached on every rank.
        e.allreduce("late", vec![1f32; 2], Reduction::Sum)?.wait()?;
        if e.rank() == 2 {
            go.wait();
            e.allreduce("late", vec![1f32; 2], Reduction::Sum)?.wait()?;
            return Ok(None);
        }
        let h = e.allreduce("late", vec![1f32; 2], Reduction::Sum)?;
        let start = Instant::now();
        let report = loop {
            if let Some(r) = e.stall_reports().into_iter().next() {
                break Some(r);
            }
            if e.rank() != 0 || start.elapsed() > check * 10 {
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let after = start.elapsed();
        go.wait();
        let sum = h.wait()?.data;
        Ok(Some((report, after, sum, e.stats())))
    });
    let r = all_ok(r);
    let (report, after, sum, stats) = r[0].clone().expect("rank 0");
    let report = report.expect("rank 0 reports the stall");
    assert_eq!((report.name.as_str(), report.submitted, report.missing), ("late", vec![0, 1], vec![2]));
    assert!(after < check * 4, "reported {after:?} after the submission, threshold {check:?}");
    assert_eq!(sum, vec![3.0; 2]);
    assert!(stats.coordinated >= 2, "the stalled name went to the coordinator again: {stats:?}");
}

#[test]
fn ranks_that_agree_differently_over_the_pairs_are_refused_at_start() {
    // Rank 1 agrees each rank to every other, the others by reduction (3 ranks), or would
    // measure (8 ranks): refused in words, at once, before any rank measures.
    for (n, others) in [(3usize, Some(3)), (8, None)] {
        let start = Instant::now();
        let r = on_pairs(n, |ctx: Context| {
            let from = if ctx.rank() == 1 { Some(0) } else { others };
            Engine::new(ctx, EngineConfig { tree_negotiation_from: from, ..cfg() }).map(drop)
        });
        let way = if others.is_some() { "over the pairs by reduction" } else { "by reduction or not as measured" };
        for (rank, r) in r.into_iter().enumerate() {
            let e = r.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(
                e.contains(way) && e.contains("each rank to every other") && e.contains("FERROGLOO_ENGINE_TREE_FROM"),
                "n={n} rank {rank}: {e}"
            );
        }
        assert!(start.elapsed() < Duration::from_secs(10), "n={n}: refused after {:?}", start.elapsed());
    }
}

/// Left to measure (the default), the ranks time both ways of agreeing as the engine starts
/// and all take the same one, whichever it is; with fewer than 8 ranks, or told, they measure
/// nothing.
#[test]
fn ranks_that_measure_how_to_agree_all_take_the_same_way() {
    for (n, from, want) in [(8usize, None, None), (9, None, None), (7, None, Some(false)), (9, Some(0), Some(false))] {
        let results = on_pairs(n, |ctx| {
            let e = Engine::new(ctx, EngineConfig { tree_negotiation_from: from, ..cfg() })?;
            let sum = e.allreduce("x", vec![e.rank() as u32; 3], Reduction::Sum)?.wait()?.data;
            Ok((e.agrees_by_reduction(), sum))
        });
        let results = all_ok(results);
        let way = results[0].0;
        for (rank, (tree, sum)) in results.into_iter().enumerate() {
            assert_eq!(tree, way, "n={n}: rank {rank} agrees differently from rank 0");
            assert_eq!(sum, vec![(n * (n - 1) / 2) as u32; 3], "n={n} rank {rank}");
        }
        if let Some(want) = want {
            assert_eq!(way, want, "n={n}, tree_negotiation_from {from:?}");
        }
    }
    // Ranks whose caches differ in size (only rank 0's decides where names go) measure with
    // messages of different sizes, and start all the same.
    let r = on_pairs(8, |ctx| {
        let cache_capacity = if ctx.rank() == 3 { 64 } else { 4096 };
        let e = Engine::new(ctx, EngineConfig { cache_capacity, ..cfg() })?;
        Ok(e.allreduce("x", vec![1u8; 2], Reduction::Sum)?.wait()?.data)
    });
    assert_eq!(all_ok(r), vec![vec![8u8; 2]; 8]);
    // Through a host's area there is nothing to choose.
    let store = HashStore::new();
    let r = common::run_ranks_on(
        4,
        &store,
        &|| Ok(Device::shared_memory(&ferrogloo::device::ShmAttr::default())),
        |b| b,
        |ctx| Ok(Engine::new(ctx, EngineConfig { tree_negotiation_from: Some(2), ..cfg() })?.agrees_by_reduction()),
    );
    assert_eq!(all_ok(r), vec![false; 4]);
}
