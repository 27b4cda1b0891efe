//! Multi-rank tests: this binary is both the harness and the worker. Run by
//! `cargo test`, it launches itself under `mpirun -np N` (N = 1..=4) once per case;
//! under mpirun (`KOLO_TEST_CASE` set) it runs that case on every rank.

mod algorithms;
mod allreduce;
mod autotune;
mod control;
mod faults;
mod fusion;
#[cfg(feature = "nccl")]
mod gpu;
mod grouped;
mod harness;
mod issue31;
mod optimizer;
mod others;
mod p2p;
mod process_sets;
mod soak;
mod sums;
mod timeline;
mod util;

use std::time::Duration;

use libtest_mimic::{Arguments, Failed, Trial};

use harness::Case;

/// Every case, with the smallest np it is meaningful at.
const CASES: &[(&str, Case, usize)] = &[
    ("topology", control::topology, 1),
    ("allreduce_sum_and_average", allreduce::sum_and_average, 1),
    ("allreduce_min_max_product", allreduce::min_max_product, 1),
    ("allreduce_scaling", allreduce::scaling, 1),
    ("allreduce_async", allreduce::asynchronous, 1),
    ("allreduce_errors", allreduce::errors, 1),
    ("grouped_allreduce", allreduce::grouped, 1),
    ("grouped_allgather", grouped::grouped_allgather, 1),
    ("grouped_reducescatter", grouped::grouped_reducescatter, 1),
    ("grouped_member_lists", grouped::grouped_member_lists, 2),
    ("allgather", others::allgather, 1),
    ("broadcast", others::broadcast, 1),
    ("alltoall", others::alltoall, 1),
    ("reducescatter", others::reducescatter, 1),
    ("large_reducescatter", others::large_reducescatter, 1),
    ("join", control::join, 1),
    ("barrier", control::barrier, 1),
    ("key_spaces", control::key_spaces, 1),
    ("objects", control::objects, 1),
    ("order_independence", control::order_independence, 1),
    ("submit_errors", control::submit_errors, 1),
    ("rank_leaves", control::rank_leaves, 2),
    ("distributed_optimizer", optimizer::semantics, 1),
    ("fusion_mixed_async", fusion::mixed_async, 1),
    ("fusion_allgather_async", fusion::allgather_async, 1),
    ("alltoall_repeated", fusion::alltoall_repeated, 1),
    ("cache_shape_change", fusion::shape_change, 1),
    ("soak_20000_ops", soak::soak, 2),
    ("large_sums_ring", fusion::large_sums, 1),
    ("sums_every_way", sums::every_way, 1),
    ("large_async", fusion::large_async, 1),
    ("process_sets", process_sets::collectives, 1),
    ("process_set_errors", process_sets::errors, 1),
    ("process_sets_independent", process_sets::independent, 4),
    ("p2p_ring", p2p::ring, 2),
    ("p2p_same_name_other_pairs", p2p::same_name_other_pairs, 2),
    ("p2p_errors", p2p::errors, 2),
    ("p2p_blocking_paths", p2p::blocking_paths, 2),
    (
        "p2p_shutdown_while_receiving",
        p2p::shutdown_while_receiving,
        2,
    ),
    ("p2p_dtypes_sizes_in_flight", p2p::dtypes_sizes_in_flight, 2),
    ("p2p_waiting_recv_sleeps", p2p::waiting_recv_sleeps, 2),
    ("p2p_in_process_set", p2p::in_process_set, 3),
    ("p2p_racing_receives", p2p::racing_receives, 2),
    ("issue57_adasum", algorithms::adasum, 1),
    ("issue57_decentralized", algorithms::decentralized, 1),
    ("issue57_bytegrad", algorithms::bytegrad, 1),
    ("issue57_onebit_adam", algorithms::onebit_adam, 1),
    (
        "issue57_decentralized_8bit",
        algorithms::decentralized_8bit,
        1,
    ),
    ("issue57_async_averaging", algorithms::async_averaging, 1),
    ("issue57_qadam", algorithms::qadam, 1),
    ("empty_buffers", others::empty_buffers, 2),
    (
        "issue57_reduce_op_and_compression",
        algorithms::reduce_op_and_compression,
        1,
    ),
    ("p2p_pair_alone", p2p::pair_alone, 3),
    (
        "p2p_pair_alone_past_heartbeats",
        p2p::pair_alone_past_heartbeats,
        3,
    ),
    (
        "issue31_grouped_member_order",
        issue31::grouped_member_order,
        2,
    ),
    (
        "issue31_broadcast_parameters_keeps_entries",
        issue31::broadcast_parameters_keeps_entries,
        2,
    ),
    (
        "issue31_failed_ops_hand_back",
        issue31::failed_ops_hand_back,
        2,
    ),
    (
        "issue31_optimizer_refusals",
        issue31::optimizer_refusals_hand_back,
        1,
    ),
    (
        "issue31_shutdown_races_add_process_set",
        issue31::shutdown_races_add_process_set,
        1,
    ),
];

