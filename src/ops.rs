//! Collective request builders and their options.
//!
//! Each collective starts from a method on [`Kolo`] that returns a builder; options are
//! set on the builder, then `.submit()` returns a [`Handle`] and `.wait()` submits and
//! waits. Names are mandatory and must be the same on every rank for the same tensor
//! (unlike Horovod, kolo never invents names: per-process counters diverge between
//! ranks and cause stalls).

use crate::engine::request::{self, Named, OpKind, Submission};
use crate::error::Result;
use crate::handle::{self, Handle};
use crate::process_set::ProcessSet;
use crate::runtime::Kolo;
use crate::submit_error::SubmitError;
use crate::tensor::Tensor;
use crate::vocab::{AlltoallOutput, ReduceOp};

/// The collectives: each returns a builder (or, for barrier and join, blocks).
impl Kolo {
    /// Reduces `tensor` over all ranks (default [`ReduceOp::Average`]). Every rank must
    /// submit a tensor of the same name, dtype and shape.
    pub fn allreduce(&self, name: impl Into<String>, tensor: Tensor) -> AllreduceBuilder<'_> {
        AllreduceBuilder::new(self, name.into(), tensor)
    }

    /// Reduces several named tensors as one unit: negotiated together; on the CPU the
    /// small ones (up to 64 KiB) reduced in one buffer per dtype, larger ones in place;
    /// on CUDA each in place, their NCCL calls issued as one NCCL group (one by one when
    /// an integer scale factor has to be applied on the host). Results come back in
    /// input order, in the tensors that were given.
    pub fn grouped_allreduce(&self, tensors: Vec<(String, Tensor)>) -> GroupedAllreduceBuilder<'_> {
        GroupedAllreduceBuilder::new(self, tensors)
    }

    /// Concatenates every rank's tensor on dim 0, in rank order.
    pub fn allgather(&self, name: impl Into<String>, tensor: Tensor) -> AllgatherBuilder<'_> {
        AllgatherBuilder::new(self, name.into(), tensor)
    }

    /// Sends `root`'s tensor to every rank.
    pub fn broadcast(
        &self,
        name: impl Into<String>,
        tensor: Tensor,
        root: usize,
    ) -> BroadcastBuilder<'_> {
        BroadcastBuilder::new(self, name.into(), tensor, root)
    }

    /// Scatters rows of dim 0 to every rank and gathers what they send here.
    pub fn alltoall(&self, name: impl Into<String>, tensor: Tensor) -> AlltoallBuilder<'_> {
        AlltoallBuilder::new(self, name.into(), tensor)
    }

    /// Reduces over all ranks and leaves block `rank` of dim 0 on each rank.
    pub fn reducescatter(
        &self,
        name: impl Into<String>,
        tensor: Tensor,
    ) -> ReducescatterBuilder<'_> {
        ReducescatterBuilder::new(self, name.into(), tensor)
    }

    /// Blocks until every rank has reached the barrier. Ops submitted before it may
    /// still be running.
    ///
    /// # Errors
    /// The engine is not running, or a rank left.
    pub fn barrier(&self) -> Result<()> {
        let s = Submission::new(OpKind::Barrier, request::BARRIER_KEY.into(), Named::new());
        self.submit_wait(s, handle::to_unit)
    }

    /// Declares that this rank has no more data this epoch (uneven data across ranks).
    /// Until every rank has joined, this rank takes part in the other ranks'
    /// allreduces with zeros (Average still divides by the full size); other
    /// collectives fail while a rank is joined. Returns the last rank to join, the
    /// same on every rank.
    ///
    /// # Errors
    /// The engine is not running, or a rank left.
    pub fn join(&self) -> Result<usize> {
        let s = Submission::new(OpKind::Join, request::JOIN_KEY.into(), Named::new());
        self.submit_wait(s, handle::to_rank)
    }
}

/// The options shared by the reducing builders (allreduce, grouped allreduce,
/// reducescatter).
#[derive(Debug, Clone, Copy)]
struct ReduceOptions {
    op: ReduceOp,
    prescale: f64,
    postscale: f64,
}

impl Default for ReduceOptions {
    fn default() -> Self {
        ReduceOptions {
            op: ReduceOp::Average,
            prescale: 1.0,
            postscale: 1.0,
        }
    }
}

impl ReduceOptions {
    fn apply(self, s: &mut Submission) {
        s.op = self.op;
        s.prescale = self.prescale;
        s.postscale = self.postscale;
    }
}

