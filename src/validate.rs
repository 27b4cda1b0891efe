//! Submit-time checks: a pure function of a submission and the number of ranks, run
//! on the submitting thread so that these errors are immediate and local (the checks
//! across ranks are in `engine::negotiate`).

use crate::engine::request::{OpKind, Submission, RESERVED_PREFIX};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::transport::{P2P_NAME_MAX, P2P_NDIM_MAX};

/// A broadcast root that is not a rank.
pub(crate) fn bad_root(op: &'static str, name: &str, root: usize, size: usize) -> Error {
    Error::InvalidArgument {
        op,
        name: name.into(),
        message: format!("root {root} is out of range: there are {size} ranks (0..{size})"),
    }
}

/// Submit-time checks: immediate errors on this rank only (README, "When something
/// goes wrong"); the checks across ranks are in `engine::negotiate`.
pub(crate) fn validate(s: &Submission, size: usize, rank: usize) -> Result<()> {
    if s.op == crate::vocab::ReduceOp::Adasum {
        return Err(invalid(
            s,
            "ReduceOp::Adasum runs as `Kolo::allreduce(name, t).op(ReduceOp::Adasum)` of one \
             f32 host tensor; a grouped allreduce or a reducescatter cannot take it"
                .into(),
        ));
    }
    if s.kind.is_p2p() {
        check_peer(s, size, rank).map_err(|m| invalid(s, m))?;
    }
    check_names(s)
        .and_then(|()| check_group(s))
        .and_then(|()| check_device(s))
        .and_then(|()| check_scales(s))
        .map_err(|m| invalid(s, m))?;
    if s.kind == OpKind::Broadcast && s.root >= size {
        return Err(bad_root(s.kind.name(), &s.key, s.root, size));
    }
    check_rows(s, size).map_err(|m| invalid(s, m))
}

/// The submit-time error of `s`: an invalid argument naming its op and key.
fn invalid(s: &Submission, message: String) -> Error {
    Error::InvalidArgument {
        op: s.kind.name(),
        name: s.key.to_string(),
        message,
    }
}

/// A send's or receive's other rank (a rank, not this one), its name's length and its
/// tensor's dimensions.
fn check_peer(s: &Submission, size: usize, rank: usize) -> std::result::Result<(), String> {
    let name = s.key.rsplit_once('@').map_or(&*s.key, |(n, _)| n);
    let tensor = s.tensors.first().map(|(_, t)| t);
    check_p2p(tensor, name, s.root, size, rank)
}

/// [`check_peer`] on its own parts, for a send or receive that is not made into a
/// submission (run on the caller's thread): a send's tensor (`None`: a receive), its
/// name (without the pair's ranks) and the other rank.
pub(crate) fn check_p2p(
    tensor: Option<&Tensor>,
    name: &str,
    peer: usize,
    size: usize,
    rank: usize,
) -> std::result::Result<(), String> {
    let role = if tensor.is_some() {
        "destination"
    } else {
        "source"
    };
    if peer >= size {
        return Err(format!(
            "{role} rank {peer} is out of range: there are {size} ranks (0..{size})"
        ));
    }
    if peer == rank {
        return Err(format!(
            "{role} rank {peer} is this rank; send and recv are between two ranks"
        ));
    }
    if name.is_empty() {
        return Err("the name must not be empty (both ranks must use the same name)".into());
    }
    if name.starts_with(RESERVED_PREFIX) {
        return Err(format!(
            "names starting with '{RESERVED_PREFIX}' are reserved for kolo's own keys; \
             rename it"
        ));
    }
    if name.len() > P2P_NAME_MAX {
        return Err(format!(
            "the name is {} bytes long; a send's or receive's name takes at most {P2P_NAME_MAX}",
            name.len()
        ));
    }
    if let Some(t) = tensor {
        if t.shape().len() > P2P_NDIM_MAX {
            return Err(format!(
                "the tensor has {} dimensions; send takes at most {P2P_NDIM_MAX}",
                t.shape().len()
            ));
        }
    }
    Ok(())
}

