//! Adasum (Horovod's adaptive summation): two gradients `a` and `b` combine as
//! `(1 − a·b / 2|a|²) a + (1 − a·b / 2|b|²) b` — their sum when they are orthogonal,
//! their value when they are equal — and N ranks' gradients as a binary tree of such
//! pairs. At a power-of-two N it runs as Horovod's recursive vector halving, distance
//! doubling: at level k a rank and its partner `rank ^ 2^k` swap halves of the
//! segment they hold, the three partial dot products of a half are summed over the
//! 2^(k+1) ranks sharing the segment (a 3-value allgather), and each combines its half;
//! after log2 N levels each rank holds 1/N of the result and an allgather assembles
//! it. Other N gather every rank's tensor and combine the same tree on each rank.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::runtime::Kolo;
use crate::tensor::{DType, Tensor};

/// The Adasum combination of `a` and `b` given `a·b`, `|a|²` and `|b|²`, into `a`.
fn combine(a: &mut [f32], b: &[f32], dot: f64, aa: f64, bb: f64) {
    let ca = if aa > 0.0 {
        1.0 - dot / (2.0 * aa)
    } else {
        1.0
    };
    let cb = if bb > 0.0 {
        1.0 - dot / (2.0 * bb)
    } else {
        1.0
    };
    let (ca, cb) = (ca as f32, cb as f32);
    for (x, &y) in a.iter_mut().zip(b) {
        *x = ca * *x + cb * y;
    }
}

/// `a·b`, `|a|²`, `|b|²` in f64.
fn dots(a: &[f32], b: &[f32]) -> [f64; 3] {
    let mut d = [0.0f64; 3];
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        d[0] += x * y;
        d[1] += x * x;
        d[2] += y * y;
    }
    d
}

/// Adasum of the tensors in `v` (in rank order) as a binary tree of pairs: (0,1),
/// (2,3), … then pairs of those, an odd one passing up unchanged.
pub fn tree(mut v: Vec<Vec<f32>>) -> Vec<f32> {
    while v.len() > 1 {
        let mut next = Vec::with_capacity(v.len().div_ceil(2));
        let mut it = v.into_iter();
        while let Some(mut a) = it.next() {
            if let Some(b) = it.next() {
                let [dot, aa, bb] = dots(&a, &b);
                combine(&mut a, &b, dot, aa, bb);
            }
            next.push(a);
        }
        v = next;
    }
    v.pop().unwrap_or_default()
}

