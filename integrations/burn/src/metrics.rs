//! Averaging metrics across ranks for logging: the core's [`kolo::average_metrics`]
//! with kolo-burn's error type.

use kolo::Kolo;

use crate::error::Result;

/// Weighted averages of `values` over all ranks, weighting each rank by `weight`
/// (e.g. its number of samples). Every rank gets the result; log it on rank 0.
///
/// # Errors
/// The allreduce fails, or ranks pass different numbers of values.
pub fn average_metrics(kolo: &Kolo, name: &str, values: &[f64], weight: f64) -> Result<Vec<f64>> {
    Ok(kolo::average_metrics(kolo, name, values, weight)?)
}
