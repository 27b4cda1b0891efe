//! Issue 57's algorithms on candle: ByteGrad and Adasum as the way
//! [`DistributedOptimizer`](crate::DistributedOptimizer) reduces gradients, and
//! decentralized weight averaging ([`decentralized_average`]). The algorithms are
//! kolo's (`kolo::algorithms`), shared with kolo-burn.

use candle_core::{DType, Tensor, Var};
use kolo::algorithms::WeightAverager;
use kolo::{Algorithm, Kolo, ReduceOp};

use crate::error::{Error, Result};

const WHAT: &str = "kolo_candle::DistributedOptimizer::algorithm";

/// Reduces every gradient of `grads` (kolo tensors, one per variable) with
/// `algorithm` as one flat f32 buffer, divided by `passes`: each variable's result,
/// or the exchange's error.
///
/// # Errors
/// On every rank alike, before any exchange (the ranks' variables agree): a gradient
/// that is not f32.
pub(crate) fn reduce_flat(
    kolo: &Kolo,
    algorithm: Algorithm,
    op: ReduceOp,
    passes: usize,
    grads: Vec<kolo::Tensor>,
) -> Result<kolo::Result<Vec<kolo::Tensor>>> {
    // Named in candle's terms here; kolo would refuse it too, by member index.
    if let Some((i, t)) = grads
        .iter()
        .enumerate()
        .find(|(_, t)| t.dtype() != kolo::DType::F32)
    {
        return Err(Error::InvalidArgument {
            what: WHAT,
            message: format!(
                "{algorithm} reduces f32 gradients; variable {i}'s is {:?} (use the \
                 default allreduce)",
                t.dtype()
            ),
        });
    }
    let prescale = 1.0 / passes.max(1) as f32;
    let name = format!("kolo_candle.{algorithm}");
    Ok(kolo.algorithm_allreduce(&name, algorithm, op, prescale, grads))
}

/// Decentralized SGD's exchange (Bagua's, [`Algorithm::Decentralized`]): averages
/// the values of `vars` with this step's peer — `(mine + peer's) / 2`, the peer at
/// distance 2^(step mod ⌈log2 N⌉) — point to point, no collective. Every rank calls
/// it with the same variables (in the same order) and step.
/// [`DistributedOptimizer`](crate::DistributedOptimizer) set to
/// [`Algorithm::Decentralized`] calls it after each step.
///
/// # Errors
/// A variable that cannot be read or written as f32; a failed exchange (a peer with
/// another number of values is named).
pub fn decentralized_average(kolo: &Kolo, vars: &[Var], step: u64) -> Result<()> {
    let flat = read_flat(vars)?;
    let n = flat.len();
    let mixed = kolo
        .decentralized_average(
            "kolo_candle.decentralized",
            step,
            kolo::Tensor::from_vec(flat, &[n])?,
        )?
        .into_vec::<f32>()?;
    write_flat(vars, &mixed)
}

/// One exchange of `averager` over the values of `vars` (or, with `finish`, its
/// completion).
pub(crate) fn average_weights(
    kolo: &Kolo,
    averager: &mut WeightAverager,
    vars: &[Var],
    finish: bool,
) -> Result<()> {
    let mut flat = read_flat(vars)?;
    let name = "kolo_candle.averaging";
    let changed = if finish {
        averager.finish(kolo, name, &mut flat)?
    } else {
        averager.after_step(kolo, name, &mut flat)?
    };
    if !changed {
        return Ok(());
    }
    write_flat(vars, &flat)
}

/// The values of `vars` as one f32 vector, in order.
pub(crate) fn read_flat(vars: &[Var]) -> Result<Vec<f32>> {
    let mut flat = Vec::new();
    for v in vars {
        flat.extend(
            v.as_tensor()
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?,
        );
    }
    Ok(flat)
}

/// Sets `vars` from `values` (read by [`read_flat`]), each in its own dtype.
pub(crate) fn write_flat(vars: &[Var], values: &[f32]) -> Result<()> {
    let mut at = 0;
    for v in vars {
        let t = v.as_tensor();
        let len = t.elem_count();
        let fresh =
            Tensor::from_slice(&values[at..at + len], t.dims(), t.device())?.to_dtype(t.dtype())?;
        at += len;
        v.set(&fresh)?;
    }
    Ok(())
}