/// The setters of [`ReduceOptions`], for a builder with a `reduce` field.
macro_rules! reduce_options {
    () => {
        /// The reduction (default [`ReduceOp::Average`]).
        pub fn op(mut self, op: ReduceOp) -> Self {
            self.reduce.op = op;
            self
        }

        /// Multiplies each rank's input by `factor` before reducing.
        pub fn prescale(mut self, factor: f64) -> Self {
            self.reduce.prescale = factor;
            self
        }

        /// Multiplies the result by `factor` (after the division of `Average`).
        pub fn postscale(mut self, factor: f64) -> Self {
            self.reduce.postscale = factor;
            self
        }
    };
}

/// The `process_set` setter, for a builder with `kolo` and `refused` fields.
macro_rules! process_set_option {
    () => {
        /// Runs the op among the ranks of `set` only (see [`ProcessSet`]). On a rank
        /// outside the set, submitting fails with an error naming the rank and the set.
        pub fn process_set(mut self, set: &'k ProcessSet) -> Self {
            match set.engine() {
                Ok(k) => self.kolo = k,
                Err(m) => self.refused = Some(m),
            }
            self
        }
    };
}

pub(crate) use process_set_option;
pub(crate) use reduce_options;

mod grouped;
mod off_engine;
pub use grouped::{GroupedAllgatherBuilder, GroupedReducescatterBuilder};

/// A builder's request, ready to go to `kolo` unless a process set refused it (the
/// tensors then come back in the error).
pub(crate) struct Prepared<'k, T> {
    pub(crate) kolo: &'k Kolo,
    pub(crate) refused: Option<String>,
    pub(crate) s: Submission,
    pub(crate) convert: fn(handle::Output) -> Result<T>,
}

impl<T> Prepared<'_, T> {
    /// The refusal of a process set this rank is not in, with the tensors.
    fn refusal(refused: Option<String>, s: Submission) -> Result<Submission, SubmitError> {
        let Some(message) = refused else {
            return Ok(s);
        };
        let (op, name) = (s.kind.name(), s.key.to_string());
        let (_, tensors) = s.into_parts();
        let e = crate::Error::InvalidArgument { op, name, message };
        Err(SubmitError::new(e, tensors.into_vec()))
    }

    pub(crate) fn submit(self) -> Result<Handle<T>, SubmitError> {
        let s = Self::refusal(self.refused, self.s)?;
        self.kolo.submit(s, self.convert)
    }

    /// Submits and waits, running the engine on this thread while it is idle.
    pub(crate) fn wait(self) -> Result<T> {
        let s = Self::refusal(self.refused, self.s)?;
        self.kolo.submit_wait(s, self.convert)
    }
}

/// Builder for [`Kolo::allreduce`].
#[derive(Debug)]
#[must_use = "a collective does nothing until .submit() or .wait()"]
pub struct AllreduceBuilder<'k> {
    kolo: &'k Kolo,
    /// Why the process set given refuses this rank's submission.
    refused: Option<String>,
    name: String,
    tensor: Tensor,
    reduce: ReduceOptions,
    compression: crate::compression::Compression,
}

impl<'k> AllreduceBuilder<'k> {
    pub(crate) fn new(kolo: &'k Kolo, name: String, tensor: Tensor) -> Self {
        AllreduceBuilder {
            kolo,
            refused: None,
            name,
            tensor,
            reduce: ReduceOptions::default(),
            compression: crate::compression::Compression::None,
        }
    }

    reduce_options!();

    process_set_option!();

    /// How the tensor travels (default: as it is). `Fp16` / `Bf16` cast f32 and f64
    /// for the wire and back; `ByteGrad` reduces f32 with Bagua's 8-bit exchange
    /// ([`Kolo::bytegrad_allreduce`]; Average or Sum). A compressed allreduce — and one
    /// with [`ReduceOp::Adasum`] — runs on a helper thread over the engine's own
    /// collectives, never fused with others; its handle behaves as any other.
    pub fn compression(mut self, compression: crate::compression::Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Submits the allreduce; the result has the input's shape and dtype.
    ///
    /// # Errors
    /// Submit-time errors only (empty or duplicate name, engine not running), with the
    /// tensor handed back.
    pub fn submit(self) -> Result<Handle<Tensor>, SubmitError> {
        if self.runs_off_engine() {
            return off_engine::submit(
                self.kolo,
                self.refused,
                self.name,
                self.tensor,
                self.reduce,
                self.compression,
            );
        }
        self.prepare().submit()
    }

    /// Whether the op runs on a helper thread (`off_engine`).
    fn runs_off_engine(&self) -> bool {
        self.reduce.op == ReduceOp::Adasum
            || self.compression != crate::compression::Compression::None
    }

    fn prepare(self) -> Prepared<'k, Tensor> {
        let mut s = Submission::single(OpKind::Allreduce, self.name, self.tensor);
        self.reduce.apply(&mut s);
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s,
            convert: handle::to_tensor,
        }
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// Submit-time errors, and cross-rank errors (mismatched dtype, shape, op or scale
    /// factors; a rank that left) reported on every rank.
    pub fn wait(self) -> Result<Tensor> {
        if self.runs_off_engine() {
            return self.submit()?.wait();
        }
        self.prepare().wait()
    }
}

