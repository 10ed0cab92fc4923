"""``lightning-recover simulate``: project in-step recovery vs checkpoint-and-restart to large clusters.

A discrete-event model (see docs/simulator.md for every parameter and assumption). ``G`` GPUs form
``N = G / gpus_per_replica`` data-parallel replicas; every GPU fails independently with an
exponential time to failure of mean ``mtbf_gpu_hours``, and a failure takes down its replica. The
same failure times (common random numbers, one seed per trial) are replayed under three approaches:

- ``recover`` (this project): a failure costs ``recovery_s`` (detection + new generation) plus the
  survivors recomputing the dead replica's part of the interrupted step; until the replacement
  rejoins (``rejoin_s`` later) the step's ``M`` microbatches are shared by fewer replicas, so steps
  take ``N / live`` times longer; nothing else is lost and the global batch never changes.
- ``checkpoint`` (checkpoint-and-restart): a blocking checkpoint of ``checkpoint_s`` every ``tau``
  seconds of work, ``tau`` from Young/Daly, ``sqrt(2 * checkpoint_s * system MTBF)``; a failure
  loses the work since the last checkpoint and the whole job restarts (``restart_s``).
- ``standby``: ``recover`` with ``standby`` warm standby replicas: a failed replica's place is taken
  ``takeover_s`` after the failure while a standby is free (a used standby is replaced, ready
  ``rejoin_s`` later); with none free the replacement is back after ``rejoin_s`` as in ``recover``.
- ``drop`` (drop-the-step, torchft-like): a failure costs ``recovery_s`` and the interrupted step is
  discarded by everybody; the global batch shrinks (``live / N``) until the replacement heals
  (``rejoin_s``), so throughput in tokens drops like ``recover``'s, but the trajectory changes.

Effective throughput = committed tokens / (failure-free tokens in the same wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from lightning_recover.optional import plotting_available

APPROACHES = ("recover", "standby", "checkpoint", "drop")


@dataclass(frozen=True)
class Params:
    gpus: int = 4096
    gpus_per_replica: int = 8  # one replica = one node (tensor/pipeline parallel inside it)
    mtbf_gpu_hours: float = 50_000.0  # per GPU; ~Llama 3's 419 interruptions in 54 days on 16384 GPUs
    step_s: float = 10.0  # failure-free step time (weak scaling: the same at every size)
    tokens_per_gpu_step: float = 16_384.0
    recovery_s: float = 5.0  # recover/drop: fault -> survivors computing again
    rejoin_s: float = 600.0  # recover/drop: a replacement replica is back after this
    standby: int = 1  # standby: warm standby replicas kept by the job
    takeover_s: float = 5.0  # standby: failure -> a standby's microbatches are in a committed step
    restart_s: float = 600.0  # checkpoint: whole-job restart (reschedule, start-up, load)
    checkpoint_s: float = 60.0  # checkpoint: blocking write of one checkpoint
    checkpoint_interval_s: float | None = None  # None: Young/Daly
    hours: float = 72.0  # simulated wall time
    # The control plane against the job's size, measured (``bench scale``): (replicas, seconds) points. Where
    # given, recover/standby/drop pay the fitted time to decide a step on every step, and recovery_s is the
    # fitted recovery at the job's size instead of a constant.
    decide_points: tuple[tuple[int, float], ...] = ()
    recovery_points: tuple[tuple[int, float], ...] = ()

    @property
    def replicas(self) -> int:
        return max(1, self.gpus // self.gpus_per_replica)

    @property
    def system_mtbf_s(self) -> float:
        return self.mtbf_gpu_hours * 3600.0 / self.gpus

    @property
    def recovery_at_size(self) -> float:
        """recover/drop: fault -> survivors computing again, at this job's size."""
        return _fitted_at(self.recovery_points, self.replicas) if self.recovery_points else self.recovery_s

    @property
    def decide_at_size(self) -> float:
        """recover/standby/drop: the control plane's time to decide one step, at this job's size."""
        return _fitted_at(self.decide_points, self.replicas) if self.decide_points else 0.0

    @property
    def tau_s(self) -> float:
        if self.checkpoint_interval_s is not None:
            return self.checkpoint_interval_s
        return young_daly(self.checkpoint_s, self.system_mtbf_s)


