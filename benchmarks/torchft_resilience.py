"""torchft beside this project under ``bench resilience``'s failure schedule: the ``torchft`` mode.

    python -m benchmarks.torchft_resilience --modes recover,torchft,failure-free --heartbeat-timeout 1.0 \\
        --repeat 3 --json benchmarks/results/bench_torchft.json

Takes the options of ``lightning-recover bench resilience`` and runs its driver with one mode more,
``torchft`` (only when ``--modes`` names it; skipped with a message when torchft is not installed:
``pip install torchft==0.2.0``): torchft 0.2.0, the same schedule; each replica is one torchft replica
group of one process restarted by its own loop, the lighthouse is hosted by this driver on 127.0.0.1
(``torchft_train.py`` holds its training job and what it does and does not use). A peer's harness: it
lives in the repository's ``benchmarks/``, not in the installed package.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

from lightning_recover.bench import resilience
from lightning_recover.bench.resilience import (
    BATCH,
    FAULT_T,
    MODEL,
    ExtraMode,
    f_,
    fmt_e,
    job_env,
    median_of,
    records,
)
from lightning_recover.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchft_available() -> str | None:
    """None if torchft can be imported, else why not (the ``torchft`` mode is then skipped)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust servers log every quorum at info
    try:
        import torchft  # noqa: F401
        from torchft._torchft import LighthouseServer  # noqa: F401
    except Exception as exc:  # ImportError, or a build that does not match this torch
        return f"{type(exc).__name__}: {exc}"
    return None


def run_torchft(
    out: str,
    *,
    replicas: int,
    steps: int,
    microbatches: int,
    mb_seconds: float,
    kills: list[tuple[int, int]],
    heartbeat_timeout: float,
    collective_timeout: float = 10.0,
    grace: float = 30.0,
    timeout: float = 1800,
    **_: object,  # the other modes' settings (checkpoints, shards, standbys) do not apply to torchft
) -> dict:
    """torchft 0.2.0 under the same schedule: the driver hosts the lighthouse (127.0.0.1, a free
    port) and runs one restart loop per replica (each replica = one replica group of one process,
    restarted up to ``len(kills)`` times after a non-zero exit, as a per-replica ``torchrun
    --max-restarts`` would). The lighthouse declares a replica dead after ``heartbeat_timeout``
    seconds without a heartbeat and waits as long for heartbeating replicas that have not asked to
    join (``join_timeout_ms``); the Manager's and gloo's timeout is ``collective_timeout``."""
    from torchft._torchft import LighthouseServer

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    hb_ms = int(heartbeat_timeout * 1000)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=hb_ms, quorum_tick_ms=100, heartbeat_timeout_ms=hb_ms
    )
    port = int(lighthouse.address().rsplit(":", 1)[1])  # it names the host by hostname; it listens on 127.0.0.1
    env = job_env()
    # the replicas run `-m benchmarks.torchft_train`: the repository's root on their path, wherever this runs
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    common = ["--replicas", str(replicas), "--steps", str(steps), "--microbatches", str(microbatches)]
    common += ["--mb-seconds", str(mb_seconds), "--out", out, "--lighthouse", f"http://127.0.0.1:{port}"]
    common += ["--kill", ",".join(f"{r}:{s}" for r, s in kills), "--timeout", str(collective_timeout)] + MODEL
    restarts = len(kills)
    done = threading.Event()
    procs: dict[int, subprocess.Popen] = {}
    lock = threading.Lock()
    codes: dict[int, list[int]] = {r: [] for r in range(replicas)}

    def loop(r: int) -> None:
        with open(os.path.join(out, f"replica{r}.log"), "wb") as f:
            for incarnation in range(1, restarts + 2):
                cmd = [sys.executable, "-m", "benchmarks.torchft_train", "--replica", str(r)]
                cmd += ["--incarnation", str(incarnation)] + common
                with lock:
                    if done.is_set():
                        return
                    procs[r] = subprocess.Popen(
                        cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                    )
                code = procs[r].wait()
                codes[r].append(code)
                if code == 0 or done.is_set():
                    return

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in range(replicas)]
    t0 = time.time()
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        # the run is over when one replica has committed the last step (it writes DIR/done) or
        # every restart loop has ended; then the others get `grace` seconds to finish theirs
        while not os.path.exists(os.path.join(out, "done")) and any(t.is_alive() for t in threads):
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchft did not finish within {timeout}s; see {out}/replica*.log")
            time.sleep(0.1)
        grace_end = time.monotonic() + grace
        while any(t.is_alive() for t in threads) and time.monotonic() < grace_end:
            time.sleep(0.1)
    finally:
        with lock:
            done.set()
            for proc in procs.values():
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the replica's own session, by its leader's pid
                except ProcessLookupError:
                    pass
                proc.wait()
        for t in threads:
            t.join(timeout=10)
        lighthouse.shutdown()
    total = time.time() - t0
    output = "".join(open(os.path.join(out, f"replica{r}.log"), errors="replace").read() for r in range(replicas))
    with open(os.path.join(out, "job.log"), "w") as f:
        f.write(output)
    finals = sorted(glob.glob(os.path.join(out, "final*.pt")))
    if not finals:
        raise RuntimeError(f"torchft: no replica finished the run (exit codes {codes}):\n{output[-3000:]}")
    shutil.copy(finals[0], os.path.join(out, "final.pt"))
    result = analyze_torchft(out, output, steps=steps, microbatches=microbatches, replicas=replicas)
    result.update(job_s=total, exit_codes=codes, heartbeat_timeout_ms=hb_ms, join_timeout_ms=hb_ms)
    result["collective_timeout_s"] = collective_timeout
    return result


