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
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_recover import coordinator
from lightning_recover.errors import CoordinatorLostError, MembershipChanged, ReplicaExcludedError

_POLL_MIN = 0.0005
_POLL_MAX = 0.005
_SLICE = 0.01  # longest a blocked wait goes without looking for failures


def _quiet(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        pass


class Heartbeat:
    """Bumps ``hb/{replica}`` every ``interval`` seconds on its own store connection."""

    def __init__(self, store: dist.TCPStore, replica: int, interval: float) -> None:
        self._store = store.clone()
        self._key = f"hb/{replica}"
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
    graveyard: list = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.members)


class ReplicaGroup:
    """One replica's view of the group: membership, heartbeats, process groups, decisions."""

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
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not dist.is_nccl_available():
            raise RuntimeError("backend='nccl' needs a CUDA build of torch with NCCL. HINT: use accelerator='cpu' (gloo).")
        self.backend = backend
        self.addr = coordinator_addr
        self.replica = replica
        self.num_replicas = num_replicas
        self.heartbeat_interval = heartbeat_interval
        self.join_timeout = join_timeout
        self.collective_timeout = collective_timeout
        self.startup_timeout = startup_timeout
        self.store: dist.TCPStore | None = None
        self.incarnation = 0
        self.gen: Generation | None = None
        self._heartbeat: Heartbeat | None = None
        self._events_seen = -1
        self._seq = 0  # sequence number of store collectives in this generation (same on every member: SPMD order)
        self._graveyard: list = []  # abandoned process groups/works; dropped off the hot path
        self.events: list[dict] = []  # membership changes, for logging by the strategy
        self.admit_next: dict[int, int] = {}  # joiners the last commit admitted (replica -> incarnation)

    # ------------------------------------------------------------------ lifecycle
    def connect(self) -> None:
        self.store = coordinator.connect(self.addr)
        self.incarnation = self._call(self.store.add, f"inc/{self.replica}", 1)
        self._heartbeat = Heartbeat(self.store, self.replica, self.heartbeat_interval)
        self._heartbeat.start()

    def form_initial(self) -> Generation | None:
        """Join generation 0 with every other replica (the job's start).

        Returns None when the group has already formed: this process is a restarted replica and
        must come in through :meth:`rejoin` (at a step boundary, with state from a peer).
        """
        latest = int(self._call(self.store.get, "gen/latest"))
        if latest != 0 or self._call(self.store.check, ["g0/members"]):
            self.request_join()
            return None
        starting = self._current_incarnations(range(self.num_replicas))
        self.gen = self._join_round(0, {"step": -1, "have": []}, expected=starting, timeout=self.startup_timeout)
        return self.gen

    # ------------------------------------------------------------------ rejoin
    def request_join(self) -> None:
        """Ask the group to admit this (restarted) replica at its next commit."""
        if self.incarnation > 1:
            # Our previous incarnation is certainly dead: say so now rather than after heartbeats.
            coordinator.mark_dead(self.store, self.replica, self.incarnation - 1)
        self._call(self.store.append, "join/requests", f"{self.replica}:{self.incarnation},")

    def pending_joins(self) -> dict[int, int]:
        """Join requests not yet admitted and still alive: ``{replica: incarnation}``."""
        if not self._call(self.store.check, ["join/requests"]):
            return {}
        latest: dict[int, int] = {}
        for item in self._call(self.store.get, "join/requests").decode().split(","):
            if item:
                r, inc = (int(x) for x in item.split(":"))
                latest[r] = max(inc, latest.get(r, 0))
        wanted = {r: inc for r, inc in latest.items() if self.gen.incarnations.get(r) != inc}
        dead = self._dead(sorted(wanted), wanted)
        return {r: inc for r, inc in wanted.items() if r not in dead}

    def wait_for_invitation(self) -> Generation:
        """A joiner waits until members invite it into a generation, then joins that round."""
        delay = _POLL_MIN
        key = None
        while True:
            self.check_health()
            latest = int(self._call(self.store.get, "gen/latest"))
            key = f"g{latest}/invite/{self.replica}"
            if self._call(self.store.check, [key]) and int(self._call(self.store.get, key)) == self.incarnation:
                break
            if self._job_over():
                print(f"[lightning-recover] replica {self.replica}: the job ended before it could rejoin", flush=True)
                raise SystemExit(0)
            delay = self._sleep(delay)
        self.gen = self._join_round(latest, {"step": None, "have": [], "joiner": True}, expected={},
                                    timeout=self.join_timeout, may_close=False)
        return self.gen

    def _job_over(self) -> bool:
        others = [r for r in range(self.num_replicas) if r != self.replica]
        return not others or len(self._dead(others, self._current_incarnations(others))) == len(others)

    def close(self) -> None:
        """Leave the group cleanly: mark this incarnation as gone so nobody waits for it."""
        if self.store is not None and self.incarnation:
            try:
                coordinator.mark_dead(self.store, self.replica, self.incarnation)
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

    # ------------------------------------------------------------------ store access
    def _call(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except (ReplicaExcludedError, MembershipChanged):
            raise
        except Exception as exc:
            raise CoordinatorLostError(
                f"replica {self.replica} lost the coordinator at {self.addr} ({type(exc).__name__}: {exc}). "
                "No further step can be agreed safely; this replica stops. "
                "HINT: restart the job from its last checkpoint."
            ) from exc

    def check_health(self) -> None:
        """Raise if the coordinator is gone or this replica was declared dead."""
        if self._heartbeat is not None and self._heartbeat.error is not None:
            raise CoordinatorLostError(
                f"replica {self.replica} lost the coordinator at {self.addr} "
                f"(heartbeat failed: {self._heartbeat.error}). HINT: restart the job from its last checkpoint."
            )

    def _dead(self, replicas: Sequence[int], incarnations: dict[int, int]) -> set[int]:
        if not replicas:
            return set()
        values = self._call(self.store.multi_get, [f"dead/{r}" for r in replicas])
        # Incarnation 0 = not started yet (only during the first formation): not dead.
        return {r for r, v in zip(replicas, values) if 0 < incarnations.get(r, 1 << 30) <= int(v)}

    def _current_incarnations(self, replicas: Sequence[int]) -> dict[int, int]:
        values = self._call(self.store.multi_get, [f"inc/{r}" for r in replicas])
        return {r: int(v) for r, v in zip(replicas, values)}

    def failure_seen(self) -> bool:
        """Cheap test (one store round trip when nothing changed): did the generation fail?"""
        self.check_health()
        events = int(self._call(self.store.add, "events", 0))
        if events == self._events_seen:
            return False
        if int(self._call(self.store.get, "gen/latest")) > self.gen.number:
            return True
        dead = self._dead(self.gen.members, self.gen.incarnations)
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

    def _sleep(self, delay: float) -> float:
        time.sleep(delay)
        return min(delay * 2, _POLL_MAX)

    # ------------------------------------------------------------------ generations
    def next_generation(self, payload: dict, invite: dict[int, int] | None = None) -> Generation:
        """Leave the current generation and form the next one.

        Its members are the survivors of the current one plus the ``invite``d joiners
        (``{replica: incarnation}``, as admitted by a commit decision) that are alive.
        """
        g = self.gen.number
        self._abandon(self.gen)
        latest = int(self._call(self.store.compare_set, "gen/latest", str(g), str(g + 1)))
        if latest == g + 1:
            self._call(self.store.add, "events", 1)
        elif latest > g + 1:
            raise ReplicaExcludedError(
                f"replica {self.replica} fell behind: the group is at generation {latest} and this replica "
                f"left generation {g}; it stops here so that it never applies a divergent step."
            )
        for r, inc in (invite or {}).items():
            self._call(self.store.set, f"g{g + 1}/invite/{r}", str(inc))
        dead = self._dead(self.gen.members, self.gen.incarnations)
        expected = {r: inc for r, inc in self.gen.incarnations.items() if r not in dead}
        expected.update(invite or {})
        self.gen = self._join_round(g + 1, payload, expected=expected, timeout=self.join_timeout)
        return self.gen

    def _join_round(self, number: int, payload: dict, expected: dict[int, int], timeout: float,
                    may_close: bool = True) -> Generation:
        """Join round ``number``; ``expected`` maps the replicas to wait for to their incarnation."""
        prefix = f"g{number}"
        payload = dict(payload, inc=self.incarnation)
        self._call(self.store.set, f"{prefix}/join/{self.replica}", json.dumps(payload))
        self._call(self.store.append, f"{prefix}/joined", f"{self.replica},")
        deadline = time.monotonic() + timeout
        delay = _POLL_MIN
        while not self._call(self.store.check, [f"{prefix}/members"]):
            self.check_health()
            if not may_close:
                delay = self._sleep(delay)
                continue
            joined = {int(x) for x in self._call(self.store.get, f"{prefix}/joined").decode().split(",") if x}
            dead = self._dead(sorted(set(expected) | joined), expected)
            if set(expected) - joined - dead and time.monotonic() < deadline:
                delay = self._sleep(delay)
                continue
            members = sorted(joined - dead)
            self._call(self.store.compare_set, f"{prefix}/members", "", json.dumps(members))
        members = json.loads(self._call(self.store.get, f"{prefix}/members"))
        if self.replica not in members:
            raise ReplicaExcludedError(
                f"replica {self.replica} was left out of generation {number} (the others suspected it dead); "
                "it stops here so that it never applies a divergent step."
            )
        raw = self._call(self.store.multi_get, [f"{prefix}/join/{r}" for r in members])
        payloads = {r: json.loads(v) for r, v in zip(members, raw)}
        gen = Generation(number, members, {r: p["inc"] for r, p in payloads.items()}, payloads,
                         rank=members.index(self.replica))
        self._build_pg(gen)
        self._events_seen = -1
        self._seq = 0  # store collectives are numbered per generation: a rejoined replica starts in step
        self.events.append({"generation": number, "members": members})
        return gen

    def _build_pg(self, gen: Generation) -> None:
        """Build the gloo group of ``gen`` on a thread, so a member dying meanwhile is noticed."""
        result: dict[str, Any] = {}

        def build() -> None:
            try:
                store = dist.PrefixStore(f"pg/g{gen.number}", self.store.clone())
                result["pg"] = self._new_process_group(store, gen.rank, gen.size)
            except BaseException as exc:  # reported to the waiting thread
                result["error"] = exc

        thread = threading.Thread(target=build, name=f"lr-build-g{gen.number}", daemon=True)
        thread.start()
        self.gen = gen
        delay = _POLL_MIN
        while thread.is_alive():
            if self.failure_seen():
                self._graveyard.append(thread)
                raise MembershipChanged(f"a member of generation {gen.number} failed while it was being built")
            thread.join(delay)
            delay = min(delay * 2, _POLL_MAX)
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

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` in place across the generation; raise MembershipChanged on any failure."""
        if self.gen.pg is None:
            raise MembershipChanged("no process group for this generation")
        try:
            works = [self.gen.pg.allreduce([t]) for t in tensors]
        except Exception as exc:
            raise MembershipChanged(f"all-reduce could not start: {exc}") from exc
        self.wait(works)

    def broadcast(self, tensors: Sequence[torch.Tensor], src_rank: int) -> None:
        """Broadcast ``tensors`` in place from the member of rank ``src_rank``."""
        if self.gen.pg is None:
            raise MembershipChanged("no process group for this generation")
        opts = dist.BroadcastOptions()
        opts.rootRank = src_rank
        try:
            works = [self.gen.pg.broadcast([t], opts) for t in tensors]
        except Exception as exc:
            raise MembershipChanged(f"broadcast could not start: {exc}") from exc
        self.wait(works)

    def wait(self, works: Sequence[Any]) -> None:
        """Wait for ``works`` in slices; between slices, look for failures of the generation.

        Completion wakes the waiter at once (a future callback sets an event), so the failure-free
        path pays no polling latency; the slice only bounds how late a failure is noticed.
        """
        done = threading.Event()
        remaining = [len(works)]
        lock = threading.Lock()

        def one_done(_fut: Any) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        for work in works:
            work.get_future().add_done_callback(one_done)
        deadline = time.monotonic() + self.collective_timeout
        while not done.wait(_SLICE):
            if self.failure_seen():
                raise MembershipChanged("a member of the generation failed during a collective")
            if time.monotonic() > deadline:
                raise MembershipChanged(f"collective did not complete within {self.collective_timeout}s")
        for work in works:
            try:
                work.wait()
            except Exception as exc:
                raise MembershipChanged(f"collective failed: {exc}") from exc

    def decide_retry(self, step: int) -> bool:
        """This member's reduce failed: settle the step as ``retry`` unless already decided.

        Returns True only if the step had been committed before (impossible for a member whose
        reduce failed, since a commit needs every member's done report; checked by the caller).
        """
        key = f"s{step}/g{self.gen.number}/dec"
        return self._read_decision(self._call(self.store.compare_set, key, "", "retry"))

    def report_done(self, step: int) -> None:
        """This member's reduce completed. The member completing the count writes ``commit``.

        Whichever ``compare_set`` lands first, this ``commit`` or some member's ``retry``, is the
        decision of the step, and every member reads that one (``await_decision``). A commit also
        names the joiners to admit after this step, so that all members admit the same ones.
        """
        key = f"s{step}/g{self.gen.number}"
        if int(self._call(self.store.add, f"{key}/done", 1)) == self.gen.size:
            joins = self.pending_joins()
            value = "commit" + ("" if not joins else ";admit=" + ",".join(f"{r}:{i}" for r, i in sorted(joins.items())))
            self._call(self.store.compare_set, f"{key}/dec", "", value)

    def await_decision(self, step: int) -> bool:
        key = f"s{step}/g{self.gen.number}/dec"
        slice_ = datetime.timedelta(seconds=_SLICE)
        while True:
            try:
                self.store.wait([key], slice_)  # returns as soon as the decision is written
                return self._read_decision(self._call(self.store.get, key))
            except (CoordinatorLostError, MembershipChanged, ReplicaExcludedError):
                raise
            except Exception:
                pass  # the slice elapsed (or the store failed: failure_seen() tells which)
            if self.failure_seen():
                return self._read_decision(self._call(self.store.compare_set, key, "", "retry"))

    def _read_decision(self, value: bytes) -> bool:
        text = value.decode()
        if not text.startswith("commit"):
            return False
        _, _, admit = text.partition(";admit=")
        self.admit_next = {int(r): int(i) for r, i in (x.split(":") for x in admit.split(",") if x)}
        return True

    def forget_step(self, step: int) -> None:
        """Delete the decision keys of an old step (called by the leader)."""
        for g in range(max(0, self.gen.number - 4), self.gen.number + 1):
            for suffix in ("done", "dec"):
                try:
                    self.store.delete_key(f"s{step}/g{g}/{suffix}")
                except Exception:
                    pass

    # -------------------------------------------------------- store collectives (small objects)
    def _live_contributors(self, prefix: str) -> list[int]:
        """Wait until every live member wrote ``{prefix}/{r}``; agree on who counts."""
        delay = _POLL_MIN
        members = self.gen.members
        while not self._call(self.store.check, [f"{prefix}/set"]):
            self.check_health()
            present = [r for r in members if self._call(self.store.check, [f"{prefix}/{r}"])]
            missing = set(members) - set(present)
            if not missing or not (missing - self._dead(sorted(missing), self.gen.incarnations)):
                self._call(self.store.compare_set, f"{prefix}/set", "", json.dumps(present))
                break
            delay = self._sleep(delay)
        return json.loads(self._call(self.store.get, f"{prefix}/set"))

    def exchange(self, obj: Any) -> dict[int, Any]:
        """Every live member contributes ``obj``; all receive the same ``{replica: obj}``."""
        self._seq += 1
        prefix = f"x/{self.gen.number}/{self._seq}"
        self._call(self.store.set, f"{prefix}/{self.replica}", pickle.dumps(obj))
        who = self._live_contributors(prefix)
        raw = self._call(self.store.multi_get, [f"{prefix}/{r}" for r in who])
        return {r: pickle.loads(v) for r, v in zip(who, raw)}

    def broadcast_object(self, obj: Any, src_rank: int = 0) -> Any:
        """Broadcast from the member of rank ``src_rank`` among those alive now."""
        values = self.exchange(obj if self.gen.rank == src_rank else None)
        who = sorted(values)
        src = self.gen.members[src_rank] if self.gen.members[src_rank] in values else who[0]
        return values[src]
