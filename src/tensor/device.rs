//! CUDA device memory for tensors (feature `nccl`), and the guards that turn a missing
//! driver, device or NCCL library into an [`Error::CudaUnavailable`] instead of the
//! panic cudarc's lazy loader would raise.
//!
//! One [`CudaContext`] per device is shared by the whole process (the primary context),
//! so that the engine's stream and the streams tensors were made on belong to the same
//! context.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};

use crate::error::{Error, Result};
use crate::tensor::{DType, Storage};

/// Whether the CUDA driver library can be loaded. Every cudarc driver call panics
/// without it, so each entry point checks this first.
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NCCL library can be loaded.
pub(crate) fn nccl_present() -> bool {
    // SAFETY: as for `driver_present`.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn no_driver() -> Error {
    Error::CudaUnavailable(
        "CUDA driver library not found (libcuda.so); install the NVIDIA driver or use CPU tensors"
            .into(),
    )
}

/// Number of CUDA devices.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a driver library or when the driver cannot start
/// (which is how "no device" shows on most machines).
pub(crate) fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(no_driver());
    }
    let n = CudaContext::device_count().map_err(|e| {
        Error::CudaUnavailable(format!("the CUDA driver found no usable device ({e})"))
    })?;
    usize::try_from(n).map_err(|_| Error::CudaUnavailable(format!("driver reported {n} devices")))
}

/// The process-wide context of device `ordinal`.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a driver or without that device.
pub(crate) fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = OnceLock::new();
    let n = device_count()?;
    if n == 0 {
        return Err(Error::CudaUnavailable("no CUDA device".into()));
    }
    if ordinal >= n {
        return Err(Error::CudaUnavailable(format!(
            "no CUDA device cuda:{ordinal}: this machine has {n} (cuda:0..cuda:{})",
            n - 1
        )));
    }
    let mut map = CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| Error::Internal("CUDA context table poisoned".into()))?;
    if let Some(ctx) = map.get(&ordinal) {
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        return Ok(ctx.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
    // SAFETY: kolo orders every use itself — NCCL work waits on an event recorded on
    // each input's stream, handles complete only after the op's completion event, and
    // buffers an op reads are freed only after that event — so cudarc's per-slice
    // read/write events (two driver calls per pointer taken) are not needed for the
    // slices of this context.
    unsafe { ctx.disable_event_tracking() };
    map.insert(ordinal, ctx.clone());
    Ok(ctx)
}

/// Maps a driver error to [`Error::Cuda`] naming the call.
pub(crate) fn cuda_err(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        message: e.to_string(),
    }
}

/// A tensor's data on a CUDA device, typed as the user handed it over, so that
/// `Tensor::from_cuda` / `into_cuda` move the slice without touching the driver.
#[derive(Debug)]
#[doc(hidden)]
#[allow(unreachable_pub)] // named by the hidden methods of the public `Element` trait
pub enum CudaData {
    U8(CudaSlice<u8>),
    I8(CudaSlice<i8>),
    I32(CudaSlice<i32>),
    I64(CudaSlice<i64>),
    F16(CudaSlice<half::f16>),
    BF16(CudaSlice<half::bf16>),
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
}

/// Runs `$body` with `$s` bound to the typed slice inside a [`CudaData`].
macro_rules! with_slice {
    ($data:expr, $s:ident => $body:expr) => {
        match $data {
            CudaData::U8($s) => $body,
            CudaData::I8($s) => $body,
            CudaData::I32($s) => $body,
            CudaData::I64($s) => $body,
            CudaData::F16($s) => $body,
            CudaData::BF16($s) => $body,
            CudaData::F32($s) => $body,
            CudaData::F64($s) => $body,
        }
    };
}

impl CudaData {
    pub(crate) fn ordinal(&self) -> usize {
        with_slice!(self, s => s.ordinal())
    }

