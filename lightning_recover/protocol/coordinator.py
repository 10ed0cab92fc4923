"""The coordinator (server side): a TCPStore server in its own process, plus a heartbeat monitor.

Replicas never hold a default process group across each other. Everything they must agree on
(generations, commit decisions, who is dead) goes through this store, whose operations are
linearizable: the first ``compare_set`` of a key wins and everyone reads the same value.

Keys (all small strings):

``inc/{r}``        incarnation counter of replica r (bumped by each (re)start of r)
``hb/{r}``         heartbeat counter of replica r (bumped every ``heartbeat_interval``);
                   ``hb/{r}/i{i}`` per process when replicas have K > 1 processes
``dead/{r}``       the incarnation of r declared dead ("0" = none)
``events``         bumped on every death and every proposed generation (one cheap read
                   tells a waiting replica whether anything changed)
``gen/latest``     newest generation that has been proposed
``g{G}/...``       the membership round of generation G (see ``membership.py``)
``s{S}/g{G}/...``  step S's reduce under generation G: done counter and the commit decision

The monitor declares a replica dead when its heartbeat counter has not moved for
``heartbeat_timeout`` seconds of the coordinator's own clock (no cross-host clock comparison).
The launcher also declares a replica dead as soon as it sees the process exit.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import torch.distributed as dist

from lightning_recover.protocol.messages import mark_dead

_STORE_TIMEOUT = datetime.timedelta(seconds=60)


def _hb_keys(r: int, replica_size: int) -> list[str]:
    return [f"hb/{r}"] if replica_size == 1 else [f"hb/{r}/i{i}" for i in range(replica_size)]


def _init_keys(store: dist.TCPStore, replicas: int, replica_size: int = 1) -> None:
    for r in range(replicas):
        store.set(f"dead/{r}", "0")
        store.add(f"inc/{r}", 0)
        for key in _hb_keys(r, replica_size):
            store.add(key, 0)
    store.add("events", 0)
    store.set("gen/latest", "0")
    store.set("meta/replicas", str(replicas))
    store.set("meta/replica_size", str(replica_size))


def _monitor(store: dist.TCPStore, replicas: int, timeout: float, stop: threading.Event,
             replica_size: int = 1) -> None:
    """Declare dead every replica one of whose heartbeat counters stopped moving."""
    beats = [(r, key) for r in range(replicas) for key in _hb_keys(r, replica_size)]
    keys = [key for _, key in beats] + [f"inc/{r}" for r in range(replicas)]
    last: dict[str, tuple[int, int, float]] = {}
    poll = min(0.02, timeout / 10)
    while not stop.wait(poll):
        values = [int(v) for v in store.multi_get(keys)]
        now = time.monotonic()
        for n, (r, key) in enumerate(beats):
            hb, inc = values[n], values[len(beats) + r]
            if inc == 0:
                continue  # not started yet
            prev = last.get(key)
            if prev is None or prev[0] != hb or prev[1] != inc:
                last[key] = (hb, inc, now)
            elif now - prev[2] > timeout and hb > 0:
                if int(store.get(f"dead/{r}")) < inc and mark_dead(store, r, inc):
                    print(f"[coordinator] replica {r} (incarnation {inc}, {key}) missed heartbeats for "
                          f"{now - prev[2]:.2f}s: declared dead", flush=True)


class Coordinator:
    """The store server and its heartbeat monitor; :func:`serve` runs one until SIGTERM.

    In-process use (tests): ``c = Coordinator("127.0.0.1", 0, replicas, 1.0)``, then
    ``threading.Thread(target=c.monitor, args=(stop_event,))``; ``c.addr`` is what replicas connect to.
    """

    def __init__(self, host: str, port: int, replicas: int, heartbeat_timeout: float, replica_size: int = 1) -> None:
        self.host = host
        self.replicas = replicas
        self.replica_size = replica_size
        self.heartbeat_timeout = heartbeat_timeout
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT,
                                   use_libuv=True)
        _init_keys(self.store, replicas, replica_size)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.store.port}"

    def monitor(self, stop: threading.Event) -> None:
        """Declare dead every replica whose heartbeat stopped, until ``stop`` is set."""
        _monitor(self.store.clone(), self.replicas, self.heartbeat_timeout, stop, self.replica_size)


def serve(host: str, port: int, replicas: int, heartbeat_timeout: float, ready_fd: int | None = None,
          replica_size: int = 1) -> None:
    coordinator = Coordinator(host, port, replicas, heartbeat_timeout, replica_size)
    line = f"LISTENING {coordinator.addr}\n"
    if ready_fd is not None:
        os.write(ready_fd, line.encode())
        os.close(ready_fd)
    print(f"[coordinator] {line.strip()} replicas={replicas} heartbeat_timeout={heartbeat_timeout}s", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        coordinator.monitor(stop)
    except Exception as exc:  # a store failure here means the server itself is broken
        print(f"[coordinator] monitor stopped: {exc}", flush=True)
        raise
