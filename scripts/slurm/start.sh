#!/usr/bin/env bash
# Starts a Slurm cluster on this machine for kolo's tests: munge, slurmctld and slurmd
# from Debian's packages (installed when missing), configured under target/slurm (no
# file outside it changes). Prints the SLURM_CONF to export; the client commands
# (srun, salloc, sbatch, scontrol) need it. scripts/slurm/stop.sh stops every daemon
# this started.
#
# One node (this machine) by default. With KOLO_SLURM_HOSTS=N, one node per emulated
# host h1..hN of scripts/multinode (set up first): slurmctld and the client commands
# on h1 (scripts/multinode/on-h1.sh), a slurmd in each host's namespace under its
# hostname; munge's socket is a file, which every namespace reaches.
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
hosts=${KOLO_SLURM_HOSTS:-0}
# The node as slurmd finds it (CPUs, sockets, memory), so that it registers as given.
node=$(slurmd -C | head -1)
if [ "$hosts" -gt 0 ]; then
    ctld=h1
    nodes=$(for i in $(seq "$hosts"); do echo "${node/NodeName=* CPUs/NodeName=h$i NodeAddr=10.77.0.$i CPUs}"; done)
else
    ctld=$(hostname -s)
    nodes=$node
fi
# Runs "$@" in emulated host $1 under its hostname (as scripts/multinode/agent.sh).
in_host() { local h=$1; shift; ip netns exec "$h" unshare --uts -- /bin/sh -c 'hostname "$0"; exec "$@"' "$h" "$@"; }
cat >"$root/slurm.conf" <<CONF
ClusterName=kolo
SlurmctldHost=$ctld
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$root/munge/munge.socket
CryptoType=crypto/munge
StateSaveLocation=$root/state
SlurmdSpoolDir=$root/spool/%n
SlurmctldPidFile=$root/slurmctld.pid
SlurmdPidFile=$root/slurmd.%n.pid
SlurmctldLogFile=$root/log/slurmctld.log
SlurmdLogFile=$root/log/slurmd.%n.log
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
$(echo "$nodes" | sed 's/$/ State=UNKNOWN/')
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$root/slurm.conf
# munged runs as its own user with the package's key; the socket lives under target/.
sudo_munge() { if command -v runuser >/dev/null; then runuser -u munge -- "$@"; else su -s /bin/sh munge -c "$*"; fi; }
sudo_munge munged --socket="$root/munge/munge.socket" --pid-file="$root/munge/munged.pid" \
    --log-file="$root/munge/munged.log" --seed-file="$root/munge/munged.seed"
if [ "$hosts" -gt 0 ]; then
    in_host h1 slurmctld -f "$SLURM_CONF"
    for i in $(seq "$hosts"); do
        mkdir -p "$root/spool/h$i"
        in_host "h$i" "$(pwd)/scripts/slurm/slurmd-in-host.sh" -f "$SLURM_CONF" -N "h$i"
    done
    client() { in_host h1 "$@"; }
    want=$hosts
else
    mkdir -p "$root/spool/$ctld"
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF"
    client() { "$@"; }
    want=1
fi
# Ready when every node is idle.
for _ in $(seq 60); do
    if [ "$(client sinfo -h -N -o %t 2>/dev/null | grep -c idle)" -ge "$want" ]; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "kolo slurm: the node did not come up; logs in $root/log" >&2
client sinfo >&2 || true
tail -20 "$root"/log/*.log >&2 || true
exit 1
