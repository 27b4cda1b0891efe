//! Whole-model records of models made of [`FullyShard`](super::FullyShard) units: the
//! record a plain, unsharded Burn model of the same structure holds (each unit's
//! parameters gathered), and loading such a record into units at any number of ranks.
//!
//! A unit's blocks are ordinary 1-D parameters to a visitor, so the units register
//! each block's whole shape by parameter id as they make (or re-map) their blocks.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::store::ModuleRecord;
use burn::tensor::{Bytes, Tensor, TensorData};
use kolo::Kolo;

use super::Full;
use crate::convert;
use crate::error::{Error, Result};
use crate::sharded::range_of;

/// The whole shape of every unit block this process has made, by parameter id.
static BLOCKS: Mutex<Option<HashMap<ParamId, Full>>> = Mutex::new(None);

/// Records that the block with `id` is a part of a parameter of shape `full`.
pub(super) fn register(id: ParamId, full: Full) {
    BLOCKS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(id, full);
}

/// The whole parameter that a parameter with `id` and shape `dims` is this rank's
/// block of, if it is one (a plain model may share a unit's ids: its parameters are
/// not 1-D blocks of this rank's length).
pub(super) fn block_of(id: ParamId, dims: &[usize], size: usize, rank: usize) -> Option<Full> {
    let full = BLOCKS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .and_then(|m| m.get(&id).cloned())?;
    (dims.len() == 1 && dims[0] == range_of(full.numel(), size, rank).len()).then_some(full)
}

/// The record of `model` as a plain Burn model of the same structure holds it: each
/// [`FullyShard`](super::FullyShard) unit's parameters whole (gathered from every
/// rank, one parameter at a time, so no rank holds more than one whole parameter
/// beyond its share), the other float parameters as they are. Collective: every rank
/// calls it; rank 0 gets `Some(record)`, the others `None`. Save it with
/// `ModuleRecord::save` (or `into_bytes`); a plain model loads it with
/// `load_record`, and [`load_fully_sharded`] loads it into units at any number of
/// ranks.
///
/// Float parameters only (a model's int and bool parameters are not recorded).
///
/// # Errors
/// A failed all-gather ([`Error::Kolo`]), a block kolo cannot move
/// ([`Error::Data`]), or Burn's record format refusing the tensors
/// ([`Error::Record`]).
pub fn consolidated_record<M: Module>(kolo: &Kolo, model: &M) -> Result<Option<ModuleRecord>> {
    let mut collect = Collect {
        path: Vec::new(),
        size: kolo.size(),
        rank: kolo.rank(),
        entries: Vec::new(),
    };
    model.visit(&mut collect);
    let root = kolo.rank() == 0;
    let copied = convert::Copied::default();
    let mut tensors = Vec::new();
    for (i, e) in collect.entries.into_iter().enumerate() {
        let (dims, data) = match e.whole {
            Some(full) => {
                let name = format!("kolo_burn.fsdp.record.{i}");
                let mine = convert::on_host(convert::to_kolo(&name, e.value, &copied)?)?;
                let all = kolo.allgather(name.clone(), mine).wait()?;
                if !root {
                    continue;
                }
                let t = convert::to_burn::<1>(&name, all, full.dtype, &e.device)?;
                (full.dims, t.into_data())
            }
            None if root => (e.dims, e.value.into_data()),
            None => continue,
        };
        let (bytes, _, dtype) = data.into_parts();
        tensors.push(burn_pack::Tensor::new(
            e.path,
            dtype,
            dims,
            Some(e.id.val()),
            bytes,
        ));
    }
    if !root {
        return Ok(None);
    }
    let bytes = burn_pack::Writer::new(tensors)
        .into_bytes()
        .map_err(|e| Error::Record {
            what: "writing the consolidated record",
            message: e.to_string(),
        })?;
    ModuleRecord::from_bytes(bytes)
        .map(Some)
        .map_err(|e| Error::Record {
            what: "reading the consolidated record",
            message: e.to_string(),
        })
}

/// A float parameter to record.
struct Entry {
    path: String,
    id: ParamId,
    dims: Vec<usize>,
    /// The parameter, flattened, without autodiff.
    value: Tensor<1>,
    device: burn::tensor::Device,
    /// The whole parameter, when this is a unit's block.
    whole: Option<Full>,
}

