//! Rank 0's table of held requests (Horovod's coordinator): names not in the response cache
//! travel in full to rank 0, which holds them until every needed rank has requested a name,
//! checks that the ranks agree, and answers with the ready names in the order they were first
//! requested, whole groups only, with the cache slot each takes.

use super::cache::Cache;
use super::meta::{Kind, Meta};
use super::wire::{Request, Response};
use crate::error::{Error, Result};
use rustc_hash::FxHashMap as HashMap;
use std::collections::BTreeSet;

/// A name the coordinator holds requests for.
#[derive(Debug)]
struct Held {
    /// Each rank's request, once it came.
    metas: Vec<Option<Meta>>,
    /// When the name was first requested (a counter).
    order: u64,
}

/// The coordinator's table.
#[derive(Debug)]
pub(crate) struct Coordinator {
    size: usize,
    held: HashMap<String, Held>,
    order: u64,
}

impl Coordinator {
    /// An empty table for `size` ranks.
    pub(crate) fn new(size: usize) -> Self {
        Coordinator { size, held: HashMap::default(), order: 0 }
    }

    /// Takes rank `r`'s request (`world`: each rank's rank in the job, for errors). A rank
    /// that requests a name it requested already is a protocol error.
    pub(crate) fn hold(&mut self, r: usize, req: &Request, world: &[usize]) -> Result<()> {
        let n = self.size;
        let order = &mut self.order;
        let h = self.held.entry(req.name.clone()).or_insert_with(|| {
            *order += 1;
            Held { metas: vec![None; n], order: *order }
        });
        let slot = h.metas.get_mut(r).ok_or_else(|| Error::Protocol {
            peer: None,
            detail: format!("engine: a request of '{}' from rank {r} of {n}", req.name),
        })?;
        if slot.is_some() {
            return Err(Error::Protocol {
                peer: Some(world.get(r).copied().unwrap_or(r)),
                detail: format!("engine: rank {r} requested '{}' twice", req.name),
            });
        }
        *slot = Some(req.meta.clone());
        Ok(())
    }

    /// The collective of a held name (for the stall inspector's words).
    pub(crate) fn kind_of(&self, name: &str) -> Option<Kind> {
        self.held.get(name).and_then(|h| h.metas.iter().flatten().next()).map(|m| m.kind)
    }

