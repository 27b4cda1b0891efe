//! kolorun end to end: a real mpirun launch that shows the variables reach every rank.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn kolorun() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kolorun"));
    c.env("OMPI_MCA_btl", "self,vader")
        .env("OMPI_MCA_oob_tcp_if_include", "lo");
    c
}

/// Runs `cmd` to completion, failing the test (and killing it) after 60 s: a hang
/// must not block the suite.
fn run(cmd: &mut Command) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kolorun");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("kolorun did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut out = child.stdout.take().expect("stdout");
    out.read_to_end(&mut stdout).expect("read stdout");
    let mut err = child.stderr.take().expect("stderr");
    err.read_to_end(&mut stderr).expect("read stderr");
    Output {
        status,
        stdout,
        stderr,
    }
}

#[test]
fn variables_reach_every_rank() {
    let out = run(kolorun()
        .args([
            "-np",
            "3",
            "--oversubscribe",
            "--fusion-threshold-mb",
            "8",
            "--cache-capacity",
            "7",
        ])
        .args([
            "sh",
            "-c",
            "echo $KOLO_FUSION_THRESHOLD/$KOLO_CACHE_CAPACITY",
        ]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches("8388608/7").count(), 3, "{stdout}");
    // Tagged output: one line per rank, each with its rank.
    for r in 0..3 {
        assert!(stdout.contains(&format!("[1,{r}]<stdout>:")), "{stdout}");
    }
}

#[test]
fn dry_run_and_check_build() {
    let out = run(kolorun().args([
        "-np",
        "2",
        "--dry-run",
        "--autotune",
        "./train",
        "--lr",
        "0.1",
    ]));
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.starts_with("mpirun -np 2 "), "{line}");
    assert!(
        line.contains("-x KOLO_AUTOTUNE=1") && line.trim_end().ends_with("./train --lr 0.1"),
        "{line}"
    );
    let out = run(kolorun().arg("--check-build"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("MPI transport:  yes") && text.contains("NCCL transport:"),
        "{text}"
    );
    // With the NCCL transport compiled in, it also says whether a driver was found.
    assert_eq!(
        text.contains("CUDA driver:"),
        cfg!(feature = "nccl"),
        "{text}"
    );
}

#[test]
fn missing_program_is_an_error() {
    let out = run(kolorun().args(["-np", "2"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no program given"));
}

/// A scratch directory for one test, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("kolorun-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn issue31_a_host_that_ssh_would_read_as_an_option_runs_nothing() {
    let dir = Scratch::new("inject");
    let marker = dir.0.join("x");
    let hostfile = dir.0.join("hosts");
    std::fs::write(
        &hostfile,
        format!("-oProxyCommand=touch${{IFS}}{} slots=1\n", marker.display()),
    )
    .expect("write hostfile");
    let out = run(kolorun()
        .args(["-np", "1", "--start-timeout", "5", "--hostfile"])
        .arg(&hostfile)
        .arg("true"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!marker.exists(), "the host name ran a command: {stderr}");
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("hostfile line 1 (")
            && stderr.contains("begins with \"-\", which ssh would read as an option"),
        "{stderr}"
    );
}

/// Polls `done` every 20 ms for up to `limit`; whether it became true.
fn within(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done()
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
fn issue31_sigterm_to_kolorun_alone_ends_the_job() {
    let dir = Scratch::new("sigterm");
    let pidfile = dir.0.join("rank.pid");
    let mut child = kolorun()
        .args(["-np", "1", "sh", "-c"])
        .arg(format!("echo $$ > {}; exec sleep 60", pidfile.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kolorun");
    let rank = || -> Option<i32> { std::fs::read_to_string(&pidfile).ok()?.trim().parse().ok() };
    let started = within(Duration::from_secs(60), || rank().is_some());
    let rank = rank();
    // The signal goes to kolorun's pid only, as Popen.terminate() or a scheduler sends it.
    // SAFETY: kill(2) on the kolorun we started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let mut status = None;
    let ended = within(Duration::from_secs(30), || {
        status = child.try_wait().expect("wait");
        status.is_some()
    });
    if !ended {
        let _ = child.kill();
    }
    let rank_gone = rank.is_some_and(|pid| within(Duration::from_secs(20), || gone(pid)));
    if let Some(pid) = rank.filter(|&pid| !gone(pid)) {
        // SAFETY: kill(2) on the rank this test started, left behind by a failure.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let _ = child.wait();
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    assert!(started, "the rank did not start: {stderr}");
    assert!(
        ended,
        "kolorun did not end within 30 s of SIGTERM: {stderr}"
    );
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(143),
        "{status:?}: {stderr}"
    );
    assert!(rank_gone, "the rank outlived kolorun: {stderr}");
}

/// Issue 37: `--max-restarts` relaunches a failed job, each rank finding the attempt
/// in `KOLO_RESTART_COUNT`, with one line per relaunch naming the exit code.
#[test]
fn a_failed_job_is_relaunched_with_its_attempt_number() {
    let out = run(kolorun()
        .args(["-np", "2", "--oversubscribe", "--max-restarts", "3"])
        .args([
            "sh",
            "-c",
            // kolo's status for a job that may be relaunched (a peer stopped answering).
            "echo attempt $KOLO_RESTART_COUNT; test $KOLO_RESTART_COUNT -ge 2 || exit 75",
        ]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for a in 0..3 {
        assert_eq!(
            stdout.matches(&format!("attempt {a}")).count(),
            2,
            "both ranks of attempt {a}: {stdout}"
        );
    }
    assert!(!stdout.contains("attempt 3"), "{stdout}");
    assert_eq!(stderr.matches("; relaunching (").count(), 2, "{stderr}");
    assert!(
        stderr.contains("attempt 1 of 4 failed (exit code 75)")
            && stderr.contains("(KOLO_RESTART_COUNT=1)"),
        "{stderr}"
    );
}

/// Once the restarts are used up, kolorun says so and exits with the job's code;
/// without `--max-restarts` a failed job is not relaunched.
#[test]
fn restarts_end_when_they_are_used_up() {
    let out = run(kolorun()
        .args([
            "-np",
            "2",
            "--oversubscribe",
            "--max-restarts",
            "1",
            "--restart-on-error",
        ])
        .args(["sh", "-c", "echo ran; exit 3"]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(
        stdout.matches("ran").count(),
        4,
        "two attempts of two ranks: {stdout}"
    );
    assert!(
        stderr.contains("attempt 1 of 2 failed (exit code 3)")
            && stderr.contains("attempt 2 of 2 failed (exit code 3)")
            && stderr.contains("no restarts left"),
        "{stderr}"
    );
    let out =
        run(kolorun()
            .args(["-np", "2", "--oversubscribe"])
            .args(["sh", "-c", "echo ran; exit 3"]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("ran").count(), 2, "one attempt: {stdout}");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("relaunching"));
}

/// Issue 37, part 4: the program's own error (any exit status but kolo's 75, no
/// signal) ends the job at once under `--max-restarts`, saying why; a rank killed by a
/// signal is relaunched.
#[test]
fn a_programs_own_error_is_not_relaunched() {
    let out = run(kolorun()
        .args(["-np", "2", "--oversubscribe", "--max-restarts", "2"])
        .args(["sh", "-c", "echo ran; exit 3"]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert_eq!(stdout.matches("ran").count(), 2, "one attempt: {stdout}");
    assert!(
        stderr.contains("failed with the program's own error (exit code 3)")
            && stderr.contains("not relaunched")
            && !stderr.contains("relaunching"),
        "{stderr}"
    );
    // Issue 53 item 12: a program's own message that reads like a failed start, and
    // an exit status above 128, are still the program's own errors.
    for (body, code) in [
        ("echo 'Error: unable to open data.bin' >&2; exit 1", 1),
        (
            "echo 'thread main panicked at src/signal.rs:3:5' >&2; exit 101",
            101,
        ),
        ("exit 255", 255),
    ] {
        let out = run(kolorun()
            .args(["-np", "2", "--oversubscribe", "--max-restarts", "2"])
            .args(["sh", "-c", body]));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{body}: {stderr}");
        assert!(
            stderr.contains("not relaunched") && !stderr.contains("relaunching"),
            "{body}: {stderr}"
        );
    }
    // A rank that kills itself on the first attempt: relaunched, and the second
    // attempt succeeds.
    let out = run(kolorun()
        .args(["-np", "2", "--oversubscribe", "--max-restarts", "2"])
        .args([
            "sh",
            "-c",
            "echo attempt $KOLO_RESTART_COUNT; if [ $KOLO_RESTART_COUNT = 0 ] && [ $OMPI_COMM_WORLD_RANK = 1 ]; then kill -9 $$; fi; sleep 0.2",
        ]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("relaunching (KOLO_RESTART_COUNT=1)"),
        "{stderr}"
    );
}

/// A `--host-discovery-script` gives every attempt its hosts (`host:slots` lines); the
/// job runs on as many ranks as they have slots, at most -np, and not at all when
/// fewer than `--min-np` remain.
#[test]
fn discovered_hosts_set_each_attempts_ranks() {
    let dir = std::env::temp_dir().join(format!("kolorun-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let script = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).expect("write script");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        p.display().to_string()
    };
    let two = script("two.sh", "echo localhost:2");
    let out = run(kolorun()
        .args([
            "-np",
            "3",
            "--min-np",
            "1",
            "--oversubscribe",
            "--max-restarts",
            "1",
            "--verbose",
        ])
        .args(["--host-discovery-script", &two])
        .args([
            "sh",
            "-c",
            "echo attempt $KOLO_RESTART_COUNT; test $KOLO_RESTART_COUNT -ge 1 || exit 75",
        ]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Two slots discovered: two ranks per attempt, not three.
    assert_eq!(stdout.matches("attempt 0").count(), 2, "{stdout}");
    assert_eq!(stdout.matches("attempt 1").count(), 2, "{stdout}");
    assert!(stderr.contains("-H localhost:2"), "{stderr}");
    let one = script("one.sh", "echo localhost:1");
    let out = run(kolorun()
        .args(["-np", "2", "--max-restarts", "1", "--min-np", "2"])
        .args(["--host-discovery-script", &one])
        .args(["sh", "-c", "true"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("1 rank(s) left on 1 host(s)") && stderr.contains("fewer than --min-np 2"),
        "{stderr}"
    );
    // Issue 53 item 14: a discovery script that hangs does not keep kolorun from its
    // signals: SIGTERM ends it (and the script) at once.
    let hangs = script("hangs.sh", "exec sleep 60");
    let mut child = kolorun()
        .args(["-np", "2", "--max-restarts", "1"])
        .args(["--host-discovery-script", &hangs])
        .args(["sh", "-c", "true"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kolorun starts");
    std::thread::sleep(Duration::from_millis(800));
    let start = std::time::Instant::now();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().expect("kolorun ends");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "kolorun took {:?} to end on SIGTERM",
        start.elapsed()
    );
    assert_eq!(status.code(), Some(143));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The threads each rank is given in `kolorun --dry-run -np 2 <hosts> ./x`.
fn threads_for(hosts: &[&str]) -> String {
    // The user's own setting would win over the slots.
    let out = run(kolorun()
        .env_remove("RAYON_NUM_THREADS")
        .args(["-np", "2", "--dry-run"])
        .args(hosts)
        .arg("./x"));
    let line = String::from_utf8_lossy(&out.stdout).into_owned();
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("RAYON_NUM_THREADS="))
        .unwrap_or_else(|| panic!("no RAYON_NUM_THREADS in {line:?}"))
        .to_string()
}

/// Issue 53 item 13: a hostfile host without `slots=` has as many slots as cores, as
/// Open MPI counts them (here: the cores `lscpu` lists), not 1: kolorun plans the job
/// as for `-H localhost:<cores>`.
#[test]
fn issue53_a_hostfile_host_without_slots_has_its_cores() {
    let lscpu = Command::new("sh")
        .args([
            "-c",
            "lscpu -p=Core,Socket | grep -v '^#' | sort -u | wc -l",
        ])
        .output()
        .expect("run lscpu");
    let cores: usize = String::from_utf8_lossy(&lscpu.stdout)
        .trim()
        .parse()
        .expect("a core count");
    let dir = std::env::temp_dir().join(format!("kolorun-slots-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("hosts");
    std::fs::write(&file, "localhost\n").expect("write hostfile");
    let from_file = threads_for(&["--hostfile", file.to_str().expect("utf-8 path")]);
    let given = threads_for(&["-H", &format!("localhost:{cores}")]);
    let one = threads_for(&["-H", "localhost:1"]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        from_file, given,
        "hostfile without slots vs -H localhost:{cores}"
    );
    if cores > 1 {
        assert_ne!(
            from_file, one,
            "a hostfile host without slots counted 1 slot"
        );
    }
}

/// Issue 56: DeepSpeed's launcher flags pick the hosts and slots: `--num_gpus 3` runs
/// three ranks here; a hostfile's host cut to two slots by `--num_gpus` (with
/// `--num_nodes 1`) runs two; `--include` with `--num_gpus` is refused as DeepSpeed
/// refuses it.
#[test]
fn issue56_deepspeed_launcher_flags() {
    let ranks = |out: &Output| {
        String::from_utf8_lossy(&out.stdout)
            .matches("<stdout>:up")
            .count()
    };
    let out = run(kolorun().args(["--num_gpus", "3", "--oversubscribe", "sh", "-c", "echo up"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(ranks(&out), 3);
    let dir = std::env::temp_dir().join(format!("kolorun-ds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch");
    let hostfile = dir.join("hostfile");
    std::fs::write(&hostfile, "localhost slots=4\n").expect("hostfile");
    let out = run(kolorun().arg("--hostfile").arg(&hostfile).args([
        "--num_nodes",
        "1",
        "--num_gpus",
        "2",
        "sh",
        "-c",
        "echo up",
    ]));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(ranks(&out), 2);
    let out = run(kolorun().args(["--include", "localhost", "--num_gpus", "2", "true"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot be combined"),
        "{err}"
    );
}
