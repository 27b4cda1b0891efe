//! Fusion and caching must not change results: many async allreduces of mixed dtypes,
//! ops and scale factors, checked against values computed here. The harness runs this
//! case under several KOLO_FUSION_THRESHOLD / KOLO_CACHE_CAPACITY settings.

use anyhow::{ensure, Result};
use kolo::{DType, Kolo, ReduceOp, Tensor};

use crate::util::*;

pub(crate) fn mixed_async(k: &Kolo) -> Result<()> {
    let size = k.size();
    for round in 0..3 {
        let mut handles = Vec::new();
        let mut expected = Vec::new();
        for i in 0..60 {
            let dtype = [DType::F32, DType::F64, DType::I32, DType::F16, DType::BF16][i % 5];
            let (op, pre, post) = match i % 3 {
                0 => (ReduceOp::Sum, 1.0, 1.0),
                1 => (ReduceOp::Average, 1.0, 1.0),
                _ => (ReduceOp::Sum, 0.5, 3.0),
            };
            // Sizes from 1 to ~3000 elements: some above a small threshold, most below.
            let n = 1 + (i * 53) % 3000;
            let v = values(dtype, n, 2 * size, &mut Rng::new(i as u64 + 100 * round));
            let want: Vec<f64> = v
                .iter()
                .map(|x| match op {
                    ReduceOp::Average => *x,
                    _ if dtype.is_float() => x * pre * size as f64 * post,
                    _ => ((x * pre).round() * size as f64 * post).round(),
                })
                .collect();
            let name = format!("mixed.{i}");
            let h = k
                .allreduce(&name, tensor(dtype, &v, &[n])?)
                .op(op)
                .prescale(pre)
                .postscale(post)
                .submit()?;
            handles.push((name, dtype, h));
            expected.push(want);
        }
        for ((name, dtype, h), want) in handles.into_iter().zip(expected) {
            let out = h.wait()?;
            ensure!(out.dtype() == dtype, "{name}: dtype changed");
            assert_close(&name, dtype, &to_f64(&out)?, &want)?;
        }
    }
    Ok(())
}

/// The same names every step, then one name changes shape: the new shape is
/// renegotiated on every rank and the results stay right.
pub(crate) fn shape_change(k: &Kolo) -> Result<()> {
    let size = k.size() as f32;
    for step in 0..20 {
        let n = if step < 10 { 8 } else { 12 };
        let handles = (0..10)
            .map(|i| {
                let t = Tensor::from_vec(vec![i as f32; n], &[n])?;
                Ok(k.allreduce(format!("steady.{i}"), t)
                    .op(ReduceOp::Sum)
                    .submit()?)
            })
            .collect::<Result<Vec<_>>>()?;
        for (i, h) in handles.into_iter().enumerate() {
            let v: Vec<f32> = h.wait()?.into_vec()?;
            ensure!(
                v == vec![i as f32 * size; n],
                "step {step} steady.{i}: {v:?}"
            );
        }
    }
    Ok(())
}

/// Sums large enough for the segmented ring (and sizes around chunk and segment
/// boundaries): exact for integers, equal on every rank for floats.
pub(crate) fn large_sums(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    // 32 MiB and up go through the ring; odd lengths exercise uneven chunks.
    for bytes in [32 << 20, (32 << 20) + 8 * (size + 1) + 4] {
        let n = bytes / 4;
        let v: Vec<i32> = (0..n)
            .map(|i| (i % 1000) as i32 * (rank as i32 + 1))
            .collect();
        let out = k
            .allreduce(format!("large.i32.{n}"), Tensor::from_vec(v, &[n])?)
            .op(ReduceOp::Sum)
            .wait()?;
        let tri = (size * (size + 1) / 2) as i32;
        ensure!(
            out.as_slice::<i32>()?
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (i % 1000) as i32 * tri),
            "i32 sum of {n} elements is wrong"
        );
        drop(out);
        let n = bytes / 8;
        let v: Vec<f64> = (0..n)
            .map(|i| (i as f64).sin() * (rank + 1) as f64)
            .collect();
        let out = k
            .allreduce(format!("large.f64.{n}"), Tensor::from_vec(v, &[n])?)
            .op(ReduceOp::Average)
            .wait()?;
        let got = out.as_slice::<f64>()?;
        let scale = (size + 1) as f64 / 2.0;
        ensure!(
            got.iter()
                .enumerate()
                .all(|(i, x)| (x - (i as f64).sin() * scale).abs() < 1e-9),
            "f64 average of {n} elements is wrong"
        );
        let bits: Vec<u64> = got.iter().step_by(97).map(|x| x.to_bits()).collect();
        let all = k.allgather_object(format!("large.bits.{n}"), bits)?;
        ensure!(
            all.iter().all(|b| b == &all[0]),
            "ranks hold different f64 sums"
        );
        drop(out);
        let n = bytes / 2;
        let v = vec![kolo::half::f16::from_f32(0.5); n];
        let out = k
            .allreduce(format!("large.f16.{n}"), Tensor::from_vec(v, &[n])?)
            .op(ReduceOp::Sum)
            .wait()?;
        ensure!(
            out.as_slice::<kolo::half::f16>()?
                .iter()
                .all(|x| x.to_f32() == 0.5 * size as f32),
            "f16 sum"
        );
    }
    Ok(())
}

