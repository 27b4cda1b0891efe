//! A DeepSpeed-style training engine for Burn, set up from DeepSpeed's JSON config.

use std::path::Path;
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, GradientsAccumulator, GradientsParams, LambConfig, ModuleOptimizer,
    SgdConfig,
};
use burn::tensor::{Device, FloatDType, Tensor};
use kolo::deepspeed::{DeepSpeedConfig, OptimizerConfig, OptimizerKind};
use kolo::Kolo;

use crate::error::{Error, Result};
use crate::{FullyShard, GradientReducer, LossScaler, ShardedOptimizer};

mod checkpoint;
mod grads;

/// DeepSpeed's engine for a Burn model: the loop is `engine.forward(..)`,
/// `engine.backward(loss)`, `engine.step()`, and everything else — micro-batch size,
/// gradient accumulation, the optimizer and its learning-rate schedule, gradient
/// clipping, fp16 with dynamic loss scaling or bf16, the ZeRO stage with CPU offload,
/// activation checkpointing, logging — comes from a DeepSpeed config file
/// ([`kolo::deepspeed::DeepSpeedConfig`]):
///
/// ```no_run
/// # use burn::module::Module;
/// # use burn::nn::Linear;
/// # use burn::tensor::Tensor;
/// # fn demo(kolo: &kolo::Kolo, model: Linear, x: Tensor<2>) -> kolo_burn::Result<()> {
/// let mut engine = kolo_burn::Engine::from_config(kolo, model, "ds_config.json")?;
/// let out = engine.forward(x, |m, x| m.forward(x));
/// let loss = out.powf_scalar(2.0).mean();
/// engine.backward(loss)?;
/// engine.step()?; // steps at the end of each accumulation window
/// # Ok(()) }
/// ```
///
/// **ZeRO stages.** 0: every gradient averaged across the ranks
/// ([`GradientReducer`]) and the plain optimizer; 1 and 2: the optimizer state
/// sharded ([`ShardedOptimizer`]: the gradients reduce-scattered, each rank stepping
/// its share); 3: the whole model one [`FullyShard`] unit (each rank holds 1/N of the
/// parameters, gathered for forward and backward), with `offload_param` /
/// `offload_optimizer` keeping the blocks and the optimizer's state on the host.
/// A model made of its own [`FullyShard`] units (stage 3 layer by layer, so that no
/// rank ever holds the whole model) is taken as it is at stage 3.
///
/// **Precision.** `fp16` / `bf16`: the model computes in that type over f32 master
/// weights (the parameters, the optimizer state and the reduction stay f32); fp16
/// scales the loss ([`LossScaler`], DeepSpeed's dynamic scaling unless
/// `loss_scale` > 0) and skips the steps whose gradients overflow on any rank.
///
/// **Accumulation.** `backward` sums each micro-step's gradients (of the loss divided
/// by `gradient_accumulation_steps`, as DeepSpeed scales it); `step` acts at the end
/// of each window of `gradient_accumulation_steps` micro-steps: unscale and check
/// (fp16), reduce, clip to `gradient_clipping` (the global norm over all ranks), step
/// the optimizer at the schedule's learning rate. A skipped step does not advance the
/// schedule.
pub struct Engine<M: Module> {
    kolo: Kolo,
    config: DeepSpeedConfig,
    /// The model (taken out only within `step`).
    held: Option<Held<M>>,
    optim: Optim,
    scaler: Option<LossScaler>,
    /// The window's gradients so far.
    acc: Option<GradientsParams>,
    /// Micro-steps since the start.
    micro: u64,
    /// Optimizer steps taken (windows ended), skipped ones included.
    steps: u64,
    /// Windows skipped for overflow.
    skipped: u64,
    /// The float type the model computes in at stages 0–2 (`None`: its own).
    compute: Option<FloatDType>,
    device: Device,
    breakdown: Breakdown,
}

impl<M: Module> std::fmt::Debug for Engine<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("stage", &self.config.zero.stage)
            .field("micro_steps", &self.micro)
            .field("steps", &self.steps)
            .field("skipped", &self.skipped)
            .finish_non_exhaustive()
    }
}

/// The model as the stage holds it.
enum Held<M: Module> {
    Whole(M),
    Unit(Box<FullyShard<M>>),
}

/// How the stage steps.
enum Optim {
    Reduced(GradientReducer, ModuleOptimizer),
    Sharded(ShardedOptimizer),
    Units(ModuleOptimizer),
}

