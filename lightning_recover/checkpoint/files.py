"""Crash-safe files and directories: temporary names, durable commit (fsync, rename, directory fsync),
cleanup; the only code that commits a checkpoint file or directory (``commit``, ``commit_dir``).

A checkpoint is written under ``.<final name>.tmp-<host>-<pid>-<8 letters>`` in its destination directory,
made durable, then renamed onto its final name and the directory fsynced: a crash at any point leaves the
previous checkpoint in place and at most a temporary file that :func:`cleanup_stale_temps` removes later.

``<host>`` is :func:`host_tag`: 12 letters naming the host, its boot and the pid namespace the writer ran in,
the only place where the writer's pid means anything. On a shared file system (NFS, Lustre) a temporary of
another host (or of this host before a reboot, or of another container) is another machine's business: its pid
says nothing here, so it may be a save in progress, and only its own host removes it. The pid is spelled with
the letters a-j for 0-9, so a temporary adds no digits to the final name (Lightning derives checkpoint
versions from the digits of every name containing ``ckpt_``, e.g. ``hpc_ckpt_<N>.ckpt``).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import string
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)

# temporary files: ".<final name>.tmp-<host tag>-<pid in letters a-j>-<8 letters>" in the destination directory
_TMP_RE = re.compile(r"^\..+\.tmp-(?P<host>[a-z]{12})-(?P<pid>[a-j]+)-[a-z]{8}$")
# the spellings of earlier versions, without a host: recognised as temporaries, never removed (whose pid?)
_HOSTLESS_TMP_RES = (re.compile(r"^\..+\.tmp-[a-j]+-[a-z]{8}$"), re.compile(r"^\..+\.tmp-\d+-[0-9a-f]{8}$"))
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


def _read_first_line(path: str) -> str:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return ""


def host_tag(hostname: Optional[str] = None, boot_id: Optional[str] = None, pid_namespace: Optional[str] = None) -> str:
    """12 letters (a-z) identifying where a pid can be checked: host name, boot and pid namespace.

    Each argument left None is this process's own: ``socket.gethostname()``, ``/proc/sys/kernel/random/boot_id``
    (a new one at every boot: pids of an earlier boot mean nothing now) and the ``/proc/self/ns/pid`` link (two
    containers of one host number their processes separately). Passing them gives another host's tag, e.g. to play
    two hosts in one directory in a test.
    """
    if hostname is None:
        hostname = socket.gethostname()
    if boot_id is None:
        boot_id = _read_first_line("/proc/sys/kernel/random/boot_id")
    if pid_namespace is None:
        try:
            pid_namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_namespace = ""
    digest = hashlib.sha256("\0".join((hostname, boot_id, pid_namespace)).encode()).digest()
    return "".join(string.ascii_lowercase[b % 26] for b in digest[:12])


def temp_path_for(path: str, host: Optional[str] = None) -> str:
    """The temporary name a save to ``path`` by this process writes first (``host``: the tag, default this host's)."""
    d, base = os.path.split(path)
    pid = str(os.getpid()).translate(_PID_LETTERS)
    tag = "".join(secrets.choice(string.ascii_lowercase) for _ in range(8))
    return os.path.join(d, f".{base}.tmp-{host or host_tag()}-{pid}-{tag}")


def is_temp_name(name: str) -> bool:
    """A temporary of ours (of any host, also the host-less spellings of earlier versions)."""
    return _TMP_RE.match(name) is not None or any(r.match(name) for r in _HOSTLESS_TMP_RES)


def cleanup_stale_temps(directory: str, host: Optional[str] = None) -> list[str]:
    """Remove temporary files left in ``directory`` by crashed saves of this host.

    Only names matching ``.NAME.tmp-<host>-<pid>-<8 letters>`` whose ``<host>`` is ``host`` (default: this host's
    :func:`host_tag`) are touched, never those of this process, and only when their pid is dead or the file is
    older than this process. Temporaries of other hosts, boots or pid namespaces, and the host-less names of
    earlier versions, are left alone: remove them by hand once no save is in flight anywhere (docs/checkpointing.md).

    Args:
        directory: where the checkpoints are saved; a directory that cannot be listed is left alone.
        host: the host tag whose temporaries are removed (default: this host's).

    Returns:
        The paths removed.
    """
    host = host or host_tag()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    me = os.getpid()
    for name in names:
        m = _TMP_RE.match(name)
        if m is None or m.group("host") != host:
            continue
        pid = int(m.group("pid").translate(_PID_DIGITS))
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


# ---------------------------------------------------------------------------- directories (a DCP checkpoint)

# a directory being written: ".<final name>.dcp-tmp-<token>"; a replaced one being removed: ".<name>.dcp-old-<token>"
DIR_TMP_MARK = ".dcp-tmp-"
OLD_MARK = ".dcp-old-"


def _renameat2_exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def commit_dir(tmp: str, path: str) -> None:
    """Make ``tmp`` (complete and durable) visible as ``path`` in one step, then fsync the parent. A previous
    checkpoint at ``path`` is removed in the background (``remove_replaced``)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(f"{path} exists and is not a checkpoint directory; remove it or choose another path")
        if not _renameat2_exchange(tmp, path):
            # no atomic exchange: move the old one aside first (a crash in between leaves both complete
            # directories, the new one under its temporary name)
            aside = tmp + ".old"
            os.rename(path, aside)
            os.rename(tmp, path)
            fsync_dir(parent)
            remove_replaced(aside, parent)
            return
        fsync_dir(parent)
        remove_replaced(tmp, parent)  # tmp now holds the previous checkpoint
        return
    os.rename(tmp, path)
    fsync_dir(parent)


# A replaced checkpoint is removed off the save's path: rmtree of a 2 GB DCP directory took 0.4 s here, inside
# every save over an existing path. It is first renamed ".<name>.dcp-old-<token>"; a process that ends before
# its removal is done (os._exit skips the wait at exit) leaves it under that name, and the next commit in the
# same directory removes it.
_REMOVALS: list[threading.Thread] = []
_REMOVALS_LOCK = threading.Lock()


def _remove_all(paths: list[str]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def remove_replaced(old: str, parent: str) -> None:
    """Remove the replaced checkpoint ``old`` (and any left by an earlier process in ``parent``) in a thread."""
    # the checkpoint is committed by now: nothing here may fail the save
    name = os.path.basename(old).lstrip(".").split(DIR_TMP_MARK)[0]
    trash = os.path.join(parent, f".{name}{OLD_MARK}{secrets.token_hex(6)}")
    try:
        os.rename(old, trash)
    except OSError:
        trash = old
    try:
        found = [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(".") and OLD_MARK in n]
    except OSError:
        found = []
    targets = [trash] + [p for p in found if p != trash]
    t = threading.Thread(target=_remove_all, args=(targets,), name="dcp-remove-replaced", daemon=True)
    with _REMOVALS_LOCK:
        _REMOVALS[:] = [x for x in _REMOVALS if x.is_alive()] + [t]
    t.start()


def wait_for_removals(timeout: Optional[float] = None) -> bool:
    """Wait for the removals of replaced checkpoints started so far; False if ``timeout`` seconds ran out first."""
    with _REMOVALS_LOCK:
        threads = list(_REMOVALS)
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


atexit.register(wait_for_removals, 60.0)
