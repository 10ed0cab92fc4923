"""A removed or replaced checkpoint file kept as the next save's temporary file, so that save overwrites blocks
the filesystem has allocated already.

On ext4 a direct write past the end of a file runs under the inode lock and is waited for, and on a thin
(``discard``-mounted) virtual disk the host allocates freshly written blocks again; an overwrite of allocated
blocks is neither. The save keeps its atomicity: it writes the kept file under a temporary name, cuts it to its
size, syncs it and renames it into place, exactly as it does a new temporary file.

``SpareFiles`` belongs to one ``CheckpointIO``. It keeps at most one file per directory:

* ``keep_removed(path)``: ``remove_checkpoint`` renames the file to a temporary name instead of unlinking it;
* ``keep_replaced(path)``: a save over an existing file links the old file to a temporary name before its rename
  replaces it;
* ``take(directory)``: the next save in that directory writes over the kept file;
* ``discard()``: ``teardown`` unlinks every kept file.

Peak disk use does not grow: a save needs the space of one checkpoint besides the live ones, and the kept file
is that space. Between saves the directory holds one hidden temporary file more than it would otherwise; the
process removes it at its exit. A process that dies leaves it under a temporary name of its host and pid, which the
next save in that directory by a later process removes (``files.cleanup_stale_temps``).

Opt-in, with ``LIGHTNING_RECOVER_RECYCLE=on``: the directory then lists a hidden temporary file between saves
(a tool that copies every file of the directory would copy it too). A file is kept only where overwriting it
cannot change what anybody else sees: a regular file of this user with one link, on a filesystem that overwrites
in place (ext4, XFS; ``any`` allows every local filesystem), and when it is taken, still the same file, and open
nowhere else (a write lease is granted only then: a reader that still has the old checkpoint open or mapped keeps
it as it was). Otherwise the file is removed as before and the save writes a new file.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import logging
import os
import stat
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from lightning_recover import env
from lightning_recover.checkpoint.engine import open_writer
from lightning_recover.checkpoint.files import temp_path_for, unlink_quiet

log = logging.getLogger(__name__)

# statfs f_type of ext4 and XFS, which overwrite allocated blocks in place (copy-on-write ones allocate anew)
IN_PLACE_FILESYSTEMS = frozenset({0xEF53, 0x58465342})

MODES = ("off", "on", "any")


def recycling_mode() -> str:
    """``LIGHTNING_RECOVER_RECYCLE``: ``off`` (default), ``on`` (ext4 and XFS) or ``any`` (any local filesystem)."""
    mode = env.flag(env.RECYCLE, "off")
    if mode not in MODES:
        raise ValueError(f"{env.RECYCLE} must be off, on or any, not {mode!r}")
    return mode


def filesystem_type(fd: int) -> Optional[int]:
    """The ``statfs`` magic number of the filesystem holding ``fd`` (None where it cannot be read)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    try:
        fstatfs = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None
    if fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def overwrites_in_place(fd: int, mode: str) -> bool:
    """Whether ``mode`` lets a file on ``fd``'s filesystem be recycled."""
    if mode == "off":
        return False
    return mode == "any" or filesystem_type(fd) in IN_PLACE_FILESYSTEMS


def open_nowhere_else(fd: int) -> bool:
    """True when no other open file (another descriptor, a mapping, another process) refers to ``fd``'s file:
    Linux grants a write lease only then. Where leases are unavailable (NFS, ``fs.leases-enable=0``), False."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


def recyclable(st: os.stat_result) -> bool:
    """A regular file of this user with one link and blocks to give (an empty one, such as the placeholder an
    asynchronous save puts at its name, has none): overwriting it changes no other name's content."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid() and st.st_size > 0


def writer_over(engine: Any, spare: tuple[str, int]) -> Any:
    """An engine writer over the kept file ``spare`` (``SpareFiles.take``'s path and descriptor; the descriptor is
    closed here): reopened through ``/proc/self/fd/N``, the very file that was checked."""
    try:
        return open_writer(engine, f"/proc/self/fd/{spare[1]}", existing=True)
    finally:
        os.close(spare[1])