    /// The decisions of a cycle: held names every needed rank has requested (a joined rank
    /// is not needed for an allreduce), checked for agreement, in the order they were first
    /// requested, whole groups only (counting members found ready in the cache: `hits`), each
    /// cacheable one with a cache slot not in `hits` nor given to another. The names decided
    /// leave the table.
    pub(crate) fn decide(&mut self, cache: &Cache, hits: &[u32], joined: &[bool], world: &[usize]) -> Vec<Response> {
        let n = self.size;
        let w = |r: usize| world.get(r).copied().unwrap_or(r);
        let mut ready: Vec<(u64, String)> = Vec::new();
        for (name, h) in &self.held {
            let Some(m0) = h.metas.iter().flatten().next() else { continue };
            let needed = |r: usize| m0.kind != Kind::Allreduce || !joined.get(r).copied().unwrap_or(false);
            if (0..n).any(needed) && (0..n).all(|r| !needed(r) || h.metas[r].is_some()) {
                ready.push((h.order, name.clone()));
            }
        }
        ready.sort();
        let mut out: Vec<Response> = Vec::new();
        for (_, name) in ready {
            let Some(h) = self.held.get(&name) else { continue };
            let present: Vec<(usize, &Meta)> =
                h.metas.iter().enumerate().filter_map(|(r, m)| m.as_ref().map(|m| (r, m))).collect();
            let (r0, m0) = present[0];
            let error = present.iter().find(|(_, m)| !m0.agrees(m)).map(|&(r, m)| {
                let (wr, w0) = (w(r), w(r0));
                let kind = if m.kind == m0.kind { m0.kind.name() } else { "collective" };
                (
                    wr as u32,
                    format!("{kind} '{name}': rank {wr} submitted {}, rank {w0} {}", m.describe(m0), m0.describe(m)),
                )
            });
            let dims = if m0.kind == Kind::Allgather && error.is_none() {
                h.metas.iter().map(|m| m.as_ref().and_then(|m| m.shape.first().copied()).unwrap_or(0)).collect()
            } else {
                Vec::new()
            };
            out.push(Response { name, meta: m0.clone(), slot: None, dims, error });
        }
        // Whole groups only (counting their members found ready in the cache).
        let mut count: HashMap<u64, u32> = HashMap::default();
        for slot in hits {
            if let Some((_, m)) = cache.at(*slot).filter(|(_, m)| m.group != 0) {
                *count.entry(m.group).or_default() += 1;
            }
        }
        for r in &out {
            if r.meta.group != 0 {
                *count.entry(r.meta.group).or_default() += 1;
            }
        }
        out.retain(|r| r.meta.group == 0 || count.get(&r.meta.group).copied().unwrap_or(0) >= r.meta.group_size);
        let mut busy: BTreeSet<u32> = hits.iter().copied().collect();
        for r in &mut out {
            self.held.remove(&r.name);
            if r.error.is_none()
                && r.meta.kind.cacheable()
                && let Some(slot) = cache.choose(&busy)
            {
                busy.insert(slot);
                r.slot = Some(slot);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cache::tests::meta;

    fn req(name: &str, m: Meta) -> Request {
        Request { name: name.into(), meta: m }
    }

    fn names(rs: &[Response]) -> Vec<&str> {
        rs.iter().map(|r| r.name.as_str()).collect()
    }

    const WORLD: [usize; 3] = [10, 11, 12];

    #[test]
    fn a_name_is_ready_once_every_rank_requested_it_in_the_order_first_requested() {
        let mut c = Coordinator::new(3);
        let cache = Cache::new(8);
        let no = [false; 3];
        c.hold(1, &req("b", meta(2)), &WORLD).unwrap();
        c.hold(0, &req("a", meta(1)), &WORLD).unwrap();
        assert!(c.decide(&cache, &[], &no, &WORLD).is_empty());
        for r in 0..3 {
            if r != 0 {
                c.hold(r, &req("a", meta(1)), &WORLD).unwrap();
            }
            if r != 1 {
                c.hold(r, &req("b", meta(2)), &WORLD).unwrap();
            }
        }
        let out = c.decide(&cache, &[], &no, &WORLD);
        // b was requested first; each gets its own slot.
        assert_eq!(names(&out), ["b", "a"]);
        assert_eq!(out.iter().map(|r| r.slot).collect::<Vec<_>>(), [Some(0), Some(1)]);
        assert!(out.iter().all(|r| r.error.is_none() && r.dims.is_empty()));
        // Decided names leave the table: a new request starts over.
        assert!(c.kind_of("a").is_none());
        c.hold(0, &req("a", meta(1)), &WORLD).unwrap();
        assert!(c.decide(&cache, &[], &no, &WORLD).is_empty());
        assert_eq!(c.kind_of("a"), Some(Kind::Allreduce));
    }

    #[test]
    fn a_disagreement_is_an_error_in_words_naming_job_ranks_and_takes_no_slot() {
        let mut c = Coordinator::new(3);
        let mut f16 = meta(4);
        f16.dtype = crate::types::DType::F16;
        c.hold(0, &req("x", meta(4)), &WORLD).unwrap();
        c.hold(1, &req("x", meta(4)), &WORLD).unwrap();
        c.hold(2, &req("x", f16), &WORLD).unwrap();
        let out = c.decide(&Cache::new(8), &[], &[false; 3], &WORLD);
        assert_eq!(out.len(), 1);
        let (rank, text) = out[0].error.clone().unwrap_or_default();
        assert_eq!(rank, 12);
        assert_eq!(text, "allreduce 'x': rank 12 submitted f16 [4], rank 10 f32 [4]");
        assert_eq!(out[0].slot, None);
        // Twice from one rank is a protocol error naming it.
        c.hold(1, &req("y", meta(1)), &WORLD).unwrap();
        let e = c.hold(1, &req("y", meta(1)), &WORLD).unwrap_err();
        assert!(matches!(e, Error::Protocol { peer: Some(11), .. }), "{e}");
    }

    #[test]
    fn allgathers_carry_every_ranks_first_dimension_and_are_not_cached() {
        let mut c = Coordinator::new(3);
        for r in 0..3 {
            let mut m = meta(0);
            m.kind = Kind::Allgather;
            m.shape = vec![r as u64 + 1, 5];
            c.hold(r, &req("g", m), &WORLD).unwrap();
        }
        let out = c.decide(&Cache::new(8), &[], &[false; 3], &WORLD);
        assert_eq!((out[0].dims.clone(), out[0].slot, out[0].error.is_none()), (vec![1, 2, 3], None, true));
    }

    #[test]
    fn a_joined_rank_is_not_needed_for_an_allreduce_but_is_for_a_broadcast() {
        let mut c = Coordinator::new(3);
        let joined = [false, true, false];
        let mut b = meta(2);
        b.kind = Kind::Broadcast;
        for r in [0, 2] {
            c.hold(r, &req("sum", meta(2)), &WORLD).unwrap();
            c.hold(r, &req("bcast", b.clone()), &WORLD).unwrap();
        }
        assert_eq!(names(&c.decide(&Cache::new(8), &[], &joined, &WORLD)), ["sum"]);
        // Every rank joined: an allreduce nobody needs is not run.
        let mut c = Coordinator::new(2);
        c.hold(0, &req("s", meta(1)), &WORLD).unwrap();
        assert!(c.decide(&Cache::new(8), &[], &[true, true], &WORLD).is_empty());
    }

    #[test]
    fn groups_are_ready_whole_counting_members_found_in_the_cache() {
        let mut c = Coordinator::new(2);
        let member = |g: u64| {
            let mut m = meta(1);
            m.group = g;
            m.group_size = 3;
            m
        };
        let mut cache = Cache::new(8);
        cache.put(0, "g.cached", &member(7), 1);
        for r in 0..2 {
            c.hold(r, &req("g.a", member(7)), &WORLD).unwrap();
            c.hold(r, &req("g.b", member(7)), &WORLD).unwrap();
        }
        // Two of three: held back.
        assert!(c.decide(&cache, &[], &[false; 2], &WORLD).is_empty());
        // The third is ready through the cache in this cycle: the group runs, and the slots
        // given out avoid the busy one.
        let out = c.decide(&cache, &[0], &[false; 2], &WORLD);
        assert_eq!(names(&out), ["g.a", "g.b"]);
        assert_eq!(out.iter().map(|r| r.slot).collect::<Vec<_>>(), [Some(1), Some(2)]);
    }
}
