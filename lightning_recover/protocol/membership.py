"""Generations of live replicas: one replica's view of the group, and how it notices a failure.

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
of these is noticed within a few milliseconds, never after a long collective timeout (``polling.py``).

:class:`Membership` owns the parts: the heartbeat (``heartbeat.py``), this replica's incarnation
(``incarnations.py``), the store side of the rounds (``join_rounds.py``, by the rule of ``rounds.py``), join
requests (``join_requests.py``) and each generation's process group (``process_groups.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_recover import env
from lightning_recover.errors import (
    COORDINATOR_LOST_HINT,
    CoordinatorLostError,
    MembershipChanged,
    ReplicaExcludedError,
)
from lightning_recover.protocol.heartbeat import Heartbeat, Progress
from lightning_recover.protocol.incarnations import (
    DECLARED_DEAD,
    current_incarnations,
    declared_dead,
    exclusion_error,
    refuse_if_id_in_use,
    sharded_incarnation,
)
from lightning_recover.protocol.join_requests import JoinRequests
from lightning_recover.protocol.join_rounds import Generation, JoinRounds, LeftOutAtStart, rounds_by_view
from lightning_recover.protocol.messages import ControlStore, JobSecret
from lightning_recover.protocol.notice import Notice
from lightning_recover.protocol.polling import PollGate
from lightning_recover.protocol.process_groups import ProcessGroups
from lightning_recover.protocol.reachability import ReachabilityResponder, start_responder
from lightning_recover.protocol.rendezvous import RendezvousHost, host_rendezvous, meeting_place
from lightning_recover.protocol.replica_agreement import ReplicaAgreement
from lightning_recover.protocol.replica_env import check_against_coordinator, check_replica_size_against_coordinator
from lightning_recover.protocol.standby import wait_for_assignment


class Membership:
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
        # A sharded replica: K processes under one replica id; position `inner` of each member has a group (_build_pg).
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
        self._failure_polls = PollGate()  # failure_seen's reads of ``events``, at a rate the coordinator holds
        self.groups = ProcessGroups(backend, collective_timeout)
        self.rounds: JoinRounds | None = None  # the store side of forming generations, once connected
        self.join_requests: JoinRequests | None = None  # this replica's requests to join, once connected
        self.agreement: ReplicaAgreement | None = None  # a sharded replica's processes go on together, once connected

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
        if rounds_by_view(self.store, self.replica_size):
            self.rendezvous = host_rendezvous(self.store, self.replica, self.collective_timeout)
        self.attach(self.store, self.incarnation)

    def attach(self, store: ControlStore, incarnation: int) -> None:
        """Work over ``store`` as ``incarnation`` of this replica: its join rounds and requests. The last step of
        :meth:`connect`; alone, a membership with no heartbeat (the protocol's in-process tests)."""
        self.store, self.incarnation = store, incarnation
        identity = dict(num_replicas=self.num_replicas, inner=self.inner, check_health=self.check_health)
        rendezvous = None if self.rendezvous is None else self.rendezvous.address
        self.rounds = JoinRounds(
            store,
            self.replica,
            incarnation,
            replica_size=self.replica_size,
            store_timeout=self.store_timeout,
            rendezvous=rendezvous,
            **identity,
        )
        self.join_requests = JoinRequests(store, self.replica, incarnation, **identity)
        if self.replica_size > 1:
            self.agreement = ReplicaAgreement(
                store,
                self.replica,
                incarnation,
                self.inner,
                self.replica_size,
                self.check_health,
                self.collective_timeout + self.store_timeout,  # a mate's build or broadcast ends within it
            )

    def form_initial(self) -> Generation | None:
        """Join generation 0 with every other replica (the job's start). None when the group has already
        formed: a restarted replica comes in through ``Replica.rejoin`` (at a step boundary, with a peer's state)."""
        latest = self.store.generation()
        if latest != 0 or self.store.get_genuine("g0/members") is not None:
            self.join_requests.request()
            return None
        starting = current_incarnations(self.store, range(self.num_replicas))
        try:
            self.gen = self._join_round(
                0, {"step": -1, "have": []}, expected=starting, timeout=self.startup_timeout, least=self.min_replicas
            )
        except LeftOutAtStart:
            # Started as generation 0 closed with MIN replicas: admitted at a commit, as a newcomer.
            self.join_requests.request()
            return None
        except MembershipChanged:
            # A member died while generation 0's group was built, which every survivor's build waits on:
            # the survivors form the next generation before any step.
            return self.form_next_generation({"step": -1, "have": []})
        return self.gen

    def close(self, clean: bool = True) -> None:
        """Leave the group cleanly: mark this incarnation as gone so nobody waits for it. ``clean`` (no uncaught
        error, so no operation in flight): the current generation's group is released now, while the interpreter
        runs (``ProcessGroups.release``)."""
        if clean and self.gen is not None and self.gen.pg is not None and not self.groups.abandoned_work:
            if self.groups.release(self.gen.pg):
                self.gen.pg = None
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
        """Raise if the coordinator is gone or this replica was declared dead (fencing: it applies nothing more)."""
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
        """The ``replicas`` whose incarnation in ``incarnations`` was declared dead."""
        return declared_dead(self.store, replicas, incarnations, recent=recent)

    def failure_seen(self) -> bool:
        """Cheap test (one store round trip when nothing changed, at most once per ``member_poll_period``; none on
        etcd while its watched view is current): did the generation fail? The counter is a hint, read a moment
        stale at worst; what it points at (the generation register, the death notices) is read directly."""
        self.check_health()
        if not self._failure_polls.due(self.gen.size, bool(self.store.raw.views), time.monotonic()):
            return False
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
        self.rounds.propose(g + 1, payload, expected, invite, settle)
        self.gen = self._join_round(g + 1, payload, expected, self.join_timeout, written=True)
        return self.gen

    def form_next_generation(self, payload: dict, leaving: frozenset[int] = frozenset()) -> Generation:
        """:meth:`next_generation`, formed again for as long as a member fails while it is built."""
        while True:
            try:
                return self.next_generation(payload, leaving=leaving)
            except MembershipChanged:
                continue

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
        """Join round ``number`` (:meth:`JoinRounds.join <lightning_recover.protocol.join_rounds.JoinRounds.join>`,
        its arguments) and build the group of the generation it closed with."""
        with self.progress.in_round():
            gen = self.rounds.join(
                number, payload, expected, timeout, may_close=may_close, written=written, least=least
            )
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
        try:
            gen.pg = self.groups.build(place, gen.number, gen.rank, gen.size, self.failure_seen)
        except MembershipChanged:
            self.agree("built", succeeded=False)  # its mates must not go on without it
            raise
        self.agree("built", succeeded=True)

    def agree(self, what: str, succeeded: bool) -> None:
        """A replica of K > 1 processes: publish this process's outcome of ``what`` in the current generation;
        after a success, return once every process of the replica succeeded and raise MembershipChanged once one
        failed (:meth:`ReplicaAgreement.settle <lightning_recover.protocol.replica_agreement.ReplicaAgreement.settle>`).
        Nothing to agree on for a replica of one process."""
        if self.agreement is not None:
            self.agreement.settle(self.gen.number, what, succeeded)

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

    # ------------------------------------------------------------------ joiners
    def pending_joins(self, recent: bool = False) -> dict[int, int]:
        """Join requests not admitted into the current generation and still alive: ``{replica: incarnation}``
        (:meth:`JoinRequests.pending <lightning_recover.protocol.join_requests.JoinRequests.pending>`)."""
        return self.join_requests.pending(self.gen.incarnations, recent=recent)

    def wait_for_invitation(self) -> Generation:
        """A joiner waits until members invite it into a generation, then joins that round."""
        number = self.join_requests.wait_for_invitation()
        self.gen = self._join_round(
            number, {"step": None, "have": [], "joiner": True}, expected={}, timeout=self.join_timeout, may_close=False
        )
        return self.gen
