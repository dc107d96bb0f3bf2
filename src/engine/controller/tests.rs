//! The negotiation without a Context: N controllers in one thread, their messages passed
//! between them by hand, each cycle checked for agreement (every rank decides the same names
//! in the same order, with the same errors, and holds the same cache).

use super::*;
use crate::engine::cache::tests::meta;
use crate::types::DType;
use proptest::prelude::*;

/// The job's numbering of the context's ranks: not the context's own, so that a message that
/// names a context rank where it should name a job rank shows.
fn world(n: usize) -> Vec<usize> {
    (0..n).map(|r| 100 + r).collect()
}

const CHECK: Duration = Duration::from_secs(10);

/// A decided name as every rank must see it alike.
#[derive(Debug, Clone, PartialEq)]
struct Agreed {
    name: String,
    meta: Meta,
    dims: Vec<u64>,
    error: Option<String>,
}

/// `n` controllers and a clock.
struct Job {
    ctls: Vec<Controller<u32>>,
    now: Instant,
}

impl Job {
    fn new(n: usize, capacity: usize) -> Job {
        let ctls = (0..n).map(|r| Controller::new(r, world(n), capacity, Some(CHECK), None)).collect();
        Job { ctls, now: Instant::now() }
    }

    /// One cycle on every rank; checks that the ranks agree, and returns each rank's decision.
    fn cycle(&mut self) -> Vec<Decision<u32>> {
        let outs: Vec<Outbox> = self.ctls.iter_mut().map(|c| c.begin()).collect();
        for (p, c) in self.ctls.iter_mut().enumerate() {
            for q in c.awaiting() {
                c.receive_state(q, outs[q].to(p)).unwrap();
            }
            assert!(c.awaiting().is_empty());
        }
        let now = self.now;
        let rs: Vec<Responses> = self.ctls.iter_mut().map(|c| c.exchanged(now, false).unwrap()).collect();
        let sent = match &rs[0] {
            Responses::Send(m) => Some(m.clone()),
            _ => None,
        };
        let ds: Vec<Decision<u32>> = self
            .ctls
            .iter_mut()
            .zip(rs)
            .map(|(c, r)| match r {
                Responses::Receive => c.conclude(sent.as_deref().map(|m| (m, COORDINATOR))),
                _ => c.conclude(None),
            })
            .collect::<Result<_>>()
            .unwrap();
        let agreed = |d: &Decision<u32>| -> Vec<Agreed> {
            d.ready
                .iter()
                .map(|r| Agreed {
                    name: r.name.clone(),
                    meta: r.meta.clone(),
                    dims: r.dims.clone(),
                    error: r.error.as_ref().map(|e| e.to_string()),
                })
                .collect()
        };
        let summary = |d: &Decision<u32>| (d.from_coordinator, d.coordinated, d.contributors, d.join_done, d.shut_by);
        for (r, d) in ds.iter().enumerate().skip(1) {
            assert_eq!(agreed(d), agreed(&ds[0]), "rank {r} decided otherwise than rank 0");
            assert_eq!(summary(d), summary(&ds[0]), "rank {r}");
            assert_eq!(self.ctls[r].cache(), self.ctls[0].cache(), "rank {r}'s cache differs from rank 0's");
        }
        ds
    }

    /// The names decided on rank `r`, with this rank's tickets.
    fn names(d: &Decision<u32>) -> Vec<(&str, Option<u32>)> {
        d.ready.iter().map(|x| (x.name.as_str(), x.own)).collect()
    }
}

