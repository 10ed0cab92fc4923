"""A step's commit vouches for the generation's members: one record instead of every member's heartbeat.

Why: on etcd every heartbeat is a Raft write that every etcd member applies and every watcher receives;
Session 9 measured 4.27 writes per step in steady state at a 0.24 s step, about 3.3 of them heartbeats. A
``commit`` of a step (etcd, replicas of one process) is written only once every member of the generation
passed the done barrier after its reduce (``decisions.py``): it proves that each member was alive and its
main thread progressing a moment before. So the leader's commit transaction also writes ``vouch``: sealed,
naming the generation's members and their incarnations, under a sequence that only grows (the generation in
the high bits, the leader's count of vouches in it below), and only if that transaction decided (a ``retry``
that landed first vouches for nobody).

* The monitor (``coordinator.run_monitor``) counts a fresh, genuine vouch as a beat and as progress of every
  member it names, at the moment it reads it; the partition judge counts it as progress of the group.
* A replica's heartbeat thread (``membership.Heartbeat``) skips its beat while a vouch naming its incarnation
  reached this process's watched view less than a period ago. Beats and vouches are then never further apart
  than a period plus the difference between two processes' delivery of one watch event.
* While steps are shorter than the heartbeat period no replica writes a beat of its own; at longer steps
  beats go on, less those a commit covered.

What a vouch cannot do: keep a replica alive whose main thread stopped (no generation with that member
commits), or make an old record count again (one whose sequence is not above the newest a reader accepted
credits nobody, so a replay is worthless).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from lightning_recover.errors import ForgedMessageError
from lightning_recover.protocol.messages import Sealer, sequence

VOUCH_KEY = "vouch"


@dataclass(frozen=True)
class Vouch:
    sequence: int
    generation: int
    incarnations: dict[int, int]  # replica -> incarnation the commit vouches for


def vouch_record(generation: int, count: int, incarnations: Mapping[int, int]) -> tuple[str, str, int]:
    """``(key, payload, sequence)`` of the leader's ``count``-th vouch in ``generation`` (counted from 1)."""
    payload = json.dumps({"gen": generation, "members": {str(r): i for r, i in sorted(incarnations.items())}})
    return VOUCH_KEY, payload, sequence(generation, count)


def open_vouch(sealer: Sealer, raw: bytes) -> Optional[Vouch]:
    """The vouch in ``raw``, or None if it is not genuine or not well formed (it counts for nobody)."""
    try:
        seq, payload = sealer.open_sequenced(VOUCH_KEY, raw)
        body = json.loads(payload)
        members = {int(r): int(i) for r, i in body["members"].items()}
        return Vouch(seq, int(body["gen"]), members)
    except (ForgedMessageError, ValueError, TypeError, KeyError, AttributeError):
        return None


class VouchReader:
    """A reader's newest accepted vouch: :meth:`newer` returns only one whose sequence is above it."""

    def __init__(self, sealer: Sealer) -> None:
        self.sealer = sealer
        self.sequence = -1
        self._raw: Optional[bytes] = None  # the raw value last opened (a view answers the same one many times)

    def newer(self, raw: Optional[bytes]) -> Optional[Vouch]:
        if raw is None or raw == self._raw:
            return None
        self._raw = raw
        vouch = open_vouch(self.sealer, raw)
        if vouch is None or vouch.sequence <= self.sequence:
            return None
        self.sequence = vouch.sequence
        return vouch
