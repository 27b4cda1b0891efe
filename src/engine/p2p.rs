//! Point to point around the cycles: sends and receives never wait for the other
//! ranks' negotiation. A send is posted to the transport as soon as the engine takes
//! it in; a receive waits for the tensor of its name from its source, which the
//! transport delivers whenever it arrives (kept here until the receive is posted, in
//! the order the sender sent them). Only the two ranks of a pair take part: a
//! pipeline stage's traffic moves at the pace of its neighbours, not of the slowest
//! stage's cycles.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use serde_json::Value;

use super::request::{OpKind, Request};
use super::timeline::Timeline;
use crate::error::Error;
use crate::handle::{Completer, Output};
use crate::tensor::Tensor;
use crate::transport::{P2pEvent, P2pPort};

/// A send or receive waiting to complete.
struct Waiting {
    done: Completer,
    /// The tensor's name (without the pair's ranks).
    name: String,
    /// The other rank.
    peer: usize,
    submitted: Instant,
    /// When it was last reported as waiting.
    reported: Option<Instant>,
    /// A send's timeline args (dtype, shape, peer), taken while its tensor was here
    /// (`Null` without a timeline, and for a receive: its tensor gives them).
    args: serde_json::Value,
}

/// What a caller running a send or receive itself polls for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want<'a> {
    Nothing,
    /// Its send's transport id.
    Sent(u64),
    /// Its receive's source and name.
    Received(usize, &'a str),
}

/// What a caller's poll found of its own.
enum Found {
    Sent,
    Tensor(Arrived),
}

/// A tensor that arrived, in host memory, and whether its sender's was on a device
/// (it is then placed on this rank's device when handed over: [`P2pLane::place`]).
struct Arrived {
    tensor: Tensor,
    from_device: bool,
}

/// This rank's point-to-point traffic.
#[derive(Default)]
pub(super) struct P2pLane {
    /// The transport's point-to-point channel (None: the transport has none).
    port: Option<Box<dyn P2pPort>>,
    /// Sends in flight, by the transport's id.
    sends: FxHashMap<u64, Waiting>,
    /// Posted receives, by (source, name).
    recvs: FxHashMap<(usize, String), Waiting>,
    /// Tensors that arrived before their receive was posted, by (source, name), in the
    /// order they were sent.
    arrived: FxHashMap<(usize, String), VecDeque<Arrived>>,
    /// This rank (of the transport's communicator).
    rank: usize,
    /// This process's place on its machine in the whole job: a tensor sent from a
    /// device lands on the device it picks (`Kolo::cuda_device`).
    local_rank: usize,
    events: Vec<P2pEvent>,
    /// When a send or receive last completed (or was taken in): the polling interval
    /// grows from then on.
    last_progress: Option<Instant>,
    /// The transport's error that broke point to point (a message stream out of step):
    /// every later send and receive fails with it.
    broken: Option<Error>,
    /// Whether a poll takes every tensor that arrived (the engine thread) or at most
    /// one new one (a caller driving the engine while it waits: it polls again at
    /// once, and returns sooner when its own has come).
    pub(super) drain: bool,
}

/// The name a send or receive was made with: its key is `name@src->dst`.
fn name_of(req: &Request) -> String {
    let key: &str = &req.meta.key;
    key.rsplit_once('@').map_or(key, |(n, _)| n).to_string()
}

impl P2pLane {
    /// The lane over `port`, on rank `rank`, whose process has local rank
    /// `local_rank` in the job.
    pub(super) fn new(port: Option<Box<dyn P2pPort>>, rank: usize, local_rank: usize) -> Self {
        P2pLane {
            port,
            rank,
            local_rank,
            drain: true,
            ..P2pLane::default()
        }
    }

    /// Whether sends or receives are waiting (the engine then keeps polling).
    pub(super) fn busy(&self) -> bool {
        !self.sends.is_empty() || !self.recvs.is_empty()
    }

