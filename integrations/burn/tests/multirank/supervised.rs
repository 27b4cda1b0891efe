//! burn-train's `SupervisedTraining::launch` across ranks, end to end: sharded data
//! loaders, the fused reducer in `TrainStep::optimize`, metrics averaged over ranks,
//! rank 0 alone rendering and checkpointing, and a resume from rank 0's checkpoint.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{ensure, Result};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor};
use burn::train::logger::{InMemoryMetricLogger, MetricLogger};
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{AccuracyMetric, LossMetric, MetricDefinition, NumericEntry};
use burn::train::{Learner, SupervisedTraining};
use kolo::Kolo;
use kolo_burn::train::{last_checkpoint, shard, DistributedTraining, GlobalMetric, SilentRenderer};
use kolo_burn::{broadcast_parameters, GradientReducer};

use super::{samples, Net, Small};

/// Sample `i` of a synthetic dataset: the features of the other cases' samples, and a
/// class that depends on them (the quadrant of the first two), so there is something
/// to learn.
#[derive(Clone, Debug)]
struct Item(usize);

fn data(ids: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
    let (x, _) = samples(ids, device);
    let first = x.clone().narrow(1, 0, 1).greater_elem(0.0).int();
    let second = x.clone().narrow(1, 1, 1).greater_elem(0.0).int();
    let y = (first * 2 + second).flatten::<1>(0, 1);
    (x, y)
}

#[derive(Clone)]
struct ItemBatcher;

impl Batcher<Item, (Tensor<2>, Tensor<1, Int>)> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let parts: Vec<_> = items.iter().map(|i| data(i.0..i.0 + 1, device)).collect();
        let (x, y): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
        (Tensor::cat(x, 0), Tensor::cat(y, 0))
    }
}

/// Keeps what the Learner logs, for comparison across ranks.
struct Recorder {
    seen: Arc<Mutex<Vec<String>>>,
    inner: InMemoryMetricLogger,
}

impl MetricLogger for Recorder {
    fn log(&mut self, update: MetricsUpdate, epoch: usize, split: &Split) {
        if let Ok(mut seen) = self.seen.lock() {
            for u in &update.entries_numeric {
                seen.push(format!(
                    "{epoch} {split:?} {}",
                    u.entry.serialized_entry.serialized
                ));
            }
        }
        self.inner.log(update, epoch, split);
    }

    fn read_numeric(
        &mut self,
        name: &str,
        epoch: usize,
        split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        self.inner.read_numeric(name, epoch, split)
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        self.inner.log_metric_definition(definition);
    }

    fn log_epoch_summary(&mut self, summary: EpochSummary) {
        self.inner.log_epoch_summary(summary);
    }
}

const TRAIN: usize = 96;
const VALID: usize = 32;
const EPOCHS: usize = 4;

/// Mean loss of `net` over the whole training set.
fn full_loss(net: &Net, device: &Device) -> Result<f32> {
    let (x, y) = data(0..TRAIN, device);
    let loss = CrossEntropyLossConfig::new()
        .init(device)
        .forward(net.forward(x), y);
    Ok(loss.into_scalar::<f32>())
}

/// One launch of `SupervisedTraining` on every rank: `epochs` epochs, resuming from
/// `resume` when given. Returns the trained model and what the metric logger saw.
fn launch(
    k: &Kolo,
    dir: &Path,
    start: &Small,
    epochs: usize,
    resume: Option<usize>,
) -> Result<(Net, Vec<String>)> {
    let device = Device::flex().autodiff();
    let train: Vec<Item> = (0..TRAIN).map(Item).collect();
    let valid: Vec<Item> = (TRAIN..TRAIN + VALID).map(Item).collect();
    // No shuffle inside the shard: a resumed run sees the same batches as a straight one.
    let loader = |items: Vec<Item>, seed| {
        DataLoaderBuilder::new(ItemBatcher)
            .batch_size(8)
            .set_device(device.clone())
            .build(shard(k, InMemDataset::new(items), seed))
    };
    let (train, valid) = (loader(train, 7), loader(valid, 8));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut training = SupervisedTraining::new(dir, train, valid)
        .num_epochs(epochs)
        .metrics((
            GlobalMetric::new(k, LossMetric::new()),
            GlobalMetric::new(k, AccuracyMetric::new()),
        ))
        .with_metric_logger(Recorder {
            seen: seen.clone(),
            inner: InMemoryMetricLogger::new(),
        })
        .with_application_logger(None)
        // Quiet test output on rank 0 too; `distributed` silences the other ranks.
        .renderer(Box::new(SilentRenderer))
        .distributed(k)
        .with_distributed_checkpointers(k, dir);
    if let Some(epoch) = resume {
        training = training.checkpoint(epoch);
    }
    let net = Net::from_small(
        start.clone(),
        Some(GradientReducer::new(k).prefix("supervised")),
    );
    let result = training.launch(Learner::new(net, AdamConfig::new().init(), 0.05));
    let seen = seen.lock().map(|s| s.clone()).unwrap_or_default();
    Ok((result.model, seen))
}