def analyze_torchft(out: str, output: str, *, steps: int, microbatches: int, replicas: int) -> dict:
    """Throughput and recovery of a torchft run from its records (see torchft_train.py)."""
    recs = records(out)
    step_recs = [r for r in recs if r["event"] == "step"]
    committed = [r for r in step_recs if r["committed"]]
    faults = sorted(((m.group(1), float(m.group(2))) for m in FAULT_T.finditer(output)), key=lambda f: f[1])
    # one commit per step index (every participant logs it; they agree on participants)
    final: dict[int, dict] = {}
    for r in committed:
        final.setdefault(r["step"], r)
    if sorted(final) != list(range(steps)):
        raise RuntimeError(f"torchft: committed steps {sorted(final)} != 0..{steps - 1}")
    first = min(r["start"] for r in step_recs if r["incarnation"] == 1)
    last = max(r["commit"] for r in committed if r["step"] == steps - 1)
    wall = last - first
    per_replica = microbatches // replicas
    applied_mb = [final[s]["participants"] * per_replica for s in range(steps)]
    dropped: dict[int, int] = {}
    for r in step_recs:
        if not r["committed"]:
            dropped[r["rank"]] = dropped.get(r["rank"], 0) + 1
    recoveries = []
    for spec, t in faults:
        step = int(re.search(r"step=(\d+)", spec).group(1))
        victim = int(re.search(r"replica=(\d+)", spec).group(1))
        # the survivors' next commit of the interrupted step (or a later one); a survivor may still
        # be committing the step before it when the kill lands, which does not count
        after = [r["commit"] for r in committed if r["commit"] > t and r["step"] >= step]
        item = {"fault": spec, "fault_t": t - first, "step": step}
        item["fault_to_commit_s"] = (min(after) - t) if after else None
        later = [r for r in recs if r["rank"] == victim and r.get("incarnation", 1) > 1]
        starts = [r["t"] for r in later if r["event"] == "start" and r["t"] > t]
        joined = [r for r in later if r["event"] == "step" and r["committed"] and r["start"] > t]
        if starts:
            item["process_restart_s"] = min(starts) - t
        if joined:
            # healed: the first committed step of the new incarnation (it received the state at that quorum);
            # participating: the first step it contributes a gradient to
            item["restart_s"] = min(r["commit"] for r in joined) - t
            item["rejoin_step"] = min(r["step"] for r in joined)
            if starts:
                item["rejoin_s"] = item["restart_s"] - item["process_restart_s"]
            part = [r["commit"] for r in joined if r["participating"]]
            item["participating_s"] = (min(part) - t) if part else None
        full = [r["commit"] for s, r in final.items() if s > step and r["participants"] >= replicas]
        item["degraded_s"] = (min(full) - t) if full else None
        recoveries.append(item)
    return {
        "mode": "torchft",
        "steps": steps,
        "wall_s": wall,
        "effective_mb_per_s": sum(applied_mb) / wall,  # microbatches applied (only the participants')
        "steps_per_s": steps / wall,
        "applied_microbatches": sum(applied_mb),
        "applied_mb_per_step": applied_mb,
        "samples_per_step": {"min": min(applied_mb) * BATCH, "max": max(applied_mb) * BATCH},
        "mean_samples_per_step": sum(applied_mb) * BATCH / steps,
        "faults": len(faults),
        "lost_steps": max(dropped.values()) if dropped else 0,
        "dropped_attempts": dropped,
        "lost_microbatches": None,
        "recomputed_microbatches": 0,
        "recoveries": recoveries,
        "median_fault_to_commit_s": statistics.median(
            [x["fault_to_commit_s"] for x in recoveries if x["fault_to_commit_s"] is not None] or [0.0]
        ),
        "median_restart_s": median_of(recoveries, "restart_s"),
        "median_process_restart_s": median_of(recoveries, "process_restart_s"),
        "median_rejoin_s": median_of(recoveries, "rejoin_s"),
        "median_degraded_s": median_of(recoveries, "degraded_s"),
        "degraded_steps": sum(1 for r in final.values() if r["participants"] < replicas),
        "rejoins": sum(1 for r in recs if r["event"] == "step" and r.get("healed")),
        "final_loss": final[steps - 1]["loss"],
        "min_live": min(r["participants"] for r in final.values()),
    }


