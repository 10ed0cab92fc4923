"""Benchmarks of elasticity: leaving on a notice against a kill, and a job that grows.

    python -m benchmarks.elastic --repeat 3 --json benchmarks/results/elastic.json

``notice``: 4 replicas of TinyGPT (fabric_gpt.py); replica 1 gets its notice signal in the backward of step S
(it leaves at S's commit), and, in the job run just before or after it, is SIGKILLed at the same point. The
*stall* of each is the survivors' longest step from the fault on (the notice: the first step planned without the
leaver, which includes the regroup; the kill: the step it died in, with detection, regroup and the recompute of
its microbatches) minus the median of the steps after it with the same live replicas. Target: the notice's stall
<= 0.05 s.

``growth``: replicas=2:4 on the embedded coordinator with a padded compute (``--sleep`` seconds per microbatch,
a stand-in for a replica's own accelerator on a 2-core host); replicas 0 and 1 train, 2 and 3 start at once and
ask to join while the members wait before step G; they are admitted at G's commit. Microbatches per second
after the growth over before (target >= 1.8x), the newcomers' first step with their microbatches after their
state arrived (in steps; target <= 1), and the state transfer's speed against this host's loopback TCP
bandwidth (measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from lightning_recover import env
from lightning_recover.bench.recovery import gpt_job
from lightning_recover.launch import coordinator_process
from lightning_recover.protocol.messages import JobSecret

HEARTBEAT_TIMEOUT = 5.0  # the growth job's
_FAULT_AT = re.compile(r"injecting fault (\S+) at t=([0-9.]+)")
_GPT = [sys.executable, "-m", "lightning_recover.bench.fabric_gpt"]


def _run(args: list[str], out: str, inject: str, timeout: float = 900, attempts: int = 3) -> tuple[str, str]:
    """One fabric_gpt job; started again (into a fresh directory) when it failed to start on a host too loaded
    for the coordinator's or the fork server's start-up bounds, at most ``attempts`` times."""
    for attempt in range(attempts):
        try:
            where = out if attempt == 0 else f"{out}.retry{attempt}"
            return where, gpt_job(args, where, inject, timeout)
        except RuntimeError as exc:
            if "did not start within" not in str(exc) or attempt == attempts - 1:
                raise
            print(f"  (the job did not start: {str(exc).strip().splitlines()[-1]}; again)", flush=True)
    raise AssertionError("unreachable")


def _records(out: str) -> dict[int, list[dict]]:
    found = {}
    for name in os.listdir(out):
        if name.startswith("rank") and name.endswith(".json"):
            found[int(name[4:-5])] = json.load(open(os.path.join(out, name)))
    return found


def stall(records: dict[int, list[dict]], first: int) -> dict[str, float]:
    """The survivors' step ``first`` beyond a normal step: its longest duration over the survivors, minus the
    median duration of the later steps (the same live replicas)."""
    longest = max(r["seconds"] for recs in records.values() for r in recs if r["step"] == first)
    normal = statistics.median(r["seconds"] for recs in records.values() for r in recs if r["step"] > first)
    return {"step_s": longest, "normal_step_s": normal, "stall_s": longest - normal}


#: The notice/kill jobs' model: small, so that a step is tens of milliseconds and a stall of that order shows
#: above a loaded host's noise (TinyGPT's default size took seconds per step here).
SMALL = ["--layers", "1", "--width", "32", "--block-size", "32", "--batch-size", "4"]


def notice_vs_kill(repeat: int, workdir: str, step: int = 3, steps: int = 14, microbatches: int = 8) -> list[dict]:
    rows = []
    args = ["--replicas", "4", "--steps", str(steps), "--microbatches", str(microbatches), *SMALL]
    for i in range(repeat):
        for kind in ("notice", "kill") if i % 2 == 0 else ("kill", "notice"):  # neither always runs first
            out = os.path.join(workdir, f"{kind}{i}")
            out, log = _run(args, out, f"{kind}:replica=1:step={step}:phase=backward")
            fault_at = float(_FAULT_AT.search(log).group(2))
            records = _records(out)
            assert sorted(records) == [0, 2, 3], f"survivors {sorted(records)}"
            # The notice: the leaver commits step S; the first step without it is S + 1. The kill: step S.
            first = step + 1 if kind == "notice" else step
            row = {"kind": kind, "run": i, **stall(records, first)}
            row["fault_to_commit_s"] = (
                max(r["committed_at"] for recs in records.values() for r in recs if r["step"] == first) - fault_at
            )
            row["recomputed"] = sum(r["recomputed"] for recs in records.values() for r in recs)
            # The regroup the survivors timed at the step boundary (the notice; none for a kill)
            row["boundary_regroup_s"] = max(
                r.get("boundary_regroup_s", 0.0) for recs in records.values() for r in recs if r["step"] == first
            )
            rows.append(row)
            print(
                f"  {kind:6s} run {i}: step {first} {row['step_s'] * 1000:.0f} ms, normal {row['normal_step_s'] * 1000:.0f} "
                f"ms, stall {row['stall_s'] * 1000:.0f} ms (boundary regroup {row['boundary_regroup_s'] * 1000:.0f} ms), "
                f"recomputed {row['recomputed']}",
                flush=True,
            )
    return rows


def loopback_bandwidth(nbytes: int = 256 << 20, chunk: int = 1 << 20) -> float:
    """Bytes per second through one TCP connection on 127.0.0.1 (a sender thread, this thread receives)."""
    server = socket.create_server(("127.0.0.1", 0))
    block = b"\0" * chunk

    def send() -> None:
        with socket.create_connection(server.getsockname()) as s:
            for _ in range(nbytes // chunk):
                s.sendall(block)

    sender = threading.Thread(target=send, daemon=True)
    began = time.perf_counter()
    sender.start()
    conn, _ = server.accept()
    buf = bytearray(chunk)
    got = 0
    with conn:
        while got < nbytes:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
    seconds = time.perf_counter() - began
    sender.join(10)
    server.close()
    return got / seconds


def _wait_for(predicate, procs: dict, log: str, limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs.values()):
            raise RuntimeError("the growth job did not get there:\n" + open(log).read()[-3000:])
        time.sleep(0.05)


def growth(workdir: str, sleep: float, microbatches: int = 16, gate_step: int = 6, steps: int = 16) -> dict:
    """One job of replicas=2:4 grown at ``gate_step`` (see the module docstring)."""
    out = os.path.join(workdir, "growth")
    os.makedirs(out, exist_ok=True)
    secret_file = JobSecret.generate().write_file(workdir)
    # A generous heartbeat timeout: a loaded host must not declare a member dead while the job waits (measured:
    # 1 s was missed under load 40); growth is what is measured here, not failure detection.
    coord = coordinator_process.start(4, HEARTBEAT_TIMEOUT, secret_file=secret_file, timeout=300)
    gate = os.path.join(workdir, "gate")
    args = ["--out", out, "--replicas", "4", "--steps", str(steps), "--microbatches", str(microbatches)]
    args += [
        "--sleep",
        str(sleep),
        "--hold",
        f"{gate_step}:{gate}",
        "--heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT),
        *SMALL,
    ]
    procs, logs = {}, {}
    try:
        for r in range(4):
            environ = dict(os.environ, OMP_NUM_THREADS="1")
            environ.pop(env.INJECT, None)
            environ.update({env.COORDINATOR: coord.addr, env.SECRET_FILE: secret_file, env.REPLICAS: "2:4"})
            environ[env.REPLICA] = str(r)
            logs[r] = os.path.join(workdir, f"replica{r}.log")
            with open(logs[r], "wb") as f:
                procs[r] = subprocess.Popen(
                    [*_GPT, *args], env=environ, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
            if r == 1:  # newcomers only once generation 0 formed with the members and trained a step
                _wait_for(lambda: os.path.exists(os.path.join(out, "started0")), procs, logs[0])
        _wait_for(lambda: all("asks to join" in open(logs[r]).read() for r in (2, 3)), procs, logs[2])
        gate_at = time.time()
        open(gate, "w").close()
        for r, p in procs.items():
            if p.wait(timeout=900) != 0:
                raise RuntimeError(f"replica {r} failed:\n" + open(logs[r]).read()[-3000:])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        coord.stop()
    records = _records(out)
    base = records[0]
    before = [microbatches / r["seconds"] for r in base if 0 < r["step"] < gate_step and r["live"] == 2]
    after = [microbatches / r["seconds"] for r in base if r["step"] > gate_step + 1 and r["live"] == 4]
    normal4 = statistics.median(r["seconds"] for r in base if r["step"] > gate_step + 1)
    joiners = []
    for r in (2, 3):
        timing = json.load(open(os.path.join(out, f"join{r}.txt")))
        first = records[r][0]
        started_at = first["committed_at"] - first["seconds"]
        joiners.append(
            {
                "replica": r,
                "first_step": first["step"],
                "first_step_live": first["live"],
                "asked_to_state_s": timing["state_at"] - max(timing["asked_at"], gate_at),
                "state_to_first_step_done_s": first["committed_at"] - timing["state_at"],
                "state_to_first_step_done_steps": (first["committed_at"] - timing["state_at"]) / normal4,
                "state_to_first_step_start_s": started_at - timing["state_at"],
                "transfer_s": timing["transfer_s"],
                "state_bytes": timing["state_bytes"],
                "transfer_bytes_per_s": timing["state_bytes"] / timing["transfer_s"],
            }
        )
    loopback = loopback_bandwidth()
    return {
        "sleep_per_microbatch_s": sleep,
        "microbatches": microbatches,
        "gate_step": gate_step,
        "mb_per_s_before": statistics.median(before),
        "mb_per_s_after": statistics.median(after),
        "growth_ratio": statistics.median(after) / statistics.median(before),
        "live_by_step": [r["live"] for r in base],
        "joiners": joiners,
        "loopback_bytes_per_s": loopback,
        "transfer_vs_loopback": min(j["transfer_bytes_per_s"] for j in joiners) / loopback,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="notice/kill pairs")
    p.add_argument("--sleep", type=float, default=0.1, help="growth: padded compute, seconds per microbatch")
    p.add_argument("--skip", choices=["notice", "growth"], default=None)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="lr-bench-elastic-")
    os.makedirs(workdir, exist_ok=True)
    report: dict = {"machine": f"{os.cpu_count()} cores", "time": time.ctime()}
    if args.skip != "notice":
        rows = notice_vs_kill(args.repeat, workdir)
        for kind in ("notice", "kill"):
            mine = [r for r in rows if r["kind"] == kind]
            report[f"{kind}_stall_s_median"] = statistics.median(r["stall_s"] for r in mine)
            report[f"{kind}_recomputed"] = [r["recomputed"] for r in mine]
            report[f"{kind}_boundary_regroup_s_median"] = statistics.median(r["boundary_regroup_s"] for r in mine)
        report["notice_vs_kill"] = rows
        print(
            f"stall beyond a normal step: notice {report['notice_stall_s_median'] * 1000:.0f} ms, kill "
            f"{report['kill_stall_s_median'] * 1000:.0f} ms (medians of {args.repeat})",
            flush=True,
        )
    if args.skip != "growth":
        report["growth"] = g = growth(workdir, args.sleep)
        print(
            f"growth 2 -> 4: {g['mb_per_s_before']:.1f} -> {g['mb_per_s_after']:.1f} microbatches/s "
            f"({g['growth_ratio']:.2f}x); newcomers' first step done "
            f"{max(j['state_to_first_step_done_steps'] for j in g['joiners']):.2f} steps after their state arrived; "
            f"state transfer {min(j['transfer_bytes_per_s'] for j in g['joiners']) / 1e6:.0f} MB/s, loopback "
            f"{g['loopback_bytes_per_s'] / 1e6:.0f} MB/s",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
