//! kolorun end to end: a real mpirun launch that shows the variables reach every rank.

use std::process::Command;

fn kolorun() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kolorun"));
    c.env("OMPI_MCA_btl", "self,vader")
        .env("OMPI_MCA_oob_tcp_if_include", "lo");
    c
}

#[test]
fn variables_reach_every_rank() {
    let out = kolorun()
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
        ])
        .output()
        .expect("run kolorun");
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
    let out = kolorun()
        .args([
            "-np",
            "2",
            "--dry-run",
            "--autotune",
            "./train",
            "--lr",
            "0.1",
        ])
        .output()
        .expect("run");
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.starts_with("mpirun -np 2 "), "{line}");
    assert!(
        line.contains("-x KOLO_AUTOTUNE=1") && line.trim_end().ends_with("./train --lr 0.1"),
        "{line}"
    );
    let out = kolorun().arg("--check-build").output().expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("MPI transport:  yes") && text.contains("NCCL transport:"),
        "{text}"
    );
}

#[test]
fn missing_program_is_an_error() {
    let out = kolorun().args(["-np", "2"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no program given"));
}
