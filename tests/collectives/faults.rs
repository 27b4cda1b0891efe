//! Cases that must end the whole job: the harness checks the exit status, the time it
//! took and the message (see `FAULTS` in main.rs).

use std::time::Duration;

use anyhow::Result;
use kolo::{DType, Kolo, ReduceOp, Tensor};

/// The last rank panics on a helper thread while its main thread is busy and the other
/// ranks wait for it in a collective.
pub(crate) fn panic_on_thread(k: &Kolo) -> Result<()> {
    if k.rank() == k.size() - 1 {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            panic!("injected fault on a helper thread");
        });
        std::thread::sleep(Duration::from_secs(60));
        return Ok(());
    }
    k.allreduce("never", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    Ok(())
}

/// The last rank's engine thread panics (injected, `KOLO_FAULT_ENGINE_PANIC_RANK` set
/// by the harness) while the other ranks wait for it in a collective.
#[cfg(feature = "fault-injection")]
pub(crate) fn engine_panic(k: &Kolo) -> Result<()> {
    if k.rank() == k.size() - 1 {
        std::thread::sleep(Duration::from_secs(60));
        return Ok(());
    }
    k.allreduce("never", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    Ok(())
}

/// The last rank shuts down with a 1 s bound while rank 0 never does: past the bound
/// the job is aborted, naming the rank that gave up.
pub(crate) fn shutdown_timeout(k: &Kolo) -> Result<()> {
    if k.rank() == k.size() - 1 {
        k.shutdown_timeout(Duration::from_secs(1))?;
        anyhow::bail!("shutdown_timeout returned although rank 0 never shut down");
    }
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}

/// The last rank panics on its main thread before a collective the others wait in.
pub(crate) fn panic_before_collective(k: &Kolo) -> Result<()> {
    if k.rank() == k.size() - 1 {
        panic!("injected fault before the collective");
    }
    k.allreduce("never", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    Ok(())
}

/// Rank 0 submits a tensor the last rank never submits. With a 1 s stall check and a
/// 3 s stall shutdown time (set by the harness), every rank logs a warning naming the
/// missing rank, then rank 0's op fails with the report, and every rank stops cleanly.
pub(crate) fn stall_shutdown(k: &Kolo) -> Result<()> {
    let last = k.size() - 1;
    let start = std::time::Instant::now();
    if k.rank() == 0 {
        let err = k
            .allreduce("stalled.x", Tensor::zeros(DType::F32, &[4]))
            .wait();
        let msg = match err {
            Ok(_) => anyhow::bail!("the stalled op succeeded"),
            Err(e) => e.to_string(),
        };
        anyhow::ensure!(
            msg.contains(&format!(
                "\"stalled.x\" is missing from ranks [{}]",
                (1..=last)
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            "{msg}"
        );
        let waited = start.elapsed();
        anyhow::ensure!(
            waited >= Duration::from_secs(3) && waited < Duration::from_secs(8),
            "failed after {waited:?}"
        );
    } else {
        std::thread::sleep(Duration::from_secs(5));
    }
    // After the stall abort the engine no longer communicates: later ops fail at once.
    let later = k
        .allreduce("after.stall", Tensor::zeros(DType::F32, &[1]))
        .wait();
    anyhow::ensure!(later.is_err(), "an op after the stall abort succeeded");
    Ok(())
}

/// The last rank returns from main early (dropping kolo) while the others still submit:
/// their ops fail naming it, and the job ends with a non-zero status.
pub(crate) fn early_exit(k: &Kolo) -> Result<()> {
    if k.rank() == k.size() - 1 {
        return Ok(());
    }
    k.allreduce("after.exit", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    Ok(())
}

/// The last rank stops (SIGSTOP: no exit, no error, no reset; what a partitioned or
/// frozen host looks like) while the others wait in a collective: with
/// `KOLO_COLLECTIVE_TIMEOUT_SECONDS=2` the others' watchdogs end the job, naming their
/// rank and the rank whose part of the cycle agreement never came (the stopped rank,
/// for its partners in the agreement).
pub(crate) fn sigstop(k: &Kolo) -> Result<()> {
    last_rank_signalled(k, libc::SIGSTOP)
}

/// The last rank is killed with SIGKILL while the others wait in a collective: mpirun
/// must end the job (no hang, no orphans).
pub(crate) fn sigkill(k: &Kolo) -> Result<()> {
    last_rank_signalled(k, libc::SIGKILL)
}

/// Issue 37: on the first attempt the last rank (on h2) is killed while the others
/// wait in an allreduce; kolorun (`--max-restarts 1 --min-np 2`) leaves h2 out and
/// relaunches on h1's two ranks, which finish (and say so).
pub(crate) fn elastic(k: &Kolo) -> Result<()> {
    let attempt: u32 = std::env::var("KOLO_RESTART_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if attempt == 0 && k.rank() == k.size() - 1 {
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: killing our own process.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let t = k
        .allreduce("elastic", Tensor::from_vec(vec![1.0f32], &[1])?)
        .op(ReduceOp::Sum)
        .wait()?;
    let sum = t.as_slice::<f32>()?[0];
    anyhow::ensure!(
        attempt == 1 && k.size() == 2 && sum == 2.0,
        "attempt {attempt} finished on {} ranks (sum {sum})",
        k.size()
    );
    println!("elastic: attempt {attempt} finished on {} ranks", k.size());
    Ok(())
}

/// Issue 36: the last rank is killed while rank 0 waits to receive from it and the
/// others wait in a barrier: the job ends (no hang), mpirun naming the rank.
pub(crate) fn p2p_dead_sender(k: &Kolo) -> Result<()> {
    while_last_rank_killed(k, |last| k.recv("never.sent", last).wait().map(drop))
}

/// The last rank is killed while rank 0 waits in a blocking 16 MiB send to it (which
/// cannot complete without its receiver: it waits in the engine after its first poll)
/// and the others wait in a barrier: the job ends (no hang), mpirun naming the rank.
pub(crate) fn p2p_dead_receiver(k: &Kolo) -> Result<()> {
    while_last_rank_killed(k, |last| {
        let big = Tensor::zeros(DType::U8, &[16 << 20]);
        k.send("never.received", big, last).wait()
    })
}

/// The last rank kills itself after 300 ms while rank 0 runs `pair` with it (given
/// the last rank) and the others wait in a barrier.
fn while_last_rank_killed(k: &Kolo, pair: impl FnOnce(usize) -> kolo::Result<()>) -> Result<()> {
    last_rank_signals_itself(k, libc::SIGKILL);
    if k.rank() == 0 {
        pair(k.size() - 1)?;
    } else {
        k.barrier()?;
    }
    Ok(())
}

/// On the last rank: sleeps 300 ms, then sends itself `signal`.
fn last_rank_signals_itself(k: &Kolo, signal: libc::c_int) {
    if k.rank() == k.size() - 1 {
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: signalling our own process.
        unsafe { libc::kill(libc::getpid(), signal) };
    }
}

/// The last rank sends itself `signal` after 300 ms; every rank then waits in an
/// allreduce the last rank never reaches.
fn last_rank_signalled(k: &Kolo, signal: libc::c_int) -> Result<()> {
    last_rank_signals_itself(k, signal);
    k.allreduce("never", Tensor::zeros(DType::F32, &[4]))
        .wait()?;
    Ok(())
}

/// Every rank allreduces a small tensor every 20 ms for up to 60 s: the job the
/// multi-host partition test cuts in two (the harness takes h2's link down).
pub(crate) fn partition(k: &Kolo) -> Result<()> {
    let start = std::time::Instant::now();
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(60) {
        k.allreduce(format!("step.{}", i % 8), Tensor::zeros(DType::F32, &[256]))
            .wait()?;
        std::thread::sleep(Duration::from_millis(20));
        i += 1;
    }
    Ok(())
}

/// Never reached on the ranks that fail: with `KOLO_START_TIMEOUT=2` (set by the
/// harness) their `init` gives up on the last rank, which starts 8 s late.
pub(crate) fn late_start(_: &Kolo) -> Result<()> {
    Ok(())
}
