//! Allreduce and grouped allreduce: values per dtype and dims, ops, scaling,
//! asynchrony, and every error case on every rank.

use std::time::Duration;

use anyhow::{ensure, Result};
use kolo::{DType, Kolo, ReduceOp, Tensor};

use crate::util::*;

/// Sum and Average over every dtype and dims 1-3, every rank with its own values:
/// sum == Σ over ranks, average == that ÷ size (floats; integer averages are checked
/// on values equal on every rank, where the mean is exact).
pub(crate) fn sum_and_average(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for dtype in DTYPES {
        for shape in shapes() {
            let n: usize = shape.iter().product();
            let seed = |r: usize| 1234 + shape.len() as u64 + 7919 * r as u64;
            let of = |r: usize| values(dtype, n, size, &mut Rng::new(seed(r)));
            let v = of(rank);
            let mut sum = vec![0.0; n];
            for r in 0..size {
                for (s, x) in sum.iter_mut().zip(of(r)) {
                    *s += x;
                }
            }
            let name = format!("sum.{dtype:?}.{}", shape.len());
            let out = k
                .allreduce(&name, tensor(dtype, &v, &shape)?)
                .op(ReduceOp::Sum)
                .wait()?;
            ensure!(
                out.shape() == shape.as_slice() && out.dtype() == dtype,
                "{name}: shape/dtype changed"
            );
            assert_close(&name, dtype, &to_f64(&out)?, &sum)?;

            let name = format!("avg.{dtype:?}.{}", shape.len());
            let float = matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64);
            let (mine, want) = if float {
                (v, sum.iter().map(|s| s / size as f64).collect())
            } else {
                let same = of(0);
                (same.clone(), same)
            };
            let out = k.allreduce(&name, tensor(dtype, &mine, &shape)?).wait()?;
            assert_close(&name, dtype, &to_f64(&out)?, &want)?;
        }
    }
    Ok(())
}

/// Min, Max and Product: rank r contributes row r of a [size, 17] tensor that every
/// rank builds from the same seed.
pub(crate) fn min_max_product(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for dtype in DTYPES {
        let mut rng = Rng::new(99);
        let rows: Vec<Vec<f64>> = (0..size)
            .map(|_| match dtype {
                // Products of up to 4 values stay exact and in range.
                DType::U8 => (0..17).map(|_| rng.int(0, 4) as f64).collect(),
                _ => (0..17).map(|_| rng.int(-3, 4) as f64).collect(),
            })
            .collect();
        for (op, fold) in [
            (ReduceOp::Min, f64::min as fn(f64, f64) -> f64),
            (ReduceOp::Max, f64::max),
            (ReduceOp::Product, |a, b| a * b),
        ] {
            let want: Vec<f64> = (0..17)
                .map(|j| rows.iter().map(|r| r[j]).reduce(fold).unwrap_or(0.0))
                .collect();
            let name = format!("{op:?}.{dtype:?}");
            let out = k
                .allreduce(&name, tensor(dtype, &rows[rank], &[17])?)
                .op(op)
                .wait()?;
            assert_close(&name, dtype, &to_f64(&out)?, &want)?;
        }
    }
    Ok(())
}

/// Prescale and postscale: expected size·(factor·t), integers scaled in f64 and rounded.
pub(crate) fn scaling(k: &Kolo) -> Result<()> {
    let size = k.size() as f64;
    for dtype in DTYPES {
        // Half the usual range: a prescale of 2 must not overflow the small integer types.
        let v = values(dtype, 17 * 17, 2 * k.size(), &mut Rng::new(7));
        for (pre, post) in [(0.5, 1.0), (1.0, 0.25), (2.0, 0.5)] {
            let name = format!("scale.{dtype:?}.{pre}.{post}");
            let out = k
                .allreduce(&name, tensor(dtype, &v, &[17, 17])?)
                .op(ReduceOp::Sum)
                .prescale(pre)
                .postscale(post)
                .wait()?;
            let want: Vec<f64> = v
                .iter()
                .map(|x| {
                    if dtype.is_float() {
                        size * x * pre * post
                    } else {
                        ((x * pre).round() * size * post).round()
                    }
                })
                .collect();
            assert_close(&name, dtype, &to_f64(&out)?, &want)?;
        }
    }
    Ok(())
}

