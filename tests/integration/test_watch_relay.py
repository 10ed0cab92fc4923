"""The host's watch relay (``control_plane/watch_relay.py``) against a real etcd: one watch stream per host, its
view followed by the host's processes over a Unix socket, with the promises of a process's own view (in order,
never older, nothing while not current), and a follower that watches etcd itself once no relay answers."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from lightning_recover import env
from lightning_recover.control_plane import watch_relay
from lightning_recover.control_plane.config import connect_store
from lightning_recover.control_plane.etcd_client import EtcdClient, b64
from lightning_recover.control_plane.etcd_store import EtcdStore
from lightning_recover.control_plane.watch_relay import RelayedView, WatchRelay
from tests.integration.test_etcd_watch import fresh_store, until


def client_of(cluster, timeout: float = 5.0) -> EtcdClient:
    return EtcdClient(cluster.endpoints, **cluster.tls_files, timeout=timeout)


@pytest.fixture
def relay_dir(tmp_path):
    # A Unix socket's path is limited to 107 bytes: pytest's tmp_path can be longer.
    short = f"/tmp/lr-relay-{os.getpid()}-{time.monotonic_ns()}"
    os.mkdir(short, 0o700)
    try:
        yield short
    finally:
        for name in os.listdir(short):
            os.unlink(os.path.join(short, name))
        os.rmdir(short)


def test_followers_see_every_write_in_order_through_one_stream(etcd1, relay_dir):
    store = fresh_store(etcd1)
    store.set("before", b"0")
    relay = WatchRelay(client_of(etcd1), store.prefix, os.path.join(relay_dir, "relay")).start()
    own_clients = [client_of(etcd1) for _ in range(3)]
    followers = [RelayedView(relay.path, c, store.prefix).start() for c in own_clients]
    seen: list[list[int]] = [[] for _ in followers]
    stop = threading.Event()

    def reader(i: int) -> None:
        while not stop.is_set():
            hit, value = followers[i].lookup(store.prefix + b"counter")
            if hit and value is not None:
                seen[i].append(int(value))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(len(followers))]
    try:
        for f in followers:
            until(lambda f=f: f.lookup(store.prefix + b"before") == (True, b"0"))
        assert relay.followers == 3
        for t in threads:
            t.start()
        for i in range(1, 21):
            store.set("counter", str(i).encode())
        store.delete_key("before")
        for f in followers:
            until(lambda f=f: f.lookup(store.prefix + b"counter") == (True, b"20"))
            until(lambda f=f: f.lookup(store.prefix + b"before") == (True, None))
            assert f.revision == relay.view.revision or f.revision <= relay.view.revision
            assert f.relayed
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join(5)
        for f in followers:
            f.close()
        relay.close()
    for values in seen:
        assert values and values == sorted(values), "a follower answered an older value after a newer one"
    # etcd sent each change once, to the relay's stream; the followers' own clients asked etcd nothing
    assert relay.view.events >= 21 and relay.view.resyncs == 1
    assert [c.requests for c in own_clients] == [0, 0, 0]
    assert all(f.events == relay.view.events for f in followers)


def test_a_follower_is_current_only_while_the_relay_is(etcd1, relay_dir):
    """The member serving the relay's stream dies: every follower stops answering within the relay's stale
    bound, and once the relay has caught up they serve the write made meanwhile, without a stream of their own."""
    store = fresh_store(etcd1, timeout=15.0)
    store.set("k", b"1")
    relay = WatchRelay(client_of(etcd1, 15.0), store.prefix, os.path.join(relay_dir, "relay"), stale_after=0.3).start()
    own = client_of(etcd1)
    follower = RelayedView(relay.path, own, store.prefix, stale_after=0.3).start()
    key = store.prefix + b"k"
    try:
        until(lambda: follower.lookup(key) == (True, b"1"))
        etcd1.kill(0)
        try:
            until(lambda: not relay.view.healthy, timeout=2.0)
            until(lambda: not follower.healthy, timeout=2.0)
            assert follower.lookup(key) == (False, None)
        finally:
            etcd1.restart(0)
        store.set("k", b"2")
        until(lambda: follower.lookup(key) == (True, b"2"), timeout=10.0)
        assert follower.relayed and own.requests == 0
    finally:
        follower.close()
        relay.close()


def test_without_a_relay_a_follower_watches_etcd_itself(etcd1, relay_dir):
    store = fresh_store(etcd1)
    store.set("k", b"1")
    follower = RelayedView(os.path.join(relay_dir, "nobody"), client_of(etcd1), store.prefix).start()
    try:
        until(lambda: follower.lookup(store.prefix + b"k") == (True, b"1"))
        assert not follower.relayed
        store.set("k", b"2")
        until(lambda: follower.lookup(store.prefix + b"k") == (True, b"2"))
    finally:
        follower.close()


def test_a_closed_relay_leaves_its_followers_on_their_own_streams(etcd1, relay_dir):
    store = fresh_store(etcd1)
    store.set("k", b"1")
    relay = WatchRelay(client_of(etcd1), store.prefix, os.path.join(relay_dir, "relay")).start()
    follower = RelayedView(relay.path, client_of(etcd1), store.prefix).start()
    try:
        until(lambda: follower.lookup(store.prefix + b"k") == (True, b"1"))
        relay.close()
        assert not os.path.exists(relay.path)
        until(lambda: not follower.relayed)
        store.set("k", b"2")
        until(lambda: follower.lookup(store.prefix + b"k") == (True, b"2"))
    finally:
        follower.close()


def test_a_relay_serves_only_its_prefix(etcd1, relay_dir):
    store, other = fresh_store(etcd1), fresh_store(etcd1)
    other.set("mine", b"1")
    relay = WatchRelay(client_of(etcd1), store.prefix, os.path.join(relay_dir, "relay")).start()
    follower = RelayedView(relay.path, client_of(etcd1), other.prefix).start()
    try:
        until(lambda: follower.lookup(other.prefix + b"mine") == (True, b"1"))
        assert not follower.relayed  # refused: it watches its own prefix itself
        assert relay.followers == 0
    finally:
        follower.close()
        relay.close()


def test_a_follower_that_stops_reading_is_dropped(etcd1, relay_dir, monkeypatch):
    """A process that stops reading its socket (frozen) does not hold the relay's memory: once its backlog is past
    the limit it is dropped. A follower that comes then gets the whole range in one snapshot larger than the limit."""
    monkeypatch.setattr(watch_relay, "BACKLOG_LIMIT", 64 << 10)
    store = fresh_store(etcd1)
    relay = WatchRelay(client_of(etcd1), store.prefix, os.path.join(relay_dir, "relay")).start()
    frozen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    frozen.connect(relay.path)
    frozen.sendall(json.dumps({"prefix": b64(store.prefix)}).encode() + b"\n")
    late = None
    try:
        until(lambda: relay.followers == 1)
        # Changes until the frozen follower's backlog is past the limit: past the socket's buffer, the send its
        # relay thread blocks in, and the head of its queue (a loaded etcd batches changes into fewer lines).
        deadline, i = time.monotonic() + 60.0, 0
        while relay.followers:
            assert time.monotonic() < deadline, "the follower that stopped reading was not dropped"
            store.set(f"big{i % 40}", b"%d" % i + b"x" * (32 << 10))
            i += 1
        last = (store.prefix + b"big%d" % ((i - 1) % 40), b"%d" % (i - 1) + b"x" * (32 << 10))
        # Writes made after the drop may still be in etcd's stream: the late follower is to get one snapshot.
        until(lambda: relay.view.lookup(last[0]) == (True, last[1]), timeout=30.0)
        late = RelayedView(relay.path, client_of(etcd1), store.prefix).start()
        until(lambda: late.lookup(last[0]) == (True, last[1]), timeout=30.0)
        assert late.relayed and relay.followers == 1
        held = [late.lookup(store.prefix + b"big%d" % k) for k in range(min(i, 40))]
        assert all(hit for hit, _ in held) and sum(len(v) for _, v in held) > 64 << 10  # larger than the limit
    finally:
        frozen.close()
        if late is not None:
            late.close()
        relay.close()


def test_a_replicas_store_follows_the_relay_its_launcher_names(etcd1, relay_dir, monkeypatch):
    """``connect_store`` (what a replica connects with) follows the relay named in its environment."""
    url = etcd1.url
    for name, value in {**etcd1.environment(), env.JOB: f"relay-job-{time.monotonic_ns()}"}.items():
        monkeypatch.setenv(name, value)
    launcher = connect_store(url, 10.0)
    launcher.set("meta/replicas", b"1")
    relay = WatchRelay(client_of(etcd1), launcher.prefix, os.path.join(relay_dir, "relay")).start()
    monkeypatch.setenv(env.WATCH_RELAY, relay.path)
    replica = connect_store(url, 10.0)
    try:
        assert isinstance(replica, EtcdStore)
        until(lambda: replica.cached("meta/replicas") == (True, b"1"))
        assert isinstance(replica.view, RelayedView) and replica.view.relayed
        assert relay.followers == 1
    finally:
        replica.close()
        launcher.close()
        relay.close()


@pytest.mark.slow  # waits out a silent relay (RELAY_SILENT_AFTER, 4 s)
def test_a_silent_relay_is_asked_again_and_a_gone_one_left(etcd1, relay_dir):
    """A relay that accepts and sends nothing (its host starved): the follower answers nothing, connects again
    and does not take it for gone; once nothing listens at the path, it watches etcd itself."""
    store = fresh_store(etcd1)
    store.set("k", b"1")
    path = os.path.join(relay_dir, "silent")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(path)
    silent.listen(8)
    silent.settimeout(3 * watch_relay.RELAY_SILENT_AFTER)  # a follower that never came back fails the test
    follower = RelayedView(path, client_of(etcd1), store.prefix).start()
    accepted = []
    try:
        for _ in range(2):  # the first connection, and the one after its silence
            conn, _ = silent.accept()
            accepted.append(conn)
        assert follower.relayed and follower.lookup(store.prefix + b"k") == (False, None)
        silent.close()
        os.unlink(path)
        until(lambda: follower.lookup(store.prefix + b"k") == (True, b"1"), timeout=watch_relay.RELAY_SILENT_AFTER + 5)
        assert not follower.relayed
    finally:
        for conn in accepted:
            conn.close()
        silent.close()
        follower.close()
