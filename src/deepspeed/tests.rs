use super::*;

/// DeepSpeed's documented ZeRO examples (stages 0–3, from its configuration and ZeRO
/// tutorial pages), each with the usual batch and fp16 keys.
const STAGES: [&str; 4] = [
    r#"{"train_batch_size": 16, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
        "fp16": {"enabled": true}, "zero_optimization": {"stage": 0}}"#,
    r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}"#,
    r#"{"train_batch_size": 32,
        "zero_optimization": {"stage": 2, "allgather_partitions": true,
          "allgather_bucket_size": 5e8, "overlap_comm": false, "reduce_scatter": true,
          "reduce_bucket_size": 5e8, "contiguous_gradients": true,
          "offload_optimizer": {"device": "cpu", "pin_memory": true}}}"#,
    r#"{"train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": true, "auto_cast": false, "loss_scale": 0,
          "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
          "consecutive_hysteresis": false, "min_loss_scale": 1},
        "zero_optimization": {"stage": 3, "contiguous_gradients": true,
          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
          "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5,
          "reduce_bucket_size": 1e7, "sub_group_size": 1e9,
          "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}"#,
];

#[test]
fn deepspeeds_stage_examples_load() {
    for (stage, text) in STAGES.iter().enumerate() {
        let c =
            DeepSpeedConfig::from_json(text, 4).unwrap_or_else(|e| panic!("stage {stage}: {e}"));
        assert_eq!(usize::from(c.zero.stage), stage);
        assert_eq!(
            c.train_batch_size,
            c.micro_batch_per_rank * c.gradient_accumulation_steps * 4
        );
    }
    let c = DeepSpeedConfig::from_json(STAGES[3], 4).unwrap();
    assert!(c.zero.offload_param && c.zero.offload_optimizer && c.fp16.enabled);
    // Inert keys are each named once.
    assert!(c
        .warnings
        .iter()
        .any(|w| w.starts_with("zero_optimization.sub_group_size:")));
    assert!(c.warnings.iter().any(|w| w.starts_with("fp16.auto_cast:")));
}

#[test]
fn every_key_is_read() {
    let c = DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.8, 0.99],
              "eps": 1e-6, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0001,
              "warmup_max_lr": 0.002, "warmup_num_steps": 10, "warmup_type": "linear",
              "total_num_steps": 100}},
            "gradient_clipping": 1.5,
            "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
              "loss_scale_window": 50, "hysteresis": 3, "min_loss_scale": 2},
            "zero_optimization": {"stage": 3, "overlap_comm": true,
              "reduce_bucket_size": 1000, "allgather_bucket_size": 2000,
              "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
            "activation_checkpointing": {"partition_activations": false,
              "cpu_checkpointing": false},
            "steps_per_print": 7, "wall_clock_breakdown": true}"#,
        2,
    )
    .unwrap();
    assert_eq!(
        (
            c.train_batch_size,
            c.micro_batch_per_rank,
            c.gradient_accumulation_steps
        ),
        (64, 8, 4)
    );
    let o = c.optimizer.unwrap();
    assert_eq!(o.kind, OptimizerKind::AdamW);
    assert_eq!(
        (o.lr, o.betas, o.eps, o.weight_decay),
        (0.002, (0.8, 0.99), 1e-6, 0.01)
    );
    assert_eq!(
        c.scheduler,
        Some(LrSchedule::WarmupDecay {
            min: 0.0001,
            max: 0.002,
            steps: 10,
            kind: WarmupType::Linear,
            total: 100
        })
    );
    assert_eq!(c.gradient_clipping, 1.5);
    assert_eq!(
        c.fp16,
        Fp16 {
            enabled: true,
            loss_scale: 0.0,
            initial_scale_power: 12,
            loss_scale_window: 50,
            hysteresis: 3,
            min_loss_scale: 2.0
        }
    );
    assert_eq!(
        c.zero,
        Zero {
            stage: 3,
            offload_optimizer: true,
            offload_param: true,
            overlap_comm: true,
            reduce_bucket_size: Some(1000),
            allgather_bucket_size: Some(2000)
        }
    );
    assert!(c.activation_checkpointing.enabled);
    assert_eq!((c.steps_per_print, c.wall_clock_breakdown), (7, true));
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn unknown_keys_name_the_nearest() {
    let e = DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 8, "gradient_acumulation_steps": 1}"#,
        1,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown key \"gradient_acumulation_steps\" in the top level (did you mean \
         \"gradient_accumulation_steps\"?)"
    );
    let e = DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 8, "zero_optimization": {"stag": 2}}"#,
        1,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("\"stag\" in zero_optimization (did you mean \"stage\"?)"),
        "{e}"
    );
    let e = DeepSpeedConfig::from_json(r#"{"train_batch_size": 8, "xyzzy": 1}"#, 1).unwrap_err();
    assert_eq!(e.to_string(), "unknown key \"xyzzy\" in the top level");
}

