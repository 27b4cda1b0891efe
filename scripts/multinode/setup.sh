#!/usr/bin/env bash
# Emulated hosts on this machine: KOLO_MN_HOSTS (default 2) network namespaces h1..hN,
# each with its own hostname (set by agent.sh / mpirun.sh) and eth0 = 10.77.0.N/24 on a
# bridge inside namespace "kolo-br" (no uplink: the root namespace's network is never
# touched). Writes /etc/netns/hN/hosts (so every host resolves the others by name) and
# an OpenMPI hostfile "hN slots=KOLO_MN_SLOTS" in the state directory. Idempotent.
# Root only; needs iproute2 and util-linux (unshare). Exit 3: this machine cannot.
set -euo pipefail
HOSTS=${KOLO_MN_HOSTS:-2}
SLOTS=${KOLO_MN_SLOTS:-2}
NET=10.77.0
STATE=${KOLO_MN_STATE:-/tmp/kolo-multinode}
[ "$(id -u)" -eq 0 ] || { echo "multinode: needs root" >&2; exit 3; }
for tool in ip unshare; do
  command -v "$tool" >/dev/null || { echo "multinode: needs $tool" >&2; exit 3; }
done
exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }
if ! exists kolo-br; then
  ip netns add kolo-br 2>/dev/null || { echo "multinode: cannot create network namespaces here" >&2; exit 3; }
  ip -n kolo-br link set lo up
  ip -n kolo-br link add br0 type bridge
  # Forward at once (no learning delay) on every port.
  ip -n kolo-br link set br0 type bridge forward_delay 0 stp_state 0 2>/dev/null || true
  ip -n kolo-br link set br0 up
fi
mkdir -p "$STATE"
: > "$STATE/hostfile"
for i in $(seq 1 "$HOSTS"); do
  h=h$i
  if ! exists "$h"; then
    ip netns add "$h"
    ip -n "$h" link set lo up
    ip -n kolo-br link add "port-$h" type veth peer name eth0 netns "$h"
    ip -n kolo-br link set "port-$h" master br0 up
    ip -n "$h" addr add "$NET.$i/24" dev eth0
    ip -n "$h" link set eth0 up
  fi
  mkdir -p "/etc/netns/$h"
  { echo "127.0.0.1 localhost"; for j in $(seq 1 "$HOSTS"); do echo "$NET.$j h$j"; done; } > "/etc/netns/$h/hosts"
  echo "$h slots=$SLOTS" >> "$STATE/hostfile"
done
# Wait until h1 reaches every host (a refused connection to port 9 is an answer).
for i in $(seq 2 "$HOSTS"); do
  for try in $(seq 1 100); do
    out=$(ip netns exec h1 timeout 1 bash -c "exec 3<>/dev/tcp/$NET.$i/9" 2>&1) || true
    if echo "$out" | grep -q refused; then
      break
    fi
    [ "$try" -eq 100 ] && { echo "multinode: h1 cannot reach h$i" >&2; exit 1; }
    sleep 0.2
  done
done
echo "multinode: $HOSTS hosts x $SLOTS slots ready (hostfile $STATE/hostfile)"
