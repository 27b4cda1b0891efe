//! kolo against raw MPI, on the same data, in the same run.
//!
//! `cargo bench --bench kolo_vs_mpi` launches itself under `mpirun -np 2` and then
//! `-np 4` (`-- --np 2` for one size; `-- --quick` for fewer repetitions; `-- --only 3`
//! for one scenario; `KOLO_BENCH_REPS=N` for N timed repetitions of each), prints a
//! table of medians with kolo/raw ratios and writes the same to
//! `target/kolo-bench-np<N>.json`. `scripts/run-bench.sh` sets OpenMPI up first.
//!
//! Each repetition runs kolo and every raw baseline once in turn (interleaved), so that
//! both see the same machine load. The raw side calls MPI directly on MPI_COMM_WORLD
//! (kolo uses its own duplicate of it), in place where the scenario says so. Inputs are
//! prepared outside the timed region on both sides: what is timed is submission,
//! negotiation, fusion and the collectives.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use kolo::{Kolo, ReduceOp, Tensor};

// The tests' mpirun launcher; the benchmark uses only its environment defaults.
mod common;

#[path = "../tests/collectives/harness.rs"]
#[allow(dead_code)]
mod harness;
use mpi::ffi;

extern "C" {
    // From kolo's C shim: the real MPI_IN_PLACE of the linked MPI.
    fn kolo_mpi_in_place() -> *mut c_void;
}

fn world() -> ffi::MPI_Comm {
    // SAFETY: reading MPI's constant world communicator handle after MPI_Init.
    unsafe { ffi::RSMPI_COMM_WORLD }
}

fn raw_barrier() {
    // SAFETY: a plain barrier on MPI_COMM_WORLD; kolo never uses that communicator.
    unsafe { ffi::MPI_Barrier(world()) };
}

/// MPI_Allgather of f32s: `out` holds `send.len()` elements per rank.
fn raw_allgather(send: &[f32], out: &mut [f32]) {
    // SAFETY: `send` and `out` are valid for the counts passed.
    unsafe {
        ffi::MPI_Allgather(
            send.as_ptr().cast(),
            send.len() as i32,
            ffi::RSMPI_FLOAT,
            out.as_mut_ptr().cast(),
            send.len() as i32,
            ffi::RSMPI_FLOAT,
            world(),
        );
    }
}

