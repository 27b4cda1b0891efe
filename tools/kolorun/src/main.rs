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

mod hosts;
mod nic;
mod supervise;

use std::collections::BTreeSet;
use std::process::Command;

use clap::Parser;

use hosts::{check_hosts, flag_hosts, hostfile_hosts, remote_agent};
use supervise::{catch_signals, supervise, ABORT_GRACE};

#[derive(Parser, Debug)]
#[command(
    name = "kolorun",
    version,
    about = "Run a kolo program on N processes with mpirun"
)]
struct Args {
    /// Number of processes.
    #[arg(short = 'n', long = "num-proc", visible_alias = "np", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    np: Option<u32>,

    /// Hosts and slots, e.g. host1:2,host2:2 or [fe80::1]:2 (default: this machine).
    #[arg(
        short = 'H',
        long = "hosts",
        value_name = "HOSTS",
        conflicts_with = "hostfile"
    )]
    hosts: Option<String>,

    /// OpenMPI hostfile: one host per line, `host slots=N [max_slots=M]`, `#` comments.
    #[arg(long, value_name = "FILE")]
    hostfile: Option<String>,

    /// Network interface(s) for traffic between hosts, e.g. eth0 or eth0,eth1 (or a
    /// subnet, 10.0.0.0/24): pins OpenMPI's control and TCP data traffic and NCCL's
    /// sockets to it (NCCL takes names: a subnet becomes this machine's interface in
    /// it). Needed where every host has an interface with the same address (a docker
    /// bridge), on which OpenMPI otherwise hangs while connecting.
    #[arg(long, value_name = "NICS")]
    network_interface: Option<String>,

    /// Seconds every rank waits for MPI to start on all ranks before it fails naming
    /// itself (`KOLO_START_TIMEOUT`). Default 30 for jobs across hosts.
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u32).range(1..))]
    start_timeout: Option<u32>,

    /// More mpirun arguments, as one string (split like a shell would), e.g.
    /// "--mca btl_tcp_links 2 --map-by node".
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    mpi_args: Option<String>,

    /// Print the mpirun command and what kolorun decided before running it.
    #[arg(short = 'v', long)]
    verbose: bool,

    /// Allow more processes than cores.
    #[arg(long)]
    oversubscribe: bool,

    /// Fusion buffer threshold in MiB (0 disables fusion).
    #[arg(long, value_name = "MB")]
    fusion_threshold_mb: Option<u64>,

    /// Milliseconds between negotiation cycles while a rank only waits for the others'
    /// submissions; new local work starts a cycle at once (`KOLO_CYCLE_TIME`,
    /// default 1).
    #[arg(long, value_name = "MS", value_parser = positive_f64)]
    cycle_time_ms: Option<f64>,

    /// Response cache entries (0 disables the cache).
    #[arg(long, value_name = "N")]
    cache_capacity: Option<u64>,

    /// Write a Chrome trace; `{rank}` in the name gives one file per rank.
    #[arg(long, value_name = "FILE")]
    timeline_filename: Option<String>,

    /// Mark each engine cycle on the timeline.
    #[arg(long)]
    timeline_mark_cycles: bool,

    /// Tune the fusion threshold, cycle time, response cache and (across hosts with
    /// equal ranks per host) hierarchical allreduce and allgather at run time: those not set
    /// explicitly.
    #[arg(long)]
    autotune: bool,

    /// Write autotune samples to this CSV file.
    #[arg(long, value_name = "FILE")]
    autotune_log_file: Option<String>,

    /// Seconds before a stall warning.
    #[arg(long, value_name = "SECONDS", value_parser = positive_f64)]
    stall_check_warning_time_seconds: Option<f64>,

    /// Seconds of stall before pending ops fail (0: never).
    #[arg(long, value_name = "SECONDS", value_parser = non_negative_f64)]
    stall_check_shutdown_time_seconds: Option<f64>,

    /// Turn the stall inspector off.
    #[arg(long)]
    disable_stall_check: bool,

    /// Allreduce within each host, then across hosts, then within each host again
    /// (only shards cross the network).
    #[arg(long)]
    hierarchical_allreduce: bool,

    /// Allgather within each host, then shares of each host's block across hosts,
    /// then within each host again.
    #[arg(long)]
    hierarchical_allgather: bool,

    /// Seconds an engine may sit in one exchange or collective (a lost host, a
    /// partition) before the job is aborted (0: never; default 300).
    #[arg(long, value_name = "SECONDS", value_parser = non_negative_f64)]
    collective_timeout_seconds: Option<f64>,

    /// Compute threads per rank (`RAYON_NUM_THREADS`, which Burn's CPU backend and
    /// other rayon users follow). Default: `RAYON_NUM_THREADS` if set, else the cores of
    /// the machine kolorun runs on ÷ the most ranks on one host, at least 1; across
    /// hosts with other core counts, set it.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    threads_per_rank: Option<u32>,

    /// kolo's log level.
    #[arg(long, value_name = "LEVEL", value_parser = ["trace", "debug", "info", "warn", "error", "off"])]
    log_level: Option<String>,

    /// Print which transports this build of kolo has, and exit.
    #[arg(long)]
    check_build: bool,

    /// Print the mpirun command instead of running it.
    #[arg(long)]
    dry_run: bool,

    /// The program and its arguments.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    command: Vec<String>,
}

