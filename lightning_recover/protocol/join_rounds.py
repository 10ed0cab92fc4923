"""The store side of forming a generation: the proposal, the join round and the member list it closes with.

A generation is proposed by moving ``gen/latest`` on with ``compare_set``; each replica joining round G writes
its sealed join payload ``g{G}/join/{replica}`` (what it holds of the open step, its incarnation, where a
generation it leads meets); the first joiner that finds nobody awaited any more (``rounds.py``'s rule, on what
the store shows) writes ``g{G}/members`` with ``compare_set``, and every joiner reads that same list. Building
the generation's process group is :class:`~lightning_recover.protocol.membership.Membership`'s.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_recover.errors import ForgedMessageError, RecoverError, ReplicaExcludedError
from lightning_recover.protocol.incarnations import current_incarnations, dead_among, exclusion_error
from lightning_recover.protocol.messages import ControlStore
from lightning_recover.protocol.polling import POLL_MIN, pause
from lightning_recover.protocol.rendezvous import FIELD as RENDEZVOUS_FIELD
from lightning_recover.protocol.rounds import SHORT, WAIT, RoundState, round_outcome, round_state


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


class LeftOutAtStart(Exception):
    """This replica joined the job's first round after it closed with MIN replicas (``replicas=MIN:MAX``)."""


def rounds_by_view(store: ControlStore, replica_size: int) -> bool:
    """Rounds run from the watched view (ControlPlane.views, replicas of one process): no list of joiners, the
    last joiner closes the round, a generation meets at its leader's rendezvous store. Else they are polled."""
    return bool(store.raw.views) and replica_size == 1


#: Longest a round's polls go on using death notices read earlier while ``events`` did not move: a notice and its
#: bump are two requests on the embedded coordinator, and a writer killed between them leaves ``events`` still.
DEATHS_REREAD = 1.0


@dataclass
class RoundReads:
    """What one replica's polls of one round already read, so that a poll costs O(1) while nothing changed: a
    join and a death notice are never taken back, and each change bumps a counter the poll reads first."""

    prefix: str = ""
    joins: set[int] = field(default_factory=set)  # replicas whose join was read genuine
    listed: int = -1  # the round's ``joins`` counter when its list of joiners was last read
    positions: dict[int, set[str]] = field(default_factory=dict)  # that list: replica -> positions that joined
    events: int = -1  # the ``events`` counter when the death notices were last read
    deaths_read: float = -math.inf  # when (monotonic)
    deaths: dict[int, int] = field(default_factory=dict)  # replica -> incarnation declared dead

    def dead(
        self,
        store: ControlStore,
        replicas: list[int],
        incarnations: dict[int, int],
        awaited: Optional[Collection[int]] = None,
    ) -> set[int]:
        """:func:`~lightning_recover.protocol.incarnations.declared_dead` for ``replicas`` (reads that may be a
        moment stale), the notices read again only when ``events`` moved or a replica is new, and those of the
        ``awaited`` replicas (default: all) when older than :data:`DEATHS_REREAD`. ``events`` is read first: a
        notice written after the notices' read is bumped after it too, and the next poll sees the bump. Only a
        notice whose writer died before its bump goes unannounced, and only an awaited replica's stalls the round
        (one that joined and died unannounced makes the group build fail, and the next round sees it): reading
        every member's each second would cost N^2 notices a second for the job."""
        events = store.recent_count("events")
        now = time.monotonic()
        if events < 0 or events != self.events or not self.deaths.keys() >= set(replicas):  # < 0: forged
            self.deaths = store.deaths(replicas, recent=True)
            self.events, self.deaths_read = events, now
        elif now - self.deaths_read > DEATHS_REREAD:
            self.deaths.update(store.deaths(sorted(replicas if awaited is None else awaited), recent=True))
            self.deaths_read = now
        return dead_among(replicas, incarnations, self.deaths)


