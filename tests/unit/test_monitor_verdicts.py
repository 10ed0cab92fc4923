"""The monitor's judgement of members whose leased heartbeat key it never read (pure, table-driven)."""

from __future__ import annotations

import pytest

from lightning_recover.protocol.coordinator import members_gone_unread

TIMEOUT = 2.0


@pytest.mark.parametrize(
    "case, read, present, settled, ticks, declared",
    [
        # a new monitor never read hb/0: its lease expired before it looked -> dead after the timeout
        ("expired before the monitor looked", set(), {"hb/0": False, "hb/1": True}, {}, [0.0, 1.0, 2.5], {0}),
        ("not yet for the timeout", set(), {"hb/0": False, "hb/1": True}, {}, [0.0, 1.9], set()),
        # a key this monitor read is judged key by key (the lease check), not here
        ("read before", {"hb/0"}, {"hb/0": False, "hb/1": True}, {}, [0.0, 3.0], set()),
        ("already dead", set(), {"hb/0": False, "hb/1": True}, {0: 1}, [0.0, 3.0], set()),
        ("never looked up: not absent", set(), {"hb/1": True}, {}, [0.0, 3.0], set()),
    ],
)
def test_members_whose_key_vanished_unread_are_declared_after_the_timeout(
    case, read, present, settled, ticks, declared
):
    members = {0: 1, 1: 1}
    absent_since: dict[str, float] = {}
    found = []
    for now in ticks:
        found = members_gone_unread(members, read, present, settled, absent_since, now, TIMEOUT)
    assert {r for _, (r, _, _) in found} == declared, case
    for key, (r, inc, why) in found:
        assert key == f"hb/{r}" and inc == members[r] and "unread by this monitor" in why


def test_a_key_that_comes_back_restarts_the_clock():
    members, absent_since = {0: 1}, {}
    assert members_gone_unread(members, set(), {"hb/0": False}, {}, absent_since, 0.0, TIMEOUT) == []
    assert members_gone_unread(members, set(), {"hb/0": True}, {}, absent_since, 1.5, TIMEOUT) == []
    assert members_gone_unread(members, set(), {"hb/0": False}, {}, absent_since, 3.0, TIMEOUT) == []
    assert [k for k, _ in members_gone_unread(members, set(), {"hb/0": False}, {}, absent_since, 5.1, TIMEOUT)] == [
        "hb/0"
    ]
