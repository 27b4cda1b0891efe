//! [`Kolo`]: the handle to this rank's engine, and start-up.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::engine::autotune::AutotuneState;
use crate::engine::queue::{Queue, Refused};
use crate::engine::request::{
    self, Command, Key, Named, OpKind, Request, Submission, Tensors, RESERVED_PREFIX,
};
use crate::engine::Driver;
use crate::error::{Error, Result};
use crate::handle::{self, Completer, Handle, Output};
use crate::order::unsort;
use crate::submit_error::SubmitError;
use crate::tensor::Tensor;
use crate::transport::Topology;

/// MPI can be initialised once per process; so can kolo.
static STARTED: AtomicBool = AtomicBool::new(false);

/// This process's rank, for the panic hook.
static RANK: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Makes a panic on any thread end the whole job: the hook reports the rank and the
/// panic, keeps the previous hook's output, and asks the engine to call MPI_Abort.
/// Unwinding into MPI_Finalize instead would leave the other ranks waiting for this
/// one forever (Horovod's users know this hang well).
fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CATCHING.with(std::cell::Cell::get) > 0 {
                // Inside `catch_panic`: the caller handles it.
                return;
            }
            let rank = RANK.load(Ordering::SeqCst);
            let thread = std::thread::current();
            let thread = thread.name().unwrap_or("<unnamed>");
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(non-string panic payload)");
            let at = info.location().map(|l| format!(" at {l}")).unwrap_or_default();
            // One write, so that mpirun's per-rank output tagging keeps it on one line.
            let line = format!("kolo: rank {rank} panicked on thread '{thread}'{at}: {message}; aborting the whole job\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            previous(info);
            // The program's own failure: not one kolorun relaunches.
            crate::transport::request_abort(1);
        }));
    });
}

thread_local! {
    /// How many `catch_panic` calls this thread is inside.
    static CATCHING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs `f` and hands back its panic instead of ending the job.
///
/// After [`init`], a panic on any thread aborts the whole job (so that no other rank
/// waits for this one forever). Code whose failure the caller turns into an error —
/// on every rank, so that nobody waits — runs inside `catch_panic`: while `f` runs on
/// this thread, a panic of this thread unwinds to here, unreported (the caller reports
/// it), as with [`std::panic::catch_unwind`]. A panic on another thread still ends the
/// job. kolo-burn's pipeline uses it to check each stage's first forward pass.
///
/// # Errors
/// The panic's payload, as `catch_unwind` gives it.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            CATCHING.with(|c| c.set(c.get().saturating_sub(1)));
        }
    }
    CATCHING.with(|c| c.set(c.get() + 1));
    let _leave = Leave;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
}

/// See [`Config::malloc_tuning`]: large blocks from the heap (up to glibc's limit for
/// the threshold, 32 MiB), the heap kept up to 2 GiB of free memory.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's allocation parameters; any thread may
        // call it, and it takes the arena lock itself.
        let ok = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
        };
        if !ok {
            tracing::debug!("glibc refused the malloc tuning; allocations stay as they were");
        }
    }
}

/// Initialises MPI and starts this rank's engine with the configuration from the
/// environment (`KOLO_*`, or the `HOROVOD_*` aliases). Every rank must call it.
///
/// ```no_run
/// let kolo = kolo::init()?;
/// let t = kolo::Tensor::from_vec(vec![kolo.rank() as f32; 4], &[4])?;
/// let sum = kolo.allreduce("x", t).op(kolo::ReduceOp::Sum).wait()?;
/// # Ok::<(), kolo::Error>(())
/// ```
///
/// # Errors
/// [`Error::Config`] for a malformed variable, [`Error::Init`] when MPI cannot start
/// or kolo was already initialised in this process.
pub fn init() -> Result<Kolo> {
    Config::from_env()?.init()
}

/// What this build of kolo contains; see [`build_info`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BuildInfo {
    /// kolo's version.
    pub version: &'static str,
    /// The MPI library kolo was built against (as its build probe reported it).
    pub mpi_library: &'static str,
    /// Whether the NCCL transport for CUDA tensors was compiled in (feature `nccl`).
    /// Whether it can run here is another question: see [`cuda_device_count`] and
    /// [`nccl_library_present`].
    pub nccl: bool,
}

