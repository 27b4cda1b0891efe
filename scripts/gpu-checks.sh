#!/usr/bin/env bash
# Runs kolo's GPU checks on a GPU machine from the folder scripts/gpu-pack.sh made
# (default .gpu): whatever of these the folder holds, each bounded by a timeout —
#   kolo's NCCL collectives suite (KOLO_TEST_GPU=1 ... gpu_), kolo-burn's CUDA
#   equivalence tests (gpu_cuda_*), the digits example on CUDA to 95%, kolo against
#   raw NCCL, and the Burn benchmark on CUDA (big model, KOLO_BENCH_REPS, default 3).
# Needs the NVIDIA driver, NVRTC and libnccl (found anywhere on the machine; CUDA's
# stub libraries are skipped: a stub libcuda makes every call fail); Open MPI comes
# from the folder. One GPU runs np 1 only (NCCL refuses two ranks on one GPU).
# Usage: scripts/gpu-checks.sh [DIR]   (output also in $OUT/gpu-checks.log when OUT is set)
set -uo pipefail
dir=$(cd "${1:-.gpu}" && pwd)
if [ -n "${OUT:-}" ]; then exec > >(tee "$OUT/gpu-checks.log") 2>&1; fi
step() { echo; echo "=== $(date +%T) $*"; }
step probe
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
libdirs=$(find / -xdev \( -name 'libnccl.so*' -o -name 'libnvrtc.so*' -o -name 'libnvrtc-builtins.so*' \) \
    -not -path '*/stubs/*' 2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
echo "libraries from: $libdirs"
mpi=$(mktemp -d)
tar -C "$mpi" -xJf "$dir/mpi.tar.xz"
export OPAL_PREFIX=$mpi/root/usr PATH=$mpi/root/usr/bin:$PATH
export LD_LIBRARY_PATH=$mpi/root/usr/lib/x86_64-linux-gnu:$mpi/root/usr/lib/x86_64-linux-gnu/openmpi/lib:$mpi/deps:${libdirs}${LD_LIBRARY_PATH:-}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
    OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_mca_base_component_show_load_errors=0 \
    PMIX_MCA_pcompress_base_silence_warning=1 RAYON_NUM_THREADS=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
step unpack
find "$dir/release" -name '*.xz' -exec xz -d -f {} +
r=$dir/release
status=0
run() { # $1 limit in s, then the command; a failure is remembered, the rest still run
    timeout "$@" || { echo "FAILED ($?): ${*:2}"; status=1; }
}
if [ -x "$r/deps/collectives" ]; then
    step "kolo's NCCL suite"
    KOLO_TEST_GPU=1 run 200 "$r/deps/collectives" gpu_ --test-threads 1
fi
if [ -x "$r/deps/burn_multirank" ]; then
    step "kolo-burn on CUDA"
    KOLO_TEST_GPU=1 run 200 "$r/deps/burn_multirank" gpu_ --test-threads 1 --nocapture
fi
if [ -x "$r/examples/train_digits" ]; then
    step "digits example on CUDA, np 1"
    run 150 mpirun -np 1 --bind-to none "$r/examples/train_digits" --device cuda --epochs 4 --min-accuracy 0.95
fi
if [ -x "$r/deps/kolo_vs_nccl" ]; then
    step "kolo against raw NCCL, np 1"
    run 90 "$r/deps/kolo_vs_nccl" --bench --np 1
fi
if [ -x "$r/deps/burn_mlp" ]; then
    step "Burn benchmark on CUDA, big model"
    KOLO_BENCH_REPS=${KOLO_BENCH_REPS:-3} run 200 "$r/deps/burn_mlp" --bench --device cuda --model big
fi
step "done (status $status)"
exit $status
