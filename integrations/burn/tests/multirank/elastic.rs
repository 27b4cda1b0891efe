//! Issue 37, part 3: the digits example commits every few steps and a relaunched job
//! goes on from its last commit — exactly, and after a rank is killed under
//! `kolorun --max-restarts`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use libtest_mimic::Trial;

/// `target/release/<name>`, beside this test binary's directory.
fn built(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    exe.parent()
        .and_then(|d| d.parent())
        .map(|d| d.join(name))
        .filter(|p| p.exists())
        .ok_or_else(|| {
            format!(
                "target/release/{name} is missing: cargo build --release --workspace --examples"
            )
        })
}

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Result<Scratch, String> {
        let dir = std::env::temp_dir().join(format!("kolo-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `launcher` (mpirun or kolorun with their flags) on the digits example with
/// `args`, output to `log`; `during` is called every 10 ms while it runs. Kills the
/// whole process group after `limit`. Returns whether it succeeded, and its output.
fn run_digits(
    launcher: &[String],
    args: &[&str],
    log: &Path,
    limit: Duration,
    during: impl FnMut(),
) -> Result<(bool, String), String> {
    run_digits_on(launcher, args, log, limit, during, true)
}

/// [`run_digits`]; `one_machine: false` leaves out the settings that keep traffic on
/// this machine (a job across emulated hosts).
fn run_digits_on(
    launcher: &[String],
    args: &[&str],
    log: &Path,
    limit: Duration,
    mut during: impl FnMut(),
    one_machine: bool,
) -> Result<(bool, String), String> {
    let example = built("examples/train_digits")?;
    let out = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let err = out.try_clone().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(&launcher[0]);
    cmd.args(&launcher[1..]).arg(&example).args(args);
    if one_machine {
        super::harness::mpi_env(&mut cmd);
    } else {
        cmd.env_remove("OMPI_MCA_btl")
            .env_remove("OMPI_MCA_oob_tcp_if_include")
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    }
    cmd.env("RAYON_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", launcher[0]))?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break Some(s);
        }
        if start.elapsed() > limit {
            // SAFETY: signalling the process group this function started.
            unsafe { libc::killpg(child.id() as i32, libc::SIGKILL) };
            let _ = child.wait();
            break None;
        }
        during();
        std::thread::sleep(Duration::from_millis(10));
    };
    let text = std::fs::read_to_string(log).unwrap_or_default();
    match status {
        None => Err(format!("timed out after {limit:?}:\n{text}")),
        Some(s) => Ok((s.success(), text)),
    }
}

/// The `parameters fingerprint … after step N` line of a run.
fn fingerprint(text: &str) -> Option<&str> {
    text.lines()
        .find_map(|l| l.split("parameters fingerprint ").nth(1))
}

fn mpirun(np: usize) -> Vec<String> {
    ["mpirun", "-np", &np.to_string(), "--bind-to", "none"]
        .map(String::from)
        .to_vec()
}

/// A run stopped at step 30 (`--max-steps`, a commit at 28 and at 30, mid-epoch) and
/// resumed trains bit for bit the parameters of an uninterrupted run (with `extra`
/// arguments for both, e.g. the sharded optimizer, whose commits hold its
/// consolidated state).
fn resume_is_exact(np: usize, extra: &[&str]) -> Result<(), String> {
    let dir = Scratch::new(&format!("resume-exact{}", extra.concat().replace('-', "")))?;
    let ck = |n: &str| dir.0.join(n).display().to_string();
    let (a, b) = (ck("a"), ck("b"));
    let common: Vec<&str> = ["--epochs", "2", "--commit-every", "7", "--seed", "5"]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    let limit = Duration::from_secs(120);
    let run = |extra: &[&str], log: &str| -> Result<String, String> {
        let args: Vec<&str> = common.iter().chain(extra).copied().collect();
        let (ok, text) = run_digits(&mpirun(np), &args, &dir.0.join(log), limit, || {})?;
        if !ok {
            return Err(format!("train_digits {args:?} failed:\n{text}"));
        }
        Ok(text)
    };
    let whole = run(&["--checkpoint", &a], "whole.log")?;
    let first = run(&["--checkpoint", &b, "--max-steps", "30"], "first.log")?;
    let rest = run(&["--checkpoint", &b, "--resume"], "rest.log")?;
    if !first.contains("stopped after step 30")
        || !rest.contains("resumed from the commit at step 30")
    {
        return Err(format!(
            "the run did not stop at 30 and resume there:\n{first}\n{rest}"
        ));
    }
    let (want, got) = (fingerprint(&whole), fingerprint(&rest));
    if want.is_none() || want != got {
        return Err(format!(
            "resumed parameters differ: uninterrupted {want:?}, resumed {got:?}\n{whole}\n{rest}"
        ));
    }
    Ok(())
}

