//! The connection handshake: who is calling, for which context, and (optionally) proof that
//! both sides hold the job's shared secret.
//!
//! The connecting side (always the higher rank) sends a [`Hello`]; the accepting side answers an
//! [`Ack`]; when a secret is in use the connector then sends its proof, the 32-byte Auth
//! message below (plain bytes, no type of its own). Every message has a fixed size, so nothing
//! a stranger sends sizes an allocation.
//!
//! A pair is two connections, both opened by the higher rank (see `pair::Lane`); the Hello's
//! `bulk` flag says which one this is.
//!
//! ```text
//! Hello (64 B): magic u32 | version u16 | flags u16 | context id [16] | from rank u32 |
//!               to rank u32 | size u32 | connector nonce [16] | reserved [12]
//! Ack   (64 B): magic u32 | version u16 | status u16 | acceptor nonce [16] | mac [32] |
//!               reserved [8]
//! Auth  (32 B): mac [32]
//! ```
//! With a secret `s`: `Ack.mac = HMAC-SHA256(s, "ferrogloo-ack" | Hello | acceptor nonce)` and
//! `Auth.mac = HMAC-SHA256(s, "ferrogloo-auth" | Hello | acceptor nonce)`; both nonces are
//! fresh random bytes, so a recorded handshake cannot be replayed. Without a secret the MACs are
//! zero.

use crate::transport::ContextId;

/// "FGLO" in little-endian.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"FGLO");
/// Wire protocol version; both sides must agree. (2: two connections per pair; 3: frame headers
/// with a group and a call descriptor.)
pub(crate) const VERSION: u16 = 3;
pub(crate) const HELLO_LEN: usize = 64;
pub(crate) const ACK_LEN: usize = 64;
pub(crate) const AUTH_LEN: usize = 32;

const FLAG_SECRET: u16 = 1;
const FLAG_BULK: u16 = 2;

/// The connector's opening message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) with_secret: bool,
    pub(crate) ctx: ContextId,
    pub(crate) from: u32,
    pub(crate) to: u32,
    pub(crate) size: u32,
    pub(crate) nonce: [u8; 16],
    /// This is the pair's bulk connection (`pair::Lane::Bulk`), else its main one.
    pub(crate) bulk: bool,
}

/// The acceptor's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum Status {
    Ok = 0,
    UnknownContext = 1,
    BadRank = 2,
    Duplicate = 3,
    SecretMismatch = 4,
}

impl Status {
    fn from_u16(v: u16) -> Option<Self> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::UnknownContext,
            2 => Status::BadRank,
            3 => Status::Duplicate,
            4 => Status::SecretMismatch,
            _ => return None,
        })
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            Status::Ok => "accepted",
            Status::UnknownContext => "the peer has no context with this id (a stale or foreign rendezvous)",
            Status::BadRank => "the ranks or world size do not fit the peer's context",
            Status::Duplicate => "the peer already has a connection for this pair",
            Status::SecretMismatch => "one side uses a shared secret and the other does not",
        }
    }
}

/// The acceptor's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ack {
    pub(crate) status: Status,
    pub(crate) nonce: [u8; 16],
    pub(crate) mac: [u8; 32],
}

fn check_magic(b: &[u8]) -> Result<(), String> {
    let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    if magic != MAGIC {
        return Err(format!("bad magic {magic:#010x} (not a ferrogloo peer)"));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(format!("protocol version {version}, this side speaks {VERSION}"));
    }
    Ok(())
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let flags = if self.with_secret { FLAG_SECRET } else { 0 } | if self.bulk { FLAG_BULK } else { 0 };
        b[6..8].copy_from_slice(&flags.to_le_bytes());
        b[8..24].copy_from_slice(&self.ctx);
        b[24..28].copy_from_slice(&self.from.to_le_bytes());
        b[28..32].copy_from_slice(&self.to.to_le_bytes());
        b[32..36].copy_from_slice(&self.size.to_le_bytes());
        b[36..52].copy_from_slice(&self.nonce);
        b
    }

    pub(crate) fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, String> {
        check_magic(b)?;
        let flags = u16::from_le_bytes([b[6], b[7]]);
        if flags & !(FLAG_SECRET | FLAG_BULK) != 0 {
            return Err(format!("unknown handshake flags {flags:#x}"));
        }
        if b[52..].iter().any(|&x| x != 0) {
            return Err("nonzero reserved bytes in handshake".into());
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut ctx = [0u8; 16];
        ctx.copy_from_slice(&b[8..24]);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[36..52]);
        Ok(Hello {
            with_secret: flags & FLAG_SECRET != 0,
            ctx,
            from: u32_at(24),
            to: u32_at(28),
            size: u32_at(32),
            nonce,
            bulk: flags & FLAG_BULK != 0,
        })
    }
}