/// Names: not empty, not in kolo's reserved key space.
fn check_names(s: &Submission) -> std::result::Result<(), String> {
    if let Some((n, _)) = s
        .tensors
        .iter()
        .find(|(n, _)| n.starts_with(RESERVED_PREFIX))
    {
        return Err(format!(
            "tensor name {n:?}: names starting with '{}' are reserved for kolo's own \
             keys (join, barrier, groups); rename the tensor",
            RESERVED_PREFIX
        ));
    }
    if s.key.is_empty() || s.tensors.iter().any(|(n, _)| n.is_empty()) {
        return Err("tensor names must not be empty (every rank must use the same name)".into());
    }
    Ok(())
}

/// A group: at least one member, no name twice.
fn check_group(s: &Submission) -> std::result::Result<(), String> {
    if !matches!(
        s.kind,
        OpKind::GroupedAllreduce | OpKind::GroupedAllgather | OpKind::GroupedReducescatter
    ) {
        return Ok(());
    }
    if s.tensors.is_empty() {
        return Err("a group needs at least one tensor".into());
    }
    let mut seen =
        rustc_hash::FxHashSet::with_capacity_and_hasher(s.tensors.len(), Default::default());
    if let Some((n, _)) = s.tensors.iter().find(|(n, _)| !seen.insert(n)) {
        return Err(format!("the name {n:?} appears twice in the group"));
    }
    Ok(())
}

/// Every tensor of one op on one device.
fn check_device(s: &Submission) -> std::result::Result<(), String> {
    let Some((first_name, first)) = s.tensors.first() else {
        return Ok(());
    };
    let device = first.device();
    match s.tensors.iter().find(|(_, t)| t.device() != device) {
        Some((n, t)) => Err(format!(
            "all tensors of one op must be on the same device: {first_name:?} is on {device}, {n:?} on {}",
            t.device()
        )),
        None => Ok(()),
    }
}

/// Finite scale factors.
fn check_scales(s: &Submission) -> std::result::Result<(), String> {
    for (label, v) in [("prescale", s.prescale), ("postscale", s.postscale)] {
        if !v.is_finite() {
            return Err(format!("{label} factor {v} is not a finite number"));
        }
    }
    Ok(())
}

