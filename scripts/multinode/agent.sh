#!/bin/sh
# What "ssh hN command" does, for OpenMPI's plm_rsh_agent: runs the command in
# namespace hN under hostname hN, from a bare environment as a login over ssh would
# get (so a variable reaches remote ranks only when mpirun forwards it with -x).
host=$1; shift
exec ip netns exec "$host" unshare --uts -- env -i HOME="${HOME:-/root}" \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  /bin/sh -c 'hostname "$1"; shift; exec /bin/sh -c "$*"' agent "$host" "$*"
