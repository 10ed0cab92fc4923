"""A replica's liveness as the coordinator sees it: the heartbeat thread, the main thread's progress it
carries, and the watchdog that ends a replica whose coordinator stopped answering.

The rule for when a beat is due once a lease keeps the key alive (etcd) is ``liveness.py``'s, with no thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Optional

from lightning_recover.errors import COORDINATOR_LOST_HINT, RecoverError
from lightning_recover.protocol.liveness import VouchCoverage, heartbeat_lease
from lightning_recover.protocol.messages import ControlStore, sequence
from lightning_recover.protocol.notice import Notice, leave_requested
from lightning_recover.protocol.silence import MAX_TURN, OwnTime
from lightning_recover.protocol.vouches import VOUCH_KEY, Roster, VouchReader, raw_reader


class Progress:
    """What the main thread is doing, reported by the heartbeat: a replica whose heartbeat thread
    lives but whose main thread is stuck (a deadlock) is told apart from a slow one by this."""

    def __init__(self) -> None:
        self.step = -1
        self.phase = "start"
        self.count = 0
        self.report: dict = {}  # what the status board shows of this replica (observe/report.py), set by it
        self.urgent = False  # the report holds news (a recovery, a join): beat even where a vouch covers it
        self.joining = False  # in a join round: waiting on the control plane, not on the data network

    @contextlib.contextmanager
    def in_round(self) -> Iterator[None]:
        """Within the block the main thread waits in a join round, which its beats tell (``"joining"``)."""
        self.joining = True
        try:
            yield
        finally:
            self.joining = False

    def note(self, phase: str, step: Optional[int] = None) -> None:
        self.phase = phase
        if step is not None:
            self.step = step
        self.count += 1


class Heartbeat:
    """Rewrites the sealed ``hb/{replica}`` every ``interval`` seconds on its own store connection,
    carrying the main thread's :class:`Progress` under a growing sequence (incarnation, beat): an
    old heartbeat written back is a replay its readers drop (messages.Freshness). It also watches
    for this incarnation being declared dead (so the main thread learns it at its next check, even
    between collectives).

    On etcd a step's commit may vouch for this replica (``vouches.py``): the thread then skips its beat while
    a vouch naming this incarnation reached the watched view less than ``interval`` ago. Why: every beat of
    its own is a Raft write (2-4 ms of the etcd members' CPU) and a watch event for every watcher; the commit
    is written anyway."""

    def __init__(
        self,
        store: ControlStore,
        replica: int,
        incarnation: int,
        interval: float,
        progress: Progress,
        key: str | None = None,
        notice: Notice | None = None,
        timeout: float | None = None,
    ) -> None:
        self._store = store.clone()
        self._notice = notice  # an operator's leave request (``lightning-recover leave``) is read here
        self._notice_sent = False  # the notice went out on a beat (news: the first one is written at once)
        self._replica = replica
        self._key = key or f"hb/{replica}"  # per process when a replica is K processes
        self._incarnation = incarnation
        self._interval = interval
        self._progress = progress
        self._beat = 0
        self._last_beat = 0.0  # monotonic time of the last beat written
        self._last_payload: dict | None = None  # what the last beat said
        # Commits vouch for whole replicas of one process only (decisions.py).
        sealer = self._store.sealer  # a vouch names its generation: whom it covers is read once per generation
        self._vouches = VouchReader(sealer, Roster(sealer, raw_reader(self._store.raw))) if key is None else None
        self.vouched_at = 0.0  # monotonic time the newest vouch naming this incarnation reached this process
        # etcd: the key lives while its lease is kept alive (liveness.py); a beat is then written only to
        # tell the main thread's progress, once no vouch covered this replica for a step or two
        self._leased = heartbeat_lease(self._store, self._key, interval, timeout) if key is None else None
        self._coverage = VouchCoverage()
        self.last_ok = time.monotonic()  # when the coordinator last answered (read by the watchdog)
        self._stop = threading.Event()
        self._sending = threading.Lock()  # the thread's beats and send_news's from the main thread
        self._watchdog: CoordinatorWatchdog | None = None
        self.error: BaseException | None = None
        self.excluded = False
        self._thread = threading.Thread(target=self._run, name=f"lr-heartbeat-{replica}", daemon=True)

    def start(self, coordinator: str | None = None, silent_limit: float = 0.0) -> None:
        """Write the first beat and go on beating on this object's thread. With ``coordinator`` (its address, for
        the error) a :class:`CoordinatorWatchdog` ends the process once no beat was answered for ``silent_limit``."""
        self._send()
        if self._leased is not None:
            self._leased.start_keeping()  # its own thread: never behind a beat or a read that etcd answers late
        self._thread.start()
        if coordinator is not None:
            self._watchdog = CoordinatorWatchdog(self, self._replica, coordinator, silent_limit)
            self._watchdog.start()

    def _covered_since(self) -> float:
        """The last beat, written or vouched for."""
        if self._vouches is not None:
            got = self._store.recent_arrival(VOUCH_KEY)
            if got is not None and got[1] > self.vouched_at:
                vouch = self._vouches.newer(got[0])
                if vouch is not None and vouch.incarnations.get(self._replica) == self._incarnation:
                    self.vouched_at = got[1]
                    self._coverage.vouched(got[1])
        return max(self._last_beat, self.vouched_at)

    def _window(self) -> float:
        """How long a beat or a vouch covers this replica: the period, or with a lease the coverage window."""
        return self._interval if self._leased is None else self._coverage.window(self._interval)

    def _next_wake(self) -> float:
        """When the next beat may be due (monotonic)."""
        return self._covered_since() + self._window()

    def _write(self, payload: dict) -> None:
        self._last_payload = payload
        seq = sequence(self._incarnation, self._beat)
        if self._leased is None:
            self._store.set(self._key, json.dumps(payload), seq=seq)
        else:  # the monitor judges a leased beat by its key's presence, not by its beats moving
            value = json.dumps(dict(payload, lease=self._leased.ttl))
            self._leased.put(self._store.sealer.seal(self._key, value.encode(), seq))

    def _send(self) -> None:
        if self._leased is not None and self._leased.error is not None:
            failed = self._leased.error
            raise RecoverError(f"the lease's keep-alives stopped: {type(failed).__name__}: {failed}") from failed
        p = self._progress
        noticed = self._notice is not None and self._notice.is_set()
        if time.monotonic() - self._covered_since() >= self._window() or p.urgent or noticed != self._notice_sent:
            self._beat += 1
            p.urgent = False
            payload = {
                **p.report,
                "inc": self._incarnation,
                "beat": self._beat,
                "step": p.step,
                "phase": p.phase,
                "count": p.count,
            }
            if p.joining:
                payload["joining"] = True  # the partition judge does not probe a group forming
            if noticed:
                payload["notice"] = self._notice.source  # the status page tells a leave from a failure by it
            self._write(payload)
            self._notice_sent = noticed
            self._last_beat = time.monotonic()
        if self._store.deaths([self._replica], recent=True)[self._replica] >= self._incarnation:
            self.excluded = True
        if self._notice is not None and not self._notice.is_set():
            if leave_requested(self._store, self._replica, self._incarnation):
                self._notice.set("leave request")
                print(
                    f"[lightning-recover] replica {self._replica}: told to leave (leave request); it leaves at the "
                    "commit of its next reduce",
                    flush=True,
                )
        self.last_ok = time.monotonic()

    def _run(self) -> None:
        # Wakes one period after the last beat, written or vouched for: never further apart than that.
        while not self._stop.wait(max(0.0, self._next_wake() - time.monotonic())):
            try:
                with self._sending:
                    self._send()
            except Exception as exc:
                self.error = exc
                return

    def send_news(self) -> None:
        """Write a beat now if the main thread's progress carries news no beat carried yet (a leave, a
        recovery): a replica that ends within one period of it would otherwise take it along unwritten."""
        if self._progress.urgent and self.error is None and not self._stop.is_set():
            with self._sending:
                self._send()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self._stop.set()
        if self._thread.ident is not None:  # started: start() raises before it when the first beat fails
            self._thread.join(timeout=5)
        if self._leased is not None:
            self._keep_last_beat()
            self._leased.close()  # its lease goes now, not a TTL later

    def _keep_last_beat(self) -> None:
        """The last beat written again without the lease, so that revoking it does not delete what it said: news
        on it (the members that left at a commit) must reach the monitor's last look at the job's end, however
        far behind the monitor's view runs. Called once the replica is marked gone: nobody judges the key."""
        if self._last_payload is None:
            return
        try:
            with self._sending:
                self._beat += 1
                value = json.dumps(dict(self._last_payload, beat=self._beat))
                self._store.set(self._key, value, seq=sequence(self._incarnation, self._beat))
        except Exception:
            pass  # the control plane is gone: the lease ends the key as before


