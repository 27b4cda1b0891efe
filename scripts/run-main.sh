#!/usr/bin/env bash
# The main job: builds kolo and runs the example under `mpirun -np ${NP:-2}`.
# Installs OpenMPI and libclang first when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo build --release --example core_demo
exec mpirun -np "${NP:-2}" --bind-to none target/release/examples/core_demo "$@"
