"""One batch written on a second thread while the caller lays out the next.

``native_io``'s ``Writer.write`` runs without the GIL, so the Python work of a save (resolving items,
building archive headers, taking views of storages) can run while the disk takes the previous batch.
Used by the DCP writer (``dcp/writer.py``) and the single-file save (``file/single_file.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional


class WritePipeline:
    """``send(batch)`` runs ``write(batch)`` on a thread, after the previous batch's ``done(batch, result)``.

    At most one batch is in flight; ``done`` runs in the caller's thread, in order. An error of ``write`` is
    raised by the next ``send`` or ``drain``. After a failure of the caller's own, ``abandon()`` waits for the
    batch in flight (so the writer may be closed) and drops its outcome.
    """

    def __init__(self, write: Callable[[Any], Any], done: Callable[[Any, Any], None]) -> None:
        self._write = write
        self._done = done
        self._thread: Optional[threading.Thread] = None
        self._batch: Any = None
        self._result: Any = None
        self._error: Optional[BaseException] = None

    def send(self, batch: Any) -> None:
        self.drain()
        self._batch, self._result = batch, None
        self._thread = threading.Thread(target=self._run, name="checkpoint-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._write(self._batch)
        except BaseException as exc:  # raised in the caller's thread by drain()
            self._error = exc

    def drain(self) -> None:
        """Wait for the batch in flight and hand its result to ``done`` (its error, if any, is raised here)."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, batch, result = None, self._batch, self._result
        self._batch = self._result = None
        if self._error is not None:
            raise self._error
        self._done(batch, result)

    def abandon(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._batch = self._result = None
