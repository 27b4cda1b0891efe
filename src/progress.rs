//! Where a training run stands, for commits and resuming (framework-free: the
//! integrations store it in their checkpoints).

use serde::{Deserialize, Serialize};

/// Where training stood at a commit: enough, with the model and optimizer, to go on
/// exactly where it stopped — on the same number of ranks or another.
///
/// ```
/// let s = kolo::DistributedSampler::new(1000, 0, 2, 7);
/// // Committed after 12 steps of 16 samples per rank into epoch 3, on 2 ranks:
/// let p = kolo::Progress { epoch: 3, consumed: s.consumed(12, 16) as u64, step: 200, seed: 7, ranks: 2 };
/// // On resuming (the same ranks or fewer), the epoch goes on with what it has left:
/// let rest = s.indices_from(p.epoch, p.consumed as usize);
/// assert_eq!(rest, s.indices(3)[12 * 16..].to_vec());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Progress {
    /// The epoch in progress (0-based).
    pub epoch: u64,
    /// Samples of that epoch's order all ranks together went through
    /// ([`DistributedSampler::consumed`](crate::DistributedSampler::consumed)).
    pub consumed: u64,
    /// Optimizer steps taken since training began.
    pub step: u64,
    /// The seed of the data order (the sampler's).
    pub seed: u64,
    /// Ranks that trained up to the commit.
    pub ranks: u64,
}

/// Which attempt of the job this is: `KOLO_RESTART_COUNT`, which `kolorun
/// --max-restarts` sets on every rank (0 on the first attempt, and without kolorun),
/// or Slurm's `SLURM_RESTART_COUNT` for a batch job Slurm requeued (after a node
/// failure, by default), whichever is larger. A program resumes from its last commit
/// when it is above 0 ([`resume_decision`]).
pub fn restart_count() -> u32 {
    restart_count_in(&|k| std::env::var(k).ok())
}

fn restart_count_in(var: &dyn Fn(&str) -> Option<String>) -> u32 {
    ["KOLO_RESTART_COUNT", "SLURM_RESTART_COUNT"]
        .iter()
        .filter_map(|k| var(k)?.trim().parse::<u32>().ok())
        .max()
        .unwrap_or(0)
}

/// This run's identity, written into every commit so that a relaunch resumes its own
/// run and never another's: `KOLO_RUN_ID` (which `kolorun` sets on every rank, the
/// same for all its attempts, unless the user set it), else `slurm-<SLURM_JOB_ID>`
/// inside a Slurm job (a requeued job keeps its id); `None` otherwise.
pub fn run_id() -> Option<String> {
    run_id_in(&|k| std::env::var(k).ok())
}

fn run_id_in(var: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let set = |k: &str| {
        var(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    set("KOLO_RUN_ID").or_else(|| set("SLURM_JOB_ID").map(|id| format!("slurm-{id}")))
}

/// Why a program must not go on from what its checkpoint directory holds
/// ([`resume_decision`]): resuming would train from the wrong state, and starting
/// over would lose a run's progress.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResumeError {
    /// A relaunched attempt found no commit: rank 0 may now run on another host whose
    /// disk does not hold it, or the directory is not the one the run commits to.
    #[error(
        "{dir}: this is attempt {restart} of the run (KOLO_RESTART_COUNT or \
         SLURM_RESTART_COUNT) but rank 0 finds no commit there; not starting from \
         scratch. Is the checkpoint directory on a disk every host shares (rank 0 may \
         have moved: kolorun keeps rank 0's host unless --shared-checkpoints)?"
    )]
    NoCommit {
        /// The checkpoint directory.
        dir: String,
        /// The attempt.
        restart: u32,
    },
    /// The directory holds a commit of another run.
    #[error(
        "{dir}: the commit there is {}, this is {}; not loading it, and not \
         overwriting it by starting over. Resume it explicitly (e.g. --resume{}), or \
         commit to another directory",
        run_name(found), run_name(this),
        if found.is_empty() { String::new() } else { format!(", or KOLO_RUN_ID={found}") }
    )]
    OtherRun {
        /// The checkpoint directory.
        dir: String,
        /// The run that wrote the commit ("" when it had no identity).
        found: String,
        /// This run ("" when it has none).
        this: String,
    },
}

/// The file in a checkpoint directory that says which run started there
/// ([`mark_run_started`]).
const STARTED: &str = ".kolo-run";

/// Marks checkpoint directory `dir` as this run's ([`run_id`]; empty without one)
/// when it starts from scratch, so that a relaunch that finds no commit there can
/// tell "failed before its first commit" (start over) from "not the directory the
/// run committed to" (rank 0 on another host: [`ResumeError::NoCommit`]). Called by
/// rank 0 only (the integrations' `resume` does).
///
/// # Errors
/// The directory or the file cannot be written.
pub fn mark_run_started(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(STARTED), run_id().unwrap_or_default())
}

/// Whether `dir` was marked by this run ([`mark_run_started`]).
pub fn run_started_in(dir: &std::path::Path) -> bool {
    std::fs::read_to_string(dir.join(STARTED))
        .is_ok_and(|id| id.trim() == run_id().unwrap_or_default())
}

