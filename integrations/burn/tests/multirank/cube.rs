//! kolo-burn on Burn's CubeCL backend (features `cpu` and `cuda`, issue 32): the
//! backend-extension route that lends a gradient's own device memory to kolo.
//!
//! On every machine (feature `cpu`): the route on Burn's CubeCL CPU runtime, where
//! kolo's MPI host path stands in for NCCL, against the Flex path; the digits example
//! with `--device cpu`; and, without a CUDA driver, `--device cuda` failing with one
//! line naming the rank. On a GPU machine (`KOLO_TEST_GPU=1`, feature `cuda`): the same
//! equivalence on `Device::cuda`, reduced by NCCL.

use std::time::Duration;

use anyhow::{ensure, Result};
use burn::module::Module;
use burn::optim::SgdConfig;
use burn::tensor::{Device, FloatDType};
use kolo::Kolo;
use kolo_burn::{broadcast_parameters, Backend, GradientReducer};

use super::{grads_for, params, Small};

/// Each rank's batch of 6; 20 SGD steps on the Cube device and, in the same process,
/// on Flex through the same reducer (the host path): after those steps the weights
/// agree to `units` units of the precision (relative, over all weights — the two
/// backends' kernels round differently), and the Cube route copied no gradient. At
/// np 1 the reduction is the identity, so the route must also give bit for bit the
/// weights of plain Burn on the same device (no reducer): the cross-backend bound
/// cannot hide a wrong reduction there.
fn cube_equivalence(
    k: &Kolo,
    backend: Backend,
    dtype: FloatDType,
    mantissa: i32,
    units: f32,
) -> Result<()> {
    let rank = k.rank();
    let size = k.size();
    let mut flex = Device::flex();
    flex.configure(dtype)
        .map_err(|e| anyhow::anyhow!("configuring the flex device for {dtype:?}: {e:?}"))?;
    let flex = flex.autodiff();
    flex.seed(29);
    let mut cube = backend.device(k)?;
    cube.configure(dtype)
        .map_err(|e| anyhow::anyhow!("configuring the {backend:?} device for {dtype:?}: {e:?}"))?;
    let cube = cube.autodiff();
    let start = broadcast_parameters(k, Small::new(&flex), 0)?;
    let (mut on_flex, mut on_cube) = (start.clone(), start.clone().fork(&cube));
    let want = burn::tensor::DType::from(dtype);
    ensure!(
        on_cube.fc1.weight.val().dtype() == want,
        "the model on {backend:?} is {:?}, not {want:?}",
        on_cube.fc1.weight.val().dtype()
    );
    let flex_reducer = GradientReducer::new(k).prefix("flex");
    let cube_reducer = GradientReducer::new(k).prefix("cube");
    let (mut sgd_flex, mut sgd_cube) = (SgdConfig::new().init(), SgdConfig::new().init());
    // At np 1 only: plain Burn on the same device, no reducer.
    let mut plain = (size == 1).then(|| (start.clone().fork(&cube), SgdConfig::new().init()));
    let b = 6;
    for step in 0..20 {
        let ids = step * b * size + rank * b..step * b * size + (rank + 1) * b;
        let g = flex_reducer.reduce(&on_flex, grads_for(&on_flex, ids.clone(), &flex))?;
        on_flex = sgd_flex.step(0.05, on_flex, g);
        if let Some((on_plain, mut sgd_plain)) = plain.take() {
            let g = grads_for(&on_plain, ids.clone(), &cube);
            plain = Some((sgd_plain.step(0.05, on_plain, g), sgd_plain));
        }
        let g = cube_reducer.reduce(&on_cube, grads_for(&on_cube, ids, &cube))?;
        on_cube = sgd_cube.step(0.05, on_cube, g);
    }
    ensure!(
        cube_reducer.copied_bytes() == 0,
        "the Cube route copied {} bytes of gradients",
        cube_reducer.copied_bytes()
    );
    let (got, want, before) = (params(&on_cube), params(&on_flex), params(&start));
    ensure!(got != before, "training changed nothing");
    if let Some((on_plain, _)) = &plain {
        let plain = params(on_plain);
        ensure!(
            got.len() == plain.len()
                && got.iter().zip(&plain).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{backend:?} {dtype:?} np1: the reduced weights are not plain Burn's on the same device"
        );
    }
    let what = format!("20 steps on {backend:?}");
    let relative = agreed_relative_diff(k, "cube.weights", &what, &got, &want)?;
    let bound = units * 2f32.powi(-mantissa);
    if rank == 0 {
        println!("CUBE {backend:?} {dtype:?} np{size} relative {relative:e} (bound {bound:e})");
    }
    ensure!(
        relative < bound,
        "{backend:?} {dtype:?}: {relative:e} relative difference from the Flex path (bound {bound:e})"
    );
    Ok(())
}

