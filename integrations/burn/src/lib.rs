//! # kolo-burn
//!
//! Data-parallel training of [Burn](https://burn.dev) models across processes and
//! machines with [`kolo`]: launch one process per core share or GPU with `mpirun`, and
//! add a few lines to a Burn training loop.
//!
//! - [`broadcast_parameters`] and [`broadcast_optimizer_state`] start every rank from
//!   rank 0's model and optimizer state.
//! - [`GradientReducer`] (the fused path, recommended) averages all gradients of a step
//!   in a few large collectives between `backward` and `ModuleOptimizer::step`; call it
//!   in a hand-written loop or from an overridden `TrainStep::optimize` in burn-train.
//! - [`DistributedOptimizer`] (the per-tensor path) wraps any Burn `Optimizer` and goes
//!   wherever one goes, at the cost of one blocking collective per parameter.
//! - [`ShardedOptimizer`] (ZeRO stages 1 and 2) keeps each rank's 1/N share of the
//!   optimizer state: gradients reduce-scattered, the share stepped, parameters
//!   all-gathered; the same results as [`GradientReducer`] with the plain optimizer.
//! - [`FullyShard`] (ZeRO stage 3, FSDP) wraps a sub-module so that each rank keeps
//!   1/N of its parameters, gathered for its forward and backward, its gradients
//!   reduce-scattered: models bigger than one rank, trained by a plain optimizer
//!   (with offloading to the host, bf16/f16 compute and [`LossScaler`]), checkpointed
//!   whole ([`save_fully_sharded`], [`resume_fully_sharded`]) at any rank count.
//! - [`DistributedSampler`] shards a dataset per rank and epoch; [`average_metrics`]
//!   averages loss and accuracy for logging; [`save_checkpoint`] / [`load_checkpoint`]
//!   write crash-safe rank-0 checkpoints and resume every rank from them.
//! - [`train`] (feature `train`, default): burn-train's `SupervisedTraining` across
//!   ranks: rank 0 renders, logs and checkpoints; metrics averaged over ranks; data
//!   sharded per rank.
//!
//! ```no_run
//! # use burn::module::Module;
//! # fn demo<M: Module>(model: M, loss: burn::tensor::Tensor<1>, mut optim: burn::optim::ModuleOptimizer) -> Result<(), kolo_burn::Error> {
//! use burn::optim::GradientsParams;
//! let kolo = kolo::init()?;
//! let mut model = kolo_burn::broadcast_parameters(&kolo, model, 0)?;
//! let reducer = kolo_burn::GradientReducer::new(&kolo);
//! // in the loop:
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! let grads = reducer.reduce(&model, grads)?;
//! model = optim.step(1e-3, model, grads);
//! # Ok(()) }
//! ```

mod algorithm;
mod broadcast;
mod checkpoint;
mod convert;
#[cfg(any(feature = "cuda", feature = "cpu"))]
mod cube;
mod device;
mod engine;
mod error;
mod fsdp;
mod grads;
mod layout;
mod loss_scale;
mod metrics;
mod onebit;
mod optim;
mod overlap;
mod pipeline;
mod sharded;
mod sync_bn;
#[cfg(feature = "train")]
pub mod train;

pub use algorithm::{decentralized_average, WeightAverager};
pub use broadcast::{broadcast_optimizer_state, broadcast_parameters};
pub use checkpoint::{checkpoint_path, commit, load_checkpoint, resume, save_checkpoint, Restored};
pub use device::{cuda_device, Backend};
pub use engine::Engine;
pub use error::{Error, Result};
pub use fsdp::{
    commit_fully_sharded, consolidated_record, load_fully_sharded, load_fully_sharded_checkpoint,
    local_param_bytes, resume_fully_sharded, save_fully_sharded, FullyShard,
};
pub use grads::GradientReducer;
pub use kolo::Algorithm;
pub use kolo::DistributedSampler;
pub use kolo::{restart_count, Progress};
pub use loss_scale::{LossScaler, LossScalerState};
pub use metrics::average_metrics;
pub use onebit::OneBitAdam;
pub use optim::{DistributedOptimizer, DistributedState};
pub use overlap::Overlap;
pub use pipeline::{Pipeline, Schedule, StepOutput};
pub use sharded::ShardedOptimizer;
pub use sync_bn::SyncBatchNorm;
