"""The device limit: fio O_DIRECT sequential write then read of a given number of bytes.

16 MiB blocks, io_uring, ``--direct=1``, ``--end_fsync=1`` for writes, at several queue depths
(``DEPTHS``): the benchmark takes the best depth as the device limit, since the engine it is
compared with keeps more than one request in flight.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any, Optional

from lightning_recover.bench.block_device import BlockDevice, measured

BLOCK = 16 << 20
# 16 MiB blocks at depth 1 understate a virtio disk (benchmarks/LOG.md); 16 covers any
# depth the engine could keep in flight.
DEPTHS = (1, 4, 16)


def available() -> bool:
    return shutil.which("fio") is not None


def huge_iomem(buffer_bytes: int) -> Optional[str]:
    """``"shmhuge"`` when enough hugetlb pages are free for fio's I/O buffers (``buffer_bytes``: iodepth x block
    size x jobs), else None (fio's default, malloc: plain 4 KiB pages).

    On a device that takes few segments per request (virtio-blk: 254) a transfer from plain pages is split into
    ~1 MiB requests, so fio's default buffers understate the device; the checkpoint engine's own staging arena
    is on transparent huge pages. fio can use only hugetlbfs pages (``vm.nr_hugepages``), which a benchmark
    does not reserve by itself: ``sysctl vm.nr_hugepages=N`` first.
    """
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = rest.split()
    except OSError:
        return None
    try:
        free = int(info["HugePages_Free"][0]) * int(info["Hugepagesize"][0]) * 1024
    except (KeyError, IndexError, ValueError):
        return None
    return "shmhuge" if free >= buffer_bytes + (2 << 20) else None


def _command(
    name: str, path: str, rw: str, size: int, engine: str, iodepth: int, bs: int = BLOCK, iomem: Optional[str] = None
) -> list[str]:
    """fio moving ``size`` bytes of ``path`` with ``O_DIRECT``; a write ends with an fsync (durable, like ours).
    ``iomem``: fio's ``--iomem`` (its I/O buffers' memory), None for fio's default."""
    cmd = [
        "fio",
        f"--name={name}",
        f"--filename={path}",
        f"--rw={rw}",
        f"--bs={int(bs)}",
        f"--size={int(size)}",
        f"--ioengine={engine}",
        f"--iodepth={int(iodepth)}",
        "--direct=1",
    ]
    if rw == "write":
        cmd.append("--end_fsync=1")
    if iomem:
        cmd.append(f"--iomem={iomem}")
    return cmd


def _run(
    path: str,
    rw: str,
    size: int,
    engine: str,
    iodepth: int = 1,
    bs: int = BLOCK,
    iomem: Optional[str] = None,
    device: Optional[BlockDevice] = None,
) -> dict[str, Any]:
    cmd = _command(f"bench-{rw}", path, rw, size, engine, iodepth, bs, iomem) + ["--output-format=json"]
    with measured(device) as disk:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    # fio may print warnings before the JSON document.
    out = proc.stdout
    doc = json.loads(out[out.index("{") :])
    job = doc["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}")
    side = job[rw if rw in ("read", "write") else "write"]
    io_bytes = int(side["io_bytes"])
    runtime_s = float(side["runtime"]) / 1000.0  # ms; includes the end_fsync for writes
    return {
        "io_bytes": io_bytes,
        "seconds": runtime_s,
        "gbps": io_bytes / runtime_s / 1e9 if runtime_s > 0 else float("nan"),
        "wall_s": wall,
        "engine": engine,
        "iodepth": int(iodepth),
        "iomem": iomem or "malloc",
        "fio_version": doc.get("fio version"),
        "cmd": " ".join(cmd),
        "disk": disk,  # what the device did during the whole fio process (block_device.py); {} unmeasured
    }


