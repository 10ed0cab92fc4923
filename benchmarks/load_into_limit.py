"""Where a cold load into existing tensors (``single_file.load(into=...)``) stands against the device (issue 51).

One file, the Llama-like state of ``bench checkpoint --state llama``, read cold (page cache dropped before every
read) by, in alternating order each round:

* ``load_depth{1,2,4}``: the load itself, into the state's own tensors, with the engine's queue depth 1, 2 (the
  default) and 4;
* ``read_depth{1,2,4}``: the engine's reader alone (``Reader.read``) into the same tensors' storages, with the CPU time
  of the thread that runs it (submissions, completions, the copy out of the staging arena with its CRC-32C);
* ``read_depth2_straight``: the same with the reader's ``direct_min`` lowered to 256 KiB, so that every record whose
  tensor sits at an address congruent to its file offset (modulo 4096) is read straight into it, no copy (on a
  device that splits plain pages into small requests, virtio-blk here, the reader's default is never);
* ``read_depth2_hugetlb_dest``: the reader into one buffer on hugetlb pages laid out like the file instead of the
  tensors (run when enough hugetlb pages are free: ``sysctl vm.nr_hugepages=1200`` for the 2 GB state): the same
  reads, copies and checksums, into memory of 2 MiB pages;
* ``read_depth2_hugetlb_dest_straight``: the reader into that hugetlb buffer with ``direct_min`` at 256 KiB: every
  record read straight into it (its offsets agree with the file's), no copy out of the arena and no checksum of a
  copy: what the reads alone cost the engine when the destination is on huge pages;
* ``fio_hugetlb_qd{1,4,16}``: fio reading the same file (O_DIRECT, io_uring, 16 MiB blocks) into hugetlb buffers
  (the device limit the paired bench compares with);
* ``fio_hugetlb_qd1_beside_copy``: fio at depth 1 while a thread of this process copies the file's bytes once with
  their CRC-32C (``native_io.copy_crc32c``, 16 MiB at a time, huge-page source, plain-page destination: the copy a
  load makes out of its arena), as fast as it can: what that copy's memory traffic costs the device's reads;
* ``fio_4k_pages_qd{4,16}``: the same into fio's default buffers, plain 4 KiB pages: what reading straight into a
  user's tensors (which sit on 4 KiB pages) would cost, against the reader's copy from its huge-page arena.

Every figure is fio's runtime or our wall time of the read alone (no process start). Run with nothing else running
and hugetlb pages reserved: 140 for fio's buffers, 1200 to add the hugetlb-destination case::

    sysctl vm.nr_hugepages=1200
    python -m benchmarks.load_into_limit --rounds 10 --json benchmarks/results/load_into_limit.json
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

import native_io
from benchmarks.scratch_dir import print_rows, run_in_scratch_dir
from lightning_recover.bench import fio
from lightning_recover.bench.checkpoint import drop_caches_supported, machine_info, make_cold
from lightning_recover.bench.gpt_state import build_state
from lightning_recover.checkpoint.file import single_file
from lightning_recover.checkpoint.file.state_tensors import storage_as_bytes, tensor_paths

BLOCK = 16 << 20
STRAIGHT_MIN = 256 << 10  # native_io's own threshold for reading a piece straight into its buffer
MAP_HUGETLB = 0x40000  # Linux's flag (Python's mmap module does not name it)


def target_segments(path: str, state: Any) -> list[tuple[int, Any]]:
    """``(file offset, bytes of the target storage)`` of every storage record of ``path``, in file order: the
    reads a load into ``state``'s own tensors makes."""
    info = single_file.read_info(path)
    by_name = {p: t for p, t in tensor_paths(state).values()}
    storage_of = {row["record"]: by_name[row["name"]].untyped_storage() for row in info.tensors}
    records = sorted(
        ((n, r) for n, r in info.index.records.items() if n.startswith("data/") and r.nbytes),
        key=lambda nr: nr[1].data_offset,
    )
    return [(rec.data_offset, storage_as_bytes(storage_of[name]).numpy()) for name, rec in records]


