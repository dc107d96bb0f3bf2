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

impl std::fmt::Display for SizeRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kib = |b: usize| format!("{} KiB", b >> 10);
        match (self.from, self.below) {
            _ if self.is_empty() => f.write_str("two copies"),
            (0, usize::MAX) => f.write_str("single copy"),
            (from, usize::MAX) => write!(f, "single copy from {}", kib(from)),
            (from, below) => write!(f, "single copy from {} below {}", kib(from), kib(below)),
        }
    }
}

/// The buffer sizes at which the collectives of a context whose ranks share one host's memory
/// read each other's buffers straight (`process_vm_readv`: one copy) instead of going through
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
}

impl CopyPlan {
    /// Two copies always.
    pub const TWO: CopyPlan =
        CopyPlan { broadcast: SizeRange::NONE, allgather: SizeRange::NONE, allreduce: SizeRange::NONE };
    /// Single copy always.
    pub const SINGLE: CopyPlan =
        CopyPlan { broadcast: SizeRange::ALL, allgather: SizeRange::ALL, allreduce: SizeRange::ALL };

    /// The plan as words, as the area and the cache carry it.
    pub(crate) fn words(&self) -> [u64; 6] {
        let w = |r: SizeRange| [r.from as u64, r.below as u64];
        let ([a, b], [c, d], [e, g]) = (w(self.broadcast), w(self.allgather), w(self.allreduce));
        [a, b, c, d, e, g]
    }

    /// The plan of [`words`](Self::words).
    pub(crate) fn from_words(w: [u64; 6]) -> Self {
        let size = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
        let r = |i: usize| SizeRange { from: size(w[i]), below: size(w[i + 1]) };
        CopyPlan { broadcast: r(0), allgather: r(2), allreduce: r(4) }
    }
}

impl std::fmt::Display for CopyPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "broadcast {}, allgather {}, allreduce {}", self.broadcast, self.allgather, self.allreduce)
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
            },
        ] {
            assert_eq!(CopyPlan::from_words(p.words()), p);
        }
        assert!(SizeRange::ALL.contains(0) && SizeRange::ALL.contains(usize::MAX));
        assert!(!SizeRange::NONE.contains(0));
        assert!(
            !some.contains(65535) && some.contains(65536) && some.contains((1 << 24) - 1) && !some.contains(1 << 24)
        );
        assert_eq!(some.to_string(), "single copy from 64 KiB below 16384 KiB");
        assert_eq!(CopyPlan::TWO.to_string(), "broadcast two copies, allgather two copies, allreduce two copies");
    }
}
