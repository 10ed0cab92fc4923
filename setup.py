"""Build of the native_io extension.

The io_uring engine is compiled in only when liburing's headers and library are present
(``apt-get install liburing-dev``); otherwise only the portable pread/pwrite engine is built.
Set ``NATIVE_IO_NO_URING=1`` to force the portable-only build. ``native_io.info()`` reports
which engines a build has.

``native_io._native_io`` (release) is always built. ``NATIVE_IO_TESTING=1`` builds the same sources a
second time, as ``native_io._native_io_testing`` with ``-DNATIVE_IO_TESTING``: the test-only fault
injection (``_inject_faults``) the tests drive. It is opt-in, so a wheel built without it holds no
testing module (nor its stub); ``scripts/setup.sh`` (``make test``, CI) sets it for the dev checkout, and
its tests skip without it (under ``CI=true`` they fail: ``tests/needs.py``).
"""

import ctypes.util
import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


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

if os.uname().machine in ("x86_64", "AMD64"):
    cflags = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-msse4.2"]
else:
    cflags = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def _extension(name: str, extra_macros: list) -> Extension:
    return Extension(
        name,
        sources=sources,
        depends=sorted(glob.glob("native_io/src/*.h")),  # a header change rebuilds every source
        define_macros=macros + extra_macros,
        libraries=libraries + ["pthread"],
        extra_compile_args=cflags,
    )


class BuildExtSeparateTemp(build_ext):
    """Both extensions compile the same sources with different macros: one object dir each."""

    def build_extension(self, ext: Extension) -> None:
        base = self.build_temp
        self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base


ext_modules = [_extension("native_io._native_io", [])]
exclude = {}
if os.environ.get("NATIVE_IO_TESTING", "") not in ("", "0"):
    ext_modules.append(_extension("native_io._native_io_testing", [("NATIVE_IO_TESTING", "1")]))
    print("native_io: building the testing module too (NATIVE_IO_TESTING)", file=sys.stderr)
else:
    exclude = {"native_io": ["_native_io_testing.pyi"]}  # no stub for a module the build lacks

setup(ext_modules=ext_modules, exclude_package_data=exclude, cmdclass={"build_ext": BuildExtSeparateTemp})
