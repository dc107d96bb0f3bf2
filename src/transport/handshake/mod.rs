//! The one handshake of every backend (TCP, shared memory, ibverbs), as a sans-IO state
//! machine ([`machine::Handshake`]), over the crate's one codec ([`crate::codec`]).
//!
//! The connecting side (always the higher rank of a pair) and the accepting side exchange:
//!
//! ```text
//! connector                                   acceptor
//!   Hello(ctx, from, to, size, lane, nonce_c)  ->
//!                                              <-  Challenge(status, nonce_a, MAC_a)
//!   Proof(connector payload, MAC_c)            ->
//!   and where the acceptor has a payload (shared memory, ibverbs; not TCP):
//!                                              <-  Welcome(status, acceptor payload, MAC)
//!   Ready(status, payload, MAC)                ->
//! ```
//!
//! Each MAC is HMAC-SHA256 under the job's secret over a label, the acceptor's address (as
//! the acceptor published it, and as the connector found it in the store), and every byte of
//! the handshake so far. So:
//!
//! - **no replay**: both sides contribute a fresh random nonce, and each proof covers the
//!   other side's nonce, so a recorded message checks in no other handshake;
//! - **both sides prove the secret** before either hands over anything: the acceptor in its
//!   challenge (the connector checks it before it sends its proof), the connector in its proof
//!   (the acceptor checks it before it welcomes). A fake acceptor without the secret gets only a
//!   hello; a stranger replaying a hello gets only a challenge;
//! - **payloads only after the proofs**: a backend's payload (the ibverbs queue pair address
//!   and ring key, the shared-memory descriptors that go with the same message) travels in the
//!   proof and the welcome, each sent only to a peer that proved the secret, and sealed by a
//!   MAC;
//! - **no relay from another address**: a stranger who puts its own address in the store and
//!   forwards the real acceptor's challenge fails, since the connector checks the MAC against
//!   the address it dialed;
//! - the ready message closes the handshakes that have a welcome: the acceptor must not use
//!   the connection before the connector has set up its side with the welcome's payload
//!   (ibverbs brings its queue pair up; shared memory says whether it can read the acceptor's
//!   memory). TCP has no acceptor payload, so its handshake ends with the proof: the connector
//!   is done when it sent it, the acceptor when it checked it.
//!
//! Against a shorter alternative (hello; challenge with the acceptor's payload; proof), the
//! welcome costs one more round trip where there is an acceptor payload, and buys that neither
//! side's payload reaches a peer that has not proved the secret. TCP's handshake takes as many
//! round trips as before (the connector sends after one, as it did with a secret). Without a
//! secret the MACs are zero and unchecked; magic, version, backend, context id, ranks and world
//! size are checked all the same, and a refusal carries a [`messages::Status`] the refused side
//! puts in words.
//!
//! Messages (little-endian):
//!
//! ```text
//! every message:   magic "FGLO" u32 | version u16 | type u8 | code u8 (flags or status)
//! Hello      56 B: ... | backend u8 | lane u8 | reserved [2] | context id [16] | from u32 |
//!                  to u32 | size u32 | nonce [16]                 (code: bit 0, a secret is used)
//! Challenge  56 B: ... | nonce [16] | MAC [32]                    (code: status)
//! Proof, Welcome, Ready: ... | payload length u16 (at most 1024) | payload | MAC [32]
//! ```
//! Every message has a bounded size, read in at most two steps, so nothing a stranger sends
//! sizes an allocation beyond [`messages::MAX_MESSAGE`] bytes.

/// The crate's codec, where the transport's code has always found it.
pub(crate) use crate::codec;
pub(crate) mod machine;
pub(crate) mod messages;

#[cfg(test)]
pub(crate) mod attacks;
#[cfg(test)]
mod tests;

pub(crate) use machine::{Dial, Done, Event, Handshake, Local};
pub(crate) use messages::{BackendKind, Status};
