"""The coordinator as a child process of a launcher (or alone: ``lightning-recover coordinator``)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from lightning_recover import env
from lightning_recover.control_plane.priority import control_nice, set_thread_nice
from lightning_recover.launch.fork_server import ForkServer, Process
from lightning_recover.launch.process_tree import describe_exit, die_with_parent, end_helper_process, is_stopped, libc
from lightning_recover.observe.address import parse_address
from lightning_recover.observe.logs import configure_logging
from lightning_recover.protocol import coordinator
from lightning_recover.protocol.options import DEFAULT_HEARTBEAT_INTERVAL, check_heartbeat_timeout

log = logging.getLogger(__name__)


@dataclass
class CoordinatorProcess:
    """A coordinator running in a child process (started by the launcher)."""

    proc: Process  # a new interpreter, or forked by a warm fork server's session
    addr: str
    status_url: str | None = None  # where it serves the job's status page (``--status-address``)
    session: ForkServer | None = None  # the warm fork server's session that forked it, closed once it is stopped

    def running(self) -> bool:
        return self.proc.poll() is None

    def exited(self) -> str | None:
        """How it ended, once it has (the job cannot go on without it)."""
        return None if self.proc.poll() is None else f"it exited ({describe_exit(self.proc.returncode)})"

    def frozen(self) -> bool:
        return is_stopped(self.proc.pid)

    def describe(self) -> str:
        return f"coordinator at {self.addr} (pid {self.proc.pid})"

    def kill(self) -> None:
        self.proc.kill()

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.session is not None:
            self.session.close()


def start(
    replicas: int,
    heartbeat_timeout: float,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 300.0,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    hang_timeout: float = 60.0,
    secret_file: str | None = None,
    replica_size: int = 1,
    status_address: str | None = None,
    event_log: str | None = None,
) -> CoordinatorProcess:
    """Start the coordinator in a child process and wait until it listens; it dies with this process.
    ``status_address``/``event_log``: see :func:`~lightning_recover.protocol.coordinator.serve`. Where a warm fork
    server fits (``LIGHTNING_RECOVER_FORK_SERVER``), a session of its own forks it: torch is imported there."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    check_heartbeat_timeout(heartbeat_timeout, heartbeat_interval)
    libc()
    options = [
        "--host",
        host,
        "--port",
        str(port),
        "--replicas",
        str(replicas),
        "--heartbeat-timeout",
        repr(float(heartbeat_timeout)),
        "--heartbeat-interval",
        repr(float(heartbeat_interval)),
        "--hang-timeout",
        repr(float(hang_timeout)),
        "--replica-size",
        str(replica_size),
    ]
    if status_address is not None:
        options += ["--status-address", status_address]
    if event_log is not None:
        options += ["--event-log", event_log]
    child_env = dict(os.environ, **{env.OMP_NUM_THREADS: "1", env.CONTROL_PROCESS: "1"})
    if secret_file is not None:
        child_env[env.SECRET_FILE] = secret_file
    forked = _fork(options, child_env)
    session = None
    if forked is not None:
        proc, read_fd, fifo_dir, session = forked
    else:
        read_fd, write_fd = os.pipe()
        cmd = [sys.executable, "-c", _MAIN, *options, "--ready-fd", str(write_fd), "--parent-pid", str(os.getpid())]
        proc, fifo_dir = subprocess.Popen(cmd, pass_fds=(write_fd,), env=child_env), None
        os.close(write_fd)
    try:
        words = _ready_line(proc, read_fd, timeout).split()  # LISTENING ADDR [STATUS URL]
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if session is not None:
            session.close()
        raise
    finally:
        os.close(read_fd)
        if fifo_dir is not None:
            shutil.rmtree(fifo_dir, ignore_errors=True)
    status_url = words[3] if len(words) > 3 and words[2] == "STATUS" else None
    return CoordinatorProcess(proc, words[1], status_url, session)


