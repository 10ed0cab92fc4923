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
    "chromium": "apt-get install chromium (scripts/setup.sh does, as root)",
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


#: The only skips a CI run may have, each a part of a reason and why it cannot run there. Any other skip
#: under ``CI=true`` fails the run (conftest.py): CI must not pass by skipping what it should test.
ALLOWED_SKIPS = {
    "CUDA": "CI has no GPU",
    "GPU": "CI has no GPU",
    "LIGHTNING_RECOVER_HEAVY": "8-12 processes per test: a manual check, too heavy for CI's 2 cores",
    "a build without liburing": "CI builds io_uring in; the portable-only build is checked by hand",
    "because root ignores permission bits": "CI runs as root; test_eacces_as_unprivileged_user covers it",
    "because this is not root": "the same test as a non-root user, covered by test_eacces as root",
    "no IPv6": "the machine has no IPv6 loopback",
    "torchft is not installed": "the torchft peer is a research benchmark's (benchmarks/torchft_resilience.py), not installed by CI",
}


def disallowed_skips(reasons: list[str]) -> list[str]:
    """The skip reasons of a run that ALLOWED_SKIPS does not allow."""
    return [reason for reason in reasons if not any(part in reason for part in ALLOWED_SKIPS)]
