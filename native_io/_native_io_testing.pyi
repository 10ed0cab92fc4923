"""Typed stub for the test build of the native_io C extension (``-DNATIVE_IO_TESTING``)."""

from native_io._native_io import (
    ALIGN as ALIGN,
    DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE,
    DEFAULT_QUEUE_DEPTH as DEFAULT_QUEUE_DEPTH,
    IOEngine as IOEngine,
    NativeIOError as NativeIOError,
    Reader as Reader,
    Writer as Writer,
    copy_crc32c as copy_crc32c,
    crc32c as crc32c,
    info as info,
    reserve as reserve,
)

def _inject_faults(
    short_every: int = 0,
    eintr_every: int = 0,
    eio_at: int = 0,
    stall_at: int = 0,
    refuse_direct: bool = False,
    refuse_uring: bool = False,
    refuse_fallocate: bool = False,
) -> None: ...
