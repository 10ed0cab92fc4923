"""The K processes of a sharded replica go on in a generation together, or none of them does.

Each process of a replica builds its own inner position's group of a generation, and (as a joiner or the
member that hands the state over) broadcasts on it. One process may fail there while its mates succeed: a
member of its position died mid-build, and the peers it had already connected to did not notice. A process
that failed forms the next generation; a mate that went on alone would start the replica's next microbatch,
whose FSDP collectives wait inside the replica for the process that left: the replica hangs until the
collective timeout and is left out of the next generation.

So after each such operation every process of the replica publishes its outcome under the generation, and
goes on only once all K succeeded; if one failed, all of them form the next generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Optional

from lightning_recover.errors import MembershipChanged, RecoverError
from lightning_recover.protocol.messages import ControlStore
from lightning_recover.protocol.polling import POLL_MIN, pause

SUCCEEDED = "ok"
FAILED = "failed"

GO = "go"
WAIT = "wait"
STOP = "stop"


def agreement_outcome(outcomes: Sequence[Optional[str]], incarnation: int) -> str:
    """What a process does with its mates' published outcomes (``"{incarnation}:{ok|failed}"``, None: not yet):
    :data:`STOP` once any process of this incarnation failed, :data:`GO` once all succeeded, else :data:`WAIT`.
    An outcome of another incarnation (a forged or earlier value) counts as not published."""
    mine = [o.partition(":")[2] for o in outcomes if o is not None and o.partition(":")[0] == str(incarnation)]
    if FAILED in mine:
        return STOP
    if len(mine) == len(outcomes) and all(o == SUCCEEDED for o in mine):
        return GO
    return WAIT


class ReplicaAgreement:
    """One process's part in its replica's agreements (replicas of K > 1 processes)."""

    def __init__(
        self,
        store: ControlStore,
        replica: int,
        incarnation: int,
        inner: int,
        replica_size: int,
        check_health: Callable[[], None],
        timeout: float,
    ) -> None:
        self.store = store
        self.replica = replica
        self.incarnation = incarnation
        self.inner = inner
        self.replica_size = replica_size
        self._check_health = check_health  # raises once this replica was excluded or the coordinator is lost
        self.timeout = timeout

    def _key(self, number: int, what: str, inner: int) -> str:
        return f"g{number}/agree/{what}/{self.replica}.{inner}"

    def settle(self, number: int, what: str, succeeded: bool) -> None:
        """Publish this process's outcome of ``what`` in generation ``number``. A process that failed returns at
        once (it raises its own failure); one that succeeded returns once every process of the replica did, and
        raises :class:`MembershipChanged` once one of them failed: all of them then form the next generation.

        Only the outcomes decide, never a failure of the generation seen meanwhile: a mate that read every
        outcome goes on in this generation, and so must this process (the generation's next collective fails
        for all of them alike). A mate that died or hangs gets this replica declared dead (``check_health``
        raises); one that published nothing within ``timeout`` ends this process with a RecoverError."""
        self.store.set(self._key(number, what, self.inner), f"{self.incarnation}:{SUCCEEDED if succeeded else FAILED}")
        if not succeeded:
            return
        keys = [self._key(number, what, i) for i in range(self.replica_size)]
        deadline = time.monotonic() + self.timeout
        delay = POLL_MIN
        while (decided := agreement_outcome(self.store.genuine_many(keys), self.incarnation)) == WAIT:
            self._check_health()
            if time.monotonic() > deadline:
                raise RecoverError(
                    f"replica {self.replica} process {self.inner}: a process of this replica published no outcome of "
                    f"{what} in generation {number} within {self.timeout:g}s although none was declared dead; this "
                    "process stops so that the replica never computes without it"
                )
            delay = pause(self.store, delay)
        if decided == STOP:
            raise MembershipChanged(f"a process of replica {self.replica} failed at {what} in generation {number}")
