//! Gradients between Burn tensors and kolo tensors, without copying where Burn's
//! buffer allows it.
//!
//! Burn's CPU backend hands a uniquely owned gradient out of `into_data` without a
//! copy. Its bytes are lent to kolo as a [`HostBuffer`] (Burn allocates them 16-byte
//! aligned, so a `Vec` of the element type could not take them over): kolo reduces
//! them in place and the same bytes become the new gradient tensor. Only a buffer that
//! is not exactly the tensor's size or not aligned for its dtype is copied, once, on
//! the way in.

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{Bytes, DType, Device, Tensor, TensorData};
use half::{bf16, f16};
use kolo::HostBuffer;

use crate::error::{Error, Result};

/// Bytes the conversions had to copy (diagnostics: [`crate::GradientReducer::copied_bytes`]).
#[derive(Debug, Default)]
pub(crate) struct Copied(AtomicU64);

impl Copied {
    fn add(&self, bytes: usize) {
        self.0.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The element types a gradient may have (f32, f64, f16, bf16): each travels as
/// itself, so f16 and bf16 take 2 bytes on the wire and f64 stays f64.
fn unsupported(name: &str, dtype: DType) -> Error {
    Error::Data {
        name: name.to_string(),
        message: format!("gradients of dtype {dtype:?} cannot be reduced (float dtypes only)"),
    }
}

/// A Burn tensor's buffer lent to kolo: reduced in place, then the new gradient.
struct BurnBytes(Bytes);

impl HostBuffer for BurnBytes {
    fn bytes(&self) -> &[u8] {
        &self.0
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// kolo's element type for a float gradient.
fn kolo_dtype(name: &str, dtype: DType) -> Result<kolo::DType> {
    Ok(match dtype {
        // Burn's flexible f32 is stored as f32 on the host.
        DType::F32 | DType::Flex32 => kolo::DType::F32,
        DType::F64 => kolo::DType::F64,
        DType::F16 => kolo::DType::F16,
        DType::BF16 => kolo::DType::BF16,
        other => return Err(unsupported(name, other)),
    })
}

/// `grad` as a kolo tensor of the same shape and element type, in `grad`'s own
/// memory when Burn hands it over (a uniquely owned CPU tensor), else copied once.
pub(crate) fn to_kolo<const D: usize>(
    name: &str,
    grad: Tensor<D>,
    copied: &Copied,
) -> Result<kolo::Tensor> {
    let dims = grad.dims();
    let dtype = kolo_dtype(name, grad.dtype())?;
    let (bytes, _, _) = grad.into_data().into_parts();
    let exact = bytes.len() == dims.iter().product::<usize>() * dtype.size_of();
    let aligned = (bytes.as_ptr() as usize).is_multiple_of(dtype.size_of());
    if exact && aligned {
        return Ok(kolo::Tensor::from_host_buffer(
            BurnBytes(bytes),
            dtype,
            &dims,
        )?);
    }
    copied.add(bytes.len());
    use bytemuck::pod_collect_to_vec as copy;
    let t = match dtype {
        kolo::DType::F64 => kolo::Tensor::from_vec(copy::<u8, f64>(&bytes), &dims),
        kolo::DType::F16 => kolo::Tensor::from_vec(copy::<u8, f16>(&bytes), &dims),
        kolo::DType::BF16 => kolo::Tensor::from_vec(copy::<u8, bf16>(&bytes), &dims),
        _ => kolo::Tensor::from_vec(copy::<u8, f32>(&bytes), &dims),
    };
    Ok(t?)
}

/// Zeros standing in for a gradient this rank does not have.
pub(crate) fn zeros(name: &str, dtype: DType, dims: &[usize]) -> Result<kolo::Tensor> {
    Ok(kolo::Tensor::zeros(kolo_dtype(name, dtype)?, dims))
}

/// A reduced kolo tensor as a Burn tensor of `dtype` on `device`, in the same memory.
pub(crate) fn to_burn<const D: usize>(
    name: &str,
    t: kolo::Tensor,
    dtype: DType,
    device: &Device,
) -> Result<Tensor<D>> {
    let shape = t.shape().to_vec();
    let data = match t.into_host_buffer::<BurnBytes>() {
        Ok(b) => TensorData::from_bytes(b.0, shape, dtype),
        Err(t) => {
            let data = match t.dtype() {
                kolo::DType::F32 => TensorData::new(t.into_vec::<f32>()?, shape),
                kolo::DType::F64 => TensorData::new(t.into_vec::<f64>()?, shape),
                kolo::DType::F16 => TensorData::new(t.into_vec::<f16>()?, shape),
                kolo::DType::BF16 => TensorData::new(t.into_vec::<bf16>()?, shape),
                other => {
                    return Err(Error::Data {
                        name: name.to_string(),
                        message: format!("a reduced gradient came back as {other}"),
                    })
                }
            };
            if data.dtype() == dtype {
                data
            } else {
                data.convert_dtype(dtype)
            }
        }
    };
    Ok(Tensor::from_data(data, device))
}
