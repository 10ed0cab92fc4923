"""A rack's watch relay elected among its launchers (``control_plane/rack_relay.py``, ``launch/host_relay.py``)
against a real etcd: the first launcher of a rack serves it, the others follow, and when the holder ends or dies
another is elected; every host's process sees every write throughout."""

from __future__ import annotations

import os
import socket
import time

import pytest

from lightning_recover.control_plane import watch_relay
from lightning_recover.control_plane.config import parse
from lightning_recover.control_plane.etcd_client import EtcdClient
from lightning_recover.control_plane.etcd_liveness import LeasedKey
from lightning_recover.control_plane.rack_relay import RackRelayRole, rack_key
from lightning_recover.control_plane.watch_relay import RelayedView, WatchRelay
from lightning_recover.launch.host_relay import RelayPlacement, start_host_relay
from lightning_recover.protocol.messages import JobSecret
from tests.integration.test_etcd_watch import until
from tests.integration.test_watch_relay import client_of

SECRET = JobSecret(b"k" * 32)


def settings_of(cluster):
    job = f"rack-{os.getpid()}-{time.monotonic_ns()}"
    return parse(cluster.url, **cluster.tls_files, job=job)


class Host:
    """One launcher's relay in rack mode (as ``start_host_relay`` starts it), and one process following it."""

    def __init__(self, cluster, settings, relay_dir: str, name: str, rack: str = "r1") -> None:
        self.said: list[str] = []
        self.relay, self.role = start_host_relay(
            settings, SECRET.key, os.path.join(relay_dir, name), RelayPlacement(rack=rack), say=self.said.append
        )
        assert self.role is not None and self.relay.address is not None
        self.address = f"{self.relay.address[0]}:{self.relay.address[1]}"
        self.process = RelayedView(self.relay.path, client_of(cluster), settings.watched_prefix.encode()).start()

    def sees(self, key: bytes, value: bytes) -> bool:
        return self.process.lookup(key) == (True, value)

    def close(self) -> None:
        self.process.close()
        if self.role is not None:
            self.role.close()  # as the launcher does: the role first, then the relay
        self.relay.close()


def test_the_first_launcher_of_a_rack_serves_it_and_another_takes_over_when_it_ends(etcd1, relay_dir):
    """Three launchers of rack r1 start, the first before the others: it claims the rack's key and watches etcd, the
    other two follow it over TCP (their own etcd clients unused). The first one ends: the key goes with its lease,
    one of the two claims it at once and the other follows that one; every process saw every write throughout."""
    settings = settings_of(etcd1)
    writer = EtcdClient(etcd1.endpoints, **etcd1.tls_files, timeout=5.0)
    key = settings.watched_prefix.encode() + b"k"
    hosts = [Host(etcd1, settings, relay_dir, "h0")]
    try:
        first = hosts[0]
        until(lambda: first.said == [f"serves rack r1's watch relay at {first.address}"])
        rest = [Host(etcd1, settings, relay_dir, f"h{i}") for i in (1, 2)]
        hosts += rest
        writer.put(key, b"1")
        for h in hosts:
            until(lambda h=h: h.sees(key, b"1"))
        assert first.role.serving() and not any(h.role.serving() for h in rest)
        assert writer.get(rack_key(settings.prefix.encode(), "r1"))[0] == first.address.encode()
        for h in rest:
            until(lambda h=h: h.said == [f"following the relay at {first.address}"])
            assert h.relay.view.relayed
        until(lambda: first.relay.followers == 3)  # its own process and the two hosts' relays
        first.close()
        hosts.remove(first)
        until(lambda: sum(h.role.serving() for h in rest) == 1, timeout=10.0)
        (holder,) = [h for h in rest if h.role.serving()]
        (other,) = [h for h in rest if h is not holder]
        until(lambda: other.said[-1:] == [f"following the relay at {holder.address}"], timeout=10.0, what=other.said)
        until(lambda: f"serves rack r1's watch relay at {holder.address}" in holder.said, what=holder.said)
        for i in range(2, 12):
            writer.put(key, str(i).encode())
        for h in rest:
            until(lambda h=h: h.sees(key, b"11"))
        assert other.relay.view.relayed and other.relay.view.found_gone == 0, other.said
        assert writer.get(rack_key(settings.prefix.encode(), "r1"))[0] == holder.address.encode()
    finally:
        for h in hosts:
            h.close()
        writer.close()


