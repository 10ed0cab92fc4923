"""Does the guest's own work slow this VM's disk? The limit of a load into existing tensors (issue 51).

A load into existing tensors (``restore_into``) keeps the device busy for 93-98% of its time, and yet moves the
file at 0.80-0.95x of fio's pace, busy second for busy second (``bench checkpoint --paired``, the disk's
counters). It copies every byte out of its staging arena with its CRC-32C while the next reads are in flight; fio
copies nothing. On a VM, the host serves the virtual disk with memory and CPU that the guest's work may share. Each
round, in alternating order, with the page cache dropped before each, on one file (the 2 GB Llama-like state of
``bench checkpoint``, written by ``single_file.save``):

* ``fio_qd2_alone``: fio reading the file (O_DIRECT, io_uring, 16 MiB blocks, depth 2, hugetlb buffers);
* ``fio_qd2_beside_busy``: the same beside a ``yes`` process (one core busy, no memory traffic);
* ``fio_qd2_beside_copy``: the same beside a thread copying 16 MiB from huge pages to plain pages with its CRC-32C
  in a loop (``native_io.copy_crc32c``: the copy a load makes out of its arena, all the time instead of a third);
* ``engine_via_arena``: the engine's reader, depth 2, 16 MiB blocks, into plain memory: reads land in the arena and
  are copied out with their CRC-32C (the load's path);
* ``engine_straight_hugetlb``: the same reads straight into memory on hugetlb pages: no copy (needs ~1,000 more
  hugetlb pages, ``sysctl vm.nr_hugepages=1200``; left out otherwise);
* ``load_into``: ``single_file.load(path, into=state)`` itself.

Every case gives its seconds (fio: its runtime) and the disk's counters around it (``bench/block_device.py``): the
device's pace (bytes read per busy second) and the requests in flight. Run with nothing else running::

    sysctl vm.nr_hugepages=1200
    python -m benchmarks.device_beside_work --rounds 10 --json benchmarks/results/device_beside_work.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

import native_io
from benchmarks.load_into_limit import hugetlb_buffer, timed_read
from benchmarks.scratch_dir import print_rows, run_in_scratch_dir
from lightning_recover.bench import fio
from lightning_recover.bench.block_device import BlockDevice
from lightning_recover.bench.checkpoint import drop_caches_supported, machine_info, make_cold
from lightning_recover.bench.gpt_state import build_state
from lightning_recover.checkpoint.file import single_file

BLOCK = fio.BLOCK


def hugetlb_bytes(nbytes: int) -> Optional[np.ndarray]:
    """``load_into_limit.hugetlb_buffer`` as ``nbytes`` of uint8 (None when too few hugetlb pages are free)."""
    mem = hugetlb_buffer(nbytes)
    return None if mem is None else np.frombuffer(mem, dtype=np.uint8)[:nbytes]


def engine_read(engine: Any, path: str, dest: np.ndarray, straight: bool) -> Callable[[], float]:
    """The reader filling ``dest`` from ``path`` 16 MiB at a time (``load_into_limit.timed_read``): via its arena,
    or straight into ``dest``."""
    segments = [(off, dest[off : off + BLOCK]) for off in range(0, len(dest), BLOCK)]
    return lambda: timed_read(path, segments, engine, 0 if straight else None)["s"]


def fio_beside(path: str, nbytes: int, iomem: Optional[str], beside: Optional[str]) -> Callable[[], float]:
    """fio at depth 2 alone, beside a ``yes`` process (``busy``) or beside a copy+CRC-32C loop (``copy``); ``iomem``:
    fio's buffers (``fio.huge_iomem``), None for malloc."""
    source: Optional[np.ndarray] = None
    if beside == "copy":  # from huge pages, as the arena's side is, where enough are reserved
        source = hugetlb_bytes(BLOCK)
        if source is None:
            source = np.ones(BLOCK, dtype=np.uint8)
    dest = np.empty(BLOCK, dtype=np.uint8)

    def run() -> float:
        stop = threading.Event()
        helper: Any = None
        if beside == "busy":
            helper = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)
        elif beside == "copy":

            def loop() -> None:
                while not stop.is_set():
                    native_io.copy_crc32c(dest, source)

            helper = threading.Thread(target=loop, name="copy-loop", daemon=True)
            helper.start()
        try:
            return fio.read(path, nbytes, 2, iomem)["seconds"]
        finally:
            if isinstance(helper, subprocess.Popen):
                helper.kill()
                helper.wait()
            elif helper is not None:
                stop.set()
                helper.join()

    return run


