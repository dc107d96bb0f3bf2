//! `DataParallel` with ranks as threads (in-process transport): the averaged gradients against
//! a sequential mean of every rank's own, over world sizes 1 to 9, shapes and element types;
//! broadcast, metrics, unused parameters and the errors.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use ferrogloo::engine::{Engine, EngineConfig, Reduction};
use ferrogloo::rendezvous::HashStore;
use ferrogloo::{Context, device::Device as Transport};
use ferrogloo_candle::{DataParallel, Error};
use proptest::prelude::*;
use std::time::Duration;

/// Runs `f` on `n` ranks (threads), each with an engine of its own; returns their results.
fn ranks<T: Send>(
    n: usize,
    f: impl Fn(Engine) -> ferrogloo_candle::Result<T> + Sync,
) -> Vec<ferrogloo_candle::Result<T>> {
    let store = HashStore::new();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let (f, store) = (&f, &store);
                s.spawn(move || {
                    let ctx = Context::builder(rank, n)
                        .timeout(Duration::from_secs(30))
                        .connect(store, &Transport::in_process())?;
                    f(Engine::new(ctx, EngineConfig::default())?)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("a rank thread panicked")).collect()
    })
}

fn all_ok<T>(r: Vec<ferrogloo_candle::Result<T>>) -> Vec<T> {
    r.into_iter().enumerate().map(|(i, x)| x.unwrap_or_else(|e| panic!("rank {i}: {e}"))).collect()
}

/// Rank r's input: values that differ per rank and per element.
fn input(rank: usize, rows: usize, cols: usize, dtype: DType) -> Tensor {
    let v: Vec<f64> = (0..rows * cols).map(|i| ((i * 7 + rank * 13) % 11) as f64 / 5.0 - 1.0).collect();
    Tensor::from_vec(v, (rows, cols), &Device::Cpu).and_then(|t| t.to_dtype(dtype)).expect("input")
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all().and_then(|t| t.to_dtype(DType::F64)).and_then(|t| t.to_vec1()).expect("values")
}

/// One step of a linear model `x·w + b` with loss sum((x·w + b)²) on each rank: returns every
/// rank's own gradients and the averaged ones.
type Grads = (Vec<Vec<f64>>, Vec<Vec<f64>>);
fn step(n: usize, rows: usize, cols: usize, outs: usize, dtype: DType) -> Vec<Grads> {
    all_ok(ranks(n, |engine| {
        let r = engine.rank();
        let w = Var::from_tensor(&input(99, cols, outs, dtype))?;
        let b = Var::from_tensor(&input(98, 1, outs, dtype).squeeze(0)?)?;
        let dp = DataParallel::new(engine, [("w".to_string(), w.clone()), ("b".to_string(), b.clone())])?;
        let y = input(r, rows, cols, dtype).matmul(w.as_tensor())?.broadcast_add(b.as_tensor())?;
        let mut grads = y.sqr()?.sum_all()?.backward()?;
        let own = vec![values(grads.get(w.as_tensor()).expect("w's")), values(grads.get(b.as_tensor()).expect("b's"))];
        dp.average_gradients(&mut grads)?;
        let avg = vec![values(grads.get(w.as_tensor()).expect("w's")), values(grads.get(b.as_tensor()).expect("b's"))];
        dp.shutdown()?;
        Ok((own, avg))
    }))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn averaged_gradients_are_the_mean_of_every_ranks_own(
        n in 1usize..=9,
        rows in 1usize..6,
        cols in 1usize..9,
        outs in 1usize..5,
        dtype in prop::sample::select(vec![DType::F32, DType::F64, DType::BF16]),
    ) {
        let got = step(n, rows, cols, outs, dtype);
        for p in 0..2 {
            let len = got[0].0[p].len();
            let want: Vec<f64> = (0..len).map(|i| got.iter().map(|(own, _)| own[p][i]).sum::<f64>() / n as f64).collect();
            let tol = if dtype == DType::BF16 { 2e-2 } else if dtype == DType::F32 { 1e-5 } else { 1e-12 };
            for (rank, (_, avg)) in got.iter().enumerate() {
                for (i, (a, w)) in avg[p].iter().zip(&want).enumerate() {
                    prop_assert!((a - w).abs() <= tol * w.abs().max(1.0),
                        "{n} ranks, {dtype:?}, rank {rank}, parameter {p}[{i}]: {a} vs mean {w}");
                }
                // Every rank holds the same bits.
                prop_assert_eq!(&avg[p], &got[0].1[p]);
            }
        }
    }
}

