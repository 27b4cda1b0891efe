//! A simulated asynchronous device behind the [`DeviceComm`] seam, for unit tests of
//! the engine's GPU executor without a GPU (issue 31, items 19–23).
//!
//! Its tensors are host buffers that report themselves on `cuda:<ordinal>`, so the
//! engine routes them to the GPU executor. Like a real stream, every op returns at
//! enqueue and runs later: an op completes (its results written into its buffers)
//! only once every rank has enqueued it and the test is not holding the device. A
//! test can make an output allocation or an enqueue fail on one rank; a failed enqueue
//! aborts the rank's communicator, as NCCL does, ending its queued ops at the next
//! settle without writing them. A buffer freed while an op still queued on it is
//! recorded as a violation (a real device would read or write freed memory).
//!
//! Simulated: every op of the seam (allreduce one tensor at a time and fused,
//! broadcast, allgather, alltoall, reducescatter).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::combine;
use crate::error::{Error, Result};
use crate::tensor::{scale_bytes, DType, HostBuffer, Tensor};
use crate::transport::device::{DeviceComm, Reduction};
use crate::vocab::ReduceOp;

/// How long `settle` waits for queued ops before it records that it would hang.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// The devices of one in-process job, shared by its ranks.
#[derive(Default)]
pub(crate) struct SimDevices {
    state: Mutex<SimState>,
    changed: Condvar,
}

impl std::fmt::Debug for SimDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDevices").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct SimState {
    /// Each op's parts by rank (inputs after prescale), by op number.
    parts: HashMap<u64, Vec<Option<Vec<u8>>>>,
    /// While set, no op completes.
    hold: bool,
    /// The rank whose output allocations fail.
    fail_alloc_on: Option<usize>,
    /// `(rank, op number)` whose enqueue fails.
    fail_enqueue: Option<(usize, u64)>,
    /// Each alltoall's send counts, by op number and rank.
    sends: HashMap<(u64, usize), Vec<usize>>,
    /// Buffers alive, and how many queued ops use each.
    alive: HashSet<u64>,
    in_use: HashMap<u64, usize>,
    next_buffer: u64,
    /// What a real device would have done wrong.
    violations: Vec<String>,
    /// The threads that enqueued ops (device calls must stay on engine threads).
    threads: HashSet<String>,
    /// Each process's (job rank's) enqueues across its communicators, in order, as
    /// `(communicator, op number)`.
    order: HashMap<usize, Vec<(u64, u64)>>,
    /// How long enqueues of a communicator on a process are delayed (to make engines
    /// race).
    delays: HashMap<(usize, u64), Duration>,
}

impl SimDevices {
    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds every op (none completes) until released.
    pub(crate) fn hold(&self, on: bool) {
        self.lock().hold = on;
        self.changed.notify_all();
    }

    /// Makes every allocation of an op's output on `rank` fail (None: none).
    pub(crate) fn fail_alloc_on(&self, rank: Option<usize>) {
        self.lock().fail_alloc_on = rank;
    }

    /// Makes op number `op` (counted from 0 per rank) fail at enqueue on `rank`.
    pub(crate) fn fail_enqueue(&self, rank: usize, op: u64) {
        self.lock().fail_enqueue = Some((rank, op));
    }

    /// Delays every enqueue of communicator `comm` (0: the job's; a process set's
    /// split number) on job rank `process` by `by`, before it is queued.
    pub(crate) fn delay_enqueues(&self, process: usize, comm: u64, by: Duration) {
        self.lock().delays.insert((process, comm), by);
    }

    /// Pairs of job ranks that enqueued the ops of two communicators in different
    /// orders (a real device could deadlock), as messages naming both orders.
    pub(crate) fn order_conflicts(&self) -> Vec<String> {
        let s = self.lock();
        let mut ranks: Vec<usize> = s.order.keys().copied().collect();
        ranks.sort_unstable();
        let mut out = Vec::new();
        for (i, &p) in ranks.iter().enumerate() {
            for &q in &ranks[i + 1..] {
                let (a, b) = (&s.order[&p], &s.order[&q]);
                let common = |x: &Vec<(u64, u64)>, y: &Vec<(u64, u64)>| -> Vec<(u64, u64)> {
                    x.iter().filter(|op| y.contains(op)).copied().collect()
                };
                let (ca, cb) = (common(a, b), common(b, a));
                if ca != cb {
                    out.push(format!(
                        "rank {p} enqueued (communicator, op) {ca:?}, rank {q} {cb:?}"
                    ));
                }
            }
        }
        out
    }

