"""A worker process of the scale harness (``bench scale``): its share of the job's replicas, as threads.

The harness (:mod:`lightning_recover.bench.scale`) starts P of these, each with a spec file (JSON): the run's
:class:`ScaleConfig`, the replicas it runs (every P-th), the planned faults, the control plane's address, the
job's secret file, the address of the harness's stand-in data plane and the harness's pid (a worker ends when
the harness is gone, however it ended). Every replica thread runs exactly the code of one replica process of a
real job around :class:`~lightning_recover.protocol.Replica` (its own membership, heartbeats, probe server,
``ControlStore`` and, on etcd, its own connections and watched views); its compute is a sleep and its data
plane a :class:`~lightning_recover.bench.stand_in_data_plane.DataPlaneClient` shared by the process's
threads. Why processes: the replicas of one process share its interpreter lock, which on a small host caps a
one-process harness far below the job sizes to measure.

Commands arrive on standard input, one JSON object a line: ``go`` (the common start time: replica r is
started at ``began + r / start_rate``, time.monotonic being system-wide), ``sample`` (the process's watched
views' counters), ``quit``. Events leave on the pipe named in the spec, one JSON object a line: ``ready``,
``started``, ``applied`` (with the step's ``StepStats`` figures the harness uses), ``killed``, ``outcome``,
``sample``, ``finished``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TextIO

import torch

from lightning_recover import env
from lightning_recover.bench.stand_in_data_plane import DataPlaneClient, StandInGroups
from lightning_recover.control_plane.config import parse
from lightning_recover.control_plane.watch_relay import WatchRelay
from lightning_recover.launch.host_relay import RelayPlacement, start_host_relay
from lightning_recover.launch.process_tree import die_with_parent, end_helper_process
from lightning_recover.protocol import Fault, FaultInjector, RecoverOptions, Replica
from lightning_recover.protocol.faults import parse_faults
from lightning_recover.protocol.messages import JobSecret
from lightning_recover.protocol.step import StepStats


@dataclass
class ScaleConfig:
    """One run: ``replicas`` replicas on ``backend`` ('etcd' or 'embedded'), as threads of ``processes`` worker
    processes (0: one per 32 replicas)."""

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
    processes: int = 0
    #: on etcd, each worker process (a host) runs a watch relay that its replicas' views follow, as a launcher does
    watch_relays: bool = False
    #: with watch relays: this many ``lightning-recover watch-relay`` processes (racks) that the workers' relays
    #: follow over TCP instead of watching etcd (worker i follows rack i mod this)
    rack_relays: int = 0
    #: with watch relays: the workers are in this many racks (worker i in rack i mod this), each electing one of its
    #: workers' relays to watch etcd and serve the others (a launcher's ``--watch-rack``)
    watch_racks: int = 0

    @property
    def steps(self) -> int:
        return self.warmup + self.window + self.kills * self.gap + 1

    def options(self) -> RecoverOptions:
        """Every replica's options (checked by the harness before it starts anything)."""
        return RecoverOptions(
            microbatches=self.replicas,
            heartbeat_timeout=self.heartbeat_timeout,
            heartbeat_interval=self.heartbeat_interval,
            join_timeout=120.0,
            collective_timeout=120.0,
            startup_timeout=600.0,
        )

    @property
    def worker_processes(self) -> int:
        """The worker processes the replicas are spread over: enough that each one's threads fit its share of
        a core, at most one per replica."""
        return max(1, min(self.replicas, self.processes or self.replicas // 32))


class _Killed(BaseException):
    """Ends a replica thread as SIGKILL ends a process (no protocol handler sees it)."""


class _Events:
    """The event pipe to the harness: JSON lines, one writer at a time."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", buffering=1)
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, separators=(",", ":"))
        with self._lock:
            try:
                self._out.write(line + "\n")
            except (BrokenPipeError, ValueError):
                end_helper_process(3)  # the harness is gone: nobody reads the results


class ScaleWorker:
    """This process's replica threads, started on ``go``, reported on the event pipe."""

    def __init__(self, spec: dict, events: _Events, plane: Any) -> None:
        self.cfg = ScaleConfig(**spec["config"])
        self.replicas: list[int] = [int(r) for r in spec["replicas"]]
        self.faults: list[Fault] = parse_faults(",".join(spec["faults"]), self.cfg.replicas)
        self.addr: str = spec["addr"]
        self.secret = JobSecret.from_file(spec["secret_file"])
        self.events = events
        self.plane = plane
        self.outcomes = {r: "running" for r in self.replicas}
        self.protocol_replicas: dict[int, Replica] = {}
        self.threads: list[threading.Thread] = []
        self.relay: Optional[WatchRelay] = None
        if spec.get("relay"):  # as a host's launcher: one watch of the job's keys for this process's replicas
            settings = parse(self.addr)
            assert settings is not None
            upstream = tuple(spec["upstream"]) if spec.get("upstream") else None
            placement = RelayPlacement(upstream=upstream, rack=spec.get("rack"), rack_address="127.0.0.1")
            self.relay, _ = start_host_relay(settings, self.secret.key, spec["relay"], placement, say=lambda _: None)
            os.environ[env.WATCH_RELAY] = spec["relay"]

    def serve(self, commands: TextIO) -> None:
        """Answer the harness's commands until ``quit`` or the end of ``commands``."""
        self.events.emit("ready", replicas=len(self.replicas))
        for line in commands:
            command = json.loads(line)
            op = command.get("op")
            if op == "go" and not self.threads:
                self.start(float(command["began"]))
            elif op == "sample":
                self.events.emit("sample", id=command["id"], **self.sample())
            elif op == "quit":
                break

    def start(self, began: float) -> None:
        for replica in self.replicas:
            release = began + replica / self.cfg.start_rate
            thread = threading.Thread(
                target=self._replica, args=(replica, release), name=f"scale-{replica}", daemon=True
            )
            thread.start()
            self.threads.append(thread)
        threading.Thread(target=self._finish, name="scale-finish", daemon=True).start()

    def _finish(self) -> None:
        for thread in self.threads:
            thread.join()
        self.events.emit("finished")

    def sample(self) -> dict:
        """The watched views' counters summed over the live replicas of this process."""
        live = [r for r, outcome in self.outcomes.items() if outcome in ("running", "done")]
        views = [v for v in (self._view(r) for r in live) if v is not None]
        # The views with a watch stream of their own on etcd: the relay's, and any replica's that is not relayed.
        streams = [v for v in views if not getattr(v, "relayed", False)]
        relay_view = self.relay.view if self.relay is not None else None
        streams += [relay_view] if relay_view is not None and not getattr(relay_view, "relayed", False) else []
        return {
            "watch_events": sum(v.events for v in views),
            "watch_bytes": sum(v.payload_bytes for v in views),
            "resyncs": sum(v.resyncs for v in views),
            "confirms": sum(v.confirms for v in views),
            "views": len(views),
            "etcd_streams": len(streams),
            "etcd_stream_bytes": sum(v.payload_bytes for v in streams),
        }

    def _view(self, replica: int) -> Any:
        protocol_replica = self.protocol_replicas.get(replica)
        store = protocol_replica.membership.store if protocol_replica is not None else None
        return getattr(store.raw, "view", None) if store is not None else None

    # ------------------------------------------------------------------ a replica thread
    def _act(self, replica: int) -> Callable[[Fault], None]:
        def act(fault: Fault) -> None:
            self.events.emit("killed", replica=replica, t=time.monotonic())
            raise _Killed(str(fault))

        return act

    def _replica(self, replica: int, release: float) -> None:
        cfg = self.cfg
        options = cfg.options()
        param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        injector = FaultInjector(self.faults, replica, 1, act=self._act(replica))
        protocol_replica = self.protocol_replicas[replica] = Replica(
            options, self.addr, replica, cfg.replicas, lambda: [param], injector=injector, secret=self.secret
        )
        protocol_replica.membership.groups = StandInGroups(self.plane, replica)
        reported = 0  # StepStats already sent
        try:
            time.sleep(max(0.0, release - time.monotonic()))
            protocol_replica.start(exit_hook=False)
            self.events.emit("started", replica=replica, t=time.monotonic())
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
                stats = [
                    [
                        st.step,
                        st.decide_seconds,
                        st.recoveries,
                        st.recovery_seconds,
                        _regroup_seconds(st),
                        st.barrier_seconds,
                    ]
                    for st in protocol_replica.history[reported:]
                ]
                reported = len(protocol_replica.history)
                grad = param.grad.item()
                self.events.emit("applied", replica=replica, step=s, t=time.monotonic(), stats=stats, grad=grad)
            protocol_replica.close()
            self._outcome(replica, "done")
        except _Killed:
            self.outcomes[replica] = "killed"
            try:
                self.plane.kill(replica)  # its sockets close: the group's operations fail at once
                protocol_replica.membership.close()  # threads stop; the death notice its launcher writes on its exit
                protocol_replica.membership.store.raw.close()  # its connections and watched views
            finally:
                self._outcome(replica, "killed")
        except BaseException as exc:  # noqa: BLE001 -- reported in the results
            try:
                protocol_replica.close()
            except BaseException:  # noqa: BLE001 -- already failing
                pass
            self._outcome(replica, "error", f"{type(exc).__name__}: {exc}")

    def _outcome(self, replica: int, outcome: str, error: str = "") -> None:
        self.outcomes[replica] = outcome
        self.events.emit("outcome", replica=replica, outcome=outcome, error=error)


def _regroup_seconds(stats: StepStats) -> float:
    """The seconds the replica spent forming new generations in this step."""
    return sum(e.get("seconds", 0.0) for e in stats.events if e["kind"] == "regroup")


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m lightning_recover.bench.scale_worker SPEC``: run the spec's replicas until told to quit."""
    (path,) = sys.argv[1:] if argv is None else argv
    with open(path) as f:
        spec = json.load(f)
    die_with_parent(int(spec["parent"]))
    events = _Events(int(spec["events_fd"]))
    plane = DataPlaneClient(spec["data_plane"])
    worker = ScaleWorker(spec, events, plane)
    worker.serve(sys.stdin)
    if all(not t.is_alive() for t in worker.threads):
        plane.close()  # a clean end: the server must not take the closed connection for this process's death
    # Replica threads still running (a failed run) end with the process, as a crashed replica's would.
    end_helper_process(0)


if __name__ == "__main__":
    main()
