//! Configuration: a builder, filled from `KOLO_*` environment variables (with the
//! `HOROVOD_*` names accepted as aliases), validated once, before anything starts.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};

/// The default fusion threshold in bytes (see `benches/` for how it was chosen).
pub const DEFAULT_FUSION_THRESHOLD: usize = 4 << 20;

/// Tensors larger than this are reduced in place, never copied into the fusion
/// buffer. Measured on one node (benches/, ResNet-50 gradient set): above a few tens of
/// KiB an allreduce is bandwidth-bound, so the copy in and out costs more than the
/// per-collective latency fusion saves (fusing every tensor up to 64 MiB made the set
/// 2.6× slower than no fusion; fusing only the small ones matches no fusion on that set
/// and is 2× faster than no fusion on 1000 small tensors).
///
/// Across hosts on a slow link the balance turns: there every collective pays a start-up
/// on the network that copies at memory speed do not (`KOLO_FUSION_MAX_TENSOR_BYTES`
/// raises this limit; the autotuner tries it where the job spans hosts; with one rank
/// per host the transport may take the larger tensors as one group instead, see
/// `engine::fusion::Step::InPlace`).
pub(crate) const MAX_FUSED_TENSOR_BYTES: usize = 64 << 10;

/// How long an engine may make no progress before it aborts the job (see
/// [`Config::collective_timeout`]).
const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// Settings for [`init`](crate::init). Start from [`Config::from_env`] (or
/// [`Config::default`]), change what you need, then call [`Config::init`].
///
/// ```no_run
/// use std::time::Duration;
/// let kolo = kolo::Config::from_env()?
///     .fusion_threshold_bytes(64 << 20)
///     .cycle_time(Duration::from_micros(500))
///     .init()?;
/// # Ok::<(), kolo::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub(crate) fusion_threshold: usize,
    pub(crate) fusion_threshold_explicit: bool,
    pub(crate) fusion_max_tensor: usize,
    pub(crate) fusion_max_tensor_explicit: bool,
    pub(crate) cycle_time: Duration,
    pub(crate) cycle_time_explicit: bool,
    pub(crate) cache_capacity: usize,
    pub(crate) cache_capacity_explicit: bool,
    pub(crate) timeline: Option<PathBuf>,
    pub(crate) timeline_mark_cycles: bool,
    pub(crate) stall_check_time: Duration,
    pub(crate) stall_shutdown_time: Duration,
    pub(crate) stall_check_disable: bool,
    /// Keep large freed blocks in the heap (glibc's malloc; see [`Config::malloc_tuning`]).
    pub(crate) malloc_tuning: bool,
    /// Large collective outputs marked for transparent huge pages ([`Config::huge_pages`]).
    pub(crate) huge_pages: bool,
    pub(crate) collective_timeout: Duration,
    pub(crate) start_timeout: Duration,
    pub(crate) hierarchical_allreduce: bool,
    pub(crate) hierarchical_allreduce_explicit: bool,
    pub(crate) hierarchical_allgather: bool,
    pub(crate) hierarchical_allgather_explicit: bool,
    /// Large sums across hosts through one ring per group (None: kolo measures the
    /// link at start and decides).
    pub(crate) grouped_ring: Option<bool>,
    pub(crate) hierarchical_piece_bytes: Option<usize>,
    pub(crate) allreduce_algorithm: crate::vocab::AllreduceAlgorithm,
    pub(crate) autotune: bool,
    pub(crate) autotune_log: Option<PathBuf>,
    pub(crate) autotune_warmup_samples: usize,
    pub(crate) autotune_steps_per_sample: usize,
    pub(crate) autotune_max_samples: usize,
    pub(crate) autotune_noise: f64,
    pub(crate) log_level: Option<String>,
    pub(crate) simulated_collective_cost: Duration,
    /// The first value a builder method refused: (method, value, reason), reported by
    /// [`Config::init`] with the message the environment path gives for it.
    pub(crate) rejected: Option<(String, String, String)>,
    /// `HOROVOD_*` variables set in the environment that kolo does not know.
    pub(crate) unknown_horovod: Vec<String>,
    /// A process set's engine: this process's local rank in the whole job, which
    /// picks the CUDA device a received tensor lands on (`Kolo::cuda_device`); the
    /// set's own topology numbers its ranks within the set.
    pub(crate) job_local_rank: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            fusion_threshold: DEFAULT_FUSION_THRESHOLD,
            fusion_threshold_explicit: false,
            fusion_max_tensor: MAX_FUSED_TENSOR_BYTES,
            fusion_max_tensor_explicit: false,
            cycle_time: Duration::from_millis(1),
            cycle_time_explicit: false,
            cache_capacity: 1024,
            cache_capacity_explicit: false,
            timeline: None,
            timeline_mark_cycles: false,
            stall_check_time: Duration::from_secs(60),
            stall_shutdown_time: Duration::ZERO,
            collective_timeout: DEFAULT_COLLECTIVE_TIMEOUT,
            start_timeout: Duration::ZERO,
            hierarchical_allreduce: false,
            hierarchical_allreduce_explicit: false,
            hierarchical_allgather: false,
            hierarchical_allgather_explicit: false,
            grouped_ring: None,
            hierarchical_piece_bytes: None,
            allreduce_algorithm: crate::vocab::AllreduceAlgorithm::Auto,
            stall_check_disable: false,
            malloc_tuning: true,
            huge_pages: true,
            autotune: false,
            autotune_log: None,
            autotune_warmup_samples: 3,
            autotune_steps_per_sample: 10,
            autotune_max_samples: 20,
            autotune_noise: 0.8,
            log_level: None,
            simulated_collective_cost: Duration::ZERO,
            rejected: None,
            unknown_horovod: Vec::new(),
            job_local_rank: None,
        }
    }
}

