//! DeepSpeed's JSON training configuration (`ds_config.json`), read and checked the way
//! DeepSpeed reads it, for training engines built on kolo (`kolo_burn::Engine`).
//!
//! Every key DeepSpeed documents for the batch sizes, the optimizer, the learning-rate
//! scheduler, gradient clipping, fp16/bf16, ZeRO (with CPU offload), activation
//! checkpointing and logging is read into [`DeepSpeedConfig`]. A key DeepSpeed has
//! but kolo does not act on is accepted and listed in [`DeepSpeedConfig::warnings`]
//! (one line each, naming it); a key that is not DeepSpeed's at all fails, naming it
//! and the nearest key that is; a setting kolo cannot honour (NVMe offload, CPU
//! activation checkpointing, an optimizer kolo does not have) fails saying so.

mod keys;
mod schedule;

use std::path::Path;

use serde_json::{Map, Value};

pub use schedule::{LrSchedule, WarmupType};

/// What is wrong with a configuration.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("cannot read the DeepSpeed config {path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The system's message.
        message: String,
    },
    /// The text is not JSON.
    #[error("the DeepSpeed config is not valid JSON: {0}")]
    Json(String),
    /// A key that is not DeepSpeed's.
    #[error("unknown key {key:?} in {section}{}", nearest.as_ref().map_or(String::new(), |n| format!(" (did you mean {n:?}?)")))]
    UnknownKey {
        /// The key as written.
        key: String,
        /// Where: `the top level`, `zero_optimization`, …
        section: String,
        /// The known key nearest to it, when one is near.
        nearest: Option<String>,
    },
    /// A value of the wrong type or out of range.
    #[error("{key}: {message}")]
    Invalid {
        /// The key's path, e.g. `fp16.loss_scale`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The three batch sizes do not agree.
    #[error(
        "train_batch_size ({train:?}) must equal train_micro_batch_size_per_gpu ({micro:?}) × \
         gradient_accumulation_steps ({accumulation:?}) × {world} ranks"
    )]
    Batch {
        /// `train_batch_size` as given.
        train: Option<u64>,
        /// `train_micro_batch_size_per_gpu` as given.
        micro: Option<u64>,
        /// `gradient_accumulation_steps` as given.
        accumulation: Option<u64>,
        /// The ranks.
        world: u64,
    },
    /// A DeepSpeed setting kolo cannot honour.
    #[error("{key}: {message}")]
    Unsupported {
        /// The key's path.
        key: String,
        /// Why, and what to do instead.
        message: String,
    },
}

/// The optimizer (`optimizer.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptimizerKind {
    /// `Adam` (decoupled weight decay, as DeepSpeed's default `adam_w_mode: true`,
    /// unless `adam_w_mode` is false).
    Adam,
    /// `AdamW`.
    AdamW,
    /// `SGD` (with `momentum`).
    Sgd,
    /// `Lamb`.
    Lamb,
}

/// `optimizer`: the type and its parameters (DeepSpeed's defaults where absent).
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerConfig {
    /// The optimizer.
    pub kind: OptimizerKind,
    /// `lr` (default 1e-3).
    pub lr: f64,
    /// `betas` (default [0.9, 0.999]).
    pub betas: (f64, f64),
    /// `eps` (default 1e-8).
    pub eps: f64,
    /// `weight_decay` (default 0).
    pub weight_decay: f64,
    /// `momentum` (SGD; default 0).
    pub momentum: f64,
    /// `adam_w_mode` (Adam; default true: decoupled weight decay).
    pub adam_w_mode: bool,
    /// `amsgrad` (Adam, AdamW; default false).
    pub amsgrad: bool,
    /// `nesterov` (SGD; default false).
    pub nesterov: bool,
    /// `dampening` (SGD; default 0, as PyTorch's).
    pub dampening: f64,
}

/// `fp16`.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp16 {
    /// `enabled`.
    pub enabled: bool,
    /// `loss_scale`: 0 for dynamic scaling (the default), else the fixed scale.
    pub loss_scale: f64,
    /// `initial_scale_power` (default 16).
    pub initial_scale_power: i32,
    /// `loss_scale_window` (default 1000).
    pub loss_scale_window: u64,
    /// `hysteresis` (default 2).
    pub hysteresis: u32,
    /// `min_loss_scale` (default 1).
    pub min_loss_scale: f64,
}

