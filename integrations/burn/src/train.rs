//! burn-train's `SupervisedTraining` across ranks (feature `train`, on by default).
//!
//! Each rank launches the same `SupervisedTraining` on its shard of the data; what
//! has to differ between ranks, or agree across them, is here:
//!
//! - [`DistributedTraining::distributed`]: only rank 0 renders progress, writes the
//!   metric logs and installs the `experiment.log` application logger; the other ranks
//!   train silently.
//! - [`DistributedTraining::with_distributed_checkpointers`]: rank 0 writes the model,
//!   optimizer and scheduler checkpoints; on resume every rank gets rank 0's checkpoint
//!   through a broadcast, so the ranks need no shared file system.
//! - [`GlobalMetric`] wraps a numeric metric so that every rank logs the average over
//!   all ranks' samples. The metrics drive checkpoint selection and early stopping on
//!   every rank, so they must agree: wrap every metric those read.
//! - [`last_checkpoint`] finds the epoch of rank 0's newest complete checkpoint, for
//!   `.checkpoint(epoch)` on every rank: a job relaunched by `kolorun --max-restarts`
//!   goes on from there.
//! - [`shard`] gives each rank an equal, disjoint share of a dataset, as
//!   [`DistributedSampler`] does, so every rank runs the
//!   same number of batches (each batch's collectives need every rank).
//!
//! Gradients are averaged in the optimizer step: either by a
//! [`GradientReducer`](crate::GradientReducer) called from an overridden
//! `TrainStep::optimize` (fused, recommended), or by a
//! [`DistributedOptimizer`](crate::DistributedOptimizer) as the Learner's optimizer.
//! With `grads_accumulation(n)` the Learner calls `optimize` once per `n` batches, so
//! the micro-steps communicate nothing.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::data::dataset::transform::SelectionDataset;
use burn::data::dataset::Dataset;
use burn::tensor::{Bytes, ExecutionError, TensorReadError};
use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError, FileCheckpointer};
use burn::train::logger::{EvaluationProgressLogger, InMemoryMetricLogger, TrainingProgressLogger};
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Metric, MetricAttributes, MetricDefinition, MetricMetadata, MetricName, Numeric, NumericEntry,
    SerializedEntry,
};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn::train::{LearnerModel, LearnerSummary, SupervisedTraining};
use kolo::{Kolo, ReduceOp, Tensor};

use crate::DistributedSampler;

/// The epoch of the newest complete checkpoint that
/// [`DistributedTraining::with_distributed_checkpointers`] wrote under `directory` —
/// model and optimizer, and the scheduler where one was saved — as rank 0 finds it,
/// the same on every rank (a broadcast: the others need no shared file system).
/// `None` when there is none. Pass it to `SupervisedTraining::checkpoint` to resume:
///
/// ```no_run
/// # use burn::train::{LearnerModel, SupervisedTraining};
/// # fn demo<M: LearnerModel>(kolo: &kolo::Kolo, training: SupervisedTraining<M>) -> kolo_burn::Result<()> {
/// use kolo_burn::train::{last_checkpoint, DistributedTraining};
/// let dir = "runs/digits";
/// let mut training = training.distributed(kolo).with_distributed_checkpointers(kolo, dir);
/// if let Some(epoch) = last_checkpoint(kolo, dir)? {
///     training = training.checkpoint(epoch); // goes on with epoch + 1
/// }
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`Error::Checkpoint`](crate::Error::Checkpoint) on every rank when rank 0 cannot
/// read the directory; a failed broadcast.
pub fn last_checkpoint(kolo: &Kolo, directory: impl AsRef<Path>) -> crate::Result<Option<usize>> {
    let dir = directory.as_ref().join("checkpoint");
    let found: std::result::Result<Option<usize>, String> = if kolo.rank() == 0 {
        newest_complete(&dir)
    } else {
        Ok(None)
    };
    kolo.broadcast_object("kolo_burn.last_checkpoint", found, 0)?
        .map_err(|message| crate::Error::Checkpoint {
            path: dir,
            message: format!("rank 0 cannot read it: {message}"),
        })
}