/// How [`ResumeError`] names a run.
fn run_name(id: &str) -> String {
    if id.is_empty() {
        "a run without an identity (KOLO_RUN_ID)".into()
    } else {
        format!("run {id:?}'s")
    }
}

/// Whether a program should go on from the commit in checkpoint directory `dir`:
/// `found` is the run identity of the commit there (`None`: no commit; `Some(None)`:
/// a commit without one, from a version before run identities or a run without
/// one), `asked` whether the user asked to resume (a `--resume` flag: any commit is
/// taken then, whoever wrote it), `started` whether this run marked the directory
/// when it started ([`run_started_in`]).
///
/// Otherwise the commit is taken when it is this run's ([`run_id`]); with no
/// identity on either side, when this is a relaunch ([`restart_count`] above 0, as
/// before run identities). A relaunch that finds no commit starts over only if the
/// run started in this directory (it failed before its first commit); no commit
/// otherwise, or another run's commit, is an error ([`ResumeError`]): never a silent
/// start from scratch, a silent load of yesterday's run, or its commit overwritten.
///
/// ```
/// // A first launch in an empty directory starts fresh.
/// assert_eq!(kolo::resume_decision("ck", None, false, false), Ok(false));
/// ```
///
/// # Errors
/// [`ResumeError::NoCommit`] on a relaunch with nothing to resume in a directory the
/// run did not start in; [`ResumeError::OtherRun`] for another run's commit (or a
/// commit and a run of which only one has an identity) when not asked to resume.
pub fn resume_decision(
    dir: impl AsRef<std::path::Path>,
    found: Option<Option<&str>>,
    asked: bool,
    started: bool,
) -> Result<bool, ResumeError> {
    decide(
        &dir.as_ref().display().to_string(),
        found,
        asked,
        run_id().as_deref(),
        restart_count(),
        started,
    )
}

fn decide(
    dir: &str,
    found: Option<Option<&str>>,
    asked: bool,
    this: Option<&str>,
    restart: u32,
    started: bool,
) -> Result<bool, ResumeError> {
    let Some(found) = found else {
        return if restart > 0 && !started {
            Err(ResumeError::NoCommit {
                dir: dir.into(),
                restart,
            })
        } else {
            Ok(false)
        };
    };
    if asked || found == this && (found.is_some() || restart > 0) {
        return Ok(true);
    }
    Err(ResumeError::OtherRun {
        dir: dir.into(),
        found: found.unwrap_or_default().into(),
        this: this.unwrap_or_default().into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issue53_slurm_requeues_count_as_restarts_and_identify_the_run() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(restart_count_in(&env(&[])), 0);
        assert_eq!(restart_count_in(&env(&[("SLURM_RESTART_COUNT", "2")])), 2);
        assert_eq!(
            restart_count_in(&env(&[
                ("KOLO_RESTART_COUNT", "1"),
                ("SLURM_RESTART_COUNT", "3")
            ])),
            3
        );
        assert_eq!(
            run_id_in(&env(&[("SLURM_JOB_ID", "77")])).as_deref(),
            Some("slurm-77")
        );
        assert_eq!(
            run_id_in(&env(&[("SLURM_JOB_ID", "77"), ("KOLO_RUN_ID", "mine")])).as_deref(),
            Some("mine")
        );
        assert_eq!(run_id_in(&env(&[])), None);
    }

    #[test]
    fn issue53_a_commit_is_taken_for_its_own_run_only() {
        let d = "ck";
        // Nothing there: fresh on a first launch, an error on a relaunch, unless the
        // run started in this directory (it failed before its first commit).
        assert_eq!(decide(d, None, false, Some("a"), 0, false), Ok(false));
        assert!(matches!(
            decide(d, None, false, Some("a"), 1, false),
            Err(ResumeError::NoCommit { restart: 1, .. })
        ));
        assert_eq!(decide(d, None, false, Some("a"), 1, true), Ok(false));
        // This run's commit: taken, relaunched or requeued or not.
        assert_eq!(
            decide(d, Some(Some("a")), false, Some("a"), 0, false),
            Ok(true)
        );
        assert_eq!(
            decide(d, Some(Some("a")), false, Some("a"), 2, false),
            Ok(true)
        );
        // Another run's: an error naming both, unless asked to resume.
        let e = decide(d, Some(Some("yesterday")), false, Some("today"), 1, false).unwrap_err();
        assert!(
            e.to_string()
                .contains("run \"yesterday\"'s, this is run \"today\"'s"),
            "{e}"
        );
        assert_eq!(
            decide(d, Some(Some("yesterday")), true, Some("today"), 0, false),
            Ok(true)
        );
        // Without identities: a relaunch takes it (as before), a first launch does not.
        assert_eq!(decide(d, Some(None), false, None, 1, false), Ok(true));
        assert!(decide(d, Some(None), false, None, 0, false).is_err());
        assert!(decide(d, Some(None), false, Some("a"), 1, false).is_err());
        assert!(decide(d, Some(Some("a")), false, None, 1, false).is_err());
    }
}
