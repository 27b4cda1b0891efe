//! Owned, typed, shaped buffers: what collectives take and give back.

use std::fmt;

use half::{bf16, f16};

use crate::error::{ConversionError, Error, Result};

pub(crate) use crate::dtype::scale_bytes;
pub use crate::dtype::{DType, Device};
#[cfg(feature = "nccl")]
mod cuda;
#[cfg(feature = "nccl")]
pub(crate) mod device;

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can be a tensor element: `u8, i8, i32, i64, f16, bf16, f32, f64`.
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    #[doc(hidden)]
    fn into_storage(v: Vec<Self>) -> Storage;
    #[doc(hidden)]
    fn from_storage(s: Storage) -> std::result::Result<Vec<Self>, Storage>;
    #[doc(hidden)]
    fn slice(s: &Storage) -> Option<&[Self]>;
    #[doc(hidden)]
    fn slice_mut(s: &mut Storage) -> Option<&mut [Self]>;
    #[cfg(feature = "nccl")]
    #[doc(hidden)]
    fn into_cuda_data(s: cudarc::driver::CudaSlice<Self>) -> device::CudaData;
    #[cfg(feature = "nccl")]
    #[doc(hidden)]
    fn from_cuda_data(
        d: device::CudaData,
    ) -> std::result::Result<cudarc::driver::CudaSlice<Self>, device::CudaData>;
}

/// The typed vector inside a tensor. Public only so that [`Element`] can name it.
#[doc(hidden)]
#[derive(Clone, PartialEq)]
pub enum Storage {
    U8(Vec<u8>),
    I8(Vec<i8>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

macro_rules! element {
    ($t:ty, $variant:ident) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn into_storage(v: Vec<Self>) -> Storage {
                Storage::$variant(v)
            }
            fn from_storage(s: Storage) -> std::result::Result<Vec<Self>, Storage> {
                match s {
                    Storage::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
            fn slice(s: &Storage) -> Option<&[Self]> {
                match s {
                    Storage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(s: &mut Storage) -> Option<&mut [Self]> {
                match s {
                    Storage::$variant(v) => Some(v),
                    _ => None,
                }
            }
            #[cfg(feature = "nccl")]
            fn into_cuda_data(s: cudarc::driver::CudaSlice<Self>) -> device::CudaData {
                device::CudaData::$variant(s)
            }
            #[cfg(feature = "nccl")]
            fn from_cuda_data(
                d: device::CudaData,
            ) -> std::result::Result<cudarc::driver::CudaSlice<Self>, device::CudaData> {
                match d {
                    device::CudaData::$variant(s) => Ok(s),
                    other => Err(other),
                }
            }
        }
    };
}

element!(u8, U8);
element!(i8, I8);
element!(i32, I32);
element!(i64, I64);
element!(f16, F16);
element!(bf16, BF16);
element!(f32, F32);
element!(f64, F64);

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Storage({}, {} elements)",
            self.dtype(),
            with_storage!(self, v => v.len())
        )
    }
}

/// Runs `$body` with `$v` bound to the typed vector inside a [`Storage`].
macro_rules! with_storage {
    ($storage:expr, $v:ident => $body:expr) => {
        match $storage {
            Storage::U8($v) => $body,
            Storage::I8($v) => $body,
            Storage::I32($v) => $body,
            Storage::I64($v) => $body,
            Storage::F16($v) => $body,
            Storage::BF16($v) => $body,
            Storage::F32($v) => $body,
            Storage::F64($v) => $body,
        }
    };
}
pub(crate) use with_storage;

impl Storage {
    fn dtype(&self) -> DType {
        match self {
            Storage::U8(_) => DType::U8,
            Storage::I8(_) => DType::I8,
            Storage::I32(_) => DType::I32,
            Storage::I64(_) => DType::I64,
            Storage::F16(_) => DType::F16,
            Storage::BF16(_) => DType::BF16,
            Storage::F32(_) => DType::F32,
            Storage::F64(_) => DType::F64,
        }
    }

    /// A typed copy of `bytes` (native endian; any alignment).
    fn from_bytes(dtype: DType, bytes: &[u8]) -> Storage {
        use bytemuck::pod_collect_to_vec as copy;
        match dtype {
            DType::U8 => Storage::U8(bytes.to_vec()),
            DType::I8 => Storage::I8(copy(bytes)),
            DType::I32 => Storage::I32(copy(bytes)),
            DType::I64 => Storage::I64(copy(bytes)),
            DType::F16 => Storage::F16(copy(bytes)),
            DType::BF16 => Storage::BF16(copy(bytes)),
            DType::F32 => Storage::F32(copy(bytes)),
            DType::F64 => Storage::F64(copy(bytes)),
        }
    }

