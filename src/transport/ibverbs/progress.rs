//! The ibverbs mesh's progress thread (completions handed to their links, lifelines read: busy
//! for a moment, then asleep on the completion channel and the lifelines) and the guard that
//! stops it and closes the links when the mesh is dropped.

use super::pair::{self, Link};
use super::reg::RegCache;
use super::verbs::{CompletionQueue, Wc};
use crate::transport::wake::{EventFd, poll_fds};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Stops the progress thread and closes the links when the mesh is dropped.
pub(super) struct Guard {
    pub(super) links: Vec<Option<Arc<Link>>>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) wake: Option<Arc<EventFd>>,
    pub(super) thread: Option<JoinHandle<()>>,
    pub(super) _cq: Arc<dyn CompletionQueue>,
    pub(super) regs: Arc<RegCache>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        for l in self.links.iter().flatten() {
            pair::close(l);
        }
        self.stop.store(true, Ordering::Release);
        if let Some(w) = &self.wake {
            w.signal();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Cached registrations of user buffers end with the last context that could use
        // them (the links hold the cache too: they go first); the next context registers
        // again.
        self.links.clear();
        if Arc::strong_count(&self.regs) <= 2 {
            self.regs.clear();
        }
    }
}

/// How often a busy progress thread looks at the lifelines.
pub(super) const LIFELINE_EVERY: Duration = Duration::from_millis(2);

/// Reads the lifelines `poll` found readable (`fds[i]` is peer `i`'s).
pub(super) fn read_lifelines(fds: &mut [libc::pollfd], links: &[Option<Arc<Link>>]) {
    for (fd, link) in fds.iter_mut().zip(links) {
        if fd.revents == 0 {
            continue;
        }
        fd.revents = 0;
        if let Some(l) = link {
            l.lifeline_readable();
            if l.is_failed() {
                fd.fd = -1; // its end was read: nothing more to watch
            }
        }
    }
}

/// How long the progress thread polls the completion queue before it sleeps.
pub(super) const SPIN: Duration = Duration::from_micros(50);

/// The progress thread: completions to their links, lifelines read, until stopped.
pub(super) fn progress(
    cq: &dyn CompletionQueue,
    links: &[Option<Arc<Link>>],
    stop: &AtomicBool,
    wake: Option<&EventFd>,
) {
    let mut wcs: Vec<Wc> = Vec::with_capacity(64);
    let dispatch = |wcs: &mut Vec<Wc>| {
        for wc in wcs.drain(..) {
            if let Some(Some(l)) = links.get(pair::wr_peer(wc.wr_id)) {
                l.completed(&wc);
            }
        }
    };
    // Descriptors: the completion channel, the wake-up, then each peer's lifeline.
    let mut fds: Vec<libc::pollfd> = [Some(cq.fd()), wake.map(EventFd::raw)]
        .into_iter()
        .chain(links.iter().map(|l| l.as_ref().map(|l| l.lifeline().as_raw_fd())))
        .map(|fd| libc::pollfd { fd: fd.unwrap_or(-1), events: libc::POLLIN, revents: 0 })
        .collect();
    let mut idle_since = Instant::now();
    let mut lifelines_seen = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if let Err(e) = cq.poll(&mut wcs, 64) {
            for l in links.iter().flatten() {
                l.fail_with(e.clone());
            }
            return;
        }
        if !wcs.is_empty() {
            dispatch(&mut wcs);
            idle_since = Instant::now();
            // Under steady traffic the completion queue is never idle: look at the
            // lifelines now and then anyway (aborts, a peer's end).
            if lifelines_seen.elapsed() >= LIFELINE_EVERY {
                lifelines_seen = Instant::now();
                if poll_fds(&mut fds[2..], Duration::ZERO).is_ok_and(|n| n > 0) {
                    // Completions first, as below: what a peer wrote before its lifeline
                    // ended is taken before the end fails the pair.
                    let _ = cq.poll(&mut wcs, usize::MAX);
                    dispatch(&mut wcs);
                    read_lifelines(&mut fds[2..], links);
                }
            }
            continue;
        }
        if idle_since.elapsed() < SPIN {
            std::thread::yield_now();
            continue;
        }
        // Arm, then look once more: a completion between the last poll and the arming
        // raised no event.
        if cq.arm().is_err() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = cq.poll(&mut wcs, 64);
        if !wcs.is_empty() {
            dispatch(&mut wcs);
            idle_since = Instant::now();
            continue;
        }
        if poll_fds(&mut fds, Duration::from_millis(200)).is_err() {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        if fds[0].revents != 0 {
            cq.ack();
        }
        if fds[1].revents != 0
            && let Some(w) = wake
        {
            w.drain();
        }
        // Completions first: what a peer wrote before its lifeline ended is taken before the
        // end fails the pair.
        let _ = cq.poll(&mut wcs, usize::MAX);
        dispatch(&mut wcs);
        read_lifelines(&mut fds[2..], links);
        lifelines_seen = Instant::now();
        idle_since = Instant::now();
    }
    // Completions still queued (reads that finished) reach their links, so that nothing
    // waits for them.
    let _ = cq.poll(&mut wcs, usize::MAX);
    dispatch(&mut wcs);
}