/// Time spent per phase since the last print (`wall_clock_breakdown`).
#[derive(Default)]
struct Breakdown {
    forward: Duration,
    backward: Duration,
    step: Duration,
}

impl<M: Module + 'static> Engine<M> {
    /// The engine for `model` set up from the DeepSpeed config file at `path`.
    ///
    /// # Errors
    /// The config's errors ([`Error::Config`]); as [`new`](Self::new).
    pub fn from_config(kolo: &Kolo, model: M, path: impl AsRef<Path>) -> Result<Self> {
        let config = DeepSpeedConfig::from_file(path, kolo.size() as u64)?;
        Self::new(kolo, model, config)
    }

    /// The engine for `model` set up from `config`. Every rank starts from rank 0's
    /// model. Warns once (rank 0) about each key accepted without effect.
    ///
    /// # Errors
    /// A config without an `optimizer` section ([`Error::InvalidArgument`]: use
    /// [`with_optimizer`](Self::with_optimizer)); the broadcast or, at stage 3, the
    /// sharding of the model failing.
    pub fn new(kolo: &Kolo, model: M, config: DeepSpeedConfig) -> Result<Self> {
        let optim = match &config.optimizer {
            Some(o) => build_optimizer(o),
            None => {
                return Err(Error::InvalidArgument {
                    what: "Engine::new",
                    message: "the config has no optimizer section: add one, or use \
                              Engine::with_optimizer"
                        .into(),
                })
            }
        };
        Self::with_optimizer(kolo, model, config, optim)
    }

    /// The engine for `model` set up from `config`, stepping with `optim` (the config's
    /// `optimizer` section, if any, is not used; its schedule still is, starting from
    /// `optim`'s learning rate given to `step`).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_optimizer(
        kolo: &Kolo,
        model: M,
        config: DeepSpeedConfig,
        optim: ModuleOptimizer,
    ) -> Result<Self> {
        // A model made of its own units is stage 3 already, layer by layer (its blocks
        // differ per rank: they must not be broadcast or reduced as one model).
        let own_units = crate::fsdp::has_units(kolo, &model);
        if own_units && config.zero.stage != 3 {
            return Err(Error::InvalidArgument {
                what: "Engine::new",
                message: format!(
                    "the model is made of FullyShard units (fully sharded parameters): set \
                     zero_optimization.stage to 3, not {}",
                    config.zero.stage
                ),
            });
        }
        let mut model = if own_units {
            model
        } else {
            crate::broadcast_parameters(kolo, model, 0)?
        };
        let mut device = model
            .devices()
            .into_iter()
            .next()
            .unwrap_or_else(|| Device::flex().autodiff());
        if config.activation_checkpointing.enabled && device.is_autodiff() && config.zero.stage < 3
        {
            // Burn's balanced checkpointing: memory-bound activations recomputed in
            // backward. (At stage 3 the unit recomputes its forward anyway.)
            device = device.gradient_checkpointing();
            model = model.fork(&device);
        }
        let half = if config.fp16.enabled {
            Some(FloatDType::F16)
        } else if config.bf16 {
            Some(FloatDType::BF16)
        } else {
            None
        };
        let mut warnings = config.warnings.clone();
        let zero = &config.zero;
        let (held, optim_kind, compute) =
            stage_parts(kolo, &config, model, optim, half, own_units, &mut warnings)?;
        if zero.overlap_comm {
            warnings.push(
                "zero_optimization.overlap_comm: no effect in kolo's engine (gradients are \
                 reduced at the end of each window; GradientReducer::overlap overlaps them)"
                    .into(),
            );
        }
        if zero.allgather_bucket_size.is_some() {
            warnings.push("zero_optimization.allgather_bucket_size: no effect in kolo".into());
        }
        if kolo.rank() == 0 {
            for w in &warnings {
                tracing::warn!("kolo_burn::Engine: {w}");
            }
        }
        let scaler = loss_scaler(kolo, &config);
        Ok(Engine {
            kolo: kolo.clone(),
            config,
            held: Some(held),
            optim: optim_kind,
            scaler,
            acc: None,
            micro: 0,
            steps: 0,
            skipped: 0,
            compute,
            device,
            breakdown: Breakdown::default(),
        })
    }

    /// `f` (the model's forward) on the model and `x`: at stage 3 on the gathered
    /// parameters, in fp16/bf16 when the config says so.
    pub fn forward<const I: usize, const O: usize, F>(&mut self, x: Tensor<I>, f: F) -> Tensor<O>
    where
        F: Fn(&M, Tensor<I>) -> Tensor<O> + Send + Sync + 'static,
    {
        let started = Instant::now();
        let Some(held) = self.held.as_ref() else {
            panic!("kolo_burn::Engine::forward: {}", gone());
        };
        let out = match (held, self.compute) {
            (Held::Unit(u), _) => u.forward(x, f),
            (Held::Whole(m), None) => f(m, x),
            (Held::Whole(m), Some(dtype)) => {
                let back = x.dtype();
                let cast = m.clone().map(&mut CastParams(dtype));
                f(&cast, x.cast(dtype)).cast(back)
            }
        };
        self.breakdown.forward += started.elapsed();
        out
    }

    /// Backward of this micro-step's `loss` (scaled for fp16 and divided by the
    /// accumulation steps), its gradients added to the window's.
    ///
    /// # Errors
    /// None today; a `Result` for the reductions a later version may start here.
    pub fn backward(&mut self, loss: Tensor<1>) -> Result<()> {
        let started = Instant::now();
        let mut loss = loss / self.config.gradient_accumulation_steps as f64;
        if let Some(s) = &self.scaler {
            loss = s.scale_loss(loss);
        }
        let raw = loss.backward();
        let earlier = self.acc.take();
        // Burn's accumulator sums the window's micro-steps, parameter by parameter.
        fn sum<N: Module>(
            module: &N,
            earlier: Option<GradientsParams>,
            grads: GradientsParams,
        ) -> GradientsParams {
            let mut acc = GradientsAccumulator::<N>::new();
            if let Some(e) = earlier {
                acc.accumulate(module, e);
            }
            acc.accumulate(module, grads);
            acc.grads()
        }
        let grads = match self.held()? {
            Held::Whole(m) => sum(m, earlier, GradientsParams::from_grads(raw, m)),
            Held::Unit(u) => sum(&**u, earlier, GradientsParams::from_grads(raw, &**u)),
        };
        self.acc = Some(grads);
        self.micro += 1;
        self.breakdown.backward += started.elapsed();
        Ok(())
    }

    /// Whether the last `backward` ended an accumulation window (the next `step`
    /// steps the optimizer).
    pub fn is_gradient_accumulation_boundary(&self) -> bool {
        self.micro > 0
            && self
                .micro
                .is_multiple_of(self.config.gradient_accumulation_steps)
    }

    /// At the end of an accumulation window: unscale and check the gradients (fp16),
    /// reduce them, clip them, step the optimizer at the schedule's learning rate and
    /// prints every `steps_per_print` steps (rank 0). `Ok(true)` when the optimizer
    /// stepped; `Ok(false)` inside a window or for a step skipped on overflow.
    ///
    /// # Errors
    /// A failed reduction or agreement (every rank fails alike).
    pub fn step(&mut self) -> Result<bool> {
        if !self.is_gradient_accumulation_boundary() || self.acc.is_none() {
            return Ok(false);
        }
        let started = Instant::now();
        let grads = self.acc.take().unwrap_or_default();
        let lr = self.lr();
        self.steps += 1;
        let grads = match (&mut self.scaler, self.held.as_ref()) {
            (Some(s), Some(Held::Whole(m))) => s.unscale(m, grads)?,
            (Some(s), Some(Held::Unit(u))) => s.unscale(&**u, grads)?,
            _ => Some(grads),
        };
        let Some(grads) = grads else {
            self.skipped += 1;
            self.breakdown.step += started.elapsed();
            self.report(lr);
            return Ok(false);
        };
        let clip = self.config.gradient_clipping;
        let kolo = &self.kolo;
        let held = self.held.take().ok_or_else(gone)?;
        // A failure keeps the model as it was (every rank fails alike).
        let (held, outcome) = match (held, &mut self.optim) {
            (Held::Whole(m), Optim::Reduced(reducer, optim)) => {
                let g = reducer.reduce(&m, grads).and_then(|g| match clip > 0.0 {
                    true => grads::clip_global(kolo, &m, g, clip, false),
                    false => Ok(g),
                });
                match g {
                    Ok(g) => (Held::Whole(optim.step(lr, m, g)), Ok(())),
                    Err(e) => (Held::Whole(m), Err(e)),
                }
            }
            (Held::Whole(m), Optim::Units(optim)) => {
                // The model's own units: gradients arrive averaged, each rank's blocks.
                let g = match clip > 0.0 {
                    true => grads::clip_global(kolo, &m, grads, clip, true),
                    false => Ok(grads),
                };
                match g {
                    Ok(g) => (Held::Whole(optim.step(lr, m, g)), Ok(())),
                    Err(e) => (Held::Whole(m), Err(e)),
                }
            }
            (Held::Whole(m), Optim::Sharded(sharded)) => match sharded.step(lr, m.clone(), grads) {
                Ok(m) => (Held::Whole(m), Ok(())),
                Err(e) => (Held::Whole(m), Err(e)),
            },
            (Held::Unit(u), Optim::Units(optim)) => {
                let g = match clip > 0.0 {
                    true => grads::clip_global(kolo, &*u, grads, clip, true),
                    false => Ok(grads),
                };
                match g {
                    Ok(g) => (Held::Unit(Box::new(optim.step(lr, *u, g))), Ok(())),
                    Err(e) => (Held::Unit(u), Err(e)),
                }
            }
            (held, _) => (held, Ok(())),
        };
        self.held = Some(held);
        outcome?;
        self.breakdown.step += started.elapsed();
        self.report(lr);
        Ok(true)
    }

    /// Prints the step, learning rate, loss scale and (with `wall_clock_breakdown`) the
    /// time per phase, every `steps_per_print` steps on rank 0.
    fn report(&mut self, lr: f64) {
        if !self.steps.is_multiple_of(self.config.steps_per_print) {
            return;
        }
        if self.kolo.rank() == 0 {
            let scale = self
                .scaler
                .as_ref()
                .map_or(String::new(), |s| format!(" loss_scale={}", s.scale()));
            println!(
                "kolo engine: step={} skipped={} lr={lr:.6e}{scale}",
                self.steps, self.skipped
            );
            if self.config.wall_clock_breakdown {
                let ms = |d: Duration| d.as_secs_f64() * 1e3;
                let b = &self.breakdown;
                println!(
                    "kolo engine: time (ms) forward={:.2} backward={:.2} step={:.2} over {} steps",
                    ms(b.forward),
                    ms(b.backward),
                    ms(b.step),
                    self.config.steps_per_print
                );
            }
        }
        self.breakdown = Breakdown::default();
    }

    /// The learning rate of the next optimizer step: the schedule's at the steps taken
    /// (skipped ones excluded), else the optimizer's `lr`.
    pub fn lr(&self) -> f64 {
        let taken = self.steps - self.skipped;
        match (&self.config.scheduler, &self.config.optimizer) {
            (Some(s), _) => s.lr_at(taken),
            (None, Some(o)) => o.lr,
            (None, None) => 1e-3,
        }
    }

    /// Optimizer steps taken (windows ended), skipped ones included.
    pub fn global_steps(&self) -> u64 {
        self.steps
    }

    /// Steps skipped because the fp16 gradients overflowed on some rank.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// The fp16 loss scale (None without fp16).
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(LossScaler::scale)
    }

    /// The resolved configuration (batch sizes for this job's ranks).
    pub fn config(&self) -> &DeepSpeedConfig {
        &self.config
    }

    /// The device to put inputs on (with activation checkpointing, the model's device
    /// with Burn's balanced checkpointing).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The whole model (at stage 3 gathered from every rank: collective).
    ///
    /// # Errors
    /// The all-gather failed (stage 3).
    pub fn module(&self) -> Result<M> {
        match self.held()? {
            Held::Whole(m) => Ok(m.clone()),
            Held::Unit(u) => u.gathered(),
        }
    }

    fn held(&self) -> Result<&Held<M>> {
        self.held.as_ref().ok_or_else(gone)
    }
}

