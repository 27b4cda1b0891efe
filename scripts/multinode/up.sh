#!/usr/bin/env bash
# For a test stage named $1 (e.g. "multinode"): removes emulated hosts left over and
# sets up KOLO_MN_HOSTS × KOLO_MN_SLOTS of them (default 2 × 2, setup.sh). Exits 0
# when they are up; 3, printing "$1: SKIPPED" and why, when KOLO_MULTINODE=0 or this
# machine cannot make them (not root, no iproute2, no CAP_SYS_ADMIN); 1 when setting up
# failed. The caller tears them down (teardown.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
label=${1:-multinode}
if [ "${KOLO_MULTINODE:-}" = 0 ]; then
    echo "$label: SKIPPED (KOLO_MULTINODE=0)"
    exit 3
fi
scripts/multinode/teardown.sh >/dev/null 2>&1 || true
why=$(KOLO_MN_HOSTS=${KOLO_MN_HOSTS:-2} KOLO_MN_SLOTS=${KOLO_MN_SLOTS:-2} scripts/multinode/setup.sh 2>&1)
rc=$?
if [ $rc -eq 3 ]; then
    echo "$label: SKIPPED, this machine cannot emulate hosts: $why"
    exit 3
elif [ $rc -ne 0 ]; then
    echo "$label: setting up the emulated hosts failed: $why" >&2
    exit 1
fi
