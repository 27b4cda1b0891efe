//! Configuration: a builder, filled from `KOLO_*` environment variables (with the
//! `HOROVOD_*` names accepted as aliases), validated once, before anything starts.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};

/// The default fusion threshold in bytes (see `benches/` for how it was chosen).
pub const DEFAULT_FUSION_THRESHOLD: usize = 4 << 20;

/// Settings for [`init`](crate::init). Start from [`Config::from_env`] (or
/// [`Config::default`]), change what you need, then call [`Config::init`].
///
/// ```no_run
/// use std::time::Duration;
/// let kolo = kolo::Config::from_env()?
///     .fusion_threshold_bytes(64 << 20)
///     .cycle_time(Duration::from_micros(500))
///     .init()?;
/// # Ok::<(), kolo::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub(crate) fusion_threshold: usize,
    pub(crate) fusion_threshold_explicit: bool,
    pub(crate) cycle_time: Duration,
    pub(crate) cycle_time_explicit: bool,
    pub(crate) cache_capacity: usize,
    pub(crate) cache_capacity_explicit: bool,
    pub(crate) timeline: Option<PathBuf>,
    pub(crate) timeline_mark_cycles: bool,
    pub(crate) stall_check_time: Duration,
    pub(crate) stall_shutdown_time: Duration,
    pub(crate) stall_check_disable: bool,
    pub(crate) autotune: bool,
    pub(crate) autotune_log: Option<PathBuf>,
    pub(crate) autotune_warmup_samples: usize,
    pub(crate) autotune_steps_per_sample: usize,
    pub(crate) autotune_max_samples: usize,
    pub(crate) autotune_noise: f64,
    pub(crate) log_level: Option<String>,
    pub(crate) simulated_collective_cost: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            fusion_threshold: DEFAULT_FUSION_THRESHOLD,
            fusion_threshold_explicit: false,
            cycle_time: Duration::from_millis(1),
            cycle_time_explicit: false,
            cache_capacity: 1024,
            cache_capacity_explicit: false,
            timeline: None,
            timeline_mark_cycles: false,
            stall_check_time: Duration::from_secs(60),
            stall_shutdown_time: Duration::ZERO,
            stall_check_disable: false,
            autotune: false,
            autotune_log: None,
            autotune_warmup_samples: 3,
            autotune_steps_per_sample: 10,
            autotune_max_samples: 20,
            autotune_noise: 0.8,
            log_level: None,
            simulated_collective_cost: Duration::ZERO,
        }
    }
}

/// Log levels accepted by `KOLO_LOG_LEVEL`.
const LOG_LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

