"""Build of the native_io extension.

The io_uring engine is compiled in only when liburing's headers and library are present
(``apt-get install liburing-dev``); otherwise only the portable pread/pwrite engine is built.
Set ``NATIVE_IO_NO_URING=1`` to force the portable-only build. ``native_io.info()`` reports
which engines a build has.
"""

import ctypes.util
import glob
import os
import sys

from setuptools import Extension, setup


def _have_liburing() -> bool:
    if os.environ.get("NATIVE_IO_NO_URING"):
        return False
    header = any(os.path.exists(os.path.join(d, "liburing.h")) for d in ("/usr/include", "/usr/local/include"))
    return header and ctypes.util.find_library("uring") is not None


sources = sorted(glob.glob("native_io/src/*.c"))
macros = []
libraries = []
if _have_liburing():
    macros.append(("NATIVE_IO_HAVE_URING", "1"))
    libraries.append("uring")
    print("native_io: building with the io_uring engine (liburing found)", file=sys.stderr)
else:
    print("native_io: liburing not found, building the portable engine only", file=sys.stderr)

setup(
    ext_modules=[
        Extension(
            "native_io._native_io",
            sources=sources,
            define_macros=macros,
            libraries=libraries + ["pthread"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-msse4.2"]
            if os.uname().machine in ("x86_64", "AMD64")
            else ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
