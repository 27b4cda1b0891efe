//! Launches a worker case under a real `mpirun -np N`, with a timeout, and reports its
//! output only when it fails.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The environment every launch gets: OpenMPI as root, oversubscription on our two
/// cores, traffic kept on this machine.
pub(crate) fn mpi_env(cmd: &mut Command) {
    for (k, v) in [
        ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
        ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
        ("OMPI_MCA_btl", "self,vader"),
        ("OMPI_MCA_oob_tcp_if_include", "lo"),
        ("OMPI_MCA_mpi_yield_when_idle", "1"),
    ] {
        if std::env::var_os(k).is_none() {
            cmd.env(k, v);
        }
    }
}

/// Worker side: runs `case` (found in `cases`) on this rank between `kolo::init` and
/// `shutdown`, and exits 0 on success, 1 on failure (printing the error), 2 for an
/// unknown case, 3 if kolo cannot start.
/// A worker case: runs on every rank and checks its own results.
pub(crate) type Case = fn(&kolo::Kolo) -> anyhow::Result<()>;

pub(crate) fn run_worker(case: &str, cases: &[(&str, Case)]) -> ! {
    let Some((_, f)) = cases.iter().find(|(n, _)| *n == case) else {
        eprintln!("unknown case {case}");
        std::process::exit(2);
    };
    // The late_start fault: the last rank starts MPI 8 s after the others.
    if case == "late_start" {
        let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
        if let (Some(rank), Some(size)) = (var("OMPI_COMM_WORLD_RANK"), var("OMPI_COMM_WORLD_SIZE"))
        {
            if rank + 1 == size {
                std::thread::sleep(std::time::Duration::from_secs(8));
            }
        }
    }
    let kolo = match kolo::init() {
        Ok(k) => k,
        Err(e) => {
            eprintln!("init failed: {e}");
            std::process::exit(3);
        }
    };
    let rank = kolo.rank();
    let result = f(&kolo);
    // Say why before shutting down: the shutdown tells the other ranks, one of them
    // may exit with an error at once, and mpirun then kills this rank mid-sentence.
    if let Err(e) = &result {
        eprintln!("rank {rank}: case {case} failed: {e:#}");
    }
    // Shut down before exiting so that mpirun sees a clean finish on this rank and
    // the other ranks get an error naming it rather than a hang.
    let shutdown = kolo.shutdown();
    let result = match (result, shutdown) {
        (Ok(()), Err(e)) => {
            eprintln!("rank {rank}: case {case} failed: shutdown failed: {e}");
            Err(anyhow::anyhow!("shutdown failed: {e}"))
        }
        (result, _) => result,
    };
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            // As a program should: a job failure (a rank left) exits with kolo's
            // restartable status, anything else with 1.
            let code = e
                .chain()
                .find_map(|c| c.downcast_ref::<kolo::Error>())
                .map_or(1, kolo::Error::exit_code);
            std::process::exit(code);
        }
    }
}

/// A test that runs `case` under `mpirun -np np` with `env` and passes when every
/// rank succeeds within `timeout`.
pub(crate) fn trial(
    case: &'static str,
    np: usize,
    timeout: Duration,
    env: &'static [(&'static str, &'static str)],
) -> libtest_mimic::Trial {
    libtest_mimic::Trial::test(format!("{case}/np{np}"), move || {
        Ok(mpirun(case, np, timeout, env)?.succeeded(&format!("case {case} at np={np}"))?)
    })
}

/// The GPU cases' trials (case, function, np values). With `KOLO_TEST_GPU=1` each runs
/// at the np values this machine has a GPU per rank for: NCCL refuses two ranks on one
/// device, so a case needing more GPUs is left out (`--include-ignored` cannot force
/// it), unless its ranks may `share` a device (no NCCL communicator); a machine where
/// no CUDA device can be used ends the run with an error rather than passing with none
/// run. Elsewhere every case is listed, ignored, so the count shows.
pub(crate) fn gpu_trials(
    cases: &'static [(&'static str, Case, &'static [usize])],
    timeout: Duration,
    env: &'static [(&'static str, &'static str)],
    share: bool,
) -> Vec<libtest_mimic::Trial> {
    let gpu_machine = std::env::var_os("KOLO_TEST_GPU").is_some_and(|v| v == "1");
    let gpus = if gpu_machine {
        match kolo::cuda_device_count() {
            Ok(n) if n > 0 => n,
            other => {
                eprintln!("KOLO_TEST_GPU=1, but no CUDA device can be used: {other:?}");
                std::process::exit(1);
            }
        }
    } else {
        usize::MAX
    };
    let mut trials = Vec::new();
    for &(name, _, nps) in cases {
        for &np in nps
            .iter()
            .filter(|&&np| !gpu_machine || share || np <= gpus)
        {
            trials.push(trial(name, np, timeout, env).with_ignored_flag(!gpu_machine));
        }
    }
    trials
}

