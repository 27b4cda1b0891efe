//! Start every rank from the same model and optimizer state.

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use kolo::Kolo;

use crate::error::{Error, Result};

/// Makes every rank's `module` equal to `root`'s: values and parameter ids (which Burn
/// draws at random per process). Call it on every rank before the first step.
///
/// # Errors
/// - [`Error::Record`] on the root when it cannot serialise its module, and
///   [`Error::OtherRank`] on every other rank, naming the root and Burn's message;
/// - [`Error::Record`] on a rank that cannot load the root's module;
/// - [`Error::Kolo`]: the broadcast failed.
pub fn broadcast_parameters<M: Module>(kolo: &Kolo, module: M, root: usize) -> Result<M> {
    let what = What {
        name: "kolo_burn.parameters",
        own: "serialising the module",
        other: "serialise the module for broadcast_parameters",
    };
    let serialise = || module.clone().into_record().into_bytes();
    let Some(bytes) = from_root(kolo, root, &what, serialise)? else {
        return Ok(module);
    };
    let record =
        ModuleRecord::from_bytes(Bytes::from_bytes_vec(bytes)).map_err(|e| Error::Record {
            what: "loading the root's module",
            message: e.to_string(),
        })?;
    Ok(module.load_record(record))
}

/// Makes every rank's optimizer state (e.g. Adam's moments) equal to `root`'s. Call
/// it after [`broadcast_parameters`], so that the parameter ids the state is keyed by
/// agree, and before the first step.
///
/// # Errors
/// - [`Error::Record`] on the root when it cannot serialise its optimizer state, and
///   [`Error::OtherRank`] on every other rank, naming the root and Burn's message;
/// - [`Error::Record`] on a rank that cannot load the root's state;
/// - [`Error::Kolo`]: the broadcast failed.
pub fn broadcast_optimizer_state(
    kolo: &Kolo,
    optim: ModuleOptimizer,
    root: usize,
) -> Result<ModuleOptimizer> {
    let what = What {
        name: "kolo_burn.optimizer_state",
        own: "serialising the optimizer state",
        other: "serialise the optimizer state for broadcast_optimizer_state",
    };
    let serialise = || optim.into_bytes();
    let Some(bytes) = from_root(kolo, root, &what, serialise)? else {
        return Ok(optim);
    };
    optim
        .from_bytes(Bytes::from_bytes_vec(bytes))
        .map_err(|e| Error::Record {
            what: "loading the root's optimizer state",
            message: e.to_string(),
        })
}

/// What is broadcast: the collective's name, and the failed step in the root's words
/// and in the other ranks' words.
struct What {
    name: &'static str,
    own: &'static str,
    other: &'static str,
}

/// `root`'s serialised bytes on every other rank (`None` on the root, which keeps its
/// own value). The root sends its bytes or why it has none, so that its failure fails
/// every rank instead of leaving them waiting for a broadcast that never comes.
fn from_root<E: std::fmt::Display>(
    kolo: &Kolo,
    root: usize,
    what: &What,
    serialise: impl FnOnce() -> std::result::Result<Bytes, E>,
) -> Result<Option<Vec<u8>>> {
    let mine: std::result::Result<Vec<u8>, String> = if kolo.rank() == root {
        serialise().map(|b| b.to_vec()).map_err(|e| e.to_string())
    } else {
        Ok(Vec::new())
    };
    let got = kolo.broadcast_object(what.name, mine, root)?;
    root_result(kolo.rank(), root, what, got)
}

/// What the root's broadcast result means on `rank`.
fn root_result(
    rank: usize,
    root: usize,
    what: &What,
    got: std::result::Result<Vec<u8>, String>,
) -> Result<Option<Vec<u8>>> {
    match got {
        Ok(_) if rank == root => Ok(None),
        Ok(bytes) => Ok(Some(bytes)),
        Err(message) if rank == root => Err(Error::Record {
            what: what.own,
            message,
        }),
        Err(message) => Err(Error::OtherRank {
            rank: root,
            what: what.other,
            message,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::{root_result, What};

    /// A root that could not serialise fails itself with Burn's message and every other
    /// rank with the root's rank and the same message.
    #[test]
    fn a_root_failure_fails_every_rank() {
        let what = &What {
            name: "kolo_burn.parameters",
            own: "serialising the module",
            other: "serialise the module for broadcast_parameters",
        };
        let got = || Err("Duplicate tensor name 'w'".to_string());
        let root = root_result(1, 1, what, got()).map(|_| ());
        let root = root.map_err(|e| e.to_string());
        assert_eq!(
            root,
            Err("serialising the module: Duplicate tensor name 'w'".into())
        );
        let other = root_result(0, 1, what, got()).map(|_| ());
        let other = other.map_err(|e| e.to_string());
        assert_eq!(
            other,
            Err(
                "rank 1 could not serialise the module for broadcast_parameters: \
                 Duplicate tensor name 'w'"
                    .into()
            )
        );
        assert_eq!(root_result(1, 1, what, Ok(vec![1])).ok(), Some(None));
        assert_eq!(
            root_result(0, 1, what, Ok(vec![1])).ok(),
            Some(Some(vec![1]))
        );
    }
}
