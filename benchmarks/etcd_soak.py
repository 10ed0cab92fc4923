"""Soak: a job on a 3-member etcd whose writes cross a small space quota many times, for as long as asked.

    python benchmarks/etcd_soak.py --minutes 30 --json benchmarks/results/etcd_soak.json

A real job (``lightning-recover run``, 2 replicas of tests/scripts/fabric_train.py, steps enough to outlast
the soak) runs on a local 3-member TLS etcd started with ``--quota-backend-bytes`` (12 MiB by default) and
*without* etcd's own compaction, so that only the job's (the monitor role holder's ``Compactor``) keeps the
history down. A neighbour on the same cluster (another tenant's writes, under its own prefix) puts 2,000-byte
values at a fixed rate, so that the cluster's writes cross the quota many times whatever the job's own rate.
Every 5 s the soak records etcd's revision, database size and alarms; at the end it checks that the job is
still training (its replicas' step logs grew in the last minute), that its log names no lost control plane
and that etcd never raised NOSPACE, then ends the job. Without the job's compaction the first crossing stops
every write (tests/integration/test_etcd_production.py shows the same writes failing at a 1 MiB quota).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_recover.control_plane import etcd_client as ec  # noqa: E402
from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster  # noqa: E402
from lightning_recover.errors import RecoverError  # noqa: E402
from lightning_recover.protocol.messages import JobSecret  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "scripts", "fabric_train.py")


class Neighbour(threading.Thread):
    """Another tenant: puts ``size``-byte values under its own prefix, ``rate`` per second."""

    def __init__(self, cluster: LocalEtcdCluster, rate: float, size: int) -> None:
        super().__init__(name="soak-neighbour", daemon=True)
        self.client = ec.EtcdClient(cluster.endpoints, **cluster.tls_files)
        self.rate, self.value = rate, os.urandom(size)
        self.puts, self.failures = 0, []
        self.stop = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.is_set():
            try:
                self.client.put(b"/soak-neighbour/%d" % (self.puts % 64), self.value)
                self.puts += 1
            except RecoverError as exc:  # NOSPACE above all: recorded, the soak reports it
                self.failures.append(f"{time.monotonic() - start:.1f}s: {exc}"[:300])
                self.stop.wait(1.0)
            self.stop.wait(max(0.0, start + self.puts / self.rate - time.monotonic()))


def _steps(out: str) -> int:
    total = 0
    for name in os.listdir(out):
        if name.startswith("steps") and name.endswith(".log"):
            with open(os.path.join(out, name)) as f:
                total += len(f.read().split())
    return total


def _alarms(client: ec.EtcdClient) -> list:
    return client.request("maintenance/alarm", {"action": "GET"}).get("alarms") or []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--quota-bytes", type=int, default=12 << 20)
    parser.add_argument("--neighbour-rate", type=float, default=40.0, help="the neighbour's puts per second")
    parser.add_argument("--neighbour-bytes", type=int, default=2000)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="etcd-soak-")
    cluster = LocalEtcdCluster(
        os.path.join(work, "etcd"), 3, quota_backend_bytes=args.quota_bytes, auto_compaction=None
    )
    cluster.start(timeout=120)
    out = os.path.join(work, "run")
    os.makedirs(out)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **cluster.environment())
    env["LIGHTNING_RECOVER_SECRET_FILE"] = JobSecret.generate().write_file(work)
    argv = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "2", "--heartbeat-timeout", "5"]
    argv += ["--job", f"soak-{os.getpid()}", "--", sys.executable, SCRIPT, out, "--replicas", "2"]
    argv += ["--steps", "1000000", "--microbatches", "4", "--work", "0.05", "--heartbeat-timeout", "5"]
    log_path = os.path.join(work, "job.log")
    log = open(log_path, "w")
    job = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    client = ec.EtcdClient(cluster.endpoints, **cluster.tls_files)
    neighbour = Neighbour(cluster, args.neighbour_rate, args.neighbour_bytes)
    samples: list[dict] = []
    started = time.monotonic()
    try:
        first_revision = int(client.status()["header"]["revision"])
        began = None  # when the job started training (and the neighbour began writing)
        while job.poll() is None and (began is None or time.monotonic() - began < args.minutes * 60):
            time.sleep(5.0)
            if began is None and os.path.exists(os.path.join(out, "started")):
                began = time.monotonic()
                neighbour.start()
            if began is None and time.monotonic() - started > 600:
                raise SystemExit("the job did not start within 10 minutes")
            status = client.status()
            samples.append(
                {
                    "t": round(time.monotonic() - (began or started), 1),
                    "training": began is not None,
                    "revision": int(status["header"]["revision"]),
                    "db_bytes": int(status["dbSize"]),
                    "db_in_use_bytes": int(status.get("dbSizeInUse") or 0),
                    "alarms": _alarms(client),
                    "steps": _steps(out),
                }
            )
            print(json.dumps(samples[-1]), flush=True)
        minute_ago = [s["steps"] for s in samples if s["training"] and s["t"] <= samples[-1]["t"] - 60]
        training = job.poll() is None and bool(minute_ago) and samples[-1]["steps"] > minute_ago[-1]
    finally:
        neighbour.stop.set()
        if neighbour.is_alive():
            neighbour.join(10)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        log.close()
        client.close()
        cluster.stop()
    text = open(log_path, errors="replace").read()
    written = neighbour.puts * args.neighbour_bytes
    result = {
        "minutes": round((samples[-1]["t"] if samples else 0) / 60, 2),
        "quota_bytes": args.quota_bytes,
        "neighbour_puts": neighbour.puts,
        "neighbour_bytes": written,
        "quota_crossings_by_neighbour": round(written / args.quota_bytes, 1),
        "revisions": (samples[-1]["revision"] - first_revision) if samples else 0,
        "db_bytes_max": max((s["db_bytes"] for s in samples), default=0),
        "nospace_alarms": sum(1 for s in samples if s["alarms"]),
        "neighbour_failures": neighbour.failures[:5],
        "job_steps": samples[-1]["steps"] if samples else 0,
        "job_training_at_end": training,
        "job_lost_control_plane": "CoordinatorLostError" in text or "EtcdNoSpace" in text,
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = training and not result["nospace_alarms"] and not neighbour.failures and not result["job_lost_control_plane"]
    print("soak:", "passed" if ok else f"FAILED (job log: {log_path})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
