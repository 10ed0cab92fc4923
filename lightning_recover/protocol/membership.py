"""Generations of live replicas: joins, heartbeats (with progress), failure detection.

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

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_recover import env
from lightning_recover.errors import (
    COORDINATOR_LOST_HINT,
    CoordinatorLostError,
    ForgedMessageError,
    MembershipChanged,
    RecoverError,
    ReplicaExcludedError,
)
from lightning_recover.protocol.liveness import VouchCoverage, heartbeat_lease
from lightning_recover.protocol.messages import ControlStore, JobSecret, sequence
from lightning_recover.protocol.notice import Notice, leave_requested
from lightning_recover.protocol.process_groups import ProcessGroups
from lightning_recover.protocol.reachability import (
    ReachabilityResponder,
    fence_reason,
    start_responder,
    wait_until_reachable,
)
from lightning_recover.protocol.rendezvous import FIELD as RENDEZVOUS_FIELD
from lightning_recover.protocol.rendezvous import RendezvousHost, host_rendezvous, meeting_place
from lightning_recover.protocol.replica_env import check_against_coordinator, check_replica_size_against_coordinator
from lightning_recover.protocol.rounds import SHORT, WAIT, RoundState, round_outcome, round_state
from lightning_recover.protocol.standby import wait_for_assignment
from lightning_recover.protocol.vouches import VOUCH_KEY, Roster, VouchReader, raw_reader

POLL_MIN = 0.0005
POLL_MAX = 0.005
SLICE = 0.01  # longest a blocked wait goes without looking for failures


def backoff(delay: float) -> float:
    """Sleep ``delay`` and return the next, doubled up to ``POLL_MAX``."""
    time.sleep(delay)
    return min(delay * 2, POLL_MAX)


class Progress:
    """What the main thread is doing, reported by the heartbeat: a replica whose heartbeat thread
    lives but whose main thread is stuck (a deadlock) is told apart from a slow one by this."""

    def __init__(self) -> None:
        self.step = -1
        self.phase = "start"
        self.count = 0
        self.report: dict = {}  # what the status board shows of this replica (observe/report.py), set by it
        self.urgent = False  # the report holds news (a recovery, a join): beat even where a vouch covers it

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
        # etcd: the key lives while a lease this thread keeps alive (liveness.py); a beat is then written only to
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
        """When the next beat may be due, or with a lease the next keep-alive if sooner (monotonic)."""
        due = self._covered_since() + self._window()
        return due if self._leased is None else min(due, self._leased.renewed_at + self._leased.ttl / 3)

    def _write(self, payload: dict) -> None:
        self._last_payload = payload
        seq = sequence(self._incarnation, self._beat)
        if self._leased is None:
            self._store.set(self._key, json.dumps(payload), seq=seq)
        else:  # the monitor judges a leased beat by its key's presence, not by its beats moving
            value = json.dumps(dict(payload, lease=self._leased.ttl))
            self._leased.put(self._store.sealer.seal(self._key, value.encode(), seq))

    def _send(self) -> None:
        if self._leased is not None and self._leased.keepalive_due:
            self._leased.keep_alive()
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
    """Ends the process when the coordinator stops answering the heartbeat for ``limit`` seconds.

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
        while not self._stop.wait(min(0.1, self._limit / 10)):
            if self._heartbeat.stopped:
                return  # the heartbeat was stopped on purpose: nothing left to watch
            silent = time.monotonic() - self._heartbeat.last_ok
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


