"""The survivors' gloo group rebuilt, against the group's size: what a regroup's data plane costs at N.

    python -m benchmarks.gloo_rebuild --sizes 4,8,16,32,64 --json benchmarks/results/gloo_rebuild.json

After a failure the survivors build a new gloo group from scratch (``ProcessGroups.build``): every member
meets the others at the generation leader's store and gloo connects a full mesh, N - 1 connections per member
(N (N - 1) / 2 in all), before the first collective. Here the N members are processes of this host,
each constructing ``ProcessGroupGloo`` over one TCPStore as the protocol does, released
together; measured: the time until every member's group exists and one all-reduce of one element completed,
for a group of N (the first generation) and of N - 1 (the survivors, a fresh group). On one host every
connection is loopback and every member shares 2 cores: a bound from above on the per-connection work, none
on a real network's latency.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch.distributed as dist

_WORKER = """
import datetime, os, sys, time, torch, torch.distributed as dist
host, port, prefix, rank, size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=300))
store.set(f"{prefix}/ready/{rank}", "1")
store.wait([f"{prefix}/go"])
pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, datetime.timedelta(seconds=300))
t = torch.ones(1)
pg.allreduce([t]).wait()
assert t.item() == size, t.item()
store.set(f"{prefix}/done/{rank}", repr(time.monotonic()))
store.wait([f"{prefix}/end"])  # every member finished before any destroys its group
os._exit(0)  # without gloo's teardown at exit (it can block on peers already gone)
"""


def build_seconds(size: int, store: dist.TCPStore, prefix: str, timeout: float = 600.0) -> float:
    """Seconds from releasing ``size`` member processes (each waiting, imports done) until each built its member
    of one gloo group over ``store`` (under ``prefix``) and one all-reduce completed everywhere. Processes, not
    threads: a group's construction holds the interpreter's lock while it connects to its peers."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["127.0.0.1", str(store.port), prefix]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, *args, str(r), str(size)], env=env) for r in range(size)]
    try:
        store.wait([f"{prefix}/ready/{r}" for r in range(size)], datetime.timedelta(seconds=timeout))
        began = time.monotonic()
        store.set(f"{prefix}/go", "1")
        store.wait([f"{prefix}/done/{r}" for r in range(size)], datetime.timedelta(seconds=timeout))
        took = max(float(store.get(f"{prefix}/done/{r}")) for r in range(size)) - began
        store.set(f"{prefix}/end", "1")
        for p in procs:
            p.wait(60)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"gloo group of {size}: a member failed")
        return took
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def measure(sizes: list[int], repeat: int) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    out: dict = {"sizes": sizes, "repeat": repeat, "runs": {}, "load": os.getloadavg()[0]}
    attempt = 0
    for n in sizes:
        first, survivors = [], []
        for _ in range(repeat):
            attempt += 1
            first.append(build_seconds(n, store, f"a{attempt}/first"))
            survivors.append(build_seconds(n - 1, store, f"a{attempt}/survivors") if n > 1 else 0.0)
        out["runs"][str(n)] = {
            "first_s": statistics.median(first),
            "survivors_s": statistics.median(survivors),
            "connections": n * (n - 1) // 2,
        }
        print(
            f"  gloo N={n:4d}: group {out['runs'][str(n)]['first_s']:.3f}s, survivors' group "
            f"{out['runs'][str(n)]['survivors_s']:.3f}s",
            flush=True,
        )
    return out


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--sizes", default="4,8,16,32,64", help="comma-separated group sizes")
    p.add_argument("--repeat", type=int, default=3, help="builds per size (medians reported)")
    p.add_argument("--json", default=None, help="write the results here as JSON")
    return p


def main(args: argparse.Namespace) -> int:
    result = measure([int(n) for n in args.sizes.split(",")], args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()))
