"""Properties of the quota planner (pure logic)."""

import itertools
import random

import pytest

from lightning_recover.protocol.quotas import held_by_members, plan_quotas, plan_step


@pytest.mark.parametrize("M,members", [(8, [0, 1, 2, 3]), (7, [0, 2, 5]), (1, [3]), (16, [1, 2]), (5, [0, 1, 2, 3, 4])])
def test_covers_exactly_m_and_balances_within_one(M, members):
    for step in range(10):
        plan = plan_quotas(step, range(M), members)
        assert sorted(plan) == sorted(members)
        ids = list(itertools.chain.from_iterable(plan.values()))
        assert sorted(ids) == list(range(M)), "every microbatch exactly once"
        sizes = [len(v) for v in plan.values()]
        assert max(sizes) - min(sizes) <= 1


def test_deterministic_and_order_independent():
    a = plan_quotas(3, [5, 1, 9, 2], [2, 0, 1])
    b = plan_quotas(3, [2, 9, 1, 5], [1, 2, 0])
    assert a == b


def test_remainder_rotates_between_steps():
    extra = [max(plan_quotas(s, range(4), [0, 1, 2]).items(), key=lambda kv: len(kv[1]))[0] for s in range(6)]
    assert len(set(extra)) == 3, "the replica with the extra microbatch changes from step to step"


def test_lost_microbatches_replanned_over_survivors():
    full = plan_quotas(0, range(8), [0, 1, 2, 3])
    lost = full[2]
    again = plan_quotas(0, lost, [0, 1, 3])
    assert sorted(itertools.chain.from_iterable(again.values())) == sorted(lost)


def test_throughput_weights_are_proportional():
    plan = plan_quotas(0, range(12), [0, 1, 2], weights={0: 1.0, 1: 2.0, 2: 3.0})
    assert [len(plan[r]) for r in (0, 1, 2)] == [2, 4, 6]
    rng = random.Random(0)
    for _ in range(50):
        members = rng.sample(range(8), rng.randint(1, 8))
        weights = {m: rng.uniform(0.1, 5) for m in members}
        M = rng.randint(len(members), 40)
        plan = plan_quotas(rng.randint(0, 100), range(M), members, weights)
        assert sorted(itertools.chain.from_iterable(plan.values())) == list(range(M))
        total = sum(weights.values())
        for m in members:
            assert abs(len(plan[m]) - M * weights[m] / total) < 1.0 + 1e-9


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(step=0, microbatch_ids=range(4), members=[]), "at least one"),
        (dict(step=0, microbatch_ids=[1, 1], members=[0]), "duplicate microbatch"),
        (dict(step=0, microbatch_ids=range(4), members=[0, 0]), "duplicate members"),
        (dict(step=0, microbatch_ids=range(4), members=[0, 1], weights={0: 1.0, 1: 0.0}), "positive"),
    ],
)
def test_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_quotas(**kwargs)


# A generation's join payloads (replica -> payload), as members publish them: at a step's start ({"step": s,
# "have": []}) or mid-step after a failed reduce ({"step": s, "have": [ids computed], "attempt": a}).
PLAN_STEP_CASES = {
    # everybody at the step's start: all M split (by weights where given)
    "fresh start": (
        6,
        18,
        {0: {"step": 18, "have": []}, 2: {"step": 18, "have": []}},
        None,
        {0: [0, 1, 2], 2: [3, 4, 5]},
    ),
    "fresh start, weighted": (
        6,
        18,
        {0: {"step": 18, "have": []}, 2: {"step": 18, "have": []}},
        {0: 2.0, 2: 1.0},
        {0: [0, 1, 2, 3], 2: [4, 5]},
    ),
    # a generation formed during step 17's recovery does not change step 18's plan
    "an older step's holdings": (
        6,
        18,
        {0: {"step": 17, "have": [0, 1]}, 2: {"step": 17, "have": [2, 3]}},
        None,
        {0: [0, 1, 2], 2: [3, 4, 5]},
    ),
    # replica 2 computed ids 2, 3 in a generation of three whose reduce failed; replica 0 joined the new
    # generation at the step's start (a boundary admission that raced the failure): both split what nobody holds
    "a boundary member beside a recovering one": (
        6,
        18,
        {0: {"step": 18, "have": []}, 2: {"step": 18, "have": [2, 3], "attempt": 0}},
        {0: 5.0, 2: 1.0},  # an in-step recovery splits equally, whatever the weights
        {0: [0, 1], 2: [4, 5]},
    ),
    "everything held": (
        4,
        3,
        {0: {"step": 3, "have": [0, 1]}, 1: {"step": 3, "have": [2, 3]}},
        None,
        {0: [], 1: []},
    ),
}


@pytest.mark.parametrize("case", list(PLAN_STEP_CASES))
def test_plan_step_splits_what_no_member_holds(case):
    M, step, payloads, weights, expected = PLAN_STEP_CASES[case]
    held = held_by_members(step, payloads)
    plan = plan_step(step, M, sorted(payloads), held, weights)
    assert plan == expected
    counted = sorted(held) + sorted(j for ids in plan.values() for j in ids)
    assert sorted(counted) == list(range(M)), "each microbatch counted exactly once in the step's reduce"
