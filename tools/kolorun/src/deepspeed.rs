//! DeepSpeed's launcher habits (`deepspeed --hostfile H --num_nodes N --num_gpus G`,
//! `--include` / `--exclude host:slots`): which hosts and how many slots of each a
//! job uses, taken from the hosts kolorun was given (`-H`, `--hostfile`, or this
//! machine).

/// DeepSpeed's host and slot filters.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Filters {
    /// `--num_nodes N`: the first N hosts.
    pub(crate) num_nodes: Option<u32>,
    /// `--num_gpus G`: G slots of each host.
    pub(crate) num_gpus: Option<u32>,
    /// `--include`: only these hosts (and slots).
    pub(crate) include: Option<String>,
    /// `--exclude`: all but these hosts (or slots).
    pub(crate) exclude: Option<String>,
}

impl Filters {
    /// Whether any filter is given.
    pub(crate) fn any(&self) -> bool {
        self.num_nodes.is_some()
            || self.num_gpus.is_some()
            || self.include.is_some()
            || self.exclude.is_some()
    }
}

/// A host of DeepSpeed's selection syntax, with the slot indices given (`None`: all).
type Pick = (String, Option<Vec<usize>>);

/// DeepSpeed's `--include` / `--exclude` value: hosts separated by `@`, each
/// optionally followed by `:` and comma-separated slot indices
/// (`worker-0@worker-1:0,2`).
fn picks(value: &str, flag: &str) -> Result<Vec<Pick>, String> {
    let mut out = Vec::new();
    for part in value.split('@').map(str::trim).filter(|p| !p.is_empty()) {
        let (host, slots) = match part.split_once(':') {
            Some((h, s)) => {
                let slots = s
                    .split(',')
                    .map(|x| {
                        x.trim().parse::<usize>().map_err(|_| {
                            format!("{flag} {value:?}: {x:?} in {part:?} is not a slot index")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                (h.to_string(), Some(slots))
            }
            None => (part.to_string(), None),
        };
        out.push((host, slots));
    }
    if out.is_empty() {
        return Err(format!("{flag} {value:?} names no host"));
    }
    Ok(out)
}

/// The hosts and slots `hosts` keep under `f`, in order, hosts left with no slot
/// dropped.
///
/// # Errors
/// `--include` with `--exclude`, or either with `--num_nodes` / `--num_gpus` (as
/// DeepSpeed refuses them together); a host or slot index the hosts do not have;
/// more nodes asked for than there are; nothing left.
pub(crate) fn select(
    hosts: &[(String, usize)],
    f: &Filters,
) -> Result<Vec<(String, usize)>, String> {
    if f.include.is_some() && f.exclude.is_some() {
        return Err("--include and --exclude cannot be used together".into());
    }
    if (f.include.is_some() || f.exclude.is_some())
        && (f.num_nodes.is_some() || f.num_gpus.is_some())
    {
        return Err(
            "--include/--exclude cannot be combined with --num_nodes/--num_gpus (as in DeepSpeed)"
                .into(),
        );
    }
    let mut kept: Vec<(String, usize)> = match &f.include {
        Some(v) => include(hosts, v)?,
        None => hosts.to_vec(),
    };
    if let Some(v) = &f.exclude {
        exclude(hosts, &mut kept, v)?;
    }
    if let Some(n) = f.num_nodes {
        if n as usize > kept.len() {
            return Err(format!(
                "--num_nodes {n}: the job has {} hosts ({})",
                kept.len(),
                kept.iter()
                    .map(|(h, _)| h.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        kept.truncate(n as usize);
    }
    if let Some(g) = f.num_gpus {
        for (host, slots) in &mut kept {
            if g as usize > *slots {
                return Err(format!("--num_gpus {g}: {host} has {slots} slots"));
            }
            *slots = g as usize;
        }
    }
    kept.retain(|(_, s)| *s > 0);
    if kept.is_empty() {
        return Err("the DeepSpeed filters leave no host and slot to run on".into());
    }
    Ok(kept)
}

/// The slots `hosts` gives `host`, or why `flag` cannot name it.
fn known(hosts: &[(String, usize)], host: &str, flag: &str) -> Result<usize, String> {
    hosts
        .iter()
        .find(|(h, _)| h == host)
        .map(|(_, s)| *s)
        .ok_or_else(|| {
            let names: Vec<&str> = hosts.iter().map(|(h, _)| h.as_str()).collect();
            format!("{flag}: host {host:?} is not one of the job's hosts {names:?}")
        })
}

/// The distinct slot indices `slots` of `host`, which has `have`, or why not.
fn distinct(host: &str, mut slots: Vec<usize>, have: usize, flag: &str) -> Result<usize, String> {
    if let Some(s) = slots.iter().find(|&&s| s >= have) {
        return Err(format!("{flag}: {host} has slots 0..{have}, not slot {s}"));
    }
    slots.sort_unstable();
    slots.dedup();
    Ok(slots.len())
}

/// `--include`: the hosts (and slots) it names, in its order.
fn include(hosts: &[(String, usize)], value: &str) -> Result<Vec<(String, usize)>, String> {
    let mut out = Vec::new();
    for (host, slots) in picks(value, "--include")? {
        let have = known(hosts, &host, "--include")?;
        let n = match slots {
            Some(s) => distinct(&host, s, have, "--include")?,
            None => have,
        };
        out.push((host, n));
    }
    Ok(out)
}

/// `--exclude`: takes the hosts (or slots) it names out of `kept`.
fn exclude(
    hosts: &[(String, usize)],
    kept: &mut [(String, usize)],
    value: &str,
) -> Result<(), String> {
    for (host, slots) in picks(value, "--exclude")? {
        let have = known(hosts, &host, "--exclude")?;
        let gone = match slots {
            Some(s) => distinct(&host, s, have, "--exclude")?,
            None => have,
        };
        if let Some(e) = kept.iter_mut().find(|(h, _)| *h == host) {
            e.1 = e.1.saturating_sub(gone);
        }
    }
    Ok(())
}

/// A copy of the hostfile `text` with the hosts of `kept` only, each with its slots
/// (`slots=N`, `max_slots=` dropped) and its other settings (`username=`, …) as the
/// user wrote them; comments and blank lines stay.
pub(crate) fn slotted_hostfile(text: &str, kept: &[(String, usize)]) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let content = line.split('#').next().unwrap_or("");
        let mut words = content.split_whitespace();
        let Some(host) = words.next() else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let Some((_, slots)) = kept.iter().find(|(h, _)| h == host) else {
            continue;
        };
        let mut l = format!("{host} slots={slots}");
        for w in words {
            let key = w.split_once('=').map_or(w, |(k, _)| k);
            let slot_key = matches!(
                key,
                "slots" | "cpu" | "count" | "max_slots" | "max-slots" | "slots_max" | "slots-max"
            );
            if !slot_key {
                l.push(' ');
                l.push_str(w);
            }
        }
        out.push_str(&l);
        out.push('\n');
    }
    out
}

/// Applies DeepSpeed's filters given on the command line to the job's hosts (`-H`,
/// `--hostfile` — a copy with the kept hosts and slots —, or this machine with
/// `--num_gpus` slots) and sets `-np` to their slots when it is not given; ends
/// kolorun saying why when they cannot apply.
pub(crate) fn apply(args: &mut crate::args::Args) {
    use crate::fail;
    let f = Filters {
        num_nodes: args.num_nodes,
        num_gpus: args.num_gpus,
        include: args.include.clone(),
        exclude: args.exclude.clone(),
    };
    if !f.any() {
        return;
    }
    if args.host_discovery_script.is_some() {
        fail("--num_nodes/--num_gpus/--include/--exclude pick among given hosts: use -H or --hostfile, not --host-discovery-script");
    }
    let text = args.hostfile.as_ref().map(|file| {
        std::fs::read_to_string(file)
            .unwrap_or_else(|e| fail(&format!("cannot read --hostfile {file}: {e}")))
    });
    let hosts: Vec<(String, usize)> = if let Some(h) = &args.hosts {
        crate::hosts::flag_hosts(h).unwrap_or_else(|e| fail(&format!("-H {h}: {e}")))
    } else if let Some(text) = &text {
        crate::hosts::hostfile_hosts(text)
            .unwrap_or_else(|e| fail(&format!("--hostfile: {e}")))
            .into_iter()
            .map(|(h, s)| {
                let s = s.unwrap_or_else(|| {
                    fail(&format!(
                        "--hostfile: {h} has no slots=; DeepSpeed's filters count slots"
                    ))
                });
                (h, s)
            })
            .collect()
    } else {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        vec![(
            "localhost".to_string(),
            f.num_gpus.map_or(cores, |g| g as usize),
        )]
    };
    let kept = select(&hosts, &f).unwrap_or_else(|e| fail(&e));
    let total: usize = kept.iter().map(|(_, s)| s).sum();
    if let Some(text) = &text {
        let copy = std::env::temp_dir().join(format!("kolorun-{}-ds.hostfile", std::process::id()));
        if let Err(e) = std::fs::write(&copy, slotted_hostfile(text, &kept)) {
            fail(&format!("cannot write {}: {e}", copy.display()));
        }
        args.hostfile = Some(copy.display().to_string());
    } else if args.hosts.is_some() {
        args.hosts = Some(crate::elastic::hosts_flag(&kept));
    }
    match args.np {
        None => args.np = Some(total as u32),
        Some(n) if n as usize > total => fail(&format!(
            "-np {n} is more than the {total} slots DeepSpeed's filters keep ({})",
            crate::elastic::hosts_flag(&kept)
        )),
        Some(_) => {}
    }
    eprintln!(
        "kolorun: DeepSpeed's filters keep {} ({} ranks)",
        crate::elastic::hosts_flag(&kept),
        args.np.unwrap_or(0)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts() -> Vec<(String, usize)> {
        vec![("a".into(), 4), ("b".into(), 4), ("c".into(), 2)]
    }

    fn f(nodes: Option<u32>, gpus: Option<u32>, inc: Option<&str>, exc: Option<&str>) -> Filters {
        Filters {
            num_nodes: nodes,
            num_gpus: gpus,
            include: inc.map(String::from),
            exclude: exc.map(String::from),
        }
    }

    fn pairs(v: &[(&str, usize)]) -> Vec<(String, usize)> {
        v.iter().map(|(h, s)| (h.to_string(), *s)).collect()
    }

    #[test]
    fn num_nodes_and_gpus_take_the_first_hosts_and_slots() {
        assert_eq!(
            select(&hosts(), &f(Some(2), Some(2), None, None)),
            Ok(pairs(&[("a", 2), ("b", 2)]))
        );
        assert_eq!(
            select(&hosts(), &f(None, Some(2), None, None)),
            Ok(pairs(&[("a", 2), ("b", 2), ("c", 2)]))
        );
        assert!(select(&hosts(), &f(Some(4), None, None, None))
            .unwrap_err()
            .contains("has 3 hosts"));
        assert!(select(&hosts(), &f(None, Some(3), None, None))
            .unwrap_err()
            .contains("c has 2 slots"));
    }

    #[test]
    fn include_and_exclude_read_deepspeeds_syntax() {
        assert_eq!(
            select(&hosts(), &f(None, None, Some("a@b:0,2"), None)),
            Ok(pairs(&[("a", 4), ("b", 2)]))
        );
        assert_eq!(
            select(&hosts(), &f(None, None, None, Some("a@c:1"))),
            Ok(pairs(&[("b", 4), ("c", 1)]))
        );
        assert!(select(&hosts(), &f(None, None, Some("d"), None))
            .unwrap_err()
            .contains("\"d\" is not one of"));
        assert!(select(&hosts(), &f(None, None, Some("c:2"), None))
            .unwrap_err()
            .contains("not slot 2"));
        assert!(select(&hosts(), &f(None, None, Some("a:x"), None))
            .unwrap_err()
            .contains("not a slot index"));
        assert!(select(&hosts(), &f(None, None, Some("a"), Some("b"))).is_err());
        assert!(select(&hosts(), &f(Some(1), None, Some("a"), None)).is_err());
        assert!(select(&hosts(), &f(None, None, None, Some("a@b@c")))
            .unwrap_err()
            .contains("leave no host"));
    }

    #[test]
    fn the_hostfile_copy_keeps_other_settings() {
        let text = "# cluster\na slots=4 username=u1\nb max_slots=8\nc slots=2\n";
        assert_eq!(
            slotted_hostfile(text, &pairs(&[("a", 2), ("b", 3)])),
            "# cluster\na slots=2 username=u1\nb slots=3\n"
        );
    }
}
