//! The hosts of each attempt: `-H`, a hostfile (slots as Open MPI counts them, the
//! hosts asked for their cores), a `--host-discovery-script`, without the hosts left
//! out after a failure; and the check that every host answers before mpirun starts.

use crate::args::Args;
use crate::elastic;
use crate::hosts::{
    check_hosts, cores_of, filtered_hostfile, flag_hosts, hostfile_hosts, hostfile_users, login,
    remote_agent,
};
use crate::signals::Signals;
use std::process::Command;

use crate::fail;

/// The arguments, number of ranks and hosts of the next attempt: as given, or — with a
/// discovery script, or hosts left out — the hosts that remain, with as many ranks as
/// they have slots (at most -np, at least --min-np, else kolorun ends saying so).
///
/// When no layout is left after a failed attempt, kolorun ends with that attempt's
/// exit code (`last_code`), not a command-line error.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attempt_layout(
    args: &Args,
    np: u32,
    min_np: u32,
    left_out: &[String],
    signals: &Signals,
    last_code: Option<i32>,
    agent: &[String],
) -> (Args, u32, Vec<(String, usize)>) {
    let hosts = match &args.host_discovery_script {
        Some(script) => discover(script, signals),
        None => job_hosts(args, agent),
    };
    if hosts.is_empty() || (left_out.is_empty() && args.host_discovery_script.is_none()) {
        if args.host_discovery_script.is_some() {
            fail("the --host-discovery-script printed no host");
        }
        return (args.clone(), np, hosts);
    }
    let (kept, run_np) = elastic::next_layout(&hosts, left_out, np, min_np).unwrap_or_else(|e| {
        eprintln!("kolorun: cannot relaunch: {e}");
        std::process::exit(last_code.unwrap_or(2))
    });
    let mut a = args.clone();
    a.host_discovery_script = None;
    match (&args.hostfile, args.host_discovery_script.is_none()) {
        // From a copy of the user's hostfile without the hosts left out: its other
        // settings and Open MPI's own slot counts stay (issue 53 item 13).
        (Some(f), true) => {
            let names: Vec<String> = kept.iter().map(|(h, _)| h.clone()).collect();
            let text = std::fs::read_to_string(f)
                .unwrap_or_else(|e| fail(&format!("cannot read --hostfile {f}: {e}")));
            let copy =
                std::env::temp_dir().join(format!("kolorun-{}.hostfile", std::process::id()));
            if let Err(e) = std::fs::write(&copy, filtered_hostfile(&text, &names)) {
                fail(&format!("cannot write {}: {e}", copy.display()));
            }
            a.hostfile = Some(copy.display().to_string());
        }
        _ => {
            a.hosts = Some(elastic::hosts_flag(&kept));
            a.hostfile = None;
        }
    }
    (a, run_np, kept)
}