def _ready_line(proc: Process, read_fd: int, timeout: float) -> str:
    """The coordinator's first line on ``read_fd``, once it listens."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            # Bounds a start that hangs only (one that fails ends the pipe, or exits, at once): importing torch took
            # over 60 s on a 2-core host under load 30, and a job then failed to start.
            raise TimeoutError(f"the coordinator did not start within {timeout}s")
        ready, _, _ = select.select([read_fd], [], [], min(left, EXIT_CHECK_PERIOD))
        chunk = os.read(read_fd, 256) if ready else b""
        if (ready and not chunk) or (not ready and proc.poll() is not None):  # the pipe ended, or it exited
            raise RuntimeError(f"the coordinator exited before listening (exit code {proc.wait()})")
        buf += chunk
    return buf.decode()


# `-c` rather than `-m`: the package imports this module, and runpy warns about re-executing it.
_MAIN = "import sys; from lightning_recover.launch.coordinator_process import main; sys.exit(main())"
EXIT_CHECK_PERIOD = 0.1  # seconds between checks that a coordinator not yet listening still runs


def _fork(options: list[str], child_env: dict[str, str]) -> tuple[Process, int, str, ForkServer] | None:
    """The coordinator forked by a session of the warm fork server where one fits, the descriptor its ready
    line comes on, the directory to remove once it came, and the session (the coordinator's alone: the job's
    replicas' session ends before the coordinator is stopped); None otherwise.

    A forked process inherits none of this one's descriptors, so the line comes through a FIFO, which this
    process holds open for writing too (so that it never reads an end of file: a coordinator that dies is seen
    by its exit status)."""
    path = child_env.get(env.FORK_SERVER)
    if not path:
        return None
    # A new coordinator interpreter skips Lightning's import (CONTROL_PROCESS); a forked one has it, unused.
    fits = {k: v for k, v in child_env.items() if k != env.CONTROL_PROCESS}
    session = ForkServer.attach(path, fits, lambda line: log.debug("coordinator: %s", line))
    if session is None:
        return None
    fifo_dir = tempfile.mkdtemp(prefix="lightning-recover-coordinator-")
    fifo = os.path.join(fifo_dir, "ready")
    os.mkfifo(fifo, 0o600)
    read_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    argv = [sys.executable, "-c", _MAIN, *options, "--ready-fifo", fifo, "--parent-pid", str(session.pid)]
    proc = session.spawn(argv, child_env)
    if proc is None:
        os.close(read_fd)
        shutil.rmtree(fifo_dir, ignore_errors=True)
        session.close()
        return None
    return proc, read_fd, fifo_dir, session


def main(argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(prog="lightning-recover coordinator", description="run the coordinator")
    add_arguments(parser)
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ready-fifo", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    try:
        nice = control_nice()
        if nice is not None:
            set_thread_nice(nice)  # first: the threads started below inherit it
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging("coordinator")
    if args.parent_pid is not None:  # started by a launcher (or its fork server): never outlive it
        die_with_parent(args.parent_pid)
    if args.ready_fifo is not None:
        args.ready_fd = os.open(args.ready_fifo, os.O_WRONLY)
    coordinator.serve(
        args.host,
        args.port,
        args.replicas,
        args.heartbeat_timeout,
        args.ready_fd,
        hang_timeout=args.hang_timeout,
        secret_file=args.secret_file,
        replica_size=args.replica_size,
        status_address=args.status_address,
        event_log=args.event_log,
    )
    end_helper_process(0)  # stopped (SIGTERM from the launcher): nothing to finalize


def int_in_range(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (``high`` None = unbounded), said with ``what``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer ({what})") from None
        if value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{value} is not in {bound} ({what})")
        return value

    return parse


replica_count = int_in_range(1, None, "a job has at least 1 replica, e.g. --replicas 3")
port_number = int_in_range(0, 65535, "0 = any free port")
non_negative_int = int_in_range(0, None, "a count, e.g. 0")


def seconds(text: str) -> float:
    """argparse type of a duration: a finite number > 0 (nan would silently turn a timeout off)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 1.0)") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number of seconds (e.g. 1.0)")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number of seconds (e.g. 1.0)")
    return value


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks of :func:`add_arguments` that involve two options."""
    try:
        check_heartbeat_timeout(args.heartbeat_timeout, args.heartbeat_interval)
    except ValueError as exc:
        parser.error(f"--heartbeat-timeout: {exc}")


def heartbeat_timeout_seconds(text: str) -> float:
    """argparse type of --heartbeat-timeout: finite, > 0 and > 2 x the replicas' heartbeat interval."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 1.0)") from None
    if not math.isfinite(value):  # nan would turn hang detection off, inf never declares anyone dead
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number of seconds (e.g. 1.0)")
    try:
        return check_heartbeat_timeout(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the one address to bind (default loopback; a multi-node job names this machine's "
        "address on the private network the replicas use)",
    )
    parser.add_argument("--port", type=port_number, default=0, help="port to bind (0 = any free port, printed)")
    parser.add_argument("--replicas", type=replica_count, required=True, help="number of replicas of the job")
    parser.add_argument(
        "--heartbeat-timeout",
        type=seconds,
        default=1.0,
        help="seconds without heartbeat before a replica is declared dead " "(> 2 x --heartbeat-interval)",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=seconds,
        default=DEFAULT_HEARTBEAT_INTERVAL,
        help="the replicas' heartbeat period (RecoverOptions.heartbeat_interval)",
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help="the job's secret (a 0600 file of hex, e.g. `openssl rand -hex 32`); default: "
        "$LIGHTNING_RECOVER_SECRET_FILE or $LIGHTNING_RECOVER_SECRET. Every replica needs the same",
    )
    parser.add_argument(
        "--hang-timeout",
        type=seconds,
        default=60.0,
        help="seconds without progress of a replica's main thread, while its peers wait on it, "
        "before it is declared hung",
    )
    parser.add_argument(
        "--replica-size",
        type=replica_count,
        default=1,
        help="processes per replica (each heartbeats; one stale process makes its replica dead)",
    )
    add_status_arguments(parser)


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """``--status-address`` and ``--event-log``: what the job's monitor shows (``run``, ``torchrun``, ``coordinator``)."""
    parser.add_argument(
        "--status-address",
        type=status_address,
        default=None,
        help="serve the job's status page (/), /status (JSON) and /metrics (Prometheus) at [HOST:]PORT (default: "
        "off; loopback unless a host is given; 0 = any free port, said in the log). On etcd each launcher serves "
        "it while it holds the monitor role",
    )
    parser.add_argument(
        "--event-log",
        default=None,
        help="append every event of the job (deaths, recoveries, joins) to this file, one JSON object per line",
    )


def status_address(text: str) -> str:
    """argparse type of ``--status-address``: checked here, bound by the monitor."""
    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
