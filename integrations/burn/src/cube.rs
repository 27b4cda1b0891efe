//! Gradients on Burn's CubeCL backend (features `cuda` and `cpu`), reduced in their
//! own memory: the backend-extension route of issue 17.
//!
//! A gradient taken out of `GradientsParams` is a plain `CubeTensor` (kolo-burn
//! builds Burn without its `fusion` feature). When it is contiguous, fills its whole
//! buffer and is not shared (`can_mut`), kolo-burn waits for the device to finish the
//! backward pass (`Device::sync`: cubecl's streams are private), asks the compute
//! client for the storage resource behind the tensor's handle — which pins the
//! allocation in place while held — and lends that memory to kolo:
//!
//! - **CUDA** (`Device::cuda(i)`): the resource's device pointer (offset included)
//!   becomes a kolo CUDA tensor, reduced by kolo's NCCL path on the device. No host
//!   copy; f16/bf16 stay 2 bytes. The cudarc slice over Burn's memory is leaked on
//!   the way back, never freed.
//! - **CPU runtime** (`Device::cpu()`): the resource is host memory, lent to kolo as a
//!   [`HostBuffer`] and reduced in place by kolo's MPI host path, as on Flex.
//!
//! The pin and the tensor travel with the kolo tensor and come back with it, so
//! cubecl cannot move or reuse the buffer while kolo works on it; the reduced
//! gradient is then the same `CubeTensor`, registered again as a Burn tensor. A
//! gradient that does not qualify (a strided view, a shared buffer) goes through the
//! host path and is counted in `copied_bytes`.
//!
//! Every `unsafe` of kolo-burn is in this module.

use burn::backend::{Cube, DispatchDevice};
use burn::tensor::{Device, Tensor};
use burn_cubecl::tensor::CubeTensor;
use cubecl_runtime::runtime::Runtime;
use cubecl_runtime::server::ServerStorage;
use cubecl_runtime::storage::{ComputeStorage, ManagedResource};
use kolo::HostBuffer;

use crate::error::{Error, Result};

/// Which of kolo's paths a Burn device's gradients take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Anything else: `into_data` to the host and back (Flex: zero copy there).
    Host,
    /// CubeCL's CPU runtime: the buffer lent to kolo's MPI path.
    #[cfg(feature = "cpu")]
    CubeCpu,
    /// CUDA device `ordinal`: the device memory handed to kolo's NCCL path.
    #[cfg(feature = "cuda")]
    CubeCuda(usize),
}

/// The route of `device`'s gradients.
pub(crate) fn route(device: &Device) -> Route {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cube) => match cube {
            #[cfg(feature = "cpu")]
            cubecl_device::Device::Cpu(_) => Route::CubeCpu,
            #[cfg(feature = "cuda")]
            cubecl_device::Device::Cuda(d) => Route::CubeCuda(d.index),
            _ => Route::Host,
        },
        #[allow(unreachable_patterns)]
        _ => Route::Host,
    }
}

/// cubecl's device enum, as Burn re-exports it.
mod cubecl_device {
    pub(crate) use burn_cubecl::CubeDevice as Device;
}

