//! Issue 57's algorithms on in-process ranks: ByteGrad within its quantisation bound,
//! Adasum's gathered tree, the ranks' agreement on the algorithm. (What moves point to
//! point — Adasum's vector halving, decentralized averaging — runs over MPI in
//! tests/collectives: the loopback transport has no point-to-point port.)

use super::{job, on_every_rank, values};
use crate::algorithms::{adasum_tree, part, quantize, Algorithm};
use crate::config::Config;
use crate::error::Error;
use crate::tensor::Tensor;
use crate::vocab::ReduceOp;

/// Rank `r`'s test vector of `n` values: smooth, different on every rank.
fn vector(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.37 + r as f32 * 1.3).sin() * (1.0 + r as f32)) * 0.01)
        .collect()
}

#[test]
fn bytegrad_average_within_its_bound() {
    for size in [2, 3, 4] {
        let n = 5000;
        let ranks = job(size, |_| Config::default());
        let outs = on_every_rank(&ranks, |r, k| {
            let t = Tensor::from_vec(vector(r, n), &[50, 100]).unwrap_or_else(|e| panic!("{e}"));
            let out = k
                .bytegrad_allreduce("g", t, ReduceOp::Average)
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
            assert_eq!(out.shape(), &[50, 100]);
            values(out)
        });
        assert!(
            outs.windows(2).all(|w| w[0] == w[1]),
            "np {size}: ranks differ"
        );
        let exact: Vec<f32> = (0..n)
            .map(|i| (0..size).map(|r| vector(r, n)[i]).sum::<f32>() / size as f32)
            .collect();
        // Each value's bound: half a step of its chunk in every rank's quantised
        // partition, over N, plus half a step of its chunk of the quantised mean
        // (whose extremes decode exactly, so the output gives that step).
        let mut worst = 0.0f32;
        for p in 0..size {
            let range = part(n, size, p);
            let phase1: Vec<f32> = (0..size)
                .map(|r| quantize::steps(&vector(r, n)[range.clone()]))
                .fold(
                    vec![0.0; range.len().div_ceil(quantize::CHUNK)],
                    |acc, s| acc.iter().zip(&s).map(|(a, b)| a + b).collect(),
                );
            let phase2 = quantize::steps(&outs[0][range.clone()]);
            for (j, i) in range.enumerate() {
                let c = j / quantize::CHUNK;
                let bound = phase1[c] / size as f32 / 2.0 + phase2[c] / 2.0 + 1e-7;
                let err = (outs[0][i] - exact[i]).abs();
                worst = worst.max(err / bound);
                assert!(
                    err <= bound,
                    "np {size} value {i}: error {err} > bound {bound}"
                );
            }
        }
        assert!(worst > 0.0, "np {size}: no quantisation error at all?");
    }
}

#[test]
fn bytegrad_refuses_other_dtypes_and_ops() {
    let ranks = job(2, |_| Config::default());
    let errs = on_every_rank(&ranks, |_, k| {
        let t = Tensor::from_vec(vec![1i32, 2], &[2]).unwrap_or_else(|e| panic!("{e}"));
        let a = k.bytegrad_allreduce("i", t, ReduceOp::Sum).unwrap_err();
        let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap_or_else(|e| panic!("{e}"));
        let b = k.bytegrad_allreduce("m", t, ReduceOp::Max).unwrap_err();
        (a.to_string(), b.to_string())
    });
    assert!(
        errs[0].0.contains("f32") && errs[0].0.contains("\"i\""),
        "{}",
        errs[0].0
    );
    assert!(errs[0].1.contains("Max"), "{}", errs[0].1);
}

#[test]
fn adasum_at_three_ranks_is_the_tree() {
    // 3 ranks: the gathered tree (the vector-halving form, point to point, runs
    // over MPI in tests/collectives: the loopback transport has no point to point).
    let n = 1001;
    let ranks = job(3, |_| Config::default());
    let outs = on_every_rank(&ranks, |r, k| {
        let t = Tensor::from_vec(vector(r, n), &[n]).unwrap_or_else(|e| panic!("{e}"));
        values(k.adasum_allreduce("g", t).unwrap_or_else(|e| panic!("{e}")))
    });
    let want = adasum_tree((0..3).map(|r| vector(r, n)).collect());
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o, &want, "rank {r}");
    }
}

#[test]
fn ranks_that_disagree_on_the_algorithm_are_named() {
    let ranks = job(3, |_| Config::default());
    let errs = on_every_rank(&ranks, |r, k| {
        let a = if r == 2 {
            Algorithm::ByteGrad
        } else {
            Algorithm::Allreduce
        };
        a.agree(k, "algo").unwrap_err()
    });
    for e in errs {
        assert!(matches!(e, Error::Mismatch { .. }), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("rank 2: bytegrad") && e.contains("rank 0: allreduce"),
            "{e}"
        );
    }
}
