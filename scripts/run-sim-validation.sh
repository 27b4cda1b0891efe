#!/usr/bin/env bash
# Issue 58's validation: kolo-sim's predictions against kolo measured on the emulated
# hosts (scripts/multinode), 4 hosts x 1 rank and 2 hosts x 2 ranks, links shaped to
# 1 and 10 Gbit/s: the ResNet-50 gradient set and one 64 MiB tensor, each submitted at
# once (the benchmark's rows 3 and 4, kolo's default settings), beside the simulator's
# prediction at the nominal rate and at the rate the 64 MiB row implies. Root only.
#   scripts/run-sim-validation.sh [--rates "1gbit 10gbit"] [--shapes "4x1 2x2"]
set -euo pipefail
cd "$(dirname "$0")/.."
rates="1gbit 10gbit"; shapes="4x1 2x2"
while [ $# -gt 0 ]; do
    case "$1" in
        --rates) rates=$2; shift 2 ;;
        --shapes) shapes=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
source scripts/setup.sh
cargo build --release -p kolo-sim
cargo bench -p kolo --bench kolo_vs_mpi --no-run
bench=$(ls -t target/release/deps/kolo_vs_mpi-* | grep -v '\.d$' | head -1)
export RAYON_NUM_THREADS=1 KOLO_BENCH_REPS=${KOLO_BENCH_REPS:-5} KOLO_BENCH_ROUNDS=${KOLO_BENCH_ROUNDS:-2}
trap 'scripts/multinode/teardown.sh >/dev/null 2>&1 || true' EXIT
sim() { # ranks-per-host gbit workload -> predicted ms
    target/release/kolo-sim --preset here --ranks 4 --ranks-per-host "$1" --gbit "$2" \
        --workload "$3" --step-ms 0 | sed -n 's/.*step_ms=\([0-9.]*\).*/\1/p'
}
for shape in $shapes; do
    hosts=${shape%x*}; ppn=${shape#*x}
    scripts/multinode/teardown.sh >/dev/null 2>&1 || true
    KOLO_MN_HOSTS=$hosts KOLO_MN_SLOTS=$ppn scripts/multinode/setup.sh
    for rate in $rates; do
        scripts/multinode/shape.sh "$rate"
        out=$("$bench" --hosts "$hosts" --np 4 --only 3,4)
        resnet=$(echo "$out" | grep -m1 '^3\. ResNet' | awk '{for (i=1;i<=NF;i++) if ($i=="ms") {print $(i-1); exit}}')
        big=$(echo "$out" | grep -m1 '^4\. one 64 MiB' | awk '{for (i=1;i<=NF;i++) if ($i=="ms") {print $(i-1); exit}}')
        gbit=${rate%gbit}
        # The effective rate: the one at which the simulator's 64 MiB matches.
        fit=$(python3 - "$ppn" "$big" "$gbit" <<'PY'
import subprocess, sys
ppn, want, top = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
def ms(g):
    out = subprocess.run(["target/release/kolo-sim", "--preset", "here", "--ranks", "4",
        "--ranks-per-host", ppn, "--gbit", str(g), "--workload", "tensor-64mib",
        "--step-ms", "0"], capture_output=True, text=True, check=True).stdout
    return float(out.rsplit("step_ms=", 1)[1].split()[0])
lo, hi = 0.05, top * 2
for _ in range(40):
    mid = (lo + hi) / 2
    lo, hi = (lo, mid) if ms(mid) < want else (mid, hi)
print(f"{(lo + hi) / 2:.2f}")
PY
)
        printf '%s %s: ResNet-50 set measured %s ms, simulated %s ms (nominal) / %s ms (at %s Gbit/s, fitted to 64 MiB); 64 MiB measured %s ms, simulated %s ms (nominal)\n' \
            "$shape" "$rate" "$resnet" "$(sim "$ppn" "$gbit" resnet50)" "$(sim "$ppn" "$fit" resnet50)" \
            "$fit" "$big" "$(sim "$ppn" "$gbit" tensor-64mib)"
    done
done
