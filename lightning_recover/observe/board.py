"""The monitor's status board: the job's state as the monitor sees it, as Prometheus metrics and as JSON.

The monitor (``coordinator.run_monitor``) hands the board, on every pass, the heartbeats it just read and
when each last moved, and tells it whom it declared dead and why. The board reads the rest itself, at most
every :data:`READ_PERIOD` seconds and from the store the monitor uses: who is dead (``dead/{r}``) and the
newest generation (``gen/latest``; on etcd from the watched view, no request). What only the replicas know
(the step they committed, their quota, their last recovery and checkpoint) arrives on their heartbeats
(:mod:`~lightning_recover.observe.report`).

A recovery is counted once, under the generation it formed, when the first survivor reports it; its cause
is that of the death it recovered from: ``kill`` (a process exit the launcher saw, or missed heartbeats),
``hang`` (no progress while peers waited), ``partition`` (fenced by the partition judge), ``notice`` (a
replica whose heartbeat said it had its preemption notice, but which ended before the step boundary it was to
leave at: too little grace; a notice followed by death within one heartbeat period is counted as ``kill``). A
replica that left at that boundary is no recovery: the members' reports name it (``left``), and the board
shows a ``leave`` event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lightning_recover.errors import RecoverError
from lightning_recover.observe.events import EventLog
from lightning_recover.protocol.messages import Sealer, read_death, recent_many

log = logging.getLogger(__name__)

#: The causes a recovery is labelled with (every label exists from the start, at 0).
CAUSES = ("kill", "hang", "partition", "notice")
#: Upper bounds (seconds) of the recovery-time histogram's buckets.
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Seconds between the board's reads of deaths and the generation (sooner when a recovery is reported).
READ_PERIOD = 0.1
#: Seconds of commits the throughput is averaged over.
THROUGHPUT_WINDOW = 10.0
#: Events and throughput samples the page shows (the event log keeps every event).
KEPT_EVENTS = 500
KEPT_SAMPLES = 600


class JobMetrics:
    """The job's Prometheus metrics, in a registry of their own (not the process-wide default one)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "lightning_recover_"
        self.replicas = Gauge(p + "replicas", "Replicas the job was started with", registry=r)
        self.live = Gauge(p + "live_replicas", "Replicas that are members of the job and not dead", registry=r)
        self.generation = Gauge(p + "generation", "Newest generation proposed", registry=r)
        self.committed = Gauge(p + "committed_step", "Newest step a live replica committed", registry=r)
        self.throughput = Gauge(
            p + "microbatches_per_second", f"Committed microbatches per second over {THROUGHPUT_WINDOW:g} s", registry=r
        )
        self.recoveries = Counter(p + "recoveries", "Recoveries (survivors regrouped)", ["cause"], registry=r)
        self.recomputed = Counter(
            p + "recomputed_microbatches", "Microbatches recomputed by survivors", ["cause"], registry=r
        )
        self.recovery_seconds = Histogram(
            p + "recovery_seconds", "Failed reduce to committed step", buckets=RECOVERY_BUCKETS, registry=r
        )
        self.heartbeat_age = Gauge(
            p + "heartbeat_age_seconds", "Seconds since a replica's last beat", ["replica"], registry=r
        )
        self.replica_step = Gauge(p + "replica_step", "Last step a replica committed", ["replica"], registry=r)
        self.incarnation = Gauge(p + "replica_incarnation", "A replica's current incarnation", ["replica"], registry=r)
        self.checkpoint_seconds = Gauge(p + "checkpoint_seconds", "Duration of the newest checkpoint save", registry=r)
        self.checkpoint_bytes = Gauge(p + "checkpoint_bytes", "Bytes of the newest checkpoint save", registry=r)
        for cause in CAUSES:
            self.recoveries.labels(cause)
            self.recomputed.labels(cause)


class _Replica:
    """What the board knows of one replica."""

    def __init__(self, replica: int) -> None:
        self.replica = replica
        self.incarnation = 0
        self.dead = 0  # the newest incarnation declared dead
        self.cause: Optional[str] = None  # why the dead incarnation ended
        self.notice = ""  # what told the current incarnation to leave (its heartbeat says), "" if nothing
        self.member = False  # the current incarnation is a member of a generation
        self.host = ""
        self.generation = -1
        self.step = -1  # last committed
        self.quota = 0
        self.phase = ""
        self.beat_at = 0.0  # monotonic time the oldest of its processes last beat

    def state(self) -> str:
        if self.incarnation == 0:
            return "not started"
        if self.dead >= self.incarnation:
            return f"dead ({self.cause})" if self.cause else "left" if self.cause == "" else "exited"
        return "live" if self.member else "joining"


