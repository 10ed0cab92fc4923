"""Where does UringCheckpointIO's time go? A breakdown of one durable save and one cold load.

``python -m benchmarks.profile_uring [--size-gb 2] [--dir DIR] [--repeat 3]`` (format 2: torch.save archives)

The functional ``save``/``load`` of :mod:`lightning_recover.checkpoint.file.single_file` are run
unchanged; their calls into the archive module (``torch_zip``) and the native engine are wrapped with
timers (an engine proxy passed as ``engine=``, archive functions patched for the duration of a call). The
writes run on the write pipeline's thread while the state is laid out, and the storage reads beside the
unpickler: those parts overlap, so "unaccounted" counts only the parts on the calling thread.
Reference numbers measured alone on the same bytes: crc32c, memcpy (warm and fresh
destination), page-cache drop. Medians over ``--repeat`` runs. Compare with the fio rows of
``lightning-recover bench checkpoint``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

from lightning_recover.bench.checkpoint import drop_caches_supported, fsync_tree, make_cold, touch_pages
from lightning_recover.bench.gpt_state import build_checkpoint, iter_tensors, tensor_stats


def _runqueue_wait() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (schedstat), 0 if unknown."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Timers:
    """Seconds and call counts accumulated per label (shared by the profilers)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

        self.cpu: dict[str, float] = defaultdict(float)
        self.runq: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        c0 = time.thread_time()  # CPU of the calling thread (the native copy+crc runs on it)
        q0 = _runqueue_wait()
        try:
            yield
        finally:
            self.t[name] += time.perf_counter() - t0
            self.cpu[name] += time.thread_time() - c0
            self.runq[name] += _runqueue_wait() - q0
            self.n[name] += 1


class _WriterProxy:
    def __init__(self, w: Any, timers: Timers) -> None:
        self._w, self._timers = w, timers

    def write(self, segments, wait=True):
        with self._timers.time("native Writer.write (copy+crc32c+submit/wait)"):
            return self._w.write(segments, wait=wait)

    def close(self, size=None):
        with self._timers.time("native Writer.close (drain, truncate, fdatasync)"):
            return self._w.close(size=size)

    def __enter__(self):
        self._w.__enter__()
        return self

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._w, name)


class _ReaderProxy:
    def __init__(self, r: Any, timers: Timers) -> None:
        self._r, self._timers = r, timers

    def read(self, segments):
        big = sum(len(memoryview(b).cast("B")) for _, b in segments) > (1 << 20)
        name = "native Reader.read (data, crc32c)" if big else "native Reader.read (header/footer/index)"
        with self._timers.time(name):
            return self._r.read(segments)

    def close(self):
        with self._timers.time("native Reader.close"):
            return self._r.close()

    def __getattr__(self, name):
        return getattr(self._r, name)


class EngineProxy:
    """A ``native_io`` engine whose writers and readers time each call into ``timers``."""

    def __init__(self, eng: Any, timers: Timers) -> None:
        self._eng, self._timers = eng, timers
        self.last_writer: Any = None
        self.last_reader: Any = None

    def open_writer(self, path, size_hint=None, *, existing=False):
        with self._timers.time("native open_writer"):
            w = self._eng.open_writer(path, size_hint=size_hint, existing=existing)
        self.last_writer = w
        return _WriterProxy(w, self._timers)

    def open_reader(self, path):
        with self._timers.time("native open_reader"):
            r = self._eng.open_reader(path)
        self.last_reader = r
        return _ReaderProxy(r, self._timers)

    def __getattr__(self, name):
        return getattr(self._eng, name)


