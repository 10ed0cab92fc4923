"""A launcher's part of an etcd job, in-process against a real one-member etcd: joining the job, its secret
(never in etcd), the monitor role's election and takeover, a monitor that fails, and two monitors racing."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_recover.control_plane import config
from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.control_plane.etcd_job import (
    CAMPAIGN_PERIOD,
    DEFAULT_LEASE_TTL,
    JobNameTaken,
    MonitorRole,
    join_job,
)
from lightning_recover.control_plane.etcd_store import Fence, FencedOut
from lightning_recover.errors import RecoverError
from lightning_recover.protocol import coordinator
from lightning_recover.protocol.messages import JobSecret, Sealer, mark_dead, read_death
from tests.jobs import wait_for

_n = [0]


def settings(cluster) -> config.EtcdSettings:
    _n[0] += 1
    s = config.parse(cluster.url, environ=cluster.environment())
    return config.with_job(s, f"job-test-{time.monotonic_ns()}-{_n[0]}")


def test_launchers_given_one_secret_join_one_job(etcd1):
    s = settings(etcd1)
    given = JobSecret.generate()  # what LIGHTNING_RECOVER_SECRET_FILE hands every launcher of the job
    first = join_job(s, replicas=3, replica_size=1, secret=given)
    second = join_job(s, replicas=3, replica_size=1, secret=given)
    assert first.key == second.key == given.key
    store = s.store()
    assert Sealer(first).open("meta/replicas", store.get("meta/replicas")) == b"3"
    assert Sealer(first).open("dead/2", store.get("dead/2")) == b"0"
    with pytest.raises(RecoverError, match="already exists with 3 replicas.*HINT"):
        join_job(s, replicas=4, replica_size=1, secret=given)


def test_the_job_secret_is_never_written_to_etcd(etcd1, monkeypatch):
    s = settings(etcd1)
    monkeypatch.delenv("LIGHTNING_RECOVER_SECRET_FILE", raising=False)
    monkeypatch.delenv("LIGHTNING_RECOVER_SECRET", raising=False)
    secret = join_job(s, replicas=2, replica_size=1)  # a launcher given none makes one
    client = s.client()
    everything = client.range(b"\x00", b"\x00")["kvs"]  # every key of the cluster
    client.close()
    assert everything, "the job's keys are there"
    for kv in everything:
        key, value = ec.unb64(kv["key"]), ec.unb64(kv.get("value"))
        assert not key.endswith(b"/secret") and secret.key not in value and secret.hex().encode() not in value


def test_a_new_job_reusing_a_name_is_refused_not_adopted(etcd1):
    """The keys of an earlier job of the same name remain (its launcher was killed): a new job, with its own
    secret, is refused by name instead of adopting the old job's secret and state."""
    s = settings(etcd1)
    join_job(s, replicas=2, replica_size=1, secret=JobSecret.generate())
    with pytest.raises(JobNameTaken, match="exists with another secret.*HINT.*new --job name.*etcdctl del"):
        join_job(s, replicas=2, replica_size=1, secret=JobSecret.generate())


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


@pytest.mark.slow  # waits for the role to move (about a third of the lease TTL, then a campaign)
def test_a_monitor_thread_that_fails_gives_the_role_up(etcd1, monkeypatch):
    """The holder's monitor thread dies on an exception (made to, here, on its first run): the holder gives the
    role up at once and another launcher takes it; a role kept without a monitor would declare nobody dead."""
    s = settings(etcd1)
    secret = join_job(s, replicas=2, replica_size=1, secret=JobSecret.generate())
    real = coordinator.run_monitor
    runs: list[str] = []

    def fails_first(*args, **kwargs):
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            raise RuntimeError("the monitor thread fails (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(coordinator, "run_monitor", fails_first)
    said: list[str] = []
    a = _role(s, secret, "A", said)
    try:
        assert wait_for(lambda: runs, 10), said
        b = _role(s, secret, "B", said)
        try:
            assert wait_for(b.held.is_set, DEFAULT_LEASE_TTL + 2), said
            assert not a.held.is_set() and b.holder(s.client()) == "B"
            assert any("monitor of A ended: the role is given up" in line for line in said), said
            assert any("RuntimeError: the monitor thread fails" in line for line in said), said
        finally:
            b.stop()
    finally:
        a.stop()


def test_a_fenced_store_reads_writes_and_deletes_more_keys_than_one_transaction_holds(etcd1):
    """The monitor's store is fenced (each transaction nested in one that checks its role), and etcd counts the
    nesting operation against its 128 operations: the monitor's read of every heartbeat at 128 replicas and more
    goes in chunks that fit."""
    s = settings(etcd1)
    join_job(s, replicas=2, replica_size=1, secret=JobSecret.generate())
    client = s.client()
    key = (s.prefix + "monitor").encode()
    lease = client.lease_grant(10)
    assert client.txn([ec.cmp_version(key, 0)], [ec.op_put(key, b"A", lease)])["succeeded"]
    store = s.store()
    store.fence = Fence(key, lease)
    keys = [f"hb/{r}" for r in range(300)]
    try:
        store.multi_set(keys, [str(r).encode() for r in range(300)])
        assert store.peek_many(keys + ["vouch"], through_log=True) == [str(r).encode() for r in range(300)] + [None]
        assert store.check(keys)
        store.delete_many(keys)
        assert store.peek_many(keys) == [None] * 300
    finally:
        store.close()
        client.lease_revoke(lease)


def test_two_monitors_racing_only_the_holder_writes(etcd1):
    """Monitor A keeps counting probe rounds and declaring deaths while its lease ends (as when its host
    stalls past the TTL) and monitor B takes the role: from that moment etcd refuses every write of A's
    (fenced by its lease), so the counter holds exactly A's writes before and B's after, and A declares
    nobody dead once it lost the role."""
    s = settings(etcd1)
    secret = join_job(s, replicas=2, replica_size=1, secret=JobSecret.generate())
    sealer = Sealer(secret)
    client = s.client()
    key = (s.prefix + "monitor").encode()

    def take(name: bytes) -> int:
        lease = client.lease_grant(10)
        assert client.txn([ec.cmp_version(key, 0)], [ec.op_put(key, name, lease)])["succeeded"]
        return lease

    a_store, b_store = s.store(), s.store()
    a_store.fence = Fence(key, take(b"A"))
    counted = {"A": 0, "B": 0}
    stopped: list[BaseException] = []

    def monitor_a() -> None:
        try:
            for _ in range(100_000):
                a_store.add("reach/rounds", 1)
                counted["A"] += 1
        except FencedOut as exc:
            stopped.append(exc)

    racer = threading.Thread(target=monitor_a, name="test-monitor-a")
    racer.start()
    try:
        assert wait_for(lambda: counted["A"] >= 20, 30)
        client.lease_revoke(a_store.fence.lease)  # A's lease ends; A does not know yet
        b_store.fence = Fence(key, take(b"B"))
        for _ in range(30):
            b_store.add("reach/rounds", 1)
            counted["B"] += 1
        racer.join(30)
        assert not racer.is_alive() and stopped, "A kept writing after it lost the role"
        assert b_store.add("reach/rounds", 0) == counted["A"] + counted["B"]
        with pytest.raises(FencedOut):
            mark_dead(a_store, sealer, 1, 1)
        assert read_death(sealer, 1, b_store.get("dead/1")) == 0
        assert mark_dead(b_store, sealer, 1, 1) is True
    finally:
        racer.join(30)
        a_store.close()
        b_store.close()
        client.close()
