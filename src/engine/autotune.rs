//! The autotuner (KOLO_AUTOTUNE=1): rank 0 scores the engine's settings by allreduce
//! and allgather bytes per second of wall time and searches fusion threshold, cycle
//! time, response cache on/off and (where they can run) hierarchical allreduce and
//! allgather on/off by Bayesian optimisation — a Gaussian process over the settings
//! (normalised to [0, 1]) with expected improvement as the acquisition, as Horovod's
//! autotuner does. Each new setting travels in rank 0's next cycle message
//! and every rank applies it at the end of that same cycle.
//!
//! Sampling: a *step* is a cycle that ran allreduce work; a *sample* is
//! `steps_per_sample` steps, scored as their bytes over the time from the first
//! step's cycle start to the last step's end. The first `warmup_samples` samples are
//! discarded, and so is the first sample after every switch (it straddles the
//! change). A configuration's score is the median of `SAMPLES_PER_CONFIG` samples.
//! After `max_samples` configurations the best one observed is applied and kept.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use nalgebra::{DMatrix, DVector};

use super::request::Settings;
use crate::config::Config;
use crate::config::MAX_FUSED_TENSOR_BYTES;

/// Samples whose median scores one configuration.
const SAMPLES_PER_CONFIG: usize = 3;

/// Kernel length scale in the normalised space.
const LENGTH_SCALE: f64 = 0.3;

/// Candidates scored by expected improvement for each proposal.
const CANDIDATES: usize = 512;

/// Thresholds below this point of the normalised axis mean "fusion off".
const FUSION_OFF_BELOW: f64 = 0.05;

/// What the autotuner has applied so far; the same on every rank (see
/// [`Kolo::autotune_state`](crate::Kolo::autotune_state)).
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct AutotuneState {
    /// Whether rank 0 runs the autotuner (`KOLO_AUTOTUNE=1` on rank 0).
    pub enabled: bool,
    /// The autotuner has settled on its final settings.
    pub finished: bool,
    /// The fusion threshold in effect, in bytes.
    pub fusion_threshold: usize,
    /// Tensors larger than this many bytes are not fused (see
    /// [`Config::fusion_max_tensor_bytes`](crate::Config::fusion_max_tensor_bytes)).
    pub fusion_max_tensor: usize,
    /// The cycle time in effect.
    pub cycle_time: Duration,
    /// Whether the response cache is on.
    pub cache_enabled: bool,
    /// Whether allreduce runs hierarchically across hosts.
    pub hierarchical_allreduce: bool,
    /// Whether allgather runs hierarchically across hosts.
    pub hierarchical_allgather: bool,
    /// Every change, in order, with the negotiation cycle it took effect after.
    pub changes: Vec<AutotuneChange>,
}

/// One change of settings made by the autotuner.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct AutotuneChange {
    /// The negotiation cycle (counted from 1 on every rank) at whose end it applied.
    pub cycle: u64,
    /// New fusion threshold in bytes.
    pub fusion_threshold: usize,
    /// New limit on the size of a fused tensor, in bytes.
    pub fusion_max_tensor: usize,
    /// New cycle time.
    pub cycle_time: Duration,
    /// Whether the response cache is on.
    pub cache_enabled: bool,
    /// Whether allreduce runs hierarchically across hosts.
    pub hierarchical_allreduce: bool,
    /// Whether allgather runs hierarchically across hosts.
    pub hierarchical_allgather: bool,
    /// The final settings.
    pub last: bool,
}

/// Which settings are tuned (those not fixed by the user).
#[derive(Debug, Clone, Copy)]
struct Dims {
    threshold: bool,
    /// Whether large tensors are fused (tried only where the job spans hosts).
    large: bool,
    cycle: bool,
    cache: bool,
    hierarchical: bool,
    hierarchical_allgather: bool,
}

impl Dims {
    fn count(&self) -> usize {
        [
            self.threshold,
            self.large,
            self.cycle,
            self.cache,
            self.hierarchical,
            self.hierarchical_allgather,
        ]
        .into_iter()
        .map(usize::from)
        .sum()
    }
}

