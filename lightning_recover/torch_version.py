"""The oldest torch this package accepts, checked when it is imported.

Everything lightning-recover reads back from a file or from a peer (checkpoint files, a rejoining replica's
state, the Trainer's sharded checkpoint entries) goes through torch's restricted ``weights_only`` unpickler.
That loader is only a safety boundary from torch 2.6 on: before it, CVE-2025-32434 let a crafted file run
code through ``torch.load(weights_only=True)``. So an older torch is refused, with what to install.
"""

from __future__ import annotations

import re

#: (major, minor) of the oldest torch accepted; pyproject.toml's ``torch>=`` says the same (a test checks).
MINIMUM = (2, 6)


def parse(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``2.13.0+cpu`` or ``2.6.0a0+git1234``."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    if not found:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


def check(version: str) -> None:
    """Raise ``ImportError`` (with a HINT) when ``version`` is older than :data:`MINIMUM`."""
    if parse(version) < MINIMUM:
        need = ".".join(map(str, MINIMUM))
        raise ImportError(
            f"lightning-recover needs torch >= {need}, found torch {version}: before {need}, torch's weights_only "
            "loader, which every checkpoint and rejoin-state load relies on, could run code from a crafted file "
            f"(CVE-2025-32434). HINT: pip install 'torch>={need}'"
        )
