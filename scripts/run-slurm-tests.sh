#!/usr/bin/env bash
# The Slurm stage of the README's test command (issue 37): starts a one-node Slurm
# cluster on this machine (scripts/slurm/start.sh: munge, slurmctld and slurmd from
# Debian's packages, installed when missing), runs the digits example through
# `srun --mpi=pmix` and through kolorun inside `salloc` (without -np, and with a rank
# killed under --max-restarts), and stops every daemon it started. Skips, saying so,
# where Slurm cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
if [ "$(id -u)" -ne 0 ]; then
    echo "kolo: the Slurm tests start slurmd, which needs root: skipping them" >&2
    exit 0
fi
if ! command -v slurmctld >/dev/null && ! command -v apt-get >/dev/null; then
    echo "kolo: Slurm is not installed and apt-get is missing: skipping the Slurm tests" >&2
    exit 0
fi
trap 'scripts/slurm/stop.sh' EXIT
eval "$(scripts/slurm/start.sh)"
export SLURM_CONF KOLO_SLURM=1
cargo test -p kolo-burn --release --test burn_multirank -- slurm/
