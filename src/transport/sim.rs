//! A simulated transport for `kolo::sim`: the control plane of a job of N virtual
//! ranks, in one process, under virtual time.
//!
//! Each simulated rank runs kolo's own negotiation code on its own thread over a
//! [`SimTransport`]. A job of N ranks may run fewer threads than ranks (the
//! *participants*): every virtual rank is represented by one participant, whose
//! contribution it sends (the workloads give every rank the same submissions at the
//! same times, so their messages are copies). A control-plane collective waits until
//! every participant has arrived, combines the contributions of all N virtual ranks
//! (each rank still receives and decodes N messages in the full exchange) and ends,
//! in virtual time, at the latest arrival plus what the network model charges for the
//! collective's messages. Between collectives a rank's clock advances by the CPU time
//! its thread spends (`CLOCK_THREAD_CPUTIME_ID`, times the model's `cpu_scale`).
//! Data-plane calls are refused: the simulator charges data movement by the model,
//! without moving bytes.

use std::sync::{Arc, Condvar, Mutex, PoisonError};

use super::{Idle, Topology, Transport};
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::vocab::ReduceOp;

/// Seconds of CPU time this thread has used.
pub(crate) fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; the clock id is a constant Linux knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// A simulated rank's virtual clock: the time at its last mark plus the CPU time
/// used since, scaled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    at: f64,
    cpu_mark: f64,
    scale: f64,
}

impl Clock {
    /// Virtual seconds now.
    pub(crate) fn read(&self) -> f64 {
        self.at + (thread_cpu() - self.cpu_mark).max(0.0) * self.scale
    }

    /// Sets the clock to `at` virtual seconds (CPU time counts from now).
    pub(crate) fn set(&mut self, at: f64) {
        self.at = at;
        self.cpu_mark = thread_cpu();
    }
}

/// What the simulated job's control-plane messages cost, and where its ranks sit
/// (`kolo::sim`'s network model implements it).
pub(crate) trait ControlCosts: Send + Sync {
    /// Virtual seconds of the bit agreement over `n` ranks, `bytes` per message.
    fn agreement(&self, n: usize, bytes: f64) -> f64;
    /// Virtual seconds of the full exchange where rank r contributes `lens[r]` bytes.
    fn exchange(&self, lens: &[usize]) -> f64;
    /// Ranks per host.
    fn ranks_per_host(&self) -> usize;
    /// Virtual seconds per second of this machine's CPU time.
    fn cpu_scale(&self) -> f64;
}

/// What one participant brings to a collective.
enum Contribution {
    Bits { words: Vec<u64>, sum: Vec<f32> },
    Bytes(Vec<u8>),
}

/// A collective's result, shared by every participant.
struct Done {
    words: Vec<u64>,
    sum: Vec<f32>,
    /// Each participant's contribution to the full exchange.
    bytes: Vec<Arc<Vec<u8>>>,
    /// Virtual time the collective ends on every rank.
    at: f64,
    /// Virtual seconds the network model charged for its messages.
    network: f64,
}

#[derive(Default)]
struct Round {
    /// Collectives completed so far.
    gen: u64,
    arrivals: Vec<Option<(f64, Contribution)>>,
    last: Option<Arc<Done>>,
    /// A participant failed: nobody waits for it.
    broken: bool,
}

/// The simulated job: which participant stands for each virtual rank, the network
/// model, and the rendezvous of the control-plane collectives.
pub(crate) struct Fabric {
    n: usize,
    /// The virtual rank each participant is.
    ranks: Vec<usize>,
    /// The participant each virtual rank copies.
    stands_for: Vec<usize>,
    network: Box<dyn ControlCosts>,
    round: Mutex<Round>,
    turned: Condvar,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fabric")
            .field("n", &self.n)
            .field("participants", &self.ranks.len())
            .finish()
    }
}

