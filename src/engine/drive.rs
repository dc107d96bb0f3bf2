//! Who runs the engine's loop (`background.rs`): one thread at a time holds it. A caller
//! waiting on a [`Handle`](super::Handle) with no deadline runs it itself ("caller runs"), so
//! that a result does not cross threads: its submission was taken, negotiated, run and
//! finished on the thread that waits for it. The background thread runs it when nobody waits:
//! for peers' cycles while this rank's callers are elsewhere, for handles never waited on or
//! waited on with a deadline (a cycle, once begun, could outlast it). Callbacks always run on
//! the background thread: a caller that finishes others' submissions hands their callbacks
//! over (they might block on what the caller holds), and one that panics fails the engine.
//!
//! The hand-over, measured on a 2-core machine (README, engine table): a waiter that spun
//! while the background thread ran its submission took the core that thread needed and made a
//! warm 4 KiB submission slower (6.9 → 16.5 µs); a waiter that sleeps pays two thread wake-ups
//! per submission. Running the loop on the waiting thread pays neither.
//!
//! - A caller comes to wait: it counts itself in [`EngineState::waiting`] and interrupts the
//!   background thread's idle wait; the background thread lets go of the loop and sleeps. The
//!   caller takes the loop (or, while another thread holds it, sleeps until the holder lets go
//!   or finishes something), drives until its result is there, and lets go.
//! - After the last caller left, the background thread stays away for [`LINGER`]: a thread
//!   that submits and waits in a loop finds the loop free at its next wait, with no hand-over.
//!   Then it takes the loop back (peers' messages wait in the transport meanwhile). While
//!   callers come and go it looks every [`LINGER`] (one to two of them after the last caller
//!   left, it has the loop), and a caller that leaves wakes nobody; while one caller stays (a
//!   long cycle), it sleeps until that caller leaves, which then wakes it.
//! - Submissions wake the loop's holder only while it waits for messages
//!   ([`EngineState::on_inbox`]); a caller about to wait needs no wake-up.

use super::background::{Core, Mode};
use super::handle::{Deferred, Drive, Promise};
use super::shared::EngineState;
use crate::Context;
use crate::comm::Interrupter;
use crate::error::Error;
use crate::sync::{lock, wait_timeout};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

/// How long the background thread leaves the loop alone after a caller let go of it.
pub(crate) const LINGER: Duration = Duration::from_millis(1);

/// How long a caller waiting for its turn sleeps before it looks again (a safety net: it is
/// woken when the loop is let go or a cycle finished something).
const TURN_SLICE: Duration = Duration::from_millis(250);

/// The engine's loop and what decides who runs it.
pub(crate) struct Driver {
    /// `None` once the engine ended (every submission was finished with its cause).
    core: Mutex<Option<Core>>,
    sh: Arc<EngineState>,
    ctx: Arc<Context>,
    /// Ends the background thread's idle wait when a caller comes to wait.
    interrupter: Interrupter,
    /// The background thread's sleep between turns.
    bg: Mutex<Background>,
    bg_wake: Condvar,
}

#[derive(Default)]
struct Background {
    /// When a caller last let go of the loop.
    last_left: Option<Instant>,
    /// Take the loop now (the engine is being stopped).
    kick: bool,
    /// The background thread sleeps until a caller leaves (a caller that leaves wakes it).
    sleeping: bool,
    /// `last_left` when the background thread last looked while a caller drove.
    seen_left: Option<Instant>,
    /// Callbacks of submissions that a caller's driving finished, for this thread to run.
    callbacks: Vec<(String, Deferred)>,
}

impl Driver {
    pub(crate) fn new(core: Core, sh: Arc<EngineState>) -> Arc<Driver> {
        Arc::new(Driver {
            interrupter: core.interrupter(),
            ctx: core.context().clone(),
            core: Mutex::new(Some(core)),
            sh,
            bg: Mutex::new(Background::default()),
            bg_wake: Condvar::new(),
        })
    }

    /// The background thread's body: runs the loop whenever no caller does, until the engine
    /// ended.
    pub(crate) fn background(&self) {
        loop {
            self.run_callbacks();
            self.linger();
            if !lock(&self.bg).callbacks.is_empty() {
                continue;
            }
            let seen = self.generation();
            match try_lock(&self.core) {
                Some(mut core) => {
                    let ended = self.run(&mut core, &Mode::Background);
                    drop(core);
                    self.sh.changed();
                    if ended {
                        self.run_callbacks();
                        return;
                    }
                }
                None => self.sleep_for_turn(seen, None, Some(Instant::now() + LINGER)),
            }
        }
    }

    /// Makes the background thread take the loop at once (stopping the engine).
    pub(crate) fn kick(&self) {
        lock(&self.bg).kick = true;
        self.bg_wake.notify_all();
        self.interrupter.interrupt();
    }

