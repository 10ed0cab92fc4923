"""The user's command on a launcher's command line: the words after ``--`` (``run``, ``torchrun``, ``slurm``)."""

from __future__ import annotations

from collections.abc import Sequence


def user_command(words: Sequence[str], missing: str) -> list[str]:
    """``words`` without a leading ``--``; ``SystemExit(missing)`` when nothing is left (the one-line hint)."""
    command = list(words)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit(missing)
    return command
