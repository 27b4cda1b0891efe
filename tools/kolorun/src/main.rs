//! `kolorun`: launches a kolo program under `mpirun`, the way `horovodrun` launches a
//! Horovod one. Tuning flags become `KOLO_*` variables exported to every rank with
//! `-x`; the right mpirun options are added (allow-run-as-root when root, bind-to none,
//! tagged output, the network interface to use, a start-up deadline).
//!
//! Without `-H`/`--hostfile` every rank runs on this machine and traffic stays on
//! loopback. With them the job spans hosts: the user's environment is forwarded to
//! every rank, and settings that only work on one machine are dropped with a note.
//!
//! ```sh
//! kolorun -np 4 -H host1:2,host2:2 --network-interface eth0 --fusion-threshold-mb 16 ./train
//! kolorun -np 8 --hostfile hosts.txt --mpi-args "--mca btl_tcp_links 2" ./train
//! kolorun --check-build
//! kolorun -np 2 --dry-run ./train --epochs 3
//! ```

mod args;
mod command;
mod deepspeed;
mod elastic;
mod hosts;
mod layout;
mod nic;
mod signals;
mod slurm;
mod supervise;

use std::process::Command;

use clap::Parser;

use args::{normalize, Args};
use command::{command_line, plan, threads_per_rank};

use hosts::remote_agent;
use layout::{attempt_layout, reach_hosts};
use signals::Signals;
use supervise::{supervise_job, ABORT_GRACE};

