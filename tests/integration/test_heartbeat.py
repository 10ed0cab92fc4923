"""A replica's heartbeat on a real coordinator and a real etcd: news written before the replica ends."""

from __future__ import annotations

import json

import pytest

from lightning_recover.errors import CoordinatorLostError
from lightning_recover.protocol.coordinator import Coordinator
from lightning_recover.protocol.heartbeat import Heartbeat, Progress
from lightning_recover.protocol.messages import ControlStore, JobSecret
from tests.integration.test_etcd_store import fresh_store


def test_news_is_written_at_once_when_asked_not_a_period_later():
    """A job can end within one period of a replica's last news (the members that left at a commit, on its
    report): ``send_news`` writes it then, so the status page and the event log still read it."""
    secret = JobSecret.generate()
    coord = Coordinator("127.0.0.1", 0, 1, 30.0, secret)
    store = ControlStore(coord.addr, 0, secret, timeout=5.0)
    progress = Progress()
    heartbeat = Heartbeat(store, 0, store.add("inc/0", 1), 3600.0, progress)  # no periodic beat in this test
    heartbeat.start()
    try:
        first = store.get_fresh("hb/0")
        assert first is not None and "left" not in json.loads(first[1])
        progress.report = {"gen": 1, "left": [1, [2]]}
        heartbeat.send_news()  # nothing new: no beat
        assert store.get_fresh("hb/0") == first  # the same beat as before
        progress.urgent = True
        heartbeat.send_news()
        news = store.get_fresh("hb/0")
        assert news is not None and news[0] > first[0] and json.loads(news[1])["left"] == [1, [2]]
        assert not progress.urgent
    finally:
        heartbeat.stop()


def test_a_beat_says_joining_while_the_main_thread_waits_in_a_round():
    """The beats of a replica in a join round say ``"joining"`` (the partition judge does not probe a group that
    waits on the control plane: ``reachability.waits_on_its_data_network``), and no longer once it left it."""
    secret = JobSecret.generate()
    coord = Coordinator("127.0.0.1", 0, 1, 30.0, secret)
    store = ControlStore(coord.addr, 0, secret, timeout=5.0)
    progress = Progress()
    heartbeat = Heartbeat(store, 0, store.add("inc/0", 1), 3600.0, progress)  # beats only when asked
    heartbeat.start()
    try:
        beats = []
        with progress.in_round():
            progress.urgent = True
            heartbeat.send_news()
            beats.append(store.get_fresh("hb/0"))
        progress.urgent = True
        heartbeat.send_news()
        beats.append(store.get_fresh("hb/0"))
        assert all(b is not None for b in beats) and beats[1][0] > beats[0][0]
        assert json.loads(beats[0][1]).get("joining") is True
        assert "joining" not in json.loads(beats[1][1])
    finally:
        heartbeat.stop()


def test_a_heartbeat_whose_first_beat_failed_stops_cleanly():
    """``start`` raises when the first beat cannot be written (the control plane is gone): the membership still
    holds the heartbeat and stops it when the replica ends, which must not raise in turn."""
    secret = JobSecret.generate()
    coord = Coordinator("127.0.0.1", 0, 1, 30.0, secret)
    store = ControlStore(coord.addr, 0, secret, timeout=1.0)
    heartbeat = Heartbeat(store, 0, store.add("inc/0", 1), 3600.0, Progress())
    del coord  # the coordinator's server goes: the first beat fails
    with pytest.raises(CoordinatorLostError):
        heartbeat.start()
    heartbeat.stop()


def test_a_leased_heartbeat_keeps_its_last_news_when_it_stops(etcd1):
    """etcd: a beat lives in a lease, revoked when the replica stops. A monitor whose view runs behind could then
    miss the last beat's news (the members that left at the job's last commits); the last beat is written again
    without the lease first, so the monitor's last look at the job's end still reads it."""
    secret = JobSecret.generate()
    store = ControlStore("etcd://test", 0, secret, store=fresh_store(etcd1))
    progress = Progress()
    heartbeat = Heartbeat(store, 0, store.add("inc/0", 1), 3600.0, progress, timeout=2.0)
    heartbeat.start()
    progress.report = {"gen": 1, "left": [1, [2]]}
    progress.urgent = True
    heartbeat.send_news()
    during = store.get_fresh("hb/0")
    assert during is not None and json.loads(during[1])["lease"] == 2
    heartbeat.stop()
    last = store.get_fresh("hb/0")
    assert last is not None, "the lease's revocation deleted the last beat"
    assert last[0] > during[0] and json.loads(last[1])["left"] == [1, [2]] and "lease" not in json.loads(last[1])
