//! # kolo
//!
//! Horovod-style distributed training for Rust: launch one process per core share or
//! GPU with `mpirun`, call [`init`], and reduce gradients across processes by name.
//!
//! - [`init`] / [`Config`] start MPI and a background engine thread per rank.
//! - [`Kolo`] is the handle to it: rank information and every collective —
//!   [`allreduce`](Kolo::allreduce), [`grouped_allreduce`](Kolo::grouped_allreduce),
//!   [`allgather`](Kolo::allgather), [`broadcast`](Kolo::broadcast),
//!   [`alltoall`](Kolo::alltoall), [`reducescatter`](Kolo::reducescatter),
//!   [`barrier`](Kolo::barrier), [`join`](Kolo::join), and the serde-based
//!   [`broadcast_object`](Kolo::broadcast_object) and
//!   [`allgather_object`](Kolo::allgather_object).
//! - [`Tensor`] is an owned, typed, shaped buffer ([`DType`]); [`Handle`] is the result
//!   of an asynchronous collective (poll, wait, or `.await`).
//! - [`DistributedOptimizer`] wraps any [`GradientStep`] with Horovod's optimizer
//!   semantics (async submission, local accumulation, compression, fusion groups), and
//!   [`broadcast_parameters`] starts every rank from rank 0's values. The Burn
//!   integration lives in the `kolo-burn` crate.
//! - Every error is an [`Error`] that names the tensor and, for cross-rank problems,
//!   which rank sent what.
//!
//! Ranks may submit tensors in any order and from any thread: the engines agree on one
//! order before anything runs, and check that every rank asked for the same thing.
//!
//! ```no_run
//! fn main() -> Result<(), kolo::Error> {
//!     let kolo = kolo::init()?;
//!     let grad = kolo::Tensor::from_vec(vec![kolo.rank() as f32; 3], &[3])?;
//!     let h = kolo.allreduce("grad.w", grad).op(kolo::ReduceOp::Sum).submit()?;
//!     // ... more work while the reduction runs ...
//!     let sum: Vec<f32> = h.wait()?.into_vec()?;
//!     let n = kolo.size() as f32;
//!     assert_eq!(sum, vec![n * (n - 1.0) / 2.0; 3]);
//!     kolo.shutdown()
//! }
//! ```
//!
//! Run it with `mpirun -np 4 target/release/my-program`.

pub mod algorithms;
mod compression;
mod config;
pub mod deepspeed;
mod dtype;
mod engine;
mod error;
mod group_plans;
mod handle;
mod logging;
#[cfg(test)]
mod loopback_tests;
mod metrics;
mod objects;
mod ops;
mod optimizer;
mod order;
mod p2p;
mod process_set;
mod progress;
mod runtime;
mod sampler;
#[cfg(feature = "sim")]
pub mod sim;
mod submit_error;
mod tensor;
mod transport;
mod validate;
mod vocab;

pub use algorithms::Algorithm;
pub use compression::Compression;
pub use config::{Config, DEFAULT_FUSION_THRESHOLD};
pub use engine::autotune::{AutotuneChange, AutotuneState};
pub use error::{ConversionError, Error, Result, RESTARTABLE_EXIT_CODE};
pub use handle::Handle;
pub use metrics::average_metrics;
pub use ops::{
    AllgatherBuilder, AllreduceBuilder, AlltoallBuilder, BroadcastBuilder, GroupedAllgatherBuilder,
    GroupedAllreduceBuilder, GroupedReducescatterBuilder, ReducescatterBuilder,
};
pub use optimizer::{
    broadcast_parameters, DistributedOptimizer, DistributedOptimizerBuilder, GradientStep,
    Gradients,
};
pub use p2p::{RecvBuilder, SendBuilder};
pub use process_set::ProcessSet;
pub use progress::{
    mark_run_started, restart_count, resume_decision, run_id, run_started_in, Progress, ResumeError,
};
pub use runtime::{
    build_info, catch_panic, cuda_device_count, init, nccl_library_present, BuildInfo, Kolo,
};
pub use sampler::DistributedSampler;
pub use submit_error::SubmitError;
pub use tensor::{DType, Device, Element, HostBuffer, Tensor};
pub use vocab::{AllreduceAlgorithm, AlltoallOutput, ReduceOp};

/// The CUDA bindings kolo was built with (feature `nccl`), for `Tensor::from_cuda`.
#[cfg(feature = "nccl")]
pub use cudarc;
/// Re-exported so that users can build f16/bf16 tensors without naming `half` themselves.
pub use half;