/// The pids of the digits example's ranks whose command line names `dir`.
fn ranks_of(dir: &str) -> Vec<i32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .filter_map(|e| {
            let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            let is_example = args.first()?.ends_with(b"/train_digits");
            let names_dir = args.contains(&dir.as_bytes());
            (is_example && names_dir).then_some(pid)
        })
        .collect()
}

/// Under `kolorun --max-restarts 2 -np 2`, one rank is SIGKILLed as soon as the first
/// commit is on disk: kolorun relaunches, the job resumes from a commit (not from the
/// start) and finishes with at least 95% test accuracy.
fn restart_after_kill() -> Result<(), String> {
    let dir = Scratch::new("restart-after-kill")?;
    let ck = dir.0.join("ck").display().to_string();
    let kolorun = built("kolorun")?.display().to_string();
    let launcher: Vec<String> = [kolorun.as_str(), "-np", "2", "--max-restarts", "2"]
        .map(String::from)
        .to_vec();
    let args = [
        "--epochs",
        "10",
        "--hidden",
        "2048",
        "--commit-every",
        "10",
        "--checkpoint",
        &ck,
        "--min-accuracy",
        "0.95",
    ];
    let file = kolo_burn::checkpoint_path(Path::new(&ck));
    let mut killed: Option<Duration> = None;
    let mut back: Option<Duration> = None;
    let start = Instant::now();
    let log = dir.0.join("log");
    let (ok, text) = run_digits(&launcher, &args, &log, Duration::from_secs(300), || {
        if killed.is_some() && back.is_none() {
            // When the relaunched job has restored its commit (the time a user waits).
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("resumed from the commit") {
                back = Some(start.elapsed());
            }
        }
        if killed.is_none() && file.exists() {
            if let Some(&pid) = ranks_of(&ck).last() {
                // SAFETY: a rank of the job this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                killed = Some(start.elapsed());
            }
        }
    })?;
    let Some(at) = killed else {
        return Err(format!("no rank was killed (no commit seen):\n{text}"));
    };
    let resumed = text
        .lines()
        .find_map(|l| l.split("resumed from the commit at step ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|s| s.parse::<u64>().ok());
    if !ok
        || !text.contains("relaunching (KOLO_RESTART_COUNT=1)")
        || resumed.is_none_or(|s| s < 10)
        || !text.contains("final test accuracy")
    {
        return Err(format!(
            "killed a rank after {at:?}; the job did not resume from a commit and finish (resumed at {resumed:?}, success {ok}):\n{text}"
        ));
    }
    eprintln!(
        "restart_after_kill: killed at {at:?}, training again from step {resumed:?} {:?} later, done after {:?}",
        back.map(|b| b.saturating_sub(at)),
        start.elapsed()
    );
    Ok(())
}

/// Under the one-node Slurm cluster of `scripts/run-slurm-tests.sh`: the digits
/// example through `srun --mpi=pmix`, and through kolorun inside `salloc -n 2` without
/// `-np` (kolorun takes the task count from the allocation, and says so).
fn slurm_digits(via_kolorun: bool) -> Result<(), String> {
    let dir = Scratch::new(&format!("slurm-{via_kolorun}"))?;
    let kolorun = built("kolorun")?.display().to_string();
    let launcher: Vec<String> = if via_kolorun {
        vec!["salloc".into(), "-n".into(), "2".into(), kolorun]
    } else {
        ["srun", "-n", "2", "--mpi=pmix"].map(String::from).to_vec()
    };
    let args = ["--epochs", "10", "--min-accuracy", "0.95"];
    let (ok, text) = run_digits(
        &launcher,
        &args,
        &dir.0.join("log"),
        Duration::from_secs(180),
        || {},
    )?;
    let said = !via_kolorun || text.contains("kolorun: inside Slurm job");
    if !ok || !said || !text.contains("on 2 ranks") || !text.contains("final test accuracy") {
        return Err(format!(
            "{launcher:?} did not train the digits on 2 ranks (success {ok}):\n{text}"
        ));
    }
    Ok(())
}

/// Inside `salloc -n 2`, `kolorun --max-restarts 2` (no `-np`): a rank SIGKILLed after
/// the first commit is relaunched within the allocation and the job resumes from the
/// commit.
fn slurm_restart_after_kill() -> Result<(), String> {
    let dir = Scratch::new("slurm-restart")?;
    let ck = dir.0.join("ck").display().to_string();
    let kolorun = built("kolorun")?.display().to_string();
    let launcher: Vec<String> = ["salloc", "-n", "2", kolorun.as_str(), "--max-restarts", "2"]
        .map(String::from)
        .to_vec();
    let args = [
        "--epochs",
        "10",
        "--hidden",
        "2048",
        "--commit-every",
        "10",
        "--checkpoint",
        &ck,
        "--min-accuracy",
        "0.95",
    ];
    let file = kolo_burn::checkpoint_path(Path::new(&ck));
    let mut killed = false;
    let (ok, text) = run_digits(
        &launcher,
        &args,
        &dir.0.join("log"),
        Duration::from_secs(300),
        || {
            if !killed && file.exists() {
                if let Some(&pid) = ranks_of(&ck).last() {
                    // SAFETY: a rank of the job this test started.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    killed = true;
                }
            }
        },
    )?;
    if !ok
        || !killed
        || !text.contains("kolorun: inside Slurm job")
        || !text.contains("relaunching (KOLO_RESTART_COUNT=1)")
        || !text.contains("resumed from the commit at step")
        || !text.contains("final test accuracy")
    {
        return Err(format!(
            "inside salloc the job did not resume from a commit after a rank was killed (killed {killed}, success {ok}):\n{text}"
        ));
    }
    Ok(())
}

/// The digits example's rank `rank` among the processes naming `dir`.
fn rank_of(dir: &str, rank: usize) -> Option<i32> {
    let want = format!("OMPI_COMM_WORLD_RANK={rank}");
    ranks_of(dir).into_iter().find(|pid| {
        std::fs::read(format!("/proc/{pid}/environ"))
            .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == want.as_bytes()))
    })
}

