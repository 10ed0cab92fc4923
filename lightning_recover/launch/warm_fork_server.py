"""A warm fork server: torch and Lightning imported once, for every job started on this host.

Each job's launcher starts its own fork server (``launch/fork_server.py``), which imports torch and
Lightning before the first replica can start: seconds of CPU per job. Someone who starts many short
jobs (tests, a notebook, a sweep) can keep one server warm instead::

    lightning-recover fork-server --socket /tmp/lr.sock &
    export LIGHTNING_RECOVER_FORK_SERVER=/tmp/lr.sock

A launcher that finds the variable connects, and the server forks a *session* for that job alone: a
process that serves the launcher's requests exactly as the job's own fork server would
(:func:`~lightning_recover.launch.fork_server.fork_on_request`, over the connection), so a job's
replicas are never the children of another job's process. The session ends when its launcher closes
the connection or dies, and the replicas it forked die with it (parent-death signal), as they die with
a job's own server.

A forked child keeps what its server's interpreter started with: the interpreter, user, namespaces,
cgroup, CPU affinity, resource limits and the environment variables read while torch and Lightning load.
Each session sends these (:func:`~lightning_recover.launch.fork_server.fit_key`) and the launcher uses
the server only where they equal its job's (it may have imported more modules than the job preloads);
otherwise (a Slurm step's cgroup, a job in another network namespace, another ``PYTHONPATH``) it says which
differ and starts its own. Connections from other users are refused; the socket is created readable and
writable by its owner only.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import signal
import socket
import stat
import struct
import sys
from collections.abc import Sequence
from typing import Optional

from lightning_recover import env
from lightning_recover.launch.fork_server import (
    DEFAULT_PRELOAD,
    TITLE_ROOM,
    ChildCommand,
    fit_key,
    fork_on_request,
    prepare,
    run_job,
    send_line,
    show_as,
)
from lightning_recover.launch.process_tree import end_helper_process, set_parent_death_signal

DESCRIPTION = (
    "Import torch and Lightning once and fork the replicas of every job started on this host with "
    f"{env.FORK_SERVER} set to the socket, instead of a fork server per job. Stops on SIGTERM or Ctrl-C."
)


class SocketInUse(RuntimeError):
    """Another server already listens at the path."""


def listen(path: str) -> socket.socket:
    """A listening socket at ``path`` (0600), replacing a stale one left by a server that died.

    Raises:
        SocketInUse: a server answers at ``path``.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SocketInUse(f"{path} exists and is not a socket: choose another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # its server is gone
        else:
            raise SocketInUse(f"a fork server already listens at {path}: use it, or stop it first")
        finally:
            probe.close()
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(64)
    return listener


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _reap(sessions: set[int]) -> None:
    for pid in list(sessions):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            sessions.discard(pid)


def _session(conn: socket.socket, loaded: str, key: dict) -> ChildCommand:
    """In a session process: serve one launcher; returns only in a child it forked (that child's job)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's handler is not the children's
    # As the job's own server: a Ctrl-C reaching this process group must not end the session (its replicas with it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        show_as(["lightning-recover fork server", "--session", f"--preload={key['preload']}"])
    except (OSError, ValueError, IndexError):
        pass
    conn.settimeout(10.0)
    try:  # the launcher's standard streams become this session's, and so its children's
        _, streams, _, _ = socket.recv_fds(conn, 1, 3)
    except OSError:
        streams = []
    if len(streams) != 3:
        end_helper_process(1)
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)
    conn.settimeout(None)
    fd = conn.detach()
    send_line(fd, {"ready": True, "loaded": loaded, "pid": os.getpid(), "key": key})
    job = fork_on_request(fd, fd)
    if job is None:
        end_helper_process(0)  # the launcher is done (or gone): its replicas die with this process
    return job


def serve_warm(path: str, preload: Sequence[str]) -> Optional[ChildCommand]:
    """Import ``preload``, listen at ``path`` and fork a session per connection until SIGTERM or SIGINT.
    Returns a job only in a process a session forked; None when the server stops."""
    started_with = {k: v for k, v in os.environ.items() if k != env.FORK_ROOM}
    ready, loaded = prepare(preload)
    if not ready:
        print(f"[lightning-recover] fork server: cannot fork safely: {loaded}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    # What the imports saw, and the variables they set themselves (every process that imports them sets them: a
    # launcher that imported torch has them, one that did not has not; neither difference is one of the job's).
    key = fit_key(started_with, preload)
    key["set_by_imports"] = sorted(k for k, v in os.environ.items() if k != env.FORK_ROOM and started_with.get(k) != v)
    try:
        listener = listen(path)
    except SocketInUse as exc:
        print(f"[lightning-recover] fork server: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    server_pid, ours = os.getpid(), os.stat(path).st_ino
    stop_r, stop_w = os.pipe()  # a signal handler's byte wakes the loop (no work in the handler)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os.write(stop_w, b"x"))
    print(f"[lightning-recover] fork server: warm at {path} ({loaded} imported); export {env.FORK_SERVER}={path}")
    sys.stdout.flush()
    sessions: set[int] = set()
    try:
        while True:
            readable, _, _ = select.select([listener, stop_r], [], [], 1.0)
            _reap(sessions)
            if stop_r in readable:
                return None
            if listener not in readable:
                continue
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.ECONNABORTED):
                    continue
                raise
            if peer_uid(conn) != os.getuid():
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for fd in (stop_r, stop_w):
                    os.close(fd)
                return _session(conn, loaded, key)
            conn.close()
            sessions.add(pid)
    finally:
        if os.getpid() == server_pid:  # not in a forked child unwinding through here
            try:
                if os.stat(path).st_ino == ours:
                    os.unlink(path)
            except OSError:
                pass


def default_socket() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/lightning-recover-{os.getuid()}"
    return os.path.join(runtime, "lightning-recover-fork-server.sock")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        default=None,
        help="where to listen (default: lightning-recover-fork-server.sock in XDG_RUNTIME_DIR, or in "
        "/tmp/lightning-recover-UID)",
    )
    parser.add_argument(
        "--preload",
        default=",".join(DEFAULT_PRELOAD),
        help="modules to import once (default: %(default)s; a launcher uses the server only for the same list)",
    )
    parser.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started it ends (tests, scripts)"
    )


def add_subcommand(sub: argparse._SubParsersAction, help_line: str) -> None:
    p = sub.add_parser(
        "fork-server",
        help=help_line,
        description=DESCRIPTION,
        epilog=f"example: lightning-recover fork-server --socket /tmp/lr.sock & export {env.FORK_SERVER}=/tmp/lr.sock",
    )
    add_arguments(p)
    p.set_defaults(func=start_from_command_line)


def start_from_command_line(args: argparse.Namespace) -> int:
    """Become the server: a new interpreter whose argument and environment areas have room for the
    command lines its children show (``fork_server.show_as``)."""
    argv = ["--socket", args.socket or default_socket(), "--preload", args.preload, "--room", "." * TITLE_ROOM]
    if args.exit_with_parent:
        argv.append("--exit-with-parent")
    os.makedirs(os.path.dirname(os.path.abspath(argv[1])), mode=0o700, exist_ok=True)
    code = "from lightning_recover.launch.warm_fork_server import main; main()"
    os.execve(
        sys.executable, [sys.executable, "-c", code, *argv], dict(os.environ, **{env.FORK_ROOM: "." * TITLE_ROOM})
    )


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-recover fork-server", description=DESCRIPTION)
    add_arguments(parser)
    parser.add_argument("--room", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.exit_with_parent:  # the parent-death signal alone: a watchdog thread would make forking unsafe
        parent = os.getppid()
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:
            raise SystemExit(1)
    try:
        show_as(["lightning-recover fork-server", f"--socket={args.socket}"])
    except (OSError, ValueError, IndexError):
        pass
    job = serve_warm(args.socket or default_socket(), [m for m in args.preload.split(",") if m])
    if job is None:
        end_helper_process(0)
    run_job(job)
