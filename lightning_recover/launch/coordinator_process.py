"""The coordinator as a child process of a launcher (or alone: ``lightning-recover coordinator``)."""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

from lightning_recover import env
from lightning_recover.protocol import coordinator


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
          timeout: float = 60.0, replica_size: int = 1) -> CoordinatorProcess:
    """Start the coordinator in a child process and wait until it listens."""
    read_fd, write_fd = os.pipe()
    # `-c` rather than `-m`: the package imports this module, and runpy warns about re-executing it.
    cmd = [sys.executable, "-c", "import sys; from lightning_recover.launch.coordinator_process import main; sys.exit(main())",
           "--host", host, "--port", str(port),
           "--replicas", str(replicas), "--heartbeat-timeout", str(heartbeat_timeout), "--ready-fd", str(write_fd),
           "--replica-size", str(replica_size)]
    child_env = dict(os.environ, **{env.OMP_NUM_THREADS: "1"})
    proc = subprocess.Popen(cmd, pass_fds=(write_fd,), env=child_env)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        while b"\n" not in buf:
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
    coordinator.serve(args.host, args.port, args.replicas, args.heartbeat_timeout, args.ready_fd,
                      replica_size=args.replica_size)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for multi-node)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0 = any free port, printed)")
    parser.add_argument("--replicas", type=int, required=True, help="number of replicas of the job")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0,
                        help="seconds without heartbeat before a replica is declared dead")
    parser.add_argument("--replica-size", type=int, default=1,
                        help="processes per replica (each heartbeats; one stale process makes its replica dead)")