impl Default for Fp16 {
    fn default() -> Self {
        Fp16 {
            enabled: false,
            loss_scale: 0.0,
            initial_scale_power: 16,
            loss_scale_window: 1000,
            hysteresis: 2,
            min_loss_scale: 1.0,
        }
    }
}

/// `zero_optimization`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Zero {
    /// `stage`: 0 (gradient allreduce), 1 and 2 (sharded optimizer state), 3 (fully
    /// sharded parameters).
    pub stage: u8,
    /// `offload_optimizer.device` is `cpu`.
    pub offload_optimizer: bool,
    /// `offload_param.device` is `cpu`.
    pub offload_param: bool,
    /// `overlap_comm`.
    pub overlap_comm: bool,
    /// `reduce_bucket_size` (elements), if given.
    pub reduce_bucket_size: Option<u64>,
    /// `allgather_bucket_size` (elements), if given.
    pub allgather_bucket_size: Option<u64>,
}

/// `activation_checkpointing`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ActivationCheckpointing {
    /// The section is present: recompute activations in backward (Burn's balanced
    /// checkpointing).
    pub enabled: bool,
    /// `partition_activations` (no effect without model parallelism).
    pub partition_activations: bool,
}

/// A DeepSpeed configuration, checked and with the batch sizes resolved for a number
/// of ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepSpeedConfig {
    /// `train_batch_size`: samples per optimizer step over all ranks.
    pub train_batch_size: u64,
    /// `train_micro_batch_size_per_gpu`: samples per forward/backward on each rank.
    pub micro_batch_per_rank: u64,
    /// `gradient_accumulation_steps`: micro-steps per optimizer step.
    pub gradient_accumulation_steps: u64,
    /// `optimizer` (None: the caller's own).
    pub optimizer: Option<OptimizerConfig>,
    /// `scheduler` (None: the optimizer's `lr` throughout).
    pub scheduler: Option<LrSchedule>,
    /// `gradient_clipping`: the global norm to clip to (0: off).
    pub gradient_clipping: f64,
    /// `fp16`.
    pub fp16: Fp16,
    /// `bf16.enabled`.
    pub bf16: bool,
    /// `zero_optimization`.
    pub zero: Zero,
    /// `activation_checkpointing`.
    pub activation_checkpointing: ActivationCheckpointing,
    /// `steps_per_print` (default 10).
    pub steps_per_print: u64,
    /// `wall_clock_breakdown`.
    pub wall_clock_breakdown: bool,
    /// One line per key accepted without effect in kolo, naming it.
    pub warnings: Vec<String>,
}

