#!/usr/bin/env bash
# Builds kolo-burn's Cube features offline — `cuda` (Burn's CUDA backend, gradients
# reduced by kolo's NCCL path) and `cpu` (Burn's CubeCL CPU runtime: the same route,
# kolo's MPI host path in place of NCCL) — with its examples, tests and benchmark,
# on a fresh Debian 12 machine: installs LLVM 22 when missing (see
# scripts/cuda-env.sh for why and how). No CUDA install is needed to build; running
# on a GPU needs the NVIDIA driver and libnccl.
#
# Usage: scripts/build-cuda.sh [extra cargo build args]   (honours CARGO_TARGET_DIR)
# Then, e.g.: kolorun -np 2 target/release/examples/train_digits --device cpu
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
source scripts/cuda-env.sh
kolo_cuda_env

# One build with both features: they share every crate but the two runtimes, and the
# binaries then take `--device cuda` and `--device cpu` alike.
start=$(date +%s)
cargo build --release -p kolo-burn --features cuda,cpu --examples --tests --benches --bins "$@"
echo "kolo build-cuda: kolo-burn --features cuda,cpu built in $(( $(date +%s) - start )) s" >&2
