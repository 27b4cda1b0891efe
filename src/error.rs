//! The error type of every fallible kolo call.

use std::sync::Arc;

use crate::dtype::{DType, Device};

/// Everything that can go wrong in kolo.
///
/// User errors (a bad argument, a mismatch between ranks, a rank that left) are kept
/// apart from [`Error::Internal`], which means kolo itself has a bug.
#[derive(Debug, Clone, thiserror::Error)]
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
    },

    /// Some ranks never submitted a request others were waiting for, for longer than
    /// the stall shutdown time (`KOLO_STALL_SHUTDOWN_TIME_SECONDS`); every pending op
    /// on every rank fails with the report, and the engine stops. A send or receive
    /// whose peer has not come within that time fails alone with this error (naming
    /// both ranks and the name); the engine goes on.
    #[error("{report}")]
    Stalled {
        /// Which requests are missing from which ranks.
        report: String,
    },

    /// The engine is not running (after `shutdown`, or it failed).
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
    },

    /// A tensor was read as the wrong element type.
    #[error("tensor holds {actual:?} elements, not {expected:?}")]
    DTypeMismatch {
        /// The type asked for.
        expected: DType,
        /// The type the tensor holds.
        actual: DType,
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

    /// A tensor's memory could not be allocated (a shape another rank sent, say): an
    /// error instead of an abort.
    #[error("cannot allocate {bytes} bytes for a tensor of shape {shape:?} ({dtype:?})")]
    OutOfMemory {
        /// The bytes asked for.
        bytes: usize,
        /// The shape.
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
        source: Arc<dyn std::error::Error + Send + Sync>,
    },

    /// The optimizer wrapped by a [`DistributedOptimizer`](crate::DistributedOptimizer)
    /// failed its step.
    #[error("the wrapped optimizer's step failed")]
    Optimizer {
        /// The optimizer's error.
        #[source]
        source: Arc<dyn std::error::Error + Send + Sync>,
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
    },

    /// A bug in kolo: please report it with the message.
    #[error("internal kolo error (please report this bug): {0}")]
    Internal(String),
}

impl Error {
    /// Whether this is the job's failure rather than the program's: another rank left
    /// ([`Error::RankLeft`]) or the stall inspector ended the pending ops
    /// ([`Error::Stalled`]). Relaunching the job (on the ranks that remain) may get past
    /// it, so a program ending with it should exit with [`Error::exit_code`].
    pub fn is_job_failure(&self) -> bool {
        matches!(self, Error::RankLeft { .. } | Error::Stalled { .. })
    }

    /// The exit status for a program that ends with this error:
    /// [`RESTARTABLE_EXIT_CODE`] for a job failure ([`is_job_failure`](Self::is_job_failure)),
    /// which `kolorun --max-restarts` relaunches, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        if self.is_job_failure() {
            RESTARTABLE_EXIT_CODE
        } else {
            1
        }
    }

    /// The engine on `rank` is not running (`reason`).
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
        }
    }
}

/// A conversion that failed, holding the value it was given so that nothing is lost
/// (as crossbeam's `SendError<T>` holds the message): a buffer
/// `Tensor::from_host_buffer` refused, a tensor `Tensor::into_vec` was asked to read
/// as another element type, or a tensor a device copy could not convert (feature
/// `nccl`). `?` turns it into an [`Error`] (dropping the value);
/// [`into_inner`](Self::into_inner) takes the value back. (The error of a failed
/// collective, with the tensors it hands back, is a `SubmitError`.)
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
    /// Boxed: the error path allocates, and every `Result` holding one stays small.
    value: Box<T>,
}

impl<T> ConversionError<T> {
    pub(crate) fn new(error: Error, value: T) -> Self {
        ConversionError {
            error,
            value: Box::new(value),
        }
    }

    /// What went wrong.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The value the conversion was given, unchanged.
    pub fn into_inner(self) -> T {
        *self.value
    }

    /// The error and the value.
    pub fn into_parts(self) -> (Error, T) {
        (self.error, *self.value)
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

/// The exit status kolo ends a job with when the job, not the program, failed: a peer
/// stopped answering (the watchdog, `KOLO_COLLECTIVE_TIMEOUT_SECONDS`) or did not shut
/// down in time (`Kolo::shutdown_timeout`). `kolorun --max-restarts` relaunches a job
/// that ended with it (or whose rank died of a signal), but not one that ended with
/// the program's own error — a panic, a failed assertion, `exit(1)` — unless given
/// `--restart-on-error`. 75 is `EX_TEMPFAIL` of BSD's `sysexits.h`: "try again later".
pub const RESTARTABLE_EXIT_CODE: i32 = 75;
