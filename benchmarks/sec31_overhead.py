"""Paired overhead of the control plane's freshness and deadlines (issue 31) on a failure-free run.

Runs the in-process protocol harness (tests/inprocess.py: a real coordinator, 3 replicas as threads,
a tiny float64 MLP, so the control plane dominates each step) for ``--steps`` steps (after a first one,
not timed) with a store barrier per step, alternately on the code at ``--base`` (a checkout of the commit before) and on this
tree, ``--pairs`` times (order swapped every pair), and reports seconds per step and the ratio.

    git archive 4ab3fe5 | tar -x -C /tmp/sec31_base   # the baseline tree (native_io not needed)
    python benchmarks/sec31_overhead.py --base /tmp/sec31_base --out benchmarks/results/sec31_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

RUN = """
import sys, time
from tests.inprocess import Cluster
steps = int(sys.argv[1])
def before_step(replica, step):
    cluster.slot(replica).protocol_replica.barrier()
with Cluster(3, steps=steps + 1, microbatches=6, before_step=before_step) as cluster:
    cluster.start().join()
assert cluster.survivors() == [0, 1, 2], cluster.report()
# Steady state: from the first applied step to the last (start-up and group formation excluded).
at = cluster.slot(0).applied_at
print("SECONDS", at[-1] - at[0])
"""


def run(tree: str, steps: int) -> float:
    environ = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(steps)], cwd=tree, env=environ, capture_output=True, text=True, timeout=600
    )
    for line in out.stdout.splitlines():
        if line.startswith("SECONDS "):
            return float(line.split()[1])
    raise RuntimeError(f"run in {tree} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="a checkout of the baseline commit")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old, new = [], []
    for i in range(args.pairs):
        order = [("old", args.base), ("new", here)]
        if i % 2:
            order.reverse()
        for name, tree in order:
            (old if name == "old" else new).append(run(tree, args.steps) / args.steps)
        print(f"pair {i}: old {old[-1] * 1e3:.2f} ms/step, new {new[-1] * 1e3:.2f} ms/step", flush=True)
    ratios = [n / o for n, o in zip(new, old)]
    result = {
        "steps": args.steps,
        "pairs": args.pairs,
        "old_ms_per_step": [x * 1e3 for x in old],
        "new_ms_per_step": [x * 1e3 for x in new],
        "pair_ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "ratio_of_medians": statistics.median(new) / statistics.median(old),
        "ratio_spread": [min(ratios), max(ratios)],
    }
    print(json.dumps({k: v for k, v in result.items() if "ratio" in k}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
