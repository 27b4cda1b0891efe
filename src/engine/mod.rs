//! The background engine: one thread per rank that owns the transport, negotiates
//! which requests are ready on every rank and runs them in one global order.
//!
//! The protocol is written down in `README.md` beside this file; the responses of a
//! cycle are run in `respond.rs`.

mod agree;
pub(crate) mod autotune;
pub(crate) mod cache;
mod control;
pub(crate) mod execute;
pub(crate) mod fusion;
mod gpu;
mod grouped;
mod inbox;
pub(crate) mod layout;
pub(crate) mod negotiate;
mod p2p;
pub(crate) mod queue;
pub(crate) mod request;
mod respond;
#[cfg(feature = "sim")]
pub(crate) mod sim;
pub(crate) mod stall;
pub(crate) mod timeline;
mod tuning;
pub(crate) mod turn;
mod watchdog;

use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::transport::{abort_requested, Topology, Transport};
use agree::{agree, Agreed, HierarchyChoice};
use autotune::{AutotuneState, Tuner};
use control::{Control, Negotiation};
use inbox::{stopped, Inbox};
use negotiate::Response;
use queue::{Queue, Woke};
use request::{Command, RequestMeta, Settings};
use respond::Executor;
use tuning::{tuned_bytes, Tuning};

/// How long an idle engine waits before a heartbeat cycle. Heartbeats let every rank
/// see what the others are waiting for (so stalls name the missing ranks) and notice a
/// rank that left, at a cost of a few microseconds ten times a second.
const HEARTBEAT: Duration = Duration::from_millis(100);
/// How long an engine that has just run ops looks for the next submit before it
/// sleeps on the queue.
const ENGINE_SPIN: Duration = Duration::from_micros(50);

/// How often an engine with ops in flight on the GPU checks their events.
const GPU_POLL: Duration = Duration::from_micros(50);

/// How often an engine that can no longer communicate checks the device for ops
/// still in flight.
const GPU_POLL_WHILE_FAILING: Duration = Duration::from_millis(1);

/// How long the engine polls GPU events without sleeping after enqueueing work.
const GPU_SPIN: Duration = Duration::from_micros(200);

mod driver;
mod start;
pub(crate) use driver::Driver;
pub(crate) use start::run;

/// One rank's engine: the inbox of local requests, the negotiation state, the
/// executor and the tuner, around the transport they share.
struct Engine {
    /// Sends and receives, around the cycles. Declared first, so dropped first: its
    /// channel is freed before the transport finalises MPI.
    p2p: p2p::P2pLane,
    transport: Box<dyn Transport>,
    config: Config,
    inbox: Inbox,
    control: Control,
    exec: Executor,
    tuning: Tuning,
    /// Negotiation cycles run so far (the same count on every rank).
    cycles: u64,
    /// What the collective-timeout watchdog watches (None when it is off).
    progress: Option<Arc<watchdog::Progress>>,
    /// When the last cycle ran (heartbeats go on while point to point is polled).
    last_cycle: Instant,
    /// Set by a driving caller that stopped because a heartbeat cycle is due: the
    /// engine thread runs it (`driver.rs`).
    heartbeat_handed_back: bool,
    /// Test-only: panic this engine thread after two cycles.
    #[cfg(feature = "fault-injection")]
    fault_panic: bool,
}

/// How a cycle loop ended: what the engine thread does next (`Engine::finish`).
enum End {
    /// This rank shut down; its last cycle told the others.
    Left,
    /// Another rank left: every op from now on fails naming it.
    RankLeft(usize),
    /// The cycle failed (a stall abort, a transport error).
    Failed(Error),
}

/// How long the engine thread sleeps before its next cycle (without the engine: a
/// caller may drive it meanwhile).
#[derive(Debug, Clone, Copy)]
enum Sleep {
    /// Nothing to do right after a cycle that ran something: look for the next
    /// submit briefly, then sleep until a heartbeat.
    SpinThenIdle,
    /// Nothing to do: sleep until work arrives or a heartbeat is due.
    Idle,
    /// Only waiting for other ranks: pace cycles by the cycle time.
    Pace(Duration),
    /// Only sends or receives are waiting: look at them again after this long (no
    /// cycle is due when it runs out).
    Poll(Duration),
}

impl Sleep {
    /// Sleeps on the queue (not on the engine) as `self` says, and says what ended it.
    fn sleep(self, queue: &Queue) -> Woke {
        match self {
            Sleep::SpinThenIdle => {
                if queue.spin_for_command(ENGINE_SPIN) {
                    Woke::Command
                } else {
                    queue.wait_for_work(HEARTBEAT)
                }
            }
            Sleep::Idle => queue.wait_for_work(HEARTBEAT),
            Sleep::Pace(t) | Sleep::Poll(t) => queue.wait_for_work(t),
        }
    }

