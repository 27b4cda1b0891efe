#!/usr/bin/env bash
# Starts a one-node Slurm cluster on this machine for kolo's tests: munge, slurmctld
# and slurmd from Debian's packages (installed when missing), configured under
# target/slurm (no file outside it changes). Prints the SLURM_CONF to export; the
# client commands (srun, salloc, sbatch, scontrol) need it. scripts/slurm/stop.sh
# stops every daemon this started.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)/target/slurm
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "kolo slurm: installing slurm-wlm and munge" >&2
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq slurm-wlm munge >/dev/null; then
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq slurm-wlm munge >/dev/null
    fi
fi
"$(dirname "$0")/stop.sh" >/dev/null 2>&1 || true
rm -rf "$root"
mkdir -p "$root/state" "$root/spool" "$root/log" "$root/munge"
chown munge:munge "$root/munge"
host=$(hostname -s)
# The node as slurmd finds it (CPUs, sockets, memory), so that it registers as given.
node=$(slurmd -C | head -1)
cat >"$root/slurm.conf" <<CONF
ClusterName=kolo
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$root/munge/munge.socket
CryptoType=crypto/munge
StateSaveLocation=$root/state
SlurmdSpoolDir=$root/spool
SlurmctldPidFile=$root/slurmctld.pid
SlurmdPidFile=$root/slurmd.pid
SlurmctldLogFile=$root/log/slurmctld.log
SlurmdLogFile=$root/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$root/slurm.conf
# munged runs as its own user with the package's key; the socket lives under target/.
sudo_munge() { if command -v runuser >/dev/null; then runuser -u munge -- "$@"; else su -s /bin/sh munge -c "$*"; fi; }
sudo_munge munged --socket="$root/munge/munge.socket" --pid-file="$root/munge/munged.pid" \
    --log-file="$root/munge/munged.log" --seed-file="$root/munge/munged.seed"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
# Ready when the node is idle.
for _ in $(seq 60); do
    if sinfo -h -o %t 2>/dev/null | grep -q idle; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "kolo slurm: the node did not come up; logs in $root/log" >&2
sinfo >&2 || true
tail -20 "$root/log/slurmctld.log" "$root/log/slurmd.log" >&2 || true
exit 1
