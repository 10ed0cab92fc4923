"""Where does a format-2 save's time go? Timers around every step of ``single_file.save``, per state.

``python -m benchmarks.profile_save --state llama|small10k|gpt [--size-gb G] [--repeat 3]
[--dir DIR] [--cprofile 25] [--json OUT]``

The plugin's ``save`` (format 2, ``single_file._save_zip``) runs unchanged; these calls are wrapped:

* ``torch_zip.ZipPlan.lay_out``: the pickler walking the checkpoint, record layout, the small records'
  CRC-32C, and batching the storages as they are found (less its waits for the batch in flight);
* ``WritePipeline.drain``: the calling thread waiting for the batch written on the second thread;
* ``state_tensors.storage_span`` (as ``single_file`` calls it): one buffer per storage (per-tensor Python work,
  inside ``lay_out``);
* ``PlanWriter.write`` less the native call inside it: the local headers ("leads") and the segment lists;
* native ``Writer.write``: copy + CRC-32C into the arena, submission and waiting for free slots; the
  calling thread's CPU time (``thread_time``: the copy, the CRC and the submission syscalls) and its
  run-queue wait (``/proc/thread-self/schedstat``) are reported apart, the rest is blocked on the device;
* ``ZipPlan.tail``: integrity record, central directory, end records;
* native ``Writer.close``: waiting for the last blocks, ``ftruncate``, ``fdatasync``;
* ``files.fsync_dir`` and the rename.

The batch writes (``PlanWriter.write`` and the native call in it) run on the pipeline's thread, beside
``lay_out``: they are reported apart, not in the sum.

Reference numbers on the same tensors (no I/O): CRC-32C alone, and a native write of the same segments to
``/dev/shm`` (the writer's ceiling without the disk). ``--cprofile N`` also runs one save under cProfile
and prints the N functions with the most own time. Medians over ``--repeat`` saves.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.profile_uring import EngineProxy, Timers
from lightning_recover.bench.checkpoint import fsync_tree
from lightning_recover.bench.gpt_state import STATES, build_state, iter_tensors, tensor_stats

NATIVE_WRITE = "native Writer.write (copy+crc32c+submit/wait)"
NATIVE_CLOSE = "native Writer.close (drain, truncate, fdatasync)"


def _wrap(owner: Any, name: str, timers: Timers, label: str) -> contextlib.AbstractContextManager:
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:  # wall time only: cheap enough for per-storage calls
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            timers.t[label] += time.perf_counter() - t0
            timers.n[label] += 1

    return _patched(owner, name, wrapper)


@contextlib.contextmanager
def _patched(owner: Any, name: str, fn: Any) -> Iterator[None]:
    """``owner.name`` replaced by ``fn`` inside the block."""
    old = getattr(owner, name)
    setattr(owner, name, fn)
    try:
        yield
    finally:
        setattr(owner, name, old)


def one_save(checkpoint: Any, path: str, eng: Any) -> dict[str, Any]:
    """One timed ``single_file.save`` (format 2) of ``checkpoint`` to ``path``; returns the breakdown.

    ``parts`` follow the calling thread and add up to the total; ``overlapped`` is work that runs beside it
    (the batch writes on the pipeline thread, the views taken inside ``lay_out``)."""
    from lightning_recover.checkpoint import files, write_pipeline
    from lightning_recover.checkpoint.file import single_file, torch_zip

    ts = Timers()
    proxy = EngineProxy(eng, ts)
    in_lay_out = [False]
    drain = write_pipeline.WritePipeline.drain

    def timed_drain(self: Any) -> None:  # the calling thread waiting for the batch in flight
        t0 = time.perf_counter()
        try:
            drain(self)
        finally:
            label = "drain inside lay_out" if in_lay_out[0] else "drain after lay_out"
            ts.t[label] += time.perf_counter() - t0

    lay_out = torch_zip.ZipPlan.lay_out

    def timed_lay_out(self: Any, *a: Any, **k: Any) -> None:
        in_lay_out[0] = True
        t0 = time.perf_counter()
        try:
            lay_out(self, *a, **k)
        finally:
            ts.t["lay_out (total)"] += time.perf_counter() - t0
            in_lay_out[0] = False

    with contextlib.ExitStack() as stack:
        stack.enter_context(_wrap(single_file, "storage_span", ts, "storage_span (a buffer per storage)"))
        stack.enter_context(_wrap(torch_zip.PlanWriter, "write", ts, "PlanWriter.write (total)"))
        stack.enter_context(_wrap(torch_zip.ZipPlan, "tail", ts, "ZipPlan.tail (integrity, central dir)"))
        stack.enter_context(_wrap(single_file, "cleanup_stale_temps", ts, "cleanup_stale_temps"))
        stack.enter_context(_wrap(files, "fsync_dir", ts, "fsync_dir"))  # inside files.commit
        stack.enter_context(_patched(write_pipeline.WritePipeline, "drain", timed_drain))
        stack.enter_context(_patched(torch_zip.ZipPlan, "lay_out", timed_lay_out))
        os.sync()
        t0 = time.perf_counter()
        single_file.save(checkpoint, path, engine=proxy)
        total = time.perf_counter() - t0
    t = dict(ts.t)
    waits = t.get("drain inside lay_out", 0.0) + t.get("drain after lay_out", 0.0)
    parts = {
        "lay_out: pickling, placing, batching (own work)": t.get("lay_out (total)", 0.0)
        - t.get("drain inside lay_out", 0.0),
        "waiting for the batch in flight (drain)": waits,
        "ZipPlan.tail (integrity, central dir)": t.get("ZipPlan.tail (integrity, central dir)", 0.0),
        NATIVE_CLOSE: t.get(NATIVE_CLOSE, 0.0),
        "fsync_dir": t.get("fsync_dir", 0.0),
        "cleanup_stale_temps": t.get("cleanup_stale_temps", 0.0),
        "native open_writer": t.get("native open_writer", 0.0),
    }
    parts["rest (temporary name, rename, tail write)"] = total - sum(parts.values())
    overlapped = {
        "storage_span (a buffer per storage), in lay_out": t.get("storage_span (a buffer per storage)", 0.0),
        "PlanWriter.write Python (leads, segment lists)": t.get("PlanWriter.write (total)", 0.0)
        - t.get(NATIVE_WRITE, 0.0),
        NATIVE_WRITE: t.get(NATIVE_WRITE, 0.0),
    }
    w = proxy.last_writer
    return {
        "total_s": total,
        "parts": parts,
        "overlapped": overlapped,
        "native_write_cpu_s": ts.cpu.get(NATIVE_WRITE, 0.0),
        "native_write_runq_s": ts.runq.get(NATIVE_WRITE, 0.0),
        "native_write_calls": ts.n.get(NATIVE_WRITE, 0),
        "native_close_cpu_s": ts.cpu.get(NATIVE_CLOSE, 0.0),
        "file_bytes": os.path.getsize(path),
        "writer": {"seconds": getattr(w, "seconds", None), "io_bytes": getattr(w, "io_bytes", None)},
    }


def reference(checkpoint: Any, eng_factory: Any) -> dict[str, float]:
    """CRC-32C alone over the tensors, and a native write of the same segments to /dev/shm (no sync cost)."""
    import torch

    import native_io

    bufs = [t.detach().reshape(-1).view(torch.uint8).numpy() for _, t in iter_tensors(checkpoint)]
    bufs = [b for b in bufs if b.size]
    nbytes = sum(b.size for b in bufs)
    t0 = time.perf_counter()
    for b in bufs:
        native_io.crc32c(b)
    out = {"crc32c alone GB/s": nbytes / (time.perf_counter() - t0) / 1e9}
    if os.path.isdir("/dev/shm"):
        d = tempfile.mkdtemp(prefix="lr-prof-shm-", dir="/dev/shm")
        try:
            segs, off = [], 0
            for b in bufs:
                segs.append((off, b))
                off += -(-b.size // 4096) * 4096
            eng = eng_factory()
            path = os.path.join(d, "x")
            t0, c0 = time.perf_counter(), time.thread_time()
            with eng.open_writer(path) as w:
                w.write(segs)
                w.close()
            out["native write of the same segments to /dev/shm GB/s"] = nbytes / (time.perf_counter() - t0) / 1e9
            out["  its CPU (calling thread) s"] = time.thread_time() - c0
            eng.close()
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


def profile(state: str, size_gb: float | None, directory: str | None, repeat: int, cprofile: int) -> dict[str, Any]:
    import native_io

    checkpoint, desc = build_state(state, size_gb)
    stats = tensor_stats(checkpoint)
    root = tempfile.mkdtemp(prefix="lr-profile-save-", dir=directory or "/tmp")
    eng = native_io.IOEngine()
    runs = []
    prof_text = None
    try:
        for rep in range(repeat):
            path = os.path.join(root, f"last-{rep}.ckpt")
            c0 = time.process_time()
            r = one_save(checkpoint, path, eng)
            r["process_cpu_s"] = time.process_time() - c0
            t0 = time.perf_counter()
            fsync_tree(root)
            r["bench_post_sync_s"] = time.perf_counter() - t0
            os.remove(path)
            runs.append(r)
            gc.collect()
        if cprofile:
            from lightning_recover.checkpoint.file import single_file

            path = os.path.join(root, "cprofile.ckpt")
            os.sync()
            pr = cProfile.Profile()
            pr.enable()
            single_file.save(checkpoint, path, engine=eng)
            pr.disable()
            os.remove(path)
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(cprofile)
            prof_text = buf.getvalue()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        eng.close()
    refs = reference(checkpoint, native_io.IOEngine)

    def med(getter: Any) -> float:
        return statistics.median(getter(r) for r in runs)

    summary: dict[str, Any] = {
        "state": state,
        "description": desc["description"],
        "bytes": stats["bytes"],
        "tensors": stats["tensors"],
        "tensors_lt_1mib": stats["tensors_lt_1mib"],
        "repeat": repeat,
        "total_s": med(lambda r: r["total_s"]),
        "parts": {k: med(lambda r, k=k: r["parts"][k]) for k in runs[0]["parts"]},
        "overlapped": {k: med(lambda r, k=k: r["overlapped"][k]) for k in runs[0]["overlapped"]},
        "native_write_cpu_s": med(lambda r: r["native_write_cpu_s"]),
        "native_write_runq_s": med(lambda r: r["native_write_runq_s"]),
        "native_write_calls": runs[0]["native_write_calls"],
        "process_cpu_s": med(lambda r: r["process_cpu_s"]),
        "bench_post_sync_s": med(lambda r: r["bench_post_sync_s"]),
        "file_bytes": runs[0]["file_bytes"],
        "reference": refs,
        "engine": native_io.info(),
        "runs": runs,
        "cprofile": prof_text,
    }
    w = summary["overlapped"][NATIVE_WRITE]
    summary["native_write_blocked_s"] = w - summary["native_write_cpu_s"] - summary["native_write_runq_s"]
    return summary


def _print(s: dict[str, Any]) -> None:
    nb = s["bytes"]
    print(
        f"state {s['state']}: {s['description']}; {nb / 1e9:.3f} GB in {s['tensors']} tensors "
        f"({s['tensors_lt_1mib']} < 1 MiB), file {s['file_bytes'] / 1e9:.3f} GB; medians of {s['repeat']}"
    )
    print(f"save total {s['total_s']:.3f}s = {nb / s['total_s'] / 1e9:.2f} GB/s; process CPU {s['process_cpu_s']:.3f}s")
    for k, v in s["parts"].items():
        print(f"   {k:<52} {v:8.3f}s  {100 * v / s['total_s']:5.1f}%")
    print("   beside it (the batch writes run on a second thread while lay_out pickles):")
    for k, v in s["overlapped"].items():
        print(f"   {k:<52} {v:8.3f}s")
        if k == NATIVE_WRITE:
            print(f"     {'of which on-CPU (copy+crc32c, submission)':<50} {s['native_write_cpu_s']:8.3f}s")
            print(f"     {'of which waiting for a CPU':<50} {s['native_write_runq_s']:8.3f}s")
            print(f"     {'rest: blocked on the device':<50} {s['native_write_blocked_s']:8.3f}s")
            print(f"     {'native write() calls':<50} {s['native_write_calls']:8d}")
    print(f"   bench post-sync (not in total) {s['bench_post_sync_s']:.3f}s")
    for k, v in s["reference"].items():
        print(f"reference: {k:<58} {v:8.2f}")
    try:
        print(f"loadavg {os.getloadavg()}")
    except OSError:
        pass
    if s.get("cprofile"):
        print(s["cprofile"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", default="llama", choices=list(STATES))
    p.add_argument("--size-gb", type=float, default=None)
    p.add_argument("--dir", default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cprofile", type=int, default=0, help="also one save under cProfile: top N by own time")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    s = profile(a.state, a.size_gb, a.dir, max(1, a.repeat), a.cprofile)
    _print(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