/// Cases rerun under other settings: (trial name, case, np values, environment, text
/// the output must contain).
/// Cases that only make sense under the settings a variant gives them.
const VARIANT_ONLY: &[(&str, Case)] = &[
    ("hierarchical_allreduce", allreduce::hierarchical),
    ("hierarchical_allgather", others::hierarchical_allgather),
    ("partition", faults::partition),
    ("elastic", faults::elastic),
    ("stall_shutdown", faults::stall_shutdown),
    ("p2p_stalled_recv", p2p::stalled_recv),
    ("p2p_async_send_unwaited", p2p::async_send_unwaited),
    ("p2p_stalled_recv_fails", p2p::stalled_recv_fails),
    #[cfg(feature = "fault-injection")]
    ("p2p_broken_stream", p2p::broken_stream),
    ("timeline", timeline::trace),
    ("autotune_grid_point", autotune::grid_point),
    ("autotune_tune", autotune::tune),
    ("autotune_hierarchical", autotune::tune_hierarchical),
    (
        "issue31_broadcast_object_2gib",
        issue31::broadcast_object_2gib,
    ),
    #[cfg(feature = "fault-injection")]
    ("issue31_mpi_error_returns", issue31::mpi_error_returns),
    #[cfg(feature = "fault-injection")]
    ("p2p_device_flag_without_gpu", p2p::device_flag_without_gpu),
];

