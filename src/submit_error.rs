//! The error of a collective that never ran, with the tensors it hands back.

use std::fmt;

use crate::error::Error;
use crate::tensor::Tensor;

/// A collective that did not run, with this rank's tensors handed back unchanged so
/// that nothing the caller gave is lost (crossbeam's `SendError<T>` pattern).
///
/// `submit()` returns it when the submit is refused (an invalid argument, a duplicate
/// name, an engine that has stopped); [`Handle::wait_or_return`](crate::Handle::wait_or_return)
/// returns it when an accepted op failed before any of its data was sent (a mismatch
/// between ranks, a rank that left, a stall, the engine stopping). The tensors come in
/// the order the caller gave them; they are empty when the op ran, or failed while
/// running (its buffers cannot be trusted then).
///
/// It shows as its [`Error`], and `?` turns it into one (dropping the tensors).
///
/// ```no_run
/// # fn main() -> kolo::Result<()> {
/// let kolo = kolo::init()?;
/// let t = kolo::Tensor::from_vec(vec![1.0f32, 2.0], &[2])?;
/// match kolo.broadcast("w", t, 99).submit() {
///     Ok(handle) => { handle.wait()?; }
///     Err(refused) => {
///         eprintln!("{refused}");                 // broadcast "w": root 99 is out of range …
///         let t = refused.into_tensors().remove(0); // the tensor, unchanged
///         kolo.broadcast("w", t, 0).wait()?;
///     }
/// }
/// # Ok(())
/// # }
/// ```
pub struct SubmitError {
    error: Error,
    tensors: Vec<Tensor>,
}

impl SubmitError {
    /// `error`, handing `tensors` back.
    pub(crate) fn new(error: Error, tensors: Vec<Tensor>) -> Self {
        SubmitError { error, tensors }
    }

    /// What went wrong.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The tensors handed back, in the caller's order (empty when the op ran).
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// Takes the tensors back, in the caller's order.
    pub fn into_tensors(self) -> Vec<Tensor> {
        self.tensors
    }

    /// The error alone.
    pub fn into_error(self) -> Error {
        self.error
    }

    /// The error and the tensors.
    pub fn into_parts(self) -> (Error, Vec<Tensor>) {
        (self.error, self.tensors)
    }

    /// The same error with its tensors in another order (a group submitted sorted).
    pub(crate) fn map_tensors(self, f: impl FnOnce(Vec<Tensor>) -> Vec<Tensor>) -> Self {
        SubmitError {
            error: self.error,
            tensors: f(self.tensors),
        }
    }
}

impl From<Error> for SubmitError {
    /// An error that hands nothing back.
    fn from(error: Error) -> Self {
        SubmitError::new(error, Vec::new())
    }
}

impl From<SubmitError> for Error {
    fn from(e: SubmitError) -> Error {
        e.error
    }
}

impl fmt::Debug for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The tensors may be large: only their shapes are shown.
        let shapes: Vec<&[usize]> = self.tensors.iter().map(Tensor::shape).collect();
        f.debug_struct("SubmitError")
            .field("error", &self.error)
            .field("tensors", &shapes)
            .finish()
    }
}

impl fmt::Display for SubmitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl std::error::Error for SubmitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}
