#!/usr/bin/env bash
# A memory-backed disk for the checkpoint benchmarks' fast-device runs (benchmarks/LOG.md,
# "Single file on a memory-backed disk"): ext4 on a loop device whose backing file lives in
# /dev/shm. O_DIRECT, fsync and io_uring behave as on a real disk, but the "device" moves bytes at
# memory speed, so a writer's or reader's own costs show up that a ~2-3 GB/s virtio disk hides.
# fio and ours pay the same loop-driver copy (a kernel thread), so their ratio stays fair.
#
#   scripts/memory_disk.sh up   [MOUNT] [SIZE]    default /mnt/lr-memdisk, 7G (root, loop support)
#   scripts/memory_disk.sh down [MOUNT]
#
# then e.g.: python -m lightning_recover.cli bench checkpoint --paired --state llama --dir /mnt/lr-memdisk
set -euo pipefail
cmd=${1:-}
mnt=${2:-/mnt/lr-memdisk}
img=/dev/shm/lr-memdisk-$(echo "$mnt" | tr '/' '_').img

case "$cmd" in
up)
    size=${3:-7G}
    if mountpoint -q "$mnt"; then
        echo "memory_disk: $mnt is already mounted" >&2
        exit 1
    fi
    truncate -s "$size" "$img"
    dev=$(losetup --find --show "$img")
    mkfs.ext4 -q "$dev"
    mkdir -p "$mnt"
    mount "$dev" "$mnt"
    echo "memory_disk: $dev ($size in $img) mounted on $mnt"
    ;;
down)
    dev=$(findmnt -n -o SOURCE "$mnt" || true)
    if [ -z "$dev" ]; then
        echo "memory_disk: nothing mounted on $mnt" >&2
        exit 1
    fi
    umount "$mnt"
    losetup -d "$dev"
    rm -f "$img"
    echo "memory_disk: $mnt removed"
    ;;
*)
    echo "usage: $0 up [MOUNT] [SIZE] | down [MOUNT]" >&2
    exit 2
    ;;
esac
