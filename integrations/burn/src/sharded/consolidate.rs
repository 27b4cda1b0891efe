//! The sharded optimizer's state as the plain optimizer holds it, and back: what makes
//! a checkpoint written at N ranks resume at M ranks, or without sharding.
//!
//! A `ModuleOptimizer` keeps its state per parameter, keyed by the parameter's id: for
//! an element-wise optimizer, tensors `"{id}.{field}"` of the parameter's shape
//! (Adam's moments, momentum, …) and scalars `"{id}.{key}"` (a step count, the
//! parameter's rank). The sharded optimizer's wrapped optimizer holds the same fields
//! for 1-D parameters: this rank's block of each parameter. Both are read and written
//! through Burn's record format (burnpack), so no optimizer internals are touched:
//! - [`ShardedOptimizer::consolidate`] all-gathers each field of every parameter over
//!   the ranks (the blocks tile the flattened parameter in rank order) and reshapes it
//!   to the parameter;
//! - [`ShardedOptimizer::load_consolidated`] keeps this rank's block of each field of
//!   each parameter.

use std::collections::BTreeMap;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn_pack::{Bytes, DType, Reader, Scalar, Writer};

use super::{Plan, ShardedOptimizer};
use crate::error::{Error, Result};

/// The scalar every parameter's state carries: its tensor rank (Burn's `__rank`).
const RANK_KEY: &str = "__rank";

/// What a rank holds of one field for one block: (parameter index, field, dtype, shape).
type HeldField = (usize, String, String, Vec<usize>);

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
        let mut mine = parts(&self.inner, "ShardedOptimizer::consolidate")?;
        // What this rank holds for each non-empty block: (parameter, field, dtype, shape).
        let mut fields: Vec<HeldField> = Vec::new();
        for (i, (id, block)) in plan.piece_ids.iter().zip(&plan.blocks).enumerate() {
            if block.is_empty() {
                continue;
            }
            let id = id.val();
            for ((_, f), (dtype, dims, _)) in mine.tensors.iter().filter(|((p, _), _)| *p == id) {
                fields.push((i, f.clone(), format!("{dtype:?}"), dims.clone()));
            }
        }
        let all: Vec<Vec<HeldField>> = self
            .kolo
            .allgather_object(format!("{}.state.fields", self.prefix), fields)?;
        let names = check_fields(&all, &plan, self.kolo.size())?;
        let slots = &plan.layout.slots;
        let mut tensors = Vec::new();
        for field in &names {
            let mut group = Vec::with_capacity(slots.len());
            for (i, id) in plan.piece_ids.iter().enumerate() {
                let values = mine
                    .tensors
                    .remove(&(id.val(), field.clone()))
                    .map(|(_, _, v)| v)
                    .unwrap_or_default();
                let len = values.len();
                group.push((
                    format!("{}.state.{field}.{i}", self.prefix),
                    kolo::Tensor::from_vec(values, &[len])?,
                ));
            }
            let wholes = self.kolo.grouped_allgather(group).wait()?;
            for ((slot, whole), &n) in slots.iter().zip(wholes).zip(&plan.sizes) {
                let whole = whole.into_vec::<f32>()?;
                if whole.len() != n {
                    return Err(Error::Kolo(kolo::Error::Internal(format!(
                        "state {field:?} of parameter {:?} gathered {} values for {n} elements",
                        slot.path,
                        whole.len()
                    ))));
                }
                tensors.push((slot.id.val(), field.clone(), slot.dims.clone(), whole));
            }
        }
        // Each parameter gets its block's scalars (none before the first step); a
        // parameter without a block here, those of this rank's first block (every block
        // is stepped together).
        let first = plan
            .piece_ids
            .iter()
            .zip(&plan.blocks)
            .find(|(_, b)| !b.is_empty())
            .map(|(id, _)| id.val());
        let mut scalars = BTreeMap::new();
        for ((slot, id), block) in slots.iter().zip(&plan.piece_ids).zip(&plan.blocks) {
            let from = if block.is_empty() {
                first
            } else {
                Some(id.val())
            };
            if let Some(from) = from {
                rename_scalars(
                    &mine.scalars,
                    from,
                    slot.id.val(),
                    slot.dims.len(),
                    &mut scalars,
                );
            }
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
        let mut tensors = Vec::new();
        let mut scalars = BTreeMap::new();
        for ((slot, block), piece) in slots.iter().zip(&plan.blocks).zip(&plan.piece_ids) {
            if block.is_empty() {
                continue;
            }
            let (id, piece) = (slot.id.val(), piece.val());
            for f in &fields {
                if let Some((_, _, v)) = full.tensors.get(&(id, f.clone())) {
                    let values = v.get(block.clone()).unwrap_or_default().to_vec();
                    tensors.push((piece, f.clone(), vec![block.len()], values));
                }
            }
            rename_scalars(&full.scalars, id, piece, 1, &mut scalars);
        }
        self.inner = assemble(&self.inner, tensors, scalars, WHAT)?;
        Ok(())
    }
}

/// Every rank holds the same fields for each of its non-empty blocks, each f32 and one
/// value per element of the block; the fields' names, in order.
fn check_fields(all: &[Vec<HeldField>], plan: &Plan, size: usize) -> Result<Vec<String>> {
    const WHAT: &str = "ShardedOptimizer::consolidate";
    let names = |r: usize| {
        all[r]
            .iter()
            .map(|(_, f, _, _)| f.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
    };
    let first = names(0);
    for (rank, fields) in all.iter().enumerate() {
        if names(rank) != first {
            return Err(Error::InvalidArgument {
                what: WHAT,
                message: format!(
                    "rank 0 holds optimizer state {first:?}, rank {rank} {:?}: were the ranks stepped the same?",
                    names(rank)
                ),
            });
        }
        let block = |i: usize| {
            plan.sizes
                .get(i)
                .map_or(0, |&n| super::range_of(n, size, rank).len())
        };
        if let Some((i, f, dtype, dims)) = fields
            .iter()
            .find(|(i, _, dtype, dims)| dtype != "F32" || *dims != [block(*i)])
        {
            return Err(Error::InvalidArgument {
                what: WHAT,
                message: format!(
                    "rank {rank} holds state {f:?} of parameter {:?} as {dtype} {dims:?}, not one f32 per \
                     element of its block of {}: the wrapped optimizer's state is not element-wise",
                    plan.layout.slots.get(*i).map(|s| s.path.as_str()).unwrap_or_default(),
                    block(*i)
                ),
            });
        }
        let blocks = (0..plan.sizes.len()).filter(|&i| block(i) > 0).count();
        if fields.len() != blocks * first.len() {
            return Err(Error::InvalidArgument {
                what: WHAT,
                message: format!(
                    "rank {rank} holds {} state tensors for {blocks} blocks of {} fields: \
                     were all its blocks stepped?",
                    fields.len(),
                    first.len()
                ),
            });
        }
    }
    Ok(first)
}
