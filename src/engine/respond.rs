//! Running the responses of a cycle on this rank: single ops, fused batches, and
//! their timeline spans.

use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::fusion::FusionBuffer;
use super::fusion::{self, Step};
use super::negotiate::{self, Ready, Response};
use super::request::OpKind;
use super::request::{self, Key, Request, RequestMeta, Tensors};
use super::timeline::Timeline;
use super::turn::{TakeTurn, Turn};
use super::{execute, gpu};
use crate::handle::{self, Output};
use crate::transport::Transport;

/// What running agreed responses needs besides the transport: the fusion buffer, the
/// GPU plane and the timeline.
pub(super) struct Executor {
    pub(super) fusion_buffer: FusionBuffer,
    pub(super) timeline: Timeline,
    /// When the responses being run became ready (the end of their cycle).
    pub(super) ready_at: Instant,
    /// `KOLO_SIMULATED_COLLECTIVE_COST_US`: slept before every collective.
    pub(super) simulated_cost: Duration,
    /// Ops on device tensors (the transport's device communicator).
    pub(super) gpu: gpu::Gpu,
    /// A process set's engine: how it gets this rank's turn to enqueue device work
    /// from the job's engine (`turn.rs`); None on the job's engine, which gives the
    /// turns.
    pub(super) turns: Option<TakeTurn>,
}

impl Executor {
    /// An executor for `rank`, its timeline off until started.
    pub(super) fn new(rank: usize, mark_cycles: bool, simulated_cost: Duration) -> Self {
        Executor {
            fusion_buffer: FusionBuffer::default(),
            timeline: Timeline::new(rank, mark_cycles),
            ready_at: Instant::now(),
            simulated_cost,
            gpu: gpu::Gpu::default(),
            turns: None,
        }
    }
}

/// This rank's requests waiting to run, by negotiation key: a response takes its
/// local request (tensors and handle) out; a rank without one (joined) contributes
/// zeros.
pub(super) type Pending = FxHashMap<Key, Box<Request>>;

impl Executor {
    /// Runs the agreed responses of a cycle (agreed at `ready_at`), fused as the plan
    /// for `fusion_threshold` and tensors up to `max_tensor` bytes says, completing the
    /// handles of this rank's requests.
    pub(super) fn run(
        &mut self,
        t: &mut dyn Transport,
        pending: &mut Pending,
        responses: Vec<Response>,
        ready_at: Instant,
        fusion_threshold: usize,
        max_tensor: usize,
    ) {
        self.ready_at = ready_at;
        self.fusion_buffer.max_tensor = max_tensor;
        let steps = fusion::plan(
            &responses,
            fusion_threshold,
            max_tensor,
            t.in_place_group_bytes(),
        );
        let mut responses: Vec<Option<Response>> = responses.into_iter().map(Some).collect();
        // Held while this cycle's device ops are enqueued (process sets only).
        let _turn = self.take_turn(pending, &mut responses);
        for step in steps {
            match step {
                Step::Single(i) => {
                    if let Some(r) = responses[i].take() {
                        self.respond(t, pending, r);
                    }
                }
                Step::Fused(batch) => {
                    let members = take_batch(&batch, &mut responses);
                    self.respond_fused(t, pending, members);
                }
                Step::InPlace(batch) => {
                    let members = take_batch(&batch, &mut responses);
                    self.respond_in_place(t, pending, members);
                }
            }
        }
    }

    /// On a process set's engine whose cycle has device ops: this rank's turn to
    /// enqueue them, from the job's engine. Without one (the job's engine has
    /// stopped) those ops fail here, before any rank enqueues them.
    fn take_turn(
        &mut self,
        pending: &mut Pending,
        responses: &mut [Option<Response>],
    ) -> Option<Turn> {
        let on_device = |r: &Option<Response>| {
            matches!(r, Some(Response::Run(ready))
                if ready.kind != OpKind::DeviceTurn
                    && ready.first().device == request::Device::Cuda)
        };
        let take = self.turns.as_mut()?;
        if !responses.iter().any(on_device) {
            return None;
        }
        match take() {
            Ok(turn) => Some(turn),
            Err(e) => {
                for r in responses.iter_mut().filter(|r| on_device(r)) {
                    if let Some(Response::Run(ready)) = r.take() {
                        if let Some(req) = pending.remove(&*ready.key) {
                            req.fail(e.clone());
                        }
                    }
                }
                None
            }
        }
    }

    /// On the job's engine: hands a process set's engine on this rank its device
    /// turn, and waits until its device ops are enqueued.
    fn grant_turn(&mut self, pending: &mut Pending, ready: &negotiate::Ready) {
        let Some(req) = pending.remove(&*ready.key) else {
            return;
        };
        let limit = self.gpu.limit();
        Turn::grant(
            |turn| req.done.complete(Ok(Output::Detached(Box::new(turn)))),
            limit,
            &ready.key,
        );
    }

