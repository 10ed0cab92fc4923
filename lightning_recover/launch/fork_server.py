"""A fork server: replicas, restarted replicas and standbys start with torch and Lightning imported.

A replica started as a new interpreter spends most of its start-up importing torch and Lightning
(~6 s of CPU here, on the cores the training runs on; a restarted replica or a replacement standby
pays it again, beside the training). The launcher instead starts one *fork server* per job: a
process that imports those modules once, checks it is still a single thread (a fork with threads
running is unsafe), and then forks one child per replica or standby process on request.
The child takes the process's environment, argv and working directory and runs the user's script
as ``__main__`` (``runpy``), exactly as ``python script.py`` would, minus the imports.

The launcher and the server talk over two private pipes in JSON lines (nothing is unpickled).
The server reports each child's exit status, so the launcher supervises a forked process through
:class:`ForkedProcess`, which has the part of ``subprocess.Popen``'s interface the launchers use.
A child dies with the server (parent-death signal) and the server with the launcher; if the server
is lost, its children are killed and reported as killed (the launcher handles them as any replica
death), and new processes start as new interpreters.

Only commands that run a script or a module with this interpreter (``python script.py ...``,
``python -m module ...``) can be forked; any other command starts new processes as before.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import random
import resource
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_recover.env import CONTROL_PROCESS, FORK_ROOM, FORK_SERVER
from lightning_recover.launch.process_tree import end_helper_process, set_parent_death_signal

DEFAULT_PRELOAD = ("torch", "torch.distributed", "lightning")
REPLY_TIMEOUT = 10.0  # seconds the launcher waits for a fork's pid before it stops using the server
START_TIMEOUT = 120.0  # seconds the server may take to import before processes start without it
# Bytes of room in the server's argv and environment areas, which its children rewrite with their
# own (see show_as): what ps, /proc/PID/cmdline and /proc/PID/environ then show for each process.
TITLE_ROOM = 16384


# Environment variables read while the interpreter and torch load (a forked child keeps the values its server
# loaded with; Lightning's own PL_ variables are read when used), and the namespaces a child inherits.
_IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_")
_NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_AS", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_MEMLOCK")


def fit_key(child_env: dict[str, str], preload: Sequence[str]) -> dict[str, Any]:
    """What a process forked by a server inherits from it instead of taking from its own start: the
    interpreter, user, namespaces, cgroup, CPU affinity, resource limits and the import-time part of
    ``child_env``, and the modules it imported. A warm server is used only where its key equals the job's, field
    by field, except that it may have imported more modules than the job preloads (:func:`key_differences`)."""

    def read(path: str, link: bool = False) -> Optional[str]:
        try:
            if link:
                return os.readlink(path)
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    return {
        "interpreter": os.path.realpath(sys.executable),
        "preload": ",".join(preload),
        "user": [os.getuid(), os.getgid(), sorted(os.getgroups())],
        "namespaces": {ns: read(f"/proc/self/ns/{ns}", link=True) for ns in _NAMESPACES},
        "cgroup": read("/proc/self/cgroup"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "umask": _umask(),
        "limits": {name: list(resource.getrlimit(getattr(resource, name))) for name in _LIMITS},
        "environment": {
            k: v for k, v in sorted(child_env.items()) if k.startswith(_IMPORT_TIME_PREFIXES) or k == CONTROL_PROCESS
        },
    }


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def key_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The fields of two :func:`fit_key` results that differ, naming the entries of those that are tables
    (``environment PYTHONPATH``, ``namespaces net``). ``preload`` differs only where the server lacks a module the job
    preloads: one that imported more serves the job as well, its extra modules already loaded."""
    differ = []
    for name, value in ours.items():
        other = theirs.get(name)
        if name == "preload" and isinstance(value, str) and isinstance(other, str):
            if set(value.split(",")) - set(other.split(",")) - {""}:  # a job that preloads nothing fits any server
                differ.append(name)
        elif isinstance(value, dict) and isinstance(other, dict):
            differ += [
                f"{name} {entry}"
                for entry in sorted(value.keys() | other.keys())
                if value.get(entry) != other.get(entry)
            ]
        elif other != value:
            differ.append(name)
    return differ


