//! Reading the settings from the environment: every `KOLO_*` variable (or its
//! `HOROVOD_*` alias), parsed and checked, with an error naming the variable and
//! value when one is malformed.

use super::*;

/// Every setting kolo reads, as `KOLO_<key>` or `HOROVOD_<key>`.
pub(crate) const KEYS: [&str; 25] = [
    "FUSION_THRESHOLD",
    "FUSION_MAX_TENSOR_BYTES",
    "CYCLE_TIME",
    "CACHE_CAPACITY",
    "TIMELINE",
    "TIMELINE_MARK_CYCLES",
    "STALL_CHECK_TIME_SECONDS",
    "STALL_SHUTDOWN_TIME_SECONDS",
    "STALL_CHECK_DISABLE",
    "MALLOC_TUNING",
    "HUGE_PAGES",
    "COLLECTIVE_TIMEOUT_SECONDS",
    "START_TIMEOUT",
    "HIERARCHICAL_ALLREDUCE",
    "HIERARCHICAL_ALLGATHER",
    "GROUPED_RING",
    "HIERARCHICAL_PIECE_BYTES",
    "AUTOTUNE",
    "AUTOTUNE_LOG",
    "AUTOTUNE_WARMUP_SAMPLES",
    "AUTOTUNE_STEPS_PER_SAMPLE",
    "AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "SIMULATED_COLLECTIVE_COST_US",
    "LOG_LEVEL",
];

/// The `HOROVOD_*` names among `names` that are not a setting kolo reads, sorted.
pub(super) fn unknown_horovod(names: impl Iterator<Item = String>) -> Vec<String> {
    let mut unknown: Vec<String> = names
        .filter(|n| {
            n.strip_prefix("HOROVOD_")
                .is_some_and(|key| !KEYS.contains(&key))
        })
        .collect();
    unknown.sort();
    unknown
}