    /// Whether a sleep that ran out makes a cycle due.
    fn cycles_when_over(self) -> bool {
        !matches!(self, Sleep::Poll(_))
    }
}

impl Engine {
    /// One cycle, with what comes before it: the watchdog's mark, an abort requested
    /// by a panic elsewhere in this process, failing everything once this rank shuts
    /// down. Returns how the engine ended, if it did.
    fn step(&mut self) -> Option<End> {
        // One clock read for the cycle's bookkeeping (the watchdog's mark, the
        // heartbeat, the cycle's start): a small op's cycle takes a few microseconds.
        let now = Instant::now();
        self.last_cycle = now;
        if let Some(p) = &self.progress {
            p.mark(self.cycles, now);
        }
        #[cfg(feature = "fault-injection")]
        if self.fault_panic && self.cycles >= 2 {
            panic!("injected fault on the engine thread (KOLO_FAULT_ENGINE_PANIC_RANK)");
        }
        if abort_requested() {
            // A panic somewhere in this process: end the whole job now rather than
            // leave the other ranks waiting (see `runtime::install_panic_hook`), with
            // the status asked for (the watchdog's says the job may be relaunched).
            self.transport.abort(crate::transport::abort_code());
        }
        if self.inbox.shutting_down {
            let rank = self.inbox.rank;
            let why = "this rank shut down before the op completed";
            self.inbox.fail_all(|m| stopped(m, rank, why));
            self.p2p.fail_all_with(&mut self.inbox.p2p, |op, name| {
                Error::engine_stopped(op, name, rank, why)
            });
        }
        let leaving = self.inbox.shutting_down;
        match self.cycle(now) {
            Ok(Some(left)) => Some(End::RankLeft(left)),
            Ok(None) if leaving => Some(End::Left),
            Ok(None) => None,
            Err(e) => Some(End::Failed(e)),
        }
    }

    /// What the engine thread does once the cycles ended: serves failures until this
    /// rank shuts down.
    fn finish(&mut self, end: End) {
        let rank = self.inbox.rank;
        match &end {
            End::Left => {}
            End::RankLeft(left) => {
                self.p2p
                    .fail_all_with(&mut self.inbox.p2p, |op, name| Error::RankLeft {
                        op,
                        name: name.to_string(),
                        rank: *left,
                    })
            }
            End::Failed(e) => {
                let why = e.to_string();
                self.p2p.fail_all_with(&mut self.inbox.p2p, |op, name| {
                    Error::engine_stopped(op, name, rank, &why)
                });
            }
        }
        match end {
            End::Left => {}
            End::RankLeft(left) => {
                // Read again: a shutdown taken in during the cycle was announced in it.
                if !self.inbox.shutting_down {
                    self.serve_after_rank_left(left);
                }
            }
            End::Failed(Error::Stalled { report }) => {
                // Every rank saw the same stall abort in the same cycle: fail
                // everything with the report and stop communicating.
                self.inbox.fail_all(|_| Error::Stalled {
                    report: report.clone(),
                });
                self.serve_stopped(&report);
            }
            End::Failed(e) => {
                tracing::error!(rank = self.inbox.rank, error = %e, "engine failed");
                let msg = e.to_string();
                let rank = self.inbox.rank;
                self.inbox.fail_all(|m| stopped(m, rank, &msg));
                self.serve_stopped(&msg);
            }
        }
    }

    /// Collects local work for the next cycle. Returns how long to sleep first when
    /// there is nothing to run now (idle: up to a heartbeat; only waiting for other
    /// ranks: the cycle time); `None` to cycle at once.
    fn gather(&mut self) -> Option<Sleep> {
        self.take_in();
        if self.inbox.shutting_down || !self.inbox.outgoing.is_empty() {
            return None;
        }
        // Ops still on the device after a heartbeat's wait: cycle now, so that the
        // other ranks and the watchdog hear from this rank meanwhile.
        if self.wait_for_gpu() || self.inbox.shutting_down || !self.inbox.outgoing.is_empty() {
            return None;
        }
        if !self.inbox.has_work() {
            // Only sends and receives wait: poll them (no cycle needed), with a
            // heartbeat cycle when one is due.
            if self.p2p.busy() {
                if self.last_cycle.elapsed() >= HEARTBEAT {
                    return None;
                }
                return Some(Sleep::Poll(self.p2p.poll_interval()));
            }
            // Other ranks wait for a cycle that needs this one too (a process set's
            // device turn among some of them): pace, do not idle.
            if self.control.negotiator.has_entries() {
                return Some(Sleep::Pace(self.config.cycle_time));
            }
            // Right after a cycle that did something, the next submit usually follows
            // within microseconds (a training loop's next tensor): look for it briefly
            // before sleeping.
            if self.control.last_cycle_had_news {
                return Some(Sleep::SpinThenIdle);
            }
            return Some(Sleep::Idle);
        }
        (!self.control.last_cycle_had_news).then_some(Sleep::Pace(self.config.cycle_time))
    }

