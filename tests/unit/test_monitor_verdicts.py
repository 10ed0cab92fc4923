"""The monitor's judgement of members whose leased heartbeat key it never read (pure, table-driven)."""

from __future__ import annotations

import pytest

from lightning_recover.protocol.verdicts import Ledger, members_gone_unread

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


# ---------------------------------------------------------------------------- the ledger: who is dead at ``now``

HANG = 5.0


def _hb(inc: int = 1, beat: int = 0, count: int = 0, phase: str = "compute", **more) -> dict:
    return {"inc": inc, "beat": beat, "count": count, "phase": phase, **more}


def _run(events: list[tuple[float, dict[int, dict]]], **found: bool) -> dict[int, tuple[str, str]]:
    """Feed ``(now, {replica: heartbeat})`` in order (a replica absent from a tick sent nothing new); the
    verdicts of the last tick as ``replica -> (cause, why)``. ``found``: ``hb_R=False`` where the last read did
    not find replica R's key."""
    ledger = Ledger(TIMEOUT, HANG)
    verdicts = {}
    for now, heard in events:
        for r, hb in heard.items():
            ledger.found(f"hb/{r}", found.get(f"hb_{r}", True))
            ledger.heard(f"hb/{r}", r, hb)
        verdicts = ledger.verdicts(now)
    return {v.replica: (v.cause, v.why) for v in verdicts.values()}


@pytest.mark.parametrize(
    "case, events, found, dead",
    [
        ("beats keep it alive", [(0.0, {0: _hb(beat=1)}), (1.5, {0: _hb(beat=2)}), (3.0, {0: _hb(beat=3)})], {}, {}),
        ("no beat for the timeout", [(0.0, {0: _hb(beat=1)}), (2.1, {})], {}, {0: "kill"}),
        ("not quite the timeout", [(0.0, {0: _hb(beat=1)}), (1.9, {})], {}, {}),
        (
            "the same beat again is no beat",
            [(0.0, {0: _hb(beat=1)}), (1.0, {0: _hb(beat=1)}), (2.1, {})],
            {},
            {0: "kill"},
        ),
        ("not started (incarnation 0)", [(0.0, {0: _hb(inc=0)}), (9.0, {})], {}, {}),
        (
            "a new incarnation starts its own clock",
            [(0.0, {0: _hb(inc=1, beat=5)}), (1.9, {0: _hb(inc=2, beat=0)}), (3.0, {})],
            {},
            {},
        ),
        ("a leased beat whose key is gone", [(0.0, {0: _hb(lease=2)})], {"hb_0": False}, {0: "kill"}),
        ("a leased beat lives while its key does", [(0.0, {0: _hb(lease=2)}), (9.0, {})], {}, {}),
        (
            "hung: no progress while a peer waits on it",
            [(0.0, {0: _hb(beat=1, count=3), 1: _hb(beat=1, phase="reduce")})]
            + [
                (t, {0: _hb(beat=int(t) + 2, count=3), 1: _hb(beat=int(t) + 2, phase="reduce")})
                for t in (1.0, 3.0, 5.5)
            ],
            {},
            {0: "hang"},
        ),
        (
            "no progress but nobody waits: not hung",
            [(t, {0: _hb(beat=int(t) + 1, count=3), 1: _hb(beat=int(t) + 1)}) for t in (0.0, 2.0, 4.0, 6.0)],
            {},
            {},
        ),
        (
            "waiting itself is not hanging",
            [
                (t, {0: _hb(beat=int(t) + 1, phase="decide"), 1: _hb(beat=int(t) + 1, phase="reduce")})
                for t in (0.0, 2.0, 4.0, 6.0)
            ],
            {},
            {},
        ),
    ],
)
def test_verdicts_follow_the_rules(case, events, found, dead):
    got = _run(events, **found)
    assert {r: cause for r, (cause, _) in got.items()} == dead, (case, got)


