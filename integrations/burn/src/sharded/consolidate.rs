//! The sharded optimizer's state as the plain optimizer holds it, and back: what makes
//! a checkpoint written at N ranks resume at M ranks, or without sharding.
//!
//! A `ModuleOptimizer` keeps its state per parameter, keyed by the parameter's id: for
//! an element-wise optimizer, tensors `"{id}.{field}"` of the parameter's shape
//! (Adam's moments, momentum, …) and scalars `"{id}.{key}"` (a step count, the
//! parameter's rank). The sharded optimizer's wrapped optimizer holds the same fields
//! for one 1-D parameter: this rank's range of the flat sequence. Both are read and
//! written through Burn's record format (burnpack), so no optimizer internals are
//! touched:
//! - [`ShardedOptimizer::consolidate`] all-gathers each field over the ranks (the
//!   ranges tile the flat sequence in rank order) and cuts the result back into the
//!   parameters;
//! - [`ShardedOptimizer::load_consolidated`] flattens each field of the parameters in
//!   module order and keeps this rank's range.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn_pack::{Bytes, DType, Reader, Scalar, Writer};

use super::{Plan, ShardedOptimizer};
use crate::error::{Error, Result};

/// The scalar every parameter's state carries: its tensor rank (Burn's `__rank`).
const RANK_KEY: &str = "__rank";

/// A state tensor: its dtype, shape and values (f32 only; empty for other dtypes).
type StateTensor = (DType, Vec<usize>, Vec<f32>);

/// One optimizer record, read apart: tensors by (parameter id, field), and scalars.
struct Parts {
    tensors: BTreeMap<(u64, String), StateTensor>,
    scalars: BTreeMap<String, Scalar>,
}

pub(super) fn record_error(what: &'static str) -> impl Fn(String) -> Error {
    move |message| Error::Record { what, message }
}

/// An optimizer record as burnpack holds it: its tensors and its scalars.
pub(super) struct Record {
    pub(super) tensors: Vec<burn_pack::Tensor>,
    pub(super) scalars: BTreeMap<String, Scalar>,
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
    let tensors = reader.into_tensors().map_err(|e| err(e.to_string()))?;
    Ok(Record { tensors, scalars })
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
    let bytes = writer.into_bytes().map_err(|e| err(e.to_string()))?;
    like.clone()
        .from_bytes(bytes)
        .map_err(|e| err(e.to_string()))
}

/// `optim`'s state, read apart (through its burnpack bytes).
fn parts(optim: &ModuleOptimizer, what: &'static str) -> Result<Parts> {
    let err = record_error(what);
    let Record {
        tensors: read_tensors,
        scalars,
    } = read(optim, what)?;
    let mut tensors = BTreeMap::new();
    for t in read_tensors {
        let (name, dtype, shape, id, bytes) = t.into_parts().map_err(|e| err(e.to_string()))?;
        let Some(id) = id else { continue };
        let field = name
            .strip_prefix(&format!("{id}."))
            .unwrap_or(&name)
            .to_string();
        let values = if dtype == DType::F32 {
            bytemuck::pod_collect_to_vec::<u8, f32>(&bytes)
        } else {
            Vec::new()
        };
        tensors.insert((id, field), (dtype, shape.to_vec(), values));
    }
    Ok(Parts { tensors, scalars })
}

/// A `ModuleOptimizer` like `like` (same optimizer and settings) holding `tensors`
/// (id, field, shape, values) and `scalars`.
fn assemble(
    like: &ModuleOptimizer,
    tensors: Vec<(u64, String, Vec<usize>, Vec<f32>)>,
    scalars: BTreeMap<String, Scalar>,
    what: &'static str,
) -> Result<ModuleOptimizer> {
    let tensors = tensors
        .into_iter()
        .map(|(id, field, dims, values)| {
            let bytes = Bytes::from_bytes_vec(bytemuck::cast_slice(&values).to_vec());
            burn_pack::Tensor::new(format!("{id}.{field}"), DType::F32, dims, Some(id), bytes)
        })
        .collect();
    write(like, Record { tensors, scalars }, what)
}

