"""The memory and rate at which an outside client fills the embedded coordinator store (issue 31).

The coordinator's TCPStore server runs in this process; a client without the job's secret writes
20,000 keys of 64 B and of 1 KiB, and the process's resident memory growth is what each key costs.

Run: PYTHONPATH=. python benchmarks/sec31_flood.py benchmarks/results/sec31_flood.json
"""

from __future__ import annotations

import json
import sys
import time

from lightning_recover.control_plane.connect import connect
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.messages import JobSecret


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


def main() -> None:
    coordinator = Coordinator("127.0.0.1", 0, 3, 1.0, JobSecret.generate())
    store = connect(coordinator.addr)
    out = {}
    for size in (64, 1024):
        n = 20000
        before = rss()
        t0 = time.monotonic()
        for i in range(n):
            store.set(f"junk{size}/{i}", b"x" * size)
        store.check([f"junk{size}/{n - 1}"])  # a set has no reply: a round trip after it, all are stored
        took = time.monotonic() - t0
        grown = rss() - before
        out[size] = {
            "keys": n,
            "value_bytes": size,
            "rss_growth_bytes": grown,
            "bytes_per_key": grown / n,
            "seconds": took,
            "keys_per_s": n / took,
        }
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