#[test]
fn a_parameter_without_a_gradient_on_some_ranks_counts_as_zeros_there() {
    let got = all_ok(ranks(3, |engine| {
        let r = engine.rank();
        let used = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let unused = Var::new(&[5f32, 6.0], &Device::Cpu)?;
        let dp = DataParallel::new(engine, [("a".into(), used.clone()), ("u".into(), unused.clone())])?;
        // Only rank 0 uses `u`; its gradient there is 2·(r+1) = [2, 2].
        let mut loss = (used.as_tensor() * (r as f64 + 1.0))?.sum_all()?;
        if r == 0 {
            loss = (loss + (unused.as_tensor() * 2.0)?.sum_all()?)?;
        }
        let mut grads = loss.backward()?;
        dp.average_gradients(&mut grads)?;
        let out = (values(grads.get(used.as_tensor()).expect("a")), values(grads.get(unused.as_tensor()).expect("u")));
        dp.shutdown()?;
        Ok(out)
    }));
    for (a, u) in got {
        assert_eq!(a, vec![2.0, 2.0]); // (1 + 2 + 3) / 3
        assert_eq!(u, vec![f64::from((2.0f64 / 3.0) as f32); 2]); // 2 / 3 in f32
    }
}

#[test]
fn broadcast_sets_every_parameter_to_the_roots_of_every_type() {
    let got = all_ok(ranks(4, |engine| {
        let r = engine.rank() as f64;
        let f = Var::from_tensor(&Tensor::new(&[[r, r + 0.5], [r * 2.0, -r]], &Device::Cpu)?.to_dtype(DType::F32)?)?;
        let h = Var::from_tensor(&Tensor::new(&[r, r + 1.0], &Device::Cpu)?.to_dtype(DType::F16)?)?;
        let i = Var::from_tensor(&Tensor::new(&[r as i64 * 10, -(r as i64)], &Device::Cpu)?)?;
        let dp =
            DataParallel::new(engine, [("f".into(), f.clone()), ("h".into(), h.clone()), ("i".into(), i.clone())])?;
        dp.broadcast_parameters(2)?;
        let out = (values(f.as_tensor()), f.dims().to_vec(), values(h.as_tensor()), values(i.as_tensor()), h.dtype());
        dp.shutdown()?;
        Ok(out)
    }));
    for (f, dims, h, i, hd) in got {
        assert_eq!((f, dims), (vec![2.0, 2.5, 4.0, -2.0], vec![2, 2]));
        assert_eq!((h, hd), (vec![2.0, 3.0], DType::F16));
        assert_eq!(i, vec![20.0, -2.0]);
    }
}

#[test]
fn metrics_and_tensors_reduce_and_an_sgd_step_leaves_every_rank_the_same_weights() {
    let got = all_ok(ranks(3, |engine| {
        let r = engine.rank();
        let w = Var::new(&[0.5f32, -0.25, 1.0], &Device::Cpu)?;
        let dp = DataParallel::new(engine, [("w".into(), w.clone())])?;
        let mut sgd = candle_nn::SGD::new(vec![w.clone()], 0.1)?;
        let x = Tensor::new(&[r as f32 + 1.0, 2.0, -1.0], &Device::Cpu)?;
        dp.backward_step(&mut sgd, &(w.as_tensor() * &x)?.sqr()?.sum_all()?)?;
        sgd.set_learning_rate(0.05);
        let mean = dp.allreduce_scalar("m", r as f64)?;
        let max = dp.allreduce_scalar_with("mx", r as f64 * 2.0, Reduction::Max)?;
        let t = dp.allreduce_tensor("t", &Tensor::new(&[r as f64, 1.0], &Device::Cpu)?, Reduction::Sum)?;
        let out = (values(w.as_tensor()), mean, max, values(&t));
        dp.shutdown()?;
        Ok(out)
    }));
    // d/dw (w·x)² = 2 w x², averaged over x0 = 1, 2, 3: 2·0.5·(1+4+9)/3.
    let w0 = 0.5 - 0.1 * (2.0 * 0.5 * (1.0 + 4.0 + 9.0) / 3.0);
    for (w, mean, max, t) in &got {
        assert!((w[0] - w0).abs() < 1e-6, "{w:?} vs {w0}");
        assert_eq!(w, &got[0].0);
        assert_eq!((*mean, *max, t.clone()), (1.0, 4.0, vec![3.0, 3.0]));
    }
}