/// MPI_Allreduce(SUM) of f32s, in place or out of place.
fn raw_allreduce(buf: &mut [f32], in_place: bool, scratch: &mut Vec<f32>) {
    // SAFETY: buffers are valid for `buf.len()` f32s for the duration of the call.
    unsafe {
        if in_place {
            ffi::MPI_Allreduce(
                kolo_mpi_in_place(),
                buf.as_mut_ptr().cast(),
                buf.len() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                world(),
            );
        } else {
            scratch.resize(buf.len(), 0.0);
            ffi::MPI_Allreduce(
                buf.as_ptr().cast(),
                scratch.as_mut_ptr().cast(),
                buf.len() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                world(),
            );
            buf.copy_from_slice(scratch);
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// One way of running a scenario (kolo, or a raw MPI baseline): an untimed setup
/// that prepares the data the run consumes, so that neither side is charged for
/// copying its inputs, then the timed run, every rank starting together.
type Way<'a> = Box<dyn FnMut() -> f64 + 'a>;

fn way<'a, T>(mut setup: impl FnMut() -> T + 'a, mut run: impl FnMut(T) + 'a) -> Way<'a> {
    Box::new(move || {
        let input = setup();
        raw_barrier();
        let t = Instant::now();
        run(input);
        t.elapsed().as_secs_f64()
    })
}

/// Runs every way `warmup` times untimed, then `reps` rounds in which each way runs
/// once in turn, and returns each way's times. Alternating kolo with raw MPI, rather
/// than timing one in a block and then the other, exposes both to the same machine
/// load: on this shared machine the load drifts within seconds.
fn interleaved(reps: usize, warmup: usize, mut ways: Vec<Way<'_>>) -> Vec<Vec<f64>> {
    for w in &mut ways {
        for _ in 0..warmup {
            w();
        }
    }
    let mut times = vec![Vec::with_capacity(reps); ways.len()];
    for _ in 0..reps {
        for (w, t) in ways.iter_mut().zip(&mut times) {
            t.push(w());
        }
    }
    times
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

struct Row {
    scenario: String,
    kolo: f64,
    raw: f64,
    raw_label: &'static str,
}

fn bench(k: &Kolo, quick: bool, only: Option<u32>) -> anyhow::Result<Vec<Row>> {
    let reps = std::env::var("KOLO_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 5 } else { 15 });
    let run = |n: u32| only.is_none_or(|o| o == n);
    let mut rows = Vec::new();

    // 1. Latency of one 4-byte allreduce.
    if run(1) {
        let n_lat = if quick { 200 } else { 2000 };
        let kolo_way = way(
            || Tensor::from_vec(vec![1.0f32], &[1]).expect("tensor"),
            |t| {
                k.allreduce("lat", t)
                    .op(ReduceOp::Sum)
                    .wait()
                    .expect("allreduce");
            },
        );
        let raw_way = way(
            || [1.0f32],
            |mut x| raw_allreduce(&mut x, true, &mut Vec::new()),
        );
        let [mut kolo_lat, mut raw_lat]: [Vec<f64>; 2] =
            interleaved(n_lat, 50, vec![kolo_way, raw_way])
                .try_into()
                .expect("two ways");
        for (p, label) in [(0.5, "p50"), (0.99, "p99")] {
            rows.push(Row {
                scenario: format!("1. 4-byte allreduce latency {label}"),
                kolo: percentile(&mut kolo_lat, p),
                raw: percentile(&mut raw_lat, p),
                raw_label: "MPI_Allreduce in place",
            });
        }
    }

    // 2. 1000 tensors of 256 floats submitted async, then waited. Inputs are built
    // outside the timed region on both sides.
    if run(2) {
        let data: Vec<Vec<f32>> = (0..1000).map(|i| vec![i as f32; 256]).collect();
        let tensors = || {
            data.iter()
                .map(|d| Tensor::from_vec(d.clone(), &[d.len()]).expect("tensor"))
                .collect::<Vec<_>>()
        };
        let kolo_way = way(tensors, |ts| {
            let hs: Vec<_> = ts
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    k.allreduce(format!("many.{i}"), t)
                        .op(ReduceOp::Sum)
                        .submit()
                        .expect("submit")
                })
                .collect();
            hs.into_iter().for_each(|h| drop(h.wait().expect("wait")));
        });
        let raw_way = way(
            || data.clone(),
            |mut d| {
                for d in &mut d {
                    raw_allreduce(d, true, &mut Vec::new());
                }
            },
        );
        // The same tensors as one grouped allreduce: one submit, one handle, one
        // negotiation entry; how far batching the submits alone gets. Names are made
        // in the timed region, as in the per-tensor way.
        let group_way = way(tensors, |ts| {
            let named = ts
                .into_iter()
                .enumerate()
                .map(|(i, t)| (format!("many.{i}"), t))
                .collect();
            let outs = k.grouped_allreduce(named).op(ReduceOp::Sum).wait();
            drop(outs.expect("grouped allreduce"));
        });
        let [mut kolo_many, mut raw_many, mut grouped]: [Vec<f64>; 3] =
            interleaved(reps, 2, vec![kolo_way, raw_way, group_way])
                .try_into()
                .expect("three ways");
        let raw = median(&mut raw_many);
        rows.push(Row {
            scenario: "2. 1000 x 256 f32, async".into(),
            kolo: median(&mut kolo_many),
            raw,
            raw_label: "per-tensor loop in place",
        });
        rows.push(Row {
            scenario: "2b. the same as one grouped_allreduce".into(),
            kolo: median(&mut grouped),
            raw,
            raw_label: "per-tensor loop in place",
        });
    }

    // 3. The ResNet-50 gradient set, in reverse (backward) order.
    if run(3) {
        let sizes = common::resnet50_sizes();
        let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.5f32; n]).collect();
        let tensors = || {
            grads
                .iter()
                .map(|g| Tensor::from_vec(g.clone(), &[g.len()]).expect("tensor"))
                .collect::<Vec<_>>()
        };
        let kolo_way = way(tensors, |ts| {
            let hs: Vec<_> = ts
                .into_iter()
                .enumerate()
                .rev()
                .map(|(i, t)| {
                    k.allreduce(format!("rn50.{i}"), t)
                        .op(ReduceOp::Sum)
                        .submit()
                        .expect("submit")
                })
                .collect();
            hs.into_iter().for_each(|h| drop(h.wait().expect("wait")));
        });
        let per_tensor = |in_place: bool| {
            let mut scratch = Vec::new();
            way(
                || grads.clone(),
                move |mut gs: Vec<Vec<f32>>| {
                    for g in gs.iter_mut().rev() {
                        raw_allreduce(g, in_place, &mut scratch);
                    }
                },
            )
        };
        let total: usize = sizes.iter().sum();
        let mut packed = vec![0.5f32; total];
        let packed_way = way(
            || (),
            |()| raw_allreduce(&mut packed, true, &mut Vec::new()),
        );
        let [mut kolo_rn, mut raw_in, mut raw_out, mut raw_packed]: [Vec<f64>; 4] = interleaved(
            reps,
            2,
            vec![kolo_way, per_tensor(true), per_tensor(false), packed_way],
        )
        .try_into()
        .expect("four ways");
        let kolo_rn = median(&mut kolo_rn);
        for (label, raw) in [
            ("per-tensor loop in place", median(&mut raw_in)),
            ("per-tensor loop out of place", median(&mut raw_out)),
            ("one pre-packed allreduce in place", median(&mut raw_packed)),
        ] {
            rows.push(Row {
                scenario: format!(
                    "3. ResNet-50 set ({} tensors, {:.2} M floats)",
                    sizes.len(),
                    total as f64 / 1e6
                ),
                kolo: kolo_rn,
                raw,
                raw_label: label,
            });
        }
    }

    // 4. One 64 MiB tensor.
    if run(4) {
        let big = vec![0.25f32; 16 << 20];
        let kolo_way = way(
            || Tensor::from_vec(big.clone(), &[big.len()]).expect("tensor"),
            |t| {
                k.allreduce("big", t)
                    .op(ReduceOp::Sum)
                    .wait()
                    .expect("allreduce");
            },
        );
        let raw_way = |in_place: bool| {
            let mut scratch = Vec::new();
            way(
                || big.clone(),
                move |mut b: Vec<f32>| raw_allreduce(&mut b, in_place, &mut scratch),
            )
        };
        let [mut kolo_big, mut raw_in, mut raw_out]: [Vec<f64>; 3] =
            interleaved(reps, 1, vec![kolo_way, raw_way(true), raw_way(false)])
                .try_into()
                .expect("three ways");
        let kolo_big = median(&mut kolo_big);
        for (raw, label) in [
            (&mut raw_in, "MPI_Allreduce in place"),
            (&mut raw_out, "MPI_Allreduce out of place"),
        ] {
            rows.push(Row {
                scenario: "4. one 64 MiB f32 tensor".into(),
                kolo: kolo_big,
                raw: median(raw),
                raw_label: label,
            });
        }
    }

    // 6. 1000 small allgathers (64 f32 per rank each) submitted async, then waited;
    // kolo fuses them into a few MPI_Allgatherv calls. Inputs built outside the timing.
    if run(6) {
        let size = k.size();
        let data: Vec<Vec<f32>> = (0..1000).map(|i| vec![i as f32; 64]).collect();
        let tensors = || {
            data.iter()
                .map(|d| Tensor::from_vec(d.clone(), &[1, d.len()]).expect("tensor"))
                .collect::<Vec<_>>()
        };
        let kolo_way = way(tensors, |ts| {
            let hs: Vec<_> = ts
                .into_iter()
                .enumerate()
                .map(|(i, t)| k.allgather(format!("ag.{i}"), t).submit().expect("submit"))
                .collect();
            hs.into_iter().for_each(|h| drop(h.wait().expect("wait")));
        });
        let mut out = vec![0f32; 64 * size];
        let raw_way = way(
            || (),
            |()| {
                for d in &data {
                    raw_allgather(d, &mut out);
                }
            },
        );
        let [mut kolo_ag, mut raw_ag]: [Vec<f64>; 2] =
            interleaved(reps, 2, vec![kolo_way, raw_way])
                .try_into()
                .expect("two ways");
        rows.push(Row {
            scenario: "6. 1000 x 64 f32 allgather, async".into(),
            kolo: median(&mut kolo_ag),
            raw: median(&mut raw_ag),
            raw_label: "per-tensor MPI_Allgather loop",
        });
    }

    // 5. Engine CPU: idle, and waiting for a rank that sleeps 2 s.
    if run(5) {
        let idle = if quick { 2.0 } else { 10.0 };
        raw_barrier();
        let c0 = cpu_seconds();
        std::thread::sleep(Duration::from_secs_f64(idle));
        let idle_cpu = (cpu_seconds() - c0) / idle;
        raw_barrier();
        let c0 = cpu_seconds();
        let t0 = Instant::now();
        if k.rank() == 1 {
            std::thread::sleep(Duration::from_secs(2));
        }
        k.allreduce("late", Tensor::from_vec(vec![1.0f32], &[1])?)
            .wait()?;
        let wait_cpu = (cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
        rows.push(Row {
            scenario: format!("5. process CPU while idle {idle:.0} s (fraction of a core)"),
            kolo: idle_cpu,
            raw: 0.0,
            raw_label: "-",
        });
        rows.push(Row {
            scenario: "5. rank 0 CPU while waiting 2 s for rank 1 (fraction of a core)".into(),
            kolo: wait_cpu,
            raw: 0.0,
            raw_label: "-",
        });
    }
    Ok(rows)
}

/// `KOLO_BENCH_RESNET=<reps>`: only the ResNet-50 set, under whatever KOLO_* settings
/// the environment gives (`scripts/run-tuning-grid.sh` runs it per grid point). With
/// KOLO_AUTOTUNE=1 it first runs steps until the tuner has finished (at most 300 s).
/// Prints `RESNET_MS <median step>` on rank 0.
fn resnet_worker(reps: usize) -> anyhow::Result<()> {
    let k = kolo::init()?;
    let grads: Vec<Vec<f32>> = common::resnet50_sizes()
        .iter()
        .map(|&n| vec![0.5f32; n])
        .collect();
    let step = |k: &Kolo| -> anyhow::Result<()> {
        let mut hs = Vec::with_capacity(grads.len());
        for (i, g) in grads.iter().enumerate().rev() {
            let t = Tensor::from_vec(g.clone(), &[g.len()])?;
            hs.push(
                k.allreduce(format!("rn50.{i}"), t)
                    .op(ReduceOp::Sum)
                    .submit()?,
            );
        }
        for h in hs {
            h.wait()?;
        }
        Ok(())
    };
    let deadline = Instant::now() + std::time::Duration::from_secs(300);
    let mut tuning_steps = 0;
    while k.autotune_state().enabled {
        step(&k)?;
        tuning_steps += 1;
        let done = k.broadcast_object("tuned", k.autotune_state().finished, 0)?;
        if done || Instant::now() > deadline {
            break;
        }
    }
    let mut times = Vec::with_capacity(reps);
    for i in 0..reps + 3 {
        raw_barrier();
        let t = Instant::now();
        step(&k)?;
        if i >= 3 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    if k.rank() == 0 {
        let s = k.autotune_state();
        println!(
            "RESNET_MS {:.3} tuning_steps {tuning_steps} threshold {} cycle_us {} cache {}",
            median(&mut times) * 1e3,
            s.fusion_threshold,
            s.cycle_time.as_micros(),
            s.cache_enabled
        );
    }
    k.shutdown()?;
    Ok(())
}

fn worker(quick: bool, only: Option<u32>) -> anyhow::Result<()> {
    let k = kolo::init()?;
    let rows = bench(&k, quick, only)?;
    if k.rank() == 0 {
        let np = k.size();
        println!("\nkolo vs raw MPI, np={np}, medians (rank 0's clock)");
        println!(
            "{:<62} {:>11} {:>11} {:>7}  raw MPI baseline",
            "scenario", "kolo", "raw", "ratio"
        );
        let mut json = Vec::new();
        for r in &rows {
            let cpu = r.raw_label == "-";
            let (kolo, raw, ratio) = if cpu {
                (format!("{:.4}", r.kolo), "-".to_string(), "-".to_string())
            } else {
                (
                    common::fmt_time(r.kolo),
                    common::fmt_time(r.raw),
                    format!("{:.2}", r.kolo / r.raw),
                )
            };
            println!(
                "{:<62} {kolo:>11} {raw:>11} {ratio:>7}  {}",
                r.scenario, r.raw_label
            );
            json.push(format!(
                "  {{\"scenario\": {:?}, \"kolo\": {}, \"raw\": {}, \"raw_baseline\": {:?}, \"ratio\": {}}}",
                r.scenario,
                r.kolo,
                r.raw,
                r.raw_label,
                if cpu { "null".to_string() } else { format!("{}", r.kolo / r.raw) }
            ));
        }
        let path = format!(
            "{}/kolo-bench-np{np}.json",
            env!("CARGO_TARGET_TMPDIR").trim_end_matches("/tmp")
        );
        std::fs::write(&path, format!("[\n{}\n]\n", json.join(",\n")))?;
        println!("written to {path}");
    }
    k.shutdown()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this binary without
    // it: then only a short smoke run checks that the benchmark still works.
    let smoke =
        !args.iter().any(|a| a == "--bench") && std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none();
    let quick = smoke || args.iter().any(|a| a == "--quick");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .or(if smoke { Some(1) } else { None });
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        if let Some(reps) = std::env::var("KOLO_BENCH_RESNET")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            return resnet_worker(reps);
        }
        return worker(quick, only);
    }
    let nps: Vec<String> = match args.iter().position(|a| a == "--np") {
        Some(i) => vec![args.get(i + 1).cloned().unwrap_or_else(|| "2".into())],
        None if smoke => vec!["2".into()],
        None => vec!["2".into(), "4".into()],
    };
    let exe = std::env::current_exe()?;
    for np in nps {
        let mut cmd = std::process::Command::new("mpirun");
        cmd.args(["-np", &np, "--bind-to", "none"]).arg(&exe);
        // The same defaults as the tests' launcher, so that a bare `cargo bench` works.
        harness::mpi_env(&mut cmd);
        if quick {
            cmd.arg("--quick");
        }
        if let Some(o) = only {
            cmd.args(["--only", &o.to_string()]);
        }
        let status = cmd.status()?;
        anyhow::ensure!(status.success(), "mpirun -np {np} failed: {status}");
    }
    Ok(())
}
