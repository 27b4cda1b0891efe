#!/usr/bin/env bash
# Benchmarks kolo against raw MPI on the same data in the same run, under
# `mpirun -np 2` and `-np 4` (pass `--np N` for one size, `--quick` for a short run).
# Prints a table of medians and kolo/raw ratios; JSON lands in target/kolo-bench-np<N>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
exec cargo bench -p kolo --bench kolo_vs_mpi -- "$@"
