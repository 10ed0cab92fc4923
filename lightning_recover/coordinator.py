"""The coordinator: a TCPStore server in its own process, plus a heartbeat monitor.

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

import argparse
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from lightning_recover.errors import CoordinatorLostError

ENV_ADDR = "LIGHTNING_RECOVER_COORDINATOR"
_STORE_TIMEOUT = datetime.timedelta(seconds=60)


def connect(addr: str, timeout: float = 60.0) -> dist.TCPStore:
    """Connect a client to the coordinator at ``host:port``."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator address {addr!r} must be HOST:PORT (set {ENV_ADDR} or pass --coordinator)")
    try:
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # torch raises several types (DistNetworkError, RuntimeError)
        raise CoordinatorLostError(
            f"cannot reach the lightning-recover coordinator at {addr}: {exc}. "
            "HINT: start it with the launcher (`lightning-recover run`) or `lightning-recover coordinator`."
        ) from exc


def mark_dead(store: dist.TCPStore, replica: int, incarnation: int | None = None) -> bool:
    """Declare ``replica`` (its current or the given incarnation) dead.

    ``dead/{r}`` only ever grows, so a stale notice for an older incarnation can never mark a
    restarted replica dead. Returns False when that incarnation was already declared dead.
    """
    inc = incarnation if incarnation is not None else int(store.add(f"inc/{replica}", 0))
    while True:
        current = store.get(f"dead/{replica}").decode()
        if int(current) >= inc or inc <= 0:
            return False
        if store.compare_set(f"dead/{replica}", current, str(inc)).decode() == str(inc):
            store.add("events", 1)
            return True


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


def serve(host: str, port: int, replicas: int, heartbeat_timeout: float, ready_fd: int | None = None) -> None:
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT,
                          use_libuv=True)
    _init_keys(store, replicas)
    line = f"LISTENING {host}:{store.port}\n"
    if ready_fd is not None:
        os.write(ready_fd, line.encode())
        os.close(ready_fd)
    print(f"[coordinator] {line.strip()} replicas={replicas} heartbeat_timeout={heartbeat_timeout}s", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        _monitor(store, replicas, heartbeat_timeout, stop)
    except Exception as exc:  # a store failure here means the server itself is broken
        print(f"[coordinator] monitor stopped: {exc}", flush=True)
        raise


@dataclass
class CoordinatorProcess:
    """A coordinator running in a child process (started by the launcher)."""

    proc: subprocess.Popen
    addr: str

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(replicas: int, heartbeat_timeout: float, host: str = "127.0.0.1", port: int = 0,
          timeout: float = 60.0) -> CoordinatorProcess:
    """Start ``python -m lightning_recover.coordinator`` and wait until it listens."""
    read_fd, write_fd = os.pipe()
    # `-c` rather than `-m`: the package imports this module, and runpy warns about re-executing it.
    cmd = [sys.executable, "-c", "import sys; from lightning_recover.coordinator import main; sys.exit(main())",
           "--host", host, "--port", str(port),
           "--replicas", str(replicas), "--heartbeat-timeout", str(heartbeat_timeout), "--ready-fd", str(write_fd)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, pass_fds=(write_fd,), env=env)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while b"\n" not in buf:
            import select

            ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"the coordinator did not start within {timeout}s")
            chunk = os.read(read_fd, 256)
            if not chunk:
                raise RuntimeError(f"the coordinator exited before listening (exit code {proc.wait()})")
            buf += chunk
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    finally:
        os.close(read_fd)
    return CoordinatorProcess(proc, buf.decode().split()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-recover coordinator", description="run the coordinator")
    add_arguments(parser)
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.replicas, args.heartbeat_timeout, args.ready_fd)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for multi-node)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0 = any free port, printed)")
    parser.add_argument("--replicas", type=int, required=True, help="number of replicas of the job")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0,
                        help="seconds without heartbeat before a replica is declared dead")


if __name__ == "__main__":
    sys.exit(main())
