"""The host's watch relay (``control_plane/watch_relay.py``) against a real etcd: one watch stream per host, its
view followed by the host's processes over a Unix socket, with the promises of a process's own view (in order,
never older, nothing while not current), and a follower that watches etcd itself once no relay answers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from lightning_recover import env
from lightning_recover.control_plane import watch_relay
from lightning_recover.control_plane.config import connect_store, parse, with_job
from lightning_recover.control_plane.etcd_client import EtcdClient, b64
from lightning_recover.control_plane.etcd_store import EtcdStore
from lightning_recover.control_plane.watch_relay import RelayedView, WatchRelay
from lightning_recover.launch.relay_command import served_address
from lightning_recover.protocol.messages import JobSecret
from tests.integration.test_etcd_watch import fresh_store, until


def client_of(cluster, timeout: float = 5.0) -> EtcdClient:
    return EtcdClient(cluster.endpoints, **cluster.tls_files, timeout=timeout)


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


# ---------------------------------------------------------------- relays that follow a relay (TCP, another host)

SECRET = JobSecret(b"r" * 32)


def rack_relay(cluster, prefix: bytes, secret: JobSecret = SECRET, port: int = 0, **kw) -> WatchRelay:
    return WatchRelay(
        client_of(cluster, kw.pop("timeout", 5.0)), prefix, listen=("127.0.0.1", port), secret_key=secret.key, **kw
    ).start()


def test_a_host_relay_follows_a_rack_relay_and_etcd_streams_once(etcd1, relay_dir):
    """Two hosts' relays follow one rack relay over TCP, and each host's process follows its host's relay: every
    write reaches every process in order, through the rack relay's one stream; the hosts' relays asked etcd nothing."""
    store = fresh_store(etcd1)
    store.set("before", b"0")
    rack = rack_relay(etcd1, store.prefix)
    hosts_clients = [client_of(etcd1) for _ in range(2)]
    hosts = [
        WatchRelay(
            c, store.prefix, os.path.join(relay_dir, f"host{i}"), upstream=rack.address, secret_key=SECRET.key
        ).start()
        for i, c in enumerate(hosts_clients)
    ]
    own = [client_of(etcd1) for _ in hosts]
    followers = [RelayedView(h.path, c, store.prefix).start() for h, c in zip(hosts, own)]
    try:
        for f in followers:
            until(lambda f=f: f.lookup(store.prefix + b"before") == (True, b"0"))
        assert rack.followers == 2 and all(h.followers == 1 for h in hosts)
        for i in range(1, 21):
            store.set("counter", str(i).encode())
        for f in followers:
            until(lambda f=f: f.lookup(store.prefix + b"counter") == (True, b"20"))
        assert all(isinstance(h.view, RelayedView) and h.view.relayed for h in hosts)
        assert rack.view.resyncs == 1 and rack.view.events >= 20
        assert [c.requests for c in hosts_clients + own] == [0, 0, 0, 0]
        assert all(f.events == rack.view.events for f in followers)
    finally:
        for f in followers:
            f.close()
        for h in hosts:
            h.close()
        rack.close()


def test_a_tree_is_current_only_while_its_top_relay_is(etcd1, relay_dir):
    """The etcd member serving the rack relay's stream dies: the host relay and its process stop answering within
    the bound (each batch's age at the rack relay crosses the TCP link), and serve the next write once it is back."""
    store = fresh_store(etcd1, timeout=15.0)
    store.set("k", b"1")
    rack = rack_relay(etcd1, store.prefix, timeout=15.0, stale_after=0.3)
    host_client = client_of(etcd1)
    host = WatchRelay(
        host_client, store.prefix, os.path.join(relay_dir, "host"), 0.3, upstream=rack.address, secret_key=SECRET.key
    ).start()
    follower = RelayedView(host.path, client_of(etcd1), store.prefix, stale_after=0.3).start()
    key = store.prefix + b"k"
    try:
        until(lambda: follower.lookup(key) == (True, b"1"))
        etcd1.kill(0)
        try:
            until(lambda: not rack.view.healthy, timeout=2.0)
            until(lambda: not host.view.healthy and not follower.healthy, timeout=2.0)
            assert follower.lookup(key) == (False, None)
        finally:
            etcd1.restart(0)
        store.set("k", b"2")
        until(lambda: follower.lookup(key) == (True, b"2"), timeout=10.0)
        assert host.view.relayed and host_client.requests == 0
    finally:
        follower.close()
        host.close()
        rack.close()


def test_a_rack_relay_serves_only_who_holds_the_secret(etcd1, relay_dir):
    """A follower with another secret gets no byte of the job's keys and watches etcd itself; one that answers
    the relay's nonce wrongly is closed unanswered."""
    store = fresh_store(etcd1)
    store.set("k", b"1")
    rack = rack_relay(etcd1, store.prefix)
    stranger = RelayedView(rack.address, client_of(etcd1), store.prefix, secret_key=b"x" * 32).start()
    raw = socket.create_connection(rack.address, timeout=5.0)
    try:
        until(lambda: stranger.lookup(store.prefix + b"k") == (True, b"1"))
        assert not stranger.relayed and rack.followers == 0
        raw.sendall(json.dumps({"prefix": b64(store.prefix), "nonce": "00" * 16}).encode() + b"\n")
        lines = raw.makefile("rb")
        assert set(json.loads(lines.readline())) == {"nonce", "proof"}  # the relay proves itself first
        raw.sendall(json.dumps({"proof": "00" * 32}).encode() + b"\n")
        assert lines.readline() == b""  # closed, nothing sent
        assert rack.followers == 0
    finally:
        raw.close()
        stranger.close()
        rack.close()


def test_an_impostor_upstream_is_not_followed(etcd1, relay_dir):
    """Something at the upstream's address that cannot prove it holds the job's secret (an old relay of another
    job, an unrelated server) is never followed: the host relay watches etcd itself."""
    store = fresh_store(etcd1)
    store.set("k", b"1")
    impostor = WatchRelay(client_of(etcd1), store.prefix, listen=("127.0.0.1", 0), secret_key=b"i" * 32).start()
    host = WatchRelay(
        client_of(etcd1),
        store.prefix,
        os.path.join(relay_dir, "host"),
        upstream=impostor.address,
        secret_key=SECRET.key,
    ).start()
    follower = RelayedView(host.path, client_of(etcd1), store.prefix).start()
    try:
        until(lambda: follower.lookup(store.prefix + b"k") == (True, b"1"))
        assert not host.view.relayed and impostor.followers == 0
    finally:
        follower.close()
        host.close()
        impostor.close()


def test_a_host_relay_watches_etcd_while_its_upstream_is_gone_and_goes_back(etcd1, relay_dir, monkeypatch):
    """The rack relay stops: the host relay watches etcd itself (its process stays current) and says so once,
    however many of its tries find the relay still gone; a rack relay started again at the same address is followed
    again after ``UPSTREAM_RETRY_AFTER``."""
    monkeypatch.setattr(watch_relay, "UPSTREAM_RETRY_AFTER", 0.5)
    store = fresh_store(etcd1)
    store.set("k", b"1")
    rack = rack_relay(etcd1, store.prefix)
    address = rack.address
    said: list[str] = []
    host = WatchRelay(
        client_of(etcd1),
        store.prefix,
        os.path.join(relay_dir, "host"),
        upstream=address,
        secret_key=SECRET.key,
        say=said.append,
    )
    host.start()
    follower = RelayedView(host.path, client_of(etcd1), store.prefix).start()
    key = store.prefix + b"k"
    again = None
    try:
        until(lambda: follower.lookup(key) == (True, b"1") and host.view.relayed)
        rack.close()
        until(lambda: not host.view.relayed)
        store.set("k", b"2")
        until(lambda: follower.lookup(key) == (True, b"2"))
        until(lambda: host.view.found_gone >= 3, timeout=10.0)  # tried again twice, the relay still gone
        again = rack_relay(etcd1, store.prefix, port=address[1])
        until(lambda: again.followers == 1 and host.view.relayed, timeout=10.0)
        store.set("k", b"3")
        until(lambda: follower.lookup(key) == (True, b"3"))
        assert follower.relayed
        where = f"{address[0]}:{address[1]}"
        assert [line.split(",")[0].split(":")[0] for line in said] == [
            f"following the relay at {address[0]}",
            "watching etcd itself",
            f"following the relay at {address[0]}",
        ], said
        assert f"no relay at {where}" in said[1]
    finally:
        follower.close()
        host.close()
        if again is not None:
            again.close()


def test_the_watch_relay_command_serves_until_sigterm(etcd1, relay_dir, tmp_path):
    """``lightning-recover watch-relay``: a real process on a free port, followed by a host relay (it says so);
    SIGTERM ends it."""
    job = f"relay-command-{time.monotonic_ns()}"
    job_store = with_job(parse(etcd1.url, environ={**os.environ, **etcd1.environment()}), job).store()
    job_store.set("meta/replicas", b"1")
    log = str(tmp_path / "rack.log")
    proc, port = _relay_command(etcd1, job, SECRET.write_file(str(tmp_path)), log)
    host = None
    try:
        prefix = job_store.prefix
        host = WatchRelay(
            client_of(etcd1),
            prefix,
            os.path.join(relay_dir, "host"),
            upstream=("127.0.0.1", port),
            secret_key=SECRET.key,
        ).start()
        until(lambda: host.view.lookup(prefix + b"meta/replicas") == (True, b"1") and host.view.relayed)
        until(lambda: "follows this one (1 followers)" in open(log).read())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if host is not None:
            host.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        job_store.close()


def _relay_command(cluster, job: str, secret_file: str, log: str) -> tuple[subprocess.Popen, int]:
    """``lightning-recover watch-relay`` on a free port of loopback, its output into ``log``: the process and port."""
    cmd = [sys.executable, "-m", "lightning_recover.cli", "watch-relay", "--listen", "127.0.0.1:0"]
    cmd += ["--control-plane", cluster.url, "--job", job, "--secret-file", secret_file]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **cluster.environment()}, stderr=out)
    until(lambda: served_address(open(log).read()) is not None or proc.poll() is not None, timeout=60.0)
    address = served_address(open(log).read())
    assert proc.poll() is None and address is not None and address[0] == "127.0.0.1", open(log).read()
    return proc, address[1]


