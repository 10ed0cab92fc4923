"""``lightning-recover bench resilience``: in-step recovery vs checkpoint-and-restart, one schedule.

Three modes train the same model on the same data with the same failure schedule
(``lightning_recover/bench/resilience_train.py`` holds the training job):

- ``recover``: this project, ``Fabric(strategy="recover")`` under
  ``lightning-recover torchrun --max-restarts K`` (one torchrun agent per replica, the same restart
  policy as the baseline's ``torchrun --max-restarts K``); the faults are injected with
  ``--inject`` (SIGKILL in the backward pass, first incarnation only); survivors recompute the lost
  microbatches in the same step and continue with fewer replicas until the agent has restarted the
  killed replica, which rejoins at a commit with the live model, optimizer state and step from a peer.
- ``recover-local``: the same, but the replicas are restarted by the local launcher
  (``fabric.launch()`` with ``RecoverStrategy(restarts=K)``), which also tells the coordinator of the
  death at once (under torchrun only the agent sees the exit: survivors learn it from the heartbeat
  threshold or from the restarted replica, whichever comes first).
- ``recover-norestart`` (not run by default): no replacement, the run ends on the last survivor.
- ``ddp-torch`` / ``ddp-uring``: what users do today: Lightning DDP (gloo) under
  ``torchrun --max-restarts``, a checkpoint every ``K`` steps (``fabric.save``, through Lightning's
  default ``TorchCheckpointIO`` or through :class:`UringCheckpointIO`), and on any failure torchrun
  restarts the whole group, which resumes from the newest checkpoint with all replicas.
- ``failure-free``: ``strategy="recover"`` without faults: the reference trajectory and throughput.
- ``recover-standby`` (only with ``--modes``): ``recover-local`` with ``--standby S`` warm standbys
  (default 1): a killed replica's place is taken by a ready standby, and a new standby starts.
  ``failure-free-standby``: no faults, S standbys waiting: what waiting standbys cost the replicas.

A peer's mode is added from outside the package (:class:`ExtraMode`): the comparison with torchft is
``python -m benchmarks.torchft_resilience`` in the repository (``benchmarks/``, not installed), which takes
these options and runs this driver with a ``torchft`` mode more.

Straggler scenario (``--straggler R:F[@S]``, no faults): replica ``R``'s microbatches take ``F``
times as long as the others' (``F * mb_seconds`` while compute fits in ``mb_seconds``; from step ``S``
on). ``recover-equal`` and ``recover-throughput`` run ``strategy="recover"`` (local launcher) with
``quota="equal"`` / ``"throughput"``, ``ddp-torch`` stock DDP with the same slowdown (no checkpoints:
nothing fails), ``failure-free`` the reference without the straggler. Reported against the ideal (the
sum of the replicas' rates) and against what the quota plan itself allows with zero communication
(:func:`planned_mb_per_s`).

Sharded mode (``--replica-size K``, K > 1): every replica is K processes sharding the model with
FSDP2. ``recover`` runs ``lightning-recover torchrun --nproc-per-replica K`` (a killed process takes
its replica out; the agent restarts all K, which rejoin with their shards from a peer),
``recover-local`` the local launcher's restarts, and the baseline is ``hsdp-dcp``: Lightning's stock
``ModelParallelStrategy`` with FSDP2 over the 2-D (replicate, shard) mesh (HSDP) under
``torchrun --max-restarts``, checkpointing DCP directories every ``K`` steps and resuming from the
newest after a whole-group restart (``ddp-*`` modes are not run then).

Effective throughput = committed microbatches (``steps * M``) / wall time from the start of the
first training step of the first attempt to the last commit. Process start-up of the *first*
attempt is excluded equally for every mode; everything after it (detection, restarts, re-imports,
rendezvous, checkpoint loads, recomputed steps, checkpoint writes) is included.

Fixed per-replica capacity: every microbatch is padded to ``--mb-seconds`` of wall time (see
``resilience_train.py``), far above its compute time, so a replica's speed does not rise when
others die and free CPU on this small machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from lightning_recover.bench.resilience_train import parse_slow, slow_factor
from lightning_recover.protocol.quotas import plan_quotas

MODES = ("recover", "recover-local", "ddp-torch", "ddp-uring", "failure-free")
SHARDED_MODES = ("recover", "recover-local", "hsdp-dcp", "failure-free")
EXTRA_MODES = ("recover-norestart", "recover-standby", "failure-free-standby")
# --straggler: no faults; one replica slowed; equal vs throughput quotas vs stock DDP (+ the reference)
STRAGGLER_MODES = ("recover-equal", "recover-throughput", "ddp-torch", "failure-free")
FAULT_T = re.compile(r"injecting fault (\S+) at t=([0-9.]+)")

# The documented default schedule: 4 replicas, 40 steps of M=12 microbatches, 3 successive kills.
DEFAULTS = {"steps": 40, "microbatches": 12, "mb_seconds": 0.1, "ckpt_every": 10, "kills": [(1, 5), (2, 16), (3, 27)]}
BATCH = 4  # samples per microbatch
MODEL = [
    "--batch-size",
    str(BATCH),
    "--block-size",
    "64",
    "--layers",
    "2",
    "--width",
    "64",
    "--corpus-bytes",
    "1000000",
]


def job_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LIGHTNING_RECOVER_INJECT", None)
    return env


def _run(cmd: list[str], env: dict[str, str], log: str, timeout: float) -> int:
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(cmd[:6])}... did not finish within {timeout}s; see {log}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the job's own process group, by its leader's pid
            except ProcessLookupError:
                pass
            proc.wait()


def run_mode(
    mode: str,
    out: str,
    *,
    replicas: int,
    steps: int,
    microbatches: int,
    mb_seconds: float,
    kills: list[tuple[int, int]],
    ckpt_every: int,
    heartbeat_timeout: float,
    replica_size: int = 1,
    slow: str = "",
    standby: int = 1,
    timeout: float = 1800,
) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    common = _training_args(mode, out, replicas, steps, microbatches, mb_seconds, replica_size, slow)
    env = job_env()
    # The restart budget is the same for every mode that restarts: torchrun --max-restarts K in the
    # baseline (K whole-group restarts), K restarts per replica for recover (each is killed once).
    inject = ",".join(f"kill:replica={r}:step={s}:phase=backward" for r, s in kills)
    if mode == "recover":
        cmd = _recover_torchrun_cmd(common, replicas, replica_size, kills, inject, heartbeat_timeout)
    elif mode.startswith(("recover", "failure-free")):
        cmd = _recover_local_cmd(mode, common, kills, heartbeat_timeout, standby)
        if not mode.startswith("failure-free") and kills:
            env["LIGHTNING_RECOVER_INJECT"] = inject
    else:
        cmd = _checkpoint_restart_cmd(mode, common, out, replicas, replica_size, kills, ckpt_every)
    log = os.path.join(out, "job.log")
    t = time.time()
    code = _run(cmd, env, log, timeout)
    total = time.time() - t
    output = open(log, errors="replace").read()
    if code != 0:
        raise RuntimeError(f"{mode} job failed ({code}):\n{output[-3000:]}")
    return analyze(mode, out, output, steps=steps, microbatches=microbatches, job_seconds=total)


def _training_args(
    mode: str,
    out: str,
    replicas: int,
    steps: int,
    microbatches: int,
    mb_seconds: float,
    replica_size: int,
    slow: str,
) -> list[str]:
    """The training job's options that every mode passes alike: the schedule, the model and the output."""
    common = [
        "--replicas",
        str(replicas),
        "--steps",
        str(steps),
        "--microbatches",
        str(microbatches),
        "--mb-seconds",
        str(mb_seconds),
        "--replica-size",
        str(replica_size),
        "--out",
        out,
    ] + MODEL
    if replica_size > 1:
        common += ["--precision", "32-true"]  # ModelParallelStrategy (the HSDP baseline) refuses 64-true
    if slow and mode != "failure-free":  # the failure-free run is the reference: no straggler either
        common += ["--slow", slow]
    return common