/// 50 async ops: rank 0 finds at least one not ready before waiting (the others
/// submit late), then every result is right.
pub(crate) fn asynchronous(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    if rank != 0 {
        std::thread::sleep(Duration::from_millis(300));
    }
    let mut handles = Vec::new();
    for i in 0..50 {
        let t = Tensor::from_vec(vec![i as f32; 100], &[100])?;
        handles.push((
            i,
            k.allreduce(format!("async.{i}"), t)
                .op(ReduceOp::Sum)
                .submit()?,
        ));
    }
    let not_ready = handles.iter().filter(|(_, h)| !h.poll()).count();
    if rank == 0 && size > 1 {
        ensure!(
            not_ready > 0,
            "every handle was ready right after submit: not asynchronous"
        );
    }
    for (i, h) in handles {
        let v: Vec<f32> = h.wait()?.into_vec()?;
        ensure!(
            v == vec![(i * size) as f32; 100],
            "async.{i}: got {:?}",
            &v[..3]
        );
    }
    // Handles are futures too.
    let fut = k
        .allreduce("async.future", Tensor::from_vec(vec![1i32], &[1])?)
        .op(ReduceOp::Sum)
        .submit()?;
    let v = block_on(fut)?.into_vec::<i32>()?;
    ensure!(v == [size as i32], "future result {v:?}");
    Ok(())
}

/// A minimal executor for one future: polls with a thread-unparking waker.
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(50));
    }
}

/// Cross-rank mismatches reach every rank with the ranks named; the engine keeps
/// working afterwards. Duplicate names fail on the submitting rank only.
pub(crate) fn errors(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    if size > 1 {
        let side = 17 + rank;
        let t = Tensor::zeros(DType::F32, &[side, side, side]);
        expect_err(
            "shape",
            k.allreduce("err.shape", t).wait(),
            &[
                "allreduce \"err.shape\": shape mismatch",
                "rank 0 sent [17, 17, 17]",
                "rank 1 sent [18, 18, 18]",
            ],
        )?;

        let t = if rank % 2 == 0 {
            Tensor::zeros(DType::F32, &[17, 23 * 57])
        } else {
            Tensor::zeros(DType::F32, &[17, 23, 57])
        };
        expect_err(
            "rank",
            k.allreduce("err.rank", t).wait(),
            &["shape mismatch", "sent [17, 1311]", "sent [17, 23, 57]"],
        )?;

        let dtype = if rank % 2 == 0 {
            DType::I32
        } else {
            DType::F32
        };
        // "rank 0" or "ranks 0, 2, 3": the ranks of 0..size that `keep` keeps.
        let ranks_where = |keep: &dyn Fn(usize) -> bool| {
            let ranks: Vec<String> = (0..size)
                .filter(|&r| keep(r))
                .map(|r| r.to_string())
                .collect();
            format!(
                "{} {}",
                if ranks.len() == 1 { "rank" } else { "ranks" },
                ranks.join(", ")
            )
        };
        let who = |parity: usize| ranks_where(&|r| r % 2 == parity);
        let want = format!("dtype mismatch: {} sent i32, {} sent f32", who(0), who(1));
        expect_err(
            "dtype",
            k.allreduce("err.dtype", Tensor::zeros(dtype, &[5])).wait(),
            &[&want],
        )?;

        // Every rank but 1 sends Sum.
        let others = ranks_where(&|r| r != 1);
        let op = if rank == 1 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        expect_err(
            "op",
            k.allreduce("err.op", Tensor::zeros(DType::F32, &[5]))
                .op(op)
                .wait(),
            &[&format!(
                "reduce op mismatch: {} sent Sum, rank 1 sent Max",
                others
            )],
        )?;

        let pre = if rank == 1 { 0.5 } else { 1.0 };
        expect_err(
            "prescale",
            k.allreduce("err.pre", Tensor::zeros(DType::F32, &[5]))
                .prescale(pre)
                .wait(),
            &["prescale mismatch", "sent 1, rank 1 sent 0.5"],
        )?;

        let t = Tensor::zeros(DType::F32, &[5]);
        let msg = if rank == 0 {
            expect_err("kind", k.allreduce("err.kind", t).wait(), &["op mismatch"])?
        } else {
            expect_err("kind", k.allgather("err.kind", t).wait(), &["op mismatch"])?
        };
        ensure!(msg.contains("rank 0 sent allreduce"), "{msg}");
    }

    // Duplicate name while the first is pending: an error on this rank only. The other
    // ranks submit late so that rank 0's first request is surely still pending.
    if rank != 0 {
        std::thread::sleep(Duration::from_millis(200));
    }
    let first = k
        .allreduce("err.dup", Tensor::zeros(DType::F32, &[3]))
        .submit()?;
    if rank == 0 && size > 1 {
        expect_err(
            "duplicate",
            k.allreduce("err.dup", Tensor::zeros(DType::F32, &[3]))
                .submit(),
            &["\"err.dup\"", "already pending on rank 0"],
        )?;
    }
    first.wait()?;
    // The name is free again once the first one is done.
    k.allreduce("err.dup", Tensor::zeros(DType::F32, &[3]))
        .wait()?;

    // And the engine still works.
    let v = k
        .allreduce("err.after", Tensor::from_vec(vec![1.0f64; 4], &[4])?)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f64>()?;
    ensure!(v == vec![size as f64; 4], "after errors: {v:?}");
    Ok(())
}