/// `grad`'s own memory as a kolo tensor of `dtype`, when `grad` sits on a Cube device
/// and its buffer can be lent. `Err(grad)` hands the gradient back unchanged for the
/// host path (another device, or a buffer that cannot be lent).
// `Err` hands the value back unmoved (the host path takes it): boxing it would
// allocate on every step for a value that is moved, not copied.
#[allow(clippy::result_large_err)]
pub(crate) fn lend<const D: usize>(
    name: &str,
    grad: Tensor<D>,
    dtype: kolo::DType,
) -> std::result::Result<Result<kolo::Tensor>, Tensor<D>> {
    let route = route(&grad.device());
    if route == Route::Host {
        return Err(grad);
    }
    let device = grad.device();
    let dims = grad.dims();
    let n: usize = dims.iter().product();
    // One dimension: CUDA may give a matrix padded rows (a pitched layout), which NCCL
    // cannot read as one run of elements; a 1-D tensor is never padded. For an
    // unpadded gradient this only changes the metadata.
    let flat: Tensor<1> = grad.reshape([n]);
    // The backward pass may still run on cubecl's own stream: wait for it before
    // anyone but cubecl reads the buffer.
    if let Err(e) = device.sync() {
        return Ok(Err(Error::Data {
            name: name.to_string(),
            message: format!("waiting for the device to finish the backward pass: {e:?}"),
        }));
    }
    let cube = match flat.clone().try_into_primitive::<Cube>() {
        Ok(c) => c,
        Err(_) => return Err(flat.reshape(dims_array::<D>(&dims))),
    };
    drop(flat);
    let len = n * dtype.size_of();
    // The element count comes from the shape, not the allocation: cubecl may round a
    // small buffer up, and only the first `len` bytes are the gradient.
    if !(cube.is_contiguous() && cube.can_mut() && cube.handle.size() as usize >= len) {
        let back = Tensor::<1>::from_primitive::<Cube>(cube);
        return Err(back.reshape(dims_array::<D>(&dims)));
    }
    let lent = match route {
        #[cfg(feature = "cpu")]
        Route::CubeCpu => lend_host(name, cube, dtype, &dims, len),
        #[cfg(feature = "cuda")]
        Route::CubeCuda(ordinal) => cuda::lend(name, cube, dtype, &dims, ordinal),
        Route::Host => unreachable!("the host route returned above"),
    };
    Ok(lent)
}

/// A reduced kolo tensor that was lent by [`lend`], as the Burn gradient in the same
/// memory; `Err(t)` for any other kolo tensor.
// `Err` hands the value back unmoved (the host path takes it): boxing it would
// allocate on every step for a value that is moved, not copied.
#[allow(clippy::result_large_err)]
pub(crate) fn reclaim<const D: usize>(
    t: kolo::Tensor,
) -> std::result::Result<Tensor<D>, kolo::Tensor> {
    let dims = dims_array::<D>(t.shape());
    reclaim_flat(t).map(|flat| flat.reshape(dims))
}

/// [`reclaim`] as the flat (1-D) Burn tensor the memory was lent from.
// `Err` hands the value back unmoved, as above.
#[allow(clippy::result_large_err)]
pub(crate) fn reclaim_flat(t: kolo::Tensor) -> std::result::Result<Tensor<1>, kolo::Tensor> {
    #[cfg(feature = "cpu")]
    let t = match t.into_host_buffer::<CubeHost>() {
        Ok(buf) => {
            let CubeHost { cube, pin, .. } = buf;
            drop(pin);
            return Ok(Tensor::<1>::from_primitive::<Cube>(cube));
        }
        Err(t) => t,
    };
    #[cfg(feature = "cuda")]
    let t = match cuda::reclaim(t) {
        Ok(cube) => return Ok(Tensor::<1>::from_primitive::<Cube>(cube)),
        Err(t) => t,
    };
    Err(t)
}

/// `dims` (a gradient's own shape, `D` long) as an array for `reshape`.
fn dims_array<const D: usize>(dims: &[usize]) -> [usize; D] {
    let mut out = [1; D];
    for (o, &d) in out.iter_mut().zip(dims) {
        *o = d;
    }
    out
}

/// Maps cubecl's error when reaching a tensor's storage.
fn storage_error(name: &str, e: impl std::fmt::Debug) -> Error {
    Error::Data {
        name: name.to_string(),
        message: format!("reaching the tensor's storage on the device failed: {e:?}"),
    }
}

/// A gradient's host buffer on the CPU runtime, lent to kolo: the tensor, the pin
/// that keeps cubecl from moving or reusing its memory, and the resource's bytes.
#[cfg(feature = "cpu")]
struct CubeHost {
    cube: CubeTensor,
    pin: CpuResource,
    len: usize,
}

