"""A partition probe round at N replicas on one host: how long it takes, what it costs, and whether it stays right.

Real: the embedded coordinator (its TCPStore server and its monitor with the partition judge, in this process), and
per replica a ``ControlStore``, a ``Heartbeat`` and a ``ReachabilityResponder`` with its probe server, as a replica
runs them; the replicas are threads of ``--processes`` worker processes. Every replica's heartbeat says it waits on
its peers (phase ``reduce``) and makes no progress, so after ``suspect_after`` (the heartbeat timeout) the monitor
opens a probe round, as it does when a group stalls: every member probes the others (or a sample of them) and
reports.

Per N: the time from the first round's opening to the verdict and when each later round opened (the judge decides a
round once every member reported, or after its ``report_within``), the reports that came in the decided round, the
probes that got no answer in time (no evidence either way) and any link reported cut (a false cut fences a healthy
replica), the largest thread count of a worker process, and the CPU seconds of the workers and of this process (the
coordinator) from the first round's opening to the verdict. ``--cut-off R``: replica R's probe port refuses
connections (its data network cut while it still reaches the coordinator), so the right verdict fences R alone.

Run against a checkout to compare (its package is imported first: ``PYTHONPATH=ROOT``)::

    python benchmarks/probe_rounds.py --replicas 64,256,512 --json out.json
    PYTHONPATH=/tmp/before python benchmarks/probe_rounds.py --replicas 64,256,512 --json before.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import lightning_recover
from lightning_recover.launch.process_tree import cpu_seconds
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.messages import ControlStore, JobSecret

# Run by each worker process: argv = coordinator address, the job secret (hex), heartbeat interval, replica ids, the
# replica whose data network is cut (-1: none).
_WORKER = """
import sys
from lightning_recover.protocol.heartbeat import Heartbeat, Progress
from lightning_recover.protocol.messages import ControlStore, JobSecret
from lightning_recover.protocol.reachability import ReachabilityResponder
addr, secret, interval = sys.argv[1], JobSecret(bytes.fromhex(sys.argv[2])), float(sys.argv[3])
running = []
for r in map(int, sys.argv[4].split(",")):
    store = ControlStore(addr, r, secret, timeout=60.0)
    inc = store.add(f"inc/{r}", 1)
    progress = Progress()
    progress.note("reduce", 0)
    heartbeat = Heartbeat(store, r, inc, interval, progress)
    heartbeat.start()
    running.append((heartbeat, ReachabilityResponder(store, r, inc, interval)))
cut_off = int(sys.argv[5])
if cut_off in {int(r) for r in sys.argv[4].split(",")}:  # its data network cut: its probe port refuses connections
    import json, socket
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    store = ControlStore(addr, cut_off, secret, timeout=60.0)
    inc = int(store.add(f"inc/{cut_off}", 0))
    store.set(f"reach/addr/{cut_off}", json.dumps({"inc": inc, "host": "127.0.0.1", "port": closed.getsockname()[1]}))
print("ready", flush=True)
sys.stdin.read()
for heartbeat, responder in running:
    responder.close()
    heartbeat.stop()
"""


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def one_round(
    replicas: int, processes: int, heartbeat_timeout: float, interval: float, limit: float, cut_off: int = -1
) -> dict[str, Any]:
    secret = JobSecret.generate()
    coord = Coordinator("127.0.0.1", 0, replicas, heartbeat_timeout, secret, hang_timeout=3600.0)
    stop = threading.Event()
    monitor = threading.Thread(target=coord.monitor, args=(stop,), daemon=True)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR")
    workers = []
    try:
        for p in range(processes):
            ids = ",".join(str(r) for r in range(p, replicas, processes))
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER, coord.addr, secret.hex(), str(interval), ids, str(cut_off)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker process failed to start its replicas")
        store = ControlStore(coord.addr, 0, secret, timeout=60.0)
        monitor.start()
        began = time.monotonic()
        while store.add("reach/rounds", 0) == 0:
            if time.monotonic() - began > heartbeat_timeout + limit:
                raise RuntimeError("no probe round opened")
            time.sleep(0.01)
        opened = time.monotonic()
        cpu0 = {w.pid: cpu_seconds(w.pid) for w in workers}
        own0 = cpu_seconds(os.getpid())
        peak, number, opens = 0, 1, [0.0]
        while not store.has(f"reach/{number}/verdict"):  # a sampled round that found a cut opens another at once
            latest = store.add("reach/rounds", 0)
            if latest != number:
                number = latest
                opens.append(time.monotonic() - opened)
            peak = max([peak] + [_threads(w.pid) for w in workers])
            if time.monotonic() - opened > limit:
                break  # recorded as no verdict
            time.sleep(0.05)
        took = time.monotonic() - opened
        workers_cpu = sum(cpu_seconds(w.pid) - cpu0[w.pid] for w in workers)
        own_cpu = cpu_seconds(os.getpid()) - own0
        decided = store.get_genuine(f"reach/{number}/verdict")
        verdict = json.loads(decided) if decided is not None else {"keep": [], "fenced": {}}
        # each member of the decided round probed its sample, or (a round of every link) all the others
        peers = int(json.loads(store.get_genuine("reach/round")).get("sample") or 0) or replicas - 1
        reports = [store.get_genuine(f"reach/{number}/{r}") for r in range(replicas)]
        got = [json.loads(r) for r in reports if r is not None]
        reached = sum(len(r["reached"]) for r in got)
        cut = sum(len(r["cut"]) for r in got)
        dead = store.deaths(list(range(replicas)))
        return {
            "replicas": replicas,
            "processes": processes,
            "cut_off": cut_off,
            "rounds": number,
            "verdict": decided is not None,
            "round_s": took,
            "rounds_opened_s": opens,
            "peers_probed_each": peers,
            "reports": len(got),
            "probes_reached": reached,
            "probes_cut": cut,
            "probes_no_answer": len(got) * peers - reached - cut,
            "kept": len(verdict["keep"]),
            "fenced": sorted(int(r) for r in verdict["fenced"]),
            "declared_dead": sorted(r for r, inc in dead.items() if inc),
            "worker_threads_peak": peak,
            "workers_cpu_s": workers_cpu,
            "coordinator_cpu_s": own_cpu,
        }
    finally:
        stop.set()
        for w in workers:
            try:
                w.stdin.close()
            except OSError:
                pass
        for w in workers:
            try:
                w.wait(60)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        monitor.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="64,256,512")
    ap.add_argument("--processes", type=int, default=16)
    ap.add_argument("--heartbeat-timeout", type=float, default=10.0, help="also the judge's suspect_after")
    ap.add_argument("--interval", type=float, default=1.0, help="heartbeat interval")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds to wait for a verdict (then recorded as none)")
    ap.add_argument("--cut-off", type=int, default=-1, help="a replica whose probe port refuses connections (-1: none)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(lightning_recover.__file__)))
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    runs = []
    for n in (int(x) for x in args.replicas.split(",")):
        run = one_round(n, min(args.processes, n), args.heartbeat_timeout, args.interval, args.limit, args.cut_off)
        print(json.dumps(run), flush=True)
        runs.append(run)
    out = {"package": root, "commit": commit.stdout.strip(), "config": vars(args), "runs": runs}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