def refuse_if_id_in_use(store: ControlStore, replica: int, num_replicas: int, heartbeat_interval: float) -> None:
    """Refuse to start while another live process holds this replica id (a hand-started
    duplicate): its incarnation is not declared dead and its heartbeat still moves. A restart
    is never refused: the launcher or the agent declares the old incarnation dead when it exits."""
    key = f"hb/{replica}"

    def beat() -> tuple[int, int]:
        found = store.get_fresh(key)  # a replayed heartbeat is no sign of life
        hb = json.loads(found[1]) if found else {}
        return int(hb.get("inc", 0)), int(hb.get("beat", 0))

    inc, first = beat()
    if inc == 0 or store.deaths([replica])[replica] >= inc:
        return
    deadline = time.monotonic() + 3 * heartbeat_interval + 0.5
    while time.monotonic() < deadline:
        time.sleep(heartbeat_interval)
        now_inc, now = beat()
        if now_inc == inc and now > first and store.deaths([replica])[replica] < inc:
            raise RecoverError(
                f"replica id {replica} is already in use by a live process of this job (incarnation {inc} "
                f"is heartbeating). HINT: give each process a distinct {env.REPLICA} in 0..{num_replicas - 1};"
                " a replica restarts only after its previous process ended."
            )


def sharded_incarnation(store: ControlStore, replica: int, inner: int, startup_timeout: float) -> int:
    """All K processes of a replica (re)start together: position 0 bumps the replica's counter,
    the others wait until it reaches their own position's count."""
    mine = store.add(f"inc/{replica}/i{inner}", 1)
    if inner == 0:
        return store.add(f"inc/{replica}", 1)
    deadline = time.monotonic() + startup_timeout
    delay = POLL_MIN
    while store.add(f"inc/{replica}", 0) < mine:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica}: process 0 did not start within {startup_timeout}s")
        delay = backoff(delay)
    return mine


def _members_never_written(replica: int, number: int, waited: float) -> RecoverError:
    return RecoverError(
        f"replica {replica}: the members of generation {number} were not written within join_timeout + "
        f"store_timeout ({waited:.0f}s; deleted or forged by a client without the job's secret?); this joiner "
        "stops. HINT: its launcher restarts it if restarts remain."
    )


def joined_round(store: ControlStore, prefix: str, num_replicas: int, replica_size: int, by_view: bool) -> set[int]:
    """Replicas that joined round ``prefix``. The unsealed list is only a hint of whom to look at:
    a replica counts once its sealed join payload is there and, with K processes per replica,
    all K of its positions said they joined.

    The reads may be a moment stale (from a watched view): a stale answer is a subset of the replicas that
    joined (a join is never taken back), so the round only waits a moment longer. ``by_view``
    (:attr:`Membership.rounds_by_view`): there is no list; the view holds every payload, and looking at each
    replica's costs no round trip (a list would cost an append, contended by every joiner, on the
    regroup's critical path)."""
    if by_view:
        keys = [f"{prefix}/join/{r}" for r in range(num_replicas)]
        return {r for r, payload in enumerate(store.recent_genuine_many(keys)) if _well_formed(payload)}
    positions: dict[int, set[str]] = {}
    hint = (store.recent_raw(f"{prefix}/joined") or b"").decode(errors="replace")
    for item in hint.split(","):
        r, _, i = item.partition(".")
        if r.isdigit() and int(r) < num_replicas:
            positions.setdefault(int(r), set()).add(i)
    # Never a waiting read: a deleted payload must not stall the round (its writer puts it back).
    joined = set()
    for r in sorted(positions):
        if len(positions[r]) < replica_size:
            continue
        try:
            payload = store.recent_genuine(f"{prefix}/join/{r}")  # None: not in the view yet, deleted, or forged
        except ForgedMessageError:
            continue  # planted by someone without the secret: not a member
        if _well_formed(payload):
            joined.add(r)
    return joined


def _say_joined(store: ControlStore, prefix: str, replica: int, inner: int, replica_size: int, by_view: bool) -> None:
    """Add this process to round ``prefix``'s list of whom to look at (not ``by_view``, where
    :func:`joined_round` needs no list)."""
    if not by_view:
        me = str(replica) if replica_size == 1 else f"{replica}.{inner}"
        store.append_hint(f"{prefix}/joined", f"{me},")


def _well_formed(payload: Optional[str]) -> bool:
    try:
        return payload is not None and isinstance(json.loads(payload), dict)
    except ValueError:
        return False


