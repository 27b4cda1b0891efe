//! Sharding by whole tensors ([`ShardedOptimizer::by_tensors`]): each parameter's
//! optimizer state lives on one rank, for optimizers whose update reads a whole tensor.

use std::collections::{BTreeMap, BTreeSet};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, LearningRate, ModuleOptimizer};
use burn::tensor::{DType, FloatDType, Tensor};

use super::record::{read, read_bytes, record_bytes, write, Record};
use super::{Flat, Gathered, Plan, ShardedOptimizer, WriteViews};
use crate::error::{Error, Result};
use crate::layout::trains;

/// Which rank steps each parameter, and where its values land in the all-gathered
/// sequence (every rank's parameters, in module order, rank after rank).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Owners {
    /// The rank that steps each parameter (module order).
    pub(super) owner: Vec<usize>,
    /// Where each parameter starts in the all-gathered sequence.
    pub(super) gathered_at: Vec<usize>,
}

impl Owners {
    /// Balanced by elements: the largest parameter first, each to the rank holding the
    /// fewest elements so far (the lowest such rank on a tie) — the same on every rank.
    pub(super) fn assign(sizes: &[usize], ranks: usize) -> Owners {
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
        let mut load = vec![0usize; ranks.max(1)];
        let mut owner = vec![0usize; sizes.len()];
        for i in order {
            let r = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            owner[i] = r;
            load[r] += sizes[i];
        }
        let mut gathered_at = vec![0usize; sizes.len()];
        let mut at = 0;
        for r in 0..load.len() {
            for (i, &o) in owner.iter().enumerate() {
                if o == r {
                    gathered_at[i] = at;
                    at += sizes[i];
                }
            }
        }
        Owners { owner, gathered_at }
    }
}

impl ShardedOptimizer {
    /// The whole-tensor step, from the gradients averaged as
    /// [`GradientReducer`](crate::GradientReducer) does:
    /// this rank's parameters stepped as themselves, everyone's gathered back.
    pub(super) fn step_by_tensors<M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        reduced: GradientsParams,
        plan: &Plan,
        owners: &Owners,
    ) -> Result<M> {
        let rank = self.kolo.rank();
        let mut keep = Keep {
            grads: reduced,
            mine: GradientsParams::new(),
            owner: &owners.owner,
            rank,
            next: 0,
            squares: self.global_norm.map(|_| 0.0),
        };
        model.visit(&mut keep);
        let mut mine = keep.mine;
        if let Some(max) = self.global_norm {
            // Every rank holds every reduced gradient here: the norm needs no message.
            let coef = super::global_clip(max, keep.squares.unwrap_or_default());
            if coef < 1.0 {
                mine = scale(&model, mine, coef as f32);
            }
        }
        let model = self.inner.step(lr, model, mine);
        match plan.dtype {
            DType::F16 => self.gather::<half::f16, M>(model, plan, owners),
            DType::BF16 => self.gather::<half::bf16, M>(model, plan, owners),
            _ => self.gather::<f32, M>(model, plan, owners),
        }
    }

    /// Every rank's stepped parameters, all-gathered (as `T`) into `model`.
    fn gather<T: Flat, M: Module>(&self, model: M, plan: &Plan, owners: &Owners) -> Result<M> {
        let values = read_owned::<T, M>(&model, &owners.owner, self.kolo.rank());
        let n = values.len();
        let all = self
            .kolo
            .allgather(
                format!("{}.params", self.prefix),
                kolo::Tensor::from_vec(values, &[n])?,
            )
            .wait()?;
        if all.len() != plan.total {
            return Err(crate::error::Error::Kolo(kolo::Error::Internal(format!(
                "the gathered parameters hold {} elements, the model {}",
                all.len(),
                plan.total
            ))));
        }
        // The parameters become slices of the gathered tensor: nothing is copied.
        let device = super::first_device(&model)?;
        let all =
            crate::convert::to_burn::<1>("the gathered parameters", all, plan.dtype, &device)?;
        Ok(model.map(&mut WriteViews {
            all: Gathered::One {
                all: Box::new(all),
                offsets: &owners.gathered_at,
            },
            next: 0,
        }))
    }
}

/// Moves the reduced gradients of this rank's parameters into `mine`, summing the
/// squares of all of them when asked to (for the global norm; each reads a value back
/// from the device).
struct Keep<'a> {
    grads: GradientsParams,
    mine: GradientsParams,
    owner: &'a [usize],
    rank: usize,
    next: usize,
    squares: Option<f64>,
}

impl ModuleVisitor for Keep<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !trains(param) {
            return;
        }
        let i = self.next;
        self.next += 1;
        let Some(g) = self.grads.remove::<D>(param.id) else {
            return;
        };
        if let Some(squares) = &mut self.squares {
            // In f32 whatever the gradient's type: an f16 sum of squares passes 65504
            // (a norm of 256) and becomes inf, which would scale every gradient by 0.
            let square = g.clone().cast(FloatDType::F32).square().sum();
            *squares += f64::from(square.into_scalar::<f32>());
        }
        if self.owner.get(i) == Some(&self.rank) {
            self.mine.register(param.id, g);
        }
    }
}

