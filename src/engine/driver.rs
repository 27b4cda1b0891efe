//! Who runs the engine's cycles: its own thread, or a caller that waits while the
//! engine is idle (leader/follower).
//!
//! The engine lives behind one lock. Its thread takes the lock to gather work and run
//! a cycle, and lets go of it while it sleeps. A thread that blocks on its own op (a
//! builder's `.wait()`, a barrier, a join) queues the op without waking the engine
//! thread and, when the lock is free, runs the cycles itself until its op completes:
//! no hand-off to another thread and back, so a small op costs about what its messages
//! cost. Whoever holds the lock is the only thread that calls the transport, as
//! before; negotiation, fusion, the cache and the cycle agreement are the same code
//! whichever thread runs them.
//!
//! A caller does not drive when the lock is taken (the engine thread or another
//! caller is running a cycle: its op goes into theirs), once the engine has ended
//! (a rank left, a stall, shutdown: the engine thread serves those), when the
//! transport may not be called from another thread (MPI below
//! `MPI_THREAD_SERIALIZED`), or once a request on a device has been taken in (CUDA
//! and NCCL calls, opening the communicator first, stay on the engine thread). It
//! then waits for its handle as any other.
//!
//! A blocking send or receive goes further ([`Driver::send_now`],
//! [`Driver::recv_now`]): while the engine is idle it is not even queued. The caller
//! posts it on the engine's point-to-point lane and polls for it, and gets a handle
//! only if it must wait longer than a spin (README, "When a cycle starts").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::p2p::P2pLane;
use super::queue::{Queue, Woke};
use super::{End, Engine, Sleep};
use crate::error::Result;
use crate::handle::{Completer, Drive};
use crate::tensor::Tensor;

/// The engine, shared by its thread and the callers that drive it; see the module docs.
pub(crate) struct Driver {
    slot: Mutex<Option<Driven>>,
    /// The engine's queue: a caller that gives up on driving kicks the engine thread.
    queue: Arc<Queue>,
    /// How many times a caller drove the engine (tests and debugging).
    drives: AtomicU64,
}

