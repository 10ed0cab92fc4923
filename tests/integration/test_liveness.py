"""Liveness through leases on etcd (control_plane/etcd_liveness.py, protocol/liveness.py): a heartbeat key
attached to a lease its thread keeps alive, no Raft write per beat while commits vouch, the monitor's verdict
when etcd deletes the key; and the coverage window's arithmetic."""

from __future__ import annotations

import json
import threading
import time

import pytest

from lightning_recover.control_plane.etcd_client import EtcdClient
from lightning_recover.control_plane.etcd_store import EtcdStore
from lightning_recover.protocol.coordinator import init_keys, run_monitor
from lightning_recover.protocol.heartbeat import Heartbeat, Progress
from lightning_recover.protocol.liveness import COVER_MAX, MIN_TTL, VouchCoverage, lease_ttl
from lightning_recover.protocol.messages import ControlStore, JobSecret, Sealer, sequence
from lightning_recover.protocol.vouches import vouch_record
from tests.compare import SLACK

_count = [0]


def fresh_store(cluster) -> EtcdStore:
    _count[0] += 1
    client = EtcdClient(cluster.endpoints, **cluster.tls_files, timeout=5.0)
    return EtcdStore(client, f"/live-test/{_count[0]}/kv/", root=f"/live-test/{_count[0]}/", apart="hb/")


def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_coverage_window_follows_the_steps_within_its_bounds():
    cover = VouchCoverage()
    assert cover.window(0.5) == 0.5  # no vouch seen: the heartbeat period
    for at in (10.0, 11.0, 12.1, 17.1):  # steps of 1.0 and 1.1 s, then a regroup of 5 s
        cover.vouched(at)
    assert cover.window(0.5) == pytest.approx(2.0)  # twice the shortest recent gap: one long gap does not count
    assert cover.window(3.0) == 3.0  # never below the period
    slow = VouchCoverage()
    for at in (0.0, 40.0, 80.0):
        slow.vouched(at)
    assert slow.window(0.5) == COVER_MAX  # a main thread stopped between two commits is seen at most that late
    assert lease_ttl(0.25) == MIN_TTL and lease_ttl(0.5) == 2 and lease_ttl(2.5) == 10
    # the heartbeat timeout, where given, whatever the period: a short period must not shorten the lease
    assert lease_ttl(0.5, 10.0) == 10 and lease_ttl(0.1, 0.5) == MIN_TTL and lease_ttl(2.5, 4.2) == 5


@pytest.mark.slow  # waits out a lease (2 s)
def test_a_leased_beat_writes_once_lives_on_keepalives_and_goes_with_its_lease(etcd1):
    """A Heartbeat on etcd writes its key once, attached to a lease, and writes nothing more while commits vouch
    for it (every 0.1 s here, naming only the generation): the key outlives the lease's TTL on keep-alives alone.
    Stopped, its lease goes at once (the last beat stays, unleased); a lease nobody keeps alive takes its key with it within the TTL (and etcd's
    0.5 s expiry check)."""
    secret = JobSecret.generate()
    raw = fresh_store(etcd1)
    store = ControlStore("etcd://test", 0, secret, store=raw)
    leader = ControlStore("etcd://test", 0, secret, store=raw.clone())
    leader.set("g0/join/0", json.dumps({"step": -1, "have": [], "inc": 1}))
    leader.set("g0/members", json.dumps([0]))
    until(lambda: raw.view.healthy)
    period = 0.5
    hb = Heartbeat(store, 0, 1, period, Progress())
    hb.start()
    try:
        key = raw.root + b"hb/0"
        value, _ = raw.client.get(key)
        payload = json.loads(Sealer(secret).open("hb/0", value))
        assert payload["lease"] == lease_ttl(period) and payload["beat"] == 1
        first = int(raw.client.range(key)["kvs"][0]["mod_revision"])
        step, until_past_ttl = 0, time.monotonic() + lease_ttl(period) + 1.5
        while time.monotonic() < until_past_ttl:  # past the TTL: alive on keep-alives alone
            step += 1
            decided = leader.report_and_decide(
                f"s{step}/done/0", "1", {}, f"s{step}/dec", "commit", vouch=vouch_record(0, step)
            )
            assert decided == "commit"
            time.sleep(0.1)
        kvs = raw.client.range(key).get("kvs") or []
        assert kvs and int(kvs[0]["mod_revision"]) == first, "a leased beat covered by vouches was written again"
        assert hb.vouched_at > 0
    finally:
        hb.stop()
    # Stopped (the replica marked gone): the lease is revoked now, not a TTL later, and the last beat stays, no
    # longer leased, for the monitor's last look (test_heartbeat.py).
    kvs = raw.client.range(key).get("kvs") or []
    assert kvs and int(kvs[0].get("lease", 0)) == 0, kvs
    assert "lease" not in json.loads(Sealer(secret).open("hb/0", raw.client.get(key)[0]))
    # A lease nobody keeps alive: its key goes by itself.
    leased = raw.leased("hb/1", MIN_TTL)
    leased.put(b"x")
    began = time.monotonic()
    until(lambda: raw.client.get(raw.root + b"hb/1")[0] is None, timeout=MIN_TTL + 0.5 + SLACK + 2)
    assert time.monotonic() - began >= MIN_TTL - 0.5
    leased.close()
    raw.close()


