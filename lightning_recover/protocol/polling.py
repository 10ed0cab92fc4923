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
#: Polls a second that the members of a job, all waiting, ask of a coordinator without a watched view at most (each
#: a request or a few): N members polling every :data:`SLICE` would ask N / SLICE, which grows with the job.
JOB_POLLS_PER_S = 2000.0


def member_poll_period(members: int) -> float:
    """The shortest period between two polls of one member such that ``members`` members polling together ask the
    coordinator :data:`JOB_POLLS_PER_S` times a second at most (under :data:`SLICE` up to 20 members)."""
    return members / JOB_POLLS_PER_S


def wait_slice(members: int, reads_from_view: bool) -> float:
    """How long a member's wait in the store (for a decision) lasts before it looks for failures: :data:`SLICE`, or
    where each wait is a request to the coordinator, the :func:`member_poll_period` when longer (a wait returns as
    soon as its key is written: only a failure is noticed that much later)."""
    return SLICE if reads_from_view else max(SLICE, member_poll_period(members))


class PollGate:
    """Whether a member's wait may poll the coordinator now: at once where reads come from the watched view (no
    round trip), else once per :func:`member_poll_period`, so a failure is noticed within that period (plus
    :data:`SLICE`) and the job's polls do not grow with it."""

    def __init__(self) -> None:
        self._next = 0.0

    def due(self, members: int, reads_from_view: bool, now: float) -> bool:
        """At ``now`` (``time.monotonic()``), in a generation of ``members``: poll, or not yet."""
        if reads_from_view:
            return True
        if now < self._next:
            return False
        self._next = now + member_poll_period(members)
        return True


def backoff(delay: float, cap: float = POLL_MAX) -> float:
    """Sleep ``delay`` and return the next, doubled up to ``cap``."""
    time.sleep(delay)
    return min(delay * 2, cap)


def pause(store: ControlStore, delay: float, members: int = 0) -> float:
    """Between two polls of a round of ``members``: until the watched view moves (at most ``POLL_MAX``) where the
    backend has one, else a sleep that doubles up to :data:`ROUND_POLL_MAX` or the round's
    :func:`member_poll_period`, the longer; the next pause's length. Not a wait in the coordinator: TCPStore waits
    in slices were seen to stall for the store's timeout (docs/control_plane.md)."""
    if store.raw.views:
        store.wait_changed(POLL_MAX)
        return delay
    return backoff(delay, max(ROUND_POLL_MAX, member_poll_period(members)))
