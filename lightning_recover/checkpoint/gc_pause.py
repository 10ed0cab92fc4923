"""Python's cyclic garbage collector held off for one DCP save or load, or one single-file save or load.

DCP allocates several small objects per item (write items, plans, results, metadata entries) and pickles
them through its collectives; each unpickle of thousands of them trips the collector's thresholds, and
every full collection walks the whole heap (torch's modules alone are hundreds of thousands of objects,
about 0.1 s per pass here). With 2048 tensors per rank this was 0.5 s of a 1.9 s save
(benchmarks/LOG.md). torch's own ``get_state_dict`` disables the collector the same way. A single-file save
of 10,000 tensors pickles as many objects, and its load unpickles them: ``single_file.save`` and ``load`` run
inside ``with GcPause():``.

The storage backends pause it when DCP first calls them and resume it at their last hook. DCP gives a
backend no hook when a save fails between two of its calls (another rank's write failed: the coordinator's
``finish`` is never called), so a pause also ends by itself ``max_s`` seconds after the backend's latest
hook: a failed save costs at most that long without cyclic collection, never a collector left off.
"""

from __future__ import annotations

import gc
import threading
from typing import Optional

DEFAULT_MAX_S = 30.0
# a rank whose last hook has run (DCP still exchanges results and the metadata): the collector comes back this
# many seconds later, so the exchange's unpickling runs without collections too
TAIL_S = 5.0


class GcPause:
    """``pause()`` disables the collector (if it was on) or, when paused, restarts the ``max_s`` countdown;
    ``resume()`` restores it (idempotent).

    Only a save or load run by the main thread pauses it: one run by a background thread
    (``dcp.async_save``'s upload) overlaps the training loop, which keeps its collector.
    """

    def __init__(self, max_s: float = DEFAULT_MAX_S) -> None:
        if not max_s > 0:
            raise ValueError(f"max_s must be positive seconds, got {max_s!r}")
        self.max_s = max_s
        self._lock = threading.Lock()
        self._timer: Optional[threading.Timer] = None
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self, max_s: Optional[float] = None) -> None:
        """Pause (or, when paused, restart the countdown) for at most ``max_s`` seconds (default: ``self.max_s``)."""
        with self._lock:
            if not self._paused:
                if not gc.isenabled() or threading.current_thread() is not threading.main_thread():
                    return  # off by the application's choice, or not the main thread: not ours to pause
                gc.disable()
                self._paused = True
            elif self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.max_s if max_s is None else max_s, self.resume)
            self._timer.daemon = True
            self._timer.start()

    def pause_tail(self) -> None:
        """A rank's last hook of a save: the collector comes back ``TAIL_S`` seconds later (at most ``max_s``),
        after DCP's closing exchange, whose unpickled objects are then already freed."""
        self.pause(min(TAIL_S, self.max_s))

    def __enter__(self) -> GcPause:
        self.pause()
        return self

    def __exit__(self, *exc: object) -> None:
        self.resume()

    def resume(self) -> None:
        with self._lock:
            if not self._paused:
                return
            self._paused = False
            timer, self._timer = self._timer, None
            gc.enable()
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()
