//! The queue from framework threads to the engine, together with the set of names
//! pending on this rank.
//!
//! One mutex guards both: a submit checks its names for duplicates, claims them and
//! queues its request under one lock, and the engine takes every queued command at
//! once by swapping buffers, so that a steady stream of submits costs one lock each
//! (and the request's box: see `Command`). The engine sleeps on the condvar only when
//! it has nothing to do; a command signals it only then.

use rustc_hash::FxHashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::request::{Command, Key, Request};
use crate::handle::{Names, PendingNames};

/// What ended a wait for work ([`Queue::wait_for_work`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Woke {
    TimedOut,
    /// A command was queued.
    Command,
    /// A kick, or the queue was closed.
    Kicked,
}

/// Why a submit was not queued.
#[derive(Debug)]
pub(crate) enum Refused {
    /// This name is already pending on this rank; the request is handed back.
    Duplicate(Key, Box<Request>),
    /// The engine is shutting down or gone; the request is handed back.
    Closed(Box<Request>),
}

#[derive(Debug, Default)]
struct State {
    commands: Vec<Command>,
    /// Names of submitted ops whose handles have not completed yet.
    names: FxHashSet<Key>,
    /// Threads blocked waiting for a command: the engine thread, and a caller driving
    /// the engine while it paces its cycles (`Driver`).
    waiters: u32,
    /// Set by [`Queue::kick`]: a waiter returns although no command is queued (a
    /// caller stopped driving with work left for the engine thread).
    kicked: bool,
    /// Shutdown was requested: no command is taken any more.
    closed: bool,
    /// The engine thread waits for a kick only ([`Queue::wait_for_kick`]).
    awaiting_kick: bool,
    /// A send or receive is queued: it ends such a wait too (its peer may be waiting
    /// for it, and its caller may not wait soon).
    urgent: bool,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    state: Mutex<State>,
    arrived: Condvar,
    /// Signalled by a kick or the close, not by commands: see [`Queue::wait_for_kick`].
    kicks: Condvar,
    /// Set whenever a command is queued, cleared when the engine takes them: lets the
    /// engine look for work without taking the lock.
    queued: AtomicBool,
}

impl PendingNames for Queue {
    fn release_names(&self, names: &mut dyn Iterator<Item = &Names>) {
        self.release(names);
    }
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the state half-changed.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims the request's names and queues it, unless a name is pending already or
    /// the queue is closed; wakes the engine thread if it sleeps.
    #[cfg(test)]
    pub(crate) fn submit(&self, request: Request) -> Result<(), Refused> {
        self.submit_waking(Box::new(request), true)
    }

