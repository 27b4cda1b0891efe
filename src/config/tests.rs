use super::*;
use proptest::strategy::Strategy;
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
        ("KOLO_FUSION_MAX_TENSOR_BYTES", "4194304"),
        ("KOLO_CYCLE_TIME", "2.5"),
        ("KOLO_CACHE_CAPACITY", "0"),
        ("KOLO_TIMELINE", "/tmp/t.json"),
        ("KOLO_TIMELINE_MARK_CYCLES", "1"),
        ("KOLO_STALL_CHECK_TIME_SECONDS", "5"),
        ("KOLO_STALL_SHUTDOWN_TIME_SECONDS", "10"),
        ("KOLO_STALL_CHECK_DISABLE", "true"),
        ("KOLO_COLLECTIVE_TIMEOUT_SECONDS", "2.5"),
        ("KOLO_START_TIMEOUT", "45"),
        ("KOLO_HIERARCHICAL_ALLREDUCE", "1"),
        ("KOLO_HIERARCHICAL_ALLGATHER", "yes"),
        ("KOLO_GROUPED_RING", "0"),
        ("KOLO_AUTOTUNE", "1"),
        ("KOLO_AUTOTUNE_LOG", "/tmp/a.csv"),
        ("KOLO_AUTOTUNE_WARMUP_SAMPLES", "7"),
        ("KOLO_AUTOTUNE_STEPS_PER_SAMPLE", "4"),
        ("KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "9"),
        ("KOLO_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.25"),
        ("KOLO_SIMULATED_COLLECTIVE_COST_US", "30"),
        ("KOLO_LOG_LEVEL", "DEBUG"),
        ("KOLO_MALLOC_TUNING", "0"),
        ("KOLO_HUGE_PAGES", "0"),
    ])
    .unwrap();
    assert!(!c.malloc_tuning);
    assert!(!c.huge_pages);
    assert_eq!(c.autotune_warmup_samples, 7);
    assert_eq!(c.autotune_steps_per_sample, 4);
    assert_eq!(c.autotune_max_samples, 9);
    assert_eq!(c.autotune_noise, 0.25);
    assert_eq!(c.simulated_collective_cost, Duration::from_micros(30));
    assert_eq!(c.fusion_threshold, 1024);
    assert_eq!(c.fusion_max_tensor, 4 << 20);
    assert!(c.fusion_max_tensor_explicit);
    assert_eq!(c.cycle_time, Duration::from_micros(2500));
    assert_eq!(c.cache_capacity, 0);
    assert_eq!(c.timeline, Some(PathBuf::from("/tmp/t.json")));
    assert!(c.timeline_mark_cycles);
    assert_eq!(c.stall_check_time, Duration::from_secs(5));
    assert_eq!(c.stall_shutdown_time, Duration::from_secs(10));
    assert_eq!(c.collective_timeout, Duration::from_millis(2500));
    assert_eq!(c.start_timeout, Duration::from_secs(45));
    assert!(c.hierarchical_allreduce && c.hierarchical_allgather);
    assert_eq!(c.grouped_ring, Some(false));
    assert!(c.stall_check_disable && c.autotune);
    assert_eq!(c.autotune_log, Some(PathBuf::from("/tmp/a.csv")));
    assert_eq!(c.log_level.as_deref(), Some("debug"));
}

#[test]
fn the_test_above_sets_every_key() {
    let src = include_str!("tests.rs");
    let test = &src[src.find("fn every_variable_is_read").unwrap_or(0)..];
    for key in KEYS {
        assert!(
            test.contains(&format!("\"KOLO_{key}\"")),
            "every_variable_is_read does not set KOLO_{key}"
        );
    }
}

#[test]
fn unknown_horovod_variables_are_named() {
    let names = [
        "HOROVOD_FUSION_THRESHOLD",
        "HOROVOD_GPU_OPERATIONS",
        "PATH",
        "HOROVOD_HIERARCHICAL_ALLGATHER",
        "HOROVOD_CACHE_BYPASS",
    ];
    assert_eq!(
        unknown_horovod(names.iter().map(|s| s.to_string())),
        ["HOROVOD_CACHE_BYPASS", "HOROVOD_GPU_OPERATIONS"]
    );
}

