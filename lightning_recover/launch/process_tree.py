"""Processes of a job, by pid: how one ended, whether it is stopped, and ending it with its descendants.

The launchers end what they started by pid (never by process group: a replica may start its own
sessions), reading the process tree from /proc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn, Optional

log = logging.getLogger(__name__)


_PR_SET_PDEATHSIG = 1
WATCHDOG_PERIOD = 0.2  # seconds between the fallback checks that the parent still lives


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where unsupported.

    Safe in a ``preexec_fn`` (no allocation beyond a cached ctypes call). Linux ties it to the
    parent *thread*: launchers spawn from their main thread.
    """
    try:
        return libc().prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_LIBC: list = []


def libc() -> ctypes.CDLL:
    """The C library, loaded once, in the parent, so that a ``preexec_fn`` does not load a library after fork."""
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (the launcher, or the fork server that forked it) is gone, however it
    died.

    PDEATHSIG covers SIGKILL of the parent; the watchdog thread covers systems without prctl
    and the window before prctl took effect (the parent died first: we were re-parented).
    """
    set_parent_death_signal(signal.SIGKILL)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                log.warning("the parent (pid %d) is gone; exiting", parent)
                os._exit(3)
            time.sleep(WATCHDOG_PERIOD)

    if os.getppid() != parent:
        log.warning("the parent (pid %d) is gone; exiting", parent)
        os._exit(3)
    threading.Thread(target=watch, name="lr-parent-watchdog", daemon=True).start()


def end_helper_process(code: int) -> NoReturn:
    """End one of the job's own helper processes (coordinator, fork server) once its work is done.

    Skips the interpreter's finalization: with torch (and Lightning) imported, its garbage collections
    take 1-3 s of CPU per process on a 2-core machine while the launcher waits for the exit. These
    processes hold no buffered files of their own; standard output and error are flushed first.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def proc_stat(pid: int, thread: Optional[str] = None) -> Optional[list[str]]:
    """The fields of ``/proc/{pid}/stat`` (``thread``: of ``/proc/{pid}/task/{thread}/stat``) after the command's name
    (state, ppid, pgrp, session, ...: ``proc(5)`` numbers them from 3), or None once the process (or thread) is
    gone. The name is skipped by its last ``)``: it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) the process ``pid`` has used so far; 0.0 once it is gone."""
    fields = proc_stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_stopped(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] in ("T", "t")


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped; raises ProcessLookupError once the process is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    for task in tasks:
        fields = proc_stat(pid, task)
        if fields is not None and fields[0] not in ("T", "t"):  # None: the thread ended meanwhile
            return False
    return True


def stop_process(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    ``kill`` returns before that: Linux wakes one thread to take the signal, and stops the others only once that
    thread runs; until then they go on (a server's thread answers requests). Raises TimeoutError when a thread
    still runs after ``timeout`` seconds."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} was sent SIGSTOP and still has a running thread after {timeout:.0f} s")
        time.sleep(0.001)


def children_of(pid: int) -> list[int]:
    """The child pids of ``pid`` ([] once it is gone); see :func:`children_of_each`."""
    return children_of_each([pid])[pid]


def children_of_each(pids: list[int]) -> dict[int, list[int]]:
    """Each pid's child pids ([] once it is gone): from its threads' ``/proc/PID/task/TID/children``, a few reads
    instead of a scan of every process (a launcher looks at its agents' workers often), or from one such scan for
    them all where the kernel has no such files (built without CONFIG_PROC_CHILDREN)."""
    out: dict[int, list[int]] = {}
    for pid in pids:
        found = _children_from_tasks(pid)
        if found is None:
            tree = children_map()
            return {p: tree.get(p, []) for p in pids}
        out[pid] = found
    return out


def _children_from_tasks(pid: int) -> list[int] | None:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended between the listing and the read
            return None
        except OSError:
            continue
    return children


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = proc_stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (a torchrun agent and its workers), by pid."""
    children = children_map()
    stack, order = [pid], []
    while stack:
        p = stack.pop()
        order.append(p)
        stack.extend(children.get(p, []))
    for p in order:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
