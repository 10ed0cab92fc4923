"""How long a watched view's stream may stay silent before it is reopened (``etcd_watch.next_quiet_allowance``)."""

from __future__ import annotations

from lightning_recover.control_plane.etcd_watch import QUIET_ALLOWANCE_MAX, STALE_AFTER, next_quiet_allowance


def test_a_quiet_stream_may_stay_silent_twice_as_long_each_time_up_to_the_most():
    allowance, seen = STALE_AFTER, []
    for _ in range(8):
        allowance = next_quiet_allowance(allowance, STALE_AFTER, missed_nothing=True)
        seen.append(allowance)
    assert seen[:3] == [2 * STALE_AFTER, 4 * STALE_AFTER, 8 * STALE_AFTER]
    assert max(seen) == QUIET_ALLOWANCE_MAX == seen[-1]


def test_a_stream_that_missed_something_is_reopened_after_stale_after_again():
    assert next_quiet_allowance(QUIET_ALLOWANCE_MAX, STALE_AFTER, missed_nothing=False) == STALE_AFTER


def test_a_view_allowed_more_than_the_most_keeps_its_own_stale_after():
    """The heartbeats' view (stale_after 10 s) is never reopened sooner than its own staleness."""
    assert next_quiet_allowance(10.0, 10.0, missed_nothing=True) == 10.0
