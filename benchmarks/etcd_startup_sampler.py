"""Samples a running ``bench scale`` etcd run every 2 s: the members' CPU, their gRPC requests by method, the
workers' CPU, established TCP connections and the load average (one JSON object a line).

Started beside the harness, it waits for the run's cluster file (``DIR/etcd/cluster.json``) and ends when the
cluster's members are gone or after ``--seconds``::

    python -m lightning_recover.bench.scale --replicas 128 --backends etcd --dir /tmp/run ... &
    python benchmarks/etcd_startup_sampler.py /tmp/run out.jsonl

What it showed (benchmarks/LOG.md, "Session 32"): where a 128-replica start-up spends the 2 cores.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import ssl
import subprocess
import time

from lightning_recover.control_plane.etcd_client import tls_context
from lightning_recover.launch.process_tree import cpu_seconds, proc_stat


def grpc_started(endpoint: str, ctx: ssl.SSLContext) -> dict[str, float]:
    """etcd's ``grpc_server_started_total`` by method, from one member's /metrics."""
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=5)
    try:
        conn.request("GET", "/metrics")
        out: dict[str, float] = {}
        for line in conn.getresponse().read().decode().splitlines():
            if line.startswith("grpc_server_started_total"):
                method = re.search(r'grpc_method="(\w+)"', line)
                if method:
                    out[method.group(1)] = out.get(method.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
        return out
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=400.0)
    args = ap.parse_args()
    cluster_file = os.path.join(args.run_dir, "etcd", "cluster.json")
    began = time.monotonic()
    while not os.path.exists(cluster_file):
        if time.monotonic() - began > args.seconds:
            return
        time.sleep(0.2)
    time.sleep(1.0)  # the file is written before the members answer
    with open(cluster_file) as f:
        cluster = json.load(f)
    ctx = tls_context(cluster["tls"]["cacert"], cluster["tls"]["cert"], cluster["tls"]["key"])
    t0 = time.monotonic()
    with open(args.out, "w") as out:
        while time.monotonic() - t0 < args.seconds and any(proc_stat(m["pid"]) is not None for m in cluster["members"]):
            row: dict = {"t": round(time.monotonic() - t0, 1), "load": os.getloadavg()[0], "grpc": {}}
            for m in cluster["members"]:
                row[m["name"] + "_cpu"] = cpu_seconds(m["pid"])  # 0.0 once the member is gone
                try:
                    for k, v in grpc_started(m["endpoint"], ctx).items():
                        row["grpc"][k] = row["grpc"].get(k, 0.0) + v
                except OSError as e:
                    row[m["name"] + "_err"] = str(e)[:60]
            workers = subprocess.run(["pgrep", "-f", "scale_worker"], capture_output=True, text=True).stdout.split()
            row["workers_cpu"] = round(sum(cpu_seconds(int(p)) for p in workers), 1)
            ss = subprocess.run(["ss", "-tnH", "state", "established"], capture_output=True, text=True).stdout
            row["estab"] = len(ss.splitlines())
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(2.0)


if __name__ == "__main__":
    main()
