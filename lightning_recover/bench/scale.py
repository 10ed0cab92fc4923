"""The control plane against the job's size: N replicas as threads of one process, N = 16 ... the limit.

    lightning-recover bench scale --replicas 16,64,256,512 --json benchmarks/results/scale.json

Real: every replica is a :class:`~lightning_recover.protocol.Replica` (its membership, heartbeats, partition
probe server, step protocol, commit decisions, its own ``ControlStore`` and, on etcd, its own connections and
watched views), over the real control plane: the embedded coordinator (a TCPStore server and its monitor, in
a process of its own) or a real 3-member TLS etcd (``LocalEtcdCluster``) with the job's monitor role
(``etcd_job.MonitorRole``, in a process of its own, as a launcher runs it). Stood in for: compute (each
microbatch is a fixed sleep of ``--compute`` seconds; the gradient is a tensor of ones) and the data plane
(``stand_in_data_plane``: a generation's group and its all-reduce meet in memory; a killed member fails its
groups' operations at once, as its closed sockets fail gloo's). A kill is acted out in the replica's thread at
the ``reduce`` phase of a random step: its data-plane connections close, its threads stop and its death
notice is written at once (as its launcher does on seeing the process exit); it is not restarted.

Per N: time to the first step (all threads started -> every replica applied step 0), the step's median
time, the time a member spends deciding a step (``StepStats.decide_seconds``), kill -> the last survivor's
next commit, etcd's Raft proposals (writes) per step and per second, lease keep-alives per second, watch
events and watch payload bytes per step per replica process, and the CPU of etcd's members, of the
coordinator (embedded) or monitor process (etcd) and of this process (all replicas), per step. Every
committed gradient is checked: each of the step's N microbatches counted exactly once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_recover.bench.etcd_metrics import members_cpu_seconds, metrics, write_capacity
from lightning_recover.bench.stand_in_data_plane import StandInDataPlane, StandInGroups
from lightning_recover.control_plane.config import EtcdSettings, with_job
from lightning_recover.control_plane.etcd_client import EtcdClient
from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster
from lightning_recover.control_plane.etcd_job import join_job
from lightning_recover.control_plane.etcd_watch import WatchView
from lightning_recover.launch.process_tree import cpu_seconds
from lightning_recover.protocol import Fault, FaultInjector, RecoverOptions, Replica
from lightning_recover.protocol.messages import JobSecret
from lightning_recover.simulate import growth_exponent, power_law_at

#: counters read from etcd's /metrics at both ends of the measured window (summed over the members)
_LEASE_RENEWED = "etcd_debugging_lease_renewed_total"


class _Killed(BaseException):
    """Ends a replica thread as SIGKILL ends a process (no protocol handler sees it)."""


@dataclass
class ScaleConfig:
    """One run: ``replicas`` threads on ``backend`` ('etcd' or 'embedded')."""

    replicas: int
    backend: str
    compute: float = 1.0  # seconds of one microbatch (each replica computes about one per step)
    warmup: int = 2  # steps before the measured window
    window: int = 5  # failure-free steps measured
    kills: int = 2  # then this many kills, each at a random step of its own gap
    gap: int = 3  # steps per kill
    heartbeat_timeout: float = 10.0  # a starved 2-core host must not look like dead replicas
    heartbeat_interval: float = 0.5  # shorter than a step: the beats a long step costs
    #: replicas started per second (their connections, incarnations and threads): hundreds at once would hold
    #: etcd's members, which share this host's cores, past the client's request deadline. The time to the first
    #: step is counted from the last replica's start.
    start_rate: float = 16.0
    seed: int = 0

    @property
    def steps(self) -> int:
        return self.warmup + self.window + self.kills * self.gap + 1


@dataclass
class _Slot:
    replica: int
    protocol_replica: Optional[Replica] = None
    thread: Optional[threading.Thread] = None
    started_at: float = 0.0  # Replica.start() returned
    applied: dict[int, float] = field(default_factory=dict)  # step -> monotonic time it was applied
    killed_at: Optional[float] = None
    outcome: str = "running"
    error: str = ""


#: run first in each control process: it ends itself (SIGTERM) when the harness is gone, whatever ended it
_ORPHAN_GUARD = (
    "import os, signal, threading, time\n"
    "def _guard(parent=os.getppid()):\n"
    "    while os.getppid() == parent: time.sleep(0.5)\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "threading.Thread(target=_guard, daemon=True).start()\n"
)


class _ControlProcess:
    """The coordinator (embedded) or the monitor role (etcd), in a process of its own: its CPU is its own."""

    def __init__(self, command: list[str], env: dict[str, str], log: str, pass_fds: tuple[int, ...] = ()) -> None:
        self.log = log  # its output (a pipe nobody reads would block it once full)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(command, env=env, pass_fds=pass_fds, stdout=out, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-2000:]

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _embedded(cfg: ScaleConfig, secret_file: str) -> tuple[_ControlProcess, str]:
    read, write = os.pipe()
    code = _ORPHAN_GUARD + (
        "import sys; from lightning_recover.protocol.coordinator import serve; "
        "serve('127.0.0.1', 0, int(sys.argv[1]), float(sys.argv[2]), ready_fd=int(sys.argv[3]), secret_file=sys.argv[4])"
    )
    args = [sys.executable, "-c", code, str(cfg.replicas), str(cfg.heartbeat_timeout), str(write), secret_file]
    control = _ControlProcess(args, dict(os.environ), f"{secret_file}.log", pass_fds=(write,))
    os.close(write)
    with os.fdopen(read) as ready:
        line = ready.readline()
    if not line.startswith("LISTENING "):
        control.stop()
        raise RuntimeError(f"the coordinator did not start: {control.tail()}")
    return control, line.split()[1]


_MONITOR = """
import signal, sys, threading
from lightning_recover.control_plane.config import parse, with_job
from lightning_recover.control_plane.etcd_job import MonitorRole
from lightning_recover.protocol.messages import JobSecret
settings = with_job(parse(None), None)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
role = MonitorRole(settings, JobSecret.from_file(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), 60.0, 1,
                   "bench-scale", lambda line: print(line, file=sys.stderr, flush=True)).start()
