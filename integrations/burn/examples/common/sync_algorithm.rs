//! `train_digits --algorithm NAME`: how a data-parallel step synchronises the ranks
//! (issue 57) — a gradient reducer (allreduce, bytegrad, adasum), local steps and a
//! weight exchange (decentralized, decentralized-8bit, async), or an optimizer of its
//! own (onebit-adam, qadam) — and that algorithm's per-rank state in a checkpoint
//! directory.
//!
//! The per-rank state (error-feedback residuals, the neighbours' weight copies, the
//! round count) differs between ranks, so each rank writes its own file,
//! `algorithm/rank-R-of-N-step-S.json`, before the step's commit; on resume each rank
//! reads the file of the committed step. The weight-exchanging algorithms leave each
//! rank with its own weights and optimizer state, which the commit (rank 0's) does not
//! hold: each rank also writes its model's record and its optimizer's state beside
//! its algorithm state (`….model`, `….optim`) and takes them back on resume, so that a
//! resumed run trains bit for bit what an uninterrupted one does. A job resumed at another number of ranks
//! starts the algorithm's state afresh (rank 0 says so): the neighbours and
//! partitions it described no longer exist.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use kolo::algorithms::{AsyncPeriod, AveragerState, OneBitAdamConfig, OneBitState};
use kolo::{Algorithm, Kolo};
use kolo_burn::{GradientReducer, OneBitAdam, WeightAverager};

/// The synchronisation of one training run.
pub(crate) enum Synchroniser {
    /// Gradients reduced, then the plain optimizer steps.
    Reducer(GradientReducer),
    /// The plain optimizer steps on this rank's gradients, then weights are exchanged.
    Averager(WeightAverager),
    /// 1-bit Adam or QAdam: optimizer and synchronisation in one.
    Optimizer(OneBitAdam),
}

impl Synchroniser {
    /// The synchronisation for `algorithm` (`warmup`: 1-bit Adam's and QAdam's plain
    /// steps; `period`: async averaging's steps between rounds).
    pub(crate) fn new(
        kolo: &Kolo,
        algorithm: Algorithm,
        compress_on_one_host: bool,
        warmup: u64,
        period: u64,
    ) -> anyhow::Result<Self> {
        let config = OneBitAdamConfig {
            warmup,
            ..Default::default()
        };
        Ok(match algorithm {
            Algorithm::OneBitAdam => Synchroniser::Optimizer(OneBitAdam::new(kolo, config)),
            Algorithm::QAdam => Synchroniser::Optimizer(OneBitAdam::qadam(kolo, config)),
            a if a.exchanges_weights() => Synchroniser::Averager(
                WeightAverager::new(kolo, a)?.period(AsyncPeriod::Steps(period.max(1))),
            ),
            a => Synchroniser::Reducer(
                GradientReducer::new(kolo)
                    .algorithm(a)
                    .hierarchical(!compress_on_one_host),
            ),
        })
    }