fn threshold_to_x(t: usize) -> f64 {
    if t == 0 {
        return 0.0;
    }
    let l = (t as f64).log2().clamp(12.0, 26.0);
    FUSION_OFF_BELOW + (1.0 - FUSION_OFF_BELOW) * (l - 12.0) / 14.0
}

/// 0 (off) below 0.05, else 4 KiB .. 64 MiB on a log scale.
fn x_to_threshold(x: f64) -> usize {
    if x < FUSION_OFF_BELOW {
        return 0;
    }
    let l = 12.0 + 14.0 * (x - FUSION_OFF_BELOW) / (1.0 - FUSION_OFF_BELOW);
    2f64.powf(l).round() as usize
}

/// 0.1 ms .. 10 ms on a log scale.
fn cycle_to_x(us: u64) -> f64 {
    (((us.max(1) as f64) / 1000.0).log10() + 1.0).clamp(0.0, 2.0) / 2.0
}

fn x_to_cycle(x: f64) -> u64 {
    (10f64.powf(2.0 * x - 1.0) * 1000.0).round() as u64
}

/// A Gaussian process with a squared-exponential kernel over points in [0, 1]^d.
struct Gp {
    xs: Vec<Vec<f64>>,
    alpha: DVector<f64>,
    chol: nalgebra::linalg::Cholesky<f64, nalgebra::Dyn>,
}

fn kernel(a: &[f64], b: &[f64]) -> f64 {
    let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    (-d2 / (2.0 * LENGTH_SCALE * LENGTH_SCALE)).exp()
}

impl Gp {
    /// Fits normalised scores `ys` at `xs`; `noise` is the observation noise's
    /// standard deviation in units of the scores' spread.
    fn fit(xs: &[Vec<f64>], ys: &[f64], noise: f64) -> Option<Gp> {
        let n = xs.len();
        let k = DMatrix::from_fn(n, n, |i, j| {
            kernel(&xs[i], &xs[j]) + if i == j { noise * noise + 1e-9 } else { 0.0 }
        });
        let chol = k.cholesky()?;
        let alpha = chol.solve(&DVector::from_column_slice(ys));
        Some(Gp {
            xs: xs.to_vec(),
            alpha,
            chol,
        })
    }

    /// Posterior mean and standard deviation at `x`.
    fn predict(&self, x: &[f64]) -> (f64, f64) {
        let ks = DVector::from_iterator(self.xs.len(), self.xs.iter().map(|xi| kernel(xi, x)));
        let mean = ks.dot(&self.alpha);
        let v = self.chol.solve(&ks);
        let var = (1.0 - ks.dot(&v)).max(1e-12);
        (mean, var.sqrt())
    }
}

/// Expected improvement over `best` of a normal posterior (mean, sd), with a small
/// exploration margin.
fn expected_improvement(mean: f64, sd: f64, best: f64) -> f64 {
    let xi = 0.01;
    let z = (mean - best - xi) / sd;
    let cdf = 0.5 * (1.0 + libm::erf(z / std::f64::consts::SQRT_2));
    let pdf = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
    (mean - best - xi) * cdf + sd * pdf
}

/// Rank 0's tuner.
pub(crate) struct Tuner {
    dims: Dims,
    current: Settings,
    cache_capacity_on: usize,
    warmup_left: usize,
    steps_per_sample: usize,
    max_configs: usize,
    noise: f64,
    discard_left: usize,
    window: Option<(Instant, u64, usize)>,
    scores: Vec<f64>,
    observed: Vec<(Vec<f64>, f64, Settings)>,
    rng: u64,
    sample: usize,
    log: Option<File>,
}