/// The scalars stored under `from.` renamed to `to.`, the parameter's rank set to
/// `rank`.
fn rename_scalars(
    scalars: &BTreeMap<String, Scalar>,
    from: u64,
    to: u64,
    rank: usize,
    out: &mut BTreeMap<String, Scalar>,
) {
    let prefix = format!("{from}.");
    for (k, v) in scalars {
        if let Some(key) = k.strip_prefix(&prefix) {
            let v = if key == RANK_KEY {
                Scalar::from(rank)
            } else {
                *v
            };
            out.insert(format!("{to}.{key}"), v);
        }
    }
}

impl ShardedOptimizer {
    /// The whole optimizer state, as the plain (unsharded) optimizer stepping `model`
    /// would hold it: every rank's share all-gathered and cut back into the model's
    /// parameters. Save it with [`save_checkpoint`](crate::save_checkpoint) or
    /// [`commit`](crate::commit); [`load_consolidated`](Self::load_consolidated) takes
    /// it back at any number of ranks, and the plain optimizer loads it as its own.
    /// Every rank calls it (a collective); each briefly holds the whole state.
    ///
    /// Before the first step there is no state: the result holds none.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on every rank when the wrapped optimizer keeps state
    /// that is not one value per element (it then cannot be sharded either);
    /// [`Error::Record`] when Burn cannot read or write the record; a failed
    /// collective.
    pub fn consolidate<M: Module>(&mut self, model: &M) -> Result<ModuleOptimizer> {
        let plan = self.plan_for(model)?;
        if plan.owners.is_some() {
            return self.consolidate_by_tensors();
        }
        let sid = self.shard_id.val();
        let mut mine = parts(&self.inner, "ShardedOptimizer::consolidate")?;
        // What this rank holds: (field, dtype, shape) in name order.
        let fields: Vec<(String, String, Vec<usize>)> = mine
            .tensors
            .iter()
            .filter(|((id, _), _)| *id == sid)
            .map(|((_, f), (dtype, dims, _))| (f.clone(), format!("{dtype:?}"), dims.clone()))
            .collect();
        let all: Vec<Vec<(String, String, Vec<usize>)>> = self
            .kolo
            .allgather_object(format!("{}.state.fields", self.prefix), fields.clone())?;
        check_fields(&all, &plan, self.kolo.size())?;
        let mut tensors = Vec::new();
        for (field, _, _) in &fields {
            let values = mine
                .tensors
                .remove(&(sid, field.clone()))
                .map(|(_, _, v)| v)
                .unwrap_or_default();
            let len = values.len();
            let whole = self
                .kolo
                .allgather(
                    format!("{}.state.{field}", self.prefix),
                    kolo::Tensor::from_vec(values, &[len])?,
                )
                .wait()?
                .into_vec::<f32>()?;
            for (slot, &start) in plan.layout.slots.iter().zip(&plan.offsets) {
                let n: usize = slot.dims.iter().product();
                let part = whole.get(start..start + n).unwrap_or_default().to_vec();
                tensors.push((slot.id.val(), field.clone(), slot.dims.clone(), part));
            }
        }
        // Every parameter gets the shard's scalars (none before the first step).
        let mut scalars = BTreeMap::new();
        for slot in &plan.layout.slots {
            rename_scalars(
                &mine.scalars,
                sid,
                slot.id.val(),
                slot.dims.len(),
                &mut scalars,
            );
        }
        assemble(
            &self.inner,
            tensors,
            scalars,
            "ShardedOptimizer::consolidate",
        )
    }

