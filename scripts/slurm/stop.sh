#!/usr/bin/env bash
# Stops the daemons scripts/slurm/start.sh started (by their pid files).
cd "$(dirname "$0")/../.."
root=$(pwd)/target/slurm
for pid in "$root"/slurmd.*.pid "$root/slurmctld.pid" "$root/munge/munged.pid"; do
    if [ -f "$pid" ]; then
        kill "$(cat "$pid")" 2>/dev/null || true
    fi
done
# Wait for them to go (slurmd ends its job steps first).
for _ in $(seq 40); do
    alive=0
    for pid in "$root"/slurmd.*.pid "$root/slurmctld.pid" "$root/munge/munged.pid"; do
        if [ -f "$pid" ] && kill -0 "$(cat "$pid")" 2>/dev/null; then alive=1; fi
    done
    [ "$alive" = 0 ] && exit 0
    sleep 0.25
done
echo "kolo slurm: a daemon did not stop" >&2
exit 1
