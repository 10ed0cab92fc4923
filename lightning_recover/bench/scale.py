"""The control plane against the job's size: N replicas as threads of P worker processes, N = 16 ... the limit.

    lightning-recover bench scale --replicas 16,64,256,512 --json benchmarks/results/scale.json

Real: every replica is a :class:`~lightning_recover.protocol.Replica` (its membership, heartbeats, partition
probe server, step protocol, commit decisions, its own ``ControlStore`` and, on etcd, its own connections and
watched views), over the real control plane: the embedded coordinator (a TCPStore server and its monitor, in
a process of its own) or a real 3-member TLS etcd (``LocalEtcdCluster``) with the job's monitor role
(``etcd_job.MonitorRole``, in a process of its own, as a launcher runs it). The replicas are threads of
``--processes`` worker processes (``scale_worker``; every P-th replica in each), so a replica shares its
interpreter lock with N / P others rather than with all N: in one process, on a 2-core host, the threads'
contention for that lock, not the control plane, capped the harness near 64 replicas.

Stood in for: compute (each microbatch is a fixed sleep of ``--compute`` seconds; the gradient is a tensor of
ones) and the data plane (``stand_in_data_plane``: a generation's group and its all-reduce meet in memory in
this process, which serves them to the workers over one local TCP connection each; a killed member fails its
groups' operations at once, as its closed sockets fail gloo's). The replicas of one worker share its process,
so a replica is not isolated from its neighbours as a real replica process is: a starved worker starves all
its replicas at once. A kill is acted out in the replica's thread at the ``reduce`` phase of a random step:
its data-plane connections close, its threads stop and its death notice is written at once (as its launcher
does on seeing the process exit); it is not restarted.

Per N: time to the first step (all replicas released -> every replica applied step 0), the step's median
time, the time a member spends deciding a step (``StepStats.decide_seconds``), kill -> the last survivor's
next commit and its timeline (kill -> the coordinator knows of the end, from its event log; per survivor: kill
-> its reduce failed, the time it took to form the next generation, and the rest of its recovery), etcd's Raft
proposals (writes) per step and per second, lease keep-alives per second, watch events and watch payload bytes
per step per replica, and the CPU per step of etcd's members, of the coordinator (embedded) or monitor process
(etcd), of the worker processes (all replicas) and of this process (the stand-in data plane). Every committed
gradient is checked in its replica: each of the step's N microbatches counted exactly once.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_recover import env as env_names
from lightning_recover.bench.etcd_metrics import members_cpu_seconds, metrics, write_capacity
from lightning_recover.bench.relay_fanout import relay_capacity
from lightning_recover.bench.scale_worker import ScaleConfig
from lightning_recover.bench.stand_in_data_plane import DataPlaneServer, StandInDataPlane
from lightning_recover.control_plane.config import EtcdSettings, with_job
from lightning_recover.control_plane.etcd_client import EtcdClient
from lightning_recover.control_plane.etcd_cluster import LocalEtcdCluster
from lightning_recover.control_plane.etcd_job import join_job
from lightning_recover.control_plane.etcd_watch import STALE_AFTER, WatchView
from lightning_recover.launch.name_lookup import lookup_seconds, mapped_address
from lightning_recover.launch.process_tree import cpu_seconds
from lightning_recover.launch.relay_command import served_address
from lightning_recover.protocol import Fault
from lightning_recover.protocol.messages import JobSecret
from lightning_recover.simulate import growth_exponent, power_law_at

__all__ = ["ScaleConfig", "ScaleRun", "fits", "project", "sweep", "build_parser", "main"]

#: counters read from etcd's /metrics at both ends of the measured window (summed over the members)
_LEASE_RENEWED = "etcd_debugging_lease_renewed_total"


@dataclass
class _Slot:
    replica: int
    worker: int = 0
    started_at: float = 0.0  # Replica.start() returned
    applied: dict[int, float] = field(default_factory=dict)  # step -> monotonic time it was applied
    #: (step, decide_seconds, recoveries, recovery_seconds, regroup_seconds, barrier_seconds) of each applied step
    stats: list[tuple[int, float, int, float, float, float]] = field(default_factory=list)
    killed_at: Optional[float] = None
    outcome: str = "running"
    error: str = ""


class _WorkerProcess:
    """A worker process of replica threads as the harness holds it: commands on its standard input, events
    read from a pipe of its own (its output goes to a log: a pipe nobody reads would block it once full)."""

    def __init__(self, index: int, spec: dict, env: dict[str, str], prefix: str, on_event: Callable) -> None:
        self.index = index
        self.ready = self.finished = False
        self.exit_code: Optional[int] = None
        read, write = os.pipe()
        spec_file = f"{prefix}-{index}.json"
        with open(spec_file, "w") as f:
            json.dump({**spec, "events_fd": write}, f)
        self.log = f"{prefix}-{index}.log"
        command = [sys.executable, "-m", "lightning_recover.bench.scale_worker", spec_file]
        try:
            with open(self.log, "w") as out:
                self.proc = subprocess.Popen(
                    command, env=env, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, pass_fds=(write,)
                )
        finally:
            os.close(write)
        self._on_event = on_event
        self._reader = threading.Thread(target=self._read, args=(read,), name=f"scale-events-{index}", daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd) as events:
            for line in events:
                self._on_event(self, json.loads(line))
        self._on_event(self, {"event": "exit", "code": self.proc.wait()})

    def send(self, **command: Any) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it exited: its exit event tells

    def tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-1500:]

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self, grace: float) -> None:
        """Close its commands (it ends at their end), then kill it if it has not ended within ``grace``."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)


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