def _join_payload(group: Membership, payload: dict) -> str:
    """What a replica publishes when it joins a round: ``payload``, its incarnation, its rendezvous store."""
    rendezvous = {} if group.rendezvous is None else {RENDEZVOUS_FIELD: group.rendezvous.address}
    return json.dumps(dict(payload, inc=group.incarnation, **rendezvous))


def pause(store: ControlStore, delay: float) -> float:
    """Between two polls of a round: until the watched view moves (at most ``POLL_MAX``) where the backend
    has one, else a sleep that doubles up to ``POLL_MAX``; the next pause's length."""
    if store.raw.views:
        store.wait_changed(POLL_MAX)
        return delay
    return backoff(delay)


#: Why a replica stops when its death notice is what it noticed (see :func:`exclusion_error`).
DECLARED_DEAD = (
    "was declared dead by the group (missed heartbeats or stalled) and must not apply further steps; it "
    "stops here. HINT: raise heartbeat_timeout/hang_timeout if this replica was only slow."
)


def exclusion_error(store: ControlStore, replica: int, incarnation: int, why: str) -> ReplicaExcludedError:
    """The error that stops a replica once the group went on without it, however it noticed (its death
    notice, a member list without it, a newer generation): a replica fenced for a network partition names
    the partition (:func:`~lightning_recover.protocol.reachability.fence_reason`), whichever it noticed
    first; otherwise ``why``."""
    partition = fence_reason(store, replica, incarnation)
    return ReplicaExcludedError(f"replica {replica} {partition or why}")


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


def _generation_listed(store: ControlStore, number: int, members: list[int], replica: int) -> Generation:
    """Generation ``number`` as its member list names it (``replica``, this process's, among them), with the
    members' join payloads."""
    payloads = {}
    # Never a waiting read: every listed member wrote its payload before it could be listed, so a
    # missing one was deleted by a client without the secret, which must not stall this reader until
    # the store's timeout (and then be misnamed a lost coordinator).
    keys = [f"g{number}/join/{r}" for r in members]
    # A watched view that showed the member list holds the payloads written before it (revision order).
    values = store.recent_genuine_many(keys)
    if None in values:  # not yet in this view (the list came from a compare_set), or gone: read the store
        values = store.genuine_many(keys)
    for r, key, value in zip(members, keys, values):
        if value is None:
            raise ForgedMessageError(
                f"replica {replica}: the join payload {key!r} of generation {number}'s member {r} "
                f"{'failed authentication' if store.has(key) else 'was deleted'} (a client without the job's "
                "secret tampers with the coordinator's store); this replica stops. "
                "HINT: keep the coordinator's port on loopback or a private network."
            )
        payloads[r] = json.loads(value)
    return Generation(
        number, members, {r: p["inc"] for r, p in payloads.items()}, payloads, rank=members.index(replica)
    )


#: a counter every join request adds one to (``add``; the requests themselves are sealed ``join/{r}``)
JOIN_REQUESTS = "join/requests"


