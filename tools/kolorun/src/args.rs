//! kolorun's command line: the flags (clap) and the normalisation of horovodrun's
//! spellings before parsing.

use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "kolorun",
    version,
    about = "Run a kolo program on N processes with mpirun"
)]
pub(crate) struct Args {
    /// Number of processes.
    #[arg(short = 'n', long = "num-proc", visible_alias = "np", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) np: Option<u32>,

    /// Hosts and slots, e.g. `host1:2,host2:2` or `[fe80::1]:2` (default: this machine).
    #[arg(
        short = 'H',
        long = "hosts",
        value_name = "HOSTS",
        conflicts_with = "hostfile"
    )]
    pub(crate) hosts: Option<String>,

    /// DeepSpeed's launcher: run on the first N hosts of -H/--hostfile.
    #[arg(long = "num_nodes", visible_alias = "num-nodes", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) num_nodes: Option<u32>,
    /// DeepSpeed's launcher: N slots (ranks) on each host (this machine alone: N
    /// ranks here).
    #[arg(long = "num_gpus", visible_alias = "num-gpus", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) num_gpus: Option<u32>,
    /// DeepSpeed's launcher: only these hosts and slots, `host1@host2:0,2` (host2's
    /// slots 0 and 2; a host alone: all its slots).
    #[arg(long, value_name = "HOSTS")]
    pub(crate) include: Option<String>,
    /// DeepSpeed's launcher: all but these hosts or slots (`host1@host2:1`).
    #[arg(long, value_name = "HOSTS")]
    pub(crate) exclude: Option<String>,
    /// OpenMPI hostfile: one host per line, `host slots=N [max_slots=M]`, `#` comments.
    #[arg(long, value_name = "FILE")]
    pub(crate) hostfile: Option<String>,

    /// Network interface(s) for traffic between hosts, e.g. eth0 or eth0,eth1 (or a
    /// subnet, 10.0.0.0/24): pins OpenMPI's control and TCP data traffic and NCCL's
    /// sockets to it (NCCL takes names: a subnet becomes this machine's interface in
    /// it). Needed where every host has an interface with the same address (a docker
    /// bridge), on which OpenMPI otherwise hangs while connecting.
    #[arg(long, value_name = "NICS")]
    pub(crate) network_interface: Option<String>,

    /// Seconds every rank waits for MPI to start on all ranks before it fails naming
    /// itself (`KOLO_START_TIMEOUT`). Default 30 for jobs across hosts.
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) start_timeout: Option<u32>,

    /// Forward this variable to every rank (repeatable; `NAME` with this shell's value,
    /// or `NAME=VALUE`), as mpirun's `-x`. Across hosts kolorun forwards only an
    /// allow-list by itself (KOLO_*, HOROVOD_*, RUST_*, RAYON_*, NCCL_*, CUDA_* but
    /// CUDA_VISIBLE_DEVICES, OMP_*, MKL_*, OPENBLAS_*, BURN_*, CUBECL_*, LC_*, PATH,
    /// LD_LIBRARY_PATH, LANG, TZ, TMPDIR, PYTHONPATH): name anything else here.
    #[arg(short = 'x', long = "env", value_name = "NAME[=VALUE]", action = clap::ArgAction::Append)]
    pub(crate) env: Vec<String>,

    /// Do not check before the launch that every host answers through mpirun's agent
    /// (`agent host true`), e.g. where the agent cannot run such a command.
    #[arg(long)]
    pub(crate) no_host_check: bool,

    /// More mpirun arguments, as one string (split like a shell would), e.g.
    /// "--mca btl_tcp_links 2 --map-by node".
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    pub(crate) mpi_args: Option<String>,

    /// Print the mpirun command and what kolorun decided before running it.
    #[arg(short = 'v', long)]
    pub(crate) verbose: bool,

    /// Allow more processes than cores.
    #[arg(long)]
    pub(crate) oversubscribe: bool,

    /// Fusion buffer threshold in MiB (0 disables fusion).
    #[arg(long, value_name = "MB")]
    pub(crate) fusion_threshold_mb: Option<u64>,

    /// Milliseconds between negotiation cycles while a rank only waits for the others'
    /// submissions; new local work starts a cycle at once (`KOLO_CYCLE_TIME`,
    /// default 1).
    #[arg(long, value_name = "MS", value_parser = positive_f64)]
    pub(crate) cycle_time_ms: Option<f64>,

    /// Response cache entries (0 disables the cache).
    #[arg(long, value_name = "N")]
    pub(crate) cache_capacity: Option<u64>,

    /// Write a Chrome trace; `{rank}` in the name gives one file per rank.
    #[arg(long, value_name = "FILE")]
    pub(crate) timeline_filename: Option<String>,

    /// Mark each engine cycle on the timeline.
    #[arg(long)]
    pub(crate) timeline_mark_cycles: bool,

    /// Tune the fusion threshold, cycle time, response cache and (across hosts with
    /// equal ranks per host) hierarchical allreduce and allgather at run time: those not set
    /// explicitly.
    #[arg(long)]
    pub(crate) autotune: bool,

    /// Write autotune samples to this CSV file.
    #[arg(long, value_name = "FILE")]
    pub(crate) autotune_log_file: Option<String>,

    /// Seconds before a stall warning.
    #[arg(long, value_name = "SECONDS", value_parser = positive_f64)]
    pub(crate) stall_check_warning_time_seconds: Option<f64>,

    /// Seconds of stall before pending ops fail (0: never).
    #[arg(long, value_name = "SECONDS", value_parser = non_negative_f64)]
    pub(crate) stall_check_shutdown_time_seconds: Option<f64>,

    /// Turn the stall inspector off.
    #[arg(long)]
    pub(crate) disable_stall_check: bool,

    /// Allreduce within each host, then across hosts, then within each host again
    /// (only shards cross the network), at every size. Without it kolo does so from
    /// 2 MiB where hosts have the same number (at least two) of ranks.
    #[arg(long)]
    pub(crate) hierarchical_allreduce: bool,

    /// Allgather within each host, then shares of each host's block across hosts,
    /// then within each host again.
    #[arg(long)]
    pub(crate) hierarchical_allgather: bool,

    /// Seconds an engine may sit in one exchange or collective (a lost host, a
    /// partition) before the job is aborted (0: never; default 300).
    #[arg(long, value_name = "SECONDS", value_parser = non_negative_f64)]
    pub(crate) collective_timeout_seconds: Option<f64>,

    /// Compute threads per rank (`RAYON_NUM_THREADS`, which Burn's CPU backend and
    /// other rayon users follow). Default: `RAYON_NUM_THREADS` if set, else the cores of
    /// the machine kolorun runs on ÷ the most ranks on one host, at least 1; across
    /// hosts with other core counts, set it.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) threads_per_rank: Option<u32>,

    /// kolo's log level.
    #[arg(long, value_name = "LEVEL", value_parser = ["trace", "debug", "info", "warn", "error", "off"])]
    pub(crate) log_level: Option<String>,

    /// Print which transports this build of kolo has, and exit.
    #[arg(long)]
    pub(crate) check_build: bool,

    /// Print the mpirun command instead of running it.
    #[arg(long)]
    pub(crate) dry_run: bool,

    /// Relaunch the job when it fails, up to this many times (0: never, as mpirun).
    /// Each rank finds the attempt in `KOLO_RESTART_COUNT` (0 for the first); resume
    /// from the last commit on a relaunch (e.g. `--checkpoint DIR --commit-every K`).
    /// Relaunched: a rank that died of a signal (killed, out of memory), a job kolo
    /// ended because a peer stopped answering (exit status 75), a failed start. Not
    /// relaunched: the program's own error (a panic, a failed assertion, any other
    /// exit status), unless --restart-on-error. Never relaunched: a job ended by a
    /// signal kolorun was sent (Ctrl-C, SIGTERM, SIGHUP, SIGQUIT).
    #[arg(long, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub(crate) max_restarts: u32,

    /// With --max-restarts: relaunch on any failure, the program's own errors too.
    #[arg(long, requires = "max_restarts")]
    pub(crate) restart_on_error: bool,

    /// With --max-restarts across hosts: a host whose rank failed (or that does not
    /// answer at start) is left out of later attempts, which run on fewer ranks as
    /// long as at least this many remain (default: -np, i.e. never fewer). Where
    /// leaving a host out would leave fewer, the next attempt runs on every host.
    #[arg(long, value_name = "M", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) min_np: Option<u32>,

    /// With --max-restarts across hosts: the checkpoint directory is shared by every
    /// host, so rank 0's host (the first) may be left out too. Without it kolorun
    /// keeps rank 0's host in every attempt: its checkpoints may live on its own disk.
    #[arg(long, requires = "max_restarts")]
    pub(crate) shared_checkpoints: bool,

    /// A program printing the job's hosts, `host:slots` per line (horovodrun's
    /// contract), run before every attempt in place of -H/--hostfile: replaced hosts
    /// join on the next attempt.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["hosts", "hostfile"])]
    pub(crate) host_discovery_script: Option<String>,

    /// The program and its arguments.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    pub(crate) command: Vec<String>,
}

pub(crate) fn positive_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

pub(crate) fn non_negative_f64(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a non-negative number")),
    }
}

/// `-np` is horovodrun's (and mpirun's) spelling; clap's short flags are one letter,
/// so `-np` (or `-np=N`) among kolorun's own arguments becomes `--np` before parsing.
/// Those end at the program (the first word that is neither an option nor an option's
/// value) or at `--`: everything from there on is the program's and passes unchanged
/// (`kolorun -n 1 prog -np 8` runs `prog -np 8`). Which options take a value is read
/// from clap's own definition of the flags, so the two cannot disagree.
pub(crate) fn normalize(argv: impl IntoIterator<Item = String>) -> Vec<String> {
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
