//! Where a training run stands, for commits and resuming (framework-free: the
//! integrations store it in their checkpoints).

use serde::{Deserialize, Serialize};

/// Where training stood at a commit: enough, with the model and optimizer, to go on
/// exactly where it stopped — on the same number of ranks or another.
///
/// ```
/// let s = kolo::DistributedSampler::new(1000, 0, 2, 7);
/// // Committed after 12 steps of 16 samples per rank into epoch 3, on 2 ranks:
/// let p = kolo::Progress { epoch: 3, consumed: s.consumed(12, 16) as u64, step: 200, seed: 7, ranks: 2 };
/// // On resuming (the same ranks or fewer), the epoch goes on with what it has left:
/// let rest = s.indices_from(p.epoch, p.consumed as usize);
/// assert_eq!(rest, s.indices(3)[12 * 16..].to_vec());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Progress {
    /// The epoch in progress (0-based).
    pub epoch: u64,
    /// Samples of that epoch's order all ranks together went through
    /// ([`DistributedSampler::consumed`](crate::DistributedSampler::consumed)).
    pub consumed: u64,
    /// Optimizer steps taken since training began.
    pub step: u64,
    /// The seed of the data order (the sampler's).
    pub seed: u64,
    /// Ranks that trained up to the commit.
    pub ranks: u64,
}

/// Which attempt of the job this is: `KOLO_RESTART_COUNT`, which `kolorun
/// --max-restarts` sets on every rank (0 on the first attempt, and without kolorun).
/// A program resumes from its last commit when it is above 0.
pub fn restart_count() -> u32 {
    std::env::var("KOLO_RESTART_COUNT")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}