/// Slurm across 2 emulated hosts (`scripts/run-slurm-tests.sh`, one slurmd per host):
/// inside `salloc -N 2 -n 4`, kolorun takes `-np 4 -H h1:2,h2:2` from the allocation;
/// rank 3 (on h2) is SIGKILLed after the first commit; kolorun leaves h2 out and the
/// job resumes from the commit on h1's 2 ranks (`--min-np 2`) and finishes.
fn slurm_hosts_leave_node_out() -> Result<(), String> {
    let dir = Scratch::new("slurm-hosts")?;
    let ck = dir.0.join("ck").display().to_string();
    let kolorun = built("kolorun")?.display().to_string();
    let on_h1 = std::env::var("KOLO_SLURM_ON_H1").map_err(|_| "KOLO_SLURM_ON_H1 is not set")?;
    let launcher: Vec<String> = [
        on_h1.as_str(),
        "salloc",
        "-N",
        "2",
        "-n",
        "4",
        kolorun.as_str(),
        "--network-interface",
        "eth0",
        "--max-restarts",
        "2",
        "--min-np",
        "2",
        "--mpi-args",
        "--mca mpi_yield_when_idle 1 --mca mpi_event_tick_rate 1",
    ]
    .map(String::from)
    .to_vec();
    let args = [
        "--epochs",
        "12",
        "--scale-lr",
        "--hidden",
        "2048",
        "--commit-every",
        "10",
        "--checkpoint",
        &ck,
        "--min-accuracy",
        "0.95",
    ];
    let file = kolo_burn::checkpoint_path(Path::new(&ck));
    let mut killed = false;
    let (mut killed_at, mut back) = (None, None);
    let log = dir.0.join("log");
    let (ok, text) = run_digits_on(
        &launcher,
        &args,
        &log,
        Duration::from_secs(300),
        || {
            if killed && back.is_none() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if text.contains("resumed from the commit") {
                    back = Some(Instant::now());
                }
            }
            if !killed && file.exists() {
                if let Some(pid) = rank_of(&ck, 3) {
                    // SAFETY: a rank of the job this test started.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    killed = true;
                    killed_at = Some(Instant::now());
                }
            }
        },
        false,
    )?;
    if let (Some(k), Some(b)) = (killed_at, back) {
        eprintln!(
            "slurm_hosts: training again on h1 {:?} after the kill on h2",
            b.duration_since(k)
        );
    }
    let wants = [
        "kolorun: inside Slurm job",
        "-H h1:2,h2:2",
        "leaving host h2 out",
        "relaunching (KOLO_RESTART_COUNT=1)",
        "resumed from the commit at step",
        "on 2 ranks",
        "final test accuracy",
    ];
    if let Some(w) = wants.iter().find(|w| !text.contains(*w)) {
        return Err(format!(
            "across 2 Slurm nodes the job did not go on without h2 (killed {killed}, success {ok}; no {w:?}):\n{text}"
        ));
    }
    if !ok || !killed {
        return Err(format!(
            "across 2 Slurm nodes: killed {killed}, success {ok}:\n{text}"
        ));
    }
    Ok(())
}

