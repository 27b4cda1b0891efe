//! Which way a flat host sum travels: kolo's ring, recursive halving and doubling, or
//! MPI's allreduce (`AllreduceAlgorithm`), by size and job; and how far the halving
//! goes. Pure rules: the MPI transport follows them, and `kolo::sim`'s model of kolo
//! calls the same functions.

/// How a flat host sum travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlatSum {
    Ring,
    HalvingDoubling,
    Mpi,
}

/// Where `AllreduceAlgorithm::Auto` stops using the ring for many ranks: below this
/// many bytes per ring step (the buffer over the ranks), its 2(N−1) start-ups cost
/// more than the halving's 2·log₂N (`kolo-sim`: at 512 ranks on the DGX A100 preset a
/// 4 MiB sum, 8 KiB a step, took 5.5 ms around a flat ring and 0.14 ms halving).
const RING_MIN_STEP_BYTES_AT_SCALE: usize = 256 << 10;
/// The ranks from which `Auto` chooses between the ring and the halving by step size
/// (below, the measured thresholds of the ring stand: at 4 ranks the ring sends 6
/// messages where the halving sends 4).
const HALVING_MIN_RANKS: usize = 8;
/// Sums below this size stay with MPI's allreduce (Open MPI's recursive doubling).
const HALVING_MIN_BYTES: usize = 10_000;

/// Halving a piece smaller than this costs a message start-up more than sending it
/// whole saves (the start-up over the bandwidth is ~100 kB on 200 Gbit/s InfiniBand
/// at 5 µs, ~5 kB on this machine's emulated 1 Gbit/s links); the halving stops
/// there and recursive doubling sums what is left.
const PIECE_BYTES: usize = 64 << 10;

/// The same for a step whose partners share a host: its extra start-up is the
/// host's (shared memory or NVLink, ~1 µs), and halving there shrinks what every
/// later step sends across hosts. `kolo-sim` at 4096 ranks, hosts of 8 (DGX A100
/// preset): a 64 KiB sum by recursive doubling 73.6 µs, halving its three
/// host-local steps first 54.6 µs (the α–β bound 48.7 µs). Below a few kilobytes
/// the start-up costs more than the bytes it saves.
const NEAR_PIECE_BYTES: usize = 2 << 10;

/// How many of the `steps` of recursive halving and doubling halve a buffer of
/// `bytes` (the same on every rank). The first `near` steps pair ranks of one host
/// (the butterfly pairs the nearest ranks first): they halve while the piece each
/// rank keeps stays at least [`NEAR_PIECE_BYTES`] and a step across hosts follows;
/// then steps across hosts halve while the piece stays at least [`PIECE_BYTES`].
pub(crate) fn halvings(bytes: usize, steps: u32, near: u32) -> u32 {
    let near = near.min(steps);
    let mut m = 0;
    if near < steps {
        while m < near && bytes >> (m + 1) >= NEAR_PIECE_BYTES {
            m += 1;
        }
        if m < near {
            return m;
        }
    }
    while m < steps && bytes >> (m + 1) >= PIECE_BYTES {
        m += 1;
    }
    m
}

/// `Auto` pipelines the hierarchical allreduce from this many hosts (where
/// `kolo-sim` says it gains from 4 MiB), ...
const PIPELINE_MIN_HOSTS: usize = 8;
/// ... and with fewer hosts, sums of at least this many bytes. Measured on 2
/// emulated hosts × 2 ranks (`kolo_vs_mpi --hosts 2 --np 4`, 2 launches each way,
/// kolo's time with 2 MiB pieces and without): one 64 MiB sum 616–622 vs 726–736 ms
/// at 1 Gbit/s, 105–119 vs 130–166 ms at 10 Gbit/s; the ResNet-50 set (tensors of
/// 2–9 MB) 1067–1097 vs 1021–1038 ms and 197–226 vs 203–204 ms, no gain, so the
/// smaller sums stay in one piece there.
const PIPELINE_MIN_BYTES_FEW_HOSTS: usize = 64 << 20;
/// ... in pieces of this many bytes (up to [`MAX_PIECES`] of them, larger
/// beyond): `kolo-sim`, DGX A100 preset, 4096 ranks, ratio to the α–β bound of a
/// 16 / 32 / 64 MiB sum: pieces of 1 MiB 1.50 / 1.49 / 1.48, of 2 MiB 1.36 / 1.24 /
/// 1.13, of 4 MiB 1.45 / 1.28 / 1.12, of 8 MiB 1.58 / 1.38 / 1.24, without
/// pieces 1.85 each (similar at 64 and 512 ranks). Smaller pieces pay their
/// start-ups more often; larger ones leave the network idle while the first is
/// reduced inside the host and the last spread.
const PIPELINE_PIECE_BYTES: usize = 2 << 20;

/// The most pieces the pipelined hierarchical allreduce cuts a buffer into.
pub(crate) const MAX_PIECES: usize = 64;

