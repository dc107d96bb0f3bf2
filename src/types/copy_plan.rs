//! Which copy path a host's shared-memory collectives take, per collective and size.

/// Buffer sizes in bytes: from `from` up to, not including, `below`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeRange {
    /// The smallest size in the range.
    pub from: usize,
    /// The first size past it (`usize::MAX`: no end).
    pub below: usize,
}

impl SizeRange {
    /// No size.
    pub const NONE: SizeRange = SizeRange { from: 0, below: 0 };
    /// Every size.
    pub const ALL: SizeRange = SizeRange { from: 0, below: usize::MAX };

    /// Whether `bytes` is in the range.
    pub fn contains(&self, bytes: usize) -> bool {
        bytes >= self.from && (bytes < self.below || self.below == usize::MAX)
    }

    fn is_empty(&self) -> bool {
        self.from >= self.below
    }
}

impl SizeRange {
    /// The range's bounds in words, after what it is the range of: "", " from 64 KiB",
    /// " from 64 KiB below 2048 KiB" (nothing said of an empty range).
    fn bounds(&self) -> String {
        let kib = |b: usize| format!("{} KiB", b >> 10);
        match (self.from, self.below) {
            (0, usize::MAX) => String::new(),
            (from, usize::MAX) => format!(" from {}", kib(from)),
            (from, below) => format!(" from {} below {}", kib(from), kib(below)),
        }
    }
}

impl std::fmt::Display for SizeRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.is_empty() {
            true => f.write_str("two copies"),
            false => write!(f, "single copy{}", self.bounds()),
        }
    }
}

/// The buffer sizes at which the collectives of a context whose ranks share one host's memory
/// copy straight between their buffers (`process_vm_readv`, `process_vm_writev`: one copy)
/// instead of going through
/// the shared area's slots (two copies: into the owner's slot, out of it); in bytes of the
/// user's buffer (allgather's output). Every rank of the host holds the same plan: one rank
/// measures and decides it as the context forms (see [`ShmCopy`](crate::device::ShmCopy)),
/// so all take the same path in every call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPlan {
    /// Broadcast's single-copy sizes.
    pub broadcast: SizeRange,
    /// Allgather's (equal blocks).
    pub allgather: SizeRange,
    /// Allreduce's (and the first host step of the two-level allreduce; its last one, a
    /// broadcast, follows [`broadcast`](Self::broadcast)'s).
    pub allreduce: SizeRange,
    /// The sizes at which a single-copy broadcast's root shares the copying: while the
    /// others read the root's buffer straight, the root writes a part of each one's buffer
    /// straight into it (`process_vm_writev`), so that two cores copy where one would. Taken
    /// before [`broadcast`](Self::broadcast) where both hold a size. Worth it where the root
    /// has a core of its own; measured with the rest.
    pub broadcast_split: SizeRange,
}

/// How a shared-memory broadcast of some size copies ([`CopyPlan::broadcast_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BroadcastPath {
    /// Through the root's slot.
    Two,
    /// The others read the root's buffer.
    Read,
    /// The others read a part of the root's buffer, the root writes the rest into theirs.
    Split,
}

impl CopyPlan {
    /// Two copies always.
    pub const TWO: CopyPlan = CopyPlan {
        broadcast: SizeRange::NONE,
        allgather: SizeRange::NONE,
        allreduce: SizeRange::NONE,
        broadcast_split: SizeRange::NONE,
    };
    /// Single copy always, every member reading for itself (the root writes nothing).
    pub const SINGLE: CopyPlan = CopyPlan {
        broadcast: SizeRange::ALL,
        allgather: SizeRange::ALL,
        allreduce: SizeRange::ALL,
        broadcast_split: SizeRange::NONE,
    };

    /// Words in [`words`](Self::words).
    pub(crate) const WORDS: usize = 8;

    /// The plan as words, as the area and the cache carry it.
    pub(crate) fn words(&self) -> [u64; Self::WORDS] {
        let w = |r: SizeRange| [r.from as u64, r.below as u64];
        let ([a, b], [c, d], [e, g], [h, i]) =
            (w(self.broadcast), w(self.allgather), w(self.allreduce), w(self.broadcast_split));
        [a, b, c, d, e, g, h, i]
    }

    /// The plan of [`words`](Self::words).
    pub(crate) fn from_words(w: [u64; Self::WORDS]) -> Self {
        let size = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
        let r = |i: usize| SizeRange { from: size(w[i]), below: size(w[i + 1]) };
        CopyPlan { broadcast: r(0), allgather: r(2), allreduce: r(4), broadcast_split: r(6) }
    }

    /// The path of a shared-memory broadcast of `bytes`.
    pub(crate) fn broadcast_path(&self, bytes: usize) -> BroadcastPath {
        if self.broadcast_split.contains(bytes) {
            BroadcastPath::Split
        } else if self.broadcast.contains(bytes) {
            BroadcastPath::Read
        } else {
            BroadcastPath::Two
        }
    }
}

impl std::fmt::Display for CopyPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "broadcast {}, allgather {}, allreduce {}", self.broadcast, self.allgather, self.allreduce)?;
        match (self.broadcast_split.is_empty(), self.broadcast_split.bounds()) {
            (true, _) => Ok(()),
            (false, b) if b.is_empty() => f.write_str("; the broadcast's root writes a share always"),
            (false, b) => write!(f, "; the broadcast's root writes a share{b}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_through_words_and_ranges_hold_what_they_say() {
        let some = SizeRange { from: 65536, below: 1 << 24 };
        for p in [
            CopyPlan::TWO,
            CopyPlan::SINGLE,
            CopyPlan {
                broadcast: some,
                allgather: SizeRange::NONE,
                allreduce: SizeRange { from: 1, below: usize::MAX },
                broadcast_split: SizeRange { from: 1 << 20, below: 1 << 26 },
            },
        ] {
            assert_eq!(CopyPlan::from_words(p.words()), p);
        }
        let split = CopyPlan { broadcast_split: SizeRange { from: 1 << 20, below: usize::MAX }, ..CopyPlan::SINGLE };
        assert_eq!(
            [0, (1 << 20) - 1, 1 << 20].map(|b| split.broadcast_path(b)),
            [BroadcastPath::Read, BroadcastPath::Read, BroadcastPath::Split]
        );
        assert_eq!(CopyPlan::TWO.broadcast_path(1 << 20), BroadcastPath::Two);
        assert!(split.to_string().ends_with("; the broadcast's root writes a share from 1024 KiB"), "{split}");
        assert!(SizeRange::ALL.contains(0) && SizeRange::ALL.contains(usize::MAX));
        assert!(!SizeRange::NONE.contains(0));
        assert!(
            !some.contains(65535) && some.contains(65536) && some.contains((1 << 24) - 1) && !some.contains(1 << 24)
        );
        assert_eq!(some.to_string(), "single copy from 64 KiB below 16384 KiB");
        assert_eq!(CopyPlan::TWO.to_string(), "broadcast two copies, allgather two copies, allreduce two copies");
    }
}