def timed_read(path: str, segments: list, engine: Any, direct_min: Optional[int] = None) -> dict[str, float]:
    t0, c0 = time.perf_counter(), time.thread_time()
    with engine.open_reader(path) as reader:
        if direct_min is not None:
            reader.direct_min = direct_min
        reader.read(segments)
        straight, staged = reader.direct_bytes, reader.io_bytes - reader.direct_bytes
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {"s": wall, "cpu_s": cpu, "staged_bytes": staged, "straight_bytes": straight}


def hugetlb_buffer(nbytes: int) -> Optional[mmap.mmap]:
    """``nbytes`` (rounded up to 2 MiB) of anonymous memory on hugetlb pages, faulted in; None when too few are free
    (fio's buffers need 16 blocks of them besides)."""
    span = -(-nbytes // (2 << 20)) * (2 << 20)
    if fio.huge_iomem(span + 16 * BLOCK) is None:
        return None
    buf = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
    for off in range(0, span, 2 << 20):
        buf[off] = 0
    return buf


def timed_load(path: str, state: Any, engine: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    single_file.load(path, into=state, engine=engine)
    return {"s": time.perf_counter() - t0}


def timed_fio(path: str, nbytes: int, depth: int, iomem: Any) -> dict[str, float]:
    r = fio.read(path, nbytes, depth, iomem)
    return {"s": r["seconds"], "fio_bytes": r["io_bytes"], "iomem": r["iomem"]}


def timed_fio_beside_copy(path: str, nbytes: int, iomem: Any, source: Any, dest: Any) -> dict[str, float]:
    """fio at depth 1 while a thread copies ``nbytes`` from ``source`` into ``dest`` (one block at a time) with their
    CRC-32C, started as fio is: how long each took."""
    copy: dict[str, float] = {}

    def run_copy() -> None:
        t0 = time.perf_counter()
        for _ in range(nbytes // BLOCK):
            native_io.copy_crc32c(dest, source)
        copy["s"] = time.perf_counter() - t0

    thread = threading.Thread(target=run_copy, name="copy", daemon=True)
    thread.start()
    result = timed_fio(path, nbytes, 1, iomem)
    thread.join()
    return {**result, "copy_s": copy["s"]}


def run(rounds: int, size_gb: float, directory: str) -> dict[str, Any]:
    if not drop_caches_supported():
        raise SystemExit("needs root: the page cache is dropped before every read (/proc/sys/vm/drop_caches)")
    huge = fio.huge_iomem(16 * BLOCK)
    if huge is None:
        raise SystemExit("reserve hugetlb pages for fio's buffers first: sysctl vm.nr_hugepages=140")
    state, desc = build_state("llama", size_gb)
    path = os.path.join(directory, "ckpt.pt")
    single_file.save(state, path)
    nbytes = os.path.getsize(path)
    segments = target_segments(path, state)
    # one engine per depth for the whole run, as a job keeps its engine: its staging arena is allocated and
    # faulted in once (by this warm-up read), not in every timed read
    engines = {qd: native_io.IOEngine(block_size=BLOCK, queue_depth=qd) for qd in (1, 2, 4)}
    for engine in engines.values():
        timed_read(path, segments, engine)
    huge_dest = hugetlb_buffer(nbytes)
    huge_segments = (
        [(off, memoryview(huge_dest)[off : off + len(b)]) for off, b in segments] if huge_dest is not None else []
    )
    copy_source = memoryview(hugetlb_buffer(BLOCK) or bytearray(BLOCK))  # the arena's side: huge pages
    copy_dest = memoryview(bytearray(BLOCK))  # a tensor's side: plain pages
    cases: list[tuple[str, Callable[[], dict]]] = [
        ("load_depth1", lambda: timed_load(path, state, engines[1])),
        ("load_depth2", lambda: timed_load(path, state, engines[2])),
        ("load_depth4", lambda: timed_load(path, state, engines[4])),
        ("read_depth1", lambda: timed_read(path, segments, engines[1])),
        ("read_depth2", lambda: timed_read(path, segments, engines[2])),
        ("read_depth4", lambda: timed_read(path, segments, engines[4])),
        ("read_depth2_straight", lambda: timed_read(path, segments, engines[2], STRAIGHT_MIN)),
        *(
            [
                ("read_depth2_hugetlb_dest", lambda: timed_read(path, huge_segments, engines[2])),
                (
                    "read_depth2_hugetlb_dest_straight",
                    lambda: timed_read(path, huge_segments, engines[2], STRAIGHT_MIN),
                ),
            ]
            if huge_segments
            else []
        ),
        ("fio_hugetlb_qd1", lambda: timed_fio(path, nbytes, 1, huge)),
        ("fio_hugetlb_qd4", lambda: timed_fio(path, nbytes, 4, huge)),
        ("fio_hugetlb_qd16", lambda: timed_fio(path, nbytes, 16, huge)),
        ("fio_hugetlb_qd1_beside_copy", lambda: timed_fio_beside_copy(path, nbytes, huge, copy_source, copy_dest)),
        ("fio_4k_pages_qd4", lambda: timed_fio(path, nbytes, 4, None)),
        ("fio_4k_pages_qd16", lambda: timed_fio(path, nbytes, 16, None)),
    ]
    samples: dict[str, list[dict]] = {name: [] for name, _ in cases}
    for r in range(rounds):
        for name, case in cases if r % 2 == 0 else cases[::-1]:
            make_cold(directory, "drop_caches")
            samples[name].append(case())
        print(f"round {r}: " + ", ".join(f"{n} {v[-1]['s']:.3f}" for n, v in samples.items()), flush=True)
    for engine in engines.values():
        engine.close()
    return {
        "meta": {
            "state": desc,
            "file_bytes": nbytes,
            "data_bytes": sum(len(b) for _, b in segments),
            "records": len(segments),
            "rounds": rounds,
            "block_bytes": BLOCK,
            "load_process_threads": torch.get_num_threads(),
            "threads_alive": threading.active_count(),
            "machine": machine_info(directory),
        },
        "samples": samples,
        "summary": summarize(samples),
    }


def summarize(samples: dict[str, list[dict]]) -> dict[str, Any]:
    """Median and range of each case, and the ratios the issue asks for: fio's best median over ours."""
    med = {n: statistics.median(x["s"] for x in v) for n, v in samples.items()}
    out: dict[str, Any] = {
        n: {"median_s": m, "min_s": min(x["s"] for x in samples[n]), "max_s": max(x["s"] for x in samples[n])}
        for n, m in med.items()
    }
    for n in out:
        if "cpu_s" in samples[n][0]:  # the reader's own cases
            out[n]["median_cpu_s"] = statistics.median(x["cpu_s"] for x in samples[n])
        if "copy_s" in samples[n][0]:
            out[n]["median_copy_s"] = statistics.median(x["copy_s"] for x in samples[n])
    fio_best = min(m for n, m in med.items() if n.startswith("fio_hugetlb") and "beside" not in n)
    fio_4k_best = min(m for n, m in med.items() if n.startswith("fio_4k_pages"))
    out["ratios"] = {f"{n}_vs_fio_best": fio_best / m for n, m in med.items() if not n.startswith("fio_")}
    out["ratios"]["fio_4k_pages_vs_fio_best"] = fio_best / fio_4k_best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    result = run_in_scratch_dir("lr-load-into-", lambda d: run(args.rounds, args.size_gb, d), args.json)
    print_rows(result["summary"])


if __name__ == "__main__":
    main()
