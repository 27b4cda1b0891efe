//! A model's gradient layout, learned once: its trainable parameters in module order
//! with their shapes and dtypes, the collective name of each, and the buckets they are
//! reduced in.
//!
//! A parameter that does not require a gradient (`no_grad()`, `freeze()`, the frozen
//! base weights of `apply_lora`) is not part of the layout: plain Burn never steps it,
//! so kolo never reduces it, steps it or gives it optimizer state. Every visitor that
//! walks a model by slot skips it through [`trains`].

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Tensor};
use kolo::Kolo;

use crate::convert;
use crate::error::{Error, Result};

/// One float parameter of the model.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Slot {
    pub(crate) id: ParamId,
    /// The module path, e.g. `fc1.weight`.
    pub(crate) path: String,
    pub(crate) dims: Vec<usize>,
    pub(crate) dtype: DType,
}

impl Slot {
    fn bytes(&self) -> usize {
        self.dims.iter().product::<usize>() * self.dtype.size()
    }
}

/// The slot's gradient as it travels, and zeros standing in for it: the parameter's
/// dtype, which [`Layout::learn`] has checked kolo can reduce.
#[derive(Debug)]
pub(crate) struct Wire {
    pub(crate) dtype: kolo::DType,
}

impl Wire {
    /// Zeros of `slot`'s shape, for a rank without a usable gradient.
    pub(crate) fn zeros(&self, slot: &Slot) -> kolo::Tensor {
        kolo::Tensor::zeros(self.dtype, &slot.dims)
    }
}

/// Parameters in module order and the buckets that reduce them.
#[derive(Debug)]
pub(crate) struct Layout {
    pub(crate) slots: Vec<Slot>,
    /// The collective name of each slot: `<prefix>.<path>`, the same on every rank and
    /// every step, so kolo's response cache serves every step after the first.
    pub(crate) names: Vec<String>,
    /// Slot indices per bucket, in the order backward produces gradients (reverse
    /// module order), each bucket at most `bucket_bytes` unless one gradient is larger.
    pub(crate) buckets: Vec<Vec<usize>>,
    /// How each slot travels.
    pub(crate) wires: Vec<Wire>,
    bucket_bytes: usize,
}

impl Layout {
    /// The layout of `module`'s float parameters, agreed by every rank: one allgather
    /// of each rank's parameters, then every check on what all ranks sent, so that an
    /// error is the same on every rank and no rank is left waiting for another.
    ///
    /// # Errors
    /// - [`Error::ModelMismatch`]: the ranks' parameters differ;
    /// - [`Error::InvalidArgument`]: a module without trainable float parameters;
    /// - [`Error::Data`]: a parameter of a dtype kolo cannot reduce (quantized);
    /// - [`Error::Kolo`]: the allgather failed.
    pub(crate) fn learn<M: Module>(
        module: &M,
        kolo: &Kolo,
        prefix: &str,
        bucket_bytes: usize,
    ) -> Result<Layout> {
        let mut visit = Learn {
            path: Vec::new(),
            slots: Vec::new(),
        };
        module.visit(&mut visit);
        agree(&visit.slots, kolo, &format!("{prefix}.layout"))?;
        let frozen = visit.slots.iter().filter(|(_, trains)| !trains).count();
        let slots: Vec<Slot> = visit
            .slots
            .into_iter()
            .filter_map(|(slot, trains)| trains.then_some(slot))
            .collect();
        if slots.is_empty() {
            return Err(Error::InvalidArgument {
                what: "GradientReducer::reduce",
                message: if frozen > 0 {
                    format!(
                        "all {frozen} float parameters of the module are frozen (they do not \
                         require a gradient), so there is no gradient to reduce"
                    )
                } else {
                    "the module has no float parameters, so there is no gradient to reduce".into()
                },
            });
        }
        let (wires, names) = wires_and_names(&slots, prefix)?;
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut filled = 0;
        for (i, slot) in slots.iter().enumerate().rev() {
            match buckets.last_mut() {
                Some(b) if filled + slot.bytes() <= bucket_bytes => b.push(i),
                _ => {
                    buckets.push(vec![i]);
                    filled = 0;
                }
            }
            filled += slot.bytes();
        }
        Ok(Layout {
            slots,
            names,
            buckets,
            wires,
            bucket_bytes,
        })
    }

    /// The layout of parameters already agreed by every rank (`slots`, trainable
    /// ones, in module order), all in one bucket; nothing is communicated.
    ///
    /// # Errors
    /// [`Error::Data`]: a parameter of a dtype kolo cannot reduce.
    pub(crate) fn given(slots: Vec<Slot>, prefix: &str) -> Result<Layout> {
        let (wires, names) = wires_and_names(&slots, prefix)?;
        Ok(Layout {
            buckets: vec![(0..slots.len()).rev().collect()],
            slots,
            names,
            wires,
            bucket_bytes: usize::MAX,
        })
    }