class _JoinRequests:
    """A replica outside the group asks to be admitted, and members read who asks: restarted replicas, standbys
    that took a dead replica's place, newcomers of a growing job. Part of :class:`Membership`."""

    store: ControlStore
    gen: Optional[Generation]
    replica: int
    incarnation: int
    inner: int
    num_replicas: int
    join_timeout: float
    join_requested_at: float = 0.0  # wall time of this process's last join request
    _join_requests_seen: int = -1  # the request counter when the last look found none pending

    # ------------------------------------------------------------------ rejoin
    def request_join(self) -> None:
        """Ask the group to admit this (restarted) replica at its next commit."""
        if self.incarnation > 1:
            # Our previous incarnation is certainly dead: say so now rather than after heartbeats.
            self.store.mark_dead(self.replica, self.incarnation - 1)
        # Cut off from the members' data network, joining would only stall their next generation.
        wait_until_reachable(self.store, self.replica, self.num_replicas, 1.0, lambda: _job_over(self))
        self.store.set(f"join/{self.replica}", str(self.incarnation))
        self.store.add(JOIN_REQUESTS, 1)  # after the request: whoever reads the new count reads the request too
        self.join_requested_at = time.time()
        if self.inner == 0:
            print(f"[lightning-recover] replica {self.replica}: asks to join at the next commit", flush=True)

    def pending_joins(self, recent: bool = False) -> dict[int, int]:
        """Join requests not yet admitted and still alive: ``{replica: incarnation}``. ``recent``: from
        reads that may be a moment stale (a request made meanwhile is admitted at the next commit).

        Read by the leader at every commit: one counter read while nobody asks, the N requests only when the
        counter moved or a request is still pending (a forged count only costs a look)."""
        counted = self.store.recent_count(JOIN_REQUESTS) if recent else self.store.add(JOIN_REQUESTS, 0)
        if counted == self._join_requests_seen:
            return {}
        latest: dict[int, int] = {}
        read = self.store.recent_genuine if recent else self.store.get_genuine
        for r in range(self.num_replicas):
            asked = read(f"join/{r}")
            if asked is not None:
                latest[r] = int(asked)
        wanted = {r: inc for r, inc in latest.items() if self.gen.incarnations.get(r) != inc}
        dead = self.dead(sorted(wanted), wanted, recent=recent)
        pending = {r: inc for r, inc in wanted.items() if r not in dead}
        self._join_requests_seen = -1 if pending else counted  # one pending: look again (admitted, or dead)
        return pending

    def wait_for_invitation(self) -> Generation:
        """A joiner waits until members invite it into a generation, then joins that round."""
        delay = POLL_MIN
        key = None
        while True:
            # Job over first: with K processes per replica, the first one to leave marks this
            # incarnation gone, which its mates must not read as an exclusion.
            if _job_over(self):
                print(f"[lightning-recover] replica {self.replica}: the job ended before it could rejoin", flush=True)
                raise SystemExit(0)
            self.check_health()
            latest = self.store.generation()
            key = f"g{latest}/invite/{self.replica}"
            if self.store.get_genuine(key) == str(self.incarnation):
                break
            if self.store.get_genuine(f"join/{self.replica}") != str(self.incarnation):
                self.request_join()  # the request was deleted or overwritten: nobody would admit this replica
            delay = backoff(delay)
        self.gen = self._join_round(
            latest, {"step": None, "have": [], "joiner": True}, expected={}, timeout=self.join_timeout, may_close=False
        )
        return self.gen


