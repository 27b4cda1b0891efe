//! Decentralized averaging (Bagua's shift-one schedule): after its optimizer step a
//! rank averages its *weights* with one peer instead of all-reducing gradients. At step
//! `t` the distance is `d = 2^(t mod ⌈log2 N⌉)`: each rank sends to `rank + d` and
//! averages what `rank − d` sent with its own (mod N). The mixing keeps the ranks'
//! mean exactly and, with the distances rotating, reaches it: at a power-of-two N
//! after log2 N steps without training in between (the shifts compose to every
//! rank), elsewhere geometrically.

use crate::error::{Error, Result};
use crate::runtime::Kolo;
use crate::tensor::{DType, Tensor};

/// The ranks step `step` exchanges with: (send to, receive from).
pub fn peers(rank: usize, size: usize, step: u64) -> (usize, usize) {
    let levels = size.next_power_of_two().trailing_zeros().max(1);
    let d = (1usize << (step % u64::from(levels))) % size.max(1);
    ((rank + d) % size, (rank + size - d) % size)
}

impl Kolo {
    /// One step of decentralized averaging of an f32 `tensor` (a model's weights,
    /// flattened): `(mine + peer's) / 2` with the peer of step `step` (see the
    /// module). Every rank calls it with the same name, step and shape; point to point
    /// only, no collective. One rank: the tensor as it is.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a tensor that is not f32 on the host, or a peer's
    /// tensor of another length; a failed transfer.
    pub fn decentralized_average(&self, name: &str, step: u64, tensor: Tensor) -> Result<Tensor> {
        let invalid = |message: String| Error::InvalidArgument {
            op: "decentralized_average",
            name: name.to_string(),
            message,
        };
        if tensor.dtype() != DType::F32 || tensor.device().is_cuda() {
            return Err(invalid(format!(
                "decentralized averaging takes f32 tensors on the host; this one is {:?} on {}",
                tensor.dtype(),
                tensor.device()
            )));
        }
        let size = self.size();
        if size == 1 {
            return Ok(tensor);
        }
        let (to, from) = peers(self.rank(), size, step);
        let shape = tensor.shape().to_vec();
        let mut mine = tensor.clone().into_vec::<f32>()?;
        let tag = format!("{name}.decentralized");
        let sent = self.send(&tag, tensor, to).submit()?;
        let theirs = self.recv(&tag, from).wait()?.into_vec::<f32>()?;
        sent.wait()?;
        if theirs.len() != mine.len() {
            return Err(invalid(format!(
                "rank {from} sent {} values, this rank has {}: the ranks' models differ",
                theirs.len(),
                mine.len()
            )));
        }
        for (m, t) in mine.iter_mut().zip(&theirs) {
            *m = 0.5 * (*m + t);
        }
        Tensor::from_vec(mine, &shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_rotate_and_pair_up() {
        assert_eq!(peers(0, 4, 0), (1, 3));
        assert_eq!(peers(0, 4, 1), (2, 2));
        assert_eq!(peers(0, 4, 2), (1, 3));
        assert_eq!(peers(1, 2, 5), (0, 0));
        assert_eq!(peers(2, 3, 1), (1, 0));
        // Every rank receives from exactly the rank that sends to it.
        for size in 2..9 {
            for step in 0..6 {
                for r in 0..size {
                    let (to, _) = peers(r, size, step);
                    assert_eq!(peers(to, size, step).1, r, "size {size} step {step}");
                }
            }
        }
    }
}