/// How long a `--host-discovery-script` may run.
const DISCOVERY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs the `--host-discovery-script` and reads its hosts, or ends kolorun saying why:
/// it failed, ran past [`DISCOVERY_TIMEOUT`], or a signal arrived meanwhile (the
/// script is killed then, and kolorun ends as the signal asks).
fn discover(script: &str, signals: &Signals) -> Vec<(String, usize)> {
    use std::io::Read;
    let mut cmd = Command::new(script);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    // Its own process group: killed whole, children included.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| fail(&format!("cannot run --host-discovery-script {script}: {e}")));
    let (mut stdout, mut stderr) = (child.stdout.take(), child.stderr.take());
    let read_out = std::thread::spawn(move || {
        let mut s = Vec::new();
        if let Some(o) = stdout.as_mut() {
            let _ = o.read_to_end(&mut s);
        }
        s
    });
    let read_err = std::thread::spawn(move || {
        let mut s = Vec::new();
        if let Some(e) = stderr.as_mut() {
            let _ = e.read_to_end(&mut s);
        }
        s
    });
    let start = std::time::Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => fail(&format!("--host-discovery-script {script}: {e}")),
        }
        let mut end = |why: &str| {
            let group = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait();
            eprintln!("kolorun: --host-discovery-script {script} {why}; killed it");
        };
        if let Some(r) = signals.ending() {
            end(&format!("was running when signal {} arrived", r.signal));
            std::process::exit(128 + r.signal);
        }
        if start.elapsed() > DISCOVERY_TIMEOUT {
            end(&format!(
                "did not finish within {} s",
                DISCOVERY_TIMEOUT.as_secs()
            ));
            std::process::exit(2);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = std::process::Output {
        status,
        stdout: read_out.join().unwrap_or_default(),
        stderr: read_err.join().unwrap_or_default(),
    };
    if !out.status.success() {
        fail(&format!(
            "--host-discovery-script {script} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    elastic::discovered(&String::from_utf8_lossy(&out.stdout))
        .unwrap_or_else(|e| fail(&format!("--host-discovery-script {script}: {e}")))
}

/// The hosts of `-H`, else of `--hostfile` (empty: this machine), or the end of
/// kolorun with the reason. A hostfile host without `slots=` (or `max_slots=`) has
/// as many slots as cores, as Open MPI counts them: asked of the host (this machine
/// directly, the others through `agent`) once per kolorun.
fn job_hosts(args: &Args, agent: &[String]) -> Vec<(String, usize)> {
    static RESOLVED: std::sync::OnceLock<Vec<(String, usize)>> = std::sync::OnceLock::new();
    if args.hosts.is_none() && args.hostfile.is_some() {
        return RESOLVED
            .get_or_init(|| resolve_slots(args, hostfile_entries(args), agent))
            .clone();
    }
    hosts_given(args)
}

/// The hostfile's hosts, slots unknown where it gives none (see [`job_hosts`]).
fn hostfile_entries(args: &Args) -> Vec<(String, Option<usize>)> {
    let Some(f) = &args.hostfile else {
        return Vec::new();
    };
    match std::fs::read_to_string(f) {
        Ok(text) => match hostfile_hosts(&text) {
            Ok(hosts) if hosts.is_empty() => fail(&format!("--hostfile {f} names no host")),
            Ok(hosts) => hosts,
            Err(e) => fail(&format!("--hostfile {f}: {e}")),
        },
        Err(e) => fail(&format!("cannot read --hostfile {f}: {e}")),
    }
}

/// `entries` with each unknown slot count replaced by the host's cores.
fn resolve_slots(
    args: &Args,
    entries: Vec<(String, Option<usize>)>,
    agent: &[String],
) -> Vec<(String, usize)> {
    let unknown: Vec<String> = entries
        .iter()
        .filter(|(_, s)| s.is_none())
        .map(|(h, _)| h.clone())
        .collect();
    if unknown.is_empty() {
        return entries
            .into_iter()
            .map(|(h, s)| (h, s.unwrap_or(1)))
            .collect();
    }
    let timeout = std::time::Duration::from_secs(args.start_timeout.unwrap_or(30).into());
    let users = hostfile_user_list(args);
    let logins: Vec<String> = unknown.iter().map(|h| login(h, &users)).collect();
    let cores = cores_of(&logins, agent, timeout).unwrap_or_else(|e| {
        fail(&format!(
            "a --hostfile host without slots= has as many slots as cores (as Open MPI counts \
             them), and kolorun could not ask:\n  {e}\n(give each host slots=N)"
        ))
    });
    let mut cores = cores.into_iter();
    entries
        .into_iter()
        .map(|(h, s)| {
            let n = s.or_else(|| cores.next()).unwrap_or(1);
            (h, n)
        })
        .collect()
}

/// The `username=` settings of the `--hostfile` (none without one).
fn hostfile_user_list(args: &Args) -> Vec<(String, String)> {
    args.hostfile
        .as_ref()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .map(|t| hostfile_users(&t))
        .unwrap_or_default()
}

/// The hosts of `-H` (empty: this machine).
fn hosts_given(args: &Args) -> Vec<(String, usize)> {
    match &args.hosts {
        Some(h) => flag_hosts(h).unwrap_or_else(|e| fail(&e)),
        None => Vec::new(),
    }
}

/// The hosts of `hosts` that do not answer within `--start-timeout` (checked before
/// mpirun would wait for them for ever). Without `--max-restarts` kolorun ends naming
/// them; with it, the caller leaves them out of the attempt.
pub(crate) fn reach_hosts(
    args: &Args,
    hosts: &[(String, usize)],
    mpi_args: &[String],
    env: &[(String, String)],
) -> Vec<String> {
    let mut names: Vec<String> = hosts.iter().map(|(name, _)| name.clone()).collect();
    names.dedup();
    if names.is_empty() || args.no_host_check {
        return Vec::new();
    }
    let timeout = std::time::Duration::from_secs(args.start_timeout.unwrap_or(30).into());
    // As mpirun logs in: as a hostfile's `username=` where it gives one.
    let users = hostfile_user_list(args);
    let logins: Vec<String> = names.iter().map(|h| login(h, &users)).collect();
    let failed: Vec<String> = check_hosts(&logins, &remote_agent(mpi_args, env), timeout)
        .into_iter()
        .map(|l| match l.split_once(": ") {
            Some((who, why)) => match logins.iter().position(|x| x == who) {
                Some(i) => format!("{}: {why}", names[i]),
                None => l,
            },
            None => l,
        })
        .collect();
    if failed.is_empty() {
        return Vec::new();
    }
    // Each line is "host: why"; one that names no host (no agent) ends kolorun.
    let named: Option<Vec<String>> = failed
        .iter()
        .map(|l| {
            let (h, _) = l.split_once(": ")?;
            names.iter().find(|n| *n == h).cloned()
        })
        .collect();
    match named {
        Some(hosts) if args.max_restarts > 0 => hosts,
        _ => fail(&format!(
            "cannot reach {} of the job's hosts (--start-timeout {} s):\n  {}",
            failed.len(),
            timeout.as_secs(),
            failed.join("\n  ")
        )),
    }
}
