//! Handles: the caller's side of a submitted collective.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::order::unsort;
use crate::submit_error::SubmitError;
use crate::tensor::Tensor;
use crate::vocab::{AlltoallOutput, Key};

/// What the engine hands back; each [`Handle`] converts it to its own output type.
#[derive(Debug)]
pub(crate) enum Output {
    Tensor(Tensor),
    Tensors(Vec<Tensor>),
    Alltoall(AlltoallOutput),
    Rank(usize),
    Unit,
    /// Something only the runtime knows the type of (a process set's transport).
    Detached(Box<dyn std::any::Any + Send>),
}

#[derive(Default)]
struct State {
    result: Option<Result<Output, SubmitError>>,
    done: bool,
    waker: Option<Waker>,
    /// A thread is blocked in `wait`: only then is the condvar signalled (a futex
    /// wake is a system call, and most handles are complete before anyone waits).
    waiting: bool,
    /// The op's names, kept from completion until the handle goes, so that their
    /// memory (allocated by the submitting thread) is freed on that thread rather than
    /// through the allocator's slower path for memory another thread allocated.
    names: Names,
}

#[derive(Default)]
struct Slot {
    state: Mutex<State>,
    ready: Condvar,
    /// `state.done`, readable without the lock: `wait` looks at it for a few
    /// microseconds before it sleeps on the condvar.
    done: AtomicBool,
}

/// How long `Handle::wait` yields the core and looks again before it sleeps: a small
/// op completes within this on one host, and sleeping would add a futex wake-up
/// (about 4 µs here) to its latency.
const WAIT_SPIN: Duration = Duration::from_micros(30);

impl Slot {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a waiter panicked; the state itself is consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The names a handle holds in the pending set: its key first, then any other tensor
/// names of its request.
pub(crate) type Names = smallvec::SmallVec<[Key; 1]>;

/// The set of names pending on this rank, from which a handle releases its names when
/// it completes. The engine's queue implements it (one lock guards the set and the
/// queue); handles know only this trait, not the engine.
pub(crate) trait PendingNames: Send + Sync + fmt::Debug {
    /// Releases the names of completed ops, under one lock for all of them.
    fn release_names(&self, names: &mut dyn Iterator<Item = &Names>);
}

/// The engine's side of a handle. Completing it (or dropping it, which completes it
/// with an "engine stopped" error) wakes the waiter. Its names are released from the
/// queue's pending set right before the handle completes, so that a caller may reuse
/// a name as soon as `wait` returns.
pub(crate) struct Completer {
    slot: Arc<Slot>,
    names: Names,
    /// The names were taken out of the pending set (or never went in).
    released: bool,
    pending: Arc<dyn PendingNames>,
    /// Dropped without completing (the engine stopped): the op and rank for the
    /// "engine stopped" error, built only then.
    on_drop: Option<(&'static str, usize)>,
    /// A group submitted in sorted order: the caller's order, restored on completion.
    order: Option<Box<[u32]>>,
}

impl fmt::Debug for Completer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("names", &self.names)
            .finish()
    }
}

impl Completer {
    /// The names this handle holds in the pending set, its key first.
    pub(crate) fn names(&self) -> &[Key] {
        &self.names
    }

    /// Forgets the handle without completing it or releasing its names: for a request
    /// the queue refused (its names were never claimed).
    pub(crate) fn disarm(mut self) {
        self.on_drop = None;
        self.released = true;
    }

    /// Makes the handle give a group's outputs (and any tensors an error hands back)
    /// in the caller's order: see `Submission::order`.
    pub(crate) fn set_order(&mut self, order: Option<Box<[u32]>>) {
        self.order = order;
    }

    /// Completes the handle with `result` (an error hands nothing back).
    pub(crate) fn complete(mut self, result: Result<Output>) {
        self.finish(result.map_err(SubmitError::from));
    }

    /// Fails an op that never ran: `tensors` (nothing of them was sent) go back to
    /// the caller with `error`.
    pub(crate) fn fail(mut self, error: Error, tensors: Vec<Tensor>) {
        self.finish(Err(SubmitError::new(error, tensors)));
    }

    /// Releases the names, stores `result` and wakes whoever waits.
    fn finish(&mut self, result: Result<Output, SubmitError>) {
        self.release_names();
        if let Some(slot) = self.store(result) {
            slot.ready.notify_all();
        }
    }

