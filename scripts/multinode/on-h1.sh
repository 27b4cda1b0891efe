#!/bin/sh
# Runs a command on emulated host h1 (its namespace, hostname h1): where a user logged
# into the first node of a cluster would start a job. E.g.
#   scripts/multinode/on-h1.sh target/release/kolorun -np 4 -H h1:2,h2:2 \
#     --network-interface eth0 --mpi-args "--mca plm_rsh_agent $PWD/scripts/multinode/agent.sh" prog
exec ip netns exec h1 unshare --uts -- /bin/sh -c 'hostname h1; exec "$@"' on-h1 "$@"
