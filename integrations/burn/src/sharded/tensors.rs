//! Sharding by whole tensors ([`ShardedOptimizer::by_tensors`]): each parameter's
//! optimizer state lives on one rank, for optimizers whose update reads a whole tensor.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, LearningRate};
use burn::tensor::{DType, Tensor};

use super::{Flat, Plan, ShardedOptimizer, WriteBack};
use crate::error::Result;
use crate::GradientReducer;

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
    /// The whole-tensor step: gradients averaged as [`GradientReducer`] does, this
    /// rank's parameters stepped as themselves, everyone's gathered back.
    pub(super) fn step_by_tensors<M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        grads: GradientsParams,
        plan: &Plan,
        owners: &Owners,
    ) -> Result<M> {
        let rank = self.kolo.rank();
        let reducer = self.reducer.get_or_insert_with(|| {
            GradientReducer::new(&self.kolo)
                .op(self.op)
                .backward_passes_per_step(self.passes)
                .prefix(format!("{}.grads", self.prefix))
        });
        let reduced = reducer.reduce(&model, grads)?;
        let mut keep = Keep {
            grads: reduced,
            mine: GradientsParams::new(),
            owner: &owners.owner,
            rank,
            next: 0,
            squares: 0.0,
        };
        model.visit(&mut keep);
        let mut mine = keep.mine;
        if let Some(max) = self.global_norm {
            // Every rank holds every reduced gradient here: the norm needs no message.
            let coef = (f64::from(max) / (keep.squares.sqrt() + 1e-6)).min(1.0);
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
            .wait()?
            .into_vec::<T>()?;
        if all.len() != plan.total {
            return Err(crate::error::Error::Kolo(kolo::Error::Internal(format!(
                "the gathered parameters hold {} elements, the model {}",
                all.len(),
                plan.total
            ))));
        }
        Ok(model.map(&mut WriteBack {
            all: &all,
            offsets: &owners.gathered_at,
            next: 0,
            dtype: plan.dtype,
        }))
    }
}

/// Moves the reduced gradients of this rank's parameters into `mine`, summing the
/// squares of all of them (for the global norm).
struct Keep<'a> {
    grads: GradientsParams,
    mine: GradientsParams,
    owner: &'a [usize],
    rank: usize,
    next: usize,
    squares: f64,
}

impl ModuleVisitor for Keep<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let i = self.next;
        self.next += 1;
        let Some(g) = self.grads.remove::<D>(param.id) else {
            return;
        };
        let sq = g.clone().square().sum().into_scalar::<f32>();
        self.squares += f64::from(sq);
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
