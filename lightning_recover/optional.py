"""Optional parts fail like optional parts: without the package they need, they are skipped with a note
that says what to install, never with a traceback."""

from __future__ import annotations

import sys


def plotting_available(what: str) -> bool:
    """True when matplotlib imports; otherwise print that ``what`` is skipped and how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            f"note: {what} skipped: matplotlib is not installed. HINT: pip install matplotlib "
            "(or install lightning-recover with its [plot] extra)",
            file=sys.stderr,
        )
        return False
    return True