def test_a_vouch_is_a_beat_and_progress_of_the_incarnations_it_names():
    ledger = Ledger(TIMEOUT, HANG)
    ledger.heard("hb/0", 0, _hb(inc=1, beat=1))
    ledger.heard("hb/1", 1, _hb(inc=1, beat=1))
    assert ledger.verdicts(0.0) == {}
    ledger.vouch({0: 1, 1: 7}, 1.5)  # replica 1 under another incarnation: not vouched for
    assert {v.replica for v in ledger.verdicts(2.5).values()} == {1}
    assert ledger.vouched == {0: 1, 1: 7}


def test_a_stall_of_the_control_plane_is_forgiven():
    ledger = Ledger(TIMEOUT, HANG)
    ledger.heard("hb/0", 0, _hb(beat=1))
    assert ledger.verdicts(0.0) == {}
    ledger.forgive(1.5)  # a read that came 1.5 s late: nobody could beat meanwhile
    assert ledger.verdicts(3.0) == {}
    ledger.forgive(0.0, until=4.0)  # a leader election: everything before 4.0 counts against nobody
    assert ledger.verdicts(5.9) == {}
    assert {v.replica for v in ledger.verdicts(6.1).values()} == {0}


def test_a_settled_incarnation_is_judged_no_more():
    ledger = Ledger(TIMEOUT, HANG)
    ledger.heard("hb/0", 0, _hb(inc=2, beat=1, step=4))
    ledger.verdicts(0.0)
    (verdict,) = ledger.verdicts(3.0).values()
    assert (verdict.replica, verdict.incarnation, verdict.cause) == (0, 2, "kill")
    assert verdict.why == "missed heartbeats for 3.00s (its last beat said phase 'compute' of step 4)"
    ledger.settle(0, 2)
    ledger.settle(0, 1)  # dead/{r} only grows: an older one changes nothing
    assert ledger.settled == {0: 2} and ledger.verdicts(9.0) == {}


def test_a_dead_incarnation_that_last_said_it_waited_makes_nobody_hung():
    # A replica killed in a collective leaves a heartbeat saying "reduce" until its restart beats again
    # (a process start: long on a loaded host); the survivors idle meanwhile (e.g. held at a step boundary).
    ledger = Ledger(TIMEOUT, HANG)
    for t in (0.0, 1.0, 3.0, 5.5):
        ledger.heard("hb/0", 0, _hb(beat=int(t) + 1, count=3, phase="idle"))
        if t == 0.0:
            ledger.heard("hb/1", 1, _hb(inc=1, beat=1, phase="reduce"))
            ledger.settle(1, 1)
        assert ledger.verdicts(t) == {}, t
    ledger.heard("hb/1", 1, _hb(inc=2, beat=1, phase="reduce"))  # its next incarnation waits on replica 0
    ledger.heard("hb/0", 0, _hb(beat=9, count=3, phase="idle"))
    assert ledger.verdicts(6.0) == {}  # replica 0's progress clock starts when someone waits on it
    for t in (7.0, 9.0, 11.0):
        ledger.heard("hb/0", 0, _hb(beat=int(t), count=3, phase="idle"))
        ledger.heard("hb/1", 1, _hb(inc=2, beat=int(t), phase="reduce"))
        ledger.verdicts(t)
    ledger.heard("hb/0", 0, _hb(beat=12, count=3, phase="idle"))
    assert [(v.replica, v.cause) for v in ledger.verdicts(11.5).values()] == [(0, "hang")]


def test_a_vouched_member_whose_key_vanished_unread_is_declared():
    ledger = Ledger(TIMEOUT, HANG)
    ledger.vouch({0: 1}, 0.0)
    ledger.found("hb/0", False)  # never read by this monitor (a new one), and gone
    assert ledger.verdicts(0.5) == {}
    (verdict,) = ledger.verdicts(3.0).values()
    assert verdict.replica == 0 and verdict.cause == "kill" and "unread by this monitor" in verdict.why