    /// Takes in what is queued (without blocking), answers timeline requests and
    /// moves point to point along.
    fn take_in(&mut self) {
        self.inbox.drain();
        self.serve_timeline_requests();
        self.progress_p2p();
    }

    /// Posts the sends and receives taken in, polls those waiting, and warns about
    /// those waiting too long.
    fn progress_p2p(&mut self) {
        self.poll_p2p(true);
    }

    /// [`progress_p2p`](Self::progress_p2p), looking for stalls only if `stalls`.
    fn poll_p2p(&mut self, stalls: bool) {
        self.p2p
            .progress(&mut self.inbox.p2p, &mut self.exec.timeline);
        if stalls && self.p2p.busy() && !self.config.stall_check_disable {
            self.p2p.check_stalled(
                self.inbox.rank,
                self.config.stall_check_time,
                self.config.stall_shutdown_time,
                Instant::now(),
            );
        }
    }

    /// While ops run on the GPU and nothing new was submitted here, completes them as
    /// their marks are reached instead of cycling — for at most a heartbeat: true when
    /// ops are still on the device after that (the caller then runs a heartbeat cycle;
    /// issue 31, item 22: an op waiting behind long kernels stopped the heartbeats, and
    /// the other ranks' watchdogs ended a healthy job blaming this rank).
    fn wait_for_gpu(&mut self) -> bool {
        self.exec.gpu.poll();
        let start = Instant::now();
        while self.exec.gpu.busy()
            && !self.inbox.shutting_down
            && self.inbox.outgoing.is_empty()
            && !abort_requested()
        {
            let waited = start.elapsed();
            if waited >= HEARTBEAT {
                return true;
            }
            if waited < GPU_SPIN {
                // Short ops finish within microseconds: look again at once.
                std::thread::yield_now();
                self.inbox.drain();
            } else if self.p2p.busy() {
                self.inbox
                    .wait_for_work(GPU_POLL.min(self.p2p.poll_interval()));
            } else {
                self.inbox.wait_for_work(GPU_POLL);
            }
            // Sends and receives taken in meanwhile are posted, and those waiting
            // polled, as between cycles (issue 53 item 21): they never wait for the
            // device's ops.
            self.poll_p2p(false);
            self.exec.gpu.poll();
        }
        false
    }

    fn serve_timeline_requests(&mut self) {
        for (path, reply) in std::mem::take(&mut self.inbox.timeline_requests) {
            let _ = reply.send(self.timeline_request(path));
        }
    }

    /// Starts (`Some(path)`) or stops the timeline: local to this rank, so it is
    /// served even after collectives have stopped.
    fn timeline_request(&mut self, path: Option<std::path::PathBuf>) -> Result<()> {
        match path {
            Some(p) => self
                .exec
                .timeline
                .start(&p)
                .map_err(|e| Error::InvalidArgument {
                    op: "start_timeline",
                    name: p.display().to_string(),
                    message: format!("cannot write the timeline: {e}"),
                }),
            None => {
                self.exec.timeline.stop();
                Ok(())
            }
        }
    }

    /// One negotiation cycle and the responses it makes ready. Returns the rank that
    /// left, if one did.
    fn cycle(&mut self, cycle_start: Instant) -> Result<Option<usize>> {
        self.cycles += 1;
        self.exec.timeline.cycle_start(cycle_start);
        let gpu = &mut self.exec.gpu;
        let (p2p, timeline) = (&mut self.p2p, &mut self.exec.timeline);
        // While other ranks are awaited: device ops complete, and sends and receives
        // move along (a pair never waits for the others' cycles).
        let mut poll = |inbox: &mut Inbox| {
            gpu.poll();
            p2p.progress(&mut inbox.p2p, timeline);
            // While sends or receives wait, naps between looks are no longer than the
            // engine's polling interval for them.
            if p2p.busy() {
                p2p.poll_interval()
            } else {
                Duration::MAX
            }
        };
        let negotiated = self.control.negotiate(
            &mut *self.transport,
            &mut self.inbox,
            &mut self.tuning.pending,
            &mut poll,
            cycle_start,
        )?;
        let (responses, tuning, ready_at) = match negotiated {
            Negotiation::RankLeft(left) => return Ok(Some(left)),
            Negotiation::Ready {
                responses,
                tuning,
                at,
            } => (responses, tuning, at),
        };
        let reduced_bytes: u64 = responses.iter().map(tuned_bytes).sum();
        self.execute(responses, ready_at);
        self.after_cycle(tuning, reduced_bytes, cycle_start);
        Ok(None)
    }