stop.wait()
role.stop()
"""


class ScaleRun:
    """One job of ``cfg.replicas`` replica threads; :meth:`run` returns its figures."""

    def __init__(self, cfg: ScaleConfig, cluster: Optional[LocalEtcdCluster], work: str) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.work = work
        self.plane = StandInDataPlane()
        self.slots = [_Slot(r) for r in range(cfg.replicas)]
        self._progress = threading.Condition()
        rng = random.Random(cfg.seed * 7919 + cfg.replicas)
        first = cfg.warmup + cfg.window + 1
        # kill k: a random replica at the reduce of a random step of its own gap (its last step left to recover)
        self.faults = [
            Fault("kill", rng.randrange(cfg.replicas), first + k * cfg.gap + rng.randrange(cfg.gap - 1), "reduce")
            for k in range(cfg.kills)
        ]

    # ------------------------------------------------------------------ the control plane
    def _start_control(self, secret_file: str) -> tuple[_ControlProcess, str, dict[str, str]]:
        if self.cfg.backend == "embedded":
            control, addr = _embedded(self.cfg, secret_file)
            return control, addr, {}
        assert self.cluster is not None
        env = self.cluster.environment()
        base = EtcdSettings(tuple(self.cluster.endpoints), "", **self.cluster.tls_files)
        settings = with_job(base, f"scale-{self.cfg.replicas}-{os.getpid()}-{time.monotonic_ns()}")
        secret = join_job(settings, self.cfg.replicas, 1)
        with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(secret.hex())
        env = {**env, **settings.environment()}
        code = [
            sys.executable,
            "-c",
            _ORPHAN_GUARD + _MONITOR,
            secret_file,
            str(self.cfg.replicas),
            str(self.cfg.heartbeat_timeout),
        ]
        return _ControlProcess(code, {**os.environ, **env}, f"{secret_file}.log"), settings.url, env

    # ------------------------------------------------------------------ a replica thread
    def _act(self, slot: _Slot) -> Any:
        def act(fault: Fault) -> None:
            slot.killed_at = time.monotonic()
            raise _Killed(str(fault))

        return act

    def _replica(self, slot: _Slot, addr: str, secret: JobSecret, release: float) -> None:
        cfg = self.cfg
        options = RecoverOptions(
            microbatches=cfg.replicas,
            heartbeat_timeout=cfg.heartbeat_timeout,
            heartbeat_interval=cfg.heartbeat_interval,
            join_timeout=120.0,
            collective_timeout=120.0,
            startup_timeout=600.0,
        )
        param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        injector = FaultInjector(self.faults, slot.replica, 1, act=self._act(slot))
        protocol_replica = slot.protocol_replica = Replica(
            options, addr, slot.replica, cfg.replicas, lambda: [param], injector=injector, secret=secret
        )
        protocol_replica.membership.groups = StandInGroups(self.plane, slot.replica)
        try:
            time.sleep(max(0.0, release - time.monotonic()))
            protocol_replica.start(exit_hook=False)
            slot.started_at = time.monotonic()
            for s in range(cfg.steps):
                for _ in protocol_replica.run_step(s):
                    protocol_replica.fire("forward")
                    time.sleep(cfg.compute)
                    param.grad = torch.ones(1, dtype=torch.float64) + (param.grad if param.grad is not None else 0)
                protocol_replica.fire("optimizer")
                if param.grad.item() != 1.0:  # the mean of M gradients of one: every microbatch counted once
                    raise AssertionError(f"step {s}: committed gradient {param.grad.item()} != 1")
                with torch.no_grad():
                    param.add_(param.grad)
                slot.applied[s] = time.monotonic()
                with self._progress:
                    self._progress.notify_all()
            slot.outcome = "done"
            protocol_replica.close()
        except _Killed:
            slot.outcome = "killed"
            self.plane.kill(slot.replica)  # its sockets close: the group's operations fail at once
            protocol_replica.membership.close()  # threads stop; the death notice its launcher writes on seeing the exit
            protocol_replica.membership.store.raw.close()  # its connections and watched views
        except BaseException as exc:  # noqa: BLE001 -- reported in the results
            slot.outcome = "error"
            slot.error = f"{type(exc).__name__}: {exc}"
            try:
                protocol_replica.close()
            except BaseException:  # noqa: BLE001 -- already failing
                pass
        finally:
            with self._progress:
                self._progress.notify_all()

    def _stop_replicas(self) -> None:
        """After a failed run: stop every replica's threads (heartbeat, watchdog, probe server, views), as their
        processes' ends would; a watchdog left running would end this whole process once its etcd is gone."""
        for slot in self.slots:
            if slot.protocol_replica is None or slot.protocol_replica.membership.store is None:
                continue
            try:
                slot.protocol_replica.membership.close()
                slot.protocol_replica.membership.store.raw.close()
            except Exception:  # noqa: BLE001 -- best effort: the run already failed
                pass

    # ------------------------------------------------------------------ measuring
    def _live(self) -> list[_Slot]:
        return [s for s in self.slots if s.outcome in ("running", "done")]

    def _wait_applied(self, step: int, timeout: float) -> float:
        """Block until every live replica applied ``step``; the time the last one did."""
        deadline = time.monotonic() + timeout

        def done() -> bool:
            live = self._live()
            return bool(live) and all(step in s.applied for s in live)

        with self._progress:
            while not done():
                if any(s.outcome == "error" for s in self.slots) or time.monotonic() > deadline:
                    errors = [f"{s.replica}: {s.error}" for s in self.slots if s.error][:5]
                    raise RuntimeError(f"{self.cfg.backend} x{self.cfg.replicas}: step {step} not applied; {errors}")
                self._progress.wait(0.5)
        return max(s.applied[step] for s in self._live())

    def _sample(self, control: _ControlProcess) -> dict:
        views = [v for v in (self._view(s) for s in self._live()) if v is not None]
        out = {
            "t": time.monotonic(),
            "harness_cpu": time.process_time(),
            "control_cpu": control.cpu_seconds(),
            "watch_events": sum(v.events for v in views),
            "watch_bytes": sum(v.payload_bytes for v in views),
            "resyncs": sum(v.resyncs for v in views),
            "views": len(views),
            "load": os.getloadavg()[0],
        }
        if self.cluster is not None:
            out["etcd_cpu"] = members_cpu_seconds(self.cluster)
            out["etcd"] = metrics(self.cluster, extra=(_LEASE_RENEWED,))
        return out

    @staticmethod
    def _view(slot: _Slot) -> Any:
        raw = (
            slot.protocol_replica.membership.store.raw
            if slot.protocol_replica is not None and slot.protocol_replica.membership.store is not None
            else None
        )
        return getattr(raw, "view", None)

    def run(self) -> dict:
        cfg = self.cfg
        secret_file = os.path.join(self.work, f"secret-{cfg.backend}-{cfg.replicas}")
        if cfg.backend == "embedded":
            with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(JobSecret.generate().hex())
        control, addr, env = self._start_control(secret_file)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        secret = JobSecret.from_file(secret_file)
        try:
            return self._run(control, addr, secret)
        except BaseException:
            self._stop_replicas()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            control.stop()

    def _run(self, control: _ControlProcess, addr: str, secret: JobSecret) -> dict:
        cfg = self.cfg
        began = time.monotonic()
        for slot in self.slots:
            release = began + slot.replica / cfg.start_rate
            slot.thread = threading.Thread(
                target=self._replica, args=(slot, addr, secret, release), name=f"scale-{slot.replica}", daemon=True
            )
            slot.thread.start()
        first = self._wait_applied(0, 600.0)
        result: dict = {"replicas": cfg.replicas, "backend": cfg.backend, "compute_s": cfg.compute}
        last = began + (cfg.replicas - 1) / cfg.start_rate  # the last replica's start
        result["first_step_s"] = first - last
        result["started_s"] = max(s.started_at for s in self.slots) - last
        result["start_rate"] = cfg.start_rate
        self._wait_applied(cfg.warmup - 1, 600.0)
        a = self._sample(control)
        ends = [self._wait_applied(s, 120.0) for s in range(cfg.warmup, cfg.warmup + cfg.window)]
        b = self._sample(control)
        steps = cfg.window
        seconds = b["t"] - a["t"]
        live = self._live()
        decide = [
            st.decide_seconds
            for s in live
            for st in s.protocol_replica.history
            if cfg.warmup <= st.step < cfg.warmup + cfg.window and not st.recoveries
        ]
        result.update(
            step_s=statistics.median(y - x for x, y in zip(ends, ends[1:])),
            decide_s=statistics.median(decide),
            decide_p90_s=statistics.quantiles(decide, n=10)[-1] if len(decide) > 1 else decide[0],
            window_s=seconds,
            harness_cpu_s_per_step=(b["harness_cpu"] - a["harness_cpu"]) / steps,
            control_cpu_s_per_step=(b["control_cpu"] - a["control_cpu"]) / steps,
            watch_events_per_step_per_process=(b["watch_events"] - a["watch_events"]) / steps / max(1, b["views"]),
            watch_bytes_per_step_per_process=(b["watch_bytes"] - a["watch_bytes"]) / steps / max(1, b["views"]),
            # full re-reads of a view (its stream lost or silent past STALE_AFTER): each is the whole prefix
            view_resyncs_per_step_per_process=(b["resyncs"] - a["resyncs"]) / steps / max(1, b["views"]),
            load=[a["load"], b["load"]],
        )
        if self.cluster is not None:
            delta = {k: b["etcd"][k] - a["etcd"][k] for k in b["etcd"]}
            writes = delta["etcd_server_proposals_committed_total"] / 3  # every member counts each proposal
            result.update(
                etcd_writes_per_step=writes / steps,
                etcd_writes_per_s=writes / seconds,
                etcd_keepalives_per_s=delta[_LEASE_RENEWED] / seconds,  # counted by the leader only
                etcd_watch_events_per_s=delta["etcd_debugging_mvcc_events_total"] / seconds,
                etcd_cpu_s_per_step=(b["etcd_cpu"] - a["etcd_cpu"]) / steps,
                leader_changes=delta.get("etcd_server_leader_changes_seen_total", 0.0),
            )
        result["kills"] = self._kills()
        result["operations"] = self.plane.operations
        for slot in self.slots:
            slot.thread.join(timeout=60)
        result["outcomes"] = {o: sum(s.outcome == o for s in self.slots) for o in {s.outcome for s in self.slots}}
        errors = [f"{s.replica}: {s.error}" for s in self.slots if s.outcome == "error"]
        if errors:
            raise RuntimeError(f"{cfg.backend} x{cfg.replicas}: replicas failed: {errors[:5]}")
        return result

    def _kills(self) -> list[dict]:
        out = []
        for fault in self.faults:
            self._wait_applied(fault.step, 300.0)
            victim = self.slots[fault.replica]
            if victim.killed_at is None:
                raise RuntimeError(f"{self.cfg.backend} x{self.cfg.replicas}: kill {fault} never fired")
            nxt = [
                min(t for s, t in slot.applied.items() if s >= fault.step and t > victim.killed_at)
                for slot in self._live()
            ]
            out.append({"fault": str(fault), "next_commit_s": max(nxt) - victim.killed_at})
        self._wait_applied(self.cfg.steps - 1, 300.0)
        return out


