"""When a replica's heartbeat thread must write a beat, once its liveness is a lease (etcd).

On etcd a replica of one process keeps its heartbeat key alive through a lease
(``control_plane/etcd_liveness.py``): keep-alives, which are not Raft writes, say that it lives. A beat written
is then only needed to tell the monitor the main thread's progress (step, phase, count: the hang and partition
judges), and while steps commit, every commit vouches for the generation's members (``vouches.py``). So the
thread skips its beat while a vouch reached it within the *coverage* window: twice the shortest of the last
gaps between two vouches it saw (the job's step time, as this replica sees it), at least the heartbeat period
and at most :data:`COVER_MAX`. Steps of any length below that cap cost no beat at all; once commits stop for
twice a step (a failure, a hang, a partition), beats resume every period and the judges see each replica's
phase as before, at most one window late.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional

#: the longest a vouch covers a replica: a quarter of the default hang_timeout (60 s), so a main thread that
#: stopped between two commits is seen by the hang judge at most that late
COVER_MAX = 15.0
_GAPS = 3  # gaps between vouches looked at: one long gap (a regroup) does not widen the window
#: etcd raises a TTL below its minimum (1.5 x the election timeout) to that minimum; 2 s is above it for
#: election timeouts up to 1.3 s
MIN_TTL = 2


def lease_ttl(period: float, timeout: Optional[float] = None) -> int:
    """The lease's TTL: the heartbeat timeout (``timeout``; where not given, the one a beat every ``period``
    stands for: 4 beats per timeout on etcd, ``options.ETCD_BEATS_PER_TIMEOUT``), in whole seconds, at least
    :data:`MIN_TTL`. A heartbeat interval set shorter than that default must not shorten the lease: a process
    starved for less than its heartbeat timeout would lose its key and be declared dead."""
    return max(MIN_TTL, math.ceil(timeout if timeout is not None else 4 * period))


class VouchCoverage:
    """How long the newest vouch covers this replica (see the module doc)."""

    def __init__(self) -> None:
        self._last: Optional[float] = None
        self._gaps: deque[float] = deque(maxlen=_GAPS)

    def vouched(self, at: float) -> None:
        """A vouch naming this replica reached it at ``at`` (monotonic)."""
        if self._last is not None and at > self._last:
            self._gaps.append(at - self._last)
        self._last = at

    def window(self, period: float) -> float:
        """Seconds a vouch (or a beat) covers, for a heartbeat ``period``."""
        steps = 2 * min(self._gaps) if self._gaps else 0.0
        return min(max(period, steps), max(period, COVER_MAX))


def heartbeat_lease(store: Any, key: str, period: float, timeout: Optional[float] = None) -> Any:
    """The leased heartbeat key of a replica beating every ``period`` with heartbeat ``timeout`` on ``store`` (a
    ``ControlStore``): ``etcd_liveness.LeasedKey`` on etcd, None where the store has no leases (the embedded
    coordinator)."""
    return store.raw.leased(key, lease_ttl(period, timeout))
