//! A submission's way back: the completion the background thread finishes, and the typed
//! [`Handle`] a user waits on (or gives a callback).

use super::tensor::Tensor;
use crate::error::{Error, Result};
use crate::sync::lock;
use crate::types::Element;
use std::any::Any;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// What a finished submission produced, before it is given its type.
pub(crate) enum Output {
    Tensor { payload: Box<dyn Payload>, shape: Vec<usize> },
    Unit,
    Rank(usize),
}

/// A tensor's storage, owned by the engine while the submission is in flight.
pub(crate) trait Payload: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
}

impl<T: Element> Payload for Vec<T> {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
}

type Callback = Box<dyn FnOnce(Result<Output>) + Send>;

/// What runs the engine's loop on a waiting caller's thread (`drive.rs`).
pub(crate) trait Drive: Send + Sync {
    /// Runs the engine's loop on this thread until `done` is finished (or, while another
    /// thread runs it, sleeps until it is this thread's turn).
    fn wait_for(&self, done: &Promise);
}

/// The completion of one submission.
pub(crate) struct Promise {
    state: Mutex<(Option<Result<Output>>, Option<Callback>)>,
    cond: Condvar,
    /// Threads asleep on `cond` (it is notified only when there are: a waiting caller that
    /// runs the engine itself is not asleep).
    sleepers: AtomicUsize,
}

impl Promise {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Promise { state: Mutex::new((None, None)), cond: Condvar::new(), sleepers: AtomicUsize::new(0) })
    }

    /// Finishes the submission (first outcome wins); runs its callback, if one is set, on
    /// this thread. Returns the callback's panic message, if it panicked.
    pub(crate) fn finish(&self, outcome: Result<Output>) -> Option<String> {
        let mut s = lock(&self.state);
        if s.0.is_some() {
            return None;
        }
        if let Some(cb) = s.1.take() {
            drop(s);
            return std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(outcome)))
                .err()
                .map(|p| panic_message(&*p));
        }
        s.0 = Some(outcome);
        drop(s);
        self.wake();
        None
    }

    /// Wakes the threads asleep on the outcome, if any (read after the outcome was set under
    /// the lock, which a sleeper holds while it counts itself and looks).
    fn wake(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.cond.notify_all();
        }
    }

    /// Finishes the submission (first outcome wins), except that a callback, if one is set,
    /// is not run here but returned with its outcome, to run on another thread.
    pub(crate) fn finish_deferring(&self, outcome: Result<Output>) -> Option<Deferred> {
        let mut s = lock(&self.state);
        if s.0.is_some() {
            return None;
        }
        if let Some(cb) = s.1.take() {
            return Some(Deferred { cb, outcome });
        }
        s.0 = Some(outcome);
        drop(s);
        self.wake();
        None
    }

    /// Finishes a completion whose callback cannot panic the engine (join, shutdown).
    pub(crate) fn done_with(&self, out: Result<Output>) {
        let _ = self.finish(out);
    }

    pub(crate) fn is_done(&self) -> bool {
        lock(&self.state).0.is_some()
    }
}

/// A finished submission's callback with its outcome, to run on the background thread (a
/// thread waiting for its own result does not run others' callbacks: they may block on what
/// it holds).
pub(crate) struct Deferred {
    cb: Callback,
    outcome: Result<Output>,
}

impl Deferred {
    /// Runs the callback; returns its panic message, if it panicked.
    pub(crate) fn run(self) -> Option<String> {
        let Deferred { cb, outcome } = self;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(outcome))).err().map(|p| panic_message(&*p))
    }
}

pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// The result of one submission, available once every rank has submitted the name and the
/// collective ran. Dropping a handle leaves the submission in flight (its result is dropped).
#[must_use = "a handle is how the result comes back"]
pub struct Handle<O> {
    pub(crate) done: Arc<Promise>,
    pub(crate) name: String,
    pub(crate) convert: fn(Output) -> Result<O>,
    /// The engine's loop, which a waiting caller runs itself (gone once the engine is).
    pub(crate) driver: Weak<dyn Drive>,
    pub(crate) _o: PhantomData<fn() -> O>,
}

