"""How often a waiting member polls the embedded coordinator (protocol/polling.py): the job's polls a second stay at
``JOB_POLLS_PER_S`` whatever its size; a small job keeps its short slice; reads from a watched view are not gated."""

from __future__ import annotations

import pytest

from lightning_recover.protocol.polling import JOB_POLLS_PER_S, SLICE, PollGate, member_poll_period, wait_slice


@pytest.mark.parametrize("members", [2, 16, 64, 512, 16000])
def test_the_jobs_polls_a_second_do_not_grow_with_its_members(members):
    assert members / member_poll_period(members) == pytest.approx(JOB_POLLS_PER_S)


def test_a_small_job_polls_within_its_slice():
    assert member_poll_period(16) < SLICE


def test_a_gate_lets_one_poll_through_per_period_and_every_one_from_a_view():
    gate, period = PollGate(), member_poll_period(512)
    assert gate.due(512, False, now=100.0)
    assert not gate.due(512, False, now=100.0 + period / 2)
    assert gate.due(512, False, now=100.0 + period)
    assert all(gate.due(512, True, now=100.0 + period) for _ in range(3)), "a watched view costs no request"


def test_a_wait_in_the_store_lasts_the_members_poll_period_where_each_is_a_request():
    assert wait_slice(16, reads_from_view=False) == SLICE
    assert wait_slice(512, reads_from_view=False) == member_poll_period(512) > SLICE
    assert wait_slice(512, reads_from_view=True) == SLICE, "a watched view's wait costs no request"
