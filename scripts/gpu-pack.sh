#!/usr/bin/env bash
# Packs what the GPU checks need into one folder, to carry to a GPU machine that has
# the NVIDIA driver, NVRTC and libnccl but neither Rust nor Open MPI (the lent H100 /
# H200 machines): the release binaries, stripped and xz-compressed, under the layout
# `cargo` gives them (release/deps/, release/examples/), and this machine's Open MPI
# (Debian 12's packages and what they link) as a relocatable tree, mpi.tar.xz.
# scripts/gpu-checks.sh runs them there.
#
# Build first (CARGO_TARGET_DIR as for the build):
#   ./scripts/build-cuda.sh && cargo build --release -p kolo --features nccl --tests --benches
# Usage: scripts/gpu-pack.sh [OUT_DIR] [tests|bench|all]   (default: .gpu all)
# tests: kolo's NCCL suite, kolo-burn's multi-rank suite and the digits example;
# bench: the Burn benchmark with its plain program, and kolo against raw NCCL.
# The three Burn binaries are ~120 MB each stripped, ~23 MB compressed.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu}
what=${2:-all}
target=${CARGO_TARGET_DIR:-$PWD/target}/release
rm -rf "$out/release" && mkdir -p "$out/release/deps" "$out/release/examples"
newest() { # the newest test or bench binary named $1-<hash>
    ls -t "$target/deps" | grep -E "^$1-[0-9a-f]+$" | head -n 1 | sed "s|^|$target/deps/|"
}
pack() { # $1 source binary, $2 path under $out/release
    [ -x "$1" ] || { echo "gpu-pack: $1 is missing: build first (see the header)" >&2; exit 1; }
    strip -o "$out/release/$2" "$1"
    xz -6 -T0 -f "$out/release/$2"
}
if [ "$what" = tests ] || [ "$what" = all ]; then
    pack "$(newest collectives)" deps/collectives
    pack "$(newest burn_multirank)" deps/burn_multirank
    pack "$target/examples/train_digits" examples/train_digits
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    pack "$(newest burn_mlp)" deps/burn_mlp
    pack "$target/kolo-burn-plain-mlp" kolo-burn-plain-mlp
    pack "$(newest kolo_vs_nccl)" deps/kolo_vs_nccl
fi

# Open MPI: the packages' files (no docs), relocated at run time through OPAL_PREFIX,
# and the libraries they link that a CUDA image may lack (glibc and libstdc++ stay).
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
for p in libopenmpi3 openmpi-bin openmpi-common libpmix2 libhwloc15 \
    libevent-core-2.1-7 libevent-pthreads-2.1-7 libevent-2.1-7; do
    dpkg -L "$p" 2>/dev/null || { echo "gpu-pack: package $p is not installed" >&2; exit 1; }
done | sort -u | while read -r f; do
    case "$f" in /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/*) continue ;; esac
    if [ -f "$f" ] || [ -L "$f" ]; then
        [ -d "$f" ] && continue
        mkdir -p "$tree/root$(dirname "$f")"
        cp -a "$f" "$tree/root$f"
    fi
done
ln -sf orterun "$tree/root/usr/bin/mpirun"
mkdir -p "$tree/deps"
find "$tree/root" -type f -name '*.so*' -print0 | xargs -0 ldd 2>/dev/null \
    | awk '/=> \// {print $3}' | sort -u \
    | grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux-x86-64|libstdc\+\+|libgcc_s|libresolv|libz|libudev|libuuid)\.so' \
    | while read -r lib; do
        [ -e "$tree/root$lib" ] || [ -e "$tree/root/usr$lib" ] || cp -L "$lib" "$tree/deps/"
    done
# Open MPI's own libraries are in the tree already.
rm -f "$tree"/deps/lib{mpi,open-rte,open-pal,pmix,hwloc,event,mca_common,oshmem}*
tar -C "$tree" -cJf "$out/mpi.tar.xz" root deps
du -sh "$out"