class CoordinatorWatchdog:
    """Ends the process when the coordinator stops answering the heartbeat for ``limit`` seconds (of this
    thread's own running time, ``silence.py``).

    A TCPStore client blocks for good in a read from a frozen (SIGSTOPped, wedged) server: its
    timeout covers waiting for keys, not a server that stopped reading. Whatever the main thread
    is blocked in, this thread prints the named error and exits the process (status 3), so a
    frozen coordinator never leaves replicas hanging.
    """

    EXIT_STATUS = 3

    def __init__(self, heartbeat: Heartbeat, replica: int, addr: str, limit: float) -> None:
        self._heartbeat = heartbeat
        self._replica = replica
        self._addr = addr
        self._limit = limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lr-watchdog-{replica}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        own_time = OwnTime(MAX_TURN)  # silence is counted while this thread ran (silence.py)
        while not self._stop.wait(min(0.1, self._limit / 10)):
            if self._heartbeat.stopped:
                return  # the heartbeat was stopped on purpose: nothing left to watch
            own_time.turn()
            silent = own_time.since(self._heartbeat.last_ok)
            if silent > self._limit and not self._stop.is_set():
                failed = self._heartbeat.error
                why = (
                    "(frozen or unreachable)"
                    if failed is None
                    else f"(the heartbeat's last call failed: {type(failed).__name__}: {failed})"
                )
                print(
                    f"[lightning-recover] replica {self._replica}: CoordinatorLostError: the coordinator at "
                    f"{self._addr} has not answered for {silent:.1f}s {why}; no further step "
                    "can be agreed, this replica stops. " + COORDINATOR_LOST_HINT,
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                os._exit(self.EXIT_STATUS)

    def stop(self) -> None:
        self._stop.set()
