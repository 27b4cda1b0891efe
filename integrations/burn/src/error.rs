//! The error type of kolo-burn.

use std::path::PathBuf;

/// What can go wrong in the Burn integration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A kolo collective failed (mismatch between ranks, a rank that left, …).
    #[error(transparent)]
    Kolo(#[from] kolo::Error),

    /// A DeepSpeed config that cannot be used ([`crate::Engine`]).
    #[error("DeepSpeed config: {0}")]
    Config(#[from] kolo::deepspeed::ConfigError),

    /// Burn could not (de)serialise a module or optimizer record.
    #[error("{what}: {message}")]
    Record {
        /// What was being (de)serialised.
        what: &'static str,
        /// Burn's message.
        message: String,
    },

    /// Another rank failed its part of an operation that every rank takes part in (the
    /// root of a broadcast could not serialise what it sends, a rank could not hand its
    /// gradients to the reduction). Every other rank reports this, so that no rank
    /// waits for a collective that will not come; the failing rank reports its own error.
    #[error("rank {rank} could not {what}: {message}")]
    OtherRank {
        /// The rank that failed.
        rank: usize,
        /// What it could not do.
        what: &'static str,
        /// Its error.
        message: String,
    },

    /// The ranks' models differ: another parameter, shape or dtype at the same place.
    #[error("the ranks' models differ at parameter #{index} ({parameter:?}): {ranks}")]
    ModelMismatch {
        /// The position of the first differing parameter in module order.
        index: usize,
        /// Its path in the module (e.g. `fc1.weight`).
        parameter: String,
        /// What each rank has there.
        ranks: String,
    },

    /// An argument kolo-burn cannot work with.
    #[error("{what}: {message}")]
    InvalidArgument {
        /// The function or setting.
        what: &'static str,
        /// What is wrong and what to do instead.
        message: String,
    },

    /// A pipeline stage cannot run (its input, its forward, or an earlier stage's
    /// failure passed on).
    #[error("pipeline stage {stage} (ranks {ranks:?}): {message}")]
    Pipeline {
        /// The stage.
        stage: usize,
        /// The ranks that run it (one per replica).
        ranks: Vec<usize>,
        /// What went wrong.
        message: String,
    },

    /// A device this rank was asked to train on cannot be used here (no CUDA driver,
    /// no such GPU, or a build without the feature).
    #[error("rank {rank}: cannot use device {device}: {message}")]
    Device {
        /// This rank.
        rank: usize,
        /// The device asked for, e.g. `cuda:0`.
        device: String,
        /// Why, and what to install or change.
        message: String,
    },

    /// A tensor's data could not be read.
    #[error("reading gradient {name:?}: {message}")]
    Data {
        /// The parameter.
        name: String,
        /// Burn's message.
        message: String,
    },

    /// A checkpoint file could not be written or read.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// The checkpoint directory holds no commit on a relaunch, or another run's.
    #[error(transparent)]
    Resume(#[from] kolo::ResumeError),
    /// A checkpoint file is not one kolo-burn wrote, or is from another version.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl Error {
    /// The exit status for a program that ends with this error, as
    /// [`kolo::Error::exit_code`]: [`kolo::RESTARTABLE_EXIT_CODE`] when the job failed
    /// (another rank left, a stall), so that `kolorun --max-restarts` relaunches it;
    /// 1 for the program's own errors.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Kolo(k) => k.exit_code(),
            _ => 1,
        }
    }
}

/// A refused or failed collective; its handed-back tensors are dropped here, so match
/// on the [`kolo::SubmitError`] itself to keep them.
impl From<kolo::SubmitError> for Error {
    fn from(e: kolo::SubmitError) -> Error {
        Error::Kolo(e.into_error())
    }
}

/// A kolo conversion that failed (`into_vec`, `from_host_buffer`, …); the value it
/// held back is dropped here, so match on the conversion's own error to keep it.
impl<T> From<kolo::ConversionError<T>> for Error {
    fn from(e: kolo::ConversionError<T>) -> Self {
        Error::Kolo(e.into())
    }
}

/// `Result` with kolo-burn's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