impl Run {
    /// Ok when every rank succeeded; otherwise the error names `what`, the time taken
    /// and the output.
    pub(crate) fn succeeded(&self, what: &str) -> Result<(), String> {
        if self.success {
            return Ok(());
        }
        Err(format!(
            "{what} failed after {:?}\n{}",
            self.elapsed, self.output
        ))
    }
}

/// Reads `pipe` to its end on a thread, into a buffer readable at any time.
fn collect(
    mut pipe: impl Read + Send + 'static,
) -> (std::thread::JoinHandle<()>, Arc<Mutex<Vec<u8>>>) {
    let buf: Arc<Mutex<Vec<u8>>> = Arc::default();
    let filled = buf.clone();
    let reader = std::thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        while let Ok(n @ 1..) = pipe.read(&mut chunk) {
            filled
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(&chunk[..n]);
        }
    });
    (reader, buf)
}

/// What a finished launch produced.
pub(crate) struct Run {
    pub(crate) success: bool,
    /// mpirun's exit status (None: ended by a signal). Read by the core's fault tests;
    /// the integrations' tests include this file too.
    #[allow(dead_code)]
    pub(crate) code: Option<i32>,
    pub(crate) elapsed: Duration,
    pub(crate) output: String,
}

/// Runs `mpirun -np <np> <this test binary>` with `KOLO_TEST_CASE=<case>`; kills the
/// whole process group after `timeout`.
pub(crate) fn mpirun(
    case: &str,
    np: usize,
    timeout: Duration,
    extra_env: &[(&str, &str)],
) -> Result<Run, String> {
    let mut tries = 0;
    loop {
        let mut cmd = Command::new("mpirun");
        cmd.args(["-np", &np.to_string(), "--bind-to", "none", "--tag-output"]);
        mpi_env(&mut cmd);
        let run = launch(cmd, case, timeout, extra_env, false)?;
        // Open MPI's own start-up failing before any rank ran (seen under load with
        // several mpiruns starting at once: "orte_session_dir failed" inside
        // orte_init) says nothing about kolo: launched again, at most twice, saying so.
        tries += 1;
        if run.success || tries > 2 || !never_started(&run.output) {
            return Ok(run);
        }
        eprintln!("case {case}: Open MPI failed to start (orte_init); launching it again");
    }
}

/// Whether mpirun's output shows Open MPI failing to start the job itself (a process
/// whose `orte_init` failed never reached the program).
fn never_started(output: &str) -> bool {
    output.contains("orte_init failed")
}

/// The emulated hosts' scripts (`scripts/multinode`), when the multi-host stage of
/// the README's test command has set them up (`KOLO_MULTINODE=1`).
pub(crate) fn multinode() -> Option<std::path::PathBuf> {
    if std::env::var_os("KOLO_MULTINODE")? != "1" {
        return None;
    }
    multinode_scripts()
}

/// Where the emulated hosts' scripts are, set up or not.
pub(crate) fn multinode_scripts() -> Option<std::path::PathBuf> {
    // The repository root holds scripts/; this file is also built into kolo-burn's tests.
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("scripts/multinode"))
        .find(|d| d.is_dir())
}

/// Runs the case on 2 emulated hosts × 2 ranks (`scripts/multinode/mpirun.sh`). Remote
/// ranks start from a bare environment, so every variable goes with `-x`.
pub(crate) fn mpirun_hosts(
    case: &str,
    timeout: Duration,
    extra_env: &[(&str, &str)],
) -> Result<Run, String> {
    mpirun_hosts_args(case, &["-np", "4"], timeout, extra_env)
}

