//! Inside a Slurm allocation (`salloc`, `sbatch`): the number of ranks and the hosts
//! kolorun takes when `-np` and `-H`/`--hostfile` are not given, from the variables
//! Slurm sets (`SLURM_NTASKS`, `SLURM_JOB_NODELIST`, `SLURM_TASKS_PER_NODE`). With
//! `--max-restarts`, a node whose ranks failed is left out of the next attempt like any
//! host, so the job goes on within the allocation.

/// What the allocation gives: its job id, the task count and each node with its tasks.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Allocation {
    pub(crate) job: String,
    pub(crate) ntasks: u32,
    pub(crate) hosts: Vec<(String, usize)>,
}

/// The allocation kolorun runs in, if any: `var` reads the environment, `expand`
/// turns a Slurm node list into host names (`scontrol show hostnames`).
///
/// # Errors
/// Inside an allocation whose variables kolorun cannot read: says which and what to
/// give instead.
pub(crate) fn allocation(
    var: &dyn Fn(&str) -> Option<String>,
    expand: &dyn Fn(&str) -> Result<Vec<String>, String>,
) -> Result<Option<Allocation>, String> {
    let Some(job) = var("SLURM_JOB_ID").or_else(|| var("SLURM_JOBID")) else {
        return Ok(None);
    };
    let list = var("SLURM_JOB_NODELIST")
        .or_else(|| var("SLURM_NODELIST"))
        .ok_or_else(|| format!("inside Slurm job {job} without SLURM_JOB_NODELIST: give -H"))?;
    let names = expand(&list)?;
    let given = var("SLURM_NTASKS").or_else(|| var("SLURM_NPROCS"));
    let ntasks: Option<u32> = given
        .map(|n| {
            n.trim()
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("SLURM_NTASKS={n:?} is not a positive number"))
        })
        .transpose()?;
    // Each node's slots as mpirun counts them: its tasks, else (an allocation made
    // without a task count) its CPUs.
    let per_node = match (var("SLURM_TASKS_PER_NODE"), ntasks) {
        (Some(t), _) => tasks_per_node(&t)?,
        // One node, all tasks on it.
        (None, Some(n)) if names.len() == 1 => vec![n as usize],
        (None, _) => match var("SLURM_JOB_CPUS_PER_NODE") {
            Some(c) => tasks_per_node(&c)
                .map_err(|e| e.replace("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE"))?,
            None => {
                return Err(format!(
                    "inside Slurm job {job} on nodes {list:?} without a task count \
                     (SLURM_NTASKS, SLURM_TASKS_PER_NODE) or CPUs per node: kolorun cannot \
                     tell how many ranks each node takes; allocate with -n N, or give -np and -H"
                ))
            }
        },
    };
    let ntasks = match ntasks {
        Some(n) => n,
        None => u32::try_from(per_node.iter().sum::<usize>())
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("inside Slurm job {job}: no slots on its nodes"))?,
    };
    if per_node.len() != names.len() {
        return Err(format!(
            "SLURM_JOB_NODELIST={list:?} names {} nodes but SLURM_TASKS_PER_NODE gives {} counts",
            names.len(),
            per_node.len()
        ));
    }
    Ok(Some(Allocation {
        job,
        ntasks,
        hosts: names.into_iter().zip(per_node).collect(),
    }))
}

