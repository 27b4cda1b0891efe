//! Choosing a Burn device for a rank, with the checks that turn a missing CUDA driver
//! into an error naming the rank instead of a panic inside Burn's device thread.

use burn::tensor::Device;
use kolo::Kolo;

use crate::error::{Error, Result};

/// The Burn backends kolo-burn trains on, as a program's `--device` flag names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// Burn's Flex CPU backend (`Device::flex()`): gradients lent to kolo's MPI path
    /// without a copy. Always built.
    Flex,
    /// Burn's CubeCL CPU runtime (`Device::cpu()`, feature `cpu`): the same route as
    /// [`Backend::Cuda`], with kolo's MPI host path in place of NCCL.
    Cpu,
    /// Burn's CUDA backend (`Device::cuda(i)`, feature `cuda`): gradients reduced on
    /// the GPU by kolo's NCCL path.
    Cuda,
}

impl std::str::FromStr for Backend {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "flex" => Ok(Backend::Flex),
            "cpu" => Ok(Backend::Cpu),
            "cuda" => Ok(Backend::Cuda),
            other => Err(format!("unknown device {other:?}: use flex, cpu or cuda")),
        }
    }
}

impl Backend {
    /// The name Burn's `BURN_DEVICE` takes for this backend. Burn builds an optimizer's
    /// loaded state on its default device (moved on the next step), which in a build
    /// with the `cuda` feature is CUDA: a program on `Backend::Flex` or `Backend::Cpu`
    /// there that resumes a checkpoint, or whose `ShardedOptimizer` consolidates its
    /// state, panics without the CUDA driver. Setting `BURN_DEVICE` to this name first
    /// (at the top of `main`, before any thread starts) keeps it on this backend.
    pub fn burn_device_name(self) -> &'static str {
        match self {
            Backend::Flex => "flex",
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }

    /// The device of `self` for this rank: Flex and the CPU runtime as they are; CUDA
    /// device `local_rank % GPUs` (one GPU per rank on a host), after checking that
    /// the CUDA driver is installed and sees a GPU.
    ///
    /// # Errors
    /// [`Error::Device`] naming the rank and what to install: the CUDA driver missing
    /// or seeing no GPU, or kolo-burn built without the `cuda` / `cpu` feature
    /// (`scripts/build-cuda.sh` builds both).
    pub fn device(self, kolo: &Kolo) -> Result<Device> {
        match self {
            Backend::Flex => Ok(Device::flex()),
            Backend::Cpu => cpu_device(kolo),
            Backend::Cuda => cuda_device(kolo, None),
        }
    }
}

#[cfg(feature = "cpu")]
fn cpu_device(_kolo: &Kolo) -> Result<Device> {
    Ok(Device::cpu())
}

#[cfg(not(feature = "cpu"))]
fn cpu_device(kolo: &Kolo) -> Result<Device> {
    Err(Error::Device {
        rank: kolo.rank(),
        device: "cpu".into(),
        message: "kolo-burn was built without its `cpu` feature (Burn's CubeCL CPU runtime); \
                  build with scripts/build-cuda.sh"
            .into(),
    })
}

/// CUDA device `index` for this rank (`None`: `local_rank % GPUs`), after checking
/// that the driver is there. Call it instead of `Device::cuda(i)`: without a driver,
/// Burn's CUDA runtime panics on its device thread ("Unable to dynamically load the
/// cuda shared library"), and the job ends with a backtrace instead of a reason.
///
/// # Errors
/// [`Error::Device`] naming the rank: no CUDA driver library (install the NVIDIA
/// driver), no GPU seen by it, no GPU `index`, or kolo-burn built without its `cuda`
/// feature.
pub fn cuda_device(kolo: &Kolo, index: Option<usize>) -> Result<Device> {
    let fail = |device: String, message: String| Error::Device {
        rank: kolo.rank(),
        device,
        message,
    };
    let named = index.map_or("cuda".to_string(), |i| format!("cuda:{i}"));
    if !cfg!(feature = "cuda") {
        return Err(fail(
            named,
            "kolo-burn was built without its `cuda` feature; build with scripts/build-cuda.sh"
                .into(),
        ));
    }
    let n = match kolo::cuda_device_count() {
        Ok(0) => Err("the CUDA driver sees no GPU".to_string()),
        Ok(n) => Ok(n),
        Err(kolo::Error::CudaUnavailable(m)) => Err(m),
        Err(e) => Err(e.to_string()),
    }
    .map_err(|m| fail(named.clone(), m))?;
    let i = index.unwrap_or(kolo.local_rank() % n);
    if i >= n {
        return Err(fail(
            named,
            format!("this machine has {n} GPU(s): cuda:0..cuda:{}", n - 1),
        ));
    }
    Ok(cuda(i))
}

#[cfg(feature = "cuda")]
fn cuda(i: usize) -> Device {
    Device::cuda(i)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_i: usize) -> Device {
    unreachable!("cuda_device returns before this without the `cuda` feature")
}