def run(rounds: int, directory: str) -> dict[str, Any]:
    if not drop_caches_supported():
        raise SystemExit("needs root: the page cache is dropped before every read (/proc/sys/vm/drop_caches)")
    iomem = fio.huge_iomem(16 * BLOCK)
    if iomem is None:
        raise SystemExit("reserve hugetlb pages for fio's buffers first: sysctl vm.nr_hugepages=140")
    state, desc = build_state("llama", 2.0)
    path = os.path.join(directory, "ckpt.pt")
    single_file.save(state, path)
    nbytes = os.path.getsize(path) // BLOCK * BLOCK  # whole blocks, as fio reads them
    device = BlockDevice.under(directory)
    engine = native_io.IOEngine(block_size=BLOCK, queue_depth=2)
    plain = np.empty(nbytes, dtype=np.uint8)
    plain[::4096] = 0
    huge = hugetlb_bytes(nbytes)
    cases: list[tuple[str, Callable[[], float]]] = [
        ("fio_qd2_alone", fio_beside(path, nbytes, iomem, None)),
        ("fio_qd2_beside_busy", fio_beside(path, nbytes, iomem, "busy")),
        ("fio_qd2_beside_copy", fio_beside(path, nbytes, iomem, "copy")),
        ("engine_via_arena", engine_read(engine, path, plain, straight=False)),
        *([("engine_straight_hugetlb", engine_read(engine, path, huge, straight=True))] if huge is not None else []),
    ]

    def load_into() -> float:
        t0 = time.perf_counter()
        single_file.load(path, into=state, engine=engine)
        return time.perf_counter() - t0

    cases.append(("load_into", load_into))
    engine_read(engine, path, plain, straight=False)()  # the arena faulted in once, as a job's engine is
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in cases}
    for r in range(rounds):
        for name, case in cases if r % 2 == 0 else cases[::-1]:
            make_cold(directory, "drop_caches")
            subprocess.run(["fio", "--version"], capture_output=True, check=True)  # fio's binary read back in
            with device.measure() as disk:
                seconds = case()
            samples[name].append({"s": seconds, "disk": disk})
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]['s']:.3f}" for n, v in samples.items()), flush=True)
    engine.close()
    return {
        "meta": {
            "state": desc,
            "bytes": nbytes,
            "rounds": rounds,
            "block_device": device.name,
            "block_device_unread": device.why_not,
            "machine": machine_info(directory),
        },
        "samples": samples,
        "summary": summarize(samples, nbytes),
    }


def summarize(samples: dict[str, list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    """Per case: median seconds [min-max], its speed against fio alone, and the device's pace and requests in
    flight (medians) where the counters were read."""
    alone = statistics.median(x["s"] for x in samples["fio_qd2_alone"])
    out: dict[str, Any] = {}
    for name, xs in samples.items():
        med = statistics.median(x["s"] for x in xs)
        row: dict[str, Any] = {
            "median_s": med,
            "min_s": min(x["s"] for x in xs),
            "max_s": max(x["s"] for x in xs),
            "vs_fio_alone": alone / med,
            "gbps": nbytes / med / 1e9,
        }
        if all(x["disk"].get("busy_s") for x in xs):
            row["device_gbps_while_busy"] = statistics.median(
                x["disk"]["read_bytes"] / x["disk"]["busy_s"] / 1e9 for x in xs
            )
            row["mean_in_flight"] = statistics.median(x["disk"]["mean_in_flight"] for x in xs)
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    parent = os.environ.get("LR_BENCH_DIR", "/var/tmp")
    result = run_in_scratch_dir("lr-device-beside-", lambda d: run(args.rounds, d), args.json, parent)
    print_rows(result["summary"])


if __name__ == "__main__":
    main()
