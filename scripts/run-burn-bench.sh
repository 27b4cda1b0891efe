#!/usr/bin/env bash
# Benchmarks kolo-burn against plain single-process Burn on two MLPs (0.67 M and 10 M
# parameters), alternating launches of the plain program and kolo's mpirun ranks;
# prints steps/s, the share spent reducing and np2 per-rank / plain ratios.
# KOLO_BENCH_REPS=N sets the repetitions (default 5); --model small|big|pipe for one
# model (pipe: the 4-layer MLP of the pipeline rows, not run by default);
# KOLO_BENCH_PATHS=reducer,pipeline,... runs only those paths;
# --device cuda|cpu runs Burn's CUDA backend or CubeCL CPU runtime (built as
# scripts/build-cuda.sh does).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
features=()
if [[ " $* " == *" --device cuda "* || " $* " == *" --device cpu "* ]]; then
    source scripts/cuda-env.sh
    kolo_cuda_env
    features=(--features cuda,cpu)
fi
exec cargo bench -p kolo-burn "${features[@]}" --bench burn_mlp -- --bench "$@"
