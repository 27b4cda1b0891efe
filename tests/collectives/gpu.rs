//! CUDA tensors (feature `nccl`). Every GPU case runs each op twice — on a CPU tensor
//! over MPI and on a CUDA copy of it over NCCL — and compares: the CPU path is the
//! reference the rest of this suite already checks against exact expectations.
//!
//! The GPU cases need a CUDA GPU per rank and are ignored unless run with
//! `KOLO_TEST_GPU=1 cargo test --release --features nccl --test collectives -- gpu_`
//! (README "GPU"); the no-GPU case runs in CI.

use anyhow::{ensure, Context, Result};
use kolo::{DType, Device, Error, Kolo, ReduceOp, Tensor};

use crate::util::{assert_close, expect_err, tensor, to_f64, values, Rng, DTYPES};

/// Without a CUDA driver (CI): CUDA entry points fail with a clear error, never a
/// panic, and CPU collectives keep working.
pub(crate) fn nodriver(k: &Kolo) -> Result<()> {
    ensure!(kolo::build_info().nccl, "built without the nccl feature");
    let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
    ensure!(t.device() == Device::Cpu);
    let msg = expect_err("to_cuda", t.clone().to_cuda(0).map_err(Error::from), &[])?;
    ensure!(
        msg == "CUDA is not available: CUDA driver library not found (libcuda.so); install the NVIDIA driver or use CPU tensors",
        "to_cuda error: {msg}"
    );
    expect_err(
        "cuda_device_count",
        kolo::cuda_device_count(),
        &["CUDA driver library not found"],
    )?;
    expect_err(
        "cuda_device",
        k.cuda_device(),
        &["CUDA driver library not found"],
    )?;
    expect_err(
        "into_cuda of a CPU tensor",
        t.clone().into_cuda::<f32>().map_err(Error::from),
        &["Tensor::into_cuda: the tensor is on cpu, but this needs a tensor on cuda:0"],
    )?;
    // Issue 31 item 6: a refused device conversion hands the tensor back, unchanged.
    let back = match t.clone().to_cuda(0) {
        Ok(_) => anyhow::bail!("to_cuda without a driver succeeded"),
        Err(e) => e.into_inner(),
    };
    ensure!(back == t, "to_cuda handed back {back:?}");
    let back = match t.clone().into_cuda::<f32>() {
        Ok(_) => anyhow::bail!("into_cuda of a CPU tensor succeeded"),
        Err(e) => e.into_inner(),
    };
    ensure!(back == t, "into_cuda handed back {back:?}");
    // A CPU tensor passes through to_cpu untouched.
    ensure!(t.clone().to_cpu()? == t);
    let sum = k
        .allreduce("no_gpu.after", t)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f32>()?;
    let n = k.size() as f32;
    ensure!(
        sum == [n, 2.0 * n],
        "allreduce after CUDA errors gave {sum:?}"
    );
    Ok(())
}

fn gpu(t: &Tensor, k: &Kolo) -> Result<Tensor> {
    let g = t.clone().to_cuda(k.cuda_device()?)?;
    ensure!(
        g.device().is_cuda(),
        "to_cuda gave a tensor on {}",
        g.device()
    );
    Ok(g)
}

/// Brings a result back and compares it with the CPU path's.
fn same(what: &str, cpu: &Tensor, cuda: Tensor) -> Result<()> {
    ensure!(
        cuda.device().is_cuda(),
        "{what}: result is on {}",
        cuda.device()
    );
    let host = cuda.to_cpu()?;
    ensure!(
        host.shape() == cpu.shape() && host.dtype() == cpu.dtype(),
        "{what}: {:?} {:?} vs CPU {:?} {:?}",
        host.dtype(),
        host.shape(),
        cpu.dtype(),
        cpu.shape()
    );
    assert_close(what, cpu.dtype(), &to_f64(&host)?, &to_f64(cpu)?)
}

