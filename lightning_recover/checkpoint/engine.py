"""The ``native_io`` engine behind the checkpoint API: created lazily, shared, serialised.

An ``IOEngine`` owns a staging arena allocated once and reused, so one engine is kept per plugin
(or one shared default) and its use is serialised by a lock. ``huge_page_bytes`` gives host memory that the
engine writes from as fast as from its own arena.
"""

from __future__ import annotations

import mmap
import threading
from typing import Any, Optional

import torch

from lightning_recover import env
from lightning_recover.checkpoint.reservation import reserve_size


class EngineHandle:
    """A lazily created ``native_io.IOEngine`` (its staging arena is reused) and a lock serialising its use."""

    def __init__(
        self,
        engine: str = "auto",
        block_size: Optional[int] = None,
        queue_depth: Optional[int] = None,
        direct: bool = True,
    ) -> None:
        self.kwargs: dict[str, Any] = {"engine": engine, "direct": direct}
        if block_size is not None:
            self.kwargs["block_size"] = block_size
        if queue_depth is not None:
            self.kwargs["queue_depth"] = queue_depth
        self._engine: Any = None
        self.lock = threading.RLock()

    def get(self) -> Any:
        """The engine, created on first use; threads asking first at the same time all get the same one."""
        eng = self._engine
        if eng is None:
            with self.lock:  # two threads both seeing None would each make an engine (and its arena)
                if self._engine is None:
                    import native_io

                    self._engine = native_io.IOEngine(**self.kwargs)
                eng = self._engine
        return eng

    def release(self) -> None:
        """Free the engine (and its staging arena); the next use creates a new one."""
        with self.lock:
            eng, self._engine = self._engine, None
            if eng is not None and hasattr(eng, "close"):
                eng.close()


DEFAULT = EngineHandle()


def resolve_engine(engine: Any) -> tuple[Any, Any]:
    """(IOEngine, lock) for ``engine``: None (shared default), an ``EngineHandle`` or an ``IOEngine`` instance."""
    if engine is None:
        engine = DEFAULT
    if isinstance(engine, EngineHandle):
        return engine.get(), engine.lock
    if isinstance(engine, str):
        raise TypeError("pass an IOEngine instance (or None), not an engine name; use UringCheckpointIO(engine=...)")
    return engine, threading.RLock()


def open_writer(eng: Any, path: Any, size_hint: Optional[int] = None, *, existing: bool = False) -> Any:
    """``eng.open_writer(path)``: a new file (``O_EXCL | O_NOFOLLOW``: an existing name or a symlink there is refused),
    or with ``existing=True`` a file that exists (``/proc/self/fd/N`` of an unnamed file); with ``LIGHTNING_RECOVER_PREALLOCATE=on``, then ``size_hint`` bytes (the
    caller's upper estimate of the file size) reserved with the file size set (``reservation.py``). Only for
    files that get their name after the writer's ``close(size=...)`` has cut them to the exact size: temporary
    and unnamed files, as every caller writes.

    Opt-in: for the DCP writer it measured no faster, in one process with the order alternating (benchmarks/LOG.md).
    """
    w = eng.open_writer(path, existing=True) if existing else eng.open_writer(path)
    if size_hint and env.flag(env.PREALLOCATE, "auto") == "on":
        reserve_size(path, size_hint)  # refused (ENOSPC, EOPNOTSUPP): the writes extend the file as they go
    return w


def huge_page_bytes(nbytes: int, fork_inherits: bool = True) -> torch.Tensor:
    """``nbytes`` of host memory (uint8) in an anonymous mapping asked to be backed by transparent huge pages,
    like the engine's own arena; plain pages where the kernel has no THP. ``fork_inherits=False``: a forked child
    (a DataLoader worker) does not get the mapping, so this process's writes to it never copy pages for one;
    only for memory that no code of a child touches.

    A device that takes few segments per request (virtio-blk: 254) splits an ``O_DIRECT`` transfer from plain
    4 KiB pages into ~1 MiB requests, from huge pages not (docs/native_io.md).
    """
    # private: a shared anonymous mapping is shmem, which THP leaves on small pages (shmem_enabled is "never"
    # by default) whatever the madvise says
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mem.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP in this kernel (EINVAL) or platform: the pages stay small
        pass
    if not fork_inherits and hasattr(mmap, "MADV_DONTFORK"):
        mem.madvise(mmap.MADV_DONTFORK)
    return torch.frombuffer(mem, dtype=torch.uint8)  # the tensor keeps the mapping alive
