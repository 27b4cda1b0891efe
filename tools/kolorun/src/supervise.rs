//! Running mpirun: its stderr passed through, an aborted job that does not end
//! ended.

use std::io::{BufRead, Write};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use crate::signals::Signals;

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
        // A group is only signalled when the child leads it, so never kolorun's own.
        let _ = if group == child_pid {
            killpg(Pid::from_raw(group), Signal::SIGKILL)
        } else {
            kill(Pid::from_raw(child_pid), Signal::SIGKILL)
        };
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

/// How a job ended: [`supervise_job`]'s exit code, whether kolorun was sent a signal
/// that ends it (the user ended it: no relaunch), what says it failed as a job, and
/// the job's first lines that say which rank failed and why.
#[derive(Debug, Default)]
pub(crate) struct Ended {
    pub(crate) code: i32,
    pub(crate) signalled: bool,
    /// mpirun's own line saying the job failed as a job (a rank killed by a signal,
    /// daemons that did not start or were lost): the first one.
    pub(crate) job_failure: Option<String>,
    /// mpirun itself died of this signal (not one kolorun passed on).
    pub(crate) mpirun_signal: Option<i32>,
    /// mpirun reported a rank's own exit status (its "Exit code:" line).
    pub(crate) rank_exit_code: bool,
    /// mpirun did not end after the job was aborted and kolorun ended it.
    pub(crate) hung: bool,
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
        || job_failure(line)
}

/// The rank and text of a line of mpirun's tagged output (`[1,R]<stderr>:text`).
fn tagged(line: &str) -> Option<(usize, &str)> {
    let rest = line.strip_prefix('[')?;
    let (tag, text) = rest.split_once(']')?;
    let rank = tag.split(',').nth(1)?.parse().ok()?;
    let text = text
        .strip_prefix("<stderr>:")
        .or_else(|| text.strip_prefix("<stdout>:"))?;
    Some((rank, text))
}