/// Allreduce of every dtype and op, with and without scale factors, on CPU and GPU.
pub(crate) fn allreduce(k: &Kolo) -> Result<()> {
    let size = k.size();
    let mut rng = Rng::new(7 + k.rank() as u64);
    let ops = [
        (ReduceOp::Sum, 1.0, 1.0),
        (ReduceOp::Average, 1.0, 1.0),
        (ReduceOp::Sum, 0.5, 3.0),
        (ReduceOp::Average, 2.0, 0.25),
        (ReduceOp::Min, 1.0, 1.0),
        (ReduceOp::Max, 1.0, 1.0),
        (ReduceOp::Max, 2.0, 1.0),
        (ReduceOp::Product, 1.0, 1.0),
    ];
    for dtype in DTYPES {
        for (i, &(op, pre, post)) in ops.iter().enumerate() {
            let v = if op == ReduceOp::Product {
                (0..33).map(|j| ((j % 3) as f64) - 1.0).collect()
            } else {
                values(dtype, 33 * 5, size, &mut rng)
            };
            let shape = if op == ReduceOp::Product {
                vec![33]
            } else {
                vec![33, 5]
            };
            let t = tensor(dtype, &v, &shape)?;
            let name = format!("ar.{dtype:?}.{i}");
            let cpu = k
                .allreduce(format!("{name}.cpu"), t.clone())
                .op(op)
                .prescale(pre)
                .postscale(post)
                .wait()?;
            let cuda = k
                .allreduce(format!("{name}.gpu"), gpu(&t, k)?)
                .op(op)
                .prescale(pre)
                .postscale(post)
                .wait()
                .with_context(|| format!("{name} on the GPU"))?;
            same(&format!("{name} {op:?} pre {pre} post {post}"), &cpu, cuda)?;
        }
    }
    // A large tensor (not fused) and an empty one.
    let big: Vec<f64> = (0..(4 << 20)).map(|i| (i % 1000) as f64).collect();
    let t = tensor(DType::F32, &big, &[4 << 20])?;
    let cpu = k.allreduce("ar.big.cpu", t.clone()).wait()?;
    same(
        "16 MiB average",
        &cpu,
        k.allreduce("ar.big.gpu", gpu(&t, k)?).wait()?,
    )?;
    let e = Tensor::zeros(DType::F32, &[0, 3]);
    let out = k.allreduce("ar.empty", gpu(&e, k)?).wait()?;
    ensure!(out.shape() == [0, 3] && out.device().is_cuda());
    Ok(())
}

/// Many small async allreduces (fused on the device), grouped allreduce.
pub(crate) fn fused_and_grouped(k: &Kolo) -> Result<()> {
    let size = k.size();
    let mut rng = Rng::new(11 + k.rank() as u64);
    let mut inputs = Vec::new();
    for i in 0..64 {
        let dtype = if i % 3 == 0 { DType::F16 } else { DType::F32 };
        let n = 1 + (i * 37) % 500;
        inputs.push(tensor(dtype, &values(dtype, n, size, &mut rng), &[n])?);
    }
    let mut handles = Vec::new();
    for (i, t) in inputs.iter().enumerate() {
        handles.push(
            k.allreduce(format!("fz.{i}"), gpu(t, k)?)
                .op(ReduceOp::Sum)
                .submit()?,
        );
    }
    let mut cpu = Vec::new();
    for (i, t) in inputs.iter().enumerate() {
        cpu.push(
            k.allreduce(format!("fz.cpu.{i}"), t.clone())
                .op(ReduceOp::Sum)
                .submit()?,
        );
    }
    for (i, (h, c)) in handles.into_iter().zip(cpu).enumerate() {
        same(&format!("fused {i}"), &c.wait()?, h.wait()?)?;
    }
    let group: Vec<(String, Tensor)> = inputs
        .iter()
        .take(6)
        .enumerate()
        .map(|(i, t)| Ok((format!("grp.{i}"), gpu(t, k)?)))
        .collect::<Result<_>>()?;
    let cpu_group: Vec<(String, Tensor)> = inputs
        .iter()
        .take(6)
        .enumerate()
        .map(|(i, t)| (format!("grp.cpu.{i}"), t.clone()))
        .collect();
    let outs = k.grouped_allreduce(group).wait()?;
    let want = k.grouped_allreduce(cpu_group).wait()?;
    ensure!(outs.len() == want.len());
    for (i, (o, w)) in outs.into_iter().zip(&want).enumerate() {
        same(&format!("grouped {i}"), w, o)?;
    }
    Ok(())
}

