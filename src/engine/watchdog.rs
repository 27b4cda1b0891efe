//! The collective timeout: a thread that ends the job when the engine has made no
//! progress for `KOLO_COLLECTIVE_TIMEOUT_SECONDS`.
//!
//! The stall inspector runs on the engine thread, so it cannot speak while that thread
//! sits in a collective that never completes (a rank stopped, its host unreachable or
//! partitioned away: no error ever comes back from MPI). Engines cycle at least every
//! heartbeat (100 ms) even while the program computes, so an engine that has not
//! finished a cycle for the timeout is stuck in its transport. The watchdog then says
//! so, asks the engine to abort the job (which any polled wait does), and if the engine
//! does not within a grace period, ends this process, which makes mpirun end the job.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::transport::Awaited;

/// How long the engine gets to abort the job itself before the process ends.
const GRACE: Duration = Duration::from_secs(2);

/// What the engine reports and the watchdog reads.
#[derive(Debug)]
pub(crate) struct Progress {
    start: Instant,
    /// Milliseconds after `start` of the last progress.
    last_ms: AtomicU64,
    /// Negotiation cycles completed.
    cycles: AtomicU64,
    stopped: AtomicBool,
}

impl Progress {
    fn new() -> Self {
        Progress {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            cycles: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
        }
    }

    /// The engine finished a cycle (or started serving) at `now`.
    pub(crate) fn mark(&self, cycles: u64, now: Instant) {
        let since = now.saturating_duration_since(self.start);
        let ms = u64::try_from(since.as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
        self.cycles.store(cycles, Ordering::Relaxed);
    }

    /// The engine stopped serving: nothing more to watch.
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// What a stuck engine says before it aborts the job: which engine, for how long,
/// and the rank it is waiting for when it knows one.
fn stuck_line(
    rank: usize,
    label: &str,
    idle: Duration,
    cycles: u64,
    timeout: Duration,
    awaited: Option<usize>,
) -> String {
    let who = match awaited {
        Some(r) => format!(
            "rank {r} has not answered (waiting for its part of the cycle agreement): it, or \
             a rank it waits for, is stopped or stuck, or its host is unreachable"
        ),
        None => "another rank is stopped or stuck, or its host is unreachable".to_string(),
    };
    format!(
        "kolo: rank {rank}: {label} has made no progress for {:.1} s (after cycle {cycles}; \
         KOLO_COLLECTIVE_TIMEOUT_SECONDS is {:.1}): {who}; aborting the whole job\n",
        idle.as_secs_f64(),
        timeout.as_secs_f64()
    )
}

/// Starts the watchdog of an engine on `rank` (`label` names the engine: the job's or
/// a process set's); `None` when the timeout is zero (off).
pub(crate) fn start(
    timeout: Duration,
    rank: usize,
    label: String,
    awaited: Awaited,
) -> Option<Arc<Progress>> {
    if timeout.is_zero() {
        return None;
    }
    let progress = Arc::new(Progress::new());
    let watched = progress.clone();
    let tick = (timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let spawned = std::thread::Builder::new()
        .name("kolo-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(tick);
            if watched.stopped.load(Ordering::Relaxed) {
                return;
            }
            let idle = watched.idle_for();
            if idle < timeout {
                continue;
            }
            let line = stuck_line(
                rank,
                &label,
                idle,
                watched.cycles.load(Ordering::Relaxed),
                timeout,
                awaited.get(),
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            crate::transport::request_abort(crate::RESTARTABLE_EXIT_CODE);
            std::thread::sleep(GRACE);
            if !watched.stopped.load(Ordering::Relaxed) {
                // The engine sits in a blocking call that will not return: end this
                // process; mpirun then ends the others.
                // SAFETY: `_exit` ends the process at once; no Rust state is used after.
                unsafe { libc::_exit(crate::RESTARTABLE_EXIT_CODE) };
            }
            return;
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the collective-timeout watchdog; continuing without it");
        return None;
    }
    Some(progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_rank_waited_for() {
        let line = stuck_line(
            0,
            "its engine (kolo-engine)",
            Duration::from_millis(2100),
            41,
            Duration::from_secs(2),
            Some(3),
        );
        assert_eq!(
            line,
            "kolo: rank 0: its engine (kolo-engine) has made no progress for 2.1 s (after cycle \
             41; KOLO_COLLECTIVE_TIMEOUT_SECONDS is 2.0): rank 3 has not answered (waiting for \
             its part of the cycle agreement): it, or a rank it waits for, is stopped or \
             stuck, or its host is unreachable; aborting the whole job\n"
        );
        let line = stuck_line(
            1,
            "x",
            Duration::from_secs(5),
            0,
            Duration::from_secs(5),
            None,
        );
        assert!(
            line.contains("): another rank is stopped or stuck"),
            "{line}"
        );
    }

    #[test]
    fn awaited_is_empty_until_set() {
        let a = Awaited::default();
        assert_eq!(a.get(), None);
        a.clone().set(Some(2));
        assert_eq!(a.get(), Some(2));
        a.set(None);
        assert_eq!(a.get(), None);
    }
}