/// The newest epoch with a model and an optimizer checkpoint in `dir` (and a scheduler
/// one, if any scheduler checkpoint is there): Burn writes each file atomically, but
/// the three one after another.
fn newest_complete(dir: &Path) -> std::result::Result<Option<usize>, String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let mut epochs: std::collections::BTreeMap<usize, [bool; 3]> = Default::default();
    for entry in entries {
        let name = entry.map_err(|e| e.to_string())?.file_name();
        let Some(name) = name.to_str().and_then(|n| n.strip_suffix(".bpk")) else {
            continue;
        };
        let Some((kind, epoch)) = name.rsplit_once('-') else {
            continue;
        };
        let (Some(i), Ok(epoch)) = (
            ["model", "optim", "scheduler"]
                .iter()
                .position(|k| *k == kind),
            epoch.parse::<usize>(),
        ) else {
            continue;
        };
        epochs.entry(epoch).or_default()[i] = true;
    }
    let schedulers = epochs.values().any(|f| f[2]);
    Ok(epochs
        .iter()
        .rev()
        .find(|(_, f)| f[0] && f[1] && (f[2] || !schedulers))
        .map(|(&e, _)| e))
}

/// Sets up a burn-train `SupervisedTraining` for one rank of a kolo job.
pub trait DistributedTraining: Sized {
    /// On ranks other than 0: a [`SilentRenderer`], an in-memory metric logger instead
    /// of the metric files, and no `experiment.log` logger (kolo's and the user's
    /// `tracing` output still goes to stderr). Rank 0 is left as configured.
    #[must_use]
    fn distributed(self, kolo: &Kolo) -> Self;

    /// Burn's default checkpointers (model, optimizer and scheduler files under
    /// `directory/checkpoint`), written by rank 0 only; resuming with `.checkpoint(n)`
    /// reads rank 0's files there and broadcasts them to every rank.
    #[must_use]
    fn with_distributed_checkpointers(self, kolo: &Kolo, directory: impl AsRef<Path>) -> Self;
}

impl<M: LearnerModel> DistributedTraining for SupervisedTraining<M> {
    fn distributed(self, kolo: &Kolo) -> Self {
        if kolo.rank() == 0 {
            return self;
        }
        self.renderer(Box::new(SilentRenderer))
            .with_metric_logger(InMemoryMetricLogger::new())
            .with_application_logger(None)
    }

    fn with_distributed_checkpointers(self, kolo: &Kolo, directory: impl AsRef<Path>) -> Self {
        let dir = directory.as_ref().join("checkpoint");
        let file =
            |name: &str| RankZeroCheckpointer::new(kolo, name, FileCheckpointer::new(&dir, name));
        self.with_custom_checkpointers(file("model"), file("optim"), file("scheduler"))
    }
}

/// Rank `kolo.rank()`'s share of `dataset`: the indices [`DistributedSampler`] gives
/// for epoch 0 with `seed` (shuffled across the whole dataset, padded by repeating a
/// few samples so that every rank has `ceil(len / size)`). Burn's `DataLoaderBuilder::
/// shuffle` then reshuffles within the shard each epoch.
pub fn shard<D, I>(kolo: &Kolo, dataset: D, seed: u64) -> SelectionDataset<D, I>
where
    D: Dataset<I>,
    I: Clone + Send + Sync,
{
    let sampler = DistributedSampler::new(dataset.len(), kolo.rank(), kolo.size(), seed);
    SelectionDataset::from_indices_unchecked(dataset, sampler.indices(0))
}

/// A renderer that shows nothing: for the ranks that do not report.
#[derive(Debug, Default, Clone, Copy)]
pub struct SilentRenderer;

impl MetricsRendererTraining for SilentRenderer {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for SilentRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn on_test_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        Ok(())
    }
}