# ---------------------------------------------------------------------- the sweep
def keepalive_capacity(cluster: LocalEtcdCluster, clients: int = 8, seconds: float = 3.0) -> float:
    """Lease keep-alives per second this cluster answers from ``clients`` concurrent clients (a lease each)."""
    counts = [0] * clients
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        c = EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
        lease = c.lease_grant(60)
        while time.monotonic() < stop:
            c.lease_keepalive(lease)
            counts[i] += 1
        c.lease_revoke(lease)
        c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def watch_capacity(cluster: LocalEtcdCluster, watchers: int = 64, writers: int = 4, seconds: float = 3.0) -> float:
    """Watch events per second this cluster delivers: ``watchers`` views of one prefix, ``writers`` clients
    putting into it as fast as they can (a bound from below: the watchers' parsing shares this process)."""
    prefix = b"/bench-watch-capacity/%d/" % time.monotonic_ns()
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
    views = [WatchView(client.clone(), prefix).start() for _ in range(watchers)]
    deadline = time.monotonic() + 30.0
    while not all(v.healthy for v in views) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop = time.monotonic() + seconds
    before = sum(v.events for v in views)

    def run(i: int) -> None:
        c = client.clone()
        while time.monotonic() < stop:
            c.put(prefix + b"%d" % i, b"x" * 64)
        c.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    delivered = sum(v.events for v in views) - before
    elapsed = time.monotonic() - began
    for v in views:
        v.close()
    client.close()
    return delivered / elapsed