/// Across 2 emulated hosts × 2 ranks, `kolorun --max-restarts 2 --min-np 1`: h2's link
/// is cut after the first commit; the ranks on h1 stop making progress (the collective
/// timeout, 5 s here) and abort, kolorun ends mpirun (h2's daemon never answers),
/// leaves h2 out (the watchdog named its ranks, or only h1's ranks reported) and
/// relaunches on h1's 2 ranks, which resume from the commit and reach 95%.
fn link_cut_goes_on_without_the_host() -> Result<(), String> {
    let scripts = super::harness::multinode().ok_or("the emulated hosts are not up")?;
    let dir = Scratch::new("link-cut")?;
    let ck = dir.0.join("ck").display().to_string();
    let kolorun = built("kolorun")?.display().to_string();
    let agent = scripts.join("agent.sh").display().to_string();
    let on_h1 = scripts.join("on-h1.sh").display().to_string();
    let mpi_args = format!(
        "--mca plm_rsh_agent {agent} --mca mpi_yield_when_idle 1 --mca mpi_event_tick_rate 1"
    );
    let launcher: Vec<String> = [
        on_h1.as_str(),
        kolorun.as_str(),
        "-np",
        "4",
        "-H",
        "h1:2,h2:2",
        "--network-interface",
        "eth0",
        "--max-restarts",
        "2",
        "--min-np",
        "1",
        "--collective-timeout-seconds",
        "5",
        "--mpi-args",
        mpi_args.as_str(),
    ]
    .map(String::from)
    .to_vec();
    let args = [
        "--epochs",
        "12",
        "--scale-lr",
        "--hidden",
        "2048",
        "--commit-every",
        "10",
        "--checkpoint",
        &ck,
        "--min-accuracy",
        "0.95",
    ];
    let link = |state: &str| {
        Command::new("ip")
            .args(["-n", "h2", "link", "set", "eth0", state])
            .status()
            .is_ok_and(|s| s.success())
    };
    let file = kolo_burn::checkpoint_path(Path::new(&ck));
    let mut cut = false;
    let (mut cut_at, mut back) = (None, None);
    let log = dir.0.join("log");
    let result = run_digits_on(
        &launcher,
        &args,
        &log,
        Duration::from_secs(300),
        || {
            if cut && back.is_none() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if text.contains("resumed from the commit") {
                    back = Some(Instant::now());
                }
            }
            if !cut && file.exists() {
                cut = link("down");
                cut_at = Some(Instant::now());
            }
        },
        false,
    );
    let restored = link("up");
    let (ok, text) = result?;
    if let (Some(c), Some(b)) = (cut_at, back) {
        eprintln!(
            "link_cut: training again on h1 {:?} after h2's link was cut",
            b.duration_since(c)
        );
    }
    let wants = [
        "has made no progress",
        "leaving host h2 out",
        "relaunching (KOLO_RESTART_COUNT=1)",
        "resumed from the commit at step",
        "on 2 ranks",
        "final test accuracy",
    ];
    if let Some(w) = wants.iter().find(|w| !text.contains(*w)) {
        return Err(format!(
            "with h2's link cut the job did not go on without it (cut {cut}, success {ok}; no {w:?}):\n{text}"
        ));
    }
    if !ok || !cut || !restored {
        return Err(format!(
            "link cut {cut}, restored {restored}, success {ok}:\n{text}"
        ));
    }
    Ok(())
}

