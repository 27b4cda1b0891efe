//! The keys DeepSpeed documents, per section: those kolo acts on, and those it accepts
//! without effect (each named once in the warnings). Anything else is an error naming
//! the nearest known key.

use serde_json::{Map, Value};

use super::ConfigError;

/// One section's keys.
pub(super) struct Section {
    /// Read and acted on (or checked).
    pub(super) used: &'static [&'static str],
    /// DeepSpeed's, accepted without effect in kolo.
    pub(super) inert: &'static [&'static str],
}

pub(super) const TOP: Section = Section {
    used: &[
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "gradient_clipping",
        "fp16",
        "bf16",
        "zero_optimization",
        "activation_checkpointing",
        "steps_per_print",
        "wall_clock_breakdown",
    ],
    inert: &[
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "memory_breakdown",
        "dump_state",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "flops_profiler",
        "comms_logger",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "checkpoint",
        "data_types",
        "aio",
        "amp",
        "disable_allgather",
        "elasticity",
        "sparse_attention",
        "data_efficiency",
        "compression_training",
        "autotuning",
        "timers",
        "load_universal_checkpoint",
        "use_node_local_storage",
        "graph_harvesting",
    ],
};

pub(super) const OPTIMIZER: Section = Section {
    used: &["type", "params"],
    inert: &[],
};

pub(super) const OPTIMIZER_PARAMS: Section = Section {
    used: &[
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "momentum",
        "adam_w_mode",
        "amsgrad",
        "nesterov",
        "dampening",
    ],
    inert: &[
        "torch_adam",
        "bias_correction",
        "max_grad_norm",
        "max_coeff",
        "min_coeff",
        "fused",
    ],
};

pub(super) const SCHEDULER: Section = Section {
    used: &["type", "params"],
    inert: &[],
};

pub(super) const SCHEDULER_PARAMS: Section = Section {
    used: &[
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "total_num_steps",
        "cycle_min_lr",
        "cycle_max_lr",
        "decay_lr_rate",
        "cycle_first_step_size",
        "cycle_second_step_size",
        "decay_step_size",
    ],
    inert: &[
        "last_batch_iteration",
        "cycle_first_stair_count",
        "cycle_second_stair_count",
        "cycle_momentum",
        "cycle_min_mom",
        "cycle_max_mom",
        "decay_mom_rate",
    ],
};

pub(super) const FP16: Section = Section {
    used: &[
        "enabled",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "min_loss_scale",
        "consecutive_hysteresis",
    ],
    inert: &["auto_cast", "fp16_master_weights_and_grads"],
};

pub(super) const BF16: Section = Section {
    used: &["enabled"],
    inert: &["immediate_grad_update", "check_grad_overflow"],
};

pub(super) const ZERO: Section = Section {
    used: &[
        "stage",
        "offload_optimizer",
        "offload_param",
        "overlap_comm",
        "reduce_bucket_size",
        "allgather_bucket_size",
    ],
    inert: &[
        "contiguous_gradients",
        "allgather_partitions",
        "reduce_scatter",
        "round_robin_gradients",
        "sub_group_size",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "elastic_checkpoint",
        "load_from_fp32_weights",
        "ignore_unused_parameters",
        "legacy_stage1",
        "memory_efficient_linear",
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_gradients",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "cpu_offload",
        "cpu_offload_params",
        "cpu_offload_use_pin_memory",
        "model_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "use_multi_rank_bucket_allreduce",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
    ],
};

pub(super) const OFFLOAD: Section = Section {
    used: &["device"],
    inert: &[
        "pin_memory",
        "nvme_path",
        "buffer_count",
        "buffer_size",
        "max_in_cpu",
        "ratio",
        "fast_init",
        "pipeline_read",
        "pipeline_write",
    ],
};

pub(super) const ACTIVATION: Section = Section {
    used: &["partition_activations", "cpu_checkpointing"],
    inert: &[
        "contiguous_memory_optimization",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "profile",
    ],
};

/// Checks every key of `m` against `section`: an inert one adds a warning (its path
/// `prefix` + key), an unknown one fails naming the nearest known key.
pub(super) fn check(
    m: &Map<String, Value>,
    section: Section,
    name: &str,
    prefix: &str,
    warnings: &mut Vec<String>,
) -> Result<(), ConfigError> {
    for key in m.keys() {
        if section.used.contains(&key.as_str()) {
            continue;
        }
        if section.inert.contains(&key.as_str()) {
            warnings.push(format!("{prefix}{key}: accepted, no effect in kolo"));
            continue;
        }
        return Err(ConfigError::UnknownKey {
            key: key.clone(),
            section: name.into(),
            nearest: nearest(key, section.used.iter().chain(section.inert)),
        });
    }
    Ok(())
}

/// The known key most like `key`, if any is close (by normalised Damerau–Levenshtein
/// similarity, or containing one another).
fn nearest<'a>(key: &str, known: impl Iterator<Item = &'a &'a str>) -> Option<String> {
    let lower = key.to_ascii_lowercase();
    known
        .map(|k| {
            let mut s = strsim::normalized_damerau_levenshtein(&lower, k);
            if k.contains(lower.as_str()) || lower.contains(k) {
                s = s.max(0.7);
            }
            (s, *k)
        })
        .filter(|(s, _)| *s >= 0.5)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.to_string())
}