#[test]
fn a_name_goes_to_the_coordinator_once_and_then_through_the_cache_bits() {
    let mut job = Job::new(3, 8);
    for (r, c) in job.ctls.iter_mut().enumerate() {
        c.submit("a".into(), meta(4), r as u32);
        assert!(c.has_news());
    }
    let ds = job.cycle();
    for (r, d) in ds.iter().enumerate() {
        assert_eq!(Job::names(d), [("a", Some(r as u32))]);
        assert_eq!((d.from_coordinator, d.coordinated, d.contributors), (1, true, 3));
    }
    assert_eq!(job.ctls[1].cache().get("a").map(|(s, _)| s), Some(0));
    // Nothing pending: a cycle decides nothing.
    assert!(job.cycle()[0].ready.is_empty());
    // The next round: bits only, no coordinator, no news to send in full.
    for (r, c) in job.ctls.iter_mut().enumerate() {
        c.submit("a".into(), meta(4), 10 + r as u32);
        assert!(!c.has_news());
    }
    let ds = job.cycle();
    for (r, d) in ds.iter().enumerate() {
        assert_eq!(Job::names(d), [("a", Some(10 + r as u32))]);
        assert_eq!((d.from_coordinator, d.coordinated), (0, false));
    }
}

#[test]
fn a_name_some_ranks_have_not_submitted_waits_and_rank_0_reports_it_stalled() {
    for cached in [false, true] {
        let mut job = Job::new(3, 8);
        if cached {
            for c in &mut job.ctls {
                c.submit("late".into(), meta(1), 0);
            }
            job.cycle();
        }
        job.ctls[0].submit("late".into(), meta(1), 1);
        job.ctls[2].submit("late".into(), meta(1), 1);
        for _ in 0..3 {
            assert!(job.cycle().iter().all(|d| d.ready.is_empty()));
        }
        assert!(job.ctls[0].stall_wait().is_some(), "rank 0 watches the pending name");
        assert!(job.ctls[0].inspect_stalls(job.now + CHECK / 2).reports.is_empty());
        let look = job.ctls[0].inspect_stalls(job.now + CHECK);
        let got: Vec<_> =
            look.reports.iter().map(|r| (r.name.as_str(), r.submitted.clone(), r.missing.clone())).collect();
        assert_eq!(got, [("late", vec![100, 102], vec![101])], "cached: {cached}");
        for c in &mut job.ctls[1..] {
            assert!(c.inspect_stalls(job.now + CHECK).reports.is_empty(), "only rank 0 reports");
            assert_eq!(c.stall_wait(), None);
        }
        // The missing rank submits: it runs, and is no longer watched.
        job.ctls[1].submit("late".into(), meta(1), 1);
        assert_eq!(Job::names(&job.cycle()[1]), [("late", Some(1))]);
        assert!(job.ctls[0].inspect_stalls(job.now + 3 * CHECK).reports.is_empty());
        assert_eq!(job.ctls[0].stall_wait(), None);
    }
}

#[test]
fn a_changed_shape_invalidates_the_slot_on_every_rank_and_the_disagreement_fails_in_words() {
    let mut job = Job::new(3, 8);
    for c in &mut job.ctls {
        c.submit("w".into(), meta(4), 0);
    }
    job.cycle();
    for (r, c) in job.ctls.iter_mut().enumerate() {
        c.submit("w".into(), meta(if r == 1 { 6 } else { 4 }), 1);
    }
    // The cycle that drops the slot decides nothing; the next one goes to the coordinator.
    assert!(job.cycle()[0].ready.is_empty());
    assert!(job.ctls[2].cache().get("w").is_none(), "the slot is dropped on every rank");
    let ds = job.cycle();
    assert_eq!(Job::names(&ds[2]), [("w", Some(1))]);
    let e = ds[0].ready[0].error.as_ref().map(|e| e.to_string()).unwrap_or_default();
    assert!(matches!(ds[0].ready[0].error, Some(Error::Mismatch { rank: 101, .. })), "{e}");
    assert!(e.contains("allreduce 'w': rank 101 submitted f32 [6], rank 100 f32 [4]"), "{e}");
}