    /// The names of the threads that enqueued ops so far.
    pub(crate) fn enqueuing_threads(&self) -> Vec<String> {
        let mut v: Vec<String> = self.lock().threads.iter().cloned().collect();
        v.sort();
        v
    }

    pub(crate) fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// How many ranks have enqueued op number `op`.
    pub(crate) fn enqueued(&self, op: u64) -> usize {
        self.lock()
            .parts
            .get(&op)
            .map_or(0, |p| p.iter().flatten().count())
    }

    /// A device tensor on `cuda:<ordinal>` holding `values`.
    pub(crate) fn tensor(self: &Arc<Self>, values: &[f32], ordinal: usize) -> Tensor {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        self.buffer(DType::F32, &[values.len()], ordinal, bytes)
    }

    fn buffer(
        self: &Arc<Self>,
        dtype: DType,
        shape: &[usize],
        ordinal: usize,
        init: &[u8],
    ) -> Tensor {
        let id = {
            let mut s = self.lock();
            s.next_buffer += 1;
            let id = s.next_buffer;
            s.alive.insert(id);
            id
        };
        let memory: Box<[u8]> = init.into();
        let len = memory.len();
        let buffer = SimBuffer {
            ptr: Box::into_raw(memory).cast::<u8>(),
            len,
            id,
            ordinal,
            devices: self.clone(),
        };
        Tensor::from_host_buffer(buffer, dtype, shape)
            .unwrap_or_else(|e| panic!("a simulated buffer of the right size: {e}"))
    }
}

/// Device memory: a host allocation the simulated device writes when an op completes.
struct SimBuffer {
    ptr: *mut u8,
    len: usize,
    id: u64,
    ordinal: usize,
    devices: Arc<SimDevices>,
}

