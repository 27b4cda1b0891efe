#!/usr/bin/env bash
# Runs every kolo test: unit tests, doc tests and the multi-rank tests, which launch
# real `mpirun -np 1..4` jobs. Installs OpenMPI and libclang first when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
cargo fmt --all -- --check
# Lints and docs are enforced, not advisory: any warning fails the run.
cargo clippy --workspace --release --all-targets -- -D warnings
cargo clippy -p kolo -p kolorun --release --features nccl,fault-injection --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --release
# The examples as a user builds them: `cargo test` compiles examples with the test
# harness and leaves no runnable `target/release/examples/<name>`, which the digits
# tests launch under mpirun.
cargo build --workspace --release --examples
cargo test --workspace --release --all-targets
cargo test --workspace --release --doc
# The NCCL transport (feature "nccl") builds and runs without CUDA: its no-GPU tests
# (missing-driver errors, id exchange, device checks) run here; the GPU cases are
# ignored unless KOLO_TEST_GPU=1 (README, "GPUs").
# The same build runs the injected faults (feature fault-injection, test-only).
cargo test -p kolo -p kolorun --release --features nccl,fault-injection --all-targets
# Across hosts: 2 emulated hosts × 2 ranks (network namespaces), when this machine can
# make them; it says so when it skips.
scripts/run-multinode-tests.sh
# Slurm (issue 37): a one-node cluster on this machine, srun and kolorun inside salloc.
scripts/run-slurm-tests.sh
# A chaos soak (issue 54), one minute of faults every 3-8 s on 2 emulated hosts × 2
# ranks: the digits example must end with the parameters of an uninterrupted run, no
# process left behind and only complete commits (about 2 minutes; skipped, saying so,
# where hosts cannot be emulated). The 10-minute soak: scripts/chaos-soak.sh.
scripts/chaos-soak.sh --minutes 1 --seed 5401 --interval 3-8 --steps 24000
# Burn on GPUs (kolo-burn's features `cuda` and `cpu`, issue 32): built once, offline
# (scripts/build-cuda.sh installs LLVM 22 when missing), linted and documented; then
# the route's tests that need no GPU — on Burn's CubeCL CPU runtime (`cube_`), and
# `--device cuda` without a CUDA driver (`nodriver_`). The GPU cases (`gpu_`) are
# ignored unless KOLO_TEST_GPU=1 (README, "Burn on GPUs").
# Part of every run (issue 53 item 30), last, so that its examples (built with the
# features) replace the plain ones only after the tests above ran them. Measured
# here: the build 17 min from a build directory without the features (1015 s), clippy
# 96 s, docs 81 s, the Cube tests about 3.5 min with the digits example at one epoch.
# KOLO_CUDA_STAGE=0 skips it (a quick local run).
if [ "${KOLO_CUDA_STAGE:-1}" = 1 ]; then
    scripts/build-cuda.sh
    source scripts/cuda-env.sh
    kolo_cuda_env
    cargo clippy -p kolo-burn --release --features cuda,cpu --all-targets -- -D warnings
    RUSTDOCFLAGS="-D warnings" cargo doc -p kolo-burn --no-deps --release --features cuda,cpu
    cargo test -p kolo-burn --release --features cuda,cpu --lib
    cargo test -p kolo-burn --release --features cuda,cpu --test burn_multirank -- cube_
    cargo test -p kolo-burn --release --features cuda,cpu --test burn_multirank -- nodriver_
fi
