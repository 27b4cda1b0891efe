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

use burn::tensor::{Bytes, DType, Device, Tensor, TensorCreationOptions, TensorData};
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
pub(crate) fn kolo_dtype(name: &str, dtype: DType) -> Result<kolo::DType> {
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
    // Burn's CubeCL backend (CUDA, CPU runtime): the tensor's own device memory.
    #[cfg(any(feature = "cuda", feature = "cpu"))]
    let grad = if crate::cube::route(&grad.device()) == crate::cube::Route::Host {
        grad
    } else {
        match crate::cube::lend(name, grad, dtype) {
            Ok(lent) => return lent,
            // A buffer that cannot be lent: copied to the host.
            Err(grad) => {
                copied.add(dims.iter().product::<usize>() * dtype.size_of());
                grad
            }
        }
    };
    let (bytes, _, _) = grad.into_data().into_parts();
    from_bytes(name, bytes, dtype, &dims, copied)
}

/// `t` in host memory, where kolo's grouped allgather and reducescatter run (they
/// take no CUDA members yet): a CUDA tensor is copied there, a host one kept as it is.
///
/// A CUDA tensor lent out of a Burn gradient ([`to_kolo`]) is handed back to Burn
/// first and read through Burn: dropping it as a kolo tensor would free memory that
/// Burn's allocator owns (the driver refuses, or worse, frees a live pool page).
pub(crate) fn on_host(t: kolo::Tensor) -> Result<kolo::Tensor> {
    #[cfg(feature = "cuda")]
    let t = if t.device().is_cuda() {
        let dims = t.shape().to_vec();
        let dtype = t.dtype();
        match crate::cube::reclaim_flat(t) {
            Ok(lent) => {
                let (bytes, _, _) = lent.into_data().into_parts();
                return from_bytes(
                    "a lent CUDA gradient",
                    bytes,
                    dtype,
                    &dims,
                    &Copied::default(),
                );
            }
            Err(t) => t.to_cpu().map_err(kolo::Error::from)?,
        }
    } else {
        t
    };
    Ok(t)
}

/// `t` as a kolo tensor in host memory, whatever its device: what send/recv carry
/// (kolo's point to point takes host tensors; a CUDA tensor is copied to the host).
pub(crate) fn to_kolo_host<const D: usize>(
    name: &str,
    t: Tensor<D>,
    copied: &Copied,
) -> Result<kolo::Tensor> {
    let dims = t.dims();
    let dtype = kolo_dtype(name, t.dtype())?;
    let (bytes, _, _) = t.into_data().into_parts();
    from_bytes(name, bytes, dtype, &dims, copied)
}

/// A gradient's bytes as a kolo tensor: lent as they are when they are exactly the
/// tensor's size and aligned for its element type, else the tensor's bytes (the
/// buffer's first `elements × size` bytes) copied once and counted in `copied`.
fn from_bytes(
    name: &str,
    bytes: Bytes,
    dtype: kolo::DType,
    dims: &[usize],
    copied: &Copied,
) -> Result<kolo::Tensor> {
    let len = dims
        .iter()
        .try_fold(dtype.size_of(), |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::Data {
            name: name.to_string(),
            message: format!("shape {dims:?} of {dtype} holds more bytes than memory can"),
        })?;
    if bytes.len() < len {
        return Err(Error::Data {
            name: name.to_string(),
            message: format!(
                "its buffer holds {} bytes, but shape {dims:?} of {dtype} needs {len}",
                bytes.len()
            ),
        });
    }
    let aligned = (bytes.as_ptr() as usize).is_multiple_of(dtype.size_of());
    if bytes.len() == len && aligned {
        return Ok(kolo::Tensor::from_host_buffer(
            BurnBytes(bytes),
            dtype,
            dims,
        )?);
    }
    copied.add(len);
    let data = &bytes[..len];
    use bytemuck::pod_collect_to_vec as copy;
    let t = match dtype {
        kolo::DType::F64 => kolo::Tensor::from_vec(copy::<u8, f64>(data), dims),
        kolo::DType::F16 => kolo::Tensor::from_vec(copy::<u8, f16>(data), dims),
        kolo::DType::BF16 => kolo::Tensor::from_vec(copy::<u8, bf16>(data), dims),
        _ => kolo::Tensor::from_vec(copy::<u8, f32>(data), dims),
    };
    Ok(t?)
}