/// How many pieces the hierarchical allreduce cuts a sum of `bytes` across `hosts`
/// hosts into (1: the three phases one after another over the whole buffer), with
/// `setting` the piece size asked for (`KOLO_HIERARCHICAL_PIECE_BYTES`; None: by
/// size and hosts, 0: never). The same on every rank.
pub(crate) fn hierarchical_pieces(setting: Option<usize>, bytes: usize, hosts: usize) -> usize {
    let piece = match setting {
        Some(0) => return 1,
        Some(b) => b,
        None if hosts >= PIPELINE_MIN_HOSTS || bytes >= PIPELINE_MIN_BYTES_FEW_HOSTS => {
            PIPELINE_PIECE_BYTES
        }
        None => return 1,
    };
    (bytes / piece).clamp(1, MAX_PIECES)
}

/// How a flat sum of `bytes` over `n` ranks travels under `algorithm`; the same on
/// every rank (nothing rank-specific goes in).
pub(crate) fn flat_sum(
    algorithm: crate::vocab::AllreduceAlgorithm,
    n: usize,
    bytes: usize,
    multi_host: bool,
    ring_min_bytes: usize,
) -> FlatSum {
    use crate::vocab::AllreduceAlgorithm as A;
    match algorithm {
        A::Ring => FlatSum::Ring,
        A::HalvingDoubling => FlatSum::HalvingDoubling,
        A::Mpi => FlatSum::Mpi,
        _ => {
            let scale = multi_host && n >= HALVING_MIN_RANKS;
            if bytes >= ring_min_bytes && (!scale || bytes / n >= RING_MIN_STEP_BYTES_AT_SCALE) {
                FlatSum::Ring
            } else if scale && bytes >= HALVING_MIN_BYTES {
                FlatSum::HalvingDoubling
            } else {
                FlatSum::Mpi
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{flat_sum, halvings, hierarchical_pieces, FlatSum};
    /// The MPI transport's ring minima (`transport/mpi/rings.rs`).
    const RING_MIN_BYTES_HOSTS: usize = 1 << 20;
    const RING_MIN_BYTES_ONE_HOST: usize = 32 << 20;
    use crate::vocab::AllreduceAlgorithm as A;

    #[test]
    fn auto_keeps_small_jobs_as_measured_and_halves_mid_sizes_at_scale() {
        let hosts = |n, b| flat_sum(A::Auto, n, b, true, RING_MIN_BYTES_HOSTS);
        // Up to 4 ranks: the ring from 1 MiB across hosts, MPI below, as before.
        assert_eq!(hosts(4, 1 << 20), FlatSum::Ring);
        assert_eq!(hosts(4, 512 << 10), FlatSum::Mpi);
        // Many ranks: the ring only while a step moves 256 KiB.
        assert_eq!(hosts(4096, 1 << 30), FlatSum::Ring);
        assert_eq!(hosts(4096, 64 << 20), FlatSum::HalvingDoubling);
        assert_eq!(hosts(512, 100_000), FlatSum::HalvingDoubling);
        assert_eq!(hosts(512, 4_000), FlatSum::Mpi);
        // One host: unchanged.
        let one = |n, b| flat_sum(A::Auto, n, b, false, RING_MIN_BYTES_ONE_HOST);
        assert_eq!(one(16, 1 << 20), FlatSum::Mpi);
        assert_eq!(one(16, 64 << 20), FlatSum::Ring);
        // Forced.
        assert_eq!(
            flat_sum(A::HalvingDoubling, 3, 4, false, 0),
            FlatSum::HalvingDoubling
        );
        assert_eq!(flat_sum(A::Mpi, 3, 1 << 30, true, 0), FlatSum::Mpi);
    }

    #[test]
    fn halving_goes_further_inside_hosts() {
        // 12 steps, none inside a host: halve while pieces stay 64 KiB.
        assert_eq!(halvings(32 << 10, 12, 0), 0);
        assert_eq!(halvings(1 << 20, 12, 0), 4);
        // The first three inside hosts of 8: those halve down to 2 KiB pieces.
        assert_eq!(halvings(32 << 10, 12, 3), 3);
        assert_eq!(halvings(8 << 10, 12, 3), 2);
        assert_eq!(halvings(4, 12, 3), 0);
        // Past the host's steps the 64 KiB rule again (1 MiB: 8 pieces of 128 KiB,
        // then one more halving to 64 KiB).
        assert_eq!(halvings(1 << 20, 12, 3), 4);
        assert_eq!(halvings(64 << 20, 12, 3), 10);
        // Every step inside one host: nothing to save across hosts, the 64 KiB rule.
        assert_eq!(halvings(32 << 10, 3, 3), 0);
        assert_eq!(halvings(1 << 20, 3, 3), 3);
    }

    #[test]
    fn large_sums_across_many_hosts_go_in_pieces() {
        assert_eq!(hierarchical_pieces(None, 64 << 20, 512), 32);
        assert_eq!(hierarchical_pieces(None, 3 << 20, 512), 1);
        assert_eq!(hierarchical_pieces(None, 1 << 30, 512), 64);
        assert_eq!(hierarchical_pieces(None, 63 << 20, 2), 1);
        assert_eq!(hierarchical_pieces(None, 64 << 20, 2), 32);
        assert_eq!(hierarchical_pieces(Some(0), 64 << 20, 512), 1);
        assert_eq!(hierarchical_pieces(Some(4 << 20), 64 << 20, 2), 16);
        assert_eq!(hierarchical_pieces(Some(1), 5, 2), 5);
    }
}