    fn zeros(dtype: DType, len: usize) -> Storage {
        match dtype {
            DType::U8 => Storage::U8(zeroed(len)),
            DType::I8 => Storage::I8(zeroed(len)),
            DType::I32 => Storage::I32(zeroed(len)),
            DType::I64 => Storage::I64(zeroed(len)),
            DType::F16 => Storage::F16(zeroed(len)),
            DType::BF16 => Storage::BF16(zeroed(len)),
            DType::F32 => Storage::F32(zeroed(len)),
            DType::F64 => Storage::F64(zeroed(len)),
        }
    }

    /// [`zeros`](Self::zeros), or `None` where the memory cannot be had (a size that
    /// came from another rank, say): never an abort.
    fn try_zeros(dtype: DType, len: usize) -> Option<Storage> {
        Some(match dtype {
            DType::U8 => Storage::U8(try_zeroed(len)?),
            DType::I8 => Storage::I8(try_zeroed(len)?),
            DType::I32 => Storage::I32(try_zeroed(len)?),
            DType::I64 => Storage::I64(try_zeroed(len)?),
            DType::F16 => Storage::F16(try_zeroed(len)?),
            DType::BF16 => Storage::BF16(try_zeroed(len)?),
            DType::F32 => Storage::F32(try_zeroed(len)?),
            DType::F64 => Storage::F64(try_zeroed(len)?),
        })
    }
}

/// The CUDA device a rank uses unless told otherwise, as Horovod users pick it: its
/// local rank modulo the number of devices on its machine.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a driver, without a device, or in a build
/// without the `nccl` feature.
pub(crate) fn default_cuda_ordinal(local_rank: usize) -> Result<usize> {
    match cuda_device_count()? {
        0 => Err(Error::CudaUnavailable("no CUDA device".into())),
        n => Ok(local_rank % n),
    }
}

/// `kolo::cuda_device_count`: the CUDA devices this process can use.
///
/// # Errors
/// [`Error::CudaUnavailable`] in a build without the `nccl` feature, without a driver,
/// or when the driver finds no device.
pub(crate) fn cuda_device_count() -> Result<usize> {
    #[cfg(feature = "nccl")]
    {
        device::device_count()
    }
    #[cfg(not(feature = "nccl"))]
    {
        Err(Error::CudaUnavailable(
            "kolo was built without the `nccl` feature".into(),
        ))
    }
}

/// Buffers from this size up ask the kernel for transparent huge pages.
const HUGE_PAGES_FROM: usize = 4 << 20;

/// `Config::huge_pages` (`KOLO_HUGE_PAGES`), set by `init`; on until then.
static HUGE_PAGES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns the huge-page advice of large buffers on or off (`init`, from the config).
pub(crate) fn set_huge_pages(on: bool) {
    HUGE_PAGES.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// `len` zeroed elements. A large buffer comes fresh from `mmap` (glibc's threshold:
/// 32 MiB once kolo has tuned it), and writing it faults every 4 KiB page in: here
/// ~2.5 µs a page, so a 40 MiB collective output cost ~25 ms of faults, more than
/// its messages. From [`HUGE_PAGES_FROM`] on the buffer is marked `MADV_HUGEPAGE`
/// before anything touches it (the allocation is zeroed by the kernel, not written),
/// so that where transparent huge pages are enabled for `madvise` (Debian's and
/// Ubuntu's default) it faults in 2 MiB at a time (`KOLO_HUGE_PAGES=0`: not).
fn zeroed<T: bytemuck::Zeroable + Clone>(len: usize) -> Vec<T> {
    // `alloc_zeroed`: calloc, which leaves fresh mmap memory untouched.
    let v: Vec<T> = bytemuck::zeroed_vec(len);
    advise_huge_pages(v.as_ptr().cast(), std::mem::size_of_val(v.as_slice()));
    v
}

/// [`zeroed`], or `None` when the allocation fails.
fn try_zeroed<T: bytemuck::Zeroable + Clone>(len: usize) -> Option<Vec<T>> {
    let v: Vec<T> = bytemuck::allocation::try_zeroed_vec(len).ok()?;
    advise_huge_pages(v.as_ptr().cast(), std::mem::size_of_val(v.as_slice()));
    Some(v)
}

/// Asks for transparent huge pages over an allocation of `bytes` at `ptr` from
/// [`HUGE_PAGES_FROM`] on, before anything touches it (see [`zeroed`]).
fn advise_huge_pages(ptr: *const u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    if bytes >= HUGE_PAGES_FROM && HUGE_PAGES.load(std::sync::atomic::Ordering::Relaxed) {
        const PAGE: usize = 4096;
        let start = (ptr as usize).next_multiple_of(PAGE);
        let end = (ptr as usize + bytes) / PAGE * PAGE;
        if end > start {
            // SAFETY: [start, end) lies inside the vector's allocation, page-aligned;
            // MADV_HUGEPAGE changes how the kernel backs the range, never its contents.
            // A kernel without THP refuses it (EINVAL), which changes nothing.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, bytes);
}

/// `len` elements of `T` whose bytes `fill` writes, in memory that is not zeroed
/// first: a collective's large output, which the transport writes in full.
///
/// # Safety
/// `fill` must have written every byte it is given whenever it returns `Ok`.
unsafe fn written<T: bytemuck::Pod>(
    len: usize,
    fill: impl FnOnce(&mut [std::mem::MaybeUninit<u8>]) -> Result<()>,
) -> Result<Vec<T>> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    let bytes = len * std::mem::size_of::<T>();
    advise_huge_pages(v.as_ptr().cast(), bytes);
    // SAFETY: the spare capacity holds at least `len` elements, `bytes` bytes, and
    // MaybeUninit<u8> has no alignment or validity requirement.
    let spare = unsafe {
        std::slice::from_raw_parts_mut(
            v.spare_capacity_mut()
                .as_mut_ptr()
                .cast::<std::mem::MaybeUninit<u8>>(),
            bytes,
        )
    };
    fill(spare)?;
    // SAFETY: `fill` wrote every byte (the caller's promise), and any bytes are a
    // valid `T` (Pod).
    unsafe { v.set_len(len) };
    Ok(v)
}

/// An owned, typed buffer with a shape (row-major).
///
/// Moving data in and out is free: [`Tensor::from_vec`] keeps the `Vec` it is given
/// and [`Tensor::into_vec`] gives it back. With the `nccl` feature a tensor can also
/// live on a CUDA device (`Tensor::from_cuda`, `Tensor::to_cuda`); collectives on such
/// tensors run over NCCL. Cloning a CUDA tensor copies its device memory; two CUDA
/// tensors compare equal only when they are the same allocation.
///
/// ```
/// let t = kolo::Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
/// assert_eq!(t.shape(), &[2, 2]);
/// assert_eq!(t.dtype(), kolo::DType::F32);
/// let v: Vec<f32> = t.into_vec()?;
/// assert_eq!(v, [1.0, 2.0, 3.0, 4.0]);
/// # Ok::<(), kolo::Error>(())
/// ```
pub struct Tensor {
    /// The host data; for a CUDA tensor or one in a [`HostBuffer`] an empty vector of
    /// the right dtype.
    data: Storage,
    shape: Vec<usize>,
    /// Host memory owned by someone else (another framework's tensor buffer).
    external: Option<Box<dyn HostBuffer>>,
    #[cfg(feature = "nccl")]
    cuda: Option<device::CudaData>,
}

/// Host memory that a [`Tensor`] can borrow for the length of a collective, so that
/// kolo reduces another framework's tensor buffer in place, with no copy and no
/// allocation ([`Tensor::from_host_buffer`], [`Tensor::into_host_buffer`]).
///
/// Both methods must return the same memory, of the same length, on every call.
pub trait HostBuffer: std::any::Any + Send + Sync {
    /// The bytes, native endian.
    fn bytes(&self) -> &[u8];
    /// The bytes, mutably: collectives write their results here.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Unit tests only: the device a simulated device's buffer stands for (the
    /// loopback transport's simulated device, `transport/loopback/sim_device.rs`).
    #[cfg(test)]
    fn simulated_device(&self) -> Option<usize> {
        None
    }
}

impl Clone for Tensor {
    /// Copies the data; a tensor in a [`HostBuffer`] is copied into a `Vec`.
    fn clone(&self) -> Self {
        let data = match &self.external {
            Some(_) => Storage::from_bytes(self.dtype(), self.host_bytes()),
            None => self.data.clone(),
        };
        Tensor {
            data,
            shape: self.shape.clone(),
            external: None,
            #[cfg(feature = "nccl")]
            cuda: self.cuda.clone(),
        }
    }
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        #[cfg(feature = "nccl")]
        if self.cuda != other.cuda {
            return false;
        }
        self.dtype() == other.dtype()
            && self.shape == other.shape
            && self.host_bytes() == other.host_bytes()
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype())
            .field("shape", &self.shape)
            .field("device", &self.device())
            .field("host_buffer", &self.external.is_some())
            .finish_non_exhaustive()
    }
}

impl Tensor {
    /// Wraps `data` with `shape` without copying. A 0-d (scalar) tensor has shape `[]`
    /// and one element.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `data.len()` is not the product of `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        let expected = checked_len(shape, T::DTYPE)?;
        if expected != data.len() {
            return Err(Error::ShapeMismatch {
                shape: shape.to_vec(),
                expected,
                actual: data.len(),
            });
        }
        Ok(Tensor::from_parts(T::into_storage(data), shape.to_vec()))
    }