def start_write(path: str, nbytes: int, iodepth: int = 2, iomem: Optional[str] = None) -> subprocess.Popen:
    """Start fio writing ``nbytes`` to ``path`` (O_DIRECT, io_uring, 16 MiB blocks, fsync at the end) in the
    background; ``wait(proc)`` ends it. For measuring what a write alone costs work running beside it.
    ``iomem``: fio's buffers (``huge_iomem``), None for malloc."""
    cmd = _command("bench-background-write", path, "write", nbytes, "io_uring", iodepth, iomem=iomem)
    cmd.append("--output=/dev/null")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait(proc: subprocess.Popen, timeout: float = 600.0) -> None:
    """Wait for a ``start_write`` fio (bounded: killed after ``timeout`` s); raises if it failed."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"fio did not finish within {timeout} s (killed)") from None
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({proc.returncode}): {err.strip()}")


def startup_s(
    directory: str, iodepth: int = 1, repeat: int = 3, engine: str = "io_uring", iomem: Optional[str] = None
) -> float:
    """Median wall time of a one-block fio read (16 MiB, ``O_DIRECT``, same depth): fio's fixed cost.

    Process start, job setup, io_uring and buffer set-up, JSON output and exit; subtracted from fio's wall
    times in the paired benchmark so that fio is charged for moving its bytes and, for writes, for its
    ``end_fsync`` (a tiny *write* with ``end_fsync`` would also subtract a device flush). The one block it
    reads makes the estimate a little high, i.e. in fio's favour.
    """
    import os

    path = os.path.join(directory, "fio-startup.bin")
    walls = []
    try:
        try:
            _run(path, "write", BLOCK, engine, 1)
        except RuntimeError:
            if engine != "io_uring":
                raise
            engine = "libaio"
            _run(path, "write", BLOCK, engine, 1)
        for _ in range(max(1, repeat)):
            walls.append(_run(path, "read", BLOCK, engine, iodepth, iomem=iomem)["wall_s"])
    finally:
        if os.path.exists(path):
            os.remove(path)
    walls.sort()
    return walls[len(walls) // 2]


def whole_blocks(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 16 MiB blocks: what a fio write of ``nbytes`` moves."""
    return -(-int(nbytes) // BLOCK) * BLOCK


def write(
    path: str,
    nbytes: int,
    iodepth: int = 1,
    iomem: Optional[str] = None,
    device: Optional[BlockDevice] = None,
    engine: str = "io_uring",
) -> dict[str, Any]:
    """Sequential O_DIRECT write (16 MiB blocks, end fsync) of ``nbytes`` rounded up to whole blocks, into ``path``
    as it is: over the blocks of an existing file of that size, fio's overwrite. Returns its result dict."""
    return _run(path, "write", whole_blocks(nbytes), engine, iodepth, iomem=iomem, device=device)


def read(path: str, nbytes: int, iodepth: int = 1, iomem: Optional[str] = None) -> dict[str, Any]:
    """Sequential O_DIRECT read (io_uring, 16 MiB blocks) of the first ``nbytes`` of an existing file, rounded down
    to whole blocks: fio reading the very extents a load reads. Returns its result dict."""
    return _run(path, "read", int(nbytes) // BLOCK * BLOCK, "io_uring", iodepth, iomem=iomem)


def run(
    path: str,
    nbytes: int,
    engine: str = "io_uring",
    iodepth: int = 1,
    iomem: Optional[str] = None,
    device: Optional[BlockDevice] = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sequential O_DIRECT write (with end fsync) then read of ``nbytes`` rounded up to 16 MiB.

    ``iodepth`` requests are kept in flight. Returns ``(write, read)`` result dicts. Falls back
    to libaio if io_uring is unavailable to fio (the engine used is reported). ``device``: the block device
    whose counters each result's ``disk`` gives.
    """
    try:
        w = write(path, nbytes, iodepth, iomem, device, engine)
    except RuntimeError:
        if engine != "io_uring":
            raise
        engine = "libaio"
        w = write(path, nbytes, iodepth, iomem, device, engine)
    r = _run(path, "read", whole_blocks(nbytes), engine, iodepth, iomem=iomem, device=device)
    return w, r