/// [`mpirun_hosts`] with these mpirun arguments (e.g. `-np 3`, filling h1's 2 slots
/// first, or `-np 4 --map-by node`, which places ranks round-robin: 0 and 2 on h1, 1
/// and 3 on h2).
pub(crate) fn mpirun_hosts_args(
    case: &str,
    args: &[&str],
    timeout: Duration,
    extra_env: &[(&str, &str)],
) -> Result<Run, String> {
    let dir = multinode().ok_or("KOLO_MULTINODE is not set: the emulated hosts are not up")?;
    let mut cmd = Command::new(dir.join("mpirun.sh"));
    cmd.args(args).arg("--tag-output");
    launch(cmd, case, timeout, extra_env, true)
}

/// Runs the case on 2 emulated hosts × 2 ranks the way a user would: `kolorun -H
/// h1:2,h2:2 --network-interface eth0` started on h1, which forwards the environment.
pub(crate) fn kolorun_hosts(
    case: &str,
    timeout: Duration,
    extra_env: &[(&str, &str)],
) -> Result<Run, String> {
    kolorun_hosts_with(case, timeout, extra_env, &[])
}

/// [`kolorun_hosts`] with more kolorun flags (`--max-restarts 1`, …).
pub(crate) fn kolorun_hosts_with(
    case: &str,
    timeout: Duration,
    extra_env: &[(&str, &str)],
    flags: &[&str],
) -> Result<Run, String> {
    let dir = multinode().ok_or("KOLO_MULTINODE is not set: the emulated hosts are not up")?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // target/release/deps/collectives-… → target/release/kolorun
    let kolorun = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("kolorun"))
        .filter(|k| k.exists())
        .ok_or("target/release/kolorun is missing: cargo build --release -p kolorun")?;
    let agent = dir.join("agent.sh");
    let mut cmd = Command::new(dir.join("on-h1.sh"));
    cmd.arg(kolorun)
        .args(["-np", "4", "-H", "h1:2,h2:2", "--network-interface", "eth0"])
        .args(flags)
        .arg("--mpi-args")
        .arg(format!(
            "--mca plm_rsh_agent {} --mca mpi_yield_when_idle 1 --mca mpi_event_tick_rate 1",
            agent.display()
        ));
    launch(cmd, case, timeout, extra_env, false)
}

/// Runs `cmd` (an mpirun line without the program) on this test binary with
/// `KOLO_TEST_CASE=<case>` and `extra_env`, forwarded with `-x` when `forward`; kills
/// the whole process group after `timeout`.
pub(crate) fn launch(
    mut cmd: Command,
    case: &str,
    timeout: Duration,
    extra_env: &[(&str, &str)],
    forward: bool,
) -> Result<Run, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the test binary: {e}"))?;
    let env = [("KOLO_TEST_CASE", case), ("RUST_BACKTRACE", "1")];
    for (k, v) in env.iter().chain(extra_env) {
        cmd.env(k, v);
        if forward {
            cmd.args(["-x", k]);
        }
    }
    cmd.arg(&exe)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| {
        format!("cannot run mpirun ({e}); run the README's test command, which installs OpenMPI")
    })?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let stderr = child.stderr.take().ok_or("no stderr")?;
    let (out_reader, out) = collect(stdout);
    let (err_reader, err) = collect(stderr);
    let pgid = child.id() as i32;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(status);
        }
        if start.elapsed() > timeout {
            // SAFETY: signalling the process group we created for mpirun.
            unsafe { libc::killpg(pgid, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(2));
            // SAFETY: as above.
            unsafe { libc::killpg(pgid, libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    // A process left on an unreachable emulated host may hold the pipes open: take
    // what came within 5 s rather than wait for ever.
    let waited = Instant::now();
    while !(out_reader.is_finished() && err_reader.is_finished())
        && waited.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = |b: &Arc<Mutex<Vec<u8>>>| {
        String::from_utf8_lossy(&b.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    };
    let output = format!(
        "--- stdout ---\n{}\n--- stderr ---\n{}",
        text(&out),
        text(&err)
    );
    match status {
        Some(s) => Ok(Run {
            success: s.success(),
            code: s.code(),
            elapsed,
            output,
        }),
        None => Err(format!(
            "case {case} timed out after {timeout:?} (a hang)\n{output}"
        )),
    }
}
