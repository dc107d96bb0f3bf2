//! Fuzzes the decoders of everything a peer or a stranger can send before and after the
//! handshake: frame headers, hellos and acks. Run with `cargo +nightly fuzz run wire` from the
//! repository root (CI runs the proptest equivalents in `src/transport/tcp/`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ferrogloo::fuzzing::wire(data));
