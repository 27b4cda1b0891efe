//! kolo's GPU path against raw NCCL on the same device buffers, in the same run
//! (feature `nccl`, one GPU per rank):
//!
//! ```text
//! cargo bench --features nccl --bench kolo_vs_nccl -- --np 1
//! ```
//!
//! Raw NCCL is cudarc's `Comm` on its own communicator (the id travels with
//! `broadcast_object`), each call followed by a stream synchronise, the way a training
//! loop that needs the result would use it. kolo's side is submit + wait. Without a
//! GPU (e.g. `cargo test --all-targets --features nccl`) it says so and exits 0.

mod common;

#[path = "../tests/collectives/harness.rs"]
#[allow(dead_code)]
mod harness;

use std::sync::Arc;
use std::time::Instant;

use kolo::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use kolo::cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};
use kolo::{Kolo, ReduceOp, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn p99(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * 0.99).round() as usize]
}

/// Times `f` `reps` times after `warmup` runs, every rank starting together.
fn time(
    k: &Kolo,
    reps: usize,
    warmup: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        k.barrier()?;
        let t = Instant::now();
        f()?;
        out.push(t.elapsed().as_secs_f64());
    }
    Ok(out)
}

struct Gpu {
    stream: Arc<CudaStream>,
    comm: Comm,
}

impl Gpu {
    fn new(k: &Kolo) -> anyhow::Result<Gpu> {
        let ctx = CudaContext::new(k.cuda_device()?)?;
        let stream = ctx.new_stream()?;
        let id = if k.rank() == 0 {
            Id::new()
                .map_err(|e| anyhow::anyhow!("ncclGetUniqueId: {e:?}"))?
                .internal()
                .map(|c| c as u8)
                .to_vec()
        } else {
            Vec::new()
        };
        let id: Vec<u8> = k.broadcast_object("bench.nccl_id", id, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(id) {
            *d = s as std::ffi::c_char;
        }
        let comm = Comm::from_rank(stream.clone(), k.rank(), k.size(), Id::uninit(internal))
            .map_err(|e| anyhow::anyhow!("ncclCommInitRank: {e:?}"))?;
        Ok(Gpu { stream, comm })
    }

    fn buffers(&self, sizes: &[usize]) -> anyhow::Result<Vec<CudaSlice<f32>>> {
        sizes
            .iter()
            .map(|&n| Ok(self.stream.clone_htod(&vec![1.0f32; n])?))
            .collect()
    }

    fn raw(&self, bufs: &mut [CudaSlice<f32>]) -> anyhow::Result<()> {
        for b in bufs.iter_mut() {
            self.comm
                .all_reduce_in_place(b, &NcclOp::Sum)
                .map_err(|e| anyhow::anyhow!("ncclAllReduce: {e:?}"))?;
        }
        self.stream.synchronize()?;
        Ok(())
    }
}

/// kolo: submit every buffer, then wait for all; the buffers come back for the next run.
fn kolo_run(k: &Kolo, prefix: &str, bufs: &mut Vec<CudaSlice<f32>>) -> anyhow::Result<()> {
    let mut handles = Vec::with_capacity(bufs.len());
    for (i, b) in bufs.drain(..).enumerate() {
        let n = b.len();
        let t = Tensor::from_cuda(b, &[n])?;
        handles.push(
            k.allreduce(format!("{prefix}.{i}"), t)
                .op(ReduceOp::Sum)
                .submit()?,
        );
    }
    for h in handles {
        bufs.push(h.wait()?.into_cuda::<f32>()?);
    }
    Ok(())
}

fn bench(k: &Kolo, quick: bool) -> anyhow::Result<Vec<(String, f64, f64)>> {
    let gpu = Gpu::new(k)?;
    let reps = if quick { 5 } else { 21 };
    let mut rows = Vec::new();
    let mut scenario =
        |name: String, sizes: Vec<usize>, reps: usize| -> anyhow::Result<(f64, f64)> {
            // kolo's side allocates through kolo (`to_cuda`), as a program whose tensors
            // come from kolo would; the raw side uses cudarc's own context and stream.
            let dev = k.cuda_device()?;
            let mut kb = sizes
                .iter()
                .map(|&n| {
                    Ok(Tensor::from_vec(vec![1.0f32; n], &[n])?
                        .to_cuda(dev)?
                        .into_cuda::<f32>()?)
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let mut rb = gpu.buffers(&sizes)?;
            let prefix = format!("b{}", rows.len());
            let kolo = time(k, reps, 3, || kolo_run(k, &prefix, &mut kb))?;
            let raw = time(k, reps, 3, || gpu.raw(&mut rb))?;
            let (km, rm) = (median(kolo.clone()), median(raw.clone()));
            if name.starts_with("(1)") {
                rows.push((format!("{name} p50"), km, rm));
                rows.push((format!("{name} p99"), p99(kolo), p99(raw)));
            } else {
                rows.push((name, km, rm));
            }
            Ok((km, rm))
        };
    scenario(
        "(1) 4-byte allreduce latency".into(),
        vec![1],
        if quick { 50 } else { 500 },
    )?;
    scenario("(2) 1000 x 256 floats, async".into(), vec![256; 1000], reps)?;
    let mut resnet = common::resnet50_sizes();
    resnet.reverse();
    scenario(
        "(3) ResNet-50 set, 161 tensors, reverse order".into(),
        resnet,
        reps,
    )?;
    scenario("(4) one 64 MiB tensor".into(), vec![16 << 20], reps)?;
    Ok(rows)
}

fn worker(quick: bool) -> anyhow::Result<()> {
    let k = kolo::init()?;
    let rows = bench(&k, quick)?;
    if k.rank() == 0 {
        println!(
            "\nkolo (NCCL) vs raw NCCL, np={}, medians (rank 0's clock)",
            k.size()
        );
        println!(
            "{:<52} {:>11} {:>11} {:>7}",
            "scenario", "kolo", "raw", "ratio"
        );
        for (s, kolo, raw) in &rows {
            println!(
                "{s:<52} {:>11} {:>11} {:>7.2}",
                common::fmt_time(*kolo),
                common::fmt_time(*raw),
                kolo / raw
            );
        }
    }
    k.shutdown()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--quick");
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        return worker(quick);
    }
    match kolo::cuda_device_count() {
        Ok(n) if n > 0 => {}
        other => {
            println!("kolo_vs_nccl: no GPU here ({other:?}); nothing to measure");
            return Ok(());
        }
    }
    let np = args
        .iter()
        .position(|a| a == "--np")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "1".into());
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args(["-np", &np, "--bind-to", "none"])
        .arg(std::env::current_exe()?);
    harness::mpi_env(&mut cmd);
    if quick {
        cmd.arg("--quick");
    }
    let status = cmd.status()?;
    anyhow::ensure!(status.success(), "mpirun -np {np} failed: {status}");
    Ok(())
}
