//! Rank-0 checkpoints that a crash cannot corrupt, and resuming from them on every rank.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use kolo::{Kolo, Progress};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

const FILE: &str = "checkpoint.kolo";
const MAGIC: &str = "kolo-burn checkpoint v3";
const MAGIC_V2: &str = "kolo-burn checkpoint v2";
const MAGIC_V1: &str = "kolo-burn checkpoint v1";

#[derive(Serialize, Deserialize)]
struct Checkpoint {
    magic: String,
    step: u64,
    model: Vec<u8>,
    optim: Vec<u8>,
    /// Where training stood ([`commit`]); `None` from [`save_checkpoint`].
    progress: Option<Progress>,
    /// The run that wrote it ([`kolo::run_id`]).
    run: Option<String>,
}

/// The format before run identities.
#[derive(Deserialize)]
struct CheckpointV2 {
    magic: String,
    step: u64,
    model: Vec<u8>,
    optim: Vec<u8>,
    progress: Option<Progress>,
}

/// The format before commits: read for files written by older versions.
#[derive(Deserialize)]
struct CheckpointV1 {
    magic: String,
    step: u64,
    model: Vec<u8>,
    optim: Vec<u8>,
}

/// What [`load_checkpoint`] restores.
pub struct Restored<M> {
    /// The model with the checkpoint's values and parameter ids.
    pub model: M,
    /// The optimizer with the checkpoint's state.
    pub optim: ModuleOptimizer,
    /// The step the checkpoint was taken at.
    pub step: u64,
    /// Where training stood, for a checkpoint written by [`commit`].
    pub progress: Option<Progress>,
    /// The run that wrote it ([`kolo::run_id`] then), if it had an identity.
    pub run: Option<String>,
}

impl<M> std::fmt::Debug for Restored<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restored")
            .field("step", &self.step)
            .field("progress", &self.progress)
            .field("run", &self.run)
            .finish_non_exhaustive()
    }
}

/// The checkpoint file inside `dir`.
pub fn checkpoint_path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Saves `model`, `optim` and `step` to `dir/checkpoint.kolo` on `kolo`'s rank 0, then
/// waits on every rank until the file is in place. The file is written to a temporary
/// name, flushed to disk and renamed over the old one, so a crash at any moment leaves
/// either the old checkpoint or the new one, never a torn file.
///
/// # Errors
/// Serialising or writing fails (on rank 0; the other ranks then fail the barrier
/// with an error naming rank 0 only if it shuts down).
pub fn save_checkpoint<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: &M,
    optim: &ModuleOptimizer,
    step: u64,
) -> Result<()> {
    write_checkpoint(kolo, dir, model, optim, step, None)
}

/// Commits the training state (issue 37's elastic training): `model`, `optim` and
/// where training stands (`progress`: epoch, samples of it consumed, step, seed,
/// ranks), written crash-safely to `dir/checkpoint.kolo` like [`save_checkpoint`].
/// Call it every few steps; after a failure, [`load_checkpoint`] on the relaunched
/// job gives it back in [`Restored::progress`], and
/// [`DistributedSampler::indices_from`](kolo::DistributedSampler::indices_from) goes on
/// with the samples the epoch has left, on as many ranks as the job now has.
/// [`kolo::restart_count`] tells a program that it was relaunched.
///
/// # Errors
/// As [`save_checkpoint`].
pub fn commit<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: &M,
    optim: &ModuleOptimizer,
    progress: &Progress,
) -> Result<()> {
    write_checkpoint(kolo, dir, model, optim, progress.step, Some(*progress))
}

/// [`save_checkpoint`] (`progress` None) and [`commit`] (Some).
pub(crate) fn write_checkpoint<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: &M,
    optim: &ModuleOptimizer,
    step: u64,
    progress: Option<Progress>,
) -> Result<()> {
    let parts = (kolo.rank() == 0).then(|| serialised(model.clone().into_record(), optim));
    write_parts(kolo, dir, parts, step, progress)
}

/// The model's record and the optimizer's state as a checkpoint stores them.
pub(crate) fn serialised(
    record: ModuleRecord,
    optim: &ModuleOptimizer,
) -> Result<(Vec<u8>, Vec<u8>)> {
    let err = |what| {
        move |e: burn::store::RecordError| Error::Record {
            what,
            message: e.to_string(),
        }
    };
    Ok((
        record
            .into_bytes()
            .map_err(err("serialising the model"))?
            .to_vec(),
        optim
            .into_bytes()
            .map_err(err("serialising the optimizer"))?
            .to_vec(),
    ))
}