impl Tuner {
    /// A tuner starting from `start`, or `None` when every setting is fixed by the
    /// user (nothing to tune). Hierarchical allreduce is tuned where it `can_be_hierarchical`
    /// (several hosts with the same number of ranks, more than one) unless the user set it;
    /// fusing large tensors is tried where the job `spans_hosts` unless the user set
    /// the limit.
    pub(crate) fn new(
        config: &Config,
        start: Settings,
        can_be_hierarchical: bool,
        spans_hosts: bool,
    ) -> Option<Tuner> {
        let dims = Dims {
            threshold: !config.fusion_threshold_explicit,
            large: spans_hosts && !config.fusion_max_tensor_explicit,
            cycle: !config.cycle_time_explicit,
            cache: !config.cache_capacity_explicit,
            hierarchical: can_be_hierarchical && !config.hierarchical_allreduce_explicit,
            hierarchical_allgather: can_be_hierarchical && !config.hierarchical_allgather_explicit,
        };
        if dims.count() == 0 {
            tracing::warn!("KOLO_AUTOTUNE: fusion threshold and tensor limit, cycle time, cache capacity and hierarchical allreduce are all set explicitly or fixed; nothing to tune");
            return None;
        }
        let log = config.autotune_log.as_deref().and_then(open_log);
        Some(Tuner {
            dims,
            current: start,
            cache_capacity_on: config.cache_capacity.max(1),
            warmup_left: config.autotune_warmup_samples,
            steps_per_sample: config.autotune_steps_per_sample.max(1),
            max_configs: config.autotune_max_samples.max(1),
            noise: config.autotune_noise,
            discard_left: 0,
            window: None,
            scores: Vec::new(),
            observed: Vec::new(),
            rng: 0x6b6f_6c6f,
            sample: 0,
            log,
        })
    }

    /// The capacity the cache gets when the tuner turns it on.
    pub(crate) fn cache_capacity_on(&self) -> usize {
        self.cache_capacity_on
    }

