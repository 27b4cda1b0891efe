//! The job's hosts: what `-H` and `--hostfile` name, and whether each answers
//! before mpirun is started.

use std::process::Command;

/// Hosts and their slots in an OpenMPI hostfile (`host slots=N`, `#` comments; a
/// host without `slots=` counts 1).
pub(crate) fn hostfile_hosts(text: &str) -> Vec<(String, usize)> {
    text.lines()
        .filter_map(|l| {
            let mut words = l.split('#').next()?.split_whitespace();
            let host = words.next()?.to_string();
            let slots = words
                .find_map(|w| w.strip_prefix("slots=").or(w.strip_prefix("max_slots=")))
                .and_then(|n| n.parse().ok())
                .unwrap_or(1);
            Some((host, slots))
        })
        .collect()
}

/// Hosts and their slots in `-H host1:2,host2:2` (a host without `:N` counts 1).
pub(crate) fn flag_hosts(hosts: &str) -> Vec<(String, usize)> {
    hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| match h.rsplit_once(':') {
            Some((name, n)) => (name.to_string(), n.parse().unwrap_or(1)),
            None => (h.to_string(), 1),
        })
        .collect()
}

/// How mpirun reaches other hosts: `--mca plm_rsh_agent` in `--mpi-args`, else
/// `OMPI_MCA_plm_rsh_agent`, else ssh (without prompts).
pub(crate) fn remote_agent(mpi_args: &[String], env: &[(String, String)]) -> Vec<String> {
    let from_args = mpi_args
        .windows(2)
        .find(|w| w[0] == "plm_rsh_agent")
        .map(|w| w[1].clone());
    let from_env = || {
        env.iter()
            .find(|(k, _)| k == "OMPI_MCA_plm_rsh_agent")
            .map(|(_, v)| v.clone())
    };
    match from_args.or_else(from_env) {
        // OpenMPI's agent lists alternatives ("ssh : rsh"): the first is tried first.
        Some(a) => a
            .split(':')
            .next()
            .unwrap_or("ssh")
            .split_whitespace()
            .map(String::from)
            .collect(),
        None => ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
            .map(String::from)
            .to_vec(),
    }
}

/// Runs `agent host true` on every host other than this one, in parallel, as
/// horovodrun does before a launch: a host that does not answer within `timeout`
/// would otherwise make mpirun wait for ever for its daemon. Returns one line per
/// host that failed.
pub(crate) fn check_hosts(
    hosts: &[String],
    agent: &[String],
    timeout: std::time::Duration,
) -> Vec<String> {
    use std::time::Instant;
    let this = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let local = |h: &str| h == "localhost" || h == "127.0.0.1" || h == this.trim();
    let Some((program, first)) = agent.split_first() else {
        return vec!["no remote agent to reach the hosts with".into()];
    };
    let mut running = Vec::new();
    let mut failed = Vec::new();
    for h in hosts.iter().filter(|h| !local(h)) {
        let mut cmd = Command::new(program);
        cmd.args(first)
            .args([h.as_str(), "true"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        match cmd.spawn() {
            Ok(child) => running.push((h.clone(), child)),
            Err(e) => failed.push(format!("{h}: cannot run {program}: {e}")),
        }
    }
    let start = Instant::now();
    while !running.is_empty() {
        running.retain_mut(|(h, child)| match child.try_wait() {
            Ok(Some(status)) if status.success() => false,
            Ok(Some(status)) => {
                failed.push(format!(
                    "{h}: `{} {h} true` failed ({status})",
                    agent.join(" ")
                ));
                false
            }
            Ok(None) if start.elapsed() < timeout => true,
            Ok(None) | Err(_) => {
                failed.push(format!(
                    "{h}: `{} {h} true` did not answer within {:.0} s",
                    agent.join(" "),
                    timeout.as_secs_f64()
                ));
                // SAFETY: signalling the process group made for this child.
                unsafe { libc::killpg(child.id() as i32, libc::SIGKILL) };
                let _ = child.wait();
                false
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_checked_through_mpiruns_agent() {
        let args = ["--mca", "plm_rsh_agent", "/x/agent.sh"].map(String::from);
        assert_eq!(remote_agent(&args, &[]), ["/x/agent.sh"]);
        let e = [(
            "OMPI_MCA_plm_rsh_agent".to_string(),
            "ssh -p 2222 : rsh".to_string(),
        )];
        assert_eq!(remote_agent(&[], &e), ["ssh", "-p", "2222"]);
        assert_eq!(remote_agent(&[], &[])[0], "ssh");
        // An agent that answers, one that fails, one that hangs (cut at the timeout).
        let script = |body: &str| ["sh", "-c", body, "agent"].map(String::from).to_vec();
        let t = std::time::Duration::from_millis(500);
        let hosts = ["a".to_string(), "localhost".into()];
        assert!(check_hosts(&hosts, &script("exit 0"), t).is_empty());
        let failed = check_hosts(&hosts, &script("exit 3"), t);
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(
            failed[0].starts_with("a: ") && failed[0].contains("failed"),
            "{failed:?}"
        );
        let start = std::time::Instant::now();
        let failed = check_hosts(&hosts, &script("sleep 30"), t);
        assert!(failed[0].contains("did not answer within"), "{failed:?}");
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }
}
