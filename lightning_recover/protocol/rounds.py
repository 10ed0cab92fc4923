"""When a join round closes, and with whom: the rule, with no store (the reads are join_rounds.py's).

A round (a generation forming) waits for the replicas it *expects* (``replica -> incarnation``: the survivors
of the last generation, the joiners a commit admitted, or at the job's start every replica). A replica is out
of the round once it *joined* or was *declared dead*; the round closes when nobody it expects is left, and
its members are those that joined and are not dead. At the job's start with ``replicas=MIN:MAX`` (*growth*)
the round closes once ``least`` replicas joined and every replica that started meanwhile did: ids never
started are admitted later, as newcomers. Past its deadline a round closes with whoever joined, unless
growth left it short of ``least`` (the job cannot start).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

WAIT, CLOSE, SHORT = "wait", "close", "short"


@dataclass(frozen=True)
class RoundState:
    """Whom a round still awaits and who its members would be were it closed now."""

    awaited: frozenset[int]
    members: list[int]


def round_state(expected: Collection[int], joined: Collection[int], dead: Collection[int]) -> RoundState:
    """The round's state: expected replicas neither joined nor dead; the joined ones not dead, sorted."""
    joined, dead = set(joined), set(dead)
    return RoundState(frozenset(set(expected) - joined - dead), sorted(joined - dead))


def round_outcome(state: RoundState, expected: dict[int, int], least: int, past_deadline: bool) -> str:
    """:data:`WAIT`, :data:`CLOSE` or :data:`SHORT` (past the deadline with fewer than ``least`` members).

    Args:
        state: :func:`round_state` of the round now.
        expected: replica -> incarnation expected (0: not started yet, at the job's start).
        least: at the job's start with ``replicas=MIN:MAX``, MIN (0 otherwise: every expected replica counts).
        past_deadline: the round's timeout has passed.

    Returns:
        What the round does now.
    """
    growth = least > 0
    short = growth and len(state.members) < least
    awaited = state.awaited
    if growth and not short:
        awaited = frozenset(r for r in awaited if expected[r])  # enough in: ids not started are not waited for
    if (awaited or short) and not past_deadline:
        return WAIT
    return SHORT if short else CLOSE