    /// Until it is the background thread's turn: no caller waits, and none let go of the loop
    /// within [`LINGER`] (or the engine is being stopped).
    fn linger(&self) {
        let mut bg = lock(&self.bg);
        loop {
            if std::mem::take(&mut bg.kick) || !bg.callbacks.is_empty() {
                return;
            }
            // Read under the lock a leaving caller takes to wake this thread.
            let waiting = self.sh.waiting.load(Ordering::SeqCst) > 0;
            let since = bg.last_left.map(|t| t.elapsed());
            if waiting {
                if bg.seen_left == bg.last_left {
                    // Nobody left since the last look: a caller drives a long cycle (a large
                    // batch). Sleep until it leaves, without looks that would take a core from
                    // the collective every linger (ResNet-50's step on 2 ranks and 2 cores:
                    // 2-3 ms of 30).
                    bg.sleeping = true;
                    bg = crate::sync::wait(&self.bg_wake, bg);
                    bg.sleeping = false;
                } else {
                    // Callers come and go (a thread that submits and waits in a loop): look
                    // again a linger later, and let them leave without waking this thread (a
                    // wake-up on every submit-and-wait would cost each a system call and, on a
                    // crowded core, its turn on it).
                    bg.seen_left = bg.last_left;
                    bg = wait_timeout(&self.bg_wake, bg, LINGER);
                }
                continue;
            }
            match since {
                Some(s) if s < LINGER => bg = wait_timeout(&self.bg_wake, bg, LINGER - s),
                _ => return,
            }
        }
    }

    /// Runs the loop as `mode` says; when it ends the engine (shut down, failed, panicked),
    /// finishes everything with the cause and returns `true`. Callbacks a caller's driving
    /// kept go to the background thread.
    fn run(&self, core: &mut Option<Core>, mode: &Mode<'_>) -> bool {
        let Some(c) = core.as_mut() else { return true };
        let driven = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.drive(mode)));
        let mut callbacks = c.take_deferred();
        let end = match driven {
            Ok(Ok(None)) => None,
            Ok(Ok(Some(by))) => Some(Ok(Ok(by))),
            Ok(Err(e)) => Some(Ok(Err(e))),
            Err(p) => Some(Err(p)),
        };
        let ended = end.is_some();
        if let (Some(end), Some(c)) = (end, ended.then(|| core.take()).flatten()) {
            callbacks.extend(c.end(end));
        }
        if !callbacks.is_empty() {
            lock(&self.bg).callbacks.extend(callbacks);
            self.bg_wake.notify_all();
        }
        ended
    }

    /// Runs the callbacks a caller's driving kept (on the background thread, holding nothing).
    /// One that panics fails the engine on every rank with the panic as the cause.
    fn run_callbacks(&self) {
        let ready = std::mem::take(&mut lock(&self.bg).callbacks);
        for (name, cb) in ready {
            if let Some(msg) = cb.run() {
                let me = self.ctx.world_rank(self.ctx.rank()).unwrap_or(self.ctx.rank());
                let e = Error::Aborted {
                    rank: me,
                    reason: format!("a completion callback of '{name}' panicked on rank {me}: {msg}"),
                };
                {
                    let mut f = lock(&self.sh.failed);
                    if f.is_none() {
                        *f = Some(e.clone());
                    }
                }
                // Every wait on the context fails with the cause: the loop's holder ends the
                // engine (this thread, if nobody else holds it).
                self.ctx.comm().fail(&e);
            }
        }
    }

    /// The turn's generation now (read before trying the loop's lock, so that a let-go
    /// between the try and the sleep is not missed).
    fn generation(&self) -> u64 {
        lock(&self.sh.turn).generation
    }

    /// Sleeps until the loop is let go or a cycle finished something since the turn's
    /// generation was `generation` (or `done` is finished, or `until`).
    fn sleep_for_turn(&self, generation: u64, done: Option<&Promise>, until: Option<Instant>) {
        let mut t = lock(&self.sh.turn);
        t.sleepers += 1;
        while t.generation == generation && !done.is_some_and(|d| d.is_done()) {
            let left = until.map_or(TURN_SLICE, |u| u.saturating_duration_since(Instant::now()).min(TURN_SLICE));
            if left.is_zero() {
                break;
            }
            t = wait_timeout(&self.sh.turn_changed, t, left);
            if until.is_none() {
                break; // a slice: look again
            }
        }
        t.sleepers -= 1;
    }
}

impl Drive for Driver {
    fn wait_for(&self, done: &Promise) {
        self.sh.waiting.fetch_add(1, Ordering::SeqCst);
        // The background thread lets go of its idle wait (it sees `waiting`, or is interrupted),
        // and of a wait for a burst that this caller's submission began (`Core::batch`).
        self.interrupter.interrupt();
        if lock(&self.sh.queue).batching {
            self.sh.arrived.notify_all();
        }
        while !done.is_done() {
            let seen = self.generation();
            match try_lock(&self.core) {
                Some(mut core) => {
                    if core.is_none() {
                        break; // ended: `done` was finished with the cause
                    }
                    self.run(&mut core, &Mode::Caller { done });
                    drop(core);
                    self.sh.changed();
                }
                None => self.sleep_for_turn(seen, Some(done), None),
            }
        }
        // Set before the count drops, under the lock the background thread reads them with:
        // it sees no caller only with this one's time of leaving.
        let mut bg = lock(&self.bg);
        bg.last_left = Some(Instant::now());
        // Only a background thread that sleeps until a caller leaves is woken.
        if self.sh.waiting.fetch_sub(1, Ordering::SeqCst) == 1 && bg.sleeping {
            drop(bg);
            self.bg_wake.notify_all();
        }
    }
}

/// `m` locked if nobody holds it (poison ignored: the loop's holder catches panics).
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}