def _standard_streams() -> list[int]:
    """Descriptors 0, 1 and 2, a new descriptor of /dev/null in place of any that is closed."""
    streams = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            streams.append(fd)
        except OSError:
            streams.append(os.open(os.devnull, os.O_RDWR))
    return streams


def _first_line(conn: socket.socket) -> bytes:
    """The first line the peer sends, read byte by byte so that nothing after it is consumed here."""
    line = b""
    while not line.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            raise OSError("it closed the connection")
        line += byte
    return line


def forkable(command: Sequence[str]) -> Optional[str]:
    """None if ``command`` runs a script or module with this interpreter, else why it cannot be forked."""
    if len(command) < 2:
        return "the command has no script"
    exe = shutil.which(command[0]) if not os.path.dirname(command[0]) else command[0]
    if exe is None or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return f"{command[0]!r} is not this interpreter ({sys.executable})"
    if command[1] == "-m":
        return None if len(command) > 2 else "-m without a module"
    if command[1].startswith("-"):
        return f"interpreter option {command[1]!r}"
    return None


# ---------------------------------------------------------------------------- launcher side


class ForkedProcess:
    """A process forked by the server: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``kill``, ``terminate``, as ``subprocess.Popen`` (the exit status comes from the server)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


Process = Union[subprocess.Popen, ForkedProcess]  # what a launcher supervises


class ForkServer:
    """The launcher's handle on its fork server: :meth:`start`, then :meth:`spawn` once :attr:`state`
    is ``"ready"``; ``"starting"`` while it imports; ``"failed"`` (with :attr:`why`) for good."""

    def __init__(
        self,
        proc: Optional[subprocess.Popen],
        requests: int,
        replies: int,
        say: Callable[[str], Any],
        connection: Optional[socket.socket] = None,
        pid: Optional[int] = None,
    ) -> None:
        self.proc = proc  # None for a session of a warm server (``connection``)
        self.pid = proc.pid if proc is not None else pid
        self._connection = connection
        self.state = "starting" if connection is None else "ready"
        self.why = ""
        self._say = say
        self._requests = requests
        self._replies = os.fdopen(replies, "rb", buffering=0)
        self._lock = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit code (Popen's convention)
        self._children: set[int] = set()
        self._next_id = 0
        self._started = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="fork-server-replies", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls,
        child_env: dict[str, str],
        say: Callable[[str], Any],
        preload: Sequence[str] = DEFAULT_PRELOAD,
        preexec: Optional[Callable[[], None]] = None,
    ) -> ForkServer:
        """Start the server (it imports ``preload`` in the background) with the job's environment."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        # -c, not -m: the package imports this module first, and runpy warns about running it as __main__
        cmd = [sys.executable, "-c", "from lightning_recover.launch.fork_server import main; main()"]
        cmd += [str(req_r), str(rep_w), "--preload", ",".join(preload), "--room", "." * TITLE_ROOM]
        server_env = dict(child_env, **{FORK_ROOM: "." * TITLE_ROOM})
        try:
            proc = subprocess.Popen(cmd, env=server_env, pass_fds=(req_r, rep_w), preexec_fn=preexec)
        finally:
            os.close(req_r)
            os.close(rep_w)
        return cls(proc, req_w, rep_r, say)

    @classmethod
    def attach(
        cls, path: str, child_env: dict[str, str], say: Callable[[str], Any], preload: Sequence[str] = DEFAULT_PRELOAD
    ) -> Optional[ForkServer]:
        """A session of the warm fork server at ``path`` (``launch/warm_fork_server.py``), serving this job
        alone; None, with the reason said, where it cannot be reached or does not run as this job's own
        server would (:func:`fit_key` of ``child_env``)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(REPLY_TIMEOUT)
        try:
            conn.connect(path)
            # The session's children write where this job's own server's would: this process's standard streams.
            streams = _standard_streams()
            try:
                socket.send_fds(conn, [b"S"], streams)
            finally:
                for position, fd in enumerate(streams):
                    if fd != position:  # /dev/null opened in place of a closed stream: the session has its copy
                        os.close(fd)
            hello = json.loads(_first_line(conn))
            theirs = hello.get("key", {})
            set_by_imports = set(theirs.pop("set_by_imports", []))
            for name in set_by_imports:
                theirs.get("environment", {}).pop(name, None)
            ours = fit_key({k: v for k, v in child_env.items() if k not in set_by_imports}, preload)
            differ = key_differences(theirs, ours)
            if differ:
                raise ValueError(f"it differs from this job in {', '.join(differ)}")
        except (OSError, ValueError) as exc:
            conn.close()
            say(f"the warm fork server at {path} is not used ({exc}): the job starts its own")
            return None
        conn.settimeout(None)
        say(f"replicas start from the warm fork server at {path} (session pid {hello.get('pid')})")
        return cls(None, conn.fileno(), os.dup(conn.fileno()), say, connection=conn, pid=hello.get("pid"))

    def _read(self) -> None:
        for line in self._replies:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                if "ready" in msg:
                    self.state = "ready" if msg["ready"] else "failed"
                    self.why = msg.get("why", "")
                    took = time.monotonic() - self._started
                    self._say(
                        f"replicas start from a fork server (pid {self.pid}; {msg.get('loaded')} "
                        f"imported in {took:.1f}s)"
                        if msg["ready"]
                        else f"fork server unavailable ({self.why}): replicas start as new processes"
                    )
                elif "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                    self._children.discard(int(msg["exit"]))
                elif "id" in msg:
                    self._pids[int(msg["id"])] = int(msg["pid"])
                    self._children.add(int(msg["pid"]))
                self._lock.notify_all()
        self._lost("it exited")

    def _lost(self, why: str) -> None:
        with self._lock:
            if self.state != "failed":
                self.state, self.why = "failed", why
            for pid in self._children:  # they die with the server (parent-death signal): make sure
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._exits.setdefault(pid, -signal.SIGKILL)
            self._children.clear()
            self._lock.notify_all()

    def current_state(self) -> str:
        """``state``, turned ``"failed"`` when the server takes too long to import."""
        with self._lock:
            if self.state == "starting" and time.monotonic() - self._started > START_TIMEOUT:
                self.state, self.why = "failed", f"not ready after {START_TIMEOUT:g}s"
                self._say(f"fork server unavailable ({self.why}): replicas start as new processes")
            return self.state

    def exit_code(self, pid: int) -> Optional[int]:
        with self._lock:
            return self._exits.get(pid)

    def wait_for_exit(self, timeout: float) -> None:
        """Return once a child's exit is reported (or the server is lost), at most after ``timeout`` seconds."""
        with self._lock:
            seen = len(self._exits)
            self._lock.wait_for(lambda: len(self._exits) != seen or self.state == "failed", timeout)

    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: Optional[str] = None) -> Optional[ForkedProcess]:
        """Fork a child running ``argv`` (``python script.py ...`` or ``python -m module ...``) in
        ``env``; None if the server is not ready (or stopped answering: it is then no longer used)."""
        if self.current_state() != "ready":
            return None
        with self._lock:
            rid = self._next_id
            self._next_id += 1
        request = {"id": rid, "argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd()}
        data = (json.dumps(request) + "\n").encode()
        try:
            while data:  # a large environment may take several writes
                data = data[os.write(self._requests, data) :]
        except OSError as exc:
            self._lost(f"its pipe failed: {exc}")
            return None
        with self._lock:
            if not self._lock.wait_for(lambda: rid in self._pids or self.state != "ready", REPLY_TIMEOUT):
                self.state, self.why = "failed", f"no answer within {REPLY_TIMEOUT:g}s"
            pid = self._pids.pop(rid, None)
        if pid is None:
            self._say(f"fork server stopped answering ({self.why}): replicas start as new processes")
            return None
        return ForkedProcess(self, pid)

    def close(self) -> None:
        """End the server, or the warm server's session (its remaining children die with it: end them first)."""
        if self._connection is not None:
            try:
                self._connection.shutdown(socket.SHUT_WR)  # the session's end of file: it exits
            except OSError:
                pass
        else:
            try:
                os.close(self._requests)
            except OSError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=2.0)
        self._lost("closed")
        if self._connection is not None:
            self._connection.close()