#: the figures fitted against N, and the exponent each must stay within (issue: flat or nearly so)
FITTED = {
    "first_step_s": None,
    "step_s": None,
    "decide_s": 0.3,
    "kill_next_commit_s": 0.3,
    "etcd_writes_per_step": 0.1,
    "watch_bytes_per_step_per_process": 0.1,
    "watch_events_per_step_per_process": None,
    "etcd_keepalives_per_s": None,
    "etcd_cpu_s_per_step": None,
    "control_cpu_s_per_step": None,
    "harness_cpu_s_per_step": None,
}
#: the step times the projection is made at: a short step, and the harness's own (long) step
SHORT_STEP_S = 0.2


def fits(runs: list[dict]) -> dict[str, dict[str, Optional[float]]]:
    """Per backend, the growth exponent of every figure of :data:`FITTED` over the runs' N."""
    out: dict[str, dict[str, Optional[float]]] = {}
    for backend in sorted({r["backend"] for r in runs}):
        mine = sorted((r for r in runs if r["backend"] == backend), key=lambda r: r["replicas"])
        ns = [r["replicas"] for r in mine]
        out[backend] = {
            name: growth_exponent(ns, [r.get(name) for r in mine])
            for name in FITTED
            if all(r.get(name) is not None for r in mine)
        }
    return out


