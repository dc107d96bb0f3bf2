//! Soak: 1,000 contexts formed and dropped back to back on one store, by two ranks that are
//! threads of this process, each with one device. Afterwards this process holds no more file
//! descriptors or threads than after the first 50, and its memory grew by less than a bound.
//! Not in the default `cargo test` (it takes a while in a debug build): `.ci/run` runs it as
//! `cargo test --release --test soak -- --ignored`.

mod common;

use ferrogloo::device::Device;
use ferrogloo::rendezvous::{FileStore, PrefixStore};
use ferrogloo::{Context, Reduction};
use std::time::{Duration, Instant};

/// (open file descriptors, threads, resident KiB) of this process.
fn usage() -> (usize, usize, u64) {
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    (fds, field("Threads:") as usize, field("VmRSS:"))
}

#[test]
#[ignore = "a soak of 1,000 contexts: .ci/run runs it (cargo test --release --test soak -- --ignored)"]
fn a_thousand_contexts_formed_and_dropped_leave_nothing_behind() {
    const CONTEXTS: usize = 1000;
    const WARM: usize = 50;
    let dir = tempfile::tempdir().expect("store directory");
    let store = FileStore::new(dir.path()).expect("store");
    let devices = [Device::loopback().expect("device"), Device::loopback().expect("device")];
    let t = Instant::now();
    let mut after_warm = None;
    for i in 0..CONTEXTS {
        if i == WARM {
            after_warm = Some(usage());
        }
        let scope = PrefixStore::new(format!("gen{i}"), &store);
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let (scope, dev) = (&scope, &devices[rank]);
                    s.spawn(move || -> ferrogloo::Result<()> {
                        let ctx = Context::builder(rank, 2).timeout(common::TIMEOUT).connect(scope, dev)?;
                        let mut v = [i as u64 + rank as u64];
                        ctx.allreduce(&mut v, Reduction::Sum)?;
                        assert_eq!(v, [2 * i as u64 + 1], "context {i}");
                        Ok(())
                    })
                })
                .collect();
            for (rank, r) in ranks.into_iter().enumerate() {
                r.join().expect("rank thread").unwrap_or_else(|e| panic!("context {i}, rank {rank}: {e}"));
            }
        });
    }
    let took = t.elapsed();
    let (fds0, threads0, rss0) = after_warm.expect("measured after the warm-up");
    // A leak persists; a thread that is just ending does not: look again for up to 2 s (CI saw
    // one extra thread once, gone a moment later).
    let settle = Instant::now() + Duration::from_secs(2);
    let (fds, threads, rss) = loop {
        let u = usage();
        if (u.0 <= fds0 + 2 && u.1 <= threads0) || Instant::now() >= settle {
            break u;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "soak: {CONTEXTS} contexts in {:.1} s; after {WARM} -> after {CONTEXTS}: fds {fds0} -> {fds}, threads {threads0} -> \
         {threads}, RSS {:.1} -> {:.1} MiB",
        took.as_secs_f64(),
        rss0 as f64 / 1024.0,
        rss as f64 / 1024.0
    );
    if fds > fds0 + 2 {
        let mut kinds = std::collections::BTreeMap::<String, usize>::new();
        for e in std::fs::read_dir("/proc/self/fd").expect("fds").flatten() {
            let target = std::fs::read_link(e.path()).map(|t| t.display().to_string()).unwrap_or_default();
            let kind = target.split(':').next().unwrap_or("").to_string();
            *kinds.entry(kind).or_insert(0) += 1;
        }
        eprintln!("descriptors by kind: {kinds:?}");
    }
    assert!(fds <= fds0 + 2, "file descriptors grew from {fds0} to {fds}");
    assert!(threads <= threads0, "threads grew from {threads0} to {threads}");
    assert!(rss < rss0 + 32 * 1024, "resident memory grew from {rss0} to {rss} KiB");
    assert!(took < Duration::from_secs(600));
}
