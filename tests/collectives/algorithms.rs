//! Issue 57's algorithms over real MPI: Adasum's vector-halving form (point to point
//! between partners) against the tree computed in one process, its defining cases,
//! decentralized averaging reaching the mean, ByteGrad within its bound.

use anyhow::{ensure, Result};
use kolo::algorithms::adasum_tree;
use kolo::{Kolo, ReduceOp, Tensor};

/// Rank `r`'s test vector of `n` values.
fn vector(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.37 + r as f32 * 1.3).sin() * (1.0 + r as f32)) * 0.01)
        .collect()
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Adasum: the same result on every rank, equal to the tree of pairs; mutually
/// orthogonal vectors add, equal vectors keep their value.
pub(crate) fn adasum(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let n = 1001;
    let got = k.adasum_allreduce("adasum.v", Tensor::from_vec(vector(rank, n), &[7, 143])?)?;
    ensure!(got.shape() == [7, 143], "shape {:?}", got.shape());
    let got = got.into_vec::<f32>()?;
    let want = adasum_tree((0..size).map(|r| vector(r, n)).collect());
    let w = worst(&got, &want);
    ensure!(w < 1e-6, "np {size}: differs from the tree by {w}");
    if size > 1 {
        let sum: Vec<f32> = (0..n)
            .map(|i| (0..size).map(|r| vector(r, n)[i]).sum())
            .collect();
        ensure!(
            worst(&want, &sum) > 1e-4,
            "Adasum equals the plain sum: the check proves nothing"
        );
    }
    let mut onehot = vec![0.0f32; size + 3];
    onehot[rank] = 1.0 + rank as f32;
    let got = k
        .adasum_allreduce("adasum.ortho", Tensor::from_vec(onehot, &[size + 3])?)?
        .into_vec::<f32>()?;
    let want: Vec<f32> = (0..size + 3)
        .map(|i| if i < size { 1.0 + i as f32 } else { 0.0 })
        .collect();
    ensure!(
        worst(&got, &want) < 1e-6,
        "orthogonal: {got:?}, want their sum {want:?}"
    );
    let same = vec![0.5f32, -1.0, 2.0, 4.0, 0.25];
    let got = k
        .adasum_allreduce("adasum.same", Tensor::from_vec(same.clone(), &[5])?)?
        .into_vec::<f32>()?;
    ensure!(worst(&got, &same) < 1e-6, "equal: {got:?}, want {same:?}");
    Ok(())
}

/// Decentralized averaging: after log2 N rounds (N a power of two) or 40, every rank
/// within 1e-6 of the mean of the starting vectors; each round moves data only
/// between pairs.
pub(crate) fn decentralized(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let n = 300;
    let rounds = if size.is_power_of_two() {
        u64::from(size.trailing_zeros())
    } else {
        40
    };
    let mut t = Tensor::from_vec(vector(rank, n), &[n])?;
    for step in 0..rounds {
        t = k.decentralized_average("decentralized.w", step, t)?;
    }
    let got = t.into_vec::<f32>()?;
    let mean: Vec<f32> = (0..n)
        .map(|i| (0..size).map(|r| vector(r, n)[i]).sum::<f32>() / size as f32)
        .collect();
    let w = worst(&got, &mean);
    ensure!(
        w < 1e-6,
        "np {size} rank {rank} after {rounds} rounds: {w} from the mean"
    );
    if size > 1 {
        // One round alone is not the mean: the rounds matter.
        let one = k
            .decentralized_average(
                "decentralized.once",
                0,
                Tensor::from_vec(vector(rank, n), &[n])?,
            )?
            .into_vec::<f32>()?;
        let far = worst(&one, &mean);
        ensure!(
            size == 2 || far > 1e-3,
            "np {size}: one round already reached the mean"
        );
    }
    Ok(())
}

/// ByteGrad: the same result on every rank, within the quantisation bound of the
/// exact average (loosely: each chunk's step is at most its whole vector's range
/// over 255), and not exact.
pub(crate) fn bytegrad(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let n = 4099;
    let got = k
        .bytegrad_allreduce(
            "bytegrad.g",
            Tensor::from_vec(vector(rank, n), &[n])?,
            ReduceOp::Average,
        )?
        .into_vec::<f32>()?;
    let all: Vec<Vec<f32>> = k.allgather_object("bytegrad.check", got.clone())?;
    ensure!(
        all.windows(2).all(|w| w[0] == w[1]),
        "the ranks' results differ"
    );
    let exact: Vec<f32> = (0..n)
        .map(|i| (0..size).map(|r| vector(r, n)[i]).sum::<f32>() / size as f32)
        .collect();
    let range = |v: &[f32]| {
        v.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            - v.iter().copied().fold(f32::INFINITY, f32::min)
    };
    let phase1: f32 = (0..size).map(|r| range(&vector(r, n)) / 255.0).sum::<f32>() / size as f32;
    let bound = phase1 / 2.0 + range(&exact) * 1.01 / 255.0 / 2.0 + phase1;
    let w = worst(&got, &exact);
    ensure!(w <= bound, "np {size}: error {w} beyond the bound {bound}");
    ensure!(
        size == 1 || w > 0.0,
        "np {size}: exact, so nothing was quantised"
    );
    Ok(())
}
