//! Issue 39: grouped allgather and reducescatter (negotiated together; the small
//! members of a dtype moved in one collective, large ones on their own), against the
//! single ops on the same data.

use anyhow::{ensure, Result};
use kolo::{DType, Kolo, ReduceOp, Tensor};

use crate::util::*;

/// A group's members listed in another order on odd ranks (a list built from a
/// `HashMap`): the results still come back in each caller's own order.
fn maybe_reversed(
    rank: usize,
    mut members: Vec<(String, Tensor)>,
) -> (Vec<(String, Tensor)>, bool) {
    let reversed = rank % 2 == 1;
    if reversed {
        members.reverse();
    }
    (members, reversed)
}

/// Members of three dtypes, per-rank dim 0, one member above the fusion limit: each
/// output equals the single allgather of the same tensor.
pub(crate) fn grouped_allgather(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let rows = |r: usize| r % 3 + 1;
    let member = |name: &str, r: usize| -> Result<(String, Tensor)> {
        let t = match name {
            "ga.a" => Tensor::from_vec(
                (0..rows(r) * 3).map(|j| (r * 100 + j) as f32).collect(),
                &[rows(r), 3],
            )?,
            "ga.b" => Tensor::from_vec(vec![r as i64; 2], &[2])?,
            "ga.c" => Tensor::from_vec(vec![r as f32 + 0.5; 4], &[1, 2, 2])?,
            "ga.d" => Tensor::from_vec(vec![r as f64; 3], &[3])?,
            // 20 000 floats per row: above the 64 KiB fusion limit on its own.
            _ => Tensor::from_vec(vec![r as f32; rows(r) * 20_000], &[rows(r), 20_000])?,
        };
        Ok((name.to_string(), t))
    };
    let names = ["ga.a", "ga.b", "ga.c", "ga.d", "ga.e"];
    let mine: Vec<(String, Tensor)> = names
        .iter()
        .map(|n| member(n, rank))
        .collect::<Result<_>>()?;
    let (list, reversed) = maybe_reversed(rank, mine);
    let mut out = k.grouped_allgather(list).wait()?;
    if reversed {
        out.reverse();
    }
    ensure!(out.len() == names.len(), "{} outputs", out.len());
    for (name, got) in names.iter().zip(&out) {
        let single = k
            .allgather(format!("single.{name}"), member(name, rank)?.1)
            .wait()?;
        ensure!(
            got.shape() == single.shape() && got.dtype() == single.dtype(),
            "{name}: shape {:?} {:?}, alone {:?} {:?}",
            got.shape(),
            got.dtype(),
            single.shape(),
            single.dtype()
        );
        ensure!(
            to_f64(got)? == to_f64(&single)?,
            "{name}: the grouped result differs from the single allgather's"
        );
    }
    // Spot check: ga.b holds every rank's number twice, in rank order.
    let want: Vec<i64> = (0..size).flat_map(|r| [r as i64; 2]).collect();
    ensure!(
        out[1].as_slice::<i64>()? == want.as_slice(),
        "ga.b {:?}",
        out[1]
    );

    if size > 1 {
        // A member whose trailing dims differ: every rank gets the error, naming it.
        let bad = vec![
            ("gm.a".to_string(), Tensor::zeros(DType::F32, &[2, 3])),
            (
                "gm.b".to_string(),
                Tensor::zeros(DType::F32, &[1, 2 + rank.min(1)]),
            ),
        ];
        expect_err(
            "group member shape",
            k.grouped_allgather(bad).wait(),
            &[
                "shape mismatch",
                "member \"gm.b\"",
                "rank 0 sent [1, 2]",
                if size == 2 {
                    "rank 1 sent [1, 3]"
                } else {
                    "ranks 1, 2"
                },
            ],
        )?;
    }
    expect_err(
        "empty group",
        k.grouped_allgather(vec![]).submit(),
        &["at least one tensor"],
    )?;
    expect_err(
        "0-d member",
        k.grouped_allgather(vec![("s".into(), Tensor::from_vec(vec![1.0f32], &[])?)])
            .submit(),
        &["member \"s\" is 0-d"],
    )?;
    Ok(())
}