def torchft_table(rows: dict[str, dict], cfg: dict) -> str:
    """torchft side by side: what a step applies, what is dropped, how fast a kill is absorbed."""
    M = cfg["microbatches"]
    lines = [
        "| mode | wall s | microbatches applied / s | steps / s | samples per step (min-max, mean) | steps dropped"
        " | kill -> next commit (median s) | kill -> restarted replica trains (median s) | process start -> rejoined"
        " (median s) | max abs param diff vs failure-free | max rel. param diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in rows.items():
        if mode == "torchft":
            sp = r["samples_per_step"]
            samples = f"{sp['min']}-{sp['max']}, {r['mean_samples_per_step']:.1f}"
        else:  # every committed step of recover / the DDP baselines covers all M microbatches
            samples = f"{M * BATCH}"
        ftc = f"{r['median_fault_to_commit_s']:.2f}" if r["faults"] else "-"
        lines.append(
            f"| {mode} | {r['wall_s']:.1f} | {r['effective_mb_per_s']:.2f} | {r['steps'] / r['wall_s']:.2f} | "
            f"{samples} | {r['lost_steps']} | {ftc} | {f_(r.get('median_restart_s'))} | "
            f"{f_(r.get('median_rejoin_s'))} | {fmt_e(r.get('param_absdiff'))} | {fmt_e(r.get('param_diff'))} |"
        )
    return "\n".join(lines)


def select_torchft(args: argparse.Namespace) -> dict[str, ExtraMode]:
    """The ``torchft`` mode when ``--modes`` names it and torchft imports; otherwise it is dropped from
    ``args.modes`` with a message (the other modes still run)."""
    modes = [m for m in (args.modes or "").split(",") if m]
    if "torchft" not in modes:
        return {}
    why = torchft_available()
    if why is None:
        return {"torchft": ExtraMode(run=run_torchft, table=torchft_table)}
    print(
        f"bench resilience: skipping the torchft mode: torchft is not importable ({why}); "
        "install it with pip install torchft==0.2.0",
        flush=True,
    )
    args.modes = ",".join(m for m in modes if m != "torchft")
    return {}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(["bench", "resilience", *(sys.argv[1:] if argv is None else argv)])
    return resilience.main(args, select_torchft(args))


if __name__ == "__main__":
    sys.exit(main())
