"""A newcomer from another host joins a running job on etcd, its replica id assigned by the control plane.

Network-namespace hosts (tests/hosts.py, root only): a three-member TLS etcd on hosts e0-e2, the job's first
launcher on h0 (`run --replicas 1:2`: replica 0 trains alone), a second launcher on h1 with `--add-replicas 1`.
The newcomer gets id 1 from etcd, is admitted at a commit with the live state over the namespaces' network,
computes its share from its first step, and both replicas end bitwise equal to the failure-free exact run.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from lightning_recover.protocol.messages import JobSecret
from tests.chaos.test_netns import ETCD_HOSTS, FABRIC, EtcdOnHosts
from tests.hosts import Hosts
from tests.jobs import ROOT, wait_for
from tests.scripts.fabric_train import reference_state

pytestmark = pytest.mark.slow

STEPS, M = 6, 4


def _launcher(cluster: EtcdOnHosts, host: str, job: str, extra: list[str], gate: str) -> None:
    argv = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "1:2", "--heartbeat-timeout", "2"]
    argv += ["--job", job, *extra, "--control-plane", "etcd://" + ",".join(cluster.endpoints)]
    argv += ["--etcd-cacert", cluster.certs["cacert"], "--etcd-cert", cluster.certs["cert"]]
    argv += ["--etcd-key", cluster.certs["key"], "--", sys.executable, FABRIC, cluster.out, "--replicas", "2"]
    argv += ["--steps", str(STEPS), "--microbatches", str(M), "--heartbeat-timeout", "2", "--exact"]
    argv += ["--hold", f"2:{gate}"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=cluster.hosts.iface[host])
    env.pop("LIGHTNING_RECOVER_INJECT", None)
    secret_file = os.path.join(cluster.out, "job.secret")  # the job's launchers share one secret (never in etcd)
    if not os.path.exists(secret_file):
        JobSecret.generate().write_file(cluster.out)
    env["LIGHTNING_RECOVER_SECRET_FILE"] = secret_file
    cluster.launchers[host] = cluster.hosts.popen(host, argv, os.path.join(cluster.out, f"{host}.log"), env)


@pytest.mark.timeout(1200)
def test_newcomer_from_another_host_gets_its_id_from_etcd(tmp_path):
    with Hosts([*ETCD_HOSTS, "h0", "h1"]) as hosts:
        cluster = EtcdOnHosts(hosts, str(tmp_path / "job"))
        gate = str(tmp_path / "gate")
        job = f"grow-netns-{os.getpid()}-{time.monotonic_ns()}"
        _launcher(cluster, "h0", job, [], gate)
        assert wait_for(lambda: cluster.applied(0) >= 2, 540), cluster.log("h0")[-3000:]
        _launcher(cluster, "h1", job, ["--add-replicas", "1"], gate)
        assert wait_for(lambda: "asks to join" in cluster.log("h1"), 540), cluster.log("h1")[-3000:]
        assert "assigned replica ids [1]" in cluster.log("h1")
        open(gate, "w").close()
        for host in ("h0", "h1"):
            cluster.launchers[host].wait(timeout=300)
            assert cluster.launchers[host].returncode == 0, cluster.log(host)[-3000:]
        reference = reference_state(STEPS, M, dtype="float32", exact=True)
        for r in (0, 1):
            data = torch.load(os.path.join(cluster.out, f"replica{r}.pt"), weights_only=False)
            for key, ref in reference.items():
                assert torch.equal(data["state"][key], ref), f"replica {r}: {key} differs from the failure-free run"
            live = [s["live_replicas"] for s in data["stats"]]
            assert live == ([1, 1, 1, 2, 2, 2] if r == 0 else [2, 2, 2]), (r, live)
            assert all(s["recomputed"] == 0 for s in data["stats"])