    /// Records a ready op's negotiation span (from its submission here) on the timeline.
    fn trace_negotiation(&mut self, meta: &RequestMeta, submitted: Instant) {
        if self.timeline.enabled() {
            let args = trace_args(meta);
            for t in &meta.tensors {
                self.timeline
                    .span(&t.name, "NEGOTIATE", submitted, self.ready_at, &args);
            }
        }
    }

    /// `KOLO_SIMULATED_COLLECTIVE_COST_US`: a fixed cost per collective, as on a slow
    /// network.
    fn simulate_collective_cost(&self) {
        let cost = self.simulated_cost;
        if !cost.is_zero() {
            std::thread::sleep(cost);
        }
    }

    /// When an op starts, if the timeline records it (no clock read otherwise).
    fn op_start(&self) -> Option<Instant> {
        self.timeline.enabled().then(Instant::now)
    }

    /// Records an op's span, from `started` ([`op_start`](Self::op_start): None when
    /// the timeline is off) to now, on the timeline.
    fn trace_op(&mut self, meta: &RequestMeta, started: Option<Instant>) {
        if let Some(started) = started {
            let (args, end) = (trace_args(meta), Instant::now());
            let phase = meta.kind.name().to_ascii_uppercase();
            for t in &meta.tensors {
                self.timeline.span(&t.name, &phase, started, end, &args);
            }
        }
    }

    /// Runs one response: an op on its own, an error for its handle, or a join.
    fn respond(&mut self, t: &mut dyn Transport, pending: &mut Pending, response: Response) {
        match response {
            Response::Run(ready) if ready.kind == OpKind::DeviceTurn => {
                self.grant_turn(pending, &ready);
            }
            Response::Run(ready) => {
                let local = pending.remove(&*ready.key);
                let (tensors, done) = match local {
                    Some(req) => {
                        self.trace_negotiation(&req.meta, req.submitted);
                        (Some(req.tensors), Some(req.done))
                    }
                    // Not one of a device turn's set: nothing to do here.
                    None if ready.kind.is_partial() => return,
                    None => (None, None),
                };
                let span = tracing::debug_span!("op", kind = ready.kind.name(), key = %ready.key);
                let started = self.op_start();
                if ready.first().device == request::Device::Cuda {
                    // Enqueued on the GPU; the handle completes when the device is done.
                    span.in_scope(|| self.gpu.respond(t, &ready, tensors, done));
                    self.trace_op(ready.first(), started);
                    return;
                }
                self.simulate_collective_cost();
                let result =
                    span.in_scope(|| execute::run(t, &ready, tensors, &mut self.fusion_buffer));
                self.trace_op(ready.first(), started);
                if let Some(done) = done {
                    done.complete(result);
                } else if let Err(e) = result {
                    tracing::warn!(key = %ready.key, error = %e, "op for a joined rank failed");
                }
            }
            Response::Reduced { ready, mut sum } => {
                let Some(req) = pending.remove(&*ready.key) else {
                    return;
                };
                self.trace_negotiation(&req.meta, req.submitted);
                let started = self.op_start();
                let size = t.topology().size;
                let result = execute::finish_speculated(&ready, req.tensors, &mut sum, size);
                self.trace_op(ready.first(), started);
                req.done.complete(result);
            }
            Response::Fail { key, error } => {
                if let Some(req) = pending.remove(&*key) {
                    req.fail(error);
                }
            }
            Response::JoinDone { last } => {
                if let Some(req) = pending.remove(request::JOIN_KEY) {
                    req.done.complete(Ok(Output::Rank(last)));
                }
            }
        }
    }

    /// Runs a fusion batch (all ready allreduces, or all ready allgathers) in one
    /// collective.
    fn respond_fused(
        &mut self,
        t: &mut dyn Transport,
        pending: &mut Pending,
        members: Vec<Response>,
    ) {
        let (readies, locals) = take_members(pending, members);
        if readies
            .first()
            .is_some_and(|r| r.first().device == request::Device::Cuda)
        {
            tracing::debug!(tensors = readies.len(), "fused device allreduce");
            let members = readies
                .iter()
                .zip(locals)
                .map(|(ready, local)| match local {
                    Some(req) => (ready, Some(req.tensors), Some(req.done)),
                    None => (ready, None, None),
                })
                .collect();
            self.gpu.respond_fused(t, members);
            return;
        }
        let (inputs, dones) = self.host_inputs(&readies, locals);
        let allgather = readies
            .first()
            .is_some_and(|r| r.kind == request::OpKind::Allgather);
        tracing::debug!(
            tensors = inputs.len(),
            "fused {}",
            if allgather { "allgather" } else { "allreduce" }
        );
        // Built only when tracing: it allocates per tensor.
        let keys: Vec<(String, serde_json::Value)> = if self.timeline.enabled() {
            inputs
                .iter()
                .map(|(r, _)| (r.key.to_string(), trace_args(r.first())))
                .collect()
        } else {
            Vec::new()
        };
        self.simulate_collective_cost();
        let result = if allgather {
            execute::run_fused_allgather(t, inputs, &mut self.fusion_buffer)
        } else {
            execute::run_fused(t, inputs, &mut self.fusion_buffer)
        };
        let outputs = result.map(|(outputs, times)| {
            let phase = if allgather { "ALLGATHER" } else { "ALLREDUCE" };
            self.trace_fused(&keys, phase, &times);
            outputs
        });
        complete_fused(dones, outputs);
    }

