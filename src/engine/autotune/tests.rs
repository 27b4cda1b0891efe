use super::*;

#[test]
fn axes_round_trip() {
    for t in [0usize, 4096, 1 << 20, 64 << 20] {
        assert_eq!(x_to_threshold(threshold_to_x(t)), t);
    }
    for us in [100u64, 1000, 10_000] {
        assert_eq!(x_to_cycle(cycle_to_x(us)), us);
    }
}

#[test]
fn gp_interpolates_and_is_unsure_far_away() {
    let xs = vec![vec![0.1], vec![0.9]];
    let gp = Gp::fit(&xs, &[1.0, -1.0], 0.01).unwrap();
    let (m, s) = gp.predict(&[0.1]);
    assert!((m - 1.0).abs() < 0.05 && s < 0.1, "{m} {s}");
    let (_, far) = gp.predict(&[0.5]);
    assert!(far > s);
}

/// Each hierarchical shape is tuned only where it can run and when left unset.
#[test]
fn hierarchical_shapes_are_tuned_where_possible_unless_set() {
    let fixed = Config::default()
        .fusion_threshold_bytes(1 << 20)
        .cycle_time(Duration::from_millis(1))
        .cache_capacity(64)
        .autotune(true);
    let start = Settings {
        fusion_threshold: 1 << 20,
        fusion_max_tensor: MAX_FUSED_TENSOR_BYTES,
        cycle_time_us: 1000,
        cache: true,
        hierarchical: false,
        hierarchical_allgather: false,
        last: false,
    };
    let dims =
        |c: &Config, possible: bool| Tuner::new(c, start, possible, false).map(|t| t.dims.count());
    assert_eq!(dims(&fixed, true), Some(2));
    assert_eq!(dims(&fixed, false), None, "one host: nothing left to tune");
    let one = fixed.clone().hierarchical_allgather(false);
    assert_eq!(dims(&one, true), Some(1));
    let t = Tuner::new(&one, start, true, false).unwrap();
    let on = t.settings_at(&[1.0]);
    assert!(on.hierarchical && !on.hierarchical_allgather, "{on:?}");
    assert_eq!(t.point_of(&on), [1.0]);
    let neither = one.hierarchical_allreduce(true);
    assert_eq!(dims(&neither, true), None);
}

/// Fusing large tensors is tried only where the job spans hosts and the user left
/// the limit unset; on it means no limit, off the one-host default.
#[test]
fn large_tensor_fusion_is_tuned_across_hosts_unless_set() {
    let fixed = Config::default()
        .fusion_threshold_bytes(1 << 20)
        .cycle_time(Duration::from_millis(1))
        .cache_capacity(64)
        .autotune(true);
    let start = Settings {
        fusion_threshold: 1 << 20,
        fusion_max_tensor: MAX_FUSED_TENSOR_BYTES,
        cycle_time_us: 1000,
        cache: true,
        hierarchical: false,
        hierarchical_allgather: false,
        last: false,
    };
    assert!(Tuner::new(&fixed, start, false, false).is_none());
    let t = Tuner::new(&fixed, start, false, true).unwrap();
    assert_eq!(t.dims.count(), 1);
    assert_eq!(t.settings_at(&[1.0]).fusion_max_tensor, usize::MAX);
    assert_eq!(
        t.settings_at(&[0.0]).fusion_max_tensor,
        MAX_FUSED_TENSOR_BYTES
    );
    assert_eq!(t.point_of(&t.settings_at(&[1.0])), [1.0]);
    let set = fixed.fusion_max_tensor_bytes(1 << 30);
    assert!(Tuner::new(&set, start, false, true).is_none());
}

/// The tuner finds the peak of a known score function of the threshold alone.
#[test]
fn finds_the_best_threshold_of_a_synthetic_score() {
    let config = Config::default()
        .cycle_time(Duration::from_millis(1))
        .cache_capacity(1024)
        .autotune(true);
    let mut config = config;
    config.autotune_warmup_samples = 0;
    config.autotune_steps_per_sample = 1;
    config.autotune_max_samples = 12;
    let start = Settings {
        fusion_threshold: 0,
        fusion_max_tensor: MAX_FUSED_TENSOR_BYTES,
        cycle_time_us: 1000,
        cache: true,
        hierarchical: false,
        hierarchical_allgather: false,
        last: false,
    };
    let mut t = Tuner::new(&config, start, false, false).unwrap();
    // Bytes per second peak at 1 MiB (x ≈ 0.64) and fall off on both sides.
    let score = |s: &Settings| {
        let x = threshold_to_x(s.fusion_threshold);
        1e9 * (-(x - threshold_to_x(1 << 20)).powi(2) / 0.02).exp() + 1e6
    };
    let t0 = Instant::now();
    let mut now = t0;
    let mut last = start;
    for _ in 0..200 {
        let begin = now;
        now += Duration::from_millis(1);
        let bytes = (score(&last) / 1000.0) as u64;
        if let Some(s) = t.observe(bytes, begin, now) {
            last = s;
            if s.last {
                break;
            }
        }
    }
    assert!(last.last, "the tuner did not finish");
    let got = threshold_to_x(last.fusion_threshold);
    assert!(
        // Within one octave of the peak (4 MiB, the library default, is two away).
        (got - threshold_to_x(1 << 20)).abs()
            <= (threshold_to_x(2 << 20) - threshold_to_x(1 << 20)) * 1.01,
        "chose {} bytes",
        last.fusion_threshold
    );
}