mod env;
#[cfg(test)]
use env::{unknown_horovod, KEYS};

const POSITIVE: &str = "expected a positive whole number";
const POSITIVE_NUMBER: &str = "expected a positive number";

/// Log levels accepted by `KOLO_LOG_LEVEL`.
const LOG_LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

impl Config {
    /// Largest number of bytes fused into one collective; 0 disables fusion.
    /// (`KOLO_FUSION_THRESHOLD`)
    pub fn fusion_threshold_bytes(mut self, bytes: usize) -> Self {
        self.fusion_threshold = bytes;
        self.fusion_threshold_explicit = true;
        self
    }

    /// Tensors larger than this many bytes are reduced in place rather than copied
    /// into the fusion buffer (default 64 KiB: on one host the copies cost more than
    /// the collectives they save). On a slow network between hosts the balance turns:
    /// 2 hosts × 1 rank at 1 Gbit/s, the ResNet-50 gradient set fused up to a 64 MiB
    /// threshold took 0.80× the time of the default. Fused tensors still respect
    /// [`Config::fusion_threshold_bytes`]. The autotuner tries this where the job
    /// spans hosts unless it is set. (`KOLO_FUSION_MAX_TENSOR_BYTES`)
    pub fn fusion_max_tensor_bytes(mut self, bytes: usize) -> Self {
        self.fusion_max_tensor = bytes;
        self.fusion_max_tensor_explicit = true;
        self
    }

    /// The pause between negotiation cycles while this rank has submitted its work and
    /// only waits for the other ranks; new local work starts a cycle at once. Also the
    /// longest an op submitted while the engine is idle waits for its own caller to run
    /// it (the caller's `wait` does, on its own thread) before the engine thread starts
    /// it. (`KOLO_CYCLE_TIME`, in ms; default 1)
    pub fn cycle_time(mut self, cycle_time: Duration) -> Self {
        self.cycle_time = cycle_time;
        self.cycle_time_explicit = true;
        self
    }

    /// Entries in the response cache; 0 disables it. (`KOLO_CACHE_CAPACITY`)
    pub fn cache_capacity(mut self, entries: usize) -> Self {
        self.cache_capacity = entries;
        self.cache_capacity_explicit = true;
        self
    }

    /// Writes a Chrome trace of the engine to `path`. (`KOLO_TIMELINE`)
    pub fn timeline(mut self, path: impl Into<PathBuf>) -> Self {
        self.timeline = Some(path.into());
        self
    }