class Membership(_JoinRequests):
    """One replica's view of the group: generations, joins, heartbeats, failure detection."""

    def __init__(
        self,
        coordinator_addr: str,
        replica: int,
        num_replicas: int,
        *,
        heartbeat_interval: float = 0.1,
        heartbeat_timeout: float | None = None,
        join_timeout: float = 60.0,
        collective_timeout: float = 60.0,
        startup_timeout: float = 300.0,
        store_timeout: float = 5.0,
        hang_timeout: float = 60.0,
        backend: str = "gloo",
        secret: JobSecret,
        inner: int = 0,
        replica_size: int = 1,
        standby: int | None = None,
        min_replicas: int | None = None,
        notice: Notice | None = None,
    ) -> None:
        # Growth (``replicas=MIN:MAX``): ids are 0..MAX-1 (``num_replicas``); training starts once MIN are in.
        self.min_replicas = num_replicas if min_replicas is None else min_replicas  # checked where it was parsed
        self.notice = notice
        # A warm standby has no replica id until the launcher assigns it one (see protocol.standby).
        self.standby = standby
        self.before_build: Callable[[], None] = lambda: None  # set by the Replica (its "regroup" faults)
        if standby is None and not 0 <= replica < num_replicas:
            raise ValueError(
                f"replica id {replica} is outside 0..{num_replicas - 1}. HINT: give each of the {num_replicas} "
                f"replicas a distinct {env.REPLICA} in that range."
            )
        self.backend = backend
        # A sharded replica is K processes; each runs this membership under the same replica id.
        # Position `inner` of every member forms its own cross-replica group (see _build_pg).
        self.inner = inner
        self.replica_size = replica_size
        self.addr = coordinator_addr
        self.replica = replica
        self.num_replicas = num_replicas
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout  # a leased heartbeat's TTL on etcd (None: 4 periods)
        self.join_timeout = join_timeout
        self.collective_timeout = collective_timeout
        self.startup_timeout = startup_timeout
        self.store_timeout = store_timeout  # bounds every store operation: a frozen coordinator is noticed
        self.hang_timeout = hang_timeout  # how long the monitor lets a peer make no progress while others wait
        self.secret = secret
        self.progress = Progress()
        self.store: ControlStore | None = None
        self.incarnation = 0
        self.gen: Generation | None = None
        self.heartbeat: Heartbeat | None = None
        self._responder: ReachabilityResponder | None = None  # answers partition probes (protocol.reachability)
        self.rendezvous: RendezvousHost | None = None  # where generations it leads meet (protocol.rendezvous)
        self._events_seen = -1
        self.groups = ProcessGroups(backend, collective_timeout)

    # ------------------------------------------------------------------ lifecycle
    def connect(self, before_standby_wait: Callable[[], None] | None = None) -> None:
        """Connect and take this replica's next incarnation. A standby first runs
        ``before_standby_wait`` (a sharded one builds its K-process world there), then waits until
        it is assigned a replica id."""
        self.store = ControlStore(self.addr, self.replica, self.secret, timeout=self.store_timeout)
        check_against_coordinator(self.store.get_genuine("meta/replicas"), self.num_replicas)
        check_replica_size_against_coordinator(self.store.get_genuine("meta/replica_size"), self.replica_size)
        if self.standby is not None:
            if before_standby_wait is not None:
                before_standby_wait()
            assigned = wait_for_assignment(self.store, self.standby, self.num_replicas, self.inner)
            self.replica = self.store.replica = assigned
            if self.inner == 0:  # one line per replica, not K
                print(
                    f"[lightning-recover] standby {self.standby}: takes the place of replica {self.replica}",
                    file=sys.stderr,
                    flush=True,
                )
        if self.replica_size == 1:
            refuse_if_id_in_use(self.store, self.replica, self.num_replicas, self.heartbeat_interval)
            self.incarnation = self.store.add(f"inc/{self.replica}", 1)
            key = None
        else:
            self.incarnation = sharded_incarnation(self.store, self.replica, self.inner, self.startup_timeout)
            key = f"hb/{self.replica}/i{self.inner}"  # per process: a hung process stops only its own
        self.heartbeat = Heartbeat(
            self.store,
            self.replica,
            self.incarnation,
            self.heartbeat_interval,
            self.progress,
            key=key,
            notice=self.notice,
            timeout=self.heartbeat_timeout,
        )
        self.heartbeat.start(self.addr, self.store_timeout)
        if self.inner == 0:  # one probe server per replica (its processes share a host)
            self._responder = start_responder(self.store, self.replica, self.incarnation, self.heartbeat_interval)
        if self.rounds_by_view:
            self.rendezvous = host_rendezvous(self.store, self.replica, self.collective_timeout)

    def form_initial(self) -> Generation | None:
        """Join generation 0 with every other replica (the job's start). None when the group has already
        formed: a restarted replica comes in through :meth:`rejoin` (at a step boundary, with a peer's state)."""
        latest = self.store.generation()
        if latest != 0 or self.store.get_genuine("g0/members") is not None:
            self.request_join()
            return None
        starting = self.current_incarnations(range(self.num_replicas))
        try:
            self.gen = self._join_round(
                0, {"step": -1, "have": []}, expected=starting, timeout=self.startup_timeout, least=self.min_replicas
            )
        except _LeftOutAtStart:
            # Started as generation 0 closed with MIN replicas: admitted at a commit, as a newcomer.
            self.request_join()
            return None
        except MembershipChanged:
            # A member died while generation 0's group was built, which every survivor's build waits on:
            # the survivors form the next generation before any step.
            return form_next_generation(self, {"step": -1, "have": []})
        return self.gen

    def close(self) -> None:
        """Leave the group cleanly: mark this incarnation as gone so nobody waits for it."""
        if self.store is not None and self.incarnation:
            try:
                try:
                    if self.heartbeat is not None:
                        self.heartbeat.send_news()  # its last report, read by the status page and the event log
                finally:
                    self.store.mark_dead(self.replica, self.incarnation)
            except Exception:
                pass  # the coordinator is already gone: nothing to tell
        if self._responder is not None:
            self._responder.close()
            self._responder = None
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

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
        """Raise if the coordinator is gone or this replica was declared dead (fencing: an
        excluded replica learns it at its next control-plane operation and applies nothing more)."""
        if self.heartbeat is not None and self.heartbeat.error is not None:
            raise CoordinatorLostError(
                f"replica {self.replica} lost the coordinator at {self.addr} "
                f"(heartbeat failed: {self.heartbeat.error}). " + COORDINATOR_LOST_HINT
            )
        if self.heartbeat is not None and self.heartbeat.excluded:
            raise self._excluded()

    def _excluded(self, why: str = DECLARED_DEAD) -> ReplicaExcludedError:
        return exclusion_error(self.store, self.replica, self.incarnation, why)

    def dead(self, replicas: Sequence[int], incarnations: dict[int, int], recent: bool = False) -> set[int]:
        if not replicas:
            return set()
        deaths = self.store.deaths(replicas, recent=recent)
        # Incarnation 0 = not started yet (only during the first formation): not dead.
        return {r for r in replicas if 0 < incarnations.get(r, 1 << 30) <= deaths[r]}

    def current_incarnations(self, replicas: Sequence[int]) -> dict[int, int]:
        values = self.store.call(self.store.raw.multi_get, [f"inc/{r}" for r in replicas])
        return {r: int(v) for r, v in zip(replicas, values)}

    def failure_seen(self) -> bool:
        """Cheap test (one store round trip when nothing changed, none on etcd while its watched view is
        current): did the generation fail? The counter is a hint, read a moment stale at worst; what it
        points at (the generation register, the death notices) is read directly."""
        self.check_health()
        events = self.store.recent_count("events")
        if events == self._events_seen:
            return False
        if self.store.generation() > self.gen.number:
            return True
        dead = self.dead(self.gen.members, self.gen.incarnations)
        if self.replica in dead:
            raise self._excluded()
        if dead:
            return True
        self._events_seen = events
        return False

    # ------------------------------------------------------------------ generations
    def next_generation(
        self,
        payload: dict,
        invite: dict[int, int] | None = None,
        settle: dict[str, str] | None = None,
        leaving: frozenset[int] = frozenset(),
    ) -> Generation:
        """Leave the current generation and form the next one: its survivors plus the ``invite``d joiners
        (``{replica: incarnation}``, as admitted by a commit decision) that are alive. ``settle``: registers
        written with the proposal where absent (a failed step's ``retry``, ``Decisions.retry_with_proposal``).
        ``leaving``: members that left on notice at the last commit (every member read the same ones from the
        step's reduce): not waited for."""
        g = self.gen.number
        self._abandon(self.gen)
        # A death the view has not shown yet only makes the round wait until it does (it reads deaths again).
        dead = self.dead(self.gen.members, self.gen.incarnations, recent=True)
        expected = {r: inc for r, inc in self.gen.incarnations.items() if r not in dead and r not in leaving}
        expected.update(invite or {})
        # The proposal, this replica's join payload, the ``events`` hint (bumped by the proposer) and, when
        # this join is the last one the round awaits, the member list: one transaction on etcd. A join
        # written into a round already closed (the group went on: excluded below) is read by nobody.
        join = {f"g{g + 1}/join/{self.replica}": _join_payload(self, payload)}
        close = None if invite else closing_members(self, g + 1, expected)

        def propose(after: int, where_absent: dict[str, str] | None) -> int:
            found = self.store.compare_set("gen/latest", str(after), str(g + 1), join, "events", where_absent)
            return int(found)

        latest = propose(g, {**(close or {}), **(settle or {})})
        if latest < g:  # gen/latest only grows: an older genuine value was written back. Take it back.
            latest = propose(latest, settle)
        if latest > g + 1:
            raise self._excluded(
                f"fell behind: the group is at generation {latest} and this replica left generation {g}; it stops "
                "here so that it never applies a divergent step."
            )
        for r, inc in (invite or {}).items():
            self.store.set(f"g{g + 1}/invite/{r}", str(inc))
        self.gen = self._join_round(g + 1, payload, expected, self.join_timeout, written=True)
        return self.gen

    def _join_round(
        self,
        number: int,
        payload: dict,
        expected: dict[int, int],
        timeout: float,
        may_close: bool = True,
        written: bool = False,
        least: int = 0,
    ) -> Generation:
        """Join round ``number``; ``expected`` maps the replicas to wait for to their incarnation. ``written``:
        this replica's join payload is already written (with the round's proposal, :meth:`next_generation`).
        ``least`` (the job's first round, ``replicas=MIN:MAX`` with MIN < MAX): the round closes once ``least``
        replicas joined and every replica started meanwhile did; ids not started are admitted later."""
        prefix = f"g{number}"
        mine = f"{prefix}/join/{self.replica}"
        growth = 0 < least < self.num_replicas
        if not written:
            self.store.set(mine, _join_payload(self, payload))
        _say_joined(self.store, prefix, self.replica, self.inner, self.replica_size, self.rounds_by_view)
        deadline = time.monotonic() + timeout
        delay = POLL_MIN
        expected = dict(expected)
        # With a watched view the round is watched, not polled: its reads come from the view (a stale view
        # only makes the round wait a moment longer: joins and deaths are never taken back, and the member
        # list is a register whose compare_set answers the list already written).
        while (listed := self.store.recent_genuine(f"{prefix}/members")) is None:
            self.check_health()
            if self.store.raw.outsiders_can_write and self.store.get_genuine(mine) is None:
                # Deleted or overwritten by a client without the secret: nobody would count this replica.
                print(f"[lightning-recover] replica {self.replica}: wrote again its join payload {mine}", flush=True)
                self.store.set(mine, _join_payload(self, payload))
            if not may_close:
                # A joiner waits for the members, who close the round within their join_timeout; a
                # member list deleted or forged after they read it must not keep it here for ever.
                if time.monotonic() > deadline + self.store_timeout:
                    raise _members_never_written(self.replica, number, timeout + self.store_timeout)
                delay = pause(self.store, delay)
                continue
            # At the job's start a replica not started yet has incarnation 0, which no death notice
            # matches: read it again, so one that starts and dies before joining is not waited for
            # until the start-up timeout.
            unstarted = [r for r, inc in expected.items() if inc == 0]
            if unstarted:
                expected.update({r: inc for r, inc in self.current_incarnations(unstarted).items() if inc})
            state = _round_state(self, prefix, expected)
            outcome = round_outcome(state, expected, least if growth else 0, time.monotonic() >= deadline)
            if outcome == WAIT:
                delay = pause(self.store, delay)
                continue
            if outcome == SHORT:
                raise RecoverError(
                    f"replica {self.replica}: only {len(state.members)} of the {least} replicas this job needs to start "
                    f"joined within startup_timeout ({timeout:g}s). HINT: start at least {least} replicas "
                    "(replicas=MIN:MAX), or raise startup_timeout."
                )
            listed = self.store.compare_set(f"{prefix}/members", None, json.dumps(state.members))
            break
        # The value read, not a second read (the key may be deleted meanwhile).
        members = json.loads(listed)
        if self.replica not in members and growth:
            raise _LeftOutAtStart()
        if self.replica not in members:
            raise self._excluded(
                f"was left out of generation {number} (the others suspected it dead); it stops here so that it "
                "never applies a divergent step."
            )
        gen = _generation_listed(self.store, number, members, self.replica)
        self._build_pg(gen)
        self._events_seen = -1
        return gen

    def _build_pg(self, gen: Generation) -> None:
        """Build the group of ``gen`` on a thread, so a member dying meanwhile is noticed."""
        self.gen = gen
        self.before_build()  # fault injection's "regroup" phase
        suffix = "" if self.replica_size == 1 else f"/i{self.inner}"  # one group per inner position
        leader = gen.payloads[gen.members[0]]
        place = meeting_place(self.store, leader, f"pg/g{gen.number}{suffix}", self.collective_timeout)
        gen.pg = self.groups.build(place, gen.number, gen.rank, gen.size, self.failure_seen)

    @property
    def rounds_by_view(self) -> bool:
        # Rounds run from the watched view (ControlPlane.views, replicas of one process): no list of joiners, the
        # last joiner closes the round, a generation meets at its leader's rendezvous store. Else they are polled.
        return self.store is not None and self.store.raw.views and self.replica_size == 1

    @property
    def abandoned_work(self) -> bool:
        """True once a group was abandoned: the process ends with ``os._exit`` (see ProcessGroups)."""
        return self.groups.abandoned_work

    def operations_started(self, pg: Any, works: list) -> None:
        """Tell the group's keeper which operations were just started on ``pg`` (see ProcessGroups.abandon)."""
        self.groups.started(pg, works)

    def abandon_current(self) -> None:
        """Give up the current generation's group (an operation on it may still be in flight)."""
        if self.gen is not None:
            self._abandon(self.gen)

    def _abandon(self, gen: Generation) -> None:
        if gen.pg is not None:
            self.groups.abandon(gen.pg)
            gen.pg = None


