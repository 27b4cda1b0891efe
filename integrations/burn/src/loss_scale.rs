//! Loss scaling for f16 training with DeepSpeed's dynamic semantics, the overflow
//! agreed by every rank so that every rank skips the same steps.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use kolo::{Kolo, ReduceOp};

use crate::error::Result;
use crate::layout::trains;

/// Scales the loss before backward so that small f16 gradients do not underflow, and
/// unscales the gradients before the step, skipping the steps whose gradients
/// overflowed (an inf or NaN on any rank) — DeepSpeed's `DynamicLossScaler`:
///
/// - the scale starts at 2^`initial_scale_power` (default 16);
/// - a step whose gradients overflow anywhere is skipped on every rank; after
///   `hysteresis` such steps (default 2; the count is restored when the scale grows)
///   the scale halves, never below `min_loss_scale` (default 1);
/// - after `loss_scale_window` steps without overflow (default 1000) the scale
///   doubles.
///
/// [`fixed`](Self::fixed) keeps one scale (DeepSpeed's `loss_scale` > 0) and still
/// skips overflowing steps.
///
/// ```no_run
/// # use burn::module::Module;
/// # use burn::optim::{GradientsParams, ModuleOptimizer};
/// # fn demo<M: Module>(kolo: &kolo::Kolo, model: M, loss: burn::tensor::Tensor<1>, optim: &mut ModuleOptimizer) -> kolo_burn::Result<M> {
/// let mut scaler = kolo_burn::LossScaler::dynamic(kolo);
/// let grads = GradientsParams::from_grads(scaler.scale_loss(loss).backward(), &model);
/// // (reduced, or straight from fully sharded units)
/// Ok(match scaler.unscale(&model, grads)? {
///     Some(grads) => optim.step(1e-3, model, grads),
///     None => model, // overflow: every rank skips this step
/// })
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct LossScaler {
    kolo: Kolo,
    schedule: Schedule,
    skipped: u64,
}

/// Where a [`LossScaler`] stands: what a checkpoint keeps of it
/// ([`LossScaler::state`], [`LossScaler::restore`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScalerState {
    /// The current scale.
    pub scale: f64,
    /// Overflowing steps left before the scale halves.
    pub left: u32,
    /// Steps seen.
    pub iter: u64,
    /// The step of the last overflow (−1: none).
    pub last_overflow: i64,
    /// Steps skipped.
    pub skipped: u64,
}

/// The scale and how it moves.
#[derive(Debug, Clone)]
struct Schedule {
    scale: f64,
    dynamic: bool,
    window: u64,
    hysteresis: u32,
    left: u32,
    min: f64,
    /// Steps seen ([`unscale`](Self::unscale) calls).
    iter: u64,
    /// The step of the last overflow (−1: none yet).
    last_overflow: i64,
}

impl Default for Schedule {
    /// DeepSpeed's defaults.
    fn default() -> Self {
        Schedule {
            scale: 65536.0,
            dynamic: true,
            window: 1000,
            hysteresis: 2,
            left: 2,
            min: 1.0,
            iter: 0,
            last_overflow: -1,
        }
    }
}

impl LossScaler {
    /// DeepSpeed's dynamic loss scaling with its defaults (see the type's docs).
    pub fn dynamic(kolo: &Kolo) -> Self {
        LossScaler {
            kolo: kolo.clone(),
            schedule: Schedule::default(),
            skipped: 0,
        }
    }

    /// One scale for the whole run; overflowing steps are still skipped.
    pub fn fixed(kolo: &Kolo, scale: f64) -> Self {
        let mut s = Self::dynamic(kolo);
        s.schedule.scale = scale;
        s.schedule.dynamic = false;
        s
    }

    /// The first scale: 2^`power`.
    pub fn initial_scale_power(mut self, power: i32) -> Self {
        self.schedule.scale = 2f64.powi(power);
        self
    }

    /// Clean steps after which the scale doubles (at least 1).
    pub fn loss_scale_window(mut self, steps: u64) -> Self {
        self.schedule.window = steps.max(1);
        self
    }

    /// Overflowing steps before the scale halves (at least 1).
    pub fn hysteresis(mut self, steps: u32) -> Self {
        self.schedule.hysteresis = steps.max(1);
        self.schedule.left = self.schedule.hysteresis;
        self
    }

