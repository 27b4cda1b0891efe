//! Running mpirun: its stderr passed through, an aborted job that does not end
//! ended.

use std::io::{BufRead, Write};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long mpirun gets to end the job once it has been aborted.
/// (A normal abort ends in 1–3 s; the bound the collective timeout promises is the
/// timeout plus 10 s, of which detection takes up to a quarter of the timeout.)
pub(crate) const ABORT_GRACE: Duration = Duration::from_secs(8);

/// Whether a line of the job's stderr says the job is being aborted (by a kolo rank,
/// by MPI_Abort, or by mpirun after a rank failed).
pub(crate) fn aborting(line: &str) -> bool {
    line.contains("aborting the whole job")
        || line.contains("MPI_ABORT was invoked")
        || line.contains("the job has been aborted")
}

/// How long kolorun waits, after mpirun has ended, for the last of the job's stderr
/// to be passed through (usually the failing rank's message). Only a process that
/// outlives mpirun and keeps the pipe open makes this wait run out.
const STDERR_DRAIN: Duration = Duration::from_secs(5);

/// The last of SIGINT, SIGTERM and SIGHUP kolorun was sent and has not yet passed on
/// to mpirun; 0 for none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn note_signal(signal: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// Catches SIGINT, SIGTERM and SIGHUP from here on: [`supervise_job`] passes each to
/// mpirun (which ends the ranks and prints its last messages) instead of kolorun
/// dying and leaving mpirun and the ranks behind. Call it before [`supervise_job`].
pub(crate) fn catch_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is valid (no flags, empty mask); the handler
        // only stores to an atomic, which is async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = note_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The exit code a shell would report for `status`: its code, or 128 + the signal