/// The segment rank `rank` holds after `levels` halvings of `0..n`.
fn segment(n: usize, rank: usize, levels: u32) -> Range<usize> {
    let (mut lo, mut hi) = (0, n);
    for k in 0..levels {
        let mid = lo + (hi - lo) / 2;
        if rank >> k & 1 == 0 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    lo..hi
}

impl Kolo {
    /// Combines an f32 `tensor` over all ranks with Adasum (see the module): Horovod's
    /// vector-halving form at a power-of-two number of ranks, a gather and the same
    /// tree elsewhere. Blocking; every rank calls it with the same name and shape. The
    /// result is the same on every rank; one rank: the tensor as it is.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a tensor that is not f32 on the host; a failed
    /// collective or point-to-point transfer.
    pub fn adasum_allreduce(&self, name: &str, tensor: Tensor) -> Result<Tensor> {
        if tensor.dtype() != DType::F32 || tensor.device().is_cuda() {
            return Err(Error::InvalidArgument {
                op: "adasum_allreduce",
                name: name.to_string(),
                message: format!(
                    "Adasum combines f32 tensors on the host; this one is {:?} on {}",
                    tensor.dtype(),
                    tensor.device()
                ),
            });
        }
        let size = self.size();
        if size == 1 {
            return Ok(tensor);
        }
        let shape = tensor.shape().to_vec();
        if !size.is_power_of_two() {
            let all = self
                .allgather(format!("{name}.adasum.all"), tensor)
                .wait()?
                .into_vec::<f32>()?;
            let n = all.len() / size;
            let v = all.chunks(n.max(1)).map(<[f32]>::to_vec).collect();
            return Tensor::from_vec(tree(v), &shape);
        }
        let rank = self.rank();
        let mut x = tensor.into_vec::<f32>()?;
        let n = x.len();
        let levels = size.trailing_zeros();
        for k in 0..levels {
            self.adasum_level(name, &mut x, k)?;
        }
        // Each rank's segment of the result, gathered in rank order and placed.
        let own = segment(n, rank, levels);
        let piece = x[own.clone()].to_vec();
        let len = piece.len();
        let all = self
            .allgather(
                format!("{name}.adasum.result"),
                Tensor::from_vec(piece, &[len])?,
            )
            .wait()?
            .into_vec::<f32>()?;
        let mut out = vec![0.0f32; n];
        let mut at = 0;
        for r in 0..size {
            let s = segment(n, r, levels);
            let end = at + s.len();
            out[s].copy_from_slice(&all[at..end]);
            at = end;
        }
        Tensor::from_vec(out, &shape)
    }
}

impl Kolo {
    /// Level `k` of the vector halving: swap halves with `rank ^ 2^k`, sum the partial
    /// dot products over the ranks sharing the segment, combine this rank's half.
    fn adasum_level(&self, name: &str, x: &mut [f32], k: u32) -> Result<()> {
        let rank = self.rank();
        let n = x.len();
        let partner = rank ^ (1 << k);
        let keep = segment(n, rank, k + 1);
        let give = segment(n, partner, k + 1);
        let tag = format!("{name}.adasum.{k}");
        let half = x[give.clone()].to_vec();
        let sent = self
            .send(&tag, Tensor::from_vec(half, &[give.len()])?, partner)
            .submit()?;
        let theirs = self.recv(&tag, partner).wait()?.into_vec::<f32>()?;
        sent.wait()?;
        // `a` is the lower group's half (bit k clear), `b` the upper's.
        let lower = rank >> k & 1 == 0;
        let mine = &mut x[keep];
        let d = if lower {
            dots(mine, &theirs)
        } else {
            dots(&theirs, mine)
        };
        // Summed over the 2^(k+1) ranks that share the segment.
        let all = self
            .allgather(
                format!("{name}.adasum.dots.{k}"),
                Tensor::from_vec(d.to_vec(), &[3])?,
            )
            .wait()?
            .into_vec::<f64>()?;
        let group = rank >> (k + 1);
        let mut sum = [0.0f64; 3];
        for (r, d) in all.chunks(3).enumerate() {
            if r >> (k + 1) == group {
                sum.iter_mut().zip(d).for_each(|(s, v)| *s += v);
            }
        }
        let [dot, aa, bb] = sum;
        if lower {
            combine(mine, &theirs, dot, aa, bb);
        } else {
            let mut a = theirs;
            combine(&mut a, mine, dot, aa, bb);
            mine.copy_from_slice(&a);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orthogonal_sum_equal_value() {
        assert_eq!(tree(vec![vec![1.0, 0.0], vec![0.0, 2.0]]), vec![1.0, 2.0]);
        assert_eq!(
            tree(vec![vec![3.0, -1.0], vec![3.0, -1.0]]),
            vec![3.0, -1.0]
        );
        // Zero vectors pass the other through.
        assert_eq!(tree(vec![vec![0.0, 0.0], vec![1.5, 2.0]]), vec![1.5, 2.0]);
    }

    #[test]
    fn segments_tile() {
        for n in [0, 1, 5, 17] {
            for levels in 0..4u32 {
                let mut seen = vec![0; n];
                for r in 0..1usize << levels {
                    for i in segment(n, r, levels) {
                        seen[i] += 1;
                    }
                }
                assert!(
                    seen.iter().all(|&c| c == 1),
                    "n {n} levels {levels}: {seen:?}"
                );
            }
        }
    }
}
