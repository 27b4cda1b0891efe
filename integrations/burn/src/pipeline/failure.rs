//! A step that fails somewhere fails everywhere: a failing stage tells the
//! neighbours that wait for it, in place of the tensor each would receive next, and
//! every step ends with the job's ranks agreeing whether it went through (issue 53
//! item 20).

use super::{Pipeline, StepState};
use crate::error::{Error, Result};

/// A neighbouring stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    /// The previous stage (activations come from it).
    Prev,
    /// The next stage (gradients come from it).
    Next,
}

impl Pipeline {
    /// Whether step `step` went through on every rank of the job (`passed` here): a
    /// step that failed on any stage of any replica fails on every rank — the failing
    /// ones with their own error, the others with [`Error::OtherRank`] naming the
    /// first that failed — before any replica reduces, so that no stage or replica
    /// steps alone (a stage after a failure that had all its activations would
    /// otherwise finish the step) and the next step starts in step everywhere. One
    /// allreduce of one value per step; the failures' texts are gathered only when
    /// one failed.
    pub(super) fn agree_step(&self, step: u64, passed: Result<()>) -> Result<()> {
        let size = self.kolo.size();
        let mine = if passed.is_err() {
            self.kolo.rank()
        } else {
            size
        };
        let first = self
            .kolo
            .allreduce(
                "kolo_burn.pipeline.step_failed",
                kolo::Tensor::from_vec(vec![mine as f64], &[1])?,
            )
            .op(kolo::ReduceOp::Min)
            .wait()
            .and_then(|t| t.into_vec::<f64>().map_err(|e| e.into_parts().0));
        let first = match (first, &passed) {
            (Ok(v), _) => v.first().map_or(size, |&r| r as usize),
            (Err(e), Ok(())) => return Err(e.into()),
            // This rank's own failure says more than the agreement's.
            (Err(_), Err(_)) => return passed,
        };
        if first >= size {
            return passed;
        }
        let text = passed.as_ref().err().map(ToString::to_string);
        let texts: Vec<Option<String>> = self
            .kolo
            .allgather_object("kolo_burn.pipeline.step_failures", text)?;
        passed?;
        Err(Error::OtherRank {
            rank: first,
            what: if step == 0 {
                "finish the pipeline's first step"
            } else {
                "finish this pipeline step"
            },
            message: texts
                .get(first)
                .cloned()
                .flatten()
                .unwrap_or_else(|| "(no message)".into()),
        })
    }

    /// After this stage's step failed with `why` (its own error, or one a neighbour
    /// passed on): tells each neighbour that may still wait for this stage — in place
    /// of the next tensor it would receive from here (activations, in micro-batch
    /// order, for the next stage; gradients for the previous one) — so that no stage
    /// is left in a receive (issue 53 item 20). The side a failure came from is not
    /// told again; each stage passes it on away from where it came.
    pub(super) fn tell_neighbours<M, I, O>(&self, state: &StepState<M, I, O>, why: &str) {
        let me = self.kolo.rank();
        let tell = |key: String, to: usize| {
            let sent = kolo::Tensor::from_vec(why.as_bytes().to_vec(), &[why.len()])
                .and_then(|marker| self.kolo.send(key.as_str(), marker, to).wait());
            if let Err(e) = sent {
                tracing::warn!(stage = self.stage, to, "could not pass a failure on: {e}");
            }
        };
        if !self.is_last() && state.failed_from != Some(Side::Next) && state.acts_sent < self.micro
        {
            tell(self.act_key(state.step, state.acts_sent), me + 1);
        }
        if !self.is_first()
            && state.failed_from != Some(Side::Prev)
            && state.grads_sent < self.micro
        {
            tell(self.grad_key(state.step, state.grads_sent), me - 1);
        }
    }

    /// Receives activations (from the previous stage) or gradients (from the next)
    /// `key` during a step: a failure a neighbour passed on (a byte tensor) is this
    /// stage's error too; the step's end passes it on to the other side.
    pub(super) fn receive_in_step<M, I, O>(
        &self,
        state: &mut StepState<M, I, O>,
        key: &str,
        side: Side,
    ) -> Result<kolo::Tensor> {
        let me = self.kolo.rank();
        let from = match side {
            Side::Prev => me - 1,
            Side::Next => me + 1,
        };
        let t = self.kolo.recv(key, from).wait()?;
        if t.dtype() != kolo::DType::U8 {
            return Ok(t);
        }
        let why = String::from_utf8_lossy(t.as_bytes()?).into_owned();
        let which = match side {
            Side::Prev => "an earlier",
            Side::Next => "a later",
        };
        let e = self.failure(format!("{which} stage failed: {why}"));
        state.failed_from = Some(side);
        state.passed_on = Some(why);
        Err(e)
    }
}