impl Config {
    /// Reads every `KOLO_*` variable (or its `HOROVOD_*` alias; the `KOLO_` name wins
    /// when both are set) on top of the defaults.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable and value when one is malformed.
    /// `HOROVOD_*` variables kolo does not know are ignored with one warning each.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::from_lookup(|name| std::env::var(name).ok())?;
        c.unknown_horovod =
            unknown_horovod(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()));
        Ok(c)
    }

    /// Like [`Config::from_env`] but reads variables through `lookup`, so that
    /// configuration can be tested without touching the process environment.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable and value when one is malformed.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let env = Env { lookup: &lookup };
        let mut c = Config::default();
        c.read_data_plane(&env)?;
        c.read_faults(&env)?;
        c.read_tuning(&env)?;
        Ok(c)
    }

    /// Fusion, cycle, cache, timeline and the hierarchy.
    fn read_data_plane(&mut self, env: &Env<'_>) -> Result<()> {
        if let Some((var, v)) = env.get("FUSION_THRESHOLD") {
            self.fusion_threshold = parse_bytes(&var, &v)?;
            self.fusion_threshold_explicit = true;
        }
        if let Some((var, v)) = env.get("FUSION_MAX_TENSOR_BYTES") {
            self.fusion_max_tensor = parse_bytes(&var, &v)?;
            self.fusion_max_tensor_explicit = true;
        }
        if let Some((var, v)) = env.get("CYCLE_TIME") {
            self.cycle_time = parse_duration(&var, &v, 1e-3, "milliseconds")?;
            self.cycle_time_explicit = true;
        }
        if let Some((var, v)) = env.get("CACHE_CAPACITY") {
            self.cache_capacity = parse_usize(&var, &v)?;
            self.cache_capacity_explicit = true;
        }
        if let Some((_, v)) = env.get("TIMELINE") {
            self.timeline = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        if let Some((var, v)) = env.get("TIMELINE_MARK_CYCLES") {
            self.timeline_mark_cycles = parse_bool(&var, &v)?;
        }
        if let Some((var, v)) = env.get("HIERARCHICAL_ALLREDUCE") {
            self.hierarchical_allreduce = parse_bool(&var, &v)?;
            self.hierarchical_allreduce_explicit = true;
        }
        if let Some((var, v)) = env.get("HIERARCHICAL_ALLGATHER") {
            self.hierarchical_allgather = parse_bool(&var, &v)?;
            self.hierarchical_allgather_explicit = true;
        }
        if let Some((var, v)) = env.get("HIERARCHICAL_PIECE_BYTES") {
            self.hierarchical_piece_bytes = Some(parse_bytes(&var, &v)?);
        }
        if let Some((var, v)) = env.get("GROUPED_RING") {
            self.grouped_ring = Some(parse_bool(&var, &v)?);
        }
        if let Some((var, v)) = env.get("ALLREDUCE_ALGORITHM") {
            use crate::vocab::AllreduceAlgorithm as A;
            let want = v.trim().to_ascii_lowercase();
            self.allreduce_algorithm = [A::Auto, A::Ring, A::HalvingDoubling, A::Mpi]
                .into_iter()
                .find(|a| a.name() == want)
                .ok_or_else(|| bad(&var, &v, "expected auto, ring, halving-doubling or mpi"))?;
        }
        Ok(())
    }

    /// The stall inspector and the timeouts.
    fn read_faults(&mut self, env: &Env<'_>) -> Result<()> {
        if let Some((var, v)) = env.get("STALL_CHECK_TIME_SECONDS") {
            self.stall_check_time = parse_duration(&var, &v, 1.0, "seconds")?;
        }
        if let Some((var, v)) = env.get("COLLECTIVE_TIMEOUT_SECONDS") {
            self.collective_timeout = parse_duration(&var, &v, 1.0, "seconds")?;
        }
        if let Some((var, v)) = env.get("START_TIMEOUT") {
            self.start_timeout = parse_duration(&var, &v, 1.0, "seconds")?;
        }
        if let Some((var, v)) = env.get("STALL_SHUTDOWN_TIME_SECONDS") {
            self.stall_shutdown_time = parse_duration(&var, &v, 1.0, "seconds")?;
        }
        if let Some((var, v)) = env.get("STALL_CHECK_DISABLE") {
            self.stall_check_disable = parse_bool(&var, &v)?;
        }
        if let Some((var, v)) = env.get("MALLOC_TUNING") {
            self.malloc_tuning = parse_bool(&var, &v)?;
        }
        if let Some((var, v)) = env.get("HUGE_PAGES") {
            self.huge_pages = parse_bool(&var, &v)?;
        }
        Ok(())
    }

    /// The autotuner, the simulated collective cost and the log level.
    fn read_tuning(&mut self, env: &Env<'_>) -> Result<()> {
        if let Some((var, v)) = env.get("AUTOTUNE") {
            self.autotune = parse_bool(&var, &v)?;
        }
        if let Some((_, v)) = env.get("AUTOTUNE_LOG") {
            self.autotune_log = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        if let Some((var, v)) = env.get("AUTOTUNE_WARMUP_SAMPLES") {
            self.autotune_warmup_samples = parse_usize(&var, &v)?;
        }
        if let Some((var, v)) = env.get("AUTOTUNE_STEPS_PER_SAMPLE") {
            self.autotune_steps_per_sample = parse_positive(&var, &v)?;
        }
        if let Some((var, v)) = env.get("AUTOTUNE_BAYES_OPT_MAX_SAMPLES") {
            self.autotune_max_samples = parse_positive(&var, &v)?;
        }
        if let Some((var, v)) = env.get("AUTOTUNE_GAUSSIAN_PROCESS_NOISE") {
            self.autotune_noise = match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => x,
                _ => return Err(bad(&var, &v, POSITIVE_NUMBER)),
            };
        }
        if let Some((var, v)) = env.get("SIMULATED_COLLECTIVE_COST_US") {
            self.simulated_collective_cost = parse_duration(&var, &v, 1e-6, "microseconds")?;
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
            self.log_level = Some(level);
        }
        Ok(())
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
        _ => Err(bad(var, value, POSITIVE)),
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
    // Beyond `Duration::MAX` (about 5.8e11 years) there is no duration to hold it: say
    // so, and how to ask for "never" where a variable has it, rather than panic.
    Duration::try_from_secs_f64(v * unit_seconds).map_err(|_| {
        bad(
            var,
            value,
            &format!(
                "{v} {unit} is larger than the longest duration kolo can wait                  ({} seconds); the timeouts (KOLO_COLLECTIVE_TIMEOUT_SECONDS,                  KOLO_START_TIMEOUT, KOLO_STALL_SHUTDOWN_TIME_SECONDS) take 0 for never",
                Duration::MAX.as_secs()
            ),
        )
    })
}
