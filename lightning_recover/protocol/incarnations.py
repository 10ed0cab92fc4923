"""A replica id's incarnations: the next one taken at a start (never while another live process holds the id),
which ones the group declared dead, and the error that stops one the group went on without.

A replica's incarnation counts its starts (``inc/{replica}``); the launcher, an agent or the monitor declares an
incarnation dead (the death notices, ``ControlStore.deaths``) and nothing it says afterwards counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from lightning_recover import env
from lightning_recover.errors import RecoverError, ReplicaExcludedError
from lightning_recover.protocol.messages import ControlStore
from lightning_recover.protocol.polling import POLL_MIN, backoff
from lightning_recover.protocol.reachability import fence_reason


def refuse_if_id_in_use(store: ControlStore, replica: int, num_replicas: int, heartbeat_interval: float) -> None:
    """Refuse to start while another live process holds this replica id (a hand-started
    duplicate): its incarnation is not declared dead and its heartbeat still moves. A restart
    is never refused: the launcher or the agent declares the old incarnation dead when it exits."""
    key = f"hb/{replica}"

    def beat() -> tuple[int, int]:
        found = store.get_fresh(key)  # a replayed heartbeat is no sign of life
        hb = json.loads(found[1]) if found else {}
        return int(hb.get("inc", 0)), int(hb.get("beat", 0))

    inc, first = beat()
    if inc == 0 or store.deaths([replica])[replica] >= inc:
        return
    deadline = time.monotonic() + 3 * heartbeat_interval + 0.5
    while time.monotonic() < deadline:
        time.sleep(heartbeat_interval)
        now_inc, now = beat()
        if now_inc == inc and now > first and store.deaths([replica])[replica] < inc:
            raise RecoverError(
                f"replica id {replica} is already in use by a live process of this job (incarnation {inc} "
                f"is heartbeating). HINT: give each process a distinct {env.REPLICA} in 0..{num_replicas - 1};"
                " a replica restarts only after its previous process ended."
            )


def sharded_incarnation(store: ControlStore, replica: int, inner: int, startup_timeout: float) -> int:
    """All K processes of a replica (re)start together: position 0 bumps the replica's counter,
    the others wait until it reaches their own position's count."""
    mine = store.add(f"inc/{replica}/i{inner}", 1)
    if inner == 0:
        return store.add(f"inc/{replica}", 1)
    deadline = time.monotonic() + startup_timeout
    delay = POLL_MIN
    while store.add(f"inc/{replica}", 0) < mine:
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {replica}: process 0 did not start within {startup_timeout}s")
        delay = backoff(delay)
    return mine


def declared_dead(
    store: ControlStore, replicas: Sequence[int], incarnations: dict[int, int], recent: bool = False
) -> set[int]:
    """The ``replicas`` whose incarnation in ``incarnations`` was declared dead. ``recent``: from reads that may be
    a moment stale (a watched view)."""
    if not replicas:
        return set()
    return dead_among(replicas, incarnations, store.deaths(replicas, recent=recent))


def dead_among(replicas: Sequence[int], incarnations: dict[int, int], deaths: dict[int, int]) -> set[int]:
    """The ``replicas`` whose incarnation is at or below the one their death notice declared (``deaths``)."""
    # Incarnation 0 = not started yet (only during the first formation): not dead.
    return {r for r in replicas if 0 < incarnations.get(r, 1 << 30) <= deaths[r]}


def current_incarnations(store: ControlStore, replicas: Sequence[int]) -> dict[int, int]:
    """Each replica's latest incarnation (0: never started)."""
    values = store.call(store.raw.multi_get, [f"inc/{r}" for r in replicas])
    return {r: int(v) for r, v in zip(replicas, values)}


def others_gone(store: ControlStore, replica: int, num_replicas: int) -> bool:
    """Every other replica's current incarnation is declared dead or never started (or there is no other
    replica): the job is over. With ``replicas=MIN:MAX`` ids above those started may never be used."""
    others = [r for r in range(num_replicas) if r != replica]
    incarnations = current_incarnations(store, others)
    started = [r for r in others if incarnations[r] > 0]
    return len(declared_dead(store, started, incarnations)) == len(started)


#: Why a replica stops when its death notice is what it noticed (see :func:`exclusion_error`).
DECLARED_DEAD = (
    "was declared dead by the group (missed heartbeats or stalled) and must not apply further steps; it "
    "stops here. HINT: raise heartbeat_timeout/hang_timeout if this replica was only slow."
)


def exclusion_error(store: ControlStore, replica: int, incarnation: int, why: str) -> ReplicaExcludedError:
    """The error that stops a replica once the group went on without it, however it noticed (its death
    notice, a member list without it, a newer generation): a replica fenced for a network partition names
    the partition (:func:`~lightning_recover.protocol.reachability.fence_reason`), whichever it noticed
    first; otherwise ``why``."""
    partition = fence_reason(store, replica, incarnation)
    return ReplicaExcludedError(f"replica {replica} {partition or why}")
