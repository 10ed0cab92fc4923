"""The etcd client's first try follows how long answers take (``etcd_client.AnswerTimes``, RFC 6298's smoothing)."""

from __future__ import annotations

import pytest

from lightning_recover.control_plane.answer_times import MAX_TRY_TIMEOUT, AnswerTimes
from lightning_recover.control_plane.etcd_client import QUICK_TRIES, EtcdClient


def test_no_answer_yet_is_the_short_try():
    assert AnswerTimes().first_try(0.25) == 0.25


def test_fast_answers_keep_the_short_try():
    """A cluster answering in milliseconds: a request swallowed by a dying leader still costs one 0.25 s try."""
    times = AnswerTimes()
    for _ in range(50):
        times.observe(0.002)
    assert times.first_try(0.25) == 0.25


def test_slow_answers_lengthen_the_first_try_up_to_the_longest():
    """Answers of ~0.3 s (members sharing busy cores): the first try waits srtt + 4 rttvar, not 0.25 s, and
    never more than MAX_TRY_TIMEOUT."""
    times = AnswerTimes()
    for s in (0.3, 0.35, 0.25, 0.4, 0.3):
        times.observe(s)
    assert 0.3 < times.first_try(0.25) <= MAX_TRY_TIMEOUT
    for _ in range(5):
        times.observe(5.0)
    assert times.first_try(0.25) == MAX_TRY_TIMEOUT


def test_the_first_try_comes_back_down_when_answers_are_fast_again():
    times = AnswerTimes()
    for _ in range(10):
        times.observe(1.0)
    assert times.first_try(0.25) > 1.0
    for _ in range(60):
        times.observe(0.002)
    assert times.first_try(0.25) == 0.25


def test_clones_share_the_answer_times_and_later_tries_double_from_the_first():
    client = EtcdClient(["127.0.0.1:1"], allow_insecure=True)
    assert client.clone().answer_times is client.answer_times
    for _ in range(10):
        client.answer_times.observe(0.3)
    first = client.try_timeout_after(0)
    assert first > 0.25
    assert [client.try_timeout_after(n) for n in range(QUICK_TRIES)] == [first] * QUICK_TRIES
    assert client.try_timeout_after(QUICK_TRIES) == pytest.approx(min(MAX_TRY_TIMEOUT, 2 * first))