def joined_round(
    store: ControlStore,
    prefix: str,
    num_replicas: int,
    replica_size: int,
    by_view: bool,
    reads: Optional[RoundReads] = None,
) -> set[int]:
    """Replicas that joined round ``prefix``. The unsealed list is only a hint of whom to look at:
    a replica counts once its sealed join payload is there and, with K processes per replica,
    all K of its positions said they joined.

    The reads may be a moment stale (from a watched view): a stale answer is a subset of the replicas that
    joined (a join is never taken back), so the round only waits a moment longer. ``by_view``
    (:func:`rounds_by_view`): there is no list; the view holds every payload, and looking at each
    replica's costs no round trip (a list would cost an append, contended by every joiner, on the
    regroup's critical path). ``reads``: what this caller's earlier polls of the round read (the same round): the
    list is read again only when the round's ``joins`` counter (bumped after each entry) moved, and a join read
    genuine is not read again, so a poll costs one counter's read while nobody new joined, not a read of the list
    and of every member's join."""
    if by_view:
        keys = [f"{prefix}/join/{r}" for r in range(num_replicas)]
        return {r for r, payload in enumerate(store.recent_genuine_many(keys)) if _well_formed(payload)}
    reads = reads if reads is not None else RoundReads(prefix)
    listed = store.recent_count(f"{prefix}/joins")  # first: an entry counted now is in the list read next
    if listed < 0 or listed != reads.listed:  # < 0: not a number (forged): no cache to trust
        reads.listed, reads.positions = listed, _joiners(store.recent_raw(f"{prefix}/joined"), num_replicas)
    # Never a waiting read: a deleted payload must not stall the round (its writer puts it back). The joins not
    # read genuine yet in one read: a round of N joiners polled by each of them costs O(N) reads, not O(N^2).
    listed_in_full = sorted(r for r, positions in reads.positions.items() if len(positions) >= replica_size)
    unread = [r for r in listed_in_full if r not in reads.joins]
    payloads = store.recent_genuine_many([f"{prefix}/join/{r}" for r in unread])  # None: not in view, gone, forged
    reads.joins.update(r for r, payload in zip(unread, payloads) if _well_formed(payload))
    return {r for r in listed_in_full if r in reads.joins}


def _joiners(hint: Optional[bytes], num_replicas: int) -> dict[int, set[str]]:
    """A round's unsealed list of joiners (``"r,"`` or ``"r.i,"`` entries): replica -> positions that joined."""
    positions: dict[int, set[str]] = {}
    for item in (hint or b"").decode(errors="replace").split(","):
        r, _, i = item.partition(".")
        if r.isdigit() and int(r) < num_replicas:
            positions.setdefault(int(r), set()).add(i)
    return positions


def _well_formed(payload: Optional[str]) -> bool:
    try:
        return payload is not None and isinstance(json.loads(payload), dict)
    except ValueError:
        return False


def _members_never_written(replica: int, number: int, waited: float) -> RecoverError:
    return RecoverError(
        f"replica {replica}: the members of generation {number} were not written within join_timeout + "
        f"store_timeout ({waited:.0f}s; deleted or forged by a client without the job's secret?); this joiner "
        "stops. HINT: its launcher restarts it if restarts remain."
    )


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


