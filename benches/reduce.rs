//! Reduction kernels in GB/s per element type and operation, next to memcpy of the same bytes.
//!
//! `cargo bench --bench reduce`. Two sizes: a pipeline segment (256 KiB, in cache, what the
//! ring reduces at a time) and 16 MiB (from memory).

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use ferrogloo::{Element, Reduction, bf16, f16};
use std::hint::black_box;

fn kernel<T: Element>(c: &mut Criterion, name: &str, one: T) {
    for bytes in [256usize << 10, 16 << 20] {
        let n = bytes / std::mem::size_of::<T>();
        let mut acc = vec![one; n];
        let src = vec![one; n];
        let mut g = c.benchmark_group(format!("reduce/{name}"));
        g.throughput(Throughput::Bytes(bytes as u64));
        for (label, op) in [("sum", Reduction::Sum), ("max", Reduction::Max)] {
            g.bench_with_input(BenchmarkId::new(label, bytes), &bytes, |b, _| {
                b.iter(|| op.apply(black_box(&mut acc), black_box(&src)))
            });
        }
        g.bench_with_input(BenchmarkId::new("memcpy", bytes), &bytes, |b, _| {
            b.iter(|| black_box(&mut acc).copy_from_slice(black_box(&src)))
        });
        g.finish();
    }
}

fn kernels(c: &mut Criterion) {
    kernel(c, "f32", 1.0f32);
    kernel(c, "f64", 1.0f64);
    kernel(c, "f16", f16::from_f32(1.0));
    kernel(c, "bf16", bf16::from_f32(1.0));
    kernel(c, "i32", 1i32);
    kernel(c, "u8", 1u8);
}

criterion_group!(benches, kernels);
criterion_main!(benches);