fn positive_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

fn non_negative_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a non-negative number")),
    }
}

/// The `KOLO_*` variables the flags set.
fn kolo_env(a: &Args) -> Vec<(String, String)> {
    let mut env = Vec::new();
    let mut set = |k: &str, v: String| env.push((format!("KOLO_{k}"), v));
    if let Some(mb) = a.fusion_threshold_mb {
        set("FUSION_THRESHOLD", (mb << 20).to_string());
    }
    if let Some(ms) = a.cycle_time_ms {
        set("CYCLE_TIME", ms.to_string());
    }
    if let Some(n) = a.cache_capacity {
        set("CACHE_CAPACITY", n.to_string());
    }
    if let Some(f) = &a.timeline_filename {
        set("TIMELINE", f.clone());
    }
    if a.timeline_mark_cycles {
        set("TIMELINE_MARK_CYCLES", "1".into());
    }
    if a.autotune {
        set("AUTOTUNE", "1".into());
    }
    if let Some(f) = &a.autotune_log_file {
        set("AUTOTUNE_LOG", f.clone());
    }
    if let Some(s) = a.stall_check_warning_time_seconds {
        set("STALL_CHECK_TIME_SECONDS", s.to_string());
    }
    if let Some(s) = a.stall_check_shutdown_time_seconds {
        set("STALL_SHUTDOWN_TIME_SECONDS", s.to_string());
    }
    if a.disable_stall_check {
        set("STALL_CHECK_DISABLE", "1".into());
    }
    if a.hierarchical_allreduce {
        set("HIERARCHICAL_ALLREDUCE", "1".into());
    }
    if a.hierarchical_allgather {
        set("HIERARCHICAL_ALLGATHER", "1".into());
    }
    if let Some(s) = a.collective_timeout_seconds {
        set("COLLECTIVE_TIMEOUT_SECONDS", s.to_string());
    }
    if let Some(l) = &a.log_level {
        set("LOG_LEVEL", l.clone());
    }
    env
}

/// Compute threads per rank: the flag, else the user's `RAYON_NUM_THREADS`, else
/// `cores` (of this machine; nodes are assumed alike) ÷ the most ranks on one node
/// (`per_host`: slots of each host, empty for this machine only).
/// Without it every rank's rayon pool takes every core and the ranks fight over them.
fn threads_per_rank(
    a: &Args,
    np: u32,
    cores: usize,
    per_host: &[usize],
    user: Option<String>,
) -> String {
    if let Some(n) = a.threads_per_rank {
        return n.to_string();
    }
    if let Some(v) = user.filter(|v| !v.is_empty()) {
        return v;
    }
    let per_node = per_host
        .iter()
        .copied()
        .max()
        .unwrap_or(np as usize)
        .min(np as usize);
    (cores / per_node.max(1)).max(1).to_string()
}