@contextlib.contextmanager
def _patched(module: Any, names: list[str], timers: Timers, label: str) -> Iterator[None]:
    saved = {}
    for name in names:
        fn = getattr(module, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*a, __fn=fn, __name=name, **k):
            with timers.time(f"{label}.{__name}"):
                return __fn(*a, **k)

        setattr(module, name, wrapper)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _ref_numbers(checkpoint: Any) -> dict[str, float]:
    import native_io

    storages = [t for _, t in iter_tensors(checkpoint)]
    nbytes = sum(t.numel() * t.element_size() for t in storages)
    out: dict[str, float] = {}
    bufs = [t.reshape(-1).view(torch.uint8).numpy() for t in storages if t.numel()]
    t0 = time.perf_counter()
    for b in bufs:
        native_io.crc32c(b)
    out["crc32c alone GB/s"] = nbytes / (time.perf_counter() - t0) / 1e9
    big = [t for t in storages if t.numel() * t.element_size() >= (1 << 20)]
    bigbytes = sum(t.numel() * t.element_size() for t in big)
    dst = [torch.empty_like(t) for t in big]
    t0 = time.perf_counter()
    for d, s in zip(dst, big):
        d.copy_(s)
    out["memcpy fresh dst GB/s"] = bigbytes / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for d, s in zip(dst, big):
        d.copy_(s)
    out["memcpy warm dst GB/s"] = bigbytes / (time.perf_counter() - t0) / 1e9
    del dst
    return out