def project(runs: list[dict], capacity: dict[str, float], targets: tuple[int, ...] = (2000, 16000)) -> dict:
    """etcd's load at ``targets`` replicas, from the fits over the measured N, against half of ``capacity``.

    Writes per second: the per-step writes at N over the step time (at the short step this counts every write
    as a per-step one: an upper bound, since a longer step's writes are partly per second). Watch events per
    second: each process's events per step times the processes (2 per replica: the replica and, at worst, a
    launcher of its own) over the step time. Keep-alives per second: the measured rate per replica times N."""
    etcd = sorted((r for r in runs if r["backend"] == "etcd"), key=lambda r: r["replicas"])
    if len({r["replicas"] for r in etcd}) < 2:
        return {"not_projected": "a fit needs etcd runs at two N at least"}
    ns = [r["replicas"] for r in etcd]
    long_step = statistics.median(r["step_s"] for r in etcd)
    out: dict = {"long_step_s": long_step, "short_step_s": SHORT_STEP_S, "half_capacity": {}}
    out["half_capacity"] = {k: v / 2 for k, v in capacity.items()}
    for n in targets:
        writes = power_law_at(ns, [r["etcd_writes_per_step"] for r in etcd], n)
        events = power_law_at(ns, [r["watch_events_per_step_per_process"] for r in etcd], n)
        keepalives = power_law_at(ns, [r["etcd_keepalives_per_s"] / r["replicas"] for r in etcd], n) * n
        for label, step in (("short", SHORT_STEP_S), ("long", long_step)):
            need = {
                "writes_per_s": writes / step,
                "watch_events_per_s": events * 2 * n / step,
                "keepalives_per_s": keepalives,
            }
            out[f"{n}_{label}"] = {
                **need,
                "within_half_capacity": {k: v <= out["half_capacity"].get(k, math.inf) for k, v in need.items()},
            }
    return out


