//! The arithmetic of the segmented ring allreduce: which chunk moves at which step,
//! and the local sum of a received segment into the buffer. The messages themselves
//! are sent by the MPI transport.
//!
//! Reduce-scatter then allgather around the ring `rank → rank+1`: in reduce-scatter
//! step `s` rank `r` sends chunk `(r - s) mod n` and adds the chunk `(r - s - 1) mod n`
//! it receives; after `n - 1` steps rank `r` holds the full sum of chunk
//! `(r + 1) mod n`, which the allgather passes around. Every chunk is summed in the
//! same order on every rank, so all ranks end with bit-identical results.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::tensor::DType;

/// Element range `[start, end)` of chunk `c` of `len` elements split `n` ways.
pub(crate) fn chunk(len: usize, n: usize, c: usize) -> (usize, usize) {
    let base = len / n;
    let extra = len % n;
    let start = c * base + c.min(extra);
    (start, start + base + usize::from(c < extra))
}

/// The chunk rank `r` sends at reduce-scatter step `s` (it receives the one before).
pub(crate) fn send_chunk(r: usize, s: usize, n: usize) -> usize {
    (r + n - s % n) % n
}

/// `acc += incoming`, elementwise, for raw bytes of `dtype` (f16/bf16 in f32).
pub(crate) fn add_into(acc: &mut [u8], incoming: &[u8], dtype: DType) {
    macro_rules! add {
        ($t:ty) => {{
            let a: &mut [$t] = bytemuck::cast_slice_mut(acc);
            let b: &[$t] = bytemuck::cast_slice(incoming);
            a.iter_mut()
                .zip(b)
                .for_each(|(x, y)| *x = x.wrapping_add_like(*y));
        }};
    }
    match dtype {
        DType::F32 => {
            let a: &mut [f32] = bytemuck::cast_slice_mut(acc);
            let b: &[f32] = bytemuck::cast_slice(incoming);
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
        DType::F64 => {
            let a: &mut [f64] = bytemuck::cast_slice_mut(acc);
            let b: &[f64] = bytemuck::cast_slice(incoming);
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
        DType::U8 => add!(u8),
        DType::I8 => add!(i8),
        DType::I32 => add!(i32),
        DType::I64 => add!(i64),
        DType::F16 => add_half::<f16>(acc, incoming),
        DType::BF16 => add_half::<bf16>(acc, incoming),
    }
}

/// Integer addition that wraps, as MPI_SUM does on overflow in practice.
trait WrappingAddLike: Copy {
    fn wrapping_add_like(self, other: Self) -> Self;
}

macro_rules! wrapping {
    ($($t:ty),*) => {$(
        impl WrappingAddLike for $t {
            fn wrapping_add_like(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
        }
    )*};
}
wrapping!(u8, i8, i32, i64);

fn add_half<T>(acc: &mut [u8], incoming: &[u8])
where
    T: bytemuck::Pod,
    [T]: HalfFloatSliceExt,
{
    const BLOCK: usize = 1024;
    let a: &mut [T] = bytemuck::cast_slice_mut(acc);
    let b: &[T] = bytemuck::cast_slice(incoming);
    let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (a, b) in a.chunks_mut(BLOCK).zip(b.chunks(BLOCK)) {
        let n = a.len();
        a.convert_to_f32_slice(&mut x[..n]);
        b.convert_to_f32_slice(&mut y[..n]);
        x[..n].iter_mut().zip(&y[..n]).for_each(|(x, y)| *x += y);
        a.convert_from_f32_slice(&x[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer() {
        let parts: Vec<_> = (0..3).map(|c| chunk(10, 3, c)).collect();
        assert_eq!(parts, [(0, 4), (4, 7), (7, 10)]);
        assert_eq!(chunk(2, 4, 3), (2, 2));
    }

    #[test]
    fn every_rank_ends_owning_a_different_chunk() {
        let n = 4;
        // After n-1 steps rank r last received chunk send_chunk(r-1, n-2) = (r+1) mod n.
        let owned: Vec<usize> = (0..n)
            .map(|r| send_chunk((r + n - 1) % n, n - 2, n))
            .collect();
        assert_eq!(owned, [1, 2, 3, 0]);
    }

    #[test]
    fn sums_per_dtype() {
        let mut a = vec![1i32, -2, 3];
        add_into(
            bytemuck::cast_slice_mut(&mut a),
            bytemuck::cast_slice(&[10i32, 20, 30]),
            DType::I32,
        );
        assert_eq!(a, [11, 18, 33]);
        let mut h = vec![f16::from_f32(1.5); 3];
        add_into(
            bytemuck::cast_slice_mut(&mut h),
            bytemuck::cast_slice(&[f16::from_f32(2.0); 3]),
            DType::F16,
        );
        assert!(h.iter().all(|x| x.to_f32() == 3.5));
    }
}
