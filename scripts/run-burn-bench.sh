#!/usr/bin/env bash
# Benchmarks kolo-burn against plain single-process Burn on two MLPs (0.67 M and 10 M
# parameters), alternating launches of the plain program and kolo's mpirun ranks;
# prints steps/s, the share spent reducing and np2 per-rank / plain ratios.
# KOLO_BENCH_REPS=N sets the repetitions (default 5); --model small|big for one model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
exec cargo bench -p kolo-burn --bench burn_mlp -- --bench "$@"
