//! kolo at scale, by simulation (feature `sim`; the `kolo-sim` tool is its command
//! line).
//!
//! [`simulate`] runs kolo's own negotiation — the announcements, the response cache's
//! bit agreement, the full exchange, the negotiator and the fusion plan — for a job
//! of N virtual ranks in this one process, under virtual time: control messages cost
//! what the [`Network`] model says, the negotiation code costs the CPU time its
//! threads really spend, and each fused collective the plan makes costs its copies
//! and the chosen allreduce [`Algorithm`] on the model. Every rank submits the
//! [`Workload`]'s gradients in backward order, each when the backward pass has
//! reached it, and the engine's cycles are paced as the engine paces them: an async
//! submit to an idle engine starts a cycle one cycle time later (its grace), pending
//! work is negotiated every cycle time, and from the end of backward the caller, waiting
//! on its handles, drives cycles at once.
//!
//! ```no_run
//! use kolo::sim::{simulate, Algorithm, Link, Network, Options, Workload};
//!
//! let network = Network {
//!     ranks_per_host: 8,
//!     intra: Link { latency: 2e-6, bandwidth: 150e9 },
//!     inter: Link { latency: 5e-6, bandwidth: 24e9 },
//!     nics_per_host: 8,
//!     oversubscription: 1.0,
//!     copy_bandwidth: 500e9,
//!     cpu_scale: 1.0,
//! };
//! let workload = Workload {
//!     name: "two".into(),
//!     tensors: vec![("b".into(), 1000), ("a".into(), 1_000_000)],
//!     forward: 0.01,
//!     backward: 0.02,
//! };
//! let steps = simulate(&workload, &Options::new(64, network, Algorithm::Auto)).unwrap();
//! println!("steady step: {:.3} ms", steps.last().unwrap().time * 1e3);
//! ```

use std::sync::mpsc;
use std::sync::Arc;

use crate::engine::sim::{SimCycle, SimRank};
use crate::error::{Error, Result};
use crate::transport::sim::Fabric;

mod network;

pub use network::{Algorithm, Link, Network};

/// One training step as every rank runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// What the tables call it.
    pub name: String,
    /// Each gradient's name and f32 element count, in the order backward produces
    /// them (the last layer's first).
    pub tensors: Vec<(String, usize)>,
    /// Seconds of the forward pass (and the optimizer step) per step.
    pub forward: f64,
    /// Seconds of the backward pass; gradient `i` is ready when the backward has
    /// done the share of it that the gradients up to `i` hold of all parameters.
    pub backward: f64,
}

impl Workload {
    /// Bytes of all gradients.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.1 * 4).sum()
    }
}

/// How the simulated job runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Ranks in the job.
    pub ranks: usize,
    /// Threads that run the negotiation code (each stands for the ranks up to the
    /// next one's; all of them when equal to `ranks`).
    pub participants: usize,
    /// The network model.
    pub network: Network,
    /// The allreduce algorithm charged for each collective.
    pub algorithm: Algorithm,
    /// Steps to run (the first has every request new; the others hit the cache).
    pub steps: usize,
    /// The engine's cycle time in seconds (kolo's default: 1 ms).
    pub cycle_time: f64,
    /// The fusion threshold in bytes (kolo's default: 4 MiB).
    pub fusion_threshold: usize,
    /// Response-cache slots (kolo's default: 1024).
    pub cache_capacity: usize,
}

impl Options {
    /// kolo's defaults for `ranks` ranks on `network`, three steps, every rank its
    /// own thread up to 32 ranks and 16 threads beyond.
    pub fn new(ranks: usize, network: Network, algorithm: Algorithm) -> Options {
        Options {
            ranks,
            participants: if ranks <= 32 { ranks } else { 16 },
            network,
            algorithm,
            steps: 3,
            cycle_time: 1e-3,
            fusion_threshold: crate::DEFAULT_FUSION_THRESHOLD,
            cache_capacity: 1024,
        }
    }
}