/// Many small async allgathers whose dim 0 differs per rank (sometimes 0), two dtypes,
/// submitted in a per-rank shuffled order; every gathered row is checked. Run with
/// fusion on (they share one MPI_Allgatherv) and off, and with the response cache
/// (which stores every rank's request): odd-numbered tensors change their dim 0 every
/// round, so cached entries are hit and invalidated.
pub(crate) fn allgather_async(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let value =
        |r: usize, i: usize, row: usize, col: usize| (r * 1000 + i * 10 + row * 4 + col) as f64;
    for round in 0..4 {
        let rows = move |r: usize, i: usize| (r + i + round * (i % 2)) % 3;
        let mut order: Vec<usize> = (0..80).collect();
        Rng::new(7 + rank as u64 + 100 * round as u64).shuffle(&mut order);
        let mut handles = Vec::new();
        for &i in &order {
            let dtype = if i % 2 == 0 { DType::F32 } else { DType::I32 };
            let n = rows(rank, i);
            let v: Vec<f64> = (0..n * 4).map(|e| value(rank, i, e / 4, e % 4)).collect();
            let h = k
                .allgather(format!("ag.{i}"), tensor(dtype, &v, &[n, 4])?)
                .submit()?;
            handles.push((i, dtype, h));
        }
        for (i, dtype, h) in handles {
            let out = h.wait()?;
            let want: Vec<f64> = (0..size)
                .flat_map(|r| (0..rows(r, i) * 4).map(move |e| value(r, i, e / 4, e % 4)))
                .collect();
            ensure!(
                out.dtype() == dtype && out.shape() == [want.len() / 4, 4],
                "ag.{i}: {:?} {:?}",
                out.dtype(),
                out.shape()
            );
            assert_close(&format!("ag.{i}"), dtype, &to_f64(&out)?, &want)?;
        }
    }
    Ok(())
}

/// Repeated alltoalls whose splits differ per rank and, for odd-numbered names, change
/// every round: the response cache stores each rank's splits; every row is checked.
pub(crate) fn alltoall_repeated(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for round in 0..4 {
        // Rows rank `from` sends to rank `to` for name `j`.
        let split =
            move |from: usize, to: usize, j: usize| (from + 2 * to + j + round * (j % 2)) % 3;
        let mut handles = Vec::new();
        for j in 0..6 {
            let splits: Vec<usize> = (0..size).map(|to| split(rank, to, j)).collect();
            let v: Vec<f64> = (0..size)
                .flat_map(|to| {
                    (0..split(rank, to, j)).map(move |row| (rank * 100 + to * 10 + row) as f64)
                })
                .collect();
            let n = v.len();
            let h = k
                .alltoall(format!("a2a.{j}"), tensor(DType::I32, &v, &[n, 1])?)
                .splits(splits)
                .submit()?;
            handles.push((j, h));
        }
        for (j, h) in handles {
            let out = h.wait()?;
            let want: Vec<f64> = (0..size)
                .flat_map(|from| {
                    (0..split(from, rank, j)).map(move |row| (from * 100 + rank * 10 + row) as f64)
                })
                .collect();
            let got_splits: Vec<usize> = (0..size).map(|from| split(from, rank, j)).collect();
            ensure!(
                out.received_splits == got_splits,
                "a2a.{j}: splits {:?}",
                out.received_splits
            );
            assert_close(
                &format!("a2a.{j}"),
                DType::I32,
                &to_f64(&out.tensor)?,
                &want,
            )?;
        }
    }
    Ok(())
}

