//! Ranks that disagree (length, element type, root, order, collective) get errors on every
//! rank within the deadline, never corrupted data or a hang.

mod common;

use common::run_ranks_with;
use ferrogloo::device::TcpAttr;
use ferrogloo::rendezvous::HashStore;
use ferrogloo::{CollectiveOptions, Context, Error, Reduction};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(3);

/// What each rank saw: its first error, and when.
struct Seen {
    first: Option<(Error, Duration)>,
    later_failed: bool,
}

/// Runs `bad` (the disagreeing call) then a follow-up allreduce on each of 3 ranks.
fn scenario(bad: impl Fn(&Context) -> ferrogloo::Result<()> + Sync) -> Vec<Seen> {
    let store = HashStore::new();
    let results = run_ranks_with(
        3,
        &store,
        &TcpAttr::loopback(),
        |b| b.timeout(DEADLINE),
        |ctx| {
            let t = Instant::now();
            let mut first = None;
            if let Err(e) = bad(&ctx) {
                first = Some((e, t.elapsed()));
            }
            let mut v = vec![1u32; 64];
            let later = ctx.allreduce(&mut v, Reduction::Sum);
            if let (None, Err(e)) = (&first, &later) {
                first = Some((e.clone(), t.elapsed()));
            }
            Ok(Seen { first, later_failed: later.is_err() || ctx.is_aborted() })
        },
    );
    results.into_iter().map(|r| r.expect("rendezvous")).collect()
}

fn assert_all_failed(seen: &[Seen], want_mismatch: bool, what: &str) {
    for (r, s) in seen.iter().enumerate() {
        eprintln!("{what}: rank {r}: {:?}", s.first.as_ref().map(|(e, t)| (t, e.to_string())));
        let Some((e, at)) = &s.first else { panic!("{what}: rank {r} saw no error") };
        assert!(*at < DEADLINE + Duration::from_millis(1500), "{what}: rank {r} erred only after {at:?}: {e}");
        assert!(s.later_failed, "{what}: rank {r}'s context is still usable after a mismatch");
    }
    if want_mismatch {
        assert!(
            seen.iter().any(|s| matches!(s.first, Some((Error::Mismatch { .. }, _)))),
            "{what}: no rank reported a Mismatch: {:?}",
            seen.iter().map(|s| s.first.as_ref().map(|(e, _)| e.to_string())).collect::<Vec<_>>()
        );
    }
}

#[test]
fn wrong_length() {
    let seen = scenario(|ctx| {
        let mut v = vec![1.0f32; if ctx.rank() == 2 { 1001 } else { 1000 }];
        ctx.allreduce(&mut v, Reduction::Sum)
    });
    assert_all_failed(&seen, true, "allreduce with a different length");
}

#[test]
fn wrong_element_type() {
    // Same byte length, different type: the descriptor word tells them apart.
    let seen = scenario(|ctx| {
        if ctx.rank() == 1 {
            let mut v = vec![1u32; 1000];
            ctx.allreduce(&mut v, Reduction::Sum)
        } else {
            let mut v = vec![1.0f32; 1000];
            ctx.allreduce(&mut v, Reduction::Sum)
        }
    });
    assert_all_failed(&seen, true, "allreduce with a different element type");
}

#[test]
fn wrong_root() {
    let seen = scenario(|ctx| {
        let mut v = vec![ctx.rank() as u64; 100];
        let root = if ctx.rank() == 2 { 1 } else { 0 };
        ctx.broadcast(&mut v, root, &CollectiveOptions::default())
    });
    assert_all_failed(&seen, false, "broadcast with a different root");
}

#[test]
fn wrong_order() {
    let seen = scenario(|ctx| {
        let mut a = vec![1i64; 500];
        let mut b = vec![2i64; 500];
        let o = CollectiveOptions::default();
        if ctx.rank() == 1 {
            ctx.broadcast(&mut b, 0, &o)?;
            ctx.allreduce(&mut a, Reduction::Sum)
        } else {
            ctx.allreduce(&mut a, Reduction::Sum)?;
            ctx.broadcast(&mut b, 0, &o)
        }
    });
    assert_all_failed(&seen, true, "collectives in a different order");
}