/// Checks that every rank holds the same weights `got` (allgathered under `name`) and
/// returns their relative distance from `want`, ‖got − want‖ / ‖want‖.
fn agreed_relative_diff(
    k: &Kolo,
    name: &str,
    what: &str,
    got: &[f32],
    want: &[f32],
) -> Result<f32> {
    let all: Vec<Vec<u32>> =
        k.allgather_object(name, got.iter().map(|x| x.to_bits()).collect::<Vec<_>>())?;
    ensure!(
        all.iter().all(|w| *w == all[0]),
        "the ranks' weights differ after {what}"
    );
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let diff: Vec<f32> = got.iter().zip(want).map(|(a, b)| a - b).collect();
    Ok(norm(&diff) / norm(want))
}

/// f32 on the CPU runtime: within 1e-5 relative of the Flex path.
pub(crate) fn cpu_f32(k: &Kolo) -> Result<()> {
    cube_equivalence(k, Backend::Cpu, FloatDType::F32, 17, 1.0)
}

/// f16 on the CPU runtime (2 bytes on the wire): within 4 units of f16. (The CPU
/// runtime has no bf16: burn-cpu 0.22.1 leaves it out, LLVM's dialect has no bfloat
/// type to compute with; bf16 runs on CUDA, below.)
pub(crate) fn cpu_f16(k: &Kolo) -> Result<()> {
    cube_equivalence(k, Backend::Cpu, FloatDType::F16, 10, 4.0)
}

/// f32 on CUDA, reduced by NCCL: within 8 × 2⁻¹⁷ relative of the Flex path. CubeCL's
/// CUDA matmul sums in another order than Flex's CPU kernels: on an H200 the two
/// backends ended 2.1e-5 apart after the 20 steps (np 1, where the reduction is the
/// identity and the weights equal plain Burn's on CUDA bit for bit).
pub(crate) fn gpu_cuda_f32(k: &Kolo) -> Result<()> {
    cube_equivalence(k, Backend::Cuda, FloatDType::F32, 17, 8.0)
}

/// bf16 on CUDA, reduced by NCCL in 2 bytes: within 4 units of bf16.
pub(crate) fn gpu_cuda_bf16(k: &Kolo) -> Result<()> {
    cube_equivalence(k, Backend::Cuda, FloatDType::BF16, 7, 4.0)
}

/// f16 on CUDA, reduced by NCCL in 2 bytes: within 4 units of f16.
pub(crate) fn gpu_cuda_f16(k: &Kolo) -> Result<()> {
    cube_equivalence(k, Backend::Cuda, FloatDType::F16, 10, 4.0)
}

