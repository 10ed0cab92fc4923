"""Microbatch quota planning.

Every optimizer step covers exactly ``M`` global microbatches with ids ``0..M-1``. The planner
decides which replica computes which ids. It is a pure, deterministic function: every replica
computes the same plan from the same inputs, so no plan is ever sent over the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def plan_quotas(
    step: int,
    microbatch_ids: Sequence[int],
    members: Sequence[int],
    weights: Mapping[int, float] | None = None,
) -> dict[int, list[int]]:
    """Split ``microbatch_ids`` among ``members``.

    Args:
        step: the optimizer step; rotates which members take the remainder so that, over
            many steps, no replica always does the extra microbatch.
        microbatch_ids: the ids to distribute (all ``M`` at the start of a step, or the ids
            lost with a dead replica during recovery). Each id lands on exactly one member.
        members: live replica ids; order does not matter (the plan sorts them).
        weights: optional relative throughput per member (higher = faster = more
            microbatches). ``None`` means equal quotas (sizes differ by at most one).

    Returns:
        ``{replica: [ids]}`` with every member present (possibly with an empty list); ids of
        each quota are contiguous runs of the sorted input, in ascending order.

    Raises:
        ValueError: no members, duplicate ids/members, or a non-positive/non-finite weight.
    """
    members = sorted(members)
    ids = sorted(microbatch_ids)
    if not members:
        raise ValueError("plan_quotas needs at least one live member")
    if len(set(members)) != len(members):
        raise ValueError(f"duplicate members in {members}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate microbatch ids in {ids}")

    counts = _apportion(len(ids), members, step, weights)
    plan: dict[int, list[int]] = {}
    start = 0
    for member in members:
        plan[member] = ids[start : start + counts[member]]
        start += counts[member]
    return plan


def _apportion(total: int, members: list[int], step: int, weights: Mapping[int, float] | None) -> dict[int, int]:
    """Largest-remainder apportionment of ``total`` items by weight, ties broken by rotation."""
    n = len(members)
    if weights is None:
        shares = [total / n] * n
    else:
        w = []
        for m in members:
            value = float(weights.get(m, 0.0))
            if not value > 0.0 or value == float("inf"):
                raise ValueError(f"throughput weight of replica {m} must be positive and finite, got {value}")
            w.append(value)
        scale = total / sum(w)
        shares = [x * scale for x in w]
    counts = [int(s) for s in shares]
    left = total - sum(counts)
    # Rotate the tie-break start by the step so equal remainders do not always favour replica 0.
    rot = step % n
    order = sorted(range(n), key=lambda i: (-(shares[i] - counts[i]), (i - rot) % n))
    for i in order[:left]:
        counts[i] += 1
    return dict(zip(members, counts))


def held_by_members(step: int, payloads: Mapping[int, Mapping]) -> set[int]:
    """The microbatch ids of ``step`` that members of a generation already hold, from their join ``payloads``
    (``replica -> payload``): a member that formed the generation in the middle of ``step`` published what it had
    computed (``have``)."""
    return {j for p in payloads.values() if p.get("step") == step for j in p.get("have", ())}


def plan_step(
    step: int,
    microbatches: int,
    members: Sequence[int],
    held: set[int],
    weights: Mapping[int, float] | None = None,
) -> dict[int, list[int]]:
    """Who computes which microbatch ids of ``step`` in a generation of ``members`` whose members already hold the
    ids ``held`` (:func:`held_by_members` of its join payloads).

    Where no member holds any of the step's microbatches, all ``microbatches`` ids are split (by ``weights``).
    Where some do (the generation was formed in the middle of the step, by survivors of a failed reduce), only the
    ids nobody holds are split, equally: the plan of an in-step recovery. Every member of the generation makes
    this plan, including one that joined it at the step's start (a boundary admission that raced the failure),
    so each id is counted exactly once in the step's reduce.
    """
    if not held:
        return plan_quotas(step, range(microbatches), members, weights)
    return plan_quotas(step, sorted(set(range(microbatches)) - held), members)
