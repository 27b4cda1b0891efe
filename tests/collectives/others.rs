//! Allgather, broadcast, alltoall and reducescatter.

use anyhow::{ensure, Result};
use kolo::{DType, Kolo, ReduceOp, Tensor};

use crate::util::*;

/// Rank r sends ones·r with a per-rank dim 0; slice i of the output is all i.
pub(crate) fn allgather(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let dim0 = |r: usize| [3, 1, 4, 2][r % 4];
    for dtype in DTYPES {
        for shape in shapes() {
            let mut s = shape.clone();
            s[0] = dim0(rank);
            let n: usize = s.iter().product();
            let name = format!("ag.{dtype:?}.{}", shape.len());
            let out = k
                .allgather(&name, tensor(dtype, &vec![rank as f64; n], &s)?)
                .wait()?;
            let total: usize = (0..size).map(dim0).sum();
            ensure!(
                out.shape()[0] == total && out.shape()[1..] == shape[1..],
                "{name}: shape {:?}",
                out.shape()
            );
            let row: usize = shape[1..].iter().product();
            let vals = to_f64(&out)?;
            let mut at = 0;
            for r in 0..size {
                let len = dim0(r) * row;
                ensure!(
                    vals[at..at + len].iter().all(|&x| x == r as f64),
                    "{name}: slice {r} is not all {r}"
                );
                at += len;
            }
        }
    }
    if size > 1 {
        let t = Tensor::zeros(DType::F32, &[2, 3 + rank]);
        expect_err(
            "ag dim1",
            k.allgather("ag.err.dim", t).wait(),
            &[
                "shape mismatch",
                "rank 0 sent [2, 3]",
                "rank 1 sent [2, 4]",
                "all dims but the first",
            ],
        )?;
        let dtype = if rank == 0 { DType::F32 } else { DType::F64 };
        expect_err(
            "ag dtype",
            k.allgather("ag.err.dtype", Tensor::zeros(dtype, &[2]))
                .wait(),
            &["dtype mismatch", "rank 0 sent f32"],
        )?;
    }
    expect_err(
        "ag scalar",
        k.allgather("ag.scalar", Tensor::zeros(DType::F32, &[]))
            .submit(),
        &["0-d"],
    )?;
    Ok(())
}

/// For every root: the output equals the root's tensor. Errors for shape, dtype and
/// root mismatch, and a root out of range.
pub(crate) fn broadcast(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for root in 0..size {
        for dtype in DTYPES {
            for shape in shapes() {
                let n: usize = shape.iter().product();
                let mine = values(dtype, n, size, &mut Rng::new(rank as u64 * 1000 + 5));
                let roots = values(dtype, n, size, &mut Rng::new(root as u64 * 1000 + 5));
                let name = format!("bc.{root}.{dtype:?}.{}", shape.len());
                let out = k
                    .broadcast(&name, tensor(dtype, &mine, &shape)?, root)
                    .wait()?;
                ensure!(out.shape() == shape.as_slice(), "{name}: shape");
                assert_close(&name, dtype, &to_f64(&out)?, &roots)?;
            }
        }
    }
    if size > 1 {
        let t = Tensor::zeros(DType::F32, &[2 + rank]);
        expect_err(
            "bc shape",
            k.broadcast("bc.err.shape", t, 0).wait(),
            &["shape mismatch", "rank 0 sent [2]", "rank 1 sent [3]"],
        )?;
        let dtype = if rank == 0 { DType::I64 } else { DType::F32 };
        expect_err(
            "bc dtype",
            k.broadcast("bc.err.dtype", Tensor::zeros(dtype, &[2]), 0)
                .wait(),
            &["dtype mismatch"],
        )?;
        // Each rank names itself as root.
        expect_err(
            "bc root",
            k.broadcast("bc.err.root", Tensor::zeros(DType::F32, &[2]), rank)
                .wait(),
            &["root mismatch", "rank 0 sent root 0", "rank 1 sent root 1"],
        )?;
    }
    expect_err(
        "bc range",
        k.broadcast("bc.range", Tensor::zeros(DType::F32, &[2]), size)
            .submit(),
        &["root", "out of range"],
    )?;
    Ok(())
}