fn check_build() {
    let b = kolo::build_info();
    println!("kolo {}", b.version);
    println!("  MPI transport:  yes ({})", b.mpi_library);
    println!(
        "  NCCL transport: {}",
        if b.nccl {
            "compiled in"
        } else {
            "not compiled in (build with --features nccl for CUDA tensors)"
        }
    );
    if b.nccl {
        match kolo::cuda_device_count() {
            Ok(n) => println!("  CUDA driver:    found, {n} device(s)"),
            Err(e) => println!("  CUDA driver:    {e}"),
        }
        println!(
            "  NCCL library:   {}",
            if kolo::nccl_library_present() {
                "found"
            } else {
                "not found (libnccl.so.2)"
            }
        );
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("kolorun: {msg}");
    std::process::exit(2);
}

fn main() {
    let mut args = Args::parse_from(normalize(std::env::args()));
    if args.check_build {
        check_build();
        return;
    }
    from_slurm(&mut args);
    deepspeed::apply(&mut args);
    let Some(np) = args.np else {
        fail("-np is required (the number of processes; inside a Slurm allocation it is the task count)");
    };
    if args.command.is_empty() {
        fail("no program given; usage: kolorun -np N [options] program [args...]");
    }
    let mpi_args = match &args.mpi_args {
        None => Vec::new(),
        Some(s) => shlex::split(s)
            .unwrap_or_else(|| fail(&format!("--mpi-args {s:?} has an unclosed quote"))),
    };
    let root = nix::unistd::geteuid().is_root();
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    let min_np = args.min_np.unwrap_or(np).min(np);
    // From here on no signal ends kolorun unseen: each is acted on (between attempts)
    // or passed to mpirun (during one).
    let signals =
        Signals::catch().unwrap_or_else(|e| fail(&format!("cannot install signal handlers: {e}")));
    // Hosts left out of later attempts: their ranks died, or they did not answer.
    let mut left_out: Vec<String> = Vec::new();
    let run_id = run_identity();
    // At most 1 000 001 (--max-restarts is bounded): no overflow.
    let attempts = args.max_restarts + 1;
    let mut attempt = 0u32;
    // The last attempt's exit code: what kolorun ends with when it cannot relaunch.
    let mut last_code: Option<i32> = None;
    // Attempts in a row that failed soon after they started (see `backoff`).
    let mut quick_failures = 0u32;
    loop {
        stop_if_signalled(&signals);
        let agent = remote_agent(&mpi_args, &env);
        let (run_args, run_np, hosts) =
            attempt_layout(&args, np, min_np, &left_out, &signals, last_code, &agent);
        let per_host: Vec<usize> = hosts.iter().map(|&(_, slots)| slots).collect();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = threads_per_rank(
            &run_args,
            run_np,
            cores,
            &per_host,
            std::env::var("RAYON_NUM_THREADS").ok(),
        );
        let mut plan = plan(
            &run_args,
            run_np,
            root,
            &threads,
            &env,
            &mpi_args,
            &nic::local_addresses(),
        )
        .unwrap_or_else(|e| fail(&e));
        // Every rank learns the run it belongs to (written into its commits) and,
        // with restarts, which attempt it is part of; before mpirun's own arguments
        // and the program.
        let at = plan.argv.len() - mpi_args.len() - args.command.len();
        let mut ours = vec!["-x".to_string(), format!("KOLO_RUN_ID={run_id}")];
        if args.max_restarts > 0 {
            ours.extend(["-x".to_string(), format!("KOLO_RESTART_COUNT={attempt}")]);
        }
        plan.argv.splice(at..at, ours);
        if attempt == 0 {
            for n in &plan.notes {
                eprintln!("{n}");
            }
        }
        if args.dry_run {
            println!("{}", command_line(&plan));
            return;
        }
        if args.verbose {
            eprintln!("kolorun: {}", command_line(&plan));
        }
        let unreachable = reach_hosts(&args, &hosts, &mpi_args, &env);
        if !unreachable.is_empty() {
            // Only with restarts: without them reach_hosts has ended kolorun.
            eprintln!(
                "kolorun: leaving out host(s) that do not answer: {}",
                unreachable.join(", ")
            );
            left_out.extend(unreachable);
            continue;
        }
        stop_if_signalled(&signals);
        let began = std::time::Instant::now();
        let ended = run_attempt(&plan, &signals);
        if run_args.hostfile != args.hostfile {
            // The filtered copy made for this attempt.
            if let Some(copy) = &run_args.hostfile {
                let _ = std::fs::remove_file(copy);
            }
        }
        if ended.code == 0 || ended.signalled || args.max_restarts == 0 {
            std::process::exit(ended.code);
        }
        last_code = Some(ended.code);
        let why = why_failed(&ended);
        if !args.restart_on_error && elastic::relaunch_reason(&ended).is_none() {
            eprintln!(
                "kolorun: attempt {} of {attempts} failed with the program's own error (exit code {}){why}; not relaunched (only ranks killed by a signal, kolo's exit status {}, lost or unstarted daemons are; --restart-on-error relaunches on any failure)",
                attempt + 1,
                ended.code,
                kolo::RESTARTABLE_EXIT_CODE
            );
            std::process::exit(ended.code);
        }
        attempt += 1;
        if attempt >= attempts {
            eprintln!(
                "kolorun: attempt {attempts} of {attempts} failed (exit code {}){why}; no restarts left (--max-restarts {})",
                ended.code, args.max_restarts
            );
            std::process::exit(ended.code);
        }
        let next = leave_out(&args, &ended, &hosts, &mut left_out, (np, min_np));
        quick_failures = if began.elapsed() < QUICK_FAILURE && supervise::daemons_failed(&ended) {
            quick_failures + 1
        } else {
            0
        };
        let wait = backoff(quick_failures);
        let waiting = if wait.is_zero() {
            String::new()
        } else {
            format!(
                "; waiting {} s (mpirun could not start its daemons {quick_failures} times in a row)",
                wait.as_secs()
            )
        };
        eprintln!(
            "kolorun: attempt {attempt} of {attempts} failed (exit code {}){why}{next}{waiting}; relaunching (KOLO_RESTART_COUNT={attempt})",
            ended.code
        );
        pause(wait, &signals);
    }
}

/// An attempt whose daemons could not be started within this long of its start
/// counts towards [`backoff`] (a host's link down; not a rank killed a moment after a
/// relaunch, which is relaunched at once).
const QUICK_FAILURE: std::time::Duration = std::time::Duration::from_secs(10);

/// How long kolorun waits before relaunching after `quick` attempts in a row whose
/// daemons could not be started: at once after the first, then 1, 2, 4, 8 and at
/// most 16 s (issue 54: a host cut off for 10 s made mpirun fail to start its daemons
/// 26 times in a row, a quarter of `--max-restarts 100` gone in seconds).
fn backoff(quick: u32) -> std::time::Duration {
    match quick {
        0 | 1 => std::time::Duration::ZERO,
        n => std::time::Duration::from_secs(1 << (n - 2).min(4)),
    }
}

/// Waits `wait`, acting on a signal meanwhile (as between attempts).
fn pause(wait: std::time::Duration, signals: &Signals) {
    let until = std::time::Instant::now() + wait;
    while std::time::Instant::now() < until {
        stop_if_signalled(signals);
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Runs one attempt's mpirun (`plan`) under supervision until it ends; ends kolorun
/// with 127 when mpirun cannot be started.
fn run_attempt(plan: &command::Plan, signals: &Signals) -> supervise::Ended {
    let mut cmd = Command::new("mpirun");
    cmd.args(&plan.argv);
    for u in &plan.unset {
        cmd.env_remove(u);
    }
    match supervise_job(cmd, ABORT_GRACE, std::io::stderr(), signals) {
        Ok(e) => e,
        Err(e) => {
            eprintln!(
                "kolorun: cannot run mpirun: {e} (install OpenMPI: apt-get install openmpi-bin)"
            );
            std::process::exit(127);
        }
    }
}

/// The end of kolorun's line about a failed attempt: the job's lines that say which
/// rank failed and why, and whether kolorun had to end mpirun.
fn why_failed(ended: &supervise::Ended) -> String {
    let mut why = if ended.cause.is_empty() {
        String::new()
    } else {
        format!(": {}", ended.cause.join(" | "))
    };
    if ended.hung {
        why.push_str(" (mpirun did not end after the job was aborted; kolorun ended it)");
    }
    why
}

/// After a failed attempt on `hosts`: leaves the failed host out of the next attempt
/// (`left_out`) when it is named (mpirun names the node of a rank that died; kolo's
/// watchdog, the rank that stopped answering: a host cut off), is not rank 0's (unless
/// `--shared-checkpoints`) and enough ranks (`np`, at least `min_np`) remain. Returns
/// what was done, for kolorun's line about the attempt.
fn leave_out(
    args: &Args,
    ended: &supervise::Ended,
    hosts: &[(String, usize)],
    left_out: &mut Vec<String>,
    (np, min_np): (u32, u32),
) -> String {
    let named =
        elastic::failed_host(&ended.cause).or_else(|| elastic::silent_host(&ended.watchdog, hosts));
    let Some(named) = named else {
        return String::new();
    };
    let host = hosts
        .iter()
        .map(|(h, _)| h)
        .find(|h| elastic::same_host(&named, h));
    let Some(h) = host.filter(|h| !left_out.contains(h)) else {
        return String::new();
    };
    let mut without = left_out.clone();
    without.push(h.clone());
    let rank0 = hosts.first().is_some_and(|(first, _)| first == h);
    if rank0 && !args.shared_checkpoints {
        format!(
            "; keeping host {h}, rank 0's (its checkpoints may be on its own disk; \
             --shared-checkpoints lets kolorun leave it out)"
        )
    } else if let Err(e) = elastic::next_layout(hosts, &without, np, min_np) {
        format!("; relaunching on every host (leaving {h} out: {e})")
    } else {
        *left_out = without;
        format!("; leaving host {h} out")
    }
}

/// The run's identity, the same for every attempt, which each rank writes into its
/// commits: `kolo::run_id` (the user's `KOLO_RUN_ID`, else the Slurm job's, which a
/// requeued job keeps), else made here from this host, kolorun's pid and the time.
fn run_identity() -> String {
    kolo::run_id().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let host = hosts::this_host();
        let host = if host.is_empty() { "host".into() } else { host };
        format!("kolorun-{host}-{}-{secs}", std::process::id())
    })
}

/// Ends kolorun with 128 + the signal when one that ends the job arrived while no
/// job runs (between attempts, during host checks or discovery): a job the user
/// ended is not relaunched.
fn stop_if_signalled(signals: &Signals) {
    if let Some(r) = signals.ending() {
        eprintln!(
            "kolorun: signal {} received; not starting another attempt",
            r.signal
        );
        std::process::exit(128 + r.signal);
    }
}

/// Inside a Slurm allocation, takes what the user left out from it: -np from the task
/// count, -H from its nodes (unless it is this machine alone), saying so on stderr.
fn from_slurm(args: &mut Args) {
    let hosts_given =
        args.hosts.is_some() || args.hostfile.is_some() || args.host_discovery_script.is_some();
    if args.np.is_some() && hosts_given {
        return;
    }
    let alloc = match slurm::allocation(&|k| std::env::var(k).ok(), &slurm::scontrol_hostnames) {
        Ok(Some(a)) => a,
        Ok(None) => return,
        // Inside an allocation kolorun cannot read: mpirun would place the ranks on its
        // nodes while kolorun kept traffic on this machine; say why instead.
        Err(e) => fail(&e),
    };
    let mut took = Vec::new();
    if args.np.is_none() {
        args.np = Some(alloc.ntasks);
        took.push(format!("-np {}", alloc.ntasks));
    }
    let this = hosts::this_host();
    let local = matches!(alloc.hosts.as_slice(),
        [(h, _)] if elastic::same_host(h, &this) || h == "localhost");
    if !hosts_given && !local {
        let flag = elastic::hosts_flag(&alloc.hosts);
        took.push(format!("-H {flag}"));
        args.hosts = Some(flag);
    }
    if !took.is_empty() {
        eprintln!(
            "kolorun: inside Slurm job {}: {}",
            alloc.job,
            took.join(" ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::*;
    use crate::hosts::{flag_hosts, hostfile_hosts};

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        let argv = std::iter::once("kolorun")
            .chain(argv.iter().copied())
            .map(String::from);
        Args::try_parse_from(normalize(argv))
    }

    /// The plan on a machine with no network interfaces.
    fn plan_here(
        a: &Args,
        np: u32,
        root: bool,
        threads: &str,
        env: &[(String, String)],
        mpi_args: &[String],
    ) -> Plan {
        plan(a, np, root, threads, env, mpi_args, &[]).unwrap()
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn issue54_quick_failures_in_a_row_back_off() {
        let secs: Vec<u64> = (0..9).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [0, 0, 1, 2, 4, 8, 16, 16, 16]);
    }

    #[test]
    fn flags_become_kolo_variables_and_mpirun_options() {
        let a = parse(&[
            "-np",
            "4",
            "-H",
            "a:2,b:2",
            "--oversubscribe",
            "--fusion-threshold-mb",
            "16",
            "--cycle-time-ms",
            "0.5",
            "--timeline-filename",
            "/tmp/t-{rank}.json",
            "--log-level",
            "debug",
            "--collective-timeout-seconds",
            "20",
            "--hierarchical-allreduce",
            "--hierarchical-allgather",
            "./train",
            "--epochs",
            "3",
        ])
        .unwrap();
        let line = plan_here(&a, 4, true, "3", &[], &[]).argv.join(" ");
        assert!(
            line.starts_with(
                "-np 4 -H a:2,b:2 --allow-run-as-root --oversubscribe --bind-to none --tag-output"
            ),
            "{line}"
        );
        assert!(line.contains("-x KOLO_FUSION_THRESHOLD=16777216"), "{line}");
        assert!(line.contains("-x KOLO_CYCLE_TIME=0.5"), "{line}");
        assert!(
            line.contains("-x KOLO_TIMELINE=/tmp/t-{rank}.json"),
            "{line}"
        );
        assert!(line.contains("-x KOLO_LOG_LEVEL=debug"), "{line}");
        assert!(
            line.contains("-x KOLO_COLLECTIVE_TIMEOUT_SECONDS=20"),
            "{line}"
        );
        assert!(line.contains("-x KOLO_HIERARCHICAL_ALLREDUCE=1"), "{line}");
        assert!(line.contains("-x KOLO_HIERARCHICAL_ALLGATHER=1"), "{line}");
        assert!(line.ends_with("./train --epochs 3"), "{line}");
        assert!(line.contains("-x RAYON_NUM_THREADS=3"), "{line}");
        assert!(!plan_here(&a, 4, false, "1", &[], &[])
            .argv
            .contains(&"--allow-run-as-root".to_string()));
        // Threads per rank: cores ÷ the most ranks on one node, the user's value, or the flag.
        assert_eq!(threads_per_rank(&a, 4, 16, &[2, 2], None), "8");
        assert_eq!(threads_per_rank(&a, 4, 1, &[2, 2], None), "1");
        let local = parse(&["-np", "3", "x"]).unwrap();
        assert_eq!(threads_per_rank(&local, 3, 16, &[], None), "5");
        assert_eq!(threads_per_rank(&local, 3, 16, &[], Some("2".into())), "2");
        let flag = parse(&["-np", "3", "--threads-per-rank", "4", "x"]).unwrap();
        assert_eq!(threads_per_rank(&flag, 3, 16, &[], Some("2".into())), "4");
    }

    #[test]
    fn hosts_and_hostfiles_give_slots_per_host() {
        let pairs = |v: &[(&str, usize)]| -> Vec<(String, usize)> {
            v.iter().map(|&(h, n)| (h.to_string(), n)).collect()
        };
        assert_eq!(
            flag_hosts("a:2,b:3,c"),
            Ok(pairs(&[("a", 2), ("b", 3), ("c", 1)]))
        );
        let text = "# cluster\nnode1 slots=4\n\nnode2 slots=2 # small\nnode3\n";
        assert_eq!(
            hostfile_hosts(text),
            Ok(vec![
                ("node1".to_string(), Some(4)),
                ("node2".to_string(), Some(2)),
                ("node3".to_string(), None),
            ])
        );
        let a = parse(&["-np", "8", "--hostfile", "hosts.txt", "x"]).unwrap();
        assert_eq!(threads_per_rank(&a, 8, 16, &[4, 2, 1], None), "4");
        let line = plan_here(&a, 8, false, "4", &[], &[]).argv.join(" ");
        assert!(line.starts_with("-np 8 --hostfile hosts.txt "), "{line}");
        let e = parse(&["-np", "2", "-H", "a:1", "--hostfile", "h", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--hostfile") && e.contains("--hosts"), "{e}");
    }

    #[test]
    fn one_machine_stays_on_loopback() {
        let a = parse(&["-np", "2", "x"]).unwrap();
        let line = plan_here(&a, 2, false, "1", &[], &[]).argv.join(" ");
        assert!(
            line.contains("--mca btl self,vader --mca oob_tcp_if_include lo"),
            "{line}"
        );
        assert!(!line.contains("START_TIMEOUT"), "{line}");
        // The user's own settings win, from the environment or --mpi-args.
        let e = env(&[("OMPI_MCA_btl", "self,vader,tcp")]);
        let mpi = [
            "--mca".to_string(),
            "oob_tcp_if_include".into(),
            "eth1".into(),
        ];
        let line = plan_here(&a, 2, false, "1", &e, &mpi).argv.join(" ");
        assert!(!line.contains("--mca btl "), "{line}");
        assert!(!line.contains("oob_tcp_if_include lo"), "{line}");
        assert!(line.ends_with("--mca oob_tcp_if_include eth1 x"), "{line}");
    }

    #[test]
    fn across_hosts_single_machine_settings_are_dropped_and_the_environment_forwarded() {
        let a = parse(&[
            "-np",
            "4",
            "-H",
            "h1:2,h2:2",
            "--network-interface",
            "eth0",
            "--start-timeout",
            "12",
            "x",
        ])
        .unwrap();
        let e = env(&[
            ("OMPI_MCA_btl", "self,vader"),
            ("OMPI_MCA_oob_tcp_if_include", "lo"),
            ("OMPI_MCA_rmaps_base_oversubscribe", "1"),
            ("OMPI_MCA_btl_tcp_if_include", "10.0.0.0/24"),
            ("DATA_DIR", "/data"),
            ("PATH", "/usr/bin"),
            ("HOSTNAME", "h1"),
            ("AWS_SECRET_KEY", "s"),
            ("AWS_SESSION_TOKEN", "t"),
            ("SSH_AUTH_SOCK", "/tmp/agent"),
            ("CUDA_VISIBLE_DEVICES", "3"),
            ("KOLO_TEST_CASE", "c"),
            ("LC_ALL", "C.UTF-8"),
            ("BASH_FUNC_f%%", "() { :; }"),
            ("RAYON_NUM_THREADS", "7"),
        ]);
        let p = plan_here(&a, 4, false, "1", &e, &[]);
        assert_eq!(p.unset, ["OMPI_MCA_btl", "OMPI_MCA_oob_tcp_if_include"]);
        assert!(
            p.notes[0].contains("OMPI_MCA_btl=self,vader"),
            "{:?}",
            p.notes
        );
        let line = p.argv.join(" ");
        for want in [
            "--mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 -x NCCL_SOCKET_IFNAME=eth0",
            "-x KOLO_START_TIMEOUT=12",
            "-x KOLO_TEST_CASE -x LC_ALL -x PATH",
            "-x RAYON_NUM_THREADS=1",
        ] {
            assert!(line.contains(want), "{want:?} missing from {line}");
        }
        // Issue 53 item 17: an allow-list, not the whole environment.
        for never in [
            "-x HOSTNAME",
            "SECRET",
            "AWS_SESSION_TOKEN",
            "SSH_AUTH_SOCK",
            "CUDA_VISIBLE_DEVICES",
            "DATA_DIR",
            "BASH_FUNC",
            "-x OMPI",
            "-x RAYON_NUM_THREADS ",
            "--mca btl self",
        ] {
            assert!(!line.contains(never), "{never:?} in {line}");
        }
        let cmd = command_line(&p);
        assert!(
            cmd.starts_with("env -u OMPI_MCA_btl -u OMPI_MCA_oob_tcp_if_include mpirun -np 4 "),
            "{cmd}"
        );
        // Anything else is forwarded when named, as mpirun's -x.
        let named = parse(&[
            "-np",
            "4",
            "-H",
            "h1:2,h2:2",
            "-x",
            "DATA_DIR",
            "-x",
            "MODE=fast",
            "x",
        ])
        .unwrap();
        let line = plan_here(&named, 4, false, "1", &e, &[]).argv.join(" ");
        assert!(line.contains("-x DATA_DIR -x MODE=fast"), "{line}");
        assert_eq!(line.matches("DATA_DIR").count(), 1, "{line}");
        let bad = parse(&["-np", "2", "-x", "a b", "x"]).unwrap();
        let e = plan(&bad, 2, false, "1", &[], &[], &[])
            .map(|_| ())
            .unwrap_err();
        assert!(e.contains("is not a variable name"), "{e}");
        // The default start-up deadline across hosts is horovodrun's 30 s.
        let b = parse(&["-np", "2", "-H", "a,b", "x"]).unwrap();
        let line = plan_here(&b, 2, false, "1", &[], &[]).argv.join(" ");
        assert!(line.contains("-x KOLO_START_TIMEOUT=30"), "{line}");
        assert!(single_machine_setting("OMPI_MCA_btl", "vader,self"));
        assert!(!single_machine_setting("OMPI_MCA_btl", "^openib"));
        assert!(!single_machine_setting(
            "OMPI_MCA_oob_tcp_if_include",
            "eth0"
        ));
        assert!(single_machine_setting(
            "OMPI_MCA_btl_tcp_if_include",
            "127.0.0.1"
        ));
    }

    #[test]
    fn bad_values_name_the_flag() {
        let e = parse(&["-np", "2", "--cycle-time-ms", "-1", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--cycle-time-ms"), "{e}");
        let e = parse(&["-np", "0", "x"]).unwrap_err().to_string();
        assert!(e.contains("--num-proc"), "{e}");
        let a = parse(&["-np", "2", "prog", "-np", "5"]).unwrap();
        assert_eq!(
            a.command,
            ["prog", "-np", "5"],
            "a later -np belongs to the program"
        );
        let e = parse(&["-np", "2", "--log-level", "loud", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--log-level"), "{e}");
        let e = parse(&["-np", "2", "--fusion-threshold-mb", "lots", "x"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--fusion-threshold-mb"), "{e}");
    }

    #[test]
    fn issue31_the_programs_own_np_is_left_alone() {
        for argv in [
            &["-n", "1", "prog", "-np", "8"][..],
            &["--num-proc", "1", "prog", "-np", "8"],
            &["--np=1", "prog", "-np", "8"],
            &["-np=1", "prog", "-np", "8"],
            &["-vn", "1", "prog", "-np", "8"],
            &["-n", "1", "--mpi-args", "-np 3", "prog", "-np", "8"],
            &["-n", "1", "-H", "a:1", "--verbose", "prog", "-np", "8"],
            &["-n", "1", "--", "prog", "-np", "8"],
        ] {
            let a = parse(argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
            assert_eq!(a.np, Some(1), "{argv:?}");
            assert_eq!(a.command, ["prog", "-np", "8"], "{argv:?}");
        }
        assert_eq!(
            normalize(["kolorun", "-np", "2", "prog", "-np", "8"].map(String::from)),
            ["kolorun", "--np", "2", "prog", "-np", "8"]
        );
        // `-np` as another flag's value is that value.
        let a = parse(&["-np", "2", "--timeline-filename", "-np", "prog"]).unwrap();
        assert_eq!(a.timeline_filename.as_deref(), Some("-np"));
    }

    /// Options kolorun knows, each with a valid value where it takes one, each at most
    /// once, the number of processes in any of its spellings.
    fn kolorun_options() -> impl proptest::strategy::Strategy<Value = Vec<String>> {
        use proptest::prelude::*;
        let np: &[&[&str]] = &[&["-np", "2"], &["-n", "3"], &["--np=4"], &["-np=4"]];
        let others: &[&[&str]] = &[
            &["-v"],
            &["--oversubscribe"],
            &["-H", "a:1,b"],
            &["--mpi-args", "--mca btl tcp -np 9"],
            &["--cycle-time-ms", "0.5"],
            &["--fusion-threshold-mb=8"],
            &["--timeline-filename", "-np"],
            &["--log-level", "info"],
            &["--threads-per-rank", "2"],
        ];
        (
            proptest::option::of(proptest::sample::select(np)),
            proptest::sample::subsequence(others, 0..5).prop_shuffle(),
        )
            .prop_map(|(np, others)| {
                np.into_iter()
                    .chain(others)
                    .flat_map(|w| w.iter().map(|s| s.to_string()))
                    .collect()
            })
    }

    proptest::proptest! {
        // kolorun's options, then a program and its arguments (any words, `-np` and
        // kolorun's own flags among them): the program's part comes back unchanged.
        #[test]
        fn the_program_and_its_arguments_pass_unchanged(
            ours in kolorun_options(),
            tail in proptest::collection::vec(
                "-np|--np|-n|--|-H|-v|--verbose|[-a-z0-9=.]{0,6}", 0..6),
        ) {
            let mut argv = vec!["kolorun".to_string()];
            argv.extend(ours);
            argv.push("prog".into());
            argv.extend(tail.iter().cloned());
            let a = Args::try_parse_from(normalize(argv.clone()));
            let a = a.map_err(|e| proptest::test_runner::TestCaseError::fail(format!("{argv:?}: {e}")))?;
            let mut want = vec!["prog".to_string()];
            want.extend(tail);
            proptest::prop_assert_eq!(a.command, want);
        }

        // Any words at all: a value or clap's error, never a panic; the normalised
        // words differ from the given ones only where `-np` became `--np`.
        #[test]
        fn any_arguments_parse_or_fail_cleanly(
            words in proptest::collection::vec("-np|-np=[0-9]|-[a-zA-Z]{1,3}|--[a-z-]{1,12}(=[a-z0-9]{0,3})?|[a-z0-9:,.]{0,5}", 0..8),
        ) {
            let argv: Vec<String> = std::iter::once("kolorun".to_string()).chain(words).collect();
            let normal = normalize(argv.clone());
            proptest::prop_assert_eq!(normal.len(), argv.len());
            for (n, a) in normal.iter().zip(&argv) {
                proptest::prop_assert!(n == a || (n.starts_with("--np") && a.starts_with("-np")));
            }
            let _ = Args::try_parse_from(normal);
        }
    }

    #[test]
    fn issue31_a_subnet_is_given_to_open_mpi_as_is_and_to_nccl_as_an_interface() {
        let a = parse(&[
            "-np",
            "2",
            "-H",
            "a,b",
            "--network-interface",
            "10.0.0.0/24",
            "x",
        ])
        .unwrap();
        let here = [("eth1".to_string(), "10.0.0.5".parse().unwrap())];
        let p = plan(&a, 2, false, "1", &[], &[], &here).unwrap();
        let line = p.argv.join(" ");
        assert!(
            line.contains(
                "--mca btl_tcp_if_include 10.0.0.0/24 --mca oob_tcp_if_include 10.0.0.0/24 \
                 -x NCCL_SOCKET_IFNAME=eth1 "
            ),
            "{line}"
        );
        assert!(
            p.notes.iter().any(|n| n.contains("gets eth1")),
            "{:?}",
            p.notes
        );
        // Not on this machine: NCCL is not told (it takes names), the user is.
        let p = plan(
            &a,
            2,
            false,
            "1",
            &env(&[("NCCL_SOCKET_IFNAME", "ib0")]),
            &[],
            &[],
        )
        .unwrap();
        let line = p.argv.join(" ");
        assert!(
            !line.contains("NCCL_SOCKET_IFNAME=") && line.contains("-x NCCL_SOCKET_IFNAME "),
            "{line}"
        );
        assert!(
            p.notes
                .iter()
                .any(|n| n.contains("no interface of this machine")),
            "{:?}",
            p.notes
        );
        let bad = parse(&["-np", "2", "--network-interface", "10.0.0.0/40", "x"]).unwrap();
        let e = plan(&bad, 2, false, "1", &[], &[], &here).unwrap_err();
        assert!(
            e.contains("\"10.0.0.0/40\": the prefix length must be 0 to 32"),
            "{e}"
        );
    }

    #[test]
    fn issue31_help_says_what_cycle_time_and_the_thread_default_mean() {
        use clap::CommandFactory;
        let help = Args::command().render_long_help().to_string();
        assert!(
            help.contains("between negotiation cycles while a rank only waits for the others'")
                && help.contains("new local work starts a cycle at once"),
            "{help}"
        );
        assert!(
            help.contains("the cores of the machine kolorun runs on"),
            "{help}"
        );
    }

    #[test]
    fn quoting_for_dry_run() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("KOLO_X=1"), "KOLO_X=1");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        // Issue 53 item 17: braces would be expanded by a shell.
        assert_eq!(shell_quote("a{b,c}"), "'a{b,c}'");
        assert_eq!(shell_quote("h1:2,h2:2"), "h1:2,h2:2");
    }
}