class _StuckProgress(Progress):
    """A main thread whose report the heartbeat thread can read once (the first beat) and then waits on until
    ``gate`` opens: the heartbeat thread stays inside its send, as behind a read etcd answers late."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate, self.reads = gate, 0
        super().__init__()

    @property
    def report(self) -> dict:
        self.reads += 1
        if self.reads > 1:
            self.gate.wait()
        return {}

    @report.setter
    def report(self, value: dict) -> None:
        pass


@pytest.mark.slow  # outlives a lease three times (6 s)
def test_keepalives_go_on_while_the_heartbeat_thread_is_stuck(etcd1):
    """The lease is kept alive from a thread and a connection of its own: a heartbeat thread held inside a beat
    (a read or a write that a loaded etcd answers seconds late) does not let a live replica's lease expire."""
    secret = JobSecret.generate()
    raw = fresh_store(etcd1)
    store = ControlStore("etcd://test", 0, secret, store=raw)
    gate = threading.Event()
    progress = _StuckProgress(gate)
    period = 0.5
    hb = Heartbeat(store, 0, 1, period, progress)
    hb.start()
    key = raw.root + b"hb/0"
    try:
        until(lambda: progress.reads > 1)  # the thread's next beat is stuck
        ttl = lease_ttl(period)
        past = time.monotonic() + 3 * ttl + 0.5  # three TTLs and etcd's expiry check
        while time.monotonic() < past:
            assert raw.client.get(key)[0] is not None, "a live replica's lease expired behind its stuck heartbeat"
            time.sleep(0.2)
    finally:
        gate.set()
        hb.stop()
        raw.close()


def test_a_keep_alive_answer_it_cannot_read_ends_the_heartbeat_with_the_cause(etcd1, monkeypatch):
    """The keeper thread retries a keep-alive etcd did not answer; one whose answer it cannot read (an etcd that
    answers without the lease's TTL) stops it, and the heartbeat thread's next beat fails naming why: what the
    watchdog prints when it ends the replica, rather than a lease that expires with no word of the cause."""
    secret = JobSecret.generate()
    raw = fresh_store(etcd1)
    store = ControlStore("etcd://test", 0, secret, store=raw)
    hb = Heartbeat(store, 0, 1, 0.25, Progress())

    def unreadable_answer(self, lease: int) -> int:
        raise KeyError("TTL")  # injected: the answer of an etcd this client does not speak with

    monkeypatch.setattr(EtcdClient, "lease_keepalive", unreadable_answer)
    hb.start()
    try:
        until(lambda: hb.error is not None)
        assert str(hb.error) == "the lease's keep-alives stopped: KeyError: 'TTL'"
    finally:
        hb.stop()
        raw.close()


@pytest.mark.slow  # waits out a lease and the monitor's polls
def test_the_monitor_declares_a_replica_whose_lease_expired_and_keeps_a_silent_live_one(etcd1):
    """Two replicas beat once each, attached to leases; neither writes again. Replica 0's lease is kept alive:
    it is not declared, though its beat never moves for twice the heartbeat timeout. Replica 1's is not: it is
    declared once etcd deletes its key, within the TTL, etcd's expiry check, a poll and this host's slack."""
    secret = JobSecret.generate()
    sealer = Sealer(secret)
    raw = fresh_store(etcd1)
    init_keys(raw, sealer, 2)
    leases = {r: raw.leased(f"hb/{r}", MIN_TTL) for r in (0, 1)}
    for r, leased in leases.items():
        body = json.dumps({"inc": 1, "beat": 1, "phase": "compute", "count": 1, "lease": MIN_TTL})
        leased.put(sealer.seal(f"hb/{r}", body.encode(), sequence(1, 1)))
    written = time.monotonic()
    stop, keep = threading.Event(), threading.Event()

    def keep_alive() -> None:
        while not keep.wait(MIN_TTL / 3):
            leases[0].keep_alive()

    keeper = threading.Thread(target=keep_alive)
    keeper.start()
    timeout, poll = 0.8, 0.05
    monitor_store = raw.clone()
    monitor = threading.Thread(target=run_monitor, args=(monitor_store, sealer, 2, timeout, 60.0, stop, 1, poll))
    monitor.start()
    deaths = ControlStore("etcd://test", 9, secret, store=raw.clone())
    try:
        until(lambda: deaths.deaths([0, 1])[1] == 1, timeout=MIN_TTL + 0.5 + poll + SLACK + 3)
        assert time.monotonic() - written <= MIN_TTL + 0.5 + poll + SLACK + 1
        time.sleep(2 * timeout)
        assert deaths.deaths([0, 1])[0] == 0, "a replica whose lease lives was declared dead"
    finally:
        stop.set()
        keep.set()
        monitor.join(5)
        keeper.join(5)
        for leased in leases.values():
            leased.close()
        monitor_store.close()
        raw.close()
