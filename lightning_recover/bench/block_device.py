"""What the disk under a directory did while an operation ran: its requests, bytes and busy time.

Linux counts these per block device in ``/sys/dev/block/MAJOR:MINOR/stat`` (the kernel's
Documentation/block/stat.rst). The counters used here are:

* requests completed;
* sectors, always 512 bytes whatever the device's own sector size;
* ``io_ticks``: the milliseconds during which the device had at least one request in flight;
* ``time_in_queue``: the milliseconds of every request from its start to its completion, summed (over
  ``io_ticks``: the mean number of requests in flight while the device was busy).

A paired benchmark reads them around each run. It then splits a ratio against fio into three factors
(:func:`ratio_factors`):

* the share of our time during which the device was busy. The rest is the device waiting for us;
* the pace at which the device moved our bytes, against fio's bytes, busy time for busy time. This is how we
  issue the I/O (request sizes, extending writes, the journal's own writes) together with the device's
  variation between the two runs;
* fio's counted time over its busy time (fio's clock also covers its own gaps).

The counters are the whole device's: anything else that reads or writes it in the meantime is counted too.
So the benchmarks that read them are run on a quiet machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Optional

SECTOR = 512  # the unit of the stat file's sector counts, whatever the device's sector size


@dataclass(frozen=True)
class DiskCounters:
    """One reading of a block device's cumulative counters."""

    read_requests: int
    read_bytes: int
    write_requests: int
    write_bytes: int
    busy_ms: int
    queue_ms: int
    flushes: int  # 0 where the kernel does not count flush requests (before 5.5)


def parse_stat(text: str) -> DiskCounters:
    """The counters of one ``stat`` file of a block device (11, 15 or 17 fields)."""
    fields = text.split()
    if len(fields) < 11:
        raise ValueError(f"a block device's stat has at least 11 fields, not {len(fields)}: {text!r}")
    n = [int(x) for x in fields]
    return DiskCounters(
        read_requests=n[0],
        read_bytes=n[2] * SECTOR,
        write_requests=n[4],
        write_bytes=n[6] * SECTOR,
        busy_ms=n[9],
        queue_ms=n[10],
        flushes=n[15] if len(n) > 15 else 0,
    )


def usage(before: DiskCounters, after: DiskCounters, wall_s: float) -> dict[str, Any]:
    """What the device did between two readings ``wall_s`` seconds apart."""
    busy_ms = after.busy_ms - before.busy_ms
    busy_s = busy_ms / 1000.0
    reads = after.read_requests - before.read_requests
    writes = after.write_requests - before.write_requests
    read_bytes = after.read_bytes - before.read_bytes
    write_bytes = after.write_bytes - before.write_bytes
    return {
        "wall_s": wall_s,
        "busy_s": busy_s,
        "busy_share": busy_s / wall_s if wall_s > 0 else math.nan,
        "read_requests": reads,
        "read_bytes": read_bytes,
        "write_requests": writes,
        "write_bytes": write_bytes,
        "mean_read_request_bytes": read_bytes / reads if reads else None,
        "mean_write_request_bytes": write_bytes / writes if writes else None,
        "mean_in_flight": (after.queue_ms - before.queue_ms) / busy_ms if busy_ms else None,
        "flushes": after.flushes - before.flushes,
    }


def ratio_factors(
    ours_bytes: int, ours_s: float, ours_busy_s: float, ref_bytes: int, ref_s: float, ref_busy_s: float
) -> Optional[dict[str, float]]:
    """A paired ratio, ours GB/s over the reference's, as the product of three factors.

    * ``ours_busy_share``: our busy time over our time (1 when the device never waited for us);
    * ``device_pace``: our bytes per busy second over the reference's (1 when the device moved both at one pace);
    * ``ref_time_per_busy``: the reference's time over its busy time.

    None when either side kept the device busy for no measurable time (the counters tick in milliseconds).
    """
    if ours_busy_s <= 0 or ref_busy_s <= 0 or ours_s <= 0 or ref_s <= 0:
        return None
    share = ours_busy_s / ours_s
    pace = (ours_bytes / ours_busy_s) / (ref_bytes / ref_busy_s)
    ref_time = ref_s / ref_busy_s
    return {
        "ratio": share * pace * ref_time,
        "ours_busy_share": share,
        "device_pace": pace,
        "ref_time_per_busy": ref_time,
    }


class BlockDevice:
    """The block device a directory's filesystem sits on, or why there is none to read."""

    def __init__(self, stat_path: Optional[str], name: str, why_not: Optional[str] = None) -> None:
        self.stat_path = stat_path
        self.name = name
        self.why_not = why_not

    @classmethod
    def under(cls, directory: str) -> BlockDevice:
        st = os.stat(directory)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        link = f"/sys/dev/block/{major}:{minor}"
        stat_path = os.path.join(link, "stat")
        if not os.path.exists(stat_path):
            return cls(
                None,
                f"{major}:{minor}",
                f"no block device behind {directory} (device {major}:{minor}: tmpfs, overlay or a network filesystem)",
            )
        return cls(stat_path, os.path.basename(os.path.realpath(link)))

    def sample(self) -> Optional[DiskCounters]:
        if self.stat_path is None:
            return None
        with open(self.stat_path) as f:
            return parse_stat(f.read())

    @contextlib.contextmanager
    def measure(self) -> Iterator[dict[str, Any]]:
        """``with dev.measure() as u:`` fills ``u`` with :func:`usage` over the block (nothing without a device)."""
        out: dict[str, Any] = {}
        before = self.sample()
        t0 = time.perf_counter()
        yield out
        wall = time.perf_counter() - t0
        after = self.sample()
        if before is not None and after is not None:
            out.update(usage(before, after, wall) | {"device": self.name})


def measured(device: Optional[BlockDevice]) -> AbstractContextManager[dict[str, Any]]:
    """``device.measure()``, or a block that measures nothing (an empty dict) without a device."""
    return device.measure() if device is not None else contextlib.nullcontext({})