/// What this build of kolo contains; needs no MPI (`kolorun --check-build` prints it).
pub fn build_info() -> BuildInfo {
    BuildInfo {
        version: env!("CARGO_PKG_VERSION"),
        mpi_library: env!("KOLO_MPI_LIBRARY"),
        nccl: cfg!(feature = "nccl"),
    }
}

/// The number of CUDA devices this process can use; needs no MPI.
///
/// # Errors
/// [`Error::CudaUnavailable`] when kolo was built without the `nccl` feature, when the
/// CUDA driver library is not installed ("CUDA driver library not found"), or when the
/// driver finds no device.
pub fn cuda_device_count() -> Result<usize> {
    crate::tensor::cuda_device_count()
}

/// Whether the NCCL library (libnccl.so.2) can be loaded; always false without the
/// `nccl` feature.
pub fn nccl_library_present() -> bool {
    #[cfg(feature = "nccl")]
    {
        crate::tensor::device::nccl_present()
    }
    #[cfg(not(feature = "nccl"))]
    {
        false
    }
}

/// The handle to this rank's kolo engine: rank information and every collective.
///
/// `Kolo` is a cheap clone (`Send + Sync`). The engine keeps running while any clone
/// is alive; handles of pending ops do not keep it alive.
///
/// # Shutdown
/// [`Kolo::shutdown`] (or dropping the last clone) stops the engine and finalises MPI.
/// Ops still pending on this rank fail; on other ranks, ops that needed this rank fail
/// with [`Error::RankLeft`] naming it. Call it (or drop kolo) on every rank before
/// the program ends, so that mpirun sees every rank finish cleanly.
#[derive(Clone)]
pub struct Kolo {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Kolo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kolo")
            .field("rank", &self.inner.topology.rank)
            .field("size", &self.inner.topology.size)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    topology: Topology,
    /// Commands to the engine, and the names pending on this rank.
    queue: Arc<Queue>,
    /// The engine itself, which a thread waiting on its own op may run (see
    /// `engine::Driver`).
    driver: Arc<Driver>,
    engine: Mutex<Option<JoinHandle<()>>>,
    autotune: Arc<Mutex<AutotuneState>>,
    /// The settings, for the engines of process sets made from this one.
    config: Config,
    /// Process sets made from this engine: stopped before it.
    sets: Mutex<Sets>,
    /// Signalled when a starting set is registered (or failed to start).
    sets_changed: std::sync::Condvar,
    /// Held for the whole of a shutdown, so that a second one (another thread, or a
    /// drop) waits for the first instead of finalising MPI under its set engines.
    stopping: Mutex<()>,
    /// Marked when this engine's thread has been joined (for the engine it was made
    /// from, which must not finalise MPI before).
    stopped: Arc<Stopped>,
    /// A process set's engine keeps the engine it was made from (and so MPI) running.
    _parent: Option<Arc<Inner>>,
    /// The last process set id given out (0 is the set of all ranks).
    last_set: AtomicUsize,
    /// The plans of the groups submitted last (sorted members and keys).
    group_plans: crate::group_plans::Plans,
}

mod shutdown;
pub(crate) use shutdown::StartingSet;
use shutdown::{Sets, Stopped};

impl Config {
    /// Initialises MPI and starts the engine with these settings. See [`crate::init`].
    ///
    /// # Errors
    /// [`Error::Init`] when MPI cannot start or kolo was already initialised in this
    /// process.
    pub fn init(self) -> Result<Kolo> {
        self.validate()?;
        start(self)
    }
}

/// Starts the engine thread; MPI is initialised on it, so that only that thread ever
/// calls MPI. All-or-nothing: on any failure the thread is joined before returning.
pub(crate) fn start(config: Config) -> Result<Kolo> {
    crate::logging::install(&config);
    if config.malloc_tuning {
        tune_malloc();
    }
    crate::tensor::set_huge_pages(config.huge_pages);
    if STARTED.swap(true, Ordering::SeqCst) {
        return Err(Error::Init(
            "kolo was already initialised in this process; MPI can start only once per process \
             (clone the Kolo handle instead of calling init again)"
                .into(),
        ));
    }
    let kolo = spawn_engine(
        config,
        "kolo-engine".into(),
        None,
        None,
        crate::transport::connect,
    )?;
    RANK.store(kolo.rank(), Ordering::SeqCst);
    install_panic_hook();
    Ok(kolo)
}