/// The engine, and how its cycles ended when a caller ended them.
struct Driven {
    engine: Engine,
    /// Set by a caller whose cycle ended the engine; the engine thread serves it.
    ended: Option<End>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

impl Driver {
    /// The driver of an engine fed by `queue`; the engine comes with [`Driver::serve`].
    pub(crate) fn new(queue: Arc<Queue>) -> Self {
        Driver {
            slot: Mutex::new(None),
            queue,
            drives: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Driven>> {
        // A panic while a cycle ran aborts the job (the panic hook); the state a
        // poisoned lock guards is only read on the way out.
        self.slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs the engine's cycles on this thread until `done()`, if the engine is idle
    /// and may be driven from here (see the module docs). Returns false when it did
    /// not drive.
    fn drive_until(&self, done: &dyn Fn() -> bool) -> bool {
        let Some(mut slot) = self.idle() else {
            return false;
        };
        if let Some(driven) = slot.as_mut() {
            self.drives.fetch_add(1, Ordering::Relaxed);
            driven.ended = driven.engine.drive(done);
        }
        self.let_go(slot);
        true
    }

    /// The engine's lock, when this thread may run it now: the lock is free, and the
    /// engine has not ended and may be driven from here.
    fn idle(&self) -> Option<MutexGuard<'_, Option<Driven>>> {
        let slot = match self.slot.try_lock() {
            Ok(slot) => slot,
            Err(TryLockError::WouldBlock | TryLockError::Poisoned(_)) => return None,
        };
        let ready = slot
            .as_ref()
            .is_some_and(|d| d.ended.is_none() && d.engine.may_be_driven());
        ready.then_some(slot)
    }

    /// Lets go of the engine taken with [`idle`](Self::idle). Work left for the engine
    /// thread (other threads' ops, taken in here), a heartbeat due, or an end it must
    /// serve: wakes it once the lock is free.
    fn let_go(&self, mut slot: MutexGuard<'_, Option<Driven>>) {
        let leftover = slot.as_mut().is_some_and(|d| {
            d.ended.is_some()
                || d.engine.inbox.has_work()
                || std::mem::take(&mut d.engine.heartbeat_handed_back)
        });
        drop(slot);
        if leftover {
            self.queue.kick();
        }
    }

    /// Sends `tensor` to `peer` on this thread, without queueing it, if the engine is
    /// idle: posted, and polled once. `Ok(Ok(true))`: sent. `Ok(Ok(false))`: still in
    /// flight, waiting in the engine under the completer `later` made (its handle
    /// then waits as usual). `Err`: not now (the engine is busy, or the usual path
    /// must report something); the tensor comes back to be queued.
    // The tensor comes back by value when this path does not apply, to go the queued
    // way (as `Tensor::into_host_buffer` hands it back).
    #[allow(clippy::result_large_err)]
    pub(crate) fn send_now(
        &self,
        peer: usize,
        name: &str,
        tensor: Tensor,
        later: impl FnOnce() -> Completer,
    ) -> Result<Result<bool>, Tensor> {
        let Some(mut slot) = self.idle() else {
            return Err(tensor);
        };
        let sent = match slot.as_mut() {
            Some(driven) => driven.engine.send_now(peer, name, tensor, later),
            None => Err(tensor),
        };
        self.let_go(slot);
        sent
    }

    /// Receives `name` from `peer` on this thread, without queueing it, if the engine
    /// is idle: the tensor if it is here or comes within [`RECV_NOW_SPIN`].
    /// `Some(Ok(None))`: it waits in the engine under the completer `later` made.
    /// `None`: not now (queue it).
    pub(crate) fn recv_now(
        &self,
        peer: usize,
        name: &str,
        later: impl FnOnce() -> Completer,
    ) -> Option<Result<Option<Tensor>>> {
        let mut slot = self.idle()?;
        let got = slot
            .as_mut()
            .and_then(|driven| driven.engine.recv_now(peer, name, later));
        self.let_go(slot);
        got
    }

    /// The engine thread's side: holds `engine` until it ends, running cycles and
    /// sleeping on `queue` (without the lock) when there is nothing to run. Returns
    /// the engine when its cycles have ended and the end was served.
    ///
    /// A sleep that ran out is a cycle due (a heartbeat, or the next paced cycle while
    /// other ranks are awaited) unless a caller ran one meanwhile; a sleep ended by
    /// work looks at the engine again first (a caller may have run it already), after
    /// a grace of one cycle time when the work woke it from idle (the submitting
    /// caller usually waits soon, and then runs the op itself; README, "Who runs a
    /// cycle"). The thread spins for the next submit only after a cycle of its own.
    pub(super) fn serve(&self, engine: Engine) -> Engine {
        let queue = &*self.queue;
        *self.lock() = Some(Driven {
            engine,
            ended: None,
        });
        // After a sleep that ran out: the cycle count when it began.
        let mut due: Option<u64> = None;
        let mut ran_last = false;
        // After a grace that ran out: take the engine only if no caller runs it.
        let mut polite: Option<Duration> = None;
        loop {
            let mut slot = match polite.take() {
                None => self.lock(),
                Some(grace) => match self.slot.try_lock() {
                    Ok(slot) => slot,
                    Err(TryLockError::Poisoned(p)) => p.into_inner(),
                    Err(TryLockError::WouldBlock) => {
                        // A caller runs the engine and takes in what is queued; look
                        // again after a kick, or a grace later (what was queued after
                        // the caller's last look waits at most that long).
                        if !queue.wait_for_kick(grace) {
                            polite = Some(grace);
                        }
                        continue;
                    }
                },
            };
            let Some(driven) = slot.as_mut() else {
                unreachable!("only the engine thread takes the engine out");
            };
            let end = match driven.ended.take() {
                Some(end) => Some(end),
                None => {
                    let engine = &mut driven.engine;
                    let sleep = match due.take() {
                        Some(seen) if seen == engine.cycles => {
                            engine.take_in();
                            None
                        }
                        _ => engine.gather(),
                    };
                    if let Some(mut sleep) = sleep {
                        if !ran_last {
                            if let Sleep::SpinThenIdle = sleep {
                                sleep = Sleep::Idle;
                            }
                        }
                        let seen = engine.cycles;
                        // Woken from idle by a submit, it leaves the op to its caller
                        // for up to a cycle time (see `grace`).
                        let grace = (matches!(sleep, Sleep::Idle) && engine.may_be_driven())
                            .then_some(engine.config.cycle_time)
                            .filter(|g| !g.is_zero());
                        drop(slot);
                        let woke = sleep.sleep(queue);
                        if woke == Woke::TimedOut && sleep.cycles_when_over() {
                            due = Some(seen);
                        }
                        if let (Woke::Command, Some(g)) = (woke, grace) {
                            if !queue.wait_for_kick(g) {
                                polite = Some(g);
                            }
                        }
                        ran_last = false;
                        continue;
                    }
                    ran_last = true;
                    engine.step()
                }
            };
            if let Some(end) = end {
                // Served with the lock held: callers find it taken and wait for their
                // handles, which the engine now fails or completes.
                driven.engine.finish(end);
                let driven = slot.take();
                drop(slot);
                return match driven {
                    Some(d) => d.engine,
                    None => unreachable!("the engine was in the slot above"),
                };
            }
        }
    }

    /// How many times a caller has driven the engine so far.
    #[cfg(test)]
    pub(crate) fn drives(&self) -> u64 {
        self.drives.load(Ordering::Relaxed)
    }

    /// The engine after a panic on its thread (to abort through its transport).
    pub(super) fn take_after_panic(&self) -> Option<Engine> {
        self.lock().take().map(|d| d.engine)
    }
}

impl Drive for Driver {
    /// Drives the engine until `done()` if it is idle (its lock is free: the engine
    /// thread lets go of it while it sleeps); otherwise kicks the engine thread, which
    /// then runs the op (it may have been queued without waking it).
    fn help(&self, done: &dyn Fn() -> bool) {
        if !self.drive_until(done) {
            self.queue.kick();
        }
    }
}

impl Engine {
    /// Whether a caller's thread may run this engine's cycles.
    fn may_be_driven(&self) -> bool {
        self.transport.any_thread() && !self.exec.gpu.opened() && !self.inbox.saw_device
    }

    /// Runs cycles on the caller's thread until `done()` (its op completed) or the
    /// engine ends. Paces cycles as the engine thread does: while only other ranks are
    /// awaited, one per cycle time unless new work arrives.
    fn drive(&mut self, done: &dyn Fn() -> bool) -> Option<End> {
        // Polls take one arrived tensor at a time: the caller looks at `done` between.
        self.p2p.drain = false;
        let end = self.drive_turns(done);
        self.p2p.drain = true;
        end
    }

    /// Takes in what is queued (this thread's earlier sends go first, in order);
    /// false once shutdown was asked for (the queued path then reports it).
    fn ready_for_p2p_now(&mut self) -> bool {
        if self.inbox.queue.flagged() {
            self.take_in();
        }
        !self.inbox.shutting_down
    }

    /// [`Driver::send_now`] with the engine in hand.
    // The tensor comes back by value when this path does not apply, to go the queued
    // way (as `Tensor::into_host_buffer` hands it back).
    #[allow(clippy::result_large_err)]
    fn send_now(
        &mut self,
        peer: usize,
        name: &str,
        tensor: Tensor,
        later: impl FnOnce() -> Completer,
    ) -> Result<Result<bool>, Tensor> {
        if !self.ready_for_p2p_now() {
            return Err(tensor);
        }
        self.p2p
            .send_now(peer, name, tensor, &mut self.exec.timeline, later)
    }

    /// [`Driver::recv_now`] with the engine in hand: polls for the tensor, one arrived
    /// header at a time, for at most [`RECV_NOW_SPIN`] or until other work is queued,
    /// then leaves the receive waiting in the engine (the caller's handle drives it
    /// from there as any other wait).
    fn recv_now(
        &mut self,
        peer: usize,
        name: &str,
        later: impl FnOnce() -> Completer,
    ) -> Option<Result<Option<Tensor>>> {
        if !self.ready_for_p2p_now() {
            return None;
        }
        let key = (peer, name.to_string());
        if !self.p2p.may_recv_now(&key) {
            return None;
        }
        let start = Instant::now();
        let mut turns = 0u32;
        let got = loop {
            match self.p2p.recv_now(&key, &mut self.exec.timeline) {
                Ok(None) => {}
                got => break got,
            }
            turns = turns.wrapping_add(1);
            if self.inbox.queue.flagged()
                || (turns.is_multiple_of(RECV_NOW_LOOKS) && start.elapsed() >= RECV_NOW_SPIN)
            {
                break Ok(None);
            }
            std::hint::spin_loop();
        };
        Some(match got {
            Ok(Some(t)) => {
                P2pLane::trace_recv(&mut self.exec.timeline, name, &t, peer, start);
                Ok(Some(t))
            }
            Ok(None) => {
                self.p2p.post_recv(key, later(), start);
                Ok(None)
            }
            Err(e) => Err(e),
        })
    }

    fn drive_turns(&mut self, done: &dyn Fn() -> bool) -> Option<End> {
        let start = Instant::now();
        // Turns in a row spent only polling sends and receives: after the first, the
        // queue's lock is taken only when something was flagged there, and stalls are
        // looked for every `STALL_POLLS` turns (each costs a clock read).
        let mut polls = 0u32;
        loop {
            if done() {
                return None;
            }
            if polls == 0 || self.inbox.queue.flagged() {
                self.take_in();
            } else {
                self.poll_p2p(polls.is_multiple_of(STALL_POLLS));
            }
            if self.inbox.saw_device {
                // A device op: CUDA and NCCL calls (opening the communicator first of
                // all) stay on the engine thread, which the caller kicks on leaving.
                return None;
            }
            let now = self.inbox.shutting_down || !self.inbox.outgoing.is_empty();
            if !now {
                if !self.inbox.has_work() {
                    if !self.p2p.busy() {
                        // Nothing here to run: the op is complete or completing.
                        return None;
                    }
                    // A send or receive waits for its peer: poll it here, spinning
                    // briefly (latency), then yielding (longer while bytes move:
                    // `P2pLane::yield_for`), then napping on the queue (new work ends
                    // a nap). One clock read a turn.
                    let now = Instant::now();
                    if now.duration_since(self.last_cycle) >= super::HEARTBEAT {
                        // A heartbeat is due: the engine thread runs it. Its agreement
                        // waits until every other rank's heartbeat joins (up to one
                        // interval later), and a caller running it would wait there
                        // after its own send or receive completed: a pipeline stage
                        // lost 40-100 ms at a time so.
                        self.heartbeat_handed_back = true;
                        return None;
                    }
                    let waited = now.duration_since(start);
                    if waited < DRIVE_SPIN {
                        std::hint::spin_loop();
                    } else if waited < self.p2p.yield_for() {
                        std::thread::yield_now();
                    } else {
                        self.inbox.queue.wait_for_command(self.p2p.poll_interval());
                    }
                    polls = polls.wrapping_add(1).max(1);
                    continue;
                }
                if !self.control.last_cycle_had_news {
                    self.inbox.queue.wait_for_command(self.config.cycle_time);
                    self.take_in();
                }
            }
            polls = 0;
            if let Some(end) = self.step() {
                return Some(end);
            }
        }
    }
}

/// How long a driving caller whose send or receive waits for its peer polls without
/// yielding the core (its peer's answer on one host comes within microseconds).
const DRIVE_SPIN: Duration = Duration::from_micros(50);

/// How long a receive on the caller's thread ([`Driver::recv_now`]) polls for its
/// tensor before it waits in the engine like any other op (whose driving caller then
/// spins as long again before it yields).
const RECV_NOW_SPIN: Duration = DRIVE_SPIN;

/// How many polls of such a receive go between two clock reads.
const RECV_NOW_LOOKS: u32 = 32;

/// How many polling turns of a driving caller go between two looks for stalled sends
/// and receives (a look reads the clock; stalls are reported after seconds).
const STALL_POLLS: u32 = 256;