impl Fabric {
    /// A job of `n` virtual ranks run by `participants` threads (at least 1, at most
    /// `n`), spread evenly over the ranks (the first and the last rank among them).
    pub(crate) fn new(
        n: usize,
        participants: usize,
        network: Box<dyn ControlCosts>,
    ) -> Arc<Fabric> {
        let k = participants.clamp(1, n.max(1));
        let ranks: Vec<usize> = if k == 1 {
            vec![0]
        } else {
            (0..k).map(|i| i * (n - 1) / (k - 1)).collect()
        };
        let stands_for = (0..n)
            .map(|v| ranks.partition_point(|&r| r <= v).saturating_sub(1))
            .collect();
        let round = Round {
            arrivals: (0..k).map(|_| None).collect(),
            ..Round::default()
        };
        Arc::new(Fabric {
            n,
            ranks,
            stands_for,
            network,
            round: Mutex::new(round),
            turned: Condvar::new(),
        })
    }

    /// The virtual ranks the participants are, in participant order.
    pub(crate) fn participants(&self) -> &[usize] {
        &self.ranks
    }

    /// Marks the job failed: every waiting and later collective returns an error.
    pub(crate) fn abandon(&self) {
        let mut round = self.round.lock().unwrap_or_else(PoisonError::into_inner);
        round.broken = true;
        self.turned.notify_all();
    }

    /// Participant `me` arrives at virtual time `at` with `c`; returns once every
    /// participant has.
    fn meet(&self, me: usize, at: f64, c: Contribution) -> Result<Arc<Done>> {
        let broken = || Error::Internal("a simulated rank failed: the job stops".into());
        let mut round = self.round.lock().unwrap_or_else(PoisonError::into_inner);
        if round.broken {
            return Err(broken());
        }
        round.arrivals[me] = Some((at, c));
        let gen = round.gen;
        if round.arrivals.iter().all(Option::is_some) {
            let arrivals: Vec<(f64, Contribution)> =
                round.arrivals.iter_mut().filter_map(Option::take).collect();
            let done = Arc::new(self.combine(arrivals)?);
            round.last = Some(done.clone());
            round.gen += 1;
            self.turned.notify_all();
            return Ok(done);
        }
        while round.gen == gen && !round.broken {
            round = self
                .turned
                .wait(round)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if round.gen == gen {
            return Err(broken());
        }
        round.last.clone().ok_or_else(broken)
    }

    /// The result of one collective from every participant's contribution.
    fn combine(&self, arrivals: Vec<(f64, Contribution)>) -> Result<Done> {
        let latest = arrivals.iter().map(|a| a.0).fold(0.0, f64::max);
        let mut words: Vec<u64> = Vec::new();
        let mut sum: Vec<f32> = Vec::new();
        let mut bytes = Vec::new();
        let mismatch = || Error::Internal("simulated ranks called different collectives".into());
        let network = match &arrivals[0].1 {
            Contribution::Bits { words: w, sum: s } => {
                words = vec![u64::MAX; w.len()];
                sum = vec![0.0; s.len()];
                let mut largest = 0usize;
                for (_, c) in &arrivals {
                    let Contribution::Bits { words: w, .. } = c else {
                        return Err(mismatch());
                    };
                    for (a, b) in words.iter_mut().zip(w) {
                        *a &= *b;
                    }
                    // Sent sparse: a bitmap of the non-zero words, then those.
                    let nonzero = w.iter().filter(|&&x| x != 0).count();
                    largest = largest.max(8 * (w.len().div_ceil(64) + nonzero) + 4 * s.len());
                }
                // Summed over every virtual rank, in rank order.
                for &p in &self.stands_for {
                    if let Contribution::Bits { sum: s, .. } = &arrivals[p].1 {
                        for (a, b) in sum.iter_mut().zip(s) {
                            *a += *b;
                        }
                    }
                }
                self.network.agreement(self.n, largest as f64)
            }
            Contribution::Bytes(_) => {
                for (_, c) in arrivals {
                    let Contribution::Bytes(b) = c else {
                        return Err(mismatch());
                    };
                    bytes.push(Arc::new(b));
                }
                let lens: Vec<usize> = self.stands_for.iter().map(|&p| bytes[p].len()).collect();
                self.network.exchange(&lens)
            }
        };
        Ok(Done {
            words,
            sum,
            bytes,
            at: latest + network,
            network,
        })
    }
}

/// One participant's end of the simulated job.
#[derive(Debug)]
pub(crate) struct SimTransport {
    fabric: Arc<Fabric>,
    me: usize,
    topology: Topology,
    /// This rank's virtual clock.
    pub(crate) clock: Clock,
    /// Virtual seconds the control-plane collectives' messages took (the network
    /// model's charge, not the waiting for later ranks).
    pub(crate) network: f64,
    /// Full exchanges run so far.
    pub(crate) exchanges: usize,
}

impl SimTransport {
    /// Participant `me` of `fabric`.
    pub(crate) fn new(fabric: Arc<Fabric>, me: usize) -> SimTransport {
        let n = fabric.n;
        let rank = fabric.ranks[me];
        let l = fabric.network.ranks_per_host().clamp(1, n.max(1));
        let host = rank / l;
        let topology = Topology {
            rank,
            size: n,
            local_rank: rank % l,
            local_size: l.min(n - host * l),
            cross_rank: host,
            cross_size: n.div_ceil(l),
        };
        let scale = fabric.network.cpu_scale();
        SimTransport {
            fabric,
            me,
            topology,
            clock: Clock {
                at: 0.0,
                cpu_mark: thread_cpu(),
                scale,
            },
            network: 0.0,
            exchanges: 0,
        }
    }

