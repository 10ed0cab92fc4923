"""The partition judge's decision, with no store: the largest set of members that all reach each other, and
a round's verdict from the members' reports of the links they found cut."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from lightning_recover.protocol.probes import PROBES_IN_FLIGHT, SAMPLE_PEERS, probe_order, probe_waves, round_peers
from lightning_recover.protocol.reachability import (
    cut_evidence,
    exclusion_bound,
    largest_mutual_set,
    partition_verdict,
    report_within_for,
    waits_on_its_data_network,
)


def _brute_force(members, reached):
    ok = [r for r in members if r in reached]
    for size in range(len(ok), 0, -1):
        for combo in itertools.combinations(sorted(ok), size):  # lexicographic: the first found is the smallest
            if all(b in reached[a] and a in reached[b] for a, b in itertools.combinations(combo, 2)):
                return list(combo)
    return []


def test_largest_mutual_set_cases():
    everyone = {0: [1, 2], 1: [0, 2], 2: [0, 1]}
    assert largest_mutual_set([0, 1, 2], everyone) == [0, 1, 2]
    # replica 2 drops its peers' traffic: nobody reaches it, it reaches nobody
    assert largest_mutual_set([0, 1, 2], {0: [1], 1: [0], 2: []}) == [0, 1]
    # one direction of a report is not enough: 2 says it reached 0 and 1, they did not reach it
    assert largest_mutual_set([0, 1, 2], {0: [1], 1: [0], 2: [0, 1]}) == [0, 1]
    # a member that sent no report is in no set
    assert largest_mutual_set([0, 1, 2], {0: [1, 2], 1: [0, 2]}) == [0, 1]
    # two halves of equal size: the smaller ids win, deterministically
    assert largest_mutual_set([0, 1, 2, 3], {0: [1], 1: [0], 2: [3], 3: [2]}) == [0, 1]
    # the larger side wins whatever the ids
    assert largest_mutual_set([0, 1, 2, 3, 4], {0: [], 1: [], 2: [3, 4], 3: [2, 4], 4: [2, 3]}) == [2, 3, 4]
    assert largest_mutual_set([0, 1], {0: [], 1: []}) == [0]
    assert largest_mutual_set([], {}) == []


def test_largest_mutual_set_matches_brute_force():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 8)
        members = list(range(n))
        reached = {r: [s for s in members if s != r and rng.random() < 0.8] for r in members if rng.random() < 0.9}
        assert largest_mutual_set(members, reached) == _brute_force(members, reached), reached


def test_largest_mutual_set_is_fast_for_a_large_group_with_a_partition():
    members = list(range(300))
    cut = {7, 150, 299}
    reached = {r: [s for s in members if s != r and (s not in cut and r not in cut)] for r in members}
    start = time.perf_counter()
    keep = largest_mutual_set(members, reached)
    assert keep == [r for r in members if r not in cut]
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize(
    "alive, cut, keep, fenced",
    [
        # nobody found a cut link: everyone is kept, whatever did not answer in time
        ([0, 1, 2], {0: [], 1: [], 2: []}, [0, 1, 2], {}),
        # replica 2's host drops its peers' traffic: every link to it is cut, from both ends
        ([0, 1, 2], {0: [2], 1: [2], 2: [0, 1]}, [0, 1], {2: [0, 1]}),
        # one end's report is enough to cut a link
        ([0, 1, 2], {0: [2], 1: [], 2: []}, [0, 1], {2: [0]}),
        # a member that sent no report is kept unless someone found its link cut (its responder was starved)
        ([0, 1, 2], {0: [], 1: []}, [0, 1, 2], {}),
        ([0, 1, 2], {0: [2], 1: [2]}, [0, 1], {2: [0, 1]}),
        # no report at all: nothing is evidence of a partition
        ([0, 1, 2], {}, [0, 1, 2], {}),
        # two halves of equal size: the smaller ids win, deterministically
        ([0, 1, 2, 3], {0: [2, 3], 1: [2, 3], 2: [0, 1], 3: [0, 1]}, [0, 1], {2: [0, 1], 3: [0, 1]}),
        # the larger side wins whatever the ids
        ([0, 1, 2, 3, 4], {0: [2, 3, 4], 1: [2, 3, 4]}, [2, 3, 4], {0: [2, 3, 4], 1: [2, 3, 4]}),
        # an asymmetric cut between two members only: one of them goes (the larger id), the rest stay
        ([0, 1, 2], {0: [1]}, [0, 2], {1: [0]}),
        # reports about members outside the round, or about oneself, count for nothing
        ([0, 1], {0: [0, 7], 1: [], 9: [0, 1]}, [0, 1], {}),
        ([], {}, [], {}),
    ],
)
def test_partition_verdict_cases(alive, cut, keep, fenced):
    assert partition_verdict(alive, cut) == (keep, fenced)


def test_every_fenced_member_has_a_cut_link_with_a_kept_one():
    """Only a cut is evidence: a random set of cut links, any reports missing, never fences a member without
    a cut link to a member kept, and the kept members have no cut link among them."""
    rng = random.Random(1)
    for _ in range(300):
        members = list(range(rng.randint(1, 8)))
        cut = {r: [s for s in members if s != r and rng.random() < 0.15] for r in members if rng.random() < 0.8}
        keep, fenced = partition_verdict(members, cut)
        linked_cut = {(a, b) for a, bs in cut.items() for b in bs} | {(b, a) for a, bs in cut.items() for b in bs}
        assert not [(a, b) for a in keep for b in keep if (a, b) in linked_cut], (cut, keep)
        assert sorted(keep + list(fenced)) == members
        for r, kept in fenced.items():
            assert kept and all((r, s) in linked_cut for s in kept), (cut, keep, fenced)


def test_cut_evidence_names_each_end_that_reported_a_cut_link_and_what_it_saw():
    reports = {
        0: {"cut": [2], "why": {"2": "connect to 10.0.0.3:4000 timed out after 0.5s"}},
        1: {"cut": [], "why": {}},
        2: {"cut": [0, 1], "why": {"0": "connect to 10.0.0.1:4000: Connection refused"}},  # no reason for 1: older
    }
    assert cut_evidence(reports, 2, [0, 1]) == [
        "replica 0 -> 2: connect to 10.0.0.3:4000 timed out after 0.5s",
        "replica 2 -> 0: connect to 10.0.0.1:4000: Connection refused",
        "replica 2 -> 1: cut",
    ]
    assert cut_evidence({}, 2, [0, 1]) == [], "the fenced member's peers sent no report"


@pytest.mark.parametrize(
    "case, heartbeats, waits",
    [
        ("every member in a collective", [{"phase": "reduce"}, {"phase": "decide"}], True),
        ("building the first group", [{"phase": "start"}, {"phase": "start"}], True),
        ("one member computing", [{"phase": "reduce"}, {"phase": "compute"}], False),
        ("the first round filling", [{"phase": "start", "joining": True}, {"phase": "start", "joining": True}], False),
        (
            "a regroup's round, one member still in it",
            [{"phase": "regroup"}, {"phase": "regroup", "joining": True}],
            False,
        ),
        ("the regroup's group being built", [{"phase": "regroup"}, {"phase": "regroup"}], True),
    ],
)
def test_a_group_waits_on_its_data_network_only_outside_join_rounds(case, heartbeats, waits):
    assert waits_on_its_data_network(heartbeats) is waits, case


def test_each_member_starts_its_probes_at_a_different_server():
    """``probe_order``: the ids after the prober first, then those before it. With every member probing
    ``PROBES_IN_FLIGHT`` at a time, each server is in the first window of exactly that many members (the
    ones just before it), never of all of them at once."""
    members = list(range(40))
    orders = {me: probe_order(me, [r for r in members if r != me]) for me in members}
    assert orders[0][:3] == [1, 2, 3] and orders[39][:3] == [0, 1, 2] and orders[5][-2:] == [3, 4]
    assert all(sorted(o) == [r for r in members if r != me] for me, o in orders.items())
    window = 8
    first = [r for o in orders.values() for r in o[:window]]
    assert all(first.count(r) == window for r in members)
    assert probe_order(None, [3, 1, 2]) == [1, 2, 3]


def test_the_report_wait_grows_only_past_one_wave_of_probes():
    """A member's probes of the others take one probe timeout up to ``PROBES_IN_FLIGHT + 1`` members (the
    report wait of a small job, 2 x P + 0.75 s), one more per ``PROBES_IN_FLIGHT`` members after that."""
    p = 0.5
    for members in (2, 3, PROBES_IN_FLIGHT + 1):
        assert probe_waves(members) == 1
        assert report_within_for(p, members) == pytest.approx(2 * p + 0.75)
    assert probe_waves(PROBES_IN_FLIGHT + 2) == 2 and probe_waves(2 * PROBES_IN_FLIGHT + 1) == 2
    assert report_within_for(p, 4 * PROBES_IN_FLIGHT + 1) == pytest.approx(5 * p + 0.75)


def test_a_sampled_round_probes_each_member_equally_and_rotates_over_every_link():
    """``round_peers`` with a sample smaller than the group: each member probes ``sample`` distinct others and is
    probed by as many; ceil((N - 1) / sample) consecutive rounds probe every link; a sample as large as the group
    is every other member."""
    members = list(range(40))
    for number in (1, 2, 7):
        peers = {me: round_peers(me, members, SAMPLE_PEERS, number) for me in members}
        assert all(len(set(p)) == SAMPLE_PEERS and me not in p for me, p in peers.items())
        assert all(sum(r in p for p in peers.values()) == SAMPLE_PEERS for r in members)
    rounds = -(-(len(members) - 1) // SAMPLE_PEERS)
    probed = {
        (me, r) for n in range(5, 5 + rounds) for me in members for r in round_peers(me, members, SAMPLE_PEERS, n)
    }
    assert probed == {(a, b) for a in members for b in members if a != b}
    small = list(range(SAMPLE_PEERS + 1))
    assert round_peers(3, small, SAMPLE_PEERS, 1) == [r for r in small if r != 3]
    assert round_peers(3, members, 0, 1) == [r for r in members if r != 3]


def test_the_bound_of_a_large_group_adds_its_sampled_round():
    p = 1.0
    small = SAMPLE_PEERS + 1
    assert exclusion_bound(5.0, p, small) == pytest.approx(5.0 + report_within_for(p, small) + 0.1)
    large = SAMPLE_PEERS + 2
    assert exclusion_bound(5.0, p, large) == pytest.approx(5.0 + 2 * report_within_for(p, small) + 0.1)