    /// Runs a group of host allreduces too large to fuse, each in its own tensor, with
    /// one call of the transport (`fusion::plan` made the group: CPU sums of one dtype
    /// and scale factors).
    fn respond_in_place(
        &mut self,
        t: &mut dyn Transport,
        pending: &mut Pending,
        members: Vec<Response>,
    ) {
        let (readies, locals) = take_members(pending, members);
        let (inputs, dones) = self.host_inputs(&readies, locals);
        tracing::debug!(tensors = inputs.len(), "grouped in-place allreduce");
        self.simulate_collective_cost();
        let result = execute::run_in_place_group(t, inputs);
        let outputs = result.map(|(outputs, times)| {
            if self.timeline.enabled() {
                for ready in &readies {
                    let args = trace_args(ready.first());
                    self.timeline
                        .span(&ready.key, "ALLREDUCE", times.start, times.reduced, &args);
                }
            }
            outputs
        });
        complete_fused(dones, outputs);
    }

    /// A batch's inputs (this rank's tensors, None on a joined rank) and handles, its
    /// members' negotiation spans recorded.
    #[allow(clippy::type_complexity)]
    fn host_inputs<'r>(
        &mut self,
        readies: &'r [Ready],
        locals: Vec<Option<Box<Request>>>,
    ) -> (
        Vec<(&'r Ready, Option<Tensors>)>,
        Vec<Option<handle::Completer>>,
    ) {
        let mut inputs = Vec::with_capacity(readies.len());
        let mut dones = Vec::with_capacity(readies.len());
        for (ready, local) in readies.iter().zip(locals) {
            match local {
                Some(req) => {
                    self.trace_negotiation(&req.meta, req.submitted);
                    inputs.push((ready, Some(req.tensors)));
                    dones.push(Some(req.done));
                }
                None => {
                    inputs.push((ready, None));
                    dones.push(None);
                }
            }
        }
        (inputs, dones)
    }

    /// The three spans of each member of a fused collective: copy in, `phase`, copy out.
    fn trace_fused(
        &mut self,
        keys: &[(String, serde_json::Value)],
        phase: &str,
        times: &execute::FusedTimes,
    ) {
        for (key, args) in keys {
            self.timeline.span(
                key,
                "MEMCPY_IN_FUSION_BUFFER",
                times.start,
                times.copied_in,
                args,
            );
            self.timeline
                .span(key, phase, times.copied_in, times.reduced, args);
            self.timeline.span(
                key,
                "MEMCPY_OUT_FUSION_BUFFER",
                times.reduced,
                times.copied_out,
                args,
            );
        }
    }
}

/// A batch's responses (all `Run`) and this rank's requests for them, taken out of
/// `pending`.
/// The responses of a batch, taken out of `responses`. Sized up front: a `collect`
/// through `filter_map` starts empty and moves the (large) responses at every doubling
/// (a thousand small ops: ~500 instructions each in reallocation and copying).
fn take_batch(batch: &[usize], responses: &mut [Option<Response>]) -> Vec<Response> {
    let mut members = Vec::with_capacity(batch.len());
    members.extend(batch.iter().filter_map(|&i| responses[i].take()));
    members
}

fn take_members(
    pending: &mut Pending,
    members: Vec<Response>,
) -> (Vec<Ready>, Vec<Option<Box<Request>>>) {
    let mut readies = Vec::with_capacity(members.len());
    let mut locals = Vec::with_capacity(members.len());
    for m in members {
        if let Response::Run(ready) = m {
            let local = pending.remove(&*ready.key);
            readies.push(ready);
            locals.push(local);
        }
    }
    (readies, locals)
}

/// Completes the handles of a fused batch: each member its output, or every member
/// the batch's error as it is (its kind too).
fn complete_fused(
    dones: Vec<Option<handle::Completer>>,
    outputs: crate::error::Result<Vec<Option<crate::tensor::Tensor>>>,
) {
    match outputs {
        Ok(mut outputs) => handle::complete_all(dones, |i| {
            let out = outputs.get_mut(i)?.take()?;
            Some(Ok(Output::Tensor(out)))
        }),
        Err(e) => handle::complete_all(dones, |_| Some(Err(e.clone()))),
    }
}

/// The timeline args of an op: dtype and shape of each tensor.
fn trace_args(meta: &RequestMeta) -> serde_json::Value {
    match meta.tensors.as_slice() {
        [t] => serde_json::json!({"dtype": t.dtype.to_string(), "shape": t.shape}),
        ts => serde_json::json!({
            "tensors": ts.iter().map(|t| serde_json::json!({"name": t.name, "dtype": t.dtype.to_string(), "shape": t.shape})).collect::<Vec<_>>()
        }),
    }
}

#[cfg(test)]
mod tests;