/// The model is gone only if a `step` panicked midway.
fn gone() -> Error {
    Error::InvalidArgument {
        what: "Engine",
        message: "the model was lost in a step that panicked".into(),
    }
}

/// The model as the ZeRO stage holds it, the optimizer path and the stage-0–2 compute
/// type (see [`Engine`]'s docs); warnings for settings without effect added to
/// `warnings`.
fn stage_parts<M: Module + 'static>(
    kolo: &Kolo,
    config: &DeepSpeedConfig,
    model: M,
    optim: ModuleOptimizer,
    half: Option<FloatDType>,
    own_units: bool,
    warnings: &mut Vec<String>,
) -> Result<(Held<M>, Optim, Option<FloatDType>)> {
    let zero = &config.zero;
    let bucket = zero.reduce_bucket_size.map(|n| n as usize * 4);
    Ok(match zero.stage {
        0 => {
            let mut reducer = GradientReducer::new(kolo);
            if let Some(b) = bucket {
                reducer = reducer.chunk_bytes(b);
            }
            (Held::Whole(model), Optim::Reduced(reducer, optim), half)
        }
        1 | 2 => {
            let mut sharded = ShardedOptimizer::new(kolo, optim);
            if config.gradient_clipping > 0.0 {
                sharded = sharded.clip_global_norm(config.gradient_clipping as f32);
            }
            if zero.offload_optimizer {
                warnings.push(
                    "zero_optimization.offload_optimizer: no effect at stage 1 and 2 in \
                     kolo (the shard's state stays with the parameters; stage 3 offloads)"
                        .into(),
                );
            }
            (Held::Whole(model), Optim::Sharded(sharded), half)
        }
        _ if own_units => {
            if half.is_some() {
                warnings.push(
                    "fp16/bf16: the model's own FullyShard units compute as they were set \
                     (FullyShard::compute_dtype); the engine scales the loss for fp16"
                        .into(),
                );
            }
            (Held::Whole(model), Optim::Units(optim), None)
        }
        _ => {
            let mut unit = FullyShard::new(kolo, model)?;
            if let Some(dtype) = half {
                unit = unit.compute_dtype(dtype);
            }
            if zero.offload_param || zero.offload_optimizer {
                unit = unit.offload(&Device::flex());
            }
            (Held::Unit(Box::new(unit)), Optim::Units(optim), None)
        }
    })
}