    /// The stream the allocation was made on (and will be freed on).
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        with_slice!(self, s => s.stream())
    }

    /// The device address, for NCCL and copies enqueued on `stream`. With cudarc's
    /// event tracking on, `stream` first waits for earlier writes to the allocation.
    pub(crate) fn ptr(&self, stream: &CudaStream) -> cudarc::driver::sys::CUdeviceptr {
        use cudarc::driver::DevicePtr;
        with_slice!(self, s => {
            let (ptr, _record) = s.device_ptr(stream);
            ptr
        })
    }

    /// `bytes` of uninitialised device memory holding `dtype` elements, on `stream`.
    pub(crate) fn alloc(stream: &Arc<CudaStream>, dtype: DType, bytes: usize) -> Result<CudaData> {
        let n = bytes / dtype.size_of();
        macro_rules! alloc {
            ($v:ident, $t:ty) => {
                CudaData::$v(
                    if n == 0 {
                        stream.null::<$t>()
                    } else {
                        // SAFETY: every element is written before it is read: by the
                        // collective, or by the memset of `zeros`.
                        unsafe { stream.alloc::<$t>(n) }
                    }
                    .map_err(cuda_err("cuMemAlloc"))?,
                )
            };
        }
        Ok(match dtype {
            DType::U8 => alloc!(U8, u8),
            DType::I8 => alloc!(I8, i8),
            DType::I32 => alloc!(I32, i32),
            DType::I64 => alloc!(I64, i64),
            DType::F16 => alloc!(F16, half::f16),
            DType::BF16 => alloc!(BF16, half::bf16),
            DType::F32 => alloc!(F32, f32),
            DType::F64 => alloc!(F64, f64),
        })
    }

    /// `bytes` of zeros holding `dtype` elements, on `stream`.
    pub(crate) fn zeros(stream: &Arc<CudaStream>, dtype: DType, bytes: usize) -> Result<CudaData> {
        let mut data = CudaData::alloc(stream, dtype, bytes)?;
        if bytes > 0 {
            with_slice!(&mut data, s => stream.memset_zeros(s))
                .map_err(cuda_err("cuMemsetD8Async"))?;
        }
        Ok(data)
    }

    /// Copies a host tensor's elements to a new allocation on device `ordinal`.
    pub(crate) fn upload(host: &Storage, ordinal: usize) -> Result<CudaData> {
        let stream = context(ordinal)?.default_stream();
        let map = cuda_err("cuMemcpyHtoD");
        Ok(match host {
            Storage::U8(v) => CudaData::U8(stream.clone_htod(v).map_err(map)?),
            Storage::I8(v) => CudaData::I8(stream.clone_htod(v).map_err(map)?),
            Storage::I32(v) => CudaData::I32(stream.clone_htod(v).map_err(map)?),
            Storage::I64(v) => CudaData::I64(stream.clone_htod(v).map_err(map)?),
            Storage::F16(v) => CudaData::F16(stream.clone_htod(v).map_err(map)?),
            Storage::BF16(v) => CudaData::BF16(stream.clone_htod(v).map_err(map)?),
            Storage::F32(v) => CudaData::F32(stream.clone_htod(v).map_err(map)?),
            Storage::F64(v) => CudaData::F64(stream.clone_htod(v).map_err(map)?),
        })
    }

    /// Copies the elements back to the host (waits for the copy).
    pub(crate) fn download(&self) -> Result<Storage> {
        self.stream()
            .context()
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        let map = cuda_err("cuMemcpyDtoH");
        Ok(match self {
            CudaData::U8(s) => Storage::U8(s.stream().clone_dtoh(s).map_err(map)?),
            CudaData::I8(s) => Storage::I8(s.stream().clone_dtoh(s).map_err(map)?),
            CudaData::I32(s) => Storage::I32(s.stream().clone_dtoh(s).map_err(map)?),
            CudaData::I64(s) => Storage::I64(s.stream().clone_dtoh(s).map_err(map)?),
            CudaData::F16(s) => Storage::F16(s.stream().clone_dtoh(s).map_err(map)?),
            CudaData::BF16(s) => Storage::BF16(s.stream().clone_dtoh(s).map_err(map)?),
            CudaData::F32(s) => Storage::F32(s.stream().clone_dtoh(s).map_err(map)?),
            CudaData::F64(s) => Storage::F64(s.stream().clone_dtoh(s).map_err(map)?),
        })
    }
}

impl Clone for CudaData {
    /// Copies the device memory.
    ///
    /// # Panics
    /// When the device is out of memory, as `Vec::clone` does on the host.
    fn clone(&self) -> Self {
        macro_rules! copy {
            ($v:ident, $s:expr) => {
                match $s.try_clone() {
                    Ok(c) => CudaData::$v(c),
                    Err(e) => panic!("cloning a CUDA tensor failed: {e}"),
                }
            };
        }
        match self {
            CudaData::U8(s) => copy!(U8, s),
            CudaData::I8(s) => copy!(I8, s),
            CudaData::I32(s) => copy!(I32, s),
            CudaData::I64(s) => copy!(I64, s),
            CudaData::F16(s) => copy!(F16, s),
            CudaData::BF16(s) => copy!(BF16, s),
            CudaData::F32(s) => copy!(F32, s),
            CudaData::F64(s) => copy!(F64, s),
        }
    }
}

impl PartialEq for CudaData {
    /// Two CUDA tensors are equal only when they are the same allocation: comparing
    /// contents would need a copy to the host (use `Tensor::to_cpu`).
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self.stream().as_ref(), other.stream().as_ref())
            && self.ptr(self.stream()) == other.ptr(other.stream())
    }
}
