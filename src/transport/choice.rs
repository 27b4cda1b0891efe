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

/// How many of the `steps` of recursive halving and doubling halve a buffer of
/// `bytes` (the same on every rank): while the piece each rank holds stays at least
/// [`PIECE_BYTES`].
pub(crate) fn halvings(bytes: usize, steps: u32) -> u32 {
    let mut m = 0;
    while m < steps && bytes >> (m + 1) >= PIECE_BYTES {
        m += 1;
    }
    m
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
    use super::{flat_sum, FlatSum};
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
}
