//! Which variables a rank holds, in an order every rank agrees on, and the check that
//! every rank holds the same ones.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use candle_core::{Tensor, TensorId, Var};
use candle_nn::VarMap;
use kolo::Kolo;

use crate::error::{Error, Result};

/// One variable as the ranks compare it: name (empty where only the creation order
/// identifies it), shape, dtype.
pub(crate) type Described = (String, Vec<usize>, String);

/// `t` as the ranks compare it.
pub(crate) fn describe(name: &str, t: &Tensor) -> Described {
    (
        name.to_string(),
        t.dims().to_vec(),
        t.dtype().as_str().to_string(),
    )
}

/// The number candle gave `v`'s tensor when it was created: candle numbers every
/// tensor from one process-wide counter, so variables built by the same code on every
/// rank come in the same relative order, whatever ran before. `TensorId` has no
/// accessor or ordering; its `Debug` form (`TensorId(17)`) carries the number (a unit
/// test holds it to that).
pub(crate) fn creation_number(v: &Var) -> Option<usize> {
    let text = format!("{:?}", v.as_tensor().id());
    text.strip_prefix("TensorId(")?
        .strip_suffix(')')?
        .parse()
        .ok()
}

/// The names of the variables kolo-candle has seen in a `VarMap` (by
/// [`broadcast_parameters`](crate::broadcast_parameters) or
/// [`DistributedOptimizer::from_varmap`](crate::DistributedOptimizer::from_varmap)),
/// by tensor id: a `Var` alone carries no name. Ids are never reused in a process.
fn names() -> std::sync::MutexGuard<'static, HashMap<TensorId, String>> {
    static NAMES: OnceLock<Mutex<HashMap<TensorId, String>>> = OnceLock::new();
    NAMES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// `varmap`'s variables with their names, sorted by name (the same order on every
/// rank that holds the same names), remembered for [`with_names`].
///
/// # Errors
/// The `VarMap`'s lock is poisoned.
pub(crate) fn named_vars(what: &'static str, varmap: &VarMap) -> Result<Vec<(String, Var)>> {
    let mut vars: Vec<(String, Var)> = {
        let data = varmap.data().lock().map_err(|_| Error::InvalidArgument {
            what,
            message: "the VarMap's lock is poisoned (a thread panicked while holding it)".into(),
        })?;
        data.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
    };
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut known = names();
    for (n, v) in &vars {
        known.insert(v.as_tensor().id(), n.clone());
    }
    Ok(vars)
}

/// `vars` (in creation order) with the name of each where known (empty where not);
/// when every name is known, sorted by name instead, so that ranks that created the
/// same variables in different orders (from a `HashMap`, say) still pair each
/// variable with its namesake.
pub(crate) fn with_names(vars: Vec<Var>) -> (Vec<Var>, Vec<String>) {
    let known = names();
    let mut named: Vec<(String, Var)> = vars
        .into_iter()
        .map(|v| {
            let n = known.get(&v.as_tensor().id()).cloned().unwrap_or_default();
            (n, v)
        })
        .collect();
    drop(known);
    if named.iter().all(|(n, _)| !n.is_empty()) {
        named.sort_by(|a, b| a.0.cmp(&b.0));
    }
    named.into_iter().map(|(n, v)| (v, n)).unzip()
}

/// `vars` in creation order, each once (candle's `VarMap::all_vars` lists them in a
/// hash map's order, which differs between processes).
pub(crate) fn in_creation_order(what: &'static str, vars: Vec<Var>) -> Result<Vec<Var>> {
    let mut numbered = Vec::with_capacity(vars.len());
    for v in vars {
        let n = creation_number(&v).ok_or_else(|| Error::InvalidArgument {
            what,
            message: format!(
                "cannot read the creation number of a variable from candle's {:?}; this candle version is not supported",
                v.as_tensor().id()
            ),
        })?;
        numbered.push((n, v));
    }
    numbered.sort_by_key(|(n, _)| *n);
    numbered.dedup_by_key(|(n, _)| *n);
    Ok(numbered.into_iter().map(|(_, v)| v).collect())
}

/// Fails on every rank when the ranks' lists differ, naming the first differing
/// variable and what each rank holds there. `key` names the exchange (unique per call
/// site).
pub(crate) fn agree(
    kolo: &Kolo,
    what: &'static str,
    key: &str,
    mine: Vec<Described>,
) -> Result<()> {
    let all: Vec<Vec<Described>> = kolo.allgather_object(key, mine)?;
    match first_difference(&all) {
        None => Ok(()),
        Some(detail) => Err(Error::Mismatch { what, detail }),
    }
}