def young_daly(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval (work seconds between checkpoints)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def growth_exponent(ns: list[float], values: list[float]) -> Optional[float]:
    """The exponent b of the least-squares fit ``value = a * N ** b`` (log-log); None with fewer than two
    positive points (a figure that is zero everywhere does not grow)."""
    points = [(n, v) for n, v in zip(ns, values) if n > 0 and v is not None and v > 0]
    if len(points) < 2:
        return None if any(v for v in values) else 0.0
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(v) for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def power_law_at(ns: list[int], values: list[float], n: int) -> float:
    """``a * n ** b`` fitted to the measured points (log-log), or 0 where there is no fit (fewer than two
    positive points)."""
    b = growth_exponent(ns, values)
    positive = [(m, v) for m, v in zip(ns, values) if v > 0]
    if not positive or b is None:
        return 0.0
    # a from the geometric mean of the points: the fit's intercept
    log_a = statistics.fmean(math.log(v) - b * math.log(m) for m, v in positive)
    return math.exp(log_a) * n**b


def _fitted_at(points: tuple[tuple[int, float], ...], n: int) -> float:
    """A measured cost at size ``n``: the power law through ``points``, the value itself for one point."""
    if len(points) == 1:
        return points[0][1]
    return power_law_at([m for m, _ in points], [v for _, v in points], n)


@dataclass(frozen=True)
class Failure:
    t: float  # seconds since the start
    replica: int
    u: float  # how far the interrupted step was, in [0, 1)


def failure_times(p: Params, seed: int) -> list[Failure]:
    """Exponential arrivals at rate G / MTBF over ``p.hours``; each hits a uniformly chosen replica."""
    rng = random.Random(seed)
    rate = p.gpus / (p.mtbf_gpu_hours * 3600.0)
    out, t, horizon = [], 0.0, p.hours * 3600.0
    while True:
        t += rng.expovariate(rate) if rate > 0 else math.inf
        if t >= horizon:
            return out
        out.append(Failure(t, rng.randrange(p.replicas), rng.random()))


@dataclass
class Result:
    approach: str
    work_s: float  # committed work in failure-free step-seconds (= steps * step_s)
    horizon_s: float
    failures: int
    lost_s: float = 0.0  # wall time that produced no committed work
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (wall s, committed work s)

    @property
    def efficiency(self) -> float:
        return self.work_s / self.horizon_s if self.horizon_s else 1.0


def _degraded(p: Params, failures: list[Failure], drop: bool, standby: int = 0) -> Result:
    """recover / drop: progress at rate live/N; per failure a pause, and the lost step share.
    ``standby`` > 0: a free standby takes a failed replica's place after ``takeover_s``."""
    n, horizon = p.replicas, p.hours * 3600.0
    pace = p.step_s / (p.step_s + p.decide_at_size)  # of the step's time, what trains
    refills: list[float] = []  # when each standby in use has a started replacement ready
    events: list[tuple[float, int, Failure | None]] = [(f.t, 0, f) for f in failures]
    down: dict[int, float] = {}  # replica -> time its replacement is back
    t = work = lost = 0.0
    timeline = [(0.0, 0.0)]
    pause_until = 0.0
    i = 0
    events.sort(key=lambda e: e[0])
    while t < horizon:
        # the next moment the rate changes: a failure, a rejoin, the end of a pause, the horizon
        nxt = min(
            [horizon]
            + [e[0] for e in events[i : i + 1]]
            + [b for b in down.values() if b > t]
            + ([pause_until] if pause_until > t else [])
        )
        live = n - len(down)
        if t >= pause_until and live > 0:
            work += (nxt - t) * live / n * pace
        else:
            lost += nxt - t
        t = nxt
        for r in [r for r, back in down.items() if back <= t]:
            del down[r]
        while i < len(events) and events[i][0] <= t:
            f = events[i][2]
            i += 1
            if f.replica in down:  # the replica was already down: nothing more to lose
                continue
            live_before = n - len(down)
            refills = [b for b in refills if b > t]  # replacements ready by now are free standbys again
            if standby - len(refills) > 0:
                refills.append(t + p.rejoin_s)
                down[f.replica] = t + p.takeover_s
            else:
                down[f.replica] = t + p.rejoin_s
            live_after = n - len(down)
            if drop:  # the interrupted step is discarded by every replica
                cost = p.recovery_at_size
                discarded = f.u * p.step_s * live_before / n  # work of the step, thrown away
                work -= min(work, discarded)
                lost += discarded
            else:  # survivors recompute the dead replica's finished part of its quota
                cost = p.recovery_at_size + (f.u * p.step_s / live_after if live_after else 0.0)
            pause_until = max(pause_until, t) + cost
        timeline.append((t, work))
    name = "drop" if drop else "standby" if standby else "recover"
    return Result(name, work, horizon, len(failures), lost, timeline)


def _checkpoint(p: Params, failures: list[Failure]) -> Result:
    """Checkpoint-and-restart: blocking checkpoints every tau of work; a failure rolls back and restarts."""
    horizon, tau, c = p.hours * 3600.0, p.tau_s, p.checkpoint_s
    t = work = saved = lost = 0.0
    timeline = [(0.0, 0.0)]
    fail_at = [f.t for f in failures] + [math.inf]
    k = 0
    since = 0.0  # work since the last checkpoint
    while t < horizon:
        nf = fail_at[k]
        # work until the next checkpoint is due, then write it
        run = min(tau - since, horizon - t, nf - t)
        t += run
        work += run
        since += run
        if t >= horizon:
            break
        if t >= nf:  # failure while computing: roll back, restart (a failure during restart restarts again)
            lost += since
            work = saved
            since = 0.0
            k += 1
            restart_end = t + p.restart_s
            while fail_at[k] < restart_end:
                restart_end = fail_at[k] + p.restart_s
                k += 1
            lost += min(restart_end, horizon) - t
            t = restart_end
            timeline.append((min(t, horizon), work))
            continue
        # a checkpoint is due: it takes c seconds; a failure during the write loses it
        end = t + c
        if nf < end:
            lost += nf - t  # the partial write is useless; the failure is handled on the next pass (run = 0)
            t = nf
            continue
        lost += min(end, horizon) - t
        t = end
        saved = work
        since = 0.0
        timeline.append((min(t, horizon), work))
    timeline.append((horizon, work))
    return Result("checkpoint", work, horizon, len([f for f in fail_at if f < horizon]), lost, timeline)


def simulate(approach: str, p: Params, failures: list[Failure]) -> Result:
    if approach == "recover":
        return _degraded(p, failures, drop=False)
    if approach == "standby":
        return _degraded(p, failures, drop=False, standby=p.standby)
    if approach == "drop":
        return _degraded(p, failures, drop=True)
    if approach == "checkpoint":
        return _checkpoint(p, failures)
    raise ValueError(f"unknown approach {approach!r}; expected one of {', '.join(APPROACHES)}")


def sweep(p: Params, gpus: list[int], trials: int, seed: int = 0) -> list[dict]:
    """Mean efficiency of every approach at every size, the same failures for all approaches."""
    rows = []
    for g in gpus:
        q = replace(p, gpus=g)
        eff = {a: [] for a in APPROACHES}
        nfail = []
        for trial in range(trials):
            fails = failure_times(q, seed * 1_000_003 + g * 101 + trial)
            nfail.append(len(fails))
            for a in APPROACHES:
                eff[a].append(simulate(a, q, fails).efficiency)
        row = {
            "gpus": g,
            "replicas": q.replicas,
            "system_mtbf_h": q.system_mtbf_s / 3600,
            "tau_min": q.tau_s / 60,
            "failures": sum(nfail) / trials,
            "recovery_s": q.recovery_at_size,
            "decide_s": q.decide_at_size,
        }
        row.update({a: sum(v) / trials for a, v in eff.items()})
        row["recover_over_checkpoint"] = row["recover"] / row["checkpoint"] if row["checkpoint"] else math.inf
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- measured costs


def control_costs_from_scale(runs: list[dict]) -> tuple[str, dict]:
    """The control plane's measured costs against N from a ``bench scale`` result's runs: the backend with the
    most sizes measured, its time to decide a step, and its kill -> next commit less the one microbatch the
    harness recomputes in it (the model counts the survivors' recomputation itself)."""
    usable = [r for r in runs if r.get("decide_s") is not None and r.get("kill_next_commit_s") is not None]
    if not usable:
        raise ValueError("the bench scale result has no run with both decide_s and kill_next_commit_s")
    backend = max(
        sorted({r["backend"] for r in usable}), key=lambda b: len({r["replicas"] for r in usable if r["backend"] == b})
    )
    mine = sorted((r for r in usable if r["backend"] == backend), key=lambda r: r["replicas"])
    return backend, {
        "decide_points": tuple((r["replicas"], r["decide_s"]) for r in mine),
        "recovery_points": tuple((r["replicas"], max(0.0, r["kill_next_commit_s"] - r["compute_s"])) for r in mine),
    }


def params_from_benchmarks(p: Params, paths: list[str]) -> tuple[Params, dict]:
    """Override costs with the figures a benchmark JSON holds (bench resilience / recovery / scale)."""
    used: dict = {}
    control_plane = None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows = data.get("rows") if isinstance(data, dict) else None
        if rows and ("recover" in rows or "recover-local" in rows):  # bench resilience
            ff = rows.get("failure-free")
            if ff:
                used["step_s"] = ff["wall_s"] / ff["steps"]
            rec = rows.get("recover") or rows["recover-local"]
            if rec.get("median_fault_to_commit_s") is not None and "step_s" in used:
                used["recovery_s"] = max(0.0, rec["median_fault_to_commit_s"] - used["step_s"])
            for mode in ("recover-local", "recover"):  # a restarted replica: fault -> it trains again
                r = rows.get(mode)
                if r and r.get("median_restart_s") is not None:
                    used.setdefault("rejoin_s", r["median_restart_s"])
            standby = rows.get("recover-standby")
            if standby and standby.get("median_takeover_commit_s") is not None:
                used["takeover_s"] = standby["median_takeover_commit_s"]
            for mode in ("ddp-uring", "ddp-torch"):
                r = rows.get(mode)
                if r and r.get("median_restart_s") is not None:
                    used.setdefault("restart_s", r["median_restart_s"])
                    used.setdefault("rejoin_s", r["median_restart_s"])
                if r and r.get("checkpoint_save_s") is not None:
                    used.setdefault("checkpoint_s", r["checkpoint_save_s"])
        elif isinstance(data, dict) and "median_s" in data and "faults" in data:  # bench recovery
            used["recovery_s"] = data["median_s"]
        elif isinstance(data, dict) and isinstance(data.get("runs"), list) and "fits" in data:  # bench scale
            control_plane, costs = control_costs_from_scale(data["runs"])
            used.update(costs)
        used_from = used.setdefault("_from", [])
        used_from.append(path)
    sources = used.pop("_from", [])
    info = {"overrides": used, "sources": sources}
    if control_plane is not None:
        info["control_plane"] = control_plane
    return replace(p, **used), info


# ---------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Params()
    parser.add_argument(
        "--gpus", default="512,1024,2048,4096,8192,16384", help="comma-separated cluster sizes, one row each"
    )
    parser.add_argument(
        "--gpus-per-replica",
        type=int,
        default=d.gpus_per_replica,
        help="GPUs of one data-parallel replica (a node: tensor/pipeline parallel inside it); a GPU's failure "
        "takes down its replica",
    )
    parser.add_argument(
        "--mtbf-gpu-hours", type=float, default=d.mtbf_gpu_hours, help="mean time between failures of one GPU"
    )
    parser.add_argument("--hours", type=float, default=d.hours, help="simulated run length (wall-clock hours)")
    parser.add_argument("--step-s", type=float, default=d.step_s, help="seconds of one failure-free training step")
    parser.add_argument(
        "--recovery-s",
        type=float,
        default=d.recovery_s,
        help="recover and drop: seconds from a failure to the survivors computing again",
    )
    parser.add_argument(
        "--rejoin-s",
        type=float,
        default=d.rejoin_s,
        help="recover and drop: seconds until a replacement for a failed replica trains again",
    )
    parser.add_argument(
        "--restart-s",
        type=float,
        default=d.restart_s,
        help="checkpoint: seconds of a whole-job restart (reschedule, start-up, checkpoint load)",
    )
    parser.add_argument("--standby", type=int, default=d.standby, help="standby approach: warm standby replicas")
    parser.add_argument(
        "--takeover-s", type=float, default=d.takeover_s, help="standby: failure -> standby in a commit"
    )
    parser.add_argument(
        "--checkpoint-s", type=float, default=d.checkpoint_s, help="checkpoint: seconds of one blocking checkpoint"
    )
    parser.add_argument(
        "--checkpoint-interval-s",
        type=float,
        default=None,
        help="checkpoint: seconds of work between checkpoints (default: Young/Daly, sqrt(2 x checkpoint-s x "
        "system MTBF), the table's 'tau min')",
    )
    parser.add_argument(
        "--from-bench",
        nargs="*",
        default=[],
        help="benchmark JSON files (bench resilience/recovery/scale) whose measured costs replace the defaults "
        "(default: none); a bench scale result adds the control plane's time to decide a step and its recovery, "
        "both fitted against the job's size",
    )
    parser.add_argument("--trials", type=int, default=20, help="Monte Carlo trials per size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the failure times (the same for every approach)")
    parser.add_argument("--out", default="simulate_out", help="directory for simulate.png and simulate.json")
    parser.add_argument("--no-plot", action="store_true", help="do not write simulate.png (needs matplotlib)")


#: What each column of the table means, printed under it.
LEGEND = (
    ("sys MTBF h", "mean hours between two failures anywhere in the cluster (GPU MTBF / GPUs)"),
    ("failures", "mean failures in one simulated run (--hours)"),
    ("tau min", "checkpoint-and-restart's interval between checkpoints, in minutes (Young/Daly)"),
    ("recovery s", "recover/drop: fault -> survivors computing again at this size (fitted where measured by size)"),
    ("decide ms", "recover/standby/drop: the control plane's time to decide each step at this size (0: not given)"),
    ("recover", "effective throughput of in-step recovery (this project): committed / failure-free tokens, same time"),
    ("standby", "the same, with --standby warm standby replicas taking a failed replica's place"),
    ("ckpt", "the same for checkpoint-and-restart (every failure: back to the last checkpoint, restart all)"),
    ("drop", "the same for dropping the interrupted step (torchft-like; the trajectory changes)"),
    ("rec/ckpt", "recover's effective throughput over ckpt's"),
)


def plot(rows: list[dict], p: Params, curves: dict[str, Result], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    labels = {
        "recover": "in-step recovery (this project)",
        "standby": "in-step recovery + warm standby",
        "checkpoint": "checkpoint-and-restart (Young/Daly)",
        "drop": "drop the step (torchft-like)",
    }
    g = [r["gpus"] for r in rows]
    for a, style in zip(APPROACHES, ("o-", "D-", "s-", "^--")):
        ax1.plot(g, [100 * r[a] for r in rows], style, label=labels[a])
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(g, [str(x) for x in g])
    ax1.set_xlabel("GPUs")
    ax1.set_ylabel("effective throughput (% of failure-free)")
    ax1.set_title(f"{p.hours:g} h runs, GPU MTBF {p.mtbf_gpu_hours:,.0f} h")
    ax1.legend()
    ax1.grid(alpha=0.3)
    gpus = max(g)
    for a in APPROACHES:
        res = curves[a]
        ax2.plot(
            [gpus * t / 3600 for t, _ in res.timeline],
            [w / p.step_s * p.tokens_per_gpu_step * gpus / 1e9 for _, w in res.timeline],
            label=labels[a],
        )
    ideal = p.hours * 3600 / p.step_s * p.tokens_per_gpu_step * gpus / 1e9
    ax2.plot([0, gpus * p.hours], [0, ideal], ":", color="0.5", label="failure-free")
    ax2.set_xlabel("GPU-hours")
    ax2.set_ylabel("tokens trained (billions)")
    ax2.set_title(f"{gpus} GPUs, one trial")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    p = Params(
        gpus_per_replica=args.gpus_per_replica,
        mtbf_gpu_hours=args.mtbf_gpu_hours,
        hours=args.hours,
        step_s=args.step_s,
        recovery_s=args.recovery_s,
        rejoin_s=args.rejoin_s,
        restart_s=args.restart_s,
        standby=args.standby,
        takeover_s=args.takeover_s,
        checkpoint_s=args.checkpoint_s,
        checkpoint_interval_s=args.checkpoint_interval_s,
    )
    info: dict = {}
    if args.from_bench:
        p, info = params_from_benchmarks(p, args.from_bench)
    gpus = [int(x) for x in str(args.gpus).split(",") if x]
    rows = sweep(p, gpus, args.trials, args.seed)
    print(
        f"costs: step {p.step_s:g}s, recovery {p.recovery_s:g}s, rejoin {p.rejoin_s:g}s, restart {p.restart_s:g}s, "
        f"standby {p.standby} taking over in {p.takeover_s:g}s, "
        f"checkpoint {p.checkpoint_s:g}s; GPU MTBF {p.mtbf_gpu_hours:g}h; {p.hours:g}h runs; {args.trials} trials"
        + (f"; measured: {info['overrides']} from {', '.join(info['sources'])}" if info else "")
        + (
            f" (control plane: {info['control_plane']}, fitted against the job's size)"
            if "control_plane" in info
            else ""
        )
    )
    print(
        f"{'GPUs':>6} {'replicas':>8} {'sys MTBF h':>10} {'failures':>8} {'tau min':>7} {'recovery s':>10} "
        f"{'decide ms':>9} {'recover':>8} {'standby':>8} {'ckpt':>8} {'drop':>8} {'rec/ckpt':>8}"
    )
    for r in rows:
        print(
            f"{r['gpus']:>6} {r['replicas']:>8} {r['system_mtbf_h']:>10.2f} {r['failures']:>8.1f} {r['tau_min']:>7.1f} "
            f"{r['recovery_s']:>10.2f} {1000 * r['decide_s']:>9.1f} "
            f"{100 * r['recover']:>7.2f}% {100 * r['standby']:>7.2f}% {100 * r['checkpoint']:>7.2f}% "
            f"{100 * r['drop']:>7.2f}% "
            f"{r['recover_over_checkpoint']:>7.3f}x"
        )
    print()
    for column, meaning in LEGEND:
        print(f"  {column:>10}: {meaning}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "simulate.json"), "w") as f:
        json.dump({"params": asdict(p), "measured": info, "rows": rows}, f, indent=2)
    if not args.no_plot and plotting_available("the plot (simulate.png)"):
        q = replace(p, gpus=max(gpus))
        fails = failure_times(q, args.seed)
        curves = {a: simulate(a, q, fails) for a in APPROACHES}
        print(f"plot: {plot(rows, p, curves, os.path.join(args.out, 'simulate.png'))}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-recover simulate",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(cli())