impl<O: Send + 'static> Handle<O> {
    /// The name it was submitted under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the result is there (a [`wait`](Self::wait) would not block). This is the
    /// polling form.
    pub fn is_done(&self) -> bool {
        self.done.is_done()
    }

    /// Blocks until the result is there, running the engine on this thread meanwhile (its
    /// negotiation and collectives: see the [module documentation](crate::engine)). A name
    /// that other ranks never submit blocks until the stall shutdown, if one is configured;
    /// use [`wait_timeout`](Self::wait_timeout) for a deadline of your own.
    pub fn wait(self) -> Result<O> {
        self.wait_until(None)
    }

    /// Like [`wait`](Self::wait), but gives up after `timeout` with [`Error::Timeout`] naming
    /// the tensor (the submission stays in flight; its result is then dropped). This thread
    /// does not run the engine: the background thread does, so that the deadline holds.
    pub fn wait_timeout(self, timeout: Duration) -> Result<O> {
        self.wait_until(Instant::now().checked_add(timeout))
    }

    fn wait_until(self, deadline: Option<Instant>) -> Result<O> {
        // Only a wait with a deadline reports how long it waited.
        let start = deadline.map(|_| Instant::now());
        // Runs the engine on this thread until the result is there (caller runs; drive.rs).
        // Not with a deadline: a cycle, once begun, may outlast it.
        if deadline.is_none()
            && !self.done.is_done()
            && let Some(driver) = self.driver.upgrade()
        {
            driver.wait_for(&self.done);
        }
        let mut s = lock(&self.done.state);
        loop {
            if let Some(out) = s.0.take() {
                return out.and_then(self.convert);
            }
            match deadline {
                None => {
                    self.done.sleepers.fetch_add(1, Ordering::SeqCst);
                    s = crate::sync::wait(&self.done.cond, s);
                    self.done.sleepers.fetch_sub(1, Ordering::SeqCst);
                }
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::Timeout {
                            op: format!("engine: waiting for '{}'", self.name),
                            ranks: Vec::new(),
                            keys: Vec::new(),
                            waited: start.map_or(Duration::ZERO, |s| s.elapsed()),
                        });
                    }
                    self.done.sleepers.fetch_add(1, Ordering::SeqCst);
                    s = crate::sync::wait_timeout(&self.done.cond, s, d - now);
                    self.done.sleepers.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }

    /// The callback form: `f` gets the result on the engine's background thread once it is
    /// there (never on a thread waiting for another handle's result), or here and now, on the
    /// calling thread, if it already is. Keep it short: the engine's callbacks run one after
    /// another on that thread. A callback that panics fails the engine on every rank, with
    /// the panic as the cause (one run here panics here). With no thread waiting, the result
    /// comes at most one to two milliseconds after a waiting thread last ran the engine (the
    /// background thread then takes it back).
    pub fn then(self, f: impl FnOnce(Result<O>) + Send + 'static) {
        let convert = self.convert;
        let mut s = lock(&self.done.state);
        if let Some(out) = s.0.take() {
            drop(s);
            f(out.and_then(convert));
            return;
        }
        s.1 = Some(Box::new(move |out: Result<Output>| f(out.and_then(convert))));
    }
}

pub(crate) fn tensor_of<T: Element>(out: Output) -> Result<Tensor<T>> {
    match out {
        Output::Tensor { payload, shape } => match payload.into_any().downcast::<Vec<T>>() {
            Ok(data) => Ok(Tensor { data: *data, shape }),
            Err(_) => Err(Error::invalid("engine: a result of another element type (a bug)")),
        },
        _ => Err(Error::invalid("engine: a result of another kind (a bug)")),
    }
}

pub(crate) fn unit_of(out: Output) -> Result<()> {
    match out {
        Output::Unit => Ok(()),
        _ => Err(Error::invalid("engine: a result of another kind (a bug)")),
    }
}

pub(crate) fn rank_of(out: Output) -> Result<usize> {
    match out {
        Output::Rank(r) => Ok(r),
        _ => Err(Error::invalid("engine: a result of another kind (a bug)")),
    }
}
