//! Checkpoints of a pipeline: each stage's model and optimizer, written by the stage's
//! first replica, and a record of the last step every stage wrote.
//!
//! Layout: `dir/step-<n>/stage-<s>-of-<S>/checkpoint.kolo` per stage, and
//! `dir/pipeline.latest` (written by rank 0 once every stage has written step `n`)
//! naming `n` and `S`. A crash while saving leaves the previous step's files and
//! record in place, so a resume never mixes the stages of two steps; older steps are
//! removed only after the record moved on.

use std::fs;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use kolo::Progress;

use super::Pipeline;
use crate::checkpoint::{
    goes_on, load_checkpoint, write_checkpoint, write_named_atomically, Restored,
};
use crate::error::{Error, Result};

const LATEST: &str = "pipeline.latest";

impl Pipeline {
    /// The directory of this stage's checkpoint of `step` under `dir`.
    pub fn checkpoint_dir(&self, dir: &Path, step: u64) -> PathBuf {
        dir.join(format!("step-{step}"))
            .join(format!("stage-{}-of-{}", self.stage, self.stages))
    }

    /// Saves this stage's `model` and `optim` at `step` (each stage's first replica
    /// writes its own file, crash-safely), then, once every stage has, records `step`
    /// as the one to resume from and removes older steps. Every rank calls it.
    ///
    /// # Errors
    /// Writing fails (on the writing rank; the others fail the barrier only if it
    /// shuts down), or a collective fails.
    pub fn save_checkpoint<M: Module>(
        &self,
        dir: &Path,
        model: &M,
        optim: &ModuleOptimizer,
        step: u64,
    ) -> Result<()> {
        self.write(dir, model, optim, step, None)
    }

    /// Commits this stage's `model` and `optim` with where training stands
    /// (`progress`: epoch, samples of it consumed, step, …), as
    /// [`save_checkpoint`](Self::save_checkpoint) saves them at `progress.step`: every
    /// few steps, so that a relaunched job goes on from there
    /// ([`load_checkpoint`](Self::load_checkpoint) gives it back in
    /// [`Restored::progress`]). Every rank calls it.
    ///
    /// # Errors
    /// As [`save_checkpoint`](Self::save_checkpoint).
    pub fn commit<M: Module>(
        &self,
        dir: &Path,
        model: &M,
        optim: &ModuleOptimizer,
        progress: &Progress,
    ) -> Result<()> {
        self.write(dir, model, optim, progress.step, Some(progress))
    }

    fn write<M: Module>(
        &self,
        dir: &Path,
        model: &M,
        optim: &ModuleOptimizer,
        step: u64,
        progress: Option<&Progress>,
    ) -> Result<()> {
        let stage_dir = self.checkpoint_dir(dir, step);
        write_checkpoint(
            self.stage_kolo()?,
            &stage_dir,
            model,
            optim,
            step,
            progress.copied(),
        )?;
        if self.replica == 0 {
            // The new directories' entries are durable before the record names them
            // (save_checkpoint makes the file and its own directory durable).
            for d in [stage_dir.parent(), Some(dir)].into_iter().flatten() {
                fs::File::open(d)
                    .and_then(|f| f.sync_all())
                    .map_err(|source| Error::Io {
                        path: d.to_path_buf(),
                        source,
                    })?;
            }
        }
        // Every stage's file is in place before the record names the step.
        self.kolo.barrier()?;
        if self.kolo.rank() == 0 {
            let record = format!("step {step}\nstages {}\n", self.stages);
            write_named_atomically(dir, LATEST, record.as_bytes())?;
        }
        self.kolo.barrier()?;
        if self.replica == 0 {
            remove_older(dir, step, &stage_dir);
        }
        Ok(())
    }