    /// A tensor of zeros.
    ///
    /// # Panics
    /// When the size of `shape` in bytes overflows `usize` (as `vec!` does on a
    /// capacity overflow); [`Tensor::try_zeros`] returns an error instead.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Tensor {
        match Tensor::try_zeros(dtype, shape) {
            Ok(t) => t,
            Err(e) => panic!("Tensor::zeros: {e}"),
        }
    }

    /// A tensor of zeros, or an error for a shape too large to address.
    ///
    /// # Errors
    /// [`Error::ShapeOverflow`] when the size of `shape` in bytes overflows `usize`.
    pub fn try_zeros(dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let len = checked_len(shape, dtype)?;
        let storage = Storage::try_zeros(dtype, len).ok_or_else(|| Error::OutOfMemory {
            bytes: len.saturating_mul(dtype.size_of()),
            shape: shape.to_vec(),
            dtype,
        })?;
        Ok(Tensor::from_parts(storage, shape.to_vec()))
    }

    /// Gives back the elements without copying (a tensor made with
    /// [`from_host_buffer`](Self::from_host_buffer) is copied into a new `Vec`).
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when `T` is not the tensor's element type,
    /// [`Error::WrongDevice`] for a CUDA tensor. The error holds the tensor, unchanged:
    /// [`ConversionError::into_inner`]; `?` turns it into an [`Error`].
    ///
    /// ```
    /// let t = kolo::Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
    /// let err = t.into_vec::<f64>().unwrap_err();
    /// assert_eq!(err.to_string(), "tensor holds F32 elements, not F64");
    /// let t = err.into_inner();                      // the tensor, unchanged
    /// assert_eq!(t.into_vec::<f32>()?, [1.0, 2.0]);
    /// # Ok::<(), kolo::Error>(())
    /// ```
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>, ConversionError<Tensor>> {
        if let Err(e) = self.require_cpu("Tensor::into_vec") {
            return Err(ConversionError::new(e, self));
        }
        let mismatch = |actual| Error::DTypeMismatch {
            expected: T::DTYPE,
            actual,
        };
        if self.dtype() != T::DTYPE {
            return Err(ConversionError::new(mismatch(self.dtype()), self));
        }
        let t = self.into_owned();
        T::from_storage(t.data).map_err(|data| {
            // The dtype was checked above; hand the data back all the same.
            ConversionError::new(mismatch(data.dtype()), Tensor::from_parts(data, t.shape))
        })
    }

    /// Wraps host memory owned by something else (e.g. another framework's tensor
    /// buffer) with `dtype` and `shape`, without copying: collectives read and write it
    /// in place. Get it back with [`into_host_buffer`](Self::into_host_buffer).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when the buffer does not hold exactly the elements of
    /// `shape`, [`Error::ShapeOverflow`] for a shape too large to address,
    /// [`Error::InvalidArgument`] when the buffer is not aligned for `dtype`. The error
    /// holds the buffer, unchanged ([`ConversionError::into_inner`]).
    pub fn from_host_buffer<B: HostBuffer>(
        buffer: B,
        dtype: DType,
        shape: &[usize],
    ) -> std::result::Result<Tensor, ConversionError<B>> {
        if let Err(e) = Self::check_host_buffer(buffer.bytes(), dtype, shape) {
            return Err(ConversionError::new(e, buffer));
        }
        let mut t = Tensor::from_parts(Storage::zeros(dtype, 0), shape.to_vec());
        t.external = Some(Box::new(buffer));
        Ok(t)
    }

    /// Gives back the buffer a tensor was made from with
    /// [`from_host_buffer`](Self::from_host_buffer), holding the collective's result.
    ///
    /// # Errors
    /// The tensor itself when it does not hold a `B`.
    // Handing the tensor back by value, as `Vec::try_into` does, is the point.
    #[allow(clippy::result_large_err)]
    pub fn into_host_buffer<B: HostBuffer>(self) -> std::result::Result<B, Tensor> {
        let holds_b = self
            .external
            .as_deref()
            .is_some_and(|b| (b as &dyn std::any::Any).is::<B>());
        if !holds_b {
            return Err(self);
        }
        match self
            .external
            .map(|b| (b as Box<dyn std::any::Any>).downcast::<B>())
        {
            Some(Ok(b)) => Ok(*b),
            // `holds_b` checked the type above.
            _ => unreachable!("the host buffer's type was checked"),
        }
    }

    /// Why `bytes` cannot hold a `dtype` tensor of `shape`, if it cannot.
    fn check_host_buffer(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<()> {
        let expected = checked_len(shape, dtype)?;
        if bytes.len() != expected * dtype.size_of() {
            return Err(Error::ShapeMismatch {
                shape: shape.to_vec(),
                expected,
                actual: bytes.len() / dtype.size_of(),
            });
        }
        if !(bytes.as_ptr() as usize).is_multiple_of(dtype.size_of()) {
            return Err(Error::InvalidArgument {
                op: "Tensor::from_host_buffer",
                name: String::new(),
                message: format!("the buffer is not aligned for {dtype} elements"),
            });
        }
        Ok(())
    }

    /// The same tensor with its data in a `Vec` (copied out of a [`HostBuffer`]).
    fn into_owned(self) -> Tensor {
        if self.external.is_none() {
            return self;
        }
        let data = Storage::from_bytes(self.dtype(), self.host_bytes());
        Tensor::from_parts(data, self.shape)
    }

    /// Borrows the elements.
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when `T` is not the tensor's element type.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.require_cpu("Tensor::as_slice")?;
        if let Some(b) = &self.external {
            return match self.dtype() == T::DTYPE {
                // Alignment and length were checked in `from_host_buffer`.
                true => Ok(bytemuck::cast_slice(b.bytes())),
                false => Err(Error::DTypeMismatch {
                    expected: T::DTYPE,
                    actual: self.dtype(),
                }),
            };
        }
        T::slice(&self.data).ok_or(Error::DTypeMismatch {
            expected: T::DTYPE,
            actual: self.dtype(),
        })
    }

    /// Borrows the elements mutably.
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when `T` is not the tensor's element type.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.require_cpu("Tensor::as_mut_slice")?;
        let actual = self.dtype();
        if let Some(b) = &mut self.external {
            return match actual == T::DTYPE {
                true => Ok(bytemuck::cast_slice_mut(b.bytes_mut())),
                false => Err(Error::DTypeMismatch {
                    expected: T::DTYPE,
                    actual,
                }),
            };
        }
        T::slice_mut(&mut self.data).ok_or(Error::DTypeMismatch {
            expected: T::DTYPE,
            actual,
        })
    }

    /// The shape (row-major; `[]` for a scalar).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Gives the same elements the shape `shape` (row-major order kept; nothing is
    /// copied, on the host or a device): e.g. a weight flattened to 1-D so that a
    /// reduce-scatter splits its elements rather than its rows.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `shape` holds a different number of elements (the
    /// tensor is left as it was).
    pub fn reshape(&mut self, shape: &[usize]) -> Result<()> {
        let expected = checked_len(shape, self.dtype())?;
        if expected != self.len() {
            return Err(Error::ShapeMismatch {
                shape: shape.to_vec(),
                expected,
                actual: self.len(),
            });
        }
        self.shape = shape.to_vec();
        Ok(())
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        // Every constructor checked that the shape's size in bytes fits in usize.
        self.shape.iter().product()
    }

    /// Where the data lives.
    pub fn device(&self) -> Device {
        #[cfg(feature = "nccl")]
        if let Some(c) = &self.cuda {
            return Device::Cuda(c.ordinal());
        }
        #[cfg(test)]
        if let Some(i) = self.external.as_ref().and_then(|b| b.simulated_device()) {
            return Device::Cuda(i);
        }
        Device::Cpu
    }

    /// Unit tests only: the host buffer this tensor borrows, if any.
    #[cfg(test)]
    pub(crate) fn host_buffer(&self) -> Option<&dyn HostBuffer> {
        self.external.as_deref()
    }

    fn require_cpu(&self, what: &'static str) -> Result<()> {
        match self.device() {
            Device::Cpu => Ok(()),
            actual => Err(Error::WrongDevice {
                what,
                expected: Device::Cpu,
                actual,
            }),
        }
    }

    /// Whether the tensor has no elements (some dimension is 0).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The size of the data in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len() * self.dtype().size_of()
    }

    /// The raw bytes, native endian.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for a tensor on a CUDA device.
    pub fn as_bytes(&self) -> Result<&[u8]> {
        self.require_cpu("Tensor::as_bytes")?;
        Ok(self.host_bytes())
    }

    /// The raw bytes, native endian, mutably.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for a tensor on a CUDA device.
    pub fn as_bytes_mut(&mut self) -> Result<&mut [u8]> {
        self.require_cpu("Tensor::as_bytes_mut")?;
        Ok(self.host_bytes_mut())
    }

    /// The host bytes (empty for a CUDA tensor; the engine routes those elsewhere).
    pub(crate) fn host_bytes(&self) -> &[u8] {
        match &self.external {
            Some(b) => b.bytes(),
            None => with_storage!(&self.data, v => bytemuck::cast_slice(v)),
        }
    }

    /// The host bytes, mutably (empty for a CUDA tensor).
    pub(crate) fn host_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.external {
            Some(b) => b.bytes_mut(),
            None => with_storage!(&mut self.data, v => bytemuck::cast_slice_mut(v)),
        }
    }

    /// Whether this tensor's memory can serve as another tensor's: a vector of its own
    /// on the host (not another framework's buffer, which goes back to it, not a
    /// device's). Point to point reuses a sent tensor's memory for the next receive,
    /// so that a receive does not fault in fresh pages, and keeps only such tensors.
    pub(crate) fn reusable(&self) -> bool {
        self.external.is_none() && self.device() == Device::Cpu
    }

    /// Makes this tensor one of `dtype` and `shape` (old contents left in place) when
    /// it is [`reusable`](Self::reusable) and holds exactly that many elements of that
    /// dtype; false, unchanged, otherwise.
    pub(crate) fn reuse_as(&mut self, dtype: DType, shape: &[usize]) -> bool {
        let fits = self.reusable()
            && self.dtype() == dtype
            && checked_len(shape, dtype).is_ok_and(|n| n == self.len());
        if fits {
            self.shape = shape.to_vec();
        }
        fits
    }

    /// A host tensor of `dtype` and `shape` whose bytes `fill` writes, in memory not
    /// zeroed first (see `Transport::allgatherv_fresh`).
    ///
    /// # Safety
    /// `fill` must have written every byte it is given whenever it returns `Ok`.
    pub(crate) unsafe fn written_by(
        dtype: DType,
        shape: &[usize],
        fill: impl FnOnce(&mut [std::mem::MaybeUninit<u8>]) -> Result<()>,
    ) -> Result<Tensor> {
        let n = checked_len(shape, dtype)?;
        // SAFETY: `fill` is the caller's, with the same promise.
        let data = unsafe {
            match dtype {
                DType::U8 => Storage::U8(written(n, fill)?),
                DType::I8 => Storage::I8(written(n, fill)?),
                DType::I32 => Storage::I32(written(n, fill)?),
                DType::I64 => Storage::I64(written(n, fill)?),
                DType::F16 => Storage::F16(written(n, fill)?),
                DType::BF16 => Storage::BF16(written(n, fill)?),
                DType::F32 => Storage::F32(written(n, fill)?),
                DType::F64 => Storage::F64(written(n, fill)?),
            }
        };
        Ok(Tensor::from_parts(data, shape.to_vec()))
    }

    pub(crate) fn from_parts(data: Storage, shape: Vec<usize>) -> Tensor {
        Tensor {
            data,
            shape,
            external: None,
            #[cfg(feature = "nccl")]
            cuda: None,
        }
    }
}

/// The element count of `shape`, checked so that its size in bytes as `dtype` fits in
/// `usize` (so that `len` and `num_bytes` of any tensor cannot overflow).
pub(crate) fn checked_len(shape: &[usize], dtype: DType) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|n| n.checked_mul(dtype.size_of()).is_some())
        .ok_or_else(|| Error::ShapeOverflow {
            shape: shape.to_vec(),
            dtype,
        })
}

#[cfg(test)]
mod tests;