    /// How long an engine with nothing else to do waits before polling again: 10 µs
    /// right after progress, 100 µs after 200 µs without, 1 ms after 10 ms without
    /// (a stage idle in the pipeline's bubble costs little CPU; new work wakes it).
    pub(super) fn poll_interval(&self) -> Duration {
        let quiet = self.last_progress.map_or(Duration::MAX, |t| t.elapsed());
        if quiet < Duration::from_micros(200) {
            Duration::from_micros(10)
        } else if quiet < Duration::from_millis(10) {
            Duration::from_micros(100)
        } else {
            Duration::from_millis(1)
        }
    }

    /// How long a caller waiting on a send or receive yields the core between polls
    /// before it naps ([`poll_interval`](Self::poll_interval)): 1 ms, or, while bytes
    /// are moving, as long as they take at 1 GB/s (at most 50 ms), within which such a
    /// transfer ends. Napping meanwhile made a 16 MiB leg ~25% slower here (2.0 against
    /// 1.5 ms; raw MPI calls 1.3): the sender saw its send done, and the next header, a
    /// nap late, and the copy between the processes ran slower beside a napping core.
    pub(super) fn yield_for(&self) -> Duration {
        const BYTES_PER_MS: usize = 1 << 20;
        let moving = self.port.as_ref().map_or(0, |p| p.in_flight());
        let ms = (moving / BYTES_PER_MS).clamp(1, 50);
        Duration::from_millis(ms as u64)
    }

    /// Takes a submitted send (posted at once) or receive (completed at once when its
    /// tensor is already here).
    pub(super) fn accept(&mut self, mut req: Request, timeline: &mut Timeline) {
        self.last_progress = Some(Instant::now());
        if let Some(e) = &self.broken {
            req.done.complete(Err(e.clone()));
            return;
        }
        let name = name_of(&req);
        let peer = req.meta.root;
        match req.meta.kind {
            OpKind::Send => {
                let Some(tensor) = req.tensors.pop() else {
                    req.done.complete(Err(Error::Internal(format!(
                        "send {name:?} without a tensor"
                    ))));
                    return;
                };
                let args = timeline_args(timeline, &tensor, peer);
                let sent = match self.port.as_mut() {
                    Some(port) => port.send(peer, &name, tensor),
                    None => Err(Error::Internal(
                        "this transport has no point-to-point messages".into(),
                    )),
                };
                match sent {
                    Ok(id) => {
                        let w = waiting(req.done, name, peer, req.submitted, args);
                        self.sends.insert(id, w);
                    }
                    Err(e) => req.done.complete(Err(e)),
                }
            }
            _ => {
                let key = (peer, name);
                if self.recvs.contains_key(&key) {
                    // Two receives of one name from one source at once: the tensor
                    // could go to either (issue 53 item 25). The first one posted
                    // keeps the name; this one is refused.
                    req.done.complete(Err(Error::DuplicateName {
                        op: "recv",
                        name: format!("{} from rank {peer}", key.1),
                        rank: self.rank,
                    }));
                    return;
                }
                if let Some(got) = self.take_arrived(&key) {
                    let args = timeline_args(timeline, &got.tensor, peer);
                    trace(timeline, "RECV", &key.1, req.submitted, args);
                    let placed = self.place(got, &key);
                    req.done.complete(placed.map(Output::Tensor));
                } else {
                    let (peer, name) = key.clone();
                    let w = waiting(req.done, name, peer, req.submitted, Value::Null);
                    self.recvs.insert(key, w);
                }
            }
        }
    }

    fn take_arrived(&mut self, key: &(usize, String)) -> Option<Arrived> {
        let q = self.arrived.get_mut(key)?;
        let t = q.pop_front();
        if q.is_empty() {
            self.arrived.remove(key);
        }
        t
    }

    /// Progresses the transport's point to point and completes what finished. An error
    /// of the transport fails every send and receive waiting (with the error).
    pub(super) fn poll(&mut self, timeline: &mut Timeline) {
        self.poll_for(Want::Nothing, timeline);
    }