/// The error of a start that did not finish within `waited`: names this rank (from
/// mpirun's environment, MPI not being up) and its host.
fn not_started(waited: Duration) -> String {
    let rank = std::env::var("OMPI_COMM_WORLD_RANK")
        .or_else(|_| std::env::var("PMI_RANK"))
        .unwrap_or_else(|_| "?".into());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "this host".into());
    format!(
        "rank {rank} on {host}: MPI did not start on every rank within {:.0} s \
         (KOLO_START_TIMEOUT / kolorun --start-timeout): the ranks of some host never \
         started or cannot reach this one; check the host names, that the program is at \
         the same path on every host, and the network interface (kolorun \
         --network-interface)",
        waited.as_secs_f64()
    )
}

/// Starts an engine thread on the transport `connect` makes (on that thread) and
/// returns the handle to it. `start` uses MPI; the protocol tests use N in-process
/// loopback ranks, each its own engine, in one process.
pub(crate) fn spawn_engine(
    config: Config,
    thread: String,
    parent: Option<Arc<Inner>>,
    turns: Option<crate::engine::turn::TakeTurn>,
    connect: impl FnOnce() -> Result<Box<dyn crate::transport::Transport>> + Send + 'static,
) -> Result<Kolo> {
    let unknown_horovod = config.unknown_horovod.clone();
    let kept_config = config.clone();
    let queue = Arc::new(Queue::default());
    let engine_queue = queue.clone();
    let driver = Arc::new(Driver::new(queue.clone()));
    let engine_driver = driver.clone();
    let (started_tx, started_rx) = mpsc::sync_channel(1);
    let autotune = Arc::new(Mutex::new(AutotuneState::default()));
    let engine_autotune = autotune.clone();
    let engine = std::thread::Builder::new()
        .name(thread)
        .spawn(move || {
            crate::engine::run(
                config,
                engine_queue,
                engine_driver,
                started_tx,
                engine_autotune,
                turns,
                connect,
            )
        })
        .map_err(|e| Error::Init(format!("cannot start the engine thread: {e}")))?;
    // Only the job's own start can wait on other hosts; a process set's split runs
    // between engines that are already up.
    let wait = if parent.is_none() && !kept_config.start_timeout.is_zero() {
        kept_config.start_timeout
    } else {
        Duration::MAX
    };
    let topology = match started_rx.recv_timeout(wait) {
        Ok(Ok(t)) => t,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            // The engine thread sits in MPI_Init, which cannot be interrupted: leave
            // it, and let the caller exit.
            return Err(Error::Init(not_started(wait)));
        }
        Ok(Err(e)) => {
            let _ = engine.join();
            return Err(e);
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            let _ = engine.join();
            return Err(Error::Init(
                "the engine thread died while starting MPI".into(),
            ));
        }
    };
    if topology.rank == 0 {
        for name in &unknown_horovod {
            tracing::warn!("{name} is set, but kolo has no such setting: it is ignored");
        }
    }
    tracing::debug!(rank = topology.rank, size = topology.size, "kolo started");
    Ok(Kolo {
        inner: Arc::new(Inner {
            topology,
            queue,
            driver,
            engine: Mutex::new(Some(engine)),
            autotune,
            config: kept_config,
            sets: Mutex::new(Sets::default()),
            sets_changed: std::sync::Condvar::new(),
            stopping: Mutex::new(()),
            stopped: Arc::new(Stopped::default()),
            _parent: parent,
            last_set: AtomicUsize::new(0),
            group_plans: crate::group_plans::Plans::default(),
        }),
    })
}

impl Kolo {
    /// The plans of the groups submitted last through this handle's engine.
    pub(crate) fn group_plans(&self) -> &crate::group_plans::Plans {
        &self.inner.group_plans
    }

