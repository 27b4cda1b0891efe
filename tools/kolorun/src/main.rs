//! `kolorun`: launches a kolo program under `mpirun`, the way `horovodrun` launches a
//! Horovod one. Tuning flags become `KOLO_*` variables exported to every rank with
//! `-x`; the right mpirun options are added (allow-run-as-root when root,
//! oversubscribe when asked, bind-to none, tagged output).
//!
//! ```sh
//! kolorun -np 4 -H host1:2,host2:2 --fusion-threshold-mb 16 --timeline-filename /tmp/t-{rank}.json ./train
//! kolorun --check-build
//! kolorun -np 2 --dry-run ./train --epochs 3
//! ```

use std::process::Command;

use clap::Parser;

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

    /// Hosts and slots, e.g. host1:2,host2:2 (default: this machine).
    #[arg(short = 'H', long = "hosts", value_name = "HOSTS")]
    hosts: Option<String>,

    /// Allow more processes than cores.
    #[arg(long)]
    oversubscribe: bool,

    /// Fusion buffer threshold in MiB (0 disables fusion).
    #[arg(long, value_name = "MB")]
    fusion_threshold_mb: Option<u64>,

    /// Longest the engine waits to batch work, in milliseconds.
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

    /// Tune the fusion threshold, cycle time and response cache at run time (those
    /// not set explicitly).
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

    /// Compute threads per rank (`RAYON_NUM_THREADS`, which Burn's CPU backend and
    /// other rayon users follow). Default: `RAYON_NUM_THREADS` if set, else this
    /// machine's cores ÷ the ranks per node, at least 1.
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
    if let Some(l) = &a.log_level {
        set("LOG_LEVEL", l.clone());
    }
    env
}

/// Compute threads per rank: the flag, else the user's `RAYON_NUM_THREADS`, else
/// `cores` (of this machine; nodes are assumed alike) ÷ the most ranks on one node.
/// Without it every rank's rayon pool takes every core and the ranks fight over them.
fn threads_per_rank(a: &Args, np: u32, cores: usize, user: Option<String>) -> String {
    if let Some(n) = a.threads_per_rank {
        return n.to_string();
    }
    if let Some(v) = user.filter(|v| !v.is_empty()) {
        return v;
    }
    let per_node = match &a.hosts {
        Some(h) => h
            .split(',')
            .map(|host| {
                host.rsplit_once(':')
                    .and_then(|(_, n)| n.parse().ok())
                    .unwrap_or(1)
            })
            .max()
            .unwrap_or(1),
        None => np as usize,
    };
    (cores / per_node.max(1)).max(1).to_string()
}

/// The full mpirun argument list.
fn mpirun_args(a: &Args, np: u32, root: bool, threads: &str) -> Vec<String> {
    let mut v = vec!["-np".to_string(), np.to_string()];
    if let Some(h) = &a.hosts {
        v.extend(["-H".into(), h.clone()]);
    }
    if root {
        v.push("--allow-run-as-root".into());
    }
    if a.oversubscribe {
        v.push("--oversubscribe".into());
    }
    v.extend(["--bind-to".into(), "none".into(), "--tag-output".into()]);
    for (k, val) in kolo_env(a) {
        v.extend(["-x".into(), format!("{k}={val}")]);
    }
    v.extend(["-x".into(), format!("RAYON_NUM_THREADS={threads}")]);
    v.extend(a.command.iter().cloned());
    v
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

/// `-np` is horovodrun's (and mpirun's) spelling; clap's short flags are one letter,
/// so the first `-np` becomes `--np` before parsing (later ones belong to the program).
fn normalize(argv: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut seen = false;
    argv.into_iter()
        .map(|a| {
            if a == "-np" && !seen {
                seen = true;
                "--np".to_string()
            } else {
                a
            }
        })
        .collect()
}

fn main() {
    let args = Args::parse_from(normalize(std::env::args()));
    if args.check_build {
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
        return;
    }
    let Some(np) = args.np else {
        eprintln!("kolorun: -np is required (the number of processes)");
        std::process::exit(2);
    };
    if args.command.is_empty() {
        eprintln!("kolorun: no program given; usage: kolorun -np N [options] program [args...]");
        std::process::exit(2);
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads_per_rank(&args, np, cores, std::env::var("RAYON_NUM_THREADS").ok());
    let argv = mpirun_args(&args, np, root, &threads);
    if args.dry_run {
        let line: Vec<String> = argv.iter().map(|a| shell_quote(a)).collect();
        println!("mpirun {}", line.join(" "));
        return;
    }
    match Command::new("mpirun").args(&argv).status() {
        Ok(status) => std::process::exit(status.code().unwrap_or(1)),
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
            "./train",
            "--epochs",
            "3",
        ])
        .unwrap();
        let argv = mpirun_args(&a, 4, true, "3");
        let line = argv.join(" ");
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
        assert!(line.ends_with("./train --epochs 3"), "{line}");
        assert!(line.contains("-x RAYON_NUM_THREADS=3"), "{line}");
        assert!(!mpirun_args(&a, 4, false, "1").contains(&"--allow-run-as-root".to_string()));
        // Threads per rank: cores ÷ the most ranks on one node, the user's value, or the flag.
        assert_eq!(threads_per_rank(&a, 4, 16, None), "8");
        assert_eq!(threads_per_rank(&a, 4, 1, None), "1");
        let local = parse(&["-np", "3", "x"]).unwrap();
        assert_eq!(threads_per_rank(&local, 3, 16, None), "5");
        assert_eq!(threads_per_rank(&local, 3, 16, Some("2".into())), "2");
        let flag = parse(&["-np", "3", "--threads-per-rank", "4", "x"]).unwrap();
        assert_eq!(threads_per_rank(&flag, 3, 16, Some("2".into())), "4");
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
    fn quoting_for_dry_run() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("KOLO_X=1"), "KOLO_X=1");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