/// Members of three dtypes, dim 0 not a multiple of the ranks, one member above the
/// fusion limit; Sum, and Average with scale factors: each output equals the single
/// reducescatter of the same tensor with the same options.
pub(crate) fn grouped_reducescatter(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let member = |name: &str| -> Result<(String, Tensor)> {
        let r = rank as f64 + 1.0;
        let t = match name {
            "gr.a" => Tensor::from_vec((0..10).map(|j| (j as f64 * r) as f32).collect(), &[5, 2])?,
            "gr.b" => Tensor::from_vec(
                (0..(2 * size + 1) as i32)
                    .map(|j| j * (rank as i32 + 1))
                    .collect(),
                &[2 * size + 1],
            )?,
            "gr.c" => Tensor::from_vec(vec![r; 6], &[3, 2])?,
            "gr.d" => Tensor::from_vec(vec![r as f32; 7], &[7])?,
            // 4 000 × 3 f64: 96 000 bytes, above the fusion limit.
            _ => Tensor::from_vec((0..12_000).map(|j| j as f64 + r).collect(), &[4_000, 3])?,
        };
        Ok((name.to_string(), t))
    };
    let names = ["gr.a", "gr.b", "gr.c", "gr.d", "gr.e"];
    for (round, (op, pre, post)) in [(ReduceOp::Sum, 1.0, 1.0), (ReduceOp::Average, 2.0, 0.5)]
        .into_iter()
        .enumerate()
    {
        let mine: Vec<(String, Tensor)> = names.iter().map(|n| member(n)).collect::<Result<_>>()?;
        let (list, reversed) = maybe_reversed(rank, mine);
        let mut out = k
            .grouped_reducescatter(list)
            .op(op)
            .prescale(pre)
            .postscale(post)
            .wait()?;
        if reversed {
            out.reverse();
        }
        ensure!(out.len() == names.len(), "{} outputs", out.len());
        for (name, got) in names.iter().zip(&out) {
            let single = k
                .reducescatter(format!("single.{round}.{name}"), member(name)?.1)
                .op(op)
                .prescale(pre)
                .postscale(post)
                .wait()?;
            ensure!(
                got.shape() == single.shape() && got.dtype() == single.dtype(),
                "{name} ({op:?}): shape {:?}, alone {:?}",
                got.shape(),
                single.shape()
            );
            let (a, b) = (to_f64(got)?, to_f64(&single)?);
            ensure!(
                a.iter()
                    .zip(&b)
                    .all(|(x, y)| (x - y).abs() <= 1e-9 * y.abs().max(1.0)),
                "{name} ({op:?}): grouped {a:?}, alone {b:?}"
            );
        }
    }
    // Spot check: gr.c sums to (1 + … + size) everywhere; rank r keeps its rows.
    let out = k
        .grouped_reducescatter(vec![member("gr.c")?])
        .op(ReduceOp::Sum)
        .wait()?;
    let tri = (size * (size + 1) / 2) as f64;
    ensure!(
        to_f64(&out[0])?.iter().all(|&x| x == tri),
        "gr.c {:?}",
        out[0]
    );
    if size > 1 {
        let bad = vec![
            ("gs.a".to_string(), Tensor::zeros(DType::F32, &[4])),
            (
                "gs.b".to_string(),
                Tensor::zeros(if rank == 0 { DType::F32 } else { DType::F64 }, &[4]),
            ),
        ];
        expect_err(
            "group member dtype",
            k.grouped_reducescatter(bad).wait(),
            &["dtype mismatch", "member \"gs.b\"", "rank 0 sent f32"],
        )?;
    }
    Ok(())
}

/// Rank 1 lists one member more: each rank's group is keyed by its own member list,
/// so the groups would never match; every rank gets an error naming a shared member
/// and what each rank sent, for all three grouped ops, and the job goes on.
pub(crate) fn grouped_member_lists(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let members = |prefix: &str| {
        let mut v = vec![
            (format!("{prefix}.a"), Tensor::zeros(DType::F32, &[size])),
            (format!("{prefix}.b"), Tensor::zeros(DType::F32, &[size])),
        ];
        if rank == 1 {
            v.push((format!("{prefix}.c"), Tensor::zeros(DType::F32, &[size])));
        }
        v
    };
    let others: Vec<String> = (0..size)
        .filter(|&r| r != 1)
        .map(|r| r.to_string())
        .collect();
    let who = if others.len() == 1 { "rank" } else { "ranks" };
    for (prefix, result) in [
        ("ml1", k.grouped_allreduce(members("ml1")).wait()),
        ("ml2", k.grouped_allgather(members("ml2")).wait()),
        ("ml3", k.grouped_reducescatter(members("ml3")).wait()),
    ] {
        let want = format!(
            "group members mismatch: member \"{prefix}.a\" is in different groups: {who} {} sent [\"{prefix}.a\", \"{prefix}.b\"], rank 1 sent [\"{prefix}.a\", \"{prefix}.b\", \"{prefix}.c\"]",
            others.join(", ")
        );
        expect_err(prefix, result, &[&want])?;
    }
    let sum = k
        .allreduce("after", Tensor::from_vec(vec![1.0f32], &[1])?)
        .op(ReduceOp::Sum)
        .wait()?;
    ensure!(sum.as_slice::<f32>()? == [size as f32], "after: {sum:?}");
    Ok(())
}