impl Ack {
    pub(crate) fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.status as u16).to_le_bytes());
        b[8..24].copy_from_slice(&self.nonce);
        b[24..56].copy_from_slice(&self.mac);
        b
    }

    pub(crate) fn decode(b: &[u8; ACK_LEN]) -> Result<Self, String> {
        check_magic(b)?;
        let raw = u16::from_le_bytes([b[6], b[7]]);
        let status = Status::from_u16(raw).ok_or_else(|| format!("unknown handshake status {raw}"))?;
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[8..24]);
        let mut mac = [0u8; 32];
        mac.copy_from_slice(&b[24..56]);
        Ok(Ack { status, nonce, mac })
    }
}

pub(crate) use crate::transport::auth::{mac, mac_eq};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello_strategy() -> impl Strategy<Value = Hello> {
        (any::<bool>(), any::<[u8; 16]>(), any::<u32>(), any::<u32>(), any::<u32>(), any::<[u8; 16]>(), any::<bool>())
            .prop_map(|(with_secret, ctx, from, to, size, nonce, bulk)| Hello {
                with_secret,
                ctx,
                from,
                to,
                size,
                nonce,
                bulk,
            })
    }

    proptest! {
        #[test]
        fn hello_round_trips(h in hello_strategy()) {
            prop_assert_eq!(Hello::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn ack_round_trips(status in 0u16..5, nonce in any::<[u8; 16]>(), mac in any::<[u8; 32]>()) {
            let a = Ack { status: Status::from_u16(status).unwrap(), nonce, mac };
            prop_assert_eq!(Ack::decode(&a.encode()), Ok(a));
        }

        #[test]
        fn random_handshakes_never_panic(bytes in proptest::collection::vec(any::<u8>(), HELLO_LEN)) {
            let arr: [u8; HELLO_LEN] = bytes.try_into().unwrap();
            let _ = Hello::decode(&arr);
            let _ = Ack::decode(&arr);
        }
    }

    #[test]
    fn macs_depend_on_secret_and_nonce() {
        let h =
            Hello { with_secret: true, ctx: [7; 16], from: 1, to: 0, size: 2, nonce: [1; 16], bulk: false }.encode();
        let a = mac(Some(b"s1"), "ferrogloo-ack", &h, &[2; 16]);
        assert!(mac_eq(&a, &mac(Some(b"s1"), "ferrogloo-ack", &h, &[2; 16])));
        assert!(!mac_eq(&a, &mac(Some(b"s2"), "ferrogloo-ack", &h, &[2; 16])));
        assert!(!mac_eq(&a, &mac(Some(b"s1"), "ferrogloo-ack", &h, &[3; 16])));
        assert!(!mac_eq(&a, &mac(Some(b"s1"), "ferrogloo-auth", &h, &[2; 16])));
    }

    #[test]
    fn strangers_are_rejected() {
        let mut b =
            Hello { with_secret: false, ctx: [0; 16], from: 1, to: 0, size: 2, nonce: [0; 16], bulk: false }.encode();
        b[0] ^= 1;
        assert!(Hello::decode(&b).unwrap_err().contains("magic"));
        let mut b =
            Hello { with_secret: false, ctx: [0; 16], from: 1, to: 0, size: 2, nonce: [0; 16], bulk: false }.encode();
        b[4] = 9;
        assert!(Hello::decode(&b).unwrap_err().contains("version"));
    }
}
