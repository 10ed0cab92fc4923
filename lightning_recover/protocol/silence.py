"""How long a peer has been silent, counted in this process's own running time.

A watcher (the launcher's main loop, a replica's watchdog) judges a coordinator lost once it has not answered
for a bound. Measured on the wall clock, a stretch in which the watcher itself did not run (a host so loaded
that its threads waited seconds for a core, a stopped process) is blamed on the coordinator: the watcher wakes,
finds the last answer old, and stops a job whose coordinator answered every request it was sent. So a watcher
counts silence in its own time: each of its turns adds the time since its previous turn, but at most
``max_turn``; the rest of a longer gap is time it did not run. A coordinator that is truly silent is still
declared lost after the bound of the watcher's own time, however slowly the watcher runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

#: The most a watcher's turn counts: its loops turn every 10-100 ms, so a longer gap is time it did not run.
MAX_TURN = 1.0
_STALLS_KEPT = 64  # stalls remembered: older ones precede any answer a watcher still measures from


class OwnTime:
    """A watcher's own running time: :meth:`turn` on every turn of its loop, :meth:`since` to measure from a
    moment. Turns may come from one thread only; :meth:`since` reads a moment written by any thread."""

    def __init__(self, max_turn: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_turn = max_turn
        self._clock = clock
        self._last = clock()
        self._stalls: deque[tuple[float, float]] = deque(maxlen=_STALLS_KEPT)  # (when it ended, seconds not run)

    def turn(self) -> None:
        """One turn of the watcher's loop: a gap since the previous one beyond ``max_turn`` was not run."""
        now = self._clock()
        if now - self._last > self.max_turn:
            self._stalls.append((now, now - self._last - self.max_turn))
        self._last = now

    def since(self, moment: float) -> float:
        """Seconds of this watcher's own time from ``moment`` (on the same clock) to its latest turn."""
        lost = sum(seconds for ended, seconds in list(self._stalls) if ended > moment)
        return max(0.0, self._last - moment - lost)
