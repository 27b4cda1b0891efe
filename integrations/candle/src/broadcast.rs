//! Every rank starts from the root's weights.

use candle_nn::VarMap;
use kolo::Kolo;

use crate::convert::{check_dtype, from_kolo, to_kolo};
use crate::error::{Error, Result};
use crate::vars::{agree, describe, named_vars};

const WHAT: &str = "kolo_candle::broadcast_parameters";

/// Sets every variable of `varmap` to rank `root`'s value (candle draws initial
/// weights at random per process). Call it on every rank after the model is built,
/// before training. Variables are matched by name; every rank must hold the same
/// names, shapes and dtypes, or every rank gets [`Error::Mismatch`] naming the first
/// difference. The variables' tensors are updated in place, so a model and optimizer
/// built on `varmap` see the new values.
///
/// # Errors
/// `root` is not a rank; the variables differ across ranks; a dtype kolo does not
/// carry; a rank left.
pub fn broadcast_parameters(kolo: &Kolo, varmap: &VarMap, root: usize) -> Result<()> {
    if root >= kolo.size() {
        return Err(Error::InvalidArgument {
            what: WHAT,
            message: format!(
                "root {root} is not a rank (the job has {} ranks)",
                kolo.size()
            ),
        });
    }
    let vars = named_vars(WHAT, varmap)?;
    let described = vars
        .iter()
        .map(|(n, v)| describe(n, v.as_tensor()))
        .collect();
    agree(
        kolo,
        WHAT,
        "kolo_candle.broadcast_parameters.vars",
        described,
    )?;
    for (name, v) in &vars {
        check_dtype(WHAT, name, v.dtype())?;
    }
    // Every broadcast in flight at once; all are waited for before any error returns,
    // so no name stays pending.
    let mut handles = Vec::with_capacity(vars.len());
    for (name, v) in &vars {
        let t = to_kolo(WHAT, name, v.as_tensor())?;
        handles.push(
            kolo.broadcast(format!("kolo_candle.param.{name}"), t, root)
                .submit()
                .map_err(|e| Error::Kolo(e.into()))?,
        );
    }
    let mut first_error = None;
    for ((_, v), h) in vars.iter().zip(handles) {
        let result = h
            .wait()
            .map_err(Error::from)
            .and_then(|t| from_kolo(t, v.device()))
            .and_then(|t| Ok(v.set(&t)?));
        if let Err(e) = result {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}