/// Ops that split or concatenate dim 0: a tensor that has one, and an alltoall's
/// splits that cover it, one per rank.
fn check_rows(s: &Submission, size: usize) -> std::result::Result<(), String> {
    let op = s.kind.name();
    if matches!(
        s.kind,
        OpKind::GroupedAllgather | OpKind::GroupedReducescatter
    ) {
        if let Some((n, _)) = s.tensors.iter().find(|(_, t)| t.shape().is_empty()) {
            return Err(format!(
                "{op} needs tensors with at least one dimension; member {n:?} is 0-d (a scalar)"
            ));
        }
        if let Some((n, _)) = s.tensors.iter().find(|(_, t)| t.device().is_cuda()) {
            return Err(format!(
                "{op} of CUDA tensors is not supported yet (member {n:?}); submit them one by one or as host tensors"
            ));
        }
        return Ok(());
    }
    let Some((_, t)) = s.tensors.first() else {
        return Ok(());
    };
    if !matches!(
        s.kind,
        OpKind::Allgather | OpKind::Alltoall | OpKind::Reducescatter
    ) {
        return Ok(());
    }
    let Some(&d0) = t.shape().first() else {
        return Err(format!(
            "{op} needs a tensor with at least one dimension; got a 0-d (scalar) tensor"
        ));
    };
    if s.kind != OpKind::Alltoall {
        return Ok(());
    }
    match &s.splits {
        Some(splits) if splits.len() != size => Err(format!(
            "splits has {} entries but there are {} ranks",
            splits.len(),
            size
        )),
        Some(splits) => {
            // Checked: splits are the caller's numbers.
            let total = splits.iter().try_fold(0usize, |a, &b| a.checked_add(b));
            match total {
                Some(total) if total == d0 => Ok(()),
                Some(total) => Err(format!(
                    "splits {splits:?} sum to {total} but dim 0 of the tensor is {d0}"
                )),
                None => Err(format!("splits {splits:?} overflow when summed")),
            }
        }
        None if d0 % size != 0 => Err(format!(
            "dim 0 ({d0}) is not divisible by the number of ranks ({size}); pass splits"
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::err_text;
    use crate::tensor::{DType, Tensor};

    fn single(kind: OpKind, name: &str, shape: &[usize]) -> Submission {
        Submission::single(kind, name.into(), Tensor::zeros(DType::F32, shape))
    }

    /// A grouped allreduce of f32 tensors (name, length).
    fn group(members: &[(&str, usize)]) -> Submission {
        let tensors = members
            .iter()
            .map(|&(n, len)| (n.into(), Tensor::zeros(DType::F32, &[len])))
            .collect();
        Submission::new(OpKind::GroupedAllreduce, "@group".into(), tensors)
    }

    /// The error message `s` gets with `size` ranks ("" when it passes).
    fn check(s: &Submission, size: usize) -> String {
        err_text(validate(s, size, 0))
    }

    #[test]
    fn accepts_well_formed_submissions() {
        for kind in [
            OpKind::Allreduce,
            OpKind::Allgather,
            OpKind::Broadcast,
            OpKind::Reducescatter,
        ] {
            assert_eq!(check(&single(kind, "w", &[4, 2]), 2), "", "{kind:?}");
        }
        let mut a = single(OpKind::Alltoall, "a", &[5]);
        a.splits = Some(vec![2, 3]);
        assert_eq!(check(&a, 2), "");
        assert_eq!(check(&single(OpKind::Alltoall, "a", &[6]), 3), "");
        assert_eq!(check(&group(&[("x", 1), ("y", 2)]), 4), "");
    }

    #[test]
    fn refuses_bad_names() {
        assert!(check(&single(OpKind::Allreduce, "", &[1]), 2)
            .contains("tensor names must not be empty"));
        assert!(check(&single(OpKind::Allreduce, "@join", &[1]), 2)
            .contains("tensor name \"@join\": names starting with '@' are reserved"));
        assert!(check(&group(&[]), 2).contains("a group needs at least one tensor"));
        assert!(check(&group(&[("x", 1), ("x", 1)]), 2)
            .contains("the name \"x\" appears twice in the group"));
    }

    #[test]
    fn refuses_bad_arguments() {
        let mut s = single(OpKind::Allreduce, "w", &[2]);
        s.prescale = f64::NAN;
        assert!(check(&s, 2).contains("prescale factor NaN is not a finite number"));
        let mut s = single(OpKind::Allreduce, "w", &[2]);
        s.postscale = f64::INFINITY;
        assert!(check(&s, 2).contains("postscale factor inf is not a finite number"));
        let mut s = single(OpKind::Broadcast, "w", &[2]);
        s.root = 2;
        assert_eq!(
            check(&s, 2),
            "broadcast \"w\": root 2 is out of range: there are 2 ranks (0..2)"
        );
        for kind in [OpKind::Allgather, OpKind::Alltoall, OpKind::Reducescatter] {
            assert!(
                check(&single(kind, "s", &[]), 2)
                    .contains("needs a tensor with at least one dimension"),
                "{kind:?}"
            );
        }
        let mut a = single(OpKind::Alltoall, "a", &[5]);
        a.splits = Some(vec![5]);
        assert!(check(&a, 2).contains("splits has 1 entries but there are 2 ranks"));
        a.splits = Some(vec![1, 1]);
        assert!(check(&a, 2).contains("splits [1, 1] sum to 2 but dim 0 of the tensor is 5"));
        assert!(check(&single(OpKind::Alltoall, "a", &[5]), 2)
            .contains("dim 0 (5) is not divisible by the number of ranks (2); pass splits"));
    }
}
