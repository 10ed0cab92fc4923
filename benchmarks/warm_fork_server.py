"""A short job started cold (the job's own fork server) against one started from a warm fork server, paired.

    python -m benchmarks.warm_fork_server --pairs 5 --json benchmarks/results/warm_fork_server.json

The job is ``tests/scripts/fabric_train.py`` (Fabric, strategy="recover", a tiny model) for a few steps under
``lightning-recover run --replicas 2``: the size of a test of this project or of a short experiment, where start-up
is most of the time. Measured per job: wall time from the launcher's start to its exit, and the CPU the
whole machine spent meanwhile (busy jiffies of /proc/stat: the forked processes are the warm server's descendants,
not the launcher's, so the launcher's own rusage would miss them). Run it on an otherwise quiet host.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FABRIC_SCRIPT = os.path.join(ROOT, "tests", "scripts", "fabric_train.py")


def busy_seconds() -> float:
    """Seconds of CPU the whole machine has spent (user, nice, system, irq, softirq, steal) since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def one_job(env: dict[str, str], steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "2", "--"]
        cmd += [sys.executable, FABRIC_SCRIPT, out, "--replicas", "2", "--steps", str(steps)]
        cpu0, t0 = busy_seconds(), time.monotonic()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        wall, cpu = time.monotonic() - t0, busy_seconds() - cpu0
        if done.returncode != 0:
            raise RuntimeError(f"the job failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        warm = "from the warm fork server" in done.stderr
        return {"wall_s": wall, "cpu_s": cpu, "warm": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    base = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", PYTHONPATH=ROOT)
    base.pop("LIGHTNING_RECOVER_FORK_SERVER", None)
    sock_dir = tempfile.mkdtemp(prefix="lr-warm-bench-")
    sock = os.path.join(sock_dir, "s.sock")
    log = open(os.path.join(sock_dir, "server.log"), "w+")
    cmd = [sys.executable, "-m", "lightning_recover.cli", "fork-server", "--socket", sock, "--exit-with-parent"]
    server_started = time.monotonic()
    server = subprocess.Popen(cmd, env=base, stdout=log, stderr=subprocess.STDOUT)
    try:
        while "warm at" not in open(log.name).read():
            if server.poll() is not None:
                raise RuntimeError(open(log.name).read())
            time.sleep(0.05)
        warm_up = time.monotonic() - server_started
        cold, warm = [], []
        for _ in range(args.pairs):
            cold.append(one_job(base, args.steps))
            warm.append(one_job(dict(base, LIGHTNING_RECOVER_FORK_SERVER=sock), args.steps))
            assert warm[-1]["warm"] and not cold[-1]["warm"], "each job started as intended"
            print(
                f"cold {cold[-1]['wall_s']:.2f} s / {cold[-1]['cpu_s']:.2f} s CPU; "
                f"warm {warm[-1]['wall_s']:.2f} s / {warm[-1]['cpu_s']:.2f} s CPU",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(timeout=30)

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    result = {
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "job": f"lightning-recover run --replicas 2 -- python tests/scripts/fabric_train.py OUT --replicas 2 --steps {args.steps}",
        "server_warm_up_s": warm_up,
        "cold": cold,
        "warm": warm,
        "median_wall_s": {"cold": med(cold, "wall_s"), "warm": med(warm, "wall_s")},
        "median_cpu_s": {"cold": med(cold, "cpu_s"), "warm": med(warm, "cpu_s")},
        "paired_wall_ratio_median": statistics.median(w["wall_s"] / c["wall_s"] for c, w in zip(cold, warm)),
        "paired_cpu_ratio_median": statistics.median(w["cpu_s"] / c["cpu_s"] for c, w in zip(cold, warm)),
        "load_average_at_end": os.getloadavg(),
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("cold", "warm")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