/// Writes a checkpoint of the serialised model and optimizer `parts` (rank 0's; `None`
/// on the other ranks) and waits on every rank until it is in place.
pub(crate) fn write_parts(
    kolo: &Kolo,
    dir: &Path,
    parts: Option<Result<(Vec<u8>, Vec<u8>)>>,
    step: u64,
    progress: Option<Progress>,
) -> Result<()> {
    if let Some(parts) = parts {
        let (model, optim) = parts?;
        let ckpt = Checkpoint {
            magic: MAGIC.into(),
            step,
            model,
            optim,
            progress,
            run: kolo::run_id(),
        };
        let bytes = postcard::to_stdvec(&ckpt).map_err(|e| Error::Checkpoint {
            path: dir.to_path_buf(),
            message: e.to_string(),
        })?;
        write_atomically(dir, &bytes)?;
    }
    kolo.barrier()?;
    Ok(())
}

fn write_atomically(dir: &Path, bytes: &[u8]) -> Result<()> {
    write_named_atomically(dir, FILE, bytes)
}

/// Writes `bytes` to `dir/name` so that a crash leaves the old file or the new one:
/// a temporary file, flushed, renamed over the old one, the rename made durable.
/// Temporary files of earlier writes that were killed midway are removed first.
pub(crate) fn write_named_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(name);
    let prefix = format!(".{name}.tmp-");
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    let tmp = dir.join(format!("{prefix}{}", std::process::id()));
    let mut f = File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    drop(f);
    fs::rename(&tmp, &path).map_err(io(&path))?;
    // Make the rename itself durable.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(dir))?;
    Ok(())
}

/// Loads `dir/checkpoint.kolo` on rank 0 and broadcasts it, so every rank resumes from
/// the same state even without a shared filesystem. `Ok(None)` on every rank when
/// rank 0 has no checkpoint.
///
/// # Errors
/// The file exists but cannot be read or is not a kolo-burn checkpoint (reported on
/// every rank), or the broadcast fails.
pub fn load_checkpoint<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: M,
    optim: ModuleOptimizer,
) -> Result<Option<Restored<M>>> {
    let Some(mut raw) = read_parts(kolo, dir)? else {
        return Ok(None);
    };
    let model = model.load_record(raw.model_record()?);
    let optim = raw.optimizer(optim)?;
    Ok(Some(raw.restored(model, optim)))
}

/// A checkpoint as read, before its parts are applied.
pub(crate) struct Raw {
    path: PathBuf,
    ckpt: Checkpoint,
}

impl Raw {
    fn bad(&self, message: String) -> Error {
        Error::Checkpoint {
            path: self.path.clone(),
            message,
        }
    }

    /// The model's record (its bytes taken out of the checkpoint, not copied).
    pub(crate) fn model_record(&mut self) -> Result<ModuleRecord> {
        ModuleRecord::from_bytes(Bytes::from_bytes_vec(std::mem::take(&mut self.ckpt.model)))
            .map_err(|e| self.bad(e.to_string()))
    }

    /// `optim` holding the checkpoint's optimizer state (its bytes taken out, not
    /// copied).
    pub(crate) fn optimizer(&mut self, optim: ModuleOptimizer) -> Result<ModuleOptimizer> {
        optim
            .from_bytes(Bytes::from_bytes_vec(std::mem::take(&mut self.ckpt.optim)))
            .map_err(|e| self.bad(e.to_string()))
    }

    /// What [`load_checkpoint`] returns, with `model` and `optim` restored.
    pub(crate) fn restored<M>(self, model: M, optim: ModuleOptimizer) -> Restored<M> {
        Restored {
            model,
            optim,
            step: self.ckpt.step,
            progress: self.ckpt.progress,
            run: self.ckpt.run,
        }
    }
}

