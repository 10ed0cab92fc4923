"""A step's commit vouches for the generation's members: one record instead of every member's heartbeat.

Why: on etcd every heartbeat is a Raft write that every etcd member applies and every watcher receives;
in the steady state most of a step's writes were heartbeats (benchmarks/figures/etcdperf.md). A
``commit`` of a step (etcd, replicas of one process) is written only once every member of the generation
passed the done barrier after its reduce (``decisions.py``): it proves that each member was alive and its
main thread progressing a moment before. So the leader's commit transaction also writes ``vouch``: sealed,
naming the generation's members and their incarnations, under a sequence that only grows (the generation in
the high bits, the leader's count of vouches in it below), and only if that transaction decided (a ``retry``
that landed first vouches for nobody).

* The monitor (``coordinator.run_monitor``) counts a fresh, genuine vouch as a beat and as progress of every
  member it names, at the moment it reads it; the partition judge counts it as progress of the group.
* A replica's heartbeat thread (``heartbeat.Heartbeat``) skips its beat while a vouch naming its incarnation
  reached this process's watched view less than a period ago. Beats and vouches are then never further apart
  than a period plus the difference between two processes' delivery of one watch event.
* While steps are shorter than the heartbeat period no replica writes a beat of its own; at longer steps
  beats go on, less those a commit covered.

What a vouch cannot do: keep a replica alive whose main thread stopped (no generation with that member
commits), or make an old record count again (one whose sequence is not above the newest a reader accepted
credits nobody, so a replay is worthless).

A vouch names only its generation, not the members and their incarnations: its size is the same at 4 and at
16,000 replicas, and every process's watched view receives it each step (naming every member it was 99
bytes sealed at 4 replicas and 20,957 at 2,000). A reader learns whom generation G vouches for from G's
round, once per generation (:class:`Roster`): its member list and each member's join payload (written
before the round closed, so before any commit of G, and held by the reader's watched view).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_recover.errors import ForgedMessageError
from lightning_recover.protocol.backend import ControlPlane
from lightning_recover.protocol.messages import Sealer, peek_all, sequence

VOUCH_KEY = "vouch"
_GENERATIONS_KEPT = 4  # rosters a reader keeps (a vouch of an older generation is a replay anyway)


@dataclass(frozen=True)
class Vouch:
    sequence: int
    generation: int
    incarnations: dict[int, int]  # replica -> incarnation the commit vouches for


def vouch_record(generation: int, count: int) -> tuple[str, str, int]:
    """``(key, payload, sequence)`` of the leader's ``count``-th vouch in ``generation`` (counted from 1)."""
    return VOUCH_KEY, json.dumps({"gen": generation}), sequence(generation, count)


def raw_reader(store: ControlPlane) -> Callable[[Sequence[str]], list[Optional[bytes]]]:
    """How a :class:`Roster` reads raw values from ``store``: from its watched view while that is current,
    else in one read that never waits."""

    def read(keys: Sequence[str]) -> list[Optional[bytes]]:
        found = store.cached_each(list(keys))
        return found if found is not None else peek_all(store, list(keys))

    return read


class Roster:
    """Whom each generation's commits vouch for: ``{replica: incarnation}`` from the generation's sealed member
    list and its members' join payloads, read once per generation through ``read`` (raw values, None absent)."""

    def __init__(self, sealer: Sealer, read: Callable[[Sequence[str]], list[Optional[bytes]]]) -> None:
        self.sealer = sealer
        self._read = read
        self._known: dict[int, dict[int, int]] = {}

    def of(self, generation: int) -> Optional[dict[int, int]]:
        """Generation ``generation``'s members and incarnations; None while its round cannot be read whole
        (not closed yet, or a value forged: such a vouch counts for nobody)."""
        if generation in self._known:
            return self._known[generation]
        try:
            (listed,) = self._read([f"g{generation}/members"])
            if listed is None:
                return None
            members = [int(r) for r in json.loads(self.sealer.open(f"g{generation}/members", listed))]
            keys = [f"g{generation}/join/{r}" for r in members]
            payloads = self._read(keys)
            if any(p is None for p in payloads):
                return None
            found = {r: int(json.loads(self.sealer.open(k, p))["inc"]) for r, k, p in zip(members, keys, payloads)}
        except (ForgedMessageError, ValueError, TypeError, KeyError, AttributeError):
            return None
        self._known[generation] = found
        for old in sorted(self._known)[:-_GENERATIONS_KEPT]:
            del self._known[old]
        return found


def open_vouch(sealer: Sealer, raw: bytes, roster: Roster) -> Optional[Vouch]:
    """The vouch in ``raw`` with whom it vouches for (``roster``), or None if it is not genuine or not well
    formed (it counts for nobody)."""
    try:
        seq, payload = sealer.open_sequenced(VOUCH_KEY, raw)
        body = json.loads(payload)
        generation = int(body["gen"])
        if seq >> 32 != generation:  # the sequence carries the generation: a vouch of another one is forged
            return None
    except (ForgedMessageError, ValueError, TypeError, KeyError, AttributeError):
        return None
    members = roster.of(generation)
    return Vouch(seq, generation, members) if members is not None else None


class VouchReader:
    """A reader's newest accepted vouch: :meth:`newer` returns only one whose sequence is above it, with whom it
    vouches for (read through ``roster`` once per generation)."""

    def __init__(self, sealer: Sealer, roster: Roster) -> None:
        self.sealer = sealer
        self.roster = roster
        self.sequence = -1
        self._raw: Optional[bytes] = None  # the raw value last opened (a view answers the same one many times)

    def newer(self, raw: Optional[bytes]) -> Optional[Vouch]:
        if raw is None or raw == self._raw:
            return None
        vouch = open_vouch(self.sealer, raw, self.roster)
        if vouch is None:
            return None  # read again next time: its generation's round may be readable then
        self._raw = raw
        if vouch.sequence <= self.sequence:
            return None
        self.sequence = vouch.sequence
        return vouch
