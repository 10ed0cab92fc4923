"""A file's space and size reserved ahead of its writer, so its direct writes never extend the file.

Opt-in, with ``LIGHTNING_RECOVER_PREALLOCATE=on``. ext4 runs an ``O_DIRECT`` write that extends a file under the
inode lock and waits for it, and fio's own default (``--fallocate=native``) reserves the whole file first. While
the engine's transfers came from plain pages this made the single-file save faster; since its arena is on huge
pages, the growing reservation makes it about 20% slower instead (docs/native_io.md, "Preallocation ..."). A
writer that knows its size up front (an upper estimate: the DCP writer, the async saver) reserves it at once
(:func:`reserve_size`, through ``engine.open_writer``). A streaming save (``single_file._save_zip``) only knows
its size once it has pickled everything, so its reservation grows ahead of the placement
(:class:`GrowingReservation`):

* geometrically, from ``FIRST_BYTES``;
* always at least ``AHEAD_BYTES`` past the last placed byte.

``native_io.reserve`` is ``fallocate`` mode 0. It also sets the file size. The writer's ``close(size=...)``
truncates to the exact size and so gives the rest back. Every file reserved this way is a temporary (or unnamed)
one that gets the checkpoint's name only after that, so the zeros past the data are never seen under it.

It is only an optimisation. When the filesystem refuses the headroom (ENOSPC, say), it asks for exactly what
is placed. When it refuses that too (EOPNOTSUPP, ENOSPC), it stops reserving, and the writes extend the file
as they would without it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import native_io

FIRST_BYTES = 256 << 20
AHEAD_BYTES = 128 << 20  # two of the save's 64 MiB batches


def reserve_size(path: Any, nbytes: int) -> Optional[OSError]:
    """Reserve ``[0, nbytes)`` of ``path`` at once, size included, for a writer that knows its size up front
    (an upper estimate); returns the filesystem's refusal, if any (the writes then extend the file)."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CLOEXEC)
    try:
        native_io.reserve(fd, 0, nbytes)
    except OSError as e:
        return e
    finally:
        os.close(fd)
    return None


class GrowingReservation:
    """``ensure(end)``: bytes ``[0, end)`` of ``path`` are allocated and inside the file's size (``path=None``:
    reserves nothing)."""

    def __init__(self, path: Any) -> None:
        self.reserved = 0
        self.calls = 0
        self.error: Optional[OSError] = None  # why it stopped, if it did
        self._fd = None if path is None else os.open(os.fspath(path), os.O_WRONLY | os.O_CLOEXEC)

    def ensure(self, end: int) -> None:
        if self._fd is None or end <= self.reserved:
            return
        for target in (max(2 * self.reserved, end + AHEAD_BYTES, FIRST_BYTES), end):
            try:
                native_io.reserve(self._fd, self.reserved, target - self.reserved)
            except OSError as e:
                self.error = e
                continue
            self.reserved, self.error = target, None
            self.calls += 1
            return
        self.close()  # refused even the placed bytes: the writes extend the file themselves

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> GrowingReservation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
