"""Generations of live replicas, and the decisions every member reads identically.

A *generation* G is a numbered set of live replicas with its own gloo process group (built
over ``PrefixStore(f"pg/g{G}", store)``, so two generations never share a key). A generation
ends when one of its members dies, hangs or leaves; its survivors then form G+1:

1. A survivor that sees the failure first settles the open step's decision for G as ``retry``
   (``compare_set``: if the step had already been decided ``commit``, that answer stands and
   everybody applies it) and proposes G+1 (``compare_set("gen/latest", G, G+1)``).
2. Every member of G that is still alive joins round G+1, publishing what it holds of the open
   step (which microbatch ids its local gradient sum covers).
3. Once every member of G is either joined or declared dead, the first joiner to notice writes the
   member list of G+1 with ``compare_set``; every joiner reads that same list.
4. A replica missing from the list it reads was excluded (it was suspected dead): it must never
   apply another step, and raises :class:`ReplicaExcludedError`.

Failures are seen in three ways: a collective raises (a killed peer closes its sockets), the
coordinator declares a member dead (heartbeat stale: a hung peer; or the launcher saw the process
exit), or another member already proposed the next generation. All waits are sliced so that each
of these is noticed within a few milliseconds, never after a long collective timeout.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_recover.errors import CoordinatorLostError, MembershipChanged, ReplicaExcludedError
from lightning_recover.protocol.messages import ControlStore

POLL_MIN = 0.0005
POLL_MAX = 0.005
SLICE = 0.01  # longest a blocked wait goes without looking for failures


def backoff(delay: float) -> float:
    """Sleep ``delay`` and return the next, doubled up to ``POLL_MAX``."""
    time.sleep(delay)
    return min(delay * 2, POLL_MAX)


def _quiet(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        pass


class Heartbeat:
    """Bumps ``hb/{replica}`` every ``interval`` seconds on its own store connection."""

    def __init__(self, store: ControlStore, replica: int, interval: float, key: str | None = None) -> None:
        self._store = store.clone()
        self._key = key or f"hb/{replica}"
        self._interval = interval
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"lr-heartbeat-{replica}", daemon=True)

    def start(self) -> None:
        self._store.add(self._key, 1)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(self._key, 1)
            except Exception as exc:
                self.error = exc
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class Generation:
    number: int
    members: list[int]  # sorted replica ids
    incarnations: dict[int, int]  # replica -> incarnation that joined
    payloads: dict[int, dict]  # replica -> what it published when joining
    pg: Any = None  # gloo (or NCCL) process group among members (None until built)
    rank: int = 0

    @property
    def size(self) -> int:
        return len(self.members)


class Membership:
    """One replica's view of the group: generations, joins, heartbeats, failure detection."""

    def __init__(
        self,
        coordinator_addr: str,
        replica: int,
        num_replicas: int,
        *,
        heartbeat_interval: float = 0.1,
        join_timeout: float = 60.0,
        collective_timeout: float = 60.0,
        startup_timeout: float = 300.0,
        backend: str = "gloo",
        inner: int = 0,
        replica_size: int = 1,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise RuntimeError("backend='nccl' needs a CUDA build of torch with NCCL. HINT: use accelerator='cpu' (gloo).")
        self.backend = backend
        # A sharded replica is K processes; each runs this membership under the same replica id.
        # Position `inner` of every member forms its own cross-replica group (see _build_pg).
        self.inner = inner
        self.replica_size = replica_size
        self.addr = coordinator_addr
        self.replica = replica
        self.num_replicas = num_replicas
        self.heartbeat_interval = heartbeat_interval
        self.join_timeout = join_timeout
        self.collective_timeout = collective_timeout
        self.startup_timeout = startup_timeout
        self.store: ControlStore | None = None
        self.incarnation = 0
        self.gen: Generation | None = None
        self._heartbeat: Heartbeat | None = None
        self._events_seen = -1
        self._graveyard: list = []  # abandoned process groups/works; dropped off the hot path
        self.events: list[dict] = []  # membership changes, for logging by the strategy

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        self.store = ControlStore(self.addr, self.replica)
        if self.replica_size == 1:
            self.incarnation = self.store.add(f"inc/{self.replica}", 1)
            key = None
        else:
            self.incarnation = self._sharded_incarnation()
            key = f"hb/{self.replica}/i{self.inner}"  # per process: a hung process stops only its own
        self._heartbeat = Heartbeat(self.store, self.replica, self.heartbeat_interval, key=key)
        self._heartbeat.start()

    def _sharded_incarnation(self) -> int:
        """All K processes of a replica (re)start together: position 0 bumps the replica's counter,
        the others wait until it reaches their own position's count."""
        mine = self.store.add(f"inc/{self.replica}/i{self.inner}", 1)
        if self.inner == 0:
            return self.store.add(f"inc/{self.replica}", 1)
        deadline = time.monotonic() + self.startup_timeout
        delay = POLL_MIN
        while int(self.store.get(f"inc/{self.replica}")) < mine:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.replica}: process 0 did not start within {self.startup_timeout}s")
            delay = backoff(delay)
        return mine

    def _joined(self, prefix: str) -> set[int]:
        """Replicas that joined round ``prefix``: with K processes, only once all K of them did."""
        items = [x for x in self.store.get(f"{prefix}/joined").split(",") if x]
        if self.replica_size == 1:
            return {int(x) for x in items}
        positions: dict[int, set[str]] = {}
        for x in items:
            r, _, i = x.partition(".")
            positions.setdefault(int(r), set()).add(i)
        return {r for r, got in positions.items() if len(got) >= self.replica_size}

    def form_initial(self) -> Generation | None:
        """Join generation 0 with every other replica (the job's start).

        Returns None when the group has already formed: this process is a restarted replica and
        must come in through :meth:`rejoin` (at a step boundary, with state from a peer).
        """
        latest = int(self.store.get("gen/latest"))
        if latest != 0 or self.store.has("g0/members"):
            self.request_join()
            return None
        starting = self.current_incarnations(range(self.num_replicas))
        self.gen = self._join_round(0, {"step": -1, "have": []}, expected=starting, timeout=self.startup_timeout)
        return self.gen

    # ------------------------------------------------------------------ rejoin
    def request_join(self) -> None:
        """Ask the group to admit this (restarted) replica at its next commit."""
        if self.incarnation > 1:
            # Our previous incarnation is certainly dead: say so now rather than after heartbeats.
            self.store.mark_dead(self.replica, self.incarnation - 1)
        self.store.append("join/requests", f"{self.replica}:{self.incarnation},")

    def pending_joins(self) -> dict[int, int]:
        """Join requests not yet admitted and still alive: ``{replica: incarnation}``."""
        if not self.store.has("join/requests"):
            return {}
        latest: dict[int, int] = {}
        for item in self.store.get("join/requests").split(","):
            if item:
                r, inc = (int(x) for x in item.split(":"))
                latest[r] = max(inc, latest.get(r, 0))
        wanted = {r: inc for r, inc in latest.items() if self.gen.incarnations.get(r) != inc}
        dead = self.dead(sorted(wanted), wanted)
        return {r: inc for r, inc in wanted.items() if r not in dead}

    def wait_for_invitation(self) -> Generation:
        """A joiner waits until members invite it into a generation, then joins that round."""
        delay = POLL_MIN
        key = None
        while True:
            self.check_health()
            latest = int(self.store.get("gen/latest"))
            key = f"g{latest}/invite/{self.replica}"
            if self.store.has(key) and int(self.store.get(key)) == self.incarnation:
                break
            if self._job_over():
                print(f"[lightning-recover] replica {self.replica}: the job ended before it could rejoin", flush=True)
                raise SystemExit(0)
            delay = backoff(delay)
        self.gen = self._join_round(latest, {"step": None, "have": [], "joiner": True}, expected={},
                                    timeout=self.join_timeout, may_close=False)
        return self.gen

    def _job_over(self) -> bool:
        others = [r for r in range(self.num_replicas) if r != self.replica]
        return not others or len(self.dead(others, self.current_incarnations(others))) == len(others)

    def close(self) -> None:
        """Leave the group cleanly: mark this incarnation as gone so nobody waits for it."""
        if self.store is not None and self.incarnation:
            try:
                self.store.mark_dead(self.replica, self.incarnation)
            except Exception:
                pass  # the coordinator is already gone: nothing to tell
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    # ------------------------------------------------------------------ views
    @property
    def members(self) -> list[int]:
        return self.gen.members

    @property
    def rank(self) -> int:
        return self.gen.rank

    @property
    def size(self) -> int:
        return self.gen.size

    # ------------------------------------------------------------------ failure detection
    def check_health(self) -> None:
        """Raise if the coordinator is gone or this replica was declared dead."""
        if self._heartbeat is not None and self._heartbeat.error is not None:
            raise CoordinatorLostError(
                f"replica {self.replica} lost the coordinator at {self.addr} "
                f"(heartbeat failed: {self._heartbeat.error}). HINT: restart the job from its last checkpoint."
            )

    def dead(self, replicas: Sequence[int], incarnations: dict[int, int]) -> set[int]:
        if not replicas:
            return set()
        values = self.store.multi_get([f"dead/{r}" for r in replicas])
        # Incarnation 0 = not started yet (only during the first formation): not dead.
        return {r for r, v in zip(replicas, values) if 0 < incarnations.get(r, 1 << 30) <= int(v)}

    def current_incarnations(self, replicas: Sequence[int]) -> dict[int, int]:
        values = self.store.multi_get([f"inc/{r}" for r in replicas])
        return {r: int(v) for r, v in zip(replicas, values)}

    def failure_seen(self) -> bool:
        """Cheap test (one store round trip when nothing changed): did the generation fail?"""
        self.check_health()
        events = self.store.add("events", 0)
        if events == self._events_seen:
            return False
        if int(self.store.get("gen/latest")) > self.gen.number:
            return True
        dead = self.dead(self.gen.members, self.gen.incarnations)
        if self.replica in dead:
            raise ReplicaExcludedError(
                f"replica {self.replica} was declared dead by the group (missed heartbeats or stalled) and "
                "must not apply further steps; it stops here. HINT: raise heartbeat_timeout if this replica "
                "was only slow."
            )
        if dead:
            return True
        self._events_seen = events
        return False

    # ------------------------------------------------------------------ generations
    def next_generation(self, payload: dict, invite: dict[int, int] | None = None) -> Generation:
        """Leave the current generation and form the next one.

        Its members are the survivors of the current one plus the ``invite``d joiners
        (``{replica: incarnation}``, as admitted by a commit decision) that are alive.
        """
        g = self.gen.number
        self._abandon(self.gen)
        latest = int(self.store.compare_set("gen/latest", str(g), str(g + 1)))
        if latest == g + 1:
            self.store.add("events", 1)
        elif latest > g + 1:
            raise ReplicaExcludedError(
                f"replica {self.replica} fell behind: the group is at generation {latest} and this replica "
                f"left generation {g}; it stops here so that it never applies a divergent step."
            )
        for r, inc in (invite or {}).items():
            self.store.set(f"g{g + 1}/invite/{r}", str(inc))
        dead = self.dead(self.gen.members, self.gen.incarnations)
        expected = {r: inc for r, inc in self.gen.incarnations.items() if r not in dead}
        expected.update(invite or {})
        self.gen = self._join_round(g + 1, payload, expected=expected, timeout=self.join_timeout)
        return self.gen

    def _join_round(self, number: int, payload: dict, expected: dict[int, int], timeout: float,
                    may_close: bool = True) -> Generation:
        """Join round ``number``; ``expected`` maps the replicas to wait for to their incarnation."""
        prefix = f"g{number}"
        payload = dict(payload, inc=self.incarnation)
        self.store.set(f"{prefix}/join/{self.replica}", json.dumps(payload))
        me = str(self.replica) if self.replica_size == 1 else f"{self.replica}.{self.inner}"
        self.store.append(f"{prefix}/joined", f"{me},")
        deadline = time.monotonic() + timeout
        delay = POLL_MIN
        while not self.store.has(f"{prefix}/members"):
            self.check_health()
            if not may_close:
                delay = backoff(delay)
                continue
            joined = self._joined(prefix)
            dead = self.dead(sorted(set(expected) | joined), expected)
            if set(expected) - joined - dead and time.monotonic() < deadline:
                delay = backoff(delay)
                continue
            members = sorted(joined - dead)
            self.store.compare_set(f"{prefix}/members", "", json.dumps(members))
        members = json.loads(self.store.get(f"{prefix}/members"))
        if self.replica not in members:
            raise ReplicaExcludedError(
                f"replica {self.replica} was left out of generation {number} (the others suspected it dead); "
                "it stops here so that it never applies a divergent step."
            )
        raw = self.store.multi_get([f"{prefix}/join/{r}" for r in members])
        payloads = {r: json.loads(v) for r, v in zip(members, raw)}
        gen = Generation(number, members, {r: p["inc"] for r, p in payloads.items()}, payloads,
                         rank=members.index(self.replica))
        self._build_pg(gen)
        self._events_seen = -1
        self.events.append({"generation": number, "members": members})
        return gen

    def _build_pg(self, gen: Generation) -> None:
        """Build the gloo group of ``gen`` on a thread, so a member dying meanwhile is noticed."""
        result: dict[str, Any] = {}

        def build() -> None:
            try:
                suffix = "" if self.replica_size == 1 else f"/i{self.inner}"  # one group per inner position
                store = self.store.prefixed(f"pg/g{gen.number}{suffix}")
                result["pg"] = self._new_process_group(store, gen.rank, gen.size)
            except BaseException as exc:  # reported to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=build, name=f"lr-build-g{gen.number}", daemon=True)
        thread.start()
        self.gen = gen
        delay = POLL_MIN
        while thread.is_alive():
            if self.failure_seen():
                self._graveyard.append(thread)
                raise MembershipChanged(f"a member of generation {gen.number} failed while it was being built")
            thread.join(delay)
            delay = min(delay * 2, POLL_MAX)
        if "error" in result:
            raise MembershipChanged(f"building generation {gen.number} failed: {result['error']}")
        gen.pg = result["pg"]

    @property
    def abandoned_work(self) -> bool:
        """True once a group with an operation possibly still in flight was abandoned."""
        return bool(self._graveyard)

    def _new_process_group(self, store: dist.Store, rank: int, size: int) -> Any:
        timeout = datetime.timedelta(seconds=self.collective_timeout)
        if self.backend == "nccl":
            # Non-blocking communicators, so that abort() can end an operation stuck on a dead peer.
            opts = dist.ProcessGroupNCCL.Options()
            opts.config.blocking = 0
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def _abandon(self, gen: Generation) -> None:
        if gen.pg is None:
            return
        if self.backend == "nccl":
            # NCCL can abort its communicators: do it off the hot path, then drop the group.
            pg = gen.pg
            threading.Thread(target=lambda: _quiet(pg.abort), name="lr-nccl-abort", daemon=True).start()
        else:
            # gloo cannot abort an op in flight and destroying its group blocks until the op's
            # timeout: keep the objects referenced and let them die with the process.
            self._graveyard.append(gen.pg)
        gen.pg = None