impl DeepSpeedConfig {
    /// Reads and checks the JSON file at `path` for a job of `world` ranks.
    ///
    /// # Errors
    /// The file cannot be read, or any [`ConfigError`] of [`from_json`](Self::from_json).
    pub fn from_file(path: impl AsRef<Path>, world: u64) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_json(&text, world)
    }

    /// Reads and checks a configuration given as JSON text for a job of `world` ranks.
    ///
    /// # Errors
    /// Invalid JSON, a key that is not DeepSpeed's (naming the nearest one), a value
    /// of the wrong type, inconsistent batch sizes (naming all three), a setting kolo
    /// cannot honour.
    pub fn from_json(text: &str, world: u64) -> Result<Self, ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let Value::Object(top) = value else {
            return Err(ConfigError::Json("the top level is not an object".into()));
        };
        let mut warnings = Vec::new();
        keys::check(&top, keys::TOP, "the top level", "", &mut warnings)?;
        let get_u = |k: &str| -> Result<Option<u64>, ConfigError> { opt_u64(&top, k, k) };
        let (train_batch_size, micro_batch_per_rank, gradient_accumulation_steps) = resolve_batch(
            get_u("train_batch_size")?,
            get_u("train_micro_batch_size_per_gpu")?,
            get_u("gradient_accumulation_steps")?,
            world,
        )?;
        let optimizer = match top.get("optimizer") {
            Some(v) => Some(optimizer(v, &mut warnings)?),
            None => None,
        };
        let scheduler = match top.get("scheduler") {
            Some(v) => Some(schedule::parse(v, &mut warnings)?),
            None => None,
        };
        let gradient_clipping =
            opt_f64(&top, "gradient_clipping", "gradient_clipping")?.unwrap_or(0.0);
        if gradient_clipping < 0.0 {
            return Err(invalid("gradient_clipping", "must be 0 (off) or positive"));
        }
        let fp16 = match top.get("fp16") {
            Some(v) => fp16(v, &mut warnings)?,
            None => Fp16::default(),
        };
        let bf16 = match top.get("bf16") {
            Some(v) => {
                let m = object(v, "bf16")?;
                keys::check(m, keys::BF16, "bf16", "bf16.", &mut warnings)?;
                opt_bool(m, "enabled", "bf16.enabled")?.unwrap_or(false)
            }
            None => false,
        };
        if fp16.enabled && bf16 {
            return Err(invalid(
                "fp16.enabled",
                "fp16 and bf16 cannot both be enabled",
            ));
        }
        let zero = match top.get("zero_optimization") {
            Some(v) => zero(v, &mut warnings)?,
            None => Zero::default(),
        };
        let activation_checkpointing = match top.get("activation_checkpointing") {
            Some(v) => activation(v, &mut warnings)?,
            None => ActivationCheckpointing::default(),
        };
        Ok(DeepSpeedConfig {
            train_batch_size,
            micro_batch_per_rank,
            gradient_accumulation_steps,
            optimizer,
            scheduler,
            gradient_clipping,
            fp16,
            bf16,
            zero,
            activation_checkpointing,
            steps_per_print: get_u("steps_per_print")?.unwrap_or(10).max(1),
            wall_clock_breakdown: opt_bool(&top, "wall_clock_breakdown", "wall_clock_breakdown")?
                .unwrap_or(false),
            warnings,
        })
    }
}

/// DeepSpeed's batch arithmetic: `train = micro × accumulation × world`; any two give
/// the third, one of `train` and `micro` alone takes one accumulation step.
///
/// # Errors
/// [`ConfigError::Batch`] when the three do not agree or cannot be completed exactly.
pub fn resolve_batch(
    train: Option<u64>,
    micro: Option<u64>,
    accumulation: Option<u64>,
    world: u64,
) -> Result<(u64, u64, u64), ConfigError> {
    let err = || ConfigError::Batch {
        train,
        micro,
        accumulation,
        world,
    };
    let world = world.max(1);
    let exact = |a: u64, b: u64| (b > 0 && a.is_multiple_of(b) && a / b > 0).then(|| a / b);
    let (t, m, a) = match (train, micro, accumulation) {
        (Some(t), Some(m), Some(a)) => (t, m, a),
        (Some(t), Some(m), None) => (t, m, exact(t, m * world).ok_or_else(err)?),
        (Some(t), None, Some(a)) => (t, exact(t, a * world).ok_or_else(err)?, a),
        (None, Some(m), Some(a)) => (m * a * world, m, a),
        (Some(t), None, None) => (t, exact(t, world).ok_or_else(err)?, 1),
        (None, Some(m), None) => (m * world, m, 1),
        (None, None, _) => {
            return Err(invalid(
                "train_batch_size",
                "give train_batch_size or train_micro_batch_size_per_gpu",
            ))
        }
    };
    if m == 0 || a == 0 || t != m * a * world {
        return Err(err());
    }
    Ok((t, m, a))
}

fn invalid(key: &str, message: &str) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

fn object<'a>(v: &'a Value, key: &str) -> Result<&'a Map<String, Value>, ConfigError> {
    v.as_object()
        .ok_or_else(|| invalid(key, "must be an object"))
}

/// A number that may be written as a float (`5e8`), as DeepSpeed's configs do.
fn as_f64(v: &Value, key: &str) -> Result<f64, ConfigError> {
    match v {
        Value::Number(n) => n.as_f64().ok_or_else(|| invalid(key, "must be a number")),
        Value::String(s) if s == "auto" => Err(invalid(
            key,
            "\"auto\" is filled in by Hugging Face's Trainer, not by DeepSpeed: give a value",
        )),
        _ => Err(invalid(key, &format!("must be a number, not {v}"))),
    }
}

fn opt_f64(m: &Map<String, Value>, k: &str, key: &str) -> Result<Option<f64>, ConfigError> {
    m.get(k).map(|v| as_f64(v, key)).transpose()
}