/// Where one simulated step's time went (seconds; the engine's time is split into
/// negotiation, copies, data movement and idle, which add up to `time`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// From the forward pass's start to the last gradient reduced.
    pub time: f64,
    /// Forward plus backward.
    pub compute: f64,
    /// The engine negotiating (from a cycle's start until its plan is made, on the
    /// slowest rank), in all cycles of the step.
    pub negotiation: f64,
    /// The share of `negotiation` that the control messages took on the model.
    pub control_network: f64,
    /// Negotiation in cycles that ran the full exchange.
    pub full_exchange: f64,
    /// Negotiation after the backward pass ended: what the step waits for.
    pub negotiation_exposed: f64,
    /// Copies into and out of the fusion buffer.
    pub copies: f64,
    /// Allreduces on the model.
    pub data: f64,
    /// The engine waiting: for gradients, or for the next cycle.
    pub idle: f64,
    /// Cycles run.
    pub cycles: usize,
    /// Cycles that ran the full exchange.
    pub full_exchanges: usize,
    /// Bytes of each collective, in order.
    pub collectives: Vec<usize>,
    /// The largest ratio of a collective's time to the α–β lower bound for its size.
    pub worst_vs_bound: f64,
}

/// Runs `options.steps` steps of `workload` on a simulated job and reports each.
///
/// # Errors
/// The options are unusable (no ranks, no steps, no gradients), a simulated rank's
/// negotiation failed, or the ranks planned differently.
pub fn simulate(workload: &Workload, options: &Options) -> Result<Vec<StepReport>> {
    if options.ranks == 0 || options.steps == 0 || workload.tensors.is_empty() {
        return Err(Error::Config {
            variable: "sim::Options".into(),
            value: format!(
                "ranks {}, steps {}, {} tensors in workload {:?}",
                options.ranks,
                options.steps,
                workload.tensors.len(),
                workload.name
            ),
            reason: "ranks, steps and the workload's tensors must not be 0".into(),
        });
    }
    let fabric = Fabric::new(
        options.ranks,
        options.participants,
        Box::new(options.network.clone()),
    );
    let k = fabric.participants().len();
    let (results_tx, results) = mpsc::channel::<(usize, Result<SimCycle>)>();
    let mut orders = Vec::with_capacity(k);
    let mut threads = Vec::with_capacity(k);
    for me in 0..k {
        let (tx, rx) = mpsc::channel::<Order>();
        orders.push(tx);
        let (fabric, results_tx) = (fabric.clone(), results_tx.clone());
        let (threshold, capacity) = (options.fusion_threshold, options.cache_capacity);
        let spawned = std::thread::Builder::new()
            .name(format!("kolo-sim-{me}"))
            .spawn(move || {
                let mut rank = SimRank::new(fabric.clone(), me, threshold, capacity);
                for (start, submit) in rx {
                    let out = rank.cycle(start, &submit);
                    if out.is_err() {
                        fabric.abandon();
                    }
                    if results_tx.send((me, out)).is_err() {
                        break;
                    }
                }
            });
        threads
            .push(spawned.map_err(|e| Error::Internal(format!("starting a simulated rank: {e}")))?);
    }
    drop(results_tx);
    let mut job = Job {
        workload,
        options,
        orders,
        results,
        clock: 0.0,
    };
    let steps = (0..options.steps).map(|_| job.step()).collect();
    drop(job);
    for t in threads {
        let _ = t.join();
    }
    steps
}

/// A cycle's start (virtual seconds) and the gradients submitted by then.
type Order = (f64, Arc<Vec<(Arc<str>, usize)>>);

/// The coordinator's side of a simulated job.
struct Job<'a> {
    workload: &'a Workload,
    options: &'a Options,
    orders: Vec<mpsc::Sender<Order>>,
    results: mpsc::Receiver<(usize, Result<SimCycle>)>,
    /// Virtual time the next step starts.
    clock: f64,
}

