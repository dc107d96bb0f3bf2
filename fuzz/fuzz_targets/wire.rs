//! Fuzzes the decoders of everything a peer or a stranger can send before and after the
//! handshake: frame headers and handshake messages, and both sides of the handshake fed the
//! bytes. Run with `cargo +nightly fuzz run wire` from the repository root (CI runs the
//! proptest equivalents in `src/lib.rs`'s `fuzzing` module and `src/transport/handshake/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ferrogloo::fuzzing::wire(data));