/// The sharded optimizer on the Cube device (gradients lent, through the host for the
/// grouped collectives) against the same on Flex: 20 SGD+momentum steps, within
/// `units` × 2⁻¹⁷ relative; every rank ends with the same weights.
fn cube_sharded(k: &Kolo, backend: Backend, units: f32) -> Result<()> {
    use burn::optim::momentum::MomentumConfig;
    use kolo_burn::ShardedOptimizer;
    let (rank, size) = (k.rank(), k.size());
    let flex = Device::flex().autodiff();
    flex.seed(31);
    let cube = backend.device(k)?.autodiff();
    let start = broadcast_parameters(k, Small::new(&flex), 0)?;
    let (mut on_flex, mut on_cube) = (start.clone(), start.clone().fork(&cube));
    let sgd = || {
        SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new()))
            .init()
    };
    let mut sharded_flex = ShardedOptimizer::new(k, sgd());
    let mut sharded_cube = ShardedOptimizer::new(k, sgd());
    let b = 6;
    for step in 0..20 {
        let ids = step * b * size + rank * b..step * b * size + (rank + 1) * b;
        let g = grads_for(&on_flex, ids.clone(), &flex);
        on_flex = sharded_flex.step(0.05, on_flex, g)?;
        let g = grads_for(&on_cube, ids, &cube);
        on_cube = sharded_cube.step(0.05, on_cube, g)?;
    }
    let (got, want, before) = (params(&on_cube), params(&on_flex), params(&start));
    ensure!(
        got != before,
        "sharded training on {backend:?} changed nothing"
    );
    let what = format!("20 sharded steps on {backend:?}");
    let relative = agreed_relative_diff(k, "cube.sharded", &what, &got, &want)?;
    let bound = units * 2f32.powi(-17);
    ensure!(
        relative < bound,
        "sharded on {backend:?}: {relative:e} relative difference from Flex (bound {bound:e})"
    );
    Ok(())
}

/// The sharded optimizer on the CPU runtime: within 1e-5 relative of Flex.
pub(crate) fn cpu_sharded(k: &Kolo) -> Result<()> {
    cube_sharded(k, Backend::Cpu, 1.0)
}

/// The sharded optimizer on CUDA (the grouped collectives through the host): within
/// 32 × 2⁻¹⁷ relative of Flex. Momentum carries each step's cross-backend rounding
/// into every later step: on an H200 the two ended 1.28e-4 apart at np 1 (plain SGD,
/// `gpu_cuda_f32`: 2.1e-5), where the reduce-scatter is the identity.
pub(crate) fn gpu_cuda_sharded(k: &Kolo) -> Result<()> {
    cube_sharded(k, Backend::Cuda, 32.0)
}

/// `kolorun -np 1 train_digits --device cuda` on a machine without the CUDA driver:
/// a non-zero exit and one line naming the rank and the missing driver, no panic and
/// no backtrace.
pub(crate) fn nodriver_cuda_digits() -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let release = exe
        .parent()
        .and_then(|d| d.parent())
        .ok_or("no target directory")?
        .to_path_buf();
    let (kolorun, example) = (
        release.join("kolorun"),
        release.join("examples/train_digits"),
    );
    for p in [&kolorun, &example] {
        if !p.exists() {
            return Err(format!(
                "{} is missing: run scripts/build-cuda.sh after the README's test command",
                p.display()
            ));
        }
    }
    let mut cmd = std::process::Command::new(&kolorun);
    cmd.args(["-np", "1"])
        .arg(&example)
        .args(["--device", "cuda"]);
    cmd.env("RAYON_NUM_THREADS", "1").env("RUST_BACKTRACE", "1");
    let out = run_with_timeout(cmd, Duration::from_secs(120))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // mpirun adds its own banner about the non-zero exit; the program's lines are
    // those that mention CUDA.
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("CUDA")).collect();
    let want = "rank 0: cannot use device cuda: CUDA driver library not found (libcuda.so)";
    let good = !out.status.success()
        && lines.len() == 1
        && lines[0].contains(want)
        && !text.contains("panicked")
        && !text.to_lowercase().contains("backtrace");
    if good {
        Ok(())
    } else {
        Err(format!(
            "want a failure with one line containing {want:?}, got {} with:\n{text}",
            out.status
        ))
    }
}