impl TrainingProgressLogger for SilentRenderer {
    fn start(&mut self, _epochs: usize, _start: usize, _items: Option<usize>, _: Option<&str>) {}
    fn update_epoch(&mut self, _epoch: usize) {}
    fn start_split(&mut self, _split: &str, _total_items: usize) {}
    fn update_split(&mut self, _items_processed: usize) {}
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for SilentRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, _total_items: usize) {}
    fn update_test_progress(&mut self, _items_processed: usize) {}
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for SilentRenderer {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// A checkpointer that only rank 0 writes to, and whose checkpoints every rank can
/// restore: rank 0 reads its file and broadcasts the record's bytes. If rank 0 cannot
/// restore, every rank gets the same error.
pub struct RankZeroCheckpointer<C> {
    kolo: Kolo,
    what: String,
    inner: C,
}

impl<C> std::fmt::Debug for RankZeroCheckpointer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankZeroCheckpointer")
            .field("what", &self.what)
            .field("rank", &self.kolo.rank())
            .finish_non_exhaustive()
    }
}

impl<C> RankZeroCheckpointer<C> {
    /// Wraps `inner` (e.g. a `FileCheckpointer`); `what` names the record in errors
    /// and in the broadcast ("model", "optim", …).
    pub fn new(kolo: &Kolo, what: &str, inner: C) -> Self {
        RankZeroCheckpointer {
            kolo: kolo.clone(),
            what: what.to_string(),
            inner,
        }
    }
}

impl<R: Checkpoint, C: Checkpointer<R>> Checkpointer<R> for RankZeroCheckpointer<C> {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        if self.kolo.rank() == 0 {
            self.inner.save(epoch, record)
        } else {
            Ok(())
        }
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        if self.kolo.rank() == 0 {
            self.inner.delete(epoch)
        } else {
            Ok(())
        }
    }

    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        let local: Result<Vec<u8>, String> = if self.kolo.rank() == 0 {
            self.inner
                .restore(epoch)
                .map_err(|e| e.to_string())
                .and_then(|r| r.checkpoint_into_bytes().map_err(|e| e.to_string()))
                .map(|b| b.to_vec())
        } else {
            Err(String::new())
        };
        let name = format!("kolo_burn.checkpoint.{}.{epoch}", self.what);
        let got = self
            .kolo
            .broadcast_object(name, local, 0)
            .map_err(|e| CheckpointerError::Unknown(e.to_string()))?;
        match got {
            Ok(bytes) => R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes))
                .map_err(CheckpointerError::Record),
            Err(message) => Err(CheckpointerError::Unknown(format!(
                "rank 0 could not restore the {} checkpoint of epoch {epoch}: {message}",
                self.what
            ))),
        }
    }
}

/// Numbers metric instances in construction order, which is the same on every rank,
/// so that the same metric has the same collective name everywhere.
static NEXT_METRIC: AtomicUsize = AtomicUsize::new(0);

/// A numeric metric averaged over all ranks: each batch's value is weighted by its
/// sample count on each rank, so the logged value is the one a single process would
/// compute on the global batch (for metrics that are means over samples: loss,
/// accuracy, …). Metrics that only produce a value at the end of the epoch (AUROC,
/// …) are averaged over ranks then, with equal weights.
///
/// Each update runs one small allreduce on Burn's metric thread. Build the metrics in
/// the same order on every rank (the collective names come from that order).
#[derive(Clone)]
pub struct GlobalMetric<Me> {
    kolo: Kolo,
    inner: Me,
    key: String,
    state: NumericMetricState,
    /// Whether `inner` has a value per batch (loss, accuracy) or only per epoch.
    per_batch: bool,
    epoch_value: Option<f64>,
}

impl<Me> std::fmt::Debug for GlobalMetric<Me> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlobalMetric")
            .field("key", &self.key)
            .field("per_batch", &self.per_batch)
            .finish_non_exhaustive()
    }
}

