"""Compare Python etcd v3 clients on a real local 3-member cluster: latency, leader-kill failover, TLS.

    python benchmarks/etcd_clients.py --venv etcd3gw=/tmp/eb-gw ... --json benchmarks/results/etcd_clients.json

Each client runs ``benchmarks/etcd_client_probe.py`` in its own venv (``NAME=VENV``; ``jsongw`` is this
package's client and runs in this interpreter). Every client gets a fresh TLS cluster (client-cert
auth) unless it has no TLS options, then a plain-text one (said in the JSON). During its failover
loop the member it connects to first (m0) is SIGKILLed 1 s after READY.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster  # noqa: E402

NO_TLS = {"etcd-client-py", "aetcd"}  # no CA / client-certificate settings (0.5.1's ConnectOptions, 1.0.0's Client)


def site_size_mb(venv: str) -> float:
    base = subprocess.run(
        [os.path.join(venv, "bin", "python"), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    total = 0
    for d, _, files in os.walk(base):
        if "/pip" in d or "/setuptools" in d or "/_distutils_hack" in d or "/pkg_resources" in d:
            continue
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files if not os.path.islink(os.path.join(d, f)))
    return total / 1e6


def move_leader_to(cluster: LocalEtcdCluster, target: int) -> int:
    """Make member ``target`` the leader (``etcdctl move-leader``); the leader's index afterwards."""
    leader = cluster.leader()
    if leader != target:
        st = cluster.status(target)
        tls = cluster.tls_files
        subprocess.run(
            ["etcdctl", "--endpoints", cluster.endpoints[leader], "--cacert", tls["cacert"], "--cert", tls["cert"]]
            + ["--key", tls["key"], "move-leader", format(int(st["header"]["member_id"]), "x")],
            env=dict(os.environ, ETCDCTL_API="3"),
            check=True,
            capture_output=True,
            timeout=30,
        )
        time.sleep(0.5)
    return cluster.leader()


def probe(name: str, python: str, n: int) -> dict:
    tls = name not in NO_TLS
    with tempfile.TemporaryDirectory(prefix="lr-etcdbench-") as d, LocalEtcdCluster(d, tls=tls) as cluster:
        cmd = [python, os.path.join(ROOT, "benchmarks", "etcd_client_probe.py"), "--client", name]
        cmd += ["--endpoints", ",".join(cluster.endpoints), "--tls", json.dumps(cluster.tls_files), "-n", str(n)]
        envs = dict(os.environ, LR_ROOT=ROOT)
        if name == "etcd3":  # its generated protobuf modules need the pure-python protobuf runtime today
            envs["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
        if name == "etcd3gw":  # requests lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override the CA it was given
            envs.pop("REQUESTS_CA_BUNDLE", None)
            envs.pop("CURL_CA_BUNDLE", None)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=envs)
        try:
            line = proc.stdout.readline()
            if line.strip() != "READY":
                _, err = proc.communicate(timeout=60)
                return {"client": name, "error": (line + err)[-600:]}
            time.sleep(1.0)
            # The member every client talks to first (a single-endpoint client's only one), made the
            # leader first: the worst case, the same for every client.
            leader = move_leader_to(cluster, 0)
            cluster.kill(0)
            killed_at = time.monotonic()
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        result = json.loads(out.strip().splitlines()[-1])
        result["tls"] = tls
        result["killed"] = "m0 (the leader)" if leader == 0 else f"m0 (a follower; leader m{leader})"
        result["done_after_kill_s"] = time.monotonic() - killed_at
        return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--venv", action="append", default=[], help="NAME=VENV_DIR for a PyPI client")
    p.add_argument("-n", type=int, default=300)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    clients = [("jsongw", sys.executable, None)] + [
        (v.split("=", 1)[0], os.path.join(v.split("=", 1)[1], "bin", "python"), v.split("=", 1)[1]) for v in a.venv
    ]
    results = []
    for name, python, venv in clients:
        r = probe(name, python, a.n)
        r["deps_mb"] = site_size_mb(venv) if venv else 0.0
        if venv:
            r["packages"] = subprocess.run(
                [python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
            ).stdout.split()
        results.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"n": a.n, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
