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

use burn::grad_clipping::GradientClipping;
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn_pack::{Bytes, DType, Scalar};

use super::record::{read, record_error, write, Record};
use super::{Plan, ShardedOptimizer};
use crate::error::{Error, Result};

/// The scalar every parameter's state carries: its tensor rank (Burn's `__rank`).
const RANK_KEY: &str = "__rank";

/// What a rank holds of one field for one block: (parameter index, field, dtype, shape).
type HeldField = (usize, String, String, Vec<usize>);

/// A state tensor: its dtype, shape and values (f32, f16 and bf16 as f32; empty for
/// other dtypes).
type StateTensor = (DType, Vec<usize>, Vec<f32>);

/// One optimizer record, read apart: tensors by (parameter id, field), and scalars.
struct Parts {
    tensors: BTreeMap<(u64, String), StateTensor>,
    scalars: BTreeMap<String, Scalar>,
}

/// The state dtypes the element ranges carry (as f32 on the wire: exact for all).
fn element_wise(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// `bytes` of `dtype` as f32 values (empty for a dtype not [`element_wise`]).
fn to_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(bytes),
        DType::F16 => bytemuck::pod_collect_to_vec::<u8, half::f16>(bytes)
            .into_iter()
            .map(half::f16::to_f32)
            .collect(),
        DType::BF16 => bytemuck::pod_collect_to_vec::<u8, half::bf16>(bytes)
            .into_iter()
            .map(half::bf16::to_f32)
            .collect(),
        _ => Vec::new(),
    }
}

/// `values` as the bytes of `dtype` (f32, f16 or bf16).
fn from_f32(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => {
            let v: Vec<half::f16> = values.iter().map(|&x| half::f16::from_f32(x)).collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        DType::BF16 => {
            let v: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
            bytemuck::cast_slice(&v).to_vec()
        }
        _ => bytemuck::cast_slice(values).to_vec(),
    }
}

/// A dtype from its `Debug` name (as the ranks exchange it).
fn dtype_named(name: &str) -> DType {
    match name {
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        _ => DType::F32,
    }
}

/// `optim`'s state, read apart (through its burnpack bytes).
fn parts(optim: &ModuleOptimizer, what: &'static str) -> Result<Parts> {
    let err = record_error(what);
    let Record {
        tensors: read_tensors,
        scalars,
        ..
    } = read(optim, what)?;
    let mut tensors = BTreeMap::new();
    for t in read_tensors {
        let (name, dtype, shape, id, bytes) = t.into_parts().map_err(|e| err(e.to_string()))?;
        let Some(id) = id else { continue };
        let field = name
            .strip_prefix(&format!("{id}."))
            .unwrap_or(&name)
            .to_string();
        let values = to_f32(dtype, &bytes);
        tensors.insert((id, field), (dtype, shape.to_vec(), values));
    }
    Ok(Parts { tensors, scalars })
}

/// A state tensor to assemble: (parameter id, field, dtype, shape, values as f32).
type Assembled = (u64, String, DType, Vec<usize>, Vec<f32>);

/// A `ModuleOptimizer` like `like` (same optimizer and settings) holding `tensors`,
/// `scalars` and the parameters' module paths `paths` (by id).
fn assemble(
    like: &ModuleOptimizer,
    tensors: Vec<Assembled>,
    scalars: BTreeMap<String, Scalar>,
    paths: BTreeMap<String, String>,
    what: &'static str,
) -> Result<ModuleOptimizer> {
    let tensors = tensors
        .into_iter()
        .map(|(id, field, dtype, dims, values)| {
            let bytes = Bytes::from_bytes_vec(from_f32(dtype, &values));
            burn_pack::Tensor::new(format!("{id}.{field}"), dtype, dims, Some(id), bytes)
        })
        .collect();
    write(
        like,
        Record {
            tensors,
            scalars,
            paths,
        },
        what,
    )
}

