//! The autotuner on a synthetic workload whose best settings are known: every step
//! submits 300 small allreduces (256 bytes each) at once and waits for them, so each
//! collective's fixed cost dominates and fusing them all (a threshold of at least
//! 75 KiB) is best; fusion off is several times slower.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use kolo::{Kolo, ReduceOp, Tensor};

/// An applied change as it travels between ranks: cycle, threshold, cycle time (us),
/// cache on, last, hierarchical.
type Change = (u64, usize, u128, bool, bool, bool);

/// Every change each rank applied, checked to be the same on every rank.
fn changes_agree(k: &Kolo) -> Result<Vec<Change>> {
    let state = k.autotune_state();
    ensure!(state.enabled && state.finished, "{state:?}");
    let mine: Vec<Change> = state
        .changes
        .iter()
        .map(|c| {
            (
                c.cycle,
                c.fusion_threshold,
                c.cycle_time.as_micros(),
                c.cache_enabled,
                c.last,
                c.hierarchical_allreduce,
            )
        })
        .collect();
    ensure!(
        !mine.is_empty() && mine.last().is_some_and(|c| c.4),
        "{mine:?}"
    );
    let all: Vec<Vec<Change>> = k.allgather_object("changes", mine.clone())?;
    for (r, theirs) in all.iter().enumerate() {
        ensure!(
            *theirs == mine,
            "rank {r} applied {theirs:?}, rank {} {mine:?}",
            k.rank()
        );
    }
    Ok(mine)
}

/// Runs `step` until rank 0's tuner has finished (every rank stops at the same step).
/// Returns the number of steps.
fn until_tuned(k: &Kolo, mut step: impl FnMut() -> Result<()>) -> Result<usize> {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut steps = 0;
    loop {
        step()?;
        steps += 1;
        // Every rank must agree on when to stop, or one would wait for the others.
        if k.broadcast_object("done", k.autotune_state().finished, 0)? {
            return Ok(steps);
        }
        ensure!(
            Instant::now() < deadline,
            "the tuner did not finish in 90 s ({steps} steps)"
        );
    }
}

const TENSORS: usize = 300;
const FLOATS: usize = 64;

/// One training-like step; returns its wall time.
fn step(k: &Kolo, tensors: &mut Vec<Tensor>) -> Result<Duration> {
    let start = Instant::now();
    let mut handles = Vec::with_capacity(TENSORS);
    for (i, t) in tensors.drain(..).enumerate() {
        handles.push(
            k.allreduce(format!("w.{i}"), t)
                .op(ReduceOp::Sum)
                .submit()?,
        );
    }
    let size = k.size() as f32;
    for h in handles {
        let mut t = h.wait()?;
        // Undo the sum so the values stay small step after step.
        for x in t.as_mut_slice::<f32>()? {
            *x /= size;
        }
        tensors.push(t);
    }
    Ok(start.elapsed())
}

fn inputs(k: &Kolo) -> Result<Vec<Tensor>> {
    (0..TENSORS)
        .map(|i| {
            Ok(Tensor::from_vec(
                vec![(k.rank() + i) as f32; FLOATS],
                &[FLOATS],
            )?)
        })
        .collect()
}

/// Median step time of `n` steps, agreed across ranks (rank 0's value).
fn median_step(k: &Kolo, tensors: &mut Vec<Tensor>, n: usize) -> Result<f64> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        times.push(step(k, tensors)?.as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(k.broadcast_object("median", times[n / 2], 0)?)
}

/// A grid point: the settings come from the environment; prints the median step.
pub(crate) fn grid_point(k: &Kolo) -> Result<()> {
    let mut t = inputs(k)?;
    median_step(k, &mut t, 10)?;
    let ms = median_step(k, &mut t, 30)? * 1e3;
    if k.rank() == 0 {
        println!("STEP_MS {ms:.4}");
    }
    Ok(())
}