/// The autotuner's test settings: only the fusion threshold is tuned (cycle time and
/// cache fixed), 8 configurations of 3 samples of 3 steps after 2 warm-up samples.
const AUTOTUNE_ENV: &[(&str, &str)] = &[
    ("KOLO_AUTOTUNE", "1"),
    ("KOLO_AUTOTUNE_LOG", "/tmp/kolo-test-autotune.csv"),
    ("KOLO_AUTOTUNE_WARMUP_SAMPLES", "2"),
    ("KOLO_AUTOTUNE_STEPS_PER_SAMPLE", "3"),
    ("KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "8"),
    ("KOLO_CYCLE_TIME", "1"),
    ("KOLO_CACHE_CAPACITY", "1024"),
    ("KOLO_SIMULATED_COLLECTIVE_COST_US", "200"),
];

/// Fusion thresholds of the grid the tuner is compared with.
const AUTOTUNE_GRID: &[&str] = &["0", "4096", "65536", "1048576", "67108864"];

/// Runs the grid, then the tuner, every collective costing 200 us extra (as on a slow
/// network, so that the cost per collective dominates as the workload intends); the
/// tuner's threshold must give a median step within 2x of the best grid point's.
/// Fusion off (300 collectives) and 4 KiB (19) are 5-100x slower than the best here,
/// so picking them fails.
fn autotune_vs_grid(np: usize) -> Result<(), Failed> {
    let number = |out: &str, key: &str| -> Option<f64> {
        out.lines()
            .find_map(|l| l.split(key).nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    };
    // Median step (ms) of one launch at a fixed threshold.
    let step_at = |threshold: &str| -> Result<f64, Failed> {
        let env = [
            ("KOLO_FUSION_THRESHOLD", threshold),
            ("KOLO_SIMULATED_COLLECTIVE_COST_US", "200"),
        ];
        let run = harness::mpirun("autotune_grid_point", np, Duration::from_secs(60), &env)?;
        run.succeeded(&format!("grid point {threshold}"))?;
        number(&run.output, "STEP_MS ")
            .ok_or_else(|| format!("grid point {threshold} failed:\n{}", run.output).into())
    };
    let mut grid = Vec::new();
    for &threshold in AUTOTUNE_GRID {
        grid.push((threshold, step_at(threshold)?));
    }
    let run = harness::mpirun("autotune_tune", np, Duration::from_secs(120), AUTOTUNE_ENV)?;
    run.succeeded("tuning")?;
    let chosen = number(&run.output, "THRESHOLD ")
        .ok_or_else(|| format!("tuning failed:\n{}", run.output))?;
    let (best, _) = grid
        .iter()
        .copied()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .ok_or("empty grid")?;
    // The tuner's choice against the best grid point, measured alternately (five
    // launches each, medians) so that both see the same machine load: other tests
    // run beside this one, and one launch against another can differ by 2x (a step
    // takes ~0.66 or ~1.1 ms from launch to launch at the same threshold here; with
    // three launches each, the medians once fell on opposite modes, 2.08x).
    let chosen = format!("{chosen:.0}");
    let (mut at_best, mut at_chosen) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        at_best.push(step_at(best)?);
        at_chosen.push(step_at(&chosen)?);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (b, c) = (median(&mut at_best), median(&mut at_chosen));
    eprintln!(
        "autotune np{np}: grid (threshold, median step ms) {grid:?}; tuner chose {chosen} B: {c:.3} ms vs best grid point {best} B: {b:.3} ms"
    );
    if c > 2.0 * b {
        return Err(format!(
            "the tuner's threshold {chosen} B gives {c:.3} ms per step, more than 2x the best grid point ({best} B, {b:.3} ms); grid {grid:?}\n{}",
            run.output
        )
        .into());
    }
    Ok(())
}

/// A rerun of a case: trial name, case, np values, environment, required output.
type Variant = (
    &'static str,
    &'static str,
    &'static [usize],
    &'static [(&'static str, &'static str)],
    Option<&'static str>,
);

const VARIANTS: &[Variant] = &[
    // Each way a flat host sum can travel, forced (issue 58: recursive halving and
    // doubling for many ranks), np 2-4 (3: a rank count that folds in).
    (
        "sums_halving_doubling",
        "sums_every_way",
        &[2, 3, 4],
        &[("KOLO_ALLREDUCE_ALGORITHM", "halving-doubling")],
        None,
    ),
    (
        "sums_ring",
        "sums_every_way",
        &[2, 3, 4],
        &[("KOLO_ALLREDUCE_ALGORITHM", "ring")],
        None,
    ),
    (
        "sums_mpi",
        "sums_every_way",
        &[2, 3],
        &[("KOLO_ALLREDUCE_ALGORITHM", "mpi")],
        None,
    ),
    (
        "fusion_off",
        "fusion_mixed_async",
        &[2, 3],
        &[("KOLO_FUSION_THRESHOLD", "0")],
        None,
    ),
    // 256 bytes: most tensors are larger than the threshold, a few small ones fuse.
    (
        "fusion_tiny_threshold",
        "fusion_mixed_async",
        &[2],
        &[("KOLO_FUSION_THRESHOLD", "256")],
        None,
    ),
    (
        "fusion_is_used",
        "fusion_mixed_async",
        &[2],
        &[
            ("KOLO_LOG_LEVEL", "debug"),
            ("KOLO_FUSION_THRESHOLD", "67108864"),
        ],
        Some("fused allreduce tensors="),
    ),
    (
        "allgather_fusion_off",
        "fusion_allgather_async",
        &[2, 3],
        &[("KOLO_FUSION_THRESHOLD", "0")],
        None,
    ),
    (
        "allgather_cache_tiny",
        "fusion_allgather_async",
        &[3],
        &[("KOLO_CACHE_CAPACITY", "4")],
        None,
    ),
    (
        "alltoall_cache_off",
        "alltoall_repeated",
        &[3],
        &[("KOLO_CACHE_CAPACITY", "0")],
        None,
    ),
    (
        "allgather_fusion_is_used",
        "fusion_allgather_async",
        &[2],
        &[("KOLO_LOG_LEVEL", "debug")],
        Some("fused allgather tensors="),
    ),
    (
        "cache_off",
        "fusion_mixed_async",
        &[2],
        &[("KOLO_CACHE_CAPACITY", "0")],
        None,
    ),
    (
        "cache_off_shape_change",
        "cache_shape_change",
        &[2],
        &[("KOLO_CACHE_CAPACITY", "0")],
        None,
    ),
    (
        "cache_tiny_shape_change",
        "cache_shape_change",
        &[3],
        &[("KOLO_CACHE_CAPACITY", "4")],
        None,
    ),
    (
        "stall_warning_then_shutdown",
        "stall_shutdown",
        &[2, 4],
        &[
            ("KOLO_STALL_CHECK_TIME_SECONDS", "1"),
            ("KOLO_STALL_SHUTDOWN_TIME_SECONDS", "3"),
        ],
        Some("have not submitted [\"stalled.x\"]"),
    ),
    (
        "p2p_stalled_recv",
        "p2p_stalled_recv",
        &[2],
        &[("KOLO_STALL_CHECK_TIME_SECONDS", "1")],
        Some("stalled recv: rank 1 has waited"),
    ),
    // Issue 53 item 20: a receive whose sender never sends fails after the stall
    // shutdown time.
    (
        "p2p_stalled_recv_fails",
        "p2p_stalled_recv_fails",
        &[2, 3],
        &[("KOLO_STALL_SHUTDOWN_TIME_SECONDS", "2")],
        Some("P2P_STALL_FAILED_AND_WENT_ON"),
    ),
    // Issue 53 item 18: a send that fails after its header breaks that destination.
    #[cfg(feature = "fault-injection")]
    (
        "p2p_broken_stream",
        "p2p_broken_stream",
        &[2, 3],
        &[
            ("KOLO_FAULT_P2P_DATA_FAIL", "broken.a"),
            ("KOLO_STALL_SHUTDOWN_TIME_SECONDS", "2"),
        ],
        Some("P2P_BROKEN_STREAM_REFUSED"),
    ),
    (
        "p2p_async_send_unwaited",
        "p2p_async_send_unwaited",
        &[2],
        &[("KOLO_CYCLE_TIME", "200")],
        None,
    ),
    (
        "timeline",
        "timeline",
        &[2],
        &[
            ("KOLO_TIMELINE", "/tmp/kolo-test-timeline-{rank}.json"),
            ("KOLO_TIMELINE_MARK_CYCLES", "1"),
        ],
        None,
    ),
    // Issue 31 item 13: 2 GiB + 9 bytes through broadcast_object (about 4 GiB of
    // memory per rank at the peak).
    (
        "issue31_broadcast_object_2gib",
        "issue31_broadcast_object_2gib",
        &[2],
        &[],
        None,
    ),
    // Issue 31 item 14: an error MPI returns reaches the caller (fault-injection).
    #[cfg(feature = "fault-injection")]
    (
        "issue31_mpi_error_returns",
        "issue31_mpi_error_returns",
        &[1, 2],
        &[("KOLO_FAULT_MPI_BAD_ROOT", "1")],
        Some("TRANSPORT_ERROR MPI_Bcast"),
    ),
    // Tensors marked as sent from a device (fault-injection): refused clearly where
    // there is none, put on the device where there is one.
    #[cfg(feature = "fault-injection")]
    (
        "p2p_device_flag_without_gpu",
        "p2p_device_flag_without_gpu",
        &[2, 3],
        &[("KOLO_FAULT_P2P_AS_DEVICE", "1")],
        Some("DEVICE_FLAG"),
    ),
];

/// Cases that must end the whole job: (name, case, np values, text the output must
/// contain). The job must exit non-zero within `FAULT_DEADLINE`.
const FAULTS: &[(&str, Case, &[usize], &str)] = &[
    (
        "panic_on_thread",
        faults::panic_on_thread,
        &[2, 4],
        "kolo: rank {last} panicked on thread '<unnamed>'",
    ),
    (
        "early_exit",
        faults::early_exit,
        &[2, 4],
        "rank {last} has shut down",
    ),
    (
        "sigkill",
        faults::sigkill,
        &[2, 4],
        "process rank {last} with PID",
    ),
    (
        "p2p_dead_sender",
        faults::p2p_dead_sender,
        &[2, 3],
        "process rank {last} with PID",
    ),
    (
        "p2p_dead_receiver",
        faults::p2p_dead_receiver,
        &[2, 3],
        "process rank {last} with PID",
    ),
    (
        "sigstop",
        faults::sigstop,
        &[2, 4],
        // Only at np 2 is the silent peer always the stopped rank itself: at np 4 the
        // first watchdog to fire may be rank 0's, waiting for rank 2, which waits for
        // rank 3 (recursive doubling), and its abort can end the others before they
        // print.
        "has not answered (waiting for its part of the cycle agreement): it, or a rank it \
         waits for, is stopped",
    ),
    ("late_start", faults::late_start, &[2], "rank 0 on "),
    (
        "shutdown_timeout",
        faults::shutdown_timeout,
        &[2, 4],
        "kolo: rank {last}: shutdown did not finish within 1s",
    ),
    (
        "panic_before_collective",
        faults::panic_before_collective,
        &[2, 4],
        "kolo: rank {last} panicked on thread 'main'",
    ),
];

/// Faults injected inside kolo (feature `fault-injection`, run by the README's test
/// command): the last rank's engine thread panics (`KOLO_FAULT_ENGINE_PANIC_RANK`).
#[cfg(feature = "fault-injection")]
const INJECTED_FAULTS: &[(&str, Case, &[usize], &str)] = &[(
    "engine_panic",
    faults::engine_panic,
    &[2, 4],
    "kolo: rank {last}: the engine thread panicked; aborting the whole job",
)];
#[cfg(not(feature = "fault-injection"))]
const INJECTED_FAULTS: &[(&str, Case, &[usize], &str)] = &[];

/// Ok when a fault ended the whole job as it must: a failure, within `deadline`,
/// whose output contains `expect`. Prints how long it took.
fn ended_by_fault(
    run: &harness::Run,
    what: &str,
    deadline: Duration,
    expect: &str,
) -> Result<(), Failed> {
    let why = if run.success {
        "the job succeeded".to_string()
    } else if run.elapsed > deadline {
        format!("the job took {:?} to end", run.elapsed)
    } else if !run.output.contains(expect) {
        format!("output lacks {expect:?}")
    } else {
        eprintln!("fault {what}: the job ended in {:?}", run.elapsed);
        return Ok(());
    };
    Err(format!("{what}: {why}\n{}", run.output).into())
}

/// mpirun start-up (~1 s here) plus the 10 s the design allows a panic to take.
const FAULT_DEADLINE: Duration = Duration::from_secs(11);

/// Cases run across 2 emulated hosts × 2 ranks when the README's test command has set
/// them up (`KOLO_MULTINODE=1`; ignored otherwise, so the count shows).
const MULTINODE_CASES: &[&str] = &[
    "topology",
    "allreduce_sum_and_average",
    "allreduce_async",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "large_reducescatter",
    "join",
    "barrier",
    "objects",
    "fusion_mixed_async",
    "large_sums_ring",
    "sums_every_way",
    "distributed_optimizer",
    "process_sets",
    "process_set_errors",
    "process_sets_independent",
];

/// The collective timeout the partition test runs with, and what the job may take
/// past it (the issue's bound).
const PARTITION_TIMEOUT_S: u64 = 5;

/// Runs `f` as a multi-host trial: ignored unless the emulated hosts are up.
fn multinode_trial(name: &str, f: impl FnOnce() -> Result<(), Failed> + Send + 'static) -> Trial {
    multinode_trial_shaped(name, "2x2", f)
}

/// [`multinode_trial`] for a trial whose ranks are placed otherwise (`shape`: hosts ×
/// ranks per host, as its name shows).
fn multinode_trial_shaped(
    name: &str,
    shape: &str,
    f: impl FnOnce() -> Result<(), Failed> + Send + 'static,
) -> Trial {
    Trial::test(format!("multinode/{name}/{shape}"), f)
        .with_ignored_flag(harness::multinode().is_none())
}

/// Multi-host faults: SIGKILL of a rank on h2, and h2's link taken down mid-job
/// (a partition: no error ever comes back, only the collective timeout ends it).
fn multinode_faults() -> Vec<Trial> {
    let sigkill = multinode_trial("fault_sigkill_on_h2", || {
        let run = harness::mpirun_hosts("sigkill", Duration::from_secs(60), &[])?;
        ended_by_fault(
            &run,
            "sigkill of rank 3 on h2",
            FAULT_DEADLINE,
            "process rank 3 with PID",
        )
    });
    // Issue 37: a rank on h2 is killed on the first attempt; kolorun leaves h2 out and
    // the second attempt finishes on h1's two ranks.
    let elastic = multinode_trial("elastic_host_left_out", || {
        let run = harness::kolorun_hosts_with(
            "elastic",
            Duration::from_secs(120),
            &[],
            &["--max-restarts", "1", "--min-np", "2"],
        )?;
        let fail =
            |why: &str| -> Result<(), Failed> { Err(format!("{why}\n{}", run.output).into()) };
        if !run.success {
            return fail("the relaunched job did not succeed");
        }
        for want in [
            "attempt 1 of 2 failed",
            "on node h2",
            "leaving host h2 out",
            "elastic: attempt 1 finished on 2 ranks",
        ] {
            if !run.output.contains(want) {
                return fail(&format!("the output lacks {want:?}"));
            }
        }
        Ok(())
    });
    let partition = multinode_trial("fault_partition", || {
        let link = |state: &str| {
            std::process::Command::new("ip")
                .args(["-n", "h2", "link", "set", "eth0", state])
                .status()
        };
        let cut = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(4));
            let at = std::time::Instant::now();
            (link("down"), at)
        });
        let timeout = PARTITION_TIMEOUT_S.to_string();
        let launched = std::time::Instant::now();
        let run = harness::kolorun_hosts(
            "partition",
            Duration::from_secs(90),
            &[("KOLO_COLLECTIVE_TIMEOUT_SECONDS", &timeout)],
        );
        let (down, at) = cut.join().map_err(|_| "the link thread panicked")?;
        let up = link("up");
        let run = run?;
        let ended_after = (launched + run.elapsed).saturating_duration_since(at);
        down.map_err(|e| format!("ip link set down: {e}"))?;
        up.map_err(|e| format!("ip link set up: {e}"))?;
        let fail =
            |why: String| -> Result<(), Failed> { Err(format!("{why}\n{}", run.output).into()) };
        if run.success {
            return fail("the job succeeded although h2 was cut off".into());
        }
        let bound = Duration::from_secs(PARTITION_TIMEOUT_S + 10);
        if ended_after > bound {
            return fail(format!(
                "the job ended {ended_after:?} after the cut, past {bound:?}"
            ));
        }
        for want in [
            "has made no progress for",
            "kolorun: mpirun has not ended the job",
        ] {
            if !run.output.contains(want) {
                return fail(format!("the output lacks {want:?}"));
            }
        }
        // The rank that never answered is named when the cut catches the engines in
        // the cycle agreement (most runs); a cut inside a collective's own MPI call
        // leaves no peer to name, and the line says so (seen in about 1 run in 4 since
        // waiting callers run the cycles themselves, issue 34).
        let why = [
            "has not answered (waiting for its part of the cycle agreement)",
            "another rank is stopped or stuck, or its host is unreachable",
        ];
        if !why.iter().any(|w| run.output.contains(w)) {
            return fail(format!("the output gives no reason ({why:?})"));
        }
        // "kolo: rank R: <engine> has made no progress … : rank W has not answered …"
        let named: Vec<String> = run
            .output
            .lines()
            .filter_map(|l| {
                let who = l.split("kolo: ").nth(1)?.split(':').next()?;
                let waited = l
                    .split("): rank ")
                    .nth(1)?
                    .split(" has not answered")
                    .next()?;
                Some(format!("{who} waits for rank {waited}"))
            })
            .collect();
        eprintln!(
            "multinode partition: the job ended {ended_after:?} after h2 was cut off; \
             the ranks waited for: {named:?}"
        );
        Ok(())
    });
    // Hierarchical allreduce at 2 hosts × 2 ranks (and the check that it ran), and
    // the flat fallback with one warning at 2 + 1 ranks; the same case flat for
    // comparison.
    let reduce_env: &[(&str, &str)] = &[
        ("KOLO_HIERARCHICAL_ALLREDUCE", "1"),
        ("KOLO_LOG_LEVEL", "debug"),
    ];
    // Hierarchical allgather: packed and round-robin placement (the host's ranks are
    // not contiguous, so the blocks must be laid out again in rank order), and the
    // flat fallback on uneven hosts.
    let gather_env: &[(&str, &str)] = &[
        ("KOLO_HIERARCHICAL_ALLGATHER", "1"),
        ("KOLO_LOG_LEVEL", "debug"),
    ];
    let mut trials = Vec::new();
    // (trial, case, mpirun arguments, environment, a line said exactly once)
    for (name, case, args, env, expect) in [
        (
            "hierarchical_allreduce",
            "hierarchical_allreduce",
            &["-np", "4"][..],
            reduce_env,
            "hierarchical allreduce on",
        ),
        (
            "hierarchical_uneven_hosts",
            "hierarchical_allreduce",
            &["-np", "3"][..],
            reduce_env,
            "hosts have different numbers of ranks (1, 2): allreduce stays flat",
        ),
        (
            "hierarchical_allgather",
            "hierarchical_allgather",
            &["-np", "4"][..],
            gather_env,
            "hierarchical allgather on",
        ),
        (
            "hierarchical_allgather_round_robin",
            "hierarchical_allgather",
            &["-np", "4", "--map-by", "node"][..],
            gather_env,
            "hierarchical allgather on",
        ),
        (
            "hierarchical_allgather_uneven_hosts",
            "hierarchical_allgather",
            &["-np", "3"][..],
            gather_env,
            "hosts have different numbers of ranks (1, 2): allgather stays flat",
        ),
    ] {
        trials.push(multinode_trial(name, move || {
            let run = harness::mpirun_hosts_args(case, args, Duration::from_secs(180), env)?;
            run.succeeded(name)?;
            if run.output.matches(expect).count() != 1 {
                return Err(
                    format!("{name}: {expect:?} not said exactly once:\n{}", run.output).into(),
                );
            }
            Ok(())
        }));
    }
    // Recursive halving and doubling across hosts (issue 58), forced: flat over the 4
    // ranks (its first step inside a host, its second across), and as the
    // hierarchical allreduce's cross-host sum. Then the hierarchical allreduce in
    // pieces, pipelined (`transport/schedule.rs`): 4 KiB pieces, so that every sum
    // of the case from 1024 elements goes in several (up to 64) pieces at once; its
    // cross-host sum as a ring, and by halving and doubling. Exact integer sums,
    // f64 averages the same bits on every rank.
    type Env = &'static [(&'static str, &'static str)];
    let sums: [(&str, Env); 4] = [
        (
            "sums_halving_doubling_flat",
            &[
                ("KOLO_ALLREDUCE_ALGORITHM", "halving-doubling"),
                ("KOLO_HIERARCHICAL_ALLREDUCE", "0"),
            ],
        ),
        (
            "sums_halving_doubling_hierarchical",
            &[
                ("KOLO_ALLREDUCE_ALGORITHM", "halving-doubling"),
                ("KOLO_HIERARCHICAL_ALLREDUCE", "1"),
            ],
        ),
        (
            "sums_pipelined_hierarchical",
            &[
                ("KOLO_ALLREDUCE_ALGORITHM", "auto"),
                ("KOLO_HIERARCHICAL_ALLREDUCE", "1"),
                ("KOLO_HIERARCHICAL_PIECE_BYTES", "4096"),
            ],
        ),
        (
            "sums_pipelined_hierarchical_halving",
            &[
                ("KOLO_ALLREDUCE_ALGORITHM", "halving-doubling"),
                ("KOLO_HIERARCHICAL_ALLREDUCE", "1"),
                ("KOLO_HIERARCHICAL_PIECE_BYTES", "4096"),
            ],
        ),
    ];
    for (name, env) in sums {
        trials.push(multinode_trial(name, move || {
            let run = harness::mpirun_hosts_args(
                "sums_every_way",
                &["-np", "4"],
                Duration::from_secs(180),
                env,
            )?;
            Ok(run.succeeded(name)?)
        }));
    }
    // Left unset, the allreduce is hierarchical from 2 MiB across hosts of 2 ranks
    // each (said once, with the size), and the same sums stay exact.
    trials.push(multinode_trial("hierarchical_allreduce_default", || {
        let run = harness::mpirun_hosts_args(
            "hierarchical_allreduce",
            &["-np", "4"],
            Duration::from_secs(180),
            &[("KOLO_LOG_LEVEL", "debug")],
        )?;
        run.succeeded("hierarchical allreduce by default")?;
        let said: Vec<&str> = run
            .output
            .lines()
            .filter(|l| l.contains("hierarchical allreduce on"))
            .collect();
        if said.len() != 1 || !said[0].contains("from_bytes=2097152") {
            return Err(format!(
                "expected one \"hierarchical allreduce on\" with from_bytes=2097152:\n{}",
                run.output
            )
            .into());
        }
        Ok(())
    }));
    // Ranks placed round-robin over the hosts: the ring still crosses each host
    // boundary once (ring order 0 2 1 3), and sums through it stay exact.
    trials.push(multinode_trial("ring_round_robin_placement", || {
        let run = harness::mpirun_hosts_args(
            "large_sums_ring",
            &["-np", "4", "--map-by", "node"],
            Duration::from_secs(180),
            &[("KOLO_LOG_LEVEL", "debug")],
        )?;
        run.succeeded("large sums with round-robin placement")?;
        let want = "ring=[0, 2, 1, 3] multi_host=true";
        if !run.output.contains(want) {
            return Err(format!("the output lacks {want:?}:\n{}", run.output).into());
        }
        Ok(())
    }));
    // One rank per host: large sums go to the ring in groups, exact in every element.
    trials.push(multinode_trial_shaped("grouped_ring", "2x1", || {
        let run = harness::mpirun_hosts_args(
            "large_async",
            &["-np", "2", "--map-by", "ppr:1:node"],
            Duration::from_secs(180),
            &[("KOLO_LOG_LEVEL", "debug"), ("KOLO_GROUPED_RING", "1")],
        )?;
        run.succeeded("large async sums, one rank per host")?;
        if !run.output.contains("grouped in-place allreduce") {
            return Err(format!("no group went to the ring:\n{}", run.output).into());
        }
        Ok(())
    }));
    // Left unset, kolo times the link at start: grouped on a 1 Gbit/s link, not on the
    // unshaped one (about 9.5 Gbit/s here).
    trials.push(multinode_trial_shaped(
        "grouped_ring_chosen_by_link",
        "2x1",
        || {
            let dir = harness::multinode().ok_or("the emulated hosts are not up")?;
            let shape = |rate: &str| {
                std::process::Command::new(dir.join("shape.sh"))
                    .arg(rate)
                    .status()
                    .map_err(|e| format!("shape.sh {rate}: {e}"))
            };
            for (rate, want) in [
                ("1gbit", "grouped_ring=true"),
                ("clear", "grouped_ring=false"),
            ] {
                shape(rate)?;
                let run = harness::mpirun_hosts_args(
                    "topology",
                    &["-np", "2", "--map-by", "ppr:1:node"],
                    Duration::from_secs(120),
                    &[("KOLO_LOG_LEVEL", "debug")],
                );
                shape("clear")?;
                let run = run?;
                run.succeeded("the link probe")?;
                if !run.output.contains(want) {
                    return Err(
                        format!("at {rate}: the output lacks {want:?}:\n{}", run.output).into(),
                    );
                }
            }
            Ok(())
        },
    ));
    // The autotuner switching hierarchical allreduce on and off across hosts (the only
    // setting left to it).
    trials.push(multinode_trial("autotune_hierarchical", || {
        let env = [
            ("KOLO_AUTOTUNE", "1"),
            ("KOLO_AUTOTUNE_WARMUP_SAMPLES", "0"),
            ("KOLO_AUTOTUNE_STEPS_PER_SAMPLE", "2"),
            ("KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "4"),
            ("KOLO_FUSION_THRESHOLD", "1048576"),
            ("KOLO_CYCLE_TIME", "1"),
            ("KOLO_CACHE_CAPACITY", "1024"),
            ("KOLO_HIERARCHICAL_ALLGATHER", "0"),
        ];
        let run = harness::mpirun_hosts("autotune_hierarchical", Duration::from_secs(180), &env)?;
        run.succeeded("the autotuner switching hierarchical allreduce")?;
        if !run.output.contains("TUNED hierarchical=") {
            return Err(format!("rank 0 did not report the choice:\n{}", run.output).into());
        }
        Ok(())
    }));
    trials.push(multinode_trial("hierarchical_case_flat", || {
        let run = harness::mpirun_hosts(
            "hierarchical_allreduce",
            Duration::from_secs(180),
            &[("KOLO_HIERARCHICAL_ALLREDUCE", "0")],
        )?;
        Ok(run.succeeded("the flat run")?)
    }));
    // kolorun end to end: inherited single-machine settings are dropped (with a note),
    // the environment reaches h2's ranks, the topology is right.
    let kolorun = multinode_trial("kolorun_topology", || {
        let env = [
            ("OMPI_MCA_btl", "self,vader"),
            ("OMPI_MCA_oob_tcp_if_include", "lo"),
        ];
        let run = harness::kolorun_hosts("topology", Duration::from_secs(120), &env)?;
        run.succeeded("kolorun across hosts")?;
        if !run
            .output
            .contains("kolorun: not passing OMPI_MCA_btl=self,vader")
        {
            return Err(format!("no note about OMPI_MCA_btl:\n{}", run.output).into());
        }
        Ok(())
    });
    trials.extend([kolorun, sigkill, partition, elastic]);
    trials
}

