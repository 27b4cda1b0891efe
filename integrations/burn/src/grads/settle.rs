//! The end of a step: the buckets' results and one small verdict collective, so
//! that a step fails on every rank or on none.

use kolo::ReduceOp;

use super::GradientReducer;
use crate::error::{Error, Result};
use crate::layout::Layout;

impl GradientReducer {
    /// Ends a step whose buckets are all submitted (one handle per bucket, in order):
    /// waits for each and returns the results by slot, unless a rank failed. A slot
    /// that no rank had a gradient for (`present` says which this rank had) is `None`.
    ///
    /// `local` is this rank's failure before the reduction (a gradient it could not
    /// hand over, a wrong layer given to `Overlap`): such a rank has still submitted
    /// every bucket, with zeros in place of what it could not provide, so that nobody
    /// waits for it. Every rank then says whether it failed in one small collective
    /// (the sum of a 0/1 flag) beside the buckets; when any did, they exchange their errors, the
    /// failing ranks return their own and the others [`Error::OtherRank`], so the step
    /// fails on every rank and no rank applies gradients the others threw away.
    ///
    /// The same collective counts the ranks that lack some gradient; only when one
    /// does, the ranks sum which slots each has (one more small allreduce) and the
    /// slots nobody has are dropped.
    pub(crate) fn settle(
        &self,
        layout: &Layout,
        handles: Vec<kolo::Handle<Vec<kolo::Tensor>>>,
        local: Option<Error>,
        present: &[bool],
    ) -> Result<Vec<Option<kolo::Tensor>>> {
        let verdict = self.submit_verdict(local.is_some(), present);
        let results = handles.into_iter().map(kolo::Handle::wait).collect();
        self.conclude(layout, verdict, results, local, present)
    }

    /// Submits the step's verdict: the number of ranks that failed and of those that
    /// lack some gradient (see [`settle`](Self::settle)).
    pub(crate) fn submit_verdict(
        &self,
        failed: bool,
        present: &[bool],
    ) -> std::result::Result<kolo::Handle<kolo::Tensor>, kolo::SubmitError> {
        let lacks = present.iter().any(|&p| !p);
        let flag = kolo::Tensor::from_vec(
            vec![
                if failed { 1.0f32 } else { 0.0 },
                if lacks { 1.0 } else { 0.0 },
            ],
            &[2],
        )
        .map_err(kolo::SubmitError::from)?;
        self.kolo
            .allreduce(format!("{}.failed", self.prefix), flag)
            // A Sum (the number of failing ranks), not a Max: a small cached f32 sum
            // can ride in the engine's cycle agreement instead of running a
            // collective of its own every step.
            .op(ReduceOp::Sum)
            .submit()
    }

    /// Ends a step from its buckets' results (in bucket order) and its verdict.
    pub(crate) fn conclude(
        &self,
        layout: &Layout,
        verdict: std::result::Result<kolo::Handle<kolo::Tensor>, kolo::SubmitError>,
        results: Vec<kolo::Result<Vec<kolo::Tensor>>>,
        local: Option<Error>,
        present: &[bool],
    ) -> Result<Vec<Option<kolo::Tensor>>> {
        let mut slots: Vec<Option<kolo::Tensor>> = (0..layout.slots.len()).map(|_| None).collect();
        let mut failed: Option<Error> = None;
        for (bucket, result) in layout.buckets.iter().zip(results) {
            match result {
                Ok(reduced) => {
                    for (&i, t) in bucket.iter().zip(reduced) {
                        slots[i] = Some(t);
                    }
                }
                Err(e) => {
                    failed.get_or_insert(e.into());
                }
            }
        }
        let (any_failed, any_lacks) = match verdict
            .map_err(kolo::Error::from)
            .and_then(|h| h.wait())
            .and_then(|t| Ok(t.into_vec::<f32>()?))
        {
            Ok(v) => (
                v.first().is_some_and(|&f| f > 0.0),
                v.get(1).is_some_and(|&f| f > 0.0),
            ),
            Err(e) => return Err(local.or(failed).unwrap_or(e.into())),
        };
        if any_failed {
            let mine = local.as_ref().map(ToString::to_string);
            let all: Vec<Option<String>> = self
                .kolo
                .allgather_object(format!("{}.failures", self.prefix), mine)?;
            return Err(local.unwrap_or_else(|| other_rank(all)));
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if any_lacks {
            self.drop_absent(&mut slots, present)?;
        }
        Ok(slots)
    }

    /// Drops the slots that no rank had a gradient for: the ranks sum how many have
    /// each (u8 would overflow past 255 ranks, so f32).
    fn drop_absent(&self, slots: &mut [Option<kolo::Tensor>], present: &[bool]) -> Result<()> {
        let mine: Vec<f32> = present.iter().map(|&p| f32::from(u8::from(p))).collect();
        let n = mine.len();
        let counts = self
            .kolo
            .allreduce(
                format!("{}.present", self.prefix),
                kolo::Tensor::from_vec(mine, &[n])?,
            )
            .op(ReduceOp::Sum)
            .wait()?
            .into_vec::<f32>()?;
        for (slot, &count) in slots.iter_mut().zip(&counts) {
            if count == 0.0 {
                *slot = None;
            }
        }
        Ok(())
    }
}

/// The error of a rank whose own step went well while another failed: the first
/// failing rank and its message.
fn other_rank(all: Vec<Option<String>>) -> Error {
    let (rank, message) = all
        .into_iter()
        .enumerate()
        .find_map(|(rank, m)| Some((rank, m?)))
        .unwrap_or((0, "(no message)".into()));
    Error::OtherRank {
        rank,
        what: "hand its gradients to the reduction, so no rank has reduced gradients for \
               this step",
        message,
    }
}
