"""Crash-safe files: temporary names, durable commit (fsync, rename, directory fsync), cleanup.

A checkpoint is written under ``.<final name>.tmp-<pid>-<8 letters>`` in its destination directory (the pid
spelled with the letters a-j for 0-9, so a temporary adds no digits to the final name: Lightning derives
checkpoint versions from the digits of every name containing ``ckpt_``, e.g. ``hpc_ckpt_<N>.ckpt``),
made durable, then renamed onto its final name and the directory fsynced: a crash at any point
leaves the previous checkpoint in place and at most a temporary file that
:func:`cleanup_stale_temps` removes later.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import string
import time

log = logging.getLogger(__name__)

# temporary files: ".<final name>.tmp-<pid in letters a-j>-<8 letters>" in the destination directory
_TMP_RE = re.compile(r"^\..+\.tmp-(?P<pid>[a-j]+)-[a-z]{8}$")
# the digit spelling written by earlier versions, still cleaned up
_OLD_TMP_RE = re.compile(r"^\..+\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")
_PID_LETTERS = str.maketrans("0123456789", "abcdefghij")
_PID_DIGITS = str.maketrans("abcdefghij", "0123456789")


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
    pid = str(os.getpid()).translate(_PID_LETTERS)
    tag = "".join(secrets.choice(string.ascii_lowercase) for _ in range(8))
    return os.path.join(d, f".{base}.tmp-{pid}-{tag}")


def _temp_pid(name: str) -> int | None:
    m = _TMP_RE.match(name)
    if m is not None:
        return int(m.group("pid").translate(_PID_DIGITS))
    m = _OLD_TMP_RE.match(name)
    return int(m.group("pid")) if m is not None else None


def is_temp_name(name: str) -> bool:
    return _temp_pid(name) is not None


def cleanup_stale_temps(directory: str) -> list[str]:
    """Remove our own temporary files left in ``directory`` by crashed saves.

    Only names matching ``.NAME.tmp-<pid>-<8 letters>`` (or the older ``<pid digits>-<8 hex>``) are touched, never those of this process, and only
    when their pid is dead or the file is older than this process.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    me = os.getpid()
    for name in names:
        pid = _temp_pid(name)
        if pid is None:
            continue
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
    rename_into_place(tmp, path)
    fsync_dir(os.path.dirname(path))


def rename_into_place(tmp: str, path: str) -> None:
    """``os.rename(tmp, path)``; where the file system refuses it across devices (EXDEV), copy and remove ``tmp``.

    The fallback is what Lightning's ``_atomic_save`` gets from fsspec's local move (``shutil.move``): the content is
    copied onto ``path`` (then fdatasync'ed) and the temporary removed, so the replacement is not atomic there; a
    crash in between leaves a partial file that fails its CRC-32C check on load. Permissions are not copied (the
    fallback must work where ``chmod`` is not permitted).
    """
    try:
        os.rename(tmp, path)
        return
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    log.warning("%s: rename across devices refused (EXDEV); copying the checkpoint into place (not atomic)", path)
    shutil.copyfile(tmp, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.unlink(tmp)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
