//! The autotuner's side of the engine: rank 0's tuner, the settings it proposes on
//! their way to every rank, and the settings in effect for `Kolo::autotune_state`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use super::autotune::{AutotuneChange, AutotuneState, Tuner};
use super::negotiate::Response;
use super::request::{self, RequestMeta, Settings};

/// Bytes an allreduce response reduces, or an allgather gathers (what the autotuner
/// scores).
pub(super) fn tuned_bytes(r: &Response) -> u64 {
    let (Response::Run(ready) | Response::Reduced { ready, .. }) = r else {
        return 0;
    };
    let bytes = |m: &RequestMeta| m.bytes() as u64;
    match ready.kind {
        request::OpKind::Allreduce | request::OpKind::GroupedAllreduce => bytes(ready.first()),
        request::OpKind::Allgather | request::OpKind::GroupedAllgather => {
            ready.metas.iter().flatten().map(|m| bytes(m)).sum()
        }
        _ => 0,
    }
}

/// The autotuner's side: rank 0's tuner, settings on their way to every rank, and
/// the settings in effect as `Kolo::autotune_state` reports them.
pub(super) struct Tuning {
    /// Rank 0's autotuner (None elsewhere or when off).
    pub(super) tuner: Option<Tuner>,
    /// Settings from the tuner to send in the next cycle.
    pub(super) pending: Option<Settings>,
    /// The response cache's capacity when the tuner turns it on.
    pub(super) cache_capacity_on: usize,
    /// The settings in effect, for `Kolo::autotune_state`.
    pub(super) state: Arc<Mutex<AutotuneState>>,
}

impl Tuning {
    /// Rank 0's tuner scores a cycle that moved `reduced_bytes`; settings it
    /// proposes go to every rank in the next cycle.
    pub(super) fn observe(&mut self, reduced_bytes: u64, cycle_start: Instant, now: Instant) {
        if let Some(tuner) = &mut self.tuner {
            if let Some(s) = tuner.observe(reduced_bytes, cycle_start, now) {
                self.pending = Some(s);
            }
        }
    }

    /// The response cache's capacity under `s`.
    pub(super) fn cache_capacity(&self, s: &Settings) -> usize {
        if s.cache {
            self.cache_capacity_on.max(1)
        } else {
            0
        }
    }

    /// Records settings every rank switched to at the end of `cycle`, for
    /// `Kolo::autotune_state`.
    pub(super) fn record(&self, s: &Settings, cycle: u64) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.fusion_threshold = s.fusion_threshold;
        state.fusion_max_tensor = s.fusion_max_tensor;
        state.cycle_time = s.cycle_time();
        state.cache_enabled = s.cache;
        state.hierarchical_allreduce = s.hierarchical;
        state.hierarchical_allgather = s.hierarchical_allgather;
        state.finished |= s.last;
        state.changes.push(AutotuneChange {
            cycle,
            fusion_threshold: s.fusion_threshold,
            fusion_max_tensor: s.fusion_max_tensor,
            cycle_time: s.cycle_time(),
            cache_enabled: s.cache,
            hierarchical_allreduce: s.hierarchical,
            hierarchical_allgather: s.hierarchical_allgather,
            last: s.last,
        });
    }
}

#[cfg(test)]
mod tests;