/// `grads` with every gradient of `module` multiplied by `c`.
fn scale<M: Module>(module: &M, mut grads: GradientsParams, c: f32) -> GradientsParams {
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(t) = self.0.remove::<D>(p.id) {
                self.0.register(p.id, t.mul_scalar(self.1));
            }
        }
    }
    module.visit(&mut Scale(&mut grads, c));
    grads
}

/// The values of the parameters `rank` owns, flattened in module order.
fn read_owned<T: Flat, M: Module>(module: &M, owner: &[usize], rank: usize) -> Vec<T> {
    struct Read<'a, T> {
        owner: &'a [usize],
        rank: usize,
        next: usize,
        out: Vec<T>,
    }
    impl<T: Flat> ModuleVisitor for Read<'_, T> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !trains(param) {
                return;
            }
            let i = self.next;
            self.next += 1;
            if self.owner.get(i) == Some(&self.rank) {
                if let Ok(v) = param.val().into_data().as_slice::<T>() {
                    self.out.extend_from_slice(v);
                }
            }
        }
    }
    let mut r = Read {
        owner,
        rank,
        next: 0,
        out: Vec::new(),
    };
    module.visit(&mut r);
    r.out
}

/// The parameter id a scalar `"{id}.{key}"` belongs to.
fn scalar_id(key: &str) -> Option<u64> {
    key.split_once('.').and_then(|(id, _)| id.parse().ok())
}

impl ShardedOptimizer {
    /// [`consolidate`](Self::consolidate) by whole tensors: every rank's record
    /// all-gathered and joined (each holds its own parameters' state, under their ids).
    pub(super) fn consolidate_by_tensors(&self) -> Result<ModuleOptimizer> {
        const WHAT: &str = "ShardedOptimizer::consolidate";
        let mine = record_bytes(&self.inner, WHAT)?.to_vec();
        let all: Vec<Vec<u8>> = self
            .kolo
            .allgather_object(format!("{}.state.records", self.prefix), mine)?;
        let mut joined = Record {
            tensors: Vec::new(),
            scalars: BTreeMap::new(),
            paths: BTreeMap::new(),
        };
        for bytes in all {
            let r = read_bytes(burn_pack::Bytes::from_bytes_vec(bytes), WHAT)?;
            joined.tensors.extend(r.tensors);
            joined.scalars.extend(r.scalars);
            joined.paths.extend(r.paths);
        }
        write(&self.inner, joined, WHAT)
    }

    /// [`load_consolidated`](Self::load_consolidated) by whole tensors: the state of
    /// the parameters this rank owns (at this job's rank count), under their ids.
    pub(super) fn load_by_tensors(
        &mut self,
        plan: &Plan,
        owners: &Owners,
        full: &ModuleOptimizer,
    ) -> Result<()> {
        const WHAT: &str = "ShardedOptimizer::load_consolidated";
        let full = read(full, WHAT)?;
        let ids: Vec<u64> = plan.layout.slots.iter().map(|s| s.id.val()).collect();
        let held: BTreeSet<u64> = full.tensors.iter().filter_map(|t| t.param_id).collect();
        // A state must be one for this model: some of its parameters (not necessarily
        // all: plain Burn keeps none for a parameter that never had a gradient).
        // Checked on every rank alike.
        if !held.is_empty() && !ids.iter().any(|id| held.contains(id)) {
            return Err(Error::InvalidArgument {
                what: WHAT,
                message: format!(
                    "the optimizer state holds nothing for any parameter of this model (the \
                     first is {:?}, id {}): is it the state of this model (loaded with its \
                     ids, e.g. by load_checkpoint)?",
                    plan.layout
                        .slots
                        .first()
                        .map(|s| s.path.as_str())
                        .unwrap_or_default(),
                    ids.first().copied().unwrap_or_default()
                ),
            });
        }
        let rank = self.kolo.rank();
        let owned: BTreeSet<u64> = ids
            .iter()
            .zip(&owners.owner)
            .filter(|(_, &o)| o == rank)
            .map(|(&id, _)| id)
            .collect();
        let record = Record {
            tensors: full
                .tensors
                .into_iter()
                .filter(|t| t.param_id.is_some_and(|id| owned.contains(&id)))
                .collect(),
            scalars: full
                .scalars
                .into_iter()
                .filter(|(k, _)| scalar_id(k).is_some_and(|id| owned.contains(&id)))
                .collect(),
            paths: full
                .paths
                .into_iter()
                .filter(|(k, _)| k.parse::<u64>().is_ok_and(|id| owned.contains(&id)))
                .collect(),
        };
        self.inner = write(&self.inner, record, WHAT)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Owners;

    #[test]
    fn whole_tensors_are_balanced_and_gathered_rank_after_rank() {
        // One large parameter and five small ones over 2 ranks: the large one alone.
        let o = Owners::assign(&[100, 10, 1000, 10, 5, 5], 2);
        assert_eq!(o.owner, vec![1, 1, 0, 1, 1, 1]);
        // Rank 0's block (parameter 2) first, then rank 1's in module order.
        assert_eq!(o.gathered_at, vec![1000, 1100, 0, 1110, 1120, 1125]);
        // More ranks than parameters: some own nothing.
        let o = Owners::assign(&[3, 2], 4);
        assert_eq!(o.owner, vec![0, 1]);
        assert_eq!(o.gathered_at, vec![0, 3]);
    }
}
