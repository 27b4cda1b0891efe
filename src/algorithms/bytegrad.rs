//! ByteGrad (Bagua's): an allreduce of f32 whose wire carries 8-bit values with a
//! scale per 1 KiB chunk, about a quarter of f32's bytes in both of its phases. Each
//! rank quantises its tensor in N partitions and sends partition `p` to rank `p`
//! (an alltoall: the compressed reduce-scatter); rank `p` decodes the N copies of its
//! partition, sums them in f32, quantises the sum and every rank gathers the sums (an
//! allgather of bytes). Every rank decodes the same bytes, so the results agree bit for
//! bit; each value is within the quantisation bound of the exact result (half a step
//! of each rank's chunk, divided by N for Average, plus half a step of the sum's).

use std::ops::Range;

use super::quantize;
use crate::error::{Error, Result};
use crate::runtime::Kolo;
use crate::tensor::{DType, Tensor};
use crate::vocab::ReduceOp;

/// Partition `p` of `n` values over `size` ranks: contiguous, the first `n % size`
/// one value longer.
pub(crate) fn part(n: usize, size: usize, p: usize) -> Range<usize> {
    let (base, extra) = (n / size, n % size);
    let start = p * base + p.min(extra);
    start..start + base + usize::from(p < extra)
}

impl Kolo {
    /// Reduces an f32 `tensor` over all ranks with ByteGrad's 8-bit compression (see
    /// the module): [`ReduceOp::Average`] or [`ReduceOp::Sum`]. Blocking; every rank
    /// calls it with the same name and shape. One rank: the tensor as it is.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a tensor that is not f32 on the host or another
    /// op; a failed collective.
    pub fn bytegrad_allreduce(&self, name: &str, tensor: Tensor, op: ReduceOp) -> Result<Tensor> {
        let invalid = |message: String| Error::InvalidArgument {
            op: "bytegrad_allreduce",
            name: name.to_string(),
            message,
        };
        if tensor.dtype() != DType::F32 || tensor.device().is_cuda() {
            return Err(invalid(format!(
                "ByteGrad reduces f32 tensors on the host; this one is {:?} on {:?}",
                tensor.dtype(),
                tensor.device()
            )));
        }
        if !matches!(op, ReduceOp::Average | ReduceOp::Sum) {
            return Err(invalid(format!(
                "ByteGrad sums or averages; {op:?} is neither"
            )));
        }
        let size = self.size();
        if size == 1 {
            return Ok(tensor);
        }
        if tensor.len() < size {
            // Fewer values than ranks: some partitions would be empty and 8-bit
            // chunks save nothing on so few bytes: full precision.
            return self.allreduce(name, tensor).op(op).wait();
        }
        let shape = tensor.shape().to_vec();
        let x = tensor.as_slice::<f32>()?;
        let n = x.len();
        let rank = self.rank();
        // Phase 1: partition p, quantised, to rank p.
        let mut wire = Vec::with_capacity(quantize::encoded_len(n) + 8 * size);
        let mut splits = Vec::with_capacity(size);
        for p in 0..size {
            let before = wire.len();
            quantize::encode_into(&x[part(n, size, p)], &mut wire);
            splits.push(wire.len() - before);
        }
        let len = wire.len();
        let got = self
            .alltoall(
                format!("{name}.bytegrad.scatter"),
                Tensor::from_vec(wire, &[len])?,
            )
            .splits(splits)
            .wait()?;
        let mine = part(n, size, rank);
        let mut sum = vec![0.0f32; mine.len()];
        let bytes = got.tensor.as_slice::<u8>()?;
        let mut at = 0;
        for (src, &count) in got.received_splits.iter().enumerate() {
            quantize::decode_add(&bytes[at..at + count], &mut sum)
                .map_err(|e| invalid(format!("rank {src}'s part: {e}")))?;
            at += count;
        }
        if op == ReduceOp::Average {
            let inv = 1.0 / size as f32;
            sum.iter_mut().for_each(|v| *v *= inv);
        }
        // Phase 2: every rank's quantised sum to every rank.
        let enc = quantize::encode(&sum);
        let len = enc.len();
        let all = self
            .allgather(
                format!("{name}.bytegrad.gather"),
                Tensor::from_vec(enc, &[len])?,
            )
            .wait()?;
        let out = decode_parts(all.as_slice::<u8>()?, n, size).map_err(invalid)?;
        Tensor::from_vec(out, &shape)
    }
}

/// The `n` values of `size` ranks' quantised partitions, concatenated in rank order.
fn decode_parts(bytes: &[u8], n: usize, size: usize) -> std::result::Result<Vec<f32>, String> {
    let mut out = vec![0.0f32; n];
    let mut at = 0;
    for p in 0..size {
        let r = part(n, size, p);
        let end = at + quantize::encoded_len(r.len());
        if end > bytes.len() {
            return Err(format!("rank {p}'s sum is missing from the gather"));
        }
        quantize::decode_into(&bytes[at..end], &mut out[r])
            .map_err(|e| format!("rank {p}'s sum: {e}"))?;
        at = end;
    }
    Ok(out)
}