    /// The scale never goes below this.
    pub fn min_loss_scale(mut self, min: f64) -> Self {
        self.schedule.min = min;
        self
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.schedule.scale
    }

    /// Steps skipped so far for overflow.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// Where the scaler stands (for a checkpoint).
    pub fn state(&self) -> LossScalerState {
        LossScalerState {
            scale: self.schedule.scale,
            left: self.schedule.left,
            iter: self.schedule.iter,
            last_overflow: self.schedule.last_overflow,
            skipped: self.skipped,
        }
    }

    /// Goes on from `state` (its settings — window, hysteresis, minimum — stay this
    /// scaler's).
    pub fn restore(&mut self, state: &LossScalerState) {
        self.schedule.scale = state.scale;
        self.schedule.left = state.left;
        self.schedule.iter = state.iter;
        self.schedule.last_overflow = state.last_overflow;
        self.skipped = state.skipped;
    }

    /// `loss` times the scale: call `backward` on it.
    pub fn scale_loss<const D: usize>(&self, loss: Tensor<D>) -> Tensor<D> {
        loss * self.schedule.scale
    }

    /// The gradients of `model`'s trainable parameters divided by the scale, or `None`
    /// when any rank's gradients hold an inf or NaN (one allreduce of a flag: every
    /// rank gets the same answer and skips the same steps). Updates the scale either
    /// way; call it once per step, on every rank.
    ///
    /// # Errors
    /// The allreduce failed.
    pub fn unscale<M: Module>(
        &mut self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<Option<GradientsParams>> {
        let mut check = Check {
            grads: &mut grads,
            factor: 1.0 / self.schedule.scale,
            overflow: false,
        };
        model.visit(&mut check);
        let mine = f32::from(u8::from(check.overflow));
        let any = self
            .kolo
            .allreduce(
                "kolo_burn.loss_scaler.overflow",
                kolo::Tensor::from_vec(vec![mine], &[1])?,
            )
            .op(ReduceOp::Max)
            .wait()?
            .into_vec::<f32>()?;
        let overflow = any.first().is_some_and(|&v| v > 0.0);
        if overflow {
            self.skipped += 1;
        }
        self.schedule.update(overflow);
        Ok((!overflow).then_some(grads))
    }
}

impl Schedule {
    /// DeepSpeed's `update_scale`.
    fn update(&mut self, overflow: bool) {
        if overflow {
            if self.dynamic {
                if self.left <= 1 {
                    self.scale = (self.scale / 2.0).max(self.min);
                } else {
                    self.left -= 1;
                }
            }
            self.last_overflow = self.iter as i64;
        } else if self.dynamic {
            let since = self.iter as i64 - self.last_overflow;
            if since > 0 && (since as u64).is_multiple_of(self.window) {
                self.left = self.hysteresis;
                self.scale *= 2.0;
            }
        }
        self.iter += 1;
    }
}

/// Divides each trainable parameter's gradient by `factor`'s inverse and notes an inf
/// or NaN.
struct Check<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
    overflow: bool,
}

impl ModuleVisitor for Check<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !trains(param) {
            return;
        }
        let id: ParamId = param.id;
        let Some(g) = self.grads.remove::<D>(id) else {
            return;
        };
        if !self.overflow {
            let bad = g.clone().is_finite().bool_not().any().into_scalar::<bool>();
            self.overflow = bad;
        }
        self.grads.register(id, g * self.factor);
    }
}

#[cfg(test)]
mod tests {
    use super::Schedule;

    fn run(hysteresis: u32, window: u64, overflows: &[bool]) -> Vec<f64> {
        let mut s = Schedule {
            scale: 8.0,
            window,
            hysteresis,
            left: hysteresis,
            ..Schedule::default()
        };
        overflows
            .iter()
            .map(|&o| {
                s.update(o);
                s.scale
            })
            .collect()
    }

    #[test]
    fn doubles_after_a_clean_window_and_halves_after_hysteresis() {
        // Window 2: doubles at the 2nd clean step (and again 2 after the last
        // overflow); hysteresis 2: the second overflow halves.
        assert_eq!(
            run(2, 2, &[false, false, true, true, false, false]),
            vec![8.0, 16.0, 16.0, 8.0, 8.0, 16.0]
        );
        // Hysteresis 1 halves at once, down to the minimum of 1.
        assert_eq!(
            run(1, 100, &[true, true, true, true]),
            vec![4.0, 2.0, 1.0, 1.0]
        );
    }
}
