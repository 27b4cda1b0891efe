//! Allreduces that run on a helper thread over the engine's own collectives rather
//! than as one engine op: [`ReduceOp::Adasum`] (point to point vector halving) and
//! compressed ones (`Compression::ByteGrad`'s two quantised phases, or a cast to
//! f16/bf16 and back). The handle completes when the thread is done; the engine never
//! sees the op itself, only the collectives it is made of (each under the op's name
//! and a suffix), so the ranks still pair them by name.

use super::ReduceOptions;
use crate::compression::{compress, decompress, Compression};
use crate::error::{Error, Result};
use crate::handle::{self, Handle, Output};
use crate::runtime::Kolo;
use crate::submit_error::SubmitError;
use crate::tensor::{DType, Tensor};
use crate::vocab::ReduceOp;

/// Starts the allreduce on a helper thread.
///
/// # Errors
/// A process set that refused this rank, an empty name, Adasum with a compression:
/// with the tensor handed back.
pub(super) fn submit(
    kolo: &Kolo,
    refused: Option<String>,
    name: String,
    tensor: Tensor,
    reduce: ReduceOptions,
    compression: Compression,
) -> Result<Handle<Tensor>, SubmitError> {
    let refuse = |message: String, tensor: Tensor| {
        let e = Error::InvalidArgument {
            op: "allreduce",
            name: name.clone(),
            message,
        };
        Err(SubmitError::new(e, vec![tensor]))
    };
    if let Some(message) = refused {
        return refuse(message, tensor);
    }
    if name.is_empty() {
        return refuse("tensor names must not be empty".into(), tensor);
    }
    if reduce.op == ReduceOp::Adasum && compression != Compression::None {
        return refuse(
            format!("ReduceOp::Adasum with {compression:?} compression is not supported"),
            tensor,
        );
    }
    let kolo = kolo.clone();
    let (handle, done) = handle::untracked("allreduce", kolo.rank(), handle::to_tensor);
    std::thread::Builder::new()
        .name("kolo-allreduce".into())
        .spawn(move || {
            let result = run(&kolo, &name, tensor, reduce, compression);
            done.complete(result.map(Output::Tensor));
        })
        .map_err(|e| {
            SubmitError::new(
                Error::Internal(format!("starting the allreduce's helper thread: {e}")),
                Vec::new(),
            )
        })?;
    Ok(handle)
}

/// The allreduce itself, blocking.
fn run(
    kolo: &Kolo,
    name: &str,
    tensor: Tensor,
    reduce: ReduceOptions,
    compression: Compression,
) -> Result<Tensor> {
    let ReduceOptions {
        op,
        prescale: pre,
        postscale: post,
    } = reduce;
    match (op, compression) {
        (ReduceOp::Adasum, _) => {
            let t = scaled(name, tensor, pre)?;
            scaled(name, kolo.adasum_allreduce(name, t)?, post)
        }
        (_, Compression::ByteGrad) => {
            let t = scaled(name, tensor, pre)?;
            scaled(name, kolo.bytegrad_allreduce(name, t, op)?, post)
        }
        (_, c) => {
            let dtype = tensor.dtype();
            let wire = compress(tensor, c)?;
            let out = kolo
                .allreduce(name, wire)
                .op(op)
                .prescale(pre)
                .postscale(post)
                .wait()?;
            decompress(out, dtype)
        }
    }
}

/// `t` (f32) multiplied by `factor`.
fn scaled(name: &str, t: Tensor, factor: f64) -> Result<Tensor> {
    if factor == 1.0 {
        return Ok(t);
    }
    if t.dtype() != DType::F32 {
        return Err(Error::InvalidArgument {
            op: "allreduce",
            name: name.to_string(),
            message: format!(
                "Adasum and ByteGrad reduce f32 tensors; this one is {:?}",
                t.dtype()
            ),
        });
    }
    let shape = t.shape().to_vec();
    let f = factor as f32;
    let v: Vec<f32> = t.into_vec::<f32>()?.into_iter().map(|x| x * f).collect();
    Tensor::from_vec(v, &shape)
}