#[test]
fn ranks_that_disagree_on_a_shape_get_an_error_naming_it_not_a_hang() {
    let got = ranks(2, |engine| {
        let cols = 2 + engine.rank();
        let w = Var::zeros(cols, DType::F32, &Device::Cpu)?;
        let dp = DataParallel::new(engine, [("layer.w".into(), w.clone())])?;
        let mut grads = w.as_tensor().sum_all()?.backward()?;
        let r = dp.average_gradients(&mut grads);
        let _ = dp.shutdown();
        r
    });
    for r in got {
        match r {
            Err(Error::Comm(e)) => assert!(e.to_string().contains("layer.w"), "{e}"),
            other => panic!("expected the engine's error naming the tensor, got {other:?}"),
        }
    }
}

#[test]
fn duplicate_names_are_refused_saying_which() {
    let one = all_ok(ranks(1, |engine| {
        let v = Var::zeros(2, DType::F32, &Device::Cpu)?;
        let dup = DataParallel::new(engine, [("x".into(), v.clone()), ("x".into(), v)]).err().expect("refused");
        Ok(dup.to_string())
    }));
    assert!(one[0].contains("two parameters are named 'x'"), "{}", one[0]);
    let converted: candle_core::Error = Error::DuplicateName("y".into()).into();
    assert!(converted.to_string().contains("'y'"), "{converted}");
}

#[test]
fn an_integer_parameter_is_broadcast_and_left_out_of_the_gradients() {
    let got = all_ok(ranks(2, |engine| {
        let r = engine.rank();
        let w = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let steps = Var::new(&[r as i64 + 5], &Device::Cpu)?;
        let dp = DataParallel::new(engine, [("w".into(), w.clone()), ("steps".into(), steps.clone())])?;
        dp.broadcast_parameters(1)?;
        let mut grads = (w.as_tensor() * (r as f64 + 1.0))?.sum_all()?.backward()?;
        dp.average_gradients(&mut grads)?;
        let out = (
            values(steps.as_tensor()),
            values(grads.get(w.as_tensor()).expect("w")),
            grads.get(steps.as_tensor()).is_none(),
        );
        dp.shutdown()?;
        Ok(out)
    }));
    for (steps, w, no_int_grad) in got {
        assert_eq!((steps, w, no_int_grad), (vec![6.0], vec![1.5, 1.5], true));
    }
}

#[test]
fn a_parameter_no_rank_used_gets_no_gradient_as_in_one_process_and_adamw_leaves_it_alone() {
    let got = all_ok(ranks(3, |engine| {
        let r = engine.rank();
        let used = Var::new(&[1f32, 2.0], &Device::Cpu)?;
        let idle = Var::new(&[5f32, 6.0], &Device::Cpu)?;
        let dp = DataParallel::new(engine, [("used".into(), used.clone()), ("idle".into(), idle.clone())])?;
        let mut adamw = candle_nn::AdamW::new_lr(vec![used.clone(), idle.clone()], 0.1)?;
        for _ in 0..3 {
            dp.backward_step(&mut adamw, &(used.as_tensor() * (r as f64 + 1.0))?.sum_all()?)?;
        }
        let mut grads = used.as_tensor().sum_all()?.backward()?;
        dp.average_gradients(&mut grads)?;
        let out = (values(idle.as_tensor()), grads.get(idle.as_tensor()).is_none(), values(used.as_tensor()));
        dp.shutdown()?;
        Ok(out)
    }));
    for (idle, no_grad, used) in &got {
        // AdamW's weight decay (0.01) would have moved it, had it got a zero gradient.
        assert_eq!((idle.clone(), *no_grad), (vec![5.0, 6.0], true));
        assert_eq!(used, &got[0].2);
    }
}