impl Job<'_> {
    /// One cycle on every participant; participant 0's plan, checked against the
    /// others', and the slowest rank's end of negotiation.
    fn cycle(&self, start: f64, submit: Vec<(Arc<str>, usize)>) -> Result<(SimCycle, f64)> {
        let submit = Arc::new(submit);
        for tx in &self.orders {
            tx.send((start, submit.clone()))
                .map_err(|_| Error::Internal("a simulated rank stopped".into()))?;
        }
        let mut outs: Vec<Option<SimCycle>> = (0..self.orders.len()).map(|_| None).collect();
        let mut first_error = None;
        for _ in 0..self.orders.len() {
            let (me, out) = self
                .results
                .recv()
                .map_err(|_| Error::Internal("a simulated rank stopped".into()))?;
            match out {
                Ok(c) => outs[me] = Some(c),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        let outs: Vec<SimCycle> = outs.into_iter().flatten().collect();
        let end = outs.iter().map(|c| c.end).fold(start, f64::max);
        let mut outs = outs.into_iter();
        let first = outs
            .next()
            .ok_or_else(|| Error::Internal("no simulated rank".into()))?;
        if outs.any(|c| c.steps != first.steps) {
            return Err(Error::Internal(format!(
                "simulated ranks planned different collectives in the cycle at {start:.6} s"
            )));
        }
        Ok((first, end))
    }

    /// Charges `cycle`'s plan to `report` (copies, data movement, the ratio to the
    /// bound); returns how many gradients it reduced and the seconds it took.
    fn execute(&self, cycle: &SimCycle, report: &mut StepReport) -> (usize, f64) {
        let (net, o) = (&self.options.network, self.options);
        let mut done = cycle.reduced_in_agreement;
        let mut took = 0.0;
        for step in &cycle.steps {
            let bytes: usize = step.iter().sum();
            if step.len() > 1 {
                let copy = 2.0 * bytes as f64 / net.copy_bandwidth;
                report.copies += copy;
                took += copy;
            }
            let moved = net.allreduce(o.algorithm, o.ranks, bytes as f64);
            let bound = net.lower_bound(o.ranks, bytes as f64);
            if bound > 0.0 {
                report.worst_vs_bound = report.worst_vs_bound.max(moved / bound);
            }
            report.data += moved;
            report.collectives.push(bytes);
            took += moved;
            done += step.len();
        }
        (done, took)
    }

    /// One training step from `self.clock`.
    fn step(&mut self) -> Result<StepReport> {
        let w = self.workload;
        let o = self.options;
        let total: usize = w.tensors.iter().map(|t| t.1).sum::<usize>().max(1);
        let begin = self.clock;
        let backward_end = begin + w.forward + w.backward;
        let mut cum = 0usize;
        let ready: Vec<f64> = w
            .tensors
            .iter()
            .map(|t| {
                cum += t.1;
                begin + w.forward + w.backward * cum as f64 / total as f64
            })
            .collect();
        let names: Vec<Arc<str>> = w.tensors.iter().map(|t| Arc::from(t.0.as_str())).collect();
        let mut report = StepReport {
            compute: w.forward + w.backward,
            ..StepReport::default()
        };
        let (mut submitted, mut done) = (0usize, 0usize);
        let mut free = begin;
        let mut last_start = f64::NEG_INFINITY;
        while done < w.tensors.len() {
            if report.cycles > 16 * w.tensors.len() + 1024 {
                return Err(Error::Internal(format!(
                    "simulated step never finished: {done} of {} gradients reduced after {} cycles",
                    w.tensors.len(),
                    report.cycles
                )));
            }
            // From the end of backward the step's caller waits on its handles, which
            // runs cycles at once (the engine's leader/follower driving).
            let start = if done == submitted {
                // Idle: an async submit wakes the engine thread, which leaves the op
                // to its caller for up to one cycle time.
                let next = ready[submitted];
                free.max((next + o.cycle_time).min(backward_end.max(next)))
            } else {
                free.max((last_start + o.cycle_time).min(backward_end))
            };
            let mut submit = Vec::new();
            while submitted < w.tensors.len() && ready[submitted] <= start {
                submit.push((names[submitted].clone(), w.tensors[submitted].1));
                submitted += 1;
            }
            let (cycle, end) = self.cycle(start, submit)?;
            report.cycles += 1;
            let negotiation = end - start;
            report.negotiation += negotiation;
            report.control_network += cycle.network;
            if cycle.full_exchange {
                report.full_exchanges += 1;
                report.full_exchange += negotiation;
            }
            if end > backward_end {
                report.negotiation_exposed += end - start.max(backward_end);
            }
            let (reduced, took) = self.execute(&cycle, &mut report);
            done += reduced;
            last_start = start;
            free = end + took;
        }
        let end = free.max(backward_end);
        report.time = end - begin;
        report.idle = (report.time - report.negotiation - report.copies - report.data).max(0.0);
        self.clock = end;
        Ok(report)
    }
}

#[cfg(test)]
mod tests;
