"""native_io: coalescing io_uring checkpoint writer/reader (C extension).

See docs/native_io.md for the design and the measurements behind the defaults.
"""

from __future__ import annotations

import os
import re
from types import ModuleType
from typing import Any, Optional

from . import _native_io
from ._native_io import (  # noqa: F401
    ALIGN,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_QUEUE_DEPTH,
    IOEngine,
    NativeIOError,
    Reader,
    ReadProgress,
    Span,
    Writer,
    copy_crc32c,
    crc32c,
    reserve,
)

__all__ = [
    "ALIGN",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_QUEUE_DEPTH",
    "IOEngine",
    "NativeIOError",
    "Reader",
    "ReadProgress",
    "Span",
    "Writer",
    "copy_crc32c",
    "crc32c",
    "info",
    "reserve",
    "testing",
]


def _linked_liburing_version() -> Optional[str]:
    """Version of the liburing shared object mapped into this process.

    liburing < 2.4 has no version macros, so read it from the soname the
    extension was linked against (e.g. /usr/lib/x86_64-linux-gnu/liburing.so.2.3).
    """
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                m = re.search(r"(/\S*liburing\.so\S*)", line)
                if m:
                    real = os.path.realpath(m.group(1))
                    v = re.search(r"liburing\.so\.(\d+(?:\.\d+)*)", real)
                    if v:
                        return v.group(1)
    except OSError:
        pass
    return None


def info() -> dict[str, Any]:
    """Describe this build: engines, defaults, io_uring usability, crc32c impl."""
    d = _native_io.info()
    if d.get("liburing") is None and d.get("liburing_compiled"):
        d["liburing"] = _linked_liburing_version()
    return d


def testing() -> ModuleType:
    """The test build ``native_io._native_io_testing``: same engine plus ``_inject_faults``.

    Fault injection is compiled only into that module (``-DNATIVE_IO_TESTING``); its objects
    (``IOEngine``, ``NativeIOError``, ...) are its own types, distinct from the release ones.
    Raises ImportError when the package was built without it (it is built only with ``NATIVE_IO_TESTING=1``).
    """
    try:
        from . import _native_io_testing
    except ImportError as e:
        raise ImportError(
            "native_io._native_io_testing is not built; rebuild with NATIVE_IO_TESTING=1 "
            "(NATIVE_IO_TESTING=1 python setup.py build_ext --inplace, or scripts/setup.sh)"
        ) from e
    return _native_io_testing
