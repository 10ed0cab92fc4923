"""Consecutive asynchronous saves in one process: what the first one pays that the later ones do not.

``python -m benchmarks.async_saves_in_a_row [--size-gb 2] [--saves 3] [--json FILE]``

One ``AsyncUringCheckpointIO`` saves the same GPT-like state (``gpt_state.build_checkpoint``) ``--saves`` times,
nothing else running: per save, the call, the snapshot (``wait_for_snapshot``, what the next ``optimizer.step()``
would wait for) and durability (``wait_until_durable``), each from the call's start. The first save allocates the
staging ring and touches it for the first time (on this VM a first touch of huge pages is slower than of plain
pages); the later ones reuse it. Run it in two trees to compare their first saves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def run(size_gb: float, saves: int, root: str) -> list[dict]:
    from lightning_recover.bench.gpt_state import build_checkpoint
    from lightning_recover.lightning.checkpoint_io import AsyncUringCheckpointIO

    checkpoint, _ = build_checkpoint(size_gb)
    io = AsyncUringCheckpointIO()
    out = []
    try:
        for i in range(saves):
            t0 = time.perf_counter()
            io.save_checkpoint(checkpoint, os.path.join(root, f"{i}.ckpt"))
            call = time.perf_counter() - t0
            io.wait_for_snapshot()
            snapshot = time.perf_counter() - t0
            io.wait_until_durable()
            out.append({"save": i, "call_s": call, "snapshot_s": snapshot, "durable_s": time.perf_counter() - t0})
    finally:
        io.teardown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp", help="where the checkpoints are written (removed after)")
    ap.add_argument("--json", help="write the per-save timings here")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="lr-async-row-", dir=args.dir)
    try:
        rows = run(args.size_gb, args.saves, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        print(
            f"save {r['save']}: call {r['call_s']:.3f} s, snapshot {r['snapshot_s']:.3f} s, durable {r['durable_s']:.3f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_gb": args.size_gb, "saves": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