/// Rank r sends value i, (r+1) rows, to each rank i: every rank receives only its own
/// rank, and received_splits == [1..=size]. Equal splits without `splits`.
pub(crate) fn alltoall(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for dtype in DTYPES {
        for shape in shapes() {
            let row: usize = shape[1..].iter().product();
            let mut s = shape.clone();
            s[0] = (rank + 1) * size;
            let v: Vec<f64> = (0..size)
                .flat_map(|i| vec![i as f64; (rank + 1) * row])
                .collect();
            let name = format!("a2a.{dtype:?}.{}", shape.len());
            let out = k
                .alltoall(&name, tensor(dtype, &v, &s)?)
                .splits(vec![rank + 1; size])
                .wait()?;
            let want_splits: Vec<usize> = (1..=size).collect();
            ensure!(
                out.received_splits == want_splits,
                "{name}: splits {:?}",
                out.received_splits
            );
            ensure!(
                out.tensor.shape()[0] == want_splits.iter().sum::<usize>(),
                "{name}: shape {:?}",
                out.tensor.shape()
            );
            ensure!(
                to_f64(&out.tensor)?.iter().all(|&x| x == rank as f64),
                "{name}: received values are not all {rank}"
            );
        }
    }
    let v: Vec<f64> = (0..size).flat_map(|i| vec![i as f64; 2]).collect();
    let out = k
        .alltoall("a2a.equal", tensor(DType::F32, &v, &[2 * size])?)
        .wait()?;
    ensure!(
        out.received_splits == vec![2; size],
        "equal splits {:?}",
        out.received_splits
    );
    ensure!(
        to_f64(&out.tensor)?.iter().all(|&x| x == rank as f64),
        "equal split values"
    );

    let t = Tensor::zeros(DType::F32, &[2 * size]);
    let mut bad = vec![1; size];
    bad[0] += 2 * size;
    expect_err(
        "a2a sum",
        k.alltoall("a2a.err.sum", t.clone()).splits(bad).submit(),
        &["sum to", "dim 0 of the tensor is"],
    )?;
    expect_err(
        "a2a len",
        k.alltoall("a2a.err.len", t)
            .splits(vec![1; size + 1])
            .submit(),
        &["entries", "ranks"],
    )?;
    if size > 1 {
        let t = Tensor::zeros(DType::F32, &[size + 1]);
        expect_err(
            "a2a divisible",
            k.alltoall("a2a.err.div", t).submit(),
            &["not divisible"],
        )?;
    }
    expect_err(
        "a2a scalar",
        k.alltoall("a2a.scalar", Tensor::zeros(DType::F32, &[]))
            .submit(),
        &["0-d"],
    )?;
    Ok(())
}

/// Input [4·size]^d with Sum: rank r gets rows [4r, 4r+4) times size; uneven dim 0
/// gives the first ranks one extra row.
pub(crate) fn reducescatter(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for dtype in DTYPES {
        for dims in 1..=3 {
            let shape = vec![4 * size; dims];
            let n: usize = shape.iter().product();
            let row = n / (4 * size);
            // Every rank its own values for the sum; the same ones for the average.
            let of = |r: usize| values(dtype, n, size, &mut Rng::new(11 + 7919 * r as u64));
            let mut sum = vec![0.0; n];
            for r in 0..size {
                for (s, x) in sum.iter_mut().zip(of(r)) {
                    *s += x;
                }
            }
            let name = format!("rs.{dtype:?}.{dims}");
            let out = k
                .reducescatter(&name, tensor(dtype, &of(rank), &shape)?)
                .op(ReduceOp::Sum)
                .wait()?;
            let mut want_shape = shape.clone();
            want_shape[0] = 4;
            ensure!(
                out.shape() == want_shape.as_slice(),
                "{name}: shape {:?}",
                out.shape()
            );
            let want = &sum[4 * rank * row..4 * (rank + 1) * row];
            assert_close(&name, dtype, &to_f64(&out)?, want)?;
            let v = of(0);

            let name = format!("rs.avg.{dtype:?}.{dims}");
            let out = k.reducescatter(&name, tensor(dtype, &v, &shape)?).wait()?;
            assert_close(
                &name,
                dtype,
                &to_f64(&out)?,
                &v[4 * rank * row..4 * (rank + 1) * row],
            )?;
        }
    }
    // Uneven: dim 0 = 2·size + 1 rows of 3.
    let d0 = 2 * size + 1;
    let v: Vec<f64> = (0..d0 * 3).map(|i| i as f64).collect();
    let out = k
        .reducescatter("rs.uneven", tensor(DType::F64, &v, &[d0, 3])?)
        .op(ReduceOp::Sum)
        .wait()?;
    let rows = |r: usize| 2 + usize::from(r == 0);
    let start: usize = (0..rank).map(rows).sum();
    ensure!(
        out.shape() == [rows(rank), 3],
        "uneven shape {:?}",
        out.shape()
    );
    let want: Vec<f64> = v[start * 3..(start + rows(rank)) * 3]
        .iter()
        .map(|x| x * size as f64)
        .collect();
    assert_close("rs.uneven", DType::F64, &to_f64(&out)?, &want)?;
    // Scale factors (also at one rank, where the input is its own block): 0.5 before
    // the sum, 3 after.
    let out = k
        .reducescatter("rs.scaled", tensor(DType::F64, &v, &[d0, 3])?)
        .op(ReduceOp::Sum)
        .prescale(0.5)
        .postscale(3.0)
        .wait()?;
    let want: Vec<f64> = want.iter().map(|x| x * 1.5).collect();
    assert_close("rs.scaled", DType::F64, &to_f64(&out)?, &want)?;

    expect_err(
        "rs scalar",
        k.reducescatter("rs.scalar", Tensor::zeros(DType::F32, &[]))
            .submit(),
        &["0-d"],
    )?;
    if size > 1 {
        let t = Tensor::zeros(DType::F32, &[4 * size + rank]);
        expect_err(
            "rs shape",
            k.reducescatter("rs.err", t).wait(),
            &["shape mismatch"],
        )?;
    }
    Ok(())
}

