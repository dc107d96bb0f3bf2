//! Measuring a cell on GPU buffers (`--device cuda`, feature `cuda`); without the feature,
//! `--device cuda` is refused.

use ferrogloo::{Context, Error, Result};
#[cfg(feature = "cuda")]
use {
    super::Cell,
    super::measure::{Buf, Setup, element, timed},
    ferrogloo::Algorithm,
};

/// The GPU collectives of a `--device cuda` run.
#[cfg(feature = "cuda")]
pub(super) type Gpu<'c> = ferrogloo::gpu::Cuda<'c>;
/// Without the feature `cuda` there is none (`--device cuda` is refused first).
#[cfg(not(feature = "cuda"))]
pub(super) type Gpu<'c> = std::marker::PhantomData<&'c ()>;

/// The GPU collectives `--device` asks for.
pub(super) fn gpu_for<'c>(ctx: &'c Context, device: &str) -> Result<Option<Gpu<'c>>> {
    match device {
        "host" => Ok(None),
        #[cfg(feature = "cuda")]
        "cuda" => {
            let stream = ferrogloo::gpu::default_stream(0)?;
            Ok(Some(ferrogloo::gpu::Cuda::new(ctx, stream)?))
        }
        #[cfg(not(feature = "cuda"))]
        "cuda" => {
            let _ = ctx;
            Err(Error::unsupported("--device cuda (this ferrogloo-bench was built without it)", Some("cuda")))
        }
        other => Err(Error::invalid(format!("--device {other}: expected host or cuda"))),
    }
}

/// Measures one cell on GPU buffers: the buffers are filled on the host and copied to the
/// GPU before each call (not timed); the time is the call until the stream has the result.
#[cfg(feature = "cuda")]
pub(super) fn measure_gpu(
    ctx: &Context,
    s: &Setup<'_>,
    g: &mut Gpu<'_>,
    op: &str,
    algo: Algorithm,
    bytes: usize,
) -> Result<Cell> {
    use ferrogloo::gpu::cudarc::driver::{CudaSlice, DriverError};
    let cuda = |e: DriverError| Error::invalid(format!("CUDA: {e:?}"));
    let (args, dtype) = (s.args, s.dtype);
    let (r, n) = (ctx.rank(), ctx.size());
    let ts = dtype.size();
    let root = args.root % n;
    let own = element(dtype, r as u32 + 1);
    let stream = g.stream().clone();
    g.set_options(s.opts(algo));
    let (count, moved, factor, times, wrong) = match op {
        "allreduce" | "broadcast" | "reduce" => {
            let count = bytes / ts;
            let mut host = Buf::new(count * ts);
            let fresh = if op == "broadcast" && r != root { element(dtype, 0) } else { own.clone() };
            host.fill(&fresh);
            let dev: CudaSlice<u8> = stream.clone_htod(host.bytes()).map_err(cuda)?;
            let mut st = [(dev, &mut *g)];
            let times = timed(
                ctx,
                args,
                &mut st,
                |st| {
                    let _ = stream.memcpy_htod(host.bytes(), &mut st.0);
                    let _ = stream.synchronize();
                },
                |st| {
                    match op {
                        "allreduce" => st.1.allreduce_bytes(&mut st.0, dtype, s.red)?,
                        "broadcast" => st.1.broadcast_bytes(&mut st.0, dtype, root)?,
                        _ => st.1.reduce_bytes(&mut st.0, dtype, root, s.red)?,
                    }
                    stream.synchronize().map_err(cuda)
                },
            )?;
            let back = stream.clone_dtoh(&st[0].0).map_err(cuda)?;
            let want = match op {
                "allreduce" => s.reduced(n, |p| p as u32 + 1)?,
                "broadcast" => element(dtype, root as u32 + 1),
                _ if r == root => s.reduced(n, |p| p as u32 + 1)?,
                _ => own.clone(),
            };
            let wrong = back.chunks_exact(ts).any(|c| c != want.as_slice());
            let factor = if op == "allreduce" { 2.0 * (n - 1) as f64 / n as f64 } else { 1.0 };
            (count, count * ts, factor, times, wrong)
        }
        "allgather" | "reduce_scatter" => {
            let per = bytes / ts / n;
            let (ilen, olen) = if op == "allgather" { (per, per * n) } else { (per * n, per) };
            let mut input = Buf::new(ilen * ts);
            input.fill(&own);
            let din: CudaSlice<u8> = stream.clone_htod(input.bytes()).map_err(cuda)?;
            let dout: CudaSlice<u8> = stream.alloc_zeros(olen * ts).map_err(cuda)?;
            let mut st = [(dout, &mut *g)];
            let times = timed(
                ctx,
                args,
                &mut st,
                |_| {},
                |st| {
                    if op == "allgather" {
                        st.1.allgather_bytes(&din, &mut st.0, dtype)?;
                    } else {
                        st.1.reduce_scatter_bytes(&din, &mut st.0, dtype, s.red)?;
                    }
                    stream.synchronize().map_err(cuda)
                },
            )?;
            let back = stream.clone_dtoh(&st[0].0).map_err(cuda)?;
            let wrong = if op == "allgather" {
                per > 0
                    && back.chunks_exact(per * ts).enumerate().any(|(p, b)| {
                        let e = element(dtype, p as u32 + 1);
                        b.chunks_exact(ts).any(|c| c != e.as_slice())
                    })
            } else {
                let want = s.reduced(n, |p| p as u32 + 1)?;
                back.chunks_exact(ts).any(|c| c != want.as_slice())
            };
            (per * n, per * n * ts, (n - 1) as f64 / n as f64, times, wrong)
        }
        other => return Err(Error::invalid(format!("{other} is not measured on GPU buffers"))),
    };
    let mut bad = [u32::from(wrong && !args.no_check)];
    ctx.allreduce(&mut bad, ferrogloo::Reduction::Max)?;
    Ok(Cell::new(op, algo, None, (count, moved, factor), times, bad[0]))
}
