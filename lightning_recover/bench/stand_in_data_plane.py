"""The data plane of the scale harness, stood in for: replicas as threads of one process meet in memory.

What it stands in for is gloo: a generation's process group (its build waits until every member came, as a
rendezvous does) and its collectives (an all-reduce completes once every member of the group started it,
with the sum of their tensors in each). A member killed by the harness fails every operation of every group
it belongs to at once, as its closed sockets fail gloo's; a member that stops without being killed (hung)
leaves the others' operations waiting, as gloo does, until the control plane tells them (a death notice).

Why a stand-in: gloo's full mesh among N members of one process is N x (N - 1) sockets and a thread pool per
member; at the harness's hundreds of replicas on 2 cores that measures gloo, not the control plane. Everything
the control plane does around it (the generation's membership, the barrier's place in the commit rule, the
failure checks between slices of a wait) runs unchanged: :class:`StandInGroups` is what
``Membership.groups`` holds instead of a ``ProcessGroups``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_recover.errors import MembershipChanged

_SLICE = 0.005  # seconds a build waits between two looks for a failure of the generation


class PeerClosed(RuntimeError):
    """A member of the group died: what gloo raises when a peer's sockets close."""


class _Work:
    """One started collective: a torch future, completed by the last member to start it."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> bool:
        self.future.wait()  # raises the operation's error
        return True


class _Meeting:
    """Generation ``number``'s group: who came (rank -> replica), its operations in start order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ranks: dict[int, int] = {}
        self.ops: dict[int, dict[int, tuple[torch.Tensor, _Work]]] = {}  # op index -> rank -> (tensor, work)
        self.started: dict[int, int] = {}  # rank -> operations it started
        self.broken: str | None = None


class StandInDataPlane:
    """The data plane every replica thread of one job shares."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._meetings: dict[int, _Meeting] = {}
        self._dead: set[int] = set()
        self.operations = 0  # collectives completed (a check that the reduce ran)

    def kill(self, replica: int) -> None:
        """``replica``'s process died: every operation of a group it belongs to fails now, and later ones at once."""
        failed: list[_Work] = []
        why = f"replica {replica} died (its connections closed)"
        with self._lock:
            self._dead.add(replica)
            for meeting in self._meetings.values():
                if replica in meeting.ranks.values() and meeting.broken is None:
                    meeting.broken = why
                    failed += [work for op in meeting.ops.values() for _, work in op.values()]
                    meeting.ops.clear()
            self._lock.notify_all()
        for work in failed:
            if not work.future.done():
                work.future.set_exception(PeerClosed(f"stand-in gloo: {why}"))

    def build(self, replica: int, number: int, rank: int, size: int, failure_seen: Callable[[], bool]) -> _Meeting:
        """Wait until all ``size`` members of generation ``number`` came; MembershipChanged if one fails first."""
        with self._lock:
            meeting = self._meetings.setdefault(number, _Meeting(size))
            meeting.ranks[rank] = replica
            self._lock.notify_all()
            while len(meeting.ranks) < size and meeting.broken is None:
                gone = self._dead & set(meeting.ranks.values())
                if gone:
                    meeting.broken = f"replica {min(gone)} died before the group was built"
                    break
                self._lock.wait(_SLICE)
                self._lock.release()
                try:
                    seen = failure_seen()
                finally:
                    self._lock.acquire()
                if seen:
                    raise MembershipChanged(f"a member of generation {number} failed while it was being built")
            if meeting.broken is not None:
                raise MembershipChanged(f"building generation {number} failed: {meeting.broken}")
            # Groups of generations before the newest this member built are never used again: forget them.
            for old in [n for n in self._meetings if n < number - 2]:
                del self._meetings[old]
            return meeting

    def allreduce(self, meeting: _Meeting, rank: int, tensor: torch.Tensor) -> _Work:
        """Start this member's part of the group's next all-reduce (a sum, in place)."""
        work = _Work()
        done: list[tuple[torch.Tensor, _Work]] = []
        with self._lock:
            index = meeting.started.get(rank, 0)
            meeting.started[rank] = index + 1
            if meeting.broken is not None:
                error: BaseException | None = PeerClosed(f"stand-in gloo: {meeting.broken}")
            else:
                error = None
                op = meeting.ops.setdefault(index, {})
                op[rank] = (tensor, work)
                if len(op) == meeting.size:
                    done = list(meeting.ops.pop(index).values())
                    self.operations += 1
        if error is not None:
            work.future.set_exception(error)
            return work
        if done:
            total = torch.stack([t for t, _ in done]).sum(0)
            for t, w in done:
                t.copy_(total)
                w.future.set_result([t])
        return work


class _Group:
    """What ``Generation.pg`` holds: this member's handle on its generation's meeting."""

    def __init__(self, plane: StandInDataPlane, meeting: _Meeting, rank: int) -> None:
        self._plane, self._meeting, self._rank = plane, meeting, rank

    def allreduce(self, tensors: Sequence[torch.Tensor], *_: Any) -> _Work:
        (tensor,) = tensors
        return self._plane.allreduce(self._meeting, self._rank, tensor)

    def size(self) -> int:
        return self._meeting.size

    def rank(self) -> int:
        return self._rank


class StandInGroups:
    """What one replica's ``Membership.groups`` holds instead of a ``ProcessGroups``: builds meet in memory."""

    def __init__(self, plane: StandInDataPlane, replica: int) -> None:
        self._plane, self._replica = plane, replica

    @property
    def abandoned_work(self) -> bool:
        return False  # nothing of gloo's to end without destructors

    @property
    def abandoned_alive(self) -> int:
        return 0

    def started(self, pg: Any, works: list) -> None:
        """Nothing to remember: an abandoned stand-in group holds no threads or sockets."""

    def abandon(self, pg: Any) -> None:
        """Nothing to tear down (see :meth:`started`)."""

    def release(self, pg: Any) -> bool:
        """Nothing to tear down: the group may be dropped (see :meth:`started`)."""
        return True

    def build(self, store: Any, number: int, rank: int, size: int, failure_seen: Callable[[], bool]) -> _Group:
        """Generation ``number``'s group, once all its members came (``store``, the rendezvous, is not used)."""
        meeting = self._plane.build(self._replica, number, rank, size, failure_seen)
        return _Group(self._plane, meeting, rank)
