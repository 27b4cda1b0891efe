#!/usr/bin/env bash
# The Slurm stage of the README's test command (issue 37): starts a one-node Slurm
# cluster on this machine (scripts/slurm/start.sh: munge, slurmctld and slurmd from
# Debian's packages, installed when missing), runs the digits example through
# `srun --mpi=pmix` and through kolorun inside `salloc` (without -np, and with a rank
# killed under --max-restarts); then, where this machine can emulate hosts
# (scripts/multinode), a slurmd on each of 2 emulated hosts, and a job across them that
# loses a rank on h2 and goes on without that node. Stops every daemon it started.
# Skips, saying so, where Slurm cannot run (not root, no apt to install it).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
if [ "$(id -u)" -ne 0 ]; then
    echo "slurm: SKIPPED, slurmd needs root" >&2
    exit 0
fi
if ! command -v slurmctld >/dev/null && ! command -v apt-get >/dev/null; then
    echo "slurm: SKIPPED, Slurm is not installed and apt-get is missing" >&2
    exit 0
fi
cleanup() {
    scripts/slurm/stop.sh || true
    if [ "${hosts_up:-0}" = 1 ]; then scripts/multinode/teardown.sh >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
eval "$(scripts/slurm/start.sh)"
export SLURM_CONF
KOLO_SLURM=1 cargo test -p kolo-burn --release --test burn_multirank -- slurm/
scripts/slurm/stop.sh
rc=0
KOLO_MN_HOSTS=2 KOLO_MN_SLOTS=2 scripts/multinode/up.sh "slurm across hosts" || rc=$?
if [ $rc -eq 3 ]; then
    exit 0
elif [ $rc -ne 0 ]; then
    exit 1
fi
hosts_up=1
eval "$(KOLO_SLURM_HOSTS=2 scripts/slurm/start.sh)"
export SLURM_CONF
KOLO_SLURM=hosts KOLO_SLURM_ON_H1="$(pwd)/scripts/multinode/on-h1.sh" \
    cargo test -p kolo-burn --release --test burn_multirank -- slurm_hosts/
