#!/usr/bin/env bash
# The CNN example's speed against plain single-process Burn (issue 39): alternating
# launches of examples/plain_digits_cnn (one process, BatchNorm) and of
# train_digits_cnn --bench under mpirun -np 2 with SyncBatchNorm and with BatchNorm;
# 5 epochs at --batch-size 8, one compute thread per rank. Prints per-rank steps/s
# (median and range) and, per launch pair, np2 per rank / plain, and SyncBatchNorm /
# BatchNorm at np 2 (the cost of the statistics' allreduces).
# KOLO_BENCH_REPS=N sets the repetitions (default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
cargo build --release -p kolo-burn --example train_digits_cnn --example plain_digits_cnn
reps="${KOLO_BENCH_REPS:-5}"
ex=target/release/examples
export RAYON_NUM_THREADS=1
result() { grep -o 'steps_per_s=[0-9.]*' | head -1 | cut -d= -f2; }
plain=() sync=() batch=()
for _ in $(seq "$reps"); do
    plain+=("$(GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=2147483647 \
        "$ex/plain_digits_cnn" 5 8 | result)")
    sync+=("$(mpirun -np 2 --bind-to none "$ex/train_digits_cnn" --bench --epochs 5 --norm sync </dev/null | result)")
    batch+=("$(mpirun -np 2 --bind-to none "$ex/train_digits_cnn" --bench --epochs 5 --norm batch </dev/null | result)")
done
stats() { tr ' ' '\n' | sort -g | awk -v f="${1:-%.1f}" '{v[NR]=$1} END {printf "%8s [" f "-" f "]", sprintf(f, v[int((NR+1)/2)]), v[1], v[NR]}'; }
ratios() { paste -d' ' <(printf '%s\n' $1) <(printf '%s\n' $2) | awk '{print $1/$2}' | stats %.2f; }
echo "CNN on the digits, batch 8 per rank, 5 epochs, $reps alternating launches (steps/s per rank)"
echo "  plain Burn, 1 process, BatchNorm      $(echo "${plain[*]}" | stats)"
echo "  kolo np2, SyncBatchNorm               $(echo "${sync[*]}" | stats)   per rank / plain $(ratios "${sync[*]}" "${plain[*]}" | sed 's/^ *//')"
echo "  kolo np2, BatchNorm                   $(echo "${batch[*]}" | stats)   per rank / plain $(ratios "${batch[*]}" "${plain[*]}" | sed 's/^ *//')"
echo "  SyncBatchNorm / BatchNorm at np2      $(ratios "${sync[*]}" "${batch[*]}" | sed 's/^ *//')"