def profile(size_gb: float, directory: str | None, repeat: int) -> dict[str, Any]:
    import native_io
    from lightning_recover.checkpoint.file import single_file as cio
    from lightning_recover.checkpoint.file import torch_zip

    checkpoint, cfg = build_checkpoint(size_gb)
    stats = tensor_stats(checkpoint)
    nbytes = stats["bytes"]
    cache = "drop_caches" if drop_caches_supported() else "fadvise"
    root = tempfile.mkdtemp(prefix="lr-profile-uring-", dir=directory or "/tmp")
    eng = native_io.IOEngine()
    zip_names = ["file_meta", "parse_tail", "parse_archive", "check_local_headers", "unpickle"]
    cio_names = ["cleanup_stale_temps", "commit"]
    # on the calling thread, one after the other (the writes and data reads overlap them on other threads)
    save_serial = {"zip.lay_out", "zip.file_meta", "cio.cleanup_stale_temps", "cio.commit", "native open_writer"}
    save_serial.add("native Writer.close (drain, truncate, fdatasync)")
    load_serial = {"native open_reader", "zip.parse_tail", "zip.parse_archive", "zip.unpickle", "native Reader.close"}
    load_serial.add("native Reader.read (header/footer/index)")
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(repeat):
            path = os.path.join(root, f"last-{rep}.ckpt")
            os.sync()
            ts = Timers()
            proxy = EngineProxy(eng, ts)
            with (
                _patched(torch_zip, zip_names, ts, "zip"),
                _patched(torch_zip.ZipPlan, ["lay_out"], ts, "zip"),
                _patched(cio, cio_names, ts, "cio"),
            ):
                t0 = time.perf_counter()
                cio.save(checkpoint, path, engine=proxy)
                t1 = time.perf_counter()
            fsync_tree(root)
            t2 = time.perf_counter()
            w = proxy.last_writer
            save = {
                "total_s": t1 - t0,
                "bench_post_sync_s": t2 - t1,
                "parts": dict(ts.t),
                "cpu": dict(ts.cpu),
                "runq": dict(ts.runq),
                "writer": {
                    "seconds": getattr(w, "seconds", None),
                    "io_bytes": getattr(w, "io_bytes", None),
                    "bytes_written": getattr(w, "bytes_written", None),
                    "direct": getattr(w, "direct", None),
                    "engine": getattr(w, "engine", None),
                },
            }
            save["unaccounted_s"] = save["total_s"] - sum(v for k, v in ts.t.items() if k in save_serial)

            make_cold(root, cache)
            tl = Timers()
            proxy = EngineProxy(eng, tl)
            with _patched(torch_zip, zip_names, tl, "zip"), _patched(cio, cio_names, tl, "cio"):
                t0 = time.perf_counter()
                loaded = cio.load(path, map_location="cpu", engine=proxy)
                t1 = time.perf_counter()
            touch_pages(loaded)
            t2 = time.perf_counter()
            r = proxy.last_reader
            load = {
                "total_s": t1 - t0,
                "touch_s": t2 - t1,
                "parts": dict(tl.t),
                "cpu": dict(tl.cpu),
                "runq": dict(tl.runq),
                "reader": {
                    "seconds": getattr(r, "seconds", None),
                    "io_bytes": getattr(r, "io_bytes", None),
                    "bytes_read": getattr(r, "bytes_read", None),
                    "direct": getattr(r, "direct", None),
                    "engine": getattr(r, "engine", None),
                },
            }
            load["unaccounted_s"] = load["total_s"] - sum(v for k, v in tl.t.items() if k in load_serial)
            del loaded
            gc.collect()
            os.remove(path)
            runs.append({"save": save, "load": load})
    finally:
        for name in os.listdir(root):
            os.remove(os.path.join(root, name))
        os.rmdir(root)
        eng.close()

    refs = _ref_numbers(checkpoint)

    def med(getter):
        vals = [getter(r) for r in runs]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    summary: dict[str, Any] = {
        "bytes": nbytes,
        "tensors": stats["tensors"],
        "cache": cache,
        "repeat": repeat,
        "engine": native_io.info(),
        "reference": refs,
        "save": {},
        "load": {},
    }
    for kind in ("save", "load"):
        keys = sorted({k for r in runs for k in r[kind]["parts"]})
        summary[kind]["total_s"] = med(lambda r, kind=kind: r[kind]["total_s"])
        summary[kind]["total_gbps"] = nbytes / summary[kind]["total_s"] / 1e9
        for k in keys:
            summary[kind][k] = med(lambda r, k=k, kind=kind: r[kind]["parts"].get(k, 0.0))
        summary[kind]["unaccounted (calling thread: waits for the write pipeline or reads, untimed steps)"] = med(
            lambda r, kind=kind: r[kind]["unaccounted_s"]
        )
    summary["save"]["  CPU of the calling thread in Writer.write"] = med(
        lambda r: r["save"]["cpu"].get("native Writer.write (copy+crc32c+submit/wait)")
    )
    summary["load"]["  CPU of the calling thread in Reader.read (data)"] = med(
        lambda r: r["load"]["cpu"].get("native Reader.read (data, crc32c)")
    )
    summary["save"]["  waiting for a CPU (runnable, schedstat) in Writer.write"] = med(
        lambda r: r["save"]["runq"].get("native Writer.write (copy+crc32c+submit/wait)")
    )
    summary["load"]["  waiting for a CPU (runnable, schedstat) in Reader.read (data)"] = med(
        lambda r: r["load"]["runq"].get("native Reader.read (data, crc32c)")
    )
    summary["save"]["writer.seconds (engine's own clock)"] = med(lambda r: r["save"]["writer"]["seconds"])
    summary["save"]["bench post-sync (extra fsync of file+dir)"] = med(lambda r: r["save"]["bench_post_sync_s"])
    summary["save"]["writer"] = runs[-1]["save"]["writer"]
    summary["load"]["reader.seconds (engine's own clock)"] = med(lambda r: r["load"]["reader"]["seconds"])
    summary["load"]["touch pass (bench, not in total)"] = med(lambda r: r["load"]["touch_s"])
    summary["load"]["reader"] = runs[-1]["load"]["reader"]
    summary["runs"] = runs
    return summary