/// A reduced kolo tensor as a Burn tensor of `dtype` on `device`, in the same memory.
pub(crate) fn to_burn<const D: usize>(
    name: &str,
    t: kolo::Tensor,
    dtype: DType,
    device: &Device,
) -> Result<Tensor<D>> {
    #[cfg(any(feature = "cuda", feature = "cpu"))]
    let t = match crate::cube::reclaim::<D>(t) {
        Ok(g) => return Ok(g),
        Err(t) => t,
    };
    // A CUDA tensor kolo-burn did not lend: through the host.
    #[cfg(feature = "cuda")]
    let t = t.to_cpu().map_err(kolo::Error::from)?;
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
    // In `dtype` itself, not the device's default float type (a parameter may differ
    // from it: an f64 one on an f32 device, f32 statistics beside f16 layers).
    let options = TensorCreationOptions::new(device.clone()).with_dtype(dtype);
    Ok(Tensor::from_data(data, options))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Bytes, DType, Device, Tensor, TensorData};

    use super::{from_bytes, to_kolo, Copied};

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_ne_bytes()).collect()
    }

    /// A buffer longer than the tensor (as a backend may hand out, with the tensor at
    /// its start) is copied: the tensor's bytes, counted; issue 31, item 4.
    #[test]
    fn issue31_an_oversized_buffer_is_copied() {
        let copied = Copied::default();
        let bytes = Bytes::from_bytes_vec(f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0]));
        let t = from_bytes("w", bytes, kolo::DType::F32, &[2, 2], &copied);
        let t = t.map_err(|e| e.to_string());
        let t = t.and_then(|t| t.into_vec::<f32>().map_err(|e| e.to_string()));
        assert_eq!(t, Ok(vec![1.0, 2.0, 3.0, 4.0]));
        assert_eq!(copied.get(), 16);
    }

    /// A buffer shorter than the tensor is refused, naming the gradient and both sizes.
    #[test]
    fn a_short_buffer_is_refused() {
        let copied = Copied::default();
        let bytes = Bytes::from_bytes_vec(f32_bytes(&[1.0, 2.0, 3.0]));
        let err = from_bytes("fc1.weight", bytes, kolo::DType::F32, &[2, 2], &copied)
            .map(|_| ())
            .map_err(|e| e.to_string());
        assert_eq!(
            err,
            Err(
                "reading gradient \"fc1.weight\": its buffer holds 12 bytes, but shape \
                 [2, 2] of f32 needs 16"
                    .into()
            )
        );
        assert_eq!(copied.get(), 0);
    }

    /// A gradient whose bytes are a misaligned window of a shared buffer (a real Burn
    /// tensor: `Bytes::view` of a shared allocation, as memory-mapped records are) is
    /// copied; a uniquely owned gradient is lent without a copy.
    #[test]
    fn a_misaligned_gradient_is_copied_and_an_owned_one_lent() {
        let copied = Copied::default();
        let mut raw = vec![0u8];
        raw.extend(f32_bytes(&[1.5, -2.0, 3.25]));
        let shared = Bytes::from_bytes_vec(raw).shared();
        let window = shared.view(1, 13).map_err(|e| format!("{e:?}"));
        let window = window.unwrap_or_else(|e| panic!("a view of a shared buffer: {e}"));
        assert_ne!(window.as_ptr() as usize % 4, 0, "the window is misaligned");
        let grad = Tensor::<1>::from_data(
            TensorData::from_bytes(window, [3], DType::F32),
            &Device::flex(),
        );
        let t = to_kolo("w", grad, &copied).map_err(|e| e.to_string());
        let t = t.and_then(|t| t.into_vec::<f32>().map_err(|e| e.to_string()));
        assert_eq!(t, Ok(vec![1.5, -2.0, 3.25]));
        assert_eq!(copied.get(), 12);
        let owned = Tensor::<1>::from_data(TensorData::new(vec![1.0f32; 4], [4]), &Device::flex());
        assert!(to_kolo("v", owned, &copied).is_ok());
        assert_eq!(copied.get(), 12, "an owned gradient is lent, not copied");
    }
}