/// CUDA cases (feature `nccl`): (name, case, np values). They need a CUDA GPU per
/// rank, so they are ignored unless `KOLO_TEST_GPU=1` (then the no-GPU case, which
/// expects no CUDA driver, is left out instead).
#[cfg(feature = "nccl")]
const GPU_CASES: &[(&str, Case, &[usize])] = &[
    ("gpu_allreduce", gpu::allreduce, &[1, 2]),
    ("gpu_fused_and_grouped", gpu::fused_and_grouped, &[1, 2]),
    ("gpu_others", gpu::others, &[1, 2]),
    ("gpu_errors", gpu::errors, &[1]),
];
#[cfg(not(feature = "nccl"))]
const GPU_CASES: &[(&str, Case, &[usize])] = &[];

/// CUDA cases whose ranks may share one GPU (no NCCL communicator): run at every np
/// listed with `KOLO_TEST_GPU=1`, ignored elsewhere.
#[cfg(feature = "nccl")]
const GPU_SHARED_CASES: &[(&str, Case, &[usize])] = &[("gpu_p2p_device", gpu::p2p_device, &[2])];
#[cfg(not(feature = "nccl"))]
const GPU_SHARED_CASES: &[(&str, Case, &[usize])] = &[];

#[cfg(feature = "nccl")]
// Named so that no filter for the GPU cases ("gpu", "gpu_") selects them: they expect
// a machine without the CUDA driver.
const NO_GPU_CASES: &[(&str, Case, &[usize])] = &[("nodriver_cuda", gpu::nodriver, &[1, 2])];
#[cfg(not(feature = "nccl"))]
const NO_GPU_CASES: &[(&str, Case, &[usize])] = &[];