def _job_over(group: Membership) -> bool:
    """Every other replica's current incarnation is declared dead or never started (or there is no other
    replica): with ``replicas=MIN:MAX`` ids above those started may never be used."""
    others = [r for r in range(group.num_replicas) if r != group.replica]
    incarnations = group.current_incarnations(others)
    started = [r for r in others if incarnations[r] > 0]
    return len(group.dead(started, incarnations)) == len(started)


class _LeftOutAtStart(Exception):
    """This replica joined the job's first round after it closed with MIN replicas (``replicas=MIN:MAX``)."""


def closing_members(group: Membership, number: int, expected: dict[int, int]) -> Optional[dict[str, str]]:
    """Round ``number``'s member list if this replica's join is the last one it awaits, as the watched view
    shows the round (etcd, replicas of one process): the list written with the join, if none is yet, by the
    rule :meth:`Membership._join_round` closes a round by. None otherwise (that loop closes it)."""
    if not group.rounds_by_view:
        return None
    prefix = f"g{number}"
    state = _round_state(group, prefix, expected, joined_too=frozenset({group.replica}))
    return None if state.awaited else {f"{prefix}/members": json.dumps(state.members)}


def _round_state(
    group: Membership, prefix: str, expected: dict[int, int], joined_too: frozenset[int] = frozenset()
) -> RoundState:
    """Round ``prefix``'s :func:`~lightning_recover.protocol.rounds.round_state`, from what the store shows (a
    watched view's join or death not shown yet only makes the round wait). ``joined_too``: joins not in the
    view yet (this replica's own, written in the transaction that would close the round)."""
    joined = joined_round(group.store, prefix, group.num_replicas, group.replica_size, group.rounds_by_view)
    joined |= joined_too
    return round_state(expected, joined, group.dead(sorted(set(expected) | joined), expected, recent=True))


def form_next_generation(group: Membership, payload: dict, leaving: frozenset[int] = frozenset()) -> Generation:
    """:meth:`Membership.next_generation`, formed again for as long as a member fails while it is built."""
    while True:
        try:
            return group.next_generation(payload, leaving=leaving)
        except MembershipChanged:
            continue
