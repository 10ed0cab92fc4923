"""A process's watched view of the job's keys: one etcd watch stream feeding a local, revision-ordered copy.

Why: on etcd every read is a round trip through TLS and the leader (3-5 ms on a loaded host, against tens
of microseconds on the embedded TCPStore), and the step protocol was written for the TCPStore: a replica's
main thread polled the decision register, the ``events`` counter, join requests and death notices about
twenty times per step. With a :class:`WatchView` those polls are answered from memory and a wait for a key
wakes on the watch event that creates it.

What a reader may rely on (tests/integration/test_etcd_watch.py checks each):

* **A consistent past state, never older than one already served**: the view starts from one linearizable
  read of the whole prefix at revision R, then applies the watch's events from R + 1 in revision order.
  Every answer is the store's state at the view's revision, and that revision only grows (a re-read after a
  lost stream is linearizable, so it is at least as new as every event applied before).
* **Bounded staleness, else no answer**: the view answers only while it is *healthy*: synced and a message
  of the stream arrived within ``stale_after`` seconds (a step's commit, or the monitor's ``tick`` written
  while nothing else is, ``coordinator.run_monitor``: a live stream of the job's keys is never that quiet).
  A silent, compacted, cancelled or broken stream makes the view unhealthy at once or within
  ``stale_after``; readers then make the round trip they would have made without a view (``lookup``
  answers ``(False, None)``), and the view catches up and watches again. A key outside the watched range
  gets the same answer: it is not watched, which is not absent.
* **Catching up costs O(1) bytes when nothing was missed**: a silent stream is mostly a quiet one (a long
  step whose tick was late on a loaded host). The view first asks etcd, in one linearizable read of a
  single key, how many keys the range holds and the newest ``mod_revision`` among them
  (:func:`range_unchanged`); only when either differs from what it holds does it re-read the whole prefix.
* A stale answer is only an earlier state: the protocol uses the view only where reading slightly earlier
  is a read that could have happened anyway (hints, registers written once, notices that only grow);
  decisions themselves are written by transactions (``EtcdStore.put_and_decide``).
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from collections.abc import Callable
from typing import Optional

from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.errors import RecoverError

#: Seconds a stream may stay silent before the view stops answering (and reconnects).
STALE_AFTER = 1.0
#: The most keys a view reads in one sync: a job's prefix holds far fewer; beyond it something else writes
#: there, and the view stays unhealthy (its readers ask etcd) rather than hold it all in memory.
MAX_SYNC_KEYS = 200_000
_RETRY_MIN, _RETRY_MAX = 0.02, 0.5  # seconds between tries to re-read and re-watch after a failure


class WatchView:
    """Keys under ``prefix`` as of :attr:`revision`, kept current by a watch on a thread of its own."""

    def __init__(self, client: ec.EtcdClient, prefix: bytes, stale_after: float = STALE_AFTER) -> None:
        self._client = client  # its own connection: the stream and the re-reads never share the caller's
        self.prefix = prefix
        self._end = ec.prefix_end(prefix)
        self.stale_after = stale_after
        self._cond = threading.Condition()
        self._values: dict[bytes, bytes] = {}
        self._mods: dict[bytes, int] = {}  # key -> its mod_revision (a compare-and-swap's first guess)
        self._arrived: dict[bytes, float] = {}  # key -> monotonic time its current value reached this view
        self.revision = 0  # the store's revision this view is complete up to
        self._synced = False
        self._heard = 0.0  # monotonic time of the stream's last message
        self.resyncs = 0  # full re-reads (1 at start; more after a stream lost while the range changed)
        self.confirms = 0  # one-key reads that found the range as the view holds it (a silent or lost stream)
        self.events = 0  # watch events applied (load figures)
        #: bytes of keys and values this view received, base64 as etcd's gateway sends them (load figures)
        self.payload_bytes = 0
        self.term = 0  # the highest Raft term in the stream's headers (grows with every leader election)
        #: called with each change as a JSON line, under the view's lock (a watch relay's followers)
        self._followers: list[Callable[[bytes], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lr-etcd-watch", daemon=True)

    def start(self) -> WatchView:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._synced = False
            self._cond.notify_all()
        deadline = time.monotonic() + self.stale_after + 1.0
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._client.end_stream()  # its read returns now, not after stale_after (again: it may open one)
            self._thread.join(0.05)

    # ---------------------------------------------------------------- reading
    def _healthy(self) -> bool:
        return self._synced and time.monotonic() - self._heard <= self.stale_after

    def _holds(self, keys: list[bytes]) -> bool:
        """Healthy, and every key is in the watched range (a key outside it is not absent: it is not watched)."""
        return self._healthy() and all(k.startswith(self.prefix) for k in keys)

    @property
    def healthy(self) -> bool:
        with self._cond:
            return self._healthy()

    @property
    def quiet_for(self) -> float:
        """Seconds since the stream's last message (or the last re-read)."""
        with self._cond:
            return time.monotonic() - self._heard

    def follow(self, follower: Callable[[bytes], None]) -> None:
        """Call ``follower`` with this view's state now and then with every change, in the view's order, each as
        one JSON line (:func:`change_line`), under the view's lock: it must only queue what it is given."""
        with self._cond:
            if self._synced:
                kvs = [[ec.b64(k), ec.b64(v), self._mods[k]] for k, v in self._values.items()]
                follower(change_line("snapshot", kvs=kvs, revision=self.revision, term=self.term, heard=self._heard))
            else:
                follower(change_line("lost"))
            self._followers.append(follower)

    def unfollow(self, follower: Callable[[bytes], None]) -> None:
        with self._cond:
            if follower in self._followers:
                self._followers.remove(follower)

    def lookup(self, key: bytes) -> tuple[bool, Optional[bytes]]:
        """``(True, value or None when absent)`` while healthy, for a key in the watched range;
        ``(False, None)``: ask etcd instead."""
        with self._cond:
            if not self._holds([key]):
                return False, None
            return True, self._values.get(key)

    def lookup_versioned(self, key: bytes) -> Optional[tuple[bytes, int]]:
        """``(value, mod_revision)`` of a key the view holds while healthy, else None: a guess for a
        compare-and-swap (a stale guess only fails its compare, and the transaction answers the truth)."""
        with self._cond:
            if not self._holds([key]) or key not in self._values:
                return None
            return self._values[key], self._mods[key]

    def lookup_arrival(self, key: bytes) -> Optional[tuple[bytes, float]]:
        """``(value, monotonic time it reached this view)`` of a key the view holds while healthy, else None:
        when a record written for this process arrived (``protocol/vouches.py``)."""
        with self._cond:
            if not self._holds([key]) or key not in self._values:
                return None
            return self._values[key], self._arrived[key]

    def lookup_each(self, keys: list[bytes]) -> Optional[list[Optional[bytes]]]:
        """Every key's value (None when absent) while healthy, else None: ask etcd instead."""
        with self._cond:
            if not self._holds(keys):
                return None
            return [self._values.get(k) for k in keys]

    def lookup_many(self, keys: list[bytes]) -> Optional[list[bytes]]:
        """Every key's value while healthy and every key is in the view; else None: ask etcd instead."""
        with self._cond:
            if not self._holds(keys) or any(k not in self._values for k in keys):
                return None
            return [self._values[k] for k in keys]

    def wait_for(self, keys: list[bytes], timeout: float) -> Optional[bool]:
        """True once every key is in the view, False after ``timeout`` seconds; None as soon as the view
        is (or becomes) unhealthy: the caller waits on etcd itself for what is left of its time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if not self._holds(keys):
                    return None
                if all(k in self._values for k in keys):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # Wake at the latest when the view would turn stale, to say so.
                self._cond.wait(min(left, max(0.001, self._heard + self.stale_after - time.monotonic())))

    def wait_change(self, revision: int, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the view to move past ``revision``; the view's revision."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.revision <= revision and self._healthy():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self.revision

    # ---------------------------------------------------------------- the stream
    def _run(self, until: float = math.inf) -> None:
        """Watch until closed, or until monotonic time ``until`` (then not current: a relay's follower that
        watched etcd while its relay was gone goes back to the relay)."""
        delay = _RETRY_MIN
        while not self._stop.is_set() and self._keep_watching(until):
            try:
                if not self._confirm():
                    self._sync()
                delay = _RETRY_MIN
                for msg in self._client.watch_messages(self.prefix, self._end, self.revision + 1, self.stale_after):
                    if self._stop.is_set() or not self._keep_watching(until):
                        break
                    if msg.get("canceled") or int(msg.get("compact_revision") or 0):
                        break  # compacted past our revision, or cancelled: re-read everything
                    self._apply(msg)
            except (OSError, ValueError, RecoverError, http.client.HTTPException):
                pass  # lost, silent, refused or ended by close(): unhealthy until re-read below
            self._lose()
            self._stop.wait(delay)
            delay = min(delay * 2, _RETRY_MAX)

    def _keep_watching(self, until: float) -> bool:
        """Whether :meth:`_run` watches on (a relay that serves its rack watches past ``until``)."""
        return time.monotonic() < until

    def _confirm(self) -> bool:
        """After a silent or lost stream: True if one linearizable read of the range's newest key shows the
        range as the view holds it; the view is then complete up to that read's revision and watches on from
        there. False (re-read everything) before the first sync or when anything changed."""
        if not self.resyncs:
            return False
        sent = time.monotonic()
        answer = self._client.range(self.prefix, self._end, keys_only=True, limit=1, newest_first=True)
        kvs = answer.get("kvs") or []
        newest = int(kvs[0].get("mod_revision") or 0) if kvs else 0
        with self._cond:
            if not range_unchanged(self._mods, int(answer.get("count") or 0), newest):
                return False
            # the read's answer is the store's state at some moment after it was sent
            self._confirmed(int(answer["header"]["revision"]), int(answer["header"].get("raft_term") or 0), sent)
        return True

    def _sync(self) -> None:
        """Replace the view by one linearizable read of the prefix (never older than what it held)."""
        for _ in range(10):
            answer = self._client.range(self.prefix, self._end, limit=MAX_SYNC_KEYS + 1)
            if answer.get("more"):
                raise OSError(f"more than {MAX_SYNC_KEYS} keys under {self.prefix!r}: not watched")
            revision = int(answer["header"]["revision"])
            if revision >= self.revision:
                break
        else:
            raise OSError(f"etcd answered revision {revision} after the view had applied {self.revision}")
        kvs = [[kv["key"], kv.get("value") or "", int(kv.get("mod_revision") or 0)] for kv in answer.get("kvs") or []]
        self._replace(kvs, revision, int(answer["header"].get("raft_term") or 0), time.monotonic())

    def _apply(self, msg: dict) -> None:
        self._apply_events(msg.get("events") or [], int((msg.get("header") or {}).get("raft_term") or 0))

    # ---------------------------------------------------------------- changes (from etcd, or from a relay)
    def _notify(self, line: bytes) -> None:
        for follower in self._followers:
            follower(line)

    def _lose(self) -> None:
        """Not known to be current any more: no answers until the next snapshot or confirmation."""
        with self._cond:
            self._synced = False
            self._cond.notify_all()
            if self._followers:
                self._notify(change_line("lost"))

    def _confirmed(self, revision: int, term: int, heard: float) -> None:
        """The range is as the view holds it at ``revision`` (known at monotonic time ``heard``); caller holds the lock."""
        self.revision = max(self.revision, revision)
        self.term = max(self.term, term)
        self._synced = True
        self._heard = heard
        self.confirms += 1
        self._cond.notify_all()
        if self._followers:
            self._notify(change_line("current", revision=self.revision, term=self.term, heard=heard))

    def _replace(self, kvs: list, revision: int, term: int, heard: float) -> None:
        """The whole range, as ``[key, value, mod_revision]`` (key and value base64), at ``revision``."""
        received = sum(len(k) + len(v) for k, v, _ in kvs)
        values = {ec.unb64(k): ec.unb64(v) for k, v, _ in kvs}
        mods = {ec.unb64(k): int(m) for k, _, m in kvs}
        now = time.monotonic()
        with self._cond:
            # A value the view already held keeps its arrival time; one first seen in this read arrived now.
            arrived = {k: self._arrived[k] if self._mods.get(k) == m else now for k, m in mods.items()}
            self._values, self._mods, self._arrived = values, mods, arrived
            self.revision = revision
            self.term = max(self.term, term)
            self._synced = True
            self._heard = heard
            self.resyncs += 1
            self.payload_bytes += received
            self._cond.notify_all()
            if self._followers:
                self._notify(change_line("snapshot", kvs=kvs, revision=revision, term=self.term, heard=heard))

    def _apply_events(self, events: list, term: int, heard: Optional[float] = None) -> None:
        """etcd watch events (in revision order) heard at monotonic time ``heard`` (now when None)."""
        now = time.monotonic()
        heard = now if heard is None else heard
        with self._cond:
            for event in events:
                kv = event.get("kv") or {}
                key = ec.unb64(kv.get("key"))
                mod = int(kv.get("mod_revision") or 0)
                if event.get("type", "PUT") == "DELETE":
                    self._values.pop(key, None)
                    self._mods.pop(key, None)
                    self._arrived.pop(key, None)
                else:
                    self._values[key] = ec.unb64(kv.get("value"))
                    self._mods[key] = mod
                    self._arrived[key] = now
                self.revision = max(self.revision, mod)
                self.events += 1
                self.payload_bytes += len(kv.get("key") or "") + len(kv.get("value") or "")
            self.term = max(self.term, term)
            self._heard = heard
            self._cond.notify_all()
            if self._followers:
                self._notify(change_line("events", events=events, revision=self.revision, term=self.term, heard=heard))


def change_line(kind: str, **body: object) -> bytes:
    """One change of a view as its followers receive it: ``{kind: body}`` as a JSON line. Kinds: ``snapshot``
    (``kvs`` as ``[key, value, mod_revision]``, base64), ``events`` (etcd's watch events), ``current`` (the
    range unchanged up to ``revision``), ``lost`` (not current until the next snapshot or ``current``). Each
    but ``lost`` carries ``revision``, ``term`` and ``heard``: the monotonic time its source heard it."""
    return json.dumps({kind: body}, separators=(",", ":")).encode() + b"\n"


def range_unchanged(held_mods: dict[bytes, int], count: int, newest: int) -> bool:
    """Whether a range whose etcd answer is ``count`` keys, the newest modified at revision ``newest``, is
    the range a view holds as ``key -> mod_revision`` (``held_mods``, complete up to the view's revision).

    Any later put sets its key's mod_revision above every held one, so it raises ``newest`` for as long as
    that key exists; a later delete with no put that survives lowers ``count``. A key put and deleted again
    changes neither, and the range's state is then indeed unchanged.
    """
    return count == len(held_mods) and newest == max(held_mods.values(), default=0)
