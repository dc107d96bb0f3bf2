//! Why a context was aborted, as it travels to the peers ([`AbortCause`]): its kinds, the error
//! each turns back into on the receiving rank, and its encoding through the one
//! [`codec`](super::handshake::codec), bounded by [`MAX_CAUSE`] bytes.

use super::handshake::codec::{BufMutExt, DecodeError, Decoded, Reader};
use crate::error::Error;

/// Why a context was aborted, as it travels to the peers: kept structured so that every rank
/// reports the first cause (the rank that died, the rank that timed out), not "aborted".
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AbortCause {
    pub(crate) kind: CauseKind,
    /// The rank the cause started at (the one that called abort, timed out or saw a peer die).
    pub(crate) origin: usize,
    /// The rank the cause is about (the dead or disagreeing peer), when another than `origin`.
    pub(crate) subject: Option<usize>,
    /// The operation that failed ("allreduce", ...), or empty.
    pub(crate) op: String,
    /// The rest, in words.
    pub(crate) detail: String,
}

/// The kinds of [`AbortCause`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum CauseKind {
    /// [`Context::abort`](crate::Context::abort).
    User = 1,
    /// A peer's connection closed ([`Error::PeerClosed`]).
    PeerClosed = 2,
    /// An operation timed out.
    TimedOut = 3,
    /// Ranks disagreed ([`Error::Mismatch`]).
    Mismatch = 4,
    /// A protocol violation ([`Error::Protocol`]).
    Protocol = 5,
    /// Anything else.
    Other = 6,
    /// [`Context::revoke`](crate::Context::revoke).
    Revoked = 7,
}

/// Longest encoded abort cause.
pub(crate) const MAX_CAUSE: usize = 4096;

impl AbortCause {
    /// The cause `err` makes when rank `me` aborts because of it.
    pub(crate) fn of(err: &Error, me: usize) -> Self {
        let cause = |kind, origin, subject, op: &str, detail: &str| AbortCause {
            kind,
            origin,
            subject,
            op: op.to_string(),
            detail: detail.to_string(),
        };
        match err {
            Error::Aborted { rank, reason } => cause(CauseKind::User, *rank, None, "", reason),
            Error::Revoked { rank, reason } => cause(CauseKind::Revoked, *rank, None, "", reason),
            Error::PeerClosed { rank, op, detail } => cause(CauseKind::PeerClosed, me, Some(*rank), op, detail),
            Error::PeerSilent { rank, .. } => {
                cause(CauseKind::PeerClosed, me, Some(*rank), "heartbeat", &err.to_string())
            }
            Error::PeerTimedOut { rank, op, detail } => cause(CauseKind::TimedOut, *rank, None, op, detail),
            Error::Timeout { op, .. } => cause(CauseKind::TimedOut, me, None, op, &err.to_string()),
            Error::Mismatch { rank, detail } => cause(CauseKind::Mismatch, me, Some(*rank), "", detail),
            Error::Protocol { peer, detail } => cause(CauseKind::Protocol, me, *peer, "", detail),
            other => cause(CauseKind::Other, me, None, "", &other.to_string()),
        }
    }

    /// The error a rank reports when a peer aborts with this cause.
    pub(crate) fn into_error(self) -> Error {
        let AbortCause { kind, origin, subject, op, detail } = self;
        let reported = |detail: String| {
            if detail.contains("reported by rank") || subject.is_none_or(|s| s == origin) {
                detail
            } else {
                format!("{detail} (reported by rank {origin})")
            }
        };
        match kind {
            CauseKind::User => Error::Aborted { rank: origin, reason: detail },
            CauseKind::PeerClosed => {
                Error::PeerClosed { rank: subject.unwrap_or(origin), op, detail: reported(detail) }
            }
            CauseKind::TimedOut => Error::PeerTimedOut { rank: origin, op, detail },
            CauseKind::Mismatch => Error::Mismatch { rank: subject.unwrap_or(origin), detail: reported(detail) },
            CauseKind::Protocol => Error::Protocol { peer: Some(subject.unwrap_or(origin)), detail: reported(detail) },
            CauseKind::Other => Error::Aborted { rank: origin, reason: detail },
            CauseKind::Revoked => Error::Revoked { rank: origin, reason: detail },
        }
    }