    /// Resumes this stage from the last step every stage saved under `dir`
    /// ([`save_checkpoint`](Self::save_checkpoint)): `Ok(None)` on every rank when
    /// there is none. Every rank calls it.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] on every rank when the record cannot be read, was written
    /// by a pipeline of another number of stages, or a stage's file is missing or
    /// unreadable (naming the stage); [`Error::Kolo`] when a collective fails.
    pub fn load_checkpoint<M: Module>(
        &self,
        dir: &Path,
        model: M,
        optim: ModuleOptimizer,
    ) -> Result<Option<Restored<M>>> {
        let latest = if self.kolo.rank() == 0 {
            read_latest(dir)
        } else {
            Ok(None)
        };
        let latest = self
            .kolo
            .broadcast_object("kolo_burn.pipeline.latest", latest, 0)?;
        let fail = |message: String| Error::Checkpoint {
            path: dir.join(LATEST),
            message,
        };
        let step = match latest {
            Err(m) => return Err(fail(m)),
            Ok(None) => return Ok(None),
            Ok(Some((_, stages))) if stages != self.stages => {
                return Err(fail(format!(
                    "written by a pipeline of {stages} stages; this one has {}: resume \
                     with {stages} stages",
                    self.stages
                )))
            }
            Ok(Some((step, _))) => step,
        };
        let stage_dir = self.checkpoint_dir(dir, step);
        let mine = load_checkpoint(self.stage_kolo()?, &stage_dir, model, optim);
        let status = match &mine {
            Ok(Some(_)) => None,
            Ok(None) => Some(format!(
                "stage {}'s checkpoint of step {step} is missing: {}",
                self.stage,
                stage_dir.display()
            )),
            Err(e) => Some(format!("stage {}: {e}", self.stage)),
        };
        let all: Vec<Option<String>> = self
            .kolo
            .allgather_object("kolo_burn.pipeline.loaded", status)?;
        if let Some(why) = all.into_iter().flatten().next() {
            return Err(fail(why));
        }
        mine
    }
}

impl Pipeline {
    /// [`load_checkpoint`](Self::load_checkpoint) when the run should go on from
    /// `dir`'s last step, as [`crate::resume`] decides for one model: this run's
    /// commit (or any with `asked`, a `--resume` flag); a relaunch that finds none in
    /// a directory the run did not start in, or another run's commit, fails on every
    /// rank. `Ok(None)`: start from scratch (rank 0 marks the directory as this run's).
    ///
    /// # Errors
    /// [`Error::Resume`] as above; as [`load_checkpoint`](Self::load_checkpoint).
    pub fn resume<M: Module>(
        &self,
        dir: &Path,
        model: M,
        optim: ModuleOptimizer,
        asked: bool,
    ) -> Result<Option<Restored<M>>> {
        let restored = self.load_checkpoint(dir, model, optim)?;
        // Every stage wrote its step with the same run identity: rank 0's stage speaks
        // for all, so that every rank decides alike.
        let found = restored.as_ref().map(|r| r.run.clone());
        let found = self
            .kolo
            .broadcast_object("kolo_burn.pipeline.resume.found", found, 0)?;
        let found = found.as_ref().map(Option::as_deref);
        Ok(match goes_on(&self.kolo, dir, found, asked)? {
            true => restored,
            false => None,
        })
    }
}

/// The step and stage count `dir`'s record names; `None` without a record.
fn read_latest(dir: &Path) -> std::result::Result<Option<(u64, usize)>, String> {
    let path = dir.join(LATEST);
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read it: {e}")),
    };
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("not a kolo-burn pipeline record (no {name:?} line)"))
    };
    let step = field("step ")?;
    let stages = usize::try_from(field("stages ")?).map_err(|e| e.to_string())?;
    Ok(Some((step, stages)))
}

/// Removes this stage's checkpoints of steps other than `keep_step` (best effort: a
/// leftover costs disk, not correctness), and step directories left empty.
fn remove_older(dir: &Path, keep_step: u64, kept: &Path) {
    let Some(stage) = kept.file_name() else {
        return;
    };
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let keep = format!("step-{keep_step}");
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with("step-") || name == keep {
            continue;
        }
        let old = e.path().join(stage);
        if let Err(err) = fs::remove_dir_all(&old) {
            if err.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %old.display(), error = %err, "cannot remove an old pipeline checkpoint");
            }
        }
        // Empty once every stage removed its part.
        let _ = fs::remove_dir(e.path());
    }
}