@pytest.mark.slow  # waits for a lease to expire in etcd (its TTL, 2 s)
def test_a_rack_whose_holder_died_elects_anew_once_its_lease_expired(etcd1, relay_dir, monkeypatch):
    """The rack's key names a relay that is gone, in a lease nobody renews (its launcher died with its host): a
    launcher of the rack finds nothing there, watches etcd itself meanwhile (its process stays current) and,
    once etcd expired the lease, claims the key and serves the rack."""
    monkeypatch.setattr(watch_relay, "UPSTREAM_RETRY_AFTER", 0.5)
    settings = settings_of(etcd1)
    writer = EtcdClient(etcd1.endpoints, **etcd1.tls_files, timeout=5.0)
    prefix = settings.watched_prefix.encode()
    dead_lease = writer.lease_grant(2)
    listener = socket.create_server(("127.0.0.1", 0))
    dead_port = listener.getsockname()[1]
    listener.close()  # nothing serves there any more
    writer.put(rack_key(settings.prefix.encode(), "r1"), f"127.0.0.1:{dead_port}".encode(), lease=dead_lease)
    said: list[str] = []
    role = RackRelayRole(settings.client(), settings.prefix.encode(), "r1", ("127.0.0.1", 0), ttl=2, say=said.append)
    relay = WatchRelay(
        settings.client(),
        prefix,
        os.path.join(relay_dir, "h"),
        listen=("127.0.0.1", 0),
        upstream=role,
        secret_key=SECRET.key,
        say=said.append,
    )
    assert relay.address is not None
    role.address = relay.address
    relay.start()
    process = RelayedView(relay.path, client_of(etcd1), prefix).start()
    try:
        until(lambda: any("watching etcd itself" in line for line in said))
        writer.put(prefix + b"k", b"1")
        until(lambda: process.lookup(prefix + b"k") == (True, b"1"))  # current from etcd meanwhile
        mine = f"127.0.0.1:{relay.address[1]}"
        until(lambda: said[-1] == f"serves rack r1's watch relay at {mine}", timeout=15.0, what=said)
        assert role.serving() and len(said) == 2, said
        assert f"no relay at 127.0.0.1:{dead_port}" in said[0], said
        assert writer.get(rack_key(settings.prefix.encode(), "r1"))[0] == mine.encode()
        writer.put(prefix + b"k", b"2")
        until(lambda: process.lookup(prefix + b"k") == (True, b"2"))
    finally:
        process.close()
        role.close()
        relay.close()
        writer.close()


def test_a_claim_sent_again_finds_its_own_key_and_keeps_it(etcd1):
    """The etcd client sends a request again when its answer comes late; a create-if-absent claim that etcd applied
    the first time then finds its own key. It is its claim all the same: not given up (its lease revoked, the key
    deleted, as before), while another launcher's claim still finds the key taken."""
    settings = settings_of(etcd1)
    key = rack_key(settings.prefix.encode(), "r1")
    mine, theirs = LeasedKey(settings.client(), key, 5), LeasedKey(settings.client(), key, 5)
    writer = EtcdClient(etcd1.endpoints, **etcd1.tls_files, timeout=5.0)
    try:
        assert mine.claim(b"10.0.0.1:7400") is None
        assert mine.claim(b"10.0.0.1:7400") is None and mine.held()  # the same claim, sent again
        assert writer.get(key)[0] == b"10.0.0.1:7400"
        assert theirs.claim(b"10.0.0.2:7400") == b"10.0.0.1:7400" and not theirs.held()
        assert writer.get(key)[0] == b"10.0.0.1:7400"
    finally:
        mine.close()
        theirs.close()
        writer.close()
