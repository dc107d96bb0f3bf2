//! The physical limit a cell is measured against: how fast one thread of this machine copies
//! the cell's bytes from one buffer to another (`memcpy`), measured in the same run. A
//! collective on one host moves its bytes through memory at best at about that speed, so
//! busbw ÷ memcpy says how close a cell comes to what the machine can do, on any machine.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Each size is timed for at least this long (and at least [`MIN_SAMPLES`] samples).
const MEASURE_FOR: Duration = Duration::from_millis(20);
/// Samples per size, at least and at most.
const MIN_SAMPLES: usize = 5;
const MAX_SAMPLES: usize = 2_000;
/// Small copies are timed in batches of at least this many bytes (the clock's own cost).
const BATCH_BYTES: usize = 1 << 20;

/// One thread's copy bandwidth, in GB/s, for each of `sizes` (bytes; 0 is skipped).
pub(super) fn bandwidths(sizes: impl IntoIterator<Item = usize>) -> BTreeMap<usize, f64> {
    sizes.into_iter().filter(|&b| b > 0).map(|b| (b, bandwidth(b))).collect()
}

/// The largest copy timed: past it, bandwidth is the memory's (the caches are long gone), and
/// rank 0 need not hold two more buffers of a cell's full size beside the cell's own.
const MAX_COPY: usize = 256 << 20;

/// One thread's copy bandwidth for `bytes` (at most [`MAX_COPY`] of them), in GB/s: the median
/// over samples of copying them from one warm buffer to another.
pub(super) fn bandwidth(bytes: usize) -> f64 {
    let bytes = bytes.min(MAX_COPY);
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut dst = vec![0u8; bytes];
    let batch = (BATCH_BYTES / bytes.max(1)).max(1);
    // Warm: pages touched, caches as a repeated cell finds them.
    dst.copy_from_slice(&src);
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < MAX_SAMPLES && (samples.len() < MIN_SAMPLES || start.elapsed() < MEASURE_FOR) {
        let t = Instant::now();
        for _ in 0..batch {
            dst.copy_from_slice(black_box(&src));
            black_box(&mut dst);
        }
        samples.push(t.elapsed().as_secs_f64() / batch as f64);
    }
    samples.sort_by(f64::total_cmp);
    let median = samples[samples.len() / 2].max(1e-12);
    bytes as f64 / median / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_measured_at_a_plausible_speed_for_every_size_asked() {
        let got = bandwidths([0, 4096, 1 << 20]);
        assert_eq!(got.keys().copied().collect::<Vec<_>>(), [4096, 1 << 20]);
        // Between a slow disk and more than any memory system: a number, not a unit error.
        for (b, gbps) in got {
            assert!((0.05..10_000.0).contains(&gbps), "{b} bytes: {gbps} GB/s");
        }
    }
}
