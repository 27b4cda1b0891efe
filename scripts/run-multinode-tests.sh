#!/usr/bin/env bash
# The multi-host stage of the README's test command: sets up 2 emulated hosts × 2
# slots (network namespaces, scripts/multinode), runs the multinode/ trials of the
# collectives suite across them (topology, collectives, process sets, kolorun -H end
# to end, SIGKILL of a rank on h2, a partition), and removes the hosts again.
# Where this machine cannot make namespaces (not root, no iproute2, a container without
# CAP_SYS_ADMIN) it says so and skips; KOLO_MULTINODE=0 skips on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
rc=0
scripts/multinode/up.sh multinode || rc=$?
if [ $rc -eq 3 ]; then
    exit 0
elif [ $rc -ne 0 ]; then
    exit 1
fi
trap 'scripts/multinode/teardown.sh' EXIT
cargo build --release -p kolorun
# One trial at a time: the hosts and two cores are shared.
KOLO_MULTINODE=1 cargo test -p kolo --release --test collectives -- multinode/ --test-threads 1
KOLO_MULTINODE=1 cargo test -p kolo-burn --release --test burn_multirank -- multinode/ --test-threads 1
