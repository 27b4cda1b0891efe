//! Launches a worker case under a real `mpirun -np N`, with a timeout, and reports its
//! output only when it fails.

use std::io::Read;
use std::process::{Command, Stdio};
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
    let kolo = match kolo::init() {
        Ok(k) => k,
        Err(e) => {
            eprintln!("init failed: {e}");
            std::process::exit(3);
        }
    };
    let rank = kolo.rank();
    let result = f(&kolo);
    // Shut down before exiting so that mpirun sees a clean finish on this rank and
    // the other ranks get an error naming it rather than a hang.
    let shutdown = kolo.shutdown();
    let result = match (result, shutdown) {
        (Ok(()), Err(e)) => Err(anyhow::anyhow!("shutdown failed: {e}")),
        (result, _) => result,
    };
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("rank {rank}: case {case} failed: {e:#}");
            std::process::exit(1);
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
        let run = mpirun(case, np, timeout, env)?;
        if run.success {
            Ok(())
        } else {
            Err(format!(
                "case {case} failed at np={np} after {:?}\n{}",
                run.elapsed, run.output
            )
            .into())
        }
    })
}

/// What a finished launch produced.
pub(crate) struct Run {
    pub(crate) success: bool,
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
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the test binary: {e}"))?;
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &np.to_string(), "--bind-to", "none", "--tag-output"])
        .arg(&exe)
        .env("KOLO_TEST_CASE", case)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    mpi_env(&mut cmd);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| {
        format!("cannot run mpirun ({e}); run the README's test command, which installs OpenMPI")
    })?;
    let mut stdout = child.stdout.take().ok_or("no stdout")?;
    let mut stderr = child.stderr.take().ok_or("no stderr")?;
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
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
    let output = format!(
        "--- stdout ---\n{}\n--- stderr ---\n{}",
        out_reader.join().unwrap_or_default(),
        err_reader.join().unwrap_or_default()
    );
    match status {
        Some(s) => Ok(Run {
            success: s.success(),
            elapsed,
            output,
        }),
        None => Err(format!(
            "case {case} at np={np} timed out after {timeout:?} (a hang)\n{output}"
        )),
    }
}