#[cfg(feature = "cpu")]
type CpuResource = ManagedResource<
    <<<cubecl_cpu::CpuRuntime as Runtime>::Server as ServerStorage>::Storage as ComputeStorage>::Resource,
>;

// SAFETY: `CubeHost` is only reached through `&self` for `bytes` (reads) and through
// `&mut self` for `bytes_mut`; the resource is a pointer into an allocation pinned by
// `pin` and owned by this tensor alone (`can_mut` was checked), so sharing `&CubeHost`
// between threads shares only reads of memory no one else writes.
#[cfg(feature = "cpu")]
unsafe impl Sync for CubeHost {}

#[cfg(feature = "cpu")]
impl HostBuffer for CubeHost {
    fn bytes(&self) -> &[u8] {
        &self.pin.resource().read()[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.pin.resource_mut().write()[..self.len]
    }
}

#[cfg(feature = "cpu")]
fn lend_host(
    name: &str,
    cube: CubeTensor,
    dtype: kolo::DType,
    dims: &[usize],
    len: usize,
) -> Result<kolo::Tensor> {
    let pin = cube
        .client
        .get_resource::<<cubecl_cpu::CpuRuntime as Runtime>::Server>(cube.handle.clone())
        .map_err(|e| storage_error(name, e))?;
    if pin.resource().read().len() < len {
        return Err(Error::Data {
            name: name.to_string(),
            message: format!(
                "its device buffer holds {} bytes, but shape {dims:?} of {dtype} needs {len}",
                pin.resource().read().len()
            ),
        });
    }
    let buf = CubeHost { cube, pin, len };
    kolo::Tensor::from_host_buffer(buf, dtype, dims).map_err(|e| Error::Kolo(e.into()))
}

/// The CUDA side: Burn's device memory as kolo CUDA tensors.
#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock, PoisonError};

    use burn_cubecl::tensor::CubeTensor;
    use cubecl_runtime::runtime::Runtime;
    use cubecl_runtime::server::ServerStorage;
    use cubecl_runtime::storage::{ComputeStorage, ManagedResource};
    use half::{bf16, f16};
    use kolo::cudarc::driver::{CudaContext, CudaSlice, CudaStream};

    use super::storage_error;
    use crate::error::{Error, Result};

    type GpuResource = ManagedResource<
        <<<cubecl_cuda::CudaRuntime as Runtime>::Server as ServerStorage>::Storage as ComputeStorage>::Resource,
    >;

    /// What travels beside a lent device buffer: the tensor and its pin, by device
    /// pointer, until the reduced kolo tensor comes back.
    struct Lent {
        cube: CubeTensor,
        _pin: GpuResource,
    }

