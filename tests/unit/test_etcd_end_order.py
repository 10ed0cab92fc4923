"""The order in which a local etcd cluster's members are ended (``etcd_cluster.end_order``): followers first."""

from __future__ import annotations

import pytest

from lightning_recover.control_plane.etcd_cluster import end_order


def _status(member: int, leader: int) -> dict:
    # As the gateway returns it: 64-bit ids as strings.
    return {"header": {"member_id": str(member)}, "leader": str(leader)}


@pytest.mark.parametrize(
    ("statuses", "order"),
    [
        ([_status(11, 22), _status(22, 22), _status(33, 22)], [[0, 2], [1]]),  # the leader last
        ([_status(11, 11), _status(22, 11), _status(33, 11)], [[1, 2], [0]]),
        ([_status(11, 22), None, _status(33, 22)], [[0, 2], [1]]),  # no answer: after the followers
        ([_status(11, 0), _status(22, 0)], [[], [0, 1]]),  # no leader (an election): none is known to follow
        ([{"header": {"member_id": "11"}}, _status(22, 33)], [[1], [0]]),  # no leader field at all
        ([_status(11, 11)], [[], [0]]),  # one member
        ([], [[], []]),
    ],
)
def test_followers_of_another_member_are_ended_first(statuses, order):
    assert end_order(statuses) == order
