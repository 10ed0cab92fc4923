"""Exact mode's cost and accuracy, on the demo's TinyGPT.

    python -m benchmarks.exact_steps paired --rounds 3 --json benchmarks/results/exact33_paired.json
    python -m benchmarks.exact_steps accuracy --json benchmarks/results/exact33_accuracy.json

``paired``: 4 replicas of TinyGPT (lightning_recover.bench.fabric_gpt). Two pairings: (1) inside one
job (``--exact-every-other``), odd steps run exact mode and even steps the default mode, and each
exact step is compared with the default step before it (the same machine load, a few hundred ms
apart: the pairing that survives a shared, loaded machine); (2) ``exact=False`` and ``exact=True``
jobs alternated (the order flips every round), per job the median step time over the steps after
warm-up. It also records the replicas' peak resident memory, and checks that every exact-mode job
ended with bitwise the same parameters (plus, with ``--replica-counts``, exact jobs on other replica
counts).

``accuracy``: the reduced gradient of one step (M microbatches of TinyGPT, float32) against the
float64 sum of the same float32 microbatch gradients: the default path (each of 4 replicas sums its
quota in float32, then the replicas' sums are added) and exact mode (fixed point, then one rounding
to float32). Errors per tensor: normwise ``|g - ref| / |ref|`` and largest elementwise error
relative to the tensor's largest element; the worst tensor is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WARMUP_STEPS = 3  # step 0 of an exact job has no grid yet (one redo); all jobs warm up their allocator


def _job(out: str, replicas: int, steps: int, microbatches: int, exact, dtype: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LIGHTNING_RECOVER_INJECT", None)
    cmd = [sys.executable, "-m", "lightning_recover.bench.fabric_gpt", "--out", out, "--strategy", "recover"]
    cmd += ["--replicas", str(replicas), "--steps", str(steps), "--microbatches", str(microbatches)]
    cmd += ["--dtype", dtype] + ({True: ["--exact"], False: [], "alternate": ["--exact-every-other"]}[exact])
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job failed ({proc.returncode}):\n{proc.stdout[-3000:]}")


def _summary(out: str) -> dict:
    import torch

    ranks = sorted(n for n in os.listdir(out) if n.startswith("rank") and n.endswith(".json"))
    records = [json.load(open(os.path.join(out, n))) for n in ranks]
    per_rank = [statistics.median(r["seconds"] for r in recs if r["step"] >= WARMUP_STEPS) for recs in records]
    return {
        "step_seconds": statistics.median(per_rank),
        "max_rss_mb": max(recs[-1]["max_rss_kb"] for recs in records) / 1024,
        "redone": [r["redone"] for r in records[0]],
        "state": torch.load(os.path.join(out, "rank0.pt"), weights_only=True),
    }


def paired(args: argparse.Namespace) -> dict:
    import torch

    rounds = []
    exact_states = []
    step_pairs, cpu_pairs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-exact-") as work:
        for i in range(args.alternating_jobs):
            out = os.path.join(work, f"alt{i}")
            _job(out, args.replicas, args.alternating_steps, args.microbatches, "alternate", args.dtype)
            for name in sorted(n for n in os.listdir(out) if n.startswith("rank") and n.endswith(".json")):
                recs = {r["step"]: r for r in json.load(open(os.path.join(out, name)))}
                for s, r in recs.items():
                    # an exact step against the mean of the default steps either side (cancels a drift)
                    if r["exact"] and s >= WARMUP_STEPS and s + 1 in recs and not r["redone"]:
                        for key, pairs in (("seconds", step_pairs), ("cpu_seconds", cpu_pairs)):
                            pairs.append(2 * r[key] / (recs[s - 1][key] + recs[s + 1][key]))
            print(
                f"alternating job {i}: {len(step_pairs)} step pairs so far, median ratio "
                f"{statistics.median(step_pairs):.3f}",
                flush=True,
            )
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            row: dict = {}
            for exact in order:
                out = os.path.join(work, f"r{i}-{'exact' if exact else 'default'}")
                _job(out, args.replicas, args.steps, args.microbatches, exact, args.dtype)
                s = _summary(out)
                if exact:
                    exact_states.append(s.pop("state"))
                else:
                    s.pop("state")
                row["exact" if exact else "default"] = s
            row["ratio"] = row["exact"]["step_seconds"] / row["default"]["step_seconds"]
            rounds.append(row)
            print(
                f"round {i}: default {row['default']['step_seconds']:.4f}s, exact {row['exact']['step_seconds']:.4f}s, "
                f"ratio {row['ratio']:.3f}",
                flush=True,
            )
        others = {}
        for count in args.replica_counts:
            out = os.path.join(work, f"exact-{count}")
            _job(out, count, args.steps, args.microbatches, True, args.dtype)
            others[count] = _summary(out)["state"]
    first = exact_states[0]

    def equal(state: dict) -> bool:
        return all(torch.equal(state[k], v) for k, v in first.items())

    ratios = [r["ratio"] for r in rounds]

    params = sum(v.numel() for v in first.values())
    return {
        "replicas": args.replicas,
        "microbatches": args.microbatches,
        "steps": args.steps,
        "dtype": args.dtype,
        "warmup_steps": WARMUP_STEPS,
        "parameters": params,
        "rounds": rounds,
        "step_pairs_in_one_job": len(step_pairs),
        "step_pair_ratio_median": statistics.median(step_pairs) if step_pairs else None,
        "step_pair_ratio_quartiles": statistics.quantiles(step_pairs, n=4) if len(step_pairs) > 1 else None,
        "step_pair_cpu_ratio_median": statistics.median(cpu_pairs) if cpu_pairs else None,
        "step_pair_cpu_ratio_quartiles": statistics.quantiles(cpu_pairs, n=4) if len(cpu_pairs) > 1 else None,
        "job_ratio_median": statistics.median(ratios),
        "job_ratio_min": min(ratios),
        "job_ratio_max": max(ratios),
        "exact_jobs_bitwise_equal": all(equal(s) for s in exact_states),
        "other_replica_counts_bitwise_equal": {str(k): equal(s) for k, s in others.items()},
        "allreduce_bytes_per_step": {
            "default": params * torch.finfo(getattr(torch, args.dtype)).bits // 8 + 8,
            # fixed-point sums (float64) + loss slots (2M float64) + MAX of (A, k, -k) per tensor and threads
            "exact": params * 8 + 2 * args.microbatches * 8 + (3 * len(first) + 2) * 4,
        },
    }


def accuracy(args: argparse.Namespace) -> dict:
    from lightning_recover.data import MicrobatchSource
    from lightning_recover.protocol.exact import ExactAccumulator, exact_step_alone
    from lightning_recover.tiny_gpt import build

    ns = argparse.Namespace(seed=0, corpus_bytes=2_000_000, block_size=64, layers=2, width=128, lr=3e-3)
    data, model, _ = build(ns)
    params = list(model.parameters())
    source = MicrobatchSource(data, 8, args.microbatches, shuffle=True, seed=0)
    worst: dict = {"default": [0.0, 0.0], "exact": [0.0, 0.0]}
    backward_s, absorb_s = [], []
    timing = ExactAccumulator(args.microbatches)
    timing.begin(params)
    timing.exponents = [0] * len(params)  # any grid: this only times the conversion
    for step in range(args.steps):
        grads = []
        for j in range(args.microbatches):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model.loss(*source.batch(step, j)).backward()
            backward_s.append(time.perf_counter() - start)
            grads.append([p.grad.detach().clone() for p in params])
            start = time.perf_counter()
            timing.absorb(params)  # what exact mode adds per microbatch (moves the gradient out of param.grad)
            absorb_s.append(time.perf_counter() - start)
        ref = [sum(g[i].double() for g in grads) / args.microbatches for i in range(len(params))]
        # the default path: 4 replicas each sum a quota in float32, then the replicas' sums are added
        quotas = [list(range(args.microbatches))[r :: args.replicas] for r in range(args.replicas)]
        default = []
        for i in range(len(params)):
            local = [sum(grads[j][i] for j in q) for q in quotas]
            total = local[0]
            for other in local[1:]:
                total = total + other
            default.append(total * (1.0 / args.microbatches))
        accumulator = ExactAccumulator(args.microbatches)
        exact_step_alone(accumulator, params, lambda j, grads=grads: _replay(params, grads[j]))
        exact = [p.grad for p in params]
        for name, result in (("default", default), ("exact", exact)):
            for g, r in zip(result, ref):
                if float(r.abs().max()) == 0.0:
                    continue
                d = (g.double() - r).abs()
                worst[name][0] = max(worst[name][0], float(d.norm() / r.norm()))
                worst[name][1] = max(worst[name][1], float(d.max() / r.abs().max()))
    return {
        "microbatches": args.microbatches,
        "replicas_of_the_default_path": args.replicas,
        "steps": args.steps,
        "normwise_relative_error_worst_tensor": {k: v[0] for k, v in worst.items()},
        "max_elementwise_error_relative_to_tensor_max": {k: v[1] for k, v in worst.items()},
        "forward_backward_seconds_per_microbatch_median": statistics.median(backward_s),
        "fixed_point_conversion_seconds_per_microbatch_median": statistics.median(absorb_s),
        "conversion_over_forward_backward": statistics.median(absorb_s) / statistics.median(backward_s),
    }


def _replay(params, grads):
    """Stand-in for a backward: put a recorded microbatch gradient into ``param.grad``."""
    import torch

    for p, g in zip(params, grads):
        p.grad = g.clone()
    return torch.zeros(())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("paired")
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--replicas", type=int, default=4)
    a.add_argument("--steps", type=int, default=15)
    a.add_argument("--microbatches", type=int, default=8)
    a.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a.add_argument("--replica-counts", type=lambda s: [int(x) for x in s.split(",") if x], default=[])
    a.add_argument("--alternating-jobs", type=int, default=1, help="jobs that alternate the modes step by step")
    a.add_argument("--alternating-steps", type=int, default=41)
    b = sub.add_parser("accuracy")
    b.add_argument("--steps", type=int, default=3)
    b.add_argument("--microbatches", type=int, default=8)
    b.add_argument("--replicas", type=int, default=4)
    for q in (a, b):
        q.add_argument("--json", default=None)
    args = p.parse_args()
    start = time.time()
    result = paired(args) if args.what == "paired" else accuracy(args)
    result["wall_seconds"] = time.time() - start
    result["command"] = " ".join(sys.argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result["commit"] = commit
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
