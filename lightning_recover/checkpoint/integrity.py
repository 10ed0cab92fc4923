"""What every checkpoint module checks data with: the error classes of a damaged, incomplete or unsafe
checkpoint, CRC-32C (``native_io``'s), and alignment in a file (4096 bytes; a storage placed congruent with its
memory so that it is written uncopied).
Used by single files, the DCP writer and reader, and the tools."""

from __future__ import annotations

import pickle
from typing import Any, Optional

LARGE_ALIGN = 4096  # O_DIRECT's alignment of file offsets and memory


class CheckpointCorruptError(ValueError):
    """A file is not a valid lightning-recover checkpoint: foreign, truncated or damaged.

    The message names the file and, for damaged data, the extent (offset, tensor names).
    ``path`` and ``damaged`` (a list of dicts for damaged extents, possibly empty) are attributes.
    """

    def __init__(self, message: str, path: Optional[str] = None, damaged: Optional[list] = None) -> None:
        super().__init__(message)
        self.path = path
        self.damaged = damaged or []


class CheckpointIncompleteError(CheckpointCorruptError):
    """``path`` is an empty placeholder: an asynchronous save to it was still in flight or did not complete."""

    @classmethod
    def for_path(cls, path: str) -> CheckpointIncompleteError:
        return cls(
            f"{path} is empty: the asynchronous save to it did not complete (a save still in flight in another "
            "process, or one interrupted by a crash); load an earlier checkpoint",
            path,
        )


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The pickled state refers to a global outside the allowlist while loading with ``weights_only=True``."""

    def __init__(self, message: str, global_name: str = "") -> None:
        super().__init__(message)
        self.global_name = global_name


def crc32c(buf: Any, value: int = 0) -> int:
    import native_io

    return native_io.crc32c(buf, value)


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def congruent_offset(cursor: int, address: int) -> int:
    """The first file offset at or after ``cursor`` that agrees with the memory ``address`` modulo 4 KiB.

    Storage bytes placed there are sent to the disk from the tensor's own memory (``O_DIRECT`` needs file
    offset and memory aligned together; torch's large CPU tensors start 64 bytes past a page), not copied
    through the staging arena: ``native_io.Writer.unstaged_min``. The DCP writer and the single-file save's
    congruent layout place storages with it.
    """
    return cursor + (address - cursor) % LARGE_ALIGN
