//! Averaging metrics across ranks for logging (framework-free: kolo-burn and
//! kolo-candle re-export it).

use crate::{Kolo, ReduceOp, Result, Tensor};

/// Weighted averages of `values` over all ranks, weighting each rank by `weight`
/// (e.g. its number of samples). Every rank gets the result; log it on rank 0.
/// Every rank must call it with the same `name` and the same number of values.
///
/// # Errors
/// The allreduce fails, or ranks pass different numbers of values (a shape mismatch
/// naming the ranks).
pub fn average_metrics(kolo: &Kolo, name: &str, values: &[f64], weight: f64) -> Result<Vec<f64>> {
    let mut v: Vec<f64> = values.iter().map(|x| x * weight).collect();
    v.push(weight);
    let n = v.len();
    let sums = kolo
        .allreduce(format!("kolo.metrics.{name}"), Tensor::from_vec(v, &[n])?)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f64>()?;
    let total = sums[n - 1];
    Ok(sums[..n - 1]
        .iter()
        .map(|s| if total > 0.0 { s / total } else { 0.0 })
        .collect())
}