class StatusBoard:
    """Thread-safe: the monitor's thread updates it; the status server's threads read it."""

    def __init__(
        self, replicas: int, replica_size: int = 1, control_plane: str = "embedded", events: Optional[EventLog] = None
    ) -> None:
        self.replicas, self.replica_size, self.control_plane = replicas, replica_size, control_plane
        self.metrics = JobMetrics()
        self.metrics.replicas.set(replicas)
        self.events_log = events or EventLog(None)
        self._lock = threading.Lock()
        self._rows = {r: _Replica(r) for r in range(replicas)}
        self._declared: dict[tuple[int, int], tuple[str, str]] = {}  # (replica, incarnation) -> (cause, why)
        self._pending: list[tuple[int, int, str]] = []  # (replica, incarnation, cause) of deaths not yet recovered from
        self._left: set[tuple[int, int]] = set()  # (replica, incarnation) that left at a step boundary
        self._recovered: set[int] = set()  # generations whose recovery was counted
        self._recomputed: set[tuple[int, int]] = set()  # (generation, replica) whose recomputed count was added
        self._checkpoint_step = -1
        self._counts = {"recoveries": dict.fromkeys(CAUSES, 0), "recomputed_microbatches": dict.fromkeys(CAUSES, 0)}
        self.generation = 0
        self.committed = -1
        self.microbatches = 0
        self._commits: deque[tuple[float, int]] = deque()  # (monotonic, committed step)
        self._samples: deque[tuple[float, float]] = deque(maxlen=KEPT_SAMPLES)  # (wall time, microbatches/s)
        self._sampled_at = 0.0
        self._events: deque[dict] = deque(maxlen=KEPT_EVENTS)
        self._read_at = float("-inf")  # the first pass reads
        self._opened: dict[str, dict] = {}  # heartbeat key -> the heartbeat last reported (the monitor's own object)
        self.started = time.time()
        self._event("monitor", what=f"monitor started ({control_plane})")

    # ------------------------------------------------------------------ fed by the monitor
    def declared(self, replica: int, incarnation: Optional[int], cause: str, why: str = "") -> None:
        """The monitor declared ``replica`` (``incarnation``; None: its current one) dead for ``cause``."""
        with self._lock:
            inc = incarnation if incarnation is not None else self._rows[replica].incarnation
            self._declared[(replica, inc)] = (cause, why)

    def poll(
        self,
        now: float,
        store: Any,
        sealer: Sealer,
        heartbeats: Mapping[str, tuple[int, dict]],
        beats: Mapping[str, tuple[int, int, float]],
    ) -> None:
        """One pass of the monitor: ``heartbeats`` {key: (replica, heartbeat)}, ``beats`` {key: (incarnation,
        beat, monotonic time it last moved)}. Reads deaths and the generation from ``store`` when due."""
        new_recovery = any(self._is_new_recovery(hb) for _, hb in heartbeats.values())
        raws = self._read(store, now) if new_recovery or now - self._read_at >= READ_PERIOD else None
        if raws is not None:
            deaths = {r: read_death(sealer, r, raw) for r, raw in zip(range(self.replicas), raws)}
            try:
                latest = int(sealer.open("gen/latest", raws[-1]))
            except (RecoverError, ValueError):  # a forged or torn value tells nothing
                latest = self.generation
            with self._lock:
                self.generation = max(self.generation, latest)
                self._deaths(deaths)
        with self._lock:
            self._heartbeats(now, heartbeats, beats)
            self._sample(now)

    def _read(self, store: Any, now: float) -> Optional[list[bytes]]:
        """``dead/*`` and ``gen/latest``: from the watched view only where the backend has one (the monitor's
        own reads are the ones that must reach etcd; None while the view cannot answer), else one request. A
        failed read is None too: the status page must never stop the monitor."""
        self._read_at = now
        keys = [f"dead/{r}" for r in range(self.replicas)] + ["gen/latest"]
        try:
            return store.cached_many(keys) if store.views else recent_many(store, keys)
        except Exception as exc:  # the monitor's next read of the same store names the failure, not this one
            log.debug("status board: reading deaths failed (%s)", exc)
            return None

    def _is_new_recovery(self, hb: dict) -> bool:
        rec = hb.get("rec")
        return isinstance(rec, list) and len(rec) == 5 and rec[0] not in self._recovered

    def _deaths(self, deaths: Mapping[int, int]) -> None:
        for r, inc in deaths.items():
            row = self._rows[r]
            if inc <= row.dead:
                continue
            was_member = row.member and row.incarnation == inc
            row.dead = inc
            row.incarnation = max(row.incarnation, inc)  # its heartbeat may be gone (a board started later)
            cause, why = self._declared.pop((r, inc), (None, ""))
            if (r, inc) in self._left:  # the members already named it as left at a step boundary
                row.cause = ""
                continue
            if cause is None:  # not the monitor's verdict: the launcher saw it exit, or it left cleanly
                row.cause = None
                on_notice = f" after its notice ({row.notice})" if row.notice and row.incarnation == inc else ""
                self._event(
                    "exit", replica=r, incarnation=inc, what=f"replica {r} (incarnation {inc}) exited{on_notice}"
                )
                cause = "kill"
            else:
                row.cause = cause
                self._event("death", replica=r, incarnation=inc, cause=cause, what=f"replica {r} declared dead: {why}")
            if row.notice and row.incarnation == inc:
                cause = "notice"  # it had its notice: a recovery from its end is the notice's (too little grace)
            if was_member:
                self._pending.append((r, inc, cause))

    def _leavers(self, generation: int, leavers: Any) -> None:
        """The members' report of the step boundary that formed ``generation`` without ``leavers``."""
        for r in leavers if isinstance(leavers, list) else []:
            row = self._rows.get(int(r))
            if row is None or (row.replica, row.incarnation) in self._left:
                continue
            self._left.add((row.replica, row.incarnation))
            self._pending = [p for p in self._pending if p[:2] != (row.replica, row.incarnation)]
            if row.dead >= row.incarnation:
                row.cause = ""  # its exit was read first
            how = f" ({row.notice})" if row.notice else ""
            self._event(
                "leave",
                replica=row.replica,
                incarnation=row.incarnation,
                what=f"replica {row.replica} left on notice{how} before generation {generation}",
            )

    def _heartbeats(
        self, now: float, heartbeats: Mapping[str, tuple[int, dict]], beats: Mapping[str, tuple[int, int, float]]
    ) -> None:
        oldest: dict[int, float] = {}
        reported_left = []  # read after every report of the pass: a leaver's own heartbeat may come later in it
        for key, (r, hb) in heartbeats.items():
            moved = beats.get(key)
            if moved is not None:
                oldest[r] = min(oldest.get(r, moved[2]), moved[2])
            if self._opened.get(key) is hb or (self.replica_size > 1 and not key.endswith("/i0")):
                continue  # the same heartbeat as the last pass (the monitor opens each once); or not the first process's
            self._opened[key] = hb
            self._report(r, int(hb.get("inc", 0)), hb)
            left = hb.get("left")
            if isinstance(left, list) and len(left) == 2:
                reported_left.append(left)
        for generation, leavers in reported_left:
            self._leavers(int(generation), leavers)
        for r, at in oldest.items():
            self._rows[r].beat_at = at

    def _report(self, r: int, inc: int, hb: dict) -> None:
        row = self._rows[r]
        if inc > row.incarnation:
            row.incarnation, row.member, row.step, row.quota = inc, False, -1, 0
            self._event("start", replica=r, incarnation=inc, what=f"replica {r} started (incarnation {inc})")
        row.phase = str(hb.get("phase", ""))
        if inc < row.incarnation or row.dead >= inc:
            return
        row.notice = str(hb.get("notice", ""))
        if hb.get("member") and not row.member:
            row.member = True
            if inc > 1:
                self._event("join", replica=r, incarnation=inc, what=f"replica {r} rejoined (incarnation {inc})")
        row.host = str(hb.get("host", row.host))
        row.generation = int(hb.get("gen", row.generation))
        self.generation = max(self.generation, row.generation)
        self.microbatches = int(hb.get("m", self.microbatches))
        if "done" in hb:
            row.step, row.quota = int(hb["done"]), int(hb.get("quota", 0))
            if row.step > self.committed:
                self.committed = row.step
        rec = hb.get("rec")
        if isinstance(rec, list) and len(rec) == 5:
            self._recovery(r, *rec)
        ckpt = hb.get("ckpt")
        if isinstance(ckpt, list) and len(ckpt) == 3 and int(ckpt[0]) > self._checkpoint_step:
            self._checkpoint_step = int(ckpt[0])
            self.metrics.checkpoint_seconds.set(float(ckpt[1]))
            self.metrics.checkpoint_bytes.set(float(ckpt[2]))
            self._event(
                "checkpoint",
                step=int(ckpt[0]),
                seconds=float(ckpt[1]),
                bytes=int(ckpt[2]),
                what=f"checkpoint of step {ckpt[0]}: {int(ckpt[2])} bytes in {float(ckpt[1]):.2f}s",
            )

    def _recovery(self, r: int, generation: int, step: int, count: int, seconds: float, recomputed: int) -> None:
        cause = self._pending[0][2] if self._pending else "kill"
        if generation not in self._recovered:
            self._recovered.add(generation)
            causes = [self._pending.pop(0)[2] if self._pending else cause for _ in range(max(1, int(count)))]
            for c in causes:
                c = c if c in CAUSES else "kill"
                self.metrics.recoveries.labels(c).inc()
                self._counts["recoveries"][c] += 1
            self.metrics.recovery_seconds.observe(float(seconds))
            cause = causes[-1]
            self._event(
                "recovery",
                step=step,
                seconds=float(seconds),
                cause=",".join(causes),
                what=f"step {step} recovered in generation {generation} in {float(seconds):.3f}s ({', '.join(causes)})",
            )
        if (generation, r) not in self._recomputed:
            self._recomputed.add((generation, r))
            cause = cause if cause in CAUSES else "kill"
            self.metrics.recomputed.labels(cause).inc(int(recomputed))
            self._counts["recomputed_microbatches"][cause] += int(recomputed)

    def _sample(self, now: float) -> None:
        if not self._commits or self._commits[-1][1] != self.committed:
            self._commits.append((now, self.committed))
        while len(self._commits) > 2 and now - self._commits[1][0] > THROUGHPUT_WINDOW:
            self._commits.popleft()
        if now - self._sampled_at >= 1.0:
            self._sampled_at = now
            self._samples.append((time.time(), self._throughput(now)))

    def _throughput(self, now: float) -> float:
        if len(self._commits) < 2:
            return 0.0
        (t0, s0), (_, s1) = self._commits[0], self._commits[-1]
        return max(0.0, (s1 - s0) * self.microbatches / max(now - t0, 1e-9))

    def _event(self, kind: str, **fields: Any) -> None:
        event = {"time": round(time.time(), 3), "generation": self.generation, "kind": kind, **fields}
        self._events.append(event)
        self.events_log.write(event)
        log.debug("%s", fields.get("what", kind))

    # ------------------------------------------------------------------ read by the server
    def _live(self) -> int:
        return sum(1 for row in self._rows.values() if row.state() == "live")

    def render_metrics(self) -> bytes:
        """Prometheus' text format of the job's metrics as of now."""
        now = time.monotonic()
        with self._lock:
            m = self.metrics
            m.live.set(self._live())
            m.generation.set(self.generation)
            m.committed.set(self.committed)
            m.throughput.set(self._throughput(now))
            for r, row in self._rows.items():
                label = str(r)
                m.heartbeat_age.labels(label).set(round(now - row.beat_at, 3) if row.beat_at else float("nan"))
                m.replica_step.labels(label).set(row.step)
                m.incarnation.labels(label).set(row.incarnation)
        return generate_latest(m.registry)

    def snapshot(self) -> dict[str, Any]:
        """The job's state as JSON-ready data (what ``/status`` serves and the page shows)."""
        now = time.monotonic()
        with self._lock:
            rows = [
                {
                    "replica": r,
                    "host": row.host,
                    "incarnation": row.incarnation,
                    "state": row.state(),
                    "generation": row.generation,
                    "step": row.step,
                    "quota": row.quota,
                    "phase": row.phase,
                    "heartbeat_age": round(now - row.beat_at, 3) if row.beat_at else None,
                }
                for r, row in sorted(self._rows.items())
            ]
            return {
                "time": time.time(),
                "started": self.started,
                "control_plane": self.control_plane,
                "replicas": self.replicas,
                "replica_size": self.replica_size,
                "live_replicas": self._live(),
                "generation": self.generation,
                "committed_step": self.committed,
                "microbatches": self.microbatches,
                "microbatches_per_second": round(self._throughput(now), 3),
                "recoveries": dict(self._counts["recoveries"]),
                "recomputed_microbatches": dict(self._counts["recomputed_microbatches"]),
                "table": rows,
                "events": list(self._events),
                "throughput": [[round(t, 3), round(v, 3)] for t, v in self._samples],
            }