    /// One training step from this rank's gradients; `local` is the plain optimizer's
    /// step (not used by 1-bit Adam and QAdam).
    pub(crate) fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
        local: impl FnOnce(M, GradientsParams) -> M,
    ) -> kolo_burn::Result<M> {
        match self {
            Synchroniser::Reducer(r) => {
                let grads = r.reduce(&model, grads)?;
                Ok(local(model, grads))
            }
            Synchroniser::Averager(a) => a.after_step(local(model, grads)),
            Synchroniser::Optimizer(o) => o.step(lr, model, grads),
        }
    }

    /// Completes the exchange before an evaluation, a commit or the end (async
    /// averaging's rounds in flight; a collective).
    pub(crate) fn finish<M: Module>(&mut self, model: M) -> kolo_burn::Result<M> {
        match self {
            Synchroniser::Averager(a) => a.finish(model),
            _ => Ok(model),
        }
    }

    /// This rank's state as JSON (none for a reducer).
    fn state(&self) -> anyhow::Result<Option<String>> {
        Ok(match self {
            Synchroniser::Reducer(_) => None,
            Synchroniser::Averager(a) => Some(serde_json::to_string(a.state())?),
            Synchroniser::Optimizer(o) => Some(serde_json::to_string(o.state())?),
        })
    }

    fn set_state(&mut self, json: &str) -> anyhow::Result<()> {
        match self {
            Synchroniser::Reducer(_) => {}
            Synchroniser::Averager(a) => a.set_state(serde_json::from_str::<AveragerState>(json)?),
            Synchroniser::Optimizer(o) => o.set_state(serde_json::from_str::<OneBitState>(json)?),
        }
        Ok(())
    }

    /// Writes this rank's state (and, for the weight exchanges, its model) for the
    /// commit of `step` (call [`finish`] first), replacing its older files.
    pub(crate) fn save<M: Module>(
        &self,
        dir: &Path,
        kolo: &Kolo,
        step: u64,
        model: &M,
        optim: &ModuleOptimizer,
    ) -> anyhow::Result<()> {
        let Some(json) = self.state()? else {
            return Ok(());
        };
        let folder = dir.join("algorithm");
        std::fs::create_dir_all(&folder)
            .with_context(|| format!("creating {}", folder.display()))?;
        let (rank, size) = (kolo.rank(), kolo.size());
        let path = file(dir, rank, size, step);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
        if matches!(self, Synchroniser::Averager(_)) {
            let files = [
                ("model", model.clone().into_record().into_bytes()?.to_vec()),
                ("optim", optim.into_bytes()?.to_vec()),
            ];
            for (ext, bytes) in files {
                let path = path.with_extension(ext);
                std::fs::write(&tmp, bytes)
                    .with_context(|| format!("writing {}", tmp.display()))?;
                std::fs::rename(&tmp, &path)
                    .with_context(|| format!("renaming to {}", path.display()))?;
            }
        }
        // Older steps' files of this rank (the commit of `step` may still fail: keep
        // the one before it).
        let mine = format!("rank-{rank}-of-{size}-step-");
        let mut older: Vec<(u64, PathBuf)> = std::fs::read_dir(&folder)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter_map(|p| {
                let name = p.file_name()?.to_str()?.to_string();
                let s = name.strip_prefix(&mine)?.split('.').next()?;
                Some((s.parse().ok()?, p))
            })
            .filter(|(s, _)| *s < step)
            .collect();
        older.sort();
        // The newest older step's files (json and model) stay.
        if let Some(keep) = older.last().map(|(s, _)| *s) {
            older.retain(|(s, _)| *s != keep);
        }
        for (_, p) in older {
            let _ = std::fs::remove_file(p);
        }
        Ok(())
    }

    /// Restores this rank's state (and its own model) of the committed `step`, if
    /// this job has the ranks it was saved on; otherwise the state starts afresh and
    /// every rank goes on from the commit's model.
    pub(crate) fn restore<M: Module>(
        &mut self,
        dir: &Path,
        kolo: &Kolo,
        step: u64,
        model: M,
        optim: ModuleOptimizer,
    ) -> anyhow::Result<(M, ModuleOptimizer)> {
        if matches!(self, Synchroniser::Reducer(_)) || step == 0 {
            return Ok((model, optim));
        }
        let path = file(dir, kolo.rank(), kolo.size(), step);
        let found = path.exists();
        // Every rank must agree: a state restored on some ranks only would pair
        // different rounds or copies.
        let all: Vec<bool> = kolo.allgather_object("train_digits.algorithm_state", found)?;
        if all.iter().all(|f| *f) {
            let json = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            self.set_state(&json)
                .with_context(|| format!("restoring {}", path.display()))?;
            if kolo.rank() == 0 {
                println!("restored the algorithm's state of step {step} on every rank");
            }
            if matches!(self, Synchroniser::Averager(_)) {
                let read = |ext: &str| {
                    let path = path.with_extension(ext);
                    std::fs::read(&path)
                        .map(burn::tensor::Bytes::from_bytes_vec)
                        .with_context(|| format!("reading {}", path.display()))
                };
                let record = burn::store::ModuleRecord::from_bytes(read("model")?)
                    .context("reading this rank's model record")?;
                let optim = optim
                    .from_bytes(read("optim")?)
                    .context("reading this rank's optimizer state")?;
                return Ok((model.load_record(record), optim));
            }
        } else if kolo.rank() == 0 {
            println!(
                "the algorithm's state of step {step} is not there for this job's {} ranks: \
                 it starts afresh",
                kolo.size()
            );
        }
        Ok((model, optim))
    }
}

fn file(dir: &Path, rank: usize, size: usize, step: u64) -> PathBuf {
    dir.join("algorithm")
        .join(format!("rank-{rank}-of-{size}-step-{step}.json"))
}
