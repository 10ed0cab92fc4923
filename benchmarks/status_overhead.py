"""What the status page costs a job: step time with the monitor's status server on and scraped every second,
against the same job without it (paired, alternated).

Each pair runs the same job twice, in alternating order: ``lightning-recover run --replicas R`` of TinyGPT
(``lightning_recover.bench.fabric_gpt``), once plain and once with ``--status-address 127.0.0.1:0`` while a
scraper reads ``/metrics``, ``/status`` and ``/`` once a second (what Prometheus and an open page do). A job's
step time is the median of its replicas' per-step seconds after ``--warmup`` steps; a pair's ratio is on/off.
Run from the repository root (under the shared lock, the other benchmarks' convention)::

    flock /tmp/lr-slow.lock python -m benchmarks.status_overhead --pairs 5 --steps 60 --json benchmarks/results/status_overhead.json

``--inprocess``: the same pairing without a process start per run (for a machine where starting jobs takes
minutes): the protocol's in-process harness (tests/inprocess.py: a real coordinator and its monitor, replicas as
threads of one process), the monitor's board and server on and scraped every second, or off. Every thread
shares one interpreter there, the server's and the scraper's included: a harsher setting than processes.
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
import threading
import time
import urllib.request

_URL = re.compile(r"STATUS (http://\S+/)")


def _scrape(log: str, done: threading.Event, counts: dict) -> None:
    """Once a second: /metrics, /status and / (the page), as Prometheus and a browser would."""
    url = None
    while url is None and not done.wait(0.05):
        found = _URL.search(open(log).read())
        url = found.group(1) if found else None
    while url is not None and not done.wait(1.0):
        for path in ("metrics", "status", ""):
            try:
                with urllib.request.urlopen(url + path, timeout=5) as answer:
                    answer.read()
                counts["scrapes"] += 1
            except OSError:
                counts["failed"] += 1


def _job(status: bool, args: argparse.Namespace, work: str) -> dict:
    out = tempfile.mkdtemp(prefix="status-", dir=work)
    log = os.path.join(out, "job.log")
    cmd = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", str(args.replicas)]
    if status:
        cmd += ["--status-address", "127.0.0.1:0"]
    cmd += ["--", sys.executable, "-m", "lightning_recover.bench.fabric_gpt", "--out", out]
    cmd += ["--replicas", str(args.replicas), "--steps", str(args.steps), "--microbatches", str(args.microbatches)]
    cmd += ["--layers", str(args.layers), "--width", str(args.width)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LIGHTNING_RECOVER_INJECT", None)
    done, counts = threading.Event(), {"scrapes": 0, "failed": 0}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    scraper = threading.Thread(target=_scrape, args=(log, done, counts), daemon=True)
    if status:
        scraper.start()
    try:
        code = proc.wait(timeout=args.timeout)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if scraper.is_alive():
        scraper.join(10)
    if code != 0:
        raise RuntimeError(f"job failed ({code}):\n{open(log).read()[-3000:]}")
    seconds = []
    for name in os.listdir(out):
        if name.startswith("rank") and name.endswith(".json"):
            seconds += [r["seconds"] for r in json.load(open(os.path.join(out, name))) if r["step"] >= args.warmup]
    return {"status": status, "median_step_seconds": statistics.median(seconds), "steps": len(seconds), **counts}


def _inprocess(status: bool, args: argparse.Namespace) -> dict:
    """One in-process run: the median of replica 0's step times (between successive step starts)."""
    from unittest import mock

    from lightning_recover.observe.board import StatusBoard
    from lightning_recover.observe.status_server import StatusServer
    from lightning_recover.protocol.coordinator import Coordinator
    from tests.inprocess import Cluster

    starts: list[float] = []
    board = StatusBoard(args.replicas) if status else None
    server = StatusServer("127.0.0.1:0", board) if status else None
    done, counts = threading.Event(), {"scrapes": 0, "failed": 0}
    monitor = Coordinator.monitor
    patch = mock.patch.object(Coordinator, "monitor", lambda self, stop, board_=None: monitor(self, stop, board))
    try:
        with (
            patch,
            Cluster(
                args.replicas,
                steps=args.steps,
                microbatches=args.microbatches,
                before_step=lambda r, s: starts.append(time.perf_counter()) if r == 0 else None,
            ) as cluster,
        ):
            if server is not None:
                log = os.path.join(tempfile.mkdtemp(prefix="lr-status-inproc-"), "url")
                with open(log, "w") as f:
                    f.write(f"STATUS {server.url}\n")
                threading.Thread(target=_scrape, args=(log, done, counts), daemon=True).start()
            cluster.start()
            cluster.join(timeout=args.timeout)
    finally:
        done.set()
        if server is not None:
            server.close()
    steps = [b - a for a, b in zip(starts, starts[1:])][args.warmup :]
    return {"status": status, "median_step_seconds": statistics.median(steps), "steps": len(steps), **counts}


