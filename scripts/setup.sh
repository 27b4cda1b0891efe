# Sourced by the scripts: installs what kolo needs on Debian when it is missing
# (OpenMPI, and libclang for the mpi crate's bindgen), then sets the OpenMPI variables
# every job needs here (root, oversubscription). Jobs that run on this machine only
# (tests, benchmarks) then call kolo_one_machine; jobs that may span hosts go through
# kolorun, which keeps a local job on loopback itself and must not inherit that.
set -euo pipefail

need_pkgs=()
command -v mpirun >/dev/null 2>&1 || need_pkgs+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || need_pkgs+=(libopenmpi-dev)
if ! ldconfig -p 2>/dev/null | grep -q 'libclang\(-[0-9.]*\)\?\.so'; then
    need_pkgs+=(libclang1-14 libclang-common-14-dev)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "kolo setup: installing ${need_pkgs[*]}" >&2
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}"; then
        # Other Debian releases ship another libclang version under the generic names.
        generic=("${need_pkgs[@]/libclang1-14/libclang-dev}")
        generic=("${generic[@]/libclang-common-14-dev/}")
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq ${generic[@]}
    fi
fi
if ! command -v cargo >/dev/null 2>&1; then
    echo "kolo setup: cargo not found; install Rust with rustup (https://rustup.rs) and re-run" >&2
    exit 1
fi

# OpenMPI refuses to run as root unless told; our tests oversubscribe small machines.
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}

# For jobs that never leave this machine: shared memory between ranks, OpenMPI's
# control traffic on loopback. (Across hosts these make ranks unreachable.)
kolo_one_machine() {
    export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader}
    export OMPI_MCA_oob_tcp_if_include=${OMPI_MCA_oob_tcp_if_include:-lo}
}