    /// Called at the end of every cycle with the allreduce bytes it ran and when it
    /// started; returns settings for every rank to switch to.
    pub(crate) fn observe(
        &mut self,
        bytes: u64,
        cycle_start: Instant,
        now: Instant,
    ) -> Option<Settings> {
        if self.current.last || bytes == 0 {
            return None;
        }
        let (start, total, steps) = self.window.get_or_insert((cycle_start, 0, 0));
        *total += bytes;
        *steps += 1;
        if *steps < self.steps_per_sample {
            return None;
        }
        let secs = now.duration_since(*start).as_secs_f64().max(1e-9);
        let score = *total as f64 / secs;
        self.window = None;
        self.sample += 1;
        if self.warmup_left > 0 {
            self.warmup_left -= 1;
            self.write_row(score, "warmup");
            return None;
        }
        if self.discard_left > 0 {
            self.discard_left -= 1;
            self.write_row(score, "after-switch");
            return None;
        }
        self.write_row(score, "sample");
        self.scores.push(score);
        if self.scores.len() < SAMPLES_PER_CONFIG {
            return None;
        }
        self.scores.sort_by(f64::total_cmp);
        let median = self.scores[self.scores.len() / 2];
        self.scores.clear();
        self.observed
            .push((self.point_of(&self.current), median, self.current));
        tracing::debug!(?self.current, median, "autotune: configuration scored");
        let next = if self.observed.len() >= self.max_configs {
            let best = self
                .observed
                .iter()
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(_, score, s)| (*score, *s))?;
            let mut s = best.1;
            s.last = true;
            tracing::info!(
                fusion_threshold = s.fusion_threshold,
                fusion_max_tensor = s.fusion_max_tensor,
                cycle_time_us = s.cycle_time_us,
                cache = s.cache,
                hierarchical = s.hierarchical,
                hierarchical_allgather = s.hierarchical_allgather,
                score = best.0,
                "autotune: done, keeping the best settings"
            );
            self.current = s;
            self.write_row(best.0, "best");
            s
        } else {
            let s = self.propose();
            self.current = s;
            self.discard_left = 1;
            s
        };
        Some(next)
    }

    fn point_of(&self, s: &Settings) -> Vec<f64> {
        let mut x = Vec::with_capacity(5);
        if self.dims.threshold {
            x.push(threshold_to_x(s.fusion_threshold));
        }
        if self.dims.large {
            x.push(if s.fusion_max_tensor > MAX_FUSED_TENSOR_BYTES {
                1.0
            } else {
                0.0
            });
        }
        if self.dims.cycle {
            x.push(cycle_to_x(s.cycle_time_us));
        }
        if self.dims.cache {
            x.push(if s.cache { 1.0 } else { 0.0 });
        }
        if self.dims.hierarchical {
            x.push(if s.hierarchical { 1.0 } else { 0.0 });
        }
        if self.dims.hierarchical_allgather {
            x.push(if s.hierarchical_allgather { 1.0 } else { 0.0 });
        }
        x
    }

    fn settings_at(&self, x: &[f64]) -> Settings {
        let mut s = self.current;
        let mut it = x.iter();
        if self.dims.threshold {
            s.fusion_threshold = x_to_threshold(it.next().copied().unwrap_or(0.0));
        }
        if self.dims.large {
            s.fusion_max_tensor = if it.next().copied().unwrap_or(0.0) >= 0.5 {
                usize::MAX
            } else {
                MAX_FUSED_TENSOR_BYTES
            };
        }
        if self.dims.cycle {
            s.cycle_time_us = x_to_cycle(it.next().copied().unwrap_or(0.5));
        }
        if self.dims.cache {
            s.cache = it.next().copied().unwrap_or(1.0) >= 0.5;
        }
        if self.dims.hierarchical {
            s.hierarchical = it.next().copied().unwrap_or(0.0) >= 0.5;
        }
        if self.dims.hierarchical_allgather {
            s.hierarchical_allgather = it.next().copied().unwrap_or(0.0) >= 0.5;
        }
        s
    }

    fn uniform(&mut self) -> f64 {
        // splitmix64: deterministic, so a run's proposals can be reproduced.
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The candidate with the highest expected improvement under a GP fitted to the
    /// configurations scored so far (scores normalised to mean 0, spread 1).
    fn propose(&mut self) -> Settings {
        let d = self.dims.count();
        let xs: Vec<Vec<f64>> = self.observed.iter().map(|o| o.0.clone()).collect();
        let raw: Vec<f64> = self.observed.iter().map(|o| o.1).collect();
        let mean = raw.iter().sum::<f64>() / raw.len() as f64;
        let sd = (raw.iter().map(|y| (y - mean).powi(2)).sum::<f64>() / raw.len() as f64).sqrt();
        let sd = if sd > 0.0 { sd } else { 1.0 };
        let ys: Vec<f64> = raw.iter().map(|y| (y - mean) / sd).collect();
        let best = ys.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut candidates: Vec<Vec<f64>> = (0..CANDIDATES)
            .map(|_| (0..d).map(|_| self.uniform()).collect())
            .collect();
        // The corners too: fusion off / largest, shortest / longest cycle, cache off /
        // on, flat / hierarchical.
        for mask in 0..(1usize << d) {
            candidates.push((0..d).map(|i| ((mask >> i) & 1) as f64).collect());
        }
        let Some(gp) = Gp::fit(&xs, &ys, self.noise) else {
            let i = (self.uniform() * candidates.len() as f64) as usize;
            return self.settings_at(&candidates[i.min(candidates.len() - 1)]);
        };
        let pick = candidates
            .iter()
            .map(|c| {
                let (m, s) = gp.predict(c);
                (expected_improvement(m, s, best), c)
            })
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, c)| c.clone())
            .unwrap_or_else(|| vec![0.5; d]);
        let mut s = self.settings_at(&pick);
        s.last = false;
        s
    }

    fn write_row(&mut self, score: f64, kind: &str) {
        let (sample, s) = (self.sample, self.current);
        if let Some(f) = &mut self.log {
            let row = format!(
                "{sample},{},{},{:.3},{},{},{},{score:.0},{kind}\n",
                s.fusion_threshold,
                s.fusion_max_tensor,
                s.cycle_time_us as f64 / 1000.0,
                u8::from(s.cache),
                u8::from(s.hierarchical),
                u8::from(s.hierarchical_allgather)
            );
            if let Err(e) = f.write_all(row.as_bytes()).and_then(|()| f.flush()) {
                tracing::warn!(error = %e, "cannot write the autotune log; stopping it");
                self.log = None;
            }
        }
    }
}

fn open_log(path: &Path) -> Option<File> {
    let header =
        "sample,fusion_threshold_bytes,fusion_max_tensor_bytes,cycle_time_ms,cache_enabled,hierarchical_allreduce,hierarchical_allgather,score_bytes_per_s,kind\n";
    match File::create(path).and_then(|mut f| f.write_all(header.as_bytes()).map(|()| f)) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the autotune log; tuning without it");
            None
        }
    }
}

#[cfg(test)]
mod tests;
