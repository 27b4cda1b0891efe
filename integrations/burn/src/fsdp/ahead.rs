//! Forward prefetch (FSDP's `forward_prefetch`): a unit's forward submits the
//! all-gather of the unit that ran after it in the previous training step, so that
//! the engine gathers it while this unit computes.
//!
//! The next unit's blocks change with every optimizer step, and its forward must
//! gather the blocks it holds then: every mapping of a unit (an optimizer step,
//! `to_device`, loading a record, …) makes a new *generation* and leaves its blocks
//! as the unit's latest. A prefetch gathers the latest blocks and is used only by a
//! copy of that generation; any other copy gathers its own (after the prefetched
//! all-gather has finished, which every rank submitted alike).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, Weak};

use crate::error::Result;
use crate::sharded::shard::Shard;

use super::Pending;

/// A unit that can be gathered ahead of its forward.
pub(super) trait Prefetch: Send + Sync {
    /// Submits the all-gather of the unit's latest blocks, unless one is waiting.
    fn prefetch(&self);

    /// Learns that `next` runs after this unit.
    fn then(&self, next: Weak<dyn Prefetch>);
}

/// A unit's prefetch state, shared by its copies.
#[derive(Default)]
pub(super) struct Ahead {
    generations: AtomicU64,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The latest generation and its blocks.
    latest: Option<(u64, Shard)>,
    /// The unit that ran after this one in the last step.
    next: Option<Weak<dyn Prefetch>>,
    /// An all-gather submitted ahead of this unit's forward, with the generation of
    /// the blocks it gathers.
    prefetched: Option<(u64, Result<Pending>)>,
}

impl Ahead {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new generation holding `shard`, now the latest.
    pub(super) fn renew(&self, shard: &Shard) -> u64 {
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        self.inner().latest = Some((generation, shard.clone()));
        generation
    }

    /// Learns that `next` runs after this unit.
    pub(super) fn then(&self, next: Weak<dyn Prefetch>) {
        self.inner().next = Some(next);
    }

    /// The unit that ran after this one, if it is still alive.
    pub(super) fn next(&self) -> Option<std::sync::Arc<dyn Prefetch>> {
        self.inner().next.as_ref().and_then(Weak::upgrade)
    }

    /// The latest blocks, when nothing is prefetched for them yet: their generation
    /// and the blocks, to gather.
    pub(super) fn to_prefetch(&self) -> Option<(u64, Shard)> {
        let inner = self.inner();
        match inner.prefetched {
            Some(_) => None,
            None => inner.latest.clone(),
        }
    }

    /// Keeps an all-gather of generation `generation`'s blocks for its forward.
    pub(super) fn keep(&self, generation: u64, gather: Result<Pending>) {
        self.inner().prefetched = Some((generation, gather));
    }

    /// The all-gather prefetched for generation `generation`, if any; one
    /// prefetched for another is waited for and dropped.
    pub(super) fn take(&self, generation: u64) -> Option<Result<Pending>> {
        let (g, gather) = self.inner().prefetched.take()?;
        if g == generation {
            return Some(gather);
        }
        if let Ok(h) = gather {
            // Its names are used again by the gather that replaces it.
            let _ = h.wait();
        }
        None
    }
}
