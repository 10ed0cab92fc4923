"""What a test needs from the machine, and what happens when it is missing.

Locally a missing prerequisite skips the test with a reason that says what was not tested and how to
get it. Under ``CI=true`` on Linux it FAILS the test instead: CI must exercise the io_uring engine and
the fio reference, never pass by skipping them (scripts/setup.sh installs them).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import NoReturn

import pytest

#: How to get each prerequisite (Debian/Ubuntu; scripts/setup.sh does this as root).
INSTALL = {
    "liburing": "apt-get install liburing-dev, then rebuild native_io (pip install -e . or make setup)",
    "fio": "apt-get install fio",
}


def strict() -> bool:
    """True where a missing prerequisite must fail the run: CI on Linux."""
    return os.environ.get("CI", "").lower() == "true" and sys.platform.startswith("linux")


def missing(untested: str, why: str, need: str) -> NoReturn:
    """Skip (locally) or fail (CI on Linux) a test: ``untested`` was not tested because ``why``."""
    message = f"not tested: {untested}, because {why}. HINT: {INSTALL[need]}"
    if strict():
        pytest.fail(f"CI=true requires {need}: {message}", pytrace=False)
    pytest.skip(message)


def problems() -> list[str]:
    """Everything the CI run needs and this machine lacks (empty where all is there)."""
    found = []
    if shutil.which("fio") is None:
        found.append(f"fio is not installed (the benchmarks' device reference). HINT: {INSTALL['fio']}")
    try:
        import native_io
    except ImportError as exc:
        found.append(f"native_io does not import ({exc}). HINT: pip install -e . (or make setup)")
    else:
        info = native_io.info()
        if not info["liburing_compiled"]:
            found.append(f"native_io was built without io_uring. HINT: {INSTALL['liburing']}")
        elif not info["uring_usable"]:
            found.append(
                f"the io_uring engine is refused here ({info['uring_refused_reason']}). HINT: run CI on a kernel "
                "and in a container that allow io_uring (seccomp, kernel.io_uring_disabled=0)"
            )
    return found
