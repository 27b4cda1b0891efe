#!/usr/bin/env bash
# Removes what setup.sh made, with any process still running inside (a job that did
# not end). Safe to run repeatedly.
STATE=${KOLO_MN_STATE:-/tmp/kolo-multinode}
ours=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^(h[0-9]+|kolo-br)$')
for ns in $ours; do
  pids=$(ip netns pids "$ns" 2>/dev/null)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null
done
for ns in $ours; do
  for _ in $(seq 20); do [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break; sleep 0.1; done
  ip netns del "$ns" 2>/dev/null
  rm -rf "/etc/netns/$ns"
done
rmdir /etc/netns 2>/dev/null
rm -rf "$STATE"
left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^(h[0-9]+|kolo-br)$')
[ -z "$left" ] || { echo "multinode teardown: still present: $left" >&2; exit 1; }
exit 0