/// Runs the workload until the tuner has finished, checks that every rank applied
/// the same settings after the same cycles and that the log has a row per sample,
/// then prints the median step under the tuned settings.
pub(crate) fn tune(k: &Kolo) -> Result<()> {
    let mut t = inputs(k)?;
    let steps = until_tuned(k, || step(k, &mut t).map(drop))?;
    let mine = changes_agree(k)?;
    let state = k.autotune_state();
    let ms = median_step(k, &mut t, 30)? * 1e3;
    if k.rank() == 0 {
        let log = std::env::var("KOLO_AUTOTUNE_LOG")?;
        let text = std::fs::read_to_string(&log)?;
        let mut lines = text.lines();
        ensure!(
            lines.next() == Some("sample,fusion_threshold_bytes,fusion_max_tensor_bytes,cycle_time_ms,cache_enabled,hierarchical_allreduce,hierarchical_allgather,score_bytes_per_s,kind"),
            "log header: {text}"
        );
        let rows: Vec<&str> = lines.collect();
        let count = |kind: &str| {
            rows.iter()
                .filter(|r| r.ends_with(&format!(",{kind}")))
                .count()
        };
        let configs: usize = std::env::var("KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES")?.parse()?;
        let warmup: usize = std::env::var("KOLO_AUTOTUNE_WARMUP_SAMPLES")?.parse()?;
        // Three scored samples per configuration, the first after each switch
        // discarded, the warm-up discarded, and the chosen one last.
        ensure!(
            count("sample") == 3 * configs
                && count("after-switch") == configs - 1
                && count("warmup") == warmup
                && count("best") == 1
                && mine.len() == configs,
            "{} changes for {configs} configurations; log:\n{text}",
            mine.len()
        );
        ensure!(rows.last().is_some_and(|r| r.ends_with(",best")), "{text}");
        println!(
            "TUNED_MS {ms:.4} THRESHOLD {} CHANGES {} STEPS {steps}",
            state.fusion_threshold,
            mine.len()
        );
    }
    Ok(())
}

/// Across hosts, with only hierarchical allreduce left to tune: the tuner tries it on
/// and off (every rank switching after the same cycle), and sums stay exact through
/// every switch, both through the hierarchical path or ring (2 MiB: hierarchical
/// when on, left unset) and fused small tensors.
pub(crate) fn tune_hierarchical(k: &Kolo) -> Result<()> {
    let (me, n) = (k.rank(), k.size());
    let len = 1 << 19;
    let mut step_no = 0usize;
    until_tuned(k, || {
        step_no += 1;
        let big: Vec<f32> = (0..len).map(|j| ((me + j + step_no) % 11) as f32).collect();
        let mut handles = vec![k
            .allreduce("big", Tensor::from_vec(big, &[len])?)
            .op(ReduceOp::Sum)
            .submit()?];
        for i in 0..8 {
            let small = Tensor::from_vec(vec![(me * 3 + i) as f32; 16], &[16])?;
            handles.push(
                k.allreduce(format!("small.{i}"), small)
                    .op(ReduceOp::Sum)
                    .submit()?,
            );
        }
        for (i, h) in handles.into_iter().enumerate() {
            let got: Vec<f32> = h.wait()?.into_vec()?;
            for (j, g) in got.iter().enumerate() {
                let want: f32 = if i == 0 {
                    (0..n).map(|r| ((r + j + step_no) % 11) as f32).sum()
                } else {
                    (0..n).map(|r| (r * 3 + i - 1) as f32).sum()
                };
                ensure!(
                    *g == want,
                    "step {step_no} tensor {i} element {j}: {g} != {want}"
                );
            }
        }
        Ok(())
    })?;
    let changes = changes_agree(k)?;
    // Left unset, it starts hierarchical (across hosts, from 2 MiB), so one switch
    // off means both shapes were scored.
    ensure!(
        changes.iter().any(|c| !c.5),
        "the tuner never tried the flat allreduce: {changes:?}"
    );
    if me == 0 {
        println!("TUNED hierarchical={}", changes.last().is_some_and(|c| c.5));
    }
    Ok(())
}