/// The module path of each of `plan`'s parameters, by id (as Burn's record keeps it).
fn plan_paths(plan: &Plan) -> BTreeMap<String, String> {
    plan.layout
        .slots
        .iter()
        .map(|s| (s.id.val().to_string(), s.path.clone()))
        .collect()
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
        self.consolidate_plan(&plan)
    }

    /// [`consolidate`](Self::consolidate) for `plan`.
    pub(super) fn consolidate_plan(&mut self, plan: &Plan) -> Result<ModuleOptimizer> {
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
        let held = check_fields(&all, plan, self.kolo.size())?;
        let slots = &plan.layout.slots;
        let mut tensors = Vec::new();
        for field in &held.names {
            // Only the parameters with state (every rank knows which): plain Burn keeps
            // none for one that never had a gradient.
            let stated: Vec<usize> = (0..slots.len()).filter(|&i| held.stated[i]).collect();
            let mut group = Vec::with_capacity(stated.len());
            for &i in &stated {
                let values = mine
                    .tensors
                    .remove(&(plan.piece_ids[i].val(), field.clone()))
                    .map(|(_, _, v)| v)
                    .unwrap_or_default();
                let len = values.len();
                group.push((
                    format!("{}.state.{field}.{i}", self.prefix),
                    kolo::Tensor::from_vec(values, &[len])?,
                ));
            }
            let wholes = self.kolo.grouped_allgather(group).wait()?;
            for (&i, whole) in stated.iter().zip(wholes) {
                let (slot, n) = (&slots[i], plan.sizes[i]);
                let whole = whole.into_vec::<f32>()?;
                if whole.len() != n {
                    return Err(Error::Kolo(kolo::Error::Internal(format!(
                        "state {field:?} of parameter {:?} gathered {} values for {n} elements",
                        slot.path,
                        whole.len()
                    ))));
                }
                let dtype = held.dtype(i, field);
                tensors.push((
                    slot.id.val(),
                    field.clone(),
                    dtype,
                    slot.dims.clone(),
                    whole,
                ));
            }
        }
        let scalars = whole_scalars(plan, &held, &mine.scalars);
        let whole = assemble(
            &self.inner,
            tensors,
            scalars,
            plan_paths(plan),
            "ShardedOptimizer::consolidate",
        )?;
        // The wrapped optimizer clips by an infinite value while this one clips each
        // parameter by its norm across the shards: the plain optimizer gets its own
        // clipping back (issue 53 item 27).
        Ok(match self.param_norm {
            Some(max) => whole.with_grad_clipping(GradientClipping::Norm(max)),
            None => whole,
        })
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
        let plan = self.plan_for(model)?;
        self.load_with(&plan, full)
    }

    /// [`load_consolidated`](Self::load_consolidated) for `plan`.
    pub(super) fn load_with(&mut self, plan: &Plan, full: &ModuleOptimizer) -> Result<()> {
        const WHAT: &str = "ShardedOptimizer::load_consolidated";
        if let Some(owners) = &plan.owners {
            return self.load_by_tensors(plan, owners, full);
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
        // A parameter holds every field or none (plain Burn keeps none for one that
        // never had a gradient); a state must hold some of this model's parameters.
        let mut any = fields.is_empty();
        for slot in slots {
            let id = slot.id.val();
            let have: Vec<&String> = fields_of(id);
            any |= !have.is_empty();
            if !have.is_empty() && have.iter().copied().ne(fields.iter()) {
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
                    if !element_wise(*dtype) || *dims != slot.dims {
                        return Err(Error::InvalidArgument {
                            what: WHAT,
                            message: format!(
                                "state {f:?} of parameter {:?} is {dtype:?} {dims:?}; the sharded optimizer \
                                 takes f32, f16 or bf16 state of the parameter's shape {:?}",
                                slot.path, slot.dims
                            ),
                        });
                    }
                }
            }
        }
        if !any {
            return Err(Error::InvalidArgument {
                what: WHAT,
                message: format!(
                    "the optimizer state holds {fields:?} for no parameter of this model (the \
                     first is {:?}): is it the state of this model (loaded with its ids, e.g. by \
                     load_checkpoint)?",
                    slots.first().map(|s| s.path.as_str()).unwrap_or_default()
                ),
            });
        }
        let mut tensors = Vec::new();
        let mut scalars = BTreeMap::new();
        for ((slot, block), piece) in slots.iter().zip(&plan.blocks).zip(&plan.piece_ids) {
            if block.is_empty() {
                continue;
            }
            let (id, piece) = (slot.id.val(), piece.val());
            for f in &fields {
                if let Some((dtype, _, v)) = full.tensors.get(&(id, f.clone())) {
                    let values = v.get(block.clone()).unwrap_or_default().to_vec();
                    tensors.push((piece, f.clone(), *dtype, vec![block.len()], values));
                }
            }
            rename_scalars(&full.scalars, id, piece, 1, &mut scalars);
        }
        self.inner = assemble(&self.inner, tensors, scalars, plan_paths(plan), WHAT)?;
        Ok(())
    }
}

