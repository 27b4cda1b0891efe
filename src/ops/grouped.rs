//! Grouped allgather and reducescatter (Horovod 0.28's `grouped_allgather` and
//! `grouped_reducescatter`): several named tensors negotiated and run as one unit,
//! like [`Kolo::grouped_allreduce`].

use super::{Prepared, ReduceOptions};
use crate::engine::request::OpKind;
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
            s: crate::group_plans::group(
                self.kolo.group_plans(),
                OpKind::GroupedAllgather,
                self.tensors,
            ),
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
        let mut s = crate::group_plans::group(
            self.kolo.group_plans(),
            OpKind::GroupedReducescatter,
            self.tensors,
        );
        self.reduce.apply(&mut s);
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s,
            convert: handle::to_tensors,
        }
    }
}