impl Config {
    /// Reads every `KOLO_*` variable (or its `HOROVOD_*` alias; the `KOLO_` name wins
    /// when both are set) on top of the defaults.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable and value when one is malformed.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`Config::from_env`] but reads variables through `lookup`, so that
    /// configuration can be tested without touching the process environment.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable and value when one is malformed.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let env = Env { lookup: &lookup };
        let mut c = Config::default();
        if let Some((var, v)) = env.get("FUSION_THRESHOLD") {
            c.fusion_threshold = parse_bytes(&var, &v)?;
            c.fusion_threshold_explicit = true;
        }
        if let Some((var, v)) = env.get("CYCLE_TIME") {
            c.cycle_time = parse_duration(&var, &v, 1e-3, "milliseconds")?;
            c.cycle_time_explicit = true;
        }
        if let Some((var, v)) = env.get("CACHE_CAPACITY") {
            c.cache_capacity = parse_usize(&var, &v)?;
            c.cache_capacity_explicit = true;
        }
        if let Some((_, v)) = env.get("TIMELINE") {
            c.timeline = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        if let Some((var, v)) = env.get("TIMELINE_MARK_CYCLES") {
            c.timeline_mark_cycles = parse_bool(&var, &v)?;
        }
        if let Some((var, v)) = env.get("STALL_CHECK_TIME_SECONDS") {
            c.stall_check_time = parse_duration(&var, &v, 1.0, "seconds")?;
        }
        if let Some((var, v)) = env.get("STALL_SHUTDOWN_TIME_SECONDS") {
            c.stall_shutdown_time = parse_duration(&var, &v, 1.0, "seconds")?;
        }
        if let Some((var, v)) = env.get("STALL_CHECK_DISABLE") {
            c.stall_check_disable = parse_bool(&var, &v)?;
        }
        if let Some((var, v)) = env.get("AUTOTUNE") {
            c.autotune = parse_bool(&var, &v)?;
        }
        if let Some((_, v)) = env.get("AUTOTUNE_LOG") {
            c.autotune_log = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        if let Some((var, v)) = env.get("AUTOTUNE_WARMUP_SAMPLES") {
            c.autotune_warmup_samples = parse_usize(&var, &v)?;
        }
        if let Some((var, v)) = env.get("AUTOTUNE_STEPS_PER_SAMPLE") {
            c.autotune_steps_per_sample = parse_positive(&var, &v)?;
        }
        if let Some((var, v)) = env.get("AUTOTUNE_BAYES_OPT_MAX_SAMPLES") {
            c.autotune_max_samples = parse_positive(&var, &v)?;
        }
        if let Some((var, v)) = env.get("AUTOTUNE_GAUSSIAN_PROCESS_NOISE") {
            c.autotune_noise = match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => x,
                _ => return Err(bad(&var, &v, "expected a positive number")),
            };
        }
        if let Some((var, v)) = env.get("SIMULATED_COLLECTIVE_COST_US") {
            c.simulated_collective_cost = parse_duration(&var, &v, 1e-6, "microseconds")?;
        }
        if let Some((var, v)) = env.get("LOG_LEVEL") {
            let level = v.trim().to_ascii_lowercase();
            if !LOG_LEVELS.contains(&level.as_str()) {
                return Err(Error::Config {
                    variable: var,
                    value: v,
                    reason: format!("expected one of {}", LOG_LEVELS.join(", ")),
                });
            }
            c.log_level = Some(level);
        }
        Ok(c)
    }

    /// Largest number of bytes fused into one collective; 0 disables fusion.
    /// (`KOLO_FUSION_THRESHOLD`)
    pub fn fusion_threshold_bytes(mut self, bytes: usize) -> Self {
        self.fusion_threshold = bytes;
        self.fusion_threshold_explicit = true;
        self
    }

    /// The longest the engine waits to batch more work into one cycle while it has
    /// work pending; it still wakes at once on new work. (`KOLO_CYCLE_TIME`, in ms)
    pub fn cycle_time(mut self, cycle_time: Duration) -> Self {
        self.cycle_time = cycle_time;
        self.cycle_time_explicit = true;
        self
    }

    /// Entries in the response cache; 0 disables it. (`KOLO_CACHE_CAPACITY`)
    pub fn cache_capacity(mut self, entries: usize) -> Self {
        self.cache_capacity = entries;
        self.cache_capacity_explicit = true;
        self
    }

    /// Writes a Chrome trace of the engine to `path`. (`KOLO_TIMELINE`)
    pub fn timeline(mut self, path: impl Into<PathBuf>) -> Self {
        self.timeline = Some(path.into());
        self
    }

    /// Adds a CYCLE_START mark per engine cycle to the timeline.
    /// (`KOLO_TIMELINE_MARK_CYCLES`)
    pub fn timeline_mark_cycles(mut self, on: bool) -> Self {
        self.timeline_mark_cycles = on;
        self
    }

    /// How long a tensor may wait for other ranks before a stall warning.
    /// (`KOLO_STALL_CHECK_TIME_SECONDS`)
    pub fn stall_check_time(mut self, time: Duration) -> Self {
        self.stall_check_time = time;
        self
    }

    /// How long a stall may last before pending ops fail; zero never fails them.
    /// (`KOLO_STALL_SHUTDOWN_TIME_SECONDS`)
    pub fn stall_shutdown_time(mut self, time: Duration) -> Self {
        self.stall_shutdown_time = time;
        self
    }

    /// Turns the stall inspector off. (`KOLO_STALL_CHECK_DISABLE`)
    pub fn stall_check_disable(mut self, disable: bool) -> Self {
        self.stall_check_disable = disable;
        self
    }