/// `dir`'s checkpoint, read on rank 0 and broadcast; `None` on every rank when rank 0
/// has none.
pub(crate) fn read_parts(kolo: &Kolo, dir: &Path) -> Result<Option<Raw>> {
    let path = checkpoint_path(dir);
    // Rank 0 sends Ok(bytes), Ok(empty) for "no checkpoint", or its error message.
    let mine: std::result::Result<Vec<u8>, String> = if kolo.rank() == 0 {
        match fs::read(&path) {
            Ok(b) => Ok(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e.to_string()),
        }
    } else {
        Ok(Vec::new())
    };
    let got = kolo.broadcast_object("kolo_burn.checkpoint", mine, 0)?;
    let bytes = got.map_err(|message| Error::Checkpoint {
        path: path.clone(),
        message: format!("rank 0 could not read it: {message}"),
    })?;
    if bytes.is_empty() {
        return Ok(None);
    }
    let ckpt = decode(&bytes).map_err(|message| Error::Checkpoint {
        path: path.clone(),
        message,
    })?;
    Ok(Some(Raw { path, ckpt }))
}

/// A checkpoint file's contents, in any format kolo-burn has written.
fn decode(bytes: &[u8]) -> std::result::Result<Checkpoint, String> {
    let first = match postcard::from_bytes::<Checkpoint>(bytes) {
        Ok(c) if c.magic == MAGIC => return Ok(c),
        first => first,
    };
    if let Ok(c) = postcard::from_bytes::<CheckpointV2>(bytes) {
        if c.magic == MAGIC_V2 {
            return Ok(Checkpoint {
                magic: c.magic,
                step: c.step,
                model: c.model,
                optim: c.optim,
                progress: c.progress,
                run: None,
            });
        }
    }
    if let Ok(c) = postcard::from_bytes::<CheckpointV1>(bytes) {
        if c.magic == MAGIC_V1 {
            return Ok(Checkpoint {
                magic: c.magic,
                step: c.step,
                model: c.model,
                optim: c.optim,
                progress: None,
                run: None,
            });
        }
    }
    Err(match first {
        Ok(c) => format!("unknown format {:?}", c.magic),
        Err(e) => format!("not a kolo-burn checkpoint ({e})"),
    })
}

/// Resumes the run from `dir`'s commit when it should, or starts it fresh: `Ok(None)`
/// to start from scratch, the restored state to go on from. `asked`: the user asked to
/// resume (a `--resume` flag), which takes any commit there. Otherwise the commit is
/// taken when it is this run's ([`kolo::run_id`]: kolorun's, or the Slurm job's, which
/// a requeued job keeps), and a relaunch ([`kolo::restart_count`] above 0, Slurm
/// requeues included) that finds none fails instead of starting over — unless the
/// run started in this directory and failed before its first commit (a fresh start
/// marks the directory, [`kolo::mark_run_started`]); another run's commit fails too,
/// naming both runs, instead of being loaded or overwritten
/// ([`kolo::resume_decision`]). The same decision on every rank (rank 0 reads).
///
/// # Errors
/// [`Error::Resume`] as above; the file cannot be read; the broadcast fails.
pub fn resume<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: M,
    optim: ModuleOptimizer,
    asked: bool,
) -> Result<Option<Restored<M>>> {
    let restored = load_checkpoint(kolo, dir, model, optim)?;
    let found = restored.as_ref().map(|r| r.run.as_deref());
    Ok(match goes_on(kolo, dir, found, asked)? {
        true => restored,
        false => None,
    })
}

/// [`resume`]'s decision on every rank of `kolo` alike, from the run of the commit
/// rank 0 found (`found`; see [`kolo::resume_decision`]) and whether rank 0 finds the
/// directory marked by this run. Starting from scratch (`false`), rank 0 marks it, so
/// that a relaunch before the first commit starts over instead of failing.
pub(crate) fn goes_on(
    kolo: &Kolo,
    dir: &Path,
    found: Option<Option<&str>>,
    asked: bool,
) -> Result<bool> {
    let started = kolo.rank() == 0 && kolo::run_started_in(dir);
    let started = kolo.broadcast_object("kolo_burn.resume.started", started, 0)?;
    if kolo::resume_decision(dir, found, asked, started)? {
        return Ok(true);
    }
    let marked = match kolo.rank() {
        0 => kolo::mark_run_started(dir).err().map(|e| e.to_string()),
        _ => None,
    };
    match kolo.broadcast_object("kolo_burn.resume.marked", marked, 0)? {
        Some(message) => Err(Error::Checkpoint {
            path: dir.to_path_buf(),
            message: format!("rank 0 cannot mark the directory as this run's: {message}"),
        }),
        None => Ok(false),
    }
}
