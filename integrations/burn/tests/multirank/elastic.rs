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

/// Issue 53 items 8 and 9: commits carry the run's identity. A second kolorun launch
/// (a new run) does not load, or overwrite, the first one's commit; a relaunch that
/// finds no commit fails instead of starting over; a requeued Slurm job
/// (`SLURM_RESTART_COUNT`) with the same run resumes its own commit.
fn run_identity() -> Result<(), String> {
    let dir = Scratch::new("run-identity")?;
    let kolorun = built("kolorun")?.display().to_string();
    let ck = dir.0.join("ck").display().to_string();
    let limit = Duration::from_secs(120);
    let common = ["--epochs", "2", "--commit-every", "7", "--checkpoint", &ck];
    let launch = |launcher: &[String], extra: &[&str], env: &[(&str, &str)], log: &str| {
        let mut l = launcher.to_vec();
        if !env.is_empty() {
            let mut e = vec!["env".to_string()];
            e.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
            e.extend(l);
            l = e;
        }
        let args: Vec<&str> = common.iter().chain(extra).copied().collect();
        run_digits(&l, &args, &dir.0.join(log), limit, || {})
    };
    let via_kolorun = [kolorun.as_str(), "-np", "2"].map(String::from).to_vec();
    let (ok, text) = launch(&via_kolorun, &["--max-steps", "14"], &[], "first.log")?;
    if !ok || !text.contains("stopped after step 14") {
        return Err(format!(
            "the first run did not commit and stop:
{text}"
        ));
    }
    // Another kolorun launch is another run: its commit is refused, named.
    let (ok, text) = launch(&via_kolorun, &[], &[], "second.log")?;
    if ok
        || !text.contains("the commit there is run \"kolorun-")
        || !text.contains("not loading it")
    {
        return Err(format!(
            "a second run took or overwrote the first's commit:
{text}"
        ));
    }
    // ... and taken when asked to resume.
    let (ok, text) = launch(
        &via_kolorun,
        &["--resume", "--max-steps", "21"],
        &[],
        "asked.log",
    )?;
    if !ok || !text.contains("resumed from the commit at step 14") {
        return Err(format!(
            "--resume did not take the commit:
{text}"
        ));
    }
    // A relaunch (attempt 1) in a directory without a commit: an error, not a start
    // from scratch.
    let empty = dir.0.join("empty").display().to_string();
    let (ok, text) = run_digits(
        &["env", "KOLO_RESTART_COUNT=1", "KOLO_RUN_ID=r9"]
            .map(String::from)
            .into_iter()
            .chain(mpirun(2))
            .collect::<Vec<_>>(),
        &["--epochs", "1", "--checkpoint", &empty],
        &dir.0.join("relaunch.log"),
        limit,
        || {},
    )?;
    if ok || !text.contains("rank 0 finds no commit there") {
        return Err(format!(
            "a relaunch without a commit started over:
{text}"
        ));
    }
    // A requeued Slurm job of the same run resumes its own commit without --resume.
    let requeue = dir.0.join("requeue").display().to_string();
    let job = |restart: &'static str| {
        ["env", "KOLO_RUN_ID=slurm-991", restart]
            .map(String::from)
            .into_iter()
            .chain(mpirun(2))
            .collect::<Vec<_>>()
    };
    let args = |extra: &'static str| {
        vec![
            "--epochs",
            "2",
            "--commit-every",
            "7",
            "--checkpoint",
            &requeue,
            "--max-steps",
            extra,
        ]
    };
    let (ok, text) = run_digits(
        &job("SLURM_RESTART_COUNT=0"),
        &args("14"),
        &dir.0.join("q0.log"),
        limit,
        || {},
    )?;
    if !ok {
        return Err(format!(
            "the Slurm job's first run failed:
{text}"
        ));
    }
    let (ok, text) = run_digits(
        &job("SLURM_RESTART_COUNT=1"),
        &args("21"),
        &dir.0.join("q1.log"),
        limit,
        || {},
    )?;
    if !ok || !text.contains("resumed from the commit at step 14") {
        return Err(format!(
            "the requeued job did not resume its commit:
{text}"
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

/// A fault test of the digits example: `launcher` runs it with `--hidden 2048
/// --commit-every 10 --checkpoint <scratch>` and `extra` (`--epochs`, …) until it
/// reaches 95%; once the first commit is on disk `fault(checkpoint dir)` is called
/// (every 10 ms until it returns true: kill a rank, cut a link). The job must fail,
/// be relaunched, resume from a commit (not from the start) and finish, and its output
/// hold every line of `wants`. Returns the output and the time from the fault to
/// training again (the relaunched job restored its commit: what a user waits).
fn fault_after_first_commit(
    name: &str,
    launcher: &[String],
    extra: &[&str],
    one_machine: bool,
    mut fault: impl FnMut(&str) -> bool,
    wants: &[&str],
) -> Result<(String, Option<Duration>), String> {
    let dir = Scratch::new(name)?;
    let ck = dir.0.join("ck").display().to_string();
    let mut args = vec![
        "--hidden",
        "2048",
        "--commit-every",
        "10",
        "--checkpoint",
        &ck,
        "--min-accuracy",
        "0.95",
    ];
    args.extend(extra);
    let file = kolo_burn::checkpoint_path(Path::new(&ck));
    let log = dir.0.join("log");
    let (mut faulted, mut back) = (None::<Instant>, None);
    let (ok, text) = run_digits_on(
        launcher,
        &args,
        &log,
        Duration::from_secs(300),
        || {
            if let (Some(at), None) = (faulted, back) {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if text.contains("resumed from the commit") {
                    back = Some(at.elapsed());
                }
            }
            if faulted.is_none() && file.exists() && fault(&ck) {
                faulted = Some(Instant::now());
            }
        },
        one_machine,
    )?;
    let resumed = text
        .lines()
        .find_map(|l| l.split("resumed from the commit at step ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|s| s.parse::<u64>().ok());
    let always = ["relaunching (KOLO_RESTART_COUNT=1)", "final test accuracy"];
    let missing = always.iter().chain(wants).find(|w| !text.contains(**w));
    if !ok || faulted.is_none() || resumed.is_none_or(|s| s < 10) || missing.is_some() {
        return Err(format!(
            "{name}: the job did not resume from a commit and finish (fault made {}, resumed at step {resumed:?}, success {ok}, missing {missing:?}):\n{text}",
            faulted.is_some()
        ));
    }
    Ok((text, back))
}

/// SIGKILL of the last rank `ranks_of` finds naming the checkpoint directory.
fn kill_a_rank(ck: &str) -> bool {
    let Some(&pid) = ranks_of(ck).last() else {
        return false;
    };
    // SAFETY: a rank of the job this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    true
}

/// Under `kolorun --max-restarts 2 -np 2`, one rank is SIGKILLed as soon as the first
/// commit is on disk: kolorun relaunches, the job resumes from a commit (not from the
/// start) and finishes with at least 95% test accuracy.
fn restart_after_kill() -> Result<(), String> {
    let kolorun = built("kolorun")?.display().to_string();
    let launcher = [kolorun.as_str(), "-np", "2", "--max-restarts", "2"].map(String::from);
    let (_, back) = fault_after_first_commit(
        "restart-after-kill",
        &launcher,
        &["--epochs", "10"],
        true,
        kill_a_rank,
        &[],
    )?;
    eprintln!("restart_after_kill: training again {back:?} after the kill");
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
    let kolorun = built("kolorun")?.display().to_string();
    let launcher = ["salloc", "-n", "2", kolorun.as_str(), "--max-restarts", "2"].map(String::from);
    fault_after_first_commit(
        "slurm-restart",
        &launcher,
        &["--epochs", "10"],
        true,
        kill_a_rank,
        &["kolorun: inside Slurm job"],
    )?;
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
    let kolorun = built("kolorun")?.display().to_string();
    let on_h1 = std::env::var("KOLO_SLURM_ON_H1").map_err(|_| "KOLO_SLURM_ON_H1 is not set")?;
    let launcher = [
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
    .map(String::from);
    let kill_rank_3 = |ck: &str| {
        let Some(pid) = rank_of(ck, 3) else {
            return false;
        };
        // SAFETY: a rank of the job this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        true
    };
    let (_, back) = fault_after_first_commit(
        "slurm-hosts",
        &launcher,
        &["--epochs", "12", "--scale-lr"],
        false,
        kill_rank_3,
        &[
            "kolorun: inside Slurm job",
            "-H h1:2,h2:2",
            "leaving host h2 out",
            "on 2 ranks",
        ],
    )?;
    eprintln!("slurm_hosts: training again on h1 {back:?} after the kill on h2");
    Ok(())
}

/// Across 2 emulated hosts × 2 ranks, `kolorun --max-restarts 2 --min-np 1`: h2's link
/// is cut after the first commit; the ranks on h1 stop making progress (the collective
/// timeout, 5 s here) and abort, kolorun ends mpirun (h2's daemon never answers),
/// leaves h2 out (the watchdog named its ranks, or only h1's ranks reported) and
/// relaunches on h1's 2 ranks, which resume from the commit and reach 95%.
fn link_cut_goes_on_without_the_host() -> Result<(), String> {
    let scripts = super::harness::multinode().ok_or("the emulated hosts are not up")?;
    let kolorun = built("kolorun")?.display().to_string();
    let agent = scripts.join("agent.sh").display().to_string();
    let on_h1 = scripts.join("on-h1.sh").display().to_string();
    let mpi_args = format!(
        "--mca plm_rsh_agent {agent} --mca mpi_yield_when_idle 1 --mca mpi_event_tick_rate 1"
    );
    let launcher = [
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
    .map(String::from);
    let link = |state: &str| {
        Command::new("ip")
            .args(["-n", "h2", "link", "set", "eth0", state])
            .status()
            .is_ok_and(|s| s.success())
    };
    let result = fault_after_first_commit(
        "link-cut",
        &launcher,
        &["--epochs", "12", "--scale-lr"],
        false,
        |_| link("down"),
        &["has made no progress", "leaving host h2 out", "on 2 ranks"],
    );
    let restored = link("up");
    let (_, back) = result?;
    if !restored {
        return Err("h2's link could not be brought up again".into());
    }
    eprintln!("link_cut: training again on h1 {back:?} after h2's link was cut");
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
        Trial::test("issue53_digits_run_identity/np2", || Ok(run_identity()?)),
        Trial::test("digits_resume_exact_sharded/np2", || {
            Ok(resume_is_exact(2, &["--sharded-optimizer"])?)
        }),
        Trial::test("digits_resume_exact_fully_sharded/np2", || {
            Ok(resume_is_exact(2, &["--fully-sharded"])?)
        }),
        // Issue 57: each algorithm's per-rank state (and, for the weight exchanges,
        // each rank's own weights) survives the stop; np 3 for two ring neighbours,
        // batches of 16 so that 30 steps of 60 remain after the stop.
        Trial::test("issue57_digits_resume_exact_algorithms/np3", || {
            for a in ["decentralized-8bit", "async", "qadam", "onebit-adam"] {
                resume_is_exact(3, &["--algorithm", a, "--batch-size", "16"])
                    .map_err(|e| format!("{a}: {e}"))?;
            }
            Ok(())
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
