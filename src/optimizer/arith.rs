//! The gradient arithmetic of the distributed optimizer: local accumulation over
//! backward passes, zeros for a missing gradient, and wire compression.

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

pub(crate) fn compress(t: Tensor, c: Compression) -> Result<Tensor> {
    let wire = c.wire_dtype(t.dtype());
    if wire == t.dtype() {
        return Ok(t);
    }
    let shape = t.shape().to_vec();
    let wide: Vec<f64> = match t.dtype() {
        DType::F32 => t.as_slice::<f32>()?.iter().map(|&x| f64::from(x)).collect(),
        _ => t.into_vec::<f64>()?,
    };
    match wire {
        DType::F16 => Tensor::from_vec(
            wide.iter().map(|&x| half::f16::from_f64(x)).collect(),
            &shape,
        ),
        _ => Tensor::from_vec(
            wide.iter().map(|&x| half::bf16::from_f64(x)).collect(),
            &shape,
        ),
    }
}

pub(crate) fn decompress(t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t);
    }
    let shape = t.shape().to_vec();
    let wide: Vec<f64> = match t.dtype() {
        DType::F16 => t
            .as_slice::<half::f16>()?
            .iter()
            .map(|x| x.to_f64())
            .collect(),
        DType::BF16 => t
            .as_slice::<half::bf16>()?
            .iter()
            .map(|x| x.to_f64())
            .collect(),
        other => {
            return Err(Error::Internal(format!(
                "cannot restore {dtype} from {other}"
            )))
        }
    };
    match dtype {
        DType::F32 => Tensor::from_vec(wide.iter().map(|&x| x as f32).collect(), &shape),
        _ => Tensor::from_vec(wide, &shape),
    }
}
