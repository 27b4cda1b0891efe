//! 1-bit Adam (DeepSpeed's; Tang et al., 2021) on flat f32 vectors, framework-free:
//! the integrations flatten a model's gradients, call [`OneBitAdam::step`] and
//! subtract the update it returns.
//!
//! For the first `warmup` steps it is Adam on the ranks' averaged gradients (a full
//! precision allreduce). Then the second moment is frozen, and each rank updates its
//! momentum with its own gradient and the ranks average the momenta through a
//! 1-bit compressed allreduce with error feedback: each value is sent as its sign and
//! one scale per 256 values (the chunk's mean magnitude) — 1/29 of f32's bytes —
//! what compression dropped is added back the next step (on the sending rank, and on
//! the rank that averages each partition, as DeepSpeed's two-stage compression).
//! Unlike DeepSpeed, the momentum is compressed divided by the frozen `√v + ε` (the
//! same on every rank, so the average is the same): compressed raw, coordinates whose
//! variance froze near zero diverged in our tests. The
//! step's update is Burn's Adam formula on the averaged momentum and frozen variance.
//! Its state (moments, step, both error-feedback residuals) is [`OneBitState`]:
//! serialise it with the training checkpoint.

use serde::{Deserialize, Serialize};

use super::bytegrad::part;
use crate::error::{Error, Result};
use crate::runtime::Kolo;
use crate::tensor::Tensor;
use crate::vocab::ReduceOp;

/// Values per scale in the 1-bit encoding.
const CHUNK: usize = 256;

/// The optimizer's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OneBitAdamConfig {
    /// Adam's β₁ (0.9).
    pub beta_1: f32,
    /// Adam's β₂ (0.999).
    pub beta_2: f32,
    /// Adam's ε (1e-5, Burn's default).
    pub epsilon: f32,
    /// Steps of plain Adam before the variance is frozen and momenta are compressed
    /// (DeepSpeed's `freeze_step`).
    pub warmup: u64,
    /// `false`: never compress (plain Adam on averaged gradients throughout).
    pub compression: bool,
}

impl Default for OneBitAdamConfig {
    fn default() -> Self {
        OneBitAdamConfig {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            warmup: 100,
            compression: true,
        }
    }
}

/// What 1-bit Adam carries from step to step (checkpoint it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OneBitState {
    /// Steps taken.
    pub step: u64,
    /// First moment (the same on every rank).
    pub m: Vec<f32>,
    /// Second moment (frozen after warm-up).
    pub v: Vec<f32>,
    /// What this rank's compression of its momentum dropped.
    pub worker_error: Vec<f32>,
    /// What this rank's compression of its partition's average dropped.
    pub server_error: Vec<f32>,
}

/// 1-bit Adam over one flat f32 vector of parameters (see the module), or QAdam.
#[derive(Debug, Clone)]
pub struct OneBitAdam {
    config: OneBitAdamConfig,
    state: OneBitState,
    /// QAdam: the momentum averaged 8-bit (ByteGrad's exchange) instead of 1-bit.
    eight_bit: bool,
}

impl OneBitAdam {
    /// A fresh optimizer (a warm-up of at least one step: the frozen variance must
    /// have seen a gradient).
    pub fn new(mut config: OneBitAdamConfig) -> Self {
        config.warmup = config.warmup.max(1);
        OneBitAdam {
            config,
            state: OneBitState::default(),
            eight_bit: false,
        }
    }

    /// Bagua's QAdam: the same warm-up and frozen variance, the momentum averaged
    /// through ByteGrad's 8-bit exchange (a quarter of f32's bytes, no error feedback
    /// needed at that precision) instead of 1-bit signs: more bytes than 1-bit Adam,
    /// closer to Adam.
    pub fn qadam(config: OneBitAdamConfig) -> Self {
        OneBitAdam {
            eight_bit: true,
            ..Self::new(config)
        }
    }

    /// Whether this is QAdam (8-bit momenta).
    pub fn is_qadam(&self) -> bool {
        self.eight_bit
    }

    /// The state to checkpoint.
    pub fn state(&self) -> &OneBitState {
        &self.state
    }

    /// Restores a checkpointed state.
    pub fn set_state(&mut self, state: OneBitState) {
        self.state = state;
    }

    /// Whether the next step compresses.
    pub fn compressing(&self) -> bool {
        self.config.compression && self.state.step >= self.config.warmup
    }

