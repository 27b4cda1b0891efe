//! The timeline: a Chrome Trace Event file that parses after every event, with a track
//! per tensor, the phases of each op, and dtype and shape in the args.

use anyhow::{ensure, Context, Result};
use kolo::{DType, Kolo, ReduceOp, Tensor};
use serde_json::Value;

fn events(path: &str) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    serde_json::from_str(&text).with_context(|| format!("{path} is not valid JSON:\n{text}"))
}

/// Checks the Trace Event fields of every event and returns the span names per track.
fn check_format(evs: &[Value], rank: usize) -> Result<Vec<(String, String)>> {
    let mut tracks = std::collections::HashMap::new();
    let mut spans = Vec::new();
    for e in evs {
        let ph = e["ph"].as_str().context("event without ph")?;
        ensure!(e["pid"] == rank, "pid is not the rank: {e}");
        ensure!(e["name"].is_string(), "event without a name: {e}");
        match ph {
            "M" => {
                if e["name"] == "thread_name" {
                    tracks.insert(
                        e["tid"].as_u64().context("tid")?,
                        e["args"]["name"]
                            .as_str()
                            .context("track name")?
                            .to_string(),
                    );
                }
            }
            "X" => {
                ensure!(
                    e["ts"].is_u64() && e["dur"].is_u64() && e["tid"].is_u64(),
                    "bad complete event: {e}"
                );
                let track = tracks
                    .get(&e["tid"].as_u64().unwrap_or(0))
                    .context("span on an unnamed track")?;
                ensure!(
                    e["args"]["dtype"].is_string() && e["args"]["shape"].is_array(),
                    "span without dtype/shape: {e}"
                );
                spans.push((track.clone(), e["name"].as_str().unwrap_or("").to_string()));
            }
            "i" => ensure!(
                e["name"] == "CYCLE_START" && e["ts"].is_u64(),
                "bad instant event: {e}"
            ),
            other => anyhow::bail!("unexpected phase {other}: {e}"),
        }
    }
    Ok(spans)
}

pub(crate) fn trace(k: &Kolo) -> Result<()> {
    let rank = k.rank();
    let path = std::env::var("KOLO_TIMELINE")?.replace("{rank}", &rank.to_string());
    // Small tensors (fused when they become ready in the same cycle, which depends on
    // timing: rank 0 submits late so that the others' are all waiting), a large one
    // (in place), and an allgather.
    if rank == 0 {
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let hs = (0..6)
        .map(|i| {
            Ok(
                k.allreduce(format!("tl.small.{i}"), Tensor::zeros(DType::F32, &[8]))
                    .op(ReduceOp::Sum)
                    .submit()?,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    for h in hs {
        h.wait()?;
    }
    k.allreduce("tl.big", Tensor::zeros(DType::F64, &[100_000]))
        .wait()?;
    k.allgather("tl.gather", Tensor::zeros(DType::I32, &[2, 3]))
        .wait()?;
    // Both ends of a send have a span: blocking (run on the calling thread while the
    // engine is idle) and submitted (through the engine's queue).
    match rank {
        0 => {
            k.send("tl.p2p", Tensor::zeros(DType::U8, &[4]), 1).wait()?;
            k.send("tl.p2p.async", Tensor::zeros(DType::U8, &[4]), 1)
                .submit()?
                .wait()?;
        }
        1 => {
            k.recv("tl.p2p", 0).wait()?;
            k.recv("tl.p2p.async", 0).submit()?.wait()?;
        }
        _ => {}
    }
    // The engine is still running: the file must already be a complete trace.
    let spans = check_format(&events(&path)?, rank)?;
    let has = |track: &str, phase: &str| spans.iter().any(|(t, p)| t == track && p == phase);
    ensure!(
        has("tl.big", "NEGOTIATE") && has("tl.big", "ALLREDUCE"),
        "tl.big spans: {spans:?}"
    );
    ensure!(
        has("tl.gather", "ALLGATHER"),
        "allgather span missing: {spans:?}"
    );
    let phase = if rank == 0 { "SEND" } else { "RECV" };
    for track in ["tl.p2p", "tl.p2p.async"] {
        ensure!(
            rank > 1 || has(track, phase),
            "no {phase} span for {track}: {spans:?}"
        );
    }
    let fused = (0..6)
        .filter(|i| has(&format!("tl.small.{i}"), "MEMCPY_IN_FUSION_BUFFER"))
        .count();
    let fused_all = k.allgather_object("tl.fused", fused)?;
    // Every rank runs the same batches; at least the tensors rank 0 submitted while
    // its first cycle ran are fused.
    ensure!(
        fused_all.iter().all(|&f| f == fused && f >= 2),
        "fused spans per rank: {fused_all:?}: {spans:?}"
    );
    for i in 0..6 {
        ensure!(
            has(&format!("tl.small.{i}"), "ALLREDUCE"),
            "tl.small.{i} has no ALLREDUCE span"
        );
    }
    ensure!(
        events(&path)?.iter().any(|e| e["name"] == "CYCLE_START"),
        "no CYCLE_START marks"
    );

    // Switching files at run time through the API.
    let second = format!("{path}.second");
    k.start_timeline(&second)?;
    k.allreduce("tl.after", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    k.stop_timeline()?;
    k.allreduce("tl.untraced", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    let spans = check_format(&events(&second)?, rank)?;
    ensure!(
        spans
            .iter()
            .any(|(t, p)| t == "tl.after" && p == "ALLREDUCE"),
        "second file: {spans:?}"
    );
    ensure!(
        !spans
            .iter()
            .any(|(t, _)| t == "tl.untraced" || t == "tl.big"),
        "second file holds other ops: {spans:?}"
    );
    let bad = k.start_timeline("/nonexistent-dir/x.json");
    ensure!(
        bad.is_err_and(|e| e.to_string().contains("cannot write the timeline")),
        "bad path accepted"
    );
    std::fs::remove_file(&path)?;
    std::fs::remove_file(&second)?;
    Ok(())
}
