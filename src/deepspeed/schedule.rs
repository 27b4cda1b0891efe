//! DeepSpeed's learning-rate schedules (`scheduler.type`): `WarmupLR`,
//! `WarmupDecayLR` and `OneCycle` (its learning rate; momentum cycling is not kolo's),
//! as a function of the optimizer step, with DeepSpeed's defaults and formulas.

use serde_json::Value;

use super::{as_f64, invalid, keys, object, opt_f64, opt_u64, ConfigError};

/// How a warm-up rises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmupType {
    /// `log` (DeepSpeed's default): `log(step + 1) / log(warmup_num_steps)`.
    Log,
    /// `linear`: `step / warmup_num_steps`.
    Linear,
}

/// A learning rate per optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub enum LrSchedule {
    /// `WarmupLR`: from `min` to `max` over `steps`, then `max`.
    Warmup {
        /// `warmup_min_lr` (default 0).
        min: f64,
        /// `warmup_max_lr` (default 1e-3).
        max: f64,
        /// `warmup_num_steps` (default 1000; at least 2).
        steps: u64,
        /// `warmup_type`.
        kind: WarmupType,
    },
    /// `WarmupDecayLR`: the warm-up, then linearly down to 0 at `total` steps.
    WarmupDecay {
        /// `warmup_min_lr`.
        min: f64,
        /// `warmup_max_lr`.
        max: f64,
        /// `warmup_num_steps`.
        steps: u64,
        /// `warmup_type`.
        kind: WarmupType,
        /// `total_num_steps`.
        total: u64,
    },
    /// `OneCycle`: from `min` up to `max` over `first` steps, back down over `second`,
    /// then `min / (1 + decay_rate × (steps past the cycle) / decay_steps)`.
    OneCycle {
        /// `cycle_min_lr`.
        min: f64,
        /// `cycle_max_lr`.
        max: f64,
        /// `cycle_first_step_size` (default 2000).
        first: u64,
        /// `cycle_second_step_size` (default: the first).
        second: u64,
        /// `decay_step_size` (0: stay at `min` after the cycle).
        decay_steps: u64,
        /// `decay_lr_rate` (default 0).
        decay_rate: f64,
    },
}

impl LrSchedule {
    /// The learning rate of optimizer step `step` (0 for the first), as DeepSpeed's
    /// scheduler gives it after `step` calls of `step()`.
    pub fn lr_at(&self, step: u64) -> f64 {
        let warm = |min: f64, max: f64, steps: u64, kind: WarmupType| -> Option<f64> {
            (step < steps).then(|| {
                let gamma = match kind {
                    WarmupType::Log => ((step + 1) as f64).ln() / (steps as f64).ln(),
                    WarmupType::Linear => step as f64 / steps as f64,
                };
                min + (max - min) * gamma
            })
        };
        match *self {
            LrSchedule::Warmup {
                min,
                max,
                steps,
                kind,
            } => warm(min, max, steps, kind).unwrap_or(max),
            LrSchedule::WarmupDecay {
                min,
                max,
                steps,
                kind,
                total,
            } => warm(min, max, steps, kind).unwrap_or_else(|| {
                let left = total.saturating_sub(step) as f64;
                let span = (total.saturating_sub(steps) as f64).max(1.0);
                min + (max - min) * (left / span).max(0.0)
            }),
            LrSchedule::OneCycle {
                min,
                max,
                first,
                second,
                decay_steps,
                decay_rate,
            } => {
                let total = first + second;
                if step < total {
                    // DeepSpeed's scale factor for iteration `step + 1` of the cycle.
                    let i = (step + 1) as f64 / total as f64;
                    let ratio = first as f64 / total as f64;
                    let x = i - i.floor();
                    let scale = if x <= ratio {
                        x / ratio
                    } else {
                        (x - 1.0) / (ratio - 1.0)
                    };
                    min + (max - min) * scale
                } else if decay_steps == 0 {
                    min
                } else {
                    let past = (step - total + 1) as f64 / decay_steps as f64;
                    min / (1.0 + decay_rate * past)
                }
            }
        }
    }
}

/// `scheduler`.
pub(super) fn parse(v: &Value, warnings: &mut Vec<String>) -> Result<LrSchedule, ConfigError> {
    let m = object(v, "scheduler")?;
    keys::check(m, keys::SCHEDULER, "scheduler", "scheduler.", warnings)?;
    let empty = serde_json::Map::new();
    let p = match m.get("params") {
        Some(v) => object(v, "scheduler.params")?,
        None => &empty,
    };
    keys::check(
        p,
        keys::SCHEDULER_PARAMS,
        "scheduler.params",
        "scheduler.params.",
        warnings,
    )?;
    let f = |k: &str, d: f64| -> Result<f64, ConfigError> {
        Ok(opt_f64(p, k, &format!("scheduler.params.{k}"))?.unwrap_or(d))
    };
    let u = |k: &str, d: u64| -> Result<u64, ConfigError> {
        Ok(opt_u64(p, k, &format!("scheduler.params.{k}"))?.unwrap_or(d))
    };
    let kind = warmup_type(p)?;
    let t = m.get("type").and_then(Value::as_str).ok_or_else(|| {
        invalid(
            "scheduler.type",
            "missing (WarmupLR, WarmupDecayLR, OneCycle)",
        )
    })?;
    let schedule = match t {
        "WarmupLR" => LrSchedule::Warmup {
            min: f("warmup_min_lr", 0.0)?,
            max: f("warmup_max_lr", 1e-3)?,
            steps: u("warmup_num_steps", 1000)?.max(2),
            kind,
        },
        "WarmupDecayLR" => {
            let total = opt_u64(p, "total_num_steps", "scheduler.params.total_num_steps")?
                .ok_or_else(|| {
                    invalid("scheduler.params.total_num_steps", "WarmupDecayLR needs it")
                })?;
            LrSchedule::WarmupDecay {
                min: f("warmup_min_lr", 0.0)?,
                max: f("warmup_max_lr", 1e-3)?,
                steps: u("warmup_num_steps", 1000)?.max(2),
                kind,
                total,
            }
        }
        "OneCycle" => {
            let first = u("cycle_first_step_size", 2000)?.max(1);
            let min = f("cycle_min_lr", 0.0)?;
            let max = p
                .get("cycle_max_lr")
                .map(|v| as_f64(v, "scheduler.params.cycle_max_lr"))
                .transpose()?
                .ok_or_else(|| invalid("scheduler.params.cycle_max_lr", "OneCycle needs it"))?;
            LrSchedule::OneCycle {
                min,
                max,
                first,
                second: u("cycle_second_step_size", first)?.max(1),
                decay_steps: u("decay_step_size", 0)?,
                decay_rate: f("decay_lr_rate", 0.0)?,
            }
        }
        other => {
            return Err(ConfigError::Unsupported {
                key: "scheduler.type".into(),
                message: format!(
                    "{other:?} is not a schedule kolo has (WarmupLR, WarmupDecayLR, OneCycle)"
                ),
            })
        }
    };
    Ok(schedule)
}

/// `warmup_type`: `log` (the default) or `linear`.
fn warmup_type(p: &serde_json::Map<String, Value>) -> Result<WarmupType, ConfigError> {
    match p.get("warmup_type") {
        None => Ok(WarmupType::Log),
        Some(Value::String(s)) if s == "log" => Ok(WarmupType::Log),
        Some(Value::String(s)) if s == "linear" => Ok(WarmupType::Linear),
        Some(v) => Err(invalid(
            "scheduler.params.warmup_type",
            &format!("must be \"log\" or \"linear\", not {v}"),
        )),
    }
}