/// Many large async allreduces (above the fusion limit, so each is reduced in its own
/// buffer; across hosts with one rank each they go to the ring together) of mixed
/// dtypes, ops, scale factors and odd lengths, submitted in a per-rank shuffled order;
/// every element is checked, and the f32 sums' bits must agree on every rank.
pub(crate) fn large_async(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let mut rng = Rng::new(0x6a09_e667 + rank as u64);
    for round in 0..2 {
        let mut specs = Vec::new();
        for i in 0..24 {
            // 70 KiB .. 3 MiB of f32 and up, odd element counts for uneven chunks.
            let n = [17_923, 80_001, 400_003, 786_431][i % 4] + round;
            let dtype = [DType::F32, DType::F64, DType::I32, DType::F16][i % 4 / 2 + (i / 8) % 3];
            let (op, pre, post) = match i % 6 {
                0 | 3 => (ReduceOp::Sum, 1.0, 1.0),
                1 => (ReduceOp::Average, 1.0, 1.0),
                2 => (ReduceOp::Sum, 0.5, 4.0),
                4 => (ReduceOp::Max, 1.0, 1.0),
                _ => (ReduceOp::Sum, 2.0, 1.0),
            };
            specs.push((i, n, dtype, op, pre, post));
        }
        let mut order: Vec<usize> = (0..specs.len()).collect();
        rng.shuffle(&mut order);
        // Every rank's value at element j of tensor i: small even integers, so that
        // scaled integers and every sum are exact.
        let value = |r: usize, i: usize, j: usize| 2.0 * ((r * 7 + i * 3 + j) % 11) as f64 - 10.0;
        let mut handles = Vec::new();
        for &o in &order {
            let (i, n, dtype, op, pre, post) = specs[o];
            let v: Vec<f64> = (0..n).map(|j| value(rank, i, j)).collect();
            let h = k
                .allreduce(format!("big.{round}.{i}"), tensor(dtype, &v, &[n])?)
                .op(op)
                .prescale(pre)
                .postscale(post)
                .submit()?;
            handles.push((o, h));
        }
        // Checked in one order on every rank: the bit comparison is a collective.
        handles.sort_by_key(|(o, _)| *o);
        for (o, h) in handles {
            let (i, n, dtype, op, pre, post) = specs[o];
            let out = h.wait()?;
            ensure!(
                out.shape() == [n],
                "big.{round}.{i}: shape {:?}",
                out.shape()
            );
            let got = to_f64(&out)?;
            let want: Vec<f64> = (0..n)
                .map(|j| {
                    let each = (0..size).map(|r| value(r, i, j) * pre);
                    let x = match op {
                        ReduceOp::Max => each.fold(f64::MIN, f64::max),
                        ReduceOp::Average => each.sum::<f64>() / size as f64,
                        _ => each.sum(),
                    };
                    x * post
                })
                .collect();
            if dtype == DType::I32 {
                // Integers are scaled in f64 and rounded back.
                let want: Vec<f64> = want.iter().map(|x| x.round()).collect();
                assert_close(&format!("big.{round}.{i}"), dtype, &got, &want)?;
            } else {
                assert_close(&format!("big.{round}.{i}"), dtype, &got, &want)?;
            }
            if dtype == DType::F32 {
                let bits: Vec<u32> = out
                    .as_slice::<f32>()?
                    .iter()
                    .step_by(997)
                    .map(|x| x.to_bits())
                    .collect();
                let all = k.allgather_object(format!("big.bits.{round}.{i}"), bits)?;
                ensure!(
                    all.iter().all(|b| b == &all[0]),
                    "big.{round}.{i}: ranks hold different f32 sums"
                );
            }
        }
    }
    Ok(())
}
