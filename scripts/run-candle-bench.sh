#!/usr/bin/env bash
# Benchmarks kolo-candle against plain single-process candle on two MLPs (0.67 M and
# 10 M parameters), alternating launches of the plain program and kolo's mpirun
# ranks; prints steps/s and per-rank / plain ratios at np 1 and 2.
# KOLO_BENCH_REPS=N sets the repetitions (default 5); --model small|big for one model.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
exec cargo bench -p kolo-candle --bench candle_mlp -- --bench "$@"
