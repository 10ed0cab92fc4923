"""How the protocol's waits poll the control plane: short sleeps that double up to :data:`POLL_MAX`, or a wait on
the watched view where the backend has one, so that a failure is noticed within :data:`SLICE` of any blocked
wait, never after a long timeout (a round's members within :data:`ROUND_POLL_MAX`)."""

from __future__ import annotations

import time

from lightning_recover.protocol.messages import ControlStore

POLL_MIN = 0.0005
POLL_MAX = 0.005
SLICE = 0.01  # longest a blocked wait goes without looking for failures
#: Longest pause between two polls of a round on the embedded coordinator: every member polls until the last joiner
#: closes the round, so N members poll N / ROUND_POLL_MAX times a second (a few requests each); a member sees the
#: member list, a death or a deadline within this.
ROUND_POLL_MAX = 0.05


def backoff(delay: float, cap: float = POLL_MAX) -> float:
    """Sleep ``delay`` and return the next, doubled up to ``cap``."""
    time.sleep(delay)
    return min(delay * 2, cap)


def pause(store: ControlStore, delay: float) -> float:
    """Between two polls of a round: until the watched view moves (at most ``POLL_MAX``) where the backend has
    one, else a sleep that doubles up to :data:`ROUND_POLL_MAX`; the next pause's length. Not a wait in the
    coordinator: TCPStore waits in slices were seen to stall for the store's timeout (docs/control_plane.md)."""
    if store.raw.views:
        store.wait_changed(POLL_MAX)
        return delay
    return backoff(delay, ROUND_POLL_MAX)