    /// [`poll`](Self::poll), keeping for the caller the completion it `want`s (a send
    /// or receive of its own that is not registered here) instead of handling it.
    fn poll_for(&mut self, want: Want<'_>, timeline: &mut Timeline) -> Option<Found> {
        let port = self.port.as_mut()?;
        let mut events = std::mem::take(&mut self.events);
        // A caller polling for its own send or receive takes one arrived tensor at a
        // time, as a driving caller does.
        let drain = self.drain && want == Want::Nothing;
        if let Err(e) = port.poll(&mut events, drain) {
            self.fail_all(|_, _| e.clone());
            self.broken = Some(e);
        }
        if !events.is_empty() {
            self.last_progress = Some(Instant::now());
        }
        let mut found = None;
        for ev in events.drain(..) {
            match ev {
                P2pEvent::Sent(id) => {
                    if found.is_none() && want == Want::Sent(id) {
                        found = Some(Found::Sent);
                    } else if let Some(w) = self.sends.remove(&id) {
                        trace(timeline, "SEND", &w.name, w.submitted, w.args);
                        w.done.complete(Ok(Output::Unit));
                    }
                }
                P2pEvent::Received {
                    src,
                    name,
                    tensor,
                    from_device,
                } => {
                    let got = Arrived {
                        tensor,
                        from_device,
                    };
                    if found.is_none()
                        && matches!(want, Want::Received(p, n) if p == src && n == name)
                    {
                        found = Some(Found::Tensor(got));
                        continue;
                    }
                    let key = (src, name);
                    match self.recvs.remove(&key) {
                        Some(w) => {
                            let args = timeline_args(timeline, &got.tensor, src);
                            trace(timeline, "RECV", &w.name, w.submitted, args);
                            let placed = self.place(got, &key);
                            w.done.complete(placed.map(Output::Tensor));
                        }
                        None => self.arrived.entry(key).or_default().push_back(got),
                    }
                }
            }
        }
        self.events = events;
        found
    }

    /// A send on the caller's thread (`Engine::send_now`): posts it and polls once.
    /// `Ok(true)`: it completed; `Ok(false)`: it waits here under the completer
    /// `later` makes. The tensor comes back (`Err`) when this path does not apply: no
    /// point to point here, or a send of that name to `peer` still in flight (the
    /// usual path then reports the duplicate).
    // The tensor comes back by value when this path does not apply, to go the queued
    // way (as `Tensor::into_host_buffer` hands it back).
    #[allow(clippy::result_large_err)]
    pub(super) fn send_now(
        &mut self,
        peer: usize,
        name: &str,
        tensor: Tensor,
        timeline: &mut Timeline,
        later: impl FnOnce() -> Completer,
    ) -> Result<Result<bool, Error>, Tensor> {
        if self.port.is_none()
            || self
                .sends
                .values()
                .any(|w| w.peer == peer && w.name == name)
        {
            return Err(tensor);
        }
        if let Some(e) = &self.broken {
            return Ok(Err(e.clone()));
        }
        let traced = timeline.enabled().then(Instant::now);
        let args = timeline_args(timeline, &tensor, peer);
        let sent = match self.port.as_mut() {
            Some(port) => port.send(peer, name, tensor),
            None => return Ok(Err(Error::Internal("point to point went away".into()))),
        };
        let id = match sent {
            Ok(id) => id,
            Err(e) => return Ok(Err(e)),
        };
        if let Some(Found::Sent) = self.poll_for(Want::Sent(id), timeline) {
            if let Some(t) = traced {
                trace(timeline, "SEND", name, t, args);
            }
            return Ok(Ok(true));
        }
        if let Some(e) = &self.broken {
            return Ok(Err(e.clone()));
        }
        let now = Instant::now();
        self.last_progress = Some(now);
        let w = waiting(later(), name.to_string(), peer, traced.unwrap_or(now), args);
        self.sends.insert(id, w);
        Ok(Ok(false))
    }

    /// Whether the receive of `key` may run on the caller's thread: point to point is
    /// here and no receive of that key is posted already.
    pub(super) fn may_recv_now(&self, key: &(usize, String)) -> bool {
        self.port.is_some() && !self.recvs.contains_key(key)
    }