class ProcessStarter:
    """How a launcher starts replica and standby processes: forked by the job's fork server once it
    has imported, as new processes when the command cannot be forked, ``fork`` is off or the server
    failed. ``start(..., wait=False)`` returns None while the server is still importing (a standby:
    start it later); ``wait=True`` (a replica) waits for the server, at most ``START_TIMEOUT``."""

    def __init__(
        self,
        command: Sequence[str],
        child_env: dict[str, str],
        say: Callable[[str], Any],
        *,
        fork: bool = True,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        preexec: Optional[Callable[[], None]] = None,
    ) -> None:
        self._preexec = preexec
        why = forkable(command) if fork else None
        self.server: Optional[ForkServer] = None
        if fork and why is None:
            warm = child_env.get(FORK_SERVER)
            self.server = ForkServer.attach(warm, child_env, say, preload) if warm else None
            if self.server is None:
                self.server = ForkServer.start(child_env, say, preload, preexec)
        if why is not None:
            say(f"replicas start as new processes: the command cannot be forked ({why})")

    def start(self, argv: Sequence[str], env: dict[str, str], wait: bool = False) -> Optional[Process]:
        if self.server is not None:
            state = self.server.current_state()
            while wait and state == "starting":
                time.sleep(0.01)
                state = self.server.current_state()
            if state == "starting":
                return None
            if state == "ready":
                proc = self.server.spawn(argv, env)
                if proc is not None:
                    return proc
        return subprocess.Popen(list(argv), env=env, preexec_fn=self._preexec)

    def nap(self, timeout: float) -> None:
        """Sleep ``timeout`` seconds, woken early by the exit of a process the fork server started (a death is
        declared from it)."""
        if self.server is not None and self.server.current_state() == "ready":
            self.server.wait_for_exit(timeout)
        else:
            time.sleep(timeout)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


