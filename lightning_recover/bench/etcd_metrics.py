"""What a local etcd cluster reports and sustains: its ``/metrics`` counters, its members' CPU and the puts per
second it takes (``bench scale`` reads them around its runs; the etcd research benchmarks in ``benchmarks/``
reuse them)."""

from __future__ import annotations

import http.client
import threading
import time

from lightning_recover.control_plane.etcd_client import EtcdClient, tls_context
from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster
from lightning_recover.launch.process_tree import cpu_seconds

#: counters read from every member's /metrics and summed over the members that answer
METRICS = (
    "etcd_server_proposals_committed_total",
    "etcd_mvcc_put_total",
    "etcd_mvcc_txn_total",
    "etcd_mvcc_range_total",
    "etcd_mvcc_delete_total",
    "etcd_debugging_mvcc_events_total",
)
#: elections each member saw (the largest count of the members that answer; not summed)
LEADER_CHANGES = "etcd_server_leader_changes_seen_total"


def metrics(cluster: LocalEtcdCluster, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """etcd's counters, summed over the members that answer (``GET /metrics``); ``extra``: more counters."""
    total = dict.fromkeys((*METRICS, *extra, LEADER_CHANGES), 0.0)
    ctx = tls_context(**cluster.tls_files) if cluster.tls else None
    for m in cluster.members:
        if m.proc is None or m.proc.poll() is not None:
            continue
        host, port = m.endpoint.rsplit(":", 1)
        conn = (
            http.client.HTTPSConnection(host, int(port), context=ctx, timeout=5)
            if ctx
            else http.client.HTTPConnection(host, int(port), timeout=5)
        )
        conn.request("GET", "/metrics")
        for line in conn.getresponse().read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name == LEADER_CHANGES:
                total[name] = max(total[name], float(line.rsplit(" ", 1)[1]))
            elif name in total:
                total[name] += float(line.rsplit(" ", 1)[1])
        conn.close()
    return total


def write_capacity(cluster: LocalEtcdCluster, clients: int = 8, seconds: float = 3.0) -> float:
    """Puts per second this cluster sustains from ``clients`` concurrent clients (one key each)."""
    counts = [0] * clients
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        c = EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
        while time.monotonic() < stop:
            c.put(b"/capacity/%d" % i, b"x" * 64)
            counts[i] += 1
        c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def members_cpu_seconds(cluster: LocalEtcdCluster) -> float:
    """User + system CPU seconds the running members used so far (``/proc/PID/stat``)."""
    total = 0.0
    for m in cluster.members:
        if m.proc is None or m.proc.poll() is not None:
            continue
        total += cpu_seconds(m.proc.pid)
    return total
