use super::{simulate, Algorithm, Link, Network, Options, Workload};

/// One rank per host, no CPU charge: only the model's messages cost time.
fn hosts() -> Network {
    Network {
        ranks_per_host: 1,
        intra: Link {
            latency: 1e-6,
            bandwidth: 100e9,
        },
        inter: Link {
            latency: 5e-6,
            bandwidth: 10e9,
        },
        nics_per_host: 1,
        oversubscription: 1.0,
        copy_bandwidth: 10e9,
        cpu_scale: 0.0,
    }
}

fn workload(sizes: &[usize]) -> Workload {
    Workload {
        name: "test".into(),
        tensors: sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("grad.{i}"), n))
            .collect(),
        forward: 1e-3,
        backward: 2e-3,
    }
}

#[test]
fn a_cache_hit_cycle_costs_one_latency_per_doubling_step() {
    // One gradient of 1000 values: after the first step it is a cache hit, and its
    // cycle is the bit agreement alone (log2 64 = 6 inter-host latencies plus the
    // bytes of a ~100-byte message).
    let w = workload(&[1000]);
    let mut o = Options::new(64, hosts(), Algorithm::Ring);
    o.participants = 8;
    let steps = simulate(&w, &o).unwrap();
    assert!(steps[0].full_exchanges >= 1, "{:?}", steps[0]);
    let steady = &steps[2];
    assert_eq!((steady.cycles, steady.full_exchanges), (1, 0), "{steady:?}");
    let want = 6.0 * 5e-6;
    assert!(
        (steady.negotiation - want).abs() < 0.02 * want,
        "negotiation {} vs {want}",
        steady.negotiation
    );
    assert!(
        (steady.negotiation - steady.control_network).abs() < 1e-12,
        "{steady:?}"
    );
    // The allreduce is charged by the ring's formula after it.
    let ring = 2.0 * 63.0 * (5e-6 + 4000.0 / 64.0 / 10e9);
    assert!(
        (steady.data - ring).abs() < 1e-9 * ring.max(1.0),
        "{} vs {ring}",
        steady.data
    );
}

#[test]
fn the_plan_fuses_every_gradient_once_and_does_not_depend_on_the_threads() {
    let sizes: Vec<usize> = (0..40).map(|i| 1000 + 50_000 * (i % 7)).collect();
    let w = workload(&sizes);
    let total: usize = sizes.iter().sum::<usize>() * 4;
    let mut plans = Vec::new();
    for participants in [1, 3, 12] {
        let mut o = Options::new(12, hosts(), Algorithm::Auto);
        o.participants = participants;
        let steps = simulate(&w, &o).unwrap();
        for s in &steps {
            assert_eq!(s.collectives.iter().sum::<usize>(), total, "{s:?}");
            assert!(s.time >= s.compute, "{s:?}");
            let parts = s.negotiation + s.copies + s.data + s.idle;
            assert!((parts - s.time).abs() < 1e-9, "{s:?}");
        }
        plans.push(steps[2].collectives.clone());
    }
    assert!(plans.windows(2).all(|p| p[0] == p[1]), "{plans:?}");
    // With a threshold of 4 MiB and 0.2-0.8 MB gradients, some are fused.
    assert!(plans[0].len() < sizes.len(), "{:?}", plans[0]);
}

#[test]
fn bad_options_name_what_is_wrong() {
    let err = simulate(&workload(&[]), &Options::new(4, hosts(), Algorithm::Ring)).unwrap_err();
    assert!(err.to_string().contains("must not be 0"), "{err}");
}