@pytest.mark.slow  # waits out a silent relay twice (RELAY_SILENT_AFTER, 4 s)
def test_a_frozen_rack_relay_is_left_within_two_silences(etcd1, relay_dir, tmp_path, monkeypatch):
    """The rack relay's process is stopped (SIGSTOP: its host frozen, its port still accepting): its hosts' views
    stop answering within their stale bound, and once a new connection's handshake is not answered either, the host
    relay watches etcd itself (its process current again); the relay resumed is followed again."""
    monkeypatch.setattr(watch_relay, "UPSTREAM_RETRY_AFTER", 1.0)
    job = f"relay-frozen-{time.monotonic_ns()}"
    job_store = with_job(parse(etcd1.url, environ={**os.environ, **etcd1.environment()}), job).store()
    job_store.set("k", b"1")
    key = job_store.prefix + b"k"
    proc, port = _relay_command(etcd1, job, SECRET.write_file(str(tmp_path)), str(tmp_path / "rack.log"))
    host = WatchRelay(
        client_of(etcd1),
        job_store.prefix,
        os.path.join(relay_dir, "host"),
        upstream=("127.0.0.1", port),
        secret_key=SECRET.key,
    ).start()
    follower = RelayedView(host.path, client_of(etcd1), job_store.prefix).start()
    try:
        until(lambda: follower.lookup(key) == (True, b"1") and host.view.relayed, timeout=10.0)
        os.kill(proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        until(lambda: not host.view.healthy, timeout=watch_relay.STALE_AFTER + 2.0)
        job_store.set("k", b"2")
        until(lambda: follower.lookup(key) == (True, b"2"), timeout=2 * watch_relay.RELAY_SILENT_AFTER + 5.0)
        assert not host.view.relayed
        print(f"\nfrozen rack relay: its host relay watched etcd itself {time.monotonic() - frozen:.2f}s after SIGSTOP")
        os.kill(proc.pid, signal.SIGCONT)
        until(lambda: host.view.relayed and host.view.healthy, timeout=10.0)
        job_store.set("k", b"3")
        until(lambda: follower.lookup(key) == (True, b"3"))
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        follower.close()
        host.close()
        proc.terminate()
        proc.wait(timeout=10)
        job_store.close()


class TamperingProxy:
    """A man in the middle of a TCP relay link: forwards both ways, and in the relay's direction replaces ``old``
    with ``new`` (same length) wherever a chunk holds it."""

    def __init__(self, target: tuple[str, int], old: bytes, new: bytes) -> None:
        self.target, self.old, self.new = target, old, new
        self.tampered = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.target)
            self.conns += [down, up]
            threading.Thread(target=self._pipe, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, down, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if tamper and self.old in chunk:
                    chunk = chunk.replace(self.old, self.new)
                    self.tampered += 1
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


def test_a_batch_altered_on_the_way_is_never_applied(etcd1, relay_dir):
    """Someone on the path between the rack relay and a host's relay changes a value in a batch (after the
    handshake, which it cannot fake): the batch fails its MAC, nothing of it is applied, and the host relay watches
    etcd itself, which serves the true value."""
    store = fresh_store(etcd1)
    store.set("k", b"1")
    rack = rack_relay(etcd1, store.prefix)
    assert rack.address is not None
    proxy = TamperingProxy(rack.address, b64(b"1").encode(), b64(b"2").encode())
    host = WatchRelay(
        client_of(etcd1), store.prefix, os.path.join(relay_dir, "host"), upstream=proxy.address, secret_key=SECRET.key
    )
    seen = []
    host.view.follow(lambda line: seen.append(line))
    host.start()
    key = store.prefix + b"k"
    try:
        until(lambda: host.view.lookup(key) == (True, b"1") and not host.view.relayed, timeout=10.0)
        assert proxy.tampered >= 1
        assert not any(b64(b"2").encode() in line for line in seen), "a value altered on the way was applied"
    finally:
        host.close()
        proxy.close()
        rack.close()


def test_a_relay_follows_a_relay_that_follows_a_relay(etcd1, relay_dir):
    """Three levels (``watch-relay --upstream``): a host's process sees every write through a host relay, a rack
    relay and a top relay, in order, and only the top relay's stream is etcd's."""
    store = fresh_store(etcd1)
    store.set("k", b"0")
    top = rack_relay(etcd1, store.prefix)
    middle_client = client_of(etcd1)
    middle = WatchRelay(
        middle_client, store.prefix, listen=("127.0.0.1", 0), upstream=top.address, secret_key=SECRET.key
    ).start()
    host_client = client_of(etcd1)
    host = WatchRelay(
        host_client, store.prefix, os.path.join(relay_dir, "host"), upstream=middle.address, secret_key=SECRET.key
    ).start()
    follower = RelayedView(host.path, client_of(etcd1), store.prefix).start()
    key = store.prefix + b"k"
    seen: list[int] = []
    try:
        until(lambda: follower.lookup(key) == (True, b"0"), timeout=10.0)
        for i in range(1, 11):
            store.set("k", str(i).encode())
            hit, value = follower.lookup(key)
            if hit and value is not None:
                seen.append(int(value))
        until(lambda: follower.lookup(key) == (True, b"10"))
        assert seen == sorted(seen), "a value older than one already served"
        assert top.followers == 1 and middle.followers == 1 and host.followers == 1
        assert middle.view.relayed and host.view.relayed and follower.relayed
        assert middle_client.requests == 0 and host_client.requests == 0  # only the top relay asked etcd
    finally:
        follower.close()
        host.close()
        middle.close()
        top.close()