    /// Adds a CYCLE_START mark per engine cycle to the timeline.
    /// (`KOLO_TIMELINE_MARK_CYCLES`)
    pub fn timeline_mark_cycles(mut self, on: bool) -> Self {
        self.timeline_mark_cycles = on;
        self
    }

    /// How long a tensor may wait for other ranks before a stall warning.
    /// (`KOLO_STALL_CHECK_TIME_SECONDS`)
    pub fn stall_check_time(mut self, time: Duration) -> Self {
        self.stall_check_time = time;
        self
    }

    /// How long a stall may last before pending ops fail; zero never fails them.
    /// (`KOLO_STALL_SHUTDOWN_TIME_SECONDS`)
    pub fn stall_shutdown_time(mut self, time: Duration) -> Self {
        self.stall_shutdown_time = time;
        self
    }

    /// How long an engine may make no progress at all (a negotiation exchange or a
    /// collective that never completes: a rank stopped, its host unreachable or
    /// partitioned away) before it aborts the whole job with a message naming this
    /// rank; zero never aborts. Default 300 s. (`KOLO_COLLECTIVE_TIMEOUT_SECONDS`)
    ///
    /// Engines exchange heartbeats every 100 ms even while the program computes, so
    /// only a stuck transport trips it; a single collective that legitimately takes
    /// longer (gigabytes over a slow link) needs a larger value.
    pub fn collective_timeout(mut self, timeout: Duration) -> Self {
        self.collective_timeout = timeout;
        self
    }

    /// How long [`init`](crate::init) waits for MPI to start on every rank (a host
    /// whose ranks never start, or cannot reach this one) before it fails naming this
    /// rank; zero waits for ever. Default: zero; `kolorun` sets 30 s for jobs across
    /// hosts (`--start-timeout`). (`KOLO_START_TIMEOUT`, in seconds, or Horovod's
    /// `HOROVOD_START_TIMEOUT`)
    ///
    /// MPI cannot be stopped half-started: after this error the process should exit.
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Allreduces in three steps across hosts: a reduce-scatter among the ranks of
    /// each host (shared memory), an allreduce of each shard among the ranks with the
    /// same local rank (one per host), an allgather within each host. Only the
    /// shards cross the network. Rank 0's choice holds for every rank; when hosts
    /// have different numbers of ranks kolo warns once and stays flat, and with one
    /// host or one rank per host there is nothing to gain, so it stays flat too.
    /// Left unset, the autotuner (when on) tries both where hierarchical can run.
    /// (`KOLO_HIERARCHICAL_ALLREDUCE`, or Horovod's `HOROVOD_HIERARCHICAL_ALLREDUCE`)
    pub fn hierarchical_allreduce(mut self, on: bool) -> Self {
        self.hierarchical_allreduce = on;
        self.hierarchical_allreduce_explicit = true;
        self
    }

    /// Where every rank is on its own host, reduces the large tensors of a cycle
    /// (those too large to fuse) through one ring together, one message per step for
    /// all of them, instead of one ring each: on a slow link each ring's start-up
    /// leaves the link idle, and together they stream like one pre-packed message
    /// (measured across 2 emulated hosts at 1 Gbit/s, ResNet-50 gradient set: 1.00× one
    /// pre-packed `MPI_Allreduce`, against 1.3× one ring each). The message is gathered
    /// from the tensors by MPI, which costs copies where the link is fast (10 Gbit/s
    /// there: 1.2–1.4× slower). Left unset, kolo times a ring across the hosts at
    /// start and groups below 2 Gbit/s; rank 0's choice holds.
    /// (`KOLO_GROUPED_RING`)
    pub fn grouped_ring(mut self, on: bool) -> Self {
        self.grouped_ring = Some(on);
        self
    }