#[test]
fn inconsistent_batches_name_all_three() {
    let e = DeepSpeedConfig::from_json(
        r#"{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}"#,
        4,
    )
    .unwrap_err();
    let m = e.to_string();
    for want in [
        "train_batch_size (Some(30))",
        "train_micro_batch_size_per_gpu (Some(4))",
        "gradient_accumulation_steps (Some(2))",
        "4 ranks",
    ] {
        assert!(m.contains(want), "{m}");
    }
    // Not divisible.
    assert!(resolve_batch(Some(10), Some(4), None, 1).is_err());
    assert!(resolve_batch(None, None, Some(2), 1).is_err());
}

/// Any two of the batch keys (or `train_batch_size` / the micro batch alone) resolve to
/// `train = micro × accumulation × world`, the given ones kept.
#[test]
fn batch_keys_resolve_for_every_valid_combination() {
    for world in 1..=8u64 {
        for micro in 1..=6u64 {
            for acc in 1..=5u64 {
                let train = micro * acc * world;
                let cases = [
                    (Some(train), Some(micro), Some(acc)),
                    (Some(train), Some(micro), None),
                    (Some(train), None, Some(acc)),
                    (None, Some(micro), Some(acc)),
                ];
                for (t, m, a) in cases {
                    let (rt, rm, ra) = resolve_batch(t, m, a, world).unwrap();
                    assert_eq!(
                        (rt, rm, ra),
                        (train, micro, acc),
                        "{t:?} {m:?} {a:?} × {world}"
                    );
                }
                let (rt, rm, ra) = resolve_batch(None, Some(micro), None, world).unwrap();
                assert_eq!((rt, rm, ra), (micro * world, micro, 1));
                let (rt, rm, ra) = resolve_batch(Some(train), None, None, world).unwrap();
                assert_eq!(rt, rm * ra * world);
            }
        }
    }
}

#[test]
fn unsupported_settings_say_so() {
    let nvme = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}"#;
    assert!(DeepSpeedConfig::from_json(nvme, 1)
        .unwrap_err()
        .to_string()
        .contains("\"nvme\": kolo offloads to \"cpu\" only"));
    let cpu_ckpt =
        r#"{"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": true}}"#;
    assert!(DeepSpeedConfig::from_json(cpu_ckpt, 1)
        .unwrap_err()
        .to_string()
        .contains("cpu_checkpointing"));
    let auto = r#"{"train_batch_size": "auto"}"#;
    assert!(DeepSpeedConfig::from_json(auto, 1)
        .unwrap_err()
        .to_string()
        .contains("Hugging Face"));
    let onebit = r#"{"train_batch_size": 8, "optimizer": {"type": "OneBitAdam"}}"#;
    assert!(DeepSpeedConfig::from_json(onebit, 1)
        .unwrap_err()
        .to_string()
        .contains("not an optimizer kolo has"));
}

#[test]
fn schedules_follow_deepspeeds_formulas() {
    let w = LrSchedule::Warmup {
        min: 0.0,
        max: 1.0,
        steps: 100,
        kind: WarmupType::Log,
    };
    assert_eq!(w.lr_at(0), 0.0);
    assert!((w.lr_at(9) - 10f64.ln() / 100f64.ln()).abs() < 1e-12);
    assert_eq!(w.lr_at(100), 1.0);
    let d = LrSchedule::WarmupDecay {
        min: 0.0,
        max: 1.0,
        steps: 10,
        kind: WarmupType::Linear,
        total: 110,
    };
    assert_eq!(d.lr_at(5), 0.5);
    assert_eq!(d.lr_at(10), 1.0);
    assert_eq!(d.lr_at(60), 0.5);
    assert_eq!(d.lr_at(200), 0.0);
    let c = LrSchedule::OneCycle {
        min: 0.1,
        max: 1.1,
        first: 10,
        second: 10,
        decay_steps: 5,
        decay_rate: 1.0,
    };
    // Up over the first 10 iterations, down over the next 10, then decaying.
    assert!((c.lr_at(4) - 0.6).abs() < 1e-12);
    assert!((c.lr_at(9) - 1.1).abs() < 1e-12);
    assert!((c.lr_at(14) - 0.6).abs() < 1e-12);
    assert!((c.lr_at(24) - 0.1 / 2.0).abs() < 1e-12);
}
