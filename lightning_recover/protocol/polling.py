"""How the protocol's waits poll the control plane: short sleeps that double up to :data:`POLL_MAX`, or a wait on
the watched view where the backend has one, so that a failure is noticed within :data:`SLICE` of any blocked
wait, never after a long timeout; a round's members wait in the coordinator for the round's member list, and
notice a failure within :data:`ROUND_WAIT_MAX`."""

from __future__ import annotations

import time

from lightning_recover.protocol.messages import ControlStore

POLL_MIN = 0.0005
POLL_MAX = 0.005
SLICE = 0.01  # longest a blocked wait goes without looking for failures
#: Longest a round's member blocks in the coordinator between two polls: the last joiner closes the round and its
#: member list ends every wait at once; a death or a deadline (which writes no list) is seen within this.
ROUND_WAIT_MAX = 0.2


def backoff(delay: float) -> float:
    """Sleep ``delay`` and return the next, doubled up to ``POLL_MAX``."""
    time.sleep(delay)
    return min(delay * 2, POLL_MAX)


def pause(store: ControlStore, closes_with: str, delay: float) -> float:
    """Between two polls of a round that ends when ``closes_with`` is written: until the watched view moves (at
    most ``POLL_MAX``) where the backend has one; else a wait in the coordinator that ends when the key is
    written or after ``delay``, doubled up to :data:`ROUND_WAIT_MAX` (a poll every few milliseconds by each of N
    members would be the coordinator's whole request rate at a few hundred replicas). The next pause's length."""
    if store.raw.views:
        store.wait_changed(POLL_MAX)
        return delay
    if store.wait(closes_with, delay):
        # Written since the caller read it, or there but not genuine (forged): pause like a poll then, so that
        # a forged key never makes the round spin.
        time.sleep(min(delay, POLL_MAX))
    return min(delay * 2, ROUND_WAIT_MAX)
