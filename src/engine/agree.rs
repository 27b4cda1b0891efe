//! Start-up agreement: every rank takes rank 0's shared settings (fusion, cache,
//! autotune, hierarchy) and decides from every rank's ranks-per-host whether
//! allreduce and allgather run hierarchically. Run once, before the first cycle.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::transport::{Topology, Transport};

/// Settings every rank must share, because every rank plans the same fusion batches
/// and cache slots: rank 0's values win.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Agreed {
    pub(super) fusion_threshold: usize,
    /// Tensors above this many bytes are not fused.
    pub(super) fusion_max_tensor: usize,
    pub(super) cache_capacity: usize,
    /// Rank 0 runs the autotuner; the others apply what it sends.
    pub(super) autotune: bool,
    /// Asked for a hierarchical allreduce (whether it runs depends on the hosts).
    pub(super) hierarchical_allreduce: bool,
    /// Not set either way: hierarchical across hosts for sums of at least
    /// [`HIERARCHICAL_AUTO_MIN_BYTES`], where it was measured faster.
    pub(super) hierarchical_allreduce_auto: bool,
    /// Asked for a hierarchical allgather (likewise).
    pub(super) hierarchical_allgather: bool,
    /// Large sums across hosts in groups (None: measured at start).
    pub(super) grouped_ring: Option<bool>,
    /// How host sums that are not hierarchical travel.
    pub(super) allreduce_algorithm: crate::vocab::AllreduceAlgorithm,
    /// The hierarchical allreduce's pipeline pieces (None: by size and hosts).
    pub(super) hierarchical_piece_bytes: Option<usize>,
}

#[cfg(any(test, feature = "sim"))]
impl Agreed {
    /// Fusion at `fusion_threshold` bytes (kolo's largest fused tensor), the cache
    /// with `cache_capacity` slots, nothing else switched on: what the simulator and
    /// the engine's unit tests run with.
    pub(super) fn plain(fusion_threshold: usize, cache_capacity: usize) -> Agreed {
        Agreed {
            fusion_threshold,
            fusion_max_tensor: crate::config::MAX_FUSED_TENSOR_BYTES,
            cache_capacity,
            autotune: false,
            hierarchical_allreduce: false,
            hierarchical_allreduce_auto: false,
            hierarchical_allgather: false,
            grouped_ring: None,
            allreduce_algorithm: crate::vocab::AllreduceAlgorithm::Auto,
            hierarchical_piece_bytes: None,
        }
    }
}

/// Whether allreduce and allgather run hierarchically, and whether they could (what
/// the autotuner may switch); the same on every rank.
#[derive(Debug, Clone, Copy)]
pub(super) struct HierarchyChoice {
    pub(super) on: bool,
    pub(super) allgather_on: bool,
    pub(super) possible: bool,
}

/// Takes rank 0's shared settings, warning on ranks configured differently, and
/// decides with every rank's number of ranks per host whether the transport
/// allreduces hierarchically.
pub(super) fn agree(t: &mut dyn Transport, config: &Config) -> Result<(Agreed, HierarchyChoice)> {
    let mine = Agreed {
        fusion_threshold: config.fusion_threshold,
        fusion_max_tensor: config.fusion_max_tensor,
        cache_capacity: config.cache_capacity,
        autotune: config.autotune,
        hierarchical_allreduce: config.hierarchical_allreduce,
        hierarchical_allreduce_auto: !config.hierarchical_allreduce_explicit,
        hierarchical_allgather: config.hierarchical_allgather,
        grouped_ring: config.grouped_ring,
        allreduce_algorithm: config.allreduce_algorithm,
        hierarchical_piece_bytes: config.hierarchical_piece_bytes,
    };
    let topology = t.topology();
    let bytes = postcard::to_stdvec(&(mine, topology.local_size as u64))
        .map_err(|e| Error::Internal(format!("encoding settings: {e}")))?;
    let all = t.exchange(&bytes, &mut |_: std::time::Duration| {})?;
    let all: Vec<(Agreed, u64)> = all
        .iter()
        .map(|b| postcard::from_bytes(b))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::Internal(format!("decoding another rank's settings: {e}")))?;
    let (first, _) = *all
        .first()
        .ok_or_else(|| Error::Internal("rank 0 sent no settings".into()))?;
    if first != mine {
        tracing::warn!(
            rank = topology.rank,
            "this rank's shared settings ({mine:?}) differ from rank 0's; using rank 0's {first:?}"
        );
    }
    let per_host: Vec<u64> = all.iter().map(|&(_, l)| l).collect();
    let auto = first.hierarchical_allreduce_auto;
    let reduce = hierarchical(first.hierarchical_allreduce || auto, &topology, &per_host);
    let gather = hierarchical(first.hierarchical_allgather, &topology, &per_host);
    if topology.rank == 0 {
        for (asked, shape, op) in [
            (first.hierarchical_allreduce, &reduce, "allreduce"),
            (first.hierarchical_allgather, &gather, "allgather"),
        ] {
            match shape {
                Hierarchy::Flat(why) if asked => tracing::warn!(
                    "KOLO_HIERARCHICAL_{} is set, but {why}: {op} stays flat",
                    op.to_ascii_uppercase()
                ),
                Hierarchy::On => tracing::debug!(
                    hosts = topology.cross_size,
                    ranks_per_host = topology.local_size,
                    from_bytes = if auto && op == "allreduce" {
                        HIERARCHICAL_AUTO_MIN_BYTES
                    } else {
                        0
                    },
                    "hierarchical {op} on"
                ),
                Hierarchy::Flat(_) => {}
            }
        }
    }
    let choice = HierarchyChoice {
        on: reduce == Hierarchy::On,
        allgather_on: gather == Hierarchy::On,
        possible: hierarchical(true, &topology, &per_host) == Hierarchy::On,
    };
    t.set_hierarchical_allreduce(choice.on);
    t.set_hierarchical_min_bytes(if auto { HIERARCHICAL_AUTO_MIN_BYTES } else { 0 });
    t.set_hierarchical_allgather(choice.allgather_on);
    // Every rank, with rank 0's choice: the link probe behind `None` is collective.
    t.choose_grouped_ring(first.grouped_ring)?;
    t.set_allreduce_algorithm(first.allreduce_algorithm);
    t.set_hierarchical_piece_bytes(first.hierarchical_piece_bytes);
    Ok((first, choice))
}