def align_experiment(size_gb: float, directory: str | None, repeat: int) -> dict[str, Any]:
    """Native read of a saved checkpoint's data into torch storages vs 4096-aligned buffers.

    ``torch.UntypedStorage`` memory sits at 64 mod 4096, so the reader's O_DIRECT "straight into
    the destination" path cannot be used and every byte goes through the arena (read, then copy
    out with crc32c). This reads the same extents into (a) fresh torch storages, (b) 4096-aligned
    numpy buffers, (c) 4096-aligned slices of torch storages over-allocated by 4096 bytes, each
    both freshly allocated and pre-faulted (faulting done untimed), and reports wall and
    calling-thread CPU seconds.
    """
    import numpy as np

    import native_io
    from lightning_recover.checkpoint.file import single_file as cio

    checkpoint, _ = build_checkpoint(size_gb)
    root = tempfile.mkdtemp(prefix="lr-align-", dir=directory or "/tmp")
    path = os.path.join(root, "a.ckpt")
    cache = "drop_caches" if drop_caches_supported() else "fadvise"
    cio.save(checkpoint, path)
    del checkpoint
    gc.collect()
    extents = [(r.data_offset, r.nbytes) for r in cio.read_info(path).index.storage_records() if r.nbytes]
    eng = native_io.IOEngine()

    def torch_bufs():
        return [(o, torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage(n)).numpy()) for o, n in extents]

    def aligned_bufs():
        out = []
        for o, n in extents:
            raw = np.empty(n + 4096, np.uint8)
            a = (-raw.ctypes.data) % 4096
            out.append((o, raw[a : a + n]))
        return out

    def aligned_torch_bufs():
        out = []
        for o, n in extents:
            raw = torch.empty(n + 4096, dtype=torch.uint8)
            a = (-raw.data_ptr()) % 4096
            out.append((o, raw[a : a + n].numpy()))
        return out

    results: dict[str, list] = defaultdict(list)
    try:
        for _ in range(repeat):
            for name, make in (
                ("torch storage (64 mod 4096)", torch_bufs),
                ("4096-aligned numpy", aligned_bufs),
                ("4096-aligned slice of a torch storage", aligned_torch_bufs),
            ):
                for prefault in (False, True):
                    bufs = make() if prefault else None
                    if prefault:
                        for _, b in bufs:
                            b.fill(1)
                    make_cold(root, cache)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    if not prefault:
                        bufs = make()
                    with eng.open_reader(path) as r:
                        r.read(bufs)
                    results[f"{name}, {'pre-faulted' if prefault else 'fresh'}"].append(
                        (time.perf_counter() - t0, time.thread_time() - c0)
                    )
                    del bufs
                    gc.collect()
    finally:
        os.remove(path)
        os.rmdir(root)
        eng.close()
    return {
        k: {"wall_s": statistics.median(a for a, _ in v), "cpu_s": statistics.median(b for _, b in v), "runs": v}
        for k, v in results.items()
    }


def _print(summary: dict[str, Any]) -> None:
    nb = summary["bytes"]
    print(f"{nb / 1e9:.3f} GB, {summary['tensors']} tensors, cache {summary['cache']}, medians of {summary['repeat']}")
    for kind in ("save", "load"):
        s = summary[kind]
        print(f"{kind}: total {s['total_s']:.3f}s = {s['total_gbps']:.3f} GB/s")
        for k, v in s.items():
            if k in ("total_s", "total_gbps") or isinstance(v, dict) or v is None:
                continue
            gbps = f"  ({nb / v / 1e9:6.2f} GB/s over the payload)" if v > 0.05 else ""
            print(f"   {k:<58} {v:8.3f}s{gbps}")
        print(f"   {json.dumps(s.get('writer') or s.get('reader'))}")
    try:
        print(f"loadavg {os.getloadavg()} (other processes compete for the {os.cpu_count()} CPUs)")
    except OSError:
        pass
    print("reference, same bytes, measured alone:")
    for k, v in summary["reference"].items():
        print(f"   {k:<58} {v:8.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--dir", default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--align-experiment",
        action="store_true",
        help="only compare native reads into torch storages vs 4096-aligned buffers",
    )
    a = p.parse_args(argv)
    if a.align_experiment:
        res = align_experiment(a.size_gb, a.dir, a.repeat)
        for k, v in res.items():
            print(
                f"{k:<55} wall {v['wall_s']:.3f}s  cpu {v['cpu_s']:.3f}s  "
                f"runs {[(round(w, 2), round(c, 2)) for w, c in v['runs']]}"
            )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
        return 0
    summary = profile(a.size_gb, a.dir, a.repeat)
    _print(summary)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
