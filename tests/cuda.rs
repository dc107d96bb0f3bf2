//! The CUDA collectives on a real GPU. Every test looks for a usable GPU first and, where
//! there is none (no CUDA driver library, or no device), says so and passes without running:
//! the staging pipeline itself is tested on host-simulated device memory in the crate's unit
//! tests (`src/gpu/staging.rs`), which run everywhere.
#![cfg(feature = "cuda")]

mod common;

use common::{all_ok, run_ranks_on};
use ferrogloo::gpu::cudarc::driver::{CudaStream, DriverError};
use ferrogloo::gpu::{Cuda, cuda_available, default_stream};
use ferrogloo::rendezvous::HashStore;
use ferrogloo::{Error, Reduction, device::Device};
use std::sync::Arc;

/// GPU 0's stream, or `None` (with the reason printed) where there is none.
fn gpu() -> Option<Arc<CudaStream>> {
    match default_stream(0) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("skipped: no usable GPU: {e}");
            None
        }
    }
}

fn cuda(e: DriverError) -> Error {
    Error::invalid(format!("CUDA: {e:?}"))
}

#[test]
fn without_a_gpu_the_error_says_what_is_missing() {
    if cuda_available() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    match default_stream(0) {
        Err(Error::Unsupported { what, .. }) => {
            assert!(what.contains("no CUDA driver library") && what.contains("libcuda.so"), "{what}")
        }
        other => panic!("expected Unsupported naming the missing driver, got {other:?}"),
    }
}

#[test]
fn collectives_on_gpu_buffers_match_the_reference() {
    let Some(_) = gpu() else { return };
    for n in [1usize, 2, 4] {
        let store = HashStore::new();
        all_ok(run_ranks_on(
            n,
            &store,
            &|| Ok(Device::in_process()),
            |b| b,
            |ctx| {
                let (r, n) = (ctx.rank(), ctx.size());
                let stream = default_stream(0)?;
                // Small staging buffers, so that the pipeline runs many chunks.
                let mut c = Cuda::with_chunk_bytes(&ctx, stream.clone(), 64 << 10)?;
                for count in [0usize, 1, 1000, 300_001] {
                    let host: Vec<f32> = (0..count).map(|i| (r + i % 7) as f32).collect();
                    let mut d = stream.clone_htod(&host).map_err(cuda)?;
                    c.allreduce(&mut d, Reduction::Sum)?;
                    let back = stream.clone_dtoh(&d).map_err(cuda)?;
                    for (i, x) in back.iter().enumerate() {
                        assert_eq!(*x, (n * (n - 1) / 2 + n * (i % 7)) as f32, "allreduce rank {r} element {i}");
                    }
                    // The average: the sum scaled once by 1/n (exact here: n is 1, 2 or 4).
                    let mut a = stream.clone_htod(&host).map_err(cuda)?;
                    c.allreduce(&mut a, Reduction::Average)?;
                    let back = stream.clone_dtoh(&a).map_err(cuda)?;
                    for (i, x) in back.iter().enumerate() {
                        assert_eq!(*x, (n - 1) as f32 / 2.0 + (i % 7) as f32, "average rank {r} element {i}");
                    }
                    let mut out = stream.alloc_zeros::<f32>(count * n).map_err(cuda)?;
                    c.allgather(&d, &mut out)?;
                    let back = stream.clone_dtoh(&out).map_err(cuda)?;
                    assert_eq!(back.len(), count * n);
                    let mut b = stream.clone_htod(&host).map_err(cuda)?;
                    c.broadcast(&mut b, n - 1)?;
                    let back = stream.clone_dtoh(&b).map_err(cuda)?;
                    assert!(back.iter().enumerate().all(|(i, x)| *x == (n - 1 + i % 7) as f32), "broadcast rank {r}");
                    let big: Vec<i32> = (0..count * n).map(|i| (r + i % 5) as i32).collect();
                    let dbig = stream.clone_htod(&big).map_err(cuda)?;
                    let mut mine = stream.alloc_zeros::<i32>(count).map_err(cuda)?;
                    c.reduce_scatter(&dbig, &mut mine, Reduction::Sum)?;
                    let back = stream.clone_dtoh(&mine).map_err(cuda)?;
                    for (i, x) in back.iter().enumerate() {
                        assert_eq!(
                            *x as usize,
                            n * (n - 1) / 2 + n * ((r * count + i) % 5),
                            "reduce_scatter rank {r} {i}"
                        );
                    }
                }
                // An average of integers is refused in words, before anything moves.
                let ints = stream.alloc_zeros::<i32>(4 * n).map_err(cuda)?;
                let mut four = stream.alloc_zeros::<i32>(4).map_err(cuda)?;
                let e = c.reduce_scatter(&ints, &mut four, Reduction::Average).expect_err("an average of i32");
                assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("average of i32")), "{e}");
                // Lengths that do not fit are refused in words, before anything moves.
                let d = stream.alloc_zeros::<f32>(10).map_err(cuda)?;
                let mut wrong = stream.alloc_zeros::<f32>(10 * n + 1).map_err(cuda)?;
                let e = c.allgather(&d, &mut wrong).expect_err("the output does not fit");
                assert!(e.to_string().contains("allgather"), "{e}");
                Ok(())
            },
        ));
    }
}