/// The rank mpirun's box names as the first to exit with a status of its own
/// (`Process name: [[50001,1],0]`).
fn process_name_rank(line: &str) -> Option<usize> {
    let at = line.find("Process name:")?;
    let name = line[at + "Process name:".len()..].trim();
    name.trim_end_matches(']')
        .rsplit(',')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// The beginnings of mpirun's own lines (Open MPI 4's ORTE and 5's PRTE) for daemons
/// that could not be started or were lost: the job failed as a job.
const DAEMON_FAILURES: [&str; 8] = [
    "ORTE was unable to reliably start one or more daemons",
    "PRTE was unable to reliably start one or more daemons",
    "ORTE has lost communication with a remote daemon",
    "PRTE has lost communication with a remote daemon",
    "An ORTE daemon has unexpectedly failed after launch",
    "A PRTE daemon has unexpectedly failed after launch",
    "ORTE does not know how to route a message to the specified daemon",
    "PRTE does not know how to route a message to the specified daemon",
];

/// Whether the attempt `ended` failed because mpirun could not start its daemons (or
/// lost them): no rank may have run at all (a host whose link is down).
pub(crate) fn daemons_failed(ended: &Ended) -> bool {
    ended.job_failure.as_deref().is_some_and(|l| {
        DAEMON_FAILURES
            .iter()
            .any(|p| l.trim_start().starts_with(p))
    })
}

/// Whether `line` is mpirun's own report of a job failure: a rank ended by a signal
/// ("mpirun noticed that process rank 1 with PID 7 on node h2 exited on signal 9"), or
/// daemons that could not be started or were lost ([`DAEMON_FAILURES`]). Anchored at
/// the start of the line: the ranks' output is tagged (`[1,0]<stderr>:`), so a
/// program's own message ("Error: unable to open …") never reads as one.
pub(crate) fn job_failure(line: &str) -> bool {
    let l = line.trim_start();
    ((l.starts_with("mpirun noticed that process rank")
        || l.starts_with("prterun noticed that process rank"))
        && l.contains(" exited on signal "))
        || DAEMON_FAILURES.iter().any(|p| l.starts_with(p))
}

/// Runs mpirun, passing its stderr through to `out`, and tells how the job ended
/// ([`Ended`]: the exit code kolorun should end with, and why).
///
/// - Once the job is being aborted, mpirun waits for every host's daemon to confirm;
///   a host that is unreachable (a partition) never does, and mpirun would wait for
///   ever: after `grace` kolorun ends it and says so ([`Ended::hung`]; exit code 75,
///   kolo's restartable status, when kolo's watchdog aborted the job, else 1).
/// - A signal in `signals` is passed on to mpirun (unless a terminal sent it to mpirun
///   too); SIGUSR1 and SIGUSR2 only that. One that ends the job (SIGINT, SIGTERM,
///   SIGHUP, SIGQUIT) is never relaunched, even when it comes during the abort's
///   grace; if mpirun has not ended `grace` later, it and its ranks here are killed.
///   The exit code is then 128 + the signal, as if kolorun had died of it.
/// - mpirun dying of a signal gives 128 + that signal, as a shell reports it.
///
/// Before it returns, the last of the job's stderr is passed through (bounded by
/// [`STDERR_DRAIN`]).
pub(crate) fn supervise_job(
    mut cmd: Command,
    grace: Duration,
    out: impl Write + Send + 'static,
    signals: &Signals,
) -> std::io::Result<Ended> {
    let mut child = cmd.stderr(std::process::Stdio::piped()).spawn()?;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let (drained, copied) = std::sync::mpsc::channel::<()>();
    if let Some(stderr) = child.stderr.take() {
        let seen = Arc::clone(&seen);
        std::thread::spawn(move || {
            copy_stderr(stderr, out, &seen);
            drop(drained);
        });
    }
    let watched = watch(&mut child, grace, &seen, signals)?;
    // The copier ends at the end of the pipe (the sender is dropped, which
    // `recv_timeout` reports as disconnected), or the wait runs out.
    let _ = copied.recv_timeout(STDERR_DRAIN);
    let mut seen = std::mem::take(&mut *lock(&seen));
    let code = match watched.code {
        Some(code) => code,
        // Ended by kolorun after the abort: kolo's watchdog asked for the restartable
        // status (a host cut off); any other abort (a program error whose teardown
        // hung) is the program's failure.
        None if !seen.watchdog.is_empty() => kolo::RESTARTABLE_EXIT_CODE,
        None => 1,
    };
    let job_failure = seen.failure.take();
    let rank_exit_code = seen.rank_exit;
    let watchdog = std::mem::take(&mut seen.watchdog);
    Ok(Ended {
        code,
        signalled: watched.signalled,
        job_failure,
        mpirun_signal: watched.mpirun_signal,
        rank_exit_code,
        hung: watched.code.is_none(),
        cause: seen.cause(),
        watchdog,
    })
}

/// What the job's stderr said so far.
#[derive(Debug, Default)]
struct Seen {
    /// The first lines naming a failing rank or why ([`names_failure`]).
    cause: Vec<String>,
    /// mpirun's first line of a job failure ([`job_failure`]).
    failure: Option<String>,
    /// mpirun reported a rank's own exit status.
    rank_exit: bool,
    /// kolo's watchdog lines.
    watchdog: Vec<String>,
    /// When the job was first said to be aborting.
    aborted_at: Option<Instant>,
    /// Each rank's last line on stderr: the failing rank's own error (issue 54: a
    /// program's error, e.g. "train_digits: committing: No space left on device",
    /// names no failure kolorun knows).
    last_err: std::collections::BTreeMap<usize, String>,
    /// The rank mpirun names as the first that exited with a status of its own.
    exited: Option<usize>,
    /// Lines that only echo another rank's failure ("rank 0 has shut down"): the
    /// cause when nothing better is seen.
    echoes: Vec<String>,
}

impl Seen {
    /// The lines that say which rank failed and why: the rank that exited first with
    /// its last line, then the first lines naming a failure; other ranks' echoes of
    /// it only when there is nothing else.
    fn cause(self) -> Vec<String> {
        let mut cause = Vec::new();
        if let Some((r, line)) = self
            .exited
            .and_then(|r| self.last_err.get(&r).map(|l| (r, l)))
        {
            cause.push(format!("rank {r}: {}", line.trim()));
        }
        cause.extend(self.cause);
        if cause.is_empty() {
            cause = self.echoes;
        }
        cause
    }
}

impl Seen {
    /// Notes what one line of the job's stderr says.
    fn line(&mut self, text: &str) {
        if aborting(text) {
            self.aborted_at.get_or_insert_with(Instant::now);
        }
        if text.contains("has made no progress") && self.watchdog.len() < 1024 {
            self.watchdog.push(text.trim().to_string());
        }
        // mpirun's box for a rank that exited with a status of its own.
        if text.trim_start().starts_with("Exit code:") {
            self.rank_exit = true;
        }
        if job_failure(text) {
            self.failure.get_or_insert_with(|| text.trim().to_string());
        }
        if let Some((rank, said)) = tagged(text) {
            if !said.trim().is_empty() && text.contains("<stderr>:") {
                self.last_err.insert(rank, said.to_string());
            }
        }
        if let Some(r) = process_name_rank(text) {
            self.exited.get_or_insert(r);
        }
        if text.contains("has shut down") {
            if self.echoes.len() < 3 {
                self.echoes.push(text.trim().to_string());
            }
            return;
        }
        // The first three, and mpirun's line naming the failed node wherever it
        // comes (usually after the ranks' own reports).
        if names_failure(text)
            && (self.cause.len() < 3
                || (text.contains(" on node ")
                    && !self.cause.iter().any(|l| l.contains(" on node "))))
        {
            self.cause.push(text.trim().to_string());
        }
    }
}

fn lock(seen: &Mutex<Seen>) -> std::sync::MutexGuard<'_, Seen> {
    seen.lock().unwrap_or_else(|p| p.into_inner())
}

