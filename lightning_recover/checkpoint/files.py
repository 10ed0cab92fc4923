"""Crash-safe files: temporary names, durable commit (fsync, rename, directory fsync), cleanup.

A checkpoint is written under ``.<final name>.tmp-<pid>-<8 hex>`` in its destination directory,
made durable, then renamed onto its final name and the directory fsynced: a crash at any point
leaves the previous checkpoint in place and at most a temporary file that
:func:`cleanup_stale_temps` removes later.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time

log = logging.getLogger(__name__)

# temporary files: ".<final name>.tmp-<pid>-<8 hex>" in the destination directory
_TMP_RE = re.compile(r"^\..+\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")


def _process_start_time() -> float:
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except Exception:  # pragma: no cover - non-Linux
        return _IMPORT_TIME


_IMPORT_TIME = time.time()
_PROCESS_START = _process_start_time()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_path_for(path: str) -> str:
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    return _TMP_RE.match(name) is not None


def cleanup_stale_temps(directory: str) -> list[str]:
    """Remove our own temporary files left in ``directory`` by crashed saves.

    Only names matching ``.NAME.tmp-<pid>-<8 hex>`` are touched, never those of this process, and only
    when their pid is dead or the file is older than this process.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    me = os.getpid()
    for name in names:
        m = _TMP_RE.match(name)
        if m is None:
            continue
        pid = int(m.group("pid"))
        if pid == me:
            continue
        full = os.path.join(directory, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        if not (os.path.isfile(full) and not os.path.islink(full)):
            continue
        if _pid_alive(pid) and st.st_mtime >= _PROCESS_START:
            continue
        try:
            os.unlink(full)
            removed.append(full)
            log.info("removed stale temporary checkpoint file %s", full)
        except OSError:
            pass
    return removed


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str, path: str) -> None:
    """Rename a durable temporary onto ``path`` and fsync the directory."""
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
