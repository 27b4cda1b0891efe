//! The optimizer record as burnpack holds it, read and written through Burn's public
//! record API: what the sharded optimizer's consolidation and its by-tensors state
//! read apart and assemble.

use std::collections::BTreeMap;

use burn::optim::ModuleOptimizer;
use burn_pack::{Bytes, Reader, Scalar, Writer};

use crate::error::{Error, Result};

pub(super) fn record_error(what: &'static str) -> impl Fn(String) -> Error {
    move |message| Error::Record { what, message }
}

/// An optimizer record as burnpack holds it: its tensors, its scalars, and each
/// parameter's module path by id (Burn keeps them as metadata, to bind parameter
/// groups again after a load: issue 53 item 3).
pub(super) struct Record {
    pub(super) tensors: Vec<burn_pack::Tensor>,
    pub(super) scalars: BTreeMap<String, Scalar>,
    pub(super) paths: BTreeMap<String, String>,
}

/// `optim`'s record, read through its burnpack bytes.
pub(super) fn read(optim: &ModuleOptimizer, what: &'static str) -> Result<Record> {
    read_bytes(record_bytes(optim, what)?, what)
}

/// `optim`'s record as burnpack bytes.
pub(super) fn record_bytes(optim: &ModuleOptimizer, what: &'static str) -> Result<Bytes> {
    optim
        .into_bytes()
        .map_err(|e| record_error(what)(e.to_string()))
}

/// A record from its burnpack bytes.
pub(super) fn read_bytes(bytes: Bytes, what: &'static str) -> Result<Record> {
    let err = record_error(what);
    let reader = Reader::from_bytes(bytes).map_err(|e| err(e.to_string()))?;
    let scalars = reader.scalars().clone();
    let paths = reader.metadata().clone();
    let tensors = reader.into_tensors().map_err(|e| err(e.to_string()))?;
    Ok(Record {
        tensors,
        scalars,
        paths,
    })
}

/// A `ModuleOptimizer` like `like` (same optimizer and settings) holding `record`.
pub(super) fn write(
    like: &ModuleOptimizer,
    record: Record,
    what: &'static str,
) -> Result<ModuleOptimizer> {
    let err = record_error(what);
    let mut writer = Writer::new(record.tensors);
    for (k, v) in &record.scalars {
        writer = writer.with_scalar(k, *v);
    }
    for (k, v) in &record.paths {
        writer = writer.with_metadata(k, v);
    }
    let bytes = writer.into_bytes().map_err(|e| err(e.to_string()))?;
    like.clone()
        .from_bytes(bytes)
        .map_err(|e| err(e.to_string()))
}

/// Whether `optim` holds any state tensors.
pub(super) fn has_state(optim: &ModuleOptimizer) -> bool {
    !optim.to_record().is_empty()
}

/// An optimizer like `optim` (same optimizers, groups and settings) without state.
pub(super) fn without_state(
    optim: &ModuleOptimizer,
    what: &'static str,
) -> Result<ModuleOptimizer> {
    let empty = Record {
        tensors: Vec::new(),
        scalars: BTreeMap::new(),
        paths: BTreeMap::new(),
    };
    write(optim, empty, what)
}