#[test]
fn different_collective() {
    let seen = scenario(|ctx| {
        let o = CollectiveOptions::default();
        if ctx.rank() == 0 {
            let mut out = vec![0u16; 30];
            ctx.allgather(&[7u16; 10], &mut out, &o)
        } else {
            let mut v = vec![7u16; 30];
            ctx.allreduce(&mut v, Reduction::Max)
        }
    });
    assert_all_failed(&seen, true, "allgather against allreduce");
}

#[test]
fn abort_from_another_thread_stops_a_blocked_collective() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let store = HashStore::new();
    let results = run_ranks_with(
        3,
        &store,
        &TcpAttr::loopback(),
        |b| b.timeout(Duration::from_secs(30)),
        |ctx| {
            ctx.barrier()?;
            if ctx.rank() == 2 {
                // Never joins the allreduce; stays connected until rank 0's abort reaches it.
                let mut b = [0u8; 1];
                let e = ctx.recv(0, 99, &mut b).expect_err("rank 0 aborts");
                return Ok((e.to_string(), Duration::ZERO));
            }
            let started = AtomicBool::new(false);
            std::thread::scope(|s| {
                let blocked = s.spawn(|| {
                    started.store(true, Ordering::SeqCst);
                    let t = Instant::now();
                    let mut v = vec![1u8; 10];
                    let r = ctx.allreduce(&mut v, Reduction::Sum);
                    (r, t.elapsed())
                });
                if ctx.rank() == 0 {
                    while !started.load(Ordering::SeqCst) {
                        std::thread::yield_now();
                    }
                    ctx.abort("test abort");
                }
                let (res, took) = blocked.join().expect("thread panicked");
                Ok((res.expect_err("the blocked allreduce must fail").to_string(), took))
            })
        },
    );
    for (r, res) in results.into_iter().enumerate() {
        let (msg, took) = res.expect("rank");
        // Without the abort these calls would wait for their 30 s deadline.
        assert!(took < Duration::from_secs(5), "rank {r} returned only after {took:?}: {msg}");
        if r == 0 {
            assert!(msg.contains("aborted") && msg.contains("test abort"), "rank 0: {msg}");
        } else if r == 2 {
            assert!(msg.contains("rank 0 aborted"), "rank 2 should learn of rank 0's abort: {msg}");
        }
    }
}

#[test]
fn sum_on_one_rank_and_average_on_another_is_a_mismatch_in_words() {
    let seen = scenario(|ctx| {
        let mut v = vec![1.0f32; 100];
        let op = if ctx.rank() == 1 { Reduction::Average } else { Reduction::Sum };
        ctx.allreduce(&mut v, op)
    });
    assert_all_failed(&seen, true, "allreduce with sum against average");
    let words: Vec<String> = seen.iter().filter_map(|s| s.first.as_ref().map(|(e, _)| e.to_string())).collect();
    assert!(words.iter().any(|w| w.contains("average") && w.contains("sum")), "{words:?}");
}

#[test]
fn averaging_a_different_number_of_inputs_per_rank_is_a_mismatch() {
    // The mean of every input of every rank needs every rank to divide by the same total.
    let seen = scenario(|ctx| {
        let (a, b) = (vec![1.0f32; 50], vec![2.0f32; 50]);
        let mut out = vec![0.0f32; 50];
        let inputs: Vec<&[f32]> = if ctx.rank() == 1 { vec![&a] } else { vec![&a, &b] };
        ctx.allreduce_multi(&inputs, &mut [&mut out], Reduction::Average, &CollectiveOptions::default())
    });
    assert_all_failed(&seen, true, "allreduce_multi averaging 1 input against 2");
}
