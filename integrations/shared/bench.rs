//! What the frameworks' benchmarks share: launching a side and reading its result
//! line, medians and ranges, and plain programs' malloc settings. Included by
//! `#[path]` from each integration's benchmark.

use std::process::Command;

use anyhow::{ensure, Context, Result};

/// glibc's tunables for what `kolo::Config::malloc_tuning` sets with `mallopt`, given
/// to the plain programs: the plain frameworks gained as much from them as kolo's ranks
/// (+40% on Burn's big model here), so the ratios compare the distributed training,
/// not the allocator.
pub(crate) const PLAIN_MALLOC: &str =
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=2147483647";

/// Runs `cmd` with one compute thread per process and reads the `fields` of its
/// `RESULT k=v …` line, in order.
pub(crate) fn result_of(mut cmd: Command, what: &str, fields: &[&str]) -> Result<Vec<f64>> {
    cmd.env("RAYON_NUM_THREADS", "1");
    let out = cmd.output().with_context(|| format!("starting {what}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .with_context(|| format!("{what} printed no result:\n{stdout}"))?;
    fields
        .iter()
        .map(|k| {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
                .with_context(|| format!("{what}: no {k} in {line:?}"))?
                .parse()
                .with_context(|| format!("{what}: {line:?}"))
        })
        .collect()
}

/// Median, lowest and highest of `v` (not empty).
pub(crate) fn median_range(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

/// `median [low-high]`.
pub(crate) fn show(v: &[f64]) -> String {
    let (m, lo, hi) = median_range(v);
    format!("{m:8.2} [{lo:.2}-{hi:.2}]")
}

/// The value after `flag` on the command line `args`.
pub(crate) fn arg(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// What a benchmark launch covers.
pub(crate) struct Plan {
    /// No `--bench` (as `cargo test --all-targets` runs it): one short smoke run.
    pub(crate) smoke: bool,
    /// Repetitions: `KOLO_BENCH_REPS` (default 5), 1 for a smoke run.
    pub(crate) reps: usize,
    /// `--model`'s, or the small model for a smoke run, else small and big.
    pub(crate) models: Vec<String>,
}

/// The [`Plan`] that `args` ask for.
pub(crate) fn plan(args: &[String]) -> Plan {
    let smoke = !args.iter().any(|a| a == "--bench");
    let reps = if smoke {
        1
    } else {
        std::env::var("KOLO_BENCH_REPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(5)
    };
    let models = match arg(args, "--model") {
        Some(m) => vec![m],
        None if smoke => vec!["small".into()],
        None => vec!["small".into(), "big".into()],
    };
    Plan {
        smoke,
        reps,
        models,
    }
}