fn worker(case: &str) -> ! {
    let faults = FAULTS
        .iter()
        .chain(INJECTED_FAULTS)
        .map(|(n, f, _, _)| (*n, *f));
    let variant_only = VARIANT_ONLY.iter().copied();
    let gpu = GPU_CASES
        .iter()
        .chain(GPU_SHARED_CASES)
        .chain(NO_GPU_CASES)
        .map(|(n, f, _)| (*n, *f));
    let all: Vec<(&str, Case)> = CASES
        .iter()
        .map(|(n, f, _)| (*n, *f))
        .chain(faults)
        .chain(variant_only)
        .chain(gpu)
        .collect();
    harness::run_worker(case, &all)
}

fn main() {
    if let Ok(case) = std::env::var("KOLO_TEST_CASE") {
        worker(&case);
    }
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for np in 1..=4 {
        for &(name, _, min_np) in CASES {
            if np < min_np {
                continue;
            }
            trials.push(harness::trial(name, np, Duration::from_secs(120), &[]));
        }
    }
    trials.extend(harness::gpu_trials(
        GPU_CASES,
        Duration::from_secs(180),
        &[],
        false,
    ));
    trials.extend(harness::gpu_trials(
        GPU_SHARED_CASES,
        Duration::from_secs(180),
        &[],
        true,
    ));
    let gpu_machine = std::env::var_os("KOLO_TEST_GPU").is_some_and(|v| v == "1");
    // The no-GPU cases expect the CUDA driver library to be missing: on a machine that
    // has one (with or without KOLO_TEST_GPU) they are ignored.
    let driver_missing = matches!(
        kolo::cuda_device_count(),
        Err(e) if e.to_string().contains("CUDA driver library not found")
    );
    for &(name, _, nps) in NO_GPU_CASES {
        for &np in nps {
            let t = harness::trial(name, np, Duration::from_secs(60), &[]);
            trials.push(t.with_ignored_flag(gpu_machine || !driver_missing));
        }
    }
    for &(trial, case, nps, env, expect) in VARIANTS {
        for &np in nps {
            trials.push(Trial::test(format!("{trial}/np{np}"), move || {
                let run = harness::mpirun(case, np, Duration::from_secs(120), env)
                    .map_err(Failed::from)?;
                run.succeeded(&format!("{trial} at np={np}"))?;
                match expect {
                    Some(text) if !run.output.contains(text) => Err(format!(
                        "{trial} at np={np}: output lacks {text:?}\n{}",
                        run.output
                    )
                    .into()),
                    _ => Ok(()),
                }
            }));
        }
    }
    for &(name, _, nps, expect) in FAULTS.iter().chain(INJECTED_FAULTS) {
        for &np in nps {
            let expect = expect.replace("{last}", &(np - 1).to_string());
            trials.push(Trial::test(format!("fault_{name}/np{np}"), move || {
                let last = (np - 1).to_string();
                let env: Vec<(&str, &str)> = match name {
                    "engine_panic" => vec![("KOLO_FAULT_ENGINE_PANIC_RANK", &last)],
                    "sigstop" => vec![("KOLO_COLLECTIVE_TIMEOUT_SECONDS", "2")],
                    "late_start" => vec![("KOLO_START_TIMEOUT", "2")],
                    _ => Vec::new(),
                };
                let run = harness::mpirun(name, np, Duration::from_secs(60), &env)
                    .map_err(Failed::from)?;
                // Issue 37, part 4: a peer that stopped answering ends the job with
                // kolo's restartable status; a panic with the program's own.
                let code = match name {
                    // The watchdog; and the other ranks' ops failing with RankLeft,
                    // which the worker turns into the same status.
                    "sigstop" | "early_exit" => Some(kolo::RESTARTABLE_EXIT_CODE),
                    "panic_before_collective" => Some(1),
                    _ => run.code,
                };
                if run.code != code {
                    return Err(format!(
                        "{name} at np={np}: mpirun exited with {:?}, expected {code:?}\n{}",
                        run.code, run.output
                    )
                    .into());
                }
                ended_by_fault(&run, &format!("{name} at np={np}"), FAULT_DEADLINE, &expect)
            }));
        }
    }
    trials.push(Trial::test("autotune_vs_grid/np2", || autotune_vs_grid(2)));
    for &case in MULTINODE_CASES {
        trials.push(multinode_trial(case, move || {
            let run = harness::mpirun_hosts(case, Duration::from_secs(180), &[])?;
            Ok(run.succeeded(&format!("case {case} across hosts"))?)
        }));
    }
    trials.extend(multinode_faults());
    libtest_mimic::run(&args, trials).exit();
}
