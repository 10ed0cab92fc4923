"""Join requests: a replica outside the group asks to be admitted, and members read who asks (restarted
replicas, standbys that took a dead replica's place, newcomers of a growing job). A request is the sealed
``join/{replica}`` (its incarnation); the leader admits the pending ones at a commit, which invites them into
the next generation's round (``g{G}/invite/{replica}``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning_recover.protocol.incarnations import declared_dead, others_gone
from lightning_recover.protocol.messages import ControlStore
from lightning_recover.protocol.polling import POLL_MIN, backoff
from lightning_recover.protocol.reachability import wait_until_reachable

#: a counter every join request adds one to (``add``; the requests themselves are sealed ``join/{r}``)
JOIN_REQUESTS = "join/requests"


class JoinRequests:
    """This replica's join requests, and its reads of everyone's. Made by a connected
    :class:`~lightning_recover.protocol.membership.Membership` for its store and incarnation."""

    def __init__(
        self,
        store: ControlStore,
        replica: int,
        incarnation: int,
        *,
        num_replicas: int,
        inner: int = 0,
        check_health: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.replica = replica
        self.incarnation = incarnation
        self.num_replicas = num_replicas
        self.inner = inner
        self._check_health = check_health  # raises once the coordinator is lost or this replica was excluded
        self.requested_at = 0.0  # wall time of this process's last join request
        self._seen = -1  # the request counter when the last look found none pending

    def _job_over(self) -> bool:
        return others_gone(self.store, self.replica, self.num_replicas)

    def request(self) -> None:
        """Ask the group to admit this (restarted) replica at its next commit."""
        if self.incarnation > 1:
            # Our previous incarnation is certainly dead: say so now rather than after heartbeats.
            self.store.mark_dead(self.replica, self.incarnation - 1)
        # Cut off from the members' data network, joining would only stall their next generation.
        wait_until_reachable(self.store, self.replica, self.num_replicas, 1.0, self._job_over)
        self.store.set(f"join/{self.replica}", str(self.incarnation))
        self.store.add(JOIN_REQUESTS, 1)  # after the request: whoever reads the new count reads the request too
        self.requested_at = time.time()
        if self.inner == 0:
            print(f"[lightning-recover] replica {self.replica}: asks to join at the next commit", flush=True)

    def pending(self, members: dict[int, int], recent: bool = False) -> dict[int, int]:
        """Join requests not yet admitted (``members``: the current generation's ``{replica: incarnation}``) and
        still alive: ``{replica: incarnation}``. ``recent``: from reads that may be a moment stale (a request made
        meanwhile is admitted at the next commit).

        Read by the leader at every commit: one counter read while nobody asks, the N requests only when the
        counter moved or a request is still pending (a forged count only costs a look)."""
        counted = self.store.recent_count(JOIN_REQUESTS) if recent else self.store.add(JOIN_REQUESTS, 0)
        if counted == self._seen:
            return {}
        latest: dict[int, int] = {}
        read = self.store.recent_genuine if recent else self.store.get_genuine
        for r in range(self.num_replicas):
            asked = read(f"join/{r}")
            if asked is not None:
                latest[r] = int(asked)
        wanted = {r: inc for r, inc in latest.items() if members.get(r) != inc}
        dead = declared_dead(self.store, sorted(wanted), wanted, recent=recent)
        pending = {r: inc for r, inc in wanted.items() if r not in dead}
        self._seen = -1 if pending else counted  # one pending: look again (admitted, or dead)
        return pending

    def wait_for_invitation(self) -> int:
        """Wait until members invite this replica into a generation; that generation's number (its round is
        joined next). Ends the process (``SystemExit(0)``) if the job ends first."""
        delay = POLL_MIN
        while True:
            # Job over first: with K processes per replica, the first one to leave marks this
            # incarnation gone, which its mates must not read as an exclusion.
            if self._job_over():
                print(f"[lightning-recover] replica {self.replica}: the job ended before it could rejoin", flush=True)
                raise SystemExit(0)
            self._check_health()
            latest = self.store.generation()
            if self.store.get_genuine(f"g{latest}/invite/{self.replica}") == str(self.incarnation):
                return latest
            if self.store.get_genuine(f"join/{self.replica}") != str(self.incarnation):
                self.request()  # the request was deleted or overwritten: nobody would admit this replica
            delay = backoff(delay)
