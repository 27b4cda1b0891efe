//! Relaunching a failed job (`--max-restarts`): which host failed, which hosts and how
//! many ranks the next attempt gets (`--min-np`, `--host-discovery-script`).

use crate::hosts::flag_hosts;

/// Whether `name` (as mpirun printed it) is `host` (as -H gave it): equal, or equal
/// without the domain (mpirun may print a full name where -H had the short one).
pub(crate) fn same_host(name: &str, host: &str) -> bool {
    let short = |h: &str| h.split('.').next().unwrap_or(h).to_string();
    let address = |h: &str| h.starts_with('[') || h.parse::<std::net::IpAddr>().is_ok();
    name == host || (!address(name) && !address(host) && short(name) == short(host))
}

/// The host mpirun names in a failure line ("… on node NAME exited on signal 9", "…
/// on node NAME").
pub(crate) fn failed_host(lines: &[String]) -> Option<String> {
    lines.iter().find_map(|l| {
        let rest = &l[l.find(" on node ")? + " on node ".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != ',')
            .collect();
        let name = name.trim_end_matches('.').to_string();
        (!name.is_empty()).then_some(name)
    })
}

/// The hosts a `--host-discovery-script` printed: `host:slots` lines (Horovod's
/// contract; a bare host has one slot), blank lines and `#` comments skipped.
pub(crate) fn discovered(text: &str) -> Result<Vec<(String, usize)>, String> {
    let entries: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    flag_hosts(&entries.join(","))
}

/// The next attempt's hosts and number of ranks: `hosts` without those `left_out`,
/// and as many ranks as they have slots, at most `max_np`; an error naming both
/// numbers when fewer than `min_np` remain.
pub(crate) fn next_layout(
    hosts: &[(String, usize)],
    left_out: &[String],
    max_np: u32,
    min_np: u32,
) -> Result<(Vec<(String, usize)>, u32), String> {
    let kept: Vec<(String, usize)> = hosts
        .iter()
        .filter(|(h, _)| !left_out.contains(h))
        .cloned()
        .collect();
    let slots: usize = kept.iter().map(|(_, s)| s).sum();
    let np = u32::try_from(slots).unwrap_or(u32::MAX).min(max_np);
    if np < min_np {
        return Err(format!(
            "{np} rank(s) left on {} host(s) ({} left out: {}), fewer than --min-np {min_np}",
            kept.len(),
            left_out.len(),
            if left_out.is_empty() {
                "none".to_string()
            } else {
                left_out.join(", ")
            }
        ));
    }
    Ok((kept, np))
}

/// `hosts` as an `-H` value.
pub(crate) fn hosts_flag(hosts: &[(String, usize)]) -> String {
    hosts
        .iter()
        .map(|(h, s)| format!("{h}:{s}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether a job that ended with exit status `code` and mpirun's `cause` lines failed
/// as a job (and may be relaunched) rather than by the program's own error: a rank
/// died of a signal (mpirun exits with 128 + the signal, or names it), kolo ended it
/// because a peer stopped answering ([`kolo::RESTARTABLE_EXIT_CODE`]), or mpirun could
/// not start every rank.
pub(crate) fn restartable(code: i32, cause: &[String]) -> bool {
    code == kolo::RESTARTABLE_EXIT_CODE
        || code > 128
        || cause.iter().any(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("signal") || l.contains("unable to") || l.contains("failed to start")
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn signals_kolos_status_and_failed_starts_restart_program_errors_do_not() {
        use super::restartable;
        let none: Vec<String> = Vec::new();
        assert!(restartable(75, &none));
        assert!(restartable(137, &none));
        assert!(!restartable(1, &none));
        assert!(!restartable(3, &none));
        let killed = vec![
            "mpirun noticed that process rank 1 with PID 7 on node h2 exited on signal 9 (Killed)."
                .to_string(),
        ];
        assert!(restartable(1, &killed));
        let start = vec!["ORTE was unable to reliably start one or more daemons.".to_string()];
        assert!(restartable(1, &start));
    }

    use super::*;

    #[test]
    fn the_failed_host_is_read_from_mpiruns_line() {
        let lines = vec![
            "kolo: rank 3 panicked".to_string(),
            "mpirun noticed that process rank 1 with PID 0 on node h2 exited on signal 9 (Killed)."
                .to_string(),
        ];
        assert_eq!(failed_host(&lines).as_deref(), Some("h2"));
        assert_eq!(failed_host(&["no host here".to_string()]), None);
        assert!(same_host("h2.cluster.local", "h2") && same_host("h2", "h2"));
        assert!(!same_host("h3", "h2") && !same_host("10.0.0.2", "10.0.0.3"));
    }

    #[test]
    fn discovery_output_is_host_slots_lines() {
        assert_eq!(
            discovered("h1:2\n# spare\n\nh2\n"),
            Ok(vec![("h1".into(), 2), ("h2".into(), 1)])
        );
        assert_eq!(discovered(""), Ok(vec![]));
        assert!(discovered("-oProxyCommand=x:1").is_err());
    }

    #[test]
    fn a_failed_host_is_left_out_while_min_np_ranks_remain() {
        let hosts = vec![("h1".to_string(), 2), ("h2".to_string(), 2)];
        assert_eq!(next_layout(&hosts, &[], 4, 2), Ok((hosts.clone(), 4)));
        assert_eq!(
            next_layout(&hosts, &["h2".into()], 4, 2),
            Ok((vec![("h1".to_string(), 2)], 2))
        );
        let e = next_layout(&hosts, &["h1".into(), "h2".into()], 4, 2).unwrap_err();
        assert!(
            e.contains("fewer than --min-np 2") && e.contains("h1, h2"),
            "{e}"
        );
        // More slots than ranks asked for: still the ranks asked for.
        assert_eq!(next_layout(&hosts, &[], 3, 1).map(|l| l.1), Ok(3));
        assert_eq!(hosts_flag(&hosts), "h1:2,h2:2");
    }
}