/// Builder for [`Kolo::grouped_allreduce`].
#[derive(Debug)]
#[must_use = "a collective does nothing until .submit() or .wait()"]
pub struct GroupedAllreduceBuilder<'k> {
    kolo: &'k Kolo,
    /// Why the process set given refuses this rank's submission.
    refused: Option<String>,
    tensors: Vec<(String, Tensor)>,
    reduce: ReduceOptions,
}

impl<'k> GroupedAllreduceBuilder<'k> {
    pub(crate) fn new(kolo: &'k Kolo, tensors: Vec<(String, Tensor)>) -> Self {
        GroupedAllreduceBuilder {
            kolo,
            refused: None,
            tensors,
            reduce: ReduceOptions::default(),
        }
    }

    reduce_options!();

    process_set_option!();

    /// Submits the group: it becomes ready only when every member is ready on every
    /// rank, and its members are reduced together. Results come back in input order.
    ///
    /// # Errors
    /// Submit-time errors: an empty group, an empty or duplicate name, engine not running.
    pub fn submit(self) -> Result<Handle<Vec<Tensor>>, SubmitError> {
        self.prepare().submit()
    }

    fn prepare(self) -> Prepared<'k, Vec<Tensor>> {
        let mut s = crate::group_plans::group(
            self.kolo.group_plans(),
            OpKind::GroupedAllreduce,
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

    /// Submits and waits.
    ///
    /// # Errors
    /// As [`AllreduceBuilder::wait`].
    pub fn wait(self) -> Result<Vec<Tensor>> {
        self.prepare().wait()
    }
}

/// Builder for [`Kolo::allgather`].
#[derive(Debug)]
#[must_use = "a collective does nothing until .submit() or .wait()"]
pub struct AllgatherBuilder<'k> {
    kolo: &'k Kolo,
    /// Why the process set given refuses this rank's submission.
    refused: Option<String>,
    name: String,
    tensor: Tensor,
}

impl<'k> AllgatherBuilder<'k> {
    pub(crate) fn new(kolo: &'k Kolo, name: String, tensor: Tensor) -> Self {
        AllgatherBuilder {
            kolo,
            refused: None,
            name,
            tensor,
        }
    }

    process_set_option!();

    /// Submits the allgather: the result is every rank's tensor concatenated on dim 0
    /// in rank order; dim 0 may differ between ranks, the other dims may not.
    ///
    /// # Errors
    /// Submit-time errors: a 0-d tensor, empty or duplicate name, engine not running.
    pub fn submit(self) -> Result<Handle<Tensor>, SubmitError> {
        self.prepare().submit()
    }

    fn prepare(self) -> Prepared<'k, Tensor> {
        let s = Submission::single(OpKind::Allgather, self.name, self.tensor);
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s,
            convert: handle::to_tensor,
        }
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// Submit-time errors, and cross-rank errors (dtype, rank or dims after the first).
    pub fn wait(self) -> Result<Tensor> {
        self.prepare().wait()
    }
}

/// Builder for [`Kolo::broadcast`].
#[derive(Debug)]
#[must_use = "a collective does nothing until .submit() or .wait()"]
pub struct BroadcastBuilder<'k> {
    kolo: &'k Kolo,
    /// Why the process set given refuses this rank's submission.
    refused: Option<String>,
    name: String,
    tensor: Tensor,
    root: usize,
}

impl<'k> BroadcastBuilder<'k> {
    pub(crate) fn new(kolo: &'k Kolo, name: String, tensor: Tensor, root: usize) -> Self {
        BroadcastBuilder {
            kolo,
            refused: None,
            name,
            tensor,
            root,
        }
    }