    /// Runs one collective: arrives now, waits, and sets the clock to its end.
    fn collective(&mut self, c: Contribution) -> Result<Arc<Done>> {
        let arrived = self.clock.read();
        let done = self.fabric.meet(self.me, arrived, c)?;
        self.network += done.network;
        Ok(done)
    }

    fn no_data(call: &str) -> Error {
        Error::Internal(format!(
            "the simulated transport moves no data ({call}): the simulator charges data \
             movement by its network model"
        ))
    }
}

impl Transport for SimTransport {
    fn topology(&self) -> Topology {
        self.topology
    }

    fn split(&mut self, _ranks: &[usize]) -> Result<Option<Box<dyn Transport>>> {
        Err(Self::no_data("split"))
    }

    fn abort(&mut self, code: i32) -> ! {
        self.fabric.abandon();
        panic!(
            "simulated rank {} aborted the job (status {code})",
            self.topology.rank
        )
    }

    fn exchange(&mut self, local: &[u8], _idle: &mut dyn Idle) -> Result<Vec<Vec<u8>>> {
        self.exchanges += 1;
        let done = self.collective(Contribution::Bytes(local.to_vec()))?;
        // Building the N messages is the transport's work, not the negotiation's.
        let all = self
            .fabric
            .stands_for
            .iter()
            .map(|&p| done.bytes[p].as_ref().clone())
            .collect();
        self.clock.set(done.at);
        Ok(all)
    }

    fn agree_bits(
        &mut self,
        words: &mut [u64],
        sum: &mut [f32],
        _idle: &mut dyn Idle,
    ) -> Result<()> {
        let done = self.collective(Contribution::Bits {
            words: words.to_vec(),
            sum: sum.to_vec(),
        })?;
        words.copy_from_slice(&done.words);
        sum.copy_from_slice(&done.sum);
        self.clock.set(done.at);
        Ok(())
    }

    fn allreduce(&mut self, _buf: &mut [u8], _dtype: DType, _op: ReduceOp) -> Result<()> {
        Err(Self::no_data("allreduce"))
    }

    fn allgatherv(&mut self, _: &[u8], _: &mut [u8], _: &[usize], _: DType) -> Result<()> {
        Err(Self::no_data("allgatherv"))
    }

    fn broadcast(&mut self, _buf: &mut [u8], _root: usize, _dtype: DType) -> Result<()> {
        Err(Self::no_data("broadcast"))
    }

    fn alltoallv(
        &mut self,
        _: &[u8],
        _: &[usize],
        _: &mut [u8],
        _: &[usize],
        _: DType,
    ) -> Result<()> {
        Err(Self::no_data("alltoallv"))
    }

    fn reduce_scatter(
        &mut self,
        _: &mut [u8],
        _: &mut [u8],
        _: &[usize],
        _: DType,
        _: ReduceOp,
    ) -> Result<()> {
        Err(Self::no_data("reduce_scatter"))
    }
}
