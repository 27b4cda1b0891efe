#!/usr/bin/env bash
# Rate-limits every emulated host's egress (each direction of each link once):
#   shape.sh RATE (e.g. 10gbit, 1gbit) | shape.sh clear | shape.sh show
set -euo pipefail
hosts=$(ip netns list | awk '{print $1}' | grep -E '^h[0-9]+$' | sort -V)
case "${1:-show}" in
  clear) for h in $hosts; do tc -n "$h" qdisc del dev eth0 root 2>/dev/null || true; done ;;
  show) for h in $hosts; do echo "$h: $(tc -n "$h" qdisc show dev eth0 | head -1)"; done ;;
  *) for h in $hosts; do tc -n "$h" qdisc replace dev eth0 root tbf rate "$1" burst 256kb latency 5ms; done ;;
esac
