#!/usr/bin/env bash
# Shows that kolo's element loops compile to packed SIMD instructions: the scaling
# loop (engine::execute::scale_bytes) and the ring reduction (transport::ring::add_into).
# Prints the packed instructions found in each; fails if one has none.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
BIN=$(cargo bench -p kolo --bench kolo_vs_mpi --no-run 2>&1 |
    grep -o 'target/release/deps/kolo_vs_mpi-[0-9a-f]*' | head -1)
status=0
for sym in 4kolo6engine7execute11scale_bytes 4kolo9transport4ring8add_into; do
    packed=$(objdump -d --no-show-raw-insn "$BIN" |
        awk "/<_ZN${sym}.*>:\$/,/^\$/" |
        grep -oE '\b(v?(mul|add)p[sd]|v?padd[bwdq])\b' | sort | uniq -c | tr '\n' ' ')
    echo "${sym}: ${packed:-NO PACKED INSTRUCTIONS}"
    [ -n "$packed" ] || status=1
done
exit $status
