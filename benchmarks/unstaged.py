"""Copy or send from the tensor's own memory? ``native_io.Writer.unstaged_min`` measured by item size.

``python -m benchmarks.unstaged [--size-gb 2] [--items 256K,1M,2M,4M,16M,64M] [--repeat 3]``

Writes ``--size-gb`` of torch tensors of one item size in the DCP writer's layout (a 1.6 KB staged head,
the storage bytes at a file offset congruent to the tensor's address modulo 4 KiB, a 300-byte tail), in
64 MiB ``write(..., wait=False)`` calls (``--wait``: each call waits for its uncopied transfers), durable
(``close`` fdatasyncs), three ways, interleaved: every byte copied through the staging arena (``unstaged_min
= 0``; the arena is on transparent huge pages), each body sent from the tensor's own memory (``unstaged_min =
1``) as torch allocates it (plain 4 KiB pages), and the same from tensors in a mapping on huge pages. Prints
the medians of wall time and process CPU and each uncopied way's speed relative to copying. On a device that
takes few segments per request (virtio-blk: 254) a transfer from plain pages is split into ~1 MiB requests,
which is why the writers copy by default there (docs/native_io.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from lightning_recover.checkpoint.engine import huge_page_bytes
from lightning_recover.checkpoint.integrity import congruent_offset

_HEAD, _TAIL = b"h" * 1600, b"t" * 300
_BATCH = 64 << 20


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def _segments(tensors: list[torch.Tensor]) -> tuple[list[list[tuple[int, object]]], int]:
    """64 MiB batches of (offset, buffer) in the DCP writer's layout, and the file size."""
    batches, batch, acc, cursor = [], [], 0, 0
    for t in tensors:
        data_at = congruent_offset(cursor + len(_HEAD), t.data_ptr())  # where the DCP writer puts it
        body = memoryview(t.numpy()).cast("B")
        batch += [(data_at - len(_HEAD), _HEAD), (data_at, body), (data_at + len(body), _TAIL)]
        cursor = data_at + len(body) + len(_TAIL)
        acc += len(body)
        if acc >= _BATCH:
            batches.append(batch)
            batch, acc = [], 0
    if batch:
        batches.append(batch)
    return batches, cursor


def _huge_page_tensors(item: int, count: int) -> list[torch.Tensor]:
    """``count`` fp32 tensors of ``item`` bytes in one anonymous mapping asked for transparent huge pages, each
    64 bytes past a page boundary like torch's own large allocations."""
    stride = -(-(item + 64) // 4096) * 4096
    flat = huge_page_bytes(stride * count)
    out = [flat[i * stride + 64 : i * stride + 64 + item].view(torch.float32) for i in range(count)]
    for t in out:
        t.uniform_()
    return out


def _one(engine: object, path: str, batches: list, size: int, unstaged_min: int, wait: bool) -> tuple[float, float]:
    if os.path.exists(path):
        os.unlink(path)
    os.sync()
    c0, t0 = time.process_time(), time.perf_counter()
    w = engine.open_writer(path)  # type: ignore[attr-defined]
    w.unstaged_min = unstaged_min
    for batch in batches:
        w.write(batch, wait=wait)
    w.close(size=size)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    import native_io

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--items", default="256K,1M,2M,4M,16M,64M", help="item sizes, comma-separated")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument(
        "--wait", action="store_true", help="each write() waits for its uncopied transfers (before 2026-11-26 pm)"
    )
    args = p.parse_args(argv)
    engine = native_io.IOEngine()
    work = tempfile.mkdtemp(prefix="lr-unstaged-", dir=args.dir)
    path = os.path.join(work, "f.bin")
    total = int(args.size_gb * 1e9)
    print(
        f"engine {native_io.info()['default_engine']}, {args.size_gb} GB per run, medians of {args.repeat}, "
        f"wait={args.wait}"
    )
    print(
        "| item | copied s | copied CPU s | uncopied s (torch memory) | its CPU s | vs copied "
        "| uncopied s (huge pages) | its CPU s | vs copied |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for item in (_parse_size(x) for x in args.items.split(",")):
            count = max(1, total // item)
            plain = [torch.rand(item // 4) for _ in range(count)]
            huge = _huge_page_tensors(item, count)
            variants = {"copied": (_segments(plain), 0), "plain": (_segments(plain), 1), "huge": (_segments(huge), 1)}
            runs: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
            for _ in range(args.repeat):
                for name, ((batches, size), unstaged_min) in variants.items():
                    runs[name].append(_one(engine, path, batches, size, unstaged_min, args.wait))
            med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
            ratio = {
                k: statistics.median(c[0] / u[0] for c, u in zip(runs["copied"], runs[k])) for k in ("plain", "huge")
            }
            print(
                f"| {item >> 10} KiB | {med['copied'][0]:.2f} | {med['copied'][1]:.2f} "
                f"| {med['plain'][0]:.2f} | {med['plain'][1]:.2f} | {ratio['plain']:.2f}x "
                f"| {med['huge'][0]:.2f} | {med['huge'][1]:.2f} | {ratio['huge']:.2f}x |"
            )
            del plain, huge, variants
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(work)
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
