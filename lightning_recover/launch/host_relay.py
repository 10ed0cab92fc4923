"""A launcher's watch relay on etcd: where it gets the job's keys from, and the relay itself.

Three placements (docs/howto.md, "Hundreds of hosts"): etcd itself (the default), a relay at ``--watch-upstream
HOST:PORT`` (a ``lightning-recover watch-relay`` run by hand), or ``--watch-rack NAME``: the launchers of rack NAME
elect one of themselves to watch etcd and serve the others (control_plane/rack_relay.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Optional

from lightning_recover import env
from lightning_recover.control_plane.config import EtcdSettings
from lightning_recover.control_plane.rack_relay import RackRelayRole, route_address
from lightning_recover.control_plane.watch_relay import WatchRelay
from lightning_recover.observe.address import parse_address

_RACK_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True)
class RelayPlacement:
    """Where this host's relay gets the job's keys: a relay at ``upstream``, its rack's elected relay (``rack``,
    served on ``rack_address`` where it is elected), or etcd itself (neither)."""

    upstream: Optional[tuple[str, int]] = None
    rack: Optional[str] = None
    rack_address: Optional[str] = None


def relay_placement(
    upstream: Optional[str],
    rack: Optional[str],
    rack_address: Optional[str],
    etcd: bool,
    environ: Mapping[str, str] = os.environ,
) -> RelayPlacement:
    """The placement the options (or, where not given, the environment) ask for; ``ValueError`` with its fix for
    one that cannot be: a relay without etcd, both an upstream and a rack, a malformed address or rack name."""
    upstream = upstream or environ.get(env.WATCH_UPSTREAM) or None
    rack = rack or environ.get(env.WATCH_RACK) or None
    rack_address = rack_address or environ.get(env.WATCH_RACK_ADDRESS) or None
    if (upstream or rack) and not etcd:
        given = "--watch-upstream" if upstream else "--watch-rack"
        raise ValueError(
            f"{given}: a watch relay serves etcd's keys. HINT: use it with --control-plane etcd://..., or drop it "
            f"(and unset {env.WATCH_UPSTREAM if upstream else env.WATCH_RACK})"
        )
    if upstream and rack:
        raise ValueError(
            "--watch-upstream and --watch-rack both name where this host's relay gets the job's keys. HINT: one of "
            f"them (a rack elects its relay; an upstream is one you run), and check {env.WATCH_UPSTREAM} and "
            f"{env.WATCH_RACK}"
        )
    if rack_address and not rack:
        raise ValueError("--watch-rack-address: the address a rack's relay serves on. HINT: give --watch-rack NAME")
    if rack is not None and not _RACK_NAME.fullmatch(rack):
        raise ValueError(
            f"--watch-rack {rack!r}: a rack's name is 1-128 letters, digits, '.', '_' or '-'. HINT: e.g. rack-07"
        )
    address = parse_address(upstream, "upstream watch relay", "--watch-upstream") if upstream else None
    return RelayPlacement(upstream=address, rack=rack, rack_address=rack_address)


def rack_listen_address(settings: EtcdSettings, placement: RelayPlacement) -> str:
    """The address this host serves its rack's relay on where elected: the one given, else the address it
    reaches its first etcd member from."""
    if placement.rack_address:
        return placement.rack_address
    host, port = parse_address(settings.endpoints[0], "etcd endpoint", "--control-plane")
    return route_address((host, port))


def start_host_relay(
    settings: EtcdSettings,
    secret_key: bytes,
    path: str,
    placement: RelayPlacement,
    say: Callable[[str], object],
) -> tuple[WatchRelay, Optional[RackRelayRole]]:
    """This host's relay, serving its processes on the Unix socket ``path``, started where ``placement`` says;
    with a rack, also the launcher's part in electing the rack's relay (close it before the relay: the followers,
    whose connections end with the relay, then find the rack's key gone and elect another at once)."""
    prefix = settings.watched_prefix.encode()
    if placement.rack is None:
        relay = WatchRelay(settings.client(), prefix, path, upstream=placement.upstream, secret_key=secret_key, say=say)
        return relay.start(), None
    listen = (rack_listen_address(settings, placement), 0)
    role = RackRelayRole(settings.client(), settings.prefix.encode(), placement.rack, listen, say=say)
    try:
        relay = WatchRelay(
            settings.client(), prefix, path, listen=listen, upstream=role, secret_key=secret_key, say=say
        )
    except BaseException:
        role.close()
        raise
    assert relay.address is not None
    role.address = relay.address  # the port it was given: what the rack's key names where it is elected
    return relay.start(), role
