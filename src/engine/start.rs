//! Starting an engine: MPI brought up on the engine thread, the start-up agreement
//! (settings every rank must share), the engine built around them, and its thread
//! served until shutdown (or aborted on a panic).

use super::*;

/// Entry point of the `kolo-engine` thread: starts MPI, reports the topology (or the
/// start-up error) through `started`, serves requests until shutdown, then finalises
/// MPI by dropping the transport.
pub(crate) fn run(
    config: Config,
    queue: Arc<Queue>,
    driver: Arc<Driver>,
    started: SyncSender<Result<Topology>>,
    autotune: Arc<Mutex<AutotuneState>>,
    turns: Option<turn::TakeTurn>,
    connect: impl FnOnce() -> Result<Box<dyn Transport>>,
) {
    // Declared first, dropped last: after the engine's own pending requests.
    let _abandon = Abandon(queue.clone());
    let (transport, agreed, hierarchy) = match connect_and_agree(&config, connect) {
        Ok(up) => up,
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    let topology = transport.topology();
    publish_start(&autotune, &config, &agreed, &hierarchy);
    if started.send(Ok(topology)).is_err() {
        return;
    }
    let mut engine = Engine::new(
        config,
        queue.clone(),
        transport,
        agreed,
        &hierarchy,
        autotune,
    );
    engine.exec.turns = turns;
    engine.open_configured_timeline();
    serve_or_abort(engine, &driver);
    tracing::debug!(rank = topology.rank, "engine stopped; finalising MPI");
}

/// Connects the transport and agrees on the start-up settings with the other ranks.
fn connect_and_agree(
    config: &Config,
    connect: impl FnOnce() -> Result<Box<dyn Transport>>,
) -> Result<(Box<dyn Transport>, Agreed, HierarchyChoice)> {
    let mut transport = connect()?;
    let (agreed, hierarchy) = agree(&mut *transport, config)?;
    Ok((transport, agreed, hierarchy))
}

/// The settings the engine starts with (the autotuner's first point).
fn start_settings(config: &Config, agreed: &Agreed, hierarchy: &HierarchyChoice) -> Settings {
    Settings {
        fusion_threshold: agreed.fusion_threshold,
        fusion_max_tensor: agreed.fusion_max_tensor,
        cycle_time_us: u64::try_from(config.cycle_time.as_micros()).unwrap_or(u64::MAX),
        cache: agreed.cache_capacity > 0,
        hierarchical: hierarchy.on,
        hierarchical_allgather: hierarchy.allgather_on,
        last: false,
    }
}

/// Makes the start-up settings what `Kolo::autotune_state` reports.
fn publish_start(
    autotune: &Mutex<AutotuneState>,
    config: &Config,
    agreed: &Agreed,
    hierarchy: &HierarchyChoice,
) {
    let mut state = autotune.lock().unwrap_or_else(PoisonError::into_inner);
    *state = AutotuneState {
        enabled: agreed.autotune,
        finished: false,
        fusion_threshold: agreed.fusion_threshold,
        fusion_max_tensor: agreed.fusion_max_tensor,
        cycle_time: config.cycle_time,
        cache_enabled: agreed.cache_capacity > 0,
        hierarchical_allreduce: hierarchy.on,
        hierarchical_allgather: hierarchy.allgather_on,
        changes: Vec::new(),
    };
}

impl Engine {
    /// The engine of a started transport, with its tuner (rank 0, when autotuning)
    /// and its watchdog.
    fn new(
        config: Config,
        queue: Arc<Queue>,
        mut transport: Box<dyn Transport>,
        agreed: Agreed,
        hierarchy: &HierarchyChoice,
        autotune: Arc<Mutex<AutotuneState>>,
    ) -> Engine {
        let port = transport.p2p_port();
        let topology = transport.topology();
        let tuner = (agreed.autotune && topology.rank == 0)
            .then(|| {
                Tuner::new(
                    &config,
                    start_settings(&config, &agreed, hierarchy),
                    hierarchy.possible,
                    topology.cross_size > 1,
                )
            })
            .flatten();
        let mark_cycles = config.timeline_mark_cycles;
        let config_timeout = config.collective_timeout;
        let simulated_cost = config.simulated_collective_cost;
        let awaited = transport.awaited();
        let device_local_rank = device_local_rank(&config, &topology);
        #[allow(unused_mut)]
        let mut engine = Engine {
            inbox: Inbox::new(queue, topology.rank),
            transport,
            control: Control::new(&config, topology, agreed),
            config,
            exec: Executor::new(topology.rank, mark_cycles, simulated_cost),
            tuning: Tuning {
                cache_capacity_on: tuner
                    .as_ref()
                    .map_or(agreed.cache_capacity, Tuner::cache_capacity_on)
                    .max(agreed.cache_capacity),
                tuner,
                pending: None,
                state: autotune,
            },
            cycles: 0,
            progress: watchdog::start(
                config_timeout,
                topology.rank,
                format!(
                    "its engine ({})",
                    std::thread::current().name().unwrap_or("kolo-engine")
                ),
                awaited,
            ),
            p2p: super::p2p::P2pLane::new(port, topology.rank, device_local_rank),
            last_cycle: Instant::now(),
            heartbeat_handed_back: false,
            #[cfg(feature = "fault-injection")]
            fault_panic: std::env::var("KOLO_FAULT_ENGINE_PANIC_RANK")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                == Some(topology.rank),
        };
        engine.exec.gpu.set_timeout(config_timeout);
        engine
    }

    /// Starts the timeline `KOLO_TIMELINE` names, if any (a warning when it cannot).
    fn open_configured_timeline(&mut self) {
        let rank = self.inbox.rank;
        let path = self
            .config
            .timeline
            .as_deref()
            .and_then(|p| timeline::path_for_rank(p, rank));
        if let Some(path) = path {
            if let Err(e) = self.exec.timeline.start(&path) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the timeline; continuing without it");
            }
        }
    }
}

/// Serves until shutdown (the engine's cycles run here, or on a caller's thread that
/// drives it: `Driver`). A panic on this thread must not unwind into MPI_Finalize
/// (dropping the transport), which waits for the other ranks while they wait for this
/// one in the cycle exchange: the job is aborted instead. The panic hook has already
/// printed the rank, the thread and the message.
fn serve_or_abort(engine: Engine, driver: &Driver) {
    let rank = engine.inbox.rank;
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driver.serve(engine)));
    match served {
        Ok(engine) => {
            if let Some(p) = &engine.progress {
                p.stop();
            }
            // Dropped here, on the thread that initialised MPI: it finalises it.
            drop(engine);
        }
        Err(_) => {
            let line =
                format!("kolo: rank {rank}: the engine thread panicked; aborting the whole job\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            if let Some(mut engine) = driver.take_after_panic() {
                if let Some(p) = &engine.progress {
                    p.stop();
                }
                engine.transport.abort(1);
            }
        }
    }
}

/// The local rank that picks the CUDA device a received tensor lands on: the job's
/// (as `Kolo::cuda_device`), also on a process set's engine, whose own topology
/// numbers the ranks within the set (issue 53 item 22).
fn device_local_rank(config: &Config, topology: &Topology) -> usize {
    config.job_local_rank.unwrap_or(topology.local_rank)
}

/// Closes the queue when the engine thread ends, also by a panic: later submits then
/// fail at once and queued ones fail their handles, rather than wait forever.
struct Abandon(Arc<Queue>);

impl Drop for Abandon {
    fn drop(&mut self) {
        self.0.abandon();
    }
}
