//! How data-parallel ranks synchronise, beyond full-precision gradient allreduce:
//! the communication-efficient algorithms of Bagua, DeepSpeed and Horovod for slow
//! links, framework-free so that every integration shares them.
//!
//! - [`Algorithm::ByteGrad`]: gradients allreduced with 8-bit values and a scale per
//!   1 KiB chunk ([`Kolo::bytegrad_allreduce`]): ~1/4 of f32's bytes on the wire.
//! - [`Algorithm::Decentralized`]: no gradient exchange; after each step a rank
//!   averages its weights with one peer, the peer rotating
//!   ([`Kolo::decentralized_average`]): point to point, no collective.
//! - [`Algorithm::Adasum`]: gradients combined by Horovod's adaptive summation
//!   ([`Kolo::adasum_allreduce`]).
//! - [`Algorithm::Decentralized8Bit`]: decentralized SGD in low precision on a ring:
//!   8-bit differences against public copies of the neighbours' weights
//!   ([`WeightAverager`]).
//! - [`Algorithm::Async`]: asynchronous model averaging every period, applied when
//!   it arrives, no barrier ([`WeightAverager`]).
//! - [`Algorithm::OneBitAdam`]: DeepSpeed's 1-bit Adam ([`OneBitAdam`]): Adam whose
//!   momentum is averaged through 1-bit compression with error feedback after a
//!   warm-up, the variance frozen.
//! - [`Algorithm::QAdam`]: Bagua's QAdam ([`OneBitAdam::qadam`]): the same, the
//!   momentum averaged 8-bit (ByteGrad's exchange).
//!
//! The quantiser is [`quantize`]; the decentralized schedule is
//! [`decentralized::peers`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::runtime::Kolo;

mod adasum;
mod averaging;
mod bytegrad;
pub mod decentralized;
mod onebit;
pub mod quantize;

pub use averaging::{ring_neighbours, AsyncPeriod, AveragerState, WeightAverager};
pub use onebit::{OneBitAdam, OneBitAdamConfig, OneBitState};

pub use adasum::tree as adasum_tree;
#[cfg(test)]
pub(crate) use bytegrad::part;

/// How a data-parallel step synchronises the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Algorithm {
    /// Gradients allreduced in full precision (the default; Horovod's and DDP's).
    #[default]
    Allreduce,
    /// Gradients allreduced 8-bit (Bagua's ByteGrad): compressed reduce-scatter, then
    /// compressed all-gather.
    ByteGrad,
    /// No gradient exchange: each rank steps on its own gradients and then averages
    /// its weights with one peer (Bagua's decentralized SGD, shift-one, full
    /// precision). The ranks' weights differ between steps and approach each other.
    Decentralized,
    /// Gradients combined with Adasum (Horovod's): orthogonal parts add, common parts
    /// average. Meant for large learning rates and many ranks; the result is not
    /// divided by the number of ranks.
    Adasum,
    /// DeepSpeed's 1-bit Adam ([`OneBitAdam`]): an optimizer of its own, not a way to
    /// reduce gradients.
    OneBitAdam,
    /// Decentralized SGD in low precision (Bagua's): each rank steps on its own
    /// gradients, then mixes its weights with its two ring neighbours' through 8-bit
    /// differences ([`WeightAverager`]).
    Decentralized8Bit,
    /// Bagua's QAdam ([`OneBitAdam::qadam`]): 1-bit Adam's schedule with the momentum
    /// averaged 8-bit; an optimizer of its own.
    QAdam,
    /// Asynchronous model averaging (Bagua's): each rank steps on its own gradients;
    /// every period its weights are averaged in the background and the average is
    /// applied when it arrives ([`WeightAverager`]).
    Async,
}

/// The names [`Algorithm`] parses and prints, in its order.
pub const ALGORITHM_NAMES: [&str; 8] = [
    "allreduce",
    "bytegrad",
    "decentralized",
    "adasum",
    "onebit-adam",
    "decentralized-8bit",
    "qadam",
    "async",
];