/// fp16's loss scaler from the config (DeepSpeed's dynamic one unless `loss_scale` >
/// 0); `None` without fp16.
fn loss_scaler(kolo: &Kolo, config: &DeepSpeedConfig) -> Option<LossScaler> {
    config.fp16.enabled.then(|| {
        let f = &config.fp16;
        let s = if f.loss_scale > 0.0 {
            LossScaler::fixed(kolo, f.loss_scale)
        } else {
            LossScaler::dynamic(kolo).initial_scale_power(f.initial_scale_power)
        };
        s.loss_scale_window(f.loss_scale_window)
            .hysteresis(f.hysteresis)
            .min_loss_scale(f.min_loss_scale)
    })
}

/// Casts every float parameter to the compute type inside the graph: gradients flow
/// back to the f32 master weights.
struct CastParams(FloatDType);

impl ModuleMapper for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|t| t.cast(dtype))
    }
}

/// The Burn optimizer for DeepSpeed's `optimizer` section.
fn build_optimizer(o: &OptimizerConfig) -> ModuleOptimizer {
    let (b1, b2, eps) = (o.betas.0 as f32, o.betas.1 as f32, o.eps as f32);
    let wd = o.weight_decay as f32;
    let decay = (wd > 0.0).then(|| WeightDecayConfig::new(wd));
    // DeepSpeed's Adam decouples the weight decay unless adam_w_mode is false.
    let decoupled =
        o.kind == OptimizerKind::AdamW || (o.kind == OptimizerKind::Adam && o.adam_w_mode);
    match o.kind {
        OptimizerKind::AdamW | OptimizerKind::Adam if decoupled => AdamWConfig::new()
            .with_beta_1(b1)
            .with_beta_2(b2)
            .with_epsilon(eps)
            .with_weight_decay(wd)
            .with_amsgrad(o.amsgrad)
            .init(),
        OptimizerKind::Adam | OptimizerKind::AdamW => AdamConfig::new()
            .with_beta_1(b1)
            .with_beta_2(b2)
            .with_epsilon(eps)
            .with_amsgrad(o.amsgrad)
            .with_weight_decay(decay)
            .init(),
        OptimizerKind::Sgd => SgdConfig::new()
            .with_momentum((o.momentum > 0.0).then(|| {
                MomentumConfig::new()
                    .with_momentum(o.momentum)
                    .with_dampening(o.dampening)
                    .with_nesterov(o.nesterov)
            }))
            .with_weight_decay(decay)
            .init(),
        OptimizerKind::Lamb => LambConfig::new()
            .with_beta_1(b1)
            .with_beta_2(b2)
            .with_epsilon(eps)
            .with_weight_decay(wd)
            .init(),
    }
}