/// Grouped allreduce: mixed dtypes and shapes come back in order and correct, also
/// averaged with scale factors; a member shape mismatch fails the whole group on
/// every rank.
pub(crate) fn grouped(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let group = vec![
        (
            "g.a".to_string(),
            Tensor::from_vec(vec![1.0f32; 6], &[2, 3])?,
        ),
        (
            "g.b".to_string(),
            Tensor::from_vec(vec![rank as i64; 4], &[4])?,
        ),
        ("g.c".to_string(), Tensor::from_vec(vec![2.0f32; 5], &[5])?),
    ];
    let out = k.grouped_allreduce(group).op(ReduceOp::Sum).wait()?;
    ensure!(out.len() == 3, "{} outputs", out.len());
    ensure!(
        out[0].shape() == [2, 3] && out[0].as_slice::<f32>()? == vec![size as f32; 6].as_slice(),
        "g.a"
    );
    let tri = (size * (size - 1) / 2) as i64;
    ensure!(
        out[1].as_slice::<i64>()? == vec![tri; 4].as_slice(),
        "g.b {:?}",
        out[1]
    );
    ensure!(
        out[2].as_slice::<f32>()? == vec![2.0 * size as f32; 5].as_slice(),
        "g.c"
    );
    // Average with scale factors; two dtypes with several members each, so the
    // fused buffer is packed, reduced and unpacked twice in one op, and one member
    // too large to pack.
    let r = rank as f32 + 1.0;
    let group = vec![
        ("s.a".to_string(), Tensor::from_vec(vec![r; 3], &[3])?),
        (
            "s.b".to_string(),
            Tensor::from_vec(vec![2 * (rank as i32 + 1); 2], &[2])?,
        ),
        (
            "s.c".to_string(),
            Tensor::from_vec(vec![1.0f32; 300], &[3, 100])?,
        ),
        ("s.d".to_string(), Tensor::from_vec(vec![4i32; 5], &[5])?),
        // Above the fusion limit: reduced in place beside the packed small ones.
        (
            "s.e".to_string(),
            Tensor::from_vec(vec![r; 20_000], &[200, 100])?,
        ),
    ];
    let out = k
        .grouped_allreduce(group)
        .prescale(2.0)
        .postscale(0.5)
        .wait()?;
    let mean = (size + 1) as f32 / 2.0;
    ensure!(out[0].as_slice::<f32>()? == [mean; 3], "s.a {:?}", out[0]);
    let want_b = vec![size as i32 + 1; 2];
    ensure!(
        out[1].as_slice::<i32>()? == want_b.as_slice(),
        "s.b {:?}",
        out[1]
    );
    ensure!(
        out[2].shape() == [3, 100] && out[2].as_slice::<f32>()?.iter().all(|&x| x == 1.0),
        "s.c {:?}",
        out[2].shape()
    );
    ensure!(out[3].as_slice::<i32>()? == [4; 5], "s.d {:?}", out[3]);
    ensure!(
        out[4].shape() == [200, 100] && out[4].as_slice::<f32>()?.iter().all(|&x| x == mean),
        "s.e {:?}",
        out[4].shape()
    );
    if size > 1 {
        let group = vec![
            ("h.a".to_string(), Tensor::zeros(DType::F32, &[3])),
            ("h.b".to_string(), Tensor::zeros(DType::F32, &[3 + rank])),
        ];
        expect_err(
            "group shape",
            k.grouped_allreduce(group).wait(),
            &["shape mismatch", "rank 0 sent [3]", "rank 1 sent [4]"],
        )?;
    }
    expect_err(
        "empty group",
        k.grouped_allreduce(vec![]).submit(),
        &["at least one tensor"],
    )?;
    Ok(())
}

