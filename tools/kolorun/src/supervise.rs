//! Running mpirun: its stderr passed through, an aborted job that does not end
//! ended.

use std::process::Command;

/// How long mpirun gets to end the job once it has been aborted.
/// (A normal abort ends in 1–3 s; the bound the collective timeout promises is the
/// timeout plus 10 s, of which detection takes up to a quarter of the timeout.)
pub(crate) const ABORT_GRACE: std::time::Duration = std::time::Duration::from_secs(8);

/// Whether a line of the job's stderr says the job is being aborted (by a kolo rank,
/// by MPI_Abort, or by mpirun after a rank failed).
pub(crate) fn aborting(line: &str) -> bool {
    line.contains("aborting the whole job")
        || line.contains("MPI_ABORT was invoked")
        || line.contains("the job has been aborted")
}

/// Runs mpirun, passing its stderr through, and returns its exit code. Once the job
/// is being aborted, mpirun waits for every host's daemon to confirm; a host that is
/// unreachable (a partition) never does, and mpirun would wait for ever: after
/// `grace` kolorun ends it and says so.
pub(crate) fn supervise(mut cmd: Command, grace: std::time::Duration) -> std::io::Result<i32> {
    use std::io::{BufRead, Write};
    use std::sync::{Arc, Mutex};
    use std::time::Instant;
    let mut child = cmd.stderr(std::process::Stdio::piped()).spawn()?;
    let aborted_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    if let Some(stderr) = child.stderr.take() {
        let aborted_at = aborted_at.clone();
        std::thread::spawn(move || {
            let mut out = std::io::stderr();
            for line in std::io::BufReader::new(stderr).split(b'\n') {
                let Ok(line) = line else { break };
                let _ = out.write_all(&line);
                let _ = out.write_all(b"\n");
                if aborting(&String::from_utf8_lossy(&line)) {
                    let mut at = aborted_at.lock().unwrap_or_else(|p| p.into_inner());
                    at.get_or_insert_with(Instant::now);
                }
            }
        });
    }
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status.code().unwrap_or(1));
        }
        let since = *aborted_at.lock().unwrap_or_else(|p| p.into_inner());
        if since.is_some_and(|at| at.elapsed() > grace) {
            eprintln!(
                "kolorun: mpirun has not ended the job {} s after it was aborted: a host's \
                 daemon does not answer (unreachable or partitioned away); ending mpirun. \
                 Processes may be left on that host.",
                grace.as_secs()
            );
            let _ = child.kill();
            let _ = child.wait();
            return Ok(1);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aborted_job_that_does_not_end_is_ended() {
        assert!(aborting(
            "[1,0]<stderr>:kolo: rank 0: its engine ... aborting the whole job"
        ));
        assert!(aborting(
            "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD"
        ));
        assert!(!aborting("[1,0]<stderr>:epoch 3 loss 0.2"));
        let short = std::time::Duration::from_millis(300);
        // An mpirun stand-in that reports an abort and then hangs is ended.
        let mut hang = Command::new("sh");
        hang.args([
            "-c",
            "echo 'MPI_ABORT was invoked on rank 0' >&2; exec sleep 30",
        ]);
        let start = std::time::Instant::now();
        assert_eq!(supervise(hang, short).unwrap(), 1);
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        // Exit codes pass through; a job that only prints is left alone.
        let mut ok = Command::new("sh");
        ok.args(["-c", "echo working >&2; sleep 0.5; exit 3"]);
        assert_eq!(supervise(ok, short).unwrap(), 3);
    }
}