def plot(result: dict, path: str) -> None:
    """One panel per figure against N (log-log), each backend a line, its fitted exponent in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in FITTED if any(n in r for r in result["runs"])]
    cols = 3
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for backend, exps in result["fits"].items():
            mine = sorted(
                (r for r in result["runs"] if r["backend"] == backend and name in r), key=lambda r: r["replicas"]
            )
            if not mine:
                continue
            b = exps.get(name)
            label = f"{backend} (N^{b:.2f})" if b is not None else backend
            ax.plot([r["replicas"] for r in mine], [max(r[name], 1e-9) for r in mine], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("replicas")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle(f"lightning-recover control plane vs N ({result.get('commit', '?')}, load {result.get('load', '?')})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def sweep(args: argparse.Namespace) -> dict:
    """Every N of ``--replicas`` on every backend of ``--backends``; the capacities; fits; the projection."""
    work = args.dir or tempfile.mkdtemp(prefix="lr-scale-")
    ns = [int(n) for n in args.replicas.split(",")]
    backends = args.backends.split(",")
    result: dict = {"commit": _commit(), "config": vars(args).copy(), "runs": [], "capacity": {}, "failures": []}
    failed: set[str] = set()
    result["load"] = os.getloadavg()[0]
    # Raft beats every 200 ms, elections after 2 s: on a 2-core host shared with the replicas (and other jobs) the
    # defaults (50/250 ms) starved the leader into missed beats and elections that no real deployment would see.
    cluster = (
        LocalEtcdCluster(
            os.path.join(work, "etcd"),
            members_count=3,
            heartbeat_ms=args.raft_heartbeat_ms,
            election_ms=args.election_ms,
            nice=args.etcd_nice,
        ).start(timeout=60)
        if "etcd" in backends
        else None
    )
    try:
        if cluster is not None and args.capacity:
            result["capacity"] = {
                "writes_per_s": write_capacity(cluster),
                "keepalives_per_s": keepalive_capacity(cluster),
                "watch_events_per_s": watch_capacity(cluster),
            }
            print(f"  capacity of the 3-member cluster: {result['capacity']}", flush=True)
        for n in ns:
            for backend in backends:
                cfg = ScaleConfig(
                    n,
                    backend,
                    compute=args.compute,
                    window=args.window,
                    kills=args.kills,
                    seed=args.seed,
                    heartbeat_timeout=args.heartbeat_timeout,
                    heartbeat_interval=args.heartbeat_interval,
                    start_rate=args.start_rate,
                )
                if backend in failed:
                    continue  # a smaller N already failed on this backend: the limit was found
                try:
                    run = ScaleRun(cfg, cluster if backend == "etcd" else None, work).run()
                except RuntimeError as exc:  # the limit on this host: recorded, the sweep goes on
                    failed.add(backend)
                    result["failures"].append({"backend": backend, "replicas": n, "error": str(exc)[:2000]})
                    print(f"  {backend:8s} N={n:5d}: FAILED {str(exc)[:300]}", flush=True)
                    continue
                result["runs"].append(run)
                kills = [k["next_commit_s"] for k in run["kills"]]
                run["kill_next_commit_s"] = statistics.median(kills) if kills else None
                print(
                    f"  {backend:8s} N={n:5d}: first step {run['first_step_s']:.1f}s, step {run['step_s']:.3f}s, "
                    f"decide {run['decide_s'] * 1e3:.1f}ms, kill->commit {kills}, "
                    f"writes/step {run.get('etcd_writes_per_step', 0):.1f}, "
                    f"watch B/step/proc {run['watch_bytes_per_step_per_process']:.0f}, load {run['load']}",
                    flush=True,
                )
                if args.json:
                    _write(args.json, result)
    finally:
        if cluster is not None:
            cluster.stop()
    result["fits"] = fits(result["runs"])
    result["projection"] = project(result["runs"], result["capacity"]) if result["capacity"] else {}
    return result


def _write(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``lightning-recover bench scale`` (and of ``python -m lightning_recover.bench.scale``)."""
    p.add_argument("--replicas", default="16,64,256,512", help="comma-separated N (replica threads per job)")
    p.add_argument("--backends", default="etcd,embedded", help="comma-separated: etcd, embedded")
    p.add_argument("--compute", type=float, default=1.0, help="seconds of one microbatch (a fixed sleep)")
    p.add_argument("--window", type=int, default=5, help="failure-free steps measured per N")
    p.add_argument("--kills", type=int, default=2, help="kills per N, each at a random step and replica")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, help="the replicas' heartbeat_timeout")
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="the replicas' heartbeat_interval")
    p.add_argument("--start-rate", type=float, default=16.0, help="replicas started per second")
    p.add_argument("--raft-heartbeat-ms", type=int, default=200, help="the etcd members' --heartbeat-interval")
    p.add_argument("--election-ms", type=int, default=2000, help="the etcd members' --election-timeout")
    p.add_argument("--etcd-nice", type=int, default=0, help="the etcd members' nice value (negative: root only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-capacity", dest="capacity", action="store_false", help="skip the cluster's capacities")
    p.add_argument("--plot", default=None, help="write the plots against N here (PNG; needs matplotlib)")
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here as JSON (after every N too)")
    return p


def main(args: argparse.Namespace) -> int:
    result = sweep(args)
    print(json.dumps({"fits": result["fits"], "projection": result["projection"]}, indent=1), flush=True)
    if args.json:
        _write(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()))
