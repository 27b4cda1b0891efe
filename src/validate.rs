//! Submit-time checks: a pure function of a submission and the number of ranks, run
//! on the submitting thread so that these errors are immediate and local (the checks
//! across ranks are in `engine::negotiate`).

use std::collections::HashSet;

use crate::engine::request::{OpKind, Submission, RESERVED_PREFIX};
use crate::error::{Error, Result};

/// A broadcast root that is not a rank.
pub(crate) fn bad_root(op: &'static str, name: &str, root: usize, size: usize) -> Error {
    Error::InvalidArgument {
        op,
        name: name.into(),
        message: format!("root {root} is out of range: there are {size} ranks (0..{size})"),
        tensors: Vec::new(),
    }
}

/// Submit-time checks: immediate errors on this rank only (README, "When something
/// goes wrong"); the checks across ranks are in `engine::negotiate`.
pub(crate) fn validate(s: &Submission, size: usize) -> Result<()> {
    let op = s.kind.name();
    let invalid = |message: String| Error::InvalidArgument {
        op,
        name: s.key.to_string(),
        message,
        tensors: Vec::new(),
    };
    if let Some((n, _)) = s
        .tensors
        .iter()
        .find(|(n, _)| n.starts_with(RESERVED_PREFIX))
    {
        return Err(invalid(format!(
            "tensor name {n:?}: names starting with '{}' are reserved for kolo's own \
             keys (join, barrier, groups); rename the tensor",
            RESERVED_PREFIX
        )));
    }
    if s.key.is_empty() || s.tensors.iter().any(|(n, _)| n.is_empty()) {
        return Err(invalid(
            "tensor names must not be empty (every rank must use the same name)".into(),
        ));
    }
    if s.kind == OpKind::GroupedAllreduce {
        if s.tensors.is_empty() {
            return Err(invalid("a group needs at least one tensor".into()));
        }
        let mut seen = HashSet::new();
        if let Some((n, _)) = s.tensors.iter().find(|(n, _)| !seen.insert(n)) {
            return Err(invalid(format!(
                "the name {n:?} appears twice in the group"
            )));
        }
    }
    if let Some((_, first)) = s.tensors.first() {
        let device = first.device();
        if let Some((n, t)) = s.tensors.iter().find(|(_, t)| t.device() != device) {
            return Err(invalid(format!(
                "all tensors of one op must be on the same device: {:?} is on {device}, {n:?} on {}",
                s.tensors[0].0,
                t.device()
            )));
        }
    }
    for (label, v) in [("prescale", s.prescale), ("postscale", s.postscale)] {
        if !v.is_finite() {
            return Err(invalid(format!(
                "{label} factor {v} is not a finite number"
            )));
        }
    }
    if s.kind == OpKind::Broadcast && s.root >= size {
        return Err(bad_root(op, &s.key, s.root, size));
    }
    if matches!(
        s.kind,
        OpKind::Allgather | OpKind::Alltoall | OpKind::Reducescatter
    ) {
        if let Some((_, t)) = s.tensors.first() {
            if t.shape().is_empty() {
                return Err(invalid(format!(
                    "{op} needs a tensor with at least one dimension; got a 0-d (scalar) tensor"
                )));
            }
        }
    }
    if s.kind == OpKind::Alltoall {
        if let Some((_, t)) = s.tensors.first() {
            let d0 = t.shape()[0];
            match &s.splits {
                Some(splits) if splits.len() != size => {
                    return Err(invalid(format!(
                        "splits has {} entries but there are {} ranks",
                        splits.len(),
                        size
                    )));
                }
                Some(splits) if splits.iter().sum::<usize>() != d0 => {
                    return Err(invalid(format!(
                        "splits {splits:?} sum to {} but dim 0 of the tensor is {d0}",
                        splits.iter().sum::<usize>()
                    )));
                }
                None if d0 % size != 0 => {
                    return Err(invalid(format!(
                        "dim 0 ({d0}) is not divisible by the number of ranks ({}); pass splits",
                        size
                    )));
                }
                _ => {}
            }
        }
    }
    Ok(())
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
        err_text(validate(s, size))
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