/// Variables never forwarded to remote ranks: OpenMPI's and PMIx's own (mpirun
/// passes those it should), this shell's bookkeeping, and secrets (as horovodrun).
fn forwardable(name: &str) -> bool {
    let own = ["OMPI_", "PMIX_", "OPAL_", "ORTE_", "BASH_FUNC_"];
    let shell = ["HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "PS1", "TERM"];
    !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && !own.iter().any(|p| name.starts_with(p))
        && !shell.contains(&name)
        && !name.ends_with("_SECRET_KEY")
}

/// An inherited OpenMPI setting that confines a job to one machine (what kolo's
/// scripts and tests use): only loopback interfaces, or transports without TCP.
fn single_machine_setting(name: &str, value: &str) -> bool {
    let loopback = |v: &str| {
        v.split(',')
            .all(|i| i == "lo" || i.starts_with("127.") || i == "::1")
    };
    match name {
        "OMPI_MCA_btl" => !value.starts_with('^') && !value.split(',').any(|b| b == "tcp"),
        "OMPI_MCA_oob_tcp_if_include" | "OMPI_MCA_btl_tcp_if_include" => loopback(value),
        _ => false,
    }
}

/// What to run: mpirun's arguments, variables to remove from its environment, and
/// notes for the user.
#[derive(Debug, Default)]
struct Plan {
    argv: Vec<String>,
    unset: Vec<String>,
    notes: Vec<String>,
}

/// Plans the launch of `np` ranks: `root` whether we run as root, `threads` the
/// compute threads per rank, `env` kolorun's environment, `mpi_args` the split
/// `--mpi-args`, `local` this machine's interfaces and addresses (for a subnet in
/// `--network-interface`, see [`nic::nccl_interfaces`]).
///
/// # Errors
/// A `--network-interface` entry that is neither an interface name nor a subnet.
fn plan(
    a: &Args,
    np: u32,
    root: bool,
    threads: &str,
    env: &[(String, String)],
    mpi_args: &[String],
    local: &[(String, std::net::IpAddr)],
) -> Result<Plan, String> {
    let mut p = Plan::default();
    let v = &mut p.argv;
    v.extend(["-np".to_string(), np.to_string()]);
    let spans_hosts = a.hosts.is_some() || a.hostfile.is_some();
    match (&a.hosts, &a.hostfile) {
        (Some(h), _) => v.extend(["-H".into(), h.clone()]),
        (None, Some(f)) => v.extend(["--hostfile".into(), f.clone()]),
        (None, None) => {}
    }
    if root {
        v.push("--allow-run-as-root".into());
    }
    if a.oversubscribe {
        v.push("--oversubscribe".into());
    }
    v.extend(["--bind-to".into(), "none".into(), "--tag-output".into()]);
    let set_in_env = |k: &str| env.iter().any(|(n, _)| n == k);
    let in_mpi_args = |k: &str| mpi_args.iter().any(|x| x == k);
    let mca = |v: &mut Vec<String>, k: &str, val: &str| {
        v.extend(["--mca".into(), k.into(), val.into()]);
    };
    let mut nccl_ifname = None;
    if let Some(nics) = &a.network_interface {
        // Open MPI takes subnets as they are; NCCL only interface names.
        mca(v, "btl_tcp_if_include", nics);
        mca(v, "oob_tcp_if_include", nics);
        let nccl = nic::nccl_interfaces(nics, local)?;
        p.notes.extend(nccl.notes);
        if let Some(names) = nccl.ifname {
            v.extend(["-x".into(), format!("NCCL_SOCKET_IFNAME={names}")]);
            nccl_ifname = Some(names);
        }
    }
    if spans_hosts {
        // Settings inherited from a single-machine set-up would make the ranks on
        // other hosts unreachable (MPI_ERR_INTERN during init).
        for (k, val) in env {
            if single_machine_setting(k, val) {
                p.unset.push(k.clone());
                p.notes.push(format!(
                    "kolorun: not passing {k}={val} from the environment to a job across hosts (it keeps traffic on one machine)"
                ));
            }
        }
    } else {
        // One machine: keep traffic on it, unless told otherwise.
        if a.network_interface.is_none() {
            if !set_in_env("OMPI_MCA_btl") && !in_mpi_args("btl") {
                mca(v, "btl", "self,vader");
            }
            if !set_in_env("OMPI_MCA_oob_tcp_if_include") && !in_mpi_args("oob_tcp_if_include") {
                mca(v, "oob_tcp_if_include", "lo");
            }
        }
    }
    let mut ours = kolo_env(a);
    // OpenMPI's own start-up timeout does not fire while a host's daemon hangs, so
    // the ranks time their start themselves.
    let start = a.start_timeout.or(spans_hosts.then_some(30));
    if let Some(t) = start {
        ours.push(("KOLO_START_TIMEOUT".into(), t.to_string()));
    }
    let mut named: BTreeSet<String> = ours.iter().map(|(k, _)| k.clone()).collect();
    named.insert("RAYON_NUM_THREADS".into());
    if nccl_ifname.is_some() {
        named.insert("NCCL_SOCKET_IFNAME".into());
    }
    for (k, val) in ours {
        v.extend(["-x".into(), format!("{k}={val}")]);
    }
    v.extend(["-x".into(), format!("RAYON_NUM_THREADS={threads}")]);
    if spans_hosts {
        // Remote ranks start from a bare environment: forward the user's, as
        // horovodrun does (by name; mpirun takes the values from its own).
        let forwarded: BTreeSet<&str> = env
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| forwardable(k) && !named.contains(*k) && !p.unset.iter().any(|u| u == k))
            .collect();
        for k in forwarded {
            v.extend(["-x".into(), k.to_string()]);
        }
    }
    v.extend(mpi_args.iter().cloned());
    v.extend(a.command.iter().cloned());
    Ok(p)
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,{}+@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The exact command line of a plan, as a shell would run it.
fn command_line(p: &Plan) -> String {
    let mut line: Vec<String> = Vec::new();
    if !p.unset.is_empty() {
        line.push("env".into());
        for u in &p.unset {
            line.extend(["-u".into(), shell_quote(u)]);
        }
    }
    line.push("mpirun".into());
    line.extend(p.argv.iter().map(|a| shell_quote(a)));
    line.join(" ")
}

/// `-np` is horovodrun's (and mpirun's) spelling; clap's short flags are one letter,
/// so `-np` (or `-np=N`) among kolorun's own arguments becomes `--np` before parsing.
/// Those end at the program (the first word that is neither an option nor an option's
/// value) or at `--`: everything from there on is the program's and passes unchanged
/// (`kolorun -n 1 prog -np 8` runs `prog -np 8`). Which options take a value is read
/// from clap's own definition of the flags, so the two cannot disagree.
fn normalize(argv: impl IntoIterator<Item = String>) -> Vec<String> {
    use clap::CommandFactory;
    let cmd = Args::command();
    let options: Vec<&clap::Arg> = cmd.get_opts().collect();
    let long_takes_value = |name: &str| {
        options.iter().any(|a| {
            a.get_action().takes_values()
                && (a.get_long() == Some(name)
                    || a.get_all_aliases().is_some_and(|v| v.contains(&name)))
        })
    };
    let short_takes_value = |c: char| {
        options
            .iter()
            .any(|a| a.get_action().takes_values() && a.get_short() == Some(c))
    };
    let mut argv = argv.into_iter();
    let mut out: Vec<String> = argv.next().into_iter().collect();
    let mut value_next = false;
    for a in argv.by_ref() {
        if std::mem::take(&mut value_next) {
            out.push(a);
        } else if a == "--" {
            out.push(a);
            break;
        } else if a == "-np" {
            out.push("--np".into());
            value_next = true;
        } else if let Some(n) = a.strip_prefix("-np=") {
            out.push(format!("--np={n}"));
        } else if let Some(long) = a.strip_prefix("--") {
            value_next = !long.contains('=') && long_takes_value(long);
            out.push(a);
        } else if let Some(shorts) = a.strip_prefix('-').filter(|s| !s.is_empty()) {
            // A cluster such as `-vn 2` or `-vn2`: the first letter taking a value
            // takes the rest of the word, or the next word when the rest is empty.
            if let Some((i, c)) = shorts.char_indices().find(|&(_, c)| short_takes_value(c)) {
                value_next = i + c.len_utf8() == shorts.len();
            }
            out.push(a);
        } else {
            out.push(a);
            break;
        }
    }
    out.extend(argv);
    out
}

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
    let args = Args::parse_from(normalize(std::env::args()));
    if args.check_build {
        check_build();
        return;
    }
    let Some(np) = args.np else {
        fail("-np is required (the number of processes)");
    };
    if args.command.is_empty() {
        fail("no program given; usage: kolorun -np N [options] program [args...]");
    }
    let mpi_args = match &args.mpi_args {
        None => Vec::new(),
        Some(s) => shlex::split(s)
            .unwrap_or_else(|| fail(&format!("--mpi-args {s:?} has an unclosed quote"))),
    };
    let hostfile = args
        .hostfile
        .as_ref()
        .map(|f| match std::fs::read_to_string(f) {
            Ok(text) => match hostfile_hosts(&text) {
                Ok(hosts) if hosts.is_empty() => fail(&format!("--hostfile {f} names no host")),
                Ok(hosts) => hosts,
                Err(e) => fail(&format!("--hostfile {f}: {e}")),
            },
            Err(e) => fail(&format!("cannot read --hostfile {f}: {e}")),
        });
    let hosts = match (&args.hosts, hostfile) {
        (Some(h), _) => flag_hosts(h).unwrap_or_else(|e| fail(&e)),
        (None, Some(hosts)) => hosts,
        (None, None) => Vec::new(),
    };
    let per_host: Vec<usize> = hosts.iter().map(|&(_, slots)| slots).collect();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads_per_rank(
        &args,
        np,
        cores,
        &per_host,
        std::env::var("RAYON_NUM_THREADS").ok(),
    );
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    let plan = plan(
        &args,
        np,
        root,
        &threads,
        &env,
        &mpi_args,
        &nic::local_addresses(),
    )
    .unwrap_or_else(|e| fail(&e));
    for n in &plan.notes {
        eprintln!("{n}");
    }
    if args.dry_run {
        println!("{}", command_line(&plan));
        return;
    }
    if args.verbose {
        eprintln!("kolorun: {}", command_line(&plan));
    }
    let mut names: Vec<String> = hosts.into_iter().map(|(name, _)| name).collect();
    names.dedup();
    if !names.is_empty() {
        let timeout = std::time::Duration::from_secs(args.start_timeout.unwrap_or(30).into());
        let failed = check_hosts(&names, &remote_agent(&mpi_args, &env), timeout);
        if !failed.is_empty() {
            fail(&format!(
                "cannot reach {} of the job's hosts (--start-timeout {} s):\n  {}",
                failed.len(),
                timeout.as_secs(),
                failed.join("\n  ")
            ));
        }
    }
    let mut cmd = Command::new("mpirun");
    cmd.args(&plan.argv);
    for u in &plan.unset {
        cmd.env_remove(u);
    }
    catch_signals();
    match supervise(cmd, ABORT_GRACE, std::io::stderr()) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!(
                "kolorun: cannot run mpirun: {e} (install OpenMPI: apt-get install openmpi-bin)"
            );
            std::process::exit(127);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            Ok(pairs(&[("node1", 4), ("node2", 2), ("node3", 1)]))
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
            "-x DATA_DIR -x PATH",
            "-x RAYON_NUM_THREADS=1",
        ] {
            assert!(line.contains(want), "{want:?} missing from {line}");
        }
        for never in [
            "-x HOSTNAME",
            "SECRET",
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
    }
}
