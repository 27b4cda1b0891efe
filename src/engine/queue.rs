//! The queue from framework threads to the engine, together with the set of names
//! pending on this rank.
//!
//! One mutex guards both: a submit checks its names for duplicates, claims them and
//! queues its request under one lock, and the engine takes every queued command at
//! once by swapping buffers, so that a steady stream of submits allocates nothing
//! here and costs one uncontended lock each.
//!
//! The engine sleeps on the condvar in two ways. Idle (nothing to do), any command
//! wakes it. Batching (it has new requests and waits up to the cycle time for more,
//! so that a burst of submits becomes one cycle), only a *flush* wakes it: a thread
//! that blocks on a handle (or polls a pending future) says that it submits nothing
//! more for now, so there is no point in waiting longer.

use rustc_hash::FxHashSet;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::request::{Command, Key, Request};
use crate::handle::Names;

/// Why a submit was not queued.
#[derive(Debug)]
pub(crate) enum Refused {
    /// This name is already pending on this rank; the request is handed back.
    Duplicate(Key, Box<Request>),
    /// The engine is shutting down or gone; the request is handed back.
    Closed(Box<Request>),
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Sleep {
    /// Not sleeping: nobody needs to signal.
    #[default]
    Awake,
    /// Waiting for any command.
    Idle,
    /// Waiting for a flush (or its deadline).
    Batching,
}

#[derive(Debug, Default)]
struct State {
    commands: Vec<Command>,
    /// Names of submitted ops whose handles have not completed yet.
    names: FxHashSet<Key>,
    /// How the engine is sleeping, if it is.
    engine: Sleep,
    /// A thread waits for a result: the engine should not wait to batch more.
    flush: bool,
    /// Shutdown was requested: no command is taken any more.
    closed: bool,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    state: Mutex<State>,
    arrived: Condvar,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the state half-changed.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `names` and queues `request`, unless a name is pending already or the
    /// queue is closed.
    pub(crate) fn submit(&self, request: Request) -> Result<(), Refused> {
        let mut state = self.lock();
        if state.closed {
            return Err(Refused::Closed(Box::new(request)));
        }
        let names = request.done.names();
        if let Some(dup) = names.iter().find(|n| state.names.contains(*n)) {
            let dup = dup.clone();
            return Err(Refused::Duplicate(dup, Box::new(request)));
        }
        state.names.extend(names.iter().cloned());
        state.commands.push(Command::Submit(request));
        self.signal(state);
        Ok(())
    }

    /// Queues a command that claims no names; false if the queue is closed.
    pub(crate) fn push(&self, command: Command) -> bool {
        let mut state = self.lock();
        if state.closed {
            return false;
        }
        state.commands.push(command);
        self.signal(state);
        true
    }

    /// Queues the shutdown command (once) and refuses everything after it.
    pub(crate) fn close(&self) {
        let mut state = self.lock();
        if !state.closed {
            state.closed = true;
            state.commands.push(Command::Shutdown);
            // Also out of a batching wait: nothing more is coming.
            let sleeping = state.engine != Sleep::Awake;
            drop(state);
            if sleeping {
                self.arrived.notify_one();
            }
        }
    }

    fn signal(&self, state: MutexGuard<'_, State>) {
        let idle = state.engine == Sleep::Idle;
        drop(state);
        if idle {
            self.arrived.notify_one();
        }
    }

    /// A thread is about to block on a result: the engine should run what it has
    /// instead of waiting for more.
    pub(crate) fn flush(&self) {
        let mut state = self.lock();
        state.flush = true;
        let batching = state.engine == Sleep::Batching;
        drop(state);
        if batching {
            self.arrived.notify_one();
        }
    }

    /// The engine's side: with new requests in hand, waits until a thread flushes,
    /// shutdown is requested or `deadline` passes, then takes every queued command
    /// into `into` (which should be empty). Clears the flush.
    pub(crate) fn take_batching(&self, into: &mut Vec<Command>, deadline: Instant) {
        let mut state = self.lock();
        loop {
            let now = Instant::now();
            if state.flush || state.closed || now >= deadline {
                break;
            }
            state.engine = Sleep::Batching;
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.engine = Sleep::Awake;
        }
        state.flush = false;
        std::mem::swap(&mut state.commands, into);
    }

    /// The engine's side: moves every queued command into `into` (which should be
    /// empty; its buffer is swapped in, so no allocation happens in steady state).
    /// When none is queued, waits up to `timeout` (`None`: until one arrives).
    pub(crate) fn take(&self, into: &mut Vec<Command>, timeout: Option<Duration>) {
        let mut state = self.lock();
        if state.commands.is_empty() {
            match timeout {
                Some(t) if t.is_zero() => {}
                Some(t) => {
                    state.engine = Sleep::Idle;
                    state = self
                        .arrived
                        .wait_timeout_while(state, t, |s| s.commands.is_empty())
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    state.engine = Sleep::Awake;
                }
                None => {
                    state.engine = Sleep::Idle;
                    state = self
                        .arrived
                        .wait_while(state, |s| s.commands.is_empty())
                        .unwrap_or_else(PoisonError::into_inner);
                    state.engine = Sleep::Awake;
                }
            }
        }
        std::mem::swap(&mut state.commands, into);
    }

    /// Releases names of completed ops, under one lock for all of them.
    pub(crate) fn release<'a>(&self, names: impl IntoIterator<Item = &'a mut Names>) {
        let mut state = self.lock();
        for list in names {
            for n in list.drain(..) {
                state.names.remove(&*n);
            }
        }
    }

    /// Claims names without queueing anything (for tests).
    #[cfg(test)]
    pub(crate) fn claim(&self, names: &[&str]) {
        self.lock()
            .names
            .extend(names.iter().map(|&n| Key::from(n)));
    }

    /// Whether `name` is pending (for tests).
    #[cfg(test)]
    pub(crate) fn is_pending(&self, name: &str) -> bool {
        self.lock().names.contains(name)
    }
}
