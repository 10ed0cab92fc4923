"""The restricted fast unpickler against torch's ``weights_only`` loader, paired, in one process.

``python -m benchmarks.fast_unpickle_ab [--state small10k] [--size-gb 0.25] [--repeat 5] [--json PATH]``

Saves the state once (``lightning_recover.checkpoint.save``), then loads it ``--repeat`` times each way with
``lightning_recover.checkpoint.load`` (verified, ``weights_only=True``): with the fast path, and with it turned
off (torch's ``weights_only`` loader, what every load did before), in alternating order. The file stays in the
page cache, so the figures are the loader's own cost (reads from memory, CRC-32C, unpickling), not the disk's.
Prints and writes wall and process CPU seconds per load, their medians and ratios, and ``/proc/loadavg`` at
each load (the CPU time is the steadier figure on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

from lightning_recover.bench.gpt_state import STATES, build_state
from lightning_recover.checkpoint import load, save
from lightning_recover.checkpoint.file import fast_unpickle


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state", default="small10k", choices=STATES)
    ap.add_argument("--size-gb", type=float, default=0.25)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ckpt, desc = build_state(args.state, args.size_gb, seed=0)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "state.ckpt")
        save(ckpt, path)
        del ckpt
        usable = fast_unpickle.fast_path_usable
        runs: dict[str, list] = {"fast": [], "torch": []}
        try:
            for r in range(args.repeat):
                for way in ("fast", "torch") if r % 2 == 0 else ("torch", "fast"):
                    fast_unpickle.fast_path_usable = usable if way == "fast" else (lambda *a: False)
                    la = _loadavg()
                    t, c = time.perf_counter(), time.process_time()
                    out = load(path)
                    runs[way].append(
                        {"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c, "loadavg": la}
                    )
                    del out
        finally:
            fast_unpickle.fast_path_usable = usable
    med = {w: {k: statistics.median(x[k] for x in v) for k in ("wall_s", "cpu_s")} for w, v in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "commit": commit,
        "state": desc,
        "args": vars(args),
        "median": med,
        "torch_over_fast": {k: med["torch"][k] / med["fast"][k] for k in ("wall_s", "cpu_s")},
        "cpu_ratio_per_pair": [t["cpu_s"] / f["cpu_s"] for f, t in zip(runs["fast"], runs["torch"])],
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
