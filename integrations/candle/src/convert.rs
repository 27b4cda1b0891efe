//! candle tensors to kolo tensors and back.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// kolo's dtype for a candle dtype, if kolo carries it.
pub(crate) fn kolo_dtype(d: DType) -> Option<kolo::DType> {
    Some(match d {
        DType::U8 => kolo::DType::U8,
        DType::I32 => kolo::DType::I32,
        DType::I64 => kolo::DType::I64,
        DType::F16 => kolo::DType::F16,
        DType::BF16 => kolo::DType::BF16,
        DType::F32 => kolo::DType::F32,
        DType::F64 => kolo::DType::F64,
        _ => return None,
    })
}

/// Checks that kolo carries `t`'s dtype; `var` names the variable in the error.
pub(crate) fn check_dtype(what: &'static str, var: &str, d: DType) -> Result<()> {
    match kolo_dtype(d) {
        Some(_) => Ok(()),
        None => Err(Error::DType {
            what,
            var: var.to_string(),
            dtype: d,
        }),
    }
}

/// `t`'s elements in a kolo tensor of the same shape: one copy (out of candle's
/// storage; from a GPU, through the host).
pub(crate) fn to_kolo(what: &'static str, var: &str, t: &Tensor) -> Result<kolo::Tensor> {
    let shape = t.dims().to_vec();
    // Contiguous CPU tensors: `flatten_all` is a view and `to_vec1` copies the slice.
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::U8 => kolo::Tensor::from_vec(flat.to_vec1::<u8>()?, &shape)?,
        DType::I32 => kolo::Tensor::from_vec(flat.to_vec1::<i32>()?, &shape)?,
        DType::I64 => kolo::Tensor::from_vec(flat.to_vec1::<i64>()?, &shape)?,
        DType::F16 => kolo::Tensor::from_vec(flat.to_vec1::<half::f16>()?, &shape)?,
        DType::BF16 => kolo::Tensor::from_vec(flat.to_vec1::<half::bf16>()?, &shape)?,
        DType::F32 => kolo::Tensor::from_vec(flat.to_vec1::<f32>()?, &shape)?,
        DType::F64 => kolo::Tensor::from_vec(flat.to_vec1::<f64>()?, &shape)?,
        d => {
            return Err(Error::DType {
                what,
                var: var.to_string(),
                dtype: d,
            })
        }
    })
}

/// A candle tensor on `device` holding `t` (its vector taken without a copy on the
/// CPU).
pub(crate) fn from_kolo(t: kolo::Tensor, device: &Device) -> Result<Tensor> {
    let shape = t.shape().to_vec();
    let cpu = Device::Cpu;
    let out = match t.dtype() {
        kolo::DType::U8 => Tensor::from_vec(t.into_vec::<u8>()?, shape, &cpu)?,
        kolo::DType::I32 => Tensor::from_vec(t.into_vec::<i32>()?, shape, &cpu)?,
        kolo::DType::I64 => Tensor::from_vec(t.into_vec::<i64>()?, shape, &cpu)?,
        kolo::DType::F16 => Tensor::from_vec(t.into_vec::<half::f16>()?, shape, &cpu)?,
        kolo::DType::BF16 => Tensor::from_vec(t.into_vec::<half::bf16>()?, shape, &cpu)?,
        kolo::DType::F32 => Tensor::from_vec(t.into_vec::<f32>()?, shape, &cpu)?,
        kolo::DType::F64 => Tensor::from_vec(t.into_vec::<f64>()?, shape, &cpu)?,
        other => {
            return Err(Error::InvalidArgument {
                what: "kolo_candle",
                message: format!("kolo returned a {other:?} tensor, which candle has no dtype for"),
            })
        }
    };
    if device.is_cpu() {
        Ok(out)
    } else {
        Ok(out.to_device(device)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_carried_dtype() {
        let base = Tensor::arange(0f32, 6f32, &Device::Cpu)
            .and_then(|t| t.reshape((2, 3)))
            .expect("arange");
        for d in [
            DType::U8,
            DType::I64,
            DType::F16,
            DType::BF16,
            DType::F32,
            DType::F64,
        ] {
            let t = base.to_dtype(d).expect("to_dtype");
            let k = to_kolo("test", "v", &t).expect("to kolo");
            assert_eq!(k.shape(), &[2, 3]);
            let back = from_kolo(k, &Device::Cpu).expect("from kolo");
            assert_eq!(back.dtype(), d);
            let v: Vec<f32> = back
                .to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1())
                .expect("read");
            assert_eq!(v, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        }
    }

    #[test]
    fn a_transposed_tensor_is_read_in_its_logical_order() {
        let t = Tensor::arange(0f32, 6f32, &Device::Cpu)
            .and_then(|t| t.reshape((2, 3)))
            .and_then(|t| t.t())
            .expect("transpose");
        let k = to_kolo("test", "v", &t).expect("to kolo");
        assert_eq!(k.shape(), &[3, 2]);
        assert_eq!(
            k.as_slice::<f32>().expect("f32"),
            &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
    }
}