    /// `kind u8 | origin u32 | subject u32 (u32::MAX: none) | op length u16 | op | detail`,
    /// at most [`MAX_CAUSE`] bytes (the detail is cut at a character boundary).
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(MAX_CAUSE.min(11 + self.op.len() + self.detail.len()));
        b.write(self.kind as u8);
        b.write(self.origin as u32);
        b.write(self.subject.map_or(u32::MAX, |s| s as u32));
        b.write_u16_prefixed(truncate(&self.op, 256).as_bytes());
        b.extend_from_slice(truncate(&self.detail, MAX_CAUSE - b.len()).as_bytes());
        b
    }

    /// Decodes [`AbortCause::encode`]'s bytes; a malformed cause is an error message.
    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Self, String> {
        if b.len() < 11 || b.len() > MAX_CAUSE {
            return Err(format!("abort cause of {} bytes", b.len()));
        }
        let mut r = Reader::new(b);
        let read = |r: &mut Reader<'_>| -> Decoded<Self> {
            let kind = match r.get::<u8>()? {
                1 => CauseKind::User,
                2 => CauseKind::PeerClosed,
                3 => CauseKind::TimedOut,
                4 => CauseKind::Mismatch,
                5 => CauseKind::Protocol,
                6 => CauseKind::Other,
                7 => CauseKind::Revoked,
                k => return Err(DecodeError::malformed(format!("unknown abort cause kind {k}"))),
            };
            let origin = r.get::<u32>()? as usize;
            let subject = r.get::<u32>()?;
            let op = r.u16_prefixed(MAX_CAUSE, "an abort cause's operation name")?;
            Ok(AbortCause {
                kind,
                origin,
                subject: (subject != u32::MAX).then_some(subject as usize),
                op: String::from_utf8_lossy(op).into_owned(),
                detail: String::from_utf8_lossy(r.rest()).into_owned(),
            })
        };
        read(&mut r).map_err(|e| match e {
            DecodeError::Short(_) => "abort cause shorter than its operation name".to_string(),
            DecodeError::Malformed(why) => why,
        })
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends at a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    #[test]
    fn abort_causes_keep_the_first_cause_across_relays() {
        // Rank 1 sees rank 2 die and aborts; rank 0 hears it and relays it to rank 3.
        let seen = Error::PeerClosed { rank: 2, op: "allreduce".into(), detail: "connection closed (EOF)".into() };
        let at_0 = AbortCause::of(&seen, 1).into_error();
        assert!(matches!(&at_0, Error::PeerClosed { rank: 2, op, .. } if op == "allreduce"), "{at_0}");
        assert!(at_0.to_string().contains("reported by rank 1"), "{at_0}");
        let at_3 = AbortCause::decode(&AbortCause::of(&at_0, 0).encode()).unwrap().into_error();
        assert_eq!(at_3.to_string(), at_0.to_string());
        // A timeout at rank 4 reaches the others as rank 4 timing out.
        let t = Error::Timeout { op: "broadcast".into(), ranks: vec![5], keys: vec![], waited: Duration::from_secs(2) };
        let e = AbortCause::of(&t, 4).into_error();
        assert!(matches!(&e, Error::PeerTimedOut { rank: 4, op, .. } if op == "broadcast"), "{e}");
        assert!(e.to_string().contains("still waiting for rank 5"), "{e}");
        let user = Error::Aborted { rank: 3, reason: "bad data".into() };
        assert!(matches!(AbortCause::of(&user, 0).into_error(), Error::Aborted { rank: 3, .. }));
    }

    proptest! {
        #[test]
        fn abort_causes_round_trip_within_their_bound(
            kind in 1u8..=7, origin in 0u32..1000, subject in proptest::option::of(0u32..1000),
            op in "[a-z_]{0,20}", detail in "\\PC{0,3000}",
        ) {
            let c = AbortCause {
                kind: AbortCause::decode(&[kind, 0, 0, 0, 0, 255, 255, 255, 255, 0, 0]).unwrap().kind,
                origin: origin as usize,
                subject: subject.map(|s| s as usize),
                op,
                detail,
            };
            let b = c.encode();
            prop_assert!(b.len() <= MAX_CAUSE);
            let d = AbortCause::decode(&b).unwrap();
            prop_assert_eq!(&d.op, &c.op);
            prop_assert!(c.detail.starts_with(&d.detail));
            prop_assert_eq!((d.kind, d.origin, d.subject), (c.kind, c.origin, c.subject));
        }

        #[test]
        fn random_abort_causes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = AbortCause::decode(&b);
        }
    }
}
