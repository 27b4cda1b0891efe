#!/usr/bin/env bash
# The main job: trains an MLP on the handwritten digits embedded in smartcore,
# data-parallel over `mpirun -np ${NP:-2}` ranks with kolo-burn. Extra arguments go to
# the program (e.g. --epochs 10, --checkpoint DIR --resume, --bench). It is launched
# with kolorun: KOLO_HOSTS=host1:2,host2:2 (and KOLORUN_ARGS, e.g.
# "--network-interface eth0") runs it across hosts, the repository at the same path on
# each.
# Installs OpenMPI and libclang first when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo build --release -p kolo-burn --example train_digits
cargo build --release -p kolorun
# kolorun gives each rank cores ÷ ranks per host compute threads.
# shellcheck disable=SC2086
exec target/release/kolorun -np "${NP:-2}" ${KOLO_HOSTS:+-H "$KOLO_HOSTS"} ${KOLORUN_ARGS:-} \
    target/release/examples/train_digits "$@"
