//! The response cache (Horovod's ResponseCache) and the bit vectors over its slots.
//!
//! Every rank holds the same slots, changed only by what every rank sees in the same cycle:
//! the coordinator's responses (a name put in the slot it chose) and the invalidations
//! announced in the state messages. A name in the cache is negotiated by one bit per cycle.

use super::meta::Meta;
use rustc_hash::FxHashMap as HashMap;
use std::collections::BTreeSet;

/// The slots: a name and what was agreed for it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Cache {
    slots: Vec<Option<(String, Meta)>>,
    index: HashMap<String, u32>,
    /// The cycle each slot was last run in (for choosing a slot to reuse).
    used: Vec<u64>,
    /// Changes made to the slots so far; each slot's `version` is the count when it last
    /// changed (the same on every rank, as the slots are).
    changes: u64,
    version: Vec<u64>,
    capacity: usize,
}

impl Cache {
    /// An empty cache of at most `capacity` slots (0: nothing is cached).
    pub(crate) fn new(capacity: usize) -> Self {
        Cache {
            slots: Vec::new(),
            index: HashMap::default(),
            used: Vec::new(),
            changes: 0,
            version: Vec::new(),
            capacity,
        }
    }

    /// The slot of `name` and what was agreed for it.
    pub(crate) fn get(&self, name: &str) -> Option<(u32, &Meta)> {
        let slot = *self.index.get(name)?;
        self.slots.get(slot as usize)?.as_ref().map(|(_, m)| (slot, m))
    }

    /// The name in `slot`, and what was agreed for it.
    pub(crate) fn at(&self, slot: u32) -> Option<&(String, Meta)> {
        self.slots.get(slot as usize)?.as_ref()
    }

    /// When `slot` last changed (a count of the cache's changes), if it holds a name: equal
    /// versions of a slot hold the same name and agreement.
    pub(crate) fn version(&self, slot: u32) -> Option<u64> {
        self.at(slot)?;
        self.version.get(slot as usize).copied()
    }

    /// The changes made to the slots so far.
    pub(crate) fn changes(&self) -> u64 {
        self.changes
    }

    fn changed(&mut self, slot: usize) {
        self.changes += 1;
        if slot >= self.version.len() {
            self.version.resize(slot + 1, 0);
        }
        self.version[slot] = self.changes;
    }

    /// Words of a bit vector over the slots.
    pub(crate) fn words(&self) -> usize {
        self.slots.len().div_ceil(64)
    }

    /// Puts `name` in `slot`; returns the name it replaced, if any.
    pub(crate) fn put(&mut self, slot: u32, name: &str, meta: &Meta, cycle: u64) -> Option<String> {
        let s = slot as usize;
        if s >= self.slots.len() {
            self.slots.resize(s + 1, None);
            self.used.resize(s + 1, 0);
        }
        if let Some(old) = self.index.remove(name)
            && old != slot
        {
            self.slots[old as usize] = None;
            self.changed(old as usize);
        }
        let replaced = self.slots[s].take().map(|(n, _)| n).filter(|n| n != name);
        if let Some(r) = &replaced {
            self.index.remove(r);
        }
        self.slots[s] = Some((name.to_string(), meta.clone()));
        self.index.insert(name.to_string(), slot);
        self.used[s] = cycle;
        self.changed(s);
        replaced
    }

    /// Empties `slot`.
    pub(crate) fn drop_slot(&mut self, slot: u32) {
        if let Some((name, _)) = self.slots.get_mut(slot as usize).and_then(Option::take) {
            self.index.remove(&name);
            self.changed(slot as usize);
        }
    }

    /// Notes that `slot` ran in `cycle`.
    pub(crate) fn touch(&mut self, slot: u32, cycle: u64) {
        if let Some(u) = self.used.get_mut(slot as usize) {
            *u = cycle;
        }
    }

    /// A slot for a new name (the coordinator's choice): a free one, a new one below the
    /// capacity, else the least recently run one not in `busy`.
    pub(crate) fn choose(&self, busy: &BTreeSet<u32>) -> Option<u32> {
        if self.capacity == 0 {
            return None;
        }
        let free = (0..self.slots.len()).find(|&s| self.slots[s].is_none() && !busy.contains(&(s as u32)));
        if let Some(s) = free {
            return Some(s as u32);
        }
        if let Some(s) = (self.slots.len()..self.capacity).find(|&s| !busy.contains(&(s as u32))) {
            return Some(s as u32);
        }
        (0..self.slots.len()).filter(|&s| !busy.contains(&(s as u32))).min_by_key(|&s| self.used[s]).map(|s| s as u32)
    }
}

/// Sets `slot`'s bit (a slot beyond the words is ignored).
pub(crate) fn set_bit(words: &mut [u64], slot: u32) {
    set_index(words, slot as usize);
}

/// Whether `slot`'s bit is set.
pub(crate) fn has_bit(words: &[u64], slot: u32) -> bool {
    is_set(words, slot as usize)
}

/// Sets bit `i` of a bit vector over slots or ranks (a bit beyond the words is ignored).
pub(crate) fn set_index(words: &mut [u64], i: usize) {
    if let Some(w) = words.get_mut(i / 64) {
        *w |= 1 << (i % 64);
    }
}

/// Whether bit `i` of a bit vector over slots or ranks is set.
pub(crate) fn is_set(words: &[u64], i: usize) -> bool {
    words.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
}