/// A directory of this rank's own, as on machines without a shared file system: a
/// resume then works only if rank 0's checkpoint reaches the others through kolo.
fn own_dir(k: &Kolo, tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "kolo-burn-{tag}-{}-rank{}",
        std::process::id(),
        k.rank()
    ))
}

/// The files under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap_or(&p).display().to_string());
            }
        }
    }
    out
}

fn same_on_every_rank(k: &Kolo, what: &str, p: &[f32]) -> Result<()> {
    let bits: Vec<u32> = p.iter().map(|x| x.to_bits()).collect();
    let all: Vec<Vec<u32>> = k.allgather_object(format!("supervised.{what}"), bits)?;
    ensure!(all.iter().all(|b| b == &all[0]), "{what}: ranks differ");
    Ok(())
}

/// `EPOCHS` epochs from rank 0's weights: every rank ends with the same weights, the loss
/// over the whole training set falls, every rank logged the same (global) metric
/// values, only rank 0 wrote anything (checkpoints, logs), and resuming from rank 0's
/// checkpoint half-way gives the weights of the straight run on every rank, although
/// only rank 0 has the files.
pub(crate) fn supervised(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let straight_dir = own_dir(k, "straight");
    let resumed_dir = own_dir(k, "resumed");

    let before = full_loss(&Net::from_small(start.clone(), None), &device)?;
    let (straight, seen) = launch(k, &straight_dir, &start, EPOCHS, None)?;
    let after = full_loss(&straight, &device)?;
    ensure!(
        after < 0.8 * before,
        "loss did not fall: {before} before, {after} after {EPOCHS} epochs"
    );
    same_on_every_rank(k, "weights", &straight.params())?;

    ensure!(!seen.is_empty(), "no metric was logged");
    let all: Vec<Vec<String>> = k.allgather_object("supervised.metrics", seen.clone())?;
    ensure!(
        all.iter().all(|s| s == &all[0]),
        "ranks logged different metric values: rank 0 {:?}, rank 1 {:?}",
        all[0].iter().take(4).collect::<Vec<_>>(),
        all.get(1).map(|s| s.iter().take(4).collect::<Vec<_>>())
    );

    let files = files_under(&straight_dir);
    if k.rank() == 0 {
        for what in ["model", "optim", "scheduler"] {
            ensure!(
                files
                    .iter()
                    .any(|f| f.starts_with(&format!("checkpoint/{what}"))),
                "rank 0 wrote no {what} checkpoint: {files:?}"
            );
        }
    } else {
        ensure!(files.is_empty(), "rank {} wrote {files:?}", k.rank());
    }

    ensure!(
        last_checkpoint(k, &resumed_dir)?.is_none(),
        "a checkpoint found before any training"
    );
    launch(k, &resumed_dir, &start, EPOCHS / 2, None)?;
    // A relaunched job finds where to go on (every rank, from rank 0's files).
    let found = last_checkpoint(k, &resumed_dir)?;
    ensure!(
        found == Some(EPOCHS / 2),
        "last_checkpoint: {found:?}, want {}",
        EPOCHS / 2
    );
    // Resumed from other weights: only the checkpoint can bring back the straight run's.
    let other = broadcast_parameters(k, Small::new(&device), 0)?;
    let (resumed, _) = launch(k, &resumed_dir, &other, EPOCHS, found)?;
    same_on_every_rank(k, "resumed weights", &resumed.params())?;
    super::assert_close(
        "resumed vs straight",
        &resumed.params(),
        &straight.params(),
        1e-6,
    )?;

    for dir in [straight_dir, resumed_dir] {
        if dir.exists() {
            std::fs::remove_dir_all(dir)?;
        }
    }
    Ok(())
}