/// Across hosts with `KOLO_HIERARCHICAL_ALLGATHER=1`: the allgather cases above, and
/// large gathers whose sizes differ per rank (odd, one empty, shares of a host's
/// block not aligned to ranks), each element checked; the same bytes as flat.
pub(crate) fn hierarchical_allgather(k: &Kolo) -> Result<()> {
    allgather(k)?;
    crate::fusion::allgather_async(k)?;
    let (rank, size) = (k.rank(), k.size());
    for (round, base) in [1usize, 3, 77_777, 300_001].into_iter().enumerate() {
        let rows = |r: usize| {
            if r == 1 && round == 2 {
                0
            } else {
                base + r * 13
            }
        };
        let value = |r: usize, i: usize| ((r * 7_919 + i * 31 + round) % 65_521) as f32;
        let mine: Vec<f32> = (0..rows(rank)).map(|i| value(rank, i)).collect();
        let got: Vec<f32> = k
            .allgather(
                format!("hag.{round}"),
                Tensor::from_vec(mine, &[rows(rank)])?,
            )
            .wait()?
            .into_vec()?;
        let want: Vec<f32> = (0..size)
            .flat_map(|r| (0..rows(r)).map(move |i| value(r, i)))
            .collect();
        ensure!(
            got.len() == want.len(),
            "hag.{round}: {} elements, want {}",
            got.len(),
            want.len()
        );
        if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
            return Err(anyhow::anyhow!(
                "hag.{round}: element {i} is {}, want {}",
                got[i],
                want[i]
            ));
        }
    }
    Ok(())
}

/// Reduce-scatters large enough for the ring (256 KiB and up on one host), every
/// dtype, uneven rows and a row length that is not a multiple of the ranks, Sum and
/// Average: each rank gets its rows of the sum, the same bits everywhere.
pub(crate) fn large_reducescatter(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    for dtype in DTYPES {
        let cols = ((600 << 10) / (dtype.size_of() * (2 * size + 1))) | 1;
        let d0 = 2 * size + 1;
        let n = d0 * cols;
        let of = |r: usize| values(dtype, n, size, &mut Rng::new(5 + 131 * r as u64));
        let mut sum = vec![0.0; n];
        for r in 0..size {
            for (s, x) in sum.iter_mut().zip(of(r)) {
                *s += x;
            }
        }
        let rows = |r: usize| 2 + usize::from(r == 0);
        let start: usize = (0..rank).map(rows).sum::<usize>() * cols;
        let mine = start..start + rows(rank) * cols;
        let name = format!("rs.large.{dtype:?}");
        let out = k
            .reducescatter(&name, tensor(dtype, &of(rank), &[d0, cols])?)
            .op(ReduceOp::Sum)
            .wait()?;
        ensure!(
            out.shape() == [rows(rank), cols],
            "{name}: shape {:?}",
            out.shape()
        );
        assert_close(&name, dtype, &to_f64(&out)?, &sum[mine.clone()])?;
        let name = format!("rs.large.avg.{dtype:?}");
        let v = of(0);
        let out = k
            .reducescatter(&name, tensor(dtype, &v, &[d0, cols])?)
            .wait()?;
        assert_close(&name, dtype, &to_f64(&out)?, &v[mine])?;
    }
    Ok(())
}

