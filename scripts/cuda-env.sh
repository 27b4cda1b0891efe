# Sourced by scripts/build-cuda.sh (and the Burn benchmark with --device cuda|cpu):
# makes kolo-burn's `cuda` and `cpu` features buildable offline.
#
# Burn's CUDA and CubeCL-CPU backends reach cubecl-llvm, whose build dependency
# tracel-llvm-bundler 23.1.0-4 downloads an LLVM 23.1 bundle unless
# `$XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4/` holds the marker file
# `.tracel-llvm-installed`; it then runs `<that dir>/bin/llvm-config --link-static`.
# kolo_cuda_env installs Debian's LLVM 22 (and what its static libraries link) when
# missing, makes that directory under the build directory with `bin/llvm-config`
# pointing at LLVM 22's, and exports XDG_DATA_HOME for cargo. Nothing is written
# outside the checkout and the build directory except what apt-get installs.
# (kolo-burn's build script adds the `liblibz3.so` alias the bundler's link line
# asks for.)

kolo_cuda_env() {
    local pkgs=(llvm-22-dev libpolly-22-dev libzstd-dev libxml2-dev) missing=() p
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "kolo build-cuda: installing ${missing[*]}" >&2
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
    fi
    local llvm_config=/usr/lib/llvm-22/bin/llvm-config
    if [ ! -x "$llvm_config" ]; then
        echo "kolo build-cuda: $llvm_config is missing (llvm-22-dev: Debian 12's security archive has it)" >&2
        return 1
    fi
    local target_dir=${CARGO_TARGET_DIR:-$PWD/target}
    local data_home="$target_dir/llvm-data"
    local bundle="$data_home/tracel/tracel-llvm-23.1.0-4"
    mkdir -p "$bundle/bin"
    [ "$(readlink "$bundle/bin/llvm-config" 2>/dev/null)" = "$llvm_config" ] \
        || ln -sfn "$llvm_config" "$bundle/bin/llvm-config"
    # Made once, never touched again: the bundler's build script reruns (and every
    # crate above it rebuilds) when the marker's timestamp changes.
    [ -e "$bundle/.tracel-llvm-installed" ] || : > "$bundle/.tracel-llvm-installed"
    export XDG_DATA_HOME="$data_home"
}