#[test]
fn builder_and_environment_refuse_the_same_values() {
    let cases: [(Config, &str, &str); 4] = [
        (
            Config::default().autotune_steps_per_sample(0),
            "KOLO_AUTOTUNE_STEPS_PER_SAMPLE",
            "0",
        ),
        (
            Config::default().autotune_max_samples(0),
            "KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
            "0",
        ),
        (
            Config::default().autotune_gaussian_process_noise(0.0),
            "KOLO_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
            "0",
        ),
        (
            Config::default().autotune_gaussian_process_noise(f64::NAN),
            "KOLO_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
            "NaN",
        ),
    ];
    for (built, var, value) in cases {
        let from_builder = match built.validate() {
            Err(Error::Config { reason, .. }) => reason,
            other => panic!("builder accepted {var}={value}: {other:?}"),
        };
        let from_env = match config(&[(var, value)]) {
            Err(Error::Config { reason, .. }) => reason,
            other => panic!("environment accepted {var}={value}: {other:?}"),
        };
        assert_eq!(from_builder, from_env, "{var}={value}");
    }
    assert!(Config::default().autotune_max_samples(3).validate().is_ok());
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

/// Issue 31 item 12: a duration beyond `Duration::MAX` (1e20 s, or 1e25 of any
/// unit) is a clear error naming the variable and how to say "never", not a panic.
#[test]
fn huge_durations_are_errors_not_panics() {
    for var in [
        "KOLO_COLLECTIVE_TIMEOUT_SECONDS",
        "KOLO_START_TIMEOUT",
        "KOLO_STALL_SHUTDOWN_TIME_SECONDS",
        "KOLO_STALL_CHECK_TIME_SECONDS",
        "KOLO_CYCLE_TIME",
    ] {
        let err = config(&[(var, "1e25")]).unwrap_err().to_string();
        assert!(err.contains(&format!("{var}=\"1e25\"")), "{err}");
        assert!(err.contains("take 0 for never"), "{err}");
    }
    let err = config(&[("KOLO_COLLECTIVE_TIMEOUT_SECONDS", "1e20")]).unwrap_err();
    assert!(
        err.to_string().contains("larger than the longest duration"),
        "{err}"
    );
    // The largest representable values are taken.
    let c = config(&[("KOLO_COLLECTIVE_TIMEOUT_SECONDS", "1e18")]).unwrap();
    assert_eq!(
        c.collective_timeout,
        Duration::from_secs(1_000_000_000_000_000_000)
    );
}

const VARIABLES: &[&str] = &[
    "KOLO_ALLREDUCE_ALGORITHM",
    "KOLO_AUTOTUNE",
    "KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "KOLO_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "KOLO_AUTOTUNE_LOG",
    "KOLO_AUTOTUNE_STEPS_PER_SAMPLE",
    "KOLO_AUTOTUNE_WARMUP_SAMPLES",
    "KOLO_CACHE_CAPACITY",
    "KOLO_COLLECTIVE_TIMEOUT_SECONDS",
    "KOLO_CYCLE_TIME",
    "KOLO_FUSION_MAX_TENSOR_BYTES",
    "KOLO_FUSION_THRESHOLD",
    "KOLO_GROUPED_RING",
    "KOLO_HIERARCHICAL_ALLGATHER",
    "KOLO_HIERARCHICAL_ALLREDUCE",
    "KOLO_HIERARCHICAL_PIECE_BYTES",
    "KOLO_LOG_LEVEL",
    "KOLO_SIMULATED_COLLECTIVE_COST_US",
    "KOLO_STALL_CHECK_DISABLE",
    "KOLO_STALL_CHECK_TIME_SECONDS",
    "KOLO_STALL_SHUTDOWN_TIME_SECONDS",
    "KOLO_START_TIMEOUT",
    "KOLO_TIMELINE",
    "KOLO_TIMELINE_MARK_CYCLES",
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME",
];

proptest::proptest! {
    /// Any text in any variable gives a configuration or an error naming that
    /// variable: never a panic, never another variable blamed.
    #[test]
    fn any_value_is_taken_or_refused_by_name(
        var in proptest::sample::select(VARIABLES),
        value in proptest::prop_oneof![
            proptest::string::string_regex("[-+0-9.eE_a-z ]{0,24}").unwrap(),
            proptest::num::f64::ANY.prop_map(|v| v.to_string()),
            proptest::num::u64::ANY.prop_map(|v| v.to_string()),
            proptest::num::i64::ANY.prop_map(|v| v.to_string()),
            ".*",
        ],
    ) {
        if let Err(e) = config(&[(var, &value)]) {
            let text = e.to_string();
            proptest::prop_assert!(text.contains(var), "{var}={value:?}: {text}");
        }
    }
}
