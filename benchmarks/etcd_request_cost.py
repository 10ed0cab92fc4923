"""What each kind of etcd request costs the cluster in CPU.

    python -m benchmarks.etcd_control_plane --parts cost --json benchmarks/results/etcd_cost.json

Why: on a host whose cores the etcd members share with the replicas, the members' CPU is taken from
training, so the step-time ratio etcd / embedded is bounded below by what the members must spend on the
requests the design cannot do without. Measured here on a fresh local 3-member TLS cluster
(``LocalEtcdCluster``), each request kind alone at a fixed rate from one client, the members' user + system
CPU read from ``/proc/PID/stat`` before and after:

* ``idle``: the members with no client (Raft heartbeats between them, timers);
* per request, above idle: a put, a report-like transaction (compare + put + read), a linearizable range,
  the monitor's read ordered through the Raft log (a transaction whose compare fails and whose success
  branch is a put), a serializable range, a lease keep-alive; and one watch event delivered to a watcher
  (puts with ``watchers`` watched views on the prefix, minus puts alone, per event).

These price a design's requests against each other (a keep-alive against a put, say). They do not add up
to a job's cost: in a job, etcd batches the replicas' concurrent reports into one Raft round, and the
members used less above idle than the sum of these per-request figures (benchmarks/figures/etcdperf.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning_recover.bench.etcd_metrics import members_cpu_seconds
from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster
from lightning_recover.control_plane.etcd_watch import WatchView

_PREFIX = b"/bench-cost/"


def _requests(client: ec.EtcdClient) -> dict[str, Callable[[int], object]]:
    """One request of each kind (``n``: the request's number, spreading the keys over 8)."""
    lease = client.lease_grant(60)
    never = _PREFIX + b"\x00never"

    def key(n: int) -> bytes:
        return _PREFIX + b"k%d" % (n % 8)

    return {
        "put": lambda n: client.put(key(n), b"v" * 100),
        "report_txn": lambda n: client.txn(
            [ec.cmp_version(key(n), 1)], [ec.op_put(_PREFIX + b"r%d" % (n % 8), b"v" * 100)], [ec.op_get(key(0))]
        ),
        "linearizable_range": lambda n: client.range(key(n)),
        "read_through_log": lambda n: client.txn(
            [ec.cmp_value(never, b"x")], [ec.op_put(never, b"x")], [ec.op_get(key(k)) for k in range(4)]
        ),
        "serializable_range": lambda n: client.range(key(n), serializable=True),
        "lease_keepalive": lambda n: client.lease_keepalive(lease),
    }


def _run_at(rate: float, seconds: float, request: Callable[[int], object] | None) -> int:
    began, n = time.monotonic(), 0
    while time.monotonic() - began < seconds:
        if request is None:
            time.sleep(0.1)
            continue
        request(n)
        n += 1
        time.sleep(max(0.0, began + n / rate - time.monotonic()))
    return n


def measure_costs(cluster: LocalEtcdCluster, rate: float = 100.0, seconds: float = 6.0, watchers: int = 6) -> dict:
    """CPU milliseconds of the members per request of each kind (above idle), idle cores, and per watch event."""
    client = ec.EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
    for k in range(8):
        client.put(_PREFIX + b"k%d" % k, b"v")

    def cores(request: Callable[[int], object] | None) -> tuple[float, int]:
        cpu, began = members_cpu_seconds(cluster), time.monotonic()
        n = _run_at(rate, seconds, request)
        return (members_cpu_seconds(cluster) - cpu) / (time.monotonic() - began), n

    idle, _ = cores(None)
    out: dict = {"idle_cores": idle, "rate_per_s": rate, "seconds": seconds, "ms_per_request": {}}
    requests = _requests(client)
    for name, request in requests.items():
        used, n = cores(request)
        out["ms_per_request"][name] = (used - idle) * 1e3 / rate if n else None
    views = [WatchView(client.clone(), _PREFIX).start() for _ in range(watchers)]
    deadline = time.monotonic() + 10.0
    while not all(v.healthy for v in views) and time.monotonic() < deadline:
        time.sleep(0.01)  # every watcher synced before the count starts
    watched, _ = cores(requests["put"])
    events = sum(v.events for v in views)
    for v in views:
        v.close()
    client.close()
    per_event = (watched - idle - out["ms_per_request"]["put"] * rate / 1e3) * seconds / max(events, 1)
    out["ms_per_watch_event"] = per_event * 1e3
    out["watchers"] = watchers
    return out
