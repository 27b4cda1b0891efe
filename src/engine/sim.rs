//! One simulated rank's engine for `kolo::sim`: the real negotiation step
//! (`Control::negotiate`, the response cache, the negotiator) and the real fusion
//! plan, over a [`SimTransport`]; nothing is executed (the simulator charges the
//! plan's copies and collectives by its model).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::control::{Control, Negotiation, SPEC_VALUES};
use super::fusion::{self, Step};
use super::negotiate::Response;
use super::queue::Queue;
use super::request::{Command, OpKind, Request, RequestMeta};
use super::{Agreed, Inbox};
use crate::config::{Config, MAX_FUSED_TENSOR_BYTES};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use crate::transport::sim::{Fabric, SimTransport};
use crate::transport::Transport;
use crate::vocab::ReduceOp;

/// What one cycle of a simulated rank decided and what it cost.
#[derive(Debug, Default)]
pub(crate) struct SimCycle {
    /// The plan's collectives in order: the byte sizes of each one's tensors (one
    /// for a lone op, several for a fused one).
    pub(crate) steps: Vec<Vec<usize>>,
    /// Ops reduced within the agreement itself (no collective of their own).
    pub(crate) reduced_in_agreement: usize,
    /// Virtual time the negotiation and the plan ended on this rank.
    pub(crate) end: f64,
    /// Virtual seconds the control-plane messages took (the model's charge).
    pub(crate) network: f64,
    /// Whether some rank announced a request in full (the full exchange ran).
    pub(crate) full_exchange: bool,
}

/// A simulated rank: its negotiation state and its end of the simulated job.
pub(crate) struct SimRank {
    control: Control,
    inbox: Inbox,
    t: SimTransport,
    threshold: usize,
}

impl SimRank {
    /// Participant `me` of `fabric`, with kolo's settings for fusion and the cache.
    pub(crate) fn new(
        fabric: Arc<Fabric>,
        me: usize,
        threshold: usize,
        cache_capacity: usize,
    ) -> Self {
        let t = SimTransport::new(fabric, me);
        let topology = t.topology();
        let agreed = Agreed::plain(threshold, cache_capacity);
        let control = Control::new(&Config::default(), topology, agreed);
        let inbox = Inbox::new(Arc::new(Queue::default()), topology.rank);
        SimRank {
            control,
            inbox,
            t,
            threshold,
        }
    }

    /// One cycle starting at virtual time `start`: takes in `submit` (name, f32
    /// elements: averaged allreduces, as a data-parallel step submits), negotiates,
    /// and plans what runs.
    pub(crate) fn cycle(&mut self, start: f64, submit: &[(Arc<str>, usize)]) -> Result<SimCycle> {
        // The requests are made on the framework's threads, before the cycle; taking
        // them in is the engine's work and counts.
        let requests = submit
            .iter()
            .map(|(name, elements)| self.request(name, *elements))
            .collect::<Result<Vec<_>>>()?;
        self.t.clock.set(start);
        let (network, exchanges) = (self.t.network, self.t.exchanges);
        for request in requests {
            self.inbox.accept(Command::Submit(Box::new(request)));
        }
        let negotiated = self.control.negotiate(
            &mut self.t,
            &mut self.inbox,
            &mut None,
            &mut |_| Duration::MAX,
            Instant::now(),
        )?;
        let Negotiation::Ready { responses, .. } = negotiated else {
            return Err(Error::Internal("a simulated rank left".into()));
        };
        let full_exchange = self.t.exchanges > exchanges;
        let mut out = SimCycle {
            full_exchange,
            ..SimCycle::default()
        };
        let mut sizes = Vec::with_capacity(responses.len());
        for r in &responses {
            match r {
                Response::Run(ready) => {
                    sizes.push(ready.first().bytes());
                    self.inbox.pending.remove(&*ready.key);
                }
                Response::Reduced { ready, .. } => {
                    out.reduced_in_agreement += 1;
                    sizes.push(0);
                    self.inbox.pending.remove(&*ready.key);
                }
                Response::Fail { key, error } => {
                    return Err(Error::Internal(format!(
                        "simulated op {key} failed: {error}"
                    )));
                }
                Response::JoinDone { .. } => sizes.push(0),
            }
        }
        for step in fusion::plan(&responses, self.threshold, MAX_FUSED_TENSOR_BYTES, 0) {
            let members = match step {
                Step::Single(i) => vec![i],
                Step::Fused(v) | Step::InPlace(v) => v,
            };
            let bytes: Vec<usize> = members
                .iter()
                .map(|&i| sizes[i])
                .filter(|&b| b > 0)
                .collect();
            if !bytes.is_empty() {
                out.steps.push(bytes);
            }
        }
        out.end = self.t.clock.read();
        out.network = self.t.network - network;
        Ok(out)
    }

    /// An averaged f32 allreduce of `elements` under `name`, as a submit makes it. The
    /// tensor itself holds at most one value more than negotiation ever reads: it reads
    /// values only of ops small enough to reduce within the agreement
    /// (`SPEC_VALUES`), and a longer tensor is never one of those.
    fn request(&self, name: &str, elements: usize) -> Result<Request> {
        let meta = RequestMeta::for_test(
            name,
            OpKind::Allreduce,
            DType::F32,
            &[elements],
            ReduceOp::Average,
        );
        let held = elements.min(SPEC_VALUES + 1);
        let tensor = Tensor::from_vec(vec![0f32; held], &[held])?;
        let (_handle, request) =
            Request::with_handle(meta, tensor, self.inbox.queue.clone(), self.inbox.rank);
        Ok(request)
    }
}