# ---------------------------------------------------------------------------- server side


@dataclass
class ChildCommand:
    argv: list[str]
    env: dict[str, str]
    cwd: str


def send_line(fd: int, msg: dict) -> None:
    """Write ``msg`` as one JSON line (the server's side of the protocol)."""
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that becomes readable when child ``pid`` exits (Linux 5.3+); None where there is none
    (the server's loop then notices the exit within its select timeout)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def prepare(preload: Sequence[str]) -> tuple[bool, str]:
    """Import ``preload`` in this (not yet forking) process: ``(True, modules imported)``, or ``(False, why)``
    when it can no longer fork safely."""
    loaded = []
    for name in preload:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # a module the job does not have: the children import what they need
            print(f"[lightning-recover] fork server: cannot preload {name}: {exc}", file=sys.stderr, flush=True)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a CUDA context does not survive fork
        return False, f"importing {loaded} initialised CUDA"
    if _threads() != 1:
        why = f"{_threads()} threads after importing {loaded} (fork needs one"
        if os.environ.get("OMP_NUM_THREADS", "") != "1":
            why += "; with OMP_NUM_THREADS other than 1, importing torch starts OpenMP's threads"
        return False, why + ")"
    # The preloaded modules' objects move to the collector's permanent generation: a child's collections
    # (the full one at its exit included) then skip them instead of writing every object header, which
    # copied the whole shared heap page by page after the fork (seconds per child at exit on 2 cores).
    gc.collect()
    gc.freeze()
    return True, ",".join(loaded)


def serve(requests: int, replies: int, preload: Sequence[str]) -> Optional[ChildCommand]:
    """Import ``preload``, then fork one child per request. Returns only in a child (its job), or
    None when the launcher closed the pipe or the server cannot fork safely."""
    ready, loaded = prepare(preload)
    if not ready:
        send_line(replies, {"ready": False, "why": loaded})
        return None
    send_line(replies, {"ready": True, "loaded": loaded})
    return fork_on_request(requests, replies)


def fork_on_request(requests: int, replies: int) -> Optional[ChildCommand]:
    """Fork one child per request read from ``requests`` (JSON lines), reporting each child's pid and exit
    on ``replies`` (the same descriptor for a socket). Returns only in a child (its job), or None once the
    launcher closed its end."""
    server_pid = os.getpid()
    pending = b""
    # pid -> pidfd of each child: readable once it exits, so the loop wakes and reports the exit at once
    # (a death is declared from it: measured 0-50 ms later with the loop's timeout alone).
    children: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([requests, *children.values()], [], [], 0.05)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                os.close(children.pop(pid))
            send_line(replies, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if requests not in readable:
            continue
        data = os.read(requests, 1 << 20)
        if not data:
            return None  # the launcher is done (or gone)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                for fd in {requests, replies, *children.values()}:
                    os.close(fd)
                # Die with the server (as a replica dies with the launcher).
                set_parent_death_signal(signal.SIGKILL)
                if os.getppid() != server_pid:
                    os._exit(1)
                signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter
                return ChildCommand([str(a) for a in request["argv"]], dict(request["env"]), str(request["cwd"]))
            fd = _pidfd(pid)
            if fd is not None:
                children[pid] = fd
            send_line(replies, {"id": request["id"], "pid": pid})


def _areas() -> tuple[tuple[int, int], tuple[int, int]]:
    """(start, end) of this process's argv and environment areas, from /proc/self/stat."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    arg_start, arg_end, env_start, env_end = (int(fields[n - 3]) for n in (48, 49, 50, 51))
    return (arg_start, arg_end), (env_start, env_end)


def _write_area(area: tuple[int, int], data: bytes) -> None:
    import ctypes

    room = area[1] - area[0]
    ctypes.memmove(area[0], data[:room].ljust(room, b"\0"), room)


def show_as(argv: Sequence[str], env: Optional[dict[str, str]] = None) -> None:
    """Make /proc/self/cmdline (and /proc/self/environ, given ``env``) show this process's own argv
    (and environment) instead of the server's: what ps and tools that look for a replica by its
    environment read.

    Both are the memory areas the kernel filled at the server's exec (their bounds are in
    /proc/self/stat); the server was started with room to spare in each. ``env`` only after
    ``os.environ`` was replaced, so that no libc environment entry points into the area any more.
    What does not fit is cut (argv) or left as it was (environment)."""
    args_area, env_area = _areas()
    _write_area(args_area, b"\0".join(os.fsencode(a) for a in argv) + b"\0")
    if env is not None:
        block = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
        if len(block) <= env_area[1] - env_area[0]:
            _write_area(env_area, block)


def run_job(job: ChildCommand) -> None:
    """In the forked child: become ``python script.py ...`` (or ``python -m module ...``, or ``python -c CODE ...``
    for the launcher's own helpers: :func:`forkable` does not offer a user's ``-c`` command)."""
    os.environ.clear()
    os.environ.update(job.env)
    # What an interpreter derives from its environment once, at its start or first use, derived again from this
    # process's own: the temporary directory (TMPDIR) and the time zone (TZ).
    tempfile.tempdir = None
    time.tzset()
    try:
        show_as(job.argv, job.env)
    except (OSError, ValueError, IndexError):
        pass  # cosmetic: ps shows the server's command line
    os.chdir(job.cwd)
    random.seed()  # a fresh interpreter's generators are seeded per process, not copied
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    args = job.argv[1:]
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = sys.modules["__main__"]
        exec(compile(args[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - the launcher's own command, as python -c
    elif args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = job.cwd
        if importlib.util.find_spec(args[1]) is None:  # what `python -m` says and does
            print(f"{job.argv[0]}: No module named {args[1]}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        if not os.path.isfile(args[0]):  # what `python script.py` says and does
            print(f"{job.argv[0]}: can't open file {os.path.abspath(args[0])!r}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        runpy.run_path(args[0], run_name="__main__")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-recover fork server", description="the launcher's fork server (started by it)"
    )
    parser.add_argument("requests", type=int)
    parser.add_argument("replies", type=int)
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD))
    parser.add_argument("--room", default="", help="room for the children's command lines (see show_as)")
    args = parser.parse_args(argv)
    set_parent_death_signal(signal.SIGKILL)  # the server dies with the launcher
    try:
        show_as(["lightning-recover fork server", f"--preload={args.preload}"])  # not 16 KiB of room
    except (OSError, ValueError, IndexError):
        pass
    # Ctrl-C reaches the whole process group: the launcher forwards it to the replicas, and the
    # server must survive it (its death would SIGKILL the children it forked, replicas included).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job = serve(args.requests, args.replies, [m for m in args.preload.split(",") if m])
    if job is None:
        end_helper_process(0)  # the launcher is done: nothing of the server's to finalize
    run_job(job)  # SystemExit from the script ends the child as it would end `python script.py`