def event_log(secret_file: str) -> str:
    """Where the embedded coordinator of the run whose secret is ``secret_file`` logs the job's events."""
    return f"{secret_file}.events"


def _embedded(cfg: ScaleConfig, secret_file: str) -> tuple[_ControlProcess, str]:
    read, write = os.pipe()
    code = _ORPHAN_GUARD + (
        "import sys; from lightning_recover.protocol.coordinator import serve; "
        "serve('127.0.0.1', 0, int(sys.argv[1]), float(sys.argv[2]), ready_fd=int(sys.argv[3]), secret_file=sys.argv[4],"
        " event_log=sys.argv[5])"
    )
    args = [sys.executable, "-c", code, str(cfg.replicas), str(cfg.heartbeat_timeout), str(write), secret_file]
    args.append(event_log(secret_file))
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


def known_dead(events_path: Optional[str], replica: int, killed_at: float) -> Optional[float]:
    """Seconds from ``killed_at`` (monotonic) to the embedded coordinator's first record of ``replica``'s end after it
    (its death notice, written at the kill as a launcher writes it, or the monitor's verdict), from its event log at
    ``events_path`` (wall clock); None on etcd (no log) or without such a record."""
    if events_path is None or not os.path.exists(events_path):
        return None
    killed_wall = killed_at + (time.time() - time.monotonic())  # one host: one monotonic clock for all
    with open(events_path) as f:
        ends = [e["time"] for e in map(json.loads, f) if e["kind"] in ("death", "exit") and e.get("replica") == replica]
    after = [t for t in ends if t >= killed_wall - 0.01]  # the log's times are rounded to ms
    return min(after) - killed_wall if after else None


def arrival_spread(plane: StandInDataPlane, since: float, until: float) -> Optional[float]:
    """The median time the collectives completed between ``since`` and ``until`` (monotonic) waited from their
    first member's start to their last's (None: none completed)."""
    spreads = [spread for when, spread in plane.arrival_spreads if since <= when <= until]
    return statistics.median(spreads) if spreads else None


def ticks_written(cluster: LocalEtcdCluster, tick_key: bytes) -> int:
    """How many ticks the job's monitor wrote so far (its ``tick`` key holds its count; 0 before the first)."""
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, allow_insecure=not cluster.tls)
    try:
        value, _ = client.get(tick_key)
    finally:
        client.close()
    return int(value) if value and value.isdigit() else 0


