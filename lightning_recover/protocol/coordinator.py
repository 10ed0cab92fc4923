"""The coordinator (server side): a TCPStore server in its own process, plus a heartbeat monitor.

Replicas never hold a default process group across each other. Everything they must agree on
(generations, commit decisions, who is dead) goes through this store, whose operations are
linearizable: the first ``compare_set`` of a key wins and everyone reads the same value.

Keys (all small strings):

``inc/{r}``        incarnation counter of replica r (bumped by each (re)start of r)
``hb/{r}``         heartbeat counter of replica r (bumped every ``heartbeat_interval``)
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
import socket
import threading
import time

import torch.distributed as dist

from lightning_recover.protocol.messages import mark_dead

_STORE_TIMEOUT = datetime.timedelta(seconds=60)


def _init_keys(store: dist.TCPStore, replicas: int) -> None:
    for r in range(replicas):
        store.set(f"dead/{r}", "0")
        store.add(f"inc/{r}", 0)
        store.add(f"hb/{r}", 0)
    store.add("events", 0)
    store.set("gen/latest", "0")
    store.set("meta/replicas", str(replicas))


def _monitor(store: dist.TCPStore, replicas: int, timeout: float, stop: threading.Event) -> None:
    """Declare dead every replica whose heartbeat counter stopped moving."""
    keys = [f"hb/{r}" for r in range(replicas)] + [f"inc/{r}" for r in range(replicas)]
    last: dict[int, tuple[int, int, float]] = {}
    poll = min(0.02, timeout / 10)
    while not stop.wait(poll):
        values = [int(v) for v in store.multi_get(keys)]
        now = time.monotonic()
        for r in range(replicas):
            hb, inc = values[r], values[replicas + r]
            if inc == 0:
                continue  # not started yet
            prev = last.get(r)
            if prev is None or prev[0] != hb or prev[1] != inc:
                last[r] = (hb, inc, now)
            elif now - prev[2] > timeout and hb > 0:
                if int(store.get(f"dead/{r}")) < inc and mark_dead(store, r, inc):
                    print(f"[coordinator] replica {r} (incarnation {inc}) missed heartbeats for "
                          f"{now - prev[2]:.2f}s: declared dead", flush=True)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket bound to ``host`` only.

    TCPStore given a host still listens on every interface (``*:PORT``, IPv4 and IPv6); handing it
    a socket bound here (``master_listen_fd``, works with libuv in torch 2.13) keeps the control
    plane on loopback by default, and on the one address a multi-host job names.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot bind the coordinator to {host!r}: {exc}. HINT: --host takes an address "
                         "of this machine (127.0.0.1 for one-machine jobs).") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # "::" must not add IPv4 too
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind the coordinator to {host}:{port}: {exc.strerror}. "
                      "HINT: pick another --port (0 = any free port) or an address of this machine.") from None
    return sock


class Coordinator:
    """The store server and its heartbeat monitor; :func:`serve` runs one until SIGTERM.

    In-process use (tests): ``c = Coordinator("127.0.0.1", 0, replicas, 1.0)``, then
    ``threading.Thread(target=c.monitor, args=(stop_event,))``; ``c.addr`` is what replicas connect to.
    """

    def __init__(self, host: str, port: int, replicas: int, heartbeat_timeout: float) -> None:
        self.host = host
        self.replicas = replicas
        self.heartbeat_timeout = heartbeat_timeout
        # The store serves on this socket; keep it referenced as long as the store lives.
        self.socket = listen_socket(host, port)
        self.store = dist.TCPStore(host, self.socket.getsockname()[1], is_master=True, wait_for_workers=False,
                                   timeout=_STORE_TIMEOUT, use_libuv=True, master_listen_fd=self.socket.fileno())
        _init_keys(self.store, replicas)

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.store.port}"

    def monitor(self, stop: threading.Event) -> None:
        """Declare dead every replica whose heartbeat stopped, until ``stop`` is set."""
        _monitor(self.store.clone(), self.replicas, self.heartbeat_timeout, stop)


def serve(host: str, port: int, replicas: int, heartbeat_timeout: float, ready_fd: int | None = None) -> None:
    coordinator = Coordinator(host, port, replicas, heartbeat_timeout)
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