    /// The hierarchical allreduce of a large sum in pieces of this many bytes, run
    /// as a pipeline: while one piece is summed across hosts, the next is reduced
    /// inside the host and the one before spread there, so that the host's links and
    /// the network work at once (as NCCL's channels overlap NVLink and the network).
    /// 0 runs the three phases one after another over the whole buffer. Left unset,
    /// kolo pipelines sums of 4 MiB or more across 8 or more hosts, and of 64 MiB
    /// or more across fewer, in pieces of 2 MiB, at most 64
    /// (`kolo-sim`'s DGX A100 preset at 4096 ranks: a 64 MiB sum 1.85× the α–β
    /// bound one phase after another, 1.13× in pieces; see the README's "kolo at
    /// thousands of ranks"); rank 0's choice holds. (`KOLO_HIERARCHICAL_PIECE_BYTES`)
    pub fn hierarchical_piece_bytes(mut self, bytes: usize) -> Self {
        self.hierarchical_piece_bytes = Some(bytes);
        self
    }

    /// How host sums that are not hierarchical travel (see
    /// [`AllreduceAlgorithm`](crate::AllreduceAlgorithm); `Auto` by default, which
    /// chooses by size and job). Rank 0's choice holds.
    /// (`KOLO_ALLREDUCE_ALGORITHM`: `auto`, `ring`, `halving-doubling` or `mpi`)
    pub fn allreduce_algorithm(mut self, algorithm: crate::AllreduceAlgorithm) -> Self {
        self.allreduce_algorithm = algorithm;
        self
    }

    /// Allgathers in three steps across hosts: an allgather within each host (shared
    /// memory), an allgather across hosts of one share of each host's block per
    /// local rank (each byte crosses the network once per receiving host, not once
    /// per receiving rank), an allgather of those shares within each host. The
    /// result is the same bytes in the same rank order as the flat allgather, also
    /// when ranks are placed round-robin. Agreed like
    /// [`hierarchical_allreduce`](Self::hierarchical_allreduce): rank 0's choice, flat
    /// with one warning on hosts with different numbers of ranks; left unset, the
    /// autotuner (when on) tries both. (`KOLO_HIERARCHICAL_ALLGATHER`, or Horovod's `HOROVOD_HIERARCHICAL_ALLGATHER`)
    pub fn hierarchical_allgather(mut self, on: bool) -> Self {
        self.hierarchical_allgather = on;
        self.hierarchical_allgather_explicit = true;
        self
    }

    /// Whether `init` tunes glibc's malloc for training (default on;
    /// `KOLO_MALLOC_TUNING=0` turns it off): blocks up to 32 MiB come from the heap
    /// instead of fresh `mmap`s, and the heap is not trimmed below 2 GiB, so the
    /// gradient, fusion and activation buffers a training step frees are reused by the
    /// next step instead of being handed back to the kernel and faulted in again page by
    /// page. It applies to the whole process (the framework's own allocations too);
    /// the cost is memory the process keeps after freeing it. No effect without glibc.
    pub fn malloc_tuning(mut self, on: bool) -> Self {
        self.malloc_tuning = on;
        self
    }