    /// This process's rank in the job, `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.topology.rank
    }

    /// The number of ranks in the job.
    pub fn size(&self) -> usize {
        self.inner.topology.size
    }

    /// This process's rank among the ranks on its machine.
    pub fn local_rank(&self) -> usize {
        self.inner.topology.local_rank
    }

    /// The settings the engine runs with and what the autotuner (`KOLO_AUTOTUNE=1`)
    /// changed, with the cycle of each change (the same on every rank).
    pub fn autotune_state(&self) -> AutotuneState {
        self.inner
            .autotune
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The CUDA device this rank should use, as Horovod users pick it: the local rank
    /// modulo the number of devices on this machine.
    ///
    /// # Errors
    /// As [`cuda_device_count`].
    pub fn cuda_device(&self) -> Result<usize> {
        crate::tensor::default_cuda_ordinal(self.local_rank())
    }

    /// The number of ranks on this machine.
    pub fn local_size(&self) -> usize {
        self.inner.topology.local_size
    }

    /// This machine's index among the machines (ranks with the same local rank).
    pub fn cross_rank(&self) -> usize {
        self.inner.topology.cross_rank
    }

    /// The number of machines that have a rank with this local rank.
    pub fn cross_size(&self) -> usize {
        self.inner.topology.cross_size
    }

    /// Starts writing this rank's timeline (Chrome Trace Event JSON, for Perfetto or
    /// chrome://tracing) to `path`, replacing any timeline being written. Unlike
    /// `KOLO_TIMELINE`, the path is used as given on every rank that calls this.
    ///
    /// # Errors
    /// The file cannot be created, or the engine is not running.
    pub fn start_timeline(&self, path: impl Into<std::path::PathBuf>) -> Result<()> {
        self.timeline_command(Some(path.into()))
    }

    /// Stops writing the timeline; the file stays a complete trace.
    ///
    /// # Errors
    /// The engine is not running.
    pub fn stop_timeline(&self) -> Result<()> {
        self.timeline_command(None)
    }

    fn timeline_command(&self, path: Option<std::path::PathBuf>) -> Result<()> {
        let (reply, answer) = mpsc::sync_channel(1);
        let stopped = || {
            Error::engine_stopped(
                "timeline",
                "",
                self.rank(),
                "kolo has been shut down on this rank",
            )
        };
        if !self.inner.queue.push(Command::Timeline { path, reply }) {
            return Err(stopped());
        }
        answer.recv().map_err(|_| stopped())?
    }

    /// Stops the engine and finalises MPI; idempotent. See the type's `# Shutdown`.
    /// MPI_Finalize waits for every rank, so this waits until the other ranks shut down
    /// too; [`shutdown_timeout`](Self::shutdown_timeout) bounds that wait.
    ///
    /// # Errors
    /// [`Error::Internal`] if the engine thread had panicked.
    pub fn shutdown(&self) -> Result<()> {
        self.inner.shutdown()
    }

    /// [`shutdown`](Self::shutdown), bounded: if the engine has not stopped and
    /// finalised MPI within `timeout` (another rank never shuts down, a collective
    /// never ends), kolo prints which rank gave up and aborts the whole job (MPI_Abort
    /// from the engine, or this process ends and mpirun ends the others), as tokio's
    /// `Runtime::shutdown_timeout` bounds its shutdown.
    ///
    /// Every clone of this `Kolo` — including those inside a kolo-burn
    /// `GradientReducer` or `DistributedOptimizer` — keeps the engine running until the
    /// last one is dropped or a shutdown is called on any of them.
    ///
    /// # Errors
    /// [`Error::Internal`] if the engine thread had panicked.
    pub fn shutdown_timeout(&self, timeout: Duration) -> Result<()> {
        self.inner.shutdown_timeout(timeout)
    }

    /// Counts an `add_process_set` as starting until the guard is dropped (shutdown
    /// waits for it); `None` once shutdown has begun.
    pub(crate) fn starting_set(&self) -> Option<StartingSet<'_>> {
        StartingSet::enter(&self.inner)
    }

    /// The next process set id (1 for the first set; the same on every rank, since
    /// every rank adds sets in the same order).
    pub(crate) fn next_set_id(&self) -> usize {
        self.inner.last_set.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Starts the engine of process set `id` on its transport `t` and registers it, so
    /// that shutdown stops it before MPI is finalised.
    pub(crate) fn start_set_engine(
        &self,
        id: usize,
        ranks: &[usize],
        t: Box<dyn crate::transport::Transport>,
    ) -> Result<Kolo> {
        let mut config = self.inner.config.clone();
        // The job's engine writes the timeline and runs the tuner.
        config.timeline = None;
        config.autotune = false;
        config.autotune_log = None;
        config.unknown_horovod.clear();
        config.job_local_rank = Some(self.local_rank());
        let set = spawn_engine(
            config,
            format!("kolo-engine-set{id}"),
            Some(self.inner.clone()),
            Some(self.device_turns(id, ranks.to_vec())),
            move || Ok(t),
        )?;
        self.inner
            .sets()
            .engines
            .push((Arc::downgrade(&set.inner), set.inner.stopped.clone()));
        Ok(set)
    }

    /// How process set `id`'s engine (job ranks `ranks`) gets this rank's turn to
    /// enqueue device work from this engine (see `engine::turn`): its `n`-th device
    /// cycle asks under key `device_turn[id]#n`, the same on each of its ranks.
    fn device_turns(&self, id: usize, ranks: Vec<usize>) -> crate::engine::turn::TakeTurn {
        // Weak: the set's engine must not keep the job's engine from shutting down
        // (the set's `Inner` holds it while the set exists).
        let job = Arc::downgrade(&self.inner);
        let mut n = 0u64;
        Box::new(move || {
            let inner = job.upgrade().ok_or_else(|| {
                Error::Internal("the job's engine is gone; no device turn for a process set".into())
            })?;
            let job = Kolo { inner };
            let mut s = Submission::new(
                OpKind::DeviceTurn,
                format!("{}device_turn[{id}]#{}", request::RESERVED_PREFIX, n + 1).into(),
                Named::new(),
            );
            s.splits = Some(ranks.clone());
            // Not driven from here: this thread runs the set's engine, and the job's
            // engine, run here, would wait for the turn this thread is to drop.
            let handle = job.submit(s, handle::to_detached)?;
            // Counted once submitted (the same count on every rank of the set).
            n += 1;
            let turn = handle.undriven().wait()?;
            turn.downcast::<crate::engine::turn::Turn>()
                .map(|t| *t)
                .map_err(|_| Error::Internal("a device turn of another type".into()))
        })
    }

    /// Forgets a process set's engine (it is being removed and stopped by the caller).
    pub(crate) fn forget_set(&self, engine: &Kolo) {
        self.inner
            .sets()
            .engines
            .retain(|(w, _)| !std::ptr::eq(w.as_ptr(), Arc::as_ptr(&engine.inner)));
    }

    /// Validates and queues a request; the handle converts the engine's output.
    pub(crate) fn submit<T>(
        &self,
        s: Submission,
        convert: fn(Output) -> Result<T>,
    ) -> Result<Handle<T>, SubmitError> {
        self.submit_waking(s, convert, true)
    }

    /// Submits and waits. While the engine is idle this thread runs its cycles itself
    /// instead of waking the engine thread and sleeping until it is done (see
    /// `engine::Driver`): a small op then costs no hand-off between threads.
    pub(crate) fn submit_wait<T>(
        &self,
        s: Submission,
        convert: fn(Output) -> Result<T>,
    ) -> Result<T> {
        // Queued without waking the engine thread: the wait runs it here, or kicks
        // that thread when it cannot.
        self.submit_waking(s, convert, false)?.wait()
    }

    /// A send run on this thread while the engine is idle (`engine::Driver::send_now`):
    /// no queue, and no handle unless it must wait for its receiver. `Err`: not here
    /// (the engine is busy, or the submit-time checks must speak): the tensor comes
    /// back for the usual path. `key` makes the pair's negotiation key, claimed only
    /// if the send must wait.
    // The tensor comes back by value when this path does not apply, to go the queued
    // way (as `Tensor::into_host_buffer` hands it back).
    #[allow(clippy::result_large_err)]
    pub(crate) fn send_now(
        &self,
        name: &str,
        tensor: Tensor,
        dest: usize,
        key: impl FnOnce() -> Key,
    ) -> Result<Result<()>, Tensor> {
        if !self.may_p2p_now(Some(&tensor), name, dest) {
            return Err(tensor);
        }
        let mut handle = None;
        let later = || {
            let (h, c) = self.claimed_pair(key(), "send", handle::to_unit);
            handle = Some(h);
            c
        };
        match self.inner.driver.send_now(dest, name, tensor, later) {
            Ok(Ok(true)) => Ok(Ok(())),
            Ok(Ok(false)) => Ok(match handle {
                Some(h) => h.wait(),
                None => Err(Error::Internal("a waiting send without a handle".into())),
            }),
            Ok(Err(e)) => Ok(Err(e)),
            Err(t) => Err(t),
        }
    }

    /// A receive run on this thread while the engine is idle, as
    /// [`send_now`](Self::send_now); `None`: not here.
    pub(crate) fn recv_now(
        &self,
        name: &str,
        src: usize,
        key: impl FnOnce() -> Key,
    ) -> Option<Result<Tensor>> {
        if !self.may_p2p_now(None, name, src) {
            return None;
        }
        let mut handle = None;
        let later = || {
            let (h, c) = self.claimed_pair(key(), "recv", handle::to_tensor);
            handle = Some(h);
            c
        };
        Some(match self.inner.driver.recv_now(src, name, later)? {
            Ok(Some(t)) => Ok(t),
            Ok(None) => match handle {
                Some(h) => h.wait(),
                None => Err(Error::Internal("a waiting recv without a handle".into())),
            },
            Err(e) => Err(e),
        })
    }

    /// Whether a send (of `tensor`) or receive of `name` with `peer` passes the
    /// submit-time checks (`validate`'s for point to point, and a name neither empty
    /// nor reserved), so that it may skip them on this thread.
    fn may_p2p_now(&self, tensor: Option<&Tensor>, name: &str, peer: usize) -> bool {
        !name.is_empty()
            && !name.starts_with(RESERVED_PREFIX)
            && crate::validate::check_p2p(tensor, name, peer, self.size(), self.rank()).is_ok()
    }

    /// A handle driven by this engine, its `key` claimed in the pending set (unless
    /// pending already: the op is posted by then, so it goes on unclaimed).
    fn claimed_pair<T>(
        &self,
        key: Key,
        op: &'static str,
        convert: fn(Output) -> Result<T>,
    ) -> (Handle<T>, Completer) {
        let mut names = handle::Names::new();
        if self.inner.queue.claim_key(&key) {
            names.push(key);
        }
        let (h, c) = handle::pair(names, self.inner.queue.clone(), (op, self.rank()), convert);
        (h.driven_by(self.inner.driver.clone()), c)
    }

    /// How many times a waiting caller ran the engine's cycles itself (tests).
    #[cfg(test)]
    pub(crate) fn caller_drives(&self) -> u64 {
        self.inner.driver.drives()
    }

    /// [`submit`](Self::submit); a sleeping engine thread is woken only if `wake`.
    fn submit_waking<T>(
        &self,
        mut s: Submission,
        convert: fn(Output) -> Result<T>,
        wake: bool,
    ) -> Result<Handle<T>, SubmitError> {
        let order = s.order.take();
        let back = |tensors: Tensors| unsort(order.as_deref(), tensors.into_vec());
        if let Err(e) = crate::validate::validate(&s, self.size(), self.rank()) {
            let (_, tensors) = s.into_parts();
            return Err(SubmitError::new(e, back(tensors)));
        }
        let rank = self.rank();
        let op = s.kind.name();
        // The key first: an "engine stopped" error names it.
        let mut names = handle::Names::new();
        names.push(s.key.clone());
        for (n, _) in &s.tensors {
            if *n != s.key {
                names.push(n.clone());
            }
        }
        let on_drop = (op, rank);
        let (meta, tensors) = s.into_parts();
        let (handle, mut done) = handle::pair(names, self.inner.queue.clone(), on_drop, convert);
        let handle = handle.driven_by(self.inner.driver.clone());
        done.set_order(order.clone());
        // Boxed here, once: the queue and the engine move it by pointer.
        let request = Box::new(Request {
            meta,
            tensors,
            done,
            submitted: std::time::Instant::now(),
        });
        match self.inner.queue.submit_waking(request, wake) {
            Ok(()) => {}
            Err(Refused::Duplicate(name, request)) => {
                let Request { tensors, done, .. } = *request;
                done.disarm();
                let e = Error::DuplicateName {
                    op,
                    name: name.to_string(),
                    rank,
                };
                return Err(SubmitError::new(e, back(tensors)));
            }
            Err(Refused::Closed(request)) => {
                let Request {
                    tensors,
                    done,
                    meta,
                    ..
                } = *request;
                done.disarm();
                // The caller gets the tensors back.
                let e = Error::engine_stopped(
                    op,
                    &*meta.key,
                    rank,
                    "kolo has been shut down on this rank",
                );
                return Err(SubmitError::new(e, back(tensors)));
            }
        }
        Ok(handle)
    }
}
