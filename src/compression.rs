//! How tensors travel between ranks: [`Compression`] and the casts for the wire
//! (used by `kolo::DistributedOptimizer` and by a compressed allreduce, `ops`).

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// How gradients travel between ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Compression {
    /// As they are.
    #[default]
    None,
    /// Cast f32/f64 gradients to IEEE half precision for the collective, restored after.
    Fp16,
    /// Cast f32/f64 gradients to bfloat16 for the collective, restored after.
    Bf16,
    /// f32 gradients reduced with Bagua's ByteGrad: 8 bits and a minimum and step per
    /// 1 KiB chunk on the wire in both phases ([`Kolo::bytegrad_allreduce`](crate::Kolo::bytegrad_allreduce)), each
    /// gradient on its own (never fused or grouped), Average or Sum.
    ByteGrad,
}

impl Compression {
    fn wire_dtype(self, dtype: DType) -> DType {
        match (self, dtype) {
            (Compression::Fp16, DType::F32 | DType::F64) => DType::F16,
            (Compression::Bf16, DType::F32 | DType::F64) => DType::BF16,
            _ => dtype,
        }
    }
}

/// `t` as it travels under `c`: f32/f64 cast to f16 or bf16; anything else as it is.
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

/// `t` back in `dtype` after the wire ([`compress`] undone).
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