def cpu_cost(replicas: int, passes: int = 5000, scrapes: int = 300) -> dict:
    """``--cpu``: the CPU the status page adds, counted rather than timed against a noisy step: per monitor pass
    (the board's ``poll`` on what the monitor read, deaths read from a real TCPStore every READ_PERIOD) and per
    scrape of ``/metrics``, ``/status`` and ``/`` (rendering only, no socket), for ``replicas`` replicas."""
    import datetime

    from lightning_recover.observe.board import StatusBoard
    from lightning_recover.observe.page import render_page
    from lightning_recover.observe.report import step_report
    from lightning_recover.protocol.coordinator import init_keys, serve_store
    from lightning_recover.protocol.messages import JobSecret, Sealer

    sealer = Sealer(JobSecret.generate())
    store = serve_store("127.0.0.1", 0, datetime.timedelta(seconds=10))
    init_keys(store, sealer, replicas)
    board = StatusBoard(replicas)
    start, now = time.process_time(), time.monotonic()
    # A pass every 20 ms (the embedded monitor's period); every replica beats every 0.1 s (5 passes), with a step
    # committed in between: the monitor hands the board a new heartbeat object only when it opened a new beat.
    hbs: dict = {}
    beats: dict = {}
    for i in range(passes):
        if i % 5 == 0:
            hbs = {f"hb/{r}": (r, {"inc": 1, "beat": i, **step_report({}, 0, i // 5, 2, 6)}) for r in range(replicas)}
            beats = {f"hb/{r}": (1, i, now + 0.02 * i) for r in range(replicas)}
        board.poll(now + 0.02 * i, store, sealer, hbs, beats)
    per_pass = (time.process_time() - start) / passes
    start = time.process_time()
    for _ in range(scrapes):
        board.render_metrics()
        render_page(board.snapshot())
        json.dumps(board.snapshot())
    per_scrape = (time.process_time() - start) / scrapes
    # The monitor passes every 20 ms; a scraper (Prometheus) and an open page each read once a second.
    share = per_pass / 0.02 + per_scrape / 1.0
    return {"replicas": replicas, "cpu_per_pass_s": per_pass, "cpu_per_scrape_s": per_scrape, "core_share": share}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of each job's median")
    p.add_argument("--microbatches", type=int, default=6)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    p.add_argument("--inprocess", action="store_true", help="replicas as threads of one process (no process starts)")
    p.add_argument("--cpu", action="store_true", help="instead: the CPU per monitor pass and per scrape (counted)")
    args = p.parse_args()
    if args.cpu:
        result = {"benchmark": "status_overhead --cpu", "command": " ".join(sys.argv), "time": time.strftime("%F %T")}
        result["load_average"] = os.getloadavg()
        result["runs"] = [cpu_cost(r) for r in (args.replicas, 64, 1024)]
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    work = tempfile.mkdtemp(prefix="lr-status-bench-")
    pairs = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)  # alternate which runs first
        runs = {status: (_inprocess(status, args) if args.inprocess else _job(status, args, work)) for status in order}
        ratio = runs[True]["median_step_seconds"] / runs[False]["median_step_seconds"]
        pairs.append({"off": runs[False], "on": runs[True], "ratio": ratio, "first": "on" if order[0] else "off"})
        print(
            f"pair {i}: off {runs[False]['median_step_seconds']:.4f}s on {runs[True]['median_step_seconds']:.4f}s "
            f"ratio {ratio:.3f} ({runs[True]['scrapes']} scrapes)",
            flush=True,
        )
        _report(args, pairs)  # after every pair: a run cut short keeps what it measured
    return 0


def _report(args: argparse.Namespace, pairs: list[dict]) -> None:
    ratios = [pair["ratio"] for pair in pairs]
    result = {
        "benchmark": "status_overhead",
        "command": " ".join(sys.argv),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "load_average": os.getloadavg(),
        "args": vars(args),
        "pairs": pairs,
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
    }
    print(
        f"step time on/off: median {result['median_ratio']:.3f}x [{result['min_ratio']:.3f}-{result['max_ratio']:.3f}]"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
