"""What one ``lightning-recover watch-relay`` process delivers: watch events per second of its CPU, to relays that
follow it over TCP (``bench scale`` measures it beside the cluster's own capacities, and its projection of a tree
of relays checks a rack relay's load against it).

Real: the relay is the command's process, following a real etcd; its followers are :class:`RelayedView` s over TCP
with the job's secret, in this process; writers put one key per request as fast as etcd takes them, so each
event is a watch message of its own (a step's commit sends several events in one message: this is the dearer
case for the relay)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

from lightning_recover.control_plane.config import EtcdSettings, with_job
from lightning_recover.control_plane.etcd_client import EtcdClient
from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster
from lightning_recover.control_plane.watch_relay import RelayedView
from lightning_recover.launch.process_tree import cpu_seconds
from lightning_recover.launch.relay_command import served_address
from lightning_recover.protocol.messages import JobSecret


def _start_relay(cluster: LocalEtcdCluster, job: str, secret_file: str, log: str) -> tuple[subprocess.Popen, int]:
    args = [sys.executable, "-m", "lightning_recover.cli", "watch-relay", "--listen", "127.0.0.1:0"]
    args += ["--control-plane", cluster.url, "--job", job, "--secret-file", secret_file]
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env={**os.environ, **cluster.environment()}, stderr=out)
    deadline = time.monotonic() + 60.0
    while True:
        with open(log, errors="replace") as f:
            text = f.read()
        address = served_address(text)
        if address is not None:
            return proc, address[1]
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the watch relay did not start: {text[-2000:]}")
        time.sleep(0.05)


def relay_capacity(cluster: LocalEtcdCluster, followers: int = 32, writers: int = 4, seconds: float = 3.0) -> dict:
    """``events_per_cpu_s``: watch events the relay delivered (summed over its ``followers``) per second of its
    CPU, what one core of a rack relay's host delivers; ``events_per_s``: the same per second of the run on this
    host (its cores shared with etcd, the writers and the followers)."""
    job = f"bench-relay-{os.getpid()}-{time.monotonic_ns()}"
    secret = JobSecret.generate()
    settings = with_job(EtcdSettings(tuple(cluster.endpoints), "", **cluster.tls_files), job)
    prefix = settings.watched_prefix.encode()
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
    with tempfile.TemporaryDirectory(prefix="lr-relay-bench-") as work:
        proc, port = _start_relay(cluster, job, secret.write_file(work), os.path.join(work, "relay.log"))
        views = [
            RelayedView(("127.0.0.1", port), client.clone(), prefix, secret_key=secret.key).start()
            for _ in range(followers)
        ]
        try:
            deadline = time.monotonic() + 30.0
            while not all(v.healthy and v.relayed for v in views):
                if time.monotonic() > deadline:
                    raise RuntimeError("the relay's followers did not become current within 30 s")
                time.sleep(0.05)
            stop = time.monotonic() + seconds

            def run(i: int) -> None:
                c = client.clone()
                while time.monotonic() < stop:
                    c.put(prefix + b"w%d" % i, b"x" * 64)
                c.close()

            threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
            before, cpu_before, began = sum(v.events for v in views), cpu_seconds(proc.pid), time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # what was written reaches every follower: count it all against the relay's CPU for it
            written = client.range(prefix, prefix + b"\xff", keys_only=True, limit=1)["header"]["revision"]
            deadline = time.monotonic() + 30.0
            while min(v.revision for v in views) < int(written) and time.monotonic() < deadline:
                time.sleep(0.01)
            delivered = sum(v.events for v in views) - before
            cpu, elapsed = cpu_seconds(proc.pid) - cpu_before, time.monotonic() - began
        finally:
            for v in views:
                v.close()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            client.close()
    return {
        "followers": followers,
        "events_delivered": delivered,
        "relay_cpu_s": cpu,
        "events_per_cpu_s": delivered / max(cpu, 1e-9),
        "events_per_s": delivered / elapsed,
    }
