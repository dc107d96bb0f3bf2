//! Which copy path a host's shared-memory collectives take, per collective and size.

/// The sizes from which the collectives of a context whose ranks share one host's memory read
/// each other's buffers straight (`process_vm_readv`: one copy) instead of going through the
/// shared area's slots (two copies: into the owner's slot, out of it). Each is in bytes of
/// the user's buffer (allgather's output); `None`: always two copies. Every rank of the host
/// holds the same plan: one rank measures and decides it as the context forms (see
/// [`ShmCopy`](crate::device::ShmCopy)), so all take the same path in every call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPlan {
    /// Broadcast's threshold.
    pub broadcast: Option<usize>,
    /// Allgather's threshold (equal blocks).
    pub allgather: Option<usize>,
    /// Allreduce's threshold.
    pub allreduce: Option<usize>,
}

impl CopyPlan {
    /// Two copies always.
    pub const TWO: CopyPlan = CopyPlan { broadcast: None, allgather: None, allreduce: None };
    /// Single copy always.
    pub const SINGLE: CopyPlan = CopyPlan { broadcast: Some(0), allgather: Some(0), allreduce: Some(0) };

    /// The plan as words (`u64::MAX` for `None`), as the area and the cache carry it.
    pub(crate) fn words(&self) -> [u64; 3] {
        [self.broadcast, self.allgather, self.allreduce].map(|t| t.map_or(u64::MAX, |b| b as u64))
    }

    /// The plan of [`words`](Self::words).
    pub(crate) fn from_words(w: [u64; 3]) -> Self {
        let t = |w: u64| if w == u64::MAX { None } else { Some(usize::try_from(w).unwrap_or(usize::MAX)) };
        CopyPlan { broadcast: t(w[0]), allgather: t(w[1]), allreduce: t(w[2]) }
    }

    /// Whether a collective with this threshold reads straight at `bytes`.
    pub(crate) fn single(threshold: Option<usize>, bytes: usize) -> bool {
        threshold.is_some_and(|t| bytes >= t)
    }
}

impl std::fmt::Display for CopyPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let from = |t: Option<usize>| match t {
            None => "two copies".to_string(),
            Some(0) => "single copy".to_string(),
            Some(b) => format!("single copy from {} KiB", b >> 10),
        };
        write!(
            f,
            "broadcast {}, allgather {}, allreduce {}",
            from(self.broadcast),
            from(self.allgather),
            from(self.allreduce)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_round_trip_through_words() {
        for p in
            [CopyPlan::TWO, CopyPlan::SINGLE, CopyPlan { broadcast: Some(65536), allgather: None, allreduce: Some(1) }]
        {
            assert_eq!(CopyPlan::from_words(p.words()), p);
        }
        assert!(CopyPlan::single(Some(0), 0) && !CopyPlan::single(None, usize::MAX));
        assert!(!CopyPlan::single(Some(4096), 4095) && CopyPlan::single(Some(4096), 4096));
    }
}