/// that ended it.
fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// Ends mpirun and what it started on this machine with SIGKILL: its children (the
/// ranks, each of which Open MPI makes the leader of its own process group, and the
/// agents reaching other hosts) by process group, then mpirun itself.
fn kill_job(child: &mut Child) {
    let pid = child.id() as i32;
    for (child_pid, group) in children_of(pid) {
        // SAFETY: plain kill(2) calls on processes mpirun started; a group is only
        // signalled when the child leads it, so never kolorun's own group.
        unsafe {
            if group == child_pid {
                libc::killpg(group, libc::SIGKILL);
            } else {
                libc::kill(child_pid, libc::SIGKILL);
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `(pid, process group)` of each process whose parent is `parent`, from /proc.
fn children_of(parent: i32) -> Vec<(i32, i32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // After the command name in parentheses: state, parent, process group.
        let mut fields = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().skip(1);
        let ppid: i32 = fields.next()?.parse().ok()?;
        let group: i32 = fields.next()?.parse().ok()?;
        (ppid == parent).then_some((pid, group))
    })
    .collect()
}

/// How a job ended: [`supervise_job`]'s exit code, whether kolorun passed a signal on
/// (the user ended it: no relaunch), and the job's first lines that say which rank
/// failed and why.
#[derive(Debug, Default)]
pub(crate) struct Ended {
    pub(crate) code: i32,
    pub(crate) signalled: bool,
    pub(crate) cause: Vec<String>,
    /// Every line of kolo's watchdog ("kolo: rank R: … has made no progress …"): which
    /// ranks still reported, and whom they waited for.
    pub(crate) watchdog: Vec<String>,
}

/// Whether a line of the job's stderr names a failing rank or why it failed: kolo's
/// own reports, a Rust error or panic, or mpirun's summary of the first process that
/// failed.
pub(crate) fn names_failure(line: &str) -> bool {
    line.contains("kolo: rank")
        || line.contains("panicked")
        || line.contains("Error:")
        || line.contains("exited on signal")
        || line.contains("Process name:")
        || line.contains("Exit code:")
        || line.contains("has shut down")
}

/// Runs mpirun, passing its stderr through to `out`, and tells how the job ended
/// ([`Ended`]: the exit code kolorun should end with, and why).
///
/// - Once the job is being aborted, mpirun waits for every host's daemon to confirm;
///   a host that is unreachable (a partition) never does, and mpirun would wait for
///   ever: after `grace` kolorun ends it and says so (exit code 1).
/// - A signal caught by [`catch_signals`] is passed on to mpirun; if mpirun has not
///   ended `grace` later, it and its ranks here are killed. The exit code is then
///   128 + the signal, as if kolorun had died of it.
/// - mpirun dying of a signal gives 128 + that signal, as a shell reports it.
///
/// Before it returns, the last of the job's stderr is passed through (bounded by
/// [`STDERR_DRAIN`]).
pub(crate) fn supervise_job(
    mut cmd: Command,
    grace: Duration,
    out: impl Write + Send + 'static,
) -> std::io::Result<Ended> {
    let mut child = cmd.stderr(std::process::Stdio::piped()).spawn()?;
    let cause: Arc<Mutex<Vec<String>>> = Arc::default();
    let watchdog: Arc<Mutex<Vec<String>>> = Arc::default();
    let aborted_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let (drained, copied) = std::sync::mpsc::channel::<()>();
    if let Some(stderr) = child.stderr.take() {
        let aborted_at = aborted_at.clone();
        let cause = cause.clone();
        let watchdog = watchdog.clone();
        let mut out = out;
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).split(b'\n') {
                let Ok(line) = line else { break };
                let _ = out.write_all(&line);
                let _ = out.write_all(b"\n");
                let text = String::from_utf8_lossy(&line);
                if aborting(&text) {
                    let mut at = aborted_at.lock().unwrap_or_else(|p| p.into_inner());
                    at.get_or_insert_with(Instant::now);
                }
                if text.contains("has made no progress") {
                    let mut w = watchdog.lock().unwrap_or_else(|p| p.into_inner());
                    if w.len() < 1024 {
                        w.push(text.trim().to_string());
                    }
                }
                if names_failure(&text) {
                    let mut c = cause.lock().unwrap_or_else(|p| p.into_inner());
                    // The first three, and mpirun's line naming the failed node
                    // wherever it comes (usually after the ranks' own reports).
                    if c.len() < 3
                        || (text.contains(" on node ")
                            && !c.iter().any(|l| l.contains(" on node ")))
                    {
                        c.push(text.trim().to_string());
                    }
                }
            }
            let _ = out.flush();
            drop(drained);
        });
    }
    let (code, signalled) = watch(&mut child, grace, &aborted_at)?;
    // The copier ends at the end of the pipe (the sender is dropped, which
    // `recv_timeout` reports as disconnected), or the wait runs out.
    let _ = copied.recv_timeout(STDERR_DRAIN);
    let cause = std::mem::take(&mut *cause.lock().unwrap_or_else(|p| p.into_inner()));
    let watchdog = std::mem::take(&mut *watchdog.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(Ended {
        code,
        signalled,
        cause,
        watchdog,
    })
}