/// The slots whose bits are set, in order.
pub(crate) fn bits(words: &[u64]) -> impl Iterator<Item = u32> + '_ {
    // Each word's set bits, lowest first, found by counting trailing zeros (a word costs as
    // many steps as it has bits set, not 64).
    words.iter().enumerate().flat_map(|(i, &w)| {
        std::iter::successors(Some(w).filter(|&w| w != 0), |&w| Some(w & (w - 1)).filter(|&w| w != 0))
            .map(move |w| i as u32 * 64 + w.trailing_zeros())
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::meta::Kind;
    use crate::engine::tensor::Compression;
    use crate::types::{DType, Reduction};
    use proptest::prelude::*;

    /// An f32 sum allreduce of `d` elements.
    pub(crate) fn meta(d: u64) -> Meta {
        Meta {
            kind: Kind::Allreduce,
            dtype: DType::F32,
            shape: vec![d],
            op: Reduction::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            compression: Compression::None,
            group: 0,
            group_size: 0,
        }
    }

    #[test]
    fn cache_slots_are_stable_and_reused_least_recently_run_first() {
        let mut c = Cache::new(2);
        let none = BTreeSet::new();
        assert_eq!(c.choose(&none), Some(0));
        assert_eq!(c.put(0, "a", &meta(1), 1), None);
        assert_eq!(c.choose(&none), Some(1));
        // A slot chosen in this round is busy: the next new one is after it.
        // The last new slot was chosen earlier in the same round: reuse the least recently run.
        assert_eq!(c.choose(&BTreeSet::from([1])), Some(0));
        c.put(1, "b", &meta(2), 2);
        assert_eq!(c.get("a").map(|(s, _)| s), Some(0));
        // Full: the least recently run slot (a, cycle 1) is reused, unless busy.
        assert_eq!(c.choose(&none), Some(0));
        assert_eq!(c.choose(&BTreeSet::from([0])), Some(1));
        // Running a makes b the least recently run.
        c.touch(0, 3);
        assert_eq!(c.choose(&none), Some(1));
        assert_eq!(c.put(0, "c", &meta(3), 3), Some("a".to_string()));
        assert!(c.get("a").is_none());
        c.drop_slot(1);
        assert!(c.get("b").is_none());
        assert_eq!(c.choose(&none), Some(1));
        assert_eq!(Cache::new(0).choose(&none), None);
        // A name put in another slot leaves its old one.
        c.put(1, "c", &meta(3), 4);
        assert_eq!((c.get("c").map(|(s, _)| s), c.at(0)), (Some(1), None));
    }

    #[test]
    fn bit_helpers() {
        let mut w = vec![0u64; 2];
        set_bit(&mut w, 3);
        set_bit(&mut w, 64);
        set_bit(&mut w, 500); // out of range: ignored
        assert!(has_bit(&w, 3) && has_bit(&w, 64) && !has_bit(&w, 4) && !has_bit(&w, 500));
        assert_eq!(bits(&w).collect::<Vec<_>>(), vec![3, 64]);
    }

    proptest! {
        // The set bits of any words, in order, as a plain look at every bit finds them.
        #[test]
        fn bits_are_every_set_bit_in_order(words in proptest::collection::vec(any::<u64>(), 0..5), ones in 0usize..3) {
            let mut words = words;
            words.extend(std::iter::repeat_n(u64::MAX, ones));
            let want: Vec<u32> = (0..words.len() as u32 * 64).filter(|&b| words[b as usize / 64] >> (b % 64) & 1 == 1).collect();
            prop_assert_eq!(bits(&words).collect::<Vec<_>>(), want);
        }
    }

    proptest! {
        // Any sequence of puts, drops and choices: the index and the slots say the same, a
        // name is in one slot at most, a choice is never busy nor at or past the capacity, and
        // there is no choice only when the cache is off or every slot is busy.
        #[test]
        fn the_index_follows_the_slots_and_choices_respect_capacity_and_busy(
            capacity in 0usize..6,
            ops in proptest::collection::vec((0u8..3, 0u32..8, 0u8..5, proptest::collection::btree_set(0u32..6, 0..4)), 0..60),
        ) {
            let mut c = Cache::new(capacity);
            for (cycle, (op, slot, name, busy)) in ops.into_iter().enumerate() {
                let name = format!("n{name}");
                match op {
                    0 => {
                        if let Some(s) = c.choose(&busy) {
                            prop_assert!(!busy.contains(&s) && (s as usize) < capacity, "{s} of {capacity}, busy {busy:?}");
                            c.put(s, &name, &meta(u64::from(s)), cycle as u64);
                        } else {
                            prop_assert!(capacity == 0 || (0..capacity as u32).all(|s| busy.contains(&s)));
                        }
                    }
                    1 => c.drop_slot(slot),
                    _ => c.touch(slot, cycle as u64),
                }
                for (s, x) in c.slots.iter().enumerate() {
                    if let Some((n, _)) = x {
                        prop_assert_eq!(c.index.get(n).copied(), Some(s as u32));
                    }
                }
                prop_assert_eq!(c.index.len(), c.slots.iter().flatten().count());
                prop_assert!(c.slots.len() <= capacity.max(1) && c.used.len() == c.slots.len());
            }
        }
    }
}
