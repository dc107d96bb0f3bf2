//! Proof of a shared secret in a handshake, for every backend that has one.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// HMAC-SHA256 of the concatenation of `parts`; zeros without a secret.
pub(crate) fn mac(secret: Option<&[u8]>, parts: &[&[u8]]) -> [u8; 32] {
    let Some(secret) = secret else { return [0u8; 32] };
    let mut m = match <Hmac<Sha256> as KeyInit>::new_from_slice(secret) {
        Ok(m) => m,
        // HMAC takes keys of any length; this arm cannot be reached.
        Err(_) => return [0u8; 32],
    };
    for p in parts {
        m.update(p);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(&m.finalize().into_bytes());
    out
}

/// Constant-time MAC comparison.
pub(crate) fn mac_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
