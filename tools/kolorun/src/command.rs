//! The mpirun command kolorun runs: the `KOLO_*` variables the flags set, the
//! environment forwarded to other hosts, and mpirun's arguments.

use std::collections::BTreeSet;

use crate::args::Args;
use crate::nic;

/// The `KOLO_*` variables the flags set.
pub(crate) fn kolo_env(a: &Args) -> Vec<(String, String)> {
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
pub(crate) fn threads_per_rank(
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

/// Whether kolorun forwards variable `name` to remote ranks by itself: an allow-list
/// of what a training job reads (kolo's and Horovod's settings, Rust's, the thread
/// pools', NCCL's and CUDA's, locale and search paths). Everything else — credentials
/// (`AWS_*`, tokens), `SSH_AUTH_SOCK`, this launcher's `CUDA_VISIBLE_DEVICES` (each
/// host has its own devices), OpenMPI's own — stays here unless named with `-x`.
pub(crate) fn forwardable(name: &str) -> bool {
    const PREFIXES: [&str; 11] = [
        "KOLO_",
        "HOROVOD_",
        "RUST_",
        "RAYON_",
        "NCCL_",
        "CUDA_",
        "OMP_",
        "MKL_",
        "OPENBLAS_",
        "BURN_",
        "CUBECL_",
    ];
    const NAMES: [&str; 6] = [
        "PATH",
        "LD_LIBRARY_PATH",
        "LANG",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
    ];
    valid_name(name)
        && name != "CUDA_VISIBLE_DEVICES"
        && (PREFIXES.iter().any(|p| name.starts_with(p))
            || name.starts_with("LC_")
            || NAMES.contains(&name))
}

/// A variable name a shell and mpirun's `-x` take: letters, digits and `_`, not a
/// digit first.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
}

/// An inherited OpenMPI setting that confines a job to one machine (what kolo's
/// scripts and tests use): only loopback interfaces, or transports without TCP.
pub(crate) fn single_machine_setting(name: &str, value: &str) -> bool {
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
pub(crate) struct Plan {
    pub(crate) argv: Vec<String>,
    pub(crate) unset: Vec<String>,
    pub(crate) notes: Vec<String>,
}

/// Plans the launch of `np` ranks: `root` whether we run as root, `threads` the
/// compute threads per rank, `env` kolorun's environment, `mpi_args` the split
/// `--mpi-args`, `local` this machine's interfaces and addresses (for a subnet in
/// `--network-interface`, see [`nic::nccl_interfaces`]).
///
/// # Errors
/// A `--network-interface` entry that is neither an interface name nor a subnet.
pub(crate) fn plan(
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
    place_traffic(&mut p, a, spans_hosts, env, mpi_args);
    let v = &mut p.argv;
    let mut ours = kolo_env(a);
    // OpenMPI's own start-up timeout does not fire while a host's daemon hangs, so
    // the ranks time their start themselves.
    let start = a.start_timeout.or(spans_hosts.then_some(30));
    if let Some(t) = start {
        ours.push(("KOLO_START_TIMEOUT".into(), t.to_string()));
    }
    let mut named: BTreeSet<String> = ours.iter().map(|(k, _)| k.clone()).collect();
    // The user's `-x` entries: forwarded as given, on one machine and across hosts.
    let mut asked = Vec::new();
    for e in &a.env {
        let name = e.split_once('=').map_or(e.as_str(), |(n, _)| n);
        if !valid_name(name) {
            return Err(format!(
                "-x {e:?}: {name:?} is not a variable name (letters, digits and _)"
            ));
        }
        named.insert(name.to_string());
        asked.push(e.clone());
    }
    named.insert("RAYON_NUM_THREADS".into());
    if nccl_ifname.is_some() {
        named.insert("NCCL_SOCKET_IFNAME".into());
    }
    for (k, val) in ours {
        v.extend(["-x".into(), format!("{k}={val}")]);
    }
    v.extend(["-x".into(), format!("RAYON_NUM_THREADS={threads}")]);
    for e in asked {
        v.extend(["-x".into(), e]);
    }
    if spans_hosts {
        forward_env(&mut p, env, &named);
    }
    let v = &mut p.argv;
    v.extend(mpi_args.iter().cloned());
    v.extend(a.command.iter().cloned());
    Ok(p)
}

/// Where the job's traffic goes: across hosts, settings inherited from a one-machine
/// set-up are not passed on (they would make the ranks on other hosts unreachable:
/// MPI_ERR_INTERN during init); on one machine, traffic stays on it unless the user
/// said otherwise.
fn place_traffic(
    p: &mut Plan,
    a: &Args,
    spans_hosts: bool,
    env: &[(String, String)],
    mpi_args: &[String],
) {
    let set_in_env = |k: &str| env.iter().any(|(n, _)| n == k);
    let in_mpi_args = |k: &str| mpi_args.iter().any(|x| x == k);
    let v = &mut p.argv;
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
}

/// Forwards the user's environment by name to remote ranks, which start from a bare
/// one (as horovodrun does; mpirun takes the values from its own), except what kolorun
/// sets (`named`) or leaves out.
fn forward_env(p: &mut Plan, env: &[(String, String)], named: &BTreeSet<String>) {
    // Remote ranks start from a bare environment: forward the user's, as
    // horovodrun does (by name; mpirun takes the values from its own).
    let forwarded: BTreeSet<&str> = env
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| forwardable(k) && !named.contains(*k) && !p.unset.iter().any(|u| u == k))
        .collect();
    for k in forwarded {
        p.argv.extend(["-x".into(), k.to_string()]);
    }
}

pub(crate) fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            // Not `{` or `}`: a shell expands `a{b,c}` into two words.
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The exact command line of a plan, as a shell would run it.
pub(crate) fn command_line(p: &Plan) -> String {
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

/// Adds `--mca k val` to mpirun's arguments `v`.
fn mca(v: &mut Vec<String>, k: &str, val: &str) {
    v.extend(["--mca".into(), k.into(), val.into()]);
}