def start_rack_relays(count: int, secret_file: str, env: dict[str, str]) -> tuple[list[_ControlProcess], list]:
    """``count`` processes of ``lightning-recover watch-relay`` on loopback (as on racks' hosts) and their addresses."""
    code = _ORPHAN_GUARD + "import sys; from lightning_recover.cli import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", code, "watch-relay", "--listen", "127.0.0.1:0", "--secret-file", secret_file]
    relays = [_ControlProcess(args, env, f"{secret_file}.rack{i}.log") for i in range(count)]
    addresses = []
    for relay in relays:
        deadline = time.monotonic() + 60.0
        while (address := served_address(relay.tail())) is None:
            if relay.proc.poll() is not None or time.monotonic() > deadline:
                for started in relays:
                    started.stop()
                raise RuntimeError(f"a rack relay did not start: {relay.tail()}")
            time.sleep(0.05)
        addresses.append(address)
    return relays, addresses


class ScaleRun:
    """One job of ``cfg.replicas`` replicas in ``cfg.worker_processes`` processes; :meth:`run` returns its
    figures."""

    def __init__(self, cfg: ScaleConfig, cluster: Optional[LocalEtcdCluster], work: str) -> None:
        cfg.options()  # a bad option (e.g. a heartbeat timeout past the hang timeout) fails here, not in each replica
        self.cfg = cfg
        self.cluster = cluster
        self.work = work
        self.plane = StandInDataPlane()
        self.slots = [_Slot(r) for r in range(cfg.replicas)]
        self.workers: list[_WorkerProcess] = []
        self.gradients: set[float] = set()  # the committed gradients the replicas applied (each checked there)
        self._progress = threading.Condition()
        self._samples = itertools.count(1)
        self.events_path: Optional[str] = None  # the embedded coordinator's event log (replicas' ends)
        #: the directory of the worker processes' watch relay sockets (short: a socket's path has 107 bytes at most)
        self._relays: Optional[str] = None  # made by run(), which removes it
        self.rack_relays: list[_ControlProcess] = []  # the relays the workers' relays follow (cfg.rack_relays)
        self._answers: dict[int, dict[int, dict]] = {}  # sample id -> worker -> its answer
        #: the figures measured so far: what :meth:`run` returns, and what a run that ended early got to
        self.measured: dict = {}
        self._tick_key: Optional[bytes] = None  # etcd: the monitor's tick (its value counts the ticks written)
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
        self._tick_key = (settings.watched_prefix + "tick").encode()
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

    # ------------------------------------------------------------------ the worker processes
    def _start_workers(self, addr: str, secret_file: str, data_plane: str, env: dict[str, str]) -> None:
        spec = {
            "config": dataclasses.asdict(self.cfg),
            "faults": [str(f) for f in self.faults],
            "addr": addr,
            "secret_file": secret_file,
            "data_plane": data_plane,
            "parent": os.getpid(),
        }
        count = self.cfg.worker_processes
        racks: list[tuple[str, int]] = []
        if self._relays and self.cfg.rack_relays:
            self.rack_relays, racks = start_rack_relays(self.cfg.rack_relays, secret_file, {**os.environ, **env})
        for i in range(count):
            mine = list(range(i, self.cfg.replicas, count))
            for r in mine:
                self.slots[r].worker = i
            prefix = os.path.join(self.work, f"worker-{self.cfg.backend}-{self.cfg.replicas}")
            relay = os.path.join(self._relays, f"w{i}") if self._relays else None
            mine_spec = {**spec, "replicas": mine, "relay": relay, "upstream": racks[i % len(racks)] if racks else None}
            if relay is not None and self.cfg.watch_racks:
                mine_spec["rack"] = f"rack-{i % self.cfg.watch_racks}"
            # As a launcher starts replicas: no c10d warning for each store wait that times out (waits in slices).
            worker_env = {env_names.TORCH_CPP_LOG_LEVEL: "ERROR", **os.environ, **env}
            worker = _WorkerProcess(i, mine_spec, worker_env, prefix, self._event)
            self.workers.append(worker)
        self._wait_for(lambda: all(w.ready for w in self.workers), 300.0, "the worker processes' start")

    def _event(self, worker: _WorkerProcess, event: dict) -> None:
        """One event of ``worker``'s (its reader thread)."""
        kind = event["event"]
        with self._progress:
            slot = self.slots[event["replica"]] if "replica" in event else None
            if kind == "started" and slot is not None:
                slot.started_at = event["t"]
            elif kind == "applied" and slot is not None:
                slot.applied[event["step"]] = event["t"]
                slot.stats += [tuple(s) for s in event["stats"]]
                self.gradients.add(event["grad"])
            elif kind == "killed" and slot is not None:
                slot.killed_at = event["t"]
            elif kind == "outcome" and slot is not None:
                slot.outcome, slot.error = event["outcome"], event["error"]
            elif kind == "sample":
                self._answers.setdefault(event["id"], {})[worker.index] = event
            elif kind == "ready":
                worker.ready = True
            elif kind == "finished":
                worker.finished = True
            elif kind == "exit":
                worker.exit_code = event["code"]
                for s in self.slots:
                    if s.worker == worker.index and s.outcome == "running":
                        s.outcome = "error"
                        s.error = f"its worker process ended ({event['code']}): {worker.tail()}"
            self._progress.notify_all()

    def _wait_for(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._progress:
            while not done():
                gone = [w for w in self.workers if w.exit_code is not None and not w.finished]
                if gone or time.monotonic() > deadline:
                    why = f"worker {gone[0].index} ended: {gone[0].tail()}" if gone else f"not within {timeout} s"
                    raise RuntimeError(f"{self.cfg.backend} x{self.cfg.replicas}: {what}: {why}")
                self._progress.wait(0.5)

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
                    started = sum(s.started_at > 0 for s in self.slots)
                    applied = sum(step in s.applied for s in self.slots)
                    raise RuntimeError(
                        f"{self.cfg.backend} x{self.cfg.replicas}: step {step} not applied ({started} replicas "
                        f"started, {applied} applied it); {errors}"
                    )
                self._progress.wait(0.5)
            return max(s.applied[step] for s in self._live())

    def _sample(self, control: _ControlProcess) -> dict:
        t = time.monotonic()
        sid = next(self._samples)
        asked = [w for w in self.workers if w.exit_code is None]
        for w in asked:
            w.send(op="sample", id=sid)
        self._wait_for(lambda: len(self._answers.get(sid, {})) == len(asked), 120.0, "the workers' sample")
        answers = list(self._answers.pop(sid).values())
        workers_cpu = sum(w.cpu_seconds() for w in self.workers)
        out = {
            "t": t,
            "workers_cpu": workers_cpu,
            "rack_relays_cpu": sum(r.cpu_seconds() for r in self.rack_relays),
            "data_plane_cpu": time.process_time(),  # this process: the stand-in data plane and the event readers
            "control_cpu": control.cpu_seconds(),
            "load": os.getloadavg()[0],
        }
        counters = ("watch_events", "watch_bytes", "resyncs", "confirms", "views", "etcd_streams", "etcd_stream_bytes")
        out.update({k: sum(a[k] for a in answers) for k in counters})
        out["etcd_streams"] += len(self.rack_relays)  # each watches etcd (its bytes are not counted here)
        if self.cluster is not None:
            out["etcd_cpu"] = members_cpu_seconds(self.cluster)
            out["etcd"] = metrics(self.cluster, extra=(_LEASE_RENEWED,))
            assert self._tick_key is not None
            out["ticks"] = ticks_written(self.cluster, self._tick_key)
        return out

    def run(self) -> dict:
        cfg = self.cfg
        secret_file = os.path.join(self.work, f"secret-{cfg.backend}-{cfg.replicas}")
        if cfg.backend == "embedded":
            with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(JobSecret.generate().hex())
            self.events_path = event_log(secret_file)
        control, addr, env = self._start_control(secret_file)
        server = DataPlaneServer(self.plane)
        try:
            if cfg.watch_relays and self.cluster is not None:
                self._relays = tempfile.mkdtemp(prefix="lr-relay-")
            self._start_workers(addr, secret_file, server.address, env)
            return self._run(control)
        finally:
            for worker in self.workers:  # after a failure: they end at their commands' end, or are killed
                worker.stop(grace=5.0)
            server.close()
            control.stop()
            for relay in self.rack_relays:
                relay.stop()
            if self._relays:
                shutil.rmtree(self._relays, ignore_errors=True)

    def _run(self, control: _ControlProcess) -> dict:
        cfg = self.cfg
        began = time.monotonic()
        for worker in self.workers:
            worker.send(op="go", began=began)
        first = self._wait_applied(0, 600.0)
        result: dict = self.measured
        result.update(
            {
                "replicas": cfg.replicas,
                "backend": cfg.backend,
                "compute_s": cfg.compute,
                "processes": len(self.workers),
                "watch_relays": bool(self._relays),
                "rack_relays": len(self.rack_relays),
                "watch_racks": cfg.watch_racks if self._relays else 0,
            }
        )
        last = began + (cfg.replicas - 1) / cfg.start_rate  # the last replica's start
        result["first_step_s"] = first - last
        result["started_s"] = max(s.started_at for s in self.slots) - last
        result["start_rate"] = cfg.start_rate
        self._wait_applied(cfg.warmup - 1, 600.0)
        a = self._sample(control)
        ends = [self._wait_applied(s, 120.0) for s in range(cfg.warmup, cfg.warmup + cfg.window)]
        b = self._sample(control)
        result.update(self._figures(a, b, ends))
        result["kills"] = []
        self._kills(result["kills"])
        self._wait_for(lambda: all(w.finished for w in self.workers), 120.0, "the replicas' ends")
        for worker in self.workers:
            worker.stop(grace=30.0)
        result["operations"] = self.plane.operations
        result["committed_gradients"] = sorted(self.gradients)
        result["outcomes"] = {o: sum(s.outcome == o for s in self.slots) for o in {s.outcome for s in self.slots}}
        errors = [f"{s.replica}: {s.error}" for s in self.slots if s.outcome == "error"]
        if errors:
            raise RuntimeError(f"{cfg.backend} x{cfg.replicas}: replicas failed: {errors[:5]}")
        return result

    def _figures(self, a: dict, b: dict, ends: list[float]) -> dict:
        """The window's figures from its two samples and the times its steps were applied."""
        cfg = self.cfg
        steps = cfg.window
        seconds = b["t"] - a["t"]
        window = [
            st for s in self._live() for st in s.stats if cfg.warmup <= st[0] < cfg.warmup + cfg.window and not st[2]
        ]
        decide = [st[1] for st in window]
        commit = [st[1] - st[5] for st in window]  # less the done barrier (the stand-in data plane's)
        workers_cpu = (b["workers_cpu"] - a["workers_cpu"]) / steps
        data_plane_cpu = (b["data_plane_cpu"] - a["data_plane_cpu"]) / steps
        views = max(1, b["views"])
        out = dict(
            step_s=statistics.median(y - x for x, y in zip(ends, ends[1:])),
            decide_s=statistics.median(decide),
            decide_p90_s=statistics.quantiles(decide, n=10)[-1] if len(decide) > 1 else decide[0],
            # the control plane's part of deciding: the leader's commit and its delivery to the member
            commit_s=statistics.median(commit),
            commit_p90_s=statistics.quantiles(commit, n=10)[-1] if len(commit) > 1 else commit[0],
            # the collectives' wait for their last member: the host's scheduling of N replicas, not a protocol's
            arrival_spread_s=arrival_spread(self.plane, a["t"], b["t"]),
            window_s=seconds,
            harness_cpu_s_per_step=workers_cpu + data_plane_cpu,  # every replica and the stand-in data plane
            workers_cpu_s_per_step=workers_cpu,
            data_plane_cpu_s_per_step=data_plane_cpu,
            control_cpu_s_per_step=(b["control_cpu"] - a["control_cpu"]) / steps,
            rack_relays_cpu_s_per_step=(b["rack_relays_cpu"] - a["rack_relays_cpu"]) / steps,
            watch_events_per_step_per_process=(b["watch_events"] - a["watch_events"]) / steps / views,
            watch_bytes_per_step_per_process=(b["watch_bytes"] - a["watch_bytes"]) / steps / views,
            # full re-reads of a view (its stream lost or silent past STALE_AFTER while the range changed): each
            # is the whole prefix; a confirm is one key's read that found nothing missed
            view_resyncs_per_step_per_process=(b["resyncs"] - a["resyncs"]) / steps / views,
            view_confirms_per_step_per_process=(b["confirms"] - a["confirms"]) / steps / views,
            # what etcd sent the job's watch streams (one per process, or one per host with watch relays)
            etcd_watch_streams=b["etcd_streams"],
            load=[a["load"], b["load"]],
        )
        if not self.rack_relays:  # the rack relays' streams are in other processes: their bytes are not counted
            out["etcd_watch_bytes_per_step"] = (b["etcd_stream_bytes"] - a["etcd_stream_bytes"]) / steps
        if self.cluster is not None:
            delta = {k: b["etcd"][k] - a["etcd"][k] for k in b["etcd"]}
            writes = delta["etcd_server_proposals_committed_total"] / 3  # every member counts each proposal
            out.update(
                etcd_writes_per_step=writes / steps,
                # the monitor's ticks while the job's keys are quiet (a write each, an event to every view):
                # their rate follows the time without a commit, not the steps
                ticks_per_s=(b["ticks"] - a["ticks"]) / seconds,
                tick_events_per_step_per_process=(b["ticks"] - a["ticks"]) / steps,
                etcd_writes_per_s=writes / seconds,
                etcd_keepalives_per_s=delta[_LEASE_RENEWED] / seconds,  # counted by the leader only
                etcd_watch_events_per_s=delta["etcd_debugging_mvcc_events_total"] / seconds,
                etcd_cpu_s_per_step=(b["etcd_cpu"] - a["etcd_cpu"]) / steps,
                leader_changes=delta.get("etcd_server_leader_changes_seen_total", 0.0),
            )
        return out

    def _kills(self, out: list[dict]) -> None:
        """Each kill's figures, appended to ``out`` as its survivors commit again."""
        for fault in self.faults:
            self._wait_applied(fault.step, 300.0)
            victim = self.slots[fault.replica]
            # its worker's events and the survivors' come through different pipes: its kill may be read later
            self._wait_for(lambda v=victim: v.killed_at is not None, 30.0, f"kill {fault} fired")
            with self._progress:
                nxt = [
                    min(t for s, t in slot.applied.items() if s >= fault.step and t > victim.killed_at)
                    for slot in self._live()
                ]
                recovered = [(slot, st) for slot in self._live() for st in slot.stats if st[0] == fault.step and st[2]]
                # when each survivor's reduce failed (its recovery began), on the workers' monotonic clock
                seen = [slot.applied[fault.step] - st[3] - victim.killed_at for slot, st in recovered]
            out.append(
                {
                    "fault": str(fault),
                    "next_commit_s": max(nxt) - victim.killed_at,
                    "known_dead_s": known_dead(self.events_path, fault.replica, victim.killed_at),
                    # the survivors' share of it: kill -> their reduce failed; forming the next generation (the
                    # wait for the verdict included); recompute, reduce and decision after it
                    "failure_seen_s": _spread(seen),
                    "regroup_s": _spread([st[4] for _, st in recovered]),
                    "after_regroup_s": _spread([st[3] - st[4] for _, st in recovered]),
                }
            )
        self._wait_applied(self.cfg.steps - 1, 300.0)


def _timeline(kill: dict) -> str:
    """One kill's recovery as a line: the verdict, then the survivors' parts (median / max)."""

    def part(name: str) -> str:
        spread = kill[name]
        return "-" if spread is None else f"{spread['median']:.1f}/{spread['max']:.1f}s"

    dead = kill["known_dead_s"]
    return (
        f"known dead {'-' if dead is None else f'{dead:.1f}s'}; survivors: failure seen {part('failure_seen_s')}, "
        f"regroup {part('regroup_s')}, then {part('after_regroup_s')}; next commit {kill['next_commit_s']:.1f}s"
    )


def _spread(values: list[float]) -> Optional[dict]:
    """Median and maximum of ``values`` (None if there are none)."""
    return {"median": statistics.median(values), "max": max(values)} if values else None


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
    "commit_s": 0.3,
    "arrival_spread_s": None,
    "kill_next_commit_s": 0.3,
    "etcd_writes_per_step": 0.1,
    "watch_bytes_per_step_per_process": 0.1,
    "watch_events_per_step_per_process": None,
    "etcd_watch_bytes_per_step": None,
    "etcd_keepalives_per_s": None,
    "etcd_cpu_s_per_step": None,
    "control_cpu_s_per_step": None,
    "harness_cpu_s_per_step": None,
}
#: the step times the projection is made at: a short step, and the harness's own (long) step
SHORT_STEP_S = 0.2
#: replicas per host in the projection with watch relays (a GPU node of 8: a replica per GPU, or one of 8 processes)
REPLICAS_PER_HOST = 8
#: hosts whose relays follow one rack relay in the projection of runs with ``--rack-relays`` (a rack of 32 nodes)
HOSTS_PER_RACK = 32


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
    second: each process's events per step times the watch streams over the step time: 2 per replica (the
    replica and, at worst, a launcher of its own), or with watch relays one per host of :data:`REPLICAS_PER_HOST`,
    or with rack relays one per :data:`HOSTS_PER_RACK` hosts (each rack relay then sends its hosts' relays the
    events of as many streams: ``rack_relay_events_per_s``, against what one core of it delivers).
    Where the runs counted the monitor's ticks, those are not per step: each stream receives the measured
    ticks per second at the harness's step, and none at a step shorter than :func:`tick_free_step` (a commit
    reaches every view before it is quiet long enough for a tick). Keep-alives per second: the measured rate
    per replica times N."""
    etcd = sorted((r for r in runs if r["backend"] == "etcd"), key=lambda r: r["replicas"])
    if len({r["replicas"] for r in etcd}) < 2:
        return {"not_projected": "a fit needs etcd runs at two N at least"}
    ns = [r["replicas"] for r in etcd]
    long_step = statistics.median(r["step_s"] for r in etcd)
    relayed = all(r.get("watch_relays") for r in etcd)
    tree = relayed and all(r.get("rack_relays") or r.get("watch_racks") for r in etcd)
    streams_per_replica = 1 / (REPLICAS_PER_HOST * HOSTS_PER_RACK) if tree else 1 / REPLICAS_PER_HOST if relayed else 2
    counted_ticks = all("ticks_per_s" in r for r in etcd)
    tick_rate = statistics.median(r["ticks_per_s"] for r in etcd) if counted_ticks else 0.0
    out: dict = {"long_step_s": long_step, "short_step_s": SHORT_STEP_S, "half_capacity": {}}
    out["watch_streams_per_replica"] = streams_per_replica
    out["ticks_per_s_at_long_step"] = tick_rate if counted_ticks else None
    out["half_capacity"] = {k: v / 2 for k, v in capacity.items()}
    for n in targets:
        writes = power_law_at(ns, [r["etcd_writes_per_step"] for r in etcd], n)
        per_step = [r["watch_events_per_step_per_process"] - r.get("tick_events_per_step_per_process", 0) for r in etcd]
        events = power_law_at(ns, [max(e, 1e-9) for e in per_step], n)
        keepalives = power_law_at(ns, [r["etcd_keepalives_per_s"] / r["replicas"] for r in etcd], n) * n
        for label, step in (("short", SHORT_STEP_S), ("long", long_step)):
            ticks = tick_rate if step > tick_free_step() else 0.0
            need = {
                "writes_per_s": writes / step,
                "watch_events_per_s": (events / step + ticks) * streams_per_replica * n,
                "keepalives_per_s": keepalives,
            }
            if tree:  # what one rack relay sends its hosts' relays, against what one core of it delivers
                need["rack_relay_events_per_s"] = (events / step + ticks) * HOSTS_PER_RACK
            out[f"{n}_{label}"] = {
                **need,
                "within_half_capacity": {k: v <= out["half_capacity"].get(k, math.inf) for k, v in need.items()},
            }
            if counted_ticks:  # the ticks' part of watch_events_per_s
                out[f"{n}_{label}"]["tick_events_per_s"] = ticks * streams_per_replica * n
    return out


def tick_free_step() -> float:
    """The longest step at which the monitor writes no tick: its view of the job's keys hears each commit before
    it has been quiet for half of what it tolerates (``EtcdStore.quiet``)."""
    return STALE_AFTER / 2


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
    os.makedirs(work, exist_ok=True)
    ns = [int(n) for n in args.replicas.split(",")]
    backends = args.backends.split(",")
    result: dict = {"commit": _commit(), "config": vars(args).copy(), "runs": [], "capacity": {}, "failures": []}
    failed: set[str] = set()
    result["load"] = os.getloadavg()[0]
    # What one reverse lookup of the harness's address costs here: torch's TCPStore client makes one per connection,
    # so a slow resolver stretches every start-up and regroup (launch/name_lookup.py); None: not done within 10 s.
    result["name_lookup_s"] = lookup_seconds(mapped_address("127.0.0.1"), 10.0)
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
            if args.rack_relays or args.watch_racks:
                fanout = relay_capacity(cluster)
                result["relay_fanout"] = fanout
                result["capacity"]["rack_relay_events_per_s"] = fanout["events_per_cpu_s"]
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
                    processes=args.processes,
                    watch_relays=args.watch_relays or bool(args.rack_relays or args.watch_racks),
                    rack_relays=args.rack_relays,
                    watch_racks=args.watch_racks,
                )
                if backend in failed:
                    continue  # a smaller N already failed on this backend: the limit was found
                job = ScaleRun(cfg, cluster if backend == "etcd" else None, work)
                try:
                    run = job.run()
                except RuntimeError as exc:  # the limit on this host: recorded, the sweep goes on
                    failed.add(backend)
                    # with what was measured before it ended (the first step, the window, the kills recovered)
                    failure = {"backend": backend, "replicas": n, "error": str(exc)[:2000], "measured": job.measured}
                    result["failures"].append(failure)
                    print(f"  {backend:8s} N={n:5d}: FAILED {str(exc)[:300]}", flush=True)
                    continue
                result["runs"].append(run)
                kills = [k["next_commit_s"] for k in run["kills"]]
                run["kill_next_commit_s"] = statistics.median(kills) if kills else None
                print(
                    f"  {backend:8s} N={n:5d}: first step {run['first_step_s']:.1f}s, step {run['step_s']:.3f}s, "
                    f"decide {run['decide_s'] * 1e3:.1f}ms (commit {run['commit_s'] * 1e3:.1f}ms), "
                    f"kill->commit {kills}, processes {run['processes']}, "
                    f"CPU/step coord {run['control_cpu_s_per_step']:.2f}s workers {run['workers_cpu_s_per_step']:.2f}s "
                    f"data plane {run['data_plane_cpu_s_per_step']:.2f}s, "
                    f"writes/step {run.get('etcd_writes_per_step', 0):.1f}, "
                    f"watch B/step/proc {run['watch_bytes_per_step_per_process']:.0f}, load {run['load']}",
                    flush=True,
                )
                for k in run["kills"]:
                    print(f"    {k['fault']}: {_timeline(k)}", flush=True)
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
    p.add_argument("--replicas", default="16,64,256,512", help="comma-separated N (replicas per job)")
    p.add_argument(
        "--processes", type=int, default=0, help="worker processes the replicas are threads of (0: one per 32)"
    )
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
    p.add_argument(
        "--watch-relays",
        action="store_true",
        help="on etcd, one watch relay per worker process (a host's launcher's) that its replicas' views follow",
    )
    p.add_argument(
        "--rack-relays",
        type=int,
        default=0,
        help="on etcd, this many `lightning-recover watch-relay` processes that the workers' relays follow over TCP "
        "(a tree: etcd streams to these only); implies --watch-relays",
    )
    p.add_argument(
        "--watch-racks",
        type=int,
        default=0,
        help="on etcd, the worker processes in this many racks, each electing one of its workers' relays to watch "
        "etcd and serve the others (a launcher's --watch-rack); implies --watch-relays",
    )
    p.add_argument("--plot", default=None, help="write the plots against N here (PNG; needs matplotlib)")
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results here as JSON (after every N too)")
    return p


def main(args: argparse.Namespace) -> int:
    if args.rack_relays and args.watch_racks:
        raise SystemExit("bench scale: --rack-relays (relays of their own) or --watch-racks (elected), not both")
    result = sweep(args)
    print(json.dumps({"fits": result["fits"], "projection": result["projection"]}, indent=1), flush=True)
    if args.json:
        _write(args.json, result)
    if args.plot and result["runs"]:  # nothing to draw when every run failed
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main(build_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()))