/// Across hosts with `KOLO_HIERARCHICAL_ALLREDUCE=1` (and left unset: hierarchical
/// from 2 MiB): integer-valued sums are exact (so equal to the flat allreduce's), and
/// for arbitrary floats every rank ends with the same bits. Sizes below, at and above
/// the ranks per host, odd ones, 2 and 4 MiB of f16 and f32 and above (hierarchical
/// when left unset too), a fused batch; f32, f64, f16, i32; Sum, Average, Max.
pub(crate) fn hierarchical(k: &Kolo) -> Result<()> {
    let (me, n) = (k.rank(), k.size());
    let mut rng = Rng::new(7 + me as u64);
    for (i, &len) in [1usize, 2, 3, 5, 1000, 4099, 1 << 20, (1 << 20) + 3]
        .iter()
        .enumerate()
    {
        // Exact: integer values, whose sums no order can round.
        let mine: Vec<f32> = (0..len).map(|j| ((me * 7 + j) % 13) as f32).collect();
        let got: Vec<f32> = k
            .allreduce(format!("h.exact.{i}"), Tensor::from_vec(mine, &[len])?)
            .op(ReduceOp::Sum)
            .wait()?
            .into_vec()?;
        for (j, g) in got.iter().enumerate() {
            let want: f32 = (0..n).map(|r| ((r * 7 + j) % 13) as f32).sum();
            ensure!(*g == want, "len {len} element {j}: {g} != {want}");
        }
        // Same bits everywhere for values whose sum depends on the order.
        for (dtype, op) in [
            (DType::F32, ReduceOp::Average),
            (DType::F64, ReduceOp::Sum),
            (DType::F16, ReduceOp::Sum),
            (DType::I32, ReduceOp::Max),
        ] {
            let v: Vec<f64> = (0..len)
                .map(|_| (rng.int(-1_000_000, 1_000_000) as f64) / 997.0)
                .collect();
            let out = k
                .allreduce(format!("h.bits.{i}.{dtype:?}"), tensor(dtype, &v, &[len])?)
                .op(op)
                .wait()?;
            let bits = out.as_bytes()?.to_vec();
            let all: Vec<Vec<u8>> = k.allgather_object(format!("h.check.{i}.{dtype:?}"), bits)?;
            ensure!(
                all.iter().all(|b| *b == all[0]),
                "len {len} {dtype:?} {op:?}: ranks ended with different bits"
            );
        }
    }
    // A fused batch of small tensors.
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let t = Tensor::from_vec(vec![(me + i) as f32; 3 + i], &[3 + i])?;
            Ok(k.allreduce(format!("h.fused.{i}"), t)
                .op(ReduceOp::Sum)
                .submit()?)
        })
        .collect::<Result<_>>()?;
    for (i, h) in handles.into_iter().enumerate() {
        let got: Vec<f32> = h.wait()?.into_vec()?;
        let want: f32 = (0..n).map(|r| (r + i) as f32).sum();
        ensure!(
            got.iter().all(|g| *g == want),
            "fused {i}: {got:?} != {want}"
        );
    }
    Ok(())
}
