//! Network presets: a published GPU cluster and this build machine.

use kolo::sim::{Link, Network};

/// A DGX A100 cluster: 8 GPUs per host on NVLink, one 200 Gbit/s HDR InfiniBand
/// interface per GPU, a non-blocking fat tree.
///
/// Sources: NVIDIA's DGX A100 datasheet (8 A100 GPUs, NVLink 3 at 600 GB/s per GPU
/// both ways, 8 × 200 Gb/s ConnectX-6 compute interfaces); NCCL's own latency model
/// (`src/graph/tuning.cc`: about 0.5–2 µs per NVLink hop, about 5 µs per network
/// hop for its low-latency protocols). Bandwidths are what a flow achieves, not the
/// signalling rate: 200 GB/s on NVLink (nccl-tests reach ~230 GB/s bus bandwidth on
/// one DGX A100), 24 GB/s per HDR interface. Fusion copies run at HBM speed (A100:
/// 1.5 TB/s, a copy reads and writes: 700 GB/s). The negotiation code is charged at
/// this machine's CPU speed.
pub(crate) fn cluster() -> Network {
    Network {
        ranks_per_host: 8,
        intra: Link {
            latency: 1e-6,
            bandwidth: 200e9,
        },
        inter: Link {
            latency: 5e-6,
            bandwidth: 24e9,
        },
        nics_per_host: 8,
        oversubscription: 1.0,
        copy_bandwidth: 700e9,
        cpu_scale: 1.0,
    }
}

/// This machine's emulated hosts (`../shared/multinode`): ranks of one host talk over
/// Open MPI's shared memory (measured here: a 4-byte allreduce ~0.4 µs a step at
/// np 2, 1 MiB at 5 GB/s), hosts over veth pairs rate-limited to `gbit` (tbf measures
/// 0.96 of the nominal rate); the start-up of a TCP message across two network
/// namespaces, ~40 µs, was measured with the 4-rank validation runs of the README.
/// memcpy runs at 11 GB/s.
pub(crate) fn here(ranks_per_host: usize, gbit: f64) -> Network {
    Network {
        ranks_per_host,
        intra: Link {
            latency: 0.5e-6,
            bandwidth: 5e9,
        },
        inter: Link {
            latency: 40e-6,
            bandwidth: gbit * 0.96e9 / 8.0,
        },
        nics_per_host: 1,
        oversubscription: 1.0,
        copy_bandwidth: 11e9,
        cpu_scale: 1.0,
    }
}
