"""One etcd client's latency and failover, measured inside that client's own virtual environment.

Run by ``benchmarks/etcd_clients.py`` (which starts the cluster, kills its leader and collects the JSON);
each client is installed in a venv of its own since their pins conflict (see docs/control_plane.md).
Prints ``READY`` before the failover loop, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time


def percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3, "p99_ms": xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e3}


def timed(fn, n: int) -> dict:
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return percentiles(out)


def sync_ops(name: str, eps: list[str], tls: dict):
    """(put, get, cas, close) callables of a synchronous client."""
    host, port = eps[0].rsplit(":", 1)
    if name == "jsongw":
        sys.path.insert(0, os.environ["LR_ROOT"])
        from lightning_recover.control_plane import etcd_client as ec

        c = ec.EtcdClient(eps, **tls, allow_insecure=not tls)

        def cas(i):
            k = b"bench/cas"
            c.txn([ec.cmp_value(k, b"%d" % (i - 1))], [ec.op_put(k, b"%d" % i)], [ec.op_get(k)])

        return (lambda i: c.put(b"bench/k", b"v%d" % i)), (lambda i: c.get(b"bench/k")), cas
    if name == "etcd3gw":
        from etcd3gw.client import Etcd3Client

        c = Etcd3Client(
            host,
            int(port),
            protocol="https" if tls else "http",
            ca_cert=tls.get("cacert"),
            cert_cert=tls.get("cert"),
            cert_key=tls.get("key"),
            timeout=5,
        )
        import base64

        def b(s):
            return base64.b64encode(s.encode()).decode()

        def cas(i):
            c.transaction(
                {
                    "compare": [{"key": b("bench/cas"), "result": "EQUAL", "target": "VALUE", "value": b(str(i - 1))}],
                    "success": [{"request_put": {"key": b("bench/cas"), "value": b(str(i))}}],
                    "failure": [{"request_range": {"key": b("bench/cas")}}],
                }
            )

        return (lambda i: c.put("bench/k", f"v{i}")), (lambda i: c.get("bench/k")), cas
    if name == "etcd3":  # 0.12 (2020): one endpoint, no failover
        import etcd3

        c = etcd3.client(
            host, int(port), ca_cert=tls.get("cacert"), cert_key=tls.get("key"), cert_cert=tls.get("cert"), timeout=5
        )

        def cas(i):
            c.transaction(
                compare=[c.transactions.value("bench/cas") == str(i - 1)],
                success=[c.transactions.put("bench/cas", str(i))],
                failure=[c.transactions.get("bench/cas")],
            )

        return (lambda i: c.put("bench/k", f"v{i}")), (lambda i: c.get("bench/k")), cas
    if name == "python3-etcd3":
        import etcd3
        import grpc

        if tls:
            creds = grpc.ssl_channel_credentials(
                open(tls["cacert"], "rb").read(), open(tls["key"], "rb").read(), open(tls["cert"], "rb").read()
            )
        endpoints = [
            etcd3.Endpoint(
                e.rsplit(":", 1)[0], int(e.rsplit(":", 1)[1]), secure=bool(tls), creds=creds if tls else None
            )
            for e in eps
        ]
        c = etcd3.MultiEndpointEtcd3Client(endpoints=endpoints, timeout=5, failover=True)

        def cas(i):
            c.transaction(
                compare=[c.transactions.value("bench/cas") == str(i - 1)],
                success=[c.transactions.put("bench/cas", str(i))],
                failure=[c.transactions.get("bench/cas")],
            )

        return (lambda i: c.put("bench/k", f"v{i}")), (lambda i: c.get("bench/k")), cas
    raise ValueError(name)


def async_ops(name: str, eps: list[str], tls: dict, loop: asyncio.AbstractEventLoop):
    host, port = eps[0].rsplit(":", 1)
    run = loop.run_until_complete
    if name == "aetcd":
        import aetcd

        c = aetcd.Client(host, int(port), timeout=5)  # 1.0.0: no CA / client-certificate parameters
        run(c.connect())

        def cas(i):
            run(
                c.transaction(
                    compare=[c.transactions.value(b"bench/cas") == str(i - 1).encode()],
                    success=[c.transactions.put(b"bench/cas", str(i).encode())],
                    failure=[c.transactions.get(b"bench/cas")],
                )
            )

        return (lambda i: run(c.put(b"bench/k", b"v%d" % i))), (lambda i: run(c.get(b"bench/k"))), cas
    if name == "etcd-client-py":
        from etcd_client import Client, Compare, CompareOp, Txn, TxnOp

        async def connect():
            return await Client(eps).connect().__aenter__()

        comm = run(connect())

        async def call(make):  # its futures need a running loop when they are created
            return await make()

        def cas(i):
            txn = (
                Txn()
                .when([Compare.value(b"bench/cas", CompareOp.Equal, str(i - 1).encode())])
                .and_then([TxnOp.put(b"bench/cas", str(i).encode())])
                .or_else([TxnOp.get(b"bench/cas")])
            )
            run(call(lambda: comm.txn(txn)))

        return (
            (lambda i: run(call(lambda: comm.put(b"bench/k", b"v%d" % i)))),
            (lambda i: run(call(lambda: comm.get(b"bench/k")))),
            cas,
        )
    raise ValueError(name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--client", required=True)
    p.add_argument("--endpoints", required=True)
    p.add_argument("--tls", default="{}")
    p.add_argument("-n", type=int, default=300)
    p.add_argument("--failover-seconds", type=float, default=8.0)
    a = p.parse_args()
    eps, tls = a.endpoints.split(","), json.loads(a.tls)
    if a.client == "jsongw":
        sys.path.insert(0, os.environ["LR_ROOT"])
        import lightning_recover  # noqa: F401 -- the package's own import (torch) is not the client's cost
    t0 = time.perf_counter()
    loop = asyncio.new_event_loop()
    if a.client in ("aetcd", "etcd-client-py"):
        put, get, cas = async_ops(a.client, eps, tls, loop)
    else:
        put, get, cas = sync_ops(a.client, eps, tls)
    put(0)
    out = {"client": a.client, "connect_s": time.perf_counter() - t0}
    mods = [m for m in sys.modules if m.split(".")[0] in ("grpc", "google", "requests", "etcd3gw", "aetcd", "etcd3")]
    out["modules_loaded"] = len(mods)
    out["put"] = timed(put, a.n)
    out["get"] = timed(get, a.n)
    put(0)
    cas(0)
    out["cas"] = timed(lambda i: cas(i + 1), a.n)
    # Failover: puts in a loop while the driver SIGKILLs the leader; the longest gap between two
    # successful puts, and the errors the client let through (each retried at once).
    print("READY", flush=True)
    end = time.perf_counter() + a.failover_seconds
    last, gap, errors, first_error = time.perf_counter(), 0.0, 0, None
    i = 0
    while time.perf_counter() < end:
        try:
            put(i)
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
        except Exception as exc:  # noqa: BLE001 -- counting what the client lets through
            errors += 1
            first_error = first_error or f"{type(exc).__name__}: {str(exc)[:120]}"
            time.sleep(0.01)
        i += 1
    gap = max(gap, time.perf_counter() - last)  # a client still stuck (or failing) at the end
    out["failover"] = {
        "max_gap_s": gap,
        "errors": errors,
        "first_error": first_error,
        "recovered": time.perf_counter() - last < 1.0,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
