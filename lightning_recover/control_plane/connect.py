"""Where a process picks its control plane's backend: once, from the address it was given.

``HOST:PORT`` is the embedded coordinator (:mod:`~lightning_recover.control_plane.embedded`), an ``etcd://``
(or ``etcd+insecure://``) URL an etcd cluster (:mod:`~lightning_recover.control_plane.etcd_store`, imported
only then). Both come back as a :class:`~lightning_recover.protocol.backend.ControlPlane`.
"""

from __future__ import annotations

from typing import Optional

from lightning_recover import env
from lightning_recover.control_plane.config import SCHEMES, connect_store
from lightning_recover.control_plane.embedded import connect_coordinator
from lightning_recover.protocol.backend import ControlPlane


def is_etcd(addr: str) -> bool:
    """True when ``addr`` names an etcd control plane rather than the embedded coordinator."""
    return addr.startswith(SCHEMES)


def connect(addr: str, timeout: float = 60.0, request_timeout: Optional[float] = None) -> ControlPlane:
    """The control plane at ``addr``, connected within ``timeout`` seconds (``CoordinatorLostError`` if not).

    For etcd the TLS files and the job's name come from the environment the launcher handed down
    (``control_plane.config.connect_store``); ``request_timeout`` bounds each of its requests, failovers
    included (None: ``config.DEFAULT_REQUEST_TIMEOUT``). The embedded coordinator's operations are bounded by
    the store's ``set_timeout``."""
    if is_etcd(addr):
        return connect_store(addr, timeout, request_timeout)
    return connect_coordinator(addr, timeout)


def check_address(addr: str) -> None:
    """ValueError with a HINT unless ``addr`` is an etcd URL (checked where it is opened) or ``HOST:PORT``."""
    if is_etcd(addr):
        return
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{env.COORDINATOR}={addr!r} must be HOST:PORT with a port in 1..65535. "
            f"HINT: use the address the coordinator printed (LISTENING HOST:PORT)."
        )
