//! kolo-candle's errors.

/// What can go wrong in kolo-candle. Converts into `candle_core::Error` (wrapped, the
/// message kept), so `?` works in functions returning candle's `Result` too.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A collective failed (another rank left, a mismatch kolo found, …).
    #[error(transparent)]
    Kolo(#[from] kolo::Error),
    /// candle refused an operation on a tensor.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The ranks hold different variables; the same error is returned on every rank.
    #[error("{what}: the ranks' variables differ: {detail}")]
    Mismatch {
        /// The call that compared them.
        what: &'static str,
        /// The first difference, naming the variable and the ranks.
        detail: String,
    },
    /// A variable's dtype is one kolo does not carry.
    #[error("{what}: variable {var} has dtype {dtype:?}, which kolo cannot reduce or broadcast (it carries f32, f64, f16, bf16, u8, i32 and i64)")]
    DType {
        /// The call.
        what: &'static str,
        /// The variable (its name, or its index in creation order).
        var: String,
        /// Its dtype.
        dtype: candle_core::DType,
    },
    /// Another rank failed this step (it could not hand a gradient over): no rank
    /// steps, and every rank's error says which failed and why.
    #[error("kolo_candle::DistributedOptimizer: rank {rank} could not hand its gradients to the reduction, so no rank steps: {message}")]
    OtherRank {
        /// The first rank that failed.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// A bad argument, named.
    #[error("{what}: {message}")]
    InvalidArgument {
        /// The call or setting.
        what: &'static str,
        /// What is wrong and what to do.
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

impl From<kolo::ConversionError<kolo::Tensor>> for Error {
    fn from(e: kolo::ConversionError<kolo::Tensor>) -> Self {
        Error::Kolo(e.into_parts().0)
    }
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// kolo-candle's result.
pub type Result<T> = std::result::Result<T, Error>;