// SAFETY: the allocation is owned by the buffer; the simulated device writes it only
// on the engine thread that owns the tensor, while the op that uses it is queued.
unsafe impl Send for SimBuffer {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for SimBuffer {}

impl HostBuffer for SimBuffer {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn simulated_device(&self) -> Option<usize> {
        Some(self.ordinal)
    }
}

impl Drop for SimBuffer {
    fn drop(&mut self) {
        {
            let mut s = self.devices.lock();
            s.alive.remove(&self.id);
            if s.in_use.get(&self.id).is_some_and(|&n| n > 0) {
                s.violations.push(format!(
                    "buffer {} was freed while an op that uses it was still queued",
                    self.id
                ));
            }
        }
        // SAFETY: made by `Box::into_raw` of a boxed slice of `len` bytes; freed once.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// What an op computes from every rank's part.
#[derive(Debug, Clone)]
enum Kind {
    Reduce {
        op: ReduceOp,
        postscale: f64,
    },
    Broadcast {
        root: usize,
    },
    Gather,
    /// Each rank's part is cut by its send counts (`SimState::sends`).
    Alltoall,
    /// The sum, of which this rank keeps block `rank` of `counts`.
    Scatter {
        op: ReduceOp,
        postscale: f64,
        counts: Vec<usize>,
    },
}

/// An op queued on one rank.
struct Queued {
    number: u64,
    kind: Kind,
    dtype: DType,
    /// Where the result goes, in order: buffer id, address, length.
    outputs: Vec<(u64, *mut u8, usize)>,
    /// Every buffer the op uses.
    uses: Vec<u64>,
}

// SAFETY: the addresses are of `SimBuffer`s, which are `Send` (see there); a queued op
// moves with its communicator, which one thread at a time uses (the engine's lock).
unsafe impl Send for Queued {}

/// One rank's simulated communicator.
pub(crate) struct SimDevice {
    /// Which communicator of the job (0: the job's own) and which job rank runs it.
    comm: u64,
    process: usize,
    rank: usize,
    size: usize,
    ordinal: usize,
    devices: Arc<SimDevices>,
    next_op: u64,
    queue: VecDeque<Queued>,
    done: u64,
    aborted: Option<String>,
}

impl SimDevice {
    /// Rank `rank` of `size` on `cuda:<ordinal>`.
    pub(crate) fn new(rank: usize, size: usize, ordinal: usize, devices: Arc<SimDevices>) -> Self {
        SimDevice {
            comm: 0,
            process: rank,
            rank,
            size,
            ordinal,
            devices,
            next_op: 0,
            queue: VecDeque::new(),
            done: 0,
            aborted: None,
        }
    }

    /// The same on communicator `comm` (a process set's split number) of job rank
    /// `process`.
    pub(crate) fn on_comm(mut self, comm: u64, process: usize) -> Self {
        self.comm = comm;
        self.process = process;
        self
    }

    /// Where op `number` of this communicator is kept among every communicator's ops
    /// (the job's op numbers are kept as they are).
    fn slot(&self, number: u64) -> u64 {
        (self.comm << 40) | number
    }

    /// The simulated buffer behind `t`.
    fn sim(t: &Tensor) -> Result<&SimBuffer> {
        let buffer: &dyn std::any::Any = t
            .host_buffer()
            .ok_or_else(|| Error::Internal("not a simulated device tensor".into()))?;
        buffer
            .downcast_ref::<SimBuffer>()
            .ok_or_else(|| Error::Internal("not a simulated device tensor".into()))
    }

    /// Queues an op reading `inputs` (prescaled by `prescale`) and writing `outputs`.
    fn enqueue(
        &mut self,
        kind: Kind,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
        prescale: f64,
    ) -> Result<()> {
        self.usable()?;
        let number = self.next_op;
        let devices = self.devices.clone();
        let delay = devices
            .lock()
            .delays
            .get(&(self.process, self.comm))
            .copied();
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        let mut s = devices.lock();
        let thread = std::thread::current();
        s.threads
            .insert(thread.name().unwrap_or("unnamed").to_string());
        if s.fail_enqueue == Some((self.rank, number)) {
            let why = format!(
                "simulated enqueue failure of op {number} on rank {}",
                self.rank
            );
            self.aborted = Some(why.clone());
            return Err(Error::Transport {
                call: "simulated enqueue",
                message: why,
            });
        }
        let dtype = inputs.first().map_or(DType::U8, |t| t.dtype());
        let mut part = Vec::new();
        let mut uses = Vec::new();
        for t in inputs {
            part.extend_from_slice(t.host_bytes());
            uses.push(Self::sim(t)?.id);
        }
        scale_bytes(&mut part, dtype, prescale);
        let mut out = Vec::new();
        for t in outputs {
            let b = Self::sim(t)?;
            out.push((b.id, b.ptr, b.len));
            uses.push(b.id);
        }
        for id in &uses {
            *s.in_use.entry(*id).or_insert(0) += 1;
        }
        s.parts
            .entry(self.slot(number))
            .or_insert_with(|| vec![None; self.size])[self.rank] = Some(part);
        s.order
            .entry(self.process)
            .or_default()
            .push((self.comm, number));
        drop(s);
        devices.changed.notify_all();
        self.next_op += 1;
        self.queue.push_back(Queued {
            number,
            kind,
            dtype,
            outputs: out,
            uses,
        });
        Ok(())
    }

    /// Completes the queued ops that can complete, in order.
    fn progress(&mut self) {
        let devices = self.devices.clone();
        let mut s = devices.lock();
        while let Some(front) = self.queue.front() {
            if s.hold || self.aborted.is_some() {
                return;
            }
            let Some(parts) = s.parts.get(&self.slot(front.number)) else {
                return;
            };
            let Some(parts) = parts.iter().cloned().collect::<Option<Vec<Vec<u8>>>>() else {
                return;
            };
            let (w, me) = (front.dtype.size_of(), self.rank);
            let sum = |op: ReduceOp| {
                let mut acc = parts[0].clone();
                for p in &parts[1..] {
                    combine(&mut acc, p, front.dtype, op);
                }
                acc
            };
            let result = match &front.kind {
                Kind::Reduce { op, postscale } => {
                    let mut acc = sum(*op);
                    scale_bytes(&mut acc, front.dtype, *postscale);
                    acc
                }
                Kind::Broadcast { root } => parts[*root].clone(),
                Kind::Gather => parts.concat(),
                Kind::Alltoall => {
                    let mut got = Vec::new();
                    for (i, p) in parts.iter().enumerate() {
                        let send = s
                            .sends
                            .get(&(self.slot(front.number), i))
                            .cloned()
                            .unwrap_or_default();
                        let at = send.iter().take(me).sum::<usize>() * w;
                        let len = send.get(me).copied().unwrap_or(0) * w;
                        got.extend_from_slice(&p[at..at + len]);
                    }
                    got
                }
                Kind::Scatter {
                    op,
                    postscale,
                    counts,
                } => {
                    let acc = sum(*op);
                    let at = counts.iter().take(me).sum::<usize>() * w;
                    let len = counts.get(me).copied().unwrap_or(0) * w;
                    let mut mine = acc[at..at + len].to_vec();
                    scale_bytes(&mut mine, front.dtype, *postscale);
                    mine
                }
            };
            let mut at = 0;
            for &(id, ptr, len) in &front.outputs {
                if s.alive.contains(&id) {
                    let n = len.min(result.len().saturating_sub(at));
                    // SAFETY: the buffer is alive (its drop removes it from `alive`
                    // under this lock) and holds `len` bytes; nothing borrows it while
                    // the engine thread is in this call.
                    unsafe { std::ptr::copy_nonoverlapping(result[at..].as_ptr(), ptr, n) };
                } else {
                    s.violations.push(format!(
                        "op {} wrote buffer {id} after it was freed",
                        front.number
                    ));
                }
                at += len;
            }
            self.finish_front(&mut s);
        }
    }

    /// Retires the oldest queued op.
    fn finish_front(&mut self, s: &mut SimState) {
        if let Some(q) = self.queue.pop_front() {
            for id in q.uses {
                if let Some(n) = s.in_use.get_mut(&id) {
                    *n = n.saturating_sub(1);
                }
            }
            self.done += 1;
        }
    }
}

impl DeviceComm for SimDevice {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn usable(&self) -> Result<()> {
        match &self.aborted {
            None => Ok(()),
            Some(why) => Err(Error::CudaUnavailable(format!(
                "the simulated communicator was aborted ({why})"
            ))),
        }
    }

    fn prepare(&mut self, _tensors: &[Tensor]) -> Result<()> {
        Ok(())
    }

    fn zeros(&mut self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let bytes = crate::tensor::checked_len(shape, dtype)? * dtype.size_of();
        Ok(self
            .devices
            .buffer(dtype, shape, self.ordinal, &vec![0; bytes]))
    }

    fn empty(&mut self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        if self.devices.lock().fail_alloc_on == Some(self.rank) {
            return Err(Error::Cuda {
                call: "cuMemAlloc",
                message: "simulated out of memory".into(),
            });
        }
        self.zeros(dtype, shape)
    }

    fn allreduce(&mut self, tensors: &[Tensor], r: Reduction) -> Result<()> {
        let kind = Kind::Reduce {
            op: r.op,
            postscale: r.postscale,
        };
        for t in tensors {
            self.enqueue(kind.clone(), &[t], &[t], r.prescale)?;
        }
        Ok(())
    }

    fn allreduce_fused(&mut self, tensors: &[Tensor], r: Reduction) -> Result<()> {
        let kind = Kind::Reduce {
            op: r.op,
            postscale: r.postscale,
        };
        let all: Vec<&Tensor> = tensors.iter().collect();
        self.enqueue(kind, &all, &all, r.prescale)
    }

    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<()> {
        self.enqueue(Kind::Broadcast { root }, &[tensor], &[tensor], 1.0)
    }

    fn allgatherv(&mut self, tensor: &Tensor, out: &Tensor, _counts: &[usize]) -> Result<()> {
        self.enqueue(Kind::Gather, &[tensor], &[out], 1.0)
    }

    fn alltoallv(
        &mut self,
        tensor: &Tensor,
        send: &[usize],
        out: &Tensor,
        _recv: &[usize],
    ) -> Result<()> {
        let key = (self.slot(self.next_op), self.rank);
        self.devices.lock().sends.insert(key, send.to_vec());
        self.enqueue(Kind::Alltoall, &[tensor], &[out], 1.0)
    }

    fn reduce_scatter(
        &mut self,
        tensor: &mut Tensor,
        out: &mut Tensor,
        counts: &[usize],
        r: Reduction,
    ) -> Result<()> {
        let kind = Kind::Scatter {
            op: r.op,
            postscale: r.postscale,
            counts: counts.to_vec(),
        };
        self.enqueue(kind, &[tensor], &[out], r.prescale)
    }

    fn mark(&mut self) -> Result<u64> {
        Ok(self.next_op)
    }

    fn reached(&mut self, mark: u64) -> Result<bool> {
        self.usable()?;
        self.progress();
        Ok(self.done >= mark)
    }

    fn settle(&mut self) {
        let deadline = Instant::now() + SETTLE_LIMIT;
        loop {
            self.progress();
            if self.queue.is_empty() {
                return;
            }
            let devices = self.devices.clone();
            let mut s = devices.lock();
            if self.aborted.is_some() {
                // The abort ended the queued ops: nothing more is written.
                while !self.queue.is_empty() {
                    self.finish_front(&mut s);
                }
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                s.violations.push(format!(
                    "settle on rank {} waited {SETTLE_LIMIT:?} for ops that never ran",
                    self.rank
                ));
                return;
            }
            let wait = (deadline - now).min(Duration::from_millis(20));
            drop(
                devices
                    .changed
                    .wait_timeout(s, wait)
                    .unwrap_or_else(PoisonError::into_inner),
            );
        }
    }
}
