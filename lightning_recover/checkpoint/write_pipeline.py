"""One batch written on a second thread while the caller lays out the next.

``native_io``'s ``Writer.write`` runs without the GIL, so the Python work of a save (resolving items,
building archive headers, taking views of storages) can run while the disk takes the previous batch.
Used by the DCP writer (``dcp/writer.py``) and the single-file save (``file/single_file.py``).

Every batch of one save is written by the same thread, which lives until ``close()``: the owner closes the
pipeline only after the writer's last transfer has completed. io_uring posts a completion through the
task that submitted the transfer; for a task that has exited (a thread per batch, say) it falls back to a
kernel work item delayed by a clock tick, and the device sits idle meanwhile wherever writes complete
asynchronously (overwrites, reserved space: docs/native_io.md, "One writing thread per save").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Optional

_STOP = object()


class WritePipeline:
    """``send(batch)`` runs ``write(batch)`` on the pipeline's thread, after the previous batch's
    ``done(batch, result)``.

    At most one batch is in flight; ``done`` runs in the caller's thread, in order. An error of ``write`` is
    raised by the next ``send`` or ``drain``. After a failure of the caller's own, ``abandon()`` waits for the
    batch in flight (so the writer may be closed) and drops its outcome. ``close()`` (or leaving the ``with``
    block) ends the thread: call it once the writer has finished, so the thread outlives its transfers.
    """

    def __init__(self, write: Callable[[Any], Any], done: Callable[[Any, Any], None]) -> None:
        self._write = write
        self._done = done
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._outcome: queue.SimpleQueue = queue.SimpleQueue()
        self._batch: Any = None
        self._in_flight = False
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> WritePipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def send(self, batch: Any) -> None:
        self.drain()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-write", daemon=True)
            self._thread.start()
        self._batch, self._in_flight = batch, True
        self._todo.put(batch)

    def _run(self) -> None:
        while True:
            batch = self._todo.get()
            if batch is _STOP:
                return
            try:
                self._outcome.put((self._write(batch), None))
            except BaseException as exc:  # raised in the caller's thread by drain()
                self._outcome.put((None, exc))

    def _wait(self) -> tuple[Any, Optional[BaseException]]:
        result, error = self._outcome.get()
        self._in_flight = False
        return result, error

    def drain(self) -> None:
        """Wait for the batch in flight and hand its result to ``done`` (its error, if any, is raised here)."""
        if not self._in_flight:
            return
        result, error = self._wait()
        batch, self._batch = self._batch, None
        if error is not None:
            raise error
        self._done(batch, result)

    def abandon(self) -> None:
        if self._in_flight:
            self._wait()
        self._batch = None

    def close(self) -> None:
        """Wait for the batch in flight (dropping its outcome) and end the thread; idempotent."""
        self.abandon()
        if self._thread is not None:
            self._todo.put(_STOP)
            self._thread.join()
            self._thread = None