/// Allgather (uneven dim 0), broadcast from every root, alltoall with splits,
/// reducescatter (uneven).
pub(crate) fn others(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let mut rng = Rng::new(23 + rank as u64);
    for dtype in [DType::F32, DType::I64, DType::BF16, DType::U8] {
        let rows = rank + 2;
        let t = tensor(dtype, &values(dtype, rows * 3, size, &mut rng), &[rows, 3])?;
        let cpu = k.allgather(format!("ag.{dtype:?}.cpu"), t.clone()).wait()?;
        same(
            "allgather",
            &cpu,
            k.allgather(format!("ag.{dtype:?}"), gpu(&t, k)?).wait()?,
        )?;
        for root in 0..size {
            // Broadcast needs the same shape everywhere.
            let t = tensor(dtype, &values(dtype, 12, size, &mut rng), &[4, 3])?;
            let want = k
                .broadcast(format!("bc2.{dtype:?}.{root}.cpu"), t.clone(), root)
                .wait()?;
            let got = k
                .broadcast(format!("bc2.{dtype:?}.{root}"), gpu(&t, k)?, root)
                .wait()?;
            same("broadcast", &want, got)?;
        }
        let splits: Vec<usize> = (0..size).map(|r| r + 1).collect();
        let n: usize = splits.iter().sum();
        let t = tensor(dtype, &values(dtype, n * 2, size, &mut rng), &[n, 2])?;
        let want = k
            .alltoall(format!("a2a.{dtype:?}.cpu"), t.clone())
            .splits(splits.clone())
            .wait()?;
        let got = k
            .alltoall(format!("a2a.{dtype:?}"), gpu(&t, k)?)
            .splits(splits)
            .wait()?;
        ensure!(got.received_splits == want.received_splits);
        same("alltoall", &want.tensor, got.tensor)?;
        let d0 = 2 * size + 1;
        let t = tensor(dtype, &values(dtype, d0 * 2, size, &mut rng), &[d0, 2])?;
        for op in [ReduceOp::Sum, ReduceOp::Average] {
            let want = k
                .reducescatter(format!("rs.{dtype:?}.{op:?}.cpu"), t.clone())
                .op(op)
                .wait()?;
            let got = k
                .reducescatter(format!("rs.{dtype:?}.{op:?}"), gpu(&t, k)?)
                .op(op)
                .wait()?;
            same("reducescatter", &want, got)?;
        }
    }
    Ok(())
}