struct Collect {
    path: Vec<String>,
    size: usize,
    rank: usize,
    entries: Vec<Entry>,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val().inner();
        let dims = t.dims().to_vec();
        let whole = block_of(param.id, &dims, self.size, self.rank);
        self.entries.push(Entry {
            path: self.path.join("."),
            id: param.id,
            device: t.device(),
            value: t.reshape([dims.iter().product::<usize>()]),
            dims,
            whole,
        });
    }
}

/// `model` (made of [`FullyShard`](super::FullyShard) units, at any number of ranks)
/// with the values and parameter ids of `record`, a whole-model record
/// ([`consolidated_record`], or a plain Burn model's `into_record`): each unit block
/// takes its elements of the whole parameter, every other float parameter the
/// recorded tensor. Call it on every rank with the same record (it communicates
/// nothing).
///
/// # Errors
/// [`Error::Record`] naming each parameter the record lacks or holds with another
/// shape, or when the record cannot be read.
pub fn load_fully_sharded<M: Module>(kolo: &Kolo, model: M, record: ModuleRecord) -> Result<M> {
    let err = |what: &'static str| move |e: String| Error::Record { what, message: e };
    let bytes: Bytes = record
        .into_bytes()
        .map_err(|e| err("reading the record")(e.to_string()))?;
    let tensors = burn_pack::Reader::from_bytes(bytes)
        .and_then(burn_pack::Reader::into_tensors)
        .map_err(|e| err("reading the record")(e.to_string()))?;
    let mut by_path = HashMap::new();
    for t in tensors {
        let (path, dtype, shape, id, bytes) = t
            .into_parts()
            .map_err(|e| err("reading the record")(e.to_string()))?;
        by_path.insert(path, (id, TensorData::from_bytes(bytes, shape, dtype)));
    }
    let mut load = Load {
        path: Vec::new(),
        size: kolo.size(),
        rank: kolo.rank(),
        tensors: by_path,
        errors: Vec::new(),
    };
    let model = model.map(&mut load);
    if load.errors.is_empty() {
        Ok(model)
    } else {
        Err(Error::Record {
            what: "loading a whole-model record into fully sharded units",
            message: load.errors.join("; "),
        })
    }
}

struct Load {
    path: Vec<String>,
    size: usize,
    rank: usize,
    tensors: HashMap<String, (Option<u64>, TensorData)>,
    errors: Vec<String>,
}

impl ModuleMapper for Load {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let path = self.path.join(".");
        let Some((id, data)) = self.tensors.remove(&path) else {
            self.errors.push(format!("{path}: not in the record"));
            return param;
        };
        let id = id.map_or(param.id, ParamId::from);
        let current = param.val();
        let (device, dtype) = (current.device(), current.dtype());
        let require_grad = current.is_require_grad();
        let shape = current.dims().to_vec();
        let recorded = data.shape().to_vec();
        let n: usize = recorded.iter().product();
        let data = match block_of(param.id, &shape, self.size, self.rank) {
            // A unit's block: this rank's elements of the whole parameter.
            Some(full) if full.dims == recorded => {
                let range = range_of(n, self.size, self.rank);
                if range.len() != shape.iter().product::<usize>() {
                    self.errors.push(format!(
                        "{path}: this rank's block holds {shape:?} elements, the record's \
                         {recorded:?} gives it {}",
                        range.len()
                    ));
                    return param;
                }
                let (bytes, _, recorded_dtype) = data.into_parts();
                let flat = TensorData::from_bytes(bytes, [n], recorded_dtype);
                let flat = Tensor::<1>::from_data(flat, &device.clone().inner());
                flat.slice(range).into_data()
            }
            Some(full) => {
                self.errors.push(format!(
                    "{path}: the unit's parameter is {:?}, the record holds {recorded:?}",
                    full.dims
                ));
                return param;
            }
            None if recorded == shape => data,
            None => {
                self.errors.push(format!(
                    "{path}: the model has {shape:?}, the record holds {recorded:?}"
                ));
                return param;
            }
        };
        let t = Tensor::<D>::from_data(data, (&device, dtype));
        let t = if device.is_autodiff() {
            t.set_require_grad(require_grad)
        } else {
            t
        };
        let (_, _, mapper) = param.consume();
        Param::from_mapped_value(id, t, mapper)
    }
}
