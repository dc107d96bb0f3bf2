//! Heartbeats between a context's ranks ([`ContextBuilder::heartbeat`]): failure detection
//! that does not wait for the next operation's deadline.
//!
//! A closed connection says at once that a peer died; a peer that is silent but connected (its
//! process stopped with SIGSTOP, its host frozen or cut off without the connection closing)
//! says nothing, and operations with it end only at their deadline. With heartbeats on, a
//! thread of each rank sends every peer a word every interval and watches what comes back: a
//! peer it has not heard from for [`MISSES`] intervals is taken for dead, and its connection is
//! closed: operations with it fail with [`Error::PeerSilent`] naming it. Closing is what makes the
//! suspicion fail-stop: every operation with the peer fails, [`Context::agree`] counts it
//! failed, and the peer, if it comes back, finds its connections closed and cannot go on in
//! the context (it must rejoin through [`Context::grow`]).
//!
//! The heartbeats go over the pairs like any message, in a group of their own, so a peer busy
//! sending one long message sends its heartbeat after it: choose an interval whose
//! [`MISSES`]-fold is longer than the longest message takes.
//!
//! [`ContextBuilder::heartbeat`]: crate::context::ContextBuilder::heartbeat
//! [`Context::agree`]: crate::Context::agree
//! [`Context::grow`]: crate::Context::grow

use super::{Comm, PersistentRecv, QUIET, fnv, wait_any};
use crate::error::Error;
use crate::transport::{ALL_GROUPS, AbortCause, group_id};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How many intervals a peer may stay silent before it is taken for dead.
pub const MISSES: u32 = 4;

/// Marks the heartbeats' group id apart from others.
const HEARTBEAT: u64 = 0x4845_4152_5442_0001;

/// A heartbeat's word, and the one that stops the thread (sent by this rank to itself).
const BEAT: u64 = 0x4245_4154;
const STOP: u64 = 0x5354_4f50;

/// The heartbeat thread of a mesh; stops it when dropped (when the last context over the
/// mesh goes).
pub(crate) struct Heartbeat {
    comm: Comm,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Heartbeat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeat").finish_non_exhaustive()
    }
}

impl Heartbeat {
    /// Starts heartbeats every `interval` among the members of `world` (the communicator of a
    /// freshly formed mesh).
    pub(crate) fn start(world: &Comm, interval: Duration) -> crate::Result<Arc<Heartbeat>> {
        let comm = world.sibling(group_id(fnv(&[world.group(), HEARTBEAT])));
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = Watcher::new(world.sibling(comm.group()), interval, stop.clone());
        let thread = std::thread::Builder::new()
            .name(format!("ferrogloo-heartbeat-{}", world.rank()))
            .spawn(move || watcher.run())
            .map_err(|e| Error::io("starting the heartbeat thread", e))?;
        Ok(Arc::new(Heartbeat { comm, stop, thread: Mutex::new(Some(thread)) }))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the thread from its wait (a message to itself), then wait for it.
        let me = self.comm.rank();
        let _ = self.comm.scope(|s| s.isend(me, 0, &[STOP])?.wait());
        let thread = self.thread.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// The heartbeat thread's state.
struct Watcher {
    comm: Comm,
    interval: Duration,
    stop: Arc<AtomicBool>,
}

impl Watcher {
    fn new(comm: Comm, interval: Duration, stop: Arc<AtomicBool>) -> Self {
        Watcher { comm, interval, stop }
    }

    fn run(self) {
        let (n, me) = (self.comm.size(), self.comm.rank());
        let mut recvs: Vec<PersistentRecv> =
            (0..n).map(|_| self.comm.persistent_recv(0, 8, QUIET, "heartbeat")).collect();
        let start = Instant::now();
        let mut heard = vec![start; n];
        // Peers still watched (this rank's own receive takes the stop word).
        let mut watched = vec![true; n];
        let mut next = start;
        while !self.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            if now >= next {
                next = now + self.interval;
                self.beat(&mut watched, next);
                let silent = self.interval * MISSES;
                for r in 0..n {
                    if r == me || !watched[r] {
                        continue;
                    }
                    let quiet = now.saturating_duration_since(heard[r]);
                    if quiet > silent {
                        watched[r] = false;
                        self.suspect(r, quiet);
                    }
                }
            }
            let mut mine: Vec<&mut PersistentRecv> = Vec::new();
            let mut from: Vec<[usize; 1]> = Vec::new();
            for (r, recv) in recvs.iter_mut().enumerate() {
                if watched[r] {
                    mine.push(recv);
                    from.push([r]);
                }
            }
            let from: Vec<&[usize]> = from.iter().map(|f| &f[..]).collect();
            if mine.is_empty() {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                continue;
            }
            match wait_any(&mut mine, &from, next) {
                None => {}
                Some((i, Ok(_))) => heard[from[i][0]] = Instant::now(),
                // Its connection failed: nothing more to watch there.
                Some((i, Err(_))) => watched[from[i][0]] = false,
            }
        }
    }

    /// Sends every watched peer a heartbeat, waiting at most until `until`; a peer whose send
    /// fails is no longer watched.
    fn beat(&self, watched: &mut [bool], until: Instant) {
        let me = self.comm.rank();
        let peers: Vec<usize> = (0..watched.len()).filter(|&r| r != me && watched[r]).collect();
        let outcomes = self.comm.scope(|s| {
            let posted: Vec<_> = peers.iter().map(|&r| (r, s.isend(r, 0, &[BEAT]))).collect();
            let left = || until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            Ok(posted.into_iter().map(|(r, q)| (r, q.and_then(|q| q.wait_timeout(left())))).collect::<Vec<_>>())
        });
        for (r, outcome) in outcomes.unwrap_or_default() {
            // A beat that waited behind a long message is dropped (silence decides); a failed
            // connection has nothing more to watch.
            if outcome.is_err_and(|e| !e.is_timeout()) {
                watched[r] = false;
            }
        }
    }

    /// Takes peer `r` for dead: closes its connection with the reason.
    fn suspect(&self, r: usize, quiet: Duration) {
        let rank = self.comm.world_rank(r).unwrap_or(r);
        let err = Error::PeerSilent { rank, silent: quiet, interval: self.interval };
        tracing::warn!(peer = rank, error = %err, "a peer is silent");
        if let Ok(p) = self.comm.pair(r) {
            p.abort(ALL_GROUPS, &err, &AbortCause::of(&err, self.comm.shared().world_rank));
        }
    }
}