    /// Takes this handle's names out of the pending set.
    fn release_names(&mut self) {
        if !self.released {
            self.pending
                .release_names(&mut std::iter::once(&self.names));
            self.released = true;
        }
    }

    /// Puts `result` in the slot (the first result wins) and wakes an async waiter.
    /// Returns the slot when a thread is blocked on it and must be signalled.
    fn store(&mut self, result: Result<Output, SubmitError>) -> Option<Arc<Slot>> {
        self.on_drop = None;
        let result = match (self.order.take(), result) {
            (None, r) => r,
            (Some(order), Ok(Output::Tensors(ts))) => Ok(Output::Tensors(unsort(Some(&order), ts))),
            (Some(order), Err(e)) => Err(e.map_tensors(|ts| unsort(Some(&order), ts))),
            (Some(_), r) => r,
        };
        let mut state = self.slot.lock();
        if state.done {
            return None;
        }
        state.result = Some(result);
        state.done = true;
        state.names = std::mem::take(&mut self.names);
        let waker = state.waker.take();
        let waiting = state.waiting;
        drop(state);
        // Published only once the lock is free: a waiter that sees it then takes the
        // lock without contention. Set inside, a waiter spinning on it would block on
        // the lock while this thread still held it, and every unlock of a batch would
        // then be a futex wake-up (measured: 1000 completions 800 µs instead of 90).
        self.slot.done.store(true, Ordering::Release);
        if let Some(w) = waker {
            w.wake();
        }
        waiting.then(|| self.slot.clone())
    }
}

/// Completes a batch of handles (a fused collective's): handle `i` with `result(i)`
/// (`None`: no result, as if the engine stopped). The names of all of them are
/// released under one lock of the pending set, and blocked threads are signalled only
/// once every result is in place. A thread waiting on the batch's first handle then
/// wakes once and finds the rest complete, instead of being woken (and competing with
/// the engine for a core) once per handle. The results are made one at a time, not
/// gathered first: a batch of 1000 small tensors moved ~200 KB through a vector so.
pub(crate) fn complete_all(
    mut dones: Vec<Option<Completer>>,
    mut result: impl FnMut(usize) -> Option<Result<Output>>,
) {
    if let Some(pending) = dones.iter().flatten().next().map(|c| c.pending.clone()) {
        let mine = |c: &Completer| {
            !c.released && std::ptr::addr_eq(Arc::as_ptr(&c.pending), Arc::as_ptr(&pending))
        };
        pending.release_names(&mut dones.iter().flatten().filter(|c| mine(c)).map(|c| &c.names));
        for c in dones.iter_mut().flatten() {
            if mine(c) {
                c.released = true;
            }
        }
    }
    let mut wake = Vec::new();
    for (i, done) in dones.into_iter().enumerate() {
        let Some(mut c) = done else {
            continue;
        };
        match result(i) {
            Some(r) => {
                // Another Kolo's handle (never within one engine): released on its own.
                c.release_names();
                wake.extend(c.store(r.map_err(SubmitError::from)));
            }
            // Dropped: completes with the "engine stopped" error.
            None => drop(c),
        }
    }
    for slot in wake {
        slot.ready.notify_all();
    }
}

impl Completer {
    /// Fails an op the engine never took in (it stopped first), handing `tensors`
    /// back with the "engine stopped" error.
    pub(crate) fn abandon(mut self, tensors: Vec<Tensor>) {
        if let Some(err) = self.stopped_error() {
            self.finish(Err(SubmitError::new(err, tensors)));
        }
    }

    /// The error of a completer dropped without completing.
    fn stopped_error(&mut self) -> Option<Error> {
        let (op, rank) = self.on_drop.take()?;
        // `submit` puts the negotiation key first.
        let name = self
            .names
            .first()
            .map(|k| k.to_string())
            .unwrap_or_default();
        Some(Error::engine_stopped(
            op,
            name,
            rank,
            "the engine stopped before this op completed",
        ))
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if let Some(err) = self.stopped_error() {
            self.finish(Err(err.into()));
        }
    }
}

