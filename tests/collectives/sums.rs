//! Host sums by each way a flat sum can travel (`KOLO_ALLREDUCE_ALGORITHM` forces
//! one): exact integers, bit-identical floats on every rank, the half types, uneven
//! and tiny lengths (fewer elements than ranks), and the ops that are not sums.

use anyhow::{ensure, Result};
use kolo::{Kolo, ReduceOp, Tensor};

/// Sums of lengths 1 to 64 Ki + 5 elements in i32, f64, f16 and bf16, a max, and a
/// fused batch.
pub(crate) fn every_way(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let tri = (size * (size + 1) / 2) as i64;
    for n in [1usize, 2, 3, 5, 7, 1000, (1 << 16) + 5] {
        let v: Vec<i32> = (0..n)
            .map(|i| (i % 977) as i32 * (rank as i32 + 1) - 3)
            .collect();
        let out = k
            .allreduce(format!("sum.i32.{n}"), Tensor::from_vec(v, &[n])?)
            .op(ReduceOp::Sum)
            .wait()?;
        let want = |i: usize| (i % 977) as i64 * tri - 3 * size as i64;
        let got = out.as_slice::<i32>()?;
        ensure!(
            got.iter()
                .enumerate()
                .all(|(i, &x)| i64::from(x) == want(i)),
            "i32 sum of {n}: first wrong at {:?}",
            got.iter()
                .enumerate()
                .find(|(i, &x)| i64::from(x) != want(*i))
        );
        let v: Vec<f64> = (0..n).map(|i| ((i * (rank + 3)) as f64).sin()).collect();
        let out = k
            .allreduce(format!("sum.f64.{n}"), Tensor::from_vec(v, &[n])?)
            .op(ReduceOp::Average)
            .wait()?;
        let got = out.as_slice::<f64>()?;
        for (i, x) in got.iter().enumerate() {
            let want: f64 =
                (0..size).map(|r| ((i * (r + 3)) as f64).sin()).sum::<f64>() / size as f64;
            ensure!(
                (x - want).abs() < 1e-12,
                "f64 average of {n} at {i}: {x} vs {want}"
            );
        }
        let bits: Vec<u64> = got.iter().map(|x| x.to_bits()).collect();
        let all = k.allgather_object(format!("sum.bits.{n}"), bits)?;
        ensure!(
            all.iter().all(|b| b == &all[0]),
            "ranks hold different f64 sums of {n}"
        );
        let v = vec![kolo::half::f16::from_f32(0.25 * (rank + 1) as f32); n];
        let out = k
            .allreduce(format!("sum.f16.{n}"), Tensor::from_vec(v, &[n])?)
            .op(ReduceOp::Sum)
            .wait()?;
        let want = 0.25 * tri as f32;
        ensure!(
            out.as_slice::<kolo::half::f16>()?
                .iter()
                .all(|x| x.to_f32() == want),
            "f16 sum of {n}"
        );
        let v = vec![kolo::half::bf16::from_f32(rank as f32); n];
        let out = k
            .allreduce(format!("sum.bf16.{n}"), Tensor::from_vec(v, &[n])?)
            .op(ReduceOp::Sum)
            .wait()?;
        let want = (size * (size - 1) / 2) as f32;
        ensure!(
            out.as_slice::<kolo::half::bf16>()?
                .iter()
                .all(|x| x.to_f32() == want),
            "bf16 sum of {n}"
        );
        let v: Vec<f32> = (0..n).map(|i| ((i + rank) % size) as f32).collect();
        let out = k
            .allreduce(format!("max.{n}"), Tensor::from_vec(v, &[n])?)
            .op(ReduceOp::Max)
            .wait()?;
        let want = if size == 1 { 0.0 } else { (size - 1) as f32 };
        ensure!(
            out.as_slice::<f32>()?
                .iter()
                .enumerate()
                .all(|(i, &x)| if size == 1 {
                    x == (i % size) as f32
                } else {
                    x == want
                }),
            "max of {n}"
        );
    }
    // A fused batch: forty small sums submitted together.
    let mut handles = Vec::new();
    for t in 0..40 {
        let v = vec![(rank * 40 + t) as f32; 33 + t];
        let tensor = Tensor::from_vec(v, &[33 + t])?;
        handles.push(
            k.allreduce(format!("fused.{t}"), tensor)
                .op(ReduceOp::Sum)
                .submit()?,
        );
    }
    for (t, h) in handles.into_iter().enumerate() {
        let out = h.wait()?;
        let want = (0..size).map(|r| (r * 40 + t) as f32).sum::<f32>();
        ensure!(
            out.as_slice::<f32>()?.iter().all(|&x| x == want),
            "fused sum {t}"
        );
    }
    Ok(())
}
