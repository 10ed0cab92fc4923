"""A benchmark run in a directory of its own, removed afterwards, with its result written as JSON."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, Optional


def run_in_scratch_dir(
    prefix: str, run: Callable[[str], dict[str, Any]], json_path: str, parent: Optional[str] = None
) -> dict[str, Any]:
    """``run(directory)`` in a new directory under ``parent`` (the system's temporary directory by default), removed
    afterwards also when the run fails; its result written to ``json_path`` and returned."""
    directory = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        result = run(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def print_rows(summary: dict[str, dict[str, float]]) -> None:
    """One line per case of a summary, its figures rounded to milliseconds."""
    for name, row in summary.items():
        print(name, {k: round(v, 3) for k, v in row.items()})