fn run_with_timeout(
    mut cmd: std::process::Command,
    timeout: Duration,
) -> Result<std::process::Output, String> {
    use std::process::Stdio;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start kolorun: {e}"))?;
    let id = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(out) => out.map_err(|e| e.to_string()),
        Err(_) => {
            // SAFETY: signalling the kolorun process this test started.
            unsafe { libc::kill(id as i32, libc::SIGKILL) };
            Err(format!("kolorun did not finish within {timeout:?}"))
        }
    }
}

/// Whether the CUDA driver library is missing here (the no-driver test's premise).
pub(crate) fn driver_missing() -> bool {
    matches!(
        kolo::cuda_device_count(),
        Err(e) if e.to_string().contains("CUDA driver library not found")
    )
}

/// `Small` with each layer a fully sharded unit.
#[derive(Module, Debug)]
struct SmallUnits {
    fc1: kolo_burn::FullyShard<burn::nn::Linear>,
    fc2: kolo_burn::FullyShard<burn::nn::Linear>,
}

impl SmallUnits {
    fn new(k: &Kolo, m: &Small, offload: bool) -> kolo_burn::Result<Self> {
        let unit = |l: &burn::nn::Linear| -> kolo_burn::Result<_> {
            let u = kolo_burn::FullyShard::new(k, l.clone())?;
            Ok(if offload {
                u.offload(&Device::flex())
            } else {
                u
            })
        };
        Ok(SmallUnits {
            fc1: unit(&m.fc1)?,
            fc2: unit(&m.fc2)?,
        })
    }

    fn step_grads(
        &self,
        ids: std::ops::Range<usize>,
        device: &Device,
    ) -> burn::optim::GradientsParams {
        let (x, y) = super::samples(ids, device);
        let h = burn::tensor::activation::relu(self.fc1.forward(x, |l, x| l.forward(x)));
        let out = self.fc2.forward(h, |l, x| l.forward(x));
        let loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(device)
            .forward(out, y);
        burn::optim::GradientsParams::from_grads(loss.backward(), self)
    }
}

/// Issue 55 item 4, offload: units made on the CubeCL CPU runtime with their blocks
/// (and so Adam's state and step) offloaded to Burn's CPU backend train as the same
/// units kept on the runtime, within 1e-5; the blocks are on the host device.
pub(crate) fn cpu_fsdp_offload(k: &Kolo) -> Result<()> {
    use burn::optim::AdamConfig;
    let (rank, size) = (k.rank(), k.size());
    let flex = Device::flex().autodiff();
    flex.seed(59);
    let cube = Backend::Cpu.device(k)?.autodiff();
    let start = broadcast_parameters(k, Small::new(&flex), 0)?.fork(&cube);
    let mut off = SmallUnits::new(k, &start, true)?;
    let mut on = SmallUnits::new(k, &start, false)?;
    let devices = off.devices();
    ensure!(
        devices.iter().all(|d| *d == flex),
        "offloaded blocks on {devices:?}, not {flex:?}"
    );
    let (mut oa, mut ob) = (AdamConfig::new().init(), AdamConfig::new().init());
    for step in 0..5 {
        let ids = (step * size + rank) * 4..(step * size + rank + 1) * 4;
        let g = off.step_grads(ids.clone(), &cube);
        off = oa.step(0.01, off, g);
        let g = on.step_grads(ids, &cube);
        on = ob.step(0.01, on, g);
    }
    let whole = |u: &SmallUnits| -> kolo_burn::Result<Vec<f32>> {
        let mut v = params(&u.fc1.gathered()?);
        v.extend(params(&u.fc2.gathered()?));
        Ok(v)
    };
    super::assert_close("offloaded units", &whole(&off)?, &whole(&on)?, 1e-5)
}
