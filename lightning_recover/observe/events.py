"""The job's event log: one JSON object per line, appended by the monitor, never rewritten.

Each line holds the wall-clock time (``time``, seconds since the epoch), the generation current when it
happened (``generation``), its ``kind`` (``start``, ``join``, ``exit``, ``death``, ``recovery``,
``generation``, ``monitor``) and the kind's fields (``replica``, ``incarnation``, ``cause``, ``seconds``,
...). On etcd each launcher appends while it holds the monitor role, so the events of a takeover are in
the new holder's file from the moment it took the role.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Optional

log = logging.getLogger(__name__)


class EventLog:
    """Appends events to ``path`` (created 0644 if absent); ``None`` keeps them in memory only."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = None
        if path:
            try:
                self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the job
            except OSError as exc:
                raise ValueError(
                    f"cannot open the event log {path!r}: {exc.strerror}. HINT: give --event-log a file in a "
                    "writable directory"
                ) from None

    def write(self, event: dict[str, Any]) -> None:
        """Append ``event`` and flush it (a crash of the monitor loses no written event)."""
        if self._file is None:
            return
        line = json.dumps(event, sort_keys=True, default=str)
        with self._lock:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except (OSError, ValueError) as exc:  # a full disk must not stop the monitor: say it once
                log.warning("event log %s: %s; no more events are written", self.path, exc)
                self._close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def read_events(path: str) -> list[dict[str, Any]]:
    """Every event in the log at ``path``, oldest first (a torn last line, from a crash, is skipped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
