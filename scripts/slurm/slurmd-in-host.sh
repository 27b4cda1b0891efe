#!/bin/sh
# Runs slurmd (arguments: its options) inside an emulated host's namespaces, where
# `ip netns exec` gave it a fresh /sys without cgroups, which slurmd's cgroup plugin
# needs even when no cgroup feature is configured: the cgroup hierarchies are mounted
# in that private mount namespace only (v1 controllers as on this machine, else v2).
set -e
if mount -t tmpfs tmpfs /sys/fs/cgroup 2>/dev/null; then
    v1=1
    for c in freezer cpuset memory devices; do
        mkdir -p "/sys/fs/cgroup/$c"
        mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c" 2>/dev/null || v1=0
    done
    mkdir -p /sys/fs/cgroup/systemd
    mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd 2>/dev/null || v1=0
    if [ "$v1" = 0 ]; then
        umount -R /sys/fs/cgroup 2>/dev/null || true
        mount -t cgroup2 none /sys/fs/cgroup
    fi
fi
exec slurmd "$@"