impl<Me: Metric> GlobalMetric<Me> {
    /// Averages `inner` over the ranks of `kolo`.
    pub fn new(kolo: &Kolo, inner: Me) -> Self {
        let n = NEXT_METRIC.fetch_add(1, Ordering::Relaxed);
        GlobalMetric {
            kolo: kolo.clone(),
            key: format!("kolo_burn.metric.{n}.{}", inner.name()),
            inner,
            state: NumericMetricState::new(),
            per_batch: false,
            epoch_value: None,
        }
    }

    fn format(&self) -> FormatOptions {
        let format = FormatOptions::new(self.inner.name()).precision(2);
        match self.inner.attributes() {
            MetricAttributes::Numeric(a) => match a.unit {
                Some(unit) => format.unit(&unit),
                None => format,
            },
            MetricAttributes::None => format,
        }
    }

    /// Sums `[weighted value, weight]` over the ranks.
    fn sum(&self, value: f64, weight: f64) -> Result<(f64, f64), TensorReadError> {
        let failed = |e: kolo::Error| {
            TensorReadError::Execution(ExecutionError::WithContext {
                reason: format!(
                    "averaging metric {} over the ranks (rank {}): {e}",
                    self.inner.name(),
                    self.kolo.rank()
                ),
            })
        };
        let t = Tensor::from_vec(vec![value * weight, weight], &[2]).map_err(failed)?;
        let s = self
            .kolo
            .allreduce(self.key.clone(), t)
            .op(ReduceOp::Sum)
            .wait()
            .and_then(|t| Ok(t.into_vec::<f64>()?))
            .map_err(failed)?;
        Ok((s[0], s[1]))
    }
}

impl<Me: Metric + Numeric> Metric for GlobalMetric<Me> {
    type Input = Me::Input;

    fn name(&self) -> MetricName {
        self.inner.name()
    }

    fn description(&self) -> Option<String> {
        self.inner.description()
    }

    fn attributes(&self) -> MetricAttributes {
        self.inner.attributes()
    }

    fn update(
        &mut self,
        item: &Self::Input,
        metadata: &MetricMetadata,
    ) -> Result<SerializedEntry, TensorReadError> {
        let entry = self.inner.update(item, metadata)?;
        // Epoch-level metrics have no value per batch: averaged in `compute`.
        let Some(local) = self.inner.value() else {
            return Ok(entry);
        };
        let (value, count) = match local {
            NumericEntry::Aggregated {
                aggregated_value,
                count,
            } => (aggregated_value, count),
            NumericEntry::Value(v) | NumericEntry::Final(v) => (v, 1),
        };
        self.per_batch = true;
        let (value, weight) = if count == 0 {
            (0.0, 0.0)
        } else {
            (value, count as f64)
        };
        let (sum, weight) = self.sum(value, weight)?;
        let global = if weight > 0.0 { sum / weight } else { f64::NAN };
        self.state.update(global, weight as usize);
        Ok(self.state.compute_update(self.format()))
    }

    fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
        self.inner.compute()?;
        if self.per_batch {
            return Ok(self.state.compute_final(self.format()));
        }
        // An epoch-level metric: its final value, averaged over the ranks.
        let (sum, n) = self.sum(self.inner.final_value().current(), 1.0)?;
        let value = sum / n;
        self.epoch_value = Some(value);
        Ok(SerializedEntry::new(
            format!("epoch {value:.2}"),
            NumericEntry::Final(value).serialize(),
        ))
    }

    fn clear(&mut self) {
        self.inner.clear();
        self.state.reset();
        self.epoch_value = None;
    }
}

impl<Me: Metric + Numeric> Numeric for GlobalMetric<Me> {
    fn value(&self) -> Option<NumericEntry> {
        if self.per_batch {
            Some(self.state.current_value())
        } else {
            self.epoch_value.map(NumericEntry::Value)
        }
    }

    fn running_value(&self) -> Option<NumericEntry> {
        if self.per_batch {
            Some(self.state.running_value())
        } else {
            self.epoch_value.map(NumericEntry::Value)
        }
    }

    fn final_value(&self) -> NumericEntry {
        match self.epoch_value {
            Some(v) if !self.per_batch => NumericEntry::Final(v),
            _ => self.state.final_value(),
        }
    }
}
