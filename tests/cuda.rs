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
use ferrogloo::{Context, Error, Reduction, device::Device};
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

/// Runs `f` on `n` ranks as threads (in-process pairs), for each `n` of `sizes`, where there
/// is a usable GPU; where there is none, says so ([`gpu`]) and runs nothing.
fn on_gpu_ranks(sizes: &[usize], f: impl Fn(Context) -> ferrogloo::Result<()> + Sync) {
    let Some(_) = gpu() else { return };
    for &n in sizes {
        let store = HashStore::new();
        all_ok(run_ranks_on(n, &store, &|| Ok(Device::in_process()), |b| b, &f));
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
    on_gpu_ranks(&[1, 2, 4], |ctx| {
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
                assert_eq!(*x as usize, n * (n - 1) / 2 + n * ((r * count + i) % 5), "reduce_scatter rank {r} {i}");
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
    });
}

/// Rank `p`'s element `i` in the typed test: small integers, exact in every element type.
fn val(p: usize, i: usize) -> usize {
    1 + (p + i) % 3
}

/// Every reduction of one element type on the GPU against a sequential reference, on a whole
/// buffer and on a view of part of one (the rest untouched), and a reduce to a root.
fn typed<T>(
    ctx: &ferrogloo::Context,
    stream: &Arc<CudaStream>,
    c: &mut Cuda<'_>,
    from: fn(usize) -> T,
) -> ferrogloo::Result<()>
where
    T: ferrogloo::gpu::CudaElement + ferrogloo::gpu::cudarc::driver::ValidAsZeroBits + PartialEq + std::fmt::Debug,
{
    let (r, n) = (ctx.rank(), ctx.size());
    let count = 100_003;
    let mine: Vec<T> = (0..count).map(|i| from(val(r, i))).collect();
    type Fold = fn(&mut dyn Iterator<Item = usize>) -> usize;
    let cases: [(Reduction, Fold); 4] = [
        (Reduction::Sum, |v| v.sum()),
        (Reduction::Product, |v| v.product()),
        (Reduction::Min, |v| v.min().unwrap_or(0)),
        (Reduction::Max, |v| v.max().unwrap_or(0)),
    ];
    for (op, fold) in cases {
        let want = |i: usize| from(fold(&mut (0..n).map(|p| val(p, i))));
        let mut d = stream.clone_htod(&mine).map_err(cuda)?;
        c.allreduce(&mut d, op)?;
        let back = stream.clone_dtoh(&d).map_err(cuda)?;
        for (i, x) in back.iter().enumerate() {
            assert_eq!(*x, want(i), "{op:?} of {} on rank {r}, element {i}", std::any::type_name::<T>());
        }
        // A view: elements 17..70_017 reduced, the others as they were.
        let mut d = stream.clone_htod(&mine).map_err(cuda)?;
        c.allreduce(&mut d.slice_mut(17..70_017), op)?;
        let back = stream.clone_dtoh(&d).map_err(cuda)?;
        for (i, x) in back.iter().enumerate() {
            let w = if (17..70_017).contains(&i) { want(i) } else { from(val(r, i)) };
            assert_eq!(*x, w, "{op:?} of a view on rank {r}, element {i}");
        }
        // A reduce to the last rank: only its buffer changes.
        let mut d = stream.clone_htod(&mine).map_err(cuda)?;
        c.reduce(&mut d, n - 1, op)?;
        let back = stream.clone_dtoh(&d).map_err(cuda)?;
        for (i, x) in back.iter().enumerate() {
            let w = if r == n - 1 { want(i) } else { from(val(r, i)) };
            assert_eq!(*x, w, "reduce {op:?} on rank {r}, element {i}");
        }
    }
    Ok(())
}

#[test]
fn every_element_type_and_reduction_on_gpu_buffers_match_the_reference() {
    on_gpu_ranks(&[2, 3], |ctx| {
        let stream = default_stream(0)?;
        let mut c = Cuda::with_chunk_bytes(&ctx, stream.clone(), 64 << 10)?;
        typed::<f64>(&ctx, &stream, &mut c, |x| x as f64)?;
        typed::<ferrogloo::f16>(&ctx, &stream, &mut c, |x| ferrogloo::f16::from_f32(x as f32))?;
        typed::<ferrogloo::bf16>(&ctx, &stream, &mut c, |x| ferrogloo::bf16::from_f32(x as f32))?;
        typed::<i64>(&ctx, &stream, &mut c, |x| x as i64)?;
        typed::<u8>(&ctx, &stream, &mut c, |x| x as u8)
    });
}

/// A call is ordered on the user's stream by its own events, with cudarc's event tracking off:
/// work queued before the call (a slow fill of the buffer) is finished before the call reads
/// it, and work queued right after it (a copy of the result) sees the result. (The call waits
/// for its copies back before it returns, so the second half holds by that alone today; it
/// guards the exit event should the call return earlier.)
#[test]
fn a_call_is_ordered_on_the_users_stream_without_event_tracking() {
    on_gpu_ranks(&[2], |ctx| {
        let r = ctx.rank();
        let gpu = ferrogloo::gpu::cudarc::driver::CudaContext::new(0).map_err(cuda)?;
        // SAFETY: every buffer of this test is made after this call, so none expects tracking.
        unsafe { gpu.disable_event_tracking() };
        let stream = gpu.new_stream().map_err(cuda)?;
        let mut c = Cuda::new(&ctx, stream.clone())?;
        let count = 16usize << 20;
        let host: Vec<f32> = (0..count).map(|i| (r + i % 7) as f32).collect();
        let src = stream.clone_htod(&host).map_err(cuda)?;
        let filler = stream.alloc_zeros::<u8>(1 << 30).map_err(cuda)?;
        let mut sink = stream.alloc_zeros::<u8>(1 << 30).map_err(cuda)?;
        let mut buf = stream.alloc_zeros::<f32>(count).map_err(cuda)?;
        let mut out = stream.alloc_zeros::<f32>(count).map_err(cuda)?;
        stream.synchronize().map_err(cuda)?;
        for round in 0..3 {
            stream.memset_zeros(&mut buf).map_err(cuda)?;
            // Milliseconds of copies queued before the buffer gets its values.
            for _ in 0..16 {
                stream.memcpy_dtod(&filler, &mut sink).map_err(cuda)?;
            }
            stream.memcpy_dtod(&src, &mut buf).map_err(cuda)?;
            c.allreduce(&mut buf, Reduction::Sum)?;
            stream.memcpy_dtod(&buf, &mut out).map_err(cuda)?;
            let back = stream.clone_dtoh(&out).map_err(cuda)?;
            if let Some(i) = (0..count).find(|&i| back[i] != (1 + 2 * (i % 7)) as f32) {
                panic!("round {round}, rank {r}: element {i} is {}, expected {}", back[i], 1 + 2 * (i % 7));
            }
        }
        Ok(())
    });
}

/// Staging buffers larger than a call's pieces, so that the pieces measured at the first call
/// (not the buffer size) decide how a 64 MiB call is cut, on every rank alike.
#[test]
fn measured_pieces_cut_large_calls_alike_on_every_rank() {
    on_gpu_ranks(&[2], |ctx| {
        let (r, n) = (ctx.rank(), ctx.size());
        let stream = default_stream(0)?;
        let mut c = Cuda::with_chunk_bytes(&ctx, stream.clone(), 64 << 20)?;
        let count = (64 << 20) / 4 + 3;
        let host: Vec<f32> = (0..count).map(|i| (r + i % 11) as f32).collect();
        for round in 0..2 {
            let mut d = stream.clone_htod(&host).map_err(cuda)?;
            c.allreduce(&mut d, Reduction::Sum)?;
            let back = stream.clone_dtoh(&d).map_err(cuda)?;
            if let Some(i) = (0..count).find(|&i| back[i] != (n * (n - 1) / 2 + n * (i % 11)) as f32) {
                panic!("round {round}, rank {r}: element {i} is {}", back[i]);
            }
            let mut b = stream.clone_htod(&host).map_err(cuda)?;
            c.broadcast(&mut b, 1)?;
            let back = stream.clone_dtoh(&b).map_err(cuda)?;
            if let Some(i) = (0..count).find(|&i| back[i] != (1 + i % 11) as f32) {
                panic!("broadcast round {round}, rank {r}: element {i} is {}", back[i]);
            }
        }
        Ok(())
    });
}
