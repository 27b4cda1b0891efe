//! The engine's checkpoints, laid out as DeepSpeed's: `dir/<tag>/` holds the model and
//! optimizer (whole-model files, so a job resumes at any number of ranks: the sharded
//! optimizer's state consolidated, fully sharded units gathered) and the engine's own
//! state (steps, the loss scaler; the schedule follows from the steps), and
//! `dir/latest` names the last tag saved.

use std::path::Path;

use burn::module::Module;
use kolo::Progress;
use serde::{Deserialize, Serialize};

use super::{Engine, Held, Optim};
use crate::checkpoint::write_named_atomically;
use crate::error::{Error, Result};
use crate::LossScalerState;

/// The engine's own state in `dir/<tag>/engine.kolo`.
#[derive(Debug, Serialize, Deserialize)]
struct EngineState {
    steps: u64,
    skipped: u64,
    scaler: Option<LossScalerState>,
}

const STATE: &str = "engine.kolo";
const LATEST: &str = "latest";

impl<M: Module + 'static> Engine<M> {
    /// Saves the model, the optimizer state, the engine's steps and loss scale, and
    /// `progress` (where the data stands: the sampler's position, as
    /// [`commit`](crate::commit) keeps it) to `dir/<tag>/`, and `tag` to `dir/latest`.
    /// Call it at an accumulation boundary, on every rank (collective; rank 0 writes).
    ///
    /// # Errors
    /// Inside an accumulation window ([`Error::InvalidArgument`]); a failed
    /// collective; writing fails.
    pub fn save_checkpoint(&mut self, dir: &Path, tag: &str, progress: &Progress) -> Result<()> {
        if self.acc.is_some() {
            return Err(Error::InvalidArgument {
                what: "Engine::save_checkpoint",
                message: "inside a gradient accumulation window: save after step()".into(),
            });
        }
        let at = dir.join(tag);
        let progress = Progress {
            step: self.steps,
            ..*progress
        };
        let held = self.held.as_ref().ok_or_else(super::gone)?;
        match (held, &mut self.optim) {
            (Held::Whole(m), Optim::Reduced(_, optim)) => {
                crate::commit(&self.kolo, &at, m, optim, &progress)?
            }
            (Held::Whole(m), Optim::Sharded(sharded)) => {
                let whole = sharded.consolidate(m)?;
                crate::commit(&self.kolo, &at, m, &whole, &progress)?
            }
            (Held::Unit(u), Optim::Units(optim)) => {
                crate::commit_fully_sharded(&self.kolo, &at, &**u, optim, &progress)?
            }
            (Held::Whole(m), Optim::Units(optim)) => {
                crate::commit_fully_sharded(&self.kolo, &at, m, optim, &progress)?
            }
            _ => {}
        }
        if self.kolo.rank() == 0 {
            let state = EngineState {
                steps: self.steps,
                skipped: self.skipped,
                scaler: self.scaler.as_ref().map(crate::LossScaler::state),
            };
            let bytes = postcard::to_stdvec(&state).map_err(|e| Error::Checkpoint {
                path: at.clone(),
                message: e.to_string(),
            })?;
            write_named_atomically(&at, STATE, &bytes)?;
            write_named_atomically(dir, LATEST, tag.as_bytes())?;
        }
        self.kolo.barrier()?;
        Ok(())
    }

    /// Loads `dir/<tag>/` (`tag` None: the one `dir/latest` names) at this job's rank
    /// count: model, optimizer state, steps, loss scale; returns the saved
    /// [`Progress`], or `None` when there is no checkpoint. Collective.
    ///
    /// # Errors
    /// The files cannot be read or are not a checkpoint of this model; a failed
    /// collective.
    pub fn load_checkpoint(&mut self, dir: &Path, tag: Option<&str>) -> Result<Option<Progress>> {
        let tag = match tag {
            Some(t) => Some(t.to_string()),
            None => {
                let mine = (self.kolo.rank() == 0)
                    .then(|| std::fs::read_to_string(dir.join(LATEST)).ok())
                    .flatten()
                    .map(|t| t.trim().to_string());
                self.kolo
                    .broadcast_object("kolo_burn.engine.latest", mine, 0)?
            }
        };
        let Some(tag) = tag else {
            return Ok(None);
        };
        let at = dir.join(&tag);
        let held = self.held.take().ok_or_else(super::gone)?;
        let (held, outcome) = self.load_parts(&at, held);
        self.held = Some(held);
        let Some(progress) = outcome? else {
            return Ok(None);
        };
        let mine = if self.kolo.rank() == 0 {
            std::fs::read(at.join(STATE)).map_err(|e| e.to_string())
        } else {
            Ok(Vec::new())
        };
        let bytes = self
            .kolo
            .broadcast_object("kolo_burn.engine.state", mine, 0)?
            .map_err(|message| Error::Checkpoint {
                path: at.join(STATE),
                message,
            })?;
        let state: EngineState = postcard::from_bytes(&bytes).map_err(|e| Error::Checkpoint {
            path: at.join(STATE),
            message: e.to_string(),
        })?;
        self.steps = state.steps;
        self.skipped = state.skipped;
        if let (Some(s), Some(st)) = (&mut self.scaler, &state.scaler) {
            s.restore(st);
        }
        Ok(Some(progress))
    }

    /// The model and optimizer from `at`, into `held` and `self.optim`; the model back
    /// as it was when nothing is loaded.
    fn load_parts(&mut self, at: &Path, held: Held<M>) -> (Held<M>, Result<Option<Progress>>) {
        let kolo = self.kolo.clone();
        let progress = |p: Option<Progress>, step| {
            p.unwrap_or(Progress {
                step,
                ..Progress::default()
            })
        };
        match (held, &mut self.optim) {
            (Held::Whole(m), Optim::Reduced(_, optim)) => {
                match crate::load_checkpoint(&kolo, at, m.clone(), optim.clone()) {
                    Ok(Some(r)) => {
                        *optim = r.optim;
                        (Held::Whole(r.model), Ok(Some(progress(r.progress, r.step))))
                    }
                    Ok(None) => (Held::Whole(m), Ok(None)),
                    Err(e) => (Held::Whole(m), Err(e)),
                }
            }
            (Held::Whole(m), Optim::Sharded(sharded)) => {
                let fresh = sharded.inner().clone();
                let loaded = crate::load_checkpoint(&kolo, at, m.clone(), fresh).and_then(|r| {
                    r.map(|r| {
                        sharded.load_consolidated(&r.model, &r.optim)?;
                        Ok((r.model, progress(r.progress, r.step)))
                    })
                    .transpose()
                });
                match loaded {
                    Ok(Some((model, p))) => (Held::Whole(model), Ok(Some(p))),
                    Ok(None) => (Held::Whole(m), Ok(None)),
                    Err(e) => (Held::Whole(m), Err(e)),
                }
            }
            (Held::Unit(u), Optim::Units(optim)) => {
                match crate::load_fully_sharded_checkpoint(&kolo, at, (*u).clone(), optim.clone()) {
                    Ok(Some(r)) => {
                        *optim = r.optim;
                        (
                            Held::Unit(Box::new(r.model)),
                            Ok(Some(progress(r.progress, r.step))),
                        )
                    }
                    Ok(None) => (Held::Unit(u), Ok(None)),
                    Err(e) => (Held::Unit(u), Err(e)),
                }
            }
            (Held::Whole(m), Optim::Units(optim)) => {
                match crate::load_fully_sharded_checkpoint(&kolo, at, m.clone(), optim.clone()) {
                    Ok(Some(r)) => {
                        *optim = r.optim;
                        (Held::Whole(r.model), Ok(Some(progress(r.progress, r.step))))
                    }
                    Ok(None) => (Held::Whole(m), Ok(None)),
                    Err(e) => (Held::Whole(m), Err(e)),
                }
            }
            (held, _) => (held, Ok(None)),
        }
    }
}