/// The scalars of the whole state (a step count, each parameter's rank) from this
/// rank's `mine`: each parameter with state gets its block's; one without a block
/// here, those of this rank's first block with state (every block is stepped
/// together).
fn whole_scalars(
    plan: &Plan,
    held: &Held,
    mine: &BTreeMap<String, Scalar>,
) -> BTreeMap<String, Scalar> {
    let first = plan
        .piece_ids
        .iter()
        .zip(&plan.blocks)
        .zip(&held.stated)
        .find(|((_, b), &stated)| !b.is_empty() && stated)
        .map(|((id, _), _)| id.val());
    let mut scalars = BTreeMap::new();
    for (((slot, id), block), &stated) in plan
        .layout
        .slots
        .iter()
        .zip(&plan.piece_ids)
        .zip(&plan.blocks)
        .zip(&held.stated)
    {
        let from = match (stated, block.is_empty()) {
            (false, _) => None,
            (true, true) => first,
            (true, false) => Some(id.val()),
        };
        if let Some(from) = from {
            rename_scalars(mine, from, slot.id.val(), slot.dims.len(), &mut scalars);
        }
    }
    scalars
}

/// What the ranks hold of the state: the fields' names (in order), which parameters
/// have state, and each field's dtype per parameter.
struct Held {
    names: Vec<String>,
    stated: Vec<bool>,
    dtypes: BTreeMap<(usize, String), String>,
}

impl Held {
    fn dtype(&self, i: usize, field: &str) -> DType {
        self.dtypes
            .get(&(i, field.to_string()))
            .map_or(DType::F32, |d| dtype_named(d))
    }
}

/// Every rank holds, for each of its non-empty blocks, either every field or none,
/// and the ranks agree on which parameters have state; each field f32, f16 or bf16,
/// one value per element of the block.
fn check_fields(all: &[Vec<HeldField>], plan: &Plan, size: usize) -> Result<Held> {
    const WHAT: &str = "ShardedOptimizer::consolidate";
    let names: Vec<String> = all
        .iter()
        .flatten()
        .map(|(_, f, _, _)| f.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let n = plan.sizes.len();
    let block = |i: usize, rank: usize| {
        plan.sizes
            .get(i)
            .map_or(0, |&n| super::range_of(n, size, rank).len())
    };
    let mut stated: Vec<Option<(usize, bool)>> = vec![None; n];
    let mut dtypes = BTreeMap::new();
    for (rank, fields) in all.iter().enumerate() {
        if let Some((i, f, dtype, dims)) = fields.iter().find(|(i, _, dtype, dims)| {
            !matches!(dtype.as_str(), "F32" | "F16" | "BF16") || *dims != [block(*i, rank)]
        }) {
            return Err(Error::InvalidArgument {
                what: WHAT,
                message: format!(
                    "rank {rank} holds state {f:?} of parameter {:?} as {dtype} {dims:?}, not one \
                     value (f32, f16 or bf16) per element of its block of {}: the wrapped \
                     optimizer's state is not element-wise",
                    plan.layout
                        .slots
                        .get(*i)
                        .map(|s| s.path.as_str())
                        .unwrap_or_default(),
                    block(*i, rank)
                ),
            });
        }
        for (i, state) in stated.iter_mut().enumerate() {
            if block(i, rank) == 0 {
                continue;
            }
            let have: Vec<&String> = fields
                .iter()
                .filter(|(p, _, _, _)| *p == i)
                .map(|(_, f, _, _)| f)
                .collect();
            let path = plan
                .layout
                .slots
                .get(i)
                .map(|s| s.path.as_str())
                .unwrap_or_default();
            if !have.is_empty() && have.iter().copied().ne(names.iter()) {
                return Err(Error::InvalidArgument {
                    what: WHAT,
                    message: format!(
                        "rank {rank} holds optimizer state {have:?} for parameter {path:?}, where \
                         the ranks hold {names:?}: were the ranks stepped the same?"
                    ),
                });
            }
            let has = !have.is_empty();
            match *state {
                Some((other, had)) if had != has => {
                    return Err(Error::InvalidArgument {
                        what: WHAT,
                        message: format!(
                            "rank {other} holds {} optimizer state for parameter {path:?}, rank \
                             {rank} {}: were the ranks stepped the same?",
                            if had { "its" } else { "no" },
                            if has { "does" } else { "none" }
                        ),
                    });
                }
                Some(_) => {}
                None => *state = Some((rank, has)),
            }
        }
        for (i, f, dtype, _) in fields {
            dtypes
                .entry((*i, f.clone()))
                .or_insert_with(|| dtype.clone());
        }
    }
    Ok(Held {
        names,
        stated: stated
            .iter()
            .map(|s| s.is_some_and(|(_, has)| has))
            .collect(),
        dtypes,
    })
}