class JoinRounds:
    """One replica's part in the rounds that form generations: its join payload, the proposal of the next
    generation, the wait until a round closes and the member list it reads. Made by a connected
    :class:`~lightning_recover.protocol.membership.Membership` for its store and incarnation."""

    def __init__(
        self,
        store: ControlStore,
        replica: int,
        incarnation: int,
        *,
        num_replicas: int,
        inner: int = 0,
        replica_size: int = 1,
        store_timeout: float = 5.0,
        check_health: Callable[[], None] = lambda: None,
        rendezvous: Optional[str] = None,
    ) -> None:
        self.store = store
        self.replica = replica
        self.incarnation = incarnation
        self.num_replicas = num_replicas
        self.inner = inner
        self.replica_size = replica_size
        self.store_timeout = store_timeout
        self._check_health = check_health  # raises once the coordinator is lost or this replica was excluded
        self.rendezvous = rendezvous  # the address of this replica's rendezvous store, where it hosts one
        self.by_view = rounds_by_view(store, replica_size)
        self._reads = RoundReads()  # what this replica's polls of its current round already read

    def _payload(self, payload: dict) -> str:
        """What this replica publishes when it joins a round: ``payload``, its incarnation, its rendezvous store."""
        rendezvous = {} if self.rendezvous is None else {RENDEZVOUS_FIELD: self.rendezvous}
        return json.dumps(dict(payload, inc=self.incarnation, **rendezvous))

    def _say_joined(self, prefix: str) -> None:
        """Add this process to round ``prefix``'s list of whom to look at (not :attr:`by_view`, where
        :func:`joined_round` needs no list)."""
        if not self.by_view:
            me = str(self.replica) if self.replica_size == 1 else f"{self.replica}.{self.inner}"
            self.store.append_hint(f"{prefix}/joined", f"{me},")
            self.store.add(f"{prefix}/joins", 1)  # after the entry: a reader that sees the count sees the entry

    def _excluded(self, why: str) -> ReplicaExcludedError:
        return exclusion_error(self.store, self.replica, self.incarnation, why)

    def state(self, prefix: str, expected: dict[int, int], joined_too: frozenset[int] = frozenset()) -> RoundState:
        """Round ``prefix``'s :func:`~lightning_recover.protocol.rounds.round_state`, from what the store shows (a
        watched view's join or death not shown yet only makes the round wait). ``joined_too``: joins not in the
        view yet (this replica's own, written in the transaction that would close the round)."""
        if self._reads.prefix != prefix:
            self._reads = RoundReads(prefix)
        joined = joined_round(self.store, prefix, self.num_replicas, self.replica_size, self.by_view, self._reads)
        joined |= joined_too
        dead = self._reads.dead(self.store, sorted(set(expected) | joined), expected, set(expected) - joined)
        return round_state(expected, joined, dead)

    def closing_members(self, number: int, expected: dict[int, int]) -> Optional[dict[str, str]]:
        """Round ``number``'s member list if this replica's join is the last one it awaits, as the watched view
        shows the round (etcd, replicas of one process): the list written with the join, if none is yet, by the
        rule :meth:`join` closes a round by. None otherwise (that loop closes it)."""
        if not self.by_view:
            return None
        prefix = f"g{number}"
        state = self.state(prefix, expected, joined_too=frozenset({self.replica}))
        return None if state.awaited else {f"{prefix}/members": json.dumps(state.members)}

    def propose(
        self,
        number: int,
        payload: dict,
        expected: dict[int, int],
        invite: Optional[dict[int, int]] = None,
        settle: Optional[dict[str, str]] = None,
    ) -> None:
        """Propose generation ``number`` (after ``number - 1``, the one this replica leaves) and write this
        replica's join to its round; ``invite``: joiners asked into it; ``settle``: registers written with the
        proposal where absent. Raises ReplicaExcludedError if the group is already past ``number``.

        The proposal, the join payload, the ``events`` hint (bumped by the proposer) and, when this join is the
        last one the round awaits, the member list: one transaction on etcd. A join written into a round already
        closed (the group went on: excluded below) is read by nobody."""
        g = number - 1
        join = {f"g{number}/join/{self.replica}": self._payload(payload)}
        close = None if invite else self.closing_members(number, expected)

        def propose(after: int, where_absent: Optional[dict[str, str]]) -> int:
            found = self.store.compare_set("gen/latest", str(after), str(number), join, "events", where_absent)
            return int(found)

        latest = propose(g, {**(close or {}), **(settle or {})})
        if latest < g:  # gen/latest only grows: an older genuine value was written back. Take it back.
            latest = propose(latest, settle)
        if latest > number:
            raise self._excluded(
                f"fell behind: the group is at generation {latest} and this replica left generation {g}; it stops "
                "here so that it never applies a divergent step."
            )
        for r, inc in (invite or {}).items():
            self.store.set(f"g{number}/invite/{r}", str(inc))

    def join(
        self,
        number: int,
        payload: dict,
        expected: dict[int, int],
        timeout: float,
        may_close: bool = True,
        written: bool = False,
        least: int = 0,
    ) -> Generation:
        """Join round ``number`` and return the generation it closed with (its group not built yet).
        ``expected`` maps the replicas to wait for to their incarnation. ``may_close``: False for a joiner, who
        waits for the members to close the round. ``written``: this replica's join payload is already written
        (with the round's proposal, :meth:`propose`). ``least`` (the job's first round, ``replicas=MIN:MAX``
        with MIN < MAX): the round closes once ``least`` replicas joined and every replica started meanwhile
        did; ids not started are admitted later (this replica, if left out, raises :class:`LeftOutAtStart`)."""
        prefix = f"g{number}"
        mine = f"{prefix}/join/{self.replica}"
        growth = 0 < least < self.num_replicas
        if not written:
            self.store.set(mine, self._payload(payload))
        self._say_joined(prefix)
        deadline = time.monotonic() + timeout
        delay = POLL_MIN
        expected = dict(expected)
        # With a watched view the round is watched, not polled: its reads come from the view (a stale view
        # only makes the round wait a moment longer: joins and deaths are never taken back, and the member
        # list is a register whose compare_set answers the list already written).
        while (listed := self.store.recent_genuine(f"{prefix}/members")) is None:
            self._check_health()
            if self.store.raw.outsiders_can_write and self.store.get_genuine(mine) is None:
                # Deleted or overwritten by a client without the secret: nobody would count this replica.
                print(f"[lightning-recover] replica {self.replica}: wrote again its join payload {mine}", flush=True)
                self.store.set(mine, self._payload(payload))
            if not may_close:
                # A joiner waits for the members, who close the round within their join_timeout; a
                # member list deleted or forged after they read it must not keep it here for ever.
                if time.monotonic() > deadline + self.store_timeout:
                    raise _members_never_written(self.replica, number, timeout + self.store_timeout)
                delay = pause(self.store, delay, len(expected))
                continue
            # At the job's start a replica not started yet has incarnation 0, which no death notice
            # matches: read it again, so one that starts and dies before joining is not waited for
            # until the start-up timeout.
            unstarted = [r for r, inc in expected.items() if inc == 0]
            if unstarted:
                expected.update({r: inc for r, inc in current_incarnations(self.store, unstarted).items() if inc})
            state = self.state(prefix, expected)
            outcome = round_outcome(state, expected, least if growth else 0, time.monotonic() >= deadline)
            if outcome == WAIT:
                delay = pause(self.store, delay, len(expected))
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
            raise LeftOutAtStart()
        if self.replica not in members:
            raise self._excluded(
                f"was left out of generation {number} (the others suspected it dead); it stops here so that it "
                "never applies a divergent step."
            )
        return _generation_listed(self.store, number, members, self.replica)
