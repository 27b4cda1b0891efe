//! Checkpoints of models made of [`FullyShard`](super::FullyShard) units: the same
//! whole-model file [`save_checkpoint`](crate::save_checkpoint) writes (the model's
//! record and the optimizer state as plain Burn holds them), so that a checkpoint
//! written at N ranks loads at M ranks, and into a plain unsharded model with
//! [`load_checkpoint`](crate::load_checkpoint).

use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::tensor::Tensor;
use kolo::{Kolo, Progress};

use super::record::{block_of, consolidated_record, load_fully_sharded};
use crate::checkpoint::{goes_on, read_parts, serialised, write_parts, Restored};
use crate::error::{Error, Result};
use crate::layout::{trains, Slot};
use crate::ShardedOptimizer;

/// Saves `model` (made of [`FullyShard`](super::FullyShard) units) and `optim` (the
/// plain Burn optimizer stepping it) to `dir/checkpoint.kolo` as one whole-model
/// checkpoint: the parameters gathered ([`consolidated_record`]) and the optimizer
/// state gathered into the whole parameters' state, written by rank 0 crash-safely
/// as [`save_checkpoint`](crate::save_checkpoint) does. Collective. Every rank briefly
/// holds one whole parameter (and one whole state field) beyond its share; rank 0
/// holds the whole model and state while writing.
///
/// # Errors
/// [`Error::InvalidArgument`] when a float parameter of `model` is not part of a unit
/// or the optimizer's state is not one value per element; a failed collective;
/// serialising or writing fails (on rank 0).
pub fn save_fully_sharded<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: &M,
    optim: &ModuleOptimizer,
    step: u64,
) -> Result<()> {
    write_fully_sharded(kolo, dir, model, optim, step, None)
}

/// [`commit`](crate::commit) for a model made of units: [`save_fully_sharded`] with
/// where training stands, which [`resume_fully_sharded`] gives back at any number of
/// ranks.
///
/// # Errors
/// As [`save_fully_sharded`].
pub fn commit_fully_sharded<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: &M,
    optim: &ModuleOptimizer,
    progress: &Progress,
) -> Result<()> {
    write_fully_sharded(kolo, dir, model, optim, progress.step, Some(*progress))
}

/// [`resume`](crate::resume) for a model made of units: this run's commit (any with
/// `asked`), loaded as [`load_fully_sharded_checkpoint`] does, or `None` to start
/// fresh, decided alike on every rank.
///
/// # Errors
/// As [`resume`](crate::resume) and [`load_fully_sharded_checkpoint`].
pub fn resume_fully_sharded<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: M,
    optim: ModuleOptimizer,
    asked: bool,
) -> Result<Option<Restored<M>>> {
    let restored = load_fully_sharded_checkpoint(kolo, dir, model, optim)?;
    let found = restored.as_ref().map(|r| r.run.as_deref());
    Ok(match goes_on(kolo, dir, found, asked)? {
        true => restored,
        false => None,
    })
}

fn write_fully_sharded<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: &M,
    optim: &ModuleOptimizer,
    step: u64,
    progress: Option<Progress>,
) -> Result<()> {
    let slots = slots_of(kolo, model)?;
    let record = consolidated_record(kolo, model)?;
    let whole = ShardedOptimizer::over_blocks(kolo, optim.clone(), slots)?.consolidate_blocks()?;
    let parts = record.map(|record| serialised(record, &whole));
    write_parts(kolo, dir, parts, step, progress)
}

/// Loads `dir/checkpoint.kolo` (written by [`save_fully_sharded`] at any number of
/// ranks, or by [`save_checkpoint`](crate::save_checkpoint) from a plain model of the
/// same structure) into `model`, made of units at this job's rank count, and `optim`:
/// each rank takes its blocks of the parameters and of the optimizer state. `Ok(None)`
/// on every rank when there is no checkpoint.
///
/// # Errors
/// As [`load_checkpoint`](crate::load_checkpoint) and [`load_fully_sharded`]; a
/// parameter of `model` outside a unit; an optimizer state that is not this model's.
pub fn load_fully_sharded_checkpoint<M: Module>(
    kolo: &Kolo,
    dir: &Path,
    model: M,
    optim: ModuleOptimizer,
) -> Result<Option<Restored<M>>> {
    let Some(mut raw) = read_parts(kolo, dir)? else {
        return Ok(None);
    };
    let model = load_fully_sharded(kolo, model, raw.model_record()?)?;
    let whole = raw.optimizer(optim.clone())?;
    let slots = slots_of(kolo, &model)?;
    let optim = ShardedOptimizer::over_blocks(kolo, optim, slots)?.load_blocks(&whole)?;
    Ok(Some(raw.restored(model, optim)))
}

/// The whole shape of each trainable block of `model`, in module order, under the
/// block's id and path.
fn slots_of<M: Module>(kolo: &Kolo, model: &M) -> Result<Vec<Slot>> {
    struct Slots {
        size: usize,
        rank: usize,
        path: Vec<String>,
        slots: Vec<Slot>,
        outside: Option<String>,
    }
    impl ModuleVisitor for Slots {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let path = self.path.join(".");
            let dims = param.lazy_shape().to_vec();
            match block_of(param.id, &dims, self.size, self.rank) {
                Some(full) if trains(param) => self.slots.push(Slot {
                    id: param.id,
                    path,
                    dims: full.dims,
                    dtype: full.dtype,
                }),
                Some(_) => {}
                None => {
                    self.outside.get_or_insert(path);
                }
            }
        }
    }
    let mut v = Slots {
        size: kolo.size(),
        rank: kolo.rank(),
        path: Vec::new(),
        slots: Vec::new(),
        outside: None,
    };
    model.visit(&mut v);
    match v.outside {
        Some(path) => Err(Error::InvalidArgument {
            what: "save_fully_sharded",
            message: format!(
                "parameter {path:?} is not part of a FullyShard unit: wrap every layer with \
                 parameters in one (a checkpoint of units keeps each rank's blocks of the \
                 optimizer state, which a parameter outside the units does not have)"
            ),
        }),
        None => Ok(v.slots),
    }
}