    /// Runs the broadcast among the ranks of `set` only (see [`ProcessSet`]); the root
    /// stays a job rank and must be in the set. On a rank outside the set, or with a
    /// root outside it, submitting fails with an error naming both.
    pub fn process_set(mut self, set: &'k ProcessSet) -> Self {
        match set.engine().and_then(|k| Ok((k, set.set_rank(self.root)?))) {
            Ok((k, root)) => {
                self.kolo = k;
                self.root = root;
            }
            Err(m) => self.refused = Some(m),
        }
        self
    }

    /// Submits the broadcast: every rank gets the root's tensor. Non-root ranks pass a
    /// tensor of the same shape and dtype, which is overwritten.
    ///
    /// # Errors
    /// Submit-time errors: root out of range, empty or duplicate name, engine not running.
    pub fn submit(self) -> Result<Handle<Tensor>, SubmitError> {
        self.prepare().submit()
    }

    fn prepare(self) -> Prepared<'k, Tensor> {
        let mut s = Submission::single(OpKind::Broadcast, self.name, self.tensor);
        s.root = self.root;
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s,
            convert: handle::to_tensor,
        }
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// Submit-time errors, and cross-rank errors (dtype, shape, root).
    pub fn wait(self) -> Result<Tensor> {
        self.prepare().wait()
    }
}

/// Builder for [`Kolo::alltoall`].
#[derive(Debug)]
#[must_use = "a collective does nothing until .submit() or .wait()"]
pub struct AlltoallBuilder<'k> {
    kolo: &'k Kolo,
    /// Why the process set given refuses this rank's submission.
    refused: Option<String>,
    name: String,
    tensor: Tensor,
    splits: Option<Vec<usize>>,
}

impl<'k> AlltoallBuilder<'k> {
    pub(crate) fn new(kolo: &'k Kolo, name: String, tensor: Tensor) -> Self {
        AlltoallBuilder {
            kolo,
            refused: None,
            name,
            tensor,
            splits: None,
        }
    }

    process_set_option!();

    /// Rows of dim 0 to send to each rank, in rank order; must have one entry per rank
    /// and sum to dim 0. Without splits, dim 0 is divided equally.
    pub fn splits(mut self, splits: Vec<usize>) -> Self {
        self.splits = Some(splits);
        self
    }

    /// Submits the alltoall.
    ///
    /// # Errors
    /// Submit-time errors: a 0-d tensor, splits of the wrong length or not summing to
    /// dim 0, dim 0 not divisible by the number of ranks without splits, empty or
    /// duplicate name, engine not running.
    pub fn submit(self) -> Result<Handle<AlltoallOutput>, SubmitError> {
        self.prepare().submit()
    }

    fn prepare(self) -> Prepared<'k, AlltoallOutput> {
        let mut s = Submission::single(OpKind::Alltoall, self.name, self.tensor);
        s.splits = self.splits;
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s,
            convert: handle::to_alltoall,
        }
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// Submit-time errors, and cross-rank errors (dtype, rank or dims after the first).
    pub fn wait(self) -> Result<AlltoallOutput> {
        self.prepare().wait()
    }
}

/// Builder for [`Kolo::reducescatter`].
#[derive(Debug)]
#[must_use = "a collective does nothing until .submit() or .wait()"]
pub struct ReducescatterBuilder<'k> {
    kolo: &'k Kolo,
    /// Why the process set given refuses this rank's submission.
    refused: Option<String>,
    name: String,
    tensor: Tensor,
    reduce: ReduceOptions,
}

impl<'k> ReducescatterBuilder<'k> {
    pub(crate) fn new(kolo: &'k Kolo, name: String, tensor: Tensor) -> Self {
        ReducescatterBuilder {
            kolo,
            refused: None,
            name,
            tensor,
            reduce: ReduceOptions::default(),
        }
    }

    reduce_options!();

    process_set_option!();

    /// Submits the reducescatter: the reduced tensor is split on dim 0, rank `r` gets
    /// block `r`; when dim 0 does not divide evenly the first `dim0 % size` ranks get
    /// one extra row.
    ///
    /// # Errors
    /// Submit-time errors: a 0-d tensor, empty or duplicate name, engine not running.
    pub fn submit(self) -> Result<Handle<Tensor>, SubmitError> {
        self.prepare().submit()
    }

    fn prepare(self) -> Prepared<'k, Tensor> {
        let mut s = Submission::single(OpKind::Reducescatter, self.name, self.tensor);
        self.reduce.apply(&mut s);
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s,
            convert: handle::to_tensor,
        }
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// Submit-time errors, and cross-rank errors (dtype, shape, op, scale factors).
    pub fn wait(self) -> Result<Tensor> {
        self.prepare().wait()
    }
}