    /// Tunes the fusion threshold and cycle time at run time. (`KOLO_AUTOTUNE`)
    pub fn autotune(mut self, on: bool) -> Self {
        self.autotune = on;
        self
    }

    /// Writes one CSV row per autotune sample to `path`. (`KOLO_AUTOTUNE_LOG`)
    pub fn autotune_log(mut self, path: impl Into<PathBuf>) -> Self {
        self.autotune_log = Some(path.into());
        self
    }

    /// Adds this delay to every collective kolo runs on CPU tensors, as a slow
    /// network would: for trying fusion and autotune settings on one machine (the
    /// autotuner's tests use it). (`KOLO_SIMULATED_COLLECTIVE_COST_US`, 0)
    pub fn simulated_collective_cost(mut self, cost: Duration) -> Self {
        self.simulated_collective_cost = cost;
        self
    }

    /// Autotune samples discarded at the start. (`KOLO_AUTOTUNE_WARMUP_SAMPLES`, 3)
    pub fn autotune_warmup_samples(mut self, n: usize) -> Self {
        self.autotune_warmup_samples = n;
        self
    }

    /// Cycles with allreduce work per autotune sample (at least 1).
    /// (`KOLO_AUTOTUNE_STEPS_PER_SAMPLE`, 10)
    pub fn autotune_steps_per_sample(mut self, n: usize) -> Self {
        self.autotune_steps_per_sample = n.max(1);
        self
    }

    /// Configurations the autotuner tries before keeping the best (at least 1).
    /// (`KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`, 20)
    pub fn autotune_max_samples(mut self, n: usize) -> Self {
        self.autotune_max_samples = n.max(1);
        self
    }

    /// Observation noise of the autotuner's Gaussian process, in units of the
    /// scores' spread. (`KOLO_AUTOTUNE_GAUSSIAN_PROCESS_NOISE`, 0.8)
    pub fn autotune_gaussian_process_noise(mut self, noise: f64) -> Self {
        if noise.is_finite() && noise > 0.0 {
            self.autotune_noise = noise;
        }
        self
    }

    /// Log level of the subscriber kolo installs when the application has none:
    /// trace, debug, info, warn (default), error or off. `RUST_LOG` wins when set.
    /// (`KOLO_LOG_LEVEL`)
    ///
    /// # Errors
    /// [`Error::Config`] for any other value.
    pub fn log_level(mut self, level: &str) -> Result<Self> {
        let l = level.trim().to_ascii_lowercase();
        if !LOG_LEVELS.contains(&l.as_str()) {
            return Err(Error::Config {
                variable: "Config::log_level".into(),
                value: level.into(),
                reason: format!("expected one of {}", LOG_LEVELS.join(", ")),
            });
        }
        self.log_level = Some(l);
        Ok(self)
    }

    /// The fusion threshold in bytes.
    pub fn get_fusion_threshold_bytes(&self) -> usize {
        self.fusion_threshold
    }

    /// The cycle time.
    pub fn get_cycle_time(&self) -> Duration {
        self.cycle_time
    }

    /// The response cache capacity.
    pub fn get_cache_capacity(&self) -> usize {
        self.cache_capacity
    }

    /// Initialises MPI and starts the engine with these settings. See [`crate::init`].
    ///
    /// # Errors
    /// [`Error::Init`] when MPI cannot start or kolo was already initialised in this
    /// process.
    pub fn init(self) -> Result<crate::Kolo> {
        crate::runtime::start(self)
    }
}

struct Env<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
}

impl Env<'_> {
    /// The value of `KOLO_<key>`, else `HOROVOD_<key>`, with the name it was found under.
    fn get(&self, key: &str) -> Option<(String, String)> {
        ["KOLO_", "HOROVOD_"].iter().find_map(|prefix| {
            let var = format!("{prefix}{key}");
            (self.lookup)(&var).map(|v| (var, v))
        })
    }
}