/// Device errors: mixed devices in one op, host access to a CUDA tensor, a device
/// that does not exist; round trips through `from_cuda` / `into_cuda`.
pub(crate) fn errors(k: &Kolo) -> Result<()> {
    let dev = k.cuda_device()?;
    let cpu = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?;
    let cuda = cpu.clone().to_cuda(dev)?;
    expect_err(
        "mixed group",
        k.grouped_allreduce(vec![
            ("m.a".into(), cpu.clone()),
            ("m.b".into(), cuda.clone()),
        ])
        .submit(),
        &[
            "all tensors of one op must be on the same device",
            "\"m.a\" is on cpu",
            &format!("\"m.b\" on cuda:{dev}"),
        ],
    )?;
    expect_err(
        "as_slice on CUDA",
        cuda.as_slice::<f32>(),
        &[&format!(
            "Tensor::as_slice: the tensor is on cuda:{dev}, but this needs a tensor on cpu"
        )],
    )?;
    expect_err("as_bytes on CUDA", cuda.as_bytes(), &["Tensor::as_bytes"])?;
    expect_err(
        "into_cuda wrong dtype",
        cuda.clone().into_cuda::<f64>().map_err(Error::from),
        &["F32"],
    )?;
    let n = kolo::cuda_device_count()?;
    expect_err(
        "missing device",
        cpu.clone().to_cuda(n + 3).map_err(Error::from),
        &[&format!("no CUDA device cuda:{}", n + 3)],
    )?;
    // from_cuda / into_cuda keep the allocation; a shape that does not fit is refused.
    let slice = cuda.into_cuda::<f32>()?;
    ensure!(slice.len() == 3);
    let back = Tensor::from_cuda(slice, &[3])?;
    ensure!(back.clone().to_cpu()?.into_vec::<f32>()? == [1.0, 2.0, 3.0]);
    let slice = back.into_cuda::<f32>()?;
    expect_err(
        "from_cuda shape",
        Tensor::from_cuda(slice, &[4]),
        &["needs 4 elements but 3"],
    )?;
    Ok(())
}

/// Send and receive of CUDA tensors (np 2; two ranks may share one GPU: no NCCL
/// communicator is made). Rank 0 sends every dtype, an empty tensor and a 16 MiB one
/// from its device, blocking and submitted; each arrives on rank 1's device
/// (`cuda_device`) with the values sent. A CPU tensor sent back arrives on the CPU.
pub(crate) fn p2p_device(k: &Kolo) -> Result<()> {
    let mut cases: Vec<(String, Tensor)> = Vec::new();
    let mut rng = Rng::new(31);
    for dtype in DTYPES {
        let v = values(dtype, 3 * 7, 2, &mut rng);
        cases.push((format!("p2p.{dtype:?}"), tensor(dtype, &v, &[3, 7])?));
    }
    cases.push(("p2p.empty".into(), tensor(DType::F32, &[], &[0, 4])?));
    let big: Vec<f64> = (0..(4 << 20)).map(|i| (i % 977) as f64).collect();
    cases.push(("p2p.16MiB".into(), tensor(DType::F32, &big, &[4 << 20])?));
    let device = Device::Cuda(k.cuda_device()?);
    match k.rank() {
        0 => {
            for (i, (name, t)) in cases.iter().enumerate() {
                let g = gpu(t, k)?;
                if i % 2 == 0 {
                    k.send(name.clone(), g, 1).wait()?;
                } else {
                    k.send(name.clone(), g, 1).submit()?.wait()?;
                }
            }
            let back = k.recv("p2p.back", 1).wait()?;
            ensure!(
                back.device() == Device::Cpu,
                "a CPU tensor came back on {}",
                back.device()
            );
            ensure!(
                back.into_vec::<f32>()? == [1.0, 2.0],
                "the CPU tensor sent back changed"
            );
        }
        1 => {
            for (i, (name, t)) in cases.iter().enumerate() {
                let got = if i % 2 == 0 {
                    k.recv(name.clone(), 0).submit()?.wait()?
                } else {
                    k.recv(name.clone(), 0).wait()?
                };
                ensure!(
                    got.device() == device,
                    "{name} arrived on {}, not {device}",
                    got.device()
                );
                let host = got.to_cpu()?;
                ensure!(
                    host.dtype() == t.dtype() && host.shape() == t.shape(),
                    "{name}: {:?} {:?}, sent {:?} {:?}",
                    host.dtype(),
                    host.shape(),
                    t.dtype(),
                    t.shape()
                );
                ensure!(
                    to_f64(&host)? == to_f64(t)?,
                    "{name}: the values changed on the way"
                );
            }
            k.send("p2p.back", Tensor::from_vec(vec![1.0f32, 2.0], &[2])?, 0)
                .wait()?;
        }
        _ => {}
    }
    Ok(())
}
