//! The algorithms that exchange *weights* between optimizer steps instead of reducing
//! gradients, behind one stateful object, [`WeightAverager`], that every integration
//! drives with a model's flattened weights after each local step:
//!
//! - [`Algorithm::Decentralized`]: `(mine + peer's) / 2` with one peer, the peer
//!   rotating ([`Kolo::decentralized_average`]).
//! - [`Algorithm::Decentralized8Bit`]: low precision decentralized SGD on a ring
//!   (CHOCO-gossip, Koloskova et al. 2019; Bagua's low-precision decentralized
//!   algorithm is of this family): every rank keeps a public copy of its own weights
//!   and of its two ring neighbours', as all three ranks know them; each step it sends
//!   both neighbours only the 8-bit quantised *difference* between its weights and its
//!   public copy ([`quantize`](super::quantize): a quarter of f32's bytes per
//!   neighbour), every holder adds the same decoded difference to that copy, and each
//!   rank moves its weights by `Σ (neighbour's copy − own copy) / (neighbours + 1)`.
//!   The mixing is symmetric, so the ranks' mean is kept; what quantisation drops
//!   stays in `weights − copy` and is sent again at the next step (no error is lost).
//! - [`Algorithm::Async`]: asynchronous model averaging (Bagua's): every `period`
//!   (steps or milliseconds, each rank by its own count) a rank snapshots its weights
//!   and submits an allreduce (Average) of the snapshot without waiting; training goes
//!   on, and at the first step after the average arrives the rank adds
//!   `average − snapshot` to its weights, keeping the steps it took meanwhile. No rank
//!   waits at a barrier; a round completes once every rank has submitted it.
//!
//! The state ([`AveragerState`]) is what a checkpoint needs; call
//! [`finish`](WeightAverager::finish) before saving, so that no asynchronous round
//! is in flight.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{quantize, Algorithm};
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::runtime::Kolo;
use crate::tensor::Tensor;
use crate::vocab::ReduceOp;

/// How often [`Algorithm::Async`] averages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AsyncPeriod {
    /// Every `n` local steps.
    Steps(u64),
    /// Once at least this many milliseconds passed since the last round began.
    Millis(u64),
}

impl Default for AsyncPeriod {
    fn default() -> Self {
        AsyncPeriod::Steps(4)
    }
}

/// What a [`WeightAverager`] carries from step to step (checkpoint it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AveragerState {
    /// Exchanges made (the decentralized peer schedule counts them).
    pub step: u64,
    /// Decentralized 8-bit: this rank's weights as its neighbours know them.
    pub own: Vec<f32>,
    /// Decentralized 8-bit: each ring neighbour's weights as this rank knows them, in
    /// the order of [`ring_neighbours`].
    pub neighbours: Vec<Vec<f32>>,
    /// Async: rounds submitted.
    pub rounds: u64,
}

/// The ranks `rank` exchanges with on a ring of `size`: left then right, once each
/// (one neighbour at two ranks, none alone).
pub fn ring_neighbours(rank: usize, size: usize) -> Vec<usize> {
    let mut n = Vec::with_capacity(2);
    for r in [(rank + size - 1) % size, (rank + 1) % size] {
        if r != rank && !n.contains(&r) {
            n.push(r);
        }
    }
    n
}

/// An asynchronous round in flight: its handle and the weights it averages.
struct Round {
    handle: Handle<Tensor>,
    snapshot: Vec<f32>,
}

/// Averages a model's weights between steps with one of the weight-exchanging
/// algorithms (see the module).
pub struct WeightAverager {
    algorithm: Algorithm,
    period: AsyncPeriod,
    state: AveragerState,
    round: Option<Round>,
    last: Instant,
}

impl std::fmt::Debug for WeightAverager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightAverager")
            .field("algorithm", &self.algorithm)
            .field("period", &self.period)
            .field("step", &self.state.step)
            .field("round_in_flight", &self.round.is_some())
            .finish()
    }
}

impl WeightAverager {
    /// An averager for `algorithm` (decentralized, decentralized-8bit or async).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an algorithm that does not exchange weights.
    pub fn new(algorithm: Algorithm) -> Result<Self> {
        if !algorithm.exchanges_weights() {
            return Err(Error::InvalidArgument {
                op: "WeightAverager::new",
                name: algorithm.name().to_string(),
                message: format!(
                    "{algorithm} does not exchange weights (decentralized, \
                     decentralized-8bit and async do)"
                ),
            });
        }
        Ok(WeightAverager {
            algorithm,
            period: AsyncPeriod::default(),
            state: AveragerState::default(),
            round: None,
            last: Instant::now(),
        })
    }

