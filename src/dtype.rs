//! A tensor's element type and device.

use std::fmt;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// The element type of a [`Tensor`](crate::Tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// `u8`
    U8,
    /// `i8`
    I8,
    /// `i32`
    I32,
    /// `i64`
    I64,
    /// IEEE half precision ([`half::f16`]).
    F16,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// `f32`
    F32,
    /// `f64`
    F64,
}

impl DType {
    /// Every element type, in declaration order.
    pub const ALL: [DType; 8] = [
        DType::U8,
        DType::I8,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        };
        f.write_str(s)
    }
}

/// Where a tensor's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Device {
    /// Host memory (reduced over MPI).
    Cpu,
    /// CUDA device memory on the GPU of this ordinal (reduced with NCCL; feature `nccl`).
    Cuda(usize),
}

impl Device {
    /// Whether this is a CUDA device.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Multiplies every element of raw bytes holding `dtype` elements by `f`; integers
/// are scaled in f64 and rounded (saturating).
pub(crate) fn scale_bytes(bytes: &mut [u8], dtype: DType, f: f64) {
    if f == 1.0 {
        return;
    }
    macro_rules! typed {
        ($t:ty) => {
            bytemuck::cast_slice_mut::<u8, $t>(bytes)
        };
    }
    match dtype {
        DType::F32 => {
            let f = f as f32;
            typed!(f32).iter_mut().for_each(|x| *x *= f);
        }
        DType::F64 => typed!(f64).iter_mut().for_each(|x| *x *= f),
        DType::U8 => typed!(u8)
            .iter_mut()
            .for_each(|x| *x = (f64::from(*x) * f).round() as u8),
        DType::I8 => typed!(i8)
            .iter_mut()
            .for_each(|x| *x = (f64::from(*x) * f).round() as i8),
        DType::I32 => typed!(i32)
            .iter_mut()
            .for_each(|x| *x = (f64::from(*x) * f).round() as i32),
        DType::I64 => typed!(i64)
            .iter_mut()
            .for_each(|x| *x = (*x as f64 * f).round() as i64),
        // Scaled in f32, rounded once.
        DType::F16 => {
            let f = f as f32;
            typed!(f16)
                .iter_mut()
                .for_each(|x| *x = f16::from_f32(x.to_f32() * f));
        }
        DType::BF16 => {
            let f = f as f32;
            typed!(bf16)
                .iter_mut()
                .for_each(|x| *x = bf16::from_f32(x.to_f32() * f));
        }
    }
}
