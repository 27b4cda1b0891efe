//! Grouped allgather and reducescatter (Horovod 0.28's `grouped_allgather` and
//! `grouped_reducescatter`): several named tensors negotiated and run as one unit,
//! like [`Kolo::grouped_allreduce`].

use super::{group_key, sorted_members, Prepared, ReduceOptions};
use crate::engine::request::{Key, OpKind, Submission};
use crate::error::Result;
use crate::handle::{self, Handle};
use crate::process_set::ProcessSet;
use crate::runtime::Kolo;
use crate::submit_error::SubmitError;
use crate::tensor::Tensor;
use crate::vocab::ReduceOp;

impl Kolo {
    /// Gathers several named tensors as one unit: each member concatenated on dim 0
    /// over the ranks in rank order (dim 0 may differ per rank, the other dims must
    /// match), negotiated together and, on the CPU, moved in one collective per
    /// dtype. Results come back in input order.
    pub fn grouped_allgather(&self, tensors: Vec<(String, Tensor)>) -> GroupedAllgatherBuilder<'_> {
        GroupedAllgatherBuilder {
            kolo: self,
            refused: None,
            tensors,
        }
    }

    /// Reduces several named tensors as one unit and leaves block `rank` of each one's
    /// dim 0 on each rank (the first `d0 % size` ranks get one row more), negotiated
    /// together and, on the CPU, reduced in one collective per dtype. Default
    /// [`ReduceOp::Average`]. Results come back in input order.
    pub fn grouped_reducescatter(
        &self,
        tensors: Vec<(String, Tensor)>,
    ) -> GroupedReducescatterBuilder<'_> {
        GroupedReducescatterBuilder {
            kolo: self,
            refused: None,
            tensors,
            reduce: ReduceOptions::default(),
        }
    }
}

/// A group's submission of `kind`: members sorted by name (every rank the same
/// order), keyed by their names.
fn group(kind: OpKind, tensors: Vec<(String, Tensor)>) -> Submission {
    let (members, order) = sorted_members(tensors);
    let key = group_key(&members);
    let tensors = members
        .into_iter()
        .map(|(n, t)| (Key::from(n), t))
        .collect();
    let mut s = Submission::new(kind, Key::from(key), tensors);
    s.order = order;
    s
}

/// Builder for [`Kolo::grouped_allgather`].
#[derive(Debug)]
#[must_use = "a collective does nothing until .submit() or .wait()"]
pub struct GroupedAllgatherBuilder<'k> {
    kolo: &'k Kolo,
    refused: Option<String>,
    tensors: Vec<(String, Tensor)>,
}

impl<'k> GroupedAllgatherBuilder<'k> {
    super::process_set_option!();

    /// Submits the group: it runs when every member is ready on every rank.
    ///
    /// # Errors
    /// Submit-time errors: an empty group, an empty or duplicate name, a 0-d member,
    /// a CUDA member (not supported yet), engine not running.
    pub fn submit(self) -> Result<Handle<Vec<Tensor>>, SubmitError> {
        self.prepare().submit()
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// As [`submit`](Self::submit), and the checks across ranks (member names, dtypes,
    /// dims after the first), each naming the member and the ranks.
    pub fn wait(self) -> Result<Vec<Tensor>> {
        self.prepare().wait()
    }

    fn prepare(self) -> Prepared<'k, Vec<Tensor>> {
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s: group(OpKind::GroupedAllgather, self.tensors),
            convert: handle::to_tensors,
        }
    }
}

/// Builder for [`Kolo::grouped_reducescatter`].
#[derive(Debug)]
#[must_use = "a collective does nothing until .submit() or .wait()"]
pub struct GroupedReducescatterBuilder<'k> {
    kolo: &'k Kolo,
    refused: Option<String>,
    tensors: Vec<(String, Tensor)>,
    reduce: ReduceOptions,
}

impl<'k> GroupedReducescatterBuilder<'k> {
    super::reduce_options!();

    super::process_set_option!();

    /// Submits the group: it runs when every member is ready on every rank.
    ///
    /// # Errors
    /// As [`GroupedAllgatherBuilder::submit`].
    pub fn submit(self) -> Result<Handle<Vec<Tensor>>, SubmitError> {
        self.prepare().submit()
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// As [`submit`](Self::submit), and the checks across ranks (member names, dtypes,
    /// shapes, reduce op, scale factors), each naming the member and the ranks.
    pub fn wait(self) -> Result<Vec<Tensor>> {
        self.prepare().wait()
    }

    fn prepare(self) -> Prepared<'k, Vec<Tensor>> {
        let mut s = group(OpKind::GroupedReducescatter, self.tensors);
        self.reduce.apply(&mut s);
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s,
            convert: handle::to_tensors,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::group_key;
    use crate::Tensor;

    /// The hand-quoted names and the escaped ones make the key `{:?}` would make.
    #[test]
    fn group_key_quotes_each_name_as_debug_does() {
        let names = [
            "w.0",
            "a, b",
            "say \"hi\"",
            "back\\slash",
            "tab\there",
            "é",
            "~ok ",
        ];
        let members: Vec<(String, Tensor)> = names
            .iter()
            .map(|n| (n.to_string(), Tensor::from_vec(vec![0f32], &[1]).unwrap()))
            .collect();
        let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
        let want = format!(
            "{}group[{}]",
            crate::engine::request::RESERVED_PREFIX,
            quoted.join(", ")
        );
        assert_eq!(group_key(&members), want);
    }
}
