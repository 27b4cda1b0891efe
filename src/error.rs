//! The error type of every fallible kolo call.

use crate::tensor::{DType, Device, Tensor};

/// Everything that can go wrong in kolo.
///
/// User errors (a bad argument, a mismatch between ranks, a rank that left) are kept
/// apart from [`Error::Internal`], which means kolo itself has a bug.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An environment variable or [`Config`](crate::Config) value is malformed.
    #[error("invalid configuration: {variable}={value:?}: {reason}")]
    Config {
        /// The variable (e.g. `KOLO_CYCLE_TIME`) or Config method that was given a bad value.
        variable: String,
        /// The value as given.
        value: String,
        /// What is wrong with it and what is accepted.
        reason: String,
    },

    /// MPI could not be started, or kolo was initialised twice in one process.
    #[error("kolo init failed: {0}")]
    Init(String),

    /// A bad argument to a collective, detected on the submitting rank before anything
    /// was sent (root out of range, bad splits, 0-d tensor, empty name, …).
    #[error("{op} {name:?}: {message}")]
    InvalidArgument {
        /// The collective (`allreduce`, `allgather`, …).
        op: &'static str,
        /// The tensor name given to it.
        name: String,
        /// What is wrong.
        message: String,
        /// The tensors of a refused submit, handed back ([`Error::into_tensors`]);
        /// empty when the error is not about a submit.
        tensors: Vec<Tensor>,
    },

    /// A second request with the same name was submitted on this rank while the first
    /// one is still pending (as in Horovod, names must be unique among pending ops).
    #[error("{op} {name:?}: a request with this name is already pending on rank {rank}; wait for it before submitting the name again")]
    DuplicateName {
        /// The collective.
        op: &'static str,
        /// The duplicated name.
        name: String,
        /// This rank.
        rank: usize,
        /// The tensors of the refused submit, handed back ([`Error::into_tensors`]).
        tensors: Vec<Tensor>,
    },

    /// The ranks disagree about a request (dtype, shape, op, root, …). Delivered to the
    /// handle on every rank; the engine keeps working for later ops.
    #[error("{op} {name:?}: {message}")]
    Mismatch {
        /// The collective as submitted by the lowest rank.
        op: &'static str,
        /// The tensor name.
        name: String,
        /// What differs and which ranks sent what.
        message: String,
        /// This rank's tensors, handed back: nothing was sent ([`Error::into_tensors`]).
        tensors: Vec<Tensor>,
    },

    /// The op cannot run because a rank has called [`join`](crate::Kolo::join) and only
    /// allreduce can run while ranks are joined.
    #[error("{op} {name:?}: cannot run while rank(s) {ranks:?} have joined; only allreduce works with joined ranks")]
    Joined {
        /// The collective.
        op: &'static str,
        /// The tensor name.
        name: String,
        /// The joined ranks.
        ranks: Vec<usize>,
    },

    /// Another rank shut down (or its program ended) while this op needed it.
    #[error("{op} {name:?}: rank {rank} has shut down, so this op can never complete")]
    RankLeft {
        /// The collective.
        op: &'static str,
        /// The tensor name.
        name: String,
        /// The rank that left first.
        rank: usize,
        /// This rank's tensors, handed back when the op never ran
        /// ([`Error::into_tensors`]).
        tensors: Vec<Tensor>,
    },

    /// Another rank could not run this op (on a device: a tensor on another device, an
    /// allocation that failed), so no rank ran it; the engine goes on.
    #[error("{op} {name:?}: rank {rank} could not run it ({message}), so no rank did")]
    PeerFailed {
        /// The collective.
        op: &'static str,
        /// The tensor name.
        name: String,
        /// The rank that could not run it.
        rank: usize,
        /// Why, in that rank's words.
        message: String,
        /// This rank's tensors, handed back: nothing was sent
        /// ([`Error::into_tensors`]).
        tensors: Vec<Tensor>,
    },

    /// Some ranks never submitted a request others were waiting for, for longer than
    /// the stall shutdown time (`KOLO_STALL_SHUTDOWN_TIME_SECONDS`); every pending op
    /// on every rank fails with the report, and the engine stops.
    #[error("{report}")]
    Stalled {
        /// Which requests are missing from which ranks.
        report: String,
        /// This rank's tensors of the failed op, handed back: it never ran
        /// ([`Error::into_tensors`]).
        tensors: Vec<Tensor>,
    },

    /// The engine is not running (after `shutdown`, or it failed). For a submit, the
    /// tensors are handed back in `tensors`.
    #[error("{op} {name:?}: the kolo engine on rank {rank} is not running ({reason})")]
    EngineStopped {
        /// The collective.
        op: &'static str,
        /// The tensor name.
        name: String,
        /// This rank.
        rank: usize,
        /// Why it stopped.
        reason: String,
        /// The tensors that were not submitted, handed back to the caller.
        tensors: Vec<Tensor>,
    },

    /// A tensor was read as the wrong element type.
    #[error("tensor holds {actual:?} elements, not {expected:?}")]
    DTypeMismatch {
        /// The type asked for.
        expected: DType,
        /// The type the tensor holds.
        actual: DType,
        /// The tensor, handed back by a conversion that took it by value
        /// ([`Tensor::into_vec`]; [`Error::into_tensors`]); empty otherwise.
        tensors: Vec<Tensor>,
    },

    /// The number of elements does not match the shape.
    #[error("shape {shape:?} needs {expected} elements but {actual} were given")]
    ShapeMismatch {
        /// The shape given.
        shape: Vec<usize>,
        /// The product of the shape.
        expected: usize,
        /// The data length.
        actual: usize,
    },

    /// A shape whose element count or byte size does not fit in `usize`.
    #[error("shape {shape:?} of {dtype} elements is too large: its size in bytes overflows usize")]
    ShapeOverflow {
        /// The shape given.
        shape: Vec<usize>,
        /// The element type.
        dtype: DType,
    },

    /// An object could not be (de)serialised for `broadcast_object` / `allgather_object`.
    #[error("{op} {name:?}: object from rank {rank} could not be (de)serialised")]
    Serialization {
        /// The collective.
        op: &'static str,
        /// The object name.
        name: String,
        /// The rank whose bytes failed.
        rank: usize,
        /// The serialisation error; for a failure on another rank, a note saying so
        /// (the cause itself is in that rank's error).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The optimizer wrapped by a [`DistributedOptimizer`](crate::DistributedOptimizer)
    /// failed its step.
    #[error("the wrapped optimizer's step failed")]
    Optimizer {
        /// The optimizer's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The MPI library reported an error.
    #[error("MPI error in {call}: {message}")]
    Transport {
        /// The MPI call.
        call: &'static str,
        /// MPI's description.
        message: String,
    },

    /// CUDA (or NCCL) cannot be used on this machine: the driver library, a device or
    /// the NCCL library is missing, or kolo was built without the `nccl` feature.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),

    /// A CUDA or NCCL call failed.
    #[error("{call} failed: {message}")]
    Cuda {
        /// The CUDA or NCCL call.
        call: &'static str,
        /// The library's description.
        message: String,
    },

    /// A tensor is on a device this operation does not take.
    #[error("{what}: the tensor is on {actual}, but this needs a tensor on {expected}")]
    WrongDevice {
        /// The operation.
        what: &'static str,
        /// Where the tensor would have to be.
        expected: Device,
        /// Where it is.
        actual: Device,
        /// The tensor, handed back by a conversion that took it by value
        /// ([`Tensor::into_vec`]; [`Error::into_tensors`]); empty otherwise.
        tensors: Vec<Tensor>,
    },

    /// A bug in kolo: please report it with the message.
    #[error("internal kolo error (please report this bug): {0}")]
    Internal(String),
}

impl Error {
    /// Takes back the tensors of an op whose data was never sent — a refused submit
    /// (an invalid argument, a duplicate name, an engine that had stopped), or an
    /// accepted op that failed before any collective ran (a mismatch between ranks, a
    /// rank that left, a stall, the engine stopping) — so that nothing the caller
    /// handed over is lost (as crossbeam's `SendError<T>` does). They come in the
    /// order the caller gave them. Empty for every other error (the op ran, or failed
    /// while running, and its buffers cannot be trusted).
    pub fn into_tensors(mut self) -> Vec<Tensor> {
        self.take_tensors()
    }

    /// Takes the tensors [`into_tensors`](Self::into_tensors) would give, leaving
    /// the error otherwise as it was (to return it after putting them back).
    pub fn take_tensors(&mut self) -> Vec<Tensor> {
        self.tensors_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The tensors this error can hand back, where its kind can hold them.
    fn tensors_mut(&mut self) -> Option<&mut Vec<Tensor>> {
        match self {
            Error::EngineStopped { tensors, .. }
            | Error::InvalidArgument { tensors, .. }
            | Error::DuplicateName { tensors, .. }
            | Error::Mismatch { tensors, .. }
            | Error::RankLeft { tensors, .. }
            | Error::PeerFailed { tensors, .. }
            | Error::Stalled { tensors, .. }
            | Error::DTypeMismatch { tensors, .. }
            | Error::WrongDevice { tensors, .. } => Some(tensors),
            _ => None,
        }
    }

    /// Puts the handed-back tensors of a group (submitted in sorted order) back into
    /// the caller's order.
    pub(crate) fn reorder_tensors(mut self, order: &[u32]) -> Self {
        if let Some(tensors) = self.tensors_mut() {
            let sorted = std::mem::take(tensors);
            *tensors = crate::order::unsort(Some(order), sorted);
        }
        self
    }

    /// The same error (kind and fields) for another request of a fused batch that
    /// failed as a whole; tensors are not copied, and a boxed source becomes its text.
    pub(crate) fn replicate(&self) -> Error {
        let text = |e: &(dyn std::error::Error + Send + Sync)| -> Box<dyn std::error::Error + Send + Sync> {
            e.to_string().into()
        };
        match self {
            Error::Config {
                variable,
                value,
                reason,
            } => Error::Config {
                variable: variable.clone(),
                value: value.clone(),
                reason: reason.clone(),
            },
            Error::Init(m) => Error::Init(m.clone()),
            Error::InvalidArgument {
                op, name, message, ..
            } => Error::InvalidArgument {
                op,
                name: name.clone(),
                message: message.clone(),
                tensors: Vec::new(),
            },
            Error::DuplicateName { op, name, rank, .. } => Error::DuplicateName {
                op,
                name: name.clone(),
                rank: *rank,
                tensors: Vec::new(),
            },
            Error::Mismatch {
                op, name, message, ..
            } => Error::Mismatch {
                op,
                name: name.clone(),
                message: message.clone(),
                tensors: Vec::new(),
            },
            Error::Joined { op, name, ranks } => Error::Joined {
                op,
                name: name.clone(),
                ranks: ranks.clone(),
            },
            Error::RankLeft { op, name, rank, .. } => Error::RankLeft {
                op,
                name: name.clone(),
                rank: *rank,
                tensors: Vec::new(),
            },
            Error::PeerFailed {
                op,
                name,
                rank,
                message,
                ..
            } => Error::PeerFailed {
                op,
                name: name.clone(),
                rank: *rank,
                message: message.clone(),
                tensors: Vec::new(),
            },
            Error::Stalled { report, .. } => Error::Stalled {
                report: report.clone(),
                tensors: Vec::new(),
            },
            Error::EngineStopped {
                op,
                name,
                rank,
                reason,
                ..
            } => Error::EngineStopped {
                op,
                name: name.clone(),
                rank: *rank,
                reason: reason.clone(),
                tensors: Vec::new(),
            },
            Error::DTypeMismatch {
                expected, actual, ..
            } => Error::DTypeMismatch {
                expected: *expected,
                actual: *actual,
                tensors: Vec::new(),
            },
            Error::ShapeMismatch {
                shape,
                expected,
                actual,
            } => Error::ShapeMismatch {
                shape: shape.clone(),
                expected: *expected,
                actual: *actual,
            },
            Error::ShapeOverflow { shape, dtype } => Error::ShapeOverflow {
                shape: shape.clone(),
                dtype: *dtype,
            },
            Error::Serialization {
                op,
                name,
                rank,
                source,
            } => Error::Serialization {
                op,
                name: name.clone(),
                rank: *rank,
                source: text(source.as_ref()),
            },
            Error::Optimizer { source } => Error::Optimizer {
                source: text(source.as_ref()),
            },
            Error::Transport { call, message } => Error::Transport {
                call,
                message: message.clone(),
            },
            Error::CudaUnavailable(m) => Error::CudaUnavailable(m.clone()),
            Error::Cuda { call, message } => Error::Cuda {
                call,
                message: message.clone(),
            },
            Error::WrongDevice {
                what,
                expected,
                actual,
                ..
            } => Error::WrongDevice {
                what,
                expected: *expected,
                actual: *actual,
                tensors: Vec::new(),
            },
            Error::Internal(m) => Error::Internal(m.clone()),
        }
    }

    /// The engine on `rank` is not running (`reason`); no tensors handed back yet (see
    /// [`Error::handing_back`]).
    pub(crate) fn engine_stopped(
        op: &'static str,
        name: impl Into<String>,
        rank: usize,
        reason: impl Into<String>,
    ) -> Error {
        Error::EngineStopped {
            op,
            name: name.into(),
            rank,
            reason: reason.into(),
            tensors: Vec::new(),
        }
    }

    /// Puts the tensors of an op that never ran into the error that ended it.
    pub(crate) fn handing_back(mut self, back: Vec<Tensor>) -> Self {
        if let Some(tensors) = self.tensors_mut() {
            *tensors = back;
        }
        self
    }
}

/// A conversion that failed, holding the value it was given so that nothing is lost
/// (as crossbeam's `SendError<T>` holds the message): a buffer
/// [`Tensor::from_host_buffer`] refused, or a tensor a device copy could not convert
/// (feature `nccl`). `?` turns it into an [`Error`] (dropping the value);
/// [`into_inner`](Self::into_inner) takes the value back. ([`Tensor::into_vec`]
/// returns a plain [`Error`] holding the tensor instead: [`Error::into_tensors`].)
///
/// ```
/// struct Bytes(Vec<u8>);
/// impl kolo::HostBuffer for Bytes {
///     fn bytes(&self) -> &[u8] { &self.0 }
///     fn bytes_mut(&mut self) -> &mut [u8] { &mut self.0 }
/// }
/// let err = kolo::Tensor::from_host_buffer(Bytes(vec![7; 3]), kolo::DType::U8, &[4])
///     .unwrap_err();
/// assert_eq!(err.to_string(), "shape [4] needs 4 elements but 3 were given");
/// assert_eq!(err.into_inner().0, [7, 7, 7]);    // the buffer, unchanged
/// ```
pub struct ConversionError<T> {
    error: Error,
    value: T,
}

impl<T> ConversionError<T> {
    pub(crate) fn new(error: Error, value: T) -> Self {
        ConversionError { error, value }
    }

    /// What went wrong.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The value the conversion was given, unchanged.
    pub fn into_inner(self) -> T {
        self.value
    }

    /// The error and the value.
    pub fn into_parts(self) -> (Error, T) {
        (self.error, self.value)
    }
}

impl<T> std::fmt::Debug for ConversionError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The value may be large (a tensor): only its type is shown.
        f.debug_struct("ConversionError")
            .field("error", &self.error)
            .field("value", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T> std::fmt::Display for ConversionError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

impl<T> std::error::Error for ConversionError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl<T> From<ConversionError<T>> for Error {
    fn from(e: ConversionError<T>) -> Error {
        e.error
    }
}

/// The message of `r`'s error, or "" when it is `Ok` (for tests that check messages).
#[cfg(test)]
pub(crate) fn err_text<T>(r: Result<T>) -> String {
    r.err().map(|e| e.to_string()).unwrap_or_default()
}

/// `Result` with kolo's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replicated_error_keeps_its_kind_and_message() {
        let errors = [
            Error::Mismatch {
                op: "allreduce",
                name: "w".into(),
                message: "shape mismatch: rank 0 sent [2], rank 1 sent [3]".into(),
                tensors: Vec::new(),
            },
            Error::WrongDevice {
                what: "fused NCCL allreduce",
                expected: Device::Cuda(0),
                actual: Device::Cuda(1),
                tensors: Vec::new(),
            },
            Error::Transport {
                call: "MPI_Allreduce",
                message: "MPI_ERR_TRUNCATE".into(),
            },
            Error::RankLeft {
                op: "allreduce",
                name: "w".into(),
                rank: 3,
                tensors: Vec::new(),
            },
            Error::Serialization {
                op: "allgather_object",
                name: "o".into(),
                rank: 1,
                source: "bad bytes".into(),
            },
        ];
        for e in &errors {
            let r = e.replicate();
            assert_eq!(std::mem::discriminant(e), std::mem::discriminant(&r));
            assert_eq!(e.to_string(), r.to_string());
        }
    }
}
