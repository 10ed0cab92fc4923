"""Processes of a job, by pid: how one ended, whether it is stopped, and ending it with its descendants.

The launchers end what they started by pid (never by process group: a replica may start its own
sessions), reading the process tree from /proc.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn


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


def is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
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