def _recover_torchrun_cmd(
    common: list[str],
    replicas: int,
    replica_size: int,
    kills: list[tuple[int, int]],
    inject: str,
    heartbeat_timeout: float,
) -> list[str]:
    """``recover``: one torchrun agent per replica (lightning-recover torchrun); the replica script runs directly."""
    cmd = [
        sys.executable,
        "-m",
        "lightning_recover.cli",
        "torchrun",
        "--replicas",
        str(replicas),
        "--nproc-per-replica",
        str(replica_size),
        "--max-restarts",
        str(len(kills)),
        "--heartbeat-timeout",
        str(heartbeat_timeout),
    ]
    return cmd + (
        (["--inject", inject] if kills else [])
        + [
            "--",
            "-m",
            "lightning_recover.bench.resilience_train",
            "--mode",
            "recover",
            "--heartbeat-timeout",
            str(heartbeat_timeout),
        ]
        + common
    )


def _recover_local_cmd(
    mode: str, common: list[str], kills: list[tuple[int, int]], heartbeat_timeout: float, standby: int
) -> list[str]:
    """The other ``recover*`` and ``failure-free*`` modes: the training job under its own local launcher."""
    cmd = [sys.executable, "-m", "lightning_recover.bench.resilience_train"]
    cmd += ["--mode", "recover", "--heartbeat-timeout", str(heartbeat_timeout)] + common
    if mode == "recover-throughput":
        cmd += ["--quota", "throughput"]
    if mode in ("recover-local", "recover-standby"):
        cmd += ["--restarts", str(len(kills))]
    if mode == "recover-standby":
        cmd += ["--standby", str(standby)]
    if mode == "failure-free-standby":  # what waiting standbys cost the replicas: no fault
        cmd += ["--restarts", "1", "--standby", str(standby)]
    return cmd