fn bad(var: &str, value: &str, reason: &str) -> Error {
    Error::Config {
        variable: var.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

fn parse_usize(var: &str, value: &str) -> Result<usize> {
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| bad(var, value, "expected a non-negative integer"))
}

fn parse_positive(var: &str, value: &str) -> Result<usize> {
    match parse_usize(var, value) {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(bad(var, value, "expected a positive whole number")),
    }
}

fn parse_bytes(var: &str, value: &str) -> Result<usize> {
    parse_usize(var, value).map_err(|_| {
        bad(
            var,
            value,
            "expected a number of bytes (a non-negative integer)",
        )
    })
}

fn parse_bool(var: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" | "" => Ok(false),
        _ => Err(bad(var, value, "expected 0 or 1 (or true/false)")),
    }
}

fn parse_duration(var: &str, value: &str, unit_seconds: f64, unit: &str) -> Result<Duration> {
    let v: f64 = value
        .trim()
        .parse()
        .map_err(|_| bad(var, value, &format!("expected a number of {unit}")))?;
    if !v.is_finite() || v < 0.0 {
        return Err(bad(
            var,
            value,
            &format!("expected a non-negative number of {unit}"),
        ));
    }
    Ok(Duration::from_secs_f64(v * unit_seconds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Config> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_without_variables() {
        assert_eq!(config(&[]).unwrap(), Config::default());
    }

    #[test]
    fn every_variable_is_read() {
        let c = config(&[
            ("KOLO_FUSION_THRESHOLD", "1024"),
            ("KOLO_CYCLE_TIME", "2.5"),
            ("KOLO_CACHE_CAPACITY", "0"),
            ("KOLO_TIMELINE", "/tmp/t.json"),
            ("KOLO_TIMELINE_MARK_CYCLES", "1"),
            ("KOLO_STALL_CHECK_TIME_SECONDS", "5"),
            ("KOLO_STALL_SHUTDOWN_TIME_SECONDS", "10"),
            ("KOLO_STALL_CHECK_DISABLE", "true"),
            ("KOLO_AUTOTUNE", "1"),
            ("KOLO_AUTOTUNE_LOG", "/tmp/a.csv"),
            ("KOLO_LOG_LEVEL", "DEBUG"),
        ])
        .unwrap();
        assert_eq!(c.fusion_threshold, 1024);
        assert_eq!(c.cycle_time, Duration::from_micros(2500));
        assert_eq!(c.cache_capacity, 0);
        assert_eq!(c.timeline, Some(PathBuf::from("/tmp/t.json")));
        assert!(c.timeline_mark_cycles);
        assert_eq!(c.stall_check_time, Duration::from_secs(5));
        assert_eq!(c.stall_shutdown_time, Duration::from_secs(10));
        assert!(c.stall_check_disable && c.autotune);
        assert_eq!(c.autotune_log, Some(PathBuf::from("/tmp/a.csv")));
        assert_eq!(c.log_level.as_deref(), Some("debug"));
    }

    #[test]
    fn horovod_aliases_and_precedence() {
        let c = config(&[("HOROVOD_FUSION_THRESHOLD", "77")]).unwrap();
        assert_eq!(c.fusion_threshold, 77);
        let c = config(&[
            ("HOROVOD_FUSION_THRESHOLD", "77"),
            ("KOLO_FUSION_THRESHOLD", "88"),
        ])
        .unwrap();
        assert_eq!(c.fusion_threshold, 88);
    }

    #[test]
    fn malformed_values_name_the_variable() {
        let err = config(&[("KOLO_CYCLE_TIME", "fast")]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid configuration: KOLO_CYCLE_TIME=\"fast\": expected a number of milliseconds"
        );
        let err = config(&[("HOROVOD_FUSION_THRESHOLD", "-1")]).unwrap_err();
        assert!(
            err.to_string().contains("HOROVOD_FUSION_THRESHOLD=\"-1\""),
            "{err}"
        );
        let err = config(&[("KOLO_STALL_CHECK_DISABLE", "maybe")]).unwrap_err();
        assert!(
            err.to_string().contains("KOLO_STALL_CHECK_DISABLE"),
            "{err}"
        );
        let err = config(&[("KOLO_LOG_LEVEL", "loud")]).unwrap_err();
        assert!(err.to_string().contains("KOLO_LOG_LEVEL=\"loud\""), "{err}");
        let err = config(&[("KOLO_STALL_CHECK_TIME_SECONDS", "-3")]).unwrap_err();
        assert!(err.to_string().contains("non-negative"), "{err}");
    }
}
