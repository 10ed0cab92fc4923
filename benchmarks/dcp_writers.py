"""Durable DCP save bandwidth, one process: UringStorageWriter vs FileSystemWriter (thread_count 1, 4) vs fio.

python -m benchmarks.dcp_writers [--gb 1] [--tensors 64] [--reps 3] [--dir DIR]
(N processes, sharded state, small tensors: `lightning-recover bench checkpoint --ranks 1,2,4`.)
Every round runs each contender once (same bytes, same disk); the median of the rounds is printed.
GB/s = state bytes / wall time of dcp.save (fsync included); fio = bytes / wall time of its run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from lightning_recover.checkpoint import UringStorageWriter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bench_dcp")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    os.makedirs(a.dir, exist_ok=True)
    total = int(a.gb * (1 << 30))
    n = total // a.tensors // 4
    state = {f"layer{i}.w": torch.randn(n) for i in range(a.tensors)}
    nbytes = sum(t.nbytes for t in state.values())
    target = os.path.join(a.dir, "ck")
    contenders = {
        "uring": lambda: UringStorageWriter(target),
        "fsw_t1": lambda: FileSystemWriter(target, thread_count=1),
        "fsw_t4": lambda: FileSystemWriter(target, thread_count=4),
    }
    fio = shutil.which("fio")
    res: dict[str, list[float]] = {k: [] for k in [*contenders, *(["fio"] if fio else [])]}
    for _ in range(a.reps):
        for name, mk in contenders.items():
            shutil.rmtree(target, ignore_errors=True)
            os.sync()
            t = time.perf_counter()
            dcp.save(state, storage_writer=mk())
            res[name].append(nbytes / (time.perf_counter() - t) / 1e9)
        if fio:
            f = os.path.join(a.dir, "fio.dat")
            cmd = [
                fio,
                "--name=w",
                f"--filename={f}",
                "--rw=write",
                "--bs=16M",
                "--direct=1",
                "--ioengine=io_uring",
                f"--size={nbytes}",
                "--end_fsync=1",
                "--output-format=terse",
            ]
            t = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            res["fio"].append(nbytes / (time.perf_counter() - t) / 1e9)
            os.unlink(f)
    shutil.rmtree(target, ignore_errors=True)
    print(f"state {nbytes / 1e9:.2f} GB in {a.tensors} tensors, median of {a.reps}, GB/s (all rounds)")
    for k, v in res.items():
        print(f"  {k:7s} {statistics.median(v):6.2f}   {' '.join(f'{x:.2f}' for x in v)}")


if __name__ == "__main__":
    main()