/// The trials of this module.
pub(crate) fn trials() -> Vec<Trial> {
    // Only where scripts/run-slurm-tests.sh has started Slurm (ignored otherwise, so
    // the count shows).
    let no_slurm = std::env::var_os("KOLO_SLURM").is_none_or(|v| v != "1");
    vec![
        Trial::test("slurm/srun_pmix_digits/np2", || Ok(slurm_digits(false)?))
            .with_ignored_flag(no_slurm),
        Trial::test("slurm/salloc_kolorun_digits/np2", || {
            Ok(slurm_digits(true)?)
        })
        .with_ignored_flag(no_slurm),
        Trial::test("slurm/salloc_kolorun_restart_after_kill/np2", || {
            Ok(slurm_restart_after_kill()?)
        })
        .with_ignored_flag(no_slurm),
        Trial::test("multinode/digits_link_cut_min_np_1/2x2", || {
            Ok(link_cut_goes_on_without_the_host()?)
        })
        .with_ignored_flag(super::harness::multinode().is_none()),
        // Where the emulated hosts run a slurmd each (KOLO_SLURM=hosts).
        Trial::test(
            "slurm_hosts/salloc_kolorun_leaves_killed_node_out/2x2",
            || Ok(slurm_hosts_leave_node_out()?),
        )
        .with_ignored_flag(std::env::var_os("KOLO_SLURM").is_none_or(|v| v != "hosts")),
        Trial::test("digits_resume_exact/np2", || Ok(resume_is_exact(2, &[])?)),
        Trial::test("digits_resume_exact_sharded/np2", || {
            Ok(resume_is_exact(2, &["--sharded-optimizer"])?)
        }),
        Trial::test("digits_resume_exact_pipeline/np2", || {
            Ok(resume_is_exact(2, &["--pipeline-stages", "2"])?)
        }),
        Trial::test(
            "digits_restart_after_kill/np2",
            || Ok(restart_after_kill()?),
        ),
    ]
}
