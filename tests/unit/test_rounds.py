"""When a join round closes, and with whom (protocol/rounds.py): the rule as a table, no store."""

from __future__ import annotations

import pytest

from lightning_recover.protocol.rounds import CLOSE, SHORT, WAIT, round_outcome, round_state


@pytest.mark.parametrize(
    "case, expected, joined, dead, least, past, outcome, members",
    [
        ("everyone joined", {0: 1, 1: 1, 2: 1}, {0, 1, 2}, set(), 0, False, CLOSE, [0, 1, 2]),
        ("one awaited", {0: 1, 1: 1, 2: 1}, {0, 1}, set(), 0, False, WAIT, [0, 1]),
        ("the awaited one declared dead", {0: 1, 1: 1, 2: 1}, {0, 1}, {2}, 0, False, CLOSE, [0, 1]),
        ("dead after joining: not a member", {0: 1, 1: 1}, {0, 1}, {1}, 0, False, CLOSE, [0]),
        ("past the deadline: whoever joined", {0: 1, 1: 1, 2: 1}, {0}, set(), 0, True, CLOSE, [0]),
        ("a joiner not expected is a member", {0: 1}, {0, 5}, set(), 0, False, CLOSE, [0, 5]),
        # the job's start with replicas=MIN:MAX: ids never started (incarnation 0) are not waited for
        ("growth: enough in, the rest never started", {0: 1, 1: 1, 2: 0, 3: 0}, {0, 1}, set(), 2, False, CLOSE, [0, 1]),
        ("growth: a started one still awaited", {0: 1, 1: 1, 2: 1, 3: 0}, {0, 1}, set(), 2, False, WAIT, [0, 1]),
        ("growth: too few yet", {0: 1, 1: 0, 2: 0}, {0}, set(), 2, False, WAIT, [0]),
        ("growth: too few at the deadline", {0: 1, 1: 0, 2: 0}, {0}, set(), 2, True, SHORT, [0]),
    ],
)
def test_a_round_closes_by_the_rule(case, expected, joined, dead, least, past, outcome, members):
    state = round_state(expected, joined, dead)
    assert state.members == members, case
    assert round_outcome(state, expected, least, past) == outcome, case


def test_awaited_are_the_expected_neither_joined_nor_dead():
    state = round_state({0: 1, 1: 1, 2: 1, 3: 2}, {0, 4}, {1})
    assert state.awaited == {2, 3} and state.members == [0, 4]