@dataclass(frozen=True)
class Spare:
    """A kept file: its temporary name and identity (st_dev, st_ino) when it was kept."""

    path: str
    identity: tuple[int, int]


class SpareFiles:
    """The files kept for the next saves of one ``CheckpointIO``, at most one per directory; ``mode`` is one of
    ``MODES`` (None: ``LIGHTNING_RECOVER_RECYCLE``'s, read at every removal)."""

    def __init__(self, mode: Optional[str] = None) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._spares: dict[str, Spare] = {}
        self._pid = os.getpid()  # a forked child has a copy of the record, not the files: it never removes them
        self.kept = 0  # files kept and files taken by a save, for the tests and the benchmarks
        self.taken = 0
        _living.add(self)

    def _eligible(self, path: str) -> Optional[os.stat_result]:
        """``path``'s stat when it may be kept, else None (also when the variable is off)."""
        mode = self.mode or recycling_mode()
        if mode == "off":
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            return st if recyclable(st) and overwrites_in_place(fd, mode) else None
        finally:
            os.close(fd)

    def _hold(self, spare: Spare) -> None:
        # kept now: a save of another process in the directory removes temporaries older than itself
        try:
            os.utime(spare.path, follow_symlinks=False)
        except OSError:
            pass
        directory = os.path.dirname(spare.path)
        with self._lock:
            old = self._spares.pop(directory, None)
            self._spares[directory] = spare
            self.kept += 1
        if old is not None:
            unlink_quiet(old.path)

    def _keep(self, path: str, put: Callable[[str, str], None]) -> Optional[str]:
        """``put(path, temporary name)`` (a rename or a link) when ``path`` may be kept, and hold it; the temporary
        name, or None when it is not kept."""
        st = self._eligible(path)
        if st is None:
            return None
        spare = temp_path_for(path)
        try:
            put(path, spare)
        except OSError:
            return None
        self._hold(Spare(spare, (st.st_dev, st.st_ino)))
        return spare

    def keep_removed(self, path: str) -> bool:
        """Keep the checkpoint file ``path`` instead of removing it; False when it is not kept (the caller removes
        it)."""
        spare = self._keep(path, os.rename)
        if spare is not None:
            log.debug("Removed checkpoint: %s (its file kept for the next save as %s)", path, spare)
        return spare is not None

    def keep_replaced(self, path: str) -> None:
        """Before a save's rename replaces the file at ``path``, keep that file under a temporary name."""
        self._keep(path, lambda src, dst: os.link(src, dst, follow_symlinks=False))

    def take(self, directory: str) -> Optional[tuple[str, int]]:
        """The kept file of ``directory`` for a save to write over: ``(temporary path, open descriptor)``, the
        descriptor ``O_WRONLY`` for ``/proc/self/fd/N`` (the caller closes it). None when there is none, or when
        it is no longer the file that was kept, has more links or is open elsewhere (it is then removed)."""
        with self._lock:
            spare = self._spares.pop(directory, None)
        if spare is None:
            return None
        try:
            fd = os.open(spare.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == spare.identity and recyclable(st) and open_nowhere_else(fd):
            self.taken += 1
            return spare.path, fd
        os.close(fd)
        if (st.st_dev, st.st_ino) == spare.identity:
            unlink_quiet(spare.path)
        return None

    def discard(self) -> None:
        """Unlink every kept file (``teardown``, and at the exit of the process that kept them)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            spares, self._spares = list(self._spares.values()), {}
        for spare in spares:
            unlink_quiet(spare.path)


# every SpareFiles of the process: what a Fabric run (which has no teardown) kept goes at the interpreter's exit
_living: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _discard_at_exit() -> None:
    for spares in list(_living):
        spares.discard()