    /// Whether buffers kolo allocates from 4 MiB up (collective outputs, received
    /// tensors) are marked `MADV_HUGEPAGE` before their first write (default on;
    /// `KOLO_HUGE_PAGES=0` turns it off). Where transparent huge pages are enabled for
    /// `madvise` (Debian's and Ubuntu's default) they then fault in 2 MiB at a time
    /// instead of 4 KiB: a fresh 40 MiB allgather output took ~25 ms of page faults
    /// on our build machine, as long as its messages. With THP's `defrag` set to
    /// `madvise` a fault may compact memory first when free huge pages run out; turn
    /// it off if that shows as stalls. No effect where THP is `always`, `never` or
    /// absent.
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
        self
    }

    /// Turns the stall inspector off. (`KOLO_STALL_CHECK_DISABLE`)
    pub fn stall_check_disable(mut self, disable: bool) -> Self {
        self.stall_check_disable = disable;
        self
    }

    /// Rank 0 tunes, at run time, whichever of the fusion threshold, the cycle time,
    /// the response cache and hierarchical allreduce and allgather were not set
    /// explicitly
    /// (hierarchical only where it can run: several hosts, the same number of ranks
    /// on each, more than one). (`KOLO_AUTOTUNE`)
    pub fn autotune(mut self, on: bool) -> Self {
        self.autotune = on;
        self
    }

    /// Writes one CSV row per autotune sample to `path`. (`KOLO_AUTOTUNE_LOG`)
    pub fn autotune_log(mut self, path: impl Into<PathBuf>) -> Self {
        self.autotune_log = Some(path.into());
        self
    }

    /// Adds this delay to every collective kolo runs on CPU tensors, as a slow
    /// network would: for trying fusion and autotune settings on one machine (the
    /// autotuner's tests use it). (`KOLO_SIMULATED_COLLECTIVE_COST_US`, 0)
    pub fn simulated_collective_cost(mut self, cost: Duration) -> Self {
        self.simulated_collective_cost = cost;
        self
    }

    /// Autotune samples discarded at the start. (`KOLO_AUTOTUNE_WARMUP_SAMPLES`, 3)
    pub fn autotune_warmup_samples(mut self, n: usize) -> Self {
        self.autotune_warmup_samples = n;
        self
    }

    /// Cycles with allreduce work per autotune sample, at least 1 (0 makes
    /// [`init`](Self::init) fail, as the variable does).
    /// (`KOLO_AUTOTUNE_STEPS_PER_SAMPLE`, 10)
    pub fn autotune_steps_per_sample(mut self, n: usize) -> Self {
        if n == 0 {
            self.reject("Config::autotune_steps_per_sample", "0", POSITIVE);
        } else {
            self.autotune_steps_per_sample = n;
        }
        self
    }

    /// Configurations the autotuner tries before keeping the best, at least 1 (0
    /// makes [`init`](Self::init) fail, as the variable does).
    /// (`KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`, 20)
    pub fn autotune_max_samples(mut self, n: usize) -> Self {
        if n == 0 {
            self.reject("Config::autotune_max_samples", "0", POSITIVE);
        } else {
            self.autotune_max_samples = n;
        }
        self
    }

    /// Observation noise of the autotuner's Gaussian process, in units of the
    /// scores' spread; positive and finite (anything else makes [`init`](Self::init)
    /// fail, as the variable does). (`KOLO_AUTOTUNE_GAUSSIAN_PROCESS_NOISE`, 0.8)
    pub fn autotune_gaussian_process_noise(mut self, noise: f64) -> Self {
        if noise.is_finite() && noise > 0.0 {
            self.autotune_noise = noise;
        } else {
            self.reject(
                "Config::autotune_gaussian_process_noise",
                &noise.to_string(),
                POSITIVE_NUMBER,
            );
        }
        self
    }

    /// Keeps the first value a builder method refused, for `init` to report.
    fn reject(&mut self, method: &str, value: &str, reason: &str) {
        self.rejected
            .get_or_insert_with(|| (method.into(), value.into(), reason.into()));
    }

    /// The error [`init`](Self::init) reports for a value a builder method refused.
    ///
    /// # Errors
    /// [`Error::Config`] naming the method, the value and what is expected.
    pub(crate) fn validate(&self) -> Result<()> {
        match &self.rejected {
            Some((variable, value, reason)) => Err(Error::Config {
                variable: variable.clone(),
                value: value.clone(),
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Log level of the subscriber kolo installs when the application has none:
    /// trace, debug, info, warn (default), error or off. `RUST_LOG` wins when set.
    /// (`KOLO_LOG_LEVEL`)
    ///
    /// # Errors
    /// [`Error::Config`] for any other value.
    pub fn log_level(mut self, level: &str) -> Result<Self> {
        let l = level.trim().to_ascii_lowercase();
        if !LOG_LEVELS.contains(&l.as_str()) {
            return Err(Error::Config {
                variable: "Config::log_level".into(),
                value: level.into(),
                reason: format!("expected one of {}", LOG_LEVELS.join(", ")),
            });
        }
        self.log_level = Some(l);
        Ok(self)
    }

    /// The fusion threshold in bytes.
    pub fn get_fusion_threshold_bytes(&self) -> usize {
        self.fusion_threshold
    }

    /// The cycle time.
    pub fn get_cycle_time(&self) -> Duration {
        self.cycle_time
    }

    /// The response cache capacity.
    pub fn get_cache_capacity(&self) -> usize {
        self.cache_capacity
    }
}

#[cfg(test)]
mod tests;