    /// `submit` (a test's), waking a sleeping engine thread only if `wake`: a
    /// caller that is about to drive the engine itself does not wake it (and must
    /// [`kick`](Self::kick) it when it cannot drive after all).
    pub(crate) fn submit_waking(&self, request: Box<Request>, wake: bool) -> Result<(), Refused> {
        let mut state = self.lock();
        if state.closed {
            return Err(Refused::Closed(request));
        }
        let names = request.done.names();
        if let Some(dup) = names.iter().find(|n| state.names.contains(*n)) {
            let dup = dup.clone();
            return Err(Refused::Duplicate(dup, request));
        }
        state.names.extend(names.iter().cloned());
        if request.meta.kind.is_p2p() {
            state.urgent = true;
            self.end_kick_wait(&state);
        }
        state.commands.push(Command::Submit(request));
        if wake {
            self.signal(state);
        }
        // Else not even the `queued` flag: an engine thread spinning on it would take
        // the op from the caller about to run it.
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
            self.end_kick_wait(&state);
            self.signal(state);
        }
    }

    /// When the engine thread ends, however it ends: refuses everything from now on
    /// and drops what is still queued, which fails those handles ("engine stopped")
    /// instead of leaving their threads waiting.
    pub(crate) fn abandon(&self) {
        let left = {
            let mut state = self.lock();
            state.closed = true;
            std::mem::take(&mut state.commands)
        };
        // Failed outside the lock: a handle releases its names through it. Each
        // request's tensors go back to its caller with the error.
        for cmd in left {
            if let Command::Submit(req) = cmd {
                req.done.abandon(req.tensors.into_vec());
            }
        }
    }

    fn signal(&self, state: MutexGuard<'_, State>) {
        self.queued.store(true, Ordering::Release);
        let waiters = state.waiters;
        drop(state);
        match waiters {
            0 => {}
            1 => self.arrived.notify_one(),
            // The engine thread and a driving caller: either may be the one to run it.
            _ => self.arrived.notify_all(),
        }
    }

    /// Wakes whoever waits for a command although none is queued: the engine thread
    /// then looks at the engine (a caller left work there, or ended it).
    pub(crate) fn kick(&self) {
        let mut state = self.lock();
        state.kicked = true;
        self.end_kick_wait(&state);
        self.signal(state);
    }

    /// Wakes the engine thread from [`wait_for_kick`](Self::wait_for_kick), if it is
    /// there (the caller changed what ends that wait).
    fn end_kick_wait(&self, state: &State) {
        if state.awaiting_kick {
            self.kicks.notify_all();
        }
    }

    /// Waits up to `timeout` until the queue is kicked or closed, or a send or receive
    /// is queued; other commands arriving meanwhile do not end the wait (nor signal
    /// it). False when the time ran out.
    pub(crate) fn wait_for_kick(&self, timeout: Duration) -> bool {
        let mut state = self.lock();
        let waiting = |s: &mut State| !s.kicked && !s.closed && !s.urgent;
        if waiting(&mut state) {
            state.awaiting_kick = true;
            state = self
                .kicks
                .wait_timeout_while(state, timeout, waiting)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.awaiting_kick = false;
        }
        !waiting(&mut state)
    }

    /// Waits up to `timeout` until a command is queued, the queue is closed or it is
    /// [kicked](Self::kick), without taking anything. False when the time ran out.
    pub(crate) fn wait_for_command(&self, timeout: Duration) -> bool {
        self.wait_for_work(timeout) != Woke::TimedOut
    }

    /// [`wait_for_command`](Self::wait_for_command), saying what ended the wait.
    pub(crate) fn wait_for_work(&self, timeout: Duration) -> Woke {
        let mut state = self.lock();
        let idle = |s: &mut State| s.commands.is_empty() && !s.closed && !s.kicked;
        if idle(&mut state) && !timeout.is_zero() {
            state.waiters += 1;
            state = self
                .arrived
                .wait_timeout_while(state, timeout, idle)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.waiters -= 1;
        }
        let woke = if state.kicked || state.closed {
            Woke::Kicked
        } else if state.commands.is_empty() {
            Woke::TimedOut
        } else {
            Woke::Command
        };
        state.kicked = false;
        woke
    }

    /// The engine's side: moves every queued command into `into` (which should be
    /// empty; its buffer is swapped in, so no allocation happens in steady state).
    /// When none is queued, waits up to `timeout` (`None`: until one arrives or the
    /// queue is closed).
    pub(crate) fn take(&self, into: &mut Vec<Command>, timeout: Option<Duration>) {
        let mut state = self.lock();
        let idle = |s: &mut State| s.commands.is_empty() && !s.closed;
        if idle(&mut state) && timeout != Some(Duration::ZERO) {
            state.waiters += 1;
            state = match timeout {
                Some(t) => {
                    self.arrived
                        .wait_timeout_while(state, t, idle)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                None => self
                    .arrived
                    .wait_while(state, idle)
                    .unwrap_or_else(PoisonError::into_inner),
            };
            state.waiters -= 1;
        }
        self.queued.store(false, Ordering::Relaxed);
        state.urgent = false;
        std::mem::swap(&mut state.commands, into);
    }

    /// Whether a command was flagged as queued (or a kick came) since the engine last
    /// took them, without the lock. A submit that did not wake the engine is not
    /// flagged until its caller kicks, which it does when it cannot drive the engine
    /// itself (`Driver::help`); a driving caller therefore takes the lock once first.
    pub(crate) fn flagged(&self) -> bool {
        self.queued.load(Ordering::Acquire)
    }

    /// Looks for a queued command for up to `spin`, yielding the core between looks;
    /// true as soon as one is queued. Cheaper than sleeping on the condvar when work is
    /// expected within microseconds (the submitter then skips the futex wake).
    pub(crate) fn spin_for_command(&self, spin: Duration) -> bool {
        let start = Instant::now();
        loop {
            if self.queued.load(Ordering::Acquire) {
                return true;
            }
            if start.elapsed() >= spin {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Whether shutdown was requested (or the engine ended).
    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Releases names of completed ops, under one lock for all of them.
    pub(crate) fn release<'a>(&self, names: impl IntoIterator<Item = &'a Names>) {
        let mut state = self.lock();
        for list in names {
            for n in list {
                state.names.remove(&**n);
            }
        }
    }

    /// Claims `key` for an op that never went through the queue (a send or receive
    /// run on the caller's thread that must wait after all); false when it is pending
    /// already.
    pub(crate) fn claim_key(&self, key: &Key) -> bool {
        self.lock().names.insert(key.clone())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::request::{OpKind, RequestMeta};
    use crate::handle::{self, Handle};
    use crate::tensor::DType;
    use crate::vocab::ReduceOp;
    use std::sync::Arc;

    fn request(queue: &Arc<Queue>, name: &str) -> (Request, Handle<usize>) {
        let meta = RequestMeta::for_test(name, OpKind::Allreduce, DType::F32, &[1], ReduceOp::Sum);
        let names = smallvec::smallvec![meta.key.clone()];
        let (h, done) = handle::pair(names, queue.clone(), ("allreduce", 0), handle::to_rank);
        let req = Request {
            meta,
            tensors: Default::default(),
            done,
            submitted: std::time::Instant::now(),
        };
        (req, h)
    }

    #[test]
    fn claims_names_refuses_duplicates_and_hands_everything_over_at_once() {
        let q = Arc::new(Queue::default());
        let (a, ha) = request(&q, "a");
        q.submit(a).unwrap();
        let (again, _h) = request(&q, "a");
        match q.submit(again) {
            Err(Refused::Duplicate(name, req)) => {
                assert_eq!(&*name, "a");
                req.done.disarm();
            }
            other => panic!("expected a duplicate, got {other:?}"),
        }
        // The refused request released nothing: "a" is still pending.
        assert!(q.is_pending("a"));
        let (b, hb) = request(&q, "b");
        q.submit(b).unwrap();
        let mut taken = Vec::new();
        q.take(&mut taken, Some(Duration::ZERO));
        assert_eq!(taken.len(), 2);
        let mut completers = taken.into_iter().map(|c| match c {
            Command::Submit(r) => r.done,
            _ => panic!("expected submits"),
        });
        completers
            .next()
            .unwrap()
            .complete(Ok(handle::Output::Rank(1)));
        assert!(!q.is_pending("a") && q.is_pending("b"));
        assert_eq!(ha.wait().unwrap(), 1);
        completers
            .next()
            .unwrap()
            .complete(Ok(handle::Output::Rank(2)));
        assert_eq!(hb.wait().unwrap(), 2);
    }

    #[test]
    fn closed_queue_refuses_and_wakes_the_engine() {
        let q = Arc::new(Queue::default());
        let engine = {
            let q = q.clone();
            std::thread::spawn(move || {
                let mut taken = Vec::new();
                q.take(&mut taken, None);
                taken.len()
            })
        };
        q.close();
        assert_eq!(engine.join().unwrap(), 1);
        let (r, _h) = request(&q, "late");
        match q.submit(r) {
            Err(Refused::Closed(req)) => req.done.disarm(),
            other => panic!("expected closed, got {other:?}"),
        }
        assert!(!q.is_pending("late"));
        assert!(!q.push(Command::Shutdown));
    }

    #[test]
    fn waiting_for_a_command_ends_once_closed_even_with_none_left() {
        let q = Arc::new(Queue::default());
        q.close();
        let mut taken = Vec::new();
        // The engine took the shutdown command earlier, then waits again.
        q.take(&mut taken, None);
        assert_eq!(taken.len(), 1);
        taken.clear();
        q.take(&mut taken, None);
        assert!(taken.is_empty() && q.is_closed());
    }

    #[test]
    fn abandoned_queue_fails_what_it_still_holds() {
        let q = Arc::new(Queue::default());
        let (r, h) = request(&q, "queued");
        q.submit(r).unwrap();
        q.abandon();
        let err = h.wait().unwrap_err().to_string();
        assert!(err.contains("engine stopped"), "{err}");
        assert!(!q.is_pending("queued"));
        let (r, _h) = request(&q, "late");
        assert!(matches!(q.submit(r), Err(Refused::Closed(_))));
    }
}