impl Algorithm {
    /// The algorithm's name, as `--algorithm` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Allreduce => ALGORITHM_NAMES[0],
            Algorithm::ByteGrad => ALGORITHM_NAMES[1],
            Algorithm::Decentralized => ALGORITHM_NAMES[2],
            Algorithm::Adasum => ALGORITHM_NAMES[3],
            Algorithm::OneBitAdam => ALGORITHM_NAMES[4],
            Algorithm::Decentralized8Bit => ALGORITHM_NAMES[5],
            Algorithm::QAdam => ALGORITHM_NAMES[6],
            Algorithm::Async => ALGORITHM_NAMES[7],
        }
    }

    /// Whether a gradient reducer runs the algorithm (the others exchange weights, or
    /// are optimizers of their own).
    pub fn reduces_gradients(self) -> bool {
        matches!(
            self,
            Algorithm::Allreduce | Algorithm::ByteGrad | Algorithm::Adasum
        )
    }

    /// Whether the algorithm exchanges weights after local steps ([`WeightAverager`]):
    /// decentralized, decentralized-8bit, async.
    pub fn exchanges_weights(self) -> bool {
        matches!(
            self,
            Algorithm::Decentralized | Algorithm::Decentralized8Bit | Algorithm::Async
        )
    }

    /// Whether the algorithm is an optimizer of its own ([`OneBitAdam`]): onebit-adam,
    /// qadam.
    pub fn is_optimizer(self) -> bool {
        matches!(self, Algorithm::OneBitAdam | Algorithm::QAdam)
    }

    /// Checks that every rank chose the same algorithm (collective: every rank calls
    /// it with the same `name`).
    ///
    /// # Errors
    /// [`Error::Mismatch`] on every rank, naming each rank's algorithm; a failed
    /// collective.
    pub fn agree(self, kolo: &Kolo, name: &str) -> Result<()> {
        let all: Vec<String> = kolo.allgather_object(name, self.name().to_string())?;
        if all.iter().all(|a| a == self.name()) {
            return Ok(());
        }
        let ranks: Vec<String> = all
            .iter()
            .enumerate()
            .map(|(r, a)| format!("rank {r}: {a}"))
            .collect();
        Err(Error::Mismatch {
            op: "algorithm",
            name: name.to_string(),
            message: format!(
                "the ranks chose different synchronisation algorithms ({}); give every rank \
                 the same one",
                ranks.join(", ")
            ),
        })
    }
}

impl Kolo {
    /// Reduces several f32 tensors with a gradient `algorithm` (ByteGrad or Adasum) as
    /// one flat buffer, each multiplied by `prescale` first (e.g. 1 / backward passes):
    /// the results in the tensors' order and shapes. What both integrations' reducers
    /// run per bucket. Blocking; every rank calls it with the same name and shapes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an algorithm that does not reduce gradients or a
    /// tensor that is not f32 (alike on every rank, before anything is sent); the
    /// algorithm's errors.
    pub fn algorithm_allreduce(
        &self,
        name: &str,
        algorithm: Algorithm,
        op: crate::vocab::ReduceOp,
        prescale: f32,
        tensors: Vec<crate::tensor::Tensor>,
    ) -> Result<Vec<crate::tensor::Tensor>> {
        let invalid = |message: String| Error::InvalidArgument {
            op: "algorithm_allreduce",
            name: name.to_string(),
            message,
        };
        if !matches!(algorithm, Algorithm::ByteGrad | Algorithm::Adasum) {
            return Err(invalid(format!("{algorithm} does not reduce gradients")));
        }
        let shapes: Vec<Vec<usize>> = tensors.iter().map(|t| t.shape().to_vec()).collect();
        let mut flat = Vec::with_capacity(tensors.iter().map(crate::tensor::Tensor::len).sum());
        for (i, t) in tensors.into_iter().enumerate() {
            if t.dtype() != crate::tensor::DType::F32 {
                return Err(invalid(format!(
                    "{algorithm} reduces f32 tensors; member {i} is {:?}",
                    t.dtype()
                )));
            }
            flat.extend(t.into_vec::<f32>()?);
        }
        if prescale != 1.0 {
            flat.iter_mut().for_each(|v| *v *= prescale);
        }
        let len = flat.len();
        let t = crate::tensor::Tensor::from_vec(flat, &[len])?;
        let out = match algorithm {
            Algorithm::Adasum => self.adasum_allreduce(name, t)?,
            _ => self.bytegrad_allreduce(name, t, op)?,
        }
        .into_vec::<f32>()?;
        let mut at = 0;
        shapes
            .iter()
            .map(|s| {
                let n: usize = s.iter().product();
                let t = crate::tensor::Tensor::from_vec(out[at..at + n].to_vec(), s);
                at += n;
                t
            })
            .collect()
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown algorithm name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct UnknownAlgorithm {
    message: String,
}

impl FromStr for Algorithm {
    type Err = UnknownAlgorithm;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let all = [
            Algorithm::Allreduce,
            Algorithm::ByteGrad,
            Algorithm::Decentralized,
            Algorithm::Adasum,
            Algorithm::OneBitAdam,
            Algorithm::Decentralized8Bit,
            Algorithm::QAdam,
            Algorithm::Async,
        ];
        if let Some(a) = all.into_iter().find(|a| a.name() == s) {
            return Ok(a);
        }
        let message = format!(
            "unknown algorithm {s:?}; available: {}",
            ALGORITHM_NAMES.join(", ")
        );
        Err(UnknownAlgorithm { message })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in ALGORITHM_NAMES {
            assert_eq!(n.parse::<Algorithm>().unwrap().name(), n);
        }
        let e = "ring".parse::<Algorithm>().unwrap_err().to_string();
        assert!(
            e.starts_with("unknown algorithm \"ring\"") && e.contains("decentralized-8bit"),
            "{e}"
        );
        for a in ALGORITHM_NAMES.map(|n| n.parse::<Algorithm>().unwrap()) {
            let kinds = [
                a.reduces_gradients(),
                a.exchanges_weights(),
                a.is_optimizer(),
            ];
            assert_eq!(kinds.iter().filter(|k| **k).count(), 1, "{a}");
        }
    }
}