#[test]
fn a_joined_rank_is_left_out_of_allreduces_and_the_join_completes_with_the_last_to_join() {
    let mut job = Job::new(3, 8);
    job.ctls[2].join();
    let mut min = meta(2);
    min.op = Reduction::Min;
    let mut bcast = meta(2);
    bcast.kind = Kind::Broadcast;
    for c in &mut job.ctls[..2] {
        c.submit("g".into(), meta(2), 7);
        c.submit("m".into(), min.clone(), 8);
        c.submit("b".into(), bcast.clone(), 9);
    }
    let ds = job.cycle();
    let mut got: Vec<_> = Job::names(&ds[2]);
    got.sort();
    // Rank 2 runs the allreduces without a tensor of its own (zeros); the broadcast waits.
    assert_eq!(got, [("g", None), ("m", None)]);
    assert_eq!((ds[0].contributors, ds[0].join_done), (2, None));
    let m = ds[0].ready.iter().find(|x| x.name == "m").and_then(|x| x.error.as_ref()).map(|e| e.to_string());
    assert!(m.is_some_and(|e| e.contains("min cannot run while ranks [102] have joined")));
    assert!(ds[0].ready.iter().find(|x| x.name == "g").is_some_and(|x| x.error.is_none()));
    job.ctls[2].submit("b".into(), bcast, 9);
    job.ctls[0].join();
    job.ctls[1].join();
    let ds = job.cycle();
    assert_eq!(Job::names(&ds[2]), [("b", Some(9))]);
    // Ranks 0 and 1 joined in the same cycle, after rank 2: the higher of them is the last.
    assert!(ds.iter().all(|d| d.join_done == Some(101)), "{:?}", ds.iter().map(|d| d.join_done).collect::<Vec<_>>());
    // A completed join is not done again.
    assert!(job.cycle().iter().all(|d| d.join_done.is_none() && d.contributors == 3));
}

#[test]
fn groups_run_whole_and_a_shutdown_reaches_every_rank() {
    let mut job = Job::new(2, 8);
    let member = |d: u64| {
        let mut m = meta(d);
        m.group = 5;
        m.group_size = 2;
        m
    };
    for c in &mut job.ctls {
        c.submit("g.a".into(), member(1), 1);
    }
    assert!(job.cycle()[0].ready.is_empty(), "half a group waits");
    for c in &mut job.ctls {
        c.submit("g.b".into(), member(2), 2);
    }
    assert_eq!(Job::names(&job.cycle()[1]), [("g.a", Some(1)), ("g.b", Some(2))]);
    job.ctls[1].shut_down();
    assert!(job.ctls[1].is_shutting_down());
    assert!(job.cycle().iter().all(|d| d.shut_by == Some(101)));
}

#[test]
fn malformed_and_out_of_turn_messages_are_protocol_errors_naming_the_peer() {
    let mut job = Job::new(2, 8);
    let out1 = job.ctls[1].begin();
    let c = &mut job.ctls[0];
    assert!(c.exchanged(Instant::now(), false).is_err(), "no cycle begun");
    assert!(matches!(c.receive_state(1, &[1, 2, 3]), Err(Error::Protocol { .. })), "no cycle begun");
    c.begin();
    assert!(matches!(c.receive_state(1, &[9, 9]), Err(Error::Protocol { peer: Some(101), .. })));
    c.receive_state(1, out1.to(0)).unwrap();
    assert!(matches!(c.receive_state(1, out1.to(0)), Err(Error::Protocol { peer: Some(101), .. })), "twice");
    assert!(c.conclude(None).is_err(), "a decision before the exchange");
    // A state message of another cycle.
    let mut a = Controller::<u32>::new(0, world(2), 8, None, None);
    let mut b = Controller::<u32>::new(1, world(2), 8, None, None);
    b.begin();
    let late = b.begin();
    a.begin();
    a.receive_state(1, late.to(0)).unwrap();
    let e = a.exchanged(Instant::now(), false).unwrap_err().to_string();
    assert!(e.contains("rank 101 is in cycle 2, rank 100 in cycle 1"), "{e}");
    // Responses where none were due.
    let mut job = Job::new(2, 8);
    let outs: Vec<Outbox> = job.ctls.iter_mut().map(|c| c.begin()).collect();
    job.ctls[1].receive_state(0, outs[0].to(1)).unwrap();
    assert!(matches!(job.ctls[1].exchanged(Instant::now(), false), Ok(Responses::None)));
    assert!(job.ctls[1].conclude(Some((&[2], COORDINATOR))).is_err());
}