    /// How often [`Algorithm::Async`] averages (default every 4 steps).
    pub fn period(mut self, period: AsyncPeriod) -> Self {
        self.period = period;
        self
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The state to checkpoint (after [`finish`](Self::finish)).
    pub fn state(&self) -> &AveragerState {
        &self.state
    }

    /// Restores a checkpointed state.
    pub fn set_state(&mut self, state: AveragerState) {
        self.state = state;
    }

    /// Whether an asynchronous round is in flight.
    pub fn in_flight(&self) -> bool {
        self.round.is_some()
    }

    /// The exchange after one local optimizer step, on the model's flattened f32
    /// weights (changed in place). Decentralized: point to point with this step's
    /// peers, blocking. Async: applies a round that arrived, and starts one when the
    /// period is up, never waiting. Every rank calls it after every step with the same
    /// name and length. Returns whether the weights changed (async: only at the
    /// steps that apply a round), so that an integration writes them back only then.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the weights' length differs from a neighbour's
    /// or from the state's (the model changed); a failed transfer.
    pub fn after_step(&mut self, kolo: &Kolo, name: &str, weights: &mut [f32]) -> Result<bool> {
        match self.algorithm {
            Algorithm::Decentralized => {
                let n = weights.len();
                let t = Tensor::from_vec(weights.to_vec(), &[n])?;
                let mixed = kolo
                    .decentralized_average(name, self.state.step, t)?
                    .into_vec::<f32>()?;
                weights.copy_from_slice(&mixed);
                self.state.step += 1;
                Ok(kolo.size() > 1)
            }
            Algorithm::Decentralized8Bit => self.gossip(kolo, name, weights),
            _ => self.asynchronous(kolo, name, weights),
        }
    }

    /// Ends the exchange for now (before a checkpoint, an evaluation that must see
    /// averaged weights, or the end of training): async averaging completes every
    /// round any rank started (collective: every rank calls it) and applies them.
    /// Nothing to do for the decentralized algorithms. Returns whether the weights
    /// changed.
    ///
    /// # Errors
    /// As [`after_step`](Self::after_step).
    pub fn finish(&mut self, kolo: &Kolo, name: &str, weights: &mut [f32]) -> Result<bool> {
        if self.algorithm == Algorithm::Async {
            return self.drain(kolo, name, weights);
        }
        Ok(false)
    }

    fn invalid(name: &str, message: String) -> Error {
        Error::InvalidArgument {
            op: "WeightAverager::after_step",
            name: name.to_string(),
            message,
        }
    }

    /// One CHOCO-gossip step on the ring with 8-bit differences (see the module).
    fn gossip(&mut self, kolo: &Kolo, name: &str, weights: &mut [f32]) -> Result<bool> {
        let (rank, size, n) = (kolo.rank(), kolo.size(), weights.len());
        let peers = ring_neighbours(rank, size);
        self.state.step += 1;
        if peers.is_empty() {
            return Ok(false);
        }
        let s = &mut self.state;
        if s.own.is_empty() && s.neighbours.is_empty() {
            s.own = vec![0.0; n];
            s.neighbours = vec![vec![0.0; n]; peers.len()];
        }
        if s.own.len() != n || s.neighbours.len() != peers.len() {
            return Err(Self::invalid(
                name,
                format!(
                    "{n} weights (and {} ring neighbours) for a state of {} (and {}): the \
                     model or the number of ranks changed since the state was made",
                    peers.len(),
                    s.own.len(),
                    s.neighbours.len()
                ),
            ));
        }
        let diff: Vec<f32> = weights.iter().zip(&s.own).map(|(w, o)| w - o).collect();
        let wire = quantize::encode(&diff);
        let len = wire.len();
        // A name per direction: a rank sends to, and receives from, two ranks at once.
        let tag = |from: usize, to: usize| format!("{name}.decentralized-8bit.{from}>{to}");
        let mut sent = Vec::with_capacity(peers.len());
        for &p in &peers {
            let t = Tensor::from_vec(wire.clone(), &[len])?;
            sent.push(kolo.send(tag(rank, p), t, p).submit()?);
        }
        // The copy of this rank's weights moves by what the neighbours decode.
        quantize::decode_add(&wire, &mut s.own)
            .map_err(|e| Self::invalid(name, format!("this rank's own difference: {e}")))?;
        for (&p, copy) in peers.iter().zip(s.neighbours.iter_mut()) {
            let got = kolo.recv(tag(p, rank), p).wait()?;
            let bytes = got.as_slice::<u8>()?;
            quantize::decode_add(bytes, copy).map_err(|e| {
                Self::invalid(
                    name,
                    format!("rank {p}'s difference ({e}): the ranks' models differ"),
                )
            })?;
        }
        for h in sent {
            h.wait()?;
        }
        let share = 1.0 / (peers.len() + 1) as f32;
        for (i, w) in weights.iter_mut().enumerate() {
            let own = s.own[i];
            let pull: f32 = s.neighbours.iter().map(|c| c[i] - own).sum();
            *w += share * pull;
        }
        Ok(true)
    }

    /// Async averaging after a step: applies a round, then starts one when the
    /// period is up. With a period in steps the k-th round starts at step k × period
    /// and is applied at step (k + 1) × period (waiting there if it is still in
    /// flight: staleness of one period), never earlier even when it arrived earlier:
    /// the weights then do not depend on how fast the network was, so every rank
    /// starts the same rounds and a run resumed from a checkpoint ends where an
    /// uninterrupted one does (applying a round as soon as it arrived made that a
    /// matter of timing: `issue57_digits_resume_exact_algorithms` failed one CI run in
    /// a few). With a period in time each rank applies a round as soon as it arrived
    /// and starts rounds by its own clock, and [`finish`](Self::finish) evens out the
    /// counts.
    fn asynchronous(&mut self, kolo: &Kolo, name: &str, weights: &mut [f32]) -> Result<bool> {
        self.state.step += 1;
        let mut changed = false;
        let by_time = matches!(self.period, AsyncPeriod::Millis(_));
        if by_time && self.round.as_ref().is_some_and(|r| r.handle.poll()) {
            changed = self.apply(name, weights)?;
        }
        let due = match self.period {
            AsyncPeriod::Steps(k) => self.state.step.is_multiple_of(k.max(1)),
            AsyncPeriod::Millis(ms) => {
                self.round.is_none() && self.last.elapsed() >= Duration::from_millis(ms)
            }
        };
        if !due || kolo.size() == 1 {
            return Ok(changed);
        }
        changed |= self.apply(name, weights)?;
        self.start_round(kolo, name, weights)?;
        Ok(changed)
    }

    /// Waits for the round in flight, if any, and adds `average − snapshot` to the
    /// weights; whether there was one.
    fn apply(&mut self, name: &str, weights: &mut [f32]) -> Result<bool> {
        let Some(round) = self.round.take() else {
            return Ok(false);
        };
        let avg = round.handle.wait()?.into_vec::<f32>()?;
        if avg.len() != weights.len() {
            return Err(Self::invalid(
                name,
                format!(
                    "an average of {} values for {} weights: the model changed while a \
                     round was in flight",
                    avg.len(),
                    weights.len()
                ),
            ));
        }
        for ((w, a), s) in weights.iter_mut().zip(&avg).zip(&round.snapshot) {
            *w += a - s;
        }
        Ok(true)
    }

    /// Submits the next round: an allreduce (Average) of the weights as they are.
    fn start_round(&mut self, kolo: &Kolo, name: &str, weights: &[f32]) -> Result<()> {
        let snapshot = weights.to_vec();
        let n = snapshot.len();
        // One name for every round: a rank submits the next only after its last one
        // completed, which every rank had submitted, so the k-th submissions pair up.
        let handle = kolo
            .allreduce(
                format!("{name}.async"),
                Tensor::from_vec(snapshot.clone(), &[n])?,
            )
            .op(ReduceOp::Average)
            .submit()?;
        self.round = Some(Round { handle, snapshot });
        self.state.rounds += 1;
        self.last = Instant::now();
        Ok(())
    }

    /// Async: the ranks agree on the most rounds any started, the ranks behind start
    /// theirs (pairing with the others' last ones), and every round is applied;
    /// whether any was.
    fn drain(&mut self, kolo: &Kolo, name: &str, weights: &mut [f32]) -> Result<bool> {
        if kolo.size() == 1 {
            return Ok(false);
        }
        let rounds = i64::try_from(self.state.rounds).unwrap_or(i64::MAX);
        let most = kolo
            .allreduce(
                format!("{name}.async.rounds"),
                Tensor::from_vec(vec![rounds], &[1])?,
            )
            .op(ReduceOp::Max)
            .wait()?
            .into_vec::<i64>()?
            .first()
            .copied()
            .unwrap_or(rounds);
        let mut changed = self.apply(name, weights)?;
        while (self.state.rounds as i64) < most {
            self.start_round(kolo, name, weights)?;
            changed |= self.apply(name, weights)?;
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_neighbours_of_small_rings() {
        assert_eq!(ring_neighbours(0, 1), Vec::<usize>::new());
        assert_eq!(ring_neighbours(0, 2), vec![1]);
        assert_eq!(ring_neighbours(1, 2), vec![0]);
        assert_eq!(ring_neighbours(0, 4), vec![3, 1]);
        assert_eq!(ring_neighbours(3, 4), vec![2, 0]);
    }

    #[test]
    fn only_weight_algorithms() {
        let e = WeightAverager::new(Algorithm::ByteGrad).unwrap_err();
        assert!(e.to_string().contains("does not exchange weights"), "{e}");
        assert!(WeightAverager::new(Algorithm::Async).is_ok());
    }
}