    /// One step from this rank's gradient `grad` (the model's, flattened): the update
    /// to subtract from the parameters, the same on every rank. Collective: every rank
    /// calls it with the same name and length.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `grad`'s length differs from the state's; a
    /// failed collective.
    pub fn step(&mut self, kolo: &Kolo, name: &str, lr: f32, grad: Vec<f32>) -> Result<Vec<f32>> {
        let n = grad.len();
        let s = &mut self.state;
        if s.m.is_empty() && s.step == 0 {
            s.m = vec![0.0; n];
            s.v = vec![0.0; n];
        }
        if s.m.len() != n {
            return Err(Error::InvalidArgument {
                op: "OneBitAdam::step",
                name: name.to_string(),
                message: format!(
                    "{n} gradient values for a state of {}: the model changed since the \
                     state was made or restored",
                    s.m.len()
                ),
            });
        }
        let (b1, b2) = (self.config.beta_1, self.config.beta_2);
        if self.config.compression && s.step >= self.config.warmup {
            // The momentum is compressed preconditioned, m / (√v + ε): v is frozen and
            // the same on every rank, so the average is unchanged, while the sign and
            // scale of a chunk err alike in every coordinate's update (compressed raw,
            // a coordinate whose variance froze near zero takes the chunk's magnitude
            // divided by it, and diverges).
            let d: Vec<f32> = s.v.iter().map(|v| v.sqrt() + self.config.epsilon).collect();
            let local: Vec<f32> =
                s.m.iter()
                    .zip(&grad)
                    .zip(&d)
                    .map(|((m, g), d)| (b1 * m + (1.0 - b1) * g) / d)
                    .collect();
            let avg = if self.eight_bit {
                let n = local.len();
                let local = with_byte_feedback(kolo.size(), local, &mut s.worker_error);
                kolo.bytegrad_allreduce(
                    &format!("{name}.qadam"),
                    Tensor::from_vec(local, &[n])?,
                    ReduceOp::Average,
                )?
                .into_vec::<f32>()?
            } else {
                compressed_average(kolo, name, local, &mut s.worker_error, &mut s.server_error)?
            };
            s.m = avg.iter().zip(&d).map(|(p, d)| p * d).collect();
        } else {
            let len = grad.len();
            let avg = kolo
                .allreduce(
                    format!("{name}.onebit.grad"),
                    Tensor::from_vec(grad, &[len])?,
                )
                .op(ReduceOp::Average)
                .wait()?
                .into_vec::<f32>()?;
            for ((m, v), g) in s.m.iter_mut().zip(&mut s.v).zip(&avg) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
            }
        }
        s.step += 1;
        // Burn's Adam: the bias corrections at the step count (the variance's at the
        // step it was frozen).
        let frozen = if self.config.compression {
            s.step.min(self.config.warmup)
        } else {
            s.step
        };
        let c1 = 1.0 - b1.powi(s.step.min(i32::MAX as u64) as i32);
        let c2 = (1.0 - b2.powi(frozen.min(i32::MAX as u64) as i32)).sqrt();
        let eps = self.config.epsilon * c2;
        Ok(s.m
            .iter()
            .zip(&s.v)
            .map(|(m, v)| lr * m * (c2 / c1) / (v.sqrt() + eps))
            .collect())
    }
}

/// QAdam's error feedback: `local` plus what the last step's 8-bit encoding dropped,
/// and, in `dropped`, what this step's encoding of it drops (the encoding of each
/// rank's partition, as ByteGrad's first phase makes it). Without it the momenta's
/// quantisation error, a fraction of each rank's own momentum rather than of their
/// average, left a floor the quadratic test stalled on.
fn with_byte_feedback(size: usize, mut local: Vec<f32>, dropped: &mut Vec<f32>) -> Vec<f32> {
    let n = local.len();
    dropped.resize(n, 0.0);
    if size == 1 {
        return local;
    }
    for (l, e) in local.iter_mut().zip(dropped.iter()) {
        *l += e;
    }
    let mut back = vec![0.0f32; n];
    for p in 0..size {
        let r = part(n, size, p);
        let enc = super::quantize::encode(&local[r.clone()]);
        // Encoded here a moment ago: the lengths agree.
        let _ = super::quantize::decode_into(&enc, &mut back[r]);
    }
    for ((d, l), b) in dropped.iter_mut().zip(&local).zip(&back) {
        *d = l - b;
    }
    local
}

/// Appends `x` 1-bit encoded (per chunk: the mean magnitude as f32, then the signs, 8
/// a byte) and writes what the encoding dropped (`x − decoded`) to `dropped`.
fn encode_signs(x: &[f32], out: &mut Vec<u8>, dropped: &mut [f32]) {
    for (c, d) in x.chunks(CHUNK).zip(dropped.chunks_mut(CHUNK)) {
        let scale = c.iter().map(|v| v.abs()).sum::<f32>() / c.len() as f32;
        out.extend_from_slice(&scale.to_le_bytes());
        for (vals, drop) in c.chunks(8).zip(d.chunks_mut(8)) {
            let mut byte = 0u8;
            for (j, (&v, e)) in vals.iter().zip(drop.iter_mut()).enumerate() {
                let positive = v >= 0.0;
                byte |= u8::from(positive) << j;
                *e = v - if positive { scale } else { -scale };
            }
            out.push(byte);
        }
    }
}

/// Bytes [`encode_signs`] makes of `n` values.
fn signs_len(n: usize) -> usize {
    let full = n / CHUNK;
    let rest = n % CHUNK;
    full * (4 + CHUNK / 8) + if rest > 0 { 4 + rest.div_ceil(8) } else { 0 }
}

