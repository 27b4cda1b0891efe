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
const MAGIC: &str = "kolo-burn checkpoint v2";
const MAGIC_V1: &str = "kolo-burn checkpoint v1";

#[derive(Serialize, Deserialize)]
struct Checkpoint {
    magic: String,
    step: u64,
    model: Vec<u8>,
    optim: Vec<u8>,
    /// Where training stood ([`commit`]); `None` from [`save_checkpoint`].
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
}

impl<M> std::fmt::Debug for Restored<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restored")
            .field("step", &self.step)
            .field("progress", &self.progress)
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
    if kolo.rank() == 0 {
        let record = |e: burn::store::RecordError, what| Error::Record {
            what,
            message: e.to_string(),
        };
        let ckpt = Checkpoint {
            magic: MAGIC.into(),
            step,
            model: model
                .clone()
                .into_record()
                .into_bytes()
                .map_err(|e| record(e, "serialising the model"))?
                .to_vec(),
            optim: optim
                .into_bytes()
                .map_err(|e| record(e, "serialising the optimizer"))?
                .to_vec(),
            progress,
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
pub(crate) fn write_named_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
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
    let bad = |message: String| Error::Checkpoint {
        path: path.clone(),
        message,
    };
    let ckpt: Checkpoint = match postcard::from_bytes::<Checkpoint>(&bytes) {
        Ok(c) if c.magic == MAGIC => c,
        first => match postcard::from_bytes::<CheckpointV1>(&bytes) {
            Ok(c) if c.magic == MAGIC_V1 => Checkpoint {
                magic: c.magic,
                step: c.step,
                model: c.model,
                optim: c.optim,
                progress: None,
            },
            _ => {
                return Err(bad(match first {
                    Ok(c) => format!("unknown format {:?}", c.magic),
                    Err(e) => format!("not a kolo-burn checkpoint ({e})"),
                }))
            }
        },
    };
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(ckpt.model))
        .map_err(|e| bad(e.to_string()))?;
    let model = model.load_record(record);
    let optim = optim
        .from_bytes(Bytes::from_bytes_vec(ckpt.optim))
        .map_err(|e| bad(e.to_string()))?;
    Ok(Some(Restored {
        model,
        optim,
        step: ckpt.step,
        progress: ckpt.progress,
    }))
}