    fn lent() -> &'static Mutex<HashMap<u64, Lent>> {
        static LENT: OnceLock<Mutex<HashMap<u64, Lent>>> = OnceLock::new();
        LENT.get_or_init(Default::default)
    }

    /// A stream of device `ordinal`'s primary context (the one cubecl and kolo use),
    /// without cudarc's per-slice event tracking: Burn's memory was synchronised
    /// before it is lent and kolo orders its own work.
    fn stream(ordinal: usize) -> Result<Arc<CudaStream>> {
        static STREAMS: OnceLock<Mutex<HashMap<usize, Arc<CudaStream>>>> = OnceLock::new();
        let mut map = STREAMS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = map.get(&ordinal) {
            return Ok(s.clone());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::Data {
            name: format!("cuda:{ordinal}"),
            message: format!("retaining the device's primary context failed: {e}"),
        })?;
        // SAFETY: slices of this context are only ever views of Burn's memory that
        // was synchronised (`Device::sync`) before it is lent; kolo's engine orders
        // its NCCL work after an event on the slice's stream itself.
        unsafe { ctx.disable_event_tracking() };
        let s = ctx.default_stream();
        map.insert(ordinal, s.clone());
        Ok(s)
    }

    pub(super) fn lend(
        name: &str,
        cube: CubeTensor,
        dtype: kolo::DType,
        dims: &[usize],
        ordinal: usize,
    ) -> Result<kolo::Tensor> {
        // The driver was checked when the device was made (`crate::cuda_device`),
        // but a model moved to CUDA another way reaches here first.
        kolo::cuda_device_count().map_err(Error::Kolo)?;
        let pin = cube
            .client
            .get_resource::<<cubecl_cuda::CudaRuntime as Runtime>::Server>(cube.handle.clone())
            .map_err(|e| storage_error(name, e))?;
        let ptr = pin.resource().ptr;
        let n: usize = dims.iter().product();
        let stream = stream(ordinal)?;
        macro_rules! wrap {
            ($t:ty) => {{
                // SAFETY: `ptr` is the start of this tensor's own buffer (offset
                // included), which holds at least `n` elements of its dtype — checked
                // contiguous, large enough and unshared by `lend` — pinned by `pin`
                // until `reclaim` takes the slice back and leaks it, so the slice
                // never frees Burn's memory.
                let slice: CudaSlice<$t> = unsafe { stream.upgrade_device_ptr::<$t>(ptr, n) };
                kolo::Tensor::from_cuda(slice, dims)
            }};
        }
        let t = match dtype {
            kolo::DType::F32 => wrap!(f32),
            kolo::DType::F64 => wrap!(f64),
            kolo::DType::F16 => wrap!(f16),
            kolo::DType::BF16 => wrap!(bf16),
            other => {
                return Err(Error::Data {
                    name: name.to_string(),
                    message: format!("gradients of dtype {other} cannot be reduced on CUDA"),
                })
            }
        }
        .map_err(Error::Kolo)?;
        lent()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(ptr, Lent { cube, _pin: pin });
        Ok(t)
    }

    /// The lent tensor behind a reduced CUDA kolo tensor: its slice leaked (the memory
    /// is Burn's), its pin released. Any other CUDA tensor comes back unchanged.
    #[allow(clippy::result_large_err)] // `Err` hands the tensor back unmoved, as above.
    pub(super) fn reclaim(t: kolo::Tensor) -> std::result::Result<CubeTensor, kolo::Tensor> {
        if !t.device().is_cuda() {
            return Err(t);
        }
        let (dims, ordinal) = (t.shape().to_vec(), ordinal_of(&t));
        macro_rules! take {
            ($t:ty) => {{
                let slice = match t.into_cuda::<$t>() {
                    Ok(s) => s,
                    Err(e) => return Err(e.into_inner()),
                };
                let n = slice.len();
                let ptr = slice.leak();
                let entry = lent()
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&ptr);
                match (entry, stream(ordinal)) {
                    (Some(l), _) => return Ok(l.cube),
                    // Memory kolo allocated itself (never for an in-place allreduce):
                    // owned again by a slice, handed back to the host path.
                    (None, Ok(stream)) => {
                        // SAFETY: `ptr` was a live kolo-owned allocation of `n`
                        // elements on this device a moment ago; leaking and upgrading
                        // moves its ownership back into a slice, freed once.
                        let slice = unsafe { stream.upgrade_device_ptr::<$t>(ptr, n) };
                        return match kolo::Tensor::from_cuda(slice, &dims) {
                            Ok(t) => Err(t),
                            Err(e) => panic!("kolo-burn: re-wrapping a CUDA tensor in its own shape failed: {e}"),
                        };
                    }
                    (None, Err(e)) => {
                        panic!("kolo-burn: a reduced CUDA gradient came back in memory it did not lend and no stream owns it: {e}")
                    }
                }
            }};
        }
        match t.dtype() {
            kolo::DType::F32 => take!(f32),
            kolo::DType::F64 => take!(f64),
            kolo::DType::F16 => take!(f16),
            kolo::DType::BF16 => take!(bf16),
            _ => Err(t),
        }
    }

    fn ordinal_of(t: &kolo::Tensor) -> usize {
        match t.device() {
            kolo::Device::Cuda(i) => i,
            _ => 0,
        }
    }
}