/// Adds (`add`) or writes the values `bytes` encodes to `out`.
fn decode_signs(bytes: &[u8], out: &mut [f32], add: bool) -> std::result::Result<(), String> {
    if bytes.len() != signs_len(out.len()) {
        return Err(format!("{} bytes for {} values", bytes.len(), out.len()));
    }
    let mut at = 0;
    for c in out.chunks_mut(CHUNK) {
        let scale = f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        at += 4;
        for vals in c.chunks_mut(8) {
            let byte = bytes[at];
            at += 1;
            for (j, o) in vals.iter_mut().enumerate() {
                let v = if byte >> j & 1 == 1 { scale } else { -scale };
                *o = if add { *o + v } else { v };
            }
        }
    }
    Ok(())
}

/// The ranks' average of `local` through 1-bit compression with error feedback on
/// both stages (see the module); the residuals are kept in `worker` and `server`.
fn compressed_average(
    kolo: &Kolo,
    name: &str,
    mut local: Vec<f32>,
    worker: &mut Vec<f32>,
    server: &mut Vec<f32>,
) -> Result<Vec<f32>> {
    let (n, size, rank) = (local.len(), kolo.size(), kolo.rank());
    if n < size {
        // Fewer values than ranks: empty partitions, nothing to save: full
        // precision.
        return Ok(kolo
            .allreduce(
                format!("{name}.onebit.small"),
                Tensor::from_vec(local, &[n])?,
            )
            .op(ReduceOp::Average)
            .wait()?
            .into_vec::<f32>()?);
    }
    let mine = part(n, size, rank);
    worker.resize(n, 0.0);
    server.resize(mine.len(), 0.0);
    for (l, e) in local.iter_mut().zip(worker.iter()) {
        *l += e;
    }
    // Stage 1: partition p, compressed, to rank p.
    let mut wire = Vec::with_capacity(signs_len(n) + 4 * size);
    let mut splits = Vec::with_capacity(size);
    for p in 0..size {
        let r = part(n, size, p);
        let before = wire.len();
        encode_signs(&local[r.clone()], &mut wire, &mut worker[r]);
        splits.push(wire.len() - before);
    }
    let len = wire.len();
    let got = kolo
        .alltoall(
            format!("{name}.onebit.scatter"),
            Tensor::from_vec(wire, &[len])?,
        )
        .splits(splits)
        .wait()?;
    let mut avg = vec![0.0f32; mine.len()];
    let bytes = got.tensor.as_slice::<u8>()?;
    let mut at = 0;
    for (src, &count) in got.received_splits.iter().enumerate() {
        decode_signs(&bytes[at..at + count], &mut avg, true)
            .map_err(|e| invalid(name, format!("rank {src}'s part: {e}")))?;
        at += count;
    }
    let inv = 1.0 / size as f32;
    for (a, e) in avg.iter_mut().zip(server.iter()) {
        *a = *a * inv + e;
    }
    gather_averages(kolo, name, &avg, server, n)
}

/// Stage 2 of [`compressed_average`]: this rank's partition average `avg`,
/// compressed (what compression drops into `server`), to every rank; the `n` values
/// of every rank's average.
fn gather_averages(
    kolo: &Kolo,
    name: &str,
    avg: &[f32],
    server: &mut [f32],
    n: usize,
) -> Result<Vec<f32>> {
    let size = kolo.size();
    let mut enc = Vec::with_capacity(signs_len(avg.len()));
    encode_signs(avg, &mut enc, server);
    let len = enc.len();
    let all = kolo
        .allgather(
            format!("{name}.onebit.gather"),
            Tensor::from_vec(enc, &[len])?,
        )
        .wait()?;
    let bytes = all.as_slice::<u8>()?;
    let mut out = vec![0.0f32; n];
    let mut at = 0;
    for p in 0..size {
        let r = part(n, size, p);
        let end = at + signs_len(r.len());
        let slice = bytes.get(at..end).ok_or_else(|| {
            invalid(
                name,
                format!("rank {p}'s average is missing from the gather"),
            )
        })?;
        decode_signs(slice, &mut out[r], false)
            .map_err(|e| invalid(name, format!("rank {p}'s average: {e}")))?;
        at = end;
    }
    Ok(out)
}

/// An exchange that does not decode, named after the op.
fn invalid(name: &str, message: String) -> Error {
    Error::InvalidArgument {
        op: "OneBitAdam::step",
        name: name.to_string(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_round_trip_and_residual() {
        let x: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.7).sin()).collect();
        let mut out = Vec::new();
        let mut dropped = vec![0.0; x.len()];
        encode_signs(&x, &mut out, &mut dropped);
        assert_eq!(out.len(), signs_len(x.len()));
        assert!(
            out.len() * 25 < x.len() * 4,
            "about 1/29 of f32's bytes: {}",
            out.len()
        );
        let mut back = vec![0.0; x.len()];
        decode_signs(&out, &mut back, false).unwrap();
        for ((a, b), d) in x.iter().zip(&back).zip(&dropped) {
            assert!((a - b - d).abs() < 1e-6, "residual is what was dropped");
            assert_eq!(a.is_sign_negative() && *a != 0.0, *b < 0.0);
        }
    }
}
