"""How the protocol's waits poll the control plane: short sleeps that double up to :data:`POLL_MAX`, or a wait on
the watched view where the backend has one, so that a failure is noticed within :data:`SLICE` of any blocked
wait, never after a long timeout."""

from __future__ import annotations

import time

from lightning_recover.protocol.messages import ControlStore

POLL_MIN = 0.0005
POLL_MAX = 0.005
SLICE = 0.01  # longest a blocked wait goes without looking for failures


#: Members of a round that all poll every ``POLL_MAX`` at most; a larger round polls less often each.
POLL_PEERS = 16


def round_poll_max(members: int) -> float:
    """The longest pause between two polls of a round of ``members``: ``POLL_MAX`` up to ``POLL_PEERS``
    members, then growing with them, so the coordinator serves a round's polls at the rate of ``POLL_PEERS``
    members whatever the round's size (the round is seen closed at most one such pause later)."""
    return POLL_MAX * max(1.0, members / POLL_PEERS)


def backoff(delay: float, ceiling: float = POLL_MAX) -> float:
    """Sleep ``delay`` and return the next, doubled up to ``ceiling``."""
    time.sleep(delay)
    return min(delay * 2, ceiling)


def pause(store: ControlStore, delay: float, ceiling: float = POLL_MAX) -> float:
    """Between two polls of a round: until the watched view moves (at most ``POLL_MAX``) where the backend
    has one, else a sleep that doubles up to ``ceiling`` (:func:`round_poll_max`); the next pause's length."""
    if store.raw.views:
        store.wait_changed(POLL_MAX)
        return delay
    return backoff(delay, ceiling)
