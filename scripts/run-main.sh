#!/usr/bin/env bash
# The main job: trains an MLP on the handwritten digits embedded in smartcore,
# data-parallel over `mpirun -np ${NP:-2}` ranks with kolo-burn. Extra arguments go to
# the program (e.g. --epochs 10, --checkpoint DIR --resume, --bench).
# Installs OpenMPI and libclang first when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo build --release -p kolo-burn --example train_digits
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1}
exec mpirun -np "${NP:-2}" --bind-to none target/release/examples/train_digits "$@"
