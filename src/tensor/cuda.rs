//! CUDA tensors (feature `nccl`): wrapping, unwrapping and moving device memory.

use super::{checked_len, DType, Device, Element, Storage, Tensor};
use crate::error::{ConversionError, Error, Result};

/// CUDA tensors (feature `nccl`).
impl Tensor {
    /// Wraps a CUDA allocation with `shape`, without copying. The tensor remembers the
    /// device; collectives on it run over NCCL on that device.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `slice.len()` is not the product of `shape`.
    pub fn from_cuda<T: Element>(
        slice: cudarc::driver::CudaSlice<T>,
        shape: &[usize],
    ) -> Result<Tensor> {
        let expected = checked_len(shape, T::DTYPE)?;
        if expected != slice.len() {
            return Err(Error::ShapeMismatch {
                shape: shape.to_vec(),
                expected,
                actual: slice.len(),
            });
        }
        Ok(Tensor::from_cuda_parts(
            T::DTYPE,
            T::into_cuda_data(slice),
            shape.to_vec(),
        ))
    }

    pub(crate) fn from_cuda_parts(
        dtype: DType,
        data: crate::tensor::device::CudaData,
        shape: Vec<usize>,
    ) -> Tensor {
        Tensor {
            data: Storage::zeros(dtype, 0),
            shape,
            external: None,
            cuda: Some(data),
        }
    }

    /// Gives back the CUDA allocation, without copying. When the handle that produced
    /// the tensor has completed, the GPU has finished writing it. Allocations kolo made
    /// (outputs, `to_cuda`) come from a context without cudarc's automatic cross-stream
    /// event tracking: order your own streams around them as with raw CUDA.
    ///
    /// # Errors
    /// [`Error::WrongDevice`] for a CPU tensor, [`Error::DTypeMismatch`] when `T` is not
    /// the element type; the error holds the tensor, unchanged.
    pub fn into_cuda<T: Element>(
        mut self,
    ) -> std::result::Result<cudarc::driver::CudaSlice<T>, ConversionError<Tensor>> {
        let actual = self.dtype();
        match self.cuda.take() {
            None => {
                let e = Error::WrongDevice {
                    what: "Tensor::into_cuda",
                    expected: Device::Cuda(0),
                    actual: Device::Cpu,
                };
                Err(ConversionError::new(e, self))
            }
            Some(c) => T::from_cuda_data(c).map_err(|c| {
                self.cuda = Some(c);
                let e = Error::DTypeMismatch {
                    expected: T::DTYPE,
                    actual,
                };
                ConversionError::new(e, self)
            }),
        }
    }

    /// Copies the tensor to CUDA device `ordinal` (a CUDA tensor on another device is
    /// copied through the host).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without a CUDA driver ("CUDA driver library not
    /// found") or without that device; [`Error::Cuda`] when the copy fails. The error
    /// holds the tensor, unchanged.
    pub fn to_cuda(self, ordinal: usize) -> std::result::Result<Tensor, ConversionError<Tensor>> {
        if self.device() == Device::Cuda(ordinal) {
            return Ok(self);
        }
        let upload = match &self.cuda {
            // Another device: through the host, the source kept until both copies worked.
            Some(c) => c
                .download()
                .and_then(|host| crate::tensor::device::CudaData::upload(&host, ordinal)),
            None if self.external.is_some() => {
                let host = Storage::from_bytes(self.dtype(), self.host_bytes());
                crate::tensor::device::CudaData::upload(&host, ordinal)
            }
            None => crate::tensor::device::CudaData::upload(&self.data, ordinal),
        };
        match upload {
            Ok(data) => Ok(Tensor::from_cuda_parts(self.dtype(), data, self.shape)),
            Err(e) => Err(ConversionError::new(e, self)),
        }
    }

    /// Copies a CUDA tensor to host memory (waits for the copy); a CPU tensor is
    /// returned as it is.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the copy fails; the error holds the tensor, unchanged.
    pub fn to_cpu(self) -> std::result::Result<Tensor, ConversionError<Tensor>> {
        let Some(c) = &self.cuda else {
            return Ok(self);
        };
        match c.download() {
            Ok(data) => Ok(Tensor::from_parts(data, self.shape)),
            Err(e) => Err(ConversionError::new(e, self)),
        }
    }

    /// The device data of a CUDA tensor.
    pub(crate) fn cuda_data(&self) -> Option<&crate::tensor::device::CudaData> {
        self.cuda.as_ref()
    }
}
