"""Several hosts, real network faults: the documented multi-host recipe (docs/howto.md, "torchrun, several
hosts") run in network namespaces (tests/hosts.py). The coordinator has a host of its own and binds
its bridge address; each replica is a plain ``torchrun --standalone`` job on its own host, its gloo
traffic on that host's interface (``GLOO_SOCKET_IFNAME``). Root only (skipped otherwise).

Every job ends with every replica's parameters equal to the failure-free float64 run (max relative
difference <= 1e-9), the partitioned replica included once it rejoined; every fault is seen within
its stated bound. Measured times are printed (and written as JSON where ``LR_NETNS_RESULTS`` names a file).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from lightning_recover.control_plane.etcd_cluster import DEFAULT_ELECTION_MS, DEFAULT_HEARTBEAT_MS
from lightning_recover.protocol.messages import JobSecret
from lightning_recover.protocol.notice import EXIT_LEFT_ON_NOTICE
from lightning_recover.protocol.reachability import exclusion_bound, probe_timeout_for
from tests.compare import SLACK, max_relative_difference
from tests.hosts import Hosts
from tests.jobs import ROOT, join_request
from tests.jobs import wait_for as wait_until
from tests.scripts.fabric_train import reference_state

pytestmark = pytest.mark.slow

TOL = 1e-9
HEARTBEAT_TIMEOUT = 2.0
FABRIC = os.path.join(ROOT, "tests", "scripts", "fabric_train.py")
SHARDED = os.path.join(ROOT, "tests", "scripts", "sharded_train.py")


class MultiHostJob:
    """A coordinator host and one torchrun job per replica host, on :class:`Hosts`."""

    def __init__(self, hosts: Hosts, out: str, replicas: int, replica_size: int = 1) -> None:
        self.hosts, self.out, self.replicas, self.replica_size = hosts, out, replicas, replica_size
        os.makedirs(out, exist_ok=True)
        self.secret_file = os.path.join(out, "job.secret")
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
        self.agents: dict[int, object] = {}

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", LIGHTNING_RECOVER_SECRET_FILE=self.secret_file)
        env.pop("LIGHTNING_RECOVER_INJECT", None)
        env.update(extra)
        return env

    def log(self, name: str) -> str:
        path = os.path.join(self.out, f"{name}.log")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def start_coordinator(self) -> str:
        argv = [sys.executable, "-m", "lightning_recover.cli", "coordinator", "--host", self.hosts.addr["coord"]]
        argv += ["--port", "0", "--replicas", str(self.replicas), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
        argv += ["--replica-size", str(self.replica_size)]
        self.hosts.popen("coord", argv, os.path.join(self.out, "coord.log"), self.env())
        assert wait_until(lambda: "LISTENING" in self.log("coord"), 60), self.log("coord")
        self.coordinator = re.search(r"LISTENING (\S+)", self.log("coord")).group(1)
        return self.coordinator

    def start_replica(self, r: int, script_args: list[str], max_restarts: int = 3, script: str = FABRIC) -> None:
        host = f"h{r}"
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(self.replica_size),
        ]
        argv += ["--max-restarts", str(max_restarts), script, self.out, *script_args]
        env = self.env(
            LIGHTNING_RECOVER_COORDINATOR=self.coordinator,
            LIGHTNING_RECOVER_REPLICA=str(r),
            LIGHTNING_RECOVER_REPLICAS=str(self.replicas),
            LIGHTNING_RECOVER_REPLICA_SIZE=str(self.replica_size),
            GLOO_SOCKET_IFNAME=self.hosts.iface[host],
        )
        self.agents[r] = self.hosts.popen(host, argv, os.path.join(self.out, f"{host}.log"), env)

    def applied(self, r: int) -> int:
        path = os.path.join(self.out, f"steps{r}.log")
        return len(open(path).read().split()) if os.path.exists(path) else 0

    def wait_finished(self, timeout: float) -> None:
        ok = wait_until(lambda: all(a.poll() is not None for a in self.agents.values()), timeout)
        assert ok, self.dump()
        for r, agent in self.agents.items():
            assert agent.returncode == 0, f"replica {r}'s torchrun exited {agent.returncode}\n{self.dump()}"

    def dump(self) -> str:
        names = ["coord"] + [f"h{r}" for r in self.agents]
        return "\n".join(f"----- {n}.log\n{self.log(n)[-2500:]}" for n in names)

    def check_states(self, reference: dict, rejoined: int | None = None) -> None:
        import torch

        for r in range(self.replicas):
            path = os.path.join(self.out, f"replica{r}.pt")
            assert os.path.exists(path), f"replica {r} did not finish\n{self.dump()}"
            data = torch.load(path, weights_only=False)
            diff = max_relative_difference(data["state"], reference)
            assert diff <= TOL, f"replica {r} diverged from the failure-free run by {diff}"
            if r == rejoined:
                assert data["stats"][0]["step"] > 0, "the partitioned replica came back mid-run (a new incarnation)"


def report(name: str, figures: dict) -> None:
    print(f"[netns] {name}: {json.dumps(figures)}")
    path = os.environ.get("LR_NETNS_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


def test_hosts_harness_partitions_and_cleans_up():
    """The harness itself: hosts reach each other; a cut host reaches nobody and heals; an isolated
    host loses only the named peers (both directions); nothing of it is left afterwards."""
    with Hosts(["a", "b", "c"]) as hosts:
        assert hosts.reaches("a", "b") and hosts.reaches("b", "c")
        hosts.cut("a")
        assert not hosts.reaches("a", "b") and not hosts.reaches("c", "a") and hosts.reaches("b", "c")
        hosts.heal("a")
        assert wait_until(lambda: hosts.reaches("a", "b"), 10)
        hosts.isolate("a", ["b"])
        assert not hosts.reaches("a", "b") and not hosts.reaches("b", "a")
        assert hosts.reaches("a", "c") and hosts.reaches("c", "a") and hosts.reaches("b", "c")
        hosts.rejoin("a")
        assert hosts.reaches("a", "b")
        tag = hosts.tag
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tag not in listed and tag not in links, "namespaces, veths and the bridge are deleted"


STEPS, M = 40, 6


def _three_replicas(hosts: Hosts, tmp_path, gate: str = "") -> MultiHostJob:
    """Three replicas on h0-h2. ``gate``: they hold before step ``STEPS - 2`` until that file exists (the test
    creates it once the replica it cut off asked to rejoin: the step's commit admits it, the job cannot end first)."""
    job = MultiHostJob(hosts, str(tmp_path / "job"), replicas=3)
    job.start_coordinator()
    args = ["--replicas", "3", "--steps", str(STEPS), "--microbatches", str(M), "--dtype", "float64"]
    args += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--work", "0.03", "--slow-while-degraded", "0.6"]
    args += ["--hold", f"{STEPS - 2}:{gate}"] if gate else []
    for r in range(3):
        job.start_replica(r, args)
    assert wait_until(lambda: job.applied(0) >= 3, 240), job.dump()
    return job


@contextlib.contextmanager
def _opened_at_the_end(gate: str):
    """Create ``gate`` when the block ends, on every path: replicas are never left holding."""
    try:
        yield
    finally:
        open(gate, "w").close()


def _next_commit_after(job: MultiHostJob, r: int, since_count: int, timeout: float) -> float:
    """Seconds until replica ``r`` applies a step beyond ``since_count``."""
    start = time.monotonic()
    assert wait_until(lambda: job.applied(r) > since_count, timeout, 0.005), job.dump()
    return time.monotonic() - start


@pytest.mark.timeout(600)
def test_replica_host_link_down_then_up(tmp_path):
    """Symmetric partition: replica 1's host loses its link. It is declared dead by its heartbeats
    (bound: heartbeat_timeout), the others commit on, and replica 1 stops with CoordinatorLostError
    (bound: store_timeout = max(5, 2 x heartbeat_timeout + 1) = 5 s) saying the others continue. The
    link comes back; torchrun restarts it and it rejoins mid-run with the live state."""
    gate = str(tmp_path / "gate")
    with Hosts(["coord", "h0", "h1", "h2"]) as hosts, _opened_at_the_end(gate):
        job = _three_replicas(hosts, tmp_path, gate)
        t_cut = time.monotonic()
        hosts.cut("h1")
        assert wait_until(lambda: "replica 1 (incarnation 1) missed heartbeats" in job.log("coord"), 30), job.dump()
        declared = time.monotonic() - t_cut
        count = job.applied(0)
        next_commit = _next_commit_after(job, 0, count, 30)
        assert wait_until(lambda: "CoordinatorLostError" in job.log("h1"), 30), job.dump()
        lost = time.monotonic() - t_cut
        assert "they continue without this one" in job.log("h1"), "the HINT says the job goes on"
        assert (
            "restart the job from its last checkpoint"
            not in job.log("h1").split("CoordinatorLostError")[1].split("if every replica stopped")[0]
        )
        hosts.heal("h1")
        assert wait_until(lambda: join_request(1) in job.log("h1"), 240), job.dump()
        open(gate, "w").close()
        job.wait_finished(300)
        job.check_states(reference_state(STEPS, M, dtype="float64"), rejoined=1)
        report(
            "link_down",
            {
                "declared_dead_s": round(declared, 3),
                "next_commit_s": round(next_commit, 3),
                "replica_stopped_s": round(lost, 3),
            },
        )
        assert declared <= HEARTBEAT_TIMEOUT + SLACK, f"declared dead after {declared:.2f}s"
        assert lost <= 5.0 + SLACK, f"the partitioned replica stopped after {lost:.2f}s"


@pytest.mark.timeout(600)
def test_asymmetric_partition_excludes_the_cut_off_replica(tmp_path):
    """Replica 2's host drops its peers' traffic (nftables, inside the host) but still reaches the
    coordinator. The group stalls in its reduce; the monitor probes the members' data addresses,
    keeps the largest mutually reachable set {0, 1} and declares 2 dead within the stated bound
    (docs/protocol.md, "Network partitions"); 0 and 1 commit on. torchrun restarts 2, which waits to
    rejoin until it reaches its peers; the rule is removed, it rejoins, and all three finish equal
    to the failure-free run."""
    bound = exclusion_bound(HEARTBEAT_TIMEOUT, probe_timeout_for(HEARTBEAT_TIMEOUT))
    gate = str(tmp_path / "gate")
    with Hosts(["coord", "h0", "h1", "h2"]) as hosts, _opened_at_the_end(gate):
        job = _three_replicas(hosts, tmp_path, gate)
        t_cut = time.monotonic()
        hosts.isolate("h2", ["h0", "h1"])
        fenced_line = "replica 2 (incarnation 1) has no two-way connection with replicas [0, 1]"
        assert wait_until(lambda: fenced_line in job.log("coord"), 60), job.dump()
        excluded = time.monotonic() - t_cut
        count = job.applied(0)
        next_commit = _next_commit_after(job, 0, count, 30)
        assert wait_until(lambda: "waits to rejoin until it reaches replicas [0, 1]" in job.log("h2"), 120), job.dump()
        assert "replica 2 has no two-way connection with replicas [0, 1]" in job.log("h2")
        assert "replica 0 -> 2: connect to " in job.log("h2") and "timed out after" in job.log(
            "h2"
        ), "dropped: no answer"
        time.sleep(1.0)  # the restarted replica keeps waiting, the others keep committing meanwhile
        before_heal = job.applied(0)
        hosts.rejoin("h2")
        assert wait_until(lambda: join_request(2) in job.log("h2"), 240), job.dump()
        open(gate, "w").close()
        job.wait_finished(300)
        job.check_states(reference_state(STEPS, M, dtype="float64"), rejoined=2)
        assert before_heal > count, "the others committed while the partitioned replica waited"
        report(
            "asymmetric",
            {"excluded_s": round(excluded, 3), "bound_s": round(bound, 3), "next_commit_s": round(next_commit, 3)},
        )
        # The bound counts from the moment the last member waits: at most one step after the cut.
        assert excluded <= bound + SLACK, f"excluded after {excluded:.2f}s (bound {bound:.2f}s + {SLACK}s slack)"


@pytest.mark.timeout(600)
def test_torchrun_two_processes_per_replica_on_two_hosts(tmp_path):
    """K = 2: each replica is a torchrun job of 2 workers (FSDP2 inside the replica) on its own host;
    the replicas' gloo groups cross the bridge. Once every worker runs, the test cuts replica 1's host
    off from replica 0's (asymmetric; the coordinator stays reachable), so their first reduce (or
    group build) stalls: with two replicas the tie goes to the smaller id, so replica 1 is fenced
    within the bound and replica 0 goes on alone. torchrun restarts replica 1's two workers, which wait until they reach replica 0;
    the rule is removed, they rejoin, and both replicas end equal to the unsharded float64 run."""
    from types import SimpleNamespace

    import torch

    from tests.scripts import sharded_train

    steps, microbatches = 40, 8
    bound = exclusion_bound(HEARTBEAT_TIMEOUT, probe_timeout_for(HEARTBEAT_TIMEOUT))
    with Hosts(["coord", "h0", "h1"]) as hosts:
        job = MultiHostJob(hosts, str(tmp_path / "job"), replicas=2, replica_size=2)
        job.start_coordinator()
        args = ["--replicas", "2", "--replica-size", "2", "--steps", str(steps), "--microbatches", str(microbatches)]
        args += ["--dtype", "float64", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--slow-while-degraded", "0.6"]
        for r in range(2):
            job.start_replica(r, args, max_restarts=2, script=SHARDED)
        pids = os.path.join(job.out, "pid.r{}.i{}")
        assert wait_until(lambda: all(os.path.exists(pids.format(r, i)) for r in range(2) for i in range(2)), 240)
        hosts.isolate("h1", ["h0"])
        t_cut = time.monotonic()
        fenced_line = "replica 1 (incarnation 1) has no two-way connection with replicas [0]"
        assert wait_until(lambda: fenced_line in job.log("coord"), 60), job.dump()
        excluded = time.monotonic() - t_cut
        assert wait_until(lambda: "waits to rejoin until it reaches replicas [0]" in job.log("h1"), 180), job.dump()
        hosts.rejoin("h1")
        job.wait_finished(300)
        ref_dir = str(tmp_path / "ref")
        options = SimpleNamespace(out=ref_dir, steps=steps, microbatches=microbatches, batch_size=4, dtype="float64")
        sharded_train.reference(options)
        job.check_states(torch.load(os.path.join(ref_dir, "reference.pt"))["state"], rejoined=1)
        stats = torch.load(os.path.join(job.out, "replica0.pt"), weights_only=False)["stats"]
        live = [s["live_replicas"] for s in stats]
        assert 1 in live and live[-1] == 2, f"replica 0 went on alone, then replica 1 rejoined: {live}"
        report("k2_asymmetric", {"excluded_s": round(excluded, 3), "bound_s": round(bound, 3)})
        assert excluded <= bound + SLACK, f"excluded after {excluded:.2f}s (bound {bound:.2f}s + {SLACK}s slack)"


# ---------------------------------------------------------------------------- the etcd control plane

ETCD_HOSTS = ["e0", "e1", "e2"]


class EtcdOnHosts:
    """A three-member TLS etcd cluster, one member per namespace host (fixed ports: each host has its own
    stack), and one ``lightning-recover run --control-plane etcd://...`` launcher per replica host."""

    def __init__(self, hosts: Hosts, out: str) -> None:
        from lightning_recover.control_plane.etcd_cluster import make_certificates

        if shutil.which("etcd") is None or shutil.which("etcdctl") is None or shutil.which("openssl") is None:
            pytest.skip("etcd-server, etcd-client and openssl are needed (scripts/setup.sh installs them)")
        self.hosts, self.out = hosts, out
        os.makedirs(out, exist_ok=True)
        self.certs = make_certificates(os.path.join(out, "pki"), [hosts.addr[h] for h in ETCD_HOSTS])
        self.endpoints = [f"{hosts.addr[h]}:2379" for h in ETCD_HOSTS]
        initial = ",".join(f"{h}=https://{hosts.addr[h]}:2380" for h in ETCD_HOSTS)
        c = self.certs
        for h in ETCD_HOSTS:
            a = hosts.addr[h]
            argv = ["etcd", "--name", h, "--data-dir", os.path.join(out, f"{h}.etcd")]
            argv += ["--listen-client-urls", f"https://{a}:2379", "--advertise-client-urls", f"https://{a}:2379"]
            argv += ["--listen-peer-urls", f"https://{a}:2380", "--initial-advertise-peer-urls", f"https://{a}:2380"]
            argv += [
                "--initial-cluster",
                initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                hosts.tag,
            ]
            argv += [
                "--heartbeat-interval",
                str(DEFAULT_HEARTBEAT_MS),
                "--election-timeout",
                str(DEFAULT_ELECTION_MS),
                "--log-level",
                "warn",
                "--logger",
                "zap",
            ]
            argv += ["--cert-file", c["server_cert"], "--key-file", c["server_key"], "--trusted-ca-file", c["cacert"]]
            argv += ["--client-cert-auth", "--peer-cert-file", c["server_cert"], "--peer-key-file", c["server_key"]]
            argv += ["--peer-trusted-ca-file", c["cacert"], "--peer-client-cert-auth"]
            hosts.popen(h, argv, os.path.join(out, f"{h}.log"))
        assert wait_until(lambda: self.leader() is not None, 60, 0.2), "no etcd leader"
        self.launchers: dict[int, object] = {}

    def leader(self, via: str = "h0") -> str | None:
        """The host of the current etcd leader, asked from host ``via`` (None if no member answers)."""
        argv = ["etcdctl", "--endpoints", ",".join(self.endpoints), "--cacert", self.certs["cacert"]]
        argv += ["--cert", self.certs["cert"], "--key", self.certs["key"], "--dial-timeout", "1s"]
        argv += ["--command-timeout", "2s", "endpoint", "status", "-w", "json"]
        proc = self.hosts.run(via, argv, timeout=20)
        try:
            statuses = json.loads(proc.stdout)
        except ValueError:
            return None
        for st in statuses:
            if st["Status"]["leader"] == st["Status"]["header"]["member_id"]:
                return ETCD_HOSTS[self.endpoints.index(st["Endpoint"].split("://")[-1])]
        return None

    def etcd_args(self) -> list[str]:
        """The control plane's options, as every launcher (and a watch relay) of the job takes them."""
        argv = ["--control-plane", "etcd://" + ",".join(self.endpoints), "--etcd-cacert", self.certs["cacert"]]
        return argv + ["--etcd-cert", self.certs["cert"], "--etcd-key", self.certs["key"]]

    def env(self, host: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=self.hosts.iface[host])
        env.pop("LIGHTNING_RECOVER_INJECT", None)
        secret_file = os.path.join(self.out, "job.secret")  # the job's launchers share one secret (never in etcd)
        if not os.path.exists(secret_file):
            JobSecret.generate().write_file(self.out)
        env["LIGHTNING_RECOVER_SECRET_FILE"] = secret_file
        return env

    def start_launcher(self, r: int, job: str, script_args: list[str], launcher_args: tuple[str, ...] = ()) -> None:
        argv = [sys.executable, "-m", "lightning_recover.cli", "run", "--replicas", "3"]
        argv += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--job", job, "--local-replicas", str(r)]
        argv += [*self.etcd_args(), *launcher_args, "--", sys.executable, FABRIC, self.out, *script_args]
        self.launchers[r] = self.hosts.popen(f"h{r}", argv, os.path.join(self.out, f"h{r}.log"), self.env(f"h{r}"))

    def log(self, name: str) -> str:
        path = os.path.join(self.out, f"{name}.log")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def logs(self) -> str:
        return "".join(self.log(f"h{r}") for r in self.launchers)

    def dump(self) -> str:
        return "\n".join(f"----- h{r}.log\n{self.log(f'h{r}')[-2500:]}" for r in self.launchers)

    def applied(self, r: int) -> int:
        path = os.path.join(self.out, f"steps{r}.log")
        return len(open(path).read().split()) if os.path.exists(path) else 0


def _etcd_job(
    hosts: Hosts, tmp_path, steps: int, rack_relay: str | None = None, launcher_args: tuple[str, ...] = ()
) -> EtcdOnHosts:
    """Three launchers on h0-h2 training; with ``rack_relay`` (a host's name) their relays follow a `lightning-recover
    watch-relay` on that host instead of watching etcd; ``launcher_args``: more options of every launcher."""
    cluster = EtcdOnHosts(hosts, str(tmp_path / "job"))
    args = ["--replicas", "3", "--steps", str(steps), "--microbatches", str(M), "--dtype", "float64"]
    args += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--work", "0.03"]
    job = f"netns-{os.getpid()}-{time.monotonic_ns()}"
    if rack_relay is not None:
        address = f"{hosts.addr[rack_relay]}:7400"
        argv = [sys.executable, "-m", "lightning_recover.cli", "watch-relay", "--listen", address, "--job", job]
        hosts.popen(
            rack_relay, [*argv, *cluster.etcd_args()], os.path.join(cluster.out, "rack.log"), cluster.env(rack_relay)
        )
        assert wait_until(lambda: f"watch relay on {address}" in cluster.log("rack"), 60), cluster.log("rack")
        launcher_args += ("--watch-upstream", address)
    for r in range(3):
        cluster.start_launcher(r, job, args, launcher_args)
    assert wait_until(lambda: cluster.applied(0) >= 3, 240), cluster.dump()
    return cluster


def _etcd_states(cluster: EtcdOnHosts, survivors: list[int], steps: int) -> dict:
    import torch

    reference = reference_state(steps, M, dtype="float64")
    states = {}
    for r in survivors:
        data = torch.load(os.path.join(cluster.out, f"replica{r}.pt"), weights_only=False)
        diff = max_relative_difference(data["state"], reference)
        assert diff <= TOL, f"replica {r} diverged from the failure-free run by {diff}"
        states[r] = data
    return states


@pytest.mark.timeout(600)
def test_etcd_rack_elects_its_watch_relay_across_hosts(tmp_path):
    """Three launchers of one rack (``--watch-rack``) on three namespace hosts: one is elected and serves the rack's
    relay on its own host's address (the one it reaches etcd from), the other two follow it across the bridge. Its
    launcher then gets SIGTERM: its replica leaves at a step boundary, the launcher gives the role up, and one of
    the other two is elected at once, the third following it; both finish on the failure-free trajectory."""
    steps = 60
    rack = "rack-1"
    with Hosts([*ETCD_HOSTS, "h0", "h1", "h2"]) as hosts:
        cluster = _etcd_job(hosts, tmp_path, steps, launcher_args=("--watch-rack", rack))
        serves = re.compile(rf"this host's watch relay: serves rack {rack}'s watch relay at (\S+)")
        # The three relays asked whom to follow as their launchers started, long before the job's third step.
        elected = {r: serves.findall(cluster.log(f"h{r}")) for r in range(3)}
        (first,) = [r for r, said in elected.items() if said]
        address = elected[first][0]
        assert address.startswith(f"{hosts.addr[f'h{first}']}:"), (address, hosts.addr)
        others = [r for r in range(3) if r != first]
        for r in others:
            following = f"this host's watch relay: following the relay at {address}"
            assert wait_until(lambda r=r: following in cluster.log(f"h{r}"), 60), cluster.dump()
        cluster.launchers[first].send_signal(signal.SIGTERM)  # a notice to its replica: it leaves, then its launcher
        assert wait_until(lambda: any(serves.search(cluster.log(f"h{r}")) for r in others), 60), cluster.dump()
        (second,) = [r for r in others if serves.search(cluster.log(f"h{r}"))]
        (third,) = [r for r in others if r != second]
        again = serves.search(cluster.log(f"h{second}")).group(1)
        assert again.startswith(f"{hosts.addr[f'h{second}']}:"), again
        following = f"this host's watch relay: following the relay at {again}"
        assert wait_until(lambda: following in cluster.log(f"h{third}"), 30), cluster.dump()
        assert cluster.applied(second) < steps, "the job ended before the rack elected again: lengthen it"
        assert wait_until(lambda: all(p.poll() is not None for p in cluster.launchers.values()), 180), cluster.dump()
        codes = {r: p.returncode for r, p in cluster.launchers.items()}
        assert codes == {first: EXIT_LEFT_ON_NOTICE, second: 0, third: 0}, (codes, cluster.dump())
        assert "watching etcd itself" not in cluster.log(f"h{third}"), "it went from one relay to the next"
        states = _etcd_states(cluster, others, steps)
        live = [s["live_replicas"] for s in states[second]["stats"]]
        assert live[0] == 3 and live[-1] == 2, live


@pytest.mark.timeout(600)
def test_etcd_leader_host_partitioned(tmp_path):
    """etcd on three namespace hosts, a launcher and its replica on each of three more. The etcd
    leader's host loses its link mid-training: the other two members elect a leader, the clients fail
    over, no replica is declared dead, and all three finish on the failure-free trajectory."""
    steps = 30
    with Hosts([*ETCD_HOSTS, "h0", "h1", "h2"]) as hosts:
        cluster = _etcd_job(hosts, tmp_path, steps)
        leader = cluster.leader()
        commits, last = [], cluster.applied(0)
        t_cut = time.monotonic()
        hosts.cut(leader)
        while cluster.applied(0) < steps and time.monotonic() - t_cut < 120:
            if cluster.applied(0) > last:
                commits.append(time.monotonic())
                last = cluster.applied(0)
            time.sleep(0.005)
        assert wait_until(lambda: all(p.poll() is not None for p in cluster.launchers.values()), 120), cluster.dump()
        assert all(p.returncode == 0 for p in cluster.launchers.values()), cluster.dump()
        states = _etcd_states(cluster, [0, 1, 2], steps)
        assert all(s["live_replicas"] == 3 for data in states.values() for s in data["stats"]), "nobody excluded"
        gaps = [b - a for a, b in zip([t_cut, *commits], commits)]
        report("etcd_leader_host_cut", {"leader": leader, "longest_commit_gap_s": round(max(gaps), 3)})


@pytest.mark.timeout(600)
def test_etcd_asymmetric_partition(tmp_path):
    """On etcd: replica 2's host drops its peers' traffic but reaches the etcd members. The launcher
    holding the monitor role runs the same partition judge: replica 2 is fenced within the bound and
    replicas 0 and 1 finish on the failure-free trajectory."""
    steps = 30
    bound = exclusion_bound(HEARTBEAT_TIMEOUT, probe_timeout_for(HEARTBEAT_TIMEOUT))
    with Hosts([*ETCD_HOSTS, "h0", "h1", "h2"]) as hosts:
        cluster = _etcd_job(hosts, tmp_path, steps)
        t_cut = time.monotonic()
        hosts.isolate("h2", ["h0", "h1"])
        fenced_line = "replica 2 (incarnation 1) has no two-way connection with replicas [0, 1]"
        assert wait_until(lambda: fenced_line in cluster.logs(), 60), cluster.dump()
        excluded = time.monotonic() - t_cut
        for r in (0, 1):
            assert wait_until(lambda: cluster.launchers[r].poll() is not None, 180), cluster.dump()
            assert cluster.launchers[r].returncode == 0, cluster.dump()
        _etcd_states(cluster, [0, 1], steps)
        assert "replica 2 has no two-way connection with replicas [0, 1]" in cluster.log("h2")
        report("etcd_asymmetric", {"excluded_s": round(excluded, 3), "bound_s": round(bound, 3)})
        assert excluded <= bound + SLACK, f"excluded after {excluded:.2f}s (bound {bound:.2f}s + {SLACK}s slack)"


@pytest.mark.timeout(600)
def test_etcd_rack_relay_host_partitioned(tmp_path):
    """The launchers' relays follow a `lightning-recover watch-relay` on a host of its own (a rack's relay), which
    then loses its links to the replica hosts (it still reaches etcd). Each launcher's relay watches etcd itself
    within two relay silences and a stale bound, nobody is declared dead, and all three replicas finish on the
    failure-free trajectory."""
    from lightning_recover.control_plane.watch_relay import RELAY_SILENT_AFTER, STALE_AFTER

    steps = 100  # long enough to go on past the relay's two silences
    bound = 2 * RELAY_SILENT_AFTER + STALE_AFTER
    with Hosts([*ETCD_HOSTS, "rack", "h0", "h1", "h2"]) as hosts:
        cluster = _etcd_job(hosts, tmp_path, steps, rack_relay="rack")
        following = f"this host's watch relay: following the relay at {hosts.addr['rack']}:7400"
        assert all(following in cluster.log(f"h{r}") for r in range(3)), cluster.dump()
        assert "(3 followers)" in cluster.log("rack"), cluster.log("rack")
        t_cut = time.monotonic()
        hosts.isolate("rack", ["h0", "h1", "h2"])
        left = []
        for r in range(3):
            assert wait_until(lambda: "watch relay: watching etcd itself" in cluster.log(f"h{r}"), 60), cluster.dump()
            left.append(time.monotonic() - t_cut)
        assert cluster.applied(0) < steps, "the job ended before its relays left the rack relay: lengthen it"
        assert wait_until(lambda: all(p.poll() is not None for p in cluster.launchers.values()), 180), cluster.dump()
        assert all(p.returncode == 0 for p in cluster.launchers.values()), cluster.dump()
        states = _etcd_states(cluster, [0, 1, 2], steps)
        assert all(s["live_replicas"] == 3 for data in states.values() for s in data["stats"]), "nobody excluded"
        report("etcd_rack_relay_cut", {"left_relay_s": [round(t, 3) for t in left], "bound_s": bound})
        assert max(left) <= bound + SLACK, f"left the relay after {max(left):.2f}s (bound {bound}s + {SLACK}s slack)"
