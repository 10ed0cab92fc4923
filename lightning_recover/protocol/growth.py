"""Replica ids for newcomers: a launcher that adds replicas to a running job (``--add-replicas N``) does not
need to know which ids are free; the control plane assigns them.

A job of ``replicas=MIN:MAX`` has the ids ``0..MAX-1``. An id is free when its current incarnation (``inc/{r}``)
never started or is declared dead (``dead/{r}``), and no launcher claimed it for an incarnation not started yet.
A launcher claims id r for incarnation ``inc/{r} + 1`` with one ``compare_set`` on the sealed ``claim/{r}``: two
launchers racing for one id cannot both win. The process it starts takes that incarnation (membership's
``connect``), and joins at the next commit with state from a peer, as a restarted replica does
(docs/protocol.md, "Growth"). A claim whose process never started keeps its id until the job ends.
"""

from __future__ import annotations

import secrets
from typing import Any

from lightning_recover.errors import RecoverError
from lightning_recover.protocol.messages import ForgedMessageError, Sealer, peek, read_death


def claim_key(replica: int) -> str:
    return f"claim/{replica}"


def _claimed(store: Any, sealer: Sealer, replica: int) -> tuple[bytes | None, int]:
    raw = peek(store, claim_key(replica))
    if raw is None:
        return None, 0
    try:
        return raw, int(sealer.open(claim_key(replica), raw).split(b":")[0])
    except (ForgedMessageError, ValueError):
        return raw, 0  # planted without the secret: no claim, and the compare_set below replaces it


def claim_free_id(store: Any, sealer: Sealer, replica: int) -> bool:
    """Claim id ``replica`` for its next incarnation if it is free (see the module docstring)."""
    inc = int(store.add(f"inc/{replica}", 0))
    if read_death(sealer, replica, peek(store, f"dead/{replica}") or b"") < inc:
        return False  # running
    raw, claimed = _claimed(store, sealer, replica)
    if claimed > inc:
        return False  # claimed for an incarnation that has not started yet
    # A nonce: two launchers claiming the same incarnation must not write the same sealed bytes (compare_set
    # answers the value it finds, and each would take the other's for its own).
    desired = sealer.seal(claim_key(replica), f"{inc + 1}:{secrets.token_hex(8)}".encode())
    return store.compare_set(claim_key(replica), raw or b"", desired) == desired


def claim_replica_ids(store: Any, sealer: Sealer, replicas: int, count: int) -> list[int]:
    """Claim ``count`` free ids among ``0..replicas-1`` (lowest first); ``RecoverError`` with a HINT if fewer
    are free (the job runs MAX replicas already)."""
    got: list[int] = []
    for r in range(replicas):
        if len(got) == count:
            break
        if claim_free_id(store, sealer, r):
            got.append(r)
    if len(got) < count:
        raise RecoverError(
            f"only {len(got)} of the {count} replica ids asked for are free in this job of at most {replicas} replicas "
            f"(claimed {got}). HINT: the job runs its MAX replicas already; start the job with a larger MAX "
            "(--replicas MIN:MAX) or add fewer."
        )
    return got
