"""Benchmarks of the resilience core (issue: recovery latency and failure-free overhead).

``lightning-recover bench recovery``: 4 replicas of TinyGPT; in each of ``--kills`` runs one
replica is SIGKILLed (or SIGSTOPped with ``--kind hang``) at a given step and phase. Latency is
measured from the moment of the fault (the injector prints its wall-clock time just before the
signal) to the moment the *last* survivor has committed the interrupted step.

``lightning-recover bench overhead``: the same model, replicas and global batch under
Lightning's ``strategy="ddp"`` (gloo) and ``strategy="recover"``, runs interleaved; median
step time of each after warm-up, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

_KILL_TIME = re.compile(r"injecting fault (\S+) at t=([0-9.]+)")


def gpt_job(
    args: list[str], out: str, inject: str | None = None, timeout: float = 600, checkout: str | None = None
) -> str:
    """Runs ``bench.fabric_gpt`` (one thread per process) with ``args``, its records under ``out``, and
    ``inject`` as its fault plan; returns its output. Raises RuntimeError with the output's tail if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if checkout:  # run another checkout of the package (a before/after comparison in one run)
        env["PYTHONPATH"] = os.path.abspath(checkout) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("LIGHTNING_RECOVER_INJECT", None)
    if inject:
        env["LIGHTNING_RECOVER_INJECT"] = inject
    cmd = [sys.executable, "-m", "lightning_recover.bench.fabric_gpt", "--out", out] + args
    proc = subprocess.run(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc.stdout


def _records(out: str) -> dict[str, list[dict]]:
    return {name[:-5]: json.load(open(os.path.join(out, name))) for name in os.listdir(out) if name.endswith(".json")}


def next_commit_after(records: list[dict], step: int, fault_at: float) -> float:
    """When a survivor next committed after a fault injected in ``step``: its first commit of that step or a
    later one, after the fault. A survivor one step behind the victim may commit the step before after the
    fault (measured: 20 ms after it, under speculative commits); that is no recovery, and not counted."""
    return min(r["committed_at"] for r in records if r["step"] >= step and r["committed_at"] > fault_at)


def measure_recovery(kills: int, kind: str, replicas: int, heartbeat_timeout: float, workdir: str) -> list[dict]:
    phases = ["reduce", "backward", "forward", "commit", "optimizer"] if kind == "kill" else ["reduce"]
    results = []
    for i in range(kills):
        victim, step, phase = 1 + i % (replicas - 1), 2 + i % 3, phases[i % len(phases)]
        out = os.path.join(workdir, f"{kind}{i}")
        log = gpt_job(
            [
                "--strategy",
                "recover",
                "--replicas",
                str(replicas),
                "--steps",
                str(step + 3),
                "--microbatches",
                str(2 * replicas),
                "--heartbeat-timeout",
                str(heartbeat_timeout),
            ],
            out,
            inject=f"{kind}:replica={victim}:step={step}:phase={phase}",
        )
        fault_at = float(_KILL_TIME.search(log).group(2))
        next_commit, recovered_commit = [], []
        for name, recs in _records(out).items():
            next_commit.append(next_commit_after(recs, step, fault_at))
            # A fault after this replica reported done (commit/optimizer phases) lets the step commit;
            # the failure is then handled in the next step: also time the first step of the new group.
            recovered_commit.append(min(r["committed_at"] for r in recs if r["generation"] > 0))
        latency = max(next_commit) - fault_at
        recovered = max(recovered_commit) - fault_at
        results.append(
            {
                "kind": kind,
                "phase": phase,
                "victim": victim,
                "step": step,
                "latency_s": latency,
                "first_commit_without_victim_s": recovered,
            }
        )
        print(
            f"  {kind} replica {victim} at step {step} ({phase}): next commit after {latency:.3f}s, "
            f"first commit of the survivors' generation after {recovered:.3f}s",
            flush=True,
        )
    return results


def measure_overhead(
    replicas: int, steps: int, repeat: int, workdir: str, warmup: int = 3, baseline: str | None = None
) -> dict:
    """Failure-free step time of recover vs Lightning DDP (and vs ``baseline``, another checkout of
    this package run as ``recover`` too: the before/after of a change, measured in the same run)."""
    times: dict[str, list[float]] = {"ddp": [], "recover": []}
    if baseline:
        times["baseline"] = []
    modes = list(times)
    for rep in range(repeat):
        order = modes[rep % len(modes) :] + modes[: rep % len(modes)]  # rotate: no mode always runs first
        for mode in order:
            strategy = "ddp" if mode == "ddp" else "recover"
            out = os.path.join(workdir, f"{mode}{rep}")
            gpt_job(
                [
                    "--strategy",
                    strategy,
                    "--replicas",
                    str(replicas),
                    "--steps",
                    str(steps),
                    "--microbatches",
                    str(2 * replicas),
                ],
                out,
                checkout=baseline if mode == "baseline" else None,
            )
            per_step = [
                statistics.median(r["seconds"] for r in recs if r["step"] == s)
                for recs in [list(_records(out).values())[0]]
                for s in range(warmup, steps)
            ]
            run = statistics.median(per_step)
            times[mode].append(run)
            print(f"  {mode:8s} run {rep}: median step {run * 1000:.1f} ms", flush=True)
    ddp, rec = statistics.median(times["ddp"]), statistics.median(times["recover"])
    # Runs of one repetition are adjacent in time, so their ratio sees the same machine load: the
    # median of these paired ratios is the figure least disturbed by a shared, noisy machine.
    paired = [r / d for d, r in zip(times["ddp"], times["recover"])]
    result = {
        "ddp_step_s": ddp,
        "recover_step_s": rec,
        "ratio": rec / ddp,
        "paired_ratio_median": statistics.median(paired),
        "paired_ratios": paired,
        "runs": times,
    }
    if baseline:
        vs = [r / b for b, r in zip(times["baseline"], times["recover"])]
        result.update(
            baseline=os.path.abspath(baseline),
            baseline_step_s=statistics.median(times["baseline"]),
            vs_baseline_paired_ratios=vs,
            vs_baseline_paired_ratio_median=statistics.median(vs),
        )
    return result


def main(args: argparse.Namespace) -> int:
    workdir = args.dir or tempfile.mkdtemp(prefix="lr-bench-")
    os.makedirs(workdir, exist_ok=True)
    report: dict = {"replicas": args.replicas, "machine": f"{os.cpu_count()} cores", "time": time.ctime()}
    if args.what == "recovery":
        print(f"recovery latency: {args.kills} faults, {args.replicas} replicas", flush=True)
        rows = measure_recovery(args.kills, args.kind, args.replicas, args.heartbeat_timeout, workdir)
        lat = [r["latency_s"] for r in rows]
        rec = [r["first_commit_without_victim_s"] for r in rows]
        report.update(
            kind=args.kind,
            faults=rows,
            median_s=statistics.median(lat),
            max_s=max(lat),
            median_without_victim_s=statistics.median(rec),
            max_without_victim_s=max(rec),
            heartbeat_timeout=args.heartbeat_timeout,
        )
        print(
            f"fault -> next committed step: median {report['median_s']:.3f}s, max {report['max_s']:.3f}s "
            f"over {len(lat)} {args.kind}s; fault -> first commit without the victim: median "
            f"{report['median_without_victim_s']:.3f}s, max {report['max_without_victim_s']:.3f}s"
        )
    else:
        print(
            f"failure-free overhead: {args.replicas} replicas, {args.steps} steps x {args.repeat} runs each", flush=True
        )
        report.update(measure_overhead(args.replicas, args.steps, args.repeat, workdir, baseline=args.baseline))
        print(
            f"median step: ddp {report['ddp_step_s'] * 1000:.1f} ms, recover {report['recover_step_s'] * 1000:.1f} ms,"
            f" ratio recover/ddp = {report['ratio']:.3f}; median of paired ratios = "
            f"{report['paired_ratio_median']:.3f}"
        )
        if args.baseline:
            print(
                f"vs baseline {args.baseline}: median step {report['baseline_step_s'] * 1000:.1f} ms; median of "
                f"paired ratios recover/baseline = {report['vs_baseline_paired_ratio_median']:.3f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
