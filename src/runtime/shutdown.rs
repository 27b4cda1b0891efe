//! Stopping an engine: its process sets' engines first (registered and closed under
//! one lock, so none starts unseen), then its own, bounded where asked.

use super::*;

/// The process sets' engines of one engine, and whether it is shutting down. A set's
/// engine is started and registered under this lock, and shutdown closes it under the
/// same lock, so no set's engine can start unseen by the shutdown that then finalises
/// MPI.
#[derive(Default)]
pub(super) struct Sets {
    /// Each set's engine, and its flag of having stopped: a set whose last handle is
    /// being dropped on another thread cannot be upgraded any more, but its engine may
    /// still be stopping (calling MPI), so shutdown waits for the flag.
    pub(super) engines: Vec<(Weak<Inner>, Arc<Stopped>)>,
    /// Shutdown has begun: no new set.
    closed: bool,
    /// `add_process_set` calls between their announcement and their set's
    /// registration: shutdown waits for them ([`StartingSet`]).
    starting: usize,
}

/// An `add_process_set` in progress, counted in [`Sets::starting`] until dropped.
pub(crate) struct StartingSet<'a>(&'a Inner);

impl<'a> StartingSet<'a> {
    /// Counts one more set starting, unless shutdown has begun.
    pub(super) fn enter(inner: &'a Inner) -> Option<Self> {
        let mut sets = inner.sets();
        if sets.closed {
            return None;
        }
        sets.starting += 1;
        Some(StartingSet(inner))
    }
}

impl Drop for StartingSet<'_> {
    fn drop(&mut self) {
        self.0.sets().starting -= 1;
        self.0.sets_changed.notify_all();
    }
}

/// Set once an engine's thread has ended and been joined.
#[derive(Default)]
pub(super) struct Stopped {
    done: Mutex<bool>,
    changed: std::sync::Condvar,
}

impl Stopped {
    fn mark(&self) {
        *self.done.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.changed.notify_all();
    }

    /// Waits until marked, or until `deadline`; whether it was marked.
    fn wait(&self, deadline: Option<Instant>) -> bool {
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        while !*done {
            let (guard, in_time) = wait_until(&self.changed, done, deadline);
            if !in_time {
                return false;
            }
            done = guard;
        }
        true
    }
}

/// Waits on `changed` with `guard` once, until `deadline` (`None`: without a bound).
/// Gives the guard back, and false when the deadline had already passed (no wait).
fn wait_until<'a, T>(
    changed: &std::sync::Condvar,
    guard: std::sync::MutexGuard<'a, T>,
    deadline: Option<Instant>,
) -> (std::sync::MutexGuard<'a, T>, bool) {
    let Some(d) = deadline else {
        return (
            changed.wait(guard).unwrap_or_else(PoisonError::into_inner),
            true,
        );
    };
    let left = d.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return (guard, false);
    }
    let (guard, _) = changed
        .wait_timeout(guard, left)
        .unwrap_or_else(PoisonError::into_inner);
    (guard, true)
}

impl Inner {
    pub(super) fn sets(&self) -> std::sync::MutexGuard<'_, Sets> {
        self.sets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stops the engines of this engine's process sets (they use MPI, so they must
    /// end before MPI is finalised); with a `deadline`, each gets what is left of it.
    /// No set can be added afterwards.
    fn stop_sets(&self, deadline: Option<Instant>) {
        let sets = {
            let mut sets = self.sets();
            sets.closed = true;
            // Sets announced before now start (their collectives need every member)
            // and are registered; then they are stopped with the rest.
            while sets.starting > 0 {
                let in_time;
                (sets, in_time) = wait_until(&self.sets_changed, sets, deadline);
                if !in_time {
                    tracing::error!("a process set still starting at the shutdown deadline");
                    break;
                }
            }
            std::mem::take(&mut sets.engines)
        };
        for set in sets.iter().filter_map(|(set, _)| set.upgrade()) {
            let stopped = match deadline {
                Some(d) => set.shutdown_timeout(d.saturating_duration_since(Instant::now())),
                None => set.shutdown(),
            };
            if let Err(e) = stopped {
                tracing::error!(error = %e, "stopping a process set's engine failed");
            }
        }
        // Sets being dropped on other threads stop there; MPI must outlive them too.
        for (_, stopped) in &sets {
            if !stopped.wait(deadline) {
                tracing::error!("a process set's engine did not stop before the deadline");
            }
        }
    }

    /// Closes the queue (the engine shuts down) and takes the engine's thread, once.
    fn stop_engine(&self) -> Option<JoinHandle<()>> {
        self.queue.close();
        self.engine
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    pub(super) fn shutdown(&self) -> Result<()> {
        let _one_at_a_time = self.stopping.lock().unwrap_or_else(PoisonError::into_inner);
        self.stop_sets(None);
        let joined = self.stop_engine().map_or(Ok(()), join_engine);
        self.stopped.mark();
        joined
    }

    /// [`Inner::shutdown`] with a bound: past `timeout` the job is aborted.
    pub(super) fn shutdown_timeout(&self, timeout: Duration) -> Result<()> {
        // One bound for the sets' engines and this one together.
        let deadline = deadline_after(timeout);
        let _one_at_a_time = self.stopping.lock().unwrap_or_else(PoisonError::into_inner);
        self.stop_sets(Some(deadline));
        let Some(engine) = self.stop_engine() else {
            self.stopped.mark();
            return Ok(());
        };
        if !finished_within(&engine, deadline.saturating_duration_since(Instant::now())) {
            // Only the engine thread calls MPI: ask it to abort (it does so from any
            // polled wait). If it sits in a blocking MPI call (MPI_Finalize waiting for
            // the other ranks), end this process: mpirun then ends the job.
            let rank = self.topology.rank;
            let line = format!(
                "kolo: rank {rank}: shutdown did not finish within {timeout:?} (the other ranks \
                 have not shut down); aborting the whole job\n"
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            crate::transport::request_abort(crate::RESTARTABLE_EXIT_CODE);
            if !finished_within(&engine, ABORT_GRACE) {
                std::process::abort();
            }
        }
        let joined = join_engine(engine);
        self.stopped.mark();
        joined
    }
}

/// `after` from now, or a century from now for a longer (or unrepresentable) bound: a
/// timeout of `Duration::MAX` means "never", not a panic in `Instant + Duration`.
fn deadline_after(after: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(after.min(CENTURY)).unwrap_or(now)
}

/// Waits up to `limit` for the engine thread to end; whether it did.
fn finished_within(engine: &JoinHandle<()>, limit: Duration) -> bool {
    let deadline = deadline_after(limit);
    while !engine.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    engine.is_finished()
}

fn join_engine(engine: JoinHandle<()>) -> Result<()> {
    engine
        .join()
        .map_err(|_| Error::Internal("the kolo engine thread panicked".into()))
}

/// How long [`Kolo::shutdown_timeout`] lets the engine abort the job itself before
/// ending the process.
const ABORT_GRACE: Duration = Duration::from_secs(1);

impl Drop for Inner {
    fn drop(&mut self) {
        // Never panic in drop (we may be unwinding already); report instead.
        if let Err(e) = self.shutdown() {
            tracing::error!(error = %e, "kolo shutdown failed");
        }
    }
}