fn opt_u64(m: &Map<String, Value>, k: &str, key: &str) -> Result<Option<u64>, ConfigError> {
    match opt_f64(m, k, key)? {
        Some(x) if x >= 0.0 && x.fract() == 0.0 && x <= 2f64.powi(53) => Ok(Some(x as u64)),
        Some(x) => Err(invalid(
            key,
            &format!("must be a whole number ≥ 0, not {x}"),
        )),
        None => Ok(None),
    }
}

fn opt_bool(m: &Map<String, Value>, k: &str, key: &str) -> Result<Option<bool>, ConfigError> {
    match m.get(k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(invalid(key, &format!("must be true or false, not {v}"))),
    }
}

fn optimizer(v: &Value, warnings: &mut Vec<String>) -> Result<OptimizerConfig, ConfigError> {
    let m = object(v, "optimizer")?;
    keys::check(m, keys::OPTIMIZER, "optimizer", "optimizer.", warnings)?;
    let kind = match m
        .get("type")
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase)
    {
        Some(t) if t == "adam" => OptimizerKind::Adam,
        Some(t) if t == "adamw" => OptimizerKind::AdamW,
        Some(t) if t == "sgd" => OptimizerKind::Sgd,
        Some(t) if t == "lamb" => OptimizerKind::Lamb,
        Some(t) => {
            return Err(ConfigError::Unsupported {
                key: "optimizer.type".into(),
                message: format!(
                    "{t:?} is not an optimizer kolo has (Adam, AdamW, SGD, Lamb); pass your own \
                     optimizer to the engine and leave the optimizer section out"
                ),
            })
        }
        None => {
            return Err(invalid(
                "optimizer.type",
                "missing (Adam, AdamW, SGD or Lamb)",
            ))
        }
    };
    let empty = Map::new();
    let p = match m.get("params") {
        Some(v) => object(v, "optimizer.params")?,
        None => &empty,
    };
    keys::check(
        p,
        keys::OPTIMIZER_PARAMS,
        "optimizer.params",
        "optimizer.params.",
        warnings,
    )?;
    let betas = match p.get("betas") {
        None => (0.9, 0.999),
        Some(Value::Array(b)) if b.len() == 2 => (
            as_f64(&b[0], "optimizer.params.betas")?,
            as_f64(&b[1], "optimizer.params.betas")?,
        ),
        Some(v) => {
            return Err(invalid(
                "optimizer.params.betas",
                &format!("must be two numbers, not {v}"),
            ))
        }
    };
    Ok(OptimizerConfig {
        kind,
        lr: opt_f64(p, "lr", "optimizer.params.lr")?.unwrap_or(1e-3),
        betas,
        eps: opt_f64(p, "eps", "optimizer.params.eps")?.unwrap_or(1e-8),
        weight_decay: opt_f64(p, "weight_decay", "optimizer.params.weight_decay")?.unwrap_or(0.0),
        momentum: opt_f64(p, "momentum", "optimizer.params.momentum")?.unwrap_or(0.0),
        adam_w_mode: opt_bool(p, "adam_w_mode", "optimizer.params.adam_w_mode")?.unwrap_or(true),
        amsgrad: opt_bool(p, "amsgrad", "optimizer.params.amsgrad")?.unwrap_or(false),
        nesterov: opt_bool(p, "nesterov", "optimizer.params.nesterov")?.unwrap_or(false),
        dampening: opt_f64(p, "dampening", "optimizer.params.dampening")?.unwrap_or(0.0),
    })
}

