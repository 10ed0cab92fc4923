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

import torch

MODES = ("recover", "recover-local", "ddp-torch", "ddp-uring", "failure-free")
SHARDED_MODES = ("recover", "recover-local", "hsdp-dcp", "failure-free")
EXTRA_MODES = ("recover-norestart",)
_FAULT_T = re.compile(r"injecting fault (\S+) at t=([0-9.]+)")

# The documented default schedule: 4 replicas, 40 steps of M=12 microbatches, 3 successive kills.
DEFAULTS = {"steps": 40, "microbatches": 12, "mb_seconds": 0.1, "ckpt_every": 10, "kills": [(1, 5), (2, 16), (3, 27)]}
MODEL = ["--batch-size", "4", "--block-size", "64", "--layers", "2", "--width", "64", "--corpus-bytes", "1000000"]


def _env() -> dict[str, str]:
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
    timeout: float = 1800,
) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
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
    env = _env()
    job = [sys.executable, "-m", "lightning_recover.bench.resilience_train"]
    # The restart budget is the same for every mode that restarts: torchrun --max-restarts K in the
    # baseline (K whole-group restarts), K restarts per replica for recover (each is killed once).
    inject = ",".join(f"kill:replica={r}:step={s}:phase=backward" for r, s in kills)
    if mode == "recover":
        # one torchrun agent per replica (lightning-recover torchrun); the replica script runs directly
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
        cmd += (
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
    elif mode.startswith("recover") or mode == "failure-free":
        cmd = job + ["--mode", "recover", "--heartbeat-timeout", str(heartbeat_timeout)] + common
        if mode == "recover-local":
            cmd += ["--restarts", str(len(kills))]
        if mode != "failure-free" and kills:
            env["LIGHTNING_RECOVER_INJECT"] = inject
    else:
        cmd = [
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
    log = os.path.join(out, "job.log")
    t = time.time()
    code = _run(cmd, env, log, timeout)
    total = time.time() - t
    output = open(log, errors="replace").read()
    if code != 0:
        raise RuntimeError(f"{mode} job failed ({code}):\n{output[-3000:]}")
    return analyze(mode, out, output, steps=steps, microbatches=microbatches, job_seconds=total)


def _records(out: str) -> list[dict]:
    recs = []
    for path in glob.glob(os.path.join(out, "rank*.jsonl")):
        rank = int(os.path.basename(path)[4:-6])
        with open(path) as f:
            recs += [dict(json.loads(line), rank=rank) for line in f if line.strip()]
    return recs


def analyze(mode: str, out: str, output: str, *, steps: int, microbatches: int, job_seconds: float) -> dict:
    recs = _records(out)
    step_recs = [r for r in recs if r["event"] == "step"]
    faults = sorted(((m.group(1), float(m.group(2))) for m in _FAULT_T.finditer(output)), key=lambda f: f[1])
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
        "attempts": len(attempts),
        "faults": len(faults),
        "lost_steps": lost_steps,
        "lost_microbatches": lost_recompute_mb,
        "recomputed_microbatches": recomputed,
        "recoveries": recoveries,
        "median_fault_to_commit_s": statistics.median(
            [x["fault_to_commit_s"] for x in recoveries if x["fault_to_commit_s"] is not None] or [0.0]
        ),
        "median_restart_s": _median(recoveries, "restart_s"),
        "median_process_restart_s": _median(recoveries, "process_restart_s"),
        "median_rejoin_s": _median(recoveries, "rejoin_s"),
        "median_degraded_s": _median(recoveries, "degraded_s"),
        "degraded_steps": sum(1 for r in final.values() if r["live"] < replicas),
        "rejoins": sum(1 for r in recs if r["event"] == "rejoin"),
        "checkpoint_save_s": statistics.median(ckpts) if ckpts else None,
        "checkpoints": len(ckpts),
        "checkpoint_load_s": statistics.median(loads) if loads else None,
        "final_loss": final[steps - 1]["loss"],
        "min_live": min(r.get("live", 0) for r in final.values()),
    }


def f_(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "-"


def _median(items: list[dict], key: str) -> float | None:
    values = [x[key] for x in items if x.get(key) is not None]
    return statistics.median(values) if values else None


def _param_diff(a_path: str, b_path: str) -> float:
    a, b = torch.load(a_path), torch.load(b_path)
    worst = 0.0
    for key, ref in b.items():
        diff = (a[key].double() - ref.double()).abs().max().item()
        worst = max(worst, diff / max(ref.double().abs().max().item(), 1e-12))
    return worst


def _table(rows: dict[str, dict], bases: tuple[str, ...] = ("ddp-torch", "ddp-uring")) -> str:
    lines = [
        f"| mode | wall s | effective mb/s | {' | '.join('vs ' + b for b in bases)} | lost steps | recomputed mb"
        " | fault -> step committed (median s) | fault -> replica training again (median s)"
        " | degraded steps | ckpt save / load s | max rel. param diff vs failure-free |",
        "|---|---|---|" + "---|" * len(bases) + "---|---|---|---|---|---|---|",
    ]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-"

    for mode, r in rows.items():
        ratios = " | ".join(
            f"{r['effective_mb_per_s'] / rows[b]['effective_mb_per_s']:.2f}x" if b in rows else "-" for b in bases
        )
        ck = " / ".join(f(r.get(k), ".3f") for k in ("checkpoint_save_s", "checkpoint_load_s"))
        ftc = f"{r['median_fault_to_commit_s']:.2f}" if r["faults"] else "-"
        lines.append(
            f"| {mode} | {r['wall_s']:.1f} | {r['effective_mb_per_s']:.2f} | {ratios} | "
            f"{r['lost_steps']} | {r['recomputed_microbatches']} | {ftc} | {f(r.get('median_restart_s'), '.1f')} | "
            f"{r.get('degraded_steps', 0)} | {ck} | {f(r.get('param_diff'), '.1e')} |"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    workdir = args.dir or tempfile.mkdtemp(prefix="lr-resilience-")
    os.makedirs(workdir, exist_ok=True)
    # the CLI's shared --steps defaults to 20 (for `bench overhead`); this benchmark's default is 40
    steps = args.steps if getattr(args, "steps", None) not in (None, 20) else DEFAULTS["steps"]
    kills = [(r, s) for r, s in DEFAULTS["kills"] if s < steps and r < args.replicas]
    replica_size = getattr(args, "replica_size", 1) or 1
    known = SHARDED_MODES if replica_size > 1 else MODES + EXTRA_MODES
    bases = ("hsdp-dcp",) if replica_size > 1 else ("ddp-torch", "ddp-uring")
    modes = [
        m for m in (getattr(args, "modes", None) or ",".join(known[:4] if replica_size > 1 else MODES)).split(",") if m
    ]
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise SystemExit(f"bench resilience: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    repeat = max(1, getattr(args, "repeat", 1) or 1)
    # under heavy load a 1 s heartbeat threshold can declare a slow replica dead (false suspicion);
    # only kills are injected here, so a generous threshold costs nothing (the CLI's shared default is 1.0)
    hb = args.heartbeat_timeout if args.heartbeat_timeout != 1.0 else 5.0
    cfg = {
        "replicas": args.replicas,
        "steps": steps,
        "microbatches": DEFAULTS["microbatches"],
        "mb_seconds": DEFAULTS["mb_seconds"],
        "kills": kills,
        "ckpt_every": DEFAULTS["ckpt_every"],
        "heartbeat_timeout": hb,
        "replica_size": replica_size,
    }
    print(f"resilience: {cfg}, modes {modes}, {repeat} repetition(s), in {workdir}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(repeat):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            out = os.path.join(workdir, f"{mode}-{rep}")
            r = run_mode(mode, out, **cfg)
            r["final_params"] = os.path.join(out, "final.pt")
            runs[mode].append(r)
            if mode == "failure-free" and r["min_live"] < args.replicas:
                print(
                    "  WARNING: a replica was declared dead in the failure-free run (false suspicion under load); "
                    "raise --heartbeat-timeout",
                    flush=True,
                )
            print(
                f"  {mode:12s} run {rep}: wall {r['wall_s']:.1f}s, {r['effective_mb_per_s']:.2f} mb/s, "
                f"lost steps {r['lost_steps']}, recomputed mb {r['recomputed_microbatches']}",
                flush=True,
            )
    rows = {}
    for mode, rs in runs.items():
        rs.sort(key=lambda r: r["wall_s"])
        rows[mode] = rs[len(rs) // 2]  # the median run by wall time
    if "failure-free" in rows:
        for mode, r in rows.items():
            r["param_diff"] = _param_diff(r["final_params"], rows["failure-free"]["final_params"])
    table = _table(rows, bases)
    print(table)
    for mode in rows:
        if mode.startswith("recover"):
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": cfg,
                    "machine": f"{os.cpu_count()} cores",
                    "time": time.ctime(),
                    "load_average": os.getloadavg(),
                    "rows": rows,
                    "runs": runs,
                    "table": table,
                },
                f,
                indent=2,
            )
    return 0
