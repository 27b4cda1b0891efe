//! A distributed sampler: each rank's share of a dataset, reshuffled every epoch (framework-free:
//! kolo-burn and kolo-candle re-export it).

/// Splits `0..len` among ranks like PyTorch's `DistributedSampler`: every epoch the
/// indices are shuffled from `(seed, epoch)` — the same permutation on every rank —
/// padded by repeating the first indices until they divide evenly, and rank `r` takes
/// every `size`-th index starting at `r`. So every rank gets the same number of
/// samples (and batches: collectives stay in step), the shards are disjoint except for
/// the padding, and together they cover the dataset.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    rank: usize,
    size: usize,
    seed: u64,
    shuffle: bool,
}

impl DistributedSampler {
    /// A shuffling sampler for `len` samples, as rank `rank` of `size`.
    pub fn new(len: usize, rank: usize, size: usize, seed: u64) -> Self {
        DistributedSampler {
            len,
            rank,
            size: size.max(1),
            seed,
            shuffle: true,
        }
    }

    /// Keeps dataset order (e.g. for evaluation).
    pub fn without_shuffle(mut self) -> Self {
        self.shuffle = false;
        self
    }

    /// Samples per rank per epoch.
    pub fn num_samples(&self) -> usize {
        self.len.div_ceil(self.size)
    }

    /// This rank's indices for `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        self.indices_from(epoch, 0)
    }

    /// This rank's indices for the rest of `epoch`, after the first `consumed` samples
    /// of the epoch's order: the samples all ranks together went through before a
    /// commit (`steps × batch × ranks`, see [`consumed`](Self::consumed)). The rest is
    /// dealt out among this sampler's ranks, which need not be as many as before: a
    /// job resumed on fewer ranks goes on with the samples the epoch has left, each
    /// once (padded, as [`indices`](Self::indices) pads, so the shares stay equal).
    /// With the same number of ranks and `consumed` a multiple of it, the result is
    /// the tail of [`indices`](Self::indices) — an interrupted epoch resumes exactly.
    pub fn indices_from(&self, epoch: u64, consumed: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            for i in (1..order.len()).rev() {
                let j = (rng.next() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        let mut rest = order[consumed.min(self.len)..].to_vec();
        // Padded with the epoch's first samples until the ranks' shares are equal.
        let mut i = 0;
        while !rest.len().is_multiple_of(self.size) && self.len > 0 {
            rest.push(order[i % self.len]);
            i += 1;
        }
        rest.into_iter()
            .skip(self.rank)
            .step_by(self.size)
            .collect()
    }

    /// The samples of an epoch all ranks went through in `steps` steps of `batch`
    /// samples per rank: the `consumed` of [`indices_from`](Self::indices_from).
    pub fn consumed(&self, steps: usize, batch: usize) -> usize {
        steps.saturating_mul(batch).saturating_mul(self.size)
    }
}

/// splitmix64: a tiny, well-known generator; the sampler needs a permutation that is
/// identical on every rank and stable across crate versions, nothing more.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_equal_disjoint_and_cover() {
        for (len, size) in [(10, 3), (1797, 4), (5, 5), (3, 4)] {
            let shards: Vec<Vec<usize>> = (0..size)
                .map(|r| DistributedSampler::new(len, r, size, 7).indices(2))
                .collect();
            let n = shards[0].len();
            assert!(shards.iter().all(|s| s.len() == n));
            assert_eq!(n, len.div_ceil(size));
            let mut seen = vec![0; len];
            for s in &shards {
                for &i in s {
                    seen[i] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c >= 1), "not covered");
            assert!(
                seen.iter().filter(|&&c| c > 1).count() < size,
                "at most size - 1 samples repeat (the padding)"
            );
        }
    }

    #[test]
    fn resumes_the_epoch_where_it_stopped() {
        // Same ranks: the tail of the full epoch, padding included.
        for (len, size) in [(10, 3), (101, 4), (7, 2)] {
            for r in 0..size {
                let s = DistributedSampler::new(len, r, size, 5);
                let all = s.indices(3);
                for steps in 0..=all.len() {
                    let from = s.indices_from(3, s.consumed(steps, 1));
                    assert_eq!(
                        from,
                        all[steps.min(all.len())..].to_vec(),
                        "len {len} size {size} rank {r} steps {steps}"
                    );
                }
            }
        }
        // Fewer ranks: the rest of the epoch, each remaining sample at least once,
        // none of the consumed ones, equal shares.
        let (len, consumed) = (103, 40);
        let before: Vec<usize> = (0..4)
            .flat_map(|r| DistributedSampler::new(len, r, 4, 9).indices(1)[..10].to_vec())
            .collect();
        let after: Vec<Vec<usize>> = (0..3)
            .map(|r| DistributedSampler::new(len, r, 3, 9).indices_from(1, consumed))
            .collect();
        assert!(after.iter().all(|a| a.len() == after[0].len()));
        let mut seen = vec![0; len];
        for &i in before.iter().chain(after.iter().flatten()) {
            seen[i] += 1;
        }
        assert!(
            seen.iter().all(|&c| c >= 1),
            "a sample of the epoch was skipped"
        );
        assert_eq!(
            seen.iter().filter(|&&c| c > 1).count(),
            3 * after[0].len() - (len - consumed)
        );
    }

    #[test]
    fn reshuffles_per_epoch_deterministically() {
        let s = DistributedSampler::new(100, 1, 2, 3);
        assert_eq!(s.indices(0), s.indices(0));
        assert_ne!(s.indices(0), s.indices(1));
        assert_eq!(
            DistributedSampler::new(6, 0, 2, 3)
                .without_shuffle()
                .indices(9),
            vec![0, 2, 4]
        );
    }
}