    /// Whether `module` still has exactly these parameters and this layout fits
    /// `bucket_bytes` (cheap: no names are built).
    pub(crate) fn fits<M: Module>(&self, module: &M, bucket_bytes: usize) -> bool {
        let mut visit = Check {
            slots: &self.slots,
            next: 0,
            same: true,
        };
        module.visit(&mut visit);
        visit.same && visit.next == self.slots.len() && bucket_bytes == self.bucket_bytes
    }
}

/// How each slot travels, and its collective name (`<prefix>.<path>`).
///
/// # Errors
/// [`Error::Data`]: a parameter of a dtype kolo cannot reduce.
fn wires_and_names(slots: &[Slot], prefix: &str) -> Result<(Vec<Wire>, Vec<String>)> {
    let wires = slots
        .iter()
        .map(|s| convert::kolo_dtype(&s.path, s.dtype).map(|dtype| Wire { dtype }))
        .collect::<Result<Vec<_>>>()?;
    let names = slots
        .iter()
        .map(|s| format!("{prefix}.{}", s.path))
        .collect();
    Ok((wires, names))
}

/// Whether plain Burn would step `param`: it requires a gradient, or the model is on
/// a device without autodiff (where nothing is tracked, and gradients a caller made
/// by hand are taken as they come).
pub(crate) fn trains<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    let t = param.val();
    !t.device().is_autodiff() || t.is_require_grad()
}

/// Checks that every rank's `module` has the same float parameters (paths, shapes,
/// dtypes, frozen state), in the same order: one allgather named `name`.
///
/// # Errors
/// As [`agree`]; [`Error::Kolo`] when the allgather fails.
pub(crate) fn agree_module<M: Module>(module: &M, kolo: &Kolo, name: &str) -> Result<()> {
    let mut visit = Learn {
        path: Vec::new(),
        slots: Vec::new(),
    };
    module.visit(&mut visit);
    agree(&visit.slots, kolo, name)
}

/// Checks that every rank has the same parameters, in the same order, with the same
/// shapes, dtypes and frozen state (one allgather, when the layout is learned).
///
/// # Errors
/// [`Error::ModelMismatch`] on every rank, naming the first parameter that differs
/// and what each rank has there.
fn agree(slots: &[(Slot, bool)], kolo: &Kolo, name: &str) -> Result<()> {
    let mine: Vec<(String, Vec<usize>, String)> = slots
        .iter()
        .map(|(s, trains)| {
            let frozen = if *trains { "" } else { " (frozen)" };
            (
                s.path.clone(),
                s.dims.clone(),
                format!("{:?}{frozen}", s.dtype),
            )
        })
        .collect();
    let all = kolo.allgather_object(name, mine)?;
    let longest = all.iter().map(Vec::len).max().unwrap_or(0);
    for i in 0..longest {
        let first = all[0].get(i);
        if all.iter().all(|r| r.get(i) == first) {
            continue;
        }
        let parameter = all
            .iter()
            .find_map(|r| r.get(i))
            .map_or_else(String::new, |p| p.0.clone());
        let ranks = all
            .iter()
            .enumerate()
            .map(|(rank, r)| match r.get(i) {
                Some((path, dims, dtype)) => {
                    format!("rank {rank} has {path:?} {dims:?} {dtype}")
                }
                None => format!("rank {rank} has no parameter #{i}"),
            })
            .collect::<Vec<_>>()
            .join(", ");
        return Err(Error::ModelMismatch {
            index: i,
            parameter,
            ranks,
        });
    }
    Ok(())
}

struct Learn {
    path: Vec<String>,
    /// Every float parameter, and whether it trains.
    slots: Vec<(Slot, bool)>,
}

impl ModuleVisitor for Learn {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        let slot = Slot {
            id: param.id,
            path: self.path.join("."),
            dims: t.dims().to_vec(),
            dtype: t.dtype(),
        };
        self.slots.push((slot, trains(param)));
    }
}

struct Check<'a> {
    slots: &'a [Slot],
    next: usize,
    same: bool,
}

impl ModuleVisitor for Check<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !trains(param) {
            return;
        }
        let same = self.slots.get(self.next).is_some_and(|s| {
            let t = param.val();
            s.id == param.id && s.dims == t.dims() && s.dtype == t.dtype()
        });
        self.same &= same;
        self.next += 1;
    }
}