/// Left unset, the allreduce runs hierarchically across hosts (with the same number,
/// at least two, of ranks each) for sums of this many bytes or more. Measured across
/// 2 emulated hosts × 2 ranks (`scripts/run-multinode-bench.sh`), hierarchical ÷
/// flat: 1000 fused 1 KiB tensors (one allreduce of 1 MiB) 1.09–1.15 (slower) at 1
/// and 10 Gbit/s; the ResNet-50 set (161 tensors, those above 64 KiB reduced each in
/// place, most of its bytes in tensors of 2–9 MB) 0.74–0.75 at 1 Gbit/s and 0.89–1.03
/// at 10 Gbit/s; one 64 MiB tensor 0.74 and 0.94–1.01. With this threshold the
/// ResNet-50 set ran 0.99× the all-hierarchical time at 1 Gbit/s (1.10× at 10 Gbit/s).
pub(super) const HIERARCHICAL_AUTO_MIN_BYTES: usize = 2 << 20;

/// Whether allreduce runs hierarchically, or why not.
#[derive(Debug, PartialEq)]
enum Hierarchy {
    On,
    Flat(String),
}

/// Decides the allreduce's shape from the request, this rank's topology and every
/// rank's number of ranks on its host (the same on every rank: every input is).
fn hierarchical(requested: bool, t: &Topology, per_host: &[u64]) -> Hierarchy {
    if !requested {
        return Hierarchy::Flat("it was not asked for".into());
    }
    if t.cross_size <= 1 {
        return Hierarchy::Flat("every rank is on one host".into());
    }
    if per_host.iter().all(|&l| l <= 1) {
        return Hierarchy::Flat("every host has one rank".into());
    }
    if per_host.iter().any(|&l| l != per_host[0]) {
        let mut sizes: Vec<u64> = per_host.to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        return Hierarchy::Flat(format!(
            "hosts have different numbers of ranks ({})",
            sizes
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Hierarchy::On
}

#[cfg(test)]
mod hierarchy_tests {
    use super::{hierarchical, Hierarchy};
    use crate::transport::Topology;

    fn at(local_size: usize, cross_size: usize) -> Topology {
        Topology {
            rank: 0,
            size: local_size * cross_size,
            local_rank: 0,
            local_size,
            cross_rank: 0,
            cross_size,
        }
    }

    #[test]
    fn hierarchical_only_where_it_can_help_and_hosts_are_alike() {
        assert_eq!(hierarchical(true, &at(2, 2), &[2, 2, 2, 2]), Hierarchy::On);
        let flat = |h| match h {
            Hierarchy::Flat(why) => why,
            Hierarchy::On => panic!("hierarchical"),
        };
        assert!(flat(hierarchical(false, &at(2, 2), &[2; 4])).contains("not asked"));
        assert!(flat(hierarchical(true, &at(4, 1), &[4; 4])).contains("one host"));
        assert!(flat(hierarchical(true, &at(1, 3), &[1; 3])).contains("one rank"));
        let why = flat(hierarchical(true, &at(2, 2), &[2, 2, 1]));
        assert!(why.contains("different numbers of ranks (1, 2)"), "{why}");
    }
}