    /// Takes this rank's share of `full`, the whole state as the plain optimizer holds
    /// it ([`consolidate`](Self::consolidate)'s result, or a plain optimizer's own,
    /// e.g. from [`load_checkpoint`](crate::load_checkpoint)) for `model`'s parameters
    /// — at any number of ranks: the range is this job's. Every rank calls it (the
    /// partition is agreed on first use). A `full` without state (before any step)
    /// leaves this optimizer without state.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on every rank when `full` does not hold the same
    /// element-wise fields for every parameter of `model` (another model, or an
    /// optimizer whose state is not one value per element); [`Error::Record`]; a
    /// failed collective.
    pub fn load_consolidated<M: Module>(
        &mut self,
        model: &M,
        full: &ModuleOptimizer,
    ) -> Result<()> {
        const WHAT: &str = "ShardedOptimizer::load_consolidated";
        let plan = self.plan_for(model)?;
        if let Some(owners) = &plan.owners {
            return self.load_by_tensors(&plan, owners, full);
        }
        let full = parts(full, WHAT)?;
        let slots = &plan.layout.slots;
        let fields_of = |id: u64| -> Vec<&String> {
            full.tensors
                .keys()
                .filter(|(i, _)| *i == id)
                .map(|(_, f)| f)
                .collect()
        };
        let first = slots.first().map(|s| s.id.val());
        // The fields the state holds for any parameter: each of the model's must hold
        // them all (none at all: no state yet).
        let fields: Vec<String> = full
            .tensors
            .keys()
            .map(|(_, f)| f.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        // Every check looks at every parameter, so every rank reaches the same verdict.
        for slot in slots {
            let id = slot.id.val();
            let have: Vec<&String> = fields_of(id);
            if have.iter().copied().ne(fields.iter()) {
                return Err(Error::InvalidArgument {
                    what: WHAT,
                    message: format!(
                        "the optimizer state holds {have:?} for parameter {:?} (id {id}) where it holds \
                         {fields:?} for others: is it the state of this model (loaded with its ids, \
                         e.g. by load_checkpoint)?",
                        slot.path
                    ),
                });
            }
            for f in &fields {
                if let Some((dtype, dims, _)) = full.tensors.get(&(id, f.clone())) {
                    if *dtype != DType::F32 || *dims != slot.dims {
                        return Err(Error::InvalidArgument {
                            what: WHAT,
                            message: format!(
                                "state {f:?} of parameter {:?} is {dtype:?} {dims:?}; the sharded optimizer \
                                 takes f32 state of the parameter's shape {:?}",
                                slot.path, slot.dims
                            ),
                        });
                    }
                }
            }
        }
        let sid = self.shard_id.val();
        let parts = plan.parts();
        let mut tensors = Vec::new();
        for f in &fields {
            let mut values = Vec::with_capacity(plan.range.len());
            for part in &parts {
                let id = slots[part.param].id.val();
                if let Some((_, _, v)) = full.tensors.get(&(id, f.clone())) {
                    values.extend_from_slice(v.get(part.in_param.clone()).unwrap_or_default());
                }
            }
            tensors.push((sid, f.clone(), vec![values.len()], values));
        }
        let mut scalars = BTreeMap::new();
        if let Some(first) = first {
            rename_scalars(&full.scalars, first, sid, 1, &mut scalars);
        }
        self.inner = assemble(&self.inner, tensors, scalars, WHAT)?;
        Ok(())
    }
}

/// Every rank holds the same fields, each f32 and one value per element of its range.
fn check_fields(all: &[Vec<(String, String, Vec<usize>)>], plan: &Plan, size: usize) -> Result<()> {
    let names = |r: usize| all[r].iter().map(|(f, _, _)| f.clone()).collect::<Vec<_>>();
    for (rank, fields) in all.iter().enumerate() {
        if names(rank) != names(0) {
            return Err(Error::InvalidArgument {
                what: "ShardedOptimizer::consolidate",
                message: format!(
                    "rank 0 holds optimizer state {:?}, rank {rank} {:?}: were the ranks stepped the same?",
                    names(0),
                    names(rank)
                ),
            });
        }
        let len = super::range_of(plan.total, size, rank).len();
        if let Some((f, dtype, dims)) = fields
            .iter()
            .find(|(_, dtype, dims)| dtype != "F32" || *dims != [len])
        {
            return Err(Error::InvalidArgument {
                what: "ShardedOptimizer::consolidate",
                message: format!(
                    "rank {rank} holds state {f:?} as {dtype} {dims:?}, not one f32 per element of its \
                     range of {len}: the wrapped optimizer's state is not element-wise"
                ),
            });
        }
    }
    Ok(())
}
