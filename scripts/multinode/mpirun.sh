#!/bin/sh
# mpirun on h1 across the emulated hosts of setup.sh (its arguments go to mpirun):
# other hosts are reached through agent.sh, host-to-host traffic is TCP on eth0, ranks
# of one host use shared memory. The single-machine settings kolo's tests use are
# cleared. yield_when_idle and event_tick_rate keep emulated hosts that share two
# cores from waiting milliseconds per message.
DIR=$(cd "$(dirname "$0")" && pwd)
STATE=${KOLO_MN_STATE:-/tmp/kolo-multinode}
exec "$DIR/on-h1.sh" env -u OMPI_MCA_btl -u OMPI_MCA_oob_tcp_if_include -u OMPI_MCA_btl_tcp_if_include \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  mpirun --mca plm rsh --mca plm_rsh_agent "$DIR/agent.sh" \
    --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
    --hostfile "$STATE/hostfile" --bind-to none \
    --mca mpi_yield_when_idle 1 --mca mpi_event_tick_rate 1 "$@"