/// `SLURM_TASKS_PER_NODE`, e.g. `2(x3),1`: the tasks of each node in order.
pub(crate) fn tasks_per_node(s: &str) -> Result<Vec<usize>, String> {
    let bad = || format!("SLURM_TASKS_PER_NODE={s:?} is not of the form 2(x3),1");
    let mut out = Vec::new();
    for part in s.trim().split(',') {
        let (n, times) = match part.split_once("(x") {
            Some((n, rest)) => (n, rest.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let n: usize = n.parse().map_err(|_| bad())?;
        let times: usize = times.parse().map_err(|_| bad())?;
        out.extend(std::iter::repeat_n(n, times));
    }
    Ok(out)
}

/// The most nodes a node list may name (Slurm's largest clusters have tens of
/// thousands; a bigger list is a typo that would fill memory).
const MAX_NODES: usize = 1 << 20;

/// A Slurm node list (`node[01-03,07],gpu5`) as host names, without `scontrol`: ranges
/// keep their zero padding; one bracket per name, as Slurm writes lists for jobs.
pub(crate) fn expand_nodelist(s: &str) -> Result<Vec<String>, String> {
    let bad = |why: &str| format!("node list {s:?}: {why}");
    let mut out = Vec::new();
    // Split at commas outside brackets.
    let mut depth = 0;
    let mut start = 0;
    let mut items = Vec::new();
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&s[start..]);
    for item in items.into_iter().map(str::trim).filter(|i| !i.is_empty()) {
        let Some(open) = item.find('[') else {
            if item.contains(']') {
                return Err(bad("a \"]\" without its \"[\""));
            }
            out.push(item.to_string());
            continue;
        };
        let close = item
            .rfind(']')
            .filter(|&c| c > open)
            .ok_or_else(|| bad("an unclosed \"[\""))?;
        let (prefix, suffix) = (&item[..open], &item[close + 1..]);
        for range in item[open + 1..close].split(',') {
            let (a, b) = range.split_once('-').unwrap_or((range, range));
            let width = a.len();
            let (lo, hi): (u64, u64) = (
                a.parse().map_err(|_| bad("a range that is not numbers"))?,
                b.parse().map_err(|_| bad("a range that is not numbers"))?,
            );
            if hi < lo {
                return Err(bad("a range that runs backwards"));
            }
            if hi - lo >= MAX_NODES as u64 || out.len() + (hi - lo) as usize > MAX_NODES {
                return Err(bad(&format!("more than {MAX_NODES} nodes")));
            }
            for n in lo..=hi {
                out.push(format!("{prefix}{n:0width$}{suffix}"));
            }
        }
    }
    Ok(out)
}

/// `scontrol show hostnames LIST` (Slurm's own expansion), else [`expand_nodelist`].
pub(crate) fn scontrol_hostnames(list: &str) -> Result<Vec<String>, String> {
    match std::process::Command::new("scontrol")
        .args(["show", "hostnames", list])
        .output()
    {
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(String::from)
            .collect()),
        _ => expand_nodelist(list),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn tasks_per_node_expands_repeats() {
        assert_eq!(tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(tasks_per_node("4").unwrap(), [4]);
        assert!(tasks_per_node("2(x").is_err());
        assert!(tasks_per_node("two").is_err());
    }

    #[test]
    fn node_lists_expand_with_padding() {
        assert_eq!(
            expand_nodelist("node[01-03,07],gpu5").unwrap(),
            ["node01", "node02", "node03", "node07", "gpu5"]
        );
        assert_eq!(expand_nodelist("a,b").unwrap(), ["a", "b"]);
        assert_eq!(expand_nodelist("r[8-10]x").unwrap(), ["r8x", "r9x", "r10x"]);
        assert!(expand_nodelist("n[3-1]").is_err());
        assert!(expand_nodelist("n[1-2").is_err());
        // Issue 53 item 17: malformed lists are errors, never a panic.
        for bad in [
            "x][",
            "]x[",
            "x[]",
            "n[0-99999999999]",
            "[",
            "]",
            "n[a-b]",
            "n[1-]",
        ] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_allocation_gives_ranks_and_hosts() {
        let vars = [
            ("SLURM_JOB_ID", "42"),
            ("SLURM_NTASKS", "5"),
            ("SLURM_JOB_NODELIST", "n[1-2],m"),
            ("SLURM_TASKS_PER_NODE", "2(x2),1"),
        ];
        let a = allocation(&env(&vars), &|l| expand_nodelist(l))
            .unwrap()
            .unwrap();
        assert_eq!(a.ntasks, 5);
        assert_eq!(
            a.hosts,
            [("n1".into(), 2), ("n2".into(), 2), ("m".into(), 1)]
        );
        assert_eq!(
            allocation(&env(&[]), &|l| expand_nodelist(l)).unwrap(),
            None
        );
        let e = allocation(&env(&vars[..1]), &|l| expand_nodelist(l)).unwrap_err();
        assert!(e.contains("SLURM_JOB_NODELIST"), "{e}");
        // Issue 53 item 16: without task counts, the nodes' CPUs are their slots (as
        // mpirun counts them), not this machine alone; without those either, an error
        // that says why.
        let cpus = [
            ("SLURM_JOB_ID", "43"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
            ("SLURM_JOB_CPUS_PER_NODE", "4(x2)"),
        ];
        let a = allocation(&env(&cpus), &|l| expand_nodelist(l))
            .unwrap()
            .unwrap();
        assert_eq!(
            (a.ntasks, a.hosts),
            (8, vec![("n1".into(), 4), ("n2".into(), 4)])
        );
        let e = allocation(&env(&cpus[..2]), &|l| expand_nodelist(l)).unwrap_err();
        assert!(
            e.contains("cannot tell how many ranks each node takes"),
            "{e}"
        );
        let wrong = [
            ("SLURM_JOB_ID", "42"),
            ("SLURM_NTASKS", "5"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
            ("SLURM_TASKS_PER_NODE", "5"),
        ];
        let e = allocation(&env(&wrong), &|l| expand_nodelist(l)).unwrap_err();
        assert!(e.contains("2 nodes") && e.contains("1 counts"), "{e}");
    }
}
