//! The first step's check of a pipeline: micro-batch 0 through every stage, and every
//! rank's micro-batches and schedule, agreed before any step can wait on a stage that
//! will not come.

use std::ops::Range;

use burn::tensor::{Device, Tensor};

use super::{panic_text, Pipeline};
use crate::convert::to_kolo_host;
use crate::error::{Error, Result};

impl Pipeline {
    /// The first step's check: micro-batch 0 forward through every stage, each
    /// stage's failure (caught) passed on; then every rank of the job learns every
    /// stage's outcome and fails with the first failure, or none does.
    pub(super) fn check<M, const DI: usize, const DO: usize>(
        &self,
        model: &M,
        input: Option<&Tensor<DI>>,
        device: &Device,
        forward: &impl Fn(&M, Tensor<DI>) -> Tensor<DO>,
        loss: &mut impl FnMut(Tensor<DO>, Range<usize>) -> Tensor<1>,
    ) -> Result<()> {
        let me = self.kolo.rank();
        let key = "kolo_burn.pipeline.check";
        let mine = (|| -> Result<Option<String>> {
            let x = if self.is_first() {
                match self.micro_rows(input) {
                    Ok(rows) => input.map(|x| x.clone().narrow(0, 0, rows)),
                    Err(e) => {
                        self.pass_failure(key, &e.to_string())?;
                        return Ok(Some(e.to_string()));
                    }
                }
            } else {
                let t = self.kolo.recv(key, me - 1).wait()?;
                if t.dtype() == kolo::DType::U8 {
                    self.pass_failure(key, "")?;
                    return Ok(None);
                }
                match self.as_burn::<DI>(key, t, device, "activations") {
                    Ok(x) => Some(x),
                    Err(e) => {
                        self.pass_failure(key, &e.to_string())?;
                        return Ok(Some(e.to_string()));
                    }
                }
            };
            let Some(x) = x else { return Ok(None) };
            let shape = x.dims().to_vec();
            let ran = kolo::catch_panic(|| {
                let out = forward(model, x.detach());
                if self.is_last() {
                    let rows = out.dims().first().copied().unwrap_or(0);
                    drop(loss(out, 0..rows));
                    None
                } else {
                    Some(out.detach())
                }
            });
            match ran {
                Ok(Some(out)) => {
                    let t = to_kolo_host(key, out, &self.copied)?;
                    self.kolo.send(key, t, me + 1).wait()?;
                    Ok(None)
                }
                Ok(None) => Ok(None),
                Err(p) => {
                    let why = self
                        .failure(format!(
                            "its {} failed on an input of shape {shape:?}: {}",
                            if self.is_last() {
                                "forward or loss"
                            } else {
                                "forward"
                            },
                            panic_text(&*p)
                        ))
                        .to_string();
                    self.pass_failure(key, "")?;
                    Ok(Some(why))
                }
            }
        })();
        // A rank whose own check failed (a send or receive refused) still tells the
        // stages after it and takes part in the agreement below: nobody waits for it.
        let mine = match mine {
            Ok(m) => m,
            Err(e) => {
                let _ = self.pass_failure(key, "");
                Some(self.failure(e.to_string()).to_string())
            }
        };
        self.agree(mine)
    }

    /// Every rank learns every rank's check outcome (`mine`: this rank's failure),
    /// micro-batches and schedule, and all fail with the first failure or difference,
    /// or none does.
    fn agree(&self, mine: Option<String>) -> Result<()> {
        // The schedule and micro-batches too: stages that disagree on them would
        // wait for sends that never come after this check.
        let plan = (self.micro, format!("{:?}", self.schedule));
        let all: Vec<((usize, String), Option<String>)> = self
            .kolo
            .allgather_object("kolo_burn.pipeline.checked", (plan, mine))?;
        let differ = all.iter().any(|(p, _)| *p != all[0].0);
        let why = all.iter().find_map(|(_, m)| m.clone()).or_else(|| {
            differ.then(|| {
                let each: Vec<String> = all
                    .iter()
                    .enumerate()
                    .map(|(r, ((m, s), _))| format!("rank {r}: {m} micro-batches, {s}"))
                    .collect();
                format!(
                    "the ranks' pipelines differ in micro-batches or schedule ({}); every \
                     rank must build it with the same Pipeline::micro_batches and \
                     Pipeline::schedule",
                    each.join("; ")
                )
            })
        });
        match why {
            None => Ok(()),
            Some(why) => Err(Error::InvalidArgument {
                what: "kolo_burn::Pipeline::step (first step's check)",
                message: why,
            }),
        }
    }
}