/// A broken response message is blamed on the rank it came from: the coordinator, or the
/// parent that forwarded it down the tree (rank 3's is rank 1, not the coordinator).
#[test]
fn a_broken_response_names_the_rank_it_came_from() {
    let mut job = Job::new(4, 8);
    for c in &mut job.ctls {
        c.submit("a".into(), meta(4), 0);
    }
    let outs: Vec<Outbox> = job.ctls.iter_mut().map(|c| c.begin()).collect();
    for (p, c) in job.ctls.iter_mut().enumerate() {
        for q in c.awaiting() {
            c.receive_state(q, outs[q].to(p)).unwrap();
        }
    }
    let now = job.now;
    for (r, c) in job.ctls.iter_mut().enumerate().skip(2) {
        assert!(matches!(c.exchanged(now, false), Ok(Responses::Receive)), "rank {r} waits for responses");
        let from = crate::engine::agree::tree_parent(r).unwrap(); // forwarded by its parent
        match c.conclude(Some((&[0xff, 0, 1], from))) {
            Err(Error::Protocol { peer, .. }) => assert_eq!(peer, Some(100 + from), "rank {r}"),
            other => panic!("rank {r}: {:?}", other.map(|d| d.ready.len())),
        }
    }
}

#[test]
fn requests_travel_in_full_to_the_coordinator_only() {
    let mut c = Controller::<u32>::new(1, world(3), 8, None, None);
    c.submit("x".into(), meta(3), 0);
    let out = c.begin();
    let full = State::decode(out.to(0), 101).unwrap();
    let short = State::decode(out.to(2), 101).unwrap();
    assert_eq!(full.requests.len(), 1);
    assert_eq!((short.requests.len(), short.flags & REQUESTS != 0), (0, true));
    assert!(!c.has_news(), "sent: no longer news");
    let drained = c.drain_tickets();
    assert_eq!(drained, [("x".to_string(), 0)]);
}

/// One submission of the random script: rank, name, variant.
type Sub = (usize, usize, u8);

/// What name `k`'s submission of variant `v` agrees to: four allreduces, a broadcast, an
/// allgather (whose first dimension may differ between ranks) and a reduce-scatter; variant 3
/// changes the shape (a disagreement, or an invalidation of a cached name).
fn meta_of(k: usize, v: u8) -> Meta {
    let mut m = meta(4 + u64::from(v == 3));
    match k {
        4 => {
            m.kind = Kind::Broadcast;
            m.root = 1;
        }
        5 => {
            m.kind = Kind::Allgather;
            m.shape = vec![u64::from(v) + 1, if v == 3 { 3 } else { 2 }];
        }
        6 => {
            m.kind = Kind::ReduceScatter;
            m.dtype = DType::F64;
        }
        _ => {}
    }
    m
}

const NAMES: usize = 7;

