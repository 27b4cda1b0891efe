//! The gradient arithmetic of the distributed optimizer: local accumulation over
//! backward passes and zeros for a missing gradient (the wire casts are
//! `crate::compression`'s).

use super::*;

/// Why `g` cannot be summed locally over a window of backward passes, if it cannot.
pub(super) fn accumulable(g: &Tensor) -> std::result::Result<(), String> {
    match (g.dtype(), g.device()) {
        (DType::F32 | DType::F64, Device::Cpu) => Ok(()),
        (dtype, device) => Err(format!(
            "backward_passes_per_step > 1 sums gradients locally, which supports f32 and \
             f64 gradients on the CPU, not {dtype} on {device}; use one pass per step or \
             accumulate in the framework"
        )),
    }
}

/// Zeros of `dtype` and `shape` on `device`.
pub(super) fn zeros_on(dtype: DType, shape: &[usize], device: Device) -> Result<Tensor> {
    let zeros = Tensor::try_zeros(dtype, shape)?;
    match device {
        Device::Cpu => Ok(zeros),
        #[cfg(feature = "nccl")]
        Device::Cuda(ordinal) => Ok(zeros.to_cuda(ordinal)?),
        #[cfg(not(feature = "nccl"))]
        Device::Cuda(_) => Err(Error::CudaUnavailable(
            "kolo was built without the \"nccl\" feature".into(),
        )),
    }
}

/// Adds `g` into `sum` (f32 or f64).
pub(super) fn add_into(sum: &mut Tensor, g: &Tensor) -> std::result::Result<(), String> {
    match sum.dtype() {
        DType::F32 => {
            let g = g.as_slice::<f32>().map_err(|e| e.to_string())?;
            let s = sum.as_mut_slice::<f32>().map_err(|e| e.to_string())?;
            s.iter_mut().zip(g).for_each(|(s, g)| *s += g);
        }
        DType::F64 => {
            let g = g.as_slice::<f64>().map_err(|e| e.to_string())?;
            let s = sum.as_mut_slice::<f64>().map_err(|e| e.to_string())?;
            s.iter_mut().zip(g).for_each(|(s, g)| *s += g);
        }
        other => {
            return Err(format!(
                "local accumulation supports f32 and f64 gradients, not {other}"
            ))
        }
    }
    Ok(())
}
