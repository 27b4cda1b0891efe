#!/usr/bin/env bash
# The benchmark across emulated hosts (scripts/multinode): 2 hosts × 1 and × 2 ranks,
# links rate-limited to 10 Gbit/s and 1 Gbit/s; kolo flat, kolo hierarchical (with 2
# ranks per host), and a plain MPI program (per tensor and pre-packed), alternating
# launches, printed as ratios. Root only (network namespaces).
#   scripts/run-multinode-bench.sh [--rates "10gbit 1gbit"] [--ppn "1 2"] [--only 1,2,3,4]
# KOLO_BENCH_REPS / KOLO_BENCH_ROUNDS as for scripts/run-bench.sh (default here 5 / 2).
set -euo pipefail
cd "$(dirname "$0")/.."
rates="10gbit 1gbit"; ppns="1 2"; only="1,2,3,4"
while [ $# -gt 0 ]; do
    case "$1" in
        --rates) rates=$2; shift 2 ;;
        --ppn) ppns=$2; shift 2 ;;
        --only) only=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
source scripts/setup.sh
scripts/multinode/teardown.sh >/dev/null 2>&1 || true
KOLO_MN_HOSTS=2 KOLO_MN_SLOTS=2 scripts/multinode/setup.sh
trap 'scripts/multinode/teardown.sh' EXIT
export KOLO_BENCH_REPS=${KOLO_BENCH_REPS:-5} KOLO_BENCH_ROUNDS=${KOLO_BENCH_ROUNDS:-2}
export RAYON_NUM_THREADS=1
for rate in $rates; do
    scripts/multinode/shape.sh "$rate"
    for ppn in $ppns; do
        echo "=== links $rate, 2 hosts x $ppn"
        cargo bench -p kolo --bench kolo_vs_mpi -- --hosts 2 --np $((2 * ppn)) --only "$only"
    done
done