fn script() -> impl Strategy<Value = (usize, usize, Vec<Vec<Sub>>)> {
    (1usize..=4, prop_oneof![Just(0usize), Just(1), Just(2), Just(3), Just(64)]).prop_flat_map(|(n, cap)| {
        let sub = (0..n, 0..NAMES, prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2), 1 => Just(3)]);
        (Just(n), Just(cap), proptest::collection::vec(proptest::collection::vec(sub, 0..5), 1..30))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    // Ranks submit names in random orders and cycles, with random shapes, through caches of
    // every size (evictions, invalidations). Every cycle every rank decides the same names in
    // the same order and holds the same cache (Job::cycle). Against a plain model: the k-th
    // round of a name runs exactly when every rank has submitted it k times, once, on every
    // rank, with each rank's own ticket, failing exactly when the rounds' submissions
    // disagree; a round some rank has not submitted never runs, and rank 0 reports it stalled
    // naming the ranks that did and did not submit it.
    #[test]
    fn every_rank_decides_the_same_names_in_the_same_order_as_the_model_says((n, cap, steps) in script()) {
        let mut job = Job::new(n, cap);
        // Per rank and name: the submissions made (ticket, variant) and how many ran.
        let mut made: Vec<Vec<Vec<(u32, u8)>>> = vec![vec![Vec::new(); NAMES]; n];
        let mut ran: Vec<Vec<usize>> = vec![vec![0; NAMES]; n];
        let mut ticket = 0u32;
        let extra = 8;
        for step in steps.iter().map(Some).chain(std::iter::repeat_n(None, extra)) {
            for &(r, k, v) in step.into_iter().flatten() {
                if made[r][k].len() > ran[r][k] {
                    continue; // in flight on this rank: the engine refuses a second one
                }
                ticket += 1;
                made[r][k].push((ticket, v));
                job.ctls[r].submit(format!("n{k}"), meta_of(k, v), ticket);
            }
            let ds = job.cycle();
            let mut once = std::collections::HashSet::new();
            for x in &ds[0].ready {
                prop_assert!(once.insert(x.name.clone()), "'{}' twice in one cycle", x.name);
                let k: usize = x.name[1..].parse().unwrap();
                let round = ran[0][k];
                // Every rank has made this round's submission.
                prop_assert!((0..n).all(|r| made[r][k].len() > round), "'{}' round {} ran early", x.name, round);
                let metas: Vec<Meta> = (0..n).map(|r| meta_of(k, made[r][k][round].1)).collect();
                let agree = metas.iter().all(|m| metas[0].agrees(m));
                prop_assert_eq!(x.error.is_none(), agree, "'{}' round {}: {:?}", x.name, round, x.error);
                if agree && metas[0].kind == Kind::Allgather {
                    let dims: Vec<u64> = metas.iter().map(|m| m.shape[0]).collect();
                    prop_assert_eq!(&x.dims, &dims);
                }
            }
            for (r, d) in ds.iter().enumerate() {
                for x in &d.ready {
                    let k: usize = x.name[1..].parse().unwrap();
                    prop_assert_eq!(x.own, Some(made[r][k][ran[r][k]].0), "rank {}'s ticket of '{}'", r, x.name);
                    ran[r][k] += 1;
                }
            }
        }
        // Every round that every rank submitted ran; no other did.
        for k in 0..NAMES {
            let full = (0..n).map(|r| made[r][k].len()).min().unwrap_or(0);
            for (r, counts) in ran.iter().enumerate() {
                prop_assert_eq!(counts[k], full, "rank {} name n{}", r, k);
            }
        }
        // What is left is reported as stalled, naming who submitted it.
        let look = job.ctls[0].inspect_stalls(job.now + CHECK);
        let mut want = Vec::new();
        for k in 0..NAMES {
            let pending: Vec<usize> = (0..n).filter(|&r| made[r][k].len() > ran[r][k]).collect();
            if !pending.is_empty() {
                let missing: Vec<usize> = (0..n).filter(|r| !pending.contains(r)).map(|r| 100 + r).collect();
                let submitted: Vec<usize> = pending.iter().map(|r| 100 + r).collect();
                want.push((format!("n{k}"), meta_of(k, 0).kind.name(), submitted, missing));
            }
        }
        let got: Vec<_> = look.reports.iter().map(|r| (r.name.clone(), r.op, r.submitted.clone(), r.missing.clone())).collect();
        prop_assert_eq!(got, want);
    }
}