/// The pending result of a collective: poll it, block on it with [`Handle::wait`], or
/// `.await` it (it implements [`Future`]).
///
/// Dropping a handle does not cancel the collective: the other ranks still need this
/// rank's part, so it runs to completion and the result is discarded.
pub struct Handle<T> {
    slot: Arc<Slot>,
    convert: fn(Output) -> Result<T>,
    /// The engine this handle's op runs on, which `wait` may run itself.
    drive: Option<Arc<dyn Drive>>,
}

/// Lets a thread that waits for its handle run the engine's cycles itself while the
/// engine is idle (the engine's `Driver` implements it; handles know only this).
pub(crate) trait Drive: Send + Sync {
    /// Runs the engine on this thread until `done()` if it can take the engine within
    /// a few microseconds; otherwise makes sure the engine thread runs it.
    fn help(&self, done: &dyn Fn() -> bool);
}

impl<T> fmt::Debug for Handle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle")
            .field("ready", &self.poll())
            .finish()
    }
}

impl<T> Handle<T> {
    /// Whether the result is ready; never blocks.
    pub fn poll(&self) -> bool {
        self.slot.lock().done
    }

    /// Whether the result is ready, without taking the lock (the engine's driver
    /// asks between cycles).
    pub(crate) fn is_done(&self) -> bool {
        self.slot.done.load(Ordering::Acquire)
    }

    /// Lets `wait` run the engine `drive` on the waiting thread.
    pub(crate) fn driven_by(mut self, drive: Arc<dyn Drive>) -> Self {
        self.drive = Some(drive);
        self
    }

    /// Makes `wait` only wait, never run the engine on the waiting thread.
    pub(crate) fn undriven(mut self) -> Self {
        self.drive = None;
        self
    }

    /// Blocks until the collective has finished on this rank and returns its result.
    ///
    /// # Errors
    /// Whatever the collective failed with: a cross-rank mismatch, a rank that left,
    /// the engine stopping, … (the tensors of an op that never ran are dropped:
    /// [`wait_or_return`](Self::wait_or_return) hands them back).
    pub fn wait(self) -> Result<T> {
        self.wait_or_return().map_err(Error::from)
    }

    /// [`wait`](Self::wait), handing this rank's tensors back with the error when the
    /// op failed before any of its data was sent (a mismatch between ranks, a rank
    /// that left, a stall, the engine stopping), so that the caller can use them again.
    ///
    /// # Errors
    /// As [`wait`](Self::wait), with the tensors in the [`SubmitError`].
    pub fn wait_or_return(self) -> Result<T, SubmitError> {
        if let Some(d) = &self.drive {
            if !self.is_done() {
                d.help(&|| self.is_done());
            }
        }
        if !self.is_done() {
            let start = Instant::now();
            while !self.is_done() && start.elapsed() < WAIT_SPIN {
                std::thread::yield_now();
            }
        }
        let mut state = self.slot.lock();
        while !state.done {
            state.waiting = true;
            state = self
                .slot
                .ready
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let result = state.result.take();
        drop(state);
        self.take(result)
    }

    fn take(&self, result: Option<Result<Output, SubmitError>>) -> Result<T, SubmitError> {
        match result {
            Some(r) => r.and_then(|o| (self.convert)(o).map_err(SubmitError::from)),
            None => Err(Error::Internal("handle result taken twice".into()).into()),
        }
    }
}

impl<T> Future for Handle<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let mut state = self.slot.lock();
        if state.done {
            let result = state.result.take();
            drop(state);
            Poll::Ready(self.take(result).map_err(Error::from))
        } else {
            state.waker = Some(cx.waker().clone());
            Poll::Pending
        }
    }
}

/// The pending set of a handle no queue tracks.
#[derive(Debug)]
struct Untracked;

impl PendingNames for Untracked {
    fn release_names(&self, _: &mut dyn Iterator<Item = &Names>) {}
}

/// A handle and its completer outside the engine's queue: for an op that a helper
/// thread runs over the engine's own collectives (`ops::off_engine`). Its name is not
/// claimed: the collectives it runs claim their own.
pub(crate) fn untracked<T>(
    op: &'static str,
    rank: usize,
    convert: fn(Output) -> Result<T>,
) -> (Handle<T>, Completer) {
    pair(Names::new(), Arc::new(Untracked), (op, rank), convert)
}

