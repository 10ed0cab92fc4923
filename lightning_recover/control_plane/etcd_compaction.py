"""Compacting etcd's history while a job runs, so that its writes never fill etcd's space quota.

etcd keeps every revision of every key until someone compacts: each heartbeat, commit, vouch and tick of a
job is a revision kept forever otherwise, and at etcd's space quota (2 GiB by default) the NOSPACE alarm
makes every write fail (``etcd_client.EtcdNoSpace``), which stops every replica until an operator compacts,
defragments and disarms. The holder of the job's monitor role (``etcd_job.MonitorRole``) therefore runs a
:class:`Compactor`: every ``period`` seconds it notes etcd's current revision, and compacts up to the newest
revision it noted at least ``retain`` seconds ago. Compacted pages are reused by etcd's backend, so the
database stops growing at about ``retain`` seconds' worth of the cluster's writes (the file itself shrinks
only with ``etcdctl defrag``, which the job never runs: it blocks the member it defragments).

What compaction may cost a reader: a watch that asks to start at a compacted revision is cancelled, and
the job's watched views then re-read their keys (``etcd_watch``); ``retain`` is far longer than any of the
job's watches lags. etcd's history is one per cluster, so on a shared cluster this compacts every job's
history older than ``retain``, which is what etcd's own ``--auto-compaction-mode periodic`` does too
(``lightning-recover etcd up`` turns that on as well); docs/control_plane.md says what an operator sets.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Optional

from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.errors import RecoverError

#: Seconds between two notes of etcd's revision (and compactions).
COMPACT_PERIOD = 5.0
#: Seconds of history kept: a compaction never removes a revision younger than this.
COMPACT_RETAIN = 30.0


class Compactor:
    """Compacts etcd's history older than ``retain`` seconds, every ``period`` seconds, on a thread of its own.

    Args:
        client: its own client (the compaction must not wait behind the monitor's requests).
        period: seconds between two compactions.
        retain: seconds of history kept.
        say: where a failure to compact is reported (once per kind, then on recovery).
        active: whether to compact now (the monitor role is held); the revisions are noted either way, so a
            launcher that takes the role (again) compacts at once what is due, however often the role moved.
    """

    def __init__(
        self,
        client: ec.EtcdClient,
        period: float = COMPACT_PERIOD,
        retain: float = COMPACT_RETAIN,
        say: Callable[[str], object] = print,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.client = client
        self.active = active
        self.period, self.retain = period, retain
        self.say = say
        self.compacted = 0  # the revision this compactor last compacted up to
        self.compactions = 0
        self._marks: collections.deque[tuple[float, int]] = collections.deque()
        self._due = 0  # the newest revision noted at least ``retain`` seconds ago
        self._failing: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lr-etcd-compactor", daemon=True)

    def start(self) -> Compactor:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (tests tick it by hand)
            self._thread.join(timeout)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.tick()
                if self._failing is not None:
                    self.say("etcd compaction works again")
                    self._failing = None
            except RecoverError as exc:  # unreachable or refused: the next period tries again
                if type(exc).__name__ != self._failing:
                    self._failing = type(exc).__name__
                    self.say(f"etcd compaction failed ({exc}); trying again every {self.period:g}s")

    def tick(self, now: Optional[float] = None) -> Optional[int]:
        """Note etcd's revision now; compact up to the newest noted at least ``retain`` seconds ago.
        Returns the revision compacted to (None: nothing due)."""
        now = time.monotonic() if now is None else now
        # A count of one absent key: the cheapest linearizable answer that carries the current revision.
        revision = int(self.client.range(b"\x00", count_only=True)["header"]["revision"])
        self._marks.append((now, revision))
        while self._marks and self._marks[0][0] <= now - self.retain:
            self._due = self._marks.popleft()[1]
        if self._due <= self.compacted or not self.active():
            return None
        self.client.compact(self._due)  # False: compacted further already (another job, or etcd's own)
        self.compacted = self._due
        self.compactions += 1
        return self._due