def _checkpoint_restart_cmd(
    mode: str,
    common: list[str],
    out: str,
    replicas: int,
    replica_size: int,
    kills: list[tuple[int, int]],
    ckpt_every: int,
) -> list[str]:
    """The baselines (``ddp-*``, ``hsdp-dcp``): stock Lightning under ``torchrun --max-restarts``, resuming the
    whole group from its newest checkpoint."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(replicas * replica_size),
        "--max-restarts",
        str(len(kills)),
        "-m",
        "lightning_recover.bench.resilience_train",
        "--mode",
        "ddp",
        "--ckpt-dir",
        os.path.join(out, "ckpt"),
        "--ckpt-every",
        str(ckpt_every),
        "--ckpt-io",
        "torch" if mode == "hsdp-dcp" else mode.split("-")[1],
        "--kill",
        ",".join(f"{r}:{s}" for r, s in kills),
    ] + common


def records(out: str) -> list[dict]:
    recs = []
    for path in glob.glob(os.path.join(out, "rank*.jsonl")):
        rank = int(os.path.basename(path)[4:-6])
        with open(path) as f:
            recs += [dict(json.loads(line), rank=rank) for line in f if line.strip()]
    return recs


def analyze(mode: str, out: str, output: str, *, steps: int, microbatches: int, job_seconds: float) -> dict:
    recs = records(out)
    step_recs = [r for r in recs if r["event"] == "step"]
    faults = sorted(((m.group(1), float(m.group(2))) for m in FAULT_T.finditer(output)), key=lambda f: f[1])
    attempts = sorted({r["attempt"] for r in step_recs})
    # the committed trajectory: for each step, its last execution (later attempts redo rolled-back steps)
    final: dict[int, dict] = {}
    for r in step_recs:
        cur = final.get(r["step"])
        if cur is None or (r["attempt"], r["commit"]) > (cur["attempt"], cur["commit"]):
            final[r["step"]] = r
    if sorted(final) != list(range(steps)):
        raise RuntimeError(f"{mode}: committed steps {sorted(final)} != 0..{steps - 1}")
    first = min(r["start"] for r in step_recs if r["attempt"] == attempts[0] and r["step"] == 0)
    last = max(r["commit"] for r in step_recs if r["step"] == steps - 1)
    wall = last - first
    executions = {(r["attempt"], r["step"]) for r in step_recs}
    lost_steps = len(executions) - steps  # steps committed by an attempt, then rolled back by a restart
    recomputed = sum(r.get("recomputed", 0) for r in step_recs)
    replicas = max(r["live"] for r in step_recs)
    recoveries = []
    for spec, t in faults:
        # time to recover: from the fault until the step it interrupted is committed (for a restart:
        # committed again, after the restart and the redone steps since the checkpoint)
        step = int(re.search(r"step=(\d+)", spec).group(1))
        done = [r["commit"] for r in step_recs if r["step"] == step and r["commit"] > t]
        item = {
            "fault": spec,
            "fault_t": t - first,
            "step": step,
            "fault_to_commit_s": (max(done) - t) if done else None,
        }
        if mode.startswith(("ddp", "hsdp")) and any(r["start"] > t for r in step_recs):
            item["restart_s"] = min(r["start"] for r in step_recs if r["start"] > t) - t  # fault -> training again
        if mode.startswith("recover"):
            victim = int(re.search(r"replica=(\d+)", spec).group(1))
            # the killed replica's next incarnation: process started, rejoined (state received), first commit
            later = [r for r in recs if r["rank"] == victim and r.get("incarnation", 1) > 1]
            starts = [r["t"] for r in later if r["event"] == "start" and r["t"] > t]
            rejoins = [r for r in later if r["event"] == "rejoin" and r["t"] > t]
            if starts:
                item["process_restart_s"] = min(starts) - t  # fault -> the new process is running
            if rejoins:
                rj = min(rejoins, key=lambda r: r["t"])
                item["restart_s"] = rj["t"] - t  # fault -> the replacement trains again (admitted, state received)
                commits = [r["commit"] for r in later if r["event"] == "step" and r["commit"] > t]
                if commits:  # fault -> the replacement's microbatches are in a committed step
                    item["replacement_commit_s"] = min(commits) - t
                item["takeover"] = not starts  # the replacement's process existed before the fault: a standby
                item["rejoin_step"] = rj["step"]
                if starts:
                    item["rejoin_s"] = rj["t"] - min(
                        starts
                    )  # process start -> admitted with state (import, connect, wait, state)
            # degraded period: from the fault until a later step commits with every replica live again
            full = [r["commit"] for s, r in final.items() if s > step and r["live"] >= replicas]
            item["degraded_s"] = (min(full) - t) if full else None
        recoveries.append(item)
    ckpts = [r["seconds"] for r in recs if r["event"] == "ckpt" and r["rank"] == 0]
    loads = [r["seconds"] for r in recs if r["event"] == "resume" and r["rank"] == 0]
    lost_recompute_mb = lost_steps * microbatches
    return {
        "mode": mode,
        "steps": steps,
        "wall_s": wall,
        "job_s": job_seconds,
        "effective_mb_per_s": steps * microbatches / wall,
        # the second half of the run alone: after every process's start-up (a standby's included)
        "late_mb_per_s": (steps - steps // 2) * microbatches / (last - final[steps // 2 - 1]["commit"]),
        "attempts": len(attempts),
        "faults": len(faults),
        "lost_steps": lost_steps,
        "lost_microbatches": lost_recompute_mb,
        "recomputed_microbatches": recomputed,
        "recoveries": recoveries,
        "median_fault_to_commit_s": statistics.median(
            [x["fault_to_commit_s"] for x in recoveries if x["fault_to_commit_s"] is not None] or [0.0]
        ),
        "median_restart_s": median_of(recoveries, "restart_s"),
        "median_process_restart_s": median_of(recoveries, "process_restart_s"),
        "median_rejoin_s": median_of(recoveries, "rejoin_s"),
        "median_replacement_commit_s": median_of(recoveries, "replacement_commit_s"),
        "median_takeover_commit_s": median_of([x for x in recoveries if x.get("takeover")], "replacement_commit_s"),
        "takeovers": sum(1 for x in recoveries if x.get("takeover")),
        "median_degraded_s": median_of(recoveries, "degraded_s"),
        "degraded_steps": sum(1 for r in final.values() if r["live"] < replicas),
        "rejoins": sum(1 for r in recs if r["event"] == "rejoin"),
        "checkpoint_save_s": statistics.median(ckpts) if ckpts else None,
        "checkpoints": len(ckpts),
        "checkpoint_load_s": statistics.median(loads) if loads else None,
        "final_loss": final[steps - 1]["loss"],
        "min_live": min(r.get("live", 0) for r in final.values()),
        "mb_by_replica": _mb_by_replica(step_recs),
    }


def _mb_by_replica(step_recs: list[dict]) -> dict[int, int]:
    """Microbatches each replica computed over the run (its quotas plus any recomputed ones)."""
    counts: dict[int, int] = {}
    for r in step_recs:
        counts[r["rank"]] = counts.get(r["rank"], 0) + r.get("computed", 0)
    return dict(sorted(counts.items()))


# ------------------------------------------------------------------ stragglers: what is attainable


def mb_times(replicas: int, mb_seconds: float, slow: dict[int, tuple[float, int]], step: int) -> list[float]:
    """Seconds one microbatch takes on each replica in ``step`` (``--slow``'s factors applied)."""
    return [mb_seconds * slow_factor(slow, r, step) for r in range(replicas)]


def ideal_mb_per_s(replicas: int, mb_seconds: float, slow: dict[int, tuple[float, int]], steps: int, M: int) -> float:
    """The ideal: every step runs at the sum of the replicas' individual rates (no quota rounding,
    no communication). One replica at 2x of 4: (3 + 0.5) / mb_seconds; slow from a later step: the
    steps' ideal times summed."""
    wall = sum(M / sum(1.0 / t for t in mb_times(replicas, mb_seconds, slow, s)) for s in range(steps))
    return steps * M / wall


def planned_mb_per_s(
    replicas: int, mb_seconds: float, slow: dict[int, tuple[float, int]], steps: int, M: int, quota: str
) -> float:
    """What the quota plan itself allows, with zero communication: each step takes its slowest
    replica's ``quota x microbatch time``. ``equal`` (and DDP): M/N each. ``throughput``: the
    protocol's own planner, weighted by the rates measured in the previous step (step 0: equal), so
    rounding to whole microbatches and the one-step lag after a change are both counted."""
    wall = 0.0
    for s in range(steps):
        times = mb_times(replicas, mb_seconds, slow, s)
        weights = None
        if quota == "throughput" and s > 0:
            weights = {r: 1.0 / t for r, t in enumerate(mb_times(replicas, mb_seconds, slow, s - 1))}
        plan = plan_quotas(s, range(M), range(replicas), weights)
        wall += max(len(plan[r]) * times[r] for r in range(replicas))
    return steps * M / wall


def f_(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "-"


def median_of(items: list[dict], key: str) -> float | None:
    values = [x[key] for x in items if x.get(key) is not None]
    return statistics.median(values) if values else None


def _param_diff(a_path: str, b_path: str, relative: bool = True) -> float:
    """Max over tensors of max |a - b| (relative: divided by the tensor's max |b|)."""
    a, b = torch.load(a_path), torch.load(b_path)
    worst = 0.0
    for key, ref in b.items():
        diff = (a[key].double() - ref.double()).abs().max().item()
        worst = max(worst, diff / max(ref.double().abs().max().item(), 1e-12) if relative else diff)
    return worst


def _table(rows: dict[str, dict], bases: tuple[str, ...] = ("ddp-torch", "ddp-uring")) -> str:
    lines = [
        f"| mode | wall s | effective mb/s | 2nd half mb/s | {' | '.join('vs ' + b for b in bases)} | lost steps"
        " | recomputed mb"
        " | of failure-free | fault -> step committed (median s) | fault -> replica training again (median s)"
        " | fault -> replacement in a commit (median s) | degraded steps | ckpt save / load s"
        " | max rel. param diff vs failure-free |",
        "|---|---|---|---|" + "---|" * len(bases) + "---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    for mode, r in rows.items():
        ratios = " | ".join(
            f"{r['effective_mb_per_s'] / rows[b]['effective_mb_per_s']:.2f}x" if b in rows else "-" for b in bases
        )
        ck = " / ".join(f(r.get(k), ".3f") for k in ("checkpoint_save_s", "checkpoint_load_s"))
        ftc = f"{r['median_fault_to_commit_s']:.2f}" if r["faults"] else "-"
        free = rows.get("failure-free")
        of_free = f"{r['effective_mb_per_s'] / free['effective_mb_per_s']:.2f}" if free else "-"
        lines.append(
            f"| {mode} | {r['wall_s']:.1f} | {r['effective_mb_per_s']:.2f} | {f(r.get('late_mb_per_s'), '.2f')} | "
            f"{ratios} | "
            f"{r['lost_steps']} | {r['recomputed_microbatches']} | {of_free} | {ftc} | "
            f"{f(r.get('median_restart_s'), '.1f')} | {f(r.get('median_replacement_commit_s'), '.2f')} | "
            f"{r.get('degraded_steps', 0)} | {ck} | {f(r.get('param_diff'), '.1e')} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ExtraMode:
    """A mode the package does not hold, added by a driver outside it (a peer's harness in ``benchmarks/``):
    ``run(out, **cfg)`` returns a row as :func:`run_mode` does; ``table(rows, cfg)``, if given, a table of
    its own printed after the main one. Offered only where the default modes are (no straggler, no shards)."""

    run: Callable[..., dict]
    table: Callable[[dict[str, dict], dict], str] | None = None


def _select_modes(
    args: argparse.Namespace, straggler: str | None, replica_size: int, extra: Mapping[str, ExtraMode] | None = None
) -> list[str]:
    if straggler:
        known, default = STRAGGLER_MODES, STRAGGLER_MODES
    elif replica_size > 1:
        known, default = SHARDED_MODES, SHARDED_MODES[:4]
    else:
        known, default = MODES + EXTRA_MODES + tuple(extra or ()), MODES
    modes = [m for m in (getattr(args, "modes", None) or ",".join(default)).split(",") if m]
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise SystemExit(f"bench resilience: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return modes


def main(args: argparse.Namespace, extra: Mapping[str, ExtraMode] | None = None) -> int:
    """Runs the modes ``args`` select (``extra``: modes added from outside, by name) and reports them."""
    extra = extra or {}
    workdir = args.dir or tempfile.mkdtemp(prefix="lr-resilience-")
    os.makedirs(workdir, exist_ok=True)
    # the CLI's shared --steps defaults to 20 (for `bench overhead`); this benchmark's default is 40
    steps = args.steps if getattr(args, "steps", None) not in (None, 20) else DEFAULTS["steps"]
    straggler = getattr(args, "straggler", None) or None
    try:
        slow = parse_slow(straggler or "")
    except ValueError as exc:
        raise SystemExit(f"bench resilience --straggler: {exc}") from None
    if any(r >= args.replicas for r in slow):
        raise SystemExit(f"bench resilience --straggler {straggler}: there are only {args.replicas} replicas")
    # the straggler scenario injects no faults: it isolates what the quotas do
    kills = [] if straggler else [(r, s) for r, s in DEFAULTS["kills"] if s < steps and r < args.replicas]
    replica_size = getattr(args, "replica_size", 1) or 1
    if straggler and replica_size > 1:
        raise SystemExit("bench resilience --straggler runs unsharded replicas (--replica-size 1)")
    bases = ("hsdp-dcp",) if replica_size > 1 else ("ddp-torch",) if straggler else ("ddp-torch", "ddp-uring")
    modes = _select_modes(args, straggler, replica_size, extra)
    repeat = max(1, getattr(args, "repeat", 1) or 1)
    # under heavy load a 1 s heartbeat threshold can declare a slow replica dead (false suspicion);
    # only kills are injected here, so a generous threshold costs nothing. The launchers see a
    # killed replica's exit at once: the threshold matters for hangs (and for a peer that only learns of
    # a death from missing heartbeats, such as torchft's lighthouse; it gets the same value).
    hb = args.heartbeat_timeout if getattr(args, "heartbeat_timeout", None) is not None else 5.0
    cfg = {
        "replicas": args.replicas,
        "steps": steps,
        "microbatches": getattr(args, "microbatches", None) or DEFAULTS["microbatches"],
        "mb_seconds": DEFAULTS["mb_seconds"],
        "kills": kills,
        # no faults, nothing to restore from: the straggler scenario's DDP writes no checkpoints
        "ckpt_every": 0 if straggler else DEFAULTS["ckpt_every"],
        "heartbeat_timeout": hb,
        "replica_size": replica_size,
    }
    if any("standby" in m for m in modes):
        cfg["standby"] = getattr(args, "standby", 1)
    if straggler:
        cfg["slow"] = straggler
    print(f"resilience: {cfg}, modes {modes}, {repeat} repetition(s), in {workdir}", flush=True)
    runs = _run_modes(modes, repeat, workdir, cfg, extra)
    rows = {}
    for mode, rs in runs.items():
        rs.sort(key=lambda r: r["wall_s"])
        rows[mode] = rs[len(rs) // 2]  # the median run by wall time
    if "failure-free" in rows:
        for mode, r in rows.items():
            r["param_diff"] = _param_diff(r["final_params"], rows["failure-free"]["final_params"])
            r["param_absdiff"] = _param_diff(r["final_params"], rows["failure-free"]["final_params"], relative=False)
    figures = {}
    if straggler:
        table = straggler_report(rows, runs, cfg, slow)
        figures = {
            "ideal_mb_per_s": ideal_mb_per_s(args.replicas, cfg["mb_seconds"], slow, steps, cfg["microbatches"]),
            "planned_mb_per_s": {
                q: planned_mb_per_s(args.replicas, cfg["mb_seconds"], slow, steps, cfg["microbatches"], q)
                for q in ("equal", "throughput")
            },
        }
    else:
        table = _table(rows, bases)
        for name, mode in extra.items():
            if name in rows and mode.table is not None:
                table += "\n\n" + mode.table(rows, cfg)
    print(table)
    paired = paired_ratios(runs, ("failure-free", *bases))
    if not straggler:
        _print_ratios(rows, bases, tuple(extra))
    if repeat > 1:
        _print_paired(paired, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": cfg,
                    "machine": f"{os.cpu_count()} cores",
                    "time": time.ctime(),
                    "load_average": os.getloadavg(),
                    **figures,
                    "paired": paired,
                    "rows": rows,
                    "runs": runs,
                    "table": table,
                },
                f,
                indent=2,
            )
    return 0


def _run_modes(
    modes: list[str], repeat: int, workdir: str, cfg: dict, extra: Mapping[str, ExtraMode]
) -> dict[str, list[dict]]:
    """Every mode ``repeat`` times, the order reversed on odd repetitions; ``{mode: [row per repetition]}``."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(repeat):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            out = os.path.join(workdir, f"{mode}-{rep}")
            r = extra[mode].run(out, **cfg) if mode in extra else run_mode(mode, out, **cfg)
            r["final_params"] = os.path.join(out, "final.pt")
            runs[mode].append(r)
            if mode == "failure-free" and r["min_live"] < cfg["replicas"]:
                print(
                    "  WARNING: a replica was declared dead in the failure-free run (false suspicion under load); "
                    "raise --heartbeat-timeout",
                    flush=True,
                )
            print(
                f"  {mode:18s} run {rep}: wall {r['wall_s']:.1f}s, {r['effective_mb_per_s']:.2f} mb/s, "
                f"lost steps {r['lost_steps']}, recomputed mb {r['recomputed_microbatches']}"
                + (f", mb by replica {r['mb_by_replica']}" if "slow" in cfg else ""),
                flush=True,
            )
    return runs


def paired_ratios(runs: dict[str, list[dict]], references: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    """Throughput ratios paired by repetition: ``{mode: {reference: {"ratios": [...], "median", "min", "max"}}}``.

    Repetition ``i`` of a mode is divided by repetition ``i`` of the reference (same repetition, modes run
    next to each other), so a machine that is slower for one repetition moves both sides; the median and
    spread of those ratios are the headline figures (docs/benchmarks.md), not the ratio of the medians.
    """
    out: dict[str, dict[str, dict]] = {}
    for mode, rs in runs.items():
        for ref in references:
            if ref == mode or ref not in runs or not rs or len(runs[ref]) != len(rs):
                continue
            ratios = [a["effective_mb_per_s"] / b["effective_mb_per_s"] for a, b in zip(rs, runs[ref])]
            out.setdefault(mode, {})[ref] = {
                "ratios": ratios,
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
    return out


def _print_paired(paired: dict[str, dict[str, dict]], runs: dict[str, list[dict]]) -> None:
    print("paired by repetition (median [min-max] of the per-repetition ratios):")
    for mode, refs in paired.items():
        cells = "; ".join(
            f"/ {ref} {v['median']:.3f}x [{v['min']:.3f}-{v['max']:.3f}] ({', '.join(f'{x:.3f}' for x in v['ratios'])})"
            for ref, v in refs.items()
        )
        takeover = [r.get("median_takeover_commit_s") for r in runs[mode]]
        if any(t is not None for t in takeover):
            cells += "; kill -> standby in a commit, per-run medians: " + ", ".join(f_(t) for t in takeover) + " s"
        print(f"  {mode}: {cells}")


def _print_ratios(rows: dict[str, dict], bases: tuple[str, ...], extra: tuple[str, ...] = ()) -> None:
    for mode in rows:
        if mode.startswith("recover") or mode in extra:
            for base in bases:
                if base in rows:
                    print(
                        f"{mode} / {base}: {rows[mode]['effective_mb_per_s'] / rows[base]['effective_mb_per_s']:.2f}x"
                    )
            per_fault = "; ".join(
                f"{x['fault'].split(':')[1]} step {x['step']}: commit {f_(x.get('fault_to_commit_s'))} s, "
                f"process up {f_(x.get('process_restart_s'))} s, training again {f_(x.get('restart_s'))} s, "
                f"full again {f_(x.get('degraded_s'))} s"
                for x in rows[mode]["recoveries"]
            )
            if per_fault:
                print(f"  {mode} per fault (from the kill): {per_fault}")


def straggler_report(rows: dict[str, dict], runs: dict[str, list[dict]], cfg: dict, slow: dict) -> str:
    """The straggler table: throughput against the ideal and against what each quota plan allows."""
    n, T, steps, M = cfg["replicas"], cfg["mb_seconds"], cfg["steps"], cfg["microbatches"]
    ideal = ideal_mb_per_s(n, T, slow, steps, M)
    lines = [
        f"ideal (sum of the replicas' rates): {ideal:.2f} mb/s; equal split allows "
        f"{planned_mb_per_s(n, T, slow, steps, M, 'equal'):.2f}, the throughput plan (whole microbatches, "
        f"one-step lag) {planned_mb_per_s(n, T, slow, steps, M, 'throughput'):.2f}",
        "",
        "| mode | wall s | mb/s (median) | mb/s per run | ideal mb/s | fraction of ideal | plan allows (fraction)"
        " | microbatches per replica | max abs param diff vs failure-free | max rel. param diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in rows.items():
        plain = mode == "failure-free"
        row_ideal = n / T if plain else ideal
        quota = "throughput" if mode == "recover-throughput" else "equal"
        plan = planned_mb_per_s(n, T, {} if plain else slow, steps, M, quota)
        r.update(ideal_mb_per_s=row_ideal, fraction_of_ideal=r["effective_mb_per_s"] / row_ideal, plan_mb_per_s=plan)
        per_run = ", ".join(f"{x['effective_mb_per_s']:.2f}" for x in runs[mode])
        by = " / ".join(str(v) for v in r["mb_by_replica"].values())
        lines.append(
            f"| {mode}{' (no straggler)' if plain else ''} | {r['wall_s']:.1f} | {r['effective_mb_per_s']:.2f} | "
            f"{per_run} | {row_ideal:.2f} | {r['fraction_of_ideal']:.3f} | {plan:.2f} ({plan / row_ideal:.3f}) | "
            f"{by} | {fmt_e(r.get('param_absdiff'))} | {fmt_e(r.get('param_diff'))} |"
        )
    return "\n".join(lines)


def fmt_e(v: float | None) -> str:
    return format(v, ".1e") if v is not None else "-"
