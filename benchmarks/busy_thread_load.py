"""A load of many small tensors beside a Python thread that never sleeps, at two switch intervals.

``python -m benchmarks.busy_thread_load [--size-gb 0.1] [--rounds 2] [--json FILE]``

Saves the small10k state (10,000 tensors, ``gpt_state.build_state``) at ``--size-gb``, then times
``single_file.load(path, into=state)`` alone and beside a thread spinning in pure Python, with the interpreter's
switch interval at its default (5 ms) and at 0.1 ms, alternated ``--rounds`` times. Each torch call that releases
the interpreter lock lets the spinning thread keep it for a switch interval: docs/checkpointing.md, "A known limit".
The page cache is not dropped: the reads are not what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

INTERVALS = (0.005, 0.0001)


def run(size_gb: float, rounds: int, directory: str) -> dict:
    from lightning_recover.bench.gpt_state import build_state
    from lightning_recover.checkpoint.file import single_file

    state, _ = build_state("small10k", size_gb=size_gb)
    fd, path = tempfile.mkstemp(suffix=".ckpt", dir=directory)
    os.close(fd)
    os.unlink(path)
    single_file.save(state, path)
    into = single_file.load(path)
    spinning = threading.Event()
    stop = threading.Event()

    def spin() -> None:
        spinning.set()
        while not stop.is_set():
            pass

    def timed() -> float:
        t0 = time.perf_counter()
        single_file.load(path, into=into)
        return time.perf_counter() - t0

    old = sys.getswitchinterval()
    result: dict = {"size_gb": size_gb, "alone_s": timed(), "beside_a_busy_thread": []}
    spinner = threading.Thread(target=spin, name="busy-python-thread", daemon=True)
    spinner.start()
    spinning.wait()
    try:
        for _ in range(rounds):
            for interval in INTERVALS:
                sys.setswitchinterval(interval)
                result["beside_a_busy_thread"].append({"switch_interval_s": interval, "load_s": timed()})
    finally:
        sys.setswitchinterval(old)
        stop.set()
        spinner.join()
        os.unlink(path)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    result = run(args.size_gb, args.rounds, args.dir)
    print(f"alone: {result['alone_s']:.3f} s")
    for r in result["beside_a_busy_thread"]:
        print(f"beside a busy thread, switch interval {r['switch_interval_s'] * 1e3:g} ms: {r['load_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
