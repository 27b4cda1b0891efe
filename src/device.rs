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

/// A tensor's bytes on a CUDA device.
#[derive(Debug)]
pub(crate) struct CudaData {
    pub(crate) slice: CudaSlice<u8>,
}

impl CudaData {
    /// Takes over `slice`'s allocation as bytes, without copying.
    pub(crate) fn from_typed<T>(slice: CudaSlice<T>) -> CudaData {
        let stream = slice.stream().clone();
        let bytes = slice.num_bytes();
        let ptr = slice.leak();
        // SAFETY: `ptr` is the allocation just leaked from `slice`, `bytes` long; the
        // new slice frees it on the same stream.
        let slice = unsafe { stream.upgrade_device_ptr::<u8>(ptr, bytes) };
        CudaData { slice }
    }

    /// Gives the allocation back as `len` elements of `T`, without copying.
    pub(crate) fn into_typed<T>(self, len: usize) -> CudaSlice<T> {
        let stream = self.slice.stream().clone();
        let ptr = self.slice.leak();
        // SAFETY: as in `from_typed`; the caller checked that `T` is the element type
        // and `len` elements fill the allocation.
        unsafe { stream.upgrade_device_ptr::<T>(ptr, len) }
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.slice.ordinal()
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }

    /// Copies host bytes to a new allocation on device `ordinal`.
    pub(crate) fn upload(bytes: &[u8], ordinal: usize) -> Result<CudaData> {
        let stream = context(ordinal)?.default_stream();
        let slice = stream.clone_htod(bytes).map_err(cuda_err("cuMemcpyHtoD"))?;
        Ok(CudaData { slice })
    }

    /// Copies the bytes back to the host (waits for the copy).
    pub(crate) fn download(&self) -> Result<Vec<u8>> {
        let stream = self.slice.stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        stream
            .clone_dtoh(&self.slice)
            .map_err(cuda_err("cuMemcpyDtoH"))
    }
}

impl Clone for CudaData {
    /// Copies the device memory.
    ///
    /// # Panics
    /// When the device is out of memory, as `Vec::clone` does on the host.
    fn clone(&self) -> Self {
        match self.slice.try_clone() {
            Ok(slice) => CudaData { slice },
            Err(e) => panic!("cloning a CUDA tensor failed: {e}"),
        }
    }
}

impl PartialEq for CudaData {
    /// Two CUDA tensors are equal only when they are the same allocation: comparing
    /// contents would need a copy to the host (use `Tensor::to_cpu`).
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.raw(), other.raw());
        a == b && self.slice.len() == other.slice.len()
    }
}

impl CudaData {
    fn raw(&self) -> cudarc::driver::sys::CUdeviceptr {
        use cudarc::driver::DevicePtr;
        let (ptr, _sync) = self.slice.device_ptr(self.slice.stream());
        ptr
    }
}
