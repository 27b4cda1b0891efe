//! Start every rank from the same model and optimizer state.

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use kolo::Kolo;

use crate::error::{Error, Result};

/// Makes every rank's `module` equal to `root`'s: values and parameter ids (which Burn
/// draws at random per process). Call it on every rank before the first step.
///
/// # Errors
/// Serialising on the root or loading elsewhere fails, or the broadcast fails.
pub fn broadcast_parameters<M: Module>(kolo: &Kolo, module: M, root: usize) -> Result<M> {
    let bytes = if kolo.rank() == root {
        let record = module
            .clone()
            .into_record()
            .into_bytes()
            .map_err(|e| Error::Record {
                what: "serialising the module",
                message: e.to_string(),
            })?;
        record.to_vec()
    } else {
        Vec::new()
    };
    let bytes: Vec<u8> = kolo.broadcast_object("kolo_burn.parameters", bytes, root)?;
    if kolo.rank() == root {
        return Ok(module);
    }
    let record =
        ModuleRecord::from_bytes(Bytes::from_bytes_vec(bytes)).map_err(|e| Error::Record {
            what: "loading the root's module",
            message: e.to_string(),
        })?;
    Ok(module.load_record(record))
}

/// Makes every rank's optimizer state (e.g. Adam's moments) equal to `root`'s. Call
/// it after [`broadcast_parameters`], so that the parameter ids the state is keyed by
/// agree, and before the first step.
///
/// # Errors
/// Serialising on the root or loading elsewhere fails, or the broadcast fails.
pub fn broadcast_optimizer_state(
    kolo: &Kolo,
    optim: ModuleOptimizer,
    root: usize,
) -> Result<ModuleOptimizer> {
    let bytes = if kolo.rank() == root {
        optim
            .into_bytes()
            .map_err(|e| Error::Record {
                what: "serialising the optimizer state",
                message: e.to_string(),
            })?
            .to_vec()
    } else {
        Vec::new()
    };
    let bytes: Vec<u8> = kolo.broadcast_object("kolo_burn.optimizer_state", bytes, root)?;
    if kolo.rank() == root {
        return Ok(optim);
    }
    optim
        .from_bytes(Bytes::from_bytes_vec(bytes))
        .map_err(|e| Error::Record {
            what: "loading the root's optimizer state",
            message: e.to_string(),
        })
}
