"""A launcher's part of an etcd job, in-process against a real one-member etcd: joining the job, the
shared secret, and the monitor role's election and takeover (fast)."""

from __future__ import annotations

import time

import pytest

from lightning_recover.control_plane import config
from lightning_recover.control_plane.etcd_job import CAMPAIGN_PERIOD, DEFAULT_LEASE_TTL, MonitorRole, join_job
from lightning_recover.errors import RecoverError
from lightning_recover.protocol.messages import Sealer
from tests.jobs import wait_for

_n = [0]


def settings(cluster) -> config.EtcdSettings:
    _n[0] += 1
    s = config.parse(cluster.url, environ=cluster.environment())
    return config.with_job(s, f"job-test-{time.monotonic_ns()}-{_n[0]}")


def test_launchers_join_one_job_and_share_its_secret(etcd1):
    s = settings(etcd1)
    first = join_job(s, replicas=3, replica_size=1)
    second = join_job(s, replicas=3, replica_size=1)
    assert first.key == second.key
    store = s.store()
    assert Sealer(first).open("meta/replicas", store.get("meta/replicas")) == b"3"
    assert Sealer(first).open("dead/2", store.get("dead/2")) == b"0"
    with pytest.raises(RecoverError, match="already exists with 3 replicas.*HINT"):
        join_job(s, replicas=4, replica_size=1)


def _role(s, secret, name, said):
    return MonitorRole(s, secret, 2, 1.0, 60.0, 1, name, said.append).start()


@pytest.mark.slow  # waits out the old holder's lease TTL (DEFAULT_LEASE_TTL, 2 s)
def test_monitor_role_is_held_by_one_and_taken_over(etcd1):
    s = settings(etcd1)
    secret = join_job(s, replicas=2, replica_size=1)
    said: list[str] = []
    a = _role(s, secret, "A", said)
    try:
        assert wait_for(a.held.is_set, 10), said
        b = _role(s, secret, "B", said)
        try:
            time.sleep(3 * CAMPAIGN_PERIOD)
            assert not b.held.is_set()  # one holder at a time
            client = s.client()
            assert a.holder(client) == "A"
            # The holder's lease vanishes (what its expiry does when the holder's host dies): B takes over
            # within the campaign period, and A stops monitoring within its TTL.
            value = client.range((s.prefix + "monitor").encode())["kvs"][0]
            client.lease_revoke(int(value["lease"]))
            t = time.monotonic()
            assert wait_for(b.held.is_set, DEFAULT_LEASE_TTL + 1), said
            assert time.monotonic() - t <= CAMPAIGN_PERIOD + 1.0
            assert wait_for(lambda: not a.held.is_set(), DEFAULT_LEASE_TTL + 1), said
            assert b.holder(client) == "B"
        finally:
            b.stop()
    finally:
        a.stop()


def test_stopping_the_holder_hands_the_role_over_at_once(etcd1):
    s = settings(etcd1)
    secret = join_job(s, replicas=2, replica_size=1)
    said: list[str] = []
    a = _role(s, secret, "A", said)
    assert wait_for(a.held.is_set, 10), said
    b = _role(s, secret, "B", said)
    try:
        t = time.monotonic()
        a.stop()  # revokes its lease: no TTL to wait out
        assert wait_for(b.held.is_set, 5), said
        assert time.monotonic() - t <= CAMPAIGN_PERIOD + 1.0
    finally:
        b.stop()