/// The first variable (by position) where some rank's list differs from rank 0's, with
/// what every rank holds there; `None` when all lists are equal.
pub(crate) fn first_difference(all: &[Vec<Described>]) -> Option<String> {
    let first = all.first()?;
    let at = all
        .iter()
        .filter_map(|l| (0..l.len().max(first.len())).find(|&i| l.get(i) != first.get(i)))
        .min()?;
    let label = |d: Option<&Described>| match d {
        Some((name, _, _)) if !name.is_empty() => format!("\"{name}\""),
        _ => format!("#{at} in creation order"),
    };
    let var = all
        .iter()
        .find_map(|l| l.get(at).filter(|d| !d.0.is_empty()))
        .map_or_else(|| label(None), |d| label(Some(d)));
    // Ranks grouped by what they hold at `at`, in rank order of first appearance.
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (rank, l) in all.iter().enumerate() {
        let held = match l.get(at) {
            Some((name, shape, dtype)) if name.is_empty() => format!("{shape:?} {dtype}"),
            Some((name, shape, dtype)) => format!("\"{name}\" {shape:?} {dtype}"),
            None => format!("no such variable (it has {})", l.len()),
        };
        match groups.iter_mut().find(|(h, _)| *h == held) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((held, vec![rank])),
        }
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(held, ranks)| {
            let who = if ranks.len() == 1 { "rank" } else { "ranks" };
            let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
            format!(
                "{who} {} hold{} {held}",
                list.join(", "),
                if ranks.len() == 1 { "s" } else { "" }
            )
        })
        .collect();
    Some(format!("variable {var}: {}", parts.join("; ")))
}

/// `vars` in creation order with their names, after every rank agreed on them under
/// `tag` (what both the optimizer wrapper and 1-bit Adam check first).
///
/// # Errors
/// As [`in_creation_order`] and [`agree`].
pub(crate) fn agreed(
    kolo: &Kolo,
    what: &'static str,
    tag: &str,
    vars: Vec<Var>,
) -> Result<(Vec<Var>, Vec<String>)> {
    let (vars, names) = with_names(in_creation_order(what, vars)?);
    let described = vars
        .iter()
        .zip(&names)
        .map(|(v, n)| describe(n, v.as_tensor()))
        .collect();
    agree(kolo, what, tag, described)?;
    Ok((vars, names))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn d(name: &str, shape: &[usize]) -> Described {
        (name.into(), shape.to_vec(), "f32".into())
    }

    #[test]
    fn names_the_first_difference_and_the_ranks() {
        let a = vec![d("", &[4, 2]), d("", &[2])];
        let b = vec![d("", &[4, 2]), d("", &[3])];
        assert_eq!(first_difference(&[a.clone(), a.clone()]), None);
        assert_eq!(
            first_difference(&[a.clone(), a.clone(), b]).as_deref(),
            Some("variable #1 in creation order: ranks 0, 1 hold [2] f32; rank 2 holds [3] f32")
        );
        assert_eq!(
            first_difference(&[a.clone(), a[..1].to_vec()]).as_deref(),
            Some("variable #1 in creation order: rank 0 holds [2] f32; rank 1 holds no such variable (it has 1)")
        );
        let named = vec![d("fc.weight", &[4, 2])];
        let renamed = vec![d("fc.w", &[4, 2])];
        assert_eq!(
            first_difference(&[named, renamed]).as_deref(),
            Some("variable \"fc.weight\": rank 0 holds \"fc.weight\" [4, 2] f32; rank 1 holds \"fc.w\" [4, 2] f32")
        );
    }

    #[test]
    fn creation_numbers_follow_creation() {
        let a = Var::zeros(3, DType::F32, &Device::Cpu).expect("var");
        let b = Var::zeros(3, DType::F32, &Device::Cpu).expect("var");
        let (na, nb) = (creation_number(&a), creation_number(&b));
        assert!(
            na.is_some() && nb.is_some(),
            "candle's TensorId Debug form changed"
        );
        assert!(na < nb);
        let sorted =
            in_creation_order("test", vec![b.clone(), a.clone(), b.clone()]).expect("order");
        assert_eq!(sorted.len(), 2);
        assert_eq!(sorted[0].as_tensor().id(), a.as_tensor().id());
    }
}
