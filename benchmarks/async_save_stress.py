"""Stress of asynchronous saves: several savers in one process, varied sizes, a CPU hog and concurrent I/O.

``python -m benchmarks.async_save_stress [--processes 4] [--seconds 300] [--switch-intervals 1e-5,0.005] [--json PATH]``

Runs ``--processes`` worker processes one after another (each a fresh interpreter, so every lazily built
module-level state is built again, by savers that start together; ``sys.setswitchinterval`` cycles through
``--switch-intervals``: ten microseconds make the interpreter interleave threads very often, 0.005 is its
default), while a busy-looping process takes a core and
another process writes and ``fsync``s a file next to the checkpoints. Each worker runs three
:class:`AsyncSaver` s of different shapes (eager only, many small lazy chunks through a small ring, the defaults)
and one thread of synchronous saves on the shared default engine, all released at once; each saver's thread saves
its state, waits for the snapshot, changes every tensor in place (as an optimizer step would) and every few saves
waits until they are durable and verifies each file: its integrity record against the CRC-32C of its bytes
(``verify_file``), and ``torch.load(weights_only=True)`` (one in eight with ``mmap=True``) equal, tensor by tensor,
to the state at the save. A worker stops saving at the end of its share of ``--seconds`` (counted from the run's
start, so the interpreters' start-up is in it too; the last verifications and the exit come after). Prints and writes the counts, the
failures (none expected) and ``/proc/loadavg`` before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from lightning_recover.checkpoint import save, verify_file
from lightning_recover.checkpoint.engine import EngineHandle
from lightning_recover.checkpoint.file.async_io import AsyncSaver

_KiB, _MiB = 1 << 10, 1 << 20
# (name, AsyncSaver keyword arguments): eager copies only; many lazy chunks (and CRC combines) through a ring
# smaller than one save; the defaults
_SAVERS = [
    ("eager", {"eager_bytes": 64 * _MiB}),
    ("small-ring", {"eager_bytes": 4 * _KiB, "chunk_bytes": 256 * _KiB, "staging_bytes": _MiB}),
    ("default", {}),
]
_DTYPES = [torch.int32, torch.int64, torch.float32, torch.int16]
_VERIFY_EVERY = 6


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def _state(rng: random.Random, max_bytes: int) -> dict[str, torch.Tensor]:
    """Ten tensors of sizes log-uniform between 8 bytes and ``max_bytes``, integer-valued (exact in every dtype)."""
    out = {}
    for j in range(10):
        dtype = rng.choice(_DTYPES)
        n = max(1, int(2 ** rng.uniform(3, max_bytes.bit_length() - 1)) // torch.tensor([], dtype=dtype).element_size())
        out[f"t{j}"] = torch.randint(
            -1000, 1000, (n,), generator=torch.Generator().manual_seed(rng.getrandbits(31))
        ).to(dtype)
    return out


def _check(path: str, base: dict, names: list, k: int, rng: random.Random) -> list:
    """What is wrong with the file of save ``k`` (empty: nothing)."""
    problems: list = []
    _, damage = verify_file(path)
    if damage:
        problems.append(f"{path}: integrity: {damage}")
    mmap = rng.random() < 1 / 8
    loaded = torch.load(path, weights_only=True, mmap=mmap)
    if loaded["step"] != k or sorted(loaded["tensors"]) != sorted(names):
        problems.append(f"{path}: step {loaded['step']} != {k} or names {sorted(loaded['tensors'])} != {sorted(names)}")
    for name in names:
        want = base[name] + k
        got = loaded["tensors"].get(name)
        if got is None or got.dtype != want.dtype or not torch.equal(got, want):
            problems.append(f"{path}: tensor {name} differs (mmap={mmap})")
    extra = loaded["extra"]
    if not torch.equal(extra, torch.arange(extra.numel(), dtype=torch.int32) + k):
        problems.append(f"{path}: extra differs")
    return problems


def _run_saver(name: str, kwargs: Any, directory: str, seed: int, deadline: float, max_bytes: int, go: Any) -> dict:
    rng = random.Random(seed)
    base = _state(rng, max_bytes)
    live = {n: t.clone() for n, t in base.items()}  # base + (saves so far): what training changes in place
    saver = AsyncSaver(EngineHandle(), **kwargs) if kwargs is not None else None
    counts = {"saver": name, "saves": 0, "verified": 0, "bytes": 0, "problems": []}
    pending: list = []

    def verify_pending() -> None:
        if saver is not None:
            saver.wait_until_durable()
        for path, names, k in pending:
            counts["problems"] += _check(path, base, names, k, rng)
            counts["verified"] += 1
            counts["bytes"] += os.path.getsize(path)
            os.unlink(path)
        pending.clear()

    go.wait()
    k = 0
    try:
        while time.monotonic() < deadline:
            names = sorted(rng.sample(sorted(live), rng.randint(1, len(live))))
            ckpt = {
                "step": k,
                "tensors": {n: live[n] for n in names},
                "extra": torch.arange(rng.randint(1, max_bytes // 4), dtype=torch.int32) + k,
            }
            path = os.path.join(directory, f"{name}-{k}.ckpt")
            if saver is None:
                save(ckpt, path)
            else:
                saver.submit(ckpt, path)
                saver.wait_for_snapshot()
            for t in live.values():  # the "optimizer step": every tensor changes once its snapshot is taken
                t.add_(1)
            pending.append((path, names, k))
            k += 1
            counts["saves"] = k
            if len(pending) >= _VERIFY_EVERY:
                verify_pending()
        verify_pending()
    except Exception as e:  # counted and reported: the run goes on with the other savers
        counts["problems"].append(f"{name}: {type(e).__name__}: {e}")
    finally:
        if saver is not None:
            saver.close(raise_errors=False)
    counts["problems"] = counts["problems"][:20]
    return counts


def _worker(args: argparse.Namespace) -> None:
    sys.setswitchinterval(args.switch_interval)
    deadline = time.monotonic() + (args.until - time.time())  # the parent's wall-clock end of this worker's share
    go = threading.Event()
    results: list = []
    specs = [(n, kw) for n, kw in _SAVERS] + [("sync", None)]
    threads = [
        threading.Thread(
            target=lambda spec=spec, i=i: results.append(
                _run_saver(spec[0], spec[1], args.dir, args.seed * 100 + i, deadline, args.max_bytes, go)
            ),
            daemon=True,
        )
        for i, spec in enumerate(specs)
    ]
    for t in threads:
        t.start()
    go.set()  # every saver's first save (and first CRC combine) at the same moment
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 300)
    alive = sum(t.is_alive() for t in threads)
    print(json.dumps({"savers": results, "threads_stuck": alive}), flush=True)


def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _io_load(directory: str) -> subprocess.Popen:
    code = (
        "import os\n"
        f"p = os.path.join({directory!r}, 'io-load.bin')\n"
        "buf = os.urandom(4 << 20)\n"
        "fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)\n"
        "i = 0\n"
        "while True:\n"
        "    os.pwrite(fd, buf, (i % 32) * len(buf)); os.fsync(fd); i += 1\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--processes", type=int, default=4, help="worker processes, one after another")
    ap.add_argument("--seconds", type=float, default=300.0, help="total time of the run (saves stop then)")
    ap.add_argument("--switch-intervals", default="1e-5,0.005", help="sys.setswitchinterval of the workers, cycled")
    ap.add_argument("--switch-interval", type=float, default=0.005, help=argparse.SUPPRESS)  # a worker's own
    ap.add_argument("--max-bytes", type=int, default=_MiB, help="largest tensor of a state")
    ap.add_argument("--dir", default=None, help="where to write (default: a new temporary directory)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--no-load", action="store_true", help="without the CPU hog and the concurrent writer")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)  # a worker's end (time.time())
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    intervals = [float(x) for x in args.switch_intervals.split(",")]
    top = args.dir or tempfile.mkdtemp(prefix="async-save-stress-")
    os.makedirs(top, exist_ok=True)
    load_before = _loadavg()
    helpers = [] if args.no_load else [_hog(), _io_load(top)]
    workers: list = []
    t0 = time.monotonic()
    try:
        for p in range(args.processes):
            share = max(5.0, (args.seconds - (time.monotonic() - t0)) / (args.processes - p))
            wdir = os.path.join(top, f"w{p}")
            os.makedirs(wdir, exist_ok=True)
            cmd = [sys.executable, "-m", "benchmarks.async_save_stress", "--worker", "--dir", wdir, "--seed", str(p)]
            interval = intervals[p % len(intervals)]
            cmd += ["--until", str(time.time() + share), "--switch-interval", str(interval)]
            cmd += ["--max-bytes", str(args.max_bytes)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=share + 600)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode != 0 or not lines:
                workers.append({"process": p, "error": f"rc {out.returncode}: {out.stderr[-2000:]}"})
            else:
                workers.append({"process": p, "switch_interval": interval, **json.loads(lines[-1])})
            shutil.rmtree(wdir, ignore_errors=True)
    finally:
        for h in helpers:
            h.kill()
            h.wait()
        if args.dir is None:
            shutil.rmtree(top, ignore_errors=True)
    savers = [s for w in workers for s in w.get("savers", ())]
    problems = [p for s in savers for p in s["problems"]] + [w["error"] for w in workers if "error" in w]
    problems += [
        f"process {w['process']}: {w['threads_stuck']} threads stuck" for w in workers if w.get("threads_stuck")
    ]
    result = {
        "commit": _commit(),
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "seed", "switch_interval", "until")},
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "seconds": round(time.monotonic() - t0, 1),
        "saves": sum(s["saves"] for s in savers),
        "async_saves": sum(s["saves"] for s in savers if s["saver"] != "sync"),
        "verified": sum(s["verified"] for s in savers),
        "gb_verified": round(sum(s["bytes"] for s in savers) / 1e9, 2),
        "by_saver": {n: sum(s["saves"] for s in savers if s["saver"] == n) for n in [n for n, _ in _SAVERS] + ["sync"]},
        "problems": problems[:50],
        "workers": workers,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "workers"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(1 if problems or result["verified"] != result["saves"] else 0)


if __name__ == "__main__":
    main()
