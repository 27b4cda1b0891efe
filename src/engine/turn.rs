//! One order for a rank's device work across its engines (issue 31, item 21).
//!
//! The job's engine and each process set's engine have their own device
//! communicator on the rank's one GPU. A collective library like NCCL needs every
//! rank to enqueue the ops of different communicators in the same order: rank 0
//! putting set A's allreduce before the job's while rank 1 does the opposite leaves
//! both kernels waiting on each other. Engines run on their own threads, so nothing
//! orders them by itself.
//!
//! The job's engine gives the order. Before a process set's engine enqueues the
//! device ops of one of its cycles, it asks the job's engine for a turn: a request
//! of kind `DeviceTurn` that only the set's ranks submit (under a key numbering the
//! set's device cycles, the same on each of them) and that the job negotiates like
//! any other op. When the job's engine reaches the turn among its responses, it
//! hands the set's engine a [`Turn`] and waits until it is dropped — after the set's
//! ops are enqueued — before it goes on with its own device ops. Responses run in
//! the same order on every rank, so every rank enqueues the job's ops and every
//! set's ops in one agreed order. A set's device cycle costs one cycle of the job's
//! engine; host-only cycles take no turn.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::error::Result;

/// How a process set's engine gets a turn from the job's engine (blocking).
pub(crate) type TakeTurn = Box<dyn FnMut() -> Result<Turn> + Send>;

/// A set engine's turn to enqueue device work on this rank; the job's engine goes on
/// once it is dropped.
#[derive(Debug)]
pub(crate) struct Turn {
    latch: Arc<Latch>,
}

#[derive(Debug, Default)]
struct Latch {
    released: Mutex<bool>,
    changed: Condvar,
}

impl Turn {
    /// Gives a turn out (through `hand`) and waits until it is given back or `limit`
    /// passes; then warns (the set's engine is stuck enqueueing: its own timeouts or
    /// the watchdog report why) and goes on.
    pub(crate) fn grant(hand: impl FnOnce(Turn), limit: Duration, key: &str) {
        let latch = Arc::new(Latch::default());
        hand(Turn {
            latch: latch.clone(),
        });
        let start = Instant::now();
        let mut released = latch
            .released
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while !*released {
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                tracing::warn!(
                    key,
                    waited = ?limit,
                    "a process set's engine has held its device turn too long; the job's engine goes on"
                );
                return;
            }
            released = latch
                .changed
                .wait_timeout(released, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        *self
            .latch
            .released
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = true;
        self.latch.changed.notify_all();
    }
}
