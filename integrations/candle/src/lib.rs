//! # kolo-candle: data-parallel training of candle models across processes
//!
//! [candle](https://github.com/huggingface/candle) trains in one process; kolo-candle
//! adds what a Horovod user expects, in candle's idioms, on top of kolo's engine
//! (negotiation, fusion, MPI):
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, Module, Optimizer, VarBuilder, VarMap, SGD};
//! # fn main() -> anyhow::Result<()> {
//! let kolo = kolo::init()?;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let model = linear(4, 2, vb.pp("fc"))?;
//! // candle draws weights at random per process: start every rank from rank 0's.
//! kolo_candle::broadcast_parameters(&kolo, &varmap, 0)?;
//! let mut opt = kolo_candle::DistributedOptimizer::new(
//!     &kolo,
//!     SGD::new(varmap.all_vars(), 0.1)?,
//!     varmap.all_vars(),
//! )?;
//! let x = Tensor::ones((8, 4), DType::F32, &Device::Cpu)?;
//! let loss = model.forward(&x)?.sqr()?.mean_all()?;
//! opt.backward_step(&loss)?; // gradients averaged across ranks, then SGD steps
//! # Ok(()) }
//! ```
//!
//! - [`DistributedOptimizer`] wraps any `candle_nn::Optimizer` and is one itself:
//!   `step`/`backward_step` average (or sum) the gradients of its variables across
//!   ranks, each submitted to kolo as its own tensor so that kolo's engine fuses the
//!   small ones, then steps the wrapped optimizer. Gradient accumulation with
//!   [`DistributedOptimizer::backward_passes_per_step`].
//! - [`broadcast_parameters`] copies the root's variables into every rank's
//!   `VarMap`.
//! - [`DistributedSampler`] and [`average_metrics`] are kolo's framework-free ones.
//! - Every rank must hold the same variables (count, shapes, dtypes; for the
//!   broadcast also names): a difference fails on every rank, naming the first
//!   differing variable and the ranks ([`Error::Mismatch`]).
//!
//! Copies: a gradient on the CPU is copied once, out of candle's storage (candle keeps
//! tensors behind a shared lock, so kolo cannot take the buffer), and the reduced
//! result becomes a candle tensor without a copy. A small gradient is copied once
//! more, into kolo's fusion buffer. Gradients on a GPU go through the host.

mod algorithm;
mod broadcast;
mod convert;
mod error;
mod onebit;
mod optim;
mod vars;

pub use algorithm::decentralized_average;
pub use broadcast::broadcast_parameters;
pub use error::{Error, Result};
pub use kolo::Algorithm;
pub use kolo::{average_metrics, DistributedSampler};
pub use onebit::OneBitAdam;
pub use optim::DistributedOptimizer;
