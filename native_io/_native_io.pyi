"""Typed stub for the native_io C extension."""

import os
from types import TracebackType
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Type, Union

from typing_extensions import Buffer

ALIGN: int
DEFAULT_BLOCK_SIZE: int
DEFAULT_QUEUE_DEPTH: int

_Path = Union[str, os.PathLike[str]]

class NativeIOError(OSError):
    operation: str
    offset: Optional[int]

class Writer:
    bytes_written: int
    io_bytes: int
    unstaged_bytes: int
    unstaged_min: int
    seconds: float
    direct: bool
    engine: Literal["uring", "portable"]
    closed: bool
    path: str
    fallback_reason: Optional[str]
    end: int
    held: int
    def write(self, segments: Sequence[Tuple[int, Buffer]], wait: bool = True) -> List[int]: ...
    def write_unstaged(self, offset: int, buffer: Buffer, crc: Optional[int] = None) -> int: ...
    def close(self, size: Optional[int] = None) -> None: ...
    def __enter__(self) -> "Writer": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class ReadProgress:
    done: int
    ended: bool
    def __init__(self) -> None: ...
    def wait(self, n: int) -> int: ...
    def crc(self, i: int) -> int: ...
    def cancel(self) -> None: ...
    def end(self) -> None: ...

class Span:
    nbytes: int
    owner: object
    def __init__(self, owner: object, address: int, nbytes: int) -> None: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class Reader:
    size: int
    bytes_read: int
    io_bytes: int
    direct_bytes: int
    seconds: float
    direct: bool
    engine: Literal["uring", "portable"]
    closed: bool
    path: str
    fallback_reason: Optional[str]
    def read(self, segments: Sequence[Tuple[int, Buffer]], progress: Optional["ReadProgress"] = None) -> List[int]: ...
    def new_progress(self) -> ReadProgress: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Reader": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool: ...

class IOEngine:
    engine: Literal["uring", "portable"]
    block_size: int
    queue_depth: int
    direct: bool
    fallback_reason: Optional[str]
    arena_bytes: int
    completion_timeout: float
    def __init__(
        self,
        engine: Literal["auto", "uring", "portable"] = "auto",
        block_size: int = ...,
        queue_depth: int = ...,
        direct: bool = True,
        completion_timeout: float = 120.0,
    ) -> None: ...
    def open_writer(self, path: _Path, size_hint: int | None = None, *, existing: bool = False) -> Writer: ...
    def open_reader(self, path: _Path) -> Reader: ...
    def close(self) -> None: ...
    def __enter__(self) -> "IOEngine": ...
    def __exit__(self, *exc: Any) -> bool: ...

def crc32c(buf: Buffer, value: int = 0) -> int: ...
def copy_crc32c(dst: Buffer, src: Buffer, value: int = 0) -> int: ...
def reserve(fd: int, offset: int, length: int) -> None: ...
def info() -> Dict[str, Any]: ...