    /// The tensor of `key` if it arrived before its receive, else one poll for it.
    pub(super) fn recv_now(
        &mut self,
        key: &(usize, String),
        timeline: &mut Timeline,
    ) -> Result<Option<Tensor>, Error> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        if let Some(got) = self.take_arrived(key) {
            return self.place(got, key).map(Some);
        }
        match self.poll_for(Want::Received(key.0, &key.1), timeline) {
            Some(Found::Tensor(got)) => self.place(got, key).map(Some),
            _ => match &self.broken {
                Some(e) => Err(e.clone()),
                None => Ok(None),
            },
        }
    }

    /// Leaves the receive of `key` (started at `start`) waiting here under `done`.
    pub(super) fn post_recv(&mut self, key: (usize, String), done: Completer, start: Instant) {
        self.last_progress = Some(Instant::now());
        let (peer, name) = key.clone();
        self.recvs
            .insert(key, waiting(done, name, peer, start, Value::Null));
    }

    /// The span of a receive of `tensor` from `peer` done on the caller's thread.
    pub(super) fn trace_recv(
        timeline: &mut Timeline,
        name: &str,
        tensor: &Tensor,
        peer: usize,
        start: Instant,
    ) {
        let args = timeline_args(timeline, tensor, peer);
        trace(timeline, "RECV", name, start, args);
    }

    /// The tensor a receive of `key` hands over: as it arrived, or, when its sender's
    /// was on a device, copied to this rank's device (`Kolo::cuda_device`).
    fn place(&self, got: Arrived, key: &(usize, String)) -> Result<Tensor, Error> {
        if !got.from_device {
            return Ok(got.tensor);
        }
        let (src, name) = key;
        let failed = |e: Error| Error::Transport {
            call: "recv",
            message: format!(
                "{name:?} from rank {src} was sent from a CUDA device, and this rank \
                 cannot put it on its own: {e}"
            ),
        };
        #[cfg(feature = "nccl")]
        {
            let ordinal = crate::tensor::default_cuda_ordinal(self.local_rank).map_err(failed)?;
            got.tensor
                .to_cuda(ordinal)
                .map_err(|e| failed(Error::from(e)))
        }
        #[cfg(not(feature = "nccl"))]
        {
            let _ = self.local_rank;
            Err(failed(Error::CudaUnavailable(
                "kolo was built without the `nccl` feature".into(),
            )))
        }
    }

    /// Takes in the sends and receives of `reqs` and polls those waiting.
    pub(super) fn progress(&mut self, reqs: &mut Vec<Request>, timeline: &mut Timeline) {
        for req in reqs.drain(..) {
            self.accept(req, timeline);
        }
        if self.busy() {
            self.poll(timeline);
        }
    }

    /// Fails every send and receive waiting with `error(op, name)`, and those taken
    /// off the queue but not yet handed to the lane (`untaken`).
    pub(super) fn fail_all_with(
        &mut self,
        untaken: &mut Vec<Request>,
        error: impl Fn(&'static str, &str) -> Error,
    ) {
        for req in untaken.drain(..) {
            let op = if req.meta.kind == OpKind::Send {
                "send"
            } else {
                "recv"
            };
            let e = error(op, &name_of(&req));
            req.done.complete(Err(e));
        }
        self.fail_all(error);
    }

    /// Fails every send and receive waiting with `error(op, name)`.
    pub(super) fn fail_all(&mut self, error: impl Fn(&'static str, &str) -> Error) {
        for (_, w) in self.sends.drain() {
            let e = error("send", &w.name);
            w.done.complete(Err(e));
        }
        for (_, w) in self.recvs.drain() {
            let e = error("recv", &w.name);
            w.done.complete(Err(e));
        }
    }

    /// Fails the sends and receives that have waited `fail_after` or longer.
    fn fail_stalled(&mut self, rank: usize, fail_after: Duration, now: Instant) {
        let late = |w: &Waiting| now.duration_since(w.submitted) >= fail_after;
        let secs = fail_after.as_secs_f64();
        for (_, w) in self.recvs.extract_if(|_, w| late(w)) {
            let report = format!(
                "recv {:?} on rank {rank}: rank {} has not sent it within {secs:.0} s \
                 (KOLO_STALL_SHUTDOWN_TIME_SECONDS); it may have failed, or sends under \
                 another name",
                w.name, w.peer
            );
            tracing::error!(rank, from = w.peer, name = %w.name, "{report}");
            w.done.complete(Err(Error::Stalled { report }));
        }
        for (_, w) in self.sends.extract_if(|_, w| late(w)) {
            let report = format!(
                "send {:?} on rank {rank}: rank {} has not received it within {secs:.0} s \
                 (KOLO_STALL_SHUTDOWN_TIME_SECONDS)",
                w.name, w.peer
            );
            tracing::error!(rank, to = w.peer, name = %w.name, "{report}");
            w.done.complete(Err(Error::Stalled { report }));
        }
    }

    /// Fails each receive (and send) that has waited `fail_after` or longer (not
    /// when it is zero), as the stall shutdown time does for collectives (issue 53
    /// item 20): a peer that failed or never sends no longer leaves it waiting for
    /// ever. The engine goes on: other pairs' traffic and collectives are unaffected.
    /// Then warns, naming both ranks and the name, about each one that has waited
    /// longer than `after` (again every `after`), as the stall inspector does for
    /// collectives.
    pub(super) fn check_stalled(
        &mut self,
        rank: usize,
        after: Duration,
        fail_after: Duration,
        now: Instant,
    ) {
        if !fail_after.is_zero() {
            self.fail_stalled(rank, fail_after, now);
        }
        if after.is_zero() {
            return;
        }
        let due = |w: &Waiting| now.duration_since(w.reported.unwrap_or(w.submitted)) >= after;
        for w in self.recvs.values_mut().filter(|w| due(w)) {
            w.reported = Some(now);
            tracing::warn!(
                rank,
                from = w.peer,
                name = %w.name,
                waited = ?now.duration_since(w.submitted),
                "stalled recv: rank {rank} has waited {:.0?} for {:?} from rank {}, which has not sent it",
                now.duration_since(w.submitted),
                w.name,
                w.peer
            );
        }
        for w in self.sends.values_mut().filter(|w| due(w)) {
            w.reported = Some(now);
            tracing::warn!(
                rank,
                to = w.peer,
                name = %w.name,
                "stalled send: rank {rank}'s send of {:?} to rank {} has not completed after {:.0?}: rank {} has not received it",
                w.name,
                w.peer,
                now.duration_since(w.submitted),
                w.peer
            );
        }
    }
}

fn waiting(done: Completer, name: String, peer: usize, submitted: Instant, args: Value) -> Waiting {
    Waiting {
        done,
        name,
        peer,
        submitted,
        reported: None,
        args,
    }
}

/// A send's or receive's timeline args: its tensor's dtype and shape, and the other
/// rank (`Null` when no timeline is written).
fn timeline_args(timeline: &Timeline, tensor: &Tensor, peer: usize) -> Value {
    if !timeline.enabled() {
        return Value::Null;
    }
    serde_json::json!({
        "dtype": tensor.dtype().to_string(),
        "shape": tensor.shape(),
        "peer": peer,
    })
}

/// A finished send's or receive's span, from its submission to now.
fn trace(timeline: &mut Timeline, phase: &str, name: &str, submitted: Instant, args: Value) {
    if timeline.enabled() {
        timeline.span(name, phase, submitted, Instant::now(), &args);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::P2pLane;
    use crate::error::{Error, Result};
    use crate::tensor::Tensor;
    use crate::transport::{P2pEvent, P2pPort};

    /// A port that reports its `.0` bytes in flight.
    struct Moving(usize);

    impl P2pPort for Moving {
        fn send(&mut self, _: usize, _: &str, _: Tensor) -> Result<u64> {
            Err(Error::Internal("not sending".into()))
        }
        fn poll(&mut self, _: &mut Vec<P2pEvent>, _: bool) -> Result<()> {
            Ok(())
        }
        fn in_flight(&self) -> usize {
            self.0
        }
    }

    #[test]
    fn a_waiting_caller_yields_as_long_as_the_bytes_moving_take_at_1_gb_per_s() {
        let lane = |bytes| P2pLane::new(Some(Box::new(Moving(bytes))), 0, 0);
        let ms = Duration::from_millis;
        assert_eq!(P2pLane::new(None, 0, 0).yield_for(), ms(1));
        assert_eq!(lane(0).yield_for(), ms(1));
        assert_eq!(lane(4 << 10).yield_for(), ms(1));
        assert_eq!(lane(2 << 20).yield_for(), ms(2));
        assert_eq!(lane(16 << 20).yield_for(), ms(16));
        assert_eq!(lane(usize::MAX).yield_for(), ms(50));
    }
}