/// Makes a connected handle and completer. `on_drop` (op, rank) names the error the handle gets if
/// the engine drops the completer without completing it.
pub(crate) fn pair<T>(
    names: Names,
    pending: Arc<dyn PendingNames>,
    on_drop: (&'static str, usize),
    convert: fn(Output) -> Result<T>,
) -> (Handle<T>, Completer) {
    let slot = Arc::new(Slot::default());
    (
        Handle {
            slot: slot.clone(),
            convert,
            drive: None,
        },
        Completer {
            slot,
            names,
            released: false,
            pending,
            on_drop: Some(on_drop),
            order: None,
        },
    )
}

fn mismatch(what: &str, got: &Output) -> Error {
    Error::Internal(format!("engine returned {got:?} where {what} was expected"))
}

pub(crate) fn to_tensor(o: Output) -> Result<Tensor> {
    match o {
        Output::Tensor(t) => Ok(t),
        other => Err(mismatch("a tensor", &other)),
    }
}

pub(crate) fn to_tensors(o: Output) -> Result<Vec<Tensor>> {
    match o {
        Output::Tensors(t) => Ok(t),
        other => Err(mismatch("tensors", &other)),
    }
}

pub(crate) fn to_alltoall(o: Output) -> Result<AlltoallOutput> {
    match o {
        Output::Alltoall(a) => Ok(a),
        other => Err(mismatch("an alltoall output", &other)),
    }
}

pub(crate) fn to_rank(o: Output) -> Result<usize> {
    match o {
        Output::Rank(r) => Ok(r),
        other => Err(mismatch("a rank", &other)),
    }
}

pub(crate) fn to_detached(o: Output) -> Result<Box<dyn std::any::Any + Send>> {
    match o {
        Output::Detached(d) => Ok(d),
        other => Err(mismatch("a detached value", &other)),
    }
}

pub(crate) fn to_unit(o: Output) -> Result<()> {
    match o {
        Output::Unit => Ok(()),
        other => Err(mismatch("nothing", &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::queue::Queue;

    #[test]
    fn completes_and_releases_names() {
        let pending: Arc<Queue> = Arc::default();
        pending.claim(&["a"]);
        let (h, c) = pair(
            smallvec::smallvec!["a".into()],
            pending.clone() as Arc<dyn PendingNames>,
            ("allreduce", 0),
            to_rank,
        );
        assert!(!h.poll());
        let t = std::thread::spawn(move || c.complete(Ok(Output::Rank(3))));
        assert_eq!(h.wait().unwrap(), 3);
        t.join().unwrap();
        assert!(!pending.is_pending("a"));
    }

    #[test]
    fn dropped_completer_fails_the_handle() {
        let (h, c) = pair(
            smallvec::smallvec!["w".into()],
            Arc::new(Queue::default()),
            ("broadcast", 2),
            to_unit,
        );
        drop(c);
        assert!(h.poll());
        assert_eq!(
            h.wait().unwrap_err().to_string(),
            "broadcast \"w\": the kolo engine on rank 2 is not running (the engine stopped before this op completed)"
        );
    }

    #[test]
    fn a_batch_releases_every_name_and_wakes_its_waiter_once_all_are_in() {
        let pending: Arc<Queue> = Arc::default();
        let names = ["a", "b", "c"];
        pending.claim(&names);
        let (handles, completers): (Vec<_>, Vec<_>) = names
            .iter()
            .map(|&n| {
                pair(
                    smallvec::smallvec![n.into()],
                    pending.clone() as Arc<dyn PendingNames>,
                    ("allreduce", 0),
                    to_rank,
                )
            })
            .unzip();
        let mut handles = handles.into_iter();
        let first = handles.next().unwrap();
        let waiter = std::thread::spawn(move || first.wait().unwrap());
        // Let the waiter block on the first handle.
        while !completers[0].slot.lock().waiting {
            std::thread::yield_now();
        }
        let dones = completers.into_iter().map(Some).collect();
        complete_all(dones, |i| Some(Ok(Output::Rank(i))));
        assert_eq!(waiter.join().unwrap(), 0);
        let rest: Vec<usize> = handles.map(|h| h.wait().unwrap()).collect();
        assert_eq!(rest, [1, 2]);
        assert!(names.iter().all(|n| !pending.is_pending(n)));
    }
}
