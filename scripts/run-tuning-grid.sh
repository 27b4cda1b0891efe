#!/usr/bin/env bash
# Fusion threshold x cycle time grid, default settings and autotuned settings, on two
# workloads under `mpirun -np $NP` (default 2):
#   - the ResNet-50 gradient set (161 f32 tensors, reverse order): median step, ms;
#   - the Burn digits example (kolo-burn, fused gradient reducer): samples/s.
# The autotuned row is measured after the tuner has finished (ResNet: same run; digits:
# a tuning run, then a run with the settings its log chose).
# Every cell is the median of RUNS launches (the machine is noisy).
# Env: NP, MAX (configurations the tuner tries, 12), STEPS (steps per sample, 5),
# EPOCHS (digits epochs per measurement, 10), REPS (ResNet steps measured, 15), RUNS (3).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
kolo_one_machine
NP=${NP:-2}
MAX=${MAX:-12}
STEPS=${STEPS:-5}
EPOCHS=${EPOCHS:-10}
REPS=${REPS:-15}
RUNS=${RUNS:-3}
cargo build --release -p kolo-burn --example train_digits
BENCH=$(cargo bench -p kolo --bench kolo_vs_mpi --no-run 2>&1 |
    grep -o 'target/release/deps/kolo_vs_mpi-[0-9a-f]*' | head -1)
DIGITS=target/release/examples/train_digits
TUNE=(KOLO_AUTOTUNE=1 KOLO_AUTOTUNE_BAYES_OPT_MAX_SAMPLES=$MAX
    KOLO_AUTOTUNE_STEPS_PER_SAMPLE=$STEPS KOLO_AUTOTUNE_WARMUP_SAMPLES=2)
export RAYON_NUM_THREADS=1

resnet1() { # env assignments... -> "ms threshold cycle_us cache"
    env "$@" KOLO_BENCH_RESNET=$REPS mpirun -np "$NP" --bind-to none "$BENCH" |
        awk '/RESNET_MS/ {print $2, $6, $8, $10}'
}
digits1() { # env assignments... -> samples/s
    env "$@" mpirun -np "$NP" --bind-to none "$DIGITS" --bench --epochs "$EPOCHS" |
        awk '/samples\/s/ {for (i = 1; i <= NF; i++) if ($i == "samples/s") print $(i-1)}'
}
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
resnet() { for _ in $(seq "$RUNS"); do resnet1 "$@" | cut -d' ' -f1; done | median; }
digits() { for _ in $(seq "$RUNS"); do digits1 "$@"; done | median; }
# The settings in the last ("best") row of an autotune log, as KOLO_* assignments.
chosen() {
    tail -n 1 "$1" | awk -F, '$6 == "best" {
        printf "KOLO_FUSION_THRESHOLD=%s KOLO_CYCLE_TIME=%s KOLO_CACHE_CAPACITY=%s\n", $2, $3, ($4 == 1 ? 1024 : 0) }'
}

printf '%-34s %14s %14s\n' "setting (np=$NP)" "ResNet ms" "digits samples/s"
row() { printf '%-34s %14s %14s\n' "$1" "$2" "$3"; }

row "default (4 MiB, 1 ms)" "$(resnet)" "$(digits)"

R=$(resnet1 "${TUNE[@]}" KOLO_AUTOTUNE_LOG=/tmp/kolo-grid-resnet.csv)
read -r _ R_T R_C R_K <<<"$R"
R_SET=(KOLO_FUSION_THRESHOLD=$R_T KOLO_CYCLE_TIME=$(awk "BEGIN {print $R_C / 1000}")
    KOLO_CACHE_CAPACITY=$([ "$R_K" = true ] && echo 1024 || echo 0))
env "${TUNE[@]}" KOLO_AUTOTUNE_LOG=/tmp/kolo-grid-digits.csv \
    mpirun -np "$NP" --bind-to none "$DIGITS" --bench --epochs 30 >/dev/null
read -r -a D_SET <<<"$(chosen /tmp/kolo-grid-digits.csv)"
row "autotuned ResNet: $(echo "$R" | awk '{printf "%d B, %.1f ms, cache %s", $2, $3/1000, $4}')" \
    "$(resnet "${R_SET[@]}")" "-"
row "autotuned digits: ${D_SET[*]:-none}" "-" "$(digits "${D_SET[@]}")"

for mib in 0 1 4 16 64; do
    for ms in 0.1 1 5; do
        set_env=(KOLO_FUSION_THRESHOLD=$((mib << 20)) KOLO_CYCLE_TIME=$ms)
        row "threshold ${mib} MiB, cycle ${ms} ms" \
            "$(resnet "${set_env[@]}")" "$(digits "${set_env[@]}")"
    done
done
echo "autotune logs: /tmp/kolo-grid-resnet.csv /tmp/kolo-grid-digits.csv"
