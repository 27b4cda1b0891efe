//! One point of the sweep, shared by its tables and its plots.

use kolo::sim::{Algorithm, StepReport};

/// One simulated job's first and steady steps.
pub(crate) struct Point {
    pub(crate) workload: &'static str,
    pub(crate) algorithm: Algorithm,
    pub(crate) ranks: usize,
    pub(crate) first: StepReport,
    pub(crate) steady: StepReport,
}
