"""How long a server takes to answer this process, and the timeout of a first try that follows it (RFC 6298):
used by the etcd client's tries and by the embedded coordinator's batched reads."""

from __future__ import annotations

import threading
from typing import Optional

#: The longest one try waits for its answer.
MAX_TRY_TIMEOUT = 2.0


class AnswerTimes:
    """How long this process's requests wait for their answers, smoothed as TCP smooths round trips (RFC 6298:
    ``srtt``, ``rttvar``), and the first try's timeout that follows: ``srtt + 4 rttvar`` between the caller's
    shortest and :data:`MAX_TRY_TIMEOUT`. On a server that answers in milliseconds that is the short try (a request
    swallowed by a dying etcd leader costs 0.25 s); on a host whose servers and clients share busy cores, where
    answers take hundreds of milliseconds, a try no longer times out on a slow but working server, so a request
    is not sent again over a new connection, which would load the cores further. Thread-safe (an etcd client
    shares one with its clones)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.srtt: Optional[float] = None
        self.rttvar = 0.0

    def observe(self, seconds: float) -> None:
        """Count one answer that took ``seconds`` (sent to fully read)."""
        with self._lock:
            if self.srtt is None:
                self.srtt, self.rttvar = seconds, seconds / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - seconds)
                self.srtt = 0.875 * self.srtt + 0.125 * seconds

    def first_try(self, least: float) -> float:
        """The first try's timeout: at least ``least``, at most :data:`MAX_TRY_TIMEOUT`."""
        with self._lock:
            expected = least if self.srtt is None else self.srtt + 4 * self.rttvar
        return min(MAX_TRY_TIMEOUT, max(least, expected))