fn fp16(v: &Value, warnings: &mut Vec<String>) -> Result<Fp16, ConfigError> {
    let m = object(v, "fp16")?;
    keys::check(m, keys::FP16, "fp16", "fp16.", warnings)?;
    let d = Fp16::default();
    let f = Fp16 {
        enabled: opt_bool(m, "enabled", "fp16.enabled")?.unwrap_or(false),
        loss_scale: opt_f64(m, "loss_scale", "fp16.loss_scale")?.unwrap_or(d.loss_scale),
        initial_scale_power: opt_f64(m, "initial_scale_power", "fp16.initial_scale_power")?
            .map_or(d.initial_scale_power, |p| p as i32),
        loss_scale_window: opt_u64(m, "loss_scale_window", "fp16.loss_scale_window")?
            .unwrap_or(d.loss_scale_window),
        hysteresis: opt_u64(m, "hysteresis", "fp16.hysteresis")?
            .map_or(d.hysteresis, |h| h.clamp(1, u64::from(u32::MAX)) as u32),
        min_loss_scale: opt_f64(m, "min_loss_scale", "fp16.min_loss_scale")?
            .unwrap_or(d.min_loss_scale),
    };
    if f.loss_scale < 0.0 {
        return Err(invalid(
            "fp16.loss_scale",
            "must be 0 (dynamic) or positive",
        ));
    }
    if opt_bool(m, "consecutive_hysteresis", "fp16.consecutive_hysteresis")? == Some(true) {
        warnings.push(
            "fp16.consecutive_hysteresis: accepted, no effect in kolo (hysteresis is restored \
             when the scale grows)"
                .into(),
        );
    }
    Ok(f)
}

fn zero(v: &Value, warnings: &mut Vec<String>) -> Result<Zero, ConfigError> {
    let m = object(v, "zero_optimization")?;
    keys::check(
        m,
        keys::ZERO,
        "zero_optimization",
        "zero_optimization.",
        warnings,
    )?;
    let stage = opt_u64(m, "stage", "zero_optimization.stage")?.unwrap_or(0);
    if stage > 3 {
        return Err(invalid("zero_optimization.stage", "must be 0, 1, 2 or 3"));
    }
    let offload = |k: &str, warnings: &mut Vec<String>| -> Result<bool, ConfigError> {
        let Some(v) = m.get(k) else { return Ok(false) };
        let key = format!("zero_optimization.{k}");
        let o = object(v, &key)?;
        keys::check(o, keys::OFFLOAD, &key, &format!("{key}."), warnings)?;
        match o.get("device").and_then(Value::as_str) {
            Some("cpu") => Ok(true),
            Some("none") | None => Ok(false),
            Some(other) => Err(ConfigError::Unsupported {
                key: format!("{key}.device"),
                message: format!("{other:?}: kolo offloads to \"cpu\" only (no NVMe)"),
            }),
        }
    };
    let offload_optimizer = offload("offload_optimizer", warnings)?;
    let offload_param = offload("offload_param", warnings)?;
    if offload_param && stage != 3 {
        return Err(invalid(
            "zero_optimization.offload_param",
            "offloading parameters needs stage 3",
        ));
    }
    Ok(Zero {
        stage: stage as u8,
        offload_optimizer,
        offload_param,
        overlap_comm: opt_bool(m, "overlap_comm", "zero_optimization.overlap_comm")?
            .unwrap_or(false),
        reduce_bucket_size: opt_u64(
            m,
            "reduce_bucket_size",
            "zero_optimization.reduce_bucket_size",
        )?,
        allgather_bucket_size: opt_u64(
            m,
            "allgather_bucket_size",
            "zero_optimization.allgather_bucket_size",
        )?,
    })
}

fn activation(
    v: &Value,
    warnings: &mut Vec<String>,
) -> Result<ActivationCheckpointing, ConfigError> {
    let m = object(v, "activation_checkpointing")?;
    keys::check(
        m,
        keys::ACTIVATION,
        "activation_checkpointing",
        "activation_checkpointing.",
        warnings,
    )?;
    if opt_bool(
        m,
        "cpu_checkpointing",
        "activation_checkpointing.cpu_checkpointing",
    )? == Some(true)
    {
        return Err(ConfigError::Unsupported {
            key: "activation_checkpointing.cpu_checkpointing".into(),
            message: "Burn keeps checkpointed activations on the device; set it to false".into(),
        });
    }
    let partition = opt_bool(
        m,
        "partition_activations",
        "activation_checkpointing.partition_activations",
    )?
    .unwrap_or(false);
    if partition {
        warnings.push(
            "activation_checkpointing.partition_activations: accepted, no effect in kolo \
             (activations are split across model-parallel ranks, which kolo does not have)"
                .into(),
        );
    }
    Ok(ActivationCheckpointing {
        enabled: true,
        partition_activations: partition,
    })
}

#[cfg(test)]
mod tests;