    /// Execution: runs the agreed responses, fused as the plan says.
    fn execute(&mut self, responses: Vec<Response>, ready_at: Instant) {
        self.exec.run(
            &mut *self.transport,
            &mut self.inbox.pending,
            responses,
            ready_at,
            self.control.agreed.fusion_threshold,
            self.control.agreed.fusion_max_tensor,
        );
    }

    /// After running: the stall check, and tuning (settings agreed this cycle take
    /// effect now on every rank; rank 0's tuner observes the cycle).
    fn after_cycle(&mut self, tuning: Option<Settings>, reduced_bytes: u64, cycle_start: Instant) {
        let now = Instant::now();
        self.control.stall.check(&self.control.negotiator, now);
        if self
            .control
            .stall
            .shutdown_due(&self.control.negotiator, now)
        {
            self.control.stall_abort = true;
        }
        if let Some(s) = tuning {
            self.apply_tuning(s);
        }
        self.tuning.observe(reduced_bytes, cycle_start, now);
    }

    /// Switches to the autotuner's settings: every rank does this at the end of the
    /// same cycle, so fusion plans and cache slots stay identical everywhere.
    fn apply_tuning(&mut self, s: Settings) {
        let capacity = self.tuning.cache_capacity(&s);
        self.control.apply(&s, capacity, &mut self.inbox);
        self.config.cycle_time = s.cycle_time();
        // The tuner only switches these where they can run (`HierarchyChoice::possible`).
        self.transport.set_hierarchical_allreduce(s.hierarchical);
        self.transport
            .set_hierarchical_allgather(s.hierarchical_allgather);
        tracing::debug!(
            rank = self.inbox.rank,
            cycle = self.cycles,
            fusion_threshold = s.fusion_threshold,
            fusion_max_tensor = s.fusion_max_tensor,
            cycle_time_us = s.cycle_time_us,
            cache = s.cache,
            hierarchical = s.hierarchical,
            hierarchical_allgather = s.hierarchical_allgather,
            last = s.last,
            "autotune: settings applied"
        );
        self.tuning.record(&s, self.cycles);
    }

    /// After a rank left no collective can run again: fail every request at once,
    /// naming that rank, until this rank shuts down too.
    fn serve_after_rank_left(&mut self, left: usize) {
        // Timeline requests taken in before the rank left still need their answer.
        self.serve_timeline_requests();
        tracing::warn!(
            rank = self.inbox.rank,
            left,
            "rank {left} has shut down; collectives on this rank will fail"
        );
        self.serve_failing(|meta| Error::RankLeft {
            op: meta.kind.name(),
            name: meta.key.to_string(),
            rank: left,
        });
    }

    fn serve_stopped(&mut self, reason: &str) {
        self.serve_timeline_requests();
        let rank = self.inbox.rank;
        self.serve_failing(|meta| stopped(meta, rank, reason));
    }

    /// Once no collective can run any more: fails every submit at once with `fail`'s
    /// error until this rank shuts down.
    fn serve_failing(&mut self, fail: impl Fn(&RequestMeta) -> Error) {
        // No more communication, so nothing for the watchdog to watch.
        if let Some(p) = &self.progress {
            p.stop();
        }
        let mut taken = Vec::new();
        loop {
            // Ops already on the device still complete as the device runs them (issue
            // 31, item 19): poll while any are in flight.
            self.exec.gpu.poll();
            let busy = self.exec.gpu.busy();
            self.inbox
                .queue
                .take(&mut taken, busy.then_some(GPU_POLL_WHILE_FAILING));
            if taken.is_empty() {
                if busy && !self.inbox.queue.is_closed() {
                    continue;
                }
                // Closed, and the shutdown command was taken in before the engine
                // stopped (an untimed `take` returns empty only once closed); ops
                // still on the device complete as the engine drops its GPU side.
                return;
            }
            for cmd in taken.drain(..) {
                match cmd {
                    Command::Submit(req) => {
                        let err = fail(&req.meta);
                        req.fail(err);
                    }
                    Command::Shutdown => return,
                    Command::Timeline { path, reply } => {
                        let _ = reply.send(self.timeline_request(path));
                    }
                }
            }
        }
    }
}