/// Ranks with nothing to receive or send: an alltoall whose rows all go to rank 0
/// (every other rank receives none), a reducescatter of fewer rows than ranks (the
/// last ranks get empty blocks), an allgather where rank 1 adds no rows. An empty
/// buffer's dangling address (0x1) is Open MPI's `MPI_IN_PLACE`: before kolo gave
/// empty buffers a real address, the alltoall failed with MPI_ERR_ARG on the ranks
/// receiving nothing while rank 0 waited in it for ever.
pub(crate) fn empty_buffers(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let mut splits = vec![0usize; size];
    splits[0] = 3;
    let got = k
        .alltoall(
            "empty.alltoall",
            Tensor::from_vec(vec![rank as u8; 3], &[3])?,
        )
        .splits(splits)
        .wait()?;
    let want_rows = if rank == 0 { 3 * size } else { 0 };
    ensure!(
        got.tensor.shape() == [want_rows],
        "rank {rank}: alltoall shape {:?}",
        got.tensor.shape()
    );
    if rank == 0 {
        let want: Vec<u8> = (0..size).flat_map(|r| [r as u8; 3]).collect();
        ensure!(
            got.tensor.as_slice::<u8>()? == want,
            "rank 0 received {:?}",
            got.tensor
        );
    }
    let rows = size - 1;
    let rs = k
        .reducescatter(
            "empty.rs",
            Tensor::from_vec(vec![1.0f32; rows * 2], &[rows, 2])?,
        )
        .op(ReduceOp::Sum)
        .wait()?;
    let mine = usize::from(rank < rows);
    ensure!(
        rs.shape() == [mine, 2] && rs.as_slice::<f32>()?.iter().all(|v| *v == size as f32),
        "rank {rank}: reducescatter gave {rs:?}"
    );
    let n = if rank == 1 { 0 } else { 2 };
    let ag = k
        .allgather("empty.ag", Tensor::from_vec(vec![rank as i32; n], &[n])?)
        .wait()?;
    ensure!(
        ag.len() == 2 * (size - 1),
        "rank {rank}: allgather gave {ag:?}"
    );
    // Empty tensors everywhere: allreduce, grouped allreduce, broadcast, allgather,
    // and a send/recv pair.
    let empty = || Tensor::from_vec(Vec::<f32>::new(), &[0]);
    let ar = k.allreduce("empty.ar", empty()?).wait()?;
    ensure!(ar.shape() == [0], "rank {rank}: allreduce gave {ar:?}");
    let g = k
        .grouped_allreduce(vec![
            ("empty.g0".to_string(), empty()?),
            (
                "empty.g1".to_string(),
                Tensor::from_vec(vec![1.0f32], &[1])?,
            ),
        ])
        .op(ReduceOp::Sum)
        .wait()?;
    ensure!(
        g[0].shape() == [0] && g[1].as_slice::<f32>()? == [size as f32],
        "rank {rank}: grouped allreduce gave {g:?}"
    );
    let b = k.broadcast("empty.bc", empty()?, 0).wait()?;
    ensure!(b.shape() == [0], "rank {rank}: broadcast gave {b:?}");
    let a = k.allgather("empty.ag0", empty()?).wait()?;
    ensure!(
        a.shape() == [0],
        "rank {rank}: allgather of nothing gave {a:?}"
    );
    if rank < 2 {
        let other = 1 - rank;
        let sent = k.send("empty.p2p", empty()?, other).submit()?;
        let got = k.recv("empty.p2p", other).wait()?;
        sent.wait()?;
        ensure!(got.shape() == [0], "rank {rank}: recv gave {got:?}");
    }
    Ok(())
}
