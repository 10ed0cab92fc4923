"""A rack's watch relay, elected among its hosts' launchers: no relay to start or place by hand.

Why: at hundreds of hosts etcd should send each change of the job's keys once per rack, not once per host
(watch_relay.py, "Relays can follow a relay"). ``lightning-recover watch-relay`` does it, but someone has to run one
per rack, tell every launcher where it is, and restart it when its host dies. With ``--watch-rack NAME`` the
launchers of rack NAME do it themselves:

* every launcher's host relay listens over TCP on its rack address (:func:`route_address`: the address this host
  reaches etcd from, unless given), and asks its :class:`RackRelayRole` whom to follow before each connection;
* the role reads ``relays/{NAME}`` under the job's prefix. Absent: it claims the key in a lease of its own (one
  transaction; the first launcher to ask wins), and its relay then watches etcd and serves the rack. Present: its
  relay follows the address the key names (a relay there proves it holds the job's secret before anything is
  taken from it, watch_relay.py, so a wrong address costs a fallback to etcd, never a wrong key);
* the holder keeps its lease alive every TTL / 3 on a thread of its own. When its launcher ends, the lease is
  revoked and the key goes at once: the followers' connections close, they ask again, and one of them is the new
  holder. When its host dies (or loses etcd), the followers watch etcd themselves (within the relay's silence
  bound) and ask again after ``UPSTREAM_RETRY_AFTER``, by when the lease has expired (``RACK_LEASE_TTL`` is
  shorter). A holder cut off from its rack but not from etcd keeps its lease, so the role: its followers watch etcd
  themselves and try it again every ``UPSTREAM_RETRY_AFTER``, as with a relay run by hand.

The cost at etcd: one read per launcher when it starts following, one grant and one transaction per election,
and each holder's keep-alives (not Raft writes: etcd_liveness.py).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Optional

from lightning_recover.control_plane import etcd_client as ec
from lightning_recover.control_plane.etcd_liveness import LeasedKey
from lightning_recover.control_plane.watch_relay import address_text

#: Seconds a rack relay's claim outlives its holder (whole seconds, etcd's unit): below the followers' retry
#: period (watch_relay.UPSTREAM_RETRY_AFTER), so a follower that left a dead holder finds the key free when it
#: asks again.
RACK_LEASE_TTL = 10


def rack_key(prefix: bytes, rack: str) -> bytes:
    """The key that names rack ``rack``'s relay: ``HOST:PORT`` in its holder's lease."""
    return prefix + b"relays/" + rack.encode()


def route_address(endpoint: tuple[str, int]) -> str:
    """The local address this host sends from to reach ``endpoint`` (an etcd member): the address its rack's
    hosts reach it on where the rack and etcd share a network. No packet is sent (a UDP socket's connect only
    chooses the route)."""
    host, port = endpoint
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


def relay_address(value: bytes) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[V6]:PORT``) as read from a rack's key; ``ValueError`` for anything else (the key's
    value comes from the network: it is parsed, never evaluated)."""
    text = value.decode("ascii")
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535 or any(c.isspace() for c in host):
        raise ValueError(f"a rack relay's address {text!r} is not HOST:PORT")
    return host, int(port)


def written_address(address: tuple[str, int]) -> bytes:
    return address_text(*address).encode("ascii")


class RackRelayRole:
    """This launcher's part in electing its rack's relay: :meth:`choose` says whom its relay follows (None: it
    holds the role, so its relay watches etcd and serves the rack); :meth:`serving` whether it holds the role
    now (no request). ``address``: where this launcher's relay serves over TCP. ``client`` is used by this role
    alone (its keep-alives get a connection of their own)."""

    def __init__(
        self,
        client: ec.EtcdClient,
        prefix: bytes,
        rack: str,
        address: tuple[str, int],
        *,
        ttl: int = RACK_LEASE_TTL,
        say: Optional[Callable[[str], object]] = None,
    ) -> None:
        self.rack = rack
        self.address = address
        self.key = rack_key(prefix, rack)
        self._client = client
        self._claim = LeasedKey(client, self.key, ttl)
        self._say = say
        self._lock = threading.Lock()  # one choice at a time, and none after close()
        self._closed = False

    def serving(self) -> bool:
        """Whether this launcher holds the role: its claim's lease renewed within its TTL."""
        return self._claim.held()

    def choose(self) -> Optional[tuple[str, int]]:
        """The relay to follow now, or None where this launcher holds the role (claimed now if nobody did).
        ``ValueError`` where the key names no address; etcd's errors (``RecoverError``) pass through."""
        with self._lock:
            if self._closed:
                raise ValueError("this launcher's rack role is closed")
            if self.serving():
                return None
            value, _ = self._client.get(self.key)
            if value is None:
                # Keep-alives first: a claim etcd applied but whose answer did not come is kept alive all the same.
                self._claim.start_keeping()
                value = self._claim.claim(written_address(self.address))
                if value is None:
                    if self._say is not None:
                        self._say(f"serves rack {self.rack}'s watch relay at {written_address(self.address).decode()}")
                    return None
            chosen = relay_address(value)
            # Its own address under a lease it no longer renews (etcd answered late): the rack follows this
            # relay until that lease expires, so it watches etcd meanwhile, and claims anew after it.
            return None if chosen == self.address else chosen

    def close(self) -> None:
        """Give the role up (the key goes at once: the followers elect another holder) and close the client; a
        choice in progress ends first, and none is made afterwards."""
        with self._lock:
            self._closed = True
            self._claim.close()
