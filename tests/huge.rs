//! A single message of several GiB (its own test binary, so nothing else runs beside it). Not
//! in the default `cargo test`, whose largest process stays under 4 GiB: `.ci/run` runs it as
//! a step of its own.

mod common;

use common::{all_ok, run_ranks_with};
use ferrogloo::device::TcpAttr;
use ferrogloo::rendezvous::HashStore;
use std::time::Duration;

/// 4.25 GiB: past the 2 GiB a single syscall moves and past `u32::MAX`.
const BYTES: usize = (4 << 30) + (1 << 28);

/// Fills `buf` with a position-dependent pattern quickly (memcpy doubling).
fn fill(buf: &mut [u8]) {
    let seed = 4096.min(buf.len());
    for (i, b) in buf[..seed].iter_mut().enumerate() {
        *b = (i.wrapping_mul(131) ^ (i >> 8)) as u8;
    }
    let mut done = seed;
    while done < buf.len() {
        let n = done.min(buf.len() - done);
        buf.copy_within(..n, done);
        done += n;
    }
    // Make every GiB distinct so a misplaced chunk cannot match.
    for (k, chunk) in buf.chunks_mut(1 << 30).enumerate() {
        chunk[0] = 0xA0 + k as u8;
    }
}

#[test]
#[ignore = "needs about 9 GiB of memory: .ci/run runs it on its own (cargo test --release --test huge -- --ignored)"]
fn a_message_of_several_gib_arrives_intact() {
    let store = HashStore::new();
    // One receive's deadline covers the whole transfer: size it for a slow debug build.
    let timeout = |b: ferrogloo::ContextBuilder| b.timeout(Duration::from_secs(180));
    let results = run_ranks_with(2, &store, &TcpAttr::loopback(), timeout, |ctx| {
        if ctx.rank() == 0 {
            let mut data = vec![0u8; BYTES];
            fill(&mut data);
            ctx.send(1, 1, &data)?;
            ctx.barrier()?;
        } else {
            let mut got = vec![0u8; BYTES];
            ctx.recv(0, 1, &mut got)?;
            ctx.barrier()?;
            let mut want = vec![0u8; BYTES];
            fill(&mut want);
            assert!(got == want, "payload differs");
        }
        Ok(())
    });
    all_ok(results);
}
