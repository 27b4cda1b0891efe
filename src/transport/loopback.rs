//! An in-process transport for tests: N ranks as N engine threads of one process,
//! meeting at a shared hub. Every call is a rendezvous: each rank deposits its part of
//! call number `k` (the engines make the same calls in the same order), waits until
//! every rank has, and computes its result from all the parts. The real negotiation,
//! response cache, fusion, stall inspector and tuner run on top, without mpirun.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::{ring, Idle, Topology, Transport};

pub(crate) mod sim_device;
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::vocab::ReduceOp;

/// One rank's part of a call.
#[derive(Debug, Clone, Default)]
struct Part {
    bytes: Vec<u8>,
    counts: Vec<usize>,
}

impl Part {
    /// A part that is only bytes (no counts).
    fn of(bytes: &[u8]) -> Part {
        Part {
            bytes: bytes.to_vec(),
            counts: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
struct Round {
    parts: Vec<Option<Part>>,
    collected: usize,
}

#[derive(Debug, Default)]
struct HubState {
    rounds: HashMap<u64, Round>,
    /// Ranks whose transport was dropped (their engine ended).
    gone: Vec<usize>,
}

#[derive(Debug, Default)]
struct Hub {
    state: Mutex<HubState>,
    changed: Condvar,
    /// Control-plane calls (cycle agreements and exchanges, heartbeats included) rank 0
    /// has completed.
    exchanges: Arc<std::sync::atomic::AtomicU64>,
    /// The hubs of process sets split from this one, by split number.
    sets: Mutex<HashMap<u64, Arc<Hub>>>,
}

/// One rank's end of the hub.
#[derive(Debug)]
pub(crate) struct Loopback {
    rank: usize,
    size: usize,
    next: u64,
    hub: Arc<Hub>,
    /// What `in_place_group_bytes` answers (0 unless a test sets it).
    in_place_group: usize,
    /// The job's simulated devices (`open_device`).
    devices: Arc<sim_device::SimDevices>,
    /// This rank in the job (the process whose device it is).
    job_rank: usize,
    /// Which communicator: 0 for the job, a process set's split number otherwise.
    comm: u64,
    /// Process sets split so far (every rank splits in the same order).
    splits: u64,
}

impl Loopback {
    /// The `size` ranks of one in-process job.
    pub(crate) fn job(size: usize) -> Vec<Loopback> {
        let hub = Arc::new(Hub::default());
        let devices = Arc::new(sim_device::SimDevices::default());
        (0..size)
            .map(|rank| Loopback {
                rank,
                size,
                next: 0,
                hub: hub.clone(),
                in_place_group: 0,
                devices: devices.clone(),
                job_rank: rank,
                comm: 0,
                splits: 0,
            })
            .collect()
    }

    /// How many control-plane calls rank 0 has completed so far, counted as they happen.
    pub(crate) fn exchanges(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.hub.exchanges.clone()
    }

    /// The job's simulated devices, shared by its ranks.
    pub(crate) fn devices(&self) -> Arc<sim_device::SimDevices> {
        self.devices.clone()
    }

    /// Takes groups of large allreduces of up to `bytes` (as the MPI transport does
    /// across hosts with one rank each), each group in one call.
    #[cfg(test)]
    pub(crate) fn with_in_place_groups(mut self, bytes: usize) -> Self {
        self.in_place_group = bytes;
        self
    }

    /// How many collective calls this rank has made.
    #[cfg(test)]
    pub(crate) fn calls(&self) -> u64 {
        self.next
    }

    /// Deposits this rank's part of the next call and returns every rank's, in rank
    /// order; calls `idle` (with the time waited) while others have not deposited.
    fn meet(&mut self, part: Part, mut idle: Option<&mut dyn Idle>) -> Result<Vec<Part>> {
        let call = self.next;
        self.next += 1;
        let size = self.size;
        let start = Instant::now();
        let lock = || {
            self.hub
                .state
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        {
            let mut state = lock();
            let round = state.rounds.entry(call).or_default();
            round.parts.resize(size, None);
            round.parts[self.rank] = Some(part);
        }
        self.hub.changed.notify_all();
        loop {
            let mut state = lock();
            let done = state
                .rounds
                .get(&call)
                .is_some_and(|r| r.parts.iter().all(Option::is_some));
            if done {
                let round = state.rounds.get_mut(&call);
                let parts = round
                    .map(|r| {
                        r.collected += 1;
                        r.parts
                            .iter()
                            .map(|p| p.clone().unwrap_or_default())
                            .collect()
                    })
                    .unwrap_or_default();
                if state.rounds.get(&call).is_some_and(|r| r.collected == size) {
                    state.rounds.remove(&call);
                }
                if self.rank == 0 && idle.is_some() {
                    self.hub
                        .exchanges
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                return Ok(parts);
            }
            if let Some(&r) = state.gone.first() {
                return Err(Error::Transport {
                    call: "loopback",
                    message: format!("rank {r} left the job during call {call}"),
                });
            }
            let (state, _) = self
                .hub
                .changed
                .wait_timeout(state, Duration::from_millis(1))
                .unwrap_or_else(PoisonError::into_inner);
            drop(state);
            if let Some(idle) = idle.as_mut() {
                idle.poll(start.elapsed());
            }
        }
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        let mut state = self
            .hub
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        state.gone.push(self.rank);
        drop(state);
        self.hub.changed.notify_all();
    }
}

/// Elementwise `acc = op(acc, x)` for raw bytes of `dtype` (Average is a sum: the
/// engine divides afterwards).
fn combine(acc: &mut [u8], x: &[u8], dtype: DType, op: ReduceOp) {
    if matches!(op, ReduceOp::Sum | ReduceOp::Average) {
        ring::add_into(acc, x, dtype);
        return;
    }
    let f = |a: f64, b: f64| match op {
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        _ => a * b,
    };
    macro_rules! each {
        ($t:ty, $to:expr, $from:expr) => {{
            let a: &mut [$t] = bytemuck::cast_slice_mut(acc);
            let b: &[$t] = bytemuck::cast_slice(x);
            for (a, b) in a.iter_mut().zip(b) {
                *a = $from(f($to(*a), $to(*b)));
            }
        }};
    }
    match dtype {
        DType::F32 => each!(f32, f64::from, |v: f64| v as f32),
        DType::F64 => each!(f64, |v| v, |v| v),
        DType::F16 => each!(f16, |v: f16| v.to_f64(), f16::from_f64),
        DType::BF16 => each!(bf16, |v: bf16| v.to_f64(), bf16::from_f64),
        DType::I32 => each!(i32, f64::from, |v: f64| v as i32),
        DType::I64 => each!(i64, |v: i64| v as f64, |v: f64| v as i64),
        DType::I8 => each!(i8, f64::from, |v: f64| v as i8),
        DType::U8 => each!(u8, f64::from, |v: f64| v as u8),
    }
}

/// Byte offset of block `r` for element `counts`.
fn offset(counts: &[usize], r: usize, width: usize) -> usize {
    counts[..r].iter().sum::<usize>() * width
}

impl Transport for Loopback {
    fn any_thread(&self) -> bool {
        true
    }

    /// A process set of the job's ranks `ranks` (sorted; every rank calls this in
    /// the same order): its ranks meet at a hub of their own; its simulated device
    /// communicator is another one on each rank's device.
    fn split(&mut self, ranks: &[usize]) -> Result<Option<Box<dyn Transport>>> {
        if self.comm != 0 {
            return Err(Error::Internal(
                "the loopback transport splits only the job".into(),
            ));
        }
        self.splits += 1;
        let Ok(rank) = ranks.binary_search(&self.rank) else {
            return Ok(None);
        };
        let hub = self
            .hub
            .sets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(self.splits)
            .or_default()
            .clone();
        Ok(Some(Box::new(Loopback {
            rank,
            size: ranks.len(),
            next: 0,
            hub,
            in_place_group: self.in_place_group,
            devices: self.devices.clone(),
            job_rank: self.job_rank,
            comm: self.splits,
            splits: 0,
        })))
    }

    fn topology(&self) -> Topology {
        Topology {
            rank: self.rank,
            size: self.size,
            local_rank: self.rank,
            local_size: self.size,
            cross_rank: 0,
            cross_size: 1,
        }
    }

    fn abort(&mut self, code: i32) -> ! {
        panic!("loopback rank {} aborted the job (code {code})", self.rank)
    }

    fn open_device(
        &mut self,
        ordinal: Option<usize>,
        _timeout: Duration,
    ) -> Result<Box<dyn crate::transport::device::DeviceComm>> {
        Ok(Box::new(
            sim_device::SimDevice::new(
                self.rank,
                self.size,
                ordinal.unwrap_or(0),
                self.devices.clone(),
            )
            .on_comm(self.comm, self.job_rank),
        ))
    }

    fn exchange(&mut self, local: &[u8], idle: &mut dyn Idle) -> Result<Vec<Vec<u8>>> {
        let part = Part::of(local);
        Ok(self
            .meet(part, Some(idle))?
            .into_iter()
            .map(|p| p.bytes)
            .collect())
    }

    fn agree_bits(
        &mut self,
        words: &mut [u64],
        sum: &mut [f32],
        idle: &mut dyn Idle,
    ) -> Result<()> {
        let mut mine: Vec<u8> = bytemuck::cast_slice(words).to_vec();
        mine.extend_from_slice(bytemuck::cast_slice(sum));
        let split = words.len() * 8;
        let parts = self.meet(Part::of(&mine), Some(idle))?;
        // Every rank combines in rank order: bit-identical sums everywhere.
        for (r, p) in parts.iter().enumerate() {
            let (w, s) = p.bytes.split_at(split.min(p.bytes.len()));
            for (acc, c) in words.iter_mut().zip(w.chunks_exact(8)) {
                *acc &= u64::from_ne_bytes(c.try_into().unwrap_or([0; 8]));
            }
            for (acc, c) in sum.iter_mut().zip(s.chunks_exact(4)) {
                let x = f32::from_ne_bytes(c.try_into().unwrap_or([0; 4]));
                *acc = if r == 0 { x } else { *acc + x };
            }
        }
        Ok(())
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let part = Part::of(buf);
        let parts = self.meet(part, None)?;
        // Every rank combines in rank order: bit-identical results everywhere.
        buf.copy_from_slice(&parts[0].bytes);
        for p in &parts[1..] {
            combine(buf, &p.bytes, dtype, op);
        }
        Ok(())
    }

    fn in_place_group_bytes(&self) -> usize {
        self.in_place_group
    }

    /// One call for the whole group: the buffers end to end.
    fn allreduce_many(&mut self, bufs: &mut [&mut [u8]], dtype: DType, op: ReduceOp) -> Result<()> {
        let mut all: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        self.allreduce(&mut all, dtype, op)?;
        let mut at = 0;
        for b in bufs.iter_mut() {
            b.copy_from_slice(&all[at..at + b.len()]);
            at += b.len();
        }
        Ok(())
    }

    fn allgatherv(&mut self, send: &[u8], recv: &mut [u8], _: &[usize], _: DType) -> Result<()> {
        let part = Part::of(send);
        let all: Vec<u8> = self
            .meet(part, None)?
            .into_iter()
            .flat_map(|p| p.bytes)
            .collect();
        recv.copy_from_slice(&all);
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize, _: DType) -> Result<()> {
        let part = Part::of(buf);
        let parts = self.meet(part, None)?;
        buf.copy_from_slice(&parts[root].bytes);
        Ok(())
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        _recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let w = dtype.size_of();
        let part = Part {
            bytes: send.to_vec(),
            counts: send_counts.to_vec(),
        };
        let me = self.rank;
        let mut at = 0;
        for p in self.meet(part, None)? {
            let from = offset(&p.counts, me, w);
            let n = p.counts[me] * w;
            recv[at..at + n].copy_from_slice(&p.bytes[from..from + n]);
            at += n;
        }
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        send: &mut [u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let mut all = send.to_vec();
        self.allreduce(&mut all, dtype, op)?;
        let from = offset(counts, self.rank, dtype.size_of());
        recv.copy_from_slice(&all[from..from + recv.len()]);
        Ok(())
    }
}

/// Ends the test process if a step of a test (starting the ranks, running them) takes
/// longer than [`LIMIT`]: an engine that hangs fails the run instead of blocking it.
pub(crate) struct Watchdog(Arc<AtomicBool>);

/// The longest one step of a loopback test may take.
const LIMIT: Duration = Duration::from_secs(60);

impl Watchdog {
    pub(crate) fn new(what: &'static str) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + LIMIT;
            while !flag.load(Ordering::SeqCst) {
                if Instant::now() > deadline {
                    eprintln!("loopback test: {what} took longer than {LIMIT:?}; the engines hang");
                    std::process::exit(1);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Watchdog(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Runs `f(rank, transport)` for each rank of an in-process job of `size` on its own
/// thread, under the watchdog, and returns the results in rank order: for unit tests
/// of one engine part at a time over the loopback transport.
pub(crate) fn on_loopback_ranks<T: Send>(
    size: usize,
    f: impl Fn(usize, Loopback) -> T + Sync,
) -> Vec<T> {
    let _watchdog = Watchdog::new("running the loopback ranks");
    std::thread::scope(|s| {
        let hs: Vec<_> = Loopback::job(size)
            .into_iter()
            .enumerate()
            .map(|(r, end)| {
                let f = &f;
                s.spawn(move || f(r, end))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| panic!("a rank panicked")))
            .collect()
    })
}