/// Waits for mpirun to end, passing signals on and ending a job that does not end:
/// the exit code, and whether a signal was passed on.
fn watch(
    child: &mut Child,
    grace: Duration,
    aborted_at: &Mutex<Option<Instant>>,
) -> std::io::Result<(i32, bool)> {
    // The first signal received, and when.
    let mut signalled: Option<(i32, Instant)> = None;
    loop {
        let signal = RECEIVED.swap(0, Ordering::SeqCst);
        if signal != 0 {
            // SAFETY: kill(2) on mpirun, which is our child and not yet reaped.
            unsafe { libc::kill(child.id() as i32, signal) };
            signalled.get_or_insert((signal, Instant::now()));
        }
        if let Some(status) = child.try_wait()? {
            return Ok(match signalled {
                Some((signal, _)) => (128 + signal, true),
                None => (exit_code(status), false),
            });
        }
        if let Some((signal, _)) = signalled.filter(|(_, at)| at.elapsed() > grace) {
            eprintln!(
                "kolorun: mpirun has not ended {} s after it was passed signal {signal}; \
                 killing it and its processes on this machine.",
                grace.as_secs()
            );
            kill_job(child);
            return Ok((128 + signal, true));
        }
        let since = *aborted_at.lock().unwrap_or_else(|p| p.into_inner());
        if since.is_some_and(|at| at.elapsed() > grace) {
            eprintln!(
                "kolorun: mpirun has not ended the job {} s after it was aborted: a host's \
                 daemon does not answer (unreachable or partitioned away); ending mpirun. \
                 Processes may be left on that host.",
                grace.as_secs()
            );
            kill_job(child);
            // The job failed as a job (a host gone), as kolo's own abort says: it may be
            // relaunched without that host.
            return Ok((kolo::RESTARTABLE_EXIT_CODE, false));
        }
        std::thread::sleep(Duration::from_millis(50));
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
        // Ended as a job that failed as a job (a host gone): kolo's restartable status.
        assert_eq!(
            supervise_job(hang, short, std::io::sink()).unwrap().code,
            kolo::RESTARTABLE_EXIT_CODE
        );
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        // Exit codes pass through; a job that only prints is left alone.
        let mut ok = Command::new("sh");
        ok.args(["-c", "echo working >&2; sleep 0.5; exit 3"]);
        assert_eq!(supervise_job(ok, short, std::io::sink()).unwrap().code, 3);
    }

    /// A terminal that takes its time: each write waits 100 ms.
    struct SlowTerminal(Arc<Mutex<Vec<u8>>>);

    impl Write for SlowTerminal {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            std::thread::sleep(Duration::from_millis(100));
            let mut text = self.0.lock().unwrap_or_else(|p| p.into_inner());
            text.extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn issue31_the_last_stderr_lines_are_passed_through_before_returning() {
        let text = Arc::default();
        let mut job = Command::new("sh");
        job.args([
            "-c",
            "echo 'rank 0: loss 0.2' >&2; echo 'rank 1: out of memory' >&2; exit 5",
        ]);
        let code = supervise_job(job, ABORT_GRACE, SlowTerminal(Arc::clone(&text)))
            .unwrap()
            .code;
        assert_eq!(code, 5);
        let text = text.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert_eq!(
            String::from_utf8_lossy(&text),
            "rank 0: loss 0.2\nrank 1: out of memory\n"
        );
    }

    #[test]
    fn issue31_mpirun_dying_of_a_signal_gives_128_plus_the_signal() {
        let mut job = Command::new("sh");
        job.args(["-c", "kill -TERM $$"]);
        assert_eq!(
            supervise_job(job, ABORT_GRACE, std::io::sink())
                .unwrap()
                .code,
            143
        );
        let mut job = Command::new("sh");
        job.args(["-c", "kill -KILL $$"]);
        assert_eq!(
            supervise_job(job, ABORT_GRACE, std::io::sink())
                .unwrap()
                .code,
            137
        );
    }

    /// Whether process `pid` is gone (or a zombie, which runs nothing).
    fn gone(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rfind(')')
                .and_then(|i| stat[i + 1..].split_whitespace().next())
                .is_some_and(|state| state == "Z" || state == "X"),
        }
    }

    #[test]
    fn issue31_killing_the_job_kills_the_ranks_in_their_own_process_groups() {
        // An mpirun stand-in whose "rank" leads its own process group, as Open MPI's do
        // (here by `setsid`), and which would wait for ever.
        let mut job = Command::new("sh");
        job.args(["-c", "setsid sleep 60 & echo $!; wait"])
            .stdout(std::process::Stdio::piped());
        let mut child = job.spawn().unwrap();
        let mut line = String::new();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        stdout.read_line(&mut line).unwrap();
        let rank: i32 = line.trim().parse().unwrap();
        // The rank leads its group once setsid has run (`$!` is known before that).
        let start = Instant::now();
        let mut children = children_of(child.id() as i32);
        while children != [(rank, rank)] && start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
            children = children_of(child.id() as i32);
        }
        kill_job(&mut child);
        assert_eq!(children, [(rank, rank)]);
        let start = Instant::now();
        while !gone(rank) && start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(gone(rank), "the rank {rank} outlived the job");
    }
}