/// Passes the job's stderr through to `out` line by line, noting what each says.
fn copy_stderr(stderr: impl std::io::Read, mut out: impl Write, seen: &Mutex<Seen>) {
    for line in std::io::BufReader::new(stderr).split(b'\n') {
        let Ok(line) = line else { break };
        let _ = out.write_all(&line);
        let _ = out.write_all(b"\n");
        lock(seen).line(&String::from_utf8_lossy(&line));
    }
    let _ = out.flush();
}

/// What [`watch`] saw.
struct Watched {
    /// The exit code; `None` when kolorun ended a job that did not end after its abort.
    code: Option<i32>,
    signalled: bool,
    mpirun_signal: Option<i32>,
}

/// Waits for mpirun to end, passing signals on and ending a job that does not end.
fn watch(
    child: &mut Child,
    grace: Duration,
    seen: &Mutex<Seen>,
    signals: &Signals,
) -> std::io::Result<Watched> {
    use std::os::unix::process::ExitStatusExt;
    // The first signal received that ends the job, and when.
    let mut signalled: Option<(i32, Instant)> = None;
    let ended_by = |signal: i32| Watched {
        code: Some(128 + signal),
        signalled: true,
        mpirun_signal: None,
    };
    loop {
        while let Some(r) = signals.next() {
            if !r.reached_mpirun() {
                if let Ok(s) = Signal::try_from(r.signal) {
                    // mpirun is our child and not yet reaped.
                    let _ = kill(Pid::from_raw(child.id() as i32), s);
                }
            }
            if r.ends() {
                signalled.get_or_insert((r.signal, Instant::now()));
            }
        }
        if let Some(status) = child.try_wait()? {
            return Ok(match signalled {
                Some((signal, _)) => ended_by(signal),
                None => Watched {
                    code: Some(exit_code(status)),
                    signalled: false,
                    mpirun_signal: status.signal(),
                },
            });
        }
        if let Some((signal, _)) = signalled.filter(|(_, at)| at.elapsed() > grace) {
            eprintln!(
                "kolorun: mpirun has not ended {} s after it was passed signal {signal}; \
                 killing it and its processes on this machine.",
                grace.as_secs()
            );
            kill_job(child);
            return Ok(ended_by(signal));
        }
        let since = lock(seen).aborted_at;
        if since.is_some_and(|at| at.elapsed() > grace) {
            eprintln!(
                "kolorun: mpirun has not ended the job {} s after it was aborted: a host's \
                 daemon does not answer (unreachable or partitioned away); ending mpirun. \
                 Processes may be left on that host.",
                grace.as_secs()
            );
            kill_job(child);
            // A signal from the user during the grace still ends the run.
            return Ok(match signalled {
                Some((signal, _)) => ended_by(signal),
                None => Watched {
                    code: None,
                    signalled: false,
                    mpirun_signal: None,
                },
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issue54_only_daemons_that_did_not_start_count_towards_the_backoff() {
        let ended = |line: &str| Ended {
            job_failure: Some(line.to_string()),
            ..Ended::default()
        };
        assert!(daemons_failed(&ended(
            "ORTE was unable to reliably start one or more daemons."
        )));
        assert!(!daemons_failed(&ended(
            "mpirun noticed that process rank 3 with PID 7 on node h2 exited on signal 9 (Killed)."
        )));
        assert!(!daemons_failed(&Ended::default()));
    }

    #[test]
    fn issue54_the_cause_is_the_failing_ranks_own_last_line_not_the_others_echoes() {
        let mut seen = Seen::default();
        for l in [
            "[1,0]<stdout>:epoch 3",
            "[1,0]<stderr>:train_digits: committing: No space left on device (os error 28)",
            "[1,1]<stderr>:[kolo rank 1] WARN kolo-engine rank 0 has shut down; collectives on this rank will fail",
            "[1,2]<stderr>:[kolo rank 2] WARN kolo-engine rank 0 has shut down; collectives on this rank will fail",
            "  Process name: [[50001,1],0]",
            "  Exit code:    1",
        ] {
            seen.line(l);
        }
        let cause = seen.cause();
        assert_eq!(
            cause.first().map(String::as_str),
            Some("rank 0: train_digits: committing: No space left on device (os error 28)"),
            "{cause:?}"
        );
        assert!(
            !cause.iter().any(|l| l.contains("has shut down")),
            "{cause:?}"
        );
        // Only echoes: they are the cause.
        let mut seen = Seen::default();
        seen.line("[1,1]<stderr>:WARN rank 0 has shut down; collectives on this rank will fail");
        assert_eq!(seen.cause().len(), 1);
        assert_eq!(tagged("[1,12]<stderr>:x"), Some((12, "x")));
        assert_eq!(process_name_rank("Process name: [[7,1],3]"), Some(3));
    }

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
        // An mpirun stand-in that reports kolo's watchdog abort and then hangs is
        // ended, with kolo's restartable status (a host gone).
        let mut hang = Command::new("sh");
        hang.args([
            "-c",
            "echo '[1,0]<stderr>:kolo: rank 0: its engine (kolo-engine) has made no progress \
             for 5.9 s: another rank is stopped or stuck, or its host is unreachable; aborting \
             the whole job' >&2; echo 'MPI_ABORT was invoked on rank 0' >&2; exec sleep 30",
        ]);
        let start = std::time::Instant::now();
        let ended = supervise_job(hang, short, std::io::sink(), &Signals::none()).unwrap();
        assert_eq!(ended.code, kolo::RESTARTABLE_EXIT_CODE);
        assert!(ended.hung && !ended.signalled);
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        // Issue 53 item 12: a program's own error whose teardown hangs stays the
        // program's error (exit 1), not kolo's restartable status.
        let mut slow = Command::new("sh");
        slow.args([
            "-c",
            "echo '[1,1]<stderr>:Error: unable to open data.bin' >&2; \
             echo 'MPI_ABORT was invoked on rank 1' >&2; exec sleep 30",
        ]);
        let ended = supervise_job(slow, short, std::io::sink(), &Signals::none()).unwrap();
        assert_eq!((ended.code, ended.hung), (1, true));
        assert_eq!(ended.job_failure, None);
        // Exit codes pass through; a job that only prints is left alone.
        let mut ok = Command::new("sh");
        ok.args(["-c", "echo working >&2; sleep 0.5; exit 3"]);
        assert_eq!(
            supervise_job(ok, short, std::io::sink(), &Signals::none())
                .unwrap()
                .code,
            3
        );
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
        let code = supervise_job(
            job,
            ABORT_GRACE,
            SlowTerminal(Arc::clone(&text)),
            &Signals::none(),
        )
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
            supervise_job(job, ABORT_GRACE, std::io::sink(), &Signals::none())
                .unwrap()
                .code,
            143
        );
        let mut job = Command::new("sh");
        job.args(["-c", "kill -KILL $$"]);
        assert_eq!(
            supervise_job(job, ABORT_GRACE, std::io::sink(), &Signals::none())
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

    #[test]
    fn issue53_job_failures_are_mpiruns_anchored_lines_only() {
        assert!(job_failure(
            "mpirun noticed that process rank 1 with PID 7 on node h2 exited on signal 9 (Killed)."
        ));
        assert!(job_failure(
            "ORTE was unable to reliably start one or more daemons."
        ));
        assert!(job_failure(
            "  ORTE has lost communication with a remote daemon."
        ));
        // A program's own words, tagged by mpirun, are never one.
        for own in [
            "[1,0]<stderr>:Error: unable to open data.bin",
            "[1,0]<stderr>:thread 'main' panicked at src/signal.rs:3:5",
            "[1,1]<stderr>:mpirun noticed that process rank 1 exited on signal 9",
            "[1,0]<stderr>:ORTE was unable to reliably start one or more daemons",
            "mpirun was unable to launch the specified application as it could not access",
        ] {
            assert!(!job_failure(own), "{own:?}");
        }
    }

    /// An mpirun stand-in that reports an abort and hangs (ignoring SIGINT, as a
    /// daemon that does not answer keeps mpirun waiting).
    fn hanging_abort() -> Command {
        let mut hang = Command::new("sh");
        hang.args([
            "-c",
            "trap '' INT; echo '[1,0]<stderr>:kolo: rank 0: its engine (kolo-engine) has made \
             no progress for 5.9 s; aborting the whole job' >&2; \
             echo 'MPI_ABORT was invoked on rank 0' >&2; while :; do sleep 0.05; done",
        ]);
        hang
    }

    #[test]
    fn issue53_a_signal_during_the_abort_grace_ends_the_run() {
        let (tx, signals) = Signals::injected();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let _ = tx.send(crate::signals::Received {
                signal: libc::SIGINT,
                from_terminal: false,
            });
            tx
        });
        let ended = supervise_job(
            hanging_abort(),
            Duration::from_millis(600),
            std::io::sink(),
            &signals,
        )
        .unwrap();
        let _tx = sender.join();
        assert!(ended.signalled, "{ended:?}");
        assert_eq!(ended.code, 130);
    }

    #[test]
    fn issue53_usr1_is_passed_on_and_a_terminals_ctrl_c_not_twice() {
        // SIGUSR1 reaches mpirun and does not end the run: the stand-in exits 4 on it.
        let (tx, signals) = Signals::injected();
        let usr1 = crate::signals::Received {
            signal: libc::SIGUSR1,
            from_terminal: false,
        };
        let mut job = Command::new("sh");
        job.args([
            "-c",
            "trap 'exit 4' USR1; echo ready >&2; while :; do sleep 0.05; done",
        ]);
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let _ = tx.send(usr1);
            tx
        });
        let ended = supervise_job(job, ABORT_GRACE, std::io::sink(), &signals).unwrap();
        let _tx = sender.join();
        assert_eq!((ended.code, ended.signalled), (4, false), "{ended:?}");
        // A terminal's Ctrl-C reached mpirun by its process group: not sent again
        // (the stand-in would exit 5 on a second SIGINT), the run still ends.
        let (tx, signals) = Signals::injected();
        let mut job = Command::new("sh");
        job.args(["-c", "trap 'exit 5' INT; while :; do sleep 0.05; done"]);
        let _ = tx.send(crate::signals::Received {
            signal: libc::SIGINT,
            from_terminal: true,
        });
        let ended =
            supervise_job(job, Duration::from_millis(400), std::io::sink(), &signals).unwrap();
        assert_eq!((ended.code, ended.signalled), (130, true), "{ended:?}");
    }
}
