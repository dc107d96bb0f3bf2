//! Collective algorithms, written once against the transport's Pair API (through a
//! [`Scope`](crate::Scope)) so they run unchanged on every backend.

pub(crate) mod barrier;

/// Descriptor words (`meta`) of collective messages: the collective in the top byte, so a
/// rank that runs a different collective than its peer gets [`Error::Mismatch`](crate::Error)
/// rather than corrupted data.
pub(crate) mod meta {
    /// Barrier round `r`.
    pub(crate) fn barrier(round: u32) -> u32 {
        0x0100_0000 | (round & 0xff_ffff)
    }
}
