//! The signals kolorun is sent, caught from its start (through `signal-hook`), so that
//! none is lost between attempts or while a host check or discovery script runs, and
//! each reaches mpirun once.

use std::sync::mpsc::{channel, Receiver, Sender};

use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;
use signal_hook::low_level::siginfo::Cause;

/// One signal kolorun was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Received {
    /// The signal's number.
    pub(crate) signal: i32,
    /// Sent by the kernel (a terminal's Ctrl-C or Ctrl-\), not by a process.
    pub(crate) from_terminal: bool,
}

impl Received {
    /// Whether it ends the job (SIGINT, SIGTERM, SIGHUP, SIGQUIT); SIGUSR1 and SIGUSR2
    /// are only passed on ("checkpoint now", a common Slurm pattern before the time
    /// limit).
    pub(crate) fn ends(&self) -> bool {
        !matches!(self.signal, SIGUSR1 | SIGUSR2)
    }

    /// Whether mpirun has it already: a terminal sends Ctrl-C and Ctrl-\ to its whole
    /// foreground process group, mpirun included. Passing it on again would be a
    /// second one, and Open MPI kills the job at once on the third.
    pub(crate) fn reached_mpirun(&self) -> bool {
        self.from_terminal && matches!(self.signal, SIGINT | SIGQUIT)
    }
}

/// The signals caught so far, in order.
#[derive(Debug)]
pub(crate) struct Signals {
    rx: Receiver<Received>,
    /// Keeps the channel open for `Signals::none` (a test's, with nothing caught).
    _tx: Option<Sender<Received>>,
}

impl Signals {
    /// Catches SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 from now on: kolorun
    /// no longer dies of them (so mpirun is never left unsupervised); each is queued
    /// here for [`next`](Self::next).
    ///
    /// # Errors
    /// The handlers cannot be installed.
    pub(crate) fn catch() -> std::io::Result<Signals> {
        let mut caught =
            SignalsInfo::<WithOrigin>::new([SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2])?;
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name("kolorun-signals".into())
            .spawn(move || {
                for origin in caught.forever() {
                    let received = Received {
                        signal: origin.signal,
                        from_terminal: origin.cause == Cause::Kernel,
                    };
                    if tx.send(received).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Signals { rx, _tx: None })
    }

    /// No signal is ever caught (for tests).
    #[cfg(test)]
    pub(crate) fn none() -> Signals {
        let (tx, rx) = channel();
        Signals { rx, _tx: Some(tx) }
    }

    /// Signals that tests send through the returned sender.
    #[cfg(test)]
    pub(crate) fn injected() -> (Sender<Received>, Signals) {
        let (tx, rx) = channel();
        (tx, Signals { rx, _tx: None })
    }

    /// The next signal caught, if any (never waits).
    pub(crate) fn next(&self) -> Option<Received> {
        self.rx.try_recv().ok()
    }

    /// The first signal caught that ends the job, if any; signals that would only be
    /// passed on are dropped, with a note, since no job runs to take them.
    pub(crate) fn ending(&self) -> Option<Received> {
        while let Some(r) = self.next() {
            if r.ends() {
                return Some(r);
            }
            eprintln!(
                "kolorun: signal {} arrived while no job runs; not passed on",
                r.signal
            );
        }
        None
    }
}
